/* The GPU MLA attention against the CPU reference (k_cpu_attn_mla) on fresh random
 * inputs: shuffled block tables, a bf16 latent cache whose exact values the reference
 * also gets, decode and prefill rows, outputs poisoned with NaN first, a captured graph
 * replayed with new ctx and block tables. The CUDA-core kernels first, then the
 * tensor-core ones under each of their knobs (key-dim split, split floors, the
 * carveout), the knobs side by side on DeepSeek-V2-Lite's
 * layer, and mla_post's work in the absorb launch against the two launches it
 * replaces, bit for bit. One line per case. Skips (77) without CUDA or a GPU.
 * KD_TEST_QUICK=1: only the small cases (for compute-sanitizer); KD_TEST_QUICK=2 (race):
 * under each knob variant a few cases that reach the code the knob changes (batch 1 as
 * a graph sizes it, odd head counts, 64 rows, an odd shape, a graph), not the
 * whole list: racecheck tracks every shared-memory access, and the quick list alone
 * took over 380 s under it. KD_TEST_SEED=n: repeat a run. Timings: tests/bench/bench_cuda_attn. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "tests/cudatest.h"
#include "tests/attntest.h"
#include "tests/attnfold.h"

static int quick;	/* KD_TEST_QUICK */
static int race;	/* KD_TEST_QUICK=2 */
static int in_variant;	/* test_mla under a knob variant (mla_variant) */

/* ---- MLA ------------------------------------------------------------------ */

static void mla_case(struct k_mla_dims d, int bt, struct rows *r, int hint)
{
	struct mla_run m;
	size_t n = (size_t)r->n_rows * d.n_heads * d.v_dim;
	int ret;

	if (mla_setup(&m, d, bt, r, hint, 0)) {
		CHECK(0, "mla setup h%d lora%d", d.n_heads, d.kv_lora);
		mla_teardown(&m);
		return;
	}
	poison(m.d_out, sizeof(float) * n);
	ret = mla_call(&m, 0);
	CHECK(ret == 0, "k_cuda_attn_mla: %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize()))
		mla_check(&m, "");
	mla_teardown(&m);
}

/* One captured launch replayed with new ctx and new block tables. */
static void mla_graph_case(struct k_mla_dims d, int bt, int n_rows, int max_ctx)
{
	struct rows *r = rows_decode(n_rows, max_ctx / 8, 1, max_ctx);
	struct mla_run m;
	int ret = -1;

	if (!mla_setup(&m, d, bt, r, 0, max_ctx))
		ret = attn_graph_replays(r, mla_call, mla_check, &m, m.d_out,
					 (size_t)n_rows * d.n_heads * d.v_dim);
	CHECK(ret == 0, "mla graph case: %d", ret);
	mla_teardown(&m);
}

/* The MLA knobs side by side on one set of inputs (mla_ab_cfgs): each checked against
 * the reference, output poisoned first. */
static void mla_ab_case(struct k_mla_dims d, int n_rows, int ctx, int spread, int max_ctx)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	size_t n = (size_t)n_rows * d.n_heads * d.v_dim;
	struct rows *r = rows_decode(n_rows, ctx, spread, max_ctx);
	struct mla_run m;
	char label[200];

	if (mla_setup(&m, d, 64, r, 0, 0)) {
		CHECK(0, "mla a/b setup");
		mla_teardown(&m);
		return;
	}
	for (size_t c = 0; c < MLA_AB_N; c++) {
		struct k_cuda_tuning t = mla_ab_tuning(&was, &mla_ab_cfgs[c]);
		int ret;

		k_cuda_tuning_set(&t);
		snprintf(label, sizeof(label), "[a/b %s]", mla_ab_cfgs[c].name);
		poison(m.d_out, sizeof(float) * n);
		ret = mla_call(&m, 0);
		CHECK(ret == 0, "%s k_cuda_attn_mla: %d", label, ret);
		if (ret == 0 && CU(cudaDeviceSynchronize()))
			mla_check(&m, label);
	}
	k_cuda_tuning_set(&was);
	mla_teardown(&m);
}

/* ---- MLA: mla_post's work in the absorb launch ----------------------------- */

