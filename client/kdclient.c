/* libkdclient: requests in, events out. Submission writes a record and its prompt
 * into the handle's segment and rings the daemon only when it sleeps; receiving
 * reads the event ring, spinning or sleeping on a futex (or an eventfd) when empty. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "client/kdclient_internal.h"
#include "ipc/ipc_futex.h"
#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"

/* Longest single futex sleep: between sleeps kd_wait checks whether the daemon
 * died (a dead daemon cannot wake the futex). */
#define WAIT_SLICE_NS 50000000LL

const char *kd_version(void)
{
	return PACKAGE_VERSION;
}

unsigned kd_protocol_version(void)
{
	return IPC_PROTOCOL_VERSION;
}

const char *kd_strerror(int err)
{
	if (err == 0)
		return "success";
	if (err > 0)
		return "not an error code (kd_* errors are negative errno values)";
	return strerrordesc_np(-err) ? strerrordesc_np(-err) : "unknown error";
}

static struct ipc_seg_hdr *hdr(struct kd_client *c)
{
	return c->seg;
}

/* Values of daemon_sleeping (daemon/serve/engine_thread.c): 2 = asleep and a request of
 * ours may be paused on our full event ring, so reading events must ring too. */
#define DAEMON_WANTS_SPACE 2u

/* Rings the daemon's doorbell if it may be asleep (at least min_state). The fence
 * orders our index store before the load of daemon_sleeping; the daemon does the
 * mirror image, so one of us sees the other (no lost wake-up). */
static void ring_daemon(struct kd_client *c, uint32_t min_state)
{
	struct ipc_seg_hdr *h = hdr(c);

	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load_explicit(&h->daemon_sleeping, memory_order_relaxed) < min_state)
		return;
	if (c->notify == IPC_NOTIFY_EVENTFD) {
		uint64_t one = 1;

		if (write(c->bell_efd, &one, sizeof(one)) < 0)
			return;	/* the counter is saturated: the daemon is awake anyway */
	} else {
		atomic_fetch_add(&h->daemon_bell, 1);
		ipc_futex_wake(&h->daemon_bell, 1);
	}
}

/* Reserves the next submission slot and n payload tokens. */
static int reserve(struct kd_client *c, uint32_t n, uint32_t *slot)
{
	struct ipc_seg_hdr *h = hdr(c);
	uint32_t head = ipc_load_acquire(&h->sub_head);
	uint32_t pay_head;

	if (c->sub_tail - head >= IPC_SUB_SLOTS)
		return -EAGAIN;
	/* Records are consumed in order, so the oldest unconsumed one marks the start of
	 * the payload still in use. */
	pay_head = head == c->sub_tail ? c->pay_tail : c->pay_start[head & (IPC_SUB_SLOTS - 1)];
	if (c->pay_tail - pay_head + n > IPC_PAY_TOKENS)
		return -EAGAIN;
	*slot = c->sub_tail;
	return 0;
}

static void publish(struct kd_client *c, uint32_t slot, uint32_t n)
{
	c->pay_start[slot & (IPC_SUB_SLOTS - 1)] = c->pay_tail;
	c->pay_tail += n;
	c->sub_tail = slot + 1;
	ipc_store_release(&hdr(c)->sub_tail, c->sub_tail);
	ring_daemon(c, 1);
}

