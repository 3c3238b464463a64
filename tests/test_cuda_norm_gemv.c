/* The GEMV with the RMSNorm of its x folded in (k_cuda_linear_norm) against the two
 * launches it replaces, k_cuda_rmsnorm then the GEMV (k_cuda_linear_run_kind), on fresh
 * random inputs: M = 1 and 2, K = 1096 (an odd multiple of 8), 2048, 4096, 7168, odd N,
 * accumulate off and on, and a GEMV of out queued after the fold (eager and from a
 * graph: out reaches the next kernel through its PDL wait). Tolerance: none. y and the
 * normalised rows `out` must equal the two-launch path BIT FOR BIT (the fold repeats
 * rmsnorm.cu's block-form sum order and roundings, and the GEMV's FMA order); both are
 * poisoned with NaN first and every element compared, with a guard zone after each that
 * must stay untouched. Then the calls the fold must decline (batch 64, M = 2 where the
 * pick is not the GEMV, matrices past the GEMV's size, K the norm runs one warp per
 * row, out over x), and a timing of each model shape: rmsnorm + gemv against the fold,
 * median of 25 event-timed runs, L2 flushed by a 128 MB memset before each, beside the
 * HBM floor of the weights at 4.25 TB/s. Skips (77) where the build has no CUDA or the
 * machine has no GPU. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_linear.h"
#include "kernels/cuda/k_cuda_ops.h"
#include "tests/cudatest.h"

#define MAX_M		64
#define MAX_K		8192
#define GUARD		64		/* floats after y and out that must stay untouched */
#define GUARD_BITS	0x7e7e7e7eu
#define POISON_BYTE	0xff		/* 0xffffffff: a NaN */
#define EPS		1e-6f
#define TIME_RUNS	25
#define FLUSH_BYTES	((size_t)128 << 20)	/* > the H200's 50 MB L2 */
#define HBM_TBS		4.25

static unsigned long long seed = 0x9e3779b97f4a7c15ull;
static cudaStream_t stream;
static struct k_cuda_linear *lin;

struct dev_case {
	int M, N, K;
	float *x, *nw, *y, *y_ref, *out, *out_ref;	/* device */
	uint16_t *w;					/* device (N, K) bf16 */
};

