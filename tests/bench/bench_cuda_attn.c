/* Attention benchmark on the GPU: the decode attention of Llama-3.1-8B, Qwen3 and
 * DeepSeek-V2-Lite layers (GQA and MLA, CUDA-core and tensor-core kernels, each knob's
 * variant), the fused inputs beside the launches they replace (qkv_post, qkv_post in
 * the attention, mla_post in MLA's absorb) and the split merge, each beside the HBM
 * floor of the bytes it must read. Cold figures replay a graph behind a 256 MB memset
 * (the step's other weights pass through L2 between two layers); warm ones repeat the
 * call. The checks of the same kernels: test_cuda_attn_*, test_cuda_merge.
 * GQA prefill (Llama-3.1-8B's heads, chunks over long contexts): the tensor-core prefill
 * kernel beside the tiled CUDA-core one, in TFLOPS beside the tensor-core floor.
 * Usage: bench_cuda_attn [prefill] (prefill: that table only). Exits 77 without CUDA or
 * a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "tests/cudatest.h"
#include "tests/attntest.h"
#include "tests/attnfold.h"
#include "tests/bench/cudabench.h"

static const struct gqa_shape llama = { 32, 8, 128 }, qwen3 = { 64, 4, 128 };
static const struct k_mla_dims v2lite = { 16, 128, 64, 128, 512 };

/* ---- GQA decode ------------------------------------------------------------- */

static int gqa_call_default(void *g)
{
	return gqa_call(g, 0);
}

/* Warm: one call repeated, the K/V read once per sequence. */
static void gqa_warm(struct gqa_shape sh, int batch, int ctx)
{
	struct gqa_run g;
	char label[160];
	double us, gb;

	if (gqa_setup(&g, sh, 16, rows_decode(batch, ctx, 0, ctx), 0, 0)) {
		CHECK(0, "gqa setup");
		gqa_teardown(&g);
		return;
	}
	us = bench_time_us(gqa_call_default, &g);
	gb = rows_kv_bytes(g.r, 4.0 * sh.kv * sh.hd) / (us * 1e3);
	gqa_label(label, sizeof(label), &g, "warm");
	printf("%s%-72s time %.1f us, %.0f GB/s of K/V read (floor %.0f)\n", attn_path, label, us,
	       gb, BENCH_HBM_BYTES_PER_S / 1e9);
	gqa_teardown(&g);
}

/* The tensor-core kernel as a graph, cold, with its merge launch: by default and on the
 * earlier path (attn_mma_early 0, attn_mma_qreg 0), beside the floor of the K/V bytes;
 * at batch > 1, each split count the workspace holds (4 at its max rows). */
static void gqa_cold(struct gqa_shape sh, int batch, int ctx, void *flush)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	double floor_us, launch, both;
	struct gqa_run g;
	char label[160];

	if (gqa_setup(&g, sh, 16, rows_decode(batch, ctx, 0, ctx), 0, 0)) {
		CHECK(0, "gqa timing setup");
		gqa_teardown(&g);
		return;
	}
	floor_us = bench_floor_us(rows_kv_bytes(g.r, 4.0 * sh.kv * sh.hd));
	launch = bench_graph_us(gqa_call, &g, flush);
	t.attn_mma_early = 0;
	t.attn_mma_qreg = 0;
	k_cuda_tuning_set(&t);
	both = bench_graph_us(gqa_call, &g, flush);
	k_cuda_tuning_set(&was);
	gqa_label(label, sizeof(label), &g, "graph");
	printf("%s%-72s default %.1f us, attn_mma_early 0 attn_mma_qreg 0 %.1f us; floor "
	       "%.1f us (%.0f%% / %.0f%% of it)\n", attn_path, label, launch, both, floor_us,
	       100 * floor_us / launch, 100 * floor_us / both);
	for (int n = 1; batch > 1 && n <= 4; n++) {
		t = was;
		t.attn_dec_splits = n;
		k_cuda_tuning_set(&t);
		launch = bench_graph_us(gqa_call, &g, flush);
		t.attn_mma_qreg = 0;
		k_cuda_tuning_set(&t);
		both = bench_graph_us(gqa_call, &g, flush);
		k_cuda_tuning_set(&was);
		printf("%s%-72s attn_dec_splits %d: default %.1f us, attn_mma_qreg 0 %.1f us\n",
		       attn_path, label, n, launch, both);
	}
	gqa_teardown(&g);
}