static int check_request(const struct kd_client *c, const struct kd_request *r)
{
	if (!r->prompt || !r->n_prompt || !r->max_tokens || r->max_tokens > IPC_MAX_NEW)
		return -EINVAL;
	if (r->n_prompt > IPC_PAY_TOKENS || r->n_prompt > c->max_prompt)
		return -E2BIG;
	const struct kd_sampling *sp = &r->sampling;

	if (isnan(sp->temperature) || isinf(sp->temperature) || sp->temperature > 1e4f ||
	    isnan(sp->top_p) || isnan(sp->min_p) || sp->min_p > 1)
		return -EINVAL;
	if (!(sp->repetition_penalty >= 0 && sp->repetition_penalty <= IPC_REP_PENALTY_MAX) ||
	    !(fabsf(sp->presence_penalty) <= IPC_PENALTY_MAX) ||
	    !(fabsf(sp->frequency_penalty) <= IPC_PENALTY_MAX))
		return -EINVAL;
	if (sp->logprobs < 0 || sp->logprobs > 1 || sp->top_logprobs < 0 || sp->top_logprobs > 1 ||
	    (sp->top_logprobs && !sp->logprobs))
		return -EINVAL;
	if (r->n_stop > KD_MAX_STOP || (r->n_stop && !r->stop) ||
	    (r->flags & ~(KD_REQUEST_SPEC | KD_REQUEST_NO_SPEC)) ||
	    (r->flags & KD_REQUEST_SPEC && r->flags & KD_REQUEST_NO_SPEC))
		return -EINVAL;
	for (int i = 0; i < 4; i++)
		if (r->reserved[i])
			return -EINVAL;
	if (r->session && r->session[0] && kd_session_name_check(r->session, NULL, 0))
		return -EINVAL;
	return 0;
}

int kd_submit(struct kd_client *c, const struct kd_request *r, uint64_t *id)
{
	struct ipc_sub *rec;
	uint32_t slot;
	int ret;

	if ((ret = check_request(c, r)))
		return ret;
	if ((ret = atomic_load(&c->closed)))
		return ret;
	if ((ret = reserve(c, r->n_prompt, &slot)))
		return ret;
	ipc_pay_write(c->seg, c->pay_tail, r->n_prompt, r->prompt);
	rec = ipc_seg_sub(c->seg, slot);
	memset(rec, 0, sizeof(*rec));
	rec->kind = IPC_SUB_REQUEST;
	rec->req_id = c->next_id;
	rec->tok_pos = c->pay_tail;
	rec->n_tokens = r->n_prompt;
	rec->max_tokens = r->max_tokens;
	rec->priority = r->priority;
	rec->temperature = r->sampling.temperature > 0 ? r->sampling.temperature : 0;
	rec->top_k = r->sampling.top_k > 0 ? r->sampling.top_k : 0;
	rec->top_p = r->sampling.top_p > 0 && r->sampling.top_p < 1 ? r->sampling.top_p : 0;
	rec->seed = r->sampling.seed;
	rec->min_p = r->sampling.min_p > 0 ? r->sampling.min_p : 0;
	rec->repetition_penalty = r->sampling.repetition_penalty != 1 ? r->sampling.repetition_penalty : 0;
	rec->presence_penalty = r->sampling.presence_penalty;
	rec->frequency_penalty = r->sampling.frequency_penalty;
	rec->flags = (r->sampling.logprobs ? IPC_SUB_LOGPROBS : 0) |
		     (r->sampling.top_logprobs ? IPC_SUB_TOP_LOGPROB : 0) |
		     (r->flags & KD_REQUEST_SPEC ? IPC_SUB_SPEC : 0) |
		     (r->flags & KD_REQUEST_NO_SPEC ? IPC_SUB_NO_SPEC : 0);
	rec->n_stop = r->n_stop;
	if (r->n_stop)
		memcpy(rec->stop, r->stop, r->n_stop * sizeof(int32_t));
	if (r->session)
		strcpy(rec->session, r->session);
	rec->t_submit_ns = ipc_now_ns();
	if (id)
		*id = c->next_id;
	c->next_id++;
	publish(c, slot, r->n_prompt);
	return 0;
}

int kd_cancel(struct kd_client *c, uint64_t id)
{
	struct ipc_sub *rec;
	uint32_t slot;
	int ret;

	if ((ret = atomic_load(&c->closed)))
		return ret;
	if ((ret = reserve(c, 0, &slot)))
		return ret;
	rec = ipc_seg_sub(c->seg, slot);
	memset(rec, 0, sizeof(*rec));
	rec->kind = IPC_SUB_CANCEL;
	rec->req_id = id;
	rec->t_submit_ns = ipc_now_ns();
	publish(c, slot, 0);
	return 0;
}

