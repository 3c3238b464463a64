// cuBLASLt for the decode-sized calls that go to cuBLAS: for each shape the heuristic's
// candidate algorithms (and cublasGemmEx's own choice) are timed once, outside the
// step's capture, each replayed alone as a graph from a cold L2 as a decode step sees
// its weights, and the fastest median is kept for the life of the context.
//
// Why: cublasGemmEx's heuristic picks tiles for arithmetic; at decode M (2..64) the call
// is a stream of the weights, and its pick leaves Llama-3.1-8B's q/k/v at 69%, o_proj at
// 63% and down at 76% of the HBM floor at M = 64 (docs/results/cuda-linear-41224dd.txt),
// where some of the other candidates fill the GPU better.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/linear_internal.h"

#define LT_MAX_CANDIDATES 64

struct lin_lt_entry {
	int M, N, K, beta;
	bool y_bf16;			/* y in bf16, else fp32 */
	bool use_lt;			/* else cublasGemmEx was the fastest */
	cublasLtMatmulAlgo_t algo;
};

int k_cuda_lin_lt_check(cublasStatus_t s, const char *call, int dev)
{
	if (s == CUBLAS_STATUS_SUCCESS)
		return 0;
	k_cuda_log("cublasLt: %s failed on device %d: %s", call, dev, cublasGetStatusString(s));
	return s == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO;
}

void k_cuda_lin_lt_descs_free(struct lin_lt_descs *d)
{
	if (d->op)
		cublasLtMatmulDescDestroy(d->op);
	if (d->a)
		cublasLtMatrixLayoutDestroy(d->a);
	if (d->b)
		cublasLtMatrixLayoutDestroy(d->b);
	if (d->c)
		cublasLtMatrixLayoutDestroy(d->c);
	*d = {};
}

