/* Sessions and the host tier on the engine (tiny synthetic models, blocks of 8):
 *  - multi-turn: turn 2 computes only the tokens the session has no KV for (counters)
 *    and its logits and greedy continuation equal a cold run's, bit for bit;
 *  - offload then restore (GQA and MLA layouts): bit-identical KV, identical logits;
 *  - quota, memory pressure, idle offload and TTL (fake clock), close during a turn,
 *    per-owner names and limits;
 *  - property test: a long random workload of starts, steps, releases, session turns,
 *    offloads and restores (waited for, or left in flight on the mover and committed
 *    by a later poll), ticks and cache drops, with every invariant checked after
 *    every operation and every computed logit row compared with a cold run. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testutil.h"
#include "tests/kvtest.h"
#include "daemon/engine/engine_internal.h"

#define BT 8

static uint64_t fake_now;

static uint64_t fake_clock(void)
{
	return fake_now;
}

static void test_multi_turn(const char *model)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 64 * BT, .max_rows = 32 };
	struct engine_opts co = { .threads = 1, .block_tokens = 16, .kv_tokens = 1024, .max_rows = 64 };
	struct model *m, *cm;
	struct engine *e, *cold;
	struct kv_session *sess;
	int32_t hist[128], gen[16], gen_cold[16];
	float *l, *ref;
	int vocab, n1 = 29, n2, cached;
	uint64_t computed, hits;
	uint8_t *kv_before, *kv_after;

	if (kvt_open(model, 7, &eo, &m, &e) || kvt_open(model, 7, &co, &cm, &cold))
		goto out;
	vocab = m->cfg.vocab_size;
	l = malloc((size_t)vocab * sizeof(float));
	ref = malloc((size_t)vocab * sizeof(float));
	CHECK(engine_session_open(e, "chat", 1000, 1000, &sess) == 0, "%s: open", model);

	/* turn 1: 29 prompt tokens, 7 generated; the history the session keeps is 35 */
	kvt_fill(hist, n1, 1, vocab);
	CHECK(kvt_turn(e, sess, hist, n1, 7, gen, NULL) == 0, "%s: turn 1 starts cold", model);
	CHECK(sess->n_tokens == n1 + 6, "%s: session keeps %d tokens", model, sess->n_tokens);
	memcpy(hist + n1, gen, 7 * sizeof(int32_t));
	n2 = n1 + 7;
	kvt_fill(hist + n2, 10, 2, vocab);	/* the user's next message */
	n2 += 10;
	kvt_check_invariants(e, NULL, 0);

	/* turn 2 re-sends everything: only the last generated token and the 10 new
	 * ones are computed, even the partial block of the history is reused */
	computed = e->stats.prompt_tokens;
	hits = e->stats.prefix_hit_tokens;
	cached = kvt_turn(e, sess, hist, n2, 5, gen, l);
	CHECK(cached == n1 + 6, "%s: turn 2 reuses %d tokens, want %d", model, cached, n1 + 6);
	CHECK(e->stats.prefix_hit_tokens - hits == (uint64_t)(n1 + 6), "%s: hit counter", model);
	CHECK(e->stats.prompt_tokens - computed == 11 + 4, "%s: turn 2 computed %llu tokens, want 11 + 4 decode",
	      model, (unsigned long long)(e->stats.prompt_tokens - computed));
	kvt_cold(cold, hist, n2, ref);
	CHECK(test_same_floats(l, ref, (size_t)vocab), "%s: turn 2 logits differ from a cold run", model);
	{
		struct engine_seq cs;

		engine_seq_init(&cs);
		kvt_step(cold, &cs, hist, n2, ref);
		kvt_greedy(cold, &cs, ref, 5, gen_cold);
		engine_seq_release(cold, &cs);
		CHECK(!memcmp(gen, gen_cold, sizeof(int32_t) * 5), "%s: turn 2 generates other tokens than cold", model);
	}
	memcpy(hist + n2, gen, 5 * sizeof(int32_t));
	n2 += 5;
	kvt_check_invariants(e, NULL, 0);

	/* offload, evict the device copies, restore: the same bytes come back */
	kv_before = kvt_session_kv(e, sess);
	CHECK(engine_session_offload(e, sess) == 0, "%s: offload", model);
	CHECK(kv_session_blocks_on_device(sess) == 0 && kv_session_blocks_on_host(sess) == sess->n_blocks,
	      "%s: all blocks on host", model);
	CHECK(e->stats.offloaded_blocks == (uint64_t)sess->n_blocks && e->stats.offloaded_zbytes > 0 &&
	      e->stats.offloaded_zbytes < e->stats.offloaded_bytes, "%s: offload counters", model);
	kvt_check_invariants(e, NULL, 0);
	engine_cache_drop(e);
	CHECK(engine_session_restore(e, sess) == 0, "%s: restore", model);
	CHECK(e->stats.restored_blocks == (uint64_t)sess->n_blocks && e->stats.restores == 1,
	      "%s: every block decompressed (%llu)", model, (unsigned long long)e->stats.restored_blocks);
	kv_after = kvt_session_kv(e, sess);
	CHECK(!memcmp(kv_before, kv_after, e->block_bytes * (size_t)sess->n_blocks),
	      "%s: restored KV differs", model);
	kvt_check_invariants(e, NULL, 0);

	/* turn 3 after the round trip: next-token logits as a cold run's */
	kvt_fill(hist + n2, 6, 3, vocab);
	n2 += 6;
	{
		int kept = sess->n_tokens;

		cached = kvt_turn(e, sess, hist, n2, 1, gen, l);
		CHECK(cached == kept, "%s: turn 3 reuses %d tokens, want the %d kept", model, cached, kept);
	}
	kvt_cold(cold, hist, n2, ref);
	CHECK(test_same_floats(l, ref, (size_t)vocab), "%s: logits after restore differ", model);

	/* offloaded session, next turn straight away: the turn restores it itself */
	CHECK(engine_session_offload(e, sess) == 0, "%s: offload again", model);
	engine_cache_drop(e);
	hist[n2] = gen[0];
	n2 += 1;
	kvt_fill(hist + n2, 3, 4, vocab);
	n2 += 3;
	cached = kvt_turn(e, sess, hist, n2, 1, gen, l);
	CHECK(cached == n2 - 4, "%s: turn 4 on an offloaded session reuses %d, want %d", model, cached, n2 - 4);
	kvt_cold(cold, hist, n2, ref);
	CHECK(test_same_floats(l, ref, (size_t)vocab), "%s: logits of a turn on an offloaded session", model);
	kvt_check_invariants(e, NULL, 0);
	free(kv_before);
	free(kv_after);
	free(l);
	free(ref);
