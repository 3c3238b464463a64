/* The GPU KV-cache write and GQA attention against the CPU references (k_cpu_kv_write,
 * k_cpu_attn_gqa) on fresh random inputs: shuffled block tables, bf16 caches whose exact
 * values the reference also gets (as fp32), decode and prefill rows, outputs poisoned
 * with NaN first, and a captured graph replayed with new ctx and block tables. The
 * CUDA-core kernels first, then the tensor-core decode kernel, whose variants (copies
 * after the wait, q in shared memory, 64-token tiles) must give its
 * default's bits, and the tensor-core prefill kernel (attn_prefill.cu; with
 * attn_prefill_mma 0 the tiled kernel again, to the fp32 tolerance). One line per case.
 * Skips (77) without CUDA or a GPU.
 * KD_TEST_QUICK=1: only the small cases (for compute-sanitizer); KD_TEST_QUICK=2 (race):
 * fewer of them, each kernel form and tile length once (Llama's and an odd head shape,
 * not every shape x block size: racecheck tracks every shared-memory access, and the
 * quick list alone took over 380 s under it); KD_TEST_SEED=n: repeat a run. Timings:
 * tests/bench/bench_cuda_attn. */
#include <errno.h>
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

static int quick;	/* KD_TEST_QUICK */
static int race;	/* KD_TEST_QUICK=2 */
static int mma_pass;	/* the tensor-core decode kernel's pass: its variants compared */

/* ---- KV write ------------------------------------------------------------- */

/* n_rows random rows (a few special values among them) into distinct shuffled slots of a
 * poisoned cache, one slot -1; every written value must equal k_f32_to_bf16 bit for bit
 * and every other cache value must keep the poison. */
static void kv_write_case(int width, int pad, int n_rows, int n_slots)
{
	static const float special[] = { 0.0f, -0.0f, 1.00390625f /* tie, to even */,
		1.01171875f /* tie, up */, 3.0e38f, -1e-40f /* subnormal */, INFINITY };
	int stride = width + pad, skipped = n_rows > 3 ? 3 : -1;
	size_t n_src = (size_t)n_rows * stride, n_cache = (size_t)n_slots * width;
	float *src = test_rand_floats(n_src, 3.0f, &attn_seed);
	int32_t *perm = test_shuffled_ids(n_slots, &attn_seed);
	uint16_t *cache = malloc(sizeof(uint16_t) * n_cache);
	float *d_src = NULL;
	int32_t *d_slots = NULL;
	uint16_t *d_cache = dalloc(sizeof(uint16_t) * n_cache);
	size_t wrong = 0, touched = 0;
	char label[160];
	int ret;

	for (size_t i = 0; i < sizeof(special) / sizeof(special[0]) && i < n_src; i++)
		src[i * 5 % n_src] = special[i];
	if (skipped >= 0)
		perm[skipped] = -1;
	d_src = dup_to_device(src, sizeof(float) * n_src);
	d_slots = dup_to_device(perm, sizeof(int32_t) * (size_t)n_rows);
	CU(cudaMemset(d_cache, 0xa5, sizeof(uint16_t) * n_cache));
	ret = k_cuda_kv_write(0, d_cache, width, d_src, stride, n_rows, d_slots);
	CHECK(ret == 0, "k_cuda_kv_write: %d", ret);
	CU(cudaMemcpy(cache, d_cache, sizeof(uint16_t) * n_cache, cudaMemcpyDeviceToHost));
	for (int r = 0; r < n_rows; r++)
		if (perm[r] >= 0)
			for (int c = 0; c < width; c++) {
				uint16_t *dst = cache + (size_t)perm[r] * width + c;

				wrong += *dst != k_f32_to_bf16(src[(size_t)r * stride + c]);
				*dst = 0xa5a5;	/* checked: back to poison for the sweep */
			}
	for (size_t i = 0; i < n_cache; i++)
		touched += cache[i] != 0xa5a5;
	snprintf(label, sizeof(label), "kv_write width %d stride %d rows %d slots %d", width, stride,
		 n_rows, n_slots);
	fprintf(stderr, "%-72s wrong %zu stray %zu %s\n", label, wrong, touched,
		wrong || touched ? "FAIL" : "PASS");
	CHECK(wrong == 0 && touched == 0, "%s", label);
	free(src);
	free(perm);
	free(cache);
	cudaFree(d_src);
	cudaFree(d_slots);
	cudaFree(d_cache);
}

