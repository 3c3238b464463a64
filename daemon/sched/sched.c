/* Continuous batching, the requests' side: submission (checks, refusals), the
 * waiting queue by priority, sessions, the end of a request, cancel and report. The
 * steps: sched_step.c; KV claims and preemption: sched_preempt.c; drafts:
 * sched_spec.c; events out: sched_events.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/log.h"
#include "daemon/sched/sched_internal.h"

int sched_create(struct sched **out, struct engine *e, const struct sched_opts *o)
{
	struct sched *s = calloc(1, sizeof(*s));
	int n;

	*out = NULL;
	if (!s)
		return -ENOMEM;
	s->e = e;
	s->o = *o;
	if (s->o.max_batch <= 0)
		s->o.max_batch = SCHED_DEFAULT_MAX_BATCH;
	if (s->o.step_tokens <= 0)
		s->o.step_tokens = SCHED_DEFAULT_STEP_TOKENS;
	if (s->o.prefill_pace == 0)
		s->o.prefill_pace = SCHED_DEFAULT_PREFILL_PACE;
	if (s->o.max_inflight <= 0)
		s->o.max_inflight = SCHED_DEFAULT_MAX_INFLIGHT;
	if (s->o.max_sessions <= 0)
		s->o.max_sessions = SCHED_DEFAULT_MAX_SESSIONS;
	if (s->o.stall_ms <= 0)
		s->o.stall_ms = SCHED_DEFAULT_STALL_MS;
	n = s->o.max_batch;
	s->run = calloc((size_t)n, sizeof(*s->run));
	s->ereq = calloc((size_t)n, sizeof(*s->ereq));
	s->of = calloc((size_t)n, sizeof(*s->of));
	s->row0 = calloc((size_t)n, sizeof(*s->row0));
	if (!s->row0) {
		sched_destroy(s);
		return -ENOMEM;
	}
	/* the rest by row: room for every request to verify its largest draft */
	n *= 1 + (s->o.spec.k > SPEC_DEFAULT_K ? s->o.spec.k : SPEC_DEFAULT_K);
	s->rows_cap = n;
	s->sp = calloc((size_t)n, sizeof(*s->sp));
	s->hist = calloc((size_t)n, sizeof(*s->hist));
	s->lp = calloc((size_t)n, sizeof(*s->lp));
	s->steps = calloc((size_t)n, sizeof(*s->steps));
	s->ids = calloc((size_t)n, sizeof(*s->ids));
	if (!s->run || !s->ereq || !s->of || !s->sp || !s->hist || !s->lp || !s->steps || !s->ids) {
		sched_destroy(s);
		return -ENOMEM;
	}
	*out = s;
	return 0;
}

static void req_free(struct sched *s, struct sched_req *r)
{
	if (r->kvs && r->keep) {
		int ret = engine_session_save(s->e, r->kvs, &r->seq);

		if (ret)
			log_warn("session '%s': cannot keep its KV: %s", r->session, strerror(-ret));
	} else if (r->kvs) {
		engine_session_cancel(s->e, r->kvs);
	}
	engine_seq_release(s->e, &r->seq);
	free(r->prompt);
	free(r->resume);
	free(r->out);
	free(r);
}

void sched_destroy(struct sched *s)
{
	if (!s)
		return;
	for (int i = 0; i < s->n_run; i++)
		req_free(s, s->run[i]);
	for (int i = 0; i < s->n_wait; i++)
		req_free(s, s->wait[i]);
	free(s->run);
	free(s->wait);
	free(s->ses);
	free(s->ereq);
	free(s->of);
	free(s->row0);
	free(s->spec_hist);
	free(s->sp);
	free(s->hist);
	free(s->lp);
	free(s->steps);
	free(s->ids);
	free(s);
}

void sched_remove_ptr(struct sched_req **v, int *n, struct sched_req *r)
{
	for (int i = 0; i < *n; i++) {
		if (v[i] == r) {
			memmove(v + i, v + i + 1, (size_t)(*n - i - 1) * sizeof(*v));
			(*n)--;
			return;
		}
	}
}

static int session_find(struct sched *s, struct client_conn *c, const char *name)
{
	for (int i = 0; i < s->n_ses; i++)
		if (s->ses[i].c == c && !strcmp(s->ses[i].name, name))
			return i;
	return -1;
}

/* Ends r: its final event (unless already carried by a token event), its KV back. */
/* What a request counts against its client's in-flight tokens: prompt + the max_tokens
 * it asked for (refuse() checks the same sum), even where the model's positions cut it. */