static uint16_t bf16_of(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static float *rand_host(size_t n, float lo, float hi)
{
	float *h = malloc(n * sizeof(float));

	for (size_t i = 0; h && i < n; i++)
		h[i] = lo + (hi - lo) * test_randf(&seed);
	return h;
}

static uint16_t *rand_w(size_t n)
{
	uint16_t *h = malloc(n * sizeof(uint16_t));

	for (size_t i = 0; h && i < n; i++)
		h[i] = bf16_of(2.0f * test_randf(&seed) - 1.0f);
	return h;
}

/* Device buffers of a case; y and out with GUARD floats after them. */
static int case_make(struct dev_case *c, int M, int N, int K)
{
	float *hx = rand_host((size_t)M * K, -2.0f, 2.0f), *hn = rand_host(K, 0.5f, 1.5f);
	uint16_t *hw = rand_w((size_t)N * K);
	int ok = hx && hn && hw;

	memset(c, 0, sizeof(*c));
	c->M = M, c->N = N, c->K = K;
	if (ok) {
		c->x = dup_to_device(hx, (size_t)M * K * sizeof(float));
		c->nw = dup_to_device(hn, (size_t)K * sizeof(float));
		c->w = dup_to_device(hw, (size_t)N * K * sizeof(uint16_t));
		c->y = dalloc(((size_t)M * N + GUARD) * sizeof(float));
		c->y_ref = dalloc(((size_t)M * N + GUARD) * sizeof(float));
		c->out = dalloc(((size_t)M * K + GUARD) * sizeof(float));
		c->out_ref = dalloc(((size_t)M * K + GUARD) * sizeof(float));
		ok = c->x && c->nw && c->w && c->y && c->y_ref && c->out && c->out_ref;
	}
	free(hx);
	free(hn);
	free(hw);
	return ok;
}

static void case_free(struct dev_case *c)
{
	cudaFree(c->x);
	cudaFree(c->nw);
	cudaFree(c->w);
	cudaFree(c->y);
	cudaFree(c->y_ref);
	cudaFree(c->out);
	cudaFree(c->out_ref);
}

/* n floats of poison, then the guard zone. */
static void poison(float *d, size_t n)
{
	uint32_t g[GUARD];

	for (int i = 0; i < GUARD; i++)
		g[i] = GUARD_BITS;
	CU(cudaMemset(d, POISON_BYTE, n * sizeof(float)));
	CU(cudaMemcpy(d + n, g, sizeof(g), cudaMemcpyHostToDevice));
}

/* got and ref hold the same n bits, and got's guard zone is intact. */
static void same_bits(const char *what, const struct dev_case *c, const float *got,
		      const float *ref, size_t n)
{
	uint32_t *a = malloc((n + GUARD) * sizeof(uint32_t)), *b = malloc(n * sizeof(uint32_t));
	size_t bad = 0, first = 0, guard = 0;

	if (!a || !b || !CU(cudaMemcpy(a, got, (n + GUARD) * 4, cudaMemcpyDeviceToHost)) ||
	    !CU(cudaMemcpy(b, ref, n * 4, cudaMemcpyDeviceToHost))) {
		CHECK(0, "%s: download", what);
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		if (a[i] != b[i] && !bad++)
			first = i;
	for (size_t i = 0; i < GUARD; i++)
		guard += a[n + i] != GUARD_BITS;
	CHECK(bad == 0, "%s M=%d N=%d K=%d: %zu of %zu differ (first at %zu: %08x vs %08x)", what,
	      c->M, c->N, c->K, bad, n, first, bad ? a[first] : 0, bad ? b[first] : 0);
	CHECK(guard == 0, "%s M=%d N=%d K=%d: %zu guard floats written", what, c->M, c->N, c->K,
	      guard);
out:
	free(a);
	free(b);
}

/* The two launches the fold replaces. */
static int run_ref(const struct dev_case *c, int acc)
{
	int ret = k_cuda_rmsnorm(stream, c->out_ref, c->K, c->x, c->K, c->nw, c->M, c->K, EPS);

	if (!ret)
		ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, c->y_ref, c->out_ref, c->w,
					     c->M, c->N, c->K, acc);
	return ret;
}

/* A kernel queued right after the fold reads out through its PDL wait: a GEMV of out
 * (into y), eagerly and replayed from a graph, against the same GEMV of out_ref. */
static void check_chain(const struct dev_case *c)
{
	cudaGraph_t g = NULL;
	cudaGraphExec_t ge = NULL;
	const size_t n = (size_t)c->M * c->N;
	int ret;

	for (int graph = 0; graph <= 1; graph++) {
		poison(c->out, (size_t)c->M * c->K);
		poison(c->y, n);
		poison(c->y_ref, n);
		ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, c->y_ref, c->out_ref, c->w,
					     c->M, c->N, c->K, 0);
		CU(cudaStreamSynchronize(stream));
		if (graph && !CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal)))
			return;
		/* the fold's y is overwritten by the GEMV of its out */
		ret = ret ? ret : k_cuda_linear_norm_gemv(lin, c->y, c->x, c->nw, EPS, c->out,
							  c->w, c->M, c->N, c->K, 0);
		ret = ret ? ret : k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, c->y, c->out,
							 c->w, c->M, c->N, c->K, 0);
		if (graph) {
			CU(cudaStreamEndCapture(stream, &g));
			if (g && CU(cudaGraphInstantiate(&ge, g, 0)))
				CU(cudaGraphLaunch(ge, stream));
			if (ge)
				cudaGraphExecDestroy(ge);
			if (g)
				cudaGraphDestroy(g);
			g = NULL, ge = NULL;
		}
		CU(cudaStreamSynchronize(stream));
		CHECK(ret == 0, "chain%s M=%d N=%d K=%d: %d", graph ? " (graph)" : "", c->M, c->N,
		      c->K, ret);
		same_bits(graph ? "gemv(out) after the fold, graph" : "gemv(out) after the fold", c,
			  c->y, c->y_ref, n);
	}
}

