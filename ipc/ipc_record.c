/* Copy-then-check of submission records and the wrapped payload ring; the daemon's
 * only reads of client-written memory besides ring indices go through here. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"

int ipc_session_check(const char *s, size_t cap)
{
	size_t i;

	for (i = 0; i < cap && s[i]; i++) {
		char c = s[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '.' || c == '_' || c == ':' || c == '-'))
			return -EINVAL;
	}
	return i < cap ? 0 : -EINVAL;
}

static int bad(char *why, size_t why_len, const char *what, double v)
{
	snprintf(why, why_len, "submission record: %s (%g)", what, v);
	return -EPROTO;
}

int ipc_sub_check(const struct ipc_sub *r, char *why, size_t why_len)
{
	if (r->kind != IPC_SUB_REQUEST && r->kind != IPC_SUB_CANCEL)
		return bad(why, why_len, "unknown kind", r->kind);
	if (r->flags & ~IPC_SUB_FLAGS)
		return bad(why, why_len, "unknown flags", r->flags);
	if ((r->flags & IPC_SUB_TOP_LOGPROB) && !(r->flags & IPC_SUB_LOGPROBS))
		return bad(why, why_len, "top logprob without logprobs", r->flags);
	if ((r->flags & IPC_SUB_SPEC) && (r->flags & IPC_SUB_NO_SPEC))
		return bad(why, why_len, "speculation both on and off", r->flags);
	for (int i = 0; i < 4; i++)
		if (r->reserved[i])
			return bad(why, why_len, "reserved word not zero at index", i);
	if (r->kind == IPC_SUB_CANCEL)
		return 0;
	if (r->n_tokens < 1 || r->n_tokens > IPC_PAY_TOKENS)
		return bad(why, why_len, "prompt length out of 1..262144", r->n_tokens);
	if (r->max_tokens < 1 || r->max_tokens > IPC_MAX_NEW)
		return bad(why, why_len, "max_tokens out of 1..16777216", r->max_tokens);
	if (!isfinite(r->temperature) || r->temperature < 0 || r->temperature > 1e4f)
		return bad(why, why_len, "temperature not in [0, 1e4]", r->temperature);
	if (r->top_k < 0)
		return bad(why, why_len, "negative top_k", r->top_k);
	if (!(r->top_p >= 0 && r->top_p <= 1))
		return bad(why, why_len, "top_p not in [0, 1]", r->top_p);
	if (!(r->min_p >= 0 && r->min_p <= 1))
		return bad(why, why_len, "min_p not in [0, 1]", r->min_p);
	if (!(r->repetition_penalty >= 0 && r->repetition_penalty <= IPC_REP_PENALTY_MAX))
		return bad(why, why_len, "repetition_penalty not 0 or in (0, 10]", r->repetition_penalty);
	if (!(fabsf(r->presence_penalty) <= IPC_PENALTY_MAX))
		return bad(why, why_len, "presence_penalty not in [-2, 2]", r->presence_penalty);
	if (!(fabsf(r->frequency_penalty) <= IPC_PENALTY_MAX))
		return bad(why, why_len, "frequency_penalty not in [-2, 2]", r->frequency_penalty);
	if (r->n_stop > IPC_STOP_MAX)
		return bad(why, why_len, "more stop tokens than 8", r->n_stop);
	if (ipc_session_check(r->session, sizeof(r->session)))
		return bad(why, why_len, "session name not [A-Za-z0-9._:-] NUL-terminated in 64 bytes", 0);
	return 0;
}

int ipc_sub_peek(void *seg, uint32_t head, struct ipc_sub *rec, char *why, size_t why_len)
{
	struct ipc_seg_hdr *h = seg;
	uint32_t tail = ipc_load_acquire(&h->sub_tail);
	int64_t used = ipc_ring_used(head, tail, IPC_SUB_SLOTS);

	if (used < 0) {
		snprintf(why, why_len, "submission ring: tail %u is impossible for head %u", tail, head);
		return -EPROTO;
	}
	if (!used)
		return 0;
	/* Copy first: the client may rewrite the slot while we look at it. */
	memcpy(rec, ipc_seg_sub(seg, head), sizeof(*rec));
	return ipc_sub_check(rec, why, why_len) ? -EPROTO : 1;
}

void ipc_pay_read(void *seg, uint32_t pos, uint32_t n, int32_t *dst)
{
	const int32_t *pay = ipc_seg_pay(seg);
	uint32_t at = pos & (IPC_PAY_TOKENS - 1);
	uint32_t first = n < IPC_PAY_TOKENS - at ? n : IPC_PAY_TOKENS - at;

	memcpy(dst, pay + at, (size_t)first * sizeof(*dst));
	memcpy(dst + first, pay, (size_t)(n - first) * sizeof(*dst));
}

