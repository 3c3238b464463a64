/* Continuous batching, the steps: admission, one decode token per running request,
 * then prefill chunks within the step's token budget, and the samples delivered. A
 * request whose client's event ring stays full is paused, then cancelled. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "daemon/base/log.h"
#include "daemon/backend/backend.h"
#include "daemon/engine/forward.h"
#include "daemon/sched/sched_internal.h"
#include "ipc/ipc_futex.h"

/* Prefix-cache salt of c's requests: its uid, or one value for all. */
static uint64_t salt_of(const struct sched *s, const struct client_conn *c)
{
	return s->o.share_prefix ? 0x6b646563736861ULL : (uint64_t)c->uid;
}

/* Starts r's sequence on its session's KV (owner: the client's uid), if it names
 * one that has no other turn running, else on the prefix cache. -EDQUOT: r names a
 * new session and the uid has max_sessions. */
static int req_start(struct sched *s, struct sched_req *r)
{
	uint64_t salt = salt_of(s, r->c);
	struct kv_session *kvs;
	int cached = 0, ret;

	ret = r->session[0] ? engine_session_open(s->e, r->session, r->c->uid, salt, &kvs) : -ENOENT;
	if (ret == -EDQUOT || ret == -ENOMEM)	/* the session would not be kept: refused */
		return ret;
	if (!ret) {
		ret = engine_seq_start_session(s->e, &r->seq, kvs, r->feed, r->n_feed, &cached);
		if (!ret)
			r->kvs = kvs;
		if (ret != -EBUSY)
			goto out;
		log_debug("session '%s' has a turn running: request %llu runs without it",
			  r->session, (unsigned long long)r->id);
	}
	ret = engine_seq_start(s->e, &r->seq, r->feed, r->n_feed, salt, &cached);
out:
	if (!ret)
		r->n_prefilled = r->n_cached = cached;
	return ret;
}

/* Whether the first waiting request w should wait a step: a running request with the
 * same prefix-cache salt is still prefilling full blocks that w's prompt starts with
 * too. Full blocks enter the prefix cache as each step completes them and admission
 * maps what is there, so w, admitted a step or a few later, maps those blocks instead
 * of computing them again beside the other (N agents arriving together with one
 * system prompt compute it once, not N times). Bounded by SCHED_PREFIX_WAIT_STEPS, in
 * case the other's prefill stalls (a paused client). */
#define SCHED_PREFIX_WAIT_STEPS 64
static int prefix_pending(struct sched *s, struct sched_req *w)
{
	struct engine_cache_status st;
	uint64_t salt = salt_of(s, w->c);

	if (s->o.no_prefix_wait || w->prefix_waits >= SCHED_PREFIX_WAIT_STEPS)
		return 0;
	engine_cache_status(s->e, &st);
	for (int i = 0; i < s->n_run; i++) {
		const struct sched_req *r = s->run[i];
		int lim, common = 0, full;

		if (r->n_prefilled >= r->n_feed || r->c->dead || salt_of(s, r->c) != salt)
			continue;
		/* w maps at most (n - 1) / bt blocks: one token is always computed */
		lim = w->n_feed - 1 < r->n_feed ? w->n_feed - 1 : r->n_feed;
		while (common < lim && w->feed[common] == r->feed[common])
			common++;
		full = common / st.block_tokens * st.block_tokens;
		if (full > r->n_prefilled) {
			w->prefix_waits++;
			return 1;
		}
	}
	return 0;
}

/* Whether w waits for its session's KV to come back from the host tier: the restore
 * runs on the engine's mover (started at the first look, with the device blocks it
 * fills) while the running requests step, and w is admitted once it is committed
 * (engine_host_poll). Where its blocks do not fit beside this step's claims, or the
 * restore cannot run, w is admitted at once and its turn's start restores what it
 * can (synchronously: the pressure path, then it may wait again, admit). start 0:
 * only look. */
static int session_restoring(struct sched *s, const struct sched_req *w, int start)
{
	struct kv_session *kvs;

	if (!w->session[0] || !(kvs = engine_session_find(s->e, w->session, w->c->uid)))
		return 0;
	if (engine_session_restoring(kvs))
		return 1;
	if (!start || kv_session_blocks_on_host(kvs) > sched_spare(s))
		return 0;
	return engine_session_restore_start(s->e, kvs);
}

