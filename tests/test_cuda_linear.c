/* The CUDA linear layers against the CPU reference k_cpu_linear: every variant forced at
 * every M, odd and model shapes, accumulate off and on, poisoned outputs, graph capture.
 * Skips (77) where the build has no CUDA or the machine has no GPU.
 *
 * Tolerances (errors relative to the reference's RMS; x, w, y0 uniform in [-1, 1)):
 *   gemv, generic (fp32 x, fp32 sums):        rel L2 <= 1e-5, max abs <= 1e-4 * rms
 *   splitk, stream, ring, cublas (x rounded to bf16):
 *     against the reference fed the same bf16-rounded x: rel L2 <= 5e-4, max abs <= 5e-3 * rms
 *     against the fp32-x reference:                      rel L2 <= 1e-2, max abs <= 5e-2 * rms
 * The tight check catches indexing errors that bf16 rounding would hide (one k group
 * of 8 lost out of 4096 moves rel L2 by ~4e-2). Every output must be written (y is
 * poisoned with NaN), nothing past y touched (a guard zone), and a second run must
 * give the same bits (kdec's own kernels; reported only for cuBLAS).
 * The ring GEMV's folded forms (k_cuda_linear_norm_run, k_cuda_linear_swiglu_run): the
 * same bits as k_cuda_rmsnorm or k_cuda_silu_mul_rows then the ring kind. The ring kind
 * where KDEC_LINEAR_RING_TUNE times it faster (test_ring_tune).
 * KD_TEST_QUICK=1 (for compute-sanitizer's racecheck, whose cost grows with every
 * shared-memory access): kdec's own kernels only, at M up to 64; no cuBLAS, no auto.
 * KD_TEST_QUICK=2 (race): the big part at M 1, 16 and 64 only, Llama's 6144 and 4096
 * rows of 4096 at M = 1 only, without 14336 x 4096 (the same kernels and splits as
 * 6144 x 4096; it alone took the last 60 s of a 430 s racecheck run).
 * KD_TEST_PART=small or big: the shapes up to 1 x 4096 (and the graphs) or the rest. */
#include <errno.h>
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
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"

#define MAX_M		200
#define MAX_K		16384
#define GUARD		256		/* floats after y that must stay untouched */
#define GUARD_BYTE	0x7e		/* 0x7e7e7e7e: a finite float */

static unsigned long long seed = 0x243f6a8885a308d3ull;
static struct k_pool *pool;
static cudaStream_t stream;
static struct k_cuda_linear *lin;
static int quick;	/* KD_TEST_QUICK */
static int race;	/* KD_TEST_QUICK=2 */
static int ring_modes;	/* test_shape runs only the ring kind, on each of its kernels */

/* Whether the cases of kind k run: every kind, but cuBLAS under KD_TEST_QUICK. */
static int kind_runs(int k)
{
	return !(quick && k == K_CUDA_LINEAR_CUBLAS);
}

struct shape {
	int N, K;
	const int *Ms;
	int n_ms;
};

static const int all_ms[] = { 1, 2, 3, 7, 16, 33, 64, 200 };
static const int big_ms[] = { 1, 33, 64 };

#define ALL(n, k) { n, k, all_ms, (int)(sizeof(all_ms) / sizeof(all_ms[0])) }
#define BIG(n, k) { n, k, big_ms, (int)(sizeof(big_ms) / sizeof(big_ms[0])) }

#define N_SMALL_SHAPES	6	/* shapes[] before the big part */

static const struct shape shapes[] = {
	ALL(1, 8), ALL(17, 24), ALL(1000, 8), ALL(1000, 1000), ALL(17, 4100), ALL(1, 4096),
	/* KD_TEST_PART=big from here */
	ALL(1000, 4096), ALL(300, 4100),
	ALL(2048, 1408),	/* batches that do not split evenly over 8 slices */
	ALL(40000, 256),	/* more 256-row groups than CTAs: split-K walks groups */
	ALL(6144, 4096),	/* Llama-3.1-8B q/k/v: the streaming kernel splits K */
	ALL(384, 7168), ALL(64, 2048),	/* MoE routers: the GEMV's warps split K */
	BIG(4096, 4096), BIG(14336, 4096),
};

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	if (!p) {
		fprintf(stderr, "FATAL: out of host memory (%zu bytes)\n", n);
		exit(1);
	}
	return p;
}

/* Copies and fills in the context's stream, which does not synchronise with the legacy
 * default stream; each copy has completed on return. */
static void copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
	CU(cudaMemcpyAsync(dst, src, bytes, kind, stream));
	CU(cudaStreamSynchronize(stream));
}

static void fill(void *dst, int byte, size_t bytes)
{
	CU(cudaMemsetAsync(dst, byte, bytes, stream));
}

/* Device buffers of one shape, sized for MAX_M rows. */
struct bufs {
	uint16_t *w;	/* (N, K) bf16 */
	float *x;	/* (MAX_M, K) + 4 floats, so that x + 1 can be used misaligned */
	float *y;	/* (MAX_M, N) + GUARD */
};

struct errs {
	double rel_l2, max_abs;
};

static struct errs compare(const float *got, const float *base, const float *ref, size_t n)
{
	double num = 0, den = 0, max_abs = 0;
	struct errs e;

	for (size_t i = 0; i < n; i++) {
		double v = base ? (double)got[i] - (double)base[i] : (double)got[i];
		double d = v - (double)ref[i];

		if (d != d)	/* NaN */
			d = INFINITY;
		num += d * d;
		den += (double)ref[i] * ref[i];
		max_abs = test_err_max(max_abs, fabs(d));
	}
	e.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
	e.max_abs = max_abs / (den > 0 ? sqrt(den / (double)n) : 1.0);	/* over the RMS */
	return e;
}

static int is_bf16_x(enum k_cuda_linear_kind kind)
{
	return kind == K_CUDA_LINEAR_SPLITK || kind == K_CUDA_LINEAR_STREAM ||
	       kind == K_CUDA_LINEAR_RING || kind == K_CUDA_LINEAR_CUBLAS;
}

