/* The quantized-weight linears against references on the host, on random payloads and
 * scales (fp8 block / channel / tensor scales, int4 groups of 32 and 128):
 * - the CUDA-core GEMV (k_cuda_linear_q): vectorised path (K a multiple of 32) and the
 *   element-by-element one (odd K, partial blocks and groups, misaligned x), M = 1..9,
 *   y = and y +=, against k_cpu_linear_q: both fp32 from the same exact values, rel L2
 *   per row <= 1e-5;
 * - the tensor-core GEMV in both forms (K_CUDA_LINEAR_Q_STREAM, _MMA), M = 1..8 (and 17:
 *   MMA three launches), STREAM at M = 9, 16, 33, 64 in one launch (x in chunks of k
 *   where the slice is long), one CTA
 *   to a cluster of 8 and slices of many stages, partial slabs, f32 and f16 scales: against a double-precision
 *   reference on x rounded to f16 as the kernel rounds it, rel L2 per row <= 1e-4
 *   (fp32 tensor-core sums), and within 2e-3 of the reference on fp32 x (the f16
 *   rounding of x, printed); the same bits on a second run;
 * - the decode GEMV (K_CUDA_LINEAR_Q_GEMV) at M = 1..8 (and 17: three launches): K split
 *   over 1..8 plain CTAs, partial row tiles and stages, the x slice near its 64 KB, each
 *   with the split model's plan and with the split timed fastest (KDEC_LINEAR_Q_TUNE),
 *   and on every projection shape of the supported models (fp8 blocks, int4 g32; M 1, and
 *   8 where small; tuned), the same tolerances and the same bits on a second run; its
 *   SwiGLU form (k_cuda_linear_q_gemv_swiglu) bit for bit as k_cuda_silu_mul_rows then
 *   the GEMV; its RMSNorm form and the streaming form's (k_cuda_linear_q_norm_run) bit
 *   for bit as k_cuda_rmsnorm then the same kind, y and the norm's out (K 1024: the
 *   norm's warp order; 2048 .. 16384 its block order);
 * - the tile kernel (K_CUDA_LINEAR_Q_TILE) at M = 1..65 (65: two launches): n8 tiles 2,
 *   4, 8, K split over up to 8 CTAs and one slice, partial row tiles and stages, the
 *   same tolerances and the same bits on a second run (fixed-order split sums); on its
 *   mma.sync kernel and on the wgmma one (KDEC_LINEAR_QWG, where the device runs it)
 *   at 128 and 256 rows a CTA, and at M 64 on the supported models' projections;
 * - the DEQUANT kind (weights to f16, cuBLAS), M = 1, 9, 33: against the reference on
 *   f16 weights and f16 x, <= 1e-4; k_cuda_quant_dequant itself bit for bit against the
 *   host's dequantization rounded to bf16 and to f16.
 * KD_TEST_QUICK=1: the sanitizers' size (main says what it leaves out), 2: racecheck's
 * (fewer M and deep slices, every kernel form and tile width still); KD_TEST_PART=mma
 * the tensor-core kernels only, =wide their forms for 8 < M <= 64 only (racecheck
 * reaches those in its time), =gemv the M <= 8 GEMV alone, =tile the tile kernel alone;
 * KD_TEST_CASES=SUBSTRING some formats only.
 * Exits 77 without a GPU. Timing: tests/bench/bench_cuda_linear_q. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"

#define MMA_TOL 1e-4	/* against the reference on the values the kernel multiplies */
#define F16X_TOL 2e-3	/* against the reference on fp32 x: x rounded to f16 */
#define MAX_M 64
#define MAX_K 16384

static unsigned long long seed = 0x9e3779b97f4a7c15ull;
static struct k_pool *pool;
static cudaStream_t stream;
static struct k_cuda_linear *lin;
static uint16_t *wtmp;		/* device scratch for DEQUANT */
static size_t wtmp_elems;

struct qcase {
	const char *what;
	enum k_qfmt fmt;
	int block_rows, block_cols;	/* 0: the whole dim */
	enum k_dtype scale_dtype;	/* as a checkpoint stores it */
};

/* A random weight (N, K) as q says: payload bytes, host scales in scale_dtype, the same
 * scales in fp32 for the device. */