out:
	kvt_close(m, e);
	kvt_close(cm, cold);
}

static void test_lifecycle(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 24 * BT, .max_rows = 32,
				  .session_quota_blocks = 6, .max_sessions = 2, .offload_after_s = 10,
				  .session_ttl_s = 100 };
	struct model *m;
	struct engine *e;
	struct kv_session *a, *b, *c;
	struct engine_session_info info[4];
	int32_t p[200], gen[4];
	int vocab;

	if (kvt_open("llama", 7, &eo, &m, &e))
		goto out;
	e->clock_ns = fake_clock;
	fake_now = 1000000000ull;
	vocab = m->cfg.vocab_size;
	kvt_fill(p, 200, 9, vocab);

	CHECK(engine_session_open(e, "a", 1, 1, &a) == 0 && engine_session_open(e, "b", 1, 1, &b) == 0, "open");
	CHECK(engine_session_open(e, "c", 1, 1, &c) == -EDQUOT, "third session of owner 1 refused");
	CHECK(engine_session_open(e, "a", 2, 2, &c) == 0 && c != a, "same name, other owner: another session");
	CHECK(engine_session_open(e, "a", 1, 1, &c) == 0 && c == a, "reopen finds it");
	CHECK(engine_session_open(e, "bad name", 1, 1, &c) == -EINVAL, "name with a space refused");
	CHECK(engine_session_close(e, "a", 2) == 0 && engine_session_close(e, "a", 2) == -ENOENT, "close");

	/* quota 6 blocks while the cache is mostly free: a (5 blocks) and b (5 blocks)
	 * both stay on the device */
	kvt_turn(e, a, p, 36, 2, gen, NULL);
	fake_now += 1000000000ull;
	kvt_turn(e, b, p + 50, 36, 2, gen, NULL);
	CHECK(kv_session_blocks_on_device(a) == 5 && kv_session_blocks_on_device(b) == 5,
	      "quota does not bind in a free cache");
	/* a live sequence holding 12 of the 24 blocks makes the cache contended: b's next
	 * turn puts owner 1 over quota, and a, the older, moves to host */
	{
		struct engine_seq big;
		float *l = malloc((size_t)vocab * sizeof(float));

		engine_seq_init(&big);
		CHECK(engine_seq_start(e, &big, p + 100, 12 * BT, 7, NULL) == 0, "hog start");
		kvt_step(e, &big, p + 100, 12 * BT, l);
		kvt_turn(e, b, p + 50, 36, 2, gen, NULL);
		CHECK(a->job && kv_session_blocks_on_device(a) == 5, "quota: a's offload in flight, a whole");
		engine_seq_release(e, &big);
		free(l);
	}
	kvt_moves_wait(e);	/* the quota's offload runs on the mover */
	CHECK(kv_session_blocks_on_device(a) == 0 && kv_session_blocks_on_host(a) == 5, "quota: a offloaded");
	CHECK(kv_session_blocks_on_device(b) == 5, "quota: b on the device");
	kvt_check_invariants(e, NULL, 0);
	CHECK(engine_sessions_list(e, info, 4) == 2, "two sessions listed");
	CHECK(!strcmp(info[0].name, "b") && info[0].blocks_device == 5 && info[1].blocks_host == 5 &&
	      info[1].n_tokens == 37 && info[1].idle_s == 1.0, "listing: %s %d/%d %d tokens idle %.2f",
	      info[1].name, info[1].blocks_device, info[1].blocks_host, info[1].n_tokens, info[1].idle_s);

	/* memory pressure: a prompt that needs most of the cache moves b to host */
	{
		struct engine_seq s;
		float *l = malloc((size_t)vocab * sizeof(float));

		engine_seq_init(&s);
		CHECK(engine_seq_start(e, &s, p + 1, 180, 7, NULL) == 0, "big start");
		kvt_step(e, &s, p + 1, 180, l);
		CHECK(kv_session_blocks_on_device(b) == 0 && kv_session_blocks_on_host(b) == 5,
		      "pressure: b offloaded");
		struct engine_seq *live[1] = { &s };
		kvt_check_invariants(e, live, 1);
		engine_seq_release(e, &s);
		free(l);
	}

	/* idle offload and TTL */
	CHECK(engine_session_restore(e, b) == 0 && kv_session_blocks_on_device(b) == 5, "b back");
	fake_now += 11000000000ull;
	engine_tick(e);
	CHECK(b->job && !engine_session_restoring(b), "idle past offload_after: b's offload in flight");
	kvt_moves_wait(e);
	CHECK(kv_session_blocks_on_device(b) == 0, "idle past offload_after: b to host");
	fake_now += 88500000000ull;
	engine_tick(e);
	CHECK(e->sessions.n == 1 && e->stats.sessions_expired == 1, "a expired after 100 s idle");
	fake_now += 1000000000ull;
	engine_tick(e);
	CHECK(e->sessions.n == 0 && e->stats.sessions_expired == 2, "then b");
	kvt_check_invariants(e, NULL, 0);

	/* saved while its sequence goes on: the next turn leaves the shared last block
	 * to that sequence and recomputes those tokens */
	{
		struct engine_seq s1, s2;
		float *l = malloc((size_t)vocab * sizeof(float)), *ref = malloc((size_t)vocab * sizeof(float));
		int cached;

		CHECK(engine_session_open(e, "y", 4, 4, &a) == 0, "open y");
		engine_seq_init(&s1);
		engine_seq_init(&s2);
		engine_seq_start_session(e, &s1, a, p, 21, &cached);
		kvt_step(e, &s1, p, 21, l);
		CHECK(engine_session_save(e, a, &s1) == 0, "save y");
		CHECK(engine_seq_start_session(e, &s2, a, p, 30, &cached) == 0 && cached == 16,
		      "next turn: %d reused, want the 2 whole blocks", cached);
		kvt_step(e, &s2, p + cached, 30 - cached, l);
		kvt_step(e, &s1, p + 21, 9, l);
		kvt_cold(e, p, 30, ref);
		CHECK(test_same_floats(l, ref, (size_t)vocab), "the first sequence's KV was overwritten");
		struct engine_seq *live[2] = { &s1, &s2 };
		kvt_check_invariants(e, live, 2);
		engine_session_cancel(e, a);
		engine_seq_release(e, &s1);
		engine_seq_release(e, &s2);
		CHECK(engine_session_close(e, "y", 4) == 0, "close y");
		free(l);
		free(ref);
	}

	/* closed during its turn: freed when the turn ends */
	{
		struct engine_seq s;
		int cached;

		CHECK(engine_session_open(e, "x", 3, 3, &a) == 0, "open x");
		engine_seq_init(&s);
		CHECK(engine_seq_start_session(e, &s, a, p, 20, &cached) == 0, "start x");
		CHECK(engine_seq_start_session(e, &s, a, p, 20, &cached) == -EBUSY, "second turn refused");
		CHECK(engine_session_offload(e, a) == -EBUSY, "offload of a busy session refused");
		CHECK(engine_session_close(e, "x", 3) == 0 && !engine_session_find(e, "x", 3), "closed");
		CHECK(engine_sessions_list(e, info, 4) == 0, "not listed");
		engine_tick(e);
		CHECK(e->sessions.n == 1, "still there during the turn");
		engine_session_cancel(e, a);
		CHECK(e->sessions.n == 0, "freed at the end of the turn");
		engine_seq_release(e, &s);
	}
	kvt_check_invariants(e, NULL, 0);