static void bench_gqa(void *flush)
{
	static const int batches[] = { 1, 8, 64 };

	for (int mma = 0; mma < 2; mma++) {
		attn_pass(mma);
		for (int b = 0; b < 3; b++)
			for (int ctx = 1024; ctx <= 4096; ctx *= 4) {
				gqa_warm(llama, batches[b], ctx);
				gqa_warm(qwen3, batches[b], ctx);
			}
	}
	attn_pass(1);
	gqa_cold(llama, 1, 1024, flush);
	gqa_cold(llama, 64, 1024, flush);
}

/* ---- GQA prefill -------------------------------------------------------------- */

/* The floor of a prefill call: its FLOPs at the H200's dense bf16 tensor-core rate as
 * NVIDIA's H200 SXM datasheet gives it (989 TFLOPS; without sparsity). mma.sync, which
 * the kernels use, reaches less of it than Hopper's wgmma. */
#define BENCH_BF16_FLOPS 989e12

/* Causal attention FLOPs of the rows: 2 hd for q.k and 2 hd for p v per visible token
 * and q head. */
static double gqa_rows_flops(const struct rows *r, struct gqa_shape sh)
{
	double f = 0;

	for (int i = 0; i < r->n_rows; i++)
		f += (double)r->ctx[i] * 4.0 * sh.h * sh.hd;
	return f;
}

/* One call of run new rows of one sequence ending at ctx, warm (median of
 * BENCH_WARM_RUNS): the tensor-core prefill kernel (and with attn_prefill_pair 0) beside
 * the tiled CUDA-core one (attn_prefill_mma 0), achieved TFLOPS and the floor. */
static void gqa_prefill_time(struct gqa_shape sh, int run, int ctx)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	int pos = ctx - run;
	struct gqa_run g;
	double flops, t_new, t_unpaired, t_old;

	if (gqa_setup(&g, sh, 16, rows_prefill(1, &run, &pos, ctx), 1, 0)) {
		CHECK(0, "gqa prefill setup");
		gqa_teardown(&g);
		return;
	}
	flops = gqa_rows_flops(g.r, sh);
	t_new = bench_time_us(gqa_call_default, &g);
	t.attn_prefill_pair = 0;
	k_cuda_tuning_set(&t);
	t_unpaired = bench_time_us(gqa_call_default, &g);
	t.attn_prefill_mma = 0;
	k_cuda_tuning_set(&t);
	t_old = bench_time_us(gqa_call_default, &g);
	k_cuda_tuning_set(&was);
	printf("gqa prefill h%d/kv%d/d%d rows %4d ctx %5d..%5d: tensor cores %8.1f us %5.1f TFLOPS"
	       " (unpaired %8.1f us) | tiled fp32 %8.1f us %5.1f TFLOPS | %4.1fx; floor %6.1f us (%.0f%%)\n",
	       sh.h, sh.kv, sh.hd, run, pos + 1, ctx, t_new, flops / t_new * 1e-6, t_unpaired, t_old,
	       flops / t_old * 1e-6, t_old / t_new, flops / BENCH_BF16_FLOPS * 1e6,
	       100.0 * flops / BENCH_BF16_FLOPS * 1e6 / t_new);
	gqa_teardown(&g);
}

/* Llama-3.1-8B's head shape: chunks of 256 and 1024 new tokens at the end of 1k..32k
 * contexts, and whole 1k and 4k prompts in one call. */
static void bench_gqa_prefill(void)
{
	static const int ctxs[] = { 1024, 4096, 16384, 32768 };

	attn_pass(1);
	printf("gqa prefill: warm, median of %d calls; floor: causal FLOPs at %.0f TFLOPS "
	       "(H200 datasheet, dense bf16)\n", BENCH_WARM_RUNS, BENCH_BF16_FLOPS / 1e12);
	for (int run = 256; run <= 1024; run *= 4)
		for (size_t i = 0; i < sizeof(ctxs) / sizeof(ctxs[0]); i++)
			gqa_prefill_time(llama, run, ctxs[i]);
	gqa_prefill_time(llama, 1024, 1024);
	gqa_prefill_time(llama, 2048, 2048);
	gqa_prefill_time(llama, 4096, 4096);
}