/* r names a new session and its uid has the most the engine keeps: refused, the
 * count and the limit in the event, rather than run without keeping the session. */
static void refuse_session_limit(struct sched *s, struct sched_req *r)
{
	uint32_t n = (uint32_t)kv_sessions_count_owner(&s->e->sessions, r->c->uid);

	log_info("client %u request %llu: uid %u has %u sessions, the limit: session '%s' refused",
		 r->c->id, (unsigned long long)r->id, (unsigned)r->c->uid, n, r->session);
	sched_emit_req(r, (struct ipc_event){ .token = -1, .flags = IPC_EV_FINAL,
					      .reason = IPC_REASON_ERROR,
					      .detail = IPC_DETAIL_SESSION_LIMIT, .err = -EDQUOT,
					      .arg = { n, (uint32_t)s->e->max_sessions,
						       (uint32_t)r->c->uid } });
	sched_finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_SESSION_LIMIT, -EDQUOT, 0, 0);
}

/* Moves the first waiting request into the batch with its cached prefix mapped;
 * NULL if that fails (the request ended with an error) or if starting it took
 * more blocks than the claims left (it waits again). */
static struct sched_req *admit(struct sched *s)
{
	struct sched_req *r = s->wait[0];
	int ret;

	sched_remove_ptr(s->wait, &s->n_wait, r);
	r->running = 1;
	r->admit_no = s->admit_no++;
	s->run[s->n_run++] = r;
	ret = req_start(s, r);
	if (ret == -EDQUOT) {
		refuse_session_limit(s, r);
		return NULL;
	}
	if (ret) {
		log_warn("client %u request %llu: cannot start: %s", r->c->id,
			 (unsigned long long)r->id, strerror(-ret));
		sched_finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return NULL;
	}
	/* a session's turn brings all its host blocks back, more than the prompt
	 * may use: the step would not fit. Its blocks stay on the device (the
	 * session's, idle), so the next look counts them. */
	if (sched_spare(s) < 0) {
		sched_unadmit(s, r);
		return NULL;
	}
	if (r->n_preempted)
		log_debug("client %u request %llu: resumed, %d of %d tokens from the prefix cache",
			  r->c->id, (unsigned long long)r->id, r->n_prefilled, r->n_feed);
	return r;
}

int sched_runnable(struct sched *s)
{
	for (int i = 0; i < s->n_run; i++) {
		struct sched_req *r = s->run[i];

		if (r->n_prefilled < r->n_feed || client_conn_ev_free(r->c) > 0)
			return 1;
	}
	return sched_can_admit(s) && !session_restoring(s, s->wait[0], 0);
}

int64_t sched_next_timeout(const struct sched *s, uint64_t now_ns)
{
	int64_t best = INT64_MAX, stall = (int64_t)s->o.stall_ms * 1000000;

	for (int i = 0; i < s->n_run; i++) {
		const struct sched_req *r = s->run[i];
		int64_t left;

		if (!r->paused_since)
			continue;
		left = (int64_t)(r->paused_since + (uint64_t)stall - now_ns);
		if (left < best)
			best = left > 0 ? left : 0;
	}
	return best;
}

/* Event-ring slots each client has for this step; -1 = not yet looked at. */
static int step_space(struct client_conn *c, int *space_cache)
{
	if (*space_cache < 0) {
		int f = client_conn_ev_free(c);

		if (f < 0) {
			c->dead = 1;
			f = 0;
		}
		*space_cache = f;
	}
	return *space_cache;
}

/* r cannot run for lack of event-ring space: pause it, or cancel it once it has
 * waited stall_ms (returns 1: r is gone). */
static int req_pause(struct sched *s, struct sched_req *r, uint64_t now)
{
	if (!r->paused_since) {
		r->paused_since = now;
		return 0;
	}
	if (now - r->paused_since < (uint64_t)s->o.stall_ms * 1000000u)
		return 0;
	log_info("client %u request %llu: event ring full for %d ms: cancelled",
		 r->c->id, (unsigned long long)r->id, s->o.stall_ms);
	sched_finish(s, r, IPC_REASON_CANCELLED, IPC_DETAIL_STALLED, 0, (uint32_t)s->o.stall_ms, 1);
	return 1;
}

