/* Helpers of the KV cache tests: engines on tiny synthetic models, greedy runs, and
 * the cache invariants checked after every operation. Include after testutil.h. */
#ifndef KD_TESTS_KVTEST_H
#define KD_TESTS_KVTEST_H

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/engine_internal.h"
#include "daemon/model/model.h"

/* The path of tests/data/tiny/<name>.json; with KDEC_TEST_CFG (a JSON object) a copy of
 * it with those keys set, written under /tmp (removed by kvt_tiny_done): the KV tests
 * run again under tensor parallel (tests/kv_tp.sh, KDEC_TEST_TP) on shapes the ranks
 * split. */
static inline const char *kvt_tiny_path(const char *name, char *path, size_t len)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	const char *set = getenv("KDEC_TEST_CFG");
	json_error_t jerr;
	json_t *cfg, *over;
	char src[1024];

	snprintf(src, sizeof(src), "%s/tests/data/tiny/%s.json", top, name);
	if (!set || !*set) {
		snprintf(path, len, "%s", src);
		return path;
	}
	snprintf(path, len, "/tmp/kdec_kvtest_%d_%s.json", (int)getpid(), name);
	cfg = json_load_file(src, 0, &jerr);
	over = json_loads(set, 0, &jerr);
	CHECK(cfg && json_is_object(over) && json_object_update(cfg, over) == 0 &&
	      json_dump_file(cfg, path, 0) == 0, "KDEC_TEST_CFG '%s' on %s: %s", set, src, jerr.text);
	json_decref(cfg);
	json_decref(over);
	return path;
}

static inline void kvt_tiny_done(const char *path)
{
	if (getenv("KDEC_TEST_CFG") && !strncmp(path, "/tmp/kdec_kvtest_", 17))
		unlink(path);
}

/* eo with KDEC_TEST_TP's ranks (tensor parallel; unset: eo's). */
static inline struct engine_opts kvt_opts(const struct engine_opts *eo)
{
	struct engine_opts o = *eo;

	if (getenv("KDEC_TEST_TP"))
		o.tp = atoi(getenv("KDEC_TEST_TP"));
	return o;
}

/* A model of tests/data/tiny/<name>.json with synthetic weights (seed) and an engine. */
static inline int kvt_open(const char *name, uint64_t seed, const struct engine_opts *eo,
			   struct model **m, struct engine **e)
{
	struct model_load_opts lo = { .synthetic = 1, .seed = seed };
	struct engine_opts o = kvt_opts(eo);
	char path[1024], err[512] = "";
	int ret;

	*m = NULL;
	*e = NULL;
	kvt_tiny_path(name, path, sizeof(path));
	ret = model_load(m, path, &lo, err, sizeof(err));
	kvt_tiny_done(path);
	CHECK(ret == 0, "%s: %s", path, err);
	if (ret)
		return ret;
	if (getenv("KDEC_TEST_MLA_CP") && (*m)->cfg.mla && o.tp > 1)
		o.mla_cp = 1;	/* the latent cache split by tokens over the ranks */
	ret = engine_create(e, *m, &o, err, sizeof(err));
	CHECK(ret == 0, "engine: %s", err);
	return ret;
}

static inline void kvt_close(struct model *m, struct engine *e)
{
	engine_destroy(e);
	model_destroy(m);
}

/* Runs toks through s in one step; logits (vocab) of the last token. */
static inline int kvt_step(struct engine *e, struct engine_seq *s, const int32_t *toks, int n,
			   float *logits)
{
	struct engine_req r = { .seq = s, .tokens = toks, .n_tokens = n };
	char err[256] = "";
	int ret = engine_step(e, &r, 1, logits, err, sizeof(err));

	CHECK(ret == 0, "step of %d tokens at %d: %s", n, s->n_tokens, err);
	return ret;
}

/* Cold reference: logits of the last of toks[0..n) in a fresh sequence, no cache. */
static inline int kvt_cold(struct engine *e, const int32_t *toks, int n, float *logits)
{
	struct engine_seq s;
	int ret;

	engine_seq_init(&s);
	ret = kvt_step(e, &s, toks, n, logits);
	engine_seq_release(e, &s);
	return ret;
}

