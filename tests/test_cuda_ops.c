/* The CUDA small ops against their CPU references on fresh random inputs: embedding,
 * RMSNorm (strided, in place, fused with the residual add), add, SwiGLU (plain and
 * fused rows), RoPE (default, llama3, YaRN; interleaved and not), and the fused
 * attention inputs of GQA and MLA layers (norm + rope + cache append). Outputs are
 * poisoned (NaN) first, so an unwritten element fails. One line per case.
 * Tolerances: embed and add are exact; RMSNorm and RoPE follow the CPU's fp32/fp64
 * steps (rel L2 <= 1e-6, in practice 0); SiLU differs by expf's last bit (<= 1e-6).
 * Skips (77) without CUDA or a GPU. */
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
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"

#define REL_TOL 1e-6

static unsigned long long seed = 0x5eed0c0da0ull;
static cudaStream_t stream;

/* ---- comparison and the report line ------------------------------------- */

/* got vs want over n floats: NaN anywhere in got (an unwritten element) fails. */
static void report(const char *op, const char *shape, const float *got, const float *want,
		   size_t n, double tol)
{
	double max_abs = 0, rel = test_rel_l2(got, want, n);
	size_t nan = 0;

	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - (double)want[i]);

		if (got[i] != got[i] && want[i] == want[i])
			nan++;
		else if (d > max_abs)
			max_abs = d;
	}
	printf("%-14s %-40s max_abs %.3g rel_l2 %.3g%s  %s\n", op, shape, max_abs, rel,
	       nan ? "  UNWRITTEN" : "", !nan && rel <= tol ? "PASS" : "FAIL");
	CHECK(!nan && rel <= tol, "%s %s: rel %.3g (tol %.3g), %zu unwritten", op, shape, rel, tol,
	      nan);
}

/* ---- embedding ------------------------------------------------------------ */

static void test_embed(int n, int dim)
{
	int vocab = 300;
	uint16_t *table = malloc(sizeof(uint16_t) * (size_t)vocab * dim);
	int32_t *ids = malloc(sizeof(int32_t) * n);
	float *want = malloc(sizeof(float) * (size_t)n * dim);
	float *got = malloc(sizeof(float) * (size_t)n * dim);
	uint16_t *dt;
	int32_t *di;
	float *dout;
	char shape[64];

	for (size_t i = 0; i < (size_t)vocab * dim; i++)
		table[i] = k_f32_to_bf16(test_randf(&seed));
	for (int i = 0; i < n; i++)
		ids[i] = (int32_t)((test_randf(&seed) + 1) * 0.5f * vocab) % vocab;
	k_cpu_embed(want, ids, n, table, K_BF16, dim);
	dt = dup_to_device(table, sizeof(uint16_t) * (size_t)vocab * dim);
	di = dup_to_device(ids, sizeof(int32_t) * n);
	dout = dalloc(sizeof(float) * (size_t)n * dim);
	poison(dout, sizeof(float) * (size_t)n * dim);
	CHECK(k_cuda_embed(stream, dout, di, n, dt, dim) == 0, "embed launch");
	to_host(got, dout, sizeof(float) * (size_t)n * dim);
	snprintf(shape, sizeof(shape), "n %d dim %d", n, dim);
	report("embed", shape, got, want, (size_t)n * dim, 0);
	cudaFree(dt);
	cudaFree(di);
	cudaFree(dout);
	free(table);
	free(ids);
	free(want);
	free(got);
}

/* ---- RMSNorm ---------------------------------------------------------------- */

/* rows of dim values, x rows x_stride apart, out rows out_stride apart (in place when
 * inplace: out = x, strides equal). The gaps between rows must stay untouched. */
/* k_cuda_rmsnorm_bf16 (rows, dim) again into fresh buffers: the fp32 output the same
 * bits as got (the plain form's), the bf16 copy exactly got rounded to nearest even. */
static void check_bf16_copy(const char *op, int rows, int dim, int out_stride, const float *got,
			    float *dout_unused, const float *dx, int x_stride, const float *dw)
{
	size_t no = (size_t)rows * out_stride, nb = (size_t)rows * dim, bad = 0, bad32 = 0;
	float *d2 = dalloc(sizeof(float) * no), *h2 = malloc(sizeof(float) * no);
	uint16_t *db = dalloc(sizeof(uint16_t) * nb), *hb = malloc(sizeof(uint16_t) * nb);

	(void)dout_unused;
	poison(d2, sizeof(float) * no);
	poison(db, sizeof(uint16_t) * nb);
	CHECK(k_cuda_rmsnorm_bf16(stream, d2, out_stride, dx, x_stride, dw, rows, dim, 1e-6f, db) == 0,
	      "%s bf16 launch", op);
	to_host(h2, d2, sizeof(float) * no);
	to_host(hb, db, sizeof(uint16_t) * nb);
	for (int r = 0; r < rows; r++)
		for (int i = 0; i < dim; i++) {
			const float g = got[(size_t)r * out_stride + i];

			bad32 += memcmp(&g, &h2[(size_t)r * out_stride + i], sizeof(g)) != 0;
			bad += hb[(size_t)r * dim + i] != k_f32_to_bf16(g);
		}
	printf("%-14s rows %d dim %d: %zu fp32 and %zu bf16 values differ  %s\n", "rmsnorm_bf16",
	       rows, dim, bad32, bad, bad || bad32 ? "FAIL" : "PASS");
	CHECK(!bad && !bad32, "%s bf16 copy: %zu fp32, %zu bf16 differ", op, bad32, bad);
	cudaFree(d2);
	cudaFree(db);
	free(h2);
	free(hb);
}

