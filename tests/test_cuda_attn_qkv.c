/* The fused attention inputs on the GPU, each against the launches it replaces, bit for
 * bit: qkv_post's early-load kernel against the one that loads one input after another
 * (q and both caches; test_cuda_ops checks the values against the CPU), and qkv_post's
 * work folded into the GQA decode attention (k_cuda_attn_gqa_qkv) against qkv_post's
 * launch then the attention (out, out_bf16, both caches), at 1..64 rows, Llama,
 * Qwen3 and odd shapes, split counts and copies after the wait. One line per case.
 * Skips (77) without CUDA or a GPU. KD_TEST_QUICK=1: shorter contexts (for
 * compute-sanitizer); KD_TEST_SEED=n: repeat a run. Timings:
 * tests/bench/bench_cuda_attn. */
#include <errno.h>
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
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"
#include "tests/attntest.h"
#include "tests/attnfold.h"

/* The fold keeps qkv_post's arithmetic (q's fp32 values are qkv_post's, the same mma
 * after): out and out_bf16 are compared bit for bit, the differences printed, with a
 * hard bound of rel L2 1e-5 and every value finite. */
#define FOLD_TOL 1e-5

static int quick;	/* KD_TEST_QUICK */

/* ---- qkv_post: the early-load kernel against the one before it ------------------ */

/* k_cuda_qkv_post with qkv_post_early 0 (the kernel that loads one input after another)
 * and by default (every load at once; from 65 rows on, the warp-per-head kernel): the
 * same arithmetic, so q and both caches must agree bit for bit, unwritten cache (slot -1
 * rows, other slots) still poisoned in both. */
static void qkv_case(int rows, int H, int KV, int D, int rope_dim, int qk_norm, int il)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning late = was;
	unsigned char *old = NULL, *got = NULL;
	struct qkv_run q;
	size_t bytes, bad = 0;
	int ret0 = -1, ret1 = -1;

	if (qkv_setup(&q, rows, H, KV, D, rope_dim, qk_norm, il)) {
		CHECK(0, "qkv_post setup rows %d H %d KV %d D %d", rows, H, KV, D);
		goto out;
	}
	late.qkv_post_early = 0;
	k_cuda_tuning_set(&late);
	qkv_poison(&q);
	ret0 = qkv_call(&q, 0);
	if (ret0 == 0 && CU(cudaDeviceSynchronize()))
		old = qkv_result(&q);
	k_cuda_tuning_set(&was);
	qkv_poison(&q);
	ret1 = qkv_call(&q, 0);
	if (ret1 == 0 && CU(cudaDeviceSynchronize()))
		got = qkv_result(&q);
	CHECK(ret0 == 0 && ret1 == 0 && old && got, "qkv_post: %d / %d", ret0, ret1);
	bytes = sizeof(float) * q.nq + 2 * sizeof(uint16_t) * q.ncache;
	for (size_t i = 0; old && got && i < bytes; i++)
		bad += old[i] != got[i];
	fprintf(stderr, "qkv_post early vs old rows %d H %d KV %d D %d rope %d%s%s: "
		"%zu of %zu bytes differ %s\n", rows, H, KV, D, rope_dim, qk_norm ? " qknorm" : "",
		il ? " il" : "", bad, bytes, bad ? "FAIL" : "PASS");
	CHECK(!bad, "qkv_post early vs old: %zu bytes differ", bad);
out:
	qkv_teardown(&q);
	free(old);
	free(got);
}

static void test_qkv_post(void)
{
	qkv_case(64, 32, 8, 128, 128, 0, 0);	/* Llama-3.1-8B batch 64 */
	qkv_case(1, 32, 8, 128, 128, 0, 0);	/* batch 1 */
	qkv_case(64, 32, 8, 128, 128, 1, 0);	/* Qwen3: q/k RMSNorm */
	qkv_case(7, 12, 4, 24, 16, 1, 1);	/* odd, partial interleaved rope */
	qkv_case(5, 6, 2, 200, 64, 1, 0);	/* two values a thread */
	qkv_case(3, 4, 2, 512, 512, 1, 1);	/* the widest head */
	qkv_case(2, 4, 4, 40, 0, 0, 0);		/* no rope */
	/* from 65 rows on, one warp per (head, row): a prefill chunk */
	qkv_case(1024, 32, 8, 128, 128, 0, 0);	/* Llama-3.1-8B, 1,024 prompt tokens */
	qkv_case(300, 32, 8, 128, 128, 1, 0);	/* Qwen3 */
	qkv_case(65, 12, 4, 24, 16, 1, 1);	/* odd, partial interleaved rope */
	qkv_case(97, 6, 2, 200, 64, 1, 0);	/* a ragged last value a lane */
	qkv_case(70, 4, 2, 512, 512, 1, 1);	/* the widest head */
	qkv_case(66, 4, 4, 40, 0, 0, 0);	/* no rope */
}