static void to_event(const struct ipc_event *w, struct kd_event *ev, uint64_t now)
{
	memset(ev, 0, sizeof(*ev));
	ev->id = w->req_id;
	ev->token = w->token;
	ev->index = w->index;
	ev->flags = w->flags & IPC_EV_FINAL ? KD_EVENT_FINAL : 0;
	ev->stop = ev->flags ? (enum kd_stop)w->reason : KD_STOP_NONE;
	ev->error = (w->flags & IPC_EV_FINAL) && w->reason == IPC_REASON_ERROR ? w->err : 0;
	if (w->token >= 0 && w->index == 0 && !ev->error)
		ev->cached_tokens = w->cached;
	ev->detail = w->detail;
	ev->top_token = -1;
	if ((w->flags & IPC_EV_LOGPROB) && w->token >= 0) {
		ev->flags |= KD_EVENT_LOGPROB;
		memcpy(&ev->logprob, &w->arg[0], sizeof(float));
		if (w->flags & IPC_EV_TOP_LOGPROB) {
			ev->top_token = (int32_t)w->arg[1];
			memcpy(&ev->top_logprob, &w->arg[2], sizeof(float));
		}
	} else {
		memcpy(ev->detail_arg, w->arg, sizeof(ev->detail_arg));
	}
	ev->t_submit_ns = w->t_submit_ns;
	ev->t_pickup_ns = w->t_pickup_ns;
	ev->t_publish_ns = w->t_publish_ns;
	ev->t_receive_ns = now;
}

/* Takes what is in the event ring; -EPROTO if the daemon's tail is impossible. */
static int take(struct kd_client *c, struct kd_event *ev, int max)
{
	struct ipc_seg_hdr *h = hdr(c);
	uint32_t tail = ipc_load_acquire(&h->ev_tail);
	int64_t avail = ipc_ring_used(c->ev_head, tail, IPC_EV_SLOTS);
	uint64_t now;
	int n;

	if (avail < 0)
		return -EPROTO;
	if (!avail || max <= 0)
		return 0;
	now = ipc_now_ns();
	n = avail < max ? (int)avail : max;
	for (int i = 0; i < n; i++)
		to_event(ipc_seg_ev(c->seg, c->ev_head + (uint32_t)i), &ev[i], now);
	c->ev_head += (uint32_t)n;
	ipc_store_release(&h->ev_head, c->ev_head);
	ring_daemon(c, DAEMON_WANTS_SPACE);
	return n;
}

static void drain_notify(struct kd_client *c)
{
	uint64_t v;

	/* Clear the notification before reading the ring: an event published after
	 * the ring read writes the eventfd again. */
	if (read(c->notify_efd, &v, sizeof(v)) < 0)
		return;
}

int kd_poll(struct kd_client *c, struct kd_event *ev, int max)
{
	int n;

	if (c->epfd >= 0 || c->notify == IPC_NOTIFY_EVENTFD) {
		struct pollfd p = { .fd = c->notify_efd, .events = POLLIN };

		if (poll(&p, 1, 0) == 1)
			drain_notify(c);
	}
	n = take(c, ev, max);
	if (n)
		return n;
	return kdclient_check_closed(c);
}

static int64_t left_ns(uint64_t deadline)
{
	uint64_t now = ipc_now_ns();

	if (deadline == UINT64_MAX)
		return WAIT_SLICE_NS;
	if (now >= deadline)
		return 0;
	return (int64_t)(deadline - now) < WAIT_SLICE_NS ? (int64_t)(deadline - now) : WAIT_SLICE_NS;
}