/* ---- the fused inputs -------------------------------------------------------- */

/* qkv_post's early-load kernel against qkv_post_early 0, graph, cold. */
static void qkv_post_cold(int rows, int H, int KV, int D, int qk_norm, void *flush)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning late = was;
	struct qkv_run q;
	double t_new, t_old;

	if (qkv_setup(&q, rows, H, KV, D, D, qk_norm, 0)) {
		CHECK(0, "qkv_post timing setup");
		qkv_teardown(&q);
		return;
	}
	t_new = bench_graph_us(qkv_call, &q, flush);
	late.qkv_post_early = 0;
	k_cuda_tuning_set(&late);
	t_old = bench_graph_us(qkv_call, &q, flush);
	k_cuda_tuning_set(&was);
	printf("qkv_post graph rows %d H %d KV %d D %d%s: early %.1f us, qkv_post_early 0 %.1f us; "
	       "floor %.1f us\n", rows, H, KV, D, qk_norm ? " qknorm" : "", t_new, t_old,
	       bench_floor_us(4.0 * rows * (H + 2 * KV) * D + 4.0 * rows * H * D +
			      2.0 * 2 * rows * KV * D));
	qkv_teardown(&q);
}

/* qkv_post folded into the decode attention (qkv_in_attn 1) against its launch then the
 * attention (0), graph, cold, beside the K/V floor. */
static void qkv_fold_cold(struct gqa_shape sh, int qk_norm, int batch, const char *name,
			  void *flush)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	struct qkv_fold f;
	double t_fold, t_sep;
	int lo, hi;

	if (qkv_fold_setup(&f, sh, sh.hd, qk_norm, 0, 16, rows_decode(batch, 1024, 0, 1024))) {
		qkv_fold_teardown(&f);
		return;
	}
	t.qkv_in_attn = 1;
	k_cuda_tuning_set(&t);
	t_fold = bench_graph_us(qkv_fold_call, &f, flush);
	t.qkv_in_attn = 0;
	k_cuda_tuning_set(&t);
	t_sep = bench_graph_us(qkv_fold_call, &f, flush);
	k_cuda_tuning_set(&was);
	rows_ctx_range(f.r, &lo, &hi);
	printf("%sqkv fold %s graph rows %d ctx %d..%d: qkv_post + attention (qkv_in_attn 0) "
	       "%.1f us, folded %.1f us (%.1f us saved); KV floor %.1f us\n", attn_path, name,
	       batch, lo, hi, t_sep, t_fold, t_sep - t_fold,
	       bench_floor_us(rows_kv_bytes(f.r, 4.0 * sh.kv * sh.hd)));
	qkv_fold_teardown(&f);
}

static void bench_fused_inputs(void *flush)
{
	qkv_post_cold(64, 32, 8, 128, 0, flush);	/* Llama-3.1-8B batch 64 */
	qkv_post_cold(1, 32, 8, 128, 0, flush);		/* batch 1 */
	qkv_post_cold(64, 32, 8, 128, 1, flush);	/* Qwen3: q/k RMSNorm */
	attn_pass(1);
	qkv_fold_cold(llama, 0, 1, "llama", flush);
	qkv_fold_cold(llama, 0, 64, "llama", flush);
	qkv_fold_cold(qwen3, 1, 1, "qwen3", flush);
	qkv_fold_cold(qwen3, 1, 64, "qwen3", flush);
}

/* ---- MLA decode ------------------------------------------------------------- */

static int mla_call_default(void *m)
{
	return mla_call(m, 0);
}