static int64_t inflight_claim(const struct sched_req *r)
{
	return (int64_t)r->n_prompt + (r->max_tokens_asked ? r->max_tokens_asked : r->max_tokens);
}

void sched_finish(struct sched *s, struct sched_req *r, uint16_t reason, uint16_t detail, int err,
		  uint32_t a0, int emit_final)
{
	if (emit_final)
		sched_emit_req(r, (struct ipc_event){ .token = -1, .index = (uint32_t)r->n_gen,
						      .flags = IPC_EV_FINAL, .reason = reason,
						      .detail = detail, .err = err, .arg = { a0 } });
	s->m.requests_finished[reason]++;
	r->keep = reason == IPC_REASON_STOP || reason == IPC_REASON_LENGTH;
	if (r->session[0]) {
		int i = session_find(s, r->c, r->session);

		if (i >= 0)
			s->ses[i].inflight--;
	}
	r->c->n_inflight--;
	r->c->inflight_tokens -= inflight_claim(r);
	if (r->running)
		sched_remove_ptr(s->run, &s->n_run, r);
	else
		sched_remove_ptr(s->wait, &s->n_wait, r);
	req_free(s, r);
}

static struct sched_req *find(struct sched *s, struct client_conn *c, uint64_t id)
{
	for (int i = 0; i < s->n_run; i++)
		if (s->run[i]->c == c && s->run[i]->id == id)
			return s->run[i];
	for (int i = 0; i < s->n_wait; i++)
		if (s->wait[i]->c == c && s->wait[i]->id == id)
			return s->wait[i];
	return NULL;
}

/* The session entry for (c, name), created if c has room; -1 if not. */
static int session_get(struct sched *s, struct client_conn *c, const char *name)
{
	int mine = 0;

	for (int i = 0; i < s->n_ses; i++) {
		if (s->ses[i].c != c)
			continue;
		if (!strcmp(s->ses[i].name, name))
			return i;
		mine++;
	}
	if (mine >= s->o.max_sessions)
		return -1;
	if (s->n_ses == s->cap_ses) {
		int cap = s->cap_ses ? 2 * s->cap_ses : 16;
		struct sched_ses *v = realloc(s->ses, (size_t)cap * sizeof(*v));

		if (!v)
			return -1;
		s->ses = v;
		s->cap_ses = cap;
	}
	memset(&s->ses[s->n_ses], 0, sizeof(s->ses[0]));
	snprintf(s->ses[s->n_ses].name, IPC_SESSION_MAX, "%s", name);
	s->ses[s->n_ses].c = c;
	return s->n_ses++;
}

/* The final event of a submission refused before it became a request: ev says
 * why (detail, err, arg); the rest is the same for every refusal. */
static void emit_refusal(struct client_conn *c, const struct ipc_sub *rec, uint64_t t_pickup,
			 struct ipc_event ev)
{
	ev.req_id = rec->req_id;
	ev.token = -1;
	ev.flags = IPC_EV_FINAL;
	ev.reason = IPC_REASON_ERROR;
	ev.t_submit_ns = rec->t_submit_ns;
	ev.t_pickup_ns = t_pickup;
	sched_emit(c, &ev);
}

/* Semantic checks of a structurally valid request: 0, or an error event sent. */
static int refuse(struct sched *s, struct client_conn *c, const struct ipc_sub *rec,
		  const int32_t *tokens, uint64_t t_pickup)
{
	uint32_t vocab = (uint32_t)s->e->model->cfg.vocab_size;
	int64_t cap = (int64_t)s->e->pool.n_blocks * s->e->pool.block_tokens;
	int64_t max_pos = s->e->model->cfg.max_position_embeddings;
	uint16_t detail = IPC_DETAIL_NONE;
	uint32_t a0 = 0, a1 = 0, a2 = vocab;
	int err = -EINVAL;

	if (s->draining) {
		detail = IPC_DETAIL_SHUTDOWN;
		err = -ESHUTDOWN;
	} else if (find(s, c, rec->req_id)) {
		detail = IPC_DETAIL_DUP_ID;
		err = -EEXIST;
		a0 = (uint32_t)rec->req_id;
	} else if ((int64_t)rec->n_tokens + rec->max_tokens > cap) {
		detail = IPC_DETAIL_TOO_LONG;
		err = -E2BIG;
		a0 = rec->n_tokens + rec->max_tokens;
		a1 = (uint32_t)cap;
	} else if ((int64_t)rec->n_tokens >= max_pos) {
		/* A prompt that leaves no position to generate at is refused: positions
		 * past the model's were never trained. (A max_tokens that would run past
		 * them is cut instead: see sched_submit.) */
		detail = IPC_DETAIL_TOO_LONG;
		err = -E2BIG;
		a0 = rec->n_tokens + rec->max_tokens;
		a1 = (uint32_t)max_pos;
		a2 = IPC_LIMIT_POSITIONS;
	} else if (c->inflight_tokens + rec->n_tokens + rec->max_tokens > cap) {
		/* One client may hold at most a whole cache's worth of tokens in flight. */
		detail = IPC_DETAIL_CLIENT_TOKENS;
		err = -EAGAIN;
		a0 = (uint32_t)(c->inflight_tokens + rec->n_tokens + rec->max_tokens);
		a1 = (uint32_t)cap;
	}
	for (uint32_t i = 0; !detail && i < rec->n_tokens; i++) {
		if ((uint32_t)tokens[i] >= vocab) {
			detail = IPC_DETAIL_TOKEN_RANGE;
			a0 = i;
			a1 = (uint32_t)tokens[i];
		}
	}
	for (uint32_t i = 0; !detail && i < rec->n_stop; i++) {
		if ((uint32_t)rec->stop[i] >= vocab) {
			detail = IPC_DETAIL_STOP_RANGE;
			a0 = i;
			a1 = (uint32_t)rec->stop[i];
		}
	}
	if (!detail)
		return 0;
	emit_refusal(c, rec, t_pickup, (struct ipc_event){ .detail = detail, .err = err,
							   .arg = { a0, a1, a2 } });
	s->m.requests_finished[IPC_REASON_ERROR]++;
	return -1;
}

