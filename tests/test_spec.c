/* Speculative decoding pieces: --spec parsing, n-gram proposals (longest, then most
 * recent match), greedy verification, engine_seq_truncate (drafts never reach the
 * prefix cache, only private blocks are dropped, the rolled-back sequence continues
 * bit-identically to a cold run), and a draft/verify loop that reproduces plain
 * greedy decoding on a tiny synthetic model. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/spec_ngram.h"
#include "tests/testutil.h"
#include "tests/kvtest.h"

#define BT 8

static void test_parse(void)
{
	static const char *bad[] = { "", "ngram", "ngram:", "ngram:n=2", "ngram:k=0", "ngram:k=33",
				     "ngram:k=2,", "ngram:k=2,n=0", "ngram:k=2,n=17", "ngram:k=2,k=3",
				     "ngram:k=x", "ngram:k=-1", "ngram:k=2,m=1", "ngram:k=2 ", "lookup:k=2",
				     "ngram:k=+2", "ngram:k=2,,n=2" };
	struct spec_opts o;
	char err[256];

	CHECK(spec_parse("ngram:k=4", &o, err, sizeof(err)) == 0 && o.k == 4 && o.n == SPEC_DEFAULT_N, "k=4");
	CHECK(spec_parse("ngram:k=5,n=2", &o, err, sizeof(err)) == 0 && o.k == 5 && o.n == 2, "k=5,n=2");
	CHECK(spec_parse("ngram:n=1,k=32", &o, err, sizeof(err)) == 0 && o.k == 32 && o.n == 1, "n first");
	CHECK(spec_parse("off", &o, err, sizeof(err)) == 0 && o.k == 0, "off");
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = 0;
		CHECK(spec_parse(bad[i], &o, err, sizeof(err)) == -EINVAL && o.k == 0 && err[0],
		      "'%s' refused", bad[i]);
	}
}

static void test_propose(void)
{
	/* ... 1 2 3 [4 5] ... 9 2 3 [7 8] ... 2 3: n=2 "2 3" matches twice, the newest
	 * (followed by 7 8) wins; with n=3, "1 2 3" is not the suffix, still 7 8 */
	int32_t h[] = { 1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 6, 2, 3 }, out[SPEC_MAX_K];
	int32_t h2[] = { 5, 1, 2, 3, 4, 0, 9, 3, 6, 1, 2, 3 };
	int32_t h3[] = { 1, 2, 3, 4 };
	int n = (int)(sizeof(h) / sizeof(h[0]));

	CHECK(spec_ngram_propose(h, n, 3, 2, out) == 2 && out[0] == 7 && out[1] == 8, "newest match");
	CHECK(spec_ngram_propose(h, n, 3, 8, out) == 8 && out[4] == 3 && out[5] == 7 && out[7] == 6,
	      "past the history's end the match repeats");
	CHECK(spec_ngram_propose(h3, 4, 3, 4, out) == 0, "no match");
	CHECK(spec_ngram_propose(h3, 4, 3, 0, out) == 0, "k = 0");
	h3[3] = 3;	/* 1 2 3 3: "3" matches just before the end, period 1 */
	CHECK(spec_ngram_propose(h3, 4, 3, 3, out) == 3 && out[0] == 3 && out[2] == 3, "period 1");
	/* longest first: "1 2 3" (n=3) at 1..3 beats the newer "3" alone at 7 */
	CHECK(spec_ngram_propose(h2, 12, 3, 2, out) == 2 && out[0] == 4 && out[1] == 0, "longest match");
	CHECK(spec_ngram_propose(h2, 12, 1, 2, out) == 2 && out[0] == 6 && out[1] == 1, "n=1: newest '3'");
	CHECK(spec_ngram_propose(h3, 1, 3, 4, out) == 0 && spec_ngram_propose(h, n, 3, 0, out) == 0, "degenerate");
}

static void test_verify(void)
{
	float l[3 * 4] = { 0, 1, 5, 0,	/* 2 */
			   3, 3, 0, 0,	/* tie: 0 */
			   0, 0, 0, 9 };	/* 3 */
	int32_t d[2], out[3];

	d[0] = 2; d[1] = 0;
	CHECK(spec_verify_greedy(l, 4, d, 2, out) == 3 && out[0] == 2 && out[1] == 0 && out[2] == 3, "all accepted");
	d[1] = 1;
	CHECK(spec_verify_greedy(l, 4, d, 2, out) == 2 && out[0] == 2 && out[1] == 0, "second rejected");
	d[0] = 1;
	CHECK(spec_verify_greedy(l, 4, d, 2, out) == 1 && out[0] == 2, "first rejected");
	CHECK(spec_verify_greedy(l, 4, d, 0, out) == 1 && out[0] == 2, "no drafts");
}