/* One case's inputs and both references, host side. */
struct ref {
	int M, N, K;
	const float *x;		/* (M, K) */
	const float *y0;	/* (M, N), the accumulate input */
	const float *r32;	/* (M, N) reference, fp32 x */
	const float *r16;	/* (M, N) reference, x rounded to bf16 */
};

/* Runs kind once into y (poisoned, or y0 when accumulating) and returns the result in
 * out (M, N); *unwritten counts NaNs left, *guard_ok whether the guard zone held. */
static int run_once(enum k_cuda_linear_kind kind, int use_auto, const struct bufs *b,
		    const float *xdev, const struct ref *r, int acc, float *out, size_t *unwritten,
		    int *guard_ok)
{
	size_t n = (size_t)r->M * r->N;
	unsigned char guard[GUARD * sizeof(float)];
	int ret;

	if (acc)
		copy(b->y, r->y0, n * sizeof(float), cudaMemcpyHostToDevice);
	else
		fill(b->y, 0xff, n * sizeof(float));	/* NaN */
	fill(b->y + n, GUARD_BYTE, GUARD * sizeof(float));
	ret = use_auto ? k_cuda_linear(lin, b->y, xdev, b->w, r->M, r->N, r->K, acc)
		       : k_cuda_linear_run_kind(lin, kind, b->y, xdev, b->w, r->M, r->N, r->K, acc);
	if (ret)
		return ret;
	CU(cudaStreamSynchronize(stream));
	CU(cudaGetLastError());
	copy(out, b->y, n * sizeof(float), cudaMemcpyDeviceToHost);
	copy(guard, b->y + n, sizeof(guard), cudaMemcpyDeviceToHost);
	*unwritten = 0;
	for (size_t i = 0; i < n; i++)
		if (out[i] != out[i])
			(*unwritten)++;
	*guard_ok = 1;
	for (size_t i = 0; i < sizeof(guard); i++)
		if (guard[i] != GUARD_BYTE)
			*guard_ok = 0;
	return 0;
}

/* All checks of one (kind, accumulate) on one case; prints one line. */
static void check_kind(enum k_cuda_linear_kind kind, int use_auto, const struct bufs *b,
		       const float *xdev, const struct ref *r, int acc, float *out, float *out2)
{
	enum k_cuda_linear_kind eff = use_auto ? k_cuda_linear_choose(xdev, b->w, r->M, r->N, r->K) : kind;
	size_t n = (size_t)r->M * r->N, unwritten = 0, unwritten2 = 0;
	const char *name;
	struct errs tight, loose;
	int guard_ok = 0, guard2 = 1, det = 1, pass, ret;
	char desc[160];

	name = use_auto ? "auto" : k_cuda_linear_kind_name(kind);
	ret = run_once(kind, use_auto, b, xdev, r, acc, out, &unwritten, &guard_ok);
	if (ret) {
		printf("N=%-6d K=%-5d M=%-3d %-7s acc=%d: returned %d  FAIL\n", r->N, r->K, r->M,
		       name, acc, ret);
		CHECK(0, "N=%d K=%d M=%d %s acc=%d returned %d", r->N, r->K, r->M, name, acc, ret);
		return;
	}
	if (!acc) {	/* the same inputs again: the same bits */
		run_once(kind, use_auto, b, xdev, r, acc, out2, &unwritten2, &guard2);
		det = memcmp(out, out2, n * sizeof(float)) == 0;
	}
	if (is_bf16_x(eff)) {
		tight = compare(out, acc ? r->y0 : NULL, r->r16, n);
		loose = compare(out, acc ? r->y0 : NULL, r->r32, n);
		pass = tight.rel_l2 <= 5e-4 && tight.max_abs <= 5e-3 && loose.rel_l2 <= 1e-2 &&
		       loose.max_abs <= 5e-2;
	} else {
		tight = loose = compare(out, acc ? r->y0 : NULL, r->r32, n);
		pass = tight.rel_l2 <= 1e-5 && tight.max_abs <= 1e-4;
	}
	pass = pass && unwritten == 0 && guard_ok && guard2 &&
	       (det || eff == K_CUDA_LINEAR_CUBLAS);
	k_cuda_linear_describe(lin, eff, r->M, r->N, r->K, desc, sizeof(desc));
	printf("N=%-6d K=%-5d M=%-3d %-7s acc=%d: rel_l2 %.2e max_abs/rms %.2e", r->N, r->K, r->M,
	       name, acc, tight.rel_l2, tight.max_abs);
	if (is_bf16_x(eff))
		printf(" (fp32-x ref: %.2e %.2e)", loose.rel_l2, loose.max_abs);
	printf(" unwritten %zu guard %s%s  %s  [%s]\n", unwritten, guard_ok && guard2 ? "ok" : "HIT",
	       acc ? "" : det ? " det" : " NONDET", pass ? "PASS" : "FAIL", desc);
	CHECK(pass, "N=%d K=%d M=%d %s acc=%d", r->N, r->K, r->M, name, acc);
}

static void rand_fill(float *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = test_randf(&seed);
}

/* The ring kind at one case under KDEC_LINEAR_RING_STREAM 0 and 2 (test_ring_modes). */
static void check_ring_modes(const struct bufs *b, const struct ref *r, float *out, float *out2)
{
	struct k_cuda_tuning was = *k_cuda_tuning(), t = was;

	t.linear_ring = K_CUDA_LINEAR_RING_M;
	for (int mode = 0; mode <= 2; mode += 2) {
		char desc[160];

		t.linear_ring_stream = mode;
		k_cuda_tuning_set(&t);
		k_cuda_linear_describe(lin, K_CUDA_LINEAR_RING, r->M, r->N, r->K, desc, sizeof(desc));
		printf("ring_stream=%d: ", mode);
		CHECK(!strncmp(desc, mode ? "qstream" : "qgemv", mode ? 7 : 5),
		      "ring_stream=%d N %d K %d M %d runs '%s'", mode, r->N, r->K, r->M, desc);
		for (int acc = 0; acc <= 1; acc++)
			check_kind(K_CUDA_LINEAR_RING, 0, b, b->x, r, acc, out, out2);
	}
	k_cuda_tuning_set(&was);
}