static int sleep_futex(struct kd_client *c, struct kd_event *ev, int max, int64_t ns)
{
	struct ipc_seg_hdr *h = hdr(c);
	uint32_t v;
	int n;

	/* Announce the sleep, then look once more: the daemon bumps client_bell after
	 * its tail store and reads client_sleep after a fence (no lost wake-up). */
	atomic_fetch_or(&h->client_sleep, IPC_SLEEP_FUTEX);
	v = atomic_load(&h->client_bell);
	n = take(c, ev, max);
	if (!n)
		ipc_futex_wait(&h->client_bell, v, ns);
	atomic_fetch_and(&h->client_sleep, ~IPC_SLEEP_FUTEX);
	return n;
}

static int sleep_fd(struct kd_client *c, struct kd_event *ev, int max, int64_t ns)
{
	struct ipc_seg_hdr *h = hdr(c);
	struct pollfd p[2] = { { .fd = c->notify_efd, .events = POLLIN },
			       { .fd = c->sock, .events = POLLIN } };
	int n;

	atomic_fetch_or(&h->client_sleep, IPC_SLEEP_FD);
	atomic_thread_fence(memory_order_seq_cst);
	n = take(c, ev, max);
	if (n)
		return n;
	if (poll(p, 2, (int)((ns + 999999) / 1000000)) > 0 && (p[0].revents & POLLIN))
		drain_notify(c);
	return take(c, ev, max);
}

int kd_wait(struct kd_client *c, struct kd_event *ev, int max, int timeout_ms)
{
	uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : ipc_now_ns() + (uint64_t)timeout_ms * 1000000u;
	int n = kd_poll(c, ev, max);

	if (n)
		return n;
	if (c->spin_us) {
		uint64_t until = ipc_now_ns() + (uint64_t)c->spin_us * 1000u;

		while (ipc_now_ns() < until && ipc_now_ns() < deadline) {
			if ((n = take(c, ev, max)))
				return n;
			ipc_cpu_relax();
		}
	}
	for (;;) {
		int64_t ns = left_ns(deadline);

		if (!ns)
			return take(c, ev, max);
		n = c->notify == IPC_NOTIFY_EVENTFD ? sleep_fd(c, ev, max, ns) : sleep_futex(c, ev, max, ns);
		if (n)
			return n;
		if ((n = take(c, ev, max)))
			return n;
		if ((n = kdclient_check_closed(c)))
			return n;
	}
}

int kd_session_name_check(const char *name, char *why, size_t why_len)
{
	size_t n = name ? strlen(name) : 0;

	if (!n) {
		snprintf(why, why_len, "the session name is empty (a session name is " KD_SESSION_RULE ")");
		return -EINVAL;
	}
	if (n > KD_SESSION_MAX) {
		snprintf(why, why_len, "the session name is %zu characters long, at most %d (a session "
			 "name is " KD_SESSION_RULE ")", n, KD_SESSION_MAX);
		return -ENAMETOOLONG;
	}
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)name[i];
		char one[2] = { (char)c, 0 };

		if (!ipc_session_check(one, sizeof(one)))
			continue;
		if (c > 0x20 && c < 0x7f)
			snprintf(why, why_len, "'%c' at position %zu of the session name is not allowed "
				 "(a session name is " KD_SESSION_RULE ")", c, i + 1);
		else
			snprintf(why, why_len, "byte 0x%02x at position %zu of the session name is not "
				 "allowed (a session name is " KD_SESSION_RULE ")", c, i + 1);
		return -EINVAL;
	}
	return 0;
}

void kd_event_message(const struct kd_event *ev, char *buf, size_t len)
{
	struct ipc_event w = {
		.reason = (uint16_t)ev->stop,
		.detail = (uint16_t)ev->detail,
		.err = ev->error,
	};

	memcpy(w.arg, ev->detail_arg, sizeof(w.arg));
	if (ev->stop == KD_STOP_LENGTH)
		snprintf(buf, len, "max_tokens reached");
	else if (ev->stop == KD_STOP_TOKEN)
		snprintf(buf, len, "stop token %d generated", ev->token);
	else
		ipc_detail_describe(&w, buf, len);
}