static void make_weight(const struct qcase *c, int N, int K, struct k_quant *q, uint8_t **w,
			size_t *wbytes, void **hs, float **fs, size_t *ns)
{
	*q = (struct k_quant){ .fmt = c->fmt, .scale_dtype = c->scale_dtype,
			       .block_rows = c->block_rows ? c->block_rows : N,
			       .block_cols = c->block_cols ? c->block_cols : K };
	q->scale_cols = (K + q->block_cols - 1) / q->block_cols;
	*ns = (size_t)((N + q->block_rows - 1) / q->block_rows) * (size_t)q->scale_cols;
	*wbytes = (size_t)N * k_quant_row_bytes(c->fmt, K);
	*w = malloc(*wbytes);
	*hs = malloc(*ns * 4);
	*fs = malloc(*ns * 4);
	for (size_t i = 0; i < *wbytes; i++) {
		uint8_t b = (uint8_t)((test_randf(&seed) + 1.0f) * 127.99f);

		/* e4m3: no NaN (0x7f/0xff) */
		(*w)[i] = c->fmt == K_Q_FP8 && (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
	}
	for (size_t i = 0; i < *ns; i++) {
		float s = (0.5f + 0.5f * (test_randf(&seed) + 1.0f)) / sqrtf((float)K) *
			  (c->fmt == K_Q_FP8 ? 0.05f : 0.3f);

		if (c->scale_dtype == K_BF16) {
			((uint16_t *)*hs)[i] = k_f32_to_bf16(s);
			s = k_bf16_to_f32(((uint16_t *)*hs)[i]);
		} else {
			((float *)*hs)[i] = s;
		}
		(*fs)[i] = s;
	}
}

static void run_case(const struct qcase *c, int N, int K, int M, int accumulate, int misalign)
{
	struct k_quant q, dq;
	uint8_t *w;
	void *hs;
	float *fs, *x, *y0, *ref, *out, *dx, *dy, *dfs;
	size_t wbytes, ns, nx = (size_t)M * K + 4, ny = (size_t)M * N;
	void *dw;
	double worst = 0;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	x = test_rand_floats(nx, 1.0f, &seed);
	y0 = test_rand_floats(ny, 1.0f, &seed);
	ref = malloc(ny * sizeof(float));
	out = malloc(ny * sizeof(float));
	q.scale = hs;
	k_cpu_linear_q(pool, ref, x + misalign, w, K_BF16, &q, M, N, K);
	if (accumulate)
		for (size_t i = 0; i < ny; i++)
			ref[i] += y0[i];
	dw = dup_to_device(w, wbytes);
	dfs = dup_to_device(fs, ns * 4);
	dx = dup_to_device(x, nx * sizeof(float));
	dy = dup_to_device(y0, ny * sizeof(float));
	dq = q;
	dq.scale = dfs;
	dq.scale_dtype = K_F32;
	if (dw && dfs && dx && dy) {
		int ret = k_cuda_linear_q(stream, dy, dx + misalign, dw, &dq, M, N, K, accumulate);

		CHECK(ret == 0, "%s N %d K %d M %d: rc %d", c->what, N, K, M, ret);
		CU(cudaStreamSynchronize(stream));
		CU(cudaMemcpy(out, dy, ny * sizeof(float), cudaMemcpyDeviceToHost));
		for (int m = 0; m < M; m++) {
			double d = 0, r = 0;

			for (int n = 0; n < N; n++) {
				double e = out[(size_t)m * N + n] - ref[(size_t)m * N + n];

				d += e * e;
				r += (double)ref[(size_t)m * N + n] * ref[(size_t)m * N + n];
			}
			d = sqrt(d / (r > 0 ? r : 1));
			worst = test_err_max(worst, d);
		}
		CHECK(worst <= 1e-5, "%s N %d K %d M %d acc %d misalign %d (%s path): rel L2 %.3g",
		      c->what, N, K, M, accumulate, misalign,
		      k_cuda_linear_q_vector(&q, K) && !misalign ? "vector" : "generic", worst);
	}
	printf("  %-12s N %5d K %5d M %d acc %d %-7s rel L2 %.2e\n", c->what, N, K, M, accumulate,
	       k_cuda_linear_q_vector(&q, K) && !misalign ? "vector" : "generic", worst);
	cudaFree(dw);
	cudaFree(dfs);
	cudaFree(dx);
	cudaFree(dy);
	free(w);
	free(hs);
	free(fs);
	free(x);
	free(y0);
	free(ref);
	free(out);
}

static const struct qcase cases[] = {
	{ "fp8-block", K_Q_FP8, 128, 128, K_F32 },
	{ "fp8-channel", K_Q_FP8, 1, 0, K_BF16 },
	{ "fp8-tensor", K_Q_FP8, 0, 0, K_F32 },
	{ "int4-g32", K_Q_INT4, 1, 32, K_BF16 },
	{ "int4-g128", K_Q_INT4, 1, 128, K_BF16 },
};

static float round_f16(float v)
{
	return k_f16_to_f32(k_f32_to_f16(v));
}

/* The two references of run_kind, in one pass over the weight: ref (M, N) in double = x
 * rounded to f16 @ w^T over w's exact dequantized values (each rounded to f16 where
 * w16), ref32 = fp32 x @ the exact values. Rows split over the pool's threads (the model
 * shapes are up to 264 M values). */
struct ref_job {
	double *ref, *ref32;
	const float *x, *x16;
	const uint8_t *w;
	const struct k_quant *hq;
	int M, N, K, w16, n_tasks;
};

static void ref_task(void *arg, int task)
{
	const struct ref_job *j = arg;
	const int n0 = (int)((long)j->N * task / j->n_tasks);
	const int n1 = (int)((long)j->N * (task + 1) / j->n_tasks);
	float *row = malloc((size_t)j->K * sizeof(float));

	for (int n = n0; n < n1 && row; n++) {
		k_quant_row_to_f32(row, j->w, j->hq, j->K, n, 0, j->K);
		for (int m = 0; m < j->M; m++) {
			const float *xr = j->x + (size_t)m * j->K, *hr = j->x16 + (size_t)m * j->K;
			double acc = 0, acc32 = 0;

			for (int k = 0; k < j->K; k++) {
				acc += (double)(j->w16 ? round_f16(row[k]) : row[k]) * hr[k];
				acc32 += (double)row[k] * xr[k];
			}
			j->ref[(size_t)m * j->N + n] = acc;
			j->ref32[(size_t)m * j->N + n] = acc32;
		}
	}
	free(row);
}

static void ref_double(double *ref, double *ref32, const float *x, const uint8_t *w,
		       const struct k_quant *hq, int M, int N, int K, int w16)
{
	float *x16 = malloc((size_t)M * K * sizeof(float));
	struct ref_job j = { ref, ref32, x, x16, w, hq, M, N, K, w16, N < 64 ? 1 : 64 };

	for (size_t i = 0; i < (size_t)M * K; i++)
		x16[i] = round_f16(x[i]);
	k_pool_run(pool, ref_task, &j, j.n_tasks);
	free(x16);
}

/* Worst rel L2 over the rows of out against ref (+ y0 where accumulate). */
static double worst_row(const float *out, const double *ref, const float *y0, int accumulate,
			int M, int N)
{
	double worst = 0;

	for (int m = 0; m < M; m++) {
		double d = 0, r = 0;

		for (int n = 0; n < N; n++) {
			size_t i = (size_t)m * N + n;
			double want = ref[i] + (accumulate ? y0[i] : 0.0), e = out[i] - want;

			d += e * e;
			r += want * want;
		}
		worst = test_err_max(worst, sqrt(d / (r > 0 ? r : 1)));
	}
	return worst;
}

/* kind (STREAM, MMA, TILE or DEQUANT) through k_cuda_linear_q_run against ref_double on the values it
 * multiplies; f16s: the device scales in f16 (int4 scales here are bf16 values, f16 exact). */
/* The ns scales fs on the device: in f16 where f16s (as the backend keeps int4's), else
 * fp32. */
static void *scales_to_device(const float *fs, size_t ns, int f16s)
{
	uint16_t *h;
	void *d;

	if (!f16s)
		return dup_to_device(fs, ns * 4);
	h = malloc(ns * 2);
	for (size_t i = 0; i < ns; i++)
		h[i] = k_f32_to_f16(fs[i]);
	d = dup_to_device(h, ns * 2);
	free(h);
	return d;
}

/* KDEC_LINEAR_Q_TUNE as installed for the launches that follow. */
static void set_qgemv_tune(int on)
{
	struct k_cuda_tuning t = *k_cuda_tuning();

	t.linear_q_tune = on;
	k_cuda_tuning_set(&t);
}

/* The fp8 tile kind's kernel: on = 0 the mma.sync one, else the wgmma one (where the
 * device runs it) with rows weight rows a CTA (0: its default by M). */
static void set_qwg(int on, int rows)
{
	struct k_cuda_tuning t = *k_cuda_tuning();

	t.linear_qwg = on;
	t.linear_qwg_rows = rows;
	k_cuda_tuning_set(&t);
}

static void run_kind(const struct qcase *c, int kind, int N, int K, int M,
		     int accumulate, int f16s)
{
	struct k_quant q, dq;
	uint8_t *w;
	void *hs, *dsc = NULL;
	float *fs, *x, *y0, *out, *out2, *dx, *dy;
	double *ref, *ref32;
	size_t wbytes, ns, nx = (size_t)M * K, ny = (size_t)M * N;
	void *dw;
	int w16 = kind == K_CUDA_LINEAR_Q_DEQUANT;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	x = test_rand_floats(nx, 1.0f, &seed);
	y0 = test_rand_floats(ny, 1.0f, &seed);
	ref = malloc(ny * sizeof(double));
	ref32 = malloc(ny * sizeof(double));
	out = malloc(ny * sizeof(float));
	out2 = malloc(ny * sizeof(float));
	q.scale = hs;
	ref_double(ref, ref32, x, w, &q, M, N, K, w16);
	dsc = scales_to_device(fs, ns, f16s);
	dw = dup_to_device(w, wbytes);
	dx = dup_to_device(x, nx * sizeof(float));
	dy = dalloc(ny * sizeof(float));
	dq = q;
	dq.scale = dsc;
	dq.scale_dtype = f16s ? K_F16 : K_F32;
	if (dw && dsc && dx && dy) {
		double e, e32, dmax = 0;
		size_t nd = 0, nd_y0 = 0, first = 0;
		int ret = 0;

		for (int rep = 0; rep < 2 && !ret; rep++) {
			/* on the kernel's stream: a pageable cudaMemcpy may return before its
			 * DMA lands, and `stream` (non-blocking) does not wait for it */
			CU(cudaMemcpyAsync(dy, y0, ny * sizeof(float), cudaMemcpyHostToDevice, stream));
			ret = k_cuda_linear_q_run(lin, kind, dy, dx, dw, &dq, M, N, K, accumulate, wtmp,
						  wtmp_elems);
			CU(cudaStreamSynchronize(stream));
			CU(cudaMemcpy(rep ? out2 : out, dy, ny * sizeof(float), cudaMemcpyDeviceToHost));
		}
		CHECK(ret == 0, "%s %s N %d K %d M %d: rc %d", c->what, k_cuda_linear_q_kind_name(kind),
		      N, K, M, ret);
		e = worst_row(out, ref, y0, accumulate, M, N);
		e32 = worst_row(out, ref32, y0, accumulate, M, N);
		CHECK(e <= MMA_TOL, "%s %s N %d K %d M %d acc %d f16 scales %d: rel L2 %.3g against "
		      "the reference on the values it multiplies", c->what,
		      k_cuda_linear_q_kind_name(kind), N, K, M, accumulate, f16s, e);
		CHECK(e32 <= F16X_TOL, "%s %s N %d K %d M %d: rel L2 %.3g against fp32 x", c->what,
		      k_cuda_linear_q_kind_name(kind), N, K, M, e32);
		for (size_t i = 0; i < ny; i++) {	/* what differs, for the message */
			if (!memcmp(&out[i], &out2[i], sizeof(float)))
				continue;
			first = nd++ ? first : i;
			nd_y0 += !memcmp(&out2[i], &y0[i], sizeof(float));
			dmax = fmax(dmax, fabs((double)out[i] - out2[i]));
		}
		CHECK(kind == K_CUDA_LINEAR_Q_DEQUANT || nd == 0,
		      "%s %s N %d K %d M %d: two runs differ: %zu of %zu values (first m %zu n %zu), "
		      "max |diff| %.3g, %zu of them y0's; second run rel L2 %.3g", c->what,
		      k_cuda_linear_q_kind_name(kind), N, K, M, nd, ny, first / (size_t)N,
		      first % (size_t)N, dmax, nd_y0, worst_row(out2, ref, y0, accumulate, M, N));
		printf("  %-12s %-7s N %5d K %5d M %2d acc %d f16s %d rel L2 %.2e (fp32 x: %.2e)\n",
		       c->what, k_cuda_linear_q_kind_name(kind), N, K, M, accumulate, f16s, e, e32);
	}
	cudaFree(dw);
	cudaFree(dsc);
	cudaFree(dx);
	cudaFree(dy);
	free(w);
	free(hs);
	free(fs);
	free(x);
	free(y0);
	free(ref);
	free(ref32);
	free(out);
	free(out2);
}

/* k_cuda_linear_q_gemv_swiglu on a random gate_up (M, 2K) against k_cuda_silu_mul_rows
 * then the GEMV kind on its output: the same bits (y = and y +=). */
static void check_swiglu(const struct qcase *c, int N, int K, int M, int accumulate, int f16s)
{
	struct k_quant q, dq;
	uint8_t *w;
	void *hs, *dsc;
	float *fs, *gu = test_rand_floats((size_t)M * 2 * K, 3.0f, &seed);
	float *y0 = test_rand_floats((size_t)M * N, 1.0f, &seed);
	float *a = malloc((size_t)M * N * sizeof(float)), *b = malloc((size_t)M * N * sizeof(float));
	size_t wbytes, ns, ny = (size_t)M * N, nd = 0;
	float *dgu, *dx, *dya, *dyb;
	void *dw;
	int ra = -1, rb = -1;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	dsc = scales_to_device(fs, ns, f16s);
	dw = dup_to_device(w, wbytes);
	dgu = dup_to_device(gu, (size_t)M * 2 * K * sizeof(float));
	dx = dalloc((size_t)M * K * sizeof(float));
	dya = dup_to_device(y0, ny * sizeof(float));
	dyb = dup_to_device(y0, ny * sizeof(float));
	dq = q;
	dq.scale = dsc;
	dq.scale_dtype = f16s ? K_F16 : K_F32;
	if (dw && dsc && dgu && dx && dya && dyb) {
		ra = k_cuda_silu_mul_rows(stream, dx, dgu, M, K);
		if (!ra)
			ra = k_cuda_linear_q_run(lin, K_CUDA_LINEAR_Q_GEMV, dya, dx, dw, &dq, M, N, K,
						 accumulate, wtmp, wtmp_elems);
		rb = k_cuda_linear_q_gemv_swiglu(lin, dyb, dgu, dw, &dq, M, N, K, accumulate);
		CU(cudaStreamSynchronize(stream));
		CU(cudaMemcpy(a, dya, ny * sizeof(float), cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(b, dyb, ny * sizeof(float), cudaMemcpyDeviceToHost));
		for (size_t i = 0; i < ny; i++)
			nd += memcmp(&a[i], &b[i], sizeof(float)) != 0;
	}
	CHECK(ra == 0 && rb == 0 && nd == 0, "%s swiglu GEMV N %d K %d M %d acc %d f16s %d: rc %d "
	      "/ %d, %zu of %zu values differ from SwiGLU then the GEMV", c->what, N, K, M,
	      accumulate, f16s, ra, rb, nd, ny);
	cudaFree(dw);
	cudaFree(dsc);
	cudaFree(dgu);
	cudaFree(dx);
	cudaFree(dya);
	cudaFree(dyb);
	free(w);
	free(hs);
	free(fs);
	free(gu);
	free(y0);
	free(a);
	free(b);
}

/* k_cuda_linear_q_norm_run of kind (GEMV or STREAM) on a random x (M, K) and norm
 * weights against k_cuda_rmsnorm then that kind on its output: the same bits, in y (=
 * and +=) and in the norm's out (written by the fused call too, where out_too). */
static void check_norm(const struct qcase *c, int kind, int N, int K, int M, int accumulate,
		       int f16s, int out_too)
{
	const float eps = 1e-5f;
	struct k_quant q, dq;
	uint8_t *w;
	void *hs, *dsc;
	float *fs, *x = test_rand_floats((size_t)M * K, 3.0f, &seed);
	float *nw = test_rand_floats((size_t)K, 1.5f, &seed);
	float *y0 = test_rand_floats((size_t)M * N, 1.0f, &seed);
	size_t wbytes, ns, ny = (size_t)M * N, nx = (size_t)M * K, nd = 0, nod = 0;
	float *a = malloc(ny * sizeof(float)), *b = malloc(ny * sizeof(float));
	float *ha = malloc(nx * sizeof(float)), *hb = malloc(nx * sizeof(float));
	float *dx, *dnw, *dha, *dhb, *dya, *dyb;
	void *dw;
	int ra = -1, rb = -1;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	dsc = scales_to_device(fs, ns, f16s);
	dw = dup_to_device(w, wbytes);
	dx = dup_to_device(x, nx * sizeof(float));
	dnw = dup_to_device(nw, (size_t)K * sizeof(float));
	dha = dalloc(nx * sizeof(float));
	dhb = dalloc(nx * sizeof(float));
	dya = dup_to_device(y0, ny * sizeof(float));
	dyb = dup_to_device(y0, ny * sizeof(float));
	dq = q;
	dq.scale = dsc;
	dq.scale_dtype = f16s ? K_F16 : K_F32;
	if (dw && dsc && dx && dnw && dha && dhb && dya && dyb && a && b && ha && hb) {
		const struct k_cuda_xnorm n = { dnw, eps, out_too ? dhb : NULL };

		ra = k_cuda_rmsnorm(stream, dha, K, dx, K, dnw, M, K, eps);
		if (!ra)
			ra = k_cuda_linear_q_run(lin, kind, dya, dha, dw, &dq, M, N, K, accumulate,
						 wtmp, wtmp_elems);
		CU(cudaMemset(dhb, 0xff, nx * sizeof(float)));	/* NaN where not written */
		rb = k_cuda_linear_q_norm_run(lin, kind, dyb, dx, &n, dw, &dq, M, N, K, accumulate);
		CU(cudaStreamSynchronize(stream));
		CU(cudaMemcpy(a, dya, ny * sizeof(float), cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(b, dyb, ny * sizeof(float), cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(ha, dha, nx * sizeof(float), cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(hb, dhb, nx * sizeof(float), cudaMemcpyDeviceToHost));
		for (size_t i = 0; i < ny; i++)
			nd += memcmp(&a[i], &b[i], sizeof(float)) != 0;
		for (size_t i = 0; out_too && i < nx; i++)
			nod += memcmp(&ha[i], &hb[i], sizeof(float)) != 0;
	}
	CHECK(ra == 0 && rb == 0 && nd == 0 && nod == 0, "%s norm %s N %d K %d M %d acc %d "
	      "f16s %d out %d: rc %d / %d, %zu of %zu values and %zu of %zu normalised ones "
	      "differ from RMSNorm then the same kind", c->what, k_cuda_linear_q_kind_name(kind),
	      N, K, M, accumulate, f16s, out_too, ra, rb, nd, ny, nod, out_too ? nx : 0);
	cudaFree(dw);
	cudaFree(dsc);
	cudaFree(dx);
	cudaFree(dnw);
	cudaFree(dha);
	cudaFree(dhb);
	cudaFree(dya);
	cudaFree(dyb);
	free(w);
	free(hs);
	free(fs);
	free(x);
	free(nw);
	free(y0);
	free(a);
	free(b);
	free(ha);
	free(hb);
}

/* k_cuda_quant_dequant to bf16 and to f16, bit for bit against the host's values. */
static void check_dequant(const struct qcase *c, int N, int K)
{
	struct k_quant q, dq;
	uint8_t *w;
	void *hs;
	float *fs, *row = malloc((size_t)K * sizeof(float));
	size_t wbytes, ns, n = (size_t)N * K;
	uint16_t *got = malloc(n * 2), *dout = dalloc(n * 2);
	void *dw, *dsc;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	q.scale = hs;
	dw = dup_to_device(w, wbytes);
	dsc = dup_to_device(fs, ns * 4);
	dq = q;
	dq.scale = dsc;
	dq.scale_dtype = K_F32;
	for (int f16 = 0; f16 < 2 && dw && dsc && dout; f16++) {
		size_t bad = 0;

		CHECK(k_cuda_quant_dequant(stream, dout, f16 ? K_F16 : K_BF16, dw, &dq, N, K) == 0,
		      "%s dequant rc", c->what);
		CU(cudaStreamSynchronize(stream));
		CU(cudaMemcpy(got, dout, n * 2, cudaMemcpyDeviceToHost));
		for (int r = 0; r < N; r++) {
			k_quant_row_to_f32(row, w, &q, K, r, 0, K);
			for (int k = 0; k < K; k++)
				bad += got[(size_t)r * K + k] !=
				       (f16 ? k_f32_to_f16(row[k]) : k_f32_to_bf16(row[k]));
		}
		CHECK(bad == 0, "%s N %d K %d: %zu of %zu dequantized %s values differ from the host's",
		      c->what, N, K, bad, n, f16 ? "f16" : "bf16");
	}
	cudaFree(dw);
	cudaFree(dsc);
	cudaFree(dout);
	free(w);
	free(hs);
	free(fs);
	free(row);
	free(got);
}

static void test_bad_args(void)
{
	struct k_quant q = { .fmt = K_Q_FP8, .scale_dtype = K_BF16, .block_rows = 1, .block_cols = 32,
			     .scale_cols = 1 };
	float f;

	q.scale = &f;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 1, 1, 32, 0) == -EINVAL, "bf16 scales refused");
	q.scale_dtype = K_F32;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 0, 1, 32, 0) == -EINVAL, "M 0 refused");
	q.fmt = K_Q_NONE;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 1, 1, 32, 0) == -EINVAL, "no format refused");
}