out:
	kvt_close(m, e);
}

/* ---- property test ---------------------------------------------------------- */

#define P_SEQS 4
#define P_DOCS 5
#define P_OPS 3000		/* KVTEST_OPS and KVTEST_SEED override (soak runs) */

struct p_seq {
	struct engine_seq s;
	int live;
	struct kv_session *sess;	/* turn of this session, or NULL */
};

/* The property test's state: the engine under test, a cold engine for reference
 * logits, the live sequences, and the documents prompts are cut from. */
struct p_run {
	struct engine *e, *cold;
	struct p_seq q[P_SEQS];
	int32_t docs[P_DOCS][160], buf[200];
	float *l, *ref;		/* (vocab) logits of the engine, of the cold run */
	int vocab;
	unsigned long long st;	/* the workload's random state */
};

static const char *const p_names[3] = { "s0", "s1", "s2" };

static unsigned p_rand(struct p_run *p, unsigned n)
{
	return (unsigned)test_rand_int(0, (int)n - 1, &p->st);
}

/* Op kind 0 (plain) or 1 (a session's turn) on x: starts it on a document's prefix
 * (a turn resends the session's history plus it) and compares its logits with a cold
 * run's. Returns 1 where the op is dropped before it changes anything. */
static int p_start(struct p_run *p, struct p_seq *x, unsigned kind, int op)
{
	struct engine *e = p->e;
	int d = (int)p_rand(p, P_DOCS), n = 1 + (int)p_rand(p, 60), cached, ret;
	uint64_t owner = p_rand(p, 2);

	memcpy(p->buf, p->docs[d], (size_t)n * sizeof(int32_t));
	engine_seq_init(&x->s);
	x->sess = NULL;
	if (kind == 1 && !engine_session_open(e, p_names[p_rand(p, 3)], owner, owner, &x->sess)) {
		struct kv_session *ss = x->sess;

		if (!ss->busy && ss->n_tokens && ss->n_tokens + n < 190) {
			memcpy(p->buf, ss->tokens, (size_t)ss->n_tokens * sizeof(int32_t));
			memcpy(p->buf + ss->n_tokens, p->docs[d], (size_t)n * sizeof(int32_t));
			n += ss->n_tokens;
		}
		ret = engine_seq_start_session(e, &x->s, ss, p->buf, n, &cached);
		if (ret) {
			CHECK(ret == -EBUSY, "op %d: session start: %d", op, ret);
			x->sess = NULL;
			return 1;
		}
	} else {
		x->sess = NULL;
		CHECK(engine_seq_start(e, &x->s, p->buf, n, owner, &cached) == 0, "op %d: start", op);
	}
	x->live = 1;
	if (engine_step(e, &(struct engine_req){ .seq = &x->s, .tokens = p->buf + cached,
						 .n_tokens = n - cached }, 1, p->l, NULL, 0)) {
		/* cache full: this turn is abandoned */
		if (x->sess)
			engine_session_cancel(e, x->sess);
		engine_seq_release(e, &x->s);
		x->live = 0;
	} else {
		kvt_cold(p->cold, p->buf, n, p->ref);
		if (!test_same_floats(p->l, p->ref, (size_t)p->vocab))
			CHECK(0, "op %d: logits after start (%d cached of %d) differ from cold", op,
			      cached, n);
	}
	return 0;
}

