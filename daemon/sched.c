/* Continuous batching: admission by KV blocks, one decode token per running request
 * per step, prefill in chunks within the step's token budget, events out. A request
 * whose client leaves its event ring full is paused (it keeps its KV) and cancelled
 * after stall_ms. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/sched.h"
#include "ipc/ipc_futex.h"

struct sched_req {
	struct client_conn *c;		/* owner; outlives the request */
	uint64_t id;			/* the client's id */
	int running;			/* 0: waiting for admission */
	struct engine_seq seq;
	int32_t *prompt;		/* (n_prompt), owned */
	int n_prompt;
	int n_prefilled;		/* prompt tokens in the KV cache */
	int32_t last;			/* the token the next decode feeds */
	int n_gen;			/* tokens generated */
	int max_tokens;
	int need_blocks;		/* KV blocks for prompt + max_tokens */
	struct k_sample_params sp;
	int32_t *out;			/* (cap_out) generated ids, kept only for penalties */
	int spec_k, spec_n;		/* n-gram drafts per step, n-gram length; k 0: off */
	int32_t fed[SPEC_MAX_K + 1];	/* a speculative step's tokens: last, then drafts */
	int cap_out;
	int32_t stop[IPC_STOP_MAX];
	int n_stop;
	int priority;
	char session[IPC_SESSION_MAX];	/* "" or the session name */
	struct kv_session *kvs;		/* the engine's session while the turn runs */
	int keep;			/* 1: the turn ended well: save it into kvs */
	uint64_t seqno;			/* arrival order */
	uint64_t t_submit, t_pickup, t_last;	/* ns */
	uint64_t paused_since;		/* ns; 0 = not paused */
};

struct sched_ses {
	char name[IPC_SESSION_MAX];
	struct client_conn *c;
	int inflight;
	uint64_t total;
};

struct sched {
	struct engine *e;
	struct sched_opts o;
	struct sched_req **run;		/* (max_batch) the running batch */
	int n_run;
	struct sched_req **wait;	/* (n_wait) by priority, then arrival */
	int n_wait, cap_wait;
	struct sched_ses *ses;
	int n_ses, cap_ses;
	struct metrics m;
	int draining;
	uint64_t seqno;
	/* step scratch, (max_batch) each */
	struct engine_req *ereq;
	struct sched_req **of;
	struct k_sample_params *sp;
	struct k_sample_hist *hist;
	struct k_sample_logprobs *lp;
	uint64_t *steps;
	int32_t *ids;
	/* sp, hist, lp, steps, ids go by logits row: (rows_cap) each, since a
	 * speculative request has one row per fed token; row0 (max_batch) is each
	 * request's first row */
	int *row0;
	int n_rows, rows_cap;
	int32_t *spec_hist;		/* (spec_cap) a request's tokens, for the drafter */
	int spec_cap;
};

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

/* A final or token event to the request's client. A client that cannot take it
 * (impossible ring indices, no memory) is marked dead; the engine thread drops it. */
static void emit(struct client_conn *c, uint64_t id, uint64_t t_submit, uint64_t t_pickup,
		 int32_t tok, uint32_t index, uint32_t flags, uint16_t reason, uint16_t detail,
		 int err, uint32_t a0, uint32_t a1, uint32_t a2)
{
	struct ipc_event ev = {
		.req_id = id, .token = tok, .index = index, .flags = flags,
		.reason = reason, .detail = detail, .err = err,
		.arg = { a0, a1, a2 }, .t_submit_ns = t_submit, .t_pickup_ns = t_pickup,
	};
	int ret;

	if (c->dead)
		return;
	ret = client_conn_push(c, &ev);
	if (ret < 0 && !c->dead) {
		c->dead = 1;
		if (ret != -EPROTO)
			snprintf(c->why, sizeof(c->why), "cannot queue an event: %s", strerror(-ret));
	}
}