static void check_case(int M, int N, int K)
{
	struct dev_case c;
	int ret;

	if (!case_make(&c, M, N, K)) {
		CHECK(0, "case M=%d N=%d K=%d: allocation", M, N, K);
		case_free(&c);
		return;
	}
	for (int acc = 0; acc <= 1; acc++) {
		poison(c.out, (size_t)M * K);
		poison(c.out_ref, (size_t)M * K);
		if (acc) {	/* the same random y0 in both */
			float *y0 = rand_host((size_t)M * N, -1.0f, 1.0f);

			CU(cudaMemcpy(c.y, y0, (size_t)M * N * 4, cudaMemcpyHostToDevice));
			CU(cudaMemcpy(c.y_ref, y0, (size_t)M * N * 4, cudaMemcpyHostToDevice));
			free(y0);
		} else {
			poison(c.y, (size_t)M * N);
			poison(c.y_ref, (size_t)M * N);
		}
		ret = run_ref(&c, acc);
		CHECK(ret == 0, "reference M=%d N=%d K=%d: %d", M, N, K, ret);
		ret = k_cuda_linear_norm_gemv(lin, c.y, c.x, c.nw, EPS, c.out, c.w, M, N, K, acc);
		CHECK(ret == 0, "k_cuda_linear_norm_gemv M=%d N=%d K=%d: %d", M, N, K, ret);
		CU(cudaStreamSynchronize(stream));
		same_bits(acc ? "y (accumulate)" : "y", &c, c.y, c.y_ref, (size_t)M * N);
		same_bits("out", &c, c.out, c.out_ref, (size_t)M * K);
	}
	check_chain(&c);
	/* the picked form takes it exactly where k_cuda_linear runs the GEMV */
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.out, c.w, M, N, K, 0);
	if (k_cuda_linear_choose(c.out, c.w, M, N, K) == K_CUDA_LINEAR_GEMV)
		CHECK(ret == 0, "k_cuda_linear_norm M=%d N=%d K=%d: %d (GEMV picked)", M, N, K, ret);
	else
		CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "k_cuda_linear_norm M=%d N=%d K=%d: %d "
		      "(the pick is not the GEMV)", M, N, K, ret);
	CU(cudaStreamSynchronize(stream));
	case_free(&c);
}

/* Calls the fold must decline, launching nothing (y keeps its poison). */
static void check_declines(void)
{
	struct dev_case c;
	float *h;
	int ret;

	if (!case_make(&c, MAX_M, 8192, 4096)) {	/* 64 MB of weights */
		CHECK(0, "declines: allocation");
		case_free(&c);
		return;
	}
	poison(c.y, (size_t)MAX_M * 8192);
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.out, c.w, 64, 2048, 2048, 0);
	CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "batch 64: %d", ret);
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.out, c.w, 2, 2048, 2048, 0);
	CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "M = 2 (split-K picked): %d", ret);
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.out, c.w, 1, 8192, 4096, 0);
	CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "64 MB matrix: %d", ret);
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.out, c.w, 1, 64, 1024, 0);
	CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "K = 1024 (warp-form norm): %d", ret);
	ret = k_cuda_linear_norm(lin, c.y, c.x, c.nw, EPS, c.x + 8, c.w, 1, 64, 2048, 0);
	CHECK(ret == K_CUDA_LINEAR_NORM_NOT_TAKEN, "out over x: %d", ret);
	ret = k_cuda_linear_norm_gemv(lin, c.y, c.x, c.nw, EPS, c.x + 8, c.w, 1, 64, 2048, 0);
	CHECK(ret == -EINVAL, "forced, out over x: %d", ret);
	ret = k_cuda_linear_norm_gemv(lin, c.y, c.x, c.nw, EPS, c.out, c.w, 3, 64, 2048, 0);
	CHECK(ret == -EINVAL, "forced, M = 3: %d", ret);
	CU(cudaStreamSynchronize(stream));
	h = download(c.y, (size_t)MAX_M * 8192);
	if (h) {
		size_t touched = 0;

		for (size_t i = 0; i < (size_t)MAX_M * 8192; i++)
			touched += !isnan(h[i]);
		CHECK(touched == 0, "declined calls wrote %zu floats of y", touched);
	}
	free(h);
	case_free(&c);
}