static void test_shape(const struct shape *s)
{
	size_t wn = (size_t)s->N * s->K, xn = (size_t)MAX_M * s->K, yn = (size_t)MAX_M * s->N;
	uint16_t *w = xmalloc(wn * sizeof(uint16_t));
	float *x = xmalloc(xn * sizeof(float)), *x16 = xmalloc(xn * sizeof(float));
	float *y0 = xmalloc(yn * sizeof(float)), *r32 = xmalloc(yn * sizeof(float));
	float *r16 = xmalloc(yn * sizeof(float));
	float *out = xmalloc(yn * sizeof(float)), *out2 = xmalloc(yn * sizeof(float));
	struct bufs b;

	for (size_t i = 0; i < wn; i++)
		w[i] = k_f32_to_bf16(test_randf(&seed));
	b.w = dalloc(wn * sizeof(uint16_t));
	b.x = dalloc((xn + 4) * sizeof(float));
	b.y = dalloc((yn + GUARD) * sizeof(float));
	copy(b.w, w, wn * sizeof(uint16_t), cudaMemcpyHostToDevice);
	for (int mi = 0; mi < s->n_ms; mi++) {
		int M = s->Ms[mi];
		struct ref r = { M, s->N, s->K, x, y0, r32, r16 };

		if (quick && M > 64)
			continue;
		if (race && !ring_modes && s - shapes >= N_SMALL_SHAPES &&
		    (s->K * (long)s->N > 6144L * 4096 ||
		     (s->K * (long)s->N >= 4096L * 4096 ? M != 1 : M != 1 && M != 16 && M != 64)))
			continue;
		rand_fill(x, (size_t)M * s->K);	/* fresh inputs for every case */
		rand_fill(y0, (size_t)M * s->N);
		for (size_t i = 0; i < (size_t)M * s->K; i++)
			x16[i] = k_bf16_to_f32(k_f32_to_bf16(x[i]));
		k_cpu_linear(pool, r32, x, w, K_BF16, M, s->N, s->K);
		k_cpu_linear(pool, r16, x16, w, K_BF16, M, s->N, s->K);
		copy(b.x, x, (size_t)M * s->K * sizeof(float), cudaMemcpyHostToDevice);
		if (ring_modes) {
			check_ring_modes(&b, &r, out, out2);
			continue;
		}
		for (int k = 0; k < K_CUDA_LINEAR_N_KINDS; k++) {
			if (!kind_runs(k))
				continue;
			if (!k_cuda_linear_supports(k, b.x, b.w, M, s->N, s->K)) {
				CHECK(k_cuda_linear_run_kind(lin, k, b.y, b.x, b.w, M, s->N, s->K, 0) ==
				      -EINVAL, "unsupported %s must return -EINVAL",
				      k_cuda_linear_kind_name(k));
				printf("N=%-6d K=%-5d M=%-3d %-7s: not supported (K %% 8 or alignment)\n",
				       s->N, s->K, M, k_cuda_linear_kind_name(k));
				continue;
			}
			for (int acc = 0; acc <= 1; acc++)
				check_kind(k, 0, &b, b.x, &r, acc, out, out2);
		}
		for (int acc = 0; !quick && acc <= 1; acc++)
			check_kind(0, 1, &b, b.x, &r, acc, out, out2);
		if (s->K % 8 == 0 && s->K <= 4096 && M <= 16) {
			/* x one float off 16-byte alignment: the vector kernels refuse, auto
			 * takes the general path */
			copy(b.x + 1, x, (size_t)M * s->K * sizeof(float), cudaMemcpyHostToDevice);
			CHECK(k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, b.y, b.x + 1, b.w, M,
						     s->N, s->K, 0) == -EINVAL, "misaligned gemv");
			printf("(x misaligned by 4 bytes)\n");
			check_kind(0, 1, &b, b.x + 1, &r, 0, out, out2);
		}
	}
	cudaFree(b.w);
	cudaFree(b.x);
	cudaFree(b.y);
	free(w);
	free(x);
	free(x16);
	free(y0);
	free(r32);
	free(r16);
	free(out);
	free(out2);
}

static void test_bad_args(void)
{
	float *y = NULL, *x = NULL;
	uint16_t *w = NULL;

	y = dalloc(4096);
	x = dalloc(4096);
	w = dalloc(4096);
	CHECK(k_cuda_linear(lin, y, x, w, 0, 8, 8, 0) == -EINVAL, "M = 0");
	CHECK(k_cuda_linear(lin, y, x, w, 1, 0, 8, 0) == -EINVAL, "N = 0");
	CHECK(k_cuda_linear(lin, y, x, w, 1, 8, 0, 0) == -EINVAL, "K = 0");
	CHECK(k_cuda_linear(lin, y, x, w, MAX_M + 1, 8, 8, 0) == -EINVAL, "M > max_M");
	CHECK(k_cuda_linear(lin, y, x, w, 1, 8, MAX_K + 8, 0) == -EINVAL, "K > max_K");
	CHECK(k_cuda_linear(NULL, y, x, w, 1, 8, 8, 0) == -EINVAL, "NULL context");
	CHECK(k_cuda_linear(lin, NULL, x, w, 1, 8, 8, 0) == -EINVAL, "NULL y");
	CHECK(k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_N_KINDS, y, x, w, 1, 8, 8, 0) == -EINVAL,
	      "bad kind");
	cudaFree(y);
	cudaFree(x);
	cudaFree(w);
}

/* The dot product of two bf16 rows of K, in double: the exact reference of a GEMM fed
 * the same bf16 x and w. */