/* Warm: one call repeated, the latent read once per sequence. */
static void mla_warm(int batch, int ctx, int max_ctx)
{
	struct mla_run m;
	char label[160];
	double us, gb;

	if (mla_setup(&m, v2lite, 64, rows_decode(batch, ctx, 0, max_ctx), 0, 0)) {
		CHECK(0, "mla setup");
		mla_teardown(&m);
		return;
	}
	us = bench_time_us(mla_call_default, &m);
	gb = rows_kv_bytes(m.r, 2.0 * (v2lite.kv_lora + v2lite.rope_dim)) / (us * 1e3);
	mla_label(label, sizeof(label), &m, "warm");
	printf("%s%-72s time %.1f us, %.0f GB/s of latent read (floor %.0f)\n", attn_path, label, us,
	       gb, BENCH_HBM_BYTES_PER_S / 1e9);
	mla_teardown(&m);
}

/* Each MLA knob configuration (mla_ab_cfgs) cold: absorb, attention, merge and expand
 * together, median of 25 calls each behind a 256 MB memset that leaves neither the
 * latent cache nor w_kv_b in L2 (ncu or nsys for the kernels one by one). */
static void mla_ab_cold(int batch, int ctx, int spread, int max_ctx, void *flush)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct mla_run m;
	double floor_us;

	if (mla_setup(&m, v2lite, 64, rows_decode(batch, ctx, spread, max_ctx), 0, 0)) {
		CHECK(0, "mla a/b setup");
		mla_teardown(&m);
		return;
	}
	floor_us = bench_floor_us(rows_kv_bytes(m.r, 2.0 * (v2lite.kv_lora + v2lite.rope_dim)) +
				  2.0 * v2lite.n_heads * (v2lite.nope_dim + v2lite.v_dim) *
				  v2lite.kv_lora);
	for (size_t c = 0; c < MLA_AB_N; c++) {
		struct k_cuda_tuning t = mla_ab_tuning(&was, &mla_ab_cfgs[c]);

		k_cuda_tuning_set(&t);
		printf("mla a/b batch %d ctx %d%s max %d %-42s cold %.1f us (floor %.1f us)\n",
		       batch, ctx, spread ? " (spread)" : "", max_ctx, mla_ab_cfgs[c].name,
		       bench_runs_us(mla_call_default, &m, 25, flush, BENCH_FLUSH_BYTES), floor_us);
	}
	k_cuda_tuning_set(&was);
	mla_teardown(&m);
}

/* mla_post in the absorb launch against mla_post then the attention, graph, cold,
 * beside the floor of w_kv_b and the latent. */
static void mla_post_fold_cold(int batch, int fused, void *flush)
{
	struct mla_fold f;
	char label[200];
	double old_us, new_us, bytes;

	if (mla_fold_setup(&f, v2lite, rows_decode(batch, 1024, 0, 1024), 64, 0, fused)) {
		mla_fold_teardown(&f);
		return;
	}
	old_us = bench_graph_us(mla_fold_old, &f, flush);
	new_us = bench_graph_us(mla_fold_new, &f, flush);
	bytes = rows_kv_bytes(f.m.r, 2.0 * (v2lite.kv_lora + v2lite.rope_dim)) +
		2.0 * v2lite.n_heads * (v2lite.nope_dim + v2lite.v_dim) * v2lite.kv_lora;
	mla_label(label, sizeof(label), &f.m, fused ? "[post in absorb, fused q]" :
		  "[post in absorb, q in place]");
	printf("mla post-in-absorb time batch %d %s: mla_post + attn_mla %.1f us, attn_mla_post "
	       "%.1f us (%+.1f); HBM floor %.1f us (w_kv_b + latent), graph, cold L2, median of "
	       "%d\n", batch, label, old_us, new_us, new_us - old_us, bench_floor_us(bytes),
	       BENCH_GRAPH_RUNS);
	mla_fold_teardown(&f);
}

static void bench_mla(void *flush)
{
	for (int mma = 0; mma < 2; mma++) {
		attn_pass(mma);
		mla_warm(1, 1024, 1024);
		mla_warm(1, 4096, 32768);
		mla_warm(8, 1024, 1024);
		mla_warm(64, 1024, 1024);
	}
	attn_pass(1);
	mla_ab_cold(1, 1024, 0, 1024, flush);
	mla_ab_cold(1, 1024, 0, 32768, flush);	/* a graph's splits: 128 */
	mla_ab_cold(1, 3000, 0, 32768, flush);	/* past the default floor's edge */
	mla_ab_cold(1, 32768, 0, 32768, flush);
	mla_ab_cold(64, 1024, 0, 1024, flush);
	mla_ab_cold(64, 1024, 1, 4096, flush);
	for (int b = 1; b <= 64; b *= 8) {
		mla_post_fold_cold(b, 1, flush);
		mla_post_fold_cold(b, 0, flush);
	}
}