/* ---- GQA ------------------------------------------------------------------ */

/* k_cuda_attn_gqa_bf16 on the same inputs: the fp32 output bit for bit that of
 * k_cuda_attn_gqa, and, where it reports writing it, the bf16 copy that output rounded
 * to nearest even; it must write it for decode rows (no prefill hint). */
static void gqa_bf16_check(struct gqa_run *g)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd, bad = 0;
	struct k_cuda_attn_rows gr = rows_gpu(g->r, g->hint);
	float *want = download(g->d_out, n), *got;
	uint16_t *db = dalloc(sizeof(uint16_t) * n), *hb = malloc(sizeof(uint16_t) * n);
	int ret;

	poison(db, sizeof(uint16_t) * n);
	poison(g->d_out, sizeof(float) * n);
	ret = k_cuda_attn_gqa_bf16(0, g->ws, g->d_out, db, g->d_q, g->k.d, g->v.d, g->r->bt, &gr,
				   g->sh.h, g->sh.kv, g->sh.hd, g->scale);
	CHECK(ret >= 0 && (g->hint || ret == 1), "k_cuda_attn_gqa_bf16: %d", ret);
	CU(cudaDeviceSynchronize());
	got = download(g->d_out, n);
	CU(cudaMemcpy(hb, db, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
	for (size_t i = 0; i < n; i++)
		bad += memcmp(&got[i], &want[i], sizeof(float)) != 0 ||
		       (ret == 1 && hb[i] != k_f32_to_bf16(want[i]));
	CHECK(!bad, "gqa bf16 output (wrote %d): %zu of %zu values differ", ret, bad, n);
	cudaFree(db);
	free(hb);
	free(want);
	free(got);
}

/* The tensor-core pass: the same inputs under the tuning variant (what names it) give
 * the output of the tuning installed (in g->d_out) bit for bit. attn_mma_early 0, every
 * copy after the PDL wait: the same copies, issued later. */
static void gqa_same_bits(struct gqa_run *g, const struct k_cuda_tuning *variant,
			  const char *what)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd, bad = 0;
	const struct k_cuda_tuning was = *k_cuda_tuning();
	float *want = download(g->d_out, n), *got = NULL;
	int ret;

	k_cuda_tuning_set(variant);
	poison(g->d_out, sizeof(float) * n);
	ret = gqa_call(g, 0);
	k_cuda_tuning_set(&was);
	CHECK(ret == 0, "k_cuda_attn_gqa (%s): %d", what, ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		got = download(g->d_out, n);
		for (size_t i = 0; i < n; i++)
			bad += memcmp(&got[i], &want[i], sizeof(float)) != 0;
		CHECK(!bad, "gqa default vs %s: %zu of %zu values differ", what, bad, n);
		/* leave the default's output for the next comparison */
		CU(cudaMemcpy(g->d_out, want, sizeof(float) * n, cudaMemcpyHostToDevice));
	}
	free(want);
	free(got);
}

/* q in registers (default) against q in shared memory (attn_mma_qreg 0): the same mma
 * on the same values, but the shapes fit 4 and 3 blocks an SM, so the split rule may
 * pick different counts: both forced to 2 splits (attn_dec_splits), then bit for bit. */
static void gqa_qreg_check(struct gqa_run *g)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd;
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	int ret;

	t.attn_dec_splits = 2;
	k_cuda_tuning_set(&t);
	poison(g->d_out, sizeof(float) * n);
	ret = gqa_call(g, 0);
	CHECK(ret == 0, "k_cuda_attn_gqa (2 splits): %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		t.attn_mma_qreg = 0;
		gqa_same_bits(g, &t, "attn_mma_qreg 0");
	}
	k_cuda_tuning_set(&was);
}

static void gqa_variants_check(struct gqa_run *g)
{
	struct k_cuda_tuning t = *k_cuda_tuning();

	t.attn_mma_early = 0;
	gqa_same_bits(g, &t, "attn_mma_early 0");
	gqa_qreg_check(g);	/* last: leaves the 2-split output */
}

static void gqa_case(struct gqa_shape sh, int bt, struct rows *r, int hint)
{
	struct gqa_run g;
	size_t n = (size_t)r->n_rows * sh.h * sh.hd;
	int ret;

	if (gqa_setup(&g, sh, bt, r, hint, 0)) {
		CHECK(0, "gqa setup h%d/kv%d/d%d", sh.h, sh.kv, sh.hd);
		gqa_teardown(&g);
		return;
	}
	poison(g.d_out, sizeof(float) * n);
	ret = gqa_call(&g, 0);
	CHECK(ret == 0, "k_cuda_attn_gqa: %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		gqa_check(&g, "");
		gqa_bf16_check(&g);
		if (mma_pass)
			gqa_variants_check(&g);
	}
	gqa_teardown(&g);
}