int main(void)
{
	static const int Ms[] = { 1, 2, 5, 9 };
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	/* KD_TEST_QUICK (the sanitizer runs): every kernel form, every M, clusters and
	 * partial slabs still, without the largest shapes and with fewer CUDA-core M */
	const char *qe = getenv("KD_TEST_QUICK");
	const int quick = qe && *qe && strcmp(qe, "0");
	/* KD_TEST_QUICK=2 (racecheck, which tracks every shared-memory access): the
	 * tensor-core kinds at fewer M (every tile width and partial tile still), without
	 * the 14336-deep slices but the one of many stages a warp */
	const int race = quick && atoi(qe) >= 2;
	const size_t n_ms = quick ? 2 : sizeof(Ms) / sizeof(Ms[0]);
	/* KD_TEST_PART=mma: the tensor-core GEMV only (racecheck: no cuBLAS, whose split-K
	 * kernels it reports); KD_TEST_CASES=fp8 (a substring): those formats only */
	const char *part = getenv("KD_TEST_PART"), *only = getenv("KD_TEST_CASES");
	const int wide_only = part && !strcmp(part, "wide");	/* STREAM at 8 < M <= 64 only */
	/* KD_TEST_PART=gemv: the M <= 8 GEMV alone (linear_qgemv.cu) */
	const int gemv_only = part && !strcmp(part, "gemv");
	/* KD_TEST_PART=tile: the 8 < M <= 64 tile kernel alone (linear_qtile.cu) */
	const int tile_only = part && !strcmp(part, "tile");
	static const int small_kinds[3] = { K_CUDA_LINEAR_Q_STREAM, K_CUDA_LINEAR_Q_MMA,
					    K_CUDA_LINEAR_Q_GEMV };
	int n_sm = 0;
	const int mma_only = wide_only || gemv_only || tile_only || (part && !strcmp(part, "mma"));

	if (!test_gpu_present("test_cuda_linear_q"))
		return 77;
	if (k_pool_create(&pool, cpus > 16 ? 16 : cpus > 0 ? (int)cpus : 1)) {
		fprintf(stderr, "FATAL: k_pool_create\n");
		return 1;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	CU(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
	test_bad_args();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]) && !mma_only; i++) {
		if (only && !strstr(cases[i].what, only))
			continue;
		for (size_t j = 0; j < n_ms; j++) {
			const int M = quick ? Ms[3 * j] : Ms[j];	/* quick: 1 and 9 */

			run_case(&cases[i], 300, 512, M, (int)(j & 1), 0);	/* vector */
			run_case(&cases[i], 77, 200, M, (int)(j & 1), 0);	/* generic: K % 32 */
			run_case(&cases[i], 130, 384, M, 0, 1);		/* generic: x misaligned */
		}
		if (!quick)
			run_case(&cases[i], 1000, 4096, 1, 0, 0);
	}
	wtmp_elems = (size_t)4096 * 4128;
	wtmp = dalloc(wtmp_elems * 2);
	if (k_cuda_linear_create(&lin, stream, MAX_M, MAX_K) || !wtmp) {
		fprintf(stderr, "FATAL: k_cuda_linear_create or the scratch\n");
		return 1;
	}
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		static const int mma_ms[] = { 1, 2, 3, 5, 8 };
		const struct qcase *c = &cases[i];
		const int is_int4 = c->fmt == K_Q_INT4, odd_k = is_int4 ? 4128 : 4112;
		struct k_quant probe = { .fmt = c->fmt, .scale = &probe, .scale_dtype = K_F32,
					 .block_rows = 1, .block_cols = c->block_cols ? c->block_cols : 200,
					 .scale_cols = 1 };

		if (only && !strstr(c->what, only))
			continue;

		CHECK(k_cuda_linear_q_pick(&probe, (const float *)wtmp, wtmp, 1, 77, 200, 0) ==
		      K_CUDA_LINEAR_Q_WARP, "%s: K 200 is not the tensor-core GEMV's", c->what);
		probe.block_cols = c->block_cols ? c->block_cols : 4096;
		CHECK(k_cuda_linear_q_pick(&probe, (const float *)wtmp, wtmp, 64, 300, 4096, 1) ==
			      K_CUDA_LINEAR_Q_STREAM &&
		      k_cuda_linear_q_pick(&probe, (const float *)wtmp, wtmp, 65, 300, 4096, wtmp_elems) ==
			      K_CUDA_LINEAR_Q_DEQUANT,
		      "%s: M 64 takes STREAM, M 65 DEQUANT", c->what);
		/* the context's choice: TILE at 8 < M <= 64 where its x scratch holds x, but
		 * STREAM up to K_CUDA_LINEAR_Q_TILE_MIN_STREAM_M rows where that splits K over
		 * at most K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT CTAs (the split read off its plan); at
		 * M <= 8 GEMV or STREAM (below) */
		for (int si = 0; si < 2; si++) {
			static const int shp[2][2] = { { 4096, 4096 }, { 28672, 4096 } };
			const int N = shp[si][0], K = shp[si][1];
			char d[160];
			const char *gp;
			int B = 0, S = 0;
			enum k_cuda_linear_q_kind want16;

			probe.block_cols = c->block_cols ? c->block_cols : K;
			k_cuda_linear_q_describe(lin, K_CUDA_LINEAR_Q_STREAM, &probe, 16, N, K, d, sizeof(d));
			gp = strstr(d, "grid=");
			CHECK(gp && sscanf(gp, "grid=%dx%d", &B, &S) == 2, "%s: plan '%s'", c->what, d);
			want16 = S > K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT ? K_CUDA_LINEAR_Q_TILE
								    : K_CUDA_LINEAR_Q_STREAM;
			CHECK(k_cuda_linear_q_choose(lin, &probe, (const float *)wtmp, wtmp, 64, N, K,
						     (size_t)N * K) == K_CUDA_LINEAR_Q_TILE &&
			      k_cuda_linear_q_choose(lin, &probe, (const float *)wtmp, wtmp, 17, N, K, 0) ==
				      K_CUDA_LINEAR_Q_TILE &&
			      k_cuda_linear_q_choose(lin, &probe, (const float *)wtmp, wtmp, 16, N, K, 0) ==
				      want16,
			      "%s N %d K %d (stream split %d at M 16): choose M 64 and 17 tile, M 16 %s",
			      c->what, N, K, S, k_cuda_linear_q_kind_name(want16));
			/* M 1 and 8: GEMV where STREAM's clusters fill K_CUDA_LINEAR_Q_GEMV_FILL
			 * percent of two CTAs a multiprocessor (4096 x 4096: 32 x 8), else STREAM
			 * (28672 x 4096: 224 x 1) */
			for (int M = 1; M <= 8; M += 7) {
				enum k_cuda_linear_q_kind want;

				k_cuda_linear_q_describe(lin, K_CUDA_LINEAR_Q_STREAM, &probe, M, N, K, d,
							 sizeof(d));
				gp = strstr(d, "grid=");
				CHECK(gp && sscanf(gp, "grid=%dx%d", &B, &S) == 2, "%s: plan '%s'", c->what, d);
				want = S >= 2 && (long)B * S * 100 >= (long)K_CUDA_LINEAR_Q_GEMV_FILL * 2 * n_sm
					       ? K_CUDA_LINEAR_Q_GEMV : K_CUDA_LINEAR_Q_STREAM;
				CHECK(k_cuda_linear_q_choose(lin, &probe, (const float *)wtmp, wtmp, M, N, K,
							     (size_t)N * K) == want,
				      "%s N %d K %d M %d (stream %dx%d on %d SMs): choose %s", c->what, N, K,
				      M, B, S, n_sm, k_cuda_linear_q_kind_name(want));
				CHECK(n_sm != 132 || want == (N == 4096 ? K_CUDA_LINEAR_Q_GEMV
									 : K_CUDA_LINEAR_Q_STREAM),
				      "%s N %d M %d: on an H200 4096 x 4096 takes GEMV, 28672 x 4096 STREAM",
				      c->what, N, M);
			}
		}
		/* K past the context's x scratch (MAX_K): neither TILE nor DEQUANT (both round
		 * x into it), so STREAM at M = 64 */
		probe.block_cols = c->block_cols ? c->block_cols : MAX_K + 2048;
		CHECK(k_cuda_linear_q_choose(lin, &probe, (const float *)wtmp, wtmp, 64, 4096,
					     MAX_K + 2048, (size_t)4096 * (MAX_K + 2048)) ==
			      K_CUDA_LINEAR_Q_STREAM,
		      "%s K %d past the context: choose M 64 stream", c->what, MAX_K + 2048);
		for (size_t j = 0; j < sizeof(mma_ms) / sizeof(mma_ms[0]) && !wide_only && !tile_only; j++) {
			const int M = mma_ms[j], acc = (int)(j & 1), f16s = is_int4 && (j & 1);

			if (race && M != 1 && M != 5 && M != 8)
				continue;
			for (int ki = 0; ki < 3; ki++) {
				const int kind = small_kinds[ki];

				if (gemv_only && kind != K_CUDA_LINEAR_Q_GEMV)
					continue;
				run_kind(c, kind, 300, 512, M, acc, f16s);
				run_kind(c, kind, 1000, 4096, M, !acc, f16s);	/* cluster */
				run_kind(c, kind, 130, odd_k, M, acc, 0);	/* partial slab */
			}
		}
		/* GEMV alone: K split over 8 CTAs (N 64, K 2048: slices of 1 or 2 stages; N 8200,
		 * K 1024: 129 row tiles, the last of 8 rows, S 1 or 2), the x slice near its
		 * largest (K 16384 at M 8: 64 KB caps the slice), M 17 in three launches */
		for (int tune = 0; tune < 2 && !tile_only && !wide_only; tune++) {
			/* the model's splits, then the ones timed fastest (a shape's first
			 * call at an M bucket tunes) */
			set_qgemv_tune(tune);
			run_kind(c, K_CUDA_LINEAR_Q_GEMV, 64, 2048, 3, 1, 0);
			run_kind(c, K_CUDA_LINEAR_Q_GEMV, 8200, 1024, 8, 0, is_int4);
			run_kind(c, K_CUDA_LINEAR_Q_GEMV, 70, odd_k, 1, 1, is_int4);
			if (!race)
				run_kind(c, K_CUDA_LINEAR_Q_GEMV, 200, 16384, 8, 1, 0);
			run_kind(c, K_CUDA_LINEAR_Q_GEMV, 300, 1024, 17, 0, is_int4);
		}
		/* the GEMV forming its x as a SwiGLU (a dense MLP's down projection) */
		if (!tile_only && !wide_only) {
			check_swiglu(c, 64, 2048, 3, 1, 0);
			check_swiglu(c, 8200, 1024, 8, 0, is_int4);
			check_swiglu(c, 300, 4096, 1, 1, is_int4);
		}
		/* the GEMV and the streaming form forming their x as an RMSNorm (a layer's
		 * input norm before q/k/v or gate/up): the norm's warp order (K 1024) and
		 * block order (2048 .. 16384), one slice and K split (clusters for the
		 * streaming form), partial row tiles */
		for (int s = 0; s < 2 && !tile_only && !wide_only; s++) {
			const int kind = s ? K_CUDA_LINEAR_Q_STREAM : K_CUDA_LINEAR_Q_GEMV;

			check_norm(c, kind, 64, 2048, 3, 1, 0, 1);
			check_norm(c, kind, 8200, 1024, 8, 0, is_int4, 1);
			check_norm(c, kind, 300, 4096, 1, 1, is_int4, 1);
			check_norm(c, kind, 6144, 4096, 1, 0, 0, 0);
			if (!race)
				check_norm(c, kind, 200, 16384, 2, 1, 0, 1);
		}
		if (gemv_only)
			continue;
		/* STREAM at 8 < M <= 64: one launch, n8 tiles 2, 4, 8 (partial ones at 9, 33),
		 * partial row blocks, clusters, partial slabs, x in chunks of k */
		if (!tile_only) {
			static const int wide_ms[] = { 9, 16, 33, 64 };

			for (size_t j = 0; j < sizeof(wide_ms) / sizeof(wide_ms[0]); j++) {
				const int M = wide_ms[j], acc = (int)(j & 1), f16s = is_int4 && (j & 1);

				if (race && M == 16)
					continue;
				run_kind(c, K_CUDA_LINEAR_Q_STREAM, 300, 512, M, acc, f16s);
				run_kind(c, K_CUDA_LINEAR_Q_STREAM, 1000, 4096, M, !acc, f16s);
				run_kind(c, K_CUDA_LINEAR_Q_STREAM, 130, odd_k, M, acc, 0);
				/* 2 row blocks, 8 slices of 1792 k: x in two chunks */
				if (!race || M == 64)
					run_kind(c, K_CUDA_LINEAR_Q_STREAM, 130, 14336, M, 0, f16s);
			}
			if (!quick)	/* 34 row blocks, 3 slices, partial slab and chunk */
				run_kind(c, K_CUDA_LINEAR_Q_STREAM, 4352, odd_k, 64, 1, 0);
		}
		/* TILE: n8 tiles 2, 4, 8 (partial ones at 5, 9, 33), K split over 8 CTAs
		 * through the workspace, partial row tiles and stages, one slice (N 16384 x K
		 * 64: one stage; N 33792 x K 256: 264 tiles, 4 stages each), M 65 in two
		 * launches */
		/* four times: the mma.sync kernel, then the wgmma one (linear_qwgmma.cu,
		 * where the device runs it: K % 64 == 0 shapes for fp8, % 128 for int4; the
		 * others stay on mma.sync) with its CTA width timed, at 128 and at 256 */
		for (int qw = 0; qw < (quick ? 2 : 4); qw++) {
			static const int tile_ms[] = { 1, 5, 9, 16, 17, 32, 33, 64 };
			static const int qw_rows[] = { 0, 0, 128, 256 };

			set_qwg(qw > 0, qw_rows[qw]);
			for (size_t j = 0; j < sizeof(tile_ms) / sizeof(tile_ms[0]); j++) {
				const int M = tile_ms[j], acc = (int)(j & 1), f16s = is_int4 && (j & 1);

				if (race && (M == 1 || M == 16))
					continue;
				run_kind(c, K_CUDA_LINEAR_Q_TILE, 300, 512, M, acc, f16s);
				run_kind(c, K_CUDA_LINEAR_Q_TILE, 1000, 4096, M, !acc, f16s);
				run_kind(c, K_CUDA_LINEAR_Q_TILE, 130, odd_k, M, acc, 0);
				if (M > 8 && (!race || M == 64))
					run_kind(c, K_CUDA_LINEAR_Q_TILE, 130, 14336, M, 0, f16s);
			}
			run_kind(c, K_CUDA_LINEAR_Q_TILE, 16384, 64, 33, 1, is_int4);
			run_kind(c, K_CUDA_LINEAR_Q_TILE, quick ? 2304 : 33792, 256, 40, 0, 0);
			run_kind(c, K_CUDA_LINEAR_Q_TILE, 520, 1024, 65, 1, is_int4);
			if (!quick)
				run_kind(c, K_CUDA_LINEAR_Q_TILE, 4352, odd_k, 64, 1, 0);
		}
		set_qwg(1, 0);
		for (int kind = K_CUDA_LINEAR_Q_STREAM; kind <= K_CUDA_LINEAR_Q_MMA && !wide_only && !tile_only;
		     kind++) {
			run_kind(c, kind, 300, 1024, 17, 1, 0);	/* STREAM one launch, MMA 3 */
			run_kind(c, kind, quick ? 130 : 520, 14336, 8, 0, 0);	/* many stages a warp */
			if (!quick)
				run_kind(c, kind, 6144, 4096, 1, 0, is_int4);
		}
		if (mma_only)
			continue;
		run_kind(c, K_CUDA_LINEAR_Q_DEQUANT, 300, 512, 1, 0, 0);
		run_kind(c, K_CUDA_LINEAR_Q_DEQUANT, 1000, 4096, 9, 1, is_int4);
		run_kind(c, K_CUDA_LINEAR_Q_DEQUANT, 130, odd_k, 33, 0, 0);
		check_dequant(c, 300, 512);
		check_dequant(c, 77, 200);
	}
	/* GEMV (the kind decode takes at M <= 8) on every projection of the supported models
	 * (bench_cuda_linear_q's list), fp8 128 x 128 blocks and int4 groups of 32: M 1, and
	 * M 8 where the matrix is under 20 M values (the host reference's time); tuned */
	set_qgemv_tune(1);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]) && !quick && !wide_only; i++) {
		static const int model[][2] = {
			{ 6144, 4096 }, { 4096, 4096 }, { 28672, 4096 }, { 4096, 14336 },
			{ 5120, 2048 }, { 2048, 4096 }, { 2112, 7168 }, { 24576, 1536 },
			{ 12288, 1536 }, { 7168, 16384 }, { 7168, 8192 }, { 36864, 7168 },
			{ 7168, 18432 },
		};
		const struct qcase *c = &cases[i];

		if ((strcmp(c->what, "fp8-block") && strcmp(c->what, "int4-g32")) ||
		    (only && !strstr(c->what, only)))
			continue;
		for (size_t j = 0; j < sizeof(model) / sizeof(model[0]); j++) {
			const int N = model[j][0], K = model[j][1], f16s = c->fmt == K_Q_INT4;

			run_kind(c, K_CUDA_LINEAR_Q_GEMV, N, K, 1, (int)(j & 1), f16s);
			if ((long)N * K < 20000000L)
				run_kind(c, K_CUDA_LINEAR_Q_GEMV, N, K, 8, (int)!(j & 1), f16s);
			/* the tile kind at batch 64 (the wgmma kernel where it runs) */
			if ((long)N * K < 40000000L)
				run_kind(c, K_CUDA_LINEAR_Q_TILE, N, K, 64, (int)(j & 1), f16s);
		}
	}
	k_cuda_linear_destroy(lin);
	cudaFree(wtmp);
	cudaStreamDestroy(stream);
	k_pool_destroy(pool);
	return test_result("test_cuda_linear_q");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_linear_q: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