/* Values of a and b (n of size sz) that differ. */
static size_t count_differ(const void *a, const void *b, size_t n, size_t sz)
{
	size_t bad = 0;

	for (size_t i = 0; i < n; i++)
		bad += memcmp((const char *)a + i * sz, (const char *)b + i * sz, sz) != 0;
	return bad;
}

/* The new path's out against the CPU reference over the old path's q (q1) and cache
 * (c1): k_cuda_mla_post itself is checked against the CPU in test_cuda_ops. */
static void mla_fold_reference(struct mla_fold *f, const float *q1, const uint16_t *c1,
			       const char *what)
{
	const size_t nq = (size_t)f->m.r->n_rows * f->m.d.n_heads *
			  (f->m.d.nope_dim + f->m.d.rope_dim);
	float *keep = f->m.d_out;

	memcpy(f->m.q, q1, sizeof(float) * nq);
	for (size_t i = 0; i < f->m.c.n; i++)
		f->m.c.f[i] = k_bf16_to_f32(c1[i]);
	f->m.d_out = f->d_out2;
	mla_check(&f->m, what);
	f->m.d_out = keep;
}

/* k_cuda_attn_mla_post against k_cuda_mla_post then k_cuda_attn_mla on the same inputs
 * (mla_fold_setup): out and every cache value equal bit for bit (the fold does
 * mla_post's rounded operations in its order), and out against the CPU reference.
 * Outputs poisoned with NaN first. The new path's attention must copy the row each
 * row appends after its PDL wait. */
static void mla_fold_case(struct k_mla_dims d, struct rows *r, int rot_dim, int interleaved,
			  int fused)
{
	const size_t no = (size_t)r->n_rows * d.n_heads * d.v_dim;
	const size_t nq = (size_t)r->n_rows * d.n_heads * (d.nope_dim + d.rope_dim);
	struct mla_fold f;
	float *o1 = NULL, *o2 = NULL, *q1 = NULL;
	uint16_t *c1 = NULL, *c2 = NULL;
	char label[200], what[64];
	int ret;

	snprintf(what, sizeof(what), "[post in absorb, rope %d%s, %s]", rot_dim,
		 interleaved ? " interleaved" : "", fused ? "fused q" : "q in place");
	if (mla_fold_setup(&f, d, r, rot_dim, interleaved, fused)) {
		mla_fold_teardown(&f);
		return;
	}
	poison(f.m.d_out, sizeof(float) * no);
	poison(f.d_out2, sizeof(float) * no);
	ret = mla_fold_old(&f, 0);
	CHECK(ret == 0, "%s old path: %d", what, ret);
	ret = ret ? ret : mla_fold_new(&f, 0);
	CHECK(ret == 0, "%s k_cuda_attn_mla_post: %d", what, ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		size_t bo, bc;

		o1 = download(f.m.d_out, no);
		o2 = download(f.d_out2, no);
		c1 = download_bytes(f.m.c.d, sizeof(uint16_t) * f.m.c.n);
		c2 = download_bytes(f.d_cache2, sizeof(uint16_t) * f.m.c.n);
		q1 = download(f.m.d_q, nq);
		bo = count_differ(o1, o2, no, sizeof(float));
		bc = count_differ(c1, c2, f.m.c.n, sizeof(uint16_t));
		mla_label(label, sizeof(label), &f.m, what);
		fprintf(stderr, "%s%-72s out %zu of %zu, cache %zu of %zu values differ from "
			"mla_post + attn_mla  %s\n", attn_path, label, bo, no, bc, f.m.c.n,
			bo || bc ? "FAIL" : "PASS");
		CHECK(!bo && !bc, "%s%s: %zu outputs, %zu cache values differ", attn_path, label,
		      bo, bc);
		mla_fold_reference(&f, q1, c1, what);
	}
	free(o1);
	free(o2);
	free(c1);
	free(c2);
	free(q1);
	mla_fold_teardown(&f);
}

/* ---- cases ---------------------------------------------------------------- */

/* DeepSeek-V2-Lite's layer (and odd dims: a vec-less absorb, the tiled attention, a
 * partial rope) at batch 1, 3, 8 (folded) and 64 (past the fold: the two launches). */