/* One captured launch replayed with new ctx and new block tables. */
static void gqa_graph_case(struct gqa_shape sh, int bt, int n_rows, int max_ctx)
{
	struct rows *r = rows_decode(n_rows, max_ctx / 8, 1, max_ctx);
	struct gqa_run g;
	int ret = -1;

	if (!gqa_setup(&g, sh, bt, r, 0, max_ctx))
		ret = attn_graph_replays(r, gqa_call, gqa_check, &g, g.d_out,
					 (size_t)n_rows * sh.h * sh.hd);
	CHECK(ret == 0, "gqa graph case: %d", ret);
	gqa_teardown(&g);
}

/* Prefill rows captured once and replayed with new ctx and block tables (hinted: the
 * prefill kernels): run rows from pos, tables and splits sized for max_ctx. */
static void gqa_prefill_graph_case(struct gqa_shape sh, int bt, int run, int pos, int max_ctx)
{
	struct rows *r = rows_prefill(1, &run, &pos, max_ctx);
	struct gqa_run g;
	int ret = -1;

	if (!gqa_setup(&g, sh, bt, r, 1, max_ctx))
		ret = attn_graph_replays(r, gqa_call, gqa_check, &g, g.d_out,
					 (size_t)r->n_rows * sh.h * sh.hd);
	CHECK(ret == 0, "gqa prefill graph case: %d", ret);
	gqa_teardown(&g);
}

/* KDEC_ATTN_PREFILL_MMA=0 in the tensor-core pass: the prefill rows go to the tiled
 * CUDA-core kernel again, which must meet the fp32 tolerance (the tensor-core kernel
 * does not: its q and p are bf16). */
static void gqa_prefill_off_case(struct gqa_shape sh, int bt, struct rows *r)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	const double tol = attn_tol;
	const char *path = attn_path;

	t.attn_prefill_mma = 0;
	k_cuda_tuning_set(&t);
	attn_tol = ATTN_TOL;
	attn_path = "[mma, attn_prefill_mma 0: tiled fp32] ";
	gqa_case(sh, bt, r, 1);
	attn_tol = tol;
	attn_path = path;
	k_cuda_tuning_set(&was);
}

/* The tensor-core prefill kernel: head_dim 64 and 128 (and 24, 40: zero-padded to 64) at
 * groups 1, 4 and 8; block_tokens 16, 64 and 7; a chunk that starts mid-context at an
 * offset that is no multiple of a tile and ends in a partial query tile, a whole prompt
 * from position 0; several sequences whose runs straddle the query tiles (one of a
 * single row); 16 rows over 30k tokens (the context split over blocks, then merged) and
 * a graph sized for 32k that the rows fill only partly (empty splits); whole prompts
 * (query tiles paired first with last); head_dim 20 and 256 take the tiled kernel (the
 * fallback). Then the knob off. */