static void remove_ptr(struct sched_req **v, int *n, struct sched_req *r)
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
static void finish(struct sched *s, struct sched_req *r, uint16_t reason, uint16_t detail, int err,
		   uint32_t a0, int emit_final)
{
	if (emit_final)
		emit(r->c, r->id, r->t_submit, r->t_pickup, -1, (uint32_t)r->n_gen, IPC_EV_FINAL,
		     reason, detail, err, a0, 0, 0);
	s->m.requests_finished[reason]++;
	r->keep = reason == IPC_REASON_STOP || reason == IPC_REASON_LENGTH;
	if (r->session[0]) {
		int i = session_find(s, r->c, r->session);

		if (i >= 0)
			s->ses[i].inflight--;
	}
	r->c->n_inflight--;
	r->c->inflight_tokens -= r->n_prompt + r->max_tokens;
	if (r->running)
		remove_ptr(s->run, &s->n_run, r);
	else
		remove_ptr(s->wait, &s->n_wait, r);
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

/* Semantic checks of a structurally valid request: 0, or an error event sent. */
static int refuse(struct sched *s, struct client_conn *c, const struct ipc_sub *rec,
		  const int32_t *tokens, uint64_t t_pickup)
{
	uint32_t vocab = (uint32_t)s->e->model->cfg.vocab_size;
	int64_t cap = (int64_t)s->e->pool.n_blocks * s->e->pool.block_tokens;
	uint16_t detail = IPC_DETAIL_NONE;
	uint32_t a0 = 0, a1 = 0;
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
	emit(c, rec->req_id, rec->t_submit_ns, t_pickup, -1, 0, IPC_EV_FINAL, IPC_REASON_ERROR,
	     detail, err, a0, a1, vocab);
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

void sched_submit(struct sched *s, struct client_conn *c, const struct ipc_sub *rec,
		  int32_t *tokens, uint64_t t_pickup_ns)
{
	struct sched_req *r;
	int ses = -1;

	if (rec->kind == IPC_SUB_CANCEL) {
		r = find(s, c, rec->req_id);
		if (r)
			finish(s, r, IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 1);
		return;
	}
	c->n_submitted++;
	if (refuse(s, c, rec, tokens, t_pickup_ns))
		goto out_free;
	if (rec->session[0] && (ses = session_get(s, c, rec->session)) < 0) {
		emit(c, rec->req_id, rec->t_submit_ns, t_pickup_ns, -1, 0, IPC_EV_FINAL, IPC_REASON_ERROR,
		     IPC_DETAIL_SESSIONS, -ENOSPC, (uint32_t)s->o.max_sessions, 0, 0);
		goto out_free;
	}
	if (s->n_wait == s->cap_wait) {
		int cap = s->cap_wait ? 2 * s->cap_wait : 64;
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
	r->max_tokens = (int)rec->max_tokens;
	r->need_blocks = kv_pool_blocks_for(&s->e->pool, (int64_t)rec->n_tokens + rec->max_tokens);
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
	c->inflight_tokens += r->n_prompt + r->max_tokens;
	enqueue(s, r);
	return;

out_oom:
	emit(c, rec->req_id, rec->t_submit_ns, t_pickup_ns, -1, 0, IPC_EV_FINAL, IPC_REASON_ERROR,
	     IPC_DETAIL_NONE, -ENOMEM, 0, 0, 0);
out_free:
	free(tokens);
}

void sched_drop_client(struct sched *s, struct client_conn *c)
{
	for (int i = s->n_run - 1; i >= 0; i--)
		if (s->run[i]->c == c)
			finish(s, s->run[i], IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 0);
	for (int i = s->n_wait - 1; i >= 0; i--)
		if (s->wait[i]->c == c)
			finish(s, s->wait[i], IPC_REASON_CANCELLED, IPC_DETAIL_CANCEL, 0, 0, 0);
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

void sched_cancel_all(struct sched *s)
{
	while (s->n_run)
		finish(s, s->run[0], IPC_REASON_CANCELLED, IPC_DETAIL_SHUTDOWN, 0, 0, 1);
	while (s->n_wait)
		finish(s, s->wait[0], IPC_REASON_CANCELLED, IPC_DETAIL_SHUTDOWN, 0, 0, 1);
}

int sched_busy(const struct sched *s)
{
	return s->n_run + s->n_wait;
}

/* Blocks the running requests may still claim (their reservations not yet taken). */
static int64_t blocks_promised(const struct sched *s)
{
	int64_t n = 0;

	for (int i = 0; i < s->n_run; i++) {
		int more = s->run[i]->need_blocks - s->run[i]->seq.n_blocks;

		n += more > 0 ? more : 0;
	}
	return n;
}

static int can_admit(const struct sched *s)
{
	return s->n_wait && s->n_run < s->o.max_batch && !s->draining &&
	       (int64_t)kv_pool_available(&s->e->pool) - blocks_promised(s) >= s->wait[0]->need_blocks;
}

/* Prefix-cache salt of c's requests: its uid, or one value for all. */
static uint64_t salt_of(const struct sched *s, const struct client_conn *c)
{
	return s->o.share_prefix ? 0x6b646563736861ULL : (uint64_t)c->uid;
}

/* Starts r's sequence on its session's KV (owner: the client's uid), if it names
 * one that has no other turn running, else on the prefix cache. */
static int req_start(struct sched *s, struct sched_req *r)
{
	uint64_t salt = salt_of(s, r->c);
	struct kv_session *kvs;
	int cached = 0, ret;

	if (r->session[0] && !engine_session_open(s->e, r->session, r->c->uid, salt, &kvs)) {
		ret = engine_seq_start_session(s->e, &r->seq, kvs, r->prompt, r->n_prompt, &cached);
		if (!ret)
			r->kvs = kvs;
		if (ret != -EBUSY)
			goto out;
		log_debug("session '%s' has a turn running: request %llu runs without it",
			  r->session, (unsigned long long)r->id);
	}
	ret = engine_seq_start(s->e, &r->seq, r->prompt, r->n_prompt, salt, &cached);
out:
	if (!ret)
		r->n_prefilled = cached;
	return ret;
}

/* Moves the first waiting request into the batch with its cached prefix mapped;
 * NULL (the request ended with an error) if that fails. */
static struct sched_req *admit(struct sched *s)
{
	struct sched_req *r = s->wait[0];
	int ret;

	remove_ptr(s->wait, &s->n_wait, r);
	r->running = 1;
	r->c->step_space = -1;
	s->run[s->n_run++] = r;
	ret = req_start(s, r);
	if (ret) {
		log_warn("client %u request %llu: cannot start: %s", r->c->id,
			 (unsigned long long)r->id, strerror(-ret));
		finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return NULL;
	}
	return r;
}

int sched_runnable(struct sched *s)
{
	for (int i = 0; i < s->n_run; i++) {
		struct sched_req *r = s->run[i];

		if (r->n_prefilled < r->n_prompt || client_conn_ev_free(r->c) > 0)
			return 1;
	}
	return can_admit(s);
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
	finish(s, r, IPC_REASON_CANCELLED, IPC_DETAIL_STALLED, 0, (uint32_t)s->o.stall_ms, 1);
	return 1;
}

static void add(struct sched *s, int *n, struct sched_req *r, const int32_t *tok, int n_tok)
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

/* Drafts for r's next decode into r->fed[1..], at most room of them; 0: r decodes
 * plainly. Only greedy requests without penalties or logprobs speculate, where
 * verification by argmax gives exactly the plain output; sampled requests need
 * rejection sampling to keep their distribution (not done yet). */
static int spec_drafts(struct sched *s, struct sched_req *r, int room)
{
	int k = r->spec_k, left = r->max_tokens - r->n_gen - 1, nh = r->seq.n_tokens + 1;

	if (!k || r->sp.temperature > 0 || r->sp.logprobs || k_sample_has_penalty(&r->sp))
		return 0;
	k = k < left ? k : left;
	k = k < room ? k : room;
	if (k <= 0)
		return 0;
	if (nh > s->spec_cap) {
		int cap = nh > 2 * s->spec_cap ? nh : 2 * s->spec_cap;
		int32_t *h = realloc(s->spec_hist, (size_t)cap * sizeof(*h));

		if (!h)
			return 0;	/* no drafts is always correct */
		s->spec_hist = h;
		s->spec_cap = cap;
	}
	/* the history: what the KV holds (prompt, output) and the token fed next */
	memcpy(s->spec_hist, r->seq.tokens, (size_t)r->seq.n_tokens * sizeof(int32_t));
	s->spec_hist[nh - 1] = r->last;
	return spec_ngram_propose(s->spec_hist, nh, r->spec_n, k, r->fed + 1);
}

/* A decode of r: its last token, and drafts to verify when it speculates. Each
 * token the step may emit takes a budget token and an event slot. */
static void add_decode(struct sched *s, int *n, struct sched_req *r, int *budget)
{
	int nd = spec_drafts(s, r, *budget - 1 < r->c->step_space - 1 ? *budget - 1 : r->c->step_space - 1);

	r->fed[0] = r->last;
	add(s, n, r, r->fed, 1 + nd);
	if (nd) {
		s->ereq[*n - 1].all_logits = 1;
		s->ereq[*n - 1].n_draft = nd;
		for (int j = 1; j <= nd; j++, s->n_rows++) {
			s->sp[s->n_rows] = r->sp;
			s->hist[s->n_rows] = s->hist[s->n_rows - 1];
			s->steps[s->n_rows] = (uint64_t)(r->n_gen + j);
		}
	}
	r->c->step_space -= 1 + nd;
	*budget -= 1 + nd;
}

/* Picks the step's requests: decodes first, then prefill chunks, admitting waiting
 * requests while the KV cache, the batch and the token budget allow. */
static int build_step(struct sched *s, uint64_t now)
{
	int budget = s->o.step_tokens, n = 0;

	s->n_rows = 0;

	/* space_cache lives in the client for one step: reset it first. */
	for (int i = 0; i < s->n_run; i++)
		s->run[i]->c->step_space = -1;
	for (int i = 0; i < s->n_run && budget > 0; i++) {
		struct sched_req *r = s->run[i];

		if (r->n_prefilled < r->n_prompt || r->c->dead)
			continue;
		if (step_space(r->c, &r->c->step_space) > 0) {
			r->paused_since = 0;
			add_decode(s, &n, r, &budget);
		} else if (req_pause(s, r, now)) {
			i--;
		}
	}
	for (int i = 0; budget > 0 && n < s->o.max_batch; i++) {
		struct sched_req *r;
		int rem, chunk;

		if (i == s->n_run) {
			if (!can_admit(s))
				break;
			if (!admit(s)) {
				i--;
				continue;
			}
		}
		r = s->run[i];
		rem = r->n_prompt - r->n_prefilled;
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
		add(s, &n, r, r->prompt + r->n_prefilled, chunk);
		budget -= chunk;
	}
	return n;
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
	uint32_t index = (uint32_t)r->n_gen++;
	uint16_t reason = IPC_REASON_NONE;

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
	emit(r->c, r->id, r->t_submit, r->t_pickup, tok, index, flags | (reason ? IPC_EV_FINAL : 0),
	     reason, IPC_DETAIL_NONE, 0, a[0], a[1], a[2]);
	if (reason)
		finish(s, r, reason, IPC_DETAIL_NONE, 0, 0, 0);
	else
		r->last = tok;
}

/* Delivers tok, with its logprobs when the request asked (lp may be NULL: none). */
static void deliver_lp(struct sched *s, struct sched_req *r, int32_t tok,
		       const struct k_sample_logprobs *lp, uint64_t now)
{
	uint32_t flags = 0, a[3] = { 0, 0, 0 };

	if (record_out(r, tok)) {
		finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_NONE, -ENOMEM, 0, 1);
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

/* A verification step of r: ids (q->n_tokens) the greedy token after each fed
 * one. Emits the drafts the model agrees with and its own next token, cut after a
 * stop token, and rolls the KV of the rest back. */
static void deliver_spec(struct sched *s, struct sched_req *r, const struct engine_req *q,
			 const int32_t *ids, uint64_t now)
{
	int nd = q->n_draft, m = 1, ret;

	while (m <= nd && ids[m - 1] == q->tokens[m])
		m++;
	for (int j = 0; j < m - 1; j++)
		for (int k = 0; k < r->n_stop; k++)
			if (ids[j] == r->stop[k])
				m = j + 1;
	s->m.spec_draft_tokens += (uint64_t)nd;
	s->m.spec_accepted_tokens += (uint64_t)(m - 1);
	/* the KV keeps the fed tokens that are now output: last and m - 1 drafts */
	ret = engine_seq_truncate(s->e, &r->seq, r->seq.n_tokens - (nd + 1 - m));
	if (ret) {
		log_error("client %u request %llu: KV rollback failed: %s", r->c->id,
			  (unsigned long long)r->id, strerror(-ret));
		finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return;
	}
	/* drafts stop short of max_tokens and of a stop token: only the last of these
	 * may end r (and free it) */
	for (int j = 0; j < m; j++)
		deliver_lp(s, r, ids[j], NULL, now);
}

int sched_step(struct sched *s, uint64_t now_ns)
{
	char err[256] = "";
	uint64_t now;
	int n, ret;

	n = build_step(s, now_ns);
	if (!n)
		return 0;
	ret = engine_step_sample_ext(s->e, s->ereq, n, s->sp, s->steps, s->hist, s->ids, s->lp, NULL,
				     err, sizeof(err));
	if (ret) {
		log_error("engine step of %d requests failed: %s", n, err[0] ? err : strerror(-ret));
		for (int i = 0; i < n; i++)
			finish(s, s->of[i], IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return ret;
	}
	now = ipc_now_ns();
	for (int i = 0; i < n; i++) {
		struct sched_req *r = s->of[i];

		if (r->n_prefilled < r->n_prompt) {
			r->n_prefilled += s->ereq[i].n_tokens;
			if (r->n_prefilled < r->n_prompt)
				continue;	/* a middle chunk: its sample is not a token */
			s->m.prompt_tokens += (uint64_t)r->n_prompt;
		}
		if (s->ereq[i].n_draft)
			deliver_spec(s, r, &s->ereq[i], s->ids + s->row0[i], now);
		else
			deliver_lp(s, r, s->ids[s->row0[i]], &s->lp[s->row0[i]], now);
	}
	return n;
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