static double bf16_dot(const uint16_t *a, const uint16_t *b, int K)
{
	double acc = 0;

	for (int k = 0; k < K; k++)
		acc += (double)k_bf16_to_f32(a[k]) * k_bf16_to_f32(b[k]);
	return acc;
}

/* A producer that wrote x in bf16 only (k_cuda_linear_x_ready_only, SwiGLU before
 * Llama's down projection): a bf16-x kind uses the scratch (the fp32 x is NaN here, so
 * any read of it shows), and a kind that reads fp32 x refuses instead of reading it. */
static void test_x_ready_only(void)
{
	enum { M = 64, N = 96, K = 256 };
	float *x = xmalloc(sizeof(float) * M * K), *y = xmalloc(sizeof(float) * M * N);
	uint16_t *xb = xmalloc(sizeof(uint16_t) * M * K), *w = xmalloc(sizeof(uint16_t) * N * K);
	uint16_t *scratch = k_cuda_linear_x_scratch(lin, M, K), *dw = NULL;
	float *dx = NULL, *dy = NULL, scale = 0.f;
	double err = 0;
	int ret;

	rand_fill(x, (size_t)M * K);
	for (size_t i = 0; i < (size_t)M * K; i++)
		xb[i] = k_f32_to_bf16(x[i]);
	for (size_t i = 0; i < (size_t)N * K; i++)
		w[i] = k_f32_to_bf16(x[i % ((size_t)M * K)] * 0.5f);
	dx = dalloc(sizeof(float) * M * K);
	dy = dalloc(sizeof(float) * M * N);
	dw = dalloc(sizeof(uint16_t) * N * K);
	fill(dx, 0xff, sizeof(float) * M * K);	/* NaN: never written */
	fill(dy, 0xff, sizeof(float) * M * N);
	copy(dw, w, sizeof(uint16_t) * N * K, cudaMemcpyHostToDevice);
	copy(scratch, xb, sizeof(uint16_t) * M * K, cudaMemcpyHostToDevice);
	k_cuda_linear_x_ready_only(lin, dx, M, K);
	ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_CUBLAS, dy, dx, dw, M, N, K, 0);
	CHECK(ret == 0, "x ready in bf16 only: cublas returned %d", ret);
	CU(cudaStreamSynchronize(stream));
	copy(y, dy, sizeof(float) * M * N, cudaMemcpyDeviceToHost);
	for (int m = 0; m < M; m++)
		for (int n = 0; n < N; n++) {
			double want = bf16_dot(xb + (size_t)m * K, w + (size_t)n * K, K);

			/* y's NaN fill (nothing written) or an fp32 x read: +inf */
			err = test_err_max(err, test_abs_err(y[(size_t)m * N + n], want));
			scale = fmaxf(scale, fabsf((float)want));
		}
	CHECK(err <= 1e-4 * scale, "x ready in bf16 only: max err %g of %g", err, scale);
	printf("x ready in bf16 only: cublas max_abs %.2e of %.2e  %s\n", err, scale,
	       err <= 1e-4 * scale ? "PASS" : "FAIL");
	k_cuda_linear_x_ready_only(lin, dx, 1, K);
	ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, dy, dx, dw, 1, N, K, 0);
	CHECK(ret == -EINVAL, "x ready in bf16 only: gemv returned %d, not -EINVAL", ret);
	printf("x ready in bf16 only: gemv (fp32 x) refused: %s\n", ret == -EINVAL ? "PASS" : "FAIL");
	cudaFree(dx);
	cudaFree(dy);
	cudaFree(dw);
	free(x);
	free(y);
	free(xb);
	free(w);
}

/* k_cuda_linear_bf16_out: at M = 64 (cuBLAS; N * K past 16 MB of weights goes through
 * the tuned cuBLASLt path, below through cublasGemmEx) every output written and within
 * one bf16 rounding (2^-8 relative) plus 1e-4 of the scale of the reference fed the
 * same bf16 x; at M = 1 (not cuBLAS) -EOPNOTSUPP. */
static void test_bf16_out(int N, int K)
{
	enum { M = 64 };
	size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N;
	float *x = xmalloc(sizeof(float) * nx), *dx = NULL, err = 0.f, scale = 0.f;
	uint16_t *xb = xmalloc(sizeof(uint16_t) * nx), *w = xmalloc(sizeof(uint16_t) * nw);
	uint16_t *y = xmalloc(sizeof(uint16_t) * ny), *dw = NULL, *dy = NULL;
	double *want = xmalloc(sizeof(double) * ny);
	int ret, bad = 0;

	rand_fill(x, nx);
	for (size_t i = 0; i < nx; i++)
		xb[i] = k_f32_to_bf16(x[i]);
	for (size_t i = 0; i < nw; i++)
		w[i] = k_f32_to_bf16(x[(i * 7919) % nx]);
	dx = dalloc(sizeof(float) * nx);
	dw = dalloc(sizeof(uint16_t) * nw);
	dy = dalloc(sizeof(uint16_t) * ny);
	copy(dx, x, sizeof(float) * nx, cudaMemcpyHostToDevice);
	copy(dw, w, sizeof(uint16_t) * nw, cudaMemcpyHostToDevice);
	fill(dy, 0xff, sizeof(uint16_t) * ny);	/* bf16 NaN: never written */
	ret = k_cuda_linear_bf16_out(lin, dy, dx, dw, M, N, K);
	CHECK(ret == 0, "bf16 out N %d K %d: returned %d", N, K, ret);
	CU(cudaStreamSynchronize(stream));
	copy(y, dy, sizeof(uint16_t) * ny, cudaMemcpyDeviceToHost);
	for (int m = 0; m < M; m++)
		for (int n = 0; n < N; n++) {
			double acc = bf16_dot(xb + (size_t)m * K, w + (size_t)n * K, K);

			want[(size_t)m * N + n] = acc;
			scale = fmaxf(scale, fabsf((float)acc));
		}
	for (size_t i = 0; i < ny; i++) {
		float got = k_bf16_to_f32(y[i]), e = fabsf(got - (float)want[i]);

		if (!(e <= fabsf((float)want[i]) / 256 + 1e-4f * scale))
			bad++;
		err = (float)test_err_max(err, e);
	}
	printf("bf16 out  N %5d K %5d M %d: max_abs %.2e of %.2e, %d outside  %s\n", N, K, M, err,
	       scale, bad, bad ? "FAIL" : "PASS");
	CHECK(!bad, "bf16 out N %d K %d: %d outputs outside one bf16 rounding", N, K, bad);
	ret = k_cuda_linear_bf16_out(lin, dy, dx, dw, 1, N, K);
	CHECK(ret == -EOPNOTSUPP, "bf16 out at M = 1: returned %d, not -EOPNOTSUPP", ret);
	cudaFree(dx);
	cudaFree(dw);
	cudaFree(dy);
	free(x);
	free(xb);
	free(w);
	free(y);
	free(want);
}

