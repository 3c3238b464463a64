/* KV blocks for the scheduler: the claims running requests hold on the step being
 * built, admission against them, and preemption (drop and recompute) when they do
 * not fit or a request of higher priority waits. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/log.h"
#include "daemon/sched/sched_internal.h"

/* Tokens of output room a request must also fit to be admitted (at most what it
 * may still generate): without it a sequence admitted at the exact edge would be
 * preempted again by its first decode that opens a block. */
#define SCHED_ADMIT_MARGIN_BLOCKS 2

int sched_claim(const struct sched *s, const struct sched_req *r)
{
	int64_t upto = r->n_prefilled < r->n_feed ? r->n_feed : (int64_t)r->seq.n_tokens + r->step_fed;
	int more = kv_pool_blocks_for(&s->e->pool, upto) - r->seq.n_blocks;

	return more > 0 ? more : 0;
}

int sched_spare(const struct sched *s)
{
	int64_t spare = kv_pool_available(&s->e->pool);

	for (int i = 0; i < s->n_run; i++)
		spare -= sched_claim(s, s->run[i]);
	return spare < -(1 << 30) ? -(1 << 30) : (int)spare;
}

/* Blocks r needs free to be admitted: its feed (for a preempted one, all it had)
 * plus the margin. */
static int admit_blocks(const struct sched *s, const struct sched_req *r)
{
	int margin = SCHED_ADMIT_MARGIN_BLOCKS * s->e->pool.block_tokens, left = r->max_tokens - r->n_gen;

	return kv_pool_blocks_for(&s->e->pool, (int64_t)r->n_feed + (left < margin ? left : margin));
}

/* Draining admits no new request, but a preempted one was running: it goes on. */
static int may_admit(const struct sched *s)
{
	return s->n_wait && s->n_run < s->o.max_batch && (!s->draining || s->wait[0]->n_preempted);
}

int sched_can_admit(const struct sched *s)
{
	return may_admit(s) && sched_spare(s) >= admit_blocks(s, s->wait[0]);
}

/* The running request to preempt: of those with priority below `below`, the lowest
 * priority, then the most recently admitted. NULL: none. */
static struct sched_req *victim(const struct sched *s, int64_t below)
{
	struct sched_req *v = NULL;

	for (int i = 0; i < s->n_run; i++) {
		struct sched_req *r = s->run[i];

		if (r->priority >= below)
			continue;
		if (!v || r->priority < v->priority || (r->priority == v->priority && r->admit_no > v->admit_no))
			v = r;
	}
	return v;
}

/* Drops r's KV and puts it back at the front of the waiting requests of its
 * priority, to prefill what it had on resume: its full blocks stay in the prefix
 * cache (LRU), so a resume soon after recomputes little. Its output, penalty
 * history and draw counter (n_gen) stay, so it goes on as if never stopped; the
 * client sees only delay. 0 or -ENOMEM (r is unchanged). */
static int preempt(struct sched *s, struct sched_req *r)
{
	/* once prefilled: the KV's tokens and the one the next decode feeds; a request
	 * stopped during its prefill keeps its feed */
	if (r->n_gen > 0 && r->n_prefilled >= r->n_feed) {
		int n = r->seq.n_tokens + 1;
		int32_t *v = realloc(r->resume, (size_t)n * sizeof(*v));

		if (!v)
			return -ENOMEM;
		memcpy(v, r->seq.tokens, (size_t)r->seq.n_tokens * sizeof(*v));
		v[n - 1] = r->last;
		r->resume = v;
		r->feed = v;
		r->n_feed = n;
	}
	log_debug("client %u request %llu (priority %d%s%s%s): preempted after %d tokens, %d blocks",
		  r->c->id, (unsigned long long)r->id, r->priority, r->session[0] ? ", session '" : "",
		  r->session, r->session[0] ? "'" : "", r->n_gen, r->seq.n_blocks);
	r->n_preempted++;
	s->m.preemptions++;
	sched_unadmit(s, r);
	return 0;
}

void sched_unadmit(struct sched *s, struct sched_req *r)
{
	if (r->kvs) {
		engine_session_cancel(s->e, r->kvs);	/* reopened on resume */
		r->kvs = NULL;
	}
	engine_seq_release(s->e, &r->seq);
	r->n_prefilled = 0;
	r->step_fed = 0;
	r->paused_since = 0;
	r->running = 0;
	sched_remove_ptr(s->run, &s->n_run, r);
	sched_enqueue_front(s, r);
}

/* Preempts v, or ends it with an error when that is impossible. */
static void preempt_or_end(struct sched *s, struct sched_req *v)
{
	int ret = preempt(s, v);

	if (ret)
		sched_finish(s, v, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
}

/* Whether idle sessions moved to the host tier (never keep, which may be NULL) made
 * spare >= want. */
static int offload_sessions(struct sched *s, int spare, int want, const struct kv_session *keep)
{
	return !engine_make_room(s->e, kv_pool_available(&s->e->pool) + want - spare, keep);
}

void sched_make_room(struct sched *s)
{
	struct sched_req *v;
	int spare;

	while ((spare = sched_spare(s)) < 0) {
		if (offload_sessions(s, spare, 0, NULL))
			break;
		v = victim(s, INT64_MAX);
		if (s->n_run == 1) {
			/* alone and still short: sessions pin the rest of the cache */
			log_warn("client %u request %llu: KV cache full (%d blocks short with nothing else running)",
				 v->c->id, (unsigned long long)v->id, -spare);
			sched_finish(s, v, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, -ENOSPC, 0, 1);
			continue;
		}
		preempt_or_end(s, v);
	}
	/* a waiting request of higher priority takes the place of lower ones, never
	 * the reverse: equal priorities wait their turn */
	while (may_admit(s)) {
		const struct sched_req *r = s->wait[0];
		int want = admit_blocks(s, r);
		/* not the session r resumes: it would only come back */
		const struct kv_session *own = r->session[0] ? engine_session_find(s->e, r->session, r->c->uid) : NULL;

		spare = sched_spare(s);
		if (spare >= want || offload_sessions(s, spare, want, own))
			break;
		v = victim(s, r->priority);
		if (!v)
			break;
		preempt_or_end(s, v);
	}
}