/* Op kind 2 on live x: a few more tokens, logits compared with a cold run's. Returns 1
 * where the op is dropped (past the documents' length, or the cache full). */
static int p_extend(struct p_run *p, struct p_seq *x, int op)
{
	int n = 1 + (int)p_rand(p, 12), at = x->s.n_tokens;
	int32_t ext[12];

	kvt_fill(ext, n, (unsigned)op, p->vocab);
	if (at + n > 190 || engine_step(p->e, &(struct engine_req){ .seq = &x->s, .tokens = ext,
								    .n_tokens = n }, 1, p->l, NULL, 0))
		return 1;
	memcpy(p->buf, x->s.tokens, (size_t)x->s.n_tokens * sizeof(int32_t));
	kvt_cold(p->cold, p->buf, x->s.n_tokens, p->ref);
	if (!test_same_floats(p->l, p->ref, (size_t)p->vocab))
		CHECK(0, "op %d: logits after extending to %d differ from cold", op, x->s.n_tokens);
	return 0;
}

/* Op kind 8: closes a session; a running turn of it ends without it. */
static void p_close(struct p_run *p)
{
	const char *nm = p_names[p_rand(p, 3)];
	uint64_t owner = p_rand(p, 2);
	struct kv_session *ss = engine_session_find(p->e, nm, owner);
	int busy = ss && ss->busy;

	engine_session_close(p->e, nm, owner);
	for (int k = 0; k < P_SEQS && busy; k++) {
		if (p->q[k].live && p->q[k].sess == ss) {
			engine_session_cancel(p->e, ss);
			p->q[k].sess = NULL;
			busy = 0;
		}
	}
}