/* The ring GEMV's folded x forms against their two-launch forms on fresh random inputs
 * (N, K: a matrix above linear_small_mb, so that the ring kind is the one chosen):
 * k_cuda_linear_norm_run against k_cuda_rmsnorm then the ring kind (y and the norm's
 * out), k_cuda_linear_swiglu_run against k_cuda_silu_mul_rows then the ring kind, bit
 * for bit, y = and y +=. swiglu 0: not the SwiGLU form (under KDEC_LINEAR_RING_STREAM=2
 * the ring kind runs the streaming form, which has none: the two sides differ in order). */
static void test_ring_folds(int N, int K, int M, int acc, int swiglu)
{
	const float eps = 1e-5f;
	size_t nx = (size_t)M * K, ny = (size_t)M * N, nw = (size_t)N * K;
	float *x = xmalloc(sizeof(float) * 2 * nx), *nw_h = xmalloc(sizeof(float) * K);
	float *y0 = xmalloc(sizeof(float) * ny), *a = xmalloc(sizeof(float) * ny);
	float *b = xmalloc(sizeof(float) * ny), *ha = xmalloc(sizeof(float) * nx);
	float *hb = xmalloc(sizeof(float) * nx);
	uint16_t *w = xmalloc(sizeof(uint16_t) * nw), *dw = dalloc(sizeof(uint16_t) * nw);
	float *dx = dalloc(sizeof(float) * 2 * nx), *dnw = dalloc(sizeof(float) * K);
	float *dha = dalloc(sizeof(float) * nx), *dhb = dalloc(sizeof(float) * nx);
	float *dya = dalloc(sizeof(float) * ny), *dyb = dalloc(sizeof(float) * ny);
	size_t nd = 0, nod = 0, sd = 0;
	int ra, rb, sa, sb;

	rand_fill(x, 2 * nx);
	rand_fill(y0, ny);
	for (int k = 0; k < K; k++)
		nw_h[k] = 0.5f + 0.5f * test_randf(&seed);
	for (size_t i = 0; i < nw; i++)
		w[i] = k_f32_to_bf16(test_randf(&seed));
	copy(dw, w, sizeof(uint16_t) * nw, cudaMemcpyHostToDevice);
	copy(dx, x, sizeof(float) * 2 * nx, cudaMemcpyHostToDevice);
	copy(dnw, nw_h, sizeof(float) * K, cudaMemcpyHostToDevice);
	/* the norm: x (M, K) */
	{
		const struct k_cuda_xnorm n = { dnw, eps, dhb };

		copy(dya, y0, sizeof(float) * ny, cudaMemcpyHostToDevice);
		copy(dyb, y0, sizeof(float) * ny, cudaMemcpyHostToDevice);
		fill(dhb, 0xff, sizeof(float) * nx);
		ra = k_cuda_rmsnorm(stream, dha, K, dx, K, dnw, M, K, eps);
		if (!ra)
			ra = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_RING, dya, dha, dw, M, N, K, acc);
		rb = k_cuda_linear_norm_run(lin, dyb, dx, &n, dw, M, N, K, acc);
		CU(cudaStreamSynchronize(stream));
		copy(a, dya, sizeof(float) * ny, cudaMemcpyDeviceToHost);
		copy(b, dyb, sizeof(float) * ny, cudaMemcpyDeviceToHost);
		copy(ha, dha, sizeof(float) * nx, cudaMemcpyDeviceToHost);
		copy(hb, dhb, sizeof(float) * nx, cudaMemcpyDeviceToHost);
		for (size_t i = 0; i < ny; i++)
			nd += memcmp(&a[i], &b[i], sizeof(float)) != 0;
		for (size_t i = 0; i < nx; i++)
			nod += memcmp(&ha[i], &hb[i], sizeof(float)) != 0;
	}
	/* SwiGLU: x as gate_up (M, 2K) */
	sa = sb = 0;
	if (swiglu) {
		copy(dya, y0, sizeof(float) * ny, cudaMemcpyHostToDevice);
		copy(dyb, y0, sizeof(float) * ny, cudaMemcpyHostToDevice);
		sa = k_cuda_silu_mul_rows(stream, dha, dx, M, K);
		if (!sa)
			sa = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_RING, dya, dha, dw, M, N, K,
						    acc);
		sb = k_cuda_linear_swiglu_run(lin, dyb, dx, dw, M, N, K, acc);
		CU(cudaStreamSynchronize(stream));
		copy(a, dya, sizeof(float) * ny, cudaMemcpyDeviceToHost);
		copy(b, dyb, sizeof(float) * ny, cudaMemcpyDeviceToHost);
		for (size_t i = 0; i < ny; i++)
			sd += memcmp(&a[i], &b[i], sizeof(float)) != 0;
	}
	printf("ring folds N=%-6d K=%-5d M=%d acc=%d: norm rc %d/%d, %zu of %zu y and %zu of %zu "
	       "out differ; swiglu %s rc %d/%d, %zu differ  %s\n", N, K, M, acc, ra, rb, nd, ny,
	       nod, nx, swiglu ? "(asked)" : "(not asked)", sa, sb, sd, !ra && !rb && !nd && !nod && !sa && !sb && !sd ? "PASS" : "FAIL");
	CHECK(!ra && !rb && !nd && !nod, "ring norm N %d K %d M %d acc %d: rc %d/%d, %zu y and "
	      "%zu out values differ from RMSNorm then the ring kind", N, K, M, acc, ra, rb, nd, nod);
	CHECK(!sa && !sb && !sd, "ring swiglu N %d K %d M %d acc %d: rc %d/%d, %zu values differ "
	      "from SwiGLU then the ring kind", N, K, M, acc, sa, sb, sd);
	/* the forms decline where the ring is not the kind chosen (M past a launch) */
	CHECK(k_cuda_linear_swiglu_run(lin, dyb, dx, dw, K_CUDA_LINEAR_RING_M + 1, N, K, 0) ==
	      -EINVAL, "ring swiglu at 9 rows must decline");
	cudaFree(dw);
	cudaFree(dx);
	cudaFree(dnw);
	cudaFree(dha);
	cudaFree(dhb);
	cudaFree(dya);
	cudaFree(dyb);
	free(x);
	free(nw_h);
	free(y0);
	free(a);
	free(b);
	free(ha);
	free(hb);
	free(w);
}