void sched_add(struct sched *s, int *n, struct sched_req *r, const int32_t *tok, int n_tok)
{
	s->ereq[*n] = (struct engine_req){ .seq = &r->seq, .tokens = tok, .n_tokens = n_tok };
	s->of[*n] = r;
	s->row0[*n] = s->n_rows;
	s->sp[s->n_rows] = r->sp;
	s->hist[s->n_rows] = (struct k_sample_hist){ .prompt = r->prompt, .n_prompt = r->n_prompt,
						     .out = r->out, .n_out = r->out ? r->n_gen : 0 };
	s->steps[s->n_rows] = (uint64_t)r->n_gen;
	s->n_rows++;
	(*n)++;
}

/* The pace of prompt chunks (Sarathi-style): while requests decode, a step that also
 * carries prompt tokens should take at most prefill_pace decode-only steps, so a new
 * prompt costs the streams a bounded stall per token, whatever its length. The step
 * costs come from the steps themselves: a moving average of the decode-only steps and
 * of a prompt token's share of the others. Small chunks would teach a per-token cost
 * that is mostly the step's fixed overhead (an eager step launches every kernel one by
 * one), so only chunks of at least PACE_LEARN_TOKENS teach it; and only steps beside
 * decodes, the steps it budgets: a step without any (a lone prompt, in up to the
 * backend's prompt_rows) costs less per token, and learning from it made the chunks
 * beside 16 agent sessions' decodes too long for the pace (H200: 85 against 96 tok/s
 * per user at P90, PERFORMANCE.md). */
#define PACE_ALPHA 0.2
#define PACE_LEARN_TOKENS 32
#define PACE_MIN_TOKENS 16	/* a prompt always progresses */

static void ema(double *avg, double v)
{
	*avg = *avg > 0 ? *avg + PACE_ALPHA * (v - *avg) : v;
}

/* What the step just run teaches, and kd_step_seconds. */
static void pace_learn(struct sched *s, uint64_t ns)
{
	double extra;

	metrics_observe_step(&s->m, (double)ns * 1e-9);
	if (!s->step_prompt) {
		if (s->step_decodes) {
			ema(&s->decode_ns, (double)ns);
			s->m.decode_steps++;
			s->m.decode_step_s += (double)ns * 1e-9;
			s->m.decode_step_bytes += s->e->last_step_bytes;
		}
		return;
	}
	if (s->step_prompt < PACE_LEARN_TOKENS || !s->step_decodes || s->decode_ns <= 0)
		return;
	extra = (double)ns - s->decode_ns;
	ema(&s->prompt_tok_ns, (extra > 0 ? extra : 0) / s->step_prompt);
}

/* Prompt tokens this step may carry beside `decodes` decoding rows, out of budget. */
static int pace_budget(const struct sched *s, int decodes, int budget)
{
	double tokens;

	if (!decodes || s->o.prefill_pace < 0 || s->decode_ns <= 0 || s->prompt_tok_ns <= 0)
		return budget;
	tokens = (s->o.prefill_pace - 1) * s->decode_ns / s->prompt_tok_ns;
	if (tokens < PACE_MIN_TOKENS)
		tokens = PACE_MIN_TOKENS;
	return tokens < budget ? (int)tokens : budget;
}

/* Picks the step's requests: decodes first, then prefill chunks, admitting waiting
 * requests while the KV cache, the batch, the token budget and the pace allow. */
