/* Prefix cache on the engine (tiny synthetic llama, blocks of 8 tokens): a miss
 * computes everything, a hit maps whole blocks and computes the rest with logits
 * bit-identical to a cold run; a partial block is never shared; a prompt cached to
 * its end recomputes its last block; LRU eviction takes the least recently released
 * blocks, a sequence's last block first, and drops their keys; two salts never share; a running sequence's blocks
 * serve another one. The invariants are checked after every operation. Plus the
 * pool's LRU on its own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testutil.h"
#include "tests/kvtest.h"

#define BT 8

static int vocab;

static void fill_prompt(int32_t *t, int n, unsigned seed)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)((seed * 2654435761u + (unsigned)i * 7919u + 13u) % (unsigned)vocab);
}

/* Starts s on prompt (salt), checks the cached count, runs the rest, compares the
 * last logits with a cold run: bit-identical. */
static void start_and_check(struct engine *e, struct engine *cold, struct engine_seq *s,
			    const int32_t *prompt, int n, uint64_t salt, int want_cached, const char *what)
{
	float *got = malloc((size_t)vocab * sizeof(float)), *ref = malloc((size_t)vocab * sizeof(float));
	uint64_t hits = e->stats.prefix_hit_tokens, computed = e->stats.prompt_tokens;
	int cached = -1;

	engine_seq_init(s);
	CHECK(engine_seq_start(e, s, prompt, n, salt, &cached) == 0, "%s: start", what);
	CHECK(cached == want_cached, "%s: %d tokens cached, want %d", what, cached, want_cached);
	CHECK(e->stats.prefix_hit_tokens - hits == (uint64_t)cached, "%s: hit counter", what);
	if (!kvt_step(e, s, prompt + cached, n - cached, got) && !kvt_cold(cold, prompt, n, ref))
		CHECK(test_same_floats(got, ref, (size_t)vocab), "%s: logits differ from a cold run", what);
	CHECK(e->stats.prompt_tokens - computed == (uint64_t)(n - cached), "%s: %llu tokens computed, want %d",
	      what, (unsigned long long)(e->stats.prompt_tokens - computed), n - cached);
	free(got);
	free(ref);
}

static void test_pool_lru(void)
{
	struct kv_pool p;
	int evicted[8], n_ev = 0;

	CHECK(kv_pool_init(&p, 4, 16) == 0, "init");
	for (int i = 0; i < 4; i++)
		CHECK(kv_pool_alloc(&p) == i, "alloc %d", i);
	CHECK(kv_pool_set_cached(&p, 1) == 0 && kv_pool_set_cached(&p, 2) == 0, "mark cached");
	CHECK(kv_pool_unref(&p, 2) == 0 && kv_pool_unref(&p, 1) == 0, "release cached 2 then 1");
	CHECK(p.n_lru == 2 && p.n_free == 0 && kv_pool_available(&p) == 2, "cached blocks on the LRU");
	CHECK(p.lru_head == 2 && p.lru_tail == 1, "LRU order: 2 oldest");
	CHECK(kv_pool_ref(&p, 2) == 0 && p.n_lru == 1 && p.refs[2] == 1, "a hit takes 2 off the LRU");
	CHECK(kv_pool_unref(&p, 2) == 0 && p.lru_head == 1 && p.lru_tail == 2, "2 back, now newest");
	CHECK(kv_pool_unref(&p, 3) == 0 && p.n_free == 1, "uncached block to the free list");
	CHECK(kv_pool_alloc(&p) == 3, "free block before any eviction");
	p.on_evict = NULL;
	CHECK(kv_pool_alloc(&p) == 1 && !p.cached[1] && p.n_evicted == 1, "then the LRU head (1) is evicted");
	CHECK(kv_pool_evict_lru(&p) == 2 && p.n_free == 1 && !p.cached[2], "evict_lru frees 2");
	CHECK(kv_pool_evict_lru(&p) == -ENOENT, "LRU empty");
	CHECK(kv_pool_alloc(&p) == 2 && kv_pool_alloc(&p) == -ENOSPC, "exhausted");
	CHECK(kv_pool_set_cached(&p, 0) == 0 && kv_pool_unref(&p, 0) == 0, "0 cached");
	CHECK(kv_pool_ref(&p, 0) == 0 && kv_pool_unref(&p, 0) == 0 && kv_pool_unref(&p, 0) == -EINVAL,
	      "double unref of a cached block caught");
	(void)evicted;
	(void)n_ev;
	kv_pool_fini(&p);
}