/* Greedy: n_gen tokens after the logits in l (vocab floats, overwritten). */
static inline int kvt_greedy(struct engine *e, struct engine_seq *s, float *l, int n_gen, int32_t *out)
{
	int vocab = e->model->cfg.vocab_size;

	for (int i = 0; i < n_gen; i++) {
		out[i] = test_argmax(l, vocab);
		if (i + 1 < n_gen && kvt_step(e, s, &out[i], 1, l))
			return -1;
	}
	return 0;
}

/* Token ids for a test prompt: n of them from seed, spread over the vocabulary. */
static inline void kvt_fill(int32_t *t, int n, unsigned seed, int vocab)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)((seed * 2654435761u + (unsigned)i * 7919u + 13u) % (unsigned)vocab);
}

/* One turn on session sess: start on it with prompt (n tokens), compute what the
 * session holds no KV for, generate n_gen tokens greedily into gen (the last one not
 * run), save, release. last_logits (vocab floats, or NULL) receives the prompt's last
 * logits. Returns the tokens the session supplied, -1 when the turn did not start. */
static inline int kvt_turn(struct engine *e, struct kv_session *sess, const int32_t *prompt,
			   int n, int n_gen, int32_t *gen, float *last_logits)
{
	int vocab = e->model->cfg.vocab_size, cached = -1, ret;
	float *l = malloc((size_t)vocab * sizeof(float));
	struct engine_seq s;

	engine_seq_init(&s);
	ret = engine_seq_start_session(e, &s, sess, prompt, n, &cached);
	CHECK(ret == 0, "start a session turn of %d tokens: %d", n, ret);
	if (ret == 0) {
		if (!kvt_step(e, &s, prompt + cached, n - cached, l)) {
			if (last_logits)
				memcpy(last_logits, l, (size_t)vocab * sizeof(float));
			kvt_greedy(e, &s, l, n_gen, gen);
		}
		CHECK(engine_session_save(e, sess, &s) == 0, "save a session turn");
	}
	engine_seq_release(e, &s);
	free(l);
	return ret == 0 ? cached : -1;
}

/* Waits for every host-tier move in flight and commits it (the engine thread's
 * engine_host_poll, blocking). */
static inline void kvt_moves_wait(struct engine *e)
{
	while (e->host_jobs) {
		engine_mover_wait(e->mover);
		engine_host_poll(e);
	}
}

/* One more reference to host block b in the distinct blocks seen so far. */
static inline void kvt_count_host(const struct kv_host_block *b, const struct kv_host_block ***hb,
				  uint32_t **hrefs, size_t *n_hb, size_t *host_used)
{
	size_t k = 0;

	while (k < *n_hb && (*hb)[k] != b)
		k++;
	if (k == *n_hb) {
		*hb = realloc(*hb, (*n_hb + 1) * sizeof(**hb));
		*hrefs = realloc(*hrefs, (*n_hb + 1) * sizeof(**hrefs));
		(*hb)[*n_hb] = b;
		(*hrefs)[(*n_hb)++] = 0;
		*host_used += kv_host_cost(b->zbytes);
	}
	(*hrefs)[k]++;
}

/* Bytes of every block of the session, in order, read from the device (malloc'd;
 * the caller frees). */
static inline uint8_t *kvt_session_kv(struct engine *e, const struct kv_session *s)
{
	uint8_t *buf = malloc(e->block_bytes * (size_t)s->n_blocks + 1);

	for (int b = 0; b < s->n_blocks; b++)
		CHECK(s->dev[b] >= 0 && engine_block_read(e, s->dev[b], buf + e->block_bytes * (size_t)b) == 0,
		      "read block %d", b);
	return buf;
}

/* Every invariant of the pool, the prefix index, the sessions and the host tier,
 * with seqs[0..n_seqs) the live sequences (the only holders besides sessions).
 * Returns the number of violations (each also a failed CHECK). */