static int build_step(struct sched *s, uint64_t now)
{
	int budget = s->o.step_tokens, n = 0;

	s->n_rows = 0;

	/* space_cache lives in the client for one step: reset it first, for the
	 * clients of requests that may be admitted too */
	for (int i = 0; i < s->n_run; i++) {
		s->run[i]->c->step_space = -1;
		s->run[i]->step_fed = 0;
	}
	for (int i = 0; i < s->n_wait; i++)
		s->wait[i]->c->step_space = -1;
	/* who decodes: each takes one event slot here (drafts get what is left);
	 * those whose client has none pause */
	for (int i = 0; i < s->n_run; i++) {
		struct sched_req *r = s->run[i];

		if (r->n_prefilled < r->n_feed || r->c->dead)
			continue;
		if (step_space(r->c, &r->c->step_space) > 0) {
			r->paused_since = 0;
			r->step_fed = 1;
			r->c->step_space--;
		} else if (req_pause(s, r, now)) {
			i--;
		}
	}
	/* the decodes' blocks, preempting when short; room for a waiting request of
	 * higher priority */
	sched_make_room(s);
	for (int i = 0; i < s->n_run && budget > 0; i++) {
		struct sched_req *r = s->run[i];

		if (r->step_fed) {
			r->c->step_space++;	/* its slot back: add_decode takes it */
			sched_add_decode(s, &n, r, &budget);
		}
	}
	s->step_decodes = n;
	s->step_prompt = 0;
	/* nobody decodes: nobody waits for this step but the prompts, which run faster per
	 * token in fewer, larger calls where the backend says so (the GPU's prompt_rows),
	 * up to the engine's rows */
	if (!n) {
		int alone = s->e->be->ops->prompt_rows;

		if (alone > s->e->fwd->max_rows)
			alone = s->e->fwd->max_rows;
		if (alone > budget)
			budget = alone;
	}
	budget = pace_budget(s, n, budget);
	for (int i = 0; budget > 0 && n < s->o.max_batch; i++) {
		struct sched_req *r;
		int rem, chunk;

		if (i == s->n_run) {
			if (!sched_can_admit(s) || prefix_pending(s, s->wait[0]) ||
			    session_restoring(s, s->wait[0], 1))
				break;
			if (!admit(s)) {
				i--;
				continue;
			}
		}
		r = s->run[i];
		rem = r->n_feed - r->n_prefilled;
		if (!rem || r->c->dead)
			continue;
		chunk = rem < budget ? rem : budget;
		/* The chunk that ends the prompt yields the first token: it needs a slot. */
		if (chunk == rem && step_space(r->c, &r->c->step_space) == 0)
			chunk--;
		if (chunk <= 0) {
			if (req_pause(s, r, now))
				i--;
			continue;
		}
		r->paused_since = 0;
		if (chunk == rem)
			r->c->step_space--;
		sched_add(s, &n, r, r->feed + r->n_prefilled, chunk);
		budget -= chunk;
		s->step_prompt += chunk;
	}
	return n;
}

int sched_step(struct sched *s, uint64_t now_ns)
{
	char err[256] = "";
	uint64_t now;
	int n, ret;

	n = build_step(s, now_ns);
	if (!n)
		return 0;
	now = ipc_now_ns();
	ret = engine_step_sample_ext(s->e, s->ereq, n, s->sp, s->steps, s->hist, s->ids, s->lp, NULL,
				     err, sizeof(err));
	pace_learn(s, ipc_now_ns() - now);
	if (ret) {
		log_error("engine step of %d requests failed: %s", n, err[0] ? err : strerror(-ret));
		for (int i = 0; i < n; i++)
			sched_finish(s, s->of[i], IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return ret;
	}
	now = ipc_now_ns();
	for (int i = 0; i < n; i++) {
		struct sched_req *r = s->of[i];

		if (r->n_prefilled < r->n_feed) {
			r->n_prefilled += s->ereq[i].n_tokens;
			if (r->n_prefilled < r->n_feed)
				continue;	/* a middle chunk: its sample is not a token */
			if (!r->n_gen)	/* not a resume after a preemption */
				s->m.prompt_tokens += (uint64_t)r->n_prompt;
		}
		if (s->ereq[i].n_draft)
			sched_deliver_spec(s, r, &s->ereq[i], s->ids + s->row0[i], s->lp + s->row0[i],
					   now);
		else
			sched_deliver(s, r, s->ids[s->row0[i]], &s->lp[s->row0[i]], now);
	}
	return n;
}

void sched_note_loop(struct sched *s, uint64_t ns)
{
	if ((double)ns * 1e-9 > s->m.loop_gap_max)
		s->m.loop_gap_max = (double)ns * 1e-9;
}