/* One op of kind on x (kinds 3..8 where they apply; others do nothing). Returns 1
 * where the op is dropped before it changes anything (no invariants to check). */
static int p_op(struct p_run *p, unsigned kind, struct p_seq *x, int op)
{
	struct engine *e = p->e;

	if (kind <= 1 && !x->live) {
		return p_start(p, x, kind, op);
	} else if (kind == 2 && x->live) {
		return p_extend(p, x, op);
	} else if (kind == 3 && x->live && x->sess && !p_rand(p, 3)) {
		/* save and go on: the sequence keeps writing past what the session
		 * holds, so the next turn must not take over the shared last block */
		engine_session_save(e, x->sess, &x->s);
		x->sess = NULL;
	} else if (kind == 3 && x->live) {	/* release, saving a session's turn */
		if (x->sess && p_rand(p, 4))
			engine_session_save(e, x->sess, &x->s);
		else if (x->sess)
			engine_session_cancel(e, x->sess);
		engine_seq_release(e, &x->s);
		x->live = 0;
	} else if (kind == 4) {
		struct kv_session *ss = engine_session_find(e, p_names[p_rand(p, 3)], p_rand(p, 2));
		int async = p_rand(p, 2), ret = 0;

		/* on the mover, left in flight across the next ops, or waited for */
		if (ss)
			ret = async ? engine_session_offload_start(e, ss, 0) : engine_session_offload(e, ss);
		CHECK(!ret || ret == -EBUSY || ret == -ENOSPC, "op %d: offload %d", op, ret);
	} else if (kind == 5) {
		struct kv_session *ss = engine_session_find(e, p_names[p_rand(p, 3)], p_rand(p, 2));
		int async = p_rand(p, 2), ret = 0;

		if (ss && async)
			engine_session_restore_start(e, ss);
		else if (ss)
			ret = engine_session_restore(e, ss);
		CHECK(!ret || ret == -EBUSY || ret == -ENOSPC, "op %d: restore %d", op, ret);
	} else if (kind == 6) {
		engine_tick(e);
	} else if (kind == 7 && p_rand(p, 4) == 0) {
		engine_cache_drop(e);
	} else if (kind == 8 && p_rand(p, 3) == 0) {
		p_close(p);
	}
	return 0;
}