static void test_mla_post_fold(void)
{
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		odd = { 5, 12, 6, 10, 37 };
	static const int runs[2] = { 3, 2 }, pos0[2] = { 500, 40 };

	mla_fold_case(lite, rows_decode(1, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(1, 1000, 0, 32768), 64, 1, 1);
	mla_fold_case(lite, rows_decode(1, 1, 0, 4096), 64, 0, 0);	/* the only token */
	mla_fold_case(lite, rows_decode(3, 1024, 1, 4096), 64, 0, 1);
	mla_fold_case(lite, rows_decode(8, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(8, 777, 1, 4096), 64, 1, 0);
	mla_fold_case(lite, rows_prefill(2, runs, pos0, 1024), 64, 0, 1);	/* 5 rows, 2 seqs */
	mla_fold_case(odd, rows_decode(2, 333, 1, 1024), 6, 0, 1);
	mla_fold_case(odd, rows_decode(1, 100, 0, 1024), 4, 1, 0);	/* rope 4 of 6 */
	mla_fold_case(odd, rows_decode(3, 333, 1, 1024), 6, 0, 1);	/* 3 rows: 2 chunks */
	if (quick)
		return;
	mla_fold_case(lite, rows_decode(1, 4096, 0, 32768), 64, 0, 1);
	mla_fold_case(lite, rows_decode(64, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(64, 1024, 1, 4096), 64, 1, 0);
}

static void test_mla(void)
{
	/* clu2, clu4: 2 and 4 expand blocks a head, rows of 14 and 30 float4 columns, the
	 * latent + rope a multiple of 8 (the tensor-core kernel, whose splits are merged) */
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		tiny = { 3, 16, 8, 16, 32 }, odd = { 5, 12, 6, 10, 37 },
		v3 = { 128, 128, 64, 128, 512 }, clu2 = { 4, 16, 12, 32, 36 },
		clu4 = { 3, 16, 4, 64, 100 };
	int run = 64, pos = quick ? 100 : 4000, runs[] = { 20, 1, 9 }, pos3[] = { 50, 7, 0 };

	if (race && in_variant) {
		mla_case(lite, 64, rows_decode(1, 1040, 0, 4096), 0);
		mla_case(lite, 64, rows_decode(64, 40, 1, 64), 0);
		mla_case(odd, 7, rows_decode(7, 200, 1, 1000), 0);
		mla_case(clu2, 16, rows_decode(1, 700, 0, 4096), 0);
		mla_case(clu4, 16, rows_decode(9, 300, 1, 4096), 0);
		mla_graph_case(lite, 64, 1, 256);
		return;
	}
	mla_case(lite, 64, rows_decode(1, 1, 0, 1), 0);
	mla_case(lite, 64, rows_decode(1, quick ? 300 : 1000, 0, 1000), 0);
	/* batch 1 as a graph sizes it: 128 splits of 32 tokens, 33 live (17 of 64 with
	 * mla_split_min 64 alone), the rest empty */
	mla_case(lite, 64, rows_decode(1, 1040, 0, 4096), 0);
	/* past 64 splits' worth the default floor of 64 tokens (47 live at 3000), and rows
	 * on both sides of it in one launch: each row's floor from its own ctx */
	mla_case(lite, 64, rows_decode(1, 3000, 0, 32768), 0);
	mla_case(lite, 16, rows_decode(5, quick ? 2500 : 5000, 1, 32768), 0);
	mla_case(lite, 16, rows_decode(7, quick ? 200 : 1000, 1, 32768), 0);
	mla_case(lite, 64, rows_decode(64, quick ? 40 : 4096, 1, quick ? 64 : 4096), 0);
	mla_case(tiny, 16, rows_decode(1, 17, 0, 17), 0);
	mla_case(tiny, 16, rows_decode(1, 300, 0, 32768), 0);	/* 128 splits, most empty */
	mla_case(tiny, 16, rows_decode(64, 300, 1, 300), 0);
	mla_case(odd, 7, rows_decode(7, quick ? 200 : 1000, 1, 1000), 0);
	mla_case(odd, 16, rows_prefill(3, runs, pos3, 80), 1);
	mla_case(v3, 64, rows_decode(2, quick ? 100 : 1000, 1, 1000), 0);
	mla_case(clu2, 16, rows_decode(1, 700, 0, 4096), 0);
	mla_case(clu4, 16, rows_decode(1, 700, 0, 4096), 0);
	mla_case(clu4, 16, rows_decode(9, quick ? 300 : 3000, 1, 4096), 0);
	mla_case(lite, 64, rows_prefill(1, &run, &pos, pos + run), 1);
	if (!quick) {
		mla_case(lite, 64, rows_decode(1, 32768, 0, 32768), 0);
		mla_case(odd, 16, rows_decode(1, 32768, 0, 32768), 0);
	}
	mla_graph_case(tiny, 16, 5, quick ? 256 : 4096);
	mla_graph_case(lite, 64, 3, quick ? 256 : 4096);
	mla_graph_case(lite, 64, 1, quick ? 256 : 4096);
}

/* DeepSeek-V2-Lite's layer at batch 1 and 64 through each MLA knob (mla_ab_case). */
static void test_mla_ab(void)
{
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		odd = { 5, 12, 6, 10, 37 };

	attn_path = "";
	mla_ab_case(lite, 1, 1024, 0, 1024);
	mla_ab_case(lite, 1, 1024, 0, 32768);	/* a graph's splits: 128 */
	mla_ab_case(lite, 1, 1000, 0, 4096);	/* a short last tile */
	mla_ab_case(odd, 3, 333, 1, 4096);
	if (quick)
		return;
	mla_ab_case(lite, 1, 2048, 0, 32768);	/* the default floor's edge: 64 splits */
	mla_ab_case(lite, 1, 3000, 0, 32768);	/* past it: 47 of 64 tokens, not 94 */
	mla_ab_case(lite, 1, 4096, 0, 32768);
	mla_ab_case(lite, 1, 8192, 0, 32768);
	mla_ab_case(lite, 1, 32768, 0, 32768);
	mla_ab_case(lite, 64, 1024, 0, 1024);
	mla_ab_case(lite, 64, 1024, 1, 4096);
	mla_ab_case(lite, 8, 1024, 0, 1024);
}

/* The tensor-core kernels under one knob setting: t installed, lines tagged path. */
static void mla_variant(const struct k_cuda_tuning *t, const char *path)
{
	k_cuda_tuning_set(t);
	attn_path = path;
	in_variant = 1;
	test_mla();
	in_variant = 0;
}

/* The tensor-core kernels under each of their knobs, from mma (the pass's tuning):
 * the 4-warp kernel (no key-dim split), the split floors; the carveout last (once asked for at a workspace's creation, it stays). */
static void mla_knobs(const struct k_cuda_tuning *mma)
{
	struct k_cuda_tuning t = *mma;

	t.mla_mma_ksplit = 0;
	mla_variant(&t, "[mma ksplit0] ");
	t = *mma;
	t.mla_split_min = 0;
	t.mla_split_live = 0;	/* a floor set alone applies at every split count */
	mla_variant(&t, "[mma split_min0] ");
	t.mla_split_min = 256;
	mla_variant(&t, "[mma split_min256] ");
	/* a floor between the two: min(256, ctx / 4 rounded up to 32) */
	t.mla_split_live = 4;
	mla_variant(&t, "[mma split_min256 live4] ");
	k_cuda_tuning_set(mma);
	test_mla_ab();
	attn_path = "[mma] ";
	test_mla_post_fold();
	t = *mma;
	t.mla_carveout = 1;
	mla_variant(&t, "[mma carveout] ");
	k_cuda_tuning_set(mma);
}

/* The CUDA-core kernels (fp32), then the tensor-core kernels, by default and under
 * each of their knobs. */
int main(void)
{
	struct k_cuda_tuning mma;

	if (!test_gpu_present("test_cuda_attn_mla"))
		return 77;
	quick = test_env_flag("KD_TEST_QUICK");
	race = quick >= 2;
	if (attn_begin("test_cuda_attn_mla", quick))
		return 1;
	attn_pass(0);
	test_mla();
	test_mla_post_fold();
	attn_pass(1);
	test_mla();
	mma = *k_cuda_tuning();
	mla_knobs(&mma);
	return attn_end("test_cuda_attn_mla");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_attn_mla: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