int main(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 40 * BT, .max_rows = 32 };
	struct engine_opts co = { .threads = 1, .block_tokens = 5, .kv_tokens = 512, .max_rows = 32 };
	struct model *m = NULL, *cm = NULL;
	struct engine *e = NULL, *cold = NULL;
	struct engine_seq s, t, *live[2];
	int32_t a[64], b[64];
	uint64_t evicted;
	float *l;

	test_pool_lru();
	if (kvt_open("llama", 7, &eo, &m, &e) || kvt_open("llama", 7, &co, &cm, &cold))
		goto out;
	vocab = m->cfg.vocab_size;
	l = malloc((size_t)vocab * sizeof(float));
	fill_prompt(a, 64, 1);
	memcpy(b, a, sizeof(b));
	b[20] = (b[20] + 1) % vocab;	/* diverges inside block 2 */

	/* miss: all 37 computed; 4 full blocks stay cached after release, the partial
	 * fifth is freed */
	start_and_check(e, cold, &s, a, 37, 1, 0, "miss");
	live[0] = &s;
	kvt_check_invariants(e, live, 1);
	CHECK(e->prefix.n_entries == 4, "4 full blocks registered while running (%d)", e->prefix.n_entries);
	engine_seq_release(e, &s);
	CHECK(e->pool.n_lru == 4 && e->pool.n_free == e->pool.n_blocks - 4, "released: 4 cached, rest free");
	kvt_check_invariants(e, NULL, 0);

	/* hit: 32 from cache, 5 computed, same logits */
	start_and_check(e, cold, &s, a, 37, 1, 32, "hit");
	kvt_check_invariants(e, live, 1);
	engine_seq_release(e, &s);

	/* partial: b shares 20 tokens with a: blocks 0-1 (16 tokens) are whole and shared,
	 * block 2 holds the difference and is computed */
	start_and_check(e, cold, &s, b, 37, 1, 16, "partial block");
	kvt_check_invariants(e, live, 1);
	engine_seq_release(e, &s);

	/* longer prompt: the cached 4 blocks, then a's tokens 37..50 computed */
	start_and_check(e, cold, &s, a, 51, 1, 32, "longer prompt");
	engine_seq_release(e, &s);

	/* whole prompt cached (32 = 4 blocks): the last block is recomputed so that one
	 * token runs, into a block of its own */
	start_and_check(e, cold, &s, a, 32, 1, 24, "fully cached prompt");
	CHECK(e->pool.refs[s.blocks[3]] == 1, "the recomputed block is private");
	engine_seq_release(e, &s);
	start_and_check(e, cold, &s, a, 1, 1, 0, "one-token prompt");
	engine_seq_release(e, &s);

	/* salts: the same prompt under another salt shares nothing */
	start_and_check(e, cold, &s, a, 37, 2, 0, "other salt");
	engine_seq_release(e, &s);
	start_and_check(e, cold, &s, a, 37, 2, 32, "other salt, second time");
	engine_seq_release(e, &s);

	/* a running sequence's full blocks serve a second one at once */
	start_and_check(e, cold, &s, b, 60, 3, 0, "running, first");
	start_and_check(e, cold, &t, b, 45, 3, 40, "running, second");
	live[1] = &t;
	kvt_check_invariants(e, live, 2);
	CHECK(e->pool.refs[s.blocks[0]] == 2 && s.blocks[4] == t.blocks[4] && s.blocks[5] != t.blocks[5],
	      "5 blocks shared, the sixth (t's partial) private");
	/* both decode on: the shared blocks are never written */
	for (int i = 0; i < 6; i++) {
		int32_t x = (int32_t)i;

		kvt_step(e, &s, &x, 1, l);
		kvt_step(e, &t, &x, 1, l);
	}
	kvt_check_invariants(e, live, 2);
	engine_seq_release(e, &t);
	engine_seq_release(e, &s);

	/* eviction: 40 blocks; fill with other prompts until a's blocks (released long
	 * ago) are evicted; the blocks of the most recent prompt stay */
	engine_cache_drop(e);
	CHECK(e->pool.n_free == e->pool.n_blocks && e->prefix.n_entries == 0, "drop empties the cache");
	evicted = e->pool.n_evicted;
	start_and_check(e, cold, &s, a, 33, 4, 0, "eviction: a");
	engine_seq_release(e, &s);
	for (unsigned k = 10; k < 19; k++) {
		int32_t c[33];

		fill_prompt(c, 33, k);
		start_and_check(e, cold, &s, c, 33, 4, 0, "eviction: filler");
		engine_seq_release(e, &s);
		kvt_check_invariants(e, NULL, 0);
	}
	CHECK(e->pool.n_evicted - evicted == 1, "the fillers evicted one block (%llu)",
	      (unsigned long long)(e->pool.n_evicted - evicted));
	/* released last block first, a lost its end, not its start */
	start_and_check(e, cold, &s, a, 33, 4, 24, "eviction: a lost its last block");
	engine_seq_release(e, &s);
	{
		int32_t c[33];

		fill_prompt(c, 33, 18);
		start_and_check(e, cold, &s, c, 33, 4, 32, "eviction: the last filler is still cached");
		engine_seq_release(e, &s);
	}
	kvt_check_invariants(e, NULL, 0);

	/* a prompt the cache cannot hold at all */
	engine_seq_init(&s);
	CHECK(engine_seq_start(e, &s, a, 0, 1, NULL) == -EINVAL, "empty prompt refused");
	a[3] = vocab;
	CHECK(engine_seq_start(e, &s, a, 10, 1, NULL) == -EINVAL, "token outside the vocabulary refused");
	CHECK(s.n_blocks == 0 && s.n_tokens == 0, "refused start leaves the sequence empty");
	engine_seq_release(e, &s);
	kvt_check_invariants(e, NULL, 0);
	free(l);
out:
	kvt_close(m, e);
	kvt_close(cm, cold);
	return test_result("test_prefix_cache");
}