/* ---- the split merge -------------------------------------------------------- */

struct merge_bench {
	int n_splits, n_rows, n_heads, dim;
	float *d_o, *d_lse, *d_out;	/* partials, their log-sum-exps (all live), out */
	uint16_t *d_bf16;		/* out in bf16 */
	struct k_cuda_attn_ws *ws;
};

static int merge_bench_call(void *p)
{
	struct merge_bench *m = p;

	return k_cuda_attn_merge(0, m->ws, m->d_o, m->d_lse, m->n_splits, m->n_rows, m->n_heads,
				 m->dim, m->d_out, (long)m->n_heads * m->dim, m->dim, m->d_bf16);
}

/* The batched merge kernel against the block one, warm, beside the floor of the
 * partials' bytes. */
static void merge_warm(int n_splits, int n_rows, int n_heads, int dim)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	struct merge_bench m = { .n_splits = n_splits, .n_rows = n_rows, .n_heads = n_heads,
				 .dim = dim };
	size_t rh = (size_t)n_rows * n_heads, no = (size_t)n_splits * rh * dim;
	float *o = test_rand_floats(no, 1.0f, &attn_seed);
	float *lse = test_rand_floats((size_t)n_splits * rh, 8.0f, &attn_seed);
	double us_block, us_batched;

	m.d_o = dup_to_device(o, sizeof(float) * no);
	m.d_lse = dup_to_device(lse, sizeof(float) * n_splits * rh);
	m.d_out = dalloc(sizeof(float) * rh * dim);
	m.d_bf16 = dalloc(sizeof(uint16_t) * rh * dim);
	if (!m.d_o || !m.d_lse || !m.d_out || !m.d_bf16 ||
	    k_cuda_attn_ws_create(&m.ws, 1, 1, 1, 0)) {
		CHECK(0, "merge setup");
		goto out;
	}
	us_block = bench_time_us(merge_bench_call, &m);
	t.attn_merge_batched = 1;
	k_cuda_tuning_set(&t);
	us_batched = bench_time_us(merge_bench_call, &m);
	k_cuda_tuning_set(&was);
	printf("merge splits %d rows %d heads %d dim %d: batched %.2f us, block kernel %.2f us; "
	       "floor %.2f us\n", n_splits, n_rows, n_heads, dim, us_batched, us_block,
	       bench_floor_us(4.0 * (no + (size_t)n_splits * rh + rh * dim) + 2.0 * rh * dim));
out:
	k_cuda_attn_ws_destroy(m.ws);
	cudaFree(m.d_o);
	cudaFree(m.d_lse);
	cudaFree(m.d_out);
	cudaFree(m.d_bf16);
	free(o);
	free(lse);
}

/* The split counts the attention calls use: batch 1 as a Llama-3.1-8B graph sizes it
 * (50 splits), 128 splits (MLA's batch 1), batch 64 (3 splits). */
static void bench_merge(void)
{
	merge_warm(50, 1, 32, 128);
	merge_warm(128, 1, 16, 512);
	merge_warm(3, 64, 32, 128);
	merge_warm(5, 64, 16, 512);
}

int main(int argc, char **argv)
{
	const int prefill_only = argc > 1 && !strcmp(argv[1], "prefill");
	void *flush;

	if (argc > 2 || (argc == 2 && !prefill_only)) {
		fprintf(stderr, "usage: bench_cuda_attn [prefill]\n");
		return 2;
	}
	if (bench_begin("bench_cuda_attn"))
		return 77;
	attn_seed = 0x5eedull;
	bench_gqa_prefill();
	if (prefill_only) {
		k_cuda_tuning_set(NULL);
		return test_failures ? 1 : 0;
	}
	if (!(flush = bench_flush_buffer()))
		return 1;
	bench_gqa(flush);
	bench_fused_inputs(flush);
	bench_mla(flush);
	bench_merge();
	k_cuda_tuning_set(NULL);
	cudaFree(flush);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_attn: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