void ipc_pay_write(void *seg, uint32_t pos, uint32_t n, const int32_t *src)
{
	int32_t *pay = ipc_seg_pay(seg);
	uint32_t at = pos & (IPC_PAY_TOKENS - 1);
	uint32_t first = n < IPC_PAY_TOKENS - at ? n : IPC_PAY_TOKENS - at;

	memcpy(pay + at, src, (size_t)first * sizeof(*src));
	memcpy(pay, src + first, (size_t)(n - first) * sizeof(*src));
}

void ipc_sub_advance(void *seg, uint32_t head)
{
	ipc_store_release(&((struct ipc_seg_hdr *)seg)->sub_head, head);
}

int ipc_ev_free(void *seg, uint32_t tail)
{
	uint32_t head = ipc_load_acquire(&((struct ipc_seg_hdr *)seg)->ev_head);
	int64_t used = ipc_ring_used(head, tail, IPC_EV_SLOTS);

	return used < 0 ? -EPROTO : (int)(IPC_EV_SLOTS - used);
}

void ipc_detail_describe(const struct ipc_event *ev, char *buf, size_t len)
{
	const uint32_t *a = ev->arg;

	switch (ev->detail) {
	case IPC_DETAIL_TOKEN_RANGE:
		snprintf(buf, len, "prompt token %u at index %u is outside the vocabulary (0..%u)",
			 a[1], a[0], a[2] ? a[2] - 1 : 0);
		break;
	case IPC_DETAIL_STOP_RANGE:
		snprintf(buf, len, "stop token %u at index %u is outside the vocabulary (0..%u)",
			 a[1], a[0], a[2] ? a[2] - 1 : 0);
		break;
	case IPC_DETAIL_TOO_LONG:
		if (a[2] == IPC_LIMIT_POSITIONS)
			snprintf(buf, len, "prompt + max_tokens = %u tokens exceed the model's %u "
				 "positions (max_position_embeddings)", a[0], a[1]);
		else
			snprintf(buf, len, "prompt + max_tokens = %u tokens exceed what the daemon "
				 "allows (%u)", a[0], a[1]);
		break;
	case IPC_DETAIL_SHUTDOWN:
		snprintf(buf, len, "the daemon is draining or shutting down and admits no requests");
		break;
	case IPC_DETAIL_STALLED:
		snprintf(buf, len, "cancelled: the client left its event ring full for %u ms", a[0]);
		break;
	case IPC_DETAIL_DUP_ID:
		snprintf(buf, len, "a request with this id is already in flight");
		break;
	case IPC_DETAIL_SESSIONS:
		snprintf(buf, len, "too many session names for one client (at most %u)", a[0]);
		break;
	case IPC_DETAIL_ENGINE:
		snprintf(buf, len, "the engine step failed (%s); see the daemon's log",
			 strerror(ev->err < 0 ? -ev->err : EIO));
		break;
	case IPC_DETAIL_CANCEL:
		snprintf(buf, len, "cancelled by the client");
		break;
	case IPC_DETAIL_SHUTDOWN_TIMEOUT:
		snprintf(buf, len, "cancelled: the daemon shut down and this request did not finish "
			 "within its shutdown timeout (%u.%u s)", a[0] / 1000, a[0] % 1000 / 100);
		break;
	case IPC_DETAIL_CLIENT_TOKENS:
		snprintf(buf, len, "the client's requests in flight would hold %u tokens (at most %u)",
			 a[0], a[1]);
		break;
	case IPC_DETAIL_SESSION_LIMIT:
		snprintf(buf, len, "uid %u already keeps %u sessions, the limit per user is %u: the new "
			 "session is refused (kdctl session-close NAME closes one)", a[2], a[0], a[1]);
		break;
	default:
		if (ev->reason == IPC_REASON_ERROR)
			snprintf(buf, len, "%s", strerror(ev->err < 0 ? -ev->err : EIO));
		else
			snprintf(buf, len, "%s", ev->reason == IPC_REASON_CANCELLED ? "cancelled" : "ok");
	}
}

int ipc_default_socket(char *buf, size_t len)
{
	const char *rt = getenv("XDG_RUNTIME_DIR");
	int n;

	if (rt && rt[0] == '/')
		n = snprintf(buf, len, "%s/kdecd.sock", rt);
	else if (geteuid() == 0)
		n = snprintf(buf, len, "/run/kdecd/kdecd.sock");
	else
		n = snprintf(buf, len, "/tmp/kdecd-%u/kdecd.sock", (unsigned)geteuid());
	return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}