static void test_rmsnorm(int rows, int dim, int x_stride, int out_stride, int inplace)
{
	size_t nx = (size_t)rows * x_stride, no = (size_t)rows * out_stride;
	float *x = test_rand_floats(nx, 3.0f, &seed), *w = test_rand_floats(dim, 1.0f, &seed);
	float *want = malloc(sizeof(float) * (inplace ? nx : no));
	float *got = malloc(sizeof(float) * (inplace ? nx : no));
	float *dx = dup_to_device(x, sizeof(float) * nx);
	float *dw = dup_to_device(w, sizeof(float) * dim), *dout;
	char shape[80];

	if (inplace) {
		memcpy(want, x, sizeof(float) * nx);
		k_cpu_rmsnorm(want, x_stride, want, x_stride, w, K_F32, rows, dim, 1e-6f);
		dout = dx;
	} else {
		for (size_t i = 0; i < no; i++)		/* gaps keep the poison */
			want[i] = NAN;
		k_cpu_rmsnorm(want, out_stride, x, x_stride, w, K_F32, rows, dim, 1e-6f);
		dout = dalloc(sizeof(float) * no);
		poison(dout, sizeof(float) * no);
	}
	CHECK(k_cuda_rmsnorm(stream, dout, inplace ? x_stride : out_stride, dx, x_stride, dw, rows,
			     dim, 1e-6f) == 0, "rmsnorm launch");
	to_host(got, dout, sizeof(float) * (inplace ? nx : no));
	if (!inplace)
		check_bf16_copy("rmsnorm", rows, dim, out_stride, got, dout, dx, x_stride, dw);
	snprintf(shape, sizeof(shape), "rows %d dim %d stride %d/%d%s", rows, dim, x_stride,
		 out_stride, inplace ? " in place" : "");
	if (!inplace)	/* the gaps: NaN where want is NaN, so compare only rows */
		for (size_t i = 0; i < no; i++)
			if (want[i] != want[i]) {
				CHECK(got[i] != got[i], "rmsnorm wrote a gap at %zu", i);
				got[i] = want[i] = 0;
			}
	report("rmsnorm", shape, got, want, inplace ? nx : no, REL_TOL);
	if (dout != dx)
		cudaFree(dout);
	cudaFree(dx);
	cudaFree(dw);
	free(x);
	free(w);
	free(want);
	free(got);
}

/* x += r; out = rmsnorm(x) * w; alias: out is r (the forward's x += h; h = norm(x)). */
static void test_add_rmsnorm(int rows, int dim, int alias)
{
	size_t n = (size_t)rows * dim;
	float *x = test_rand_floats(n, 2.0f, &seed), *r = test_rand_floats(n, 2.0f, &seed);
	float *w = test_rand_floats(dim, 1.0f, &seed);
	float *want = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
	float *gx = malloc(sizeof(float) * n);
	float *dx = dup_to_device(x, sizeof(float) * n), *dr = dup_to_device(r, sizeof(float) * n);
	float *dw = dup_to_device(w, sizeof(float) * dim), *dout = alias ? dr : dalloc(sizeof(float) * n);
	char shape[64];

	k_cpu_add(x, r, n);
	k_cpu_rmsnorm(want, dim, x, dim, w, K_F32, rows, dim, 1e-5f);
	if (!alias)
		poison(dout, sizeof(float) * n);
	CHECK(k_cuda_add_rmsnorm(stream, dx, dr, dout, dw, rows, dim, 1e-5f) == 0, "add_rmsnorm launch");
	to_host(got, dout, sizeof(float) * n);
	to_host(gx, dx, sizeof(float) * n);
	snprintf(shape, sizeof(shape), "rows %d dim %d%s", rows, dim, alias ? " out=r" : "");
	report("add_rmsnorm.x", shape, gx, x, n, 0);
	report("add_rmsnorm", shape, got, want, n, REL_TOL);
	if (!alias)
		cudaFree(dout);
	cudaFree(dx);
	cudaFree(dr);
	cudaFree(dw);
	free(x);
	free(r);
	free(w);
	free(want);
	free(got);
	free(gx);
}

/* ---- add and SwiGLU ------------------------------------------------------- */