static void test_gqa_prefill_mma(void)
{
	static const struct gqa_shape shapes[] = {
		{ 32, 8, 128 }, { 32, 4, 128 }, { 8, 8, 128 },	/* groups 4, 8, 1 */
		{ 16, 4, 64 }, { 16, 2, 64 }, { 8, 8, 64 },
		{ 12, 4, 24 }, { 10, 2, 40 },			/* padded to 64 */
		{ 6, 2, 20 }, { 4, 2, 256 },			/* the fallback */
	};
	int run = quick ? 77 : 200, pos = quick ? 203 : 3037, zero = 0;
	int runs[] = { 37, 100, 1, 70 }, pos0[] = { 1000, 0, 4000, 3001 };
	int few = 16, far = quick ? 2000 : 30000;
	int runs2[] = { 300, 1, 211, 150 }, pos2[] = { 0, 90, 0, 20 }, whole = 2048;

	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
		if (race && i != 0 && i != 3 && i != 6 && i != 8 && i != 9)
			continue;	/* groups 4, head 64, padded, fallback, 256 */
		gqa_case(shapes[i], 16, rows_prefill(1, &run, &pos, pos + run), 1);
		gqa_case(shapes[i], i % 2 ? 64 : 7, rows_prefill(1, &run, &zero, run), 1);
	}
	gqa_case(shapes[0], 16, rows_prefill(4, runs, pos0, 4200), 1);
	gqa_case(shapes[4], 7, rows_prefill(4, runs, pos0, 4200), 1);
	gqa_case(shapes[0], 16, rows_prefill(1, &few, &far, far + few), 1);
	gqa_case(shapes[3], 16, rows_prefill(1, &few, &far, 32768), 1);
	/* whole prompts (paired query tiles): several sequences from position 0 or near it;
	 * one Llama prompt of 2,048 (pairs of 128 query vectors; below that, of 64) */
	gqa_case(shapes[0], 16, rows_prefill(4, runs2, pos2, 400), 1);
	gqa_case(shapes[1], 7, rows_prefill(4, runs2, pos2, 400), 1);
	if (!quick)
		gqa_case(shapes[0], 16, rows_prefill(1, &whole, &zero, whole), 1);
	gqa_prefill_graph_case(shapes[0], 16, 64, quick ? 100 : 1000, quick ? 512 : 8192);
	gqa_prefill_off_case(shapes[0], 16, rows_prefill(1, &run, &pos, pos + run));
	gqa_prefill_off_case(shapes[3], 7, rows_prefill(4, runs, pos0, 4200));
}

/* ---- cases ---------------------------------------------------------------- */

/* Sizes the kernels must refuse, with -EINVAL. */
static void test_refusals(void)
{
	struct k_cuda_attn_ws *ws = NULL;
	struct k_mla_dims big = { .n_heads = 1, .nope_dim = 16, .rope_dim = 8, .v_dim = 16,
		.kv_lora = 4096 };
	struct k_cuda_attn_rows r = { .n_rows = 1, .max_ctx = 16 };

	if (k_cuda_attn_ws_create(&ws, 4, 8, 4096, 64)) {
		CHECK(0, "ws create");
		return;
	}
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 1, 1, 300, 1.0f) == -EINVAL,
	      "head_dim 300");
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 6, 4, 64, 1.0f) == -EINVAL,
	      "6 heads over 4 kv heads");
	r.n_rows = 5;
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 8, 8, 64, 1.0f) == -EINVAL,
	      "rows over the workspace");
	r.n_rows = 1;
	r.max_ctx = 65;
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 8, 8, 64, 1.0f) == -EINVAL,
	      "max_ctx over the workspace");
	r.max_ctx = 16;
	CHECK(k_cuda_attn_mla(0, ws, NULL, NULL, NULL, NULL, 16, &r, &big, 1.0f) == -EINVAL,
	      "kv_lora 4096");
	k_cuda_attn_ws_destroy(ws);
	fprintf(stderr, "%-72s %s\n", "refusals of unsupported sizes (-EINVAL)", "done");
}

static void test_kv_write(void)
{
	kv_write_case(1024, 0, 37, 4096);	/* 16-byte path */
	kv_write_case(576, 8, 64, 300);		/* MLA width */
	kv_write_case(46, 3, 29, 100);		/* odd: scalar path */
	kv_write_case(40, 1, 7, 7);		/* every slot but the skipped one */
}

static void test_gqa(void)
{
	static const struct gqa_shape shapes[] = {
		{ 32, 8, 128 }, { 8, 8, 64 }, { 12, 4, 24 }, { 10, 2, 40 },
	};
	static const int bts[] = { 16, 64 };

	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		for (size_t b = 0; b < 2; b++) {
			struct gqa_shape sh = shapes[i];
			int bt = bts[b];

			if (race && (i % 2 || (i == 2 && b == 0)))
				continue;	/* Llama at both block sizes, head 24 at 64 */
			gqa_case(sh, bt, rows_decode(1, 1, 0, 1), 0);
			gqa_case(sh, bt, rows_decode(1, 17, 0, 17), 0);
			gqa_case(sh, bt, rows_decode(7, quick ? 300 : 1000, 1, 1000), 0);
			gqa_case(sh, bt, rows_decode(7, 17, 1, 32768), 0);	/* empty splits */
			if (!quick)
				gqa_case(sh, bt, rows_decode(64, 4096, 1, 4096), 0);
			else
				gqa_case(sh, bt, rows_decode(64, 40, 1, 64), 0);
		}
	gqa_case(shapes[0], 7, rows_decode(5, quick ? 200 : 3000, 1, 3000), 0);	/* bt 7 */
	gqa_case(shapes[0], 16, rows_decode(1, 300, 0, 32768), 0);	/* most splits empty */
	/* beyond the brief: head_dim 20 (no 16-byte path) and 256 (widest) */
	for (size_t i = 0; i < 2; i++) {
		static const struct gqa_shape more[] = { { 6, 2, 20 }, { 4, 2, 256 } };
		int run = 64, pos = quick ? 100 : 2000;

		gqa_case(more[i], 16, rows_decode(7, quick ? 300 : 1000, 1, 1000), 0);
		gqa_case(more[i], 64, rows_prefill(1, &run, &pos, pos + run), 1);
	}
	if (!quick) {
		static const int few[] = { 32768, 20000, 5 };

		for (size_t i = 0; i < 4; i += 3) {
			struct rows *r = rows_decode(3, 32768, 0, 32768);

			memcpy(r->ctx, few, sizeof(few));
			gqa_case(shapes[i], 16, r, 0);
		}
	}
}