/* The ring kind's two kernels on bf16 (KDEC_LINEAR_RING_STREAM): the decode GEMV (0)
 * and the cluster streaming form (2: wherever it has a plan) on fresh random inputs,
 * each held to the bf16-x reference as check_kind holds every kind; the form that ran
 * is the one asked for (its description). */
static void test_ring_modes(int N, int K)
{
	static const int ms[] = { 1, 3, 8, 13 };
	const struct shape sh = { N, K, ms, (int)(sizeof(ms) / sizeof(ms[0])) };

	ring_modes = 1;
	test_shape(&sh);
	ring_modes = 0;
}

/* KDEC_LINEAR_RING_TUNE on a fresh context: the first call at a bucket size times the
 * plain choice against the ring kind and keeps one of the two; it is asked again the
 * same, a capture takes it, the graph gives the eager call's bits (kdec's kernels) and
 * the result holds the reference of the kind kept; another M of an untuned bucket, a
 * call whose x exists only in bf16, and the tuning switched off take the plain choice. */
static void test_ring_tune(int N, int K)
{
	static const int ms[] = { 1, 8 };
	struct k_cuda_tuning was = *k_cuda_tuning(), t = was;
	const size_t wn = (size_t)N * K, xn = (size_t)8 * K, yn = (size_t)8 * N;
	uint16_t *w = xmalloc(wn * sizeof(uint16_t)), *dw;
	float *x = xmalloc(xn * sizeof(float)), *x16 = xmalloc(xn * sizeof(float));
	float *r32 = xmalloc(yn * sizeof(float)), *r16 = xmalloc(yn * sizeof(float));
	float *out = xmalloc(yn * sizeof(float)), *out2 = xmalloc(yn * sizeof(float));
	float *dx, *dy;
	struct k_cuda_linear *tl = NULL;

	CHECK(k_cuda_linear_create(&tl, stream, 8, K) == 0, "ring tune: context");
	if (!tl)
		goto out;
	for (size_t i = 0; i < wn; i++)
		w[i] = k_f32_to_bf16(test_randf(&seed));
	rand_fill(x, xn);
	for (size_t i = 0; i < xn; i++)
		x16[i] = k_bf16_to_f32(k_f32_to_bf16(x[i]));
	dw = dalloc(wn * sizeof(uint16_t));
	dx = dalloc(xn * sizeof(float));
	dy = dalloc(yn * sizeof(float));
	copy(dw, w, wn * sizeof(uint16_t), cudaMemcpyHostToDevice);
	copy(dx, x, xn * sizeof(float), cudaMemcpyHostToDevice);
	t.linear_ring_tune = 1;
	t.lt_log = 1;
	k_cuda_tuning_set(&t);
	for (size_t mi = 0; mi < sizeof(ms) / sizeof(ms[0]); mi++) {
		const int M = ms[mi];
		const size_t n = (size_t)M * N;
		enum k_cuda_linear_kind plain = k_cuda_linear_choose(dx, dw, M, N, K), kept, again, cap;
		cudaGraph_t graph = NULL;
		cudaGraphExec_t exec = NULL;
		struct errs e;
		int same, pass;

		kept = k_cuda_linear_choose_tuned(tl, dx, dw, M, N, K);
		again = k_cuda_linear_choose_tuned(tl, dx, dw, M, N, K);
		CHECK(kept == plain || kept == K_CUDA_LINEAR_RING, "ring tune N %d K %d M %d: kept %s, "
		      "neither %s nor ring", N, K, M, k_cuda_linear_kind_name(kept),
		      k_cuda_linear_kind_name(plain));
		CHECK(again == kept, "ring tune N %d K %d M %d: asked again %s, kept %s", N, K, M,
		      k_cuda_linear_kind_name(again), k_cuda_linear_kind_name(kept));
		fill(dy, 0xff, n * sizeof(float));
		CHECK(k_cuda_linear(tl, dy, dx, dw, M, N, K, 0) == 0, "ring tune: eager call");
		CU(cudaStreamSynchronize(stream));
		copy(out, dy, n * sizeof(float), cudaMemcpyDeviceToHost);
		CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
		cap = k_cuda_linear_choose_tuned(tl, dx, dw, M, N, K);
		CHECK(k_cuda_linear(tl, dy, dx, dw, M, N, K, 0) == 0, "ring tune: captured call");
		CU(cudaStreamEndCapture(stream, &graph));
		CU(cudaGraphInstantiate(&exec, graph, 0));
		fill(dy, 0xff, n * sizeof(float));
		CU(cudaGraphLaunch(exec, stream));
		CU(cudaStreamSynchronize(stream));
		copy(out2, dy, n * sizeof(float), cudaMemcpyDeviceToHost);
		cudaGraphExecDestroy(exec);
		cudaGraphDestroy(graph);
		same = !memcmp(out, out2, n * sizeof(float));
		k_cpu_linear(pool, r32, x, w, K_BF16, M, N, K);
		k_cpu_linear(pool, r16, x16, w, K_BF16, M, N, K);
		e = compare(out, NULL, is_bf16_x(kept) ? r16 : r32, n);
		pass = cap == kept && (same || kept == K_CUDA_LINEAR_CUBLAS) &&
		       (is_bf16_x(kept) ? e.rel_l2 <= 5e-4 && e.max_abs <= 5e-3
					: e.rel_l2 <= 1e-5 && e.max_abs <= 1e-4);
		printf("ring tune N=%-6d K=%-5d M=%d: plain %s, kept %s, in capture %s, graph %s, "
		       "rel_l2 %.2e max_abs/rms %.2e  %s\n", N, K, M, k_cuda_linear_kind_name(plain),
		       k_cuda_linear_kind_name(kept), k_cuda_linear_kind_name(cap),
		       same ? "same bits" : "other bits", e.rel_l2, e.max_abs, pass ? "PASS" : "FAIL");
		CHECK(pass, "ring tune N %d K %d M %d", N, K, M);
		/* what the CPU reference asks (k_cuda_linear_rounds_x): 1 for the matrix's rows
		 * where the ring was kept over a kind reading fp32 x, -1 elsewhere */
		{
			const int want = kept == K_CUDA_LINEAR_RING && !is_bf16_x(plain) ? 1 : -1;
			const int at0 = k_cuda_linear_rounds_x(tl, dw, K, M);
			const int mid = k_cuda_linear_rounds_x(tl, dw + (size_t)(N / 2) * K, K, M);

			CHECK(at0 == want && mid == want && k_cuda_linear_rounds_x(tl, dw + 1, K, M) == -1 &&
			      k_cuda_linear_rounds_x(tl, dw + wn, K, M) == -1 &&
			      k_cuda_linear_rounds_x(tl, dw, K + 8, M) == -1,
			      "ring tune N %d K %d M %d: rounds_x %d (row %d: %d), want %d", N, K, M, at0,
			      N / 2, mid, want);
		}
		/* x written in bf16 only: never the ring, whatever was kept */
		k_cuda_linear_x_ready_only(tl, dx, M, K);
		CHECK(k_cuda_linear_choose_tuned(tl, dx, dw, M, N, K) == plain,
		      "ring tune N %d K %d M %d: a bf16-only x takes the plain choice", N, K, M);
		k_cuda_linear_x_ready(tl, NULL, 0, 0);
	}
	/* 3 rows: bucket 4, never tuned, and 3 is not a bucket size */
	CHECK(k_cuda_linear_choose_tuned(tl, dx, dw, 3, N, K) == k_cuda_linear_choose(dx, dw, 3, N, K),
	      "ring tune N %d K %d: an untuned bucket takes the plain choice", N, K);
	/* KDEC_LINEAR_FP32X (test_golden's GPU run with nothing rounded): the plain fp32-x
	 * kind at every bucket, whatever was kept */
	{
		struct k_cuda_tuning f = t;

		f.linear_fp32x = 1;
		k_cuda_tuning_set(&f);
		for (size_t mi = 0; mi < sizeof(ms) / sizeof(ms[0]); mi++)
			CHECK(k_cuda_linear_choose_tuned(tl, dx, dw, ms[mi], N, K) ==
			      k_cuda_linear_choose(dx, dw, ms[mi], N, K),
			      "ring tune N %d K %d M %d: fp32 x takes the plain choice", N, K, ms[mi]);
		k_cuda_tuning_set(&t);
	}
	k_cuda_tuning_set(&was);	/* off: the plain choice, whatever was kept */
	CHECK(k_cuda_linear_choose_tuned(tl, dx, dw, 1, N, K) == k_cuda_linear_choose(dx, dw, 1, N, K),
	      "ring tune N %d K %d: off, the plain choice", N, K);
	cudaFree(dw);
	cudaFree(dx);
	cudaFree(dy);
out:
	k_cuda_tuning_set(&was);
	k_cuda_linear_destroy(tl);
	free(w);
	free(x);
	free(x16);
	free(r32);
	free(r16);
	free(out);
	free(out2);
}