/* off: floats into the buffers, so off % 4 != 0 takes the unaligned path. */
static void test_add(size_t n, int off)
{
	float *y = test_rand_floats(n, 5.0f, &seed), *x = test_rand_floats(n, 5.0f, &seed);
	float *got = malloc(sizeof(float) * n);
	float *dy = dalloc(sizeof(float) * (n + off)), *dx = dalloc(sizeof(float) * (n + off));
	char shape[64];

	CU(cudaMemcpy(dy + off, y, sizeof(float) * n, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(dx + off, x, sizeof(float) * n, cudaMemcpyHostToDevice));
	k_cpu_add(y, x, n);
	CHECK(k_cuda_add(stream, dy + off, dx + off, n) == 0, "add launch");
	to_host(got, dy + off, sizeof(float) * n);
	snprintf(shape, sizeof(shape), "n %zu offset %d", n, off);
	report("add", shape, got, y, n, 0);
	cudaFree(dy);
	cudaFree(dx);
	free(y);
	free(x);
	free(got);
}

static void test_silu_mul(size_t n, int off, int alias)
{
	float *g = test_rand_floats(n, 8.0f, &seed), *u = test_rand_floats(n, 2.0f, &seed);
	float *want = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
	float *dg = dalloc(sizeof(float) * (n + off)), *du = dalloc(sizeof(float) * (n + off));
	float *dout = alias ? dg : dalloc(sizeof(float) * (n + off));
	char shape[64];

	CU(cudaMemcpy(dg + off, g, sizeof(float) * n, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(du + off, u, sizeof(float) * n, cudaMemcpyHostToDevice));
	if (!alias)
		poison(dout, sizeof(float) * (n + off));
	k_cpu_silu_mul(want, g, u, n);
	CHECK(k_cuda_silu_mul(stream, dout + off, dg + off, du + off, n) == 0, "silu_mul launch");
	to_host(got, dout + off, sizeof(float) * n);
	snprintf(shape, sizeof(shape), "n %zu offset %d%s", n, off, alias ? " out=gate" : "");
	report("silu_mul", shape, got, want, n, REL_TOL);
	if (!alias)
		cudaFree(dout);
	cudaFree(dg);
	cudaFree(du);
	free(g);
	free(u);
	free(want);
	free(got);
}

/* gate_up in bf16 (k_cuda_silu_mul_rows_bf16in): the bf16 rounding of the fp32 kernel's
 * output on the same bf16-rounded inputs, bit for bit. db: (rows, inter) bf16 scratch. */
static void test_silu_rows_bf16in(const float *gu, int rows, int inter, uint16_t *db)
{
	size_t n = (size_t)rows * inter;
	uint16_t *gb = malloc(sizeof(uint16_t) * 2 * n), *hb = malloc(sizeof(uint16_t) * n);
	float *gr = malloc(sizeof(float) * 2 * n), *want = malloc(sizeof(float) * n);
	float *dgr, *dout = dalloc(sizeof(float) * n);
	uint16_t *dgb;
	char shape[64];
	size_t bad = 0;

	for (size_t i = 0; i < 2 * n; i++) {
		gb[i] = k_f32_to_bf16(gu[i]);
		gr[i] = k_bf16_to_f32(gb[i]);
	}
	dgr = dup_to_device(gr, sizeof(float) * 2 * n);
	dgb = dup_to_device(gb, sizeof(uint16_t) * 2 * n);
	CHECK(k_cuda_silu_mul_rows(stream, dout, dgr, rows, inter) == 0, "silu_mul_rows launch");
	to_host(want, dout, sizeof(float) * n);
	poison(db, sizeof(uint16_t) * n);
	CHECK(k_cuda_silu_mul_rows_bf16in(stream, dgb, rows, inter, db) == 0,
	      "silu_mul_rows_bf16in launch");
	to_host(hb, db, sizeof(uint16_t) * n);
	for (size_t i = 0; i < n; i++)
		bad += hb[i] != k_f32_to_bf16(want[i]);
	snprintf(shape, sizeof(shape), "rows %d inter %d", rows, inter);
	printf("%-14s %-40s %zu differ  %s\n", "silu_rows_b16i", shape, bad, bad ? "FAIL" : "PASS");
	CHECK(!bad, "silu_mul_rows_bf16in %s: %zu differ", shape, bad);
	CHECK(k_cuda_silu_mul_rows_bf16in(stream, dgb, rows, inter + 4, db) == -EINVAL,
	      "silu_mul_rows_bf16in: inter %% 8 != 0 not refused");
	cudaFree(dgr);
	cudaFree(dgb);
	cudaFree(dout);
	free(gb);
	free(hb);
	free(gr);
	free(want);
}

static void test_silu_mul_rows(int rows, int inter)
{
	size_t n = (size_t)rows * inter;
	float *gu = test_rand_floats(2 * n, 8.0f, &seed);
	float *want = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
	float *dgu = dup_to_device(gu, sizeof(float) * 2 * n), *dout = dalloc(sizeof(float) * n);
	char shape[64];

	for (int r = 0; r < rows; r++)
		k_cpu_silu_mul(want + (size_t)r * inter, gu + (size_t)r * 2 * inter,
			       gu + (size_t)r * 2 * inter + inter, (size_t)inter);
	poison(dout, sizeof(float) * n);
	CHECK(k_cuda_silu_mul_rows(stream, dout, dgu, rows, inter) == 0, "silu_mul_rows launch");
	to_host(got, dout, sizeof(float) * n);
	snprintf(shape, sizeof(shape), "rows %d inter %d", rows, inter);
	report("silu_mul_rows", shape, got, want, n, REL_TOL);
	{	/* the bf16 form: the same fp32 bits, and their bf16 rounding */
		uint16_t *db = dalloc(sizeof(uint16_t) * n), *hb = malloc(sizeof(uint16_t) * n);
		float *h2 = malloc(sizeof(float) * n);
		size_t bad = 0;

		poison(dout, sizeof(float) * n);
		poison(db, sizeof(uint16_t) * n);
		CHECK(k_cuda_silu_mul_rows_bf16(stream, dout, dgu, rows, inter, db) == 0,
		      "silu_mul_rows_bf16 launch");
		to_host(h2, dout, sizeof(float) * n);
		to_host(hb, db, sizeof(uint16_t) * n);
		for (size_t i = 0; i < n; i++)
			bad += memcmp(&h2[i], &got[i], sizeof(float)) != 0 || hb[i] != k_f32_to_bf16(got[i]);
		printf("%-14s %-40s %zu differ  %s\n", "silu_rows_bf16", shape, bad, bad ? "FAIL" : "PASS");
		CHECK(!bad, "silu_mul_rows_bf16 %s: %zu differ", shape, bad);
		/* bf16 only (out NULL): the same bf16 bits where inter % 8 == 0, else refused */
		poison(db, sizeof(uint16_t) * n);
		if (inter % 8) {
			CHECK(k_cuda_silu_mul_rows_bf16(stream, NULL, dgu, rows, inter, db) == -EINVAL,
			      "silu_mul_rows_bf16 bf16-only %s: not refused", shape);
		} else {
			CHECK(k_cuda_silu_mul_rows_bf16(stream, NULL, dgu, rows, inter, db) == 0,
			      "silu_mul_rows_bf16 bf16-only launch");
			to_host(hb, db, sizeof(uint16_t) * n);
			bad = 0;
			for (size_t i = 0; i < n; i++)
				bad += hb[i] != k_f32_to_bf16(got[i]);
			printf("%-14s %-40s %zu differ  %s\n", "silu_rows_b16o", shape, bad,
			       bad ? "FAIL" : "PASS");
			CHECK(!bad, "silu_mul_rows_bf16 bf16-only %s: %zu differ", shape, bad);
			test_silu_rows_bf16in(gu, rows, inter, db);
		}
		cudaFree(db);
		free(hb);
		free(h2);
	}
	cudaFree(dgu);
	cudaFree(dout);
	free(gu);
	free(want);
	free(got);
}

/* ---- RoPE ----------------------------------------------------------------- */

/* Heads of head_dim floats, the rotary part at rope_off in each, rows head_stride *
 * n_heads apart (head_stride 0 with one head: the MLA key). */
static void test_rope(const char *name, const struct k_rope_params *rp, int n_rows, int n_heads,
		      int head_dim, int rope_off, int head_stride)
{
	struct k_rope rope;
	int row_stride = (head_stride ? head_stride : head_dim) * n_heads;
	size_t n = (size_t)n_rows * row_stride;
	float *x, *got = malloc(sizeof(float) * n), *dx, *dinv;
	int32_t *pos = malloc(sizeof(int32_t) * n_rows), *dpos;
	char shape[96];

	CHECK(k_rope_init(&rope, rp) == 0, "rope init");
	x = test_rand_floats(n, 2.0f, &seed);
	for (int r = 0; r < n_rows; r++)	/* 0 and large positions included */
		pos[r] = r == 0 ? 0 : (int32_t)((test_randf(&seed) + 1) * 0.5f * 32768);
	dx = dup_to_device(x, sizeof(float) * n);
	dpos = dup_to_device(pos, sizeof(int32_t) * n_rows);
	dinv = dup_to_device(rope.inv_freq, sizeof(float) * (size_t)rope.dim / 2);
	k_cpu_rope(&rope, x + rope_off, n_rows, n_heads, row_stride, head_stride, pos);
	CHECK(k_cuda_rope(stream, dinv, rope.dim, rope.interleaved, rope.attn_factor, dx + rope_off,
			  n_rows, n_heads, row_stride, head_stride, dpos) == 0, "rope launch");
	to_host(got, dx, sizeof(float) * n);
	snprintf(shape, sizeof(shape), "%s%s rows %d heads %d dim %d/%d", name,
		 rp->interleaved ? " il" : "", n_rows, n_heads, rope.dim, head_dim);
	report("rope", shape, got, x, n, REL_TOL);
	cudaFree(dx);
	cudaFree(dpos);
	cudaFree(dinv);
	k_rope_fini(&rope);
	free(x);
	free(got);
	free(pos);
}

static void test_rope_all(void)
{
	struct k_rope_params def = { .type = K_ROPE_DEFAULT, .theta = 10000, .dim = 128 };
	struct k_rope_params l3 = { .type = K_ROPE_LLAMA3, .theta = 500000, .dim = 128,
		.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
		.original_max_pos = 8192 };
	struct k_rope_params yarn = { .type = K_ROPE_YARN, .theta = 10000, .dim = 64,
		.factor = 40, .original_max_pos = 4096, .beta_fast = 32, .beta_slow = 1,
		.mscale = 1, .mscale_all_dim = 0.707, .truncate = 1 };
	const int rows[] = { 1, 64, 257 };

	for (int il = 0; il < 2; il++) {
		def.interleaved = l3.interleaved = yarn.interleaved = il;
		for (int i = 0; i < 3; i++) {
			test_rope("default", &def, rows[i], 32, 128, 0, 128);
			test_rope("llama3", &l3, rows[i], 8, 128, 0, 128);
			/* DeepSeek: rope part of a 192-wide q head, and the shared key */
			test_rope("yarn", &yarn, rows[i], 16, 192, 128, 192);
			test_rope("yarn k", &yarn, rows[i], 1, 576, 512, 0);
		}
	}
	def.interleaved = 0;
	def.dim = 2;
	test_rope("default", &def, 7, 3, 7, 0, 7);	/* one pair, odd head width */
}

/* ---- fused attention inputs: norm + rope + cache append --------------------- */

/* Rows of fused (rows, (H + 2 KV) D) projections, or three separate blocks, through
 * k_cuda_qkv_post against k_cpu_rmsnorm + k_cpu_rope + bf16 rounding. One row writes
 * no KV (slot -1) and the slots are scattered. q: REL_TOL; the bf16 cache: 1e-5 (the
 * fp64 sum of squares in another order may move one rounding). */
static void test_qkv_post(int rows, int H, int KV, int D, int qk_norm, int interleaved, int fused)
{
	struct k_rope_params rp = { .type = K_ROPE_LLAMA3, .theta = 500000, .dim = D,
		.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
		.original_max_pos = 8192, .interleaved = interleaved };
	const int nq = H * D, nk = KV * D, tot = nq + 2 * nk, n_slots = rows + 5;
	const size_t nsrc = (size_t)rows * tot, ncache = (size_t)n_slots * nk;
	float *src = test_rand_floats(nsrc, 2.0f, &seed), *qw = test_rand_floats((size_t)D, 1.0f, &seed);
	float *kw = test_rand_floats((size_t)D, 1.0f, &seed);
	float *qref = malloc(sizeof(float) * (size_t)rows * nq), *kref = malloc(sizeof(float) * (size_t)rows * nk);
	float *got = malloc(sizeof(float) * (size_t)rows * nq), *kgot = malloc(sizeof(float) * ncache);
	float *vgot = malloc(sizeof(float) * ncache), *kwant = malloc(sizeof(float) * ncache);
	float *vwant = malloc(sizeof(float) * ncache);
	uint16_t *hk = malloc(sizeof(uint16_t) * ncache), *hv = malloc(sizeof(uint16_t) * ncache);
	int32_t *pos = malloc(sizeof(int32_t) * rows), *slots = malloc(sizeof(int32_t) * rows);
	struct k_rope rope;
	struct k_cuda_qkv_args a;
	float *dsrc, *dq, *dqw, *dkw, *dinv;
	uint16_t *dk, *dv;
	int32_t *dpos, *dslots;
	long qo, ko, vo, qrs, krs, vrs;
	char shape[96];

	CHECK(k_rope_init(&rope, &rp) == 0, "rope init");
	for (int r = 0; r < rows; r++) {
		pos[r] = r == 0 ? 0 : (int32_t)((test_randf(&seed) + 1) * 0.5f * 32768);
		slots[r] = r == rows / 2 ? -1 : (r * 7 + 3) % n_slots;
	}
	/* the layout: fused rows hold q | k | v; else three blocks, each row-contiguous */
	qo = 0, ko = fused ? nq : (long)rows * nq, vo = fused ? nq + nk : (long)rows * (nq + nk);
	qrs = fused ? tot : nq, krs = fused ? tot : nk, vrs = krs;
	for (int r = 0; r < rows; r++) {
		memcpy(qref + (size_t)r * nq, src + qo + r * qrs, sizeof(float) * nq);
		memcpy(kref + (size_t)r * nk, src + ko + r * krs, sizeof(float) * nk);
	}
	if (qk_norm) {
		k_cpu_rmsnorm(qref, D, qref, D, qw, K_F32, rows * H, D, 1e-6f);
		k_cpu_rmsnorm(kref, D, kref, D, kw, K_F32, rows * KV, D, 1e-6f);
	}
	k_cpu_rope(&rope, qref, rows, H, nq, D, pos);
	k_cpu_rope(&rope, kref, rows, KV, nk, D, pos);

	dsrc = dup_to_device(src, sizeof(float) * nsrc);
	dqw = dup_to_device(qw, sizeof(float) * D);
	dkw = dup_to_device(kw, sizeof(float) * D);
	dinv = dup_to_device(rope.inv_freq, sizeof(float) * (size_t)D / 2);
	dpos = dup_to_device(pos, sizeof(int32_t) * rows);
	dslots = dup_to_device(slots, sizeof(int32_t) * rows);
	dq = dalloc(sizeof(float) * (size_t)rows * nq);
	dk = dalloc(sizeof(uint16_t) * ncache);
	dv = dalloc(sizeof(uint16_t) * ncache);
	poison(dq, sizeof(float) * (size_t)rows * nq);
	poison(dk, sizeof(uint16_t) * ncache);
	poison(dv, sizeof(uint16_t) * ncache);
	a = (struct k_cuda_qkv_args){
		.q = dq, .q_src = dsrc + qo, .k_src = dsrc + ko, .v_src = dsrc + vo,
		.q_rs = qrs, .k_rs = krs, .v_rs = vrs, .rows = rows, .n_heads = H, .kv_heads = KV,
		.head_dim = D, .q_norm = qk_norm ? dqw : NULL, .k_norm = qk_norm ? dkw : NULL,
		.eps = 1e-6f, .inv_freq = dinv, .rope_dim = rope.dim,
		.interleaved = rope.interleaved, .attn_factor = rope.attn_factor, .pos = dpos,
		.k_cache = dk, .v_cache = dv, .slots = dslots,
	};
	CHECK(k_cuda_qkv_post(stream, &a) == 0, "qkv_post launch");
	to_host(got, dq, sizeof(float) * (size_t)rows * nq);
	to_host(hk, dk, sizeof(uint16_t) * ncache);
	to_host(hv, dv, sizeof(uint16_t) * ncache);
	/* compare the written slots only; every one must hold its row's values */
	for (size_t i = 0; i < ncache; i++)
		kgot[i] = vgot[i] = kwant[i] = vwant[i] = 0.0f;
	for (int r = 0; r < rows; r++) {
		if (slots[r] < 0)
			continue;
		for (int i = 0; i < nk; i++) {
			size_t c = (size_t)slots[r] * nk + i;

			kgot[c] = k_bf16_to_f32(hk[c]);
			vgot[c] = k_bf16_to_f32(hv[c]);
			kwant[c] = k_bf16_to_f32(k_f32_to_bf16(kref[(size_t)r * nk + i]));
			vwant[c] = k_bf16_to_f32(k_f32_to_bf16(src[vo + r * vrs + i]));
		}
	}
	snprintf(shape, sizeof(shape), "rows %d H %d KV %d D %d%s%s%s", rows, H, KV, D,
		 qk_norm ? " qknorm" : "", interleaved ? " il" : "", fused ? " fused" : " split");
	report("qkv_post q", shape, got, qref, (size_t)rows * nq, REL_TOL);
	report("qkv_post k", shape, kgot, kwant, ncache, 1e-5);
	report("qkv_post v", shape, vgot, vwant, ncache, 0);
	cudaFree(dsrc), cudaFree(dqw), cudaFree(dkw), cudaFree(dinv), cudaFree(dpos);
	cudaFree(dslots), cudaFree(dq), cudaFree(dk), cudaFree(dv);
	k_rope_fini(&rope);
	free(src), free(qw), free(kw), free(qref), free(kref), free(got), free(kgot), free(vgot);
	free(kwant), free(vwant), free(hk), free(hv), free(pos), free(slots);
}

/* ---- fused MLA inputs: latent norm + both ropes + cache append -------------- */

/* Rows of q (rows, H, nope + pe) and kv_a (rows, kv_rs) through k_cuda_mla_post against
 * k_cpu_rmsnorm + k_cpu_rope (q_pe, key) + bf16 rounding, as forward.c's op-by-op path.
 * fused: q and kv_a side by side in the rows of one source (mla_prep's [q | kv_a]), q
 * out into a poisoned buffer: every value of it must be written (nope and the unrotated
 * tail copied, the rotated part as in place) and the source left as it was.
 * Every fourth row writes no cache entry (slot -1); the slots are scattered, unwritten
 * cache stays poisoned, kv_a is only read. q: REL_TOL (in practice 0); cache: bit for
 * bit (the fp64 sum of squares in another order could move one rounding: about never). */
static void test_mla_post(int rows, int H, int nope, int pe, int lora, int kv_pad,
			  const struct k_rope_params *rp, const char *name, int fused)
{
	const int qk = nope + pe, width = lora + pe, kv_rs = width + kv_pad;
	const int n_slots = (rows + 7) % 5 ? rows + 7 : rows + 8;	/* coprime to 5 */
	const size_t nq = (size_t)rows * H * qk, nkv = (size_t)rows * kv_rs;
	const size_t ncache = (size_t)n_slots * width;
	float *q = test_rand_floats(nq, 2.0f, &seed), *kv = test_rand_floats(nkv, 3.0f, &seed);
	float *w = test_rand_floats(lora, 1.0f, &seed);
	float *qref = malloc(sizeof(float) * nq), *kvref = malloc(sizeof(float) * nkv);
	float *qgot = malloc(sizeof(float) * nq), *kvgot = malloc(sizeof(float) * nkv);
	uint16_t *hc = malloc(sizeof(uint16_t) * ncache);
	int32_t *pos = malloc(sizeof(int32_t) * rows), *slots = malloc(sizeof(int32_t) * rows);
	size_t bad = 0, kept = 0, written = 0;
	struct k_rope rope;
	struct k_cuda_mla_post_args a;
	float *dq, *dkv, *dw, *dinv, *dsrc = NULL;
	const long src_rs = (long)H * qk + kv_rs + 4;	/* fused rows, a little padding */
	uint16_t *dc;
	int32_t *dpos, *dslots;
	char shape[128];

	CHECK(k_rope_init(&rope, rp) == 0, "rope init");
	for (int r = 0; r < rows; r++) {	/* distinct slots: 5 and n_slots share no factor */
		pos[r] = r == 0 ? 0 : (int32_t)((test_randf(&seed) + 1) * 0.5f * 32768);
		slots[r] = r % 4 == 3 ? -1 : (r * 5 + 2) % n_slots;
		written += slots[r] >= 0;
	}
	memcpy(qref, q, sizeof(float) * nq);
	memcpy(kvref, kv, sizeof(float) * nkv);
	k_cpu_rmsnorm(kvref, kv_rs, kvref, kv_rs, w, K_F32, rows, lora, 1e-6f);
	k_cpu_rope(&rope, qref + nope, rows, H, H * qk, qk, pos);
	k_cpu_rope(&rope, kvref + lora, rows, 1, kv_rs, 0, pos);

	dq = dup_to_device(q, sizeof(float) * nq);
	dkv = dup_to_device(kv, sizeof(float) * nkv);
	if (fused) {	/* [q | kv_a] rows in dsrc; dq poisoned */
		const size_t hq = (size_t)H * qk;

		dsrc = dalloc(sizeof(float) * (size_t)rows * src_rs);
		for (int r = 0; r < rows; r++) {
			CU(cudaMemcpy(dsrc + (size_t)r * src_rs, q + r * hq, sizeof(float) * hq,
				      cudaMemcpyHostToDevice));
			CU(cudaMemcpy(dsrc + (size_t)r * src_rs + hq, kv + (size_t)r * kv_rs,
				      sizeof(float) * kv_rs, cudaMemcpyHostToDevice));
		}
		poison(dq, sizeof(float) * nq);
	}
	dw = dup_to_device(w, sizeof(float) * lora);
	dinv = dup_to_device(rope.inv_freq, sizeof(float) * (size_t)rope.dim / 2);
	dpos = dup_to_device(pos, sizeof(int32_t) * rows);
	dslots = dup_to_device(slots, sizeof(int32_t) * rows);
	dc = dalloc(sizeof(uint16_t) * ncache);
	poison(dc, sizeof(uint16_t) * ncache);
	a = (struct k_cuda_mla_post_args){
		.q_pe = dq + nope, .q_rs = (long)H * qk, .q_hs = qk, .n_heads = H, .kv = dkv,
		.kv_rs = kv_rs, .rows = rows, .kv_lora = lora, .pe_dim = pe, .norm = dw,
		.eps = 1e-6f, .inv_freq = dinv, .rot_dim = rope.dim, .interleaved = rope.interleaved,
		.attn_factor = rope.attn_factor, .pos = dpos, .cache = dc, .slots = dslots,
	};
	if (fused) {
		a.q_src_pe = dsrc + nope;
		a.q_src_rs = src_rs;
		a.nope_dim = nope;
		a.kv = dsrc + (size_t)H * qk;
		a.kv_rs = src_rs;
	}
	CHECK(k_cuda_mla_post(stream, &a) == 0, "mla_post launch");
	to_host(qgot, dq, sizeof(float) * nq);
	if (fused) {	/* the source's kv_a part, and its q part unchanged */
		float *src = malloc(sizeof(float) * (size_t)rows * src_rs);

		to_host(src, dsrc, sizeof(float) * (size_t)rows * src_rs);
		for (int r = 0; r < rows; r++) {
			memcpy(kvgot + (size_t)r * kv_rs, src + (size_t)r * src_rs + (size_t)H * qk,
			       sizeof(float) * kv_rs);
			for (int i = 0; i < H * qk; i++)
				bad += memcmp(&src[(size_t)r * src_rs + i], &q[(size_t)r * H * qk + i],
					      sizeof(float)) != 0;
		}
		free(src);
		CHECK(!bad, "mla_post fused: %zu source q values changed", bad);
		bad = 0;
	} else {
		to_host(kvgot, dkv, sizeof(float) * nkv);
	}
	to_host(hc, dc, sizeof(uint16_t) * ncache);
	for (size_t i = 0; i < ncache; i++)
		kept += hc[i] == 0xffff;
	for (int r = 0; r < rows; r++) {
		if (slots[r] < 0)
			continue;
		for (int i = 0; i < width; i++) {
			const size_t c = (size_t)slots[r] * width + i;

			bad += hc[c] != k_f32_to_bf16(kvref[(size_t)r * kv_rs + i]);
			kept -= hc[c] == 0xffff;	/* 0xffff is a NaN: never a right value */
		}
	}
	snprintf(shape, sizeof(shape), "%s rows %d H %d nope %d pe %d/%d lora %d%s%s%s", name, rows,
		 H, nope, rope.dim, pe, lora, rp->interleaved ? " il" : "", kv_pad ? " padded" : "",
		 fused ? " fused" : "");
	CHECK(kept == ncache - written * width, "mla_post %s: %zu cache values outside the slots "
	      "written", shape, ncache - written * width - kept);
	report("mla_post q", shape, qgot, qref, nq, REL_TOL);
	report("mla_post kv_a", shape, kvgot, kv, nkv, 0);
	printf("%-14s %-40s %zu bf16 values differ  %s\n", "mla_post cache", shape, bad,
	       bad ? "FAIL" : "PASS");
	CHECK(!bad, "mla_post cache %s: %zu bf16 values differ", shape, bad);
	cudaFree(dq), cudaFree(dkv), cudaFree(dw), cudaFree(dinv), cudaFree(dpos);
	cudaFree(dslots), cudaFree(dc), cudaFree(dsrc);
	k_rope_fini(&rope);
	free(q), free(kv), free(w), free(qref), free(kvref), free(qgot), free(kvgot), free(hc);
	free(pos), free(slots);
}

static void test_mla_post_all(void)
{
	struct k_rope_params yarn = { .type = K_ROPE_YARN, .theta = 10000, .dim = 64,
		.factor = 40, .original_max_pos = 4096, .beta_fast = 32, .beta_slow = 1,
		.mscale = 1, .mscale_all_dim = 0.707, .truncate = 1 };
	struct k_rope_params def = { .type = K_ROPE_DEFAULT, .theta = 10000, .dim = 64 };
	struct k_rope_params l3 = { .type = K_ROPE_LLAMA3, .theta = 500000, .dim = 16,
		.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
		.original_max_pos = 8192 };
	struct k_rope_params lin = { .type = K_ROPE_LINEAR, .theta = 10000, .dim = 6, .factor = 4,
		.interleaved = 1 };
	const int rows[] = { 1, 8, 64 };

	for (int fused = 0; fused < 2; fused++) {	/* in place; from [q | kv_a] rows */
		def.dim = 64;
		for (int r = 0; r < 3; r++)
			for (int il = 0; il < 2; il++) {	/* DeepSeek-V2-Lite: 16 heads, 512 + 64 */
				yarn.interleaved = def.interleaved = il;
				test_mla_post(rows[r], 16, 128, 64, 512, 0, &yarn, "yarn", fused);
				test_mla_post(rows[r], 16, 128, 64, 512, 0, &def, "default", fused);
			}
		def.interleaved = 0;
		test_mla_post(3, 128, 128, 64, 512, 0, &yarn, "yarn", fused);	/* V3: 128 heads */
		test_mla_post(5, 3, 12, 16, 37, 3, &l3, "llama3", fused);	/* odd latent, padded */
		test_mla_post(7, 5, 7, 10, 2048, 1, &lin, "linear", fused);	/* rope 6 of 10 */
		def.dim = 2;
		test_mla_post(2, 1, 1, 2, 1, 0, &def, "default", fused);	/* one pair, latent 1 */
	}
}

int main(void)
{
	const int dims[] = { 1, 7, 1000, 4096, 7168 };
	const int rows[] = { 1, 64, 257 };
	struct k_cuda_tuning late;

	if (!test_gpu_present("test_cuda_ops"))
		return 77;
	CU(cudaStreamCreate(&stream));

	for (int d = 0; d < 5; d++) {
		test_embed(1, dims[d]);
		test_embed(257, dims[d]);
	}
	for (int d = 0; d < 5; d++)
		for (int r = 0; r < 3; r++) {
			test_rmsnorm(rows[r], dims[d], dims[d], dims[d], 0);
			test_add_rmsnorm(rows[r], dims[d], r == 1);
		}
	test_rmsnorm(64, 512, 576, 576, 1);	/* MLA kv_a: a slice normalised in place */
	test_rmsnorm(257 * 8, 128, 128, 128, 1);	/* per-head q/k norm */
	test_rmsnorm(5, 1536, 1539, 1600, 0);	/* odd strides */
	test_rmsnorm(3, 7, 9, 11, 0);
	for (int d = 0; d < 5; d++) {
		test_add((size_t)dims[d], 0);
		test_silu_mul((size_t)dims[d], 0, 0);
	}
	test_add((size_t)64 * 4096 + 3, 0);
	test_add(1003, 1);
	test_silu_mul((size_t)64 * 14336 + 5, 0, 1);
	test_silu_mul(1003, 3, 0);
	for (int r = 0; r < 3; r++) {
		test_silu_mul_rows(rows[r], 7);
		test_silu_mul_rows(rows[r], 1408);
	}
	test_silu_mul_rows(2, 1);
	test_silu_mul_rows(3, 1412);	/* four columns a thread */
	test_silu_mul_rows(64, 14336);	/* Llama-3.1-8B at batch 64 */
	test_rope_all();
	for (int r = 0; r < 3; r++)
		for (int v = 0; v < 4; v++)	/* Llama 3 8B and Qwen3 heads; fused and split */
			test_qkv_post(rows[r], 32, 8, 128, v & 1, 0, v >> 1);
	test_qkv_post(5, 6, 2, 64, 1, 1, 1);	/* interleaved pairs */
	test_qkv_post(3, 3, 3, 14, 0, 0, 0);	/* odd sizes, MHA */
	test_mla_post_all();
	late = *k_cuda_tuning();
	late.mla_post_early = 0;	/* the cos/sin table after the PDL wait */
	k_cuda_tuning_set(&late);
	printf("mla_post again, mla_post_early 0:\n");
	test_mla_post_all();
	k_cuda_tuning_set(NULL);

	cudaStreamDestroy(stream);
	return test_result("test_cuda_ops");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_ops: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