/* Median us of TIME_RUNS runs of the two launches (fold = 0) or the fold, each after
 * a memset that flushes L2, as a decode step finds the layer's weights. */
static double time_path(const struct dev_case *c, void *flush, int fold)
{
	cudaEvent_t a, b;
	float ms[TIME_RUNS];

	if (!CU(cudaEventCreate(&a)) || !CU(cudaEventCreate(&b)))
		return 0;
	for (int i = -2; i < TIME_RUNS; i++) {	/* two warm-up runs */
		CU(cudaMemsetAsync(flush, i & 0xff, FLUSH_BYTES, stream));
		CU(cudaEventRecord(a, stream));
		if (fold)
			k_cuda_linear_norm_gemv(lin, c->y, c->x, c->nw, EPS, c->out, c->w, c->M,
						c->N, c->K, 0);
		else
			run_ref(c, 0);
		CU(cudaEventRecord(b, stream));
		CU(cudaEventSynchronize(b));
		if (i >= 0)
			CU(cudaEventElapsedTime(&ms[i], a, b));
	}
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	return test_median(ms, TIME_RUNS) * 1000.0;
}

static void time_shapes(void)
{
	static const struct { const char *name; int M, N, K; } s[] = {
		{ "V2-Lite q+kv_a (mla_prep)", 1, 3648, 2048 },
		{ "V2-Lite router", 1, 64, 2048 },
		{ "V2-Lite q+kv_a, M = 2", 2, 3648, 2048 },
		{ "K 4096, 8 MB", 1, 1024, 4096 },
		{ "K 7168, 14 MB", 1, 1024, 7168 },
	};
	void *flush = dalloc(FLUSH_BYTES);

	if (!flush)
		return;
	printf("%-28s %2s %5s %5s %10s %9s %9s %9s\n", "timing (cold L2)", "M", "N", "K",
	       "norm+gemv", "fold", "saved", "floor");
	for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++) {
		struct dev_case c;
		double t0, t1, floor_us;

		if (!case_make(&c, s[i].M, s[i].N, s[i].K)) {
			case_free(&c);
			continue;
		}
		t0 = time_path(&c, flush, 0);
		t1 = time_path(&c, flush, 1);
		floor_us = (double)s[i].N * s[i].K * 2 / (HBM_TBS * 1e12) * 1e6;
		printf("%-28s %2d %5d %5d %8.2fus %7.2fus %7.2fus %7.2fus\n", s[i].name, s[i].M,
		       s[i].N, s[i].K, t0, t1, t0 - t1, floor_us);
		case_free(&c);
	}
	cudaFree(flush);
}

int main(void)
{
	static const int ks[] = { 1096, 2048, 4096, 7168 };
	static const int ns[] = { 1, 7, 129, 1001, 3649 };
	int count = 0, ret;

	k_cuda_device_count(&count);
	if (count == 0) {
		fprintf(stderr, "test_cuda_norm_gemv: skipped: no CUDA device on this machine\n");
		return 77;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	ret = k_cuda_linear_create(&lin, stream, MAX_M, MAX_K);
	CHECK(ret == 0, "k_cuda_linear_create: %d", ret);
	if (ret)
		return test_result("test_cuda_norm_gemv");
	printf("tolerance: y and out equal to rmsnorm + gemv bit for bit\n");
	for (int m = 1; m <= 2; m++)
		for (size_t k = 0; k < sizeof(ks) / sizeof(ks[0]); k++)
			for (size_t n = 0; n < sizeof(ns) / sizeof(ns[0]); n++)
				check_case(m, ns[n], ks[k]);
	check_declines();
	time_shapes();
	k_cuda_linear_destroy(lin);
	cudaStreamDestroy(stream);
	return test_result("test_cuda_norm_gemv");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_norm_gemv: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