static cudaDataType_t lt_ytype(bool y_bf16)
{
	return y_bf16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The descriptors of y^T (N, M) = w^T (col-major K x N, transposed) . xb (col-major K x M).
static int lt_descs_make(int dev, struct lin_lt_descs *d, int M, int N, int K, bool y_bf16)
{
	const cublasOperation_t t = CUBLAS_OP_T;
	int ret;

	*d = {};
	ret = LIN_LT(dev, cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
	if (!ret)
		ret = LIN_LT(dev, cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA,
								 &t, sizeof(t)));
	if (!ret)
		ret = LIN_LT(dev, cublasLtMatrixLayoutCreate(&d->a, CUDA_R_16BF, K, N, K));
	if (!ret)
		ret = LIN_LT(dev, cublasLtMatrixLayoutCreate(&d->b, CUDA_R_16BF, K, M, K));
	if (!ret)
		ret = LIN_LT(dev, cublasLtMatrixLayoutCreate(&d->c, lt_ytype(y_bf16), N, M, N));
	if (ret)
		k_cuda_lin_lt_descs_free(d);
	return ret;
}

static cublasStatus_t lt_run(const struct k_cuda_linear *ctx, const struct lin_lt_descs *d,
			     const cublasLtMatmulAlgo_t *algo, void *y, const uint16_t *xb,
			     const uint16_t *w, int beta)
{
	const float one = 1.0f, b = beta ? 1.0f : 0.0f;

	return cublasLtMatmul(ctx->lt, d->op, &one, w, d->a, xb, d->b, &b, y, d->c, y, d->c, algo,
			      ctx->blas_ws, LIN_BLAS_WS_BYTES, ctx->stream);
}

static cublasStatus_t lt_gemmex(const struct k_cuda_linear *ctx, void *y, bool y_bf16,
				const uint16_t *xb, const uint16_t *w, int M, int N, int K, int beta)
{
	const float one = 1.0f, b = beta ? 1.0f : 0.0f;

	return cublasGemmEx(ctx->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K,
			    xb, CUDA_R_16BF, K, &b, y, lt_ytype(y_bf16), N, CUBLAS_COMPUTE_32F,
			    CUBLAS_GEMM_DEFAULT);
}

// What lt_time's graph holds: candidate i (-1: cublasGemmEx) into the scratch y.
struct lt_call {
	const struct lin_lt_descs *d;
	const cublasLtMatmulHeuristicResult_t *cand;
	int i;
	void *ys;
	bool y_bf16;
	const uint16_t *xb, *w;
	int M, N, K, beta;
};

static int lt_enqueue(const struct k_cuda_linear *ctx, void *arg)
{
	const struct lt_call *c = (const struct lt_call *)arg;
	cublasStatus_t s = c->i < 0 ? lt_gemmex(ctx, c->ys, c->y_bf16, c->xb, c->w, c->M, c->N,
						 c->K, c->beta)
				    : lt_run(ctx, c->d, &c->cand[c->i].algo, c->ys, c->xb, c->w,
					     c->beta);

	return s == CUBLAS_STATUS_SUCCESS ? 0 : -EIO;
}

// Median of the cold-L2 replays of candidate i (-1: cublasGemmEx) captured alone in a
// graph (k_cuda_lin_time), in ms, as a decode step replays it (a split-K candidate's
// reduction kernel with its in-graph launch gap included); < 0 if it fails. *nodes: the
// graph's nodes (kernels). Writes only the scratch y. The median, not the fastest: two
// candidates a few tenths of a microsecond apart were picked by the noise of the fastest
// of three, and the step's time moved with the pick (Llama-3.1-8B batch 64: 7.16
// against 7.24 ms).
static float lt_time(const struct k_cuda_linear *ctx, const struct lin_lt_descs *d,
		     const cublasLtMatmulHeuristicResult_t *cand, int i,
		     const struct lin_time_scratch *ts, bool y_bf16, const uint16_t *xb,
		     const uint16_t *w, int M, int N, int K, int beta, int *nodes)
{
	struct lt_call c = { d, cand, i, ts->ys, y_bf16, xb, w, M, N, K, beta };

	return k_cuda_lin_time(ctx, ts, lt_enqueue, &c, nodes);
}

// One KDEC_LT_LOG line (k_cuda_tuning()->lt_log; a diagnostic behind a knob, so plain
// prints): GemmEx's time, the pick's, and the fastest plan of another kernel count (a
// split-K GEMM + reduce against one kernel), whose margin says how near the pick was to
// a step with one kernel more or fewer per call.
static void lt_log_pick(int M, int N, int K, int beta, bool y_bf16, float gemmex,
			int gemmex_nodes, int pick, float best, int best_nodes, const float *ms,
			const int *nodes, int n)
{
	float alt = gemmex_nodes != best_nodes && gemmex > 0 ? gemmex : -1.0f;
	int alt_nodes = gemmex_nodes;

	for (int i = 0; i < n; i++)
		if (ms[i] > 0 && nodes[i] != best_nodes && (alt < 0 || ms[i] < alt)) {
			alt = ms[i];
			alt_nodes = nodes[i];
		}
	fprintf(stderr, "cublasLt: M %d N %d K %d beta %d y %s: cublasGemmEx %.2f us (%d kernels); "
		"kept %s%.2f us (%d kernels), %d candidates", M, N, K, beta,
		y_bf16 ? "bf16" : "fp32", gemmex * 1e3, gemmex_nodes,
		pick < 0 ? "cublasGemmEx " : "a candidate ", best * 1e3, best_nodes, n);
	if (alt > 0)
		fprintf(stderr, "; fastest with %d kernels %.2f us (+%.1f%%)", alt_nodes, alt * 1e3,
			100.0f * (alt - best) / best);
	fputc('\n', stderr);
}

// How many candidates to ask for: k_cuda_tuning()->lt_candidates (16; up to
// LT_MAX_CANDIDATES for A/B runs of a wider search).
static int lt_candidates(void)
{
	const int n = k_cuda_tuning()->lt_candidates;

	return n < 1 ? 1 : n > LT_MAX_CANDIDATES ? LT_MAX_CANDIDATES : n;
}

// Times the candidates for one shape and records the winner in its cache entry (use_lt
// false: cublasGemmEx, also where tuning failed).
static int lt_tune(struct k_cuda_linear *ctx, const struct lin_lt_descs *d, const uint16_t *xb,
		   const uint16_t *w, int M, int N, int K, int beta, bool y_bf16,
		   struct lin_lt_entry *e)
{
	cublasLtMatmulHeuristicResult_t cand[LT_MAX_CANDIDATES];
	cublasLtMatmulPreference_t pref = NULL;
	const size_t ws = LIN_BLAS_WS_BYTES;
	struct lin_time_scratch ts;
	float best, gemmex, ms[LT_MAX_CANDIDATES];	// ms[i]: candidate i (< 0: failed)
	int n = 0, ret, pick = -1, gemmex_nodes = 0, best_nodes = 0;
	int nodes[LT_MAX_CANDIDATES];

	e->M = M;
	e->N = N;
	e->K = K;
	e->beta = beta;
	e->y_bf16 = y_bf16;
	e->use_lt = false;
	ret = LIN_LT(ctx->dev, cublasLtMatmulPreferenceCreate(&pref));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulPreferenceSetAttribute(pref,
				CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulAlgoGetHeuristic(ctx->lt, d->op, d->a, d->b, d->c,
				d->c, pref, lt_candidates(), cand, &n));
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	if (ret || n == 0)
		return ret;	// cublasGemmEx it is
	// scratch for the timed runs: where the device has no room for it (the KV cache
	// may hold nearly all of it), cublasGemmEx stays, as without tuning
	if ((ret = k_cuda_lin_time_scratch_get(ctx, (size_t)M * N * (y_bf16 ? 2 : 4), &ts))) {
		if (ret != -ENOMEM)
			return ret;
		k_cuda_log("cublasLt: M %d N %d K %d not tuned: no room on device %d for %zu MB "
			   "of timing scratch; cublasGemmEx's choice stays", M, N, K, ctx->dev,
			   ((size_t)M * N * (y_bf16 ? 2 : 4) + LIN_TIME_FLUSH_BYTES) >> 20);
		return 0;
	}
	gemmex = best = lt_time(ctx, d, cand, -1, &ts, y_bf16, xb, w, M, N, K, beta,
				&gemmex_nodes);
	best_nodes = gemmex_nodes;
	for (int i = 0; i < n; i++) {
		float t = -1.0f;

		nodes[i] = 0;
		if (cand[i].state == CUBLAS_STATUS_SUCCESS)
			t = lt_time(ctx, d, cand, i, &ts, y_bf16, xb, w, M, N, K, beta, &nodes[i]);
		ms[i] = t;
		if (t > 0 && (best < 0 || t < best)) {
			best = t;
			best_nodes = nodes[i];
			pick = i;
			e->use_lt = true;
			e->algo = cand[i].algo;
		}
	}
	if (k_cuda_tuning()->lt_log)
		lt_log_pick(M, N, K, beta, y_bf16, gemmex, gemmex_nodes, pick, best, best_nodes, ms,
			    nodes, n);
	k_cuda_lin_time_scratch_put(&ts);
	return 0;
}

static struct lin_lt_entry *lt_find(struct k_cuda_linear *ctx, int M, int N, int K, int beta,
				     bool y_bf16)
{
	for (int i = 0; i < ctx->lt_n; i++) {
		struct lin_lt_entry *e = &ctx->lt_cache[i];

		if (e->M == M && e->N == N && e->K == K && e->beta == beta && e->y_bf16 == y_bf16)
			return e;
	}
	return NULL;
}

// Whether algo (tuned at another M) is valid for d's shape.
static bool lt_algo_fits(const struct k_cuda_linear *ctx, const struct lin_lt_descs *d,
			 const cublasLtMatmulAlgo_t *algo)
{
	cublasLtMatmulHeuristicResult_t r = {};

	return cublasLtMatmulAlgoCheck(ctx->lt, d->op, d->a, d->b, d->c, d->c, algo, &r) ==
		       CUBLAS_STATUS_SUCCESS && r.workspaceSize <= LIN_BLAS_WS_BYTES;
}

int k_cuda_lin_lt(struct k_cuda_linear *ctx, void *y, bool y_bf16, const uint16_t *xb,
		  const uint16_t *w, int M, int N, int K, int beta, bool *done)
{
	struct lin_lt_entry *e;
	struct lin_lt_descs d;
	const int Mb = k_cuda_lin_bucket(M);	// the M whose pick it takes
	int ret;

	*done = false;
	if (!k_cuda_tuning()->linear_tune || !ctx->lt || M > LIN_LT_MAX_M)
		return 0;
	e = lt_find(ctx, Mb, N, K, beta, y_bf16);
	if (!e && Mb != M)
		return 0;	// its bucket is not tuned: cublasGemmEx, no tuning here
	if (!e) {
		// timing needs a stream that runs: a shape first seen in capture keeps GemmEx
		if (!k_cuda_lin_stream_runs(ctx) || ctx->lt_n == LIN_LT_CACHE)
			return 0;
		// a tuning that fails (logged) leaves the shape to cublasGemmEx for good
		e = &ctx->lt_cache[ctx->lt_n++];
		if (lt_descs_make(ctx->dev, &d, M, N, K, y_bf16)) {
			*e = lin_lt_entry{ M, N, K, beta, y_bf16, false, {} };
			return 0;
		}
		lt_tune(ctx, &d, xb, w, M, N, K, beta, y_bf16, e);
		k_cuda_lin_lt_descs_free(&d);
	}
	if (!e->use_lt || lt_descs_make(ctx->dev, &d, M, N, K, y_bf16))
		return 0;
	if (Mb != M && !lt_algo_fits(ctx, &d, &e->algo)) {
		k_cuda_lin_lt_descs_free(&d);
		return 0;
	}
	ret = LIN_LT(ctx->dev, lt_run(ctx, &d, &e->algo, y, xb, w, beta));
	k_cuda_lin_lt_descs_free(&d);
	*done = !ret;
	return ret;
}

int k_cuda_lin_lt_setup(struct k_cuda_linear *ctx)
{
	ctx->lt_cache = (struct lin_lt_entry *)calloc(LIN_LT_CACHE, sizeof(*ctx->lt_cache));
	if (!ctx->lt_cache)
		return -ENOMEM;
	return LIN_LT(ctx->dev, cublasLtCreate(&ctx->lt));
}

void k_cuda_lin_lt_destroy(struct k_cuda_linear *ctx)
{
	if (ctx->lt)
		cublasLtDestroy(ctx->lt);
	free(ctx->lt_cache);
}