/* ---- qkv_post folded into the decode attention (k_cuda_attn_gqa_qkv) ----------- */

/* One run of f's call under tuning t, caches and outputs reset first; its bytes
 * (qkv_fold_result), or NULL. *ret: the call's return. */
static unsigned char *qkv_fold_run(struct qkv_fold *f, const struct k_cuda_tuning *t, int *ret)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	unsigned char *h = NULL;

	k_cuda_tuning_set(t);
	qkv_fold_reset(f);
	*ret = qkv_fold_call(f, 0);
	if (*ret == 0 && CU(cudaDeviceSynchronize()))
		h = qkv_fold_result(f);
	k_cuda_tuning_set(&was);
	return h;
}

/* Counts what differs between the reference's bytes and the fold's (qkv_fold_result's
 * layout): fp32 and bf16 outputs, cache values, the new rows' values left poisoned;
 * *rel the fp32 outputs' rel L2 (infinite where one is not finite). */
static void qkv_fold_diff(const struct qkv_fold *f, const unsigned char *ref,
			  const unsigned char *got, size_t *bad_out, size_t *bad_outb,
			  size_t *bad_cache, size_t *left, double *rel)
{
	const size_t bo = sizeof(float) * f->n_out, width = (size_t)f->a.kv_heads * f->a.head_dim;
	const float *ro = (const float *)ref, *go = (const float *)got;
	const uint16_t *rb = (const uint16_t *)(ref + bo), *gb = (const uint16_t *)(got + bo);
	const uint16_t *rk = rb + f->n_out, *gk = gb + f->n_out;
	int finite = 1;

	*bad_out = *bad_outb = *bad_cache = *left = 0;
	for (size_t i = 0; i < f->n_out; i++) {
		*bad_out += memcmp(&ro[i], &go[i], sizeof(float)) != 0;
		*bad_outb += rb[i] != gb[i];
		finite &= isfinite(go[i]) && isfinite(ro[i]) && gb[i] != 0xffff;
	}
	for (size_t i = 0; i < 2 * f->k.n; i++)
		*bad_cache += rk[i] != gk[i];
	for (int i = 0; i < f->r->n_rows; i++)	/* the new rows: none left poisoned */
		for (size_t j = 0; f->slots[i] >= 0 && j < width; j++)
			*left += gk[(size_t)f->slots[i] * width + j] == 0xffff ||
				 gk[f->k.n + (size_t)f->slots[i] * width + j] == 0xffff;
	*rel = finite ? test_rel_l2(go, ro, f->n_out) : INFINITY;
}

/* The rows r through k_cuda_attn_gqa_qkv twice: with qkv_in_attn 0 (qkv_post's launch,
 * then the attention: the reference) and 1 (the attention launch doing qkv_post's work
 * at any split count; by default it does only where the rows take one split). Before
 * each run the caches are reset to the same random contents with the new tokens' rows
 * poisoned (bf16 NaN), and out, out_bf16 poisoned. Both caches must equal the
 * reference's bit for bit (the new rows written, nothing else touched), out within
 * FOLD_TOL and finite, the bit differences of out and out_bf16 printed. */
static void fold_case(struct gqa_shape sh, int rope_dim, int qk_norm, int il, int bt,
		      struct rows *r, const char *name)
{
	struct k_cuda_tuning t = *k_cuda_tuning();
	unsigned char *ref = NULL, *got = NULL;
	struct qkv_fold f;
	size_t bad_out = 0, bad_outb = 0, bad_cache = 0, left = 0;
	int ret0 = -1, ret1 = -1, lo, hi;
	double rel = INFINITY;

