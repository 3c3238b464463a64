/* Events out: a request's token and final events into its client's event ring,
 * with the bookkeeping each token brings (metrics, the penalties' history, the end
 * of a request at a stop token or max_tokens). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/sched/sched_internal.h"

/* A client that cannot take an event (impossible ring indices, no memory) is marked
 * dead; the engine thread drops it. */
void sched_emit(struct client_conn *c, const struct ipc_event *ev)
{
	int ret;

	if (c->dead)
		return;
	ret = client_conn_push(c, ev);
	if (ret < 0 && !c->dead) {
		c->dead = 1;
		if (ret != -EPROTO)
			snprintf(c->why, sizeof(c->why), "cannot queue an event: %s", strerror(-ret));
	}
}

void sched_emit_req(const struct sched_req *r, struct ipc_event ev)
{
	ev.req_id = r->id;
	ev.t_submit_ns = r->t_submit;
	ev.t_pickup_ns = r->t_pickup;
	sched_emit(r->c, &ev);
}

/* Keeps tok in r->out when r's penalties need its output. 0 or -ENOMEM. */
static int record_out(struct sched_req *r, int32_t tok)
{
	if (!k_sample_has_penalty(&r->sp))
		return 0;
	if (r->n_gen == r->cap_out) {
		int cap = r->cap_out ? 2 * r->cap_out : 64;
		int32_t *v = realloc(r->out, (size_t)cap * sizeof(*v));

		if (!v)
			return -ENOMEM;
		r->out = v;
		r->cap_out = cap;
	}
	r->out[r->n_gen] = tok;
	return 0;
}

static uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static void deliver_event(struct sched *s, struct sched_req *r, int32_t tok, uint32_t flags,
			  const uint32_t *a, uint64_t now)
{
	uint32_t index = (uint32_t)r->n_gen++, arg[3] = { a[0], a[1], a[2] };
	uint16_t reason = IPC_REASON_NONE, detail = IPC_DETAIL_NONE;

	s->m.generation_tokens++;
	r->c->n_generated++;
	if (index == 0)
		metrics_observe_ttft(&s->m, (double)(now - r->t_pickup) * 1e-9);
	else
		metrics_observe_itl(&s->m, (double)(now - r->t_last) * 1e-9);
	r->t_last = now;
	for (int k = 0; k < r->n_stop; k++)
		if (r->stop[k] == tok)
			reason = IPC_REASON_STOP;
	if (!reason && r->n_gen >= r->max_tokens)
		reason = IPC_REASON_LENGTH;
	if (reason == IPC_REASON_LENGTH && r->max_tokens_asked && !(flags & IPC_EV_LOGPROB)) {
		/* cut by the model's positions, not by max_tokens: say so (arg is free
		 * where it carries no logprob) */
		detail = IPC_DETAIL_TOO_LONG;
		arg[0] = (uint32_t)(r->n_prompt + r->max_tokens_asked);
		arg[1] = (uint32_t)(r->n_prompt + r->max_tokens);
		arg[2] = IPC_LIMIT_POSITIONS;
	}
	sched_emit_req(r, (struct ipc_event){ .token = tok, .index = index,
					      .flags = flags | (reason ? IPC_EV_FINAL : 0),
					      .reason = reason, .detail = detail,
					      .cached = index == 0 ? (uint32_t)r->n_cached : 0,
					      .arg = { arg[0], arg[1], arg[2] } });
	if (reason)
		sched_finish(s, r, reason, IPC_DETAIL_NONE, 0, 0, 0);
	else
		r->last = tok;
}

/* Delivers tok, with its logprobs when the request asked (lp may be NULL: none). */
void sched_deliver(struct sched *s, struct sched_req *r, int32_t tok,
		   const struct k_sample_logprobs *lp, uint64_t now)
{
	uint32_t flags = 0, a[3] = { 0, 0, 0 };

	if (record_out(r, tok)) {
		sched_finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_NONE, -ENOMEM, 0, 1);
		return;
	}
	if (r->sp.logprobs && lp) {
		flags = IPC_EV_LOGPROB;
		a[0] = f32_bits(lp->logprob);
		if (lp->n) {
			flags |= IPC_EV_TOP_LOGPROB;
			a[1] = (uint32_t)lp->ids[0];
			a[2] = f32_bits(lp->logprobs[0]);
		}
	}
	deliver_event(s, r, tok, flags, a, now);
}