static void enqueue(struct sched *s, struct sched_req *r)
{
	int i = s->n_wait;

	/* Higher priority first; arrival order within a priority. */
	while (i > 0 && s->wait[i - 1]->priority < r->priority)
		i--;
	memmove(s->wait + i + 1, s->wait + i, (size_t)(s->n_wait - i) * sizeof(*s->wait));
	s->wait[i] = r;
	s->n_wait++;
}

void sched_enqueue_front(struct sched *s, struct sched_req *r)
{
	int i = 0;

	/* before the first of its priority: a preempted request resumes first */
	while (i < s->n_wait && s->wait[i]->priority > r->priority)
		i++;
	memmove(s->wait + i + 1, s->wait + i, (size_t)(s->n_wait - i) * sizeof(*s->wait));
	s->wait[i] = r;
	s->n_wait++;
}

void sched_submit(struct sched *s, struct client_conn *c, const struct ipc_sub *rec,
		  int32_t *tokens, uint64_t t_pickup_ns)
{
	struct sched_req *r;
	int ses = -1;

	if (rec->kind == IPC_SUB_CANCEL) {
		r = find(s, c, rec->req_id);
		if (r)
			sched_finish(s, r, IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 1);
		return;
	}
	c->n_submitted++;
	if (refuse(s, c, rec, tokens, t_pickup_ns))
		goto out_free;
	if (rec->session[0] && (ses = session_get(s, c, rec->session)) < 0) {
		emit_refusal(c, rec, t_pickup_ns,
			     (struct ipc_event){ .detail = IPC_DETAIL_SESSIONS, .err = -ENOSPC,
						 .arg = { (uint32_t)s->o.max_sessions } });
		goto out_free;
	}
	/* a slot for every request, running ones too: a preempted one comes back */
	if (s->n_wait + s->n_run >= s->cap_wait) {
		int cap = s->cap_wait ? 2 * s->cap_wait : 64 + s->o.max_batch;
		struct sched_req **v = realloc(s->wait, (size_t)cap * sizeof(*v));

		if (!v)
			goto out_oom;
		s->wait = v;
		s->cap_wait = cap;
	}
	r = calloc(1, sizeof(*r));
	if (!r)
		goto out_oom;
	r->c = c;
	r->id = rec->req_id;
	engine_seq_init(&r->seq);
	r->prompt = tokens;
	r->n_prompt = (int)rec->n_tokens;
	r->feed = r->prompt;
	r->n_feed = r->n_prompt;
	r->max_tokens = (int)rec->max_tokens;
	if ((int64_t)r->n_prompt + r->max_tokens > s->e->model->cfg.max_position_embeddings) {
		/* cut at the model's last position (refuse() kept prompts that fill it): the
		 * request ends with reason length there, the final event saying why */
		r->max_tokens_asked = r->max_tokens;
		r->max_tokens = s->e->model->cfg.max_position_embeddings - r->n_prompt;
	}
	r->sp = (struct k_sample_params){ .temperature = rec->temperature, .top_k = rec->top_k,
					  .top_p = rec->top_p, .seed = rec->seed, .min_p = rec->min_p,
					  .repetition_penalty = rec->repetition_penalty,
					  .presence_penalty = rec->presence_penalty,
					  .frequency_penalty = rec->frequency_penalty,
					  .logprobs = !!(rec->flags & IPC_SUB_LOGPROBS),
					  .top_logprobs = !!(rec->flags & IPC_SUB_TOP_LOGPROB) };
	/* the daemon's --spec unless the request says; IPC_SUB_SPEC without a --spec
	 * takes the defaults */
	r->spec_k = s->o.spec.k;
	r->spec_n = s->o.spec.n;
	if ((rec->flags & IPC_SUB_SPEC) && !r->spec_k) {
		r->spec_k = SPEC_DEFAULT_K;
		r->spec_n = SPEC_DEFAULT_N;
	}
	if (rec->flags & IPC_SUB_NO_SPEC)
		r->spec_k = 0;
	memcpy(r->stop, rec->stop, sizeof(r->stop));
	r->n_stop = (int)rec->n_stop;
	r->priority = rec->priority;
	memcpy(r->session, rec->session, sizeof(r->session));
	r->seqno = s->seqno++;
	r->t_submit = rec->t_submit_ns;
	r->t_pickup = t_pickup_ns;
	if (ses >= 0) {
		s->ses[ses].inflight++;
		s->ses[ses].total++;
	}
	c->n_inflight++;
	c->inflight_tokens += inflight_claim(r);
	enqueue(s, r);
	return;

out_oom:
	emit_refusal(c, rec, t_pickup_ns,
		     (struct ipc_event){ .detail = IPC_DETAIL_NONE, .err = -ENOMEM });
out_free:
	free(tokens);
}