/* One variant captured into a CUDA graph and replayed: no allocation or synchronisation
 * hides in a call. Runs eagerly first, so kernels and cuBLAS heuristics load outside
 * the capture (as an engine warms up before capturing). */
static void graph_case(enum k_cuda_linear_kind k, int M, int pdl, int N, int K, const uint16_t *w,
		       const float *x, const uint16_t *dw, const float *dx, float *dy, float *ref,
		       float *out)
{
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	struct errs e;
	int ret, cap_ok;

	k_cuda_linear_set_pdl(lin, pdl);
	ret = k_cuda_linear_run_kind(lin, k, dy, dx, dw, M, N, K, 0);
	CU(cudaStreamSynchronize(stream));
	CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
	ret = ret ? ret : k_cuda_linear_run_kind(lin, k, dy, dx, dw, M, N, K, 0);
	cap_ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess;
	if (ret || !cap_ok || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
		printf("graph %-7s M=%-3d pdl=%d: capture failed (ret %d, %s)  FAIL\n",
		       k_cuda_linear_kind_name(k), M, pdl, ret, cudaGetErrorString(cudaGetLastError()));
		CHECK(0, "graph capture of %s M=%d pdl=%d", k_cuda_linear_kind_name(k), M, pdl);
		if (graph)
			cudaGraphDestroy(graph);
		k_cuda_linear_set_pdl(lin, 1);
		return;
	}
	k_cpu_linear(pool, ref, x, w, K_BF16, M, N, K);
	fill(dy, 0xff, (size_t)M * N * sizeof(float));
	CU(cudaGraphLaunch(exec, stream));
	CU(cudaStreamSynchronize(stream));
	copy(out, dy, (size_t)M * N * sizeof(float), cudaMemcpyDeviceToHost);
	e = compare(out, NULL, ref, (size_t)M * N);
	printf("graph %-7s M=%-3d pdl=%d: rel_l2 %.2e vs fp32-x ref  %s\n",
	       k_cuda_linear_kind_name(k), M, pdl, e.rel_l2, e.rel_l2 <= 1e-2 ? "PASS" : "FAIL");
	CHECK(e.rel_l2 <= 1e-2, "graph replay of %s M=%d pdl=%d", k_cuda_linear_kind_name(k), M, pdl);
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	k_cuda_linear_set_pdl(lin, 1);
}