static void test_truncate(struct engine *e, struct engine *cold, int vocab)
{
	struct engine_seq s, *live[1] = { &s };
	int32_t p[32], fed[8];
	float *l = malloc((size_t)8 * vocab * sizeof(float)), *ref = malloc((size_t)vocab * sizeof(float));
	struct engine_req r;
	char err[256];
	int free0, cached;

	for (int i = 0; i < 32; i++)
		p[i] = (i * 37 + 11) % vocab;
	engine_seq_init(&s);
	CHECK(engine_seq_start(e, &s, p, 13, 5, &cached) == 0 && cached == 0, "start");
	kvt_step(e, &s, p, 13, l);
	CHECK(s.n_keyed == 1 && e->prefix.n_entries == 1, "block 0 registered");
	/* 1 real token + 6 drafts: block 1 fills, but with drafts, so stays private */
	memcpy(fed, p + 13, 7 * sizeof(int32_t));
	r = (struct engine_req){ .seq = &s, .tokens = fed, .n_tokens = 7, .all_logits = 1, .n_draft = 7 };
	CHECK(engine_step(e, &r, 1, l, err, sizeof(err)) == -EINVAL, "all drafts refused");
	r.n_draft = 6;
	CHECK(engine_step(e, &r, 1, l, err, sizeof(err)) == 0, "verify step: %s", err);
	CHECK(s.n_tokens == 20 && s.n_blocks == 3 && s.n_keyed == 1 && e->prefix.n_entries == 1,
	      "draft-filled block not registered (keyed %d, entries %d)", s.n_keyed, e->prefix.n_entries);
	kvt_check_invariants(e, live, 1);
	CHECK(engine_seq_truncate(e, &s, 21) == -EINVAL, "past the end refused");
	CHECK(engine_seq_truncate(e, &s, 7) == -EINVAL, "into a registered block refused");
	kv_pool_ref(&e->pool, s.blocks[2]);
	CHECK(engine_seq_truncate(e, &s, 15) == -EBUSY && s.n_tokens == 20 && s.n_blocks == 3,
	      "shared block not dropped, sequence unchanged");
	kv_pool_unref(&e->pool, s.blocks[2]);
	free0 = e->pool.n_free;
	CHECK(engine_seq_truncate(e, &s, 15) == 0, "accept 1 of 6");
	CHECK(s.n_tokens == 15 && s.n_blocks == 2 && e->pool.n_free == free0 + 1 && e->prefix.n_entries == 1,
	      "third block freed, nothing registered");
	kvt_check_invariants(e, live, 1);
	/* the model's token replaces draft 2; the sequence goes on as if never drafted */
	fed[0] = (p[15] + 1) % vocab;
	kvt_step(e, &s, fed, 1, l);
	CHECK(s.n_keyed == 2 && e->prefix.n_entries == 2, "block 1 registered once confirmed");
	memcpy(p + 15, fed, sizeof(int32_t));
	if (!kvt_cold(cold, p, 16, ref))
		CHECK(test_same_floats(l, ref, (size_t)vocab), "logits after rollback differ from a cold run");
	/* truncating to the end confirms everything: the full blocks get registered */
	CHECK(engine_seq_truncate(e, &s, 16) == 0 && s.n_keyed == 2, "no-op truncate");
	engine_seq_release(e, &s);
	kvt_check_invariants(e, NULL, 0);
	free(l);
	free(ref);
}

/* Plain greedy vs draft-and-verify on the same prompt: identical ids. */
static void test_loop(struct engine *e, int vocab)
{
	enum { N_GEN = 48, K = 4 };
	int32_t hist[64 + N_GEN + K], plain[N_GEN], drafts[K + 1], fed[K + 1], got[K + 1];
	float *l = malloc((size_t)(K + 1) * vocab * sizeof(float));
	int n = 24, out = 0, steps = 0, accepted = 0;
	struct engine_seq s;
	char err[256];

	for (int i = 0; i < n; i++)
		hist[i] = (i % 6) * 5 + 1;	/* a repeating prompt */
	engine_seq_init(&s);
	kvt_step(e, &s, hist, n, l);
	kvt_greedy(e, &s, l, N_GEN, plain);
	engine_seq_release(e, &s);

	engine_seq_init(&s);
	kvt_step(e, &s, hist, n, l);
	hist[n++] = test_argmax(l, vocab);
	out = 1;
	while (out < N_GEN) {
		int nd = spec_ngram_propose(hist, n, 3, K < N_GEN - out - 1 ? K : N_GEN - out - 1, drafts);
		struct engine_req r = { .seq = &s, .tokens = fed, .n_tokens = nd + 1, .all_logits = 1, .n_draft = nd };
		int m;

		fed[0] = hist[n - 1];
		memcpy(fed + 1, drafts, (size_t)nd * sizeof(int32_t));
		if (engine_step(e, &r, 1, l, err, sizeof(err))) {
			CHECK(0, "verify step: %s", err);
			break;
		}
		m = spec_verify_greedy(l, vocab, drafts, nd, got);
		CHECK(engine_seq_truncate(e, &s, s.n_tokens - (nd - (m - 1))) == 0, "truncate");
		memcpy(hist + n, got, (size_t)m * sizeof(int32_t));
		n += m;
		out += m;
		accepted += m - 1;
		steps++;
	}
	CHECK(out == N_GEN, "%d tokens, want %d", out, N_GEN);
	CHECK(accepted > 0, "the repeating prompt got no draft accepted");
	CHECK(!memcmp(plain, hist + 24, N_GEN * sizeof(int32_t)), "speculative output differs from greedy");
	printf("loop: %d steps for %d tokens, %d drafts accepted\n", steps, N_GEN, accepted);
	engine_seq_release(e, &s);
	free(l);
}

int main(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 40 * BT, .max_rows = 32 };
	struct engine_opts co = { .threads = 1, .block_tokens = 5, .kv_tokens = 512, .max_rows = 32 };
	struct model *m = NULL, *cm = NULL;
	struct engine *e = NULL, *cold = NULL;

	test_parse();
	test_propose();
	test_verify();
	if (kvt_open("llama", 7, &eo, &m, &e) || kvt_open("llama", 7, &co, &cm, &cold))
		goto out;
	test_truncate(e, cold, m->cfg.vocab_size);
	test_loop(e, m->cfg.vocab_size);
out:
	kvt_close(m, e);
	kvt_close(cm, cold);
	return test_result("test_spec");
}