static void test_gqa_prefill(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, odd = { 12, 4, 24 },
		odd2 = { 10, 2, 40 }, mha = { 8, 8, 64 };
	int run = 256, end = quick ? 300 : 32000, zero = 0, mid = 500;
	/* several sequences in one call: tiles straddle the runs, plus two decode rows */
	int runs[] = { 37, 100, 5, 1, 1 }, pos[] = { 1000, 0, 4000, 3000, 0 };

	gqa_case(llama, 16, rows_prefill(1, &run, &end, end + run), 1);
	gqa_case(llama, 16, rows_prefill(1, &run, &zero, run), 1);
	gqa_case(odd, 64, rows_prefill(1, &run, &end, end + run), 1);
	gqa_case(odd2, 16, rows_prefill(1, &run, &zero, run), 1);
	if (quick) {
		pos[0] = 100;
		pos[2] = 200;
		pos[3] = 150;
	}
	gqa_case(llama, 16, rows_prefill(5, runs, pos, 4096), 1);
	gqa_case(odd2, 7, rows_prefill(5, runs, pos, 4096), 1);
	run = 64;	/* prefill rows through the decode kernel: no hint */
	gqa_case(mha, 16, rows_prefill(1, &run, &mid, mid + run), 0);
	gqa_graph_case(llama, 16, 7, quick ? 256 : 4096);
	gqa_graph_case(odd2, 16, 3, quick ? 256 : 4096);
}

/* The tensor-core pass: shapes of 2..8 splits and their merge launch: Llama at batch 64
 * (3 splits), an odd batch (2), group 16 (a 16-head chunk per block), contexts up to
 * 32k (7 splits, some empty). */
static void test_gqa_splits(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, g16 = { 32, 2, 128 },
		odd = { 10, 2, 40 };

	gqa_case(llama, 16, rows_decode(64, 1024, 0, 1024), 0);
	gqa_case(llama, 16, rows_decode(33, quick ? 200 : 1000, 1, 1000), 0);
	gqa_case(g16, 16, rows_decode(64, quick ? 200 : 2000, 1, 2000), 0);
	gqa_case(odd, 7, rows_decode(45, quick ? 200 : 1000, 1, 1000), 0);
	gqa_case(llama, 16, rows_decode(8, quick ? 300 : 32768, 1, 32768), 0);
}

/* The KV write and the GQA cases: the CUDA-core kernels (fp32) first, then the
 * tensor-core decode kernel on the decode-shaped cases, with each tile length it has,
 * and the tensor-core prefill kernel on the prefill cases. */
int main(void)
{
	struct k_cuda_tuning t;

	if (!test_gpu_present("test_cuda_attn_gqa"))
		return 77;
	quick = test_env_flag("KD_TEST_QUICK");
	race = quick >= 2;
	if (attn_begin("test_cuda_attn_gqa", quick))
		return 1;
	test_refusals();
	test_kv_write();
	attn_pass(0);
	test_gqa();
	test_gqa_prefill();
	attn_pass(1);
	mma_pass = 1;
	test_gqa();
	test_gqa_splits();
	test_gqa_prefill();
	test_gqa_prefill_mma();
	if (!quick) {
		t = *k_cuda_tuning();
		t.attn_mma_tk = 64;
		k_cuda_tuning_set(&t);
		attn_path = "[mma tk64] ";
		test_gqa();
	}
	return attn_end("test_cuda_attn_gqa");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_attn_gqa: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