static void test_property(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = 4, .kv_tokens = 48 * 4, .max_rows = 16,
				  .host_kv_bytes = 96 * 1024, .session_quota_blocks = 12, .max_sessions = 3,
				  .offload_after_s = 5, .session_ttl_s = 60 };
	struct engine_opts co = { .threads = 1, .block_tokens = 16, .kv_tokens = 1024, .max_rows = 64 };
	struct model *m = NULL, *cm = NULL;
	struct p_run p;
	struct engine *e;
	struct engine_seq *live[P_SEQS];
	int n_ops = getenv("KVTEST_OPS") ? atoi(getenv("KVTEST_OPS")) : P_OPS;
	int counts[9] = { 0 }, bad = 0;

	memset(&p, 0, sizeof(p));
	p.st = getenv("KVTEST_SEED") ? strtoull(getenv("KVTEST_SEED"), NULL, 0) : 99;
	if (kvt_open("llama", 5, &eo, &m, &p.e) || kvt_open("llama", 5, &co, &cm, &p.cold))
		goto out;
	e = p.e;
	e->host_delay_us = 300;	/* moves stay in flight across a few ops */
	e->host_workers = 2;	/* and their blocks go through two workers */
	e->clock_ns = fake_clock;
	fake_now = 1;
	p.vocab = m->cfg.vocab_size;
	p.l = malloc((size_t)p.vocab * sizeof(float));
	p.ref = malloc((size_t)p.vocab * sizeof(float));
	for (int d = 0; d < P_DOCS; d++)
		kvt_fill(p.docs[d], 160, 100 + (unsigned)d, p.vocab);
	for (int op = 0; op < n_ops && !bad; op++) {
		unsigned kind = p_rand(&p, 9), i = p_rand(&p, P_SEQS);
		int n_live = 0;

		counts[kind]++;
		fake_now += 1000000000ull * p_rand(&p, 3);
		if (!p_rand(&p, 3))	/* the engine loop's commit of the moves done */
			engine_host_poll(e);
		if (p_op(&p, kind, &p.q[i], op))
			continue;
		for (int k = 0; k < P_SEQS; k++)
			if (p.q[k].live)
				live[n_live++] = &p.q[k].s;
		bad = kvt_check_invariants(e, live, n_live);
		if (bad)
			fprintf(stderr, "property test: invariants broken after op %d (kind %u)\n", op, kind);
	}
	fprintf(stderr, "  property test: ops start %d+%d extend %d release %d offload %d restore %d tick %d "
		"drop %d close %d; hits %llu tokens, restores %llu, evictions %llu, dropped %llu, expired %llu\n",
		counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6], counts[7], counts[8],
		(unsigned long long)e->stats.prefix_hit_tokens, (unsigned long long)e->stats.restores,
		(unsigned long long)e->pool.n_evicted, (unsigned long long)e->stats.sessions_dropped,
		(unsigned long long)e->stats.sessions_expired);
	CHECK(e->stats.prefix_hit_tokens > 0 && e->stats.restores > 0 && e->pool.n_evicted > 0,
	      "the workload exercised hits, restores and evictions");
	for (int k = 0; k < P_SEQS; k++) {
		if (!p.q[k].live)
			continue;
		if (p.q[k].sess)
			engine_session_cancel(e, p.q[k].sess);
		engine_seq_release(e, &p.q[k].s);
	}
	kvt_check_invariants(e, NULL, 0);
	kvt_moves_wait(e);
	kvt_check_invariants(e, NULL, 0);
	free(p.l);
	free(p.ref);
out:
	kvt_close(m, p.e);
	kvt_close(cm, p.cold);
}

int main(void)
{
	test_multi_turn("llama");
	test_multi_turn("deepseek_v2");
	test_lifecycle();
	test_property();
	return test_result("test_sessions");
}