	if (qkv_fold_setup(&f, sh, rope_dim, qk_norm, il, bt, r))
		goto out;
	t.qkv_in_attn = 0;
	ref = qkv_fold_run(&f, &t, &ret0);
	t.qkv_in_attn = 1;	/* folded at any split count */
	got = qkv_fold_run(&f, &t, &ret1);
	CHECK(ret0 == 0 && ret1 == 0 && ref && got, "attn_gqa_qkv: %d / %d", ret0, ret1);
	if (ref && got)
		qkv_fold_diff(&f, ref, got, &bad_out, &bad_outb, &bad_cache, &left, &rel);
	rows_ctx_range(r, &lo, &hi);
	fprintf(stderr, "%sqkv fold %s h%d/kv%d/d%d rope %d%s%s bt%d rows %d ctx %d..%d: out rel_l2 "
		"%.2e, %zu fp32 / %zu bf16 values differ (0 expected), cache %zu differ, %zu "
		"unwritten %s\n", attn_path, name, sh.h, sh.kv, sh.hd, rope_dim,
		qk_norm ? " qknorm" : "", il ? " il" : "", bt, r->n_rows, lo, hi, rel, bad_out,
		bad_outb, bad_cache, left, rel <= FOLD_TOL && !bad_cache && !left ? "PASS" : "FAIL");
	CHECK(rel <= FOLD_TOL && !bad_cache && !left,
	      "qkv fold %s rows %d: rel %g, cache %zu differ, %zu unwritten", name, r->n_rows, rel,
	      bad_cache, left);
out:
	qkv_fold_teardown(&f);
	free(ref);
	free(got);
}

/* Llama-3.1-8B (32 q / 8 kv heads, head 128, full rope), Qwen3 (q/k RMSNorm, 64 / 4:
 * a 16-head group), a head_dim 64 shape with partial interleaved rope, and a group of
 * 20 (the fold does not apply: the separate launches, the same results), at batch 1,
 * 3, 64, contexts 1..1024 and ~4000; then 3 splits at batch 64 (merge launch and the
 * merge in the last split) and every copy after the wait. */
static void test_qkv_fold(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, qwen3 = { 64, 4, 128 },
		d64 = { 12, 4, 64 }, d96 = { 8, 2, 96 }, g20 = { 40, 2, 128 };
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	const int big = quick ? 300 : 4000;

	fold_case(llama, 128, 0, 0, 16, rows_decode(1, 1024, 0, 1024), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 0, 1024), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(3, 1024, 1, 1024), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(1, big - 3, 0, big), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, big, 1, big), "llama");
	fold_case(llama, 128, 0, 0, 16, rows_decode(5, 1, 0, 64), "llama ctx1");
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(1, 1024, 0, 1024), "qwen3");
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(64, 1024, 0, 1024), "qwen3");
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(3, big, 1, big), "qwen3");
	fold_case(qwen3, 128, 1, 0, 7, rows_decode(33, 1000, 1, 1000), "qwen3");
	fold_case(d64, 32, 1, 1, 16, rows_decode(3, 700, 1, 700), "d64");
	fold_case(d64, 64, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "d64");
	fold_case(d96, 64, 1, 0, 16, rows_decode(3, 300, 1, 300), "d96");
	fold_case(g20, 128, 1, 0, 16, rows_decode(3, 500, 1, 500), "group20 (no fold)");
	/* 3 splits at batch 64 and their merge launch */
	t.attn_dec_splits = 3;
	k_cuda_tuning_set(&t);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama splits3");
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(64, 1024, 1, 1024), "qwen3 splits3");
	/* every copy after the wait */
	t = was;
	t.attn_mma_early = 0;
	k_cuda_tuning_set(&t);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama early0");
	k_cuda_tuning_set(&was);
}

/* qkv_post alone, then its fold on the tensor-core decode kernel's pass. */
int main(void)
{
	if (!test_gpu_present("test_cuda_attn_qkv"))
		return 77;
	quick = test_env_flag("KD_TEST_QUICK");
	if (attn_begin("test_cuda_attn_qkv", quick))
		return 1;
	test_qkv_post();
	attn_pass(1);
	test_qkv_fold();
	return attn_end("test_cuda_attn_qkv");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_attn_qkv: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