static inline int kvt_check_invariants(const struct engine *e, struct engine_seq *const *seqs, int n_seqs)
{
	const struct kv_pool *p = &e->pool;
	int nb = p->n_blocks, before = test_failures, n_lru = 0, n_reg = 0;
	uint32_t *want = calloc((size_t)nb, sizeof(*want));
	char *state = calloc((size_t)nb, 1);	/* 'f' free list, 'l' LRU */
	const struct kv_host_block **hb = NULL;
	uint32_t *hrefs = NULL;
	size_t n_hb = 0, host_used = 0;

	for (int i = 0; i < n_seqs; i++) {
		const struct engine_seq *s = seqs[i];

		CHECK(s->n_blocks == kv_pool_blocks_for(p, s->n_tokens), "seq %d: %d blocks for %d tokens",
		      i, s->n_blocks, s->n_tokens);
		for (int b = 0; b < s->n_blocks; b++)
			if (s->blocks[b] >= 0 && s->blocks[b] < nb)
				want[s->blocks[b]]++;
	}
	for (const struct kv_session *s = e->sessions.head; s; s = s->next) {
		CHECK(s->n_blocks == kv_pool_blocks_for(p, s->n_tokens), "session %s: %d blocks for %d tokens",
		      s->name, s->n_blocks, s->n_tokens);
		for (int b = 0; b < s->n_blocks; b++) {
			CHECK(s->dev[b] >= 0 || s->host[b], "session %s block %d nowhere", s->name, b);
			if (s->dev[b] >= 0 && s->dev[b] < nb)
				want[s->dev[b]]++;
			if (s->host[b])
				kvt_count_host(s->host[b], &hb, &hrefs, &n_hb, &host_used);
		}
		if (s->job)
			CHECK(((const struct host_job *)s->job)->sess == s, "session %s: its move is not its", s->name);
	}
	/* moves in flight hold references of their own (engine_internal.h) */
	for (const struct host_job *j = e->host_jobs; j; j = j->next) {
		for (int k = 0; k < j->mj.n; k++) {
			const struct mover_block *b = &j->mj.b[k];

			if (b->dev >= 0 && b->dev < nb)
				want[b->dev]++;
			if (b->hb)
				kvt_count_host(b->hb, &hb, &hrefs, &n_hb, &host_used);
		}
		CHECK(!j->sess || j->sess->job == j, "a move's session does not point back at it");
	}
	for (int i = 0; i < p->n_free; i++) {
		int32_t id = p->free_ids[i];

		CHECK(id >= 0 && id < nb && !state[id], "free list entry %d (bad or twice)", id);
		if (id >= 0 && id < nb)
			state[id] = 'f';
	}
	for (int32_t id = p->lru_head, prev = -1; id >= 0; prev = id, id = p->lru_next[id]) {
		CHECK(id < nb && !state[id] && p->lru_prev[id] == prev, "LRU entry %d (bad, twice or mislinked)", id);
		if (id >= nb || state[id] || n_lru > nb)
			break;
		state[id] = 'l';
		n_lru++;
	}
	CHECK(n_lru == p->n_lru, "LRU holds %d blocks, n_lru %d", n_lru, p->n_lru);
	for (int b = 0; b < nb; b++) {
		CHECK(p->refs[b] == want[b], "block %d: refcount %u, %u references", b, p->refs[b], want[b]);
		CHECK((p->refs[b] > 0) + (state[b] == 'f') + (state[b] == 'l') == 1,
		      "block %d: refs %u, state '%c' (free, cached or referenced: exactly one)", b, p->refs[b],
		      state[b] ? state[b] : '-');
		CHECK(p->cached[b] == e->prefix.registered[b], "block %d: cached %d, registered %d", b,
		      p->cached[b], e->prefix.registered[b]);
		CHECK(state[b] != 'l' || p->cached[b], "block %d on the LRU but not cached", b);
		CHECK(state[b] != 'f' || !p->cached[b], "block %d free but cached", b);
		if (e->prefix.registered[b]) {
			n_reg++;
			CHECK(kv_prefix_find(&e->prefix, e->prefix.keys[b], e->prefix.salts[b]) == b,
			      "block %d: its key does not find it", b);
		}
	}
	CHECK(n_reg == e->prefix.n_entries, "index: %d registered, n_entries %d", n_reg, e->prefix.n_entries);
	for (size_t k = 0; k < n_hb; k++)
		CHECK(hb[k]->refs == hrefs[k], "host block %zu: refs %u, %u references", k, hb[k]->refs, hrefs[k]);
	CHECK(n_hb == e->host.n_blocks && host_used == e->host.used,
	      "host tier: %zu blocks / %zu bytes referenced, %zu / %zu accounted", n_hb, host_used,
	      e->host.n_blocks, e->host.used);
	CHECK(e->host.used <= e->host.budget, "host tier: %zu bytes over the budget %zu", e->host.used,
	      e->host.budget);
	free(want);
	free(state);
	free(hb);
	free(hrefs);
	return test_failures - before;
}

#endif