/* Every variant at M = 1, 16, 100, with programmatic dependent launch on and off. */
static void test_graph(void)
{
	const int N = 1000, K = 4096, MM = 100, Ms[] = { 1, 16, MM };
	size_t wn = (size_t)N * K;
	uint16_t *w = xmalloc(wn * sizeof(uint16_t)), *dw;
	float *x = xmalloc((size_t)MM * K * sizeof(float)), *dx, *dy;
	float *ref = xmalloc((size_t)MM * N * sizeof(float));
	float *out = xmalloc((size_t)MM * N * sizeof(float));

	for (size_t i = 0; i < wn; i++)
		w[i] = k_f32_to_bf16(test_randf(&seed));
	rand_fill(x, (size_t)MM * K);
	dw = dalloc(wn * sizeof(uint16_t));
	dx = dalloc((size_t)MM * K * sizeof(float));
	dy = dalloc((size_t)MM * N * sizeof(float));
	copy(dw, w, wn * sizeof(uint16_t), cudaMemcpyHostToDevice);
	copy(dx, x, (size_t)MM * K * sizeof(float), cudaMemcpyHostToDevice);
	for (int pdl = 1; pdl >= 0; pdl--)
		for (int k = 0; k < K_CUDA_LINEAR_N_KINDS; k++)
			for (int mi = 0; mi < 3 && kind_runs(k); mi++)
				graph_case(k, Ms[mi], pdl, N, K, w, x, dw, dx, dy, ref, out);
	cudaFree(dw);
	cudaFree(dx);
	cudaFree(dy);
	free(w);
	free(x);
	free(ref);
	free(out);
}

int main(void)
{
	const char *part;
	char name[128];
	double gib;
	int major, minor, ret;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);

	if (!test_gpu_present("test_cuda_linear"))
		return 77;
	part = test_part("test_cuda_linear", "small", "big");
	setvbuf(stdout, NULL, _IOLBF, 0);
	CHECK(k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor) == 0, "describe");
	printf("device 0: %s, %.1f GiB, sm_%d%d\n", name, gib, major, minor);
	printf("tolerances: gemv/generic rel_l2 <= 1e-5, max_abs/rms <= 1e-4; splitk/stream/ring/cublas "
	       "rel_l2 <= 5e-4, max_abs/rms <= 5e-3 (bf16-x ref) and 1e-2, 5e-2 (fp32-x ref)\n");
	if (k_pool_create(&pool, cpus > 16 ? 16 : cpus > 0 ? (int)cpus : 1)) {
		fprintf(stderr, "FATAL: k_pool_create\n");
		return 1;
	}
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	ret = k_cuda_linear_create(&lin, stream, MAX_M, MAX_K);
	CHECK(ret == 0, "k_cuda_linear_create: %d", ret);
	if (ret)
		return test_result("test_cuda_linear");
	test_bad_args();
	test_x_ready_only();
	quick = test_env_flag("KD_TEST_QUICK");
	race = quick >= 2;
	if (!quick && test_part_runs(part, "small")) {
		test_bf16_out(1000, 1000);	/* 2 MB of weights: cublasGemmEx */
		test_bf16_out(8192, 4096);	/* 64 MB: the tuned cuBLASLt path */
	}
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		if (test_part_runs(part, i < N_SMALL_SHAPES ? "small" : "big"))
			test_shape(&shapes[i]);
	if (test_part_runs(part, "big")) {
		struct k_cuda_tuning was = *k_cuda_tuning(), t = was;

		t.linear_ring = K_CUDA_LINEAR_RING_M;	/* the folds want the ring chosen */
		k_cuda_tuning_set(&t);
		test_ring_folds(4096, 4096, 1, 0, 1);	/* Llama's q/k/v and gate/up over a norm */
		test_ring_folds(4100, 4096, 3, 1, 1);	/* a last row tile part full */
		test_ring_folds(1100, 14336, 8, 0, 1);	/* down's K, an x slice split */
		test_ring_folds(2000, 8192, 1, 1, 1);
		t.linear_ring_stream = 2;	/* the norm form on the streaming form */
		k_cuda_tuning_set(&t);
		test_ring_folds(4096, 4096, 1, 0, 0);
		test_ring_folds(1100, 14336, 8, 1, 0);
		k_cuda_tuning_set(&was);
		test_ring_modes(14336, 4096);	/* Llama's gate/up (one CTA a row block) */
		test_ring_modes(4096, 14336);	/* down: K split over clusters */
		test_ring_modes(1000, 1032);	/* K not a whole stage of 64 */
		test_ring_modes(6144, 4096);
		test_ring_tune(3072, 2048);	/* DeepSeek-V2-Lite's q/kv: the ring won alone */
		test_ring_tune(14336, 4096);	/* a Llama gate/up's half: cuBLAS won alone */
	}
	if (test_part_runs(part, "small"))
		test_graph();
	k_cuda_linear_destroy(lin);
	k_cuda_linear_destroy(NULL);
	cudaStreamDestroy(stream);
	k_pool_destroy(pool);
	return test_result("test_cuda_linear");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_linear: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