void sched_drop_client(struct sched *s, struct client_conn *c)
{
	for (int i = s->n_run - 1; i >= 0; i--)
		if (s->run[i]->c == c)
			sched_finish(s, s->run[i], IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 0);
	for (int i = s->n_wait - 1; i >= 0; i--)
		if (s->wait[i]->c == c)
			sched_finish(s, s->wait[i], IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 0);
	for (int i = s->n_ses - 1; i >= 0; i--) {
		if (s->ses[i].c != c)
			continue;
		s->ses[i] = s->ses[--s->n_ses];
	}
}

void sched_set_draining(struct sched *s, int on)
{
	s->draining = on;
}

void sched_cancel_all(struct sched *s, uint32_t timeout_ms)
{
	while (s->n_run)
		sched_finish(s, s->run[0], IPC_REASON_CANCELLED, IPC_DETAIL_SHUTDOWN_TIMEOUT, 0, timeout_ms, 1);
	while (s->n_wait)
		sched_finish(s, s->wait[0], IPC_REASON_CANCELLED, IPC_DETAIL_SHUTDOWN_TIMEOUT, 0, timeout_ms, 1);
}

int sched_busy(const struct sched *s)
{
	return s->n_run + s->n_wait;
}

static int report_kv_sessions(struct sched *s, struct sched_report *r)
{
	int n = engine_sessions_list(s->e, NULL, 0);

	if (!n)
		return 0;
	r->kv_sessions = calloc((size_t)n, sizeof(*r->kv_sessions));
	if (!r->kv_sessions)
		return -ENOMEM;
	r->n_kv_sessions = engine_sessions_list(s->e, r->kv_sessions, n);
	if (r->n_kv_sessions > n)
		r->n_kv_sessions = n;
	return 0;
}

int sched_report(struct sched *s, struct sched_report *r)
{
	int ret;

	memset(r, 0, sizeof(*r));
	r->running = s->n_run;
	r->waiting = s->n_wait;
	engine_cache_status(s->e, &r->cache);
	r->kv_blocks_total = r->cache.blocks_total;
	r->kv_blocks_used = r->cache.blocks_used;
	r->draining = s->draining;
	r->prefix_hit_tokens = s->e->stats.prefix_hit_tokens;
	r->stats = s->e->stats;
	r->m = s->m;
	ret = report_kv_sessions(s, r);
	if (ret || !s->n_ses)
		return ret;
	r->sessions = calloc((size_t)s->n_ses, sizeof(*r->sessions));
	if (!r->sessions)
		return -ENOMEM;
	for (int i = 0; i < s->n_ses; i++) {
		memcpy(r->sessions[i].name, s->ses[i].name, IPC_SESSION_MAX);
		r->sessions[i].client_id = s->ses[i].c->id;
		r->sessions[i].inflight = s->ses[i].inflight;
		r->sessions[i].total = s->ses[i].total;
	}
	r->n_sessions = s->n_ses;
	return 0;
}
