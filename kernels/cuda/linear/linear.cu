// The linear-layer entry points: the per-stream context (cuBLAS handle, workspace, x
// scratch), the choice of variant by shape, and the cuBLAS path for prefill-sized M.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/linear_internal.h"

/* Where the kernels of this file beat cuBLAS, measured on H200 (docs/PERFORMANCE.md,
 * bench_cuda_linear, weights rotated out of L2, graph replays): for matrices of at
 * most 16 MiB (k_cuda_tuning's linear_small_mb; DeepSeek-V2-Lite's 2048-wide
 * projections and experts: 1.0-1.8x faster, as cuBLAS pays a fixed ~6 us there), the
 * GEMV at M = 1 and split-K up to M = 16; for the 32-64 MB ones (Llama-3.1-8B q/k/v,
 * o_proj) the streaming kernel up to M = 8. On the 117-235 MB matrices cuBLAS streams
 * at 3.7-4.2 TB/s and beats both at every M. A wgmma (sm_90a) weight-streaming kernel
 * for 8 < M <= 64 was tried and removed (2026-12-02): it lost to tuned cuBLAS at every
 * measured shape, at M = 64 q/k/v 18.8 us against 17.6, o_proj 15.2 against 13.3,
 * gate_up 67.5 against 61.8, down 39.4 against 37.0, and end to end (Llama-3.1-8B batch
 * 64 7.19-7.32 ms against 7.16; docs/results/cuda-linear-97bfe73.txt). */
#define LIN_GEMV_MAX_M		1
#define LIN_SPLITK_MAX_M	16
/* The streaming kernel takes M <= 8 on matrices above linear_small_mb (where the GEMV
 * and split-K kernels win) and up to linear_stream_mb (64 MiB; 0 turns it off):
 * Llama-3.1-8B q/k/v 15.9 us against cuBLAS's 17.5 at M = 1, o_proj 11.9 against 12.8;
 * even at M = 8; behind cuBLAS from M = 16, where its mma.sync tiles are bound by
 * instruction issue, not bytes (docs/results/cuda-linear-41224dd.txt). */
#define LIN_STREAM_MAX_M	8
/* The vector kernels read 8 bf16 (16 bytes) of a weight row at a time. */
#define LIN_VEC_K		8

int k_cuda_lin_pdl_attr(const struct k_cuda_linear *ctx, cudaLaunchAttribute *attrs)
{
	if (!ctx->pdl)
		return 0;
	attrs->id = cudaLaunchAttributeProgrammaticStreamSerialization;
	attrs->val.programmaticStreamSerializationAllowed = 1;
	return 1;
}

static int lin_blas_check(cublasStatus_t s, const char *call, const char *file, int line, int dev)
{
	if (s == CUBLAS_STATUS_SUCCESS)
		return 0;
	k_cuda_log("cublas: %s failed at %s:%d on device %d: %s", call, file, line, dev,
		   cublasGetStatusString(s));
	return s == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO;
}
#define LIN_BLAS(dev, call) lin_blas_check((call), #call, __FILE__, __LINE__, (dev))

// ---- variant predicates, tried in this order -------------------------------

static bool lin_vec_ok(const float *x, const uint16_t *w, int K)
{
	return K % LIN_VEC_K == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0;
}

// k_cuda_tuning()->linear_small_mb (experiments): the weight size up to which the
// project's kernels are tried before cuBLAS.
static bool lin_small_weights(int N, int K)
{
	return (size_t)N * (size_t)K * sizeof(uint16_t) <=
	       (size_t)k_cuda_tuning()->linear_small_mb << 20;
}

// linear_ring: the rows up to which the ring GEMV takes the matrices above
// linear_small_mb, where it has a plan (else the pick would fall to the generic kernel:
// session 22's first measurement of the ring at 8 rows spent 3 ms in Llama-3.1-8B's LM
// head so).
static bool lin_use_ring(int M, int N, int K)
{
	return M <= k_cuda_tuning()->linear_ring && !lin_small_weights(N, K) &&
	       k_cuda_lin_bf16_gemv_shape_ok(M, N, K);
}

// linear_stream_mb: the weight size up to which the streaming kernel is used.
static bool lin_use_stream(int M, int N, int K)
{
	return M <= LIN_STREAM_MAX_M && K % LIN_VEC_K == 0 && !lin_small_weights(N, K) &&
	       (size_t)N * (size_t)K * sizeof(uint16_t) <=
		       (size_t)k_cuda_tuning()->linear_stream_mb << 20;
}

static bool lin_use_gemv(int M, int N, int K)
{
	return M <= LIN_GEMV_MAX_M && K % LIN_VEC_K == 0 && lin_small_weights(N, K);
}

static bool lin_use_splitk(int M, int N, int K)
{
	return M <= LIN_SPLITK_MAX_M && K % LIN_VEC_K == 0 && lin_small_weights(N, K);
}

/* cuBLAS takes any shape; the generic kernel is left for tiny ones, where a cuBLAS
 * call costs more than the work. */
static bool lin_use_cublas(int M, int N, int K)
{
	return M > LIN_SPLITK_MAX_M || (size_t)N * (size_t)K >= 4096;
}

extern "C" enum k_cuda_linear_kind k_cuda_linear_pick(int M, int N, int K)
{
	if (k_cuda_tuning()->linear_fp32x)	// KDEC_LINEAR_FP32X: x never rounded
		return K % LIN_VEC_K == 0 ? K_CUDA_LINEAR_GEMV : K_CUDA_LINEAR_GENERIC;
	if (lin_use_ring(M, N, K))
		return K_CUDA_LINEAR_RING;
	if (lin_use_stream(M, N, K))
		return K_CUDA_LINEAR_STREAM;
	if (lin_use_gemv(M, N, K))
		return K_CUDA_LINEAR_GEMV;
	if (lin_use_splitk(M, N, K))
		return K_CUDA_LINEAR_SPLITK;
	if (lin_use_cublas(M, N, K))
		return K_CUDA_LINEAR_CUBLAS;
	return K_CUDA_LINEAR_GENERIC;
}

extern "C" int k_cuda_linear_supports(enum k_cuda_linear_kind kind, const float *x,
				      const uint16_t *w, int M, int N, int K)
{
	if (M < 1 || N < 1 || K < 1)
		return 0;
	switch (kind) {
	case K_CUDA_LINEAR_RING:	// in blocks of up to K_CUDA_LINEAR_RING_M rows
		return lin_vec_ok(x, w, K) &&
		       k_cuda_lin_bf16_gemv_shape_ok(M < K_CUDA_LINEAR_RING_M ? M : K_CUDA_LINEAR_RING_M,
						     N, K);
	case K_CUDA_LINEAR_GEMV:
	case K_CUDA_LINEAR_SPLITK:
	case K_CUDA_LINEAR_STREAM:
		return lin_vec_ok(x, w, K);
	case K_CUDA_LINEAR_CUBLAS:
	case K_CUDA_LINEAR_GENERIC:
		return 1;
	default:
		return 0;
	}
}

extern "C" const char *k_cuda_linear_kind_name(enum k_cuda_linear_kind kind)
{
	switch (kind) {
	case K_CUDA_LINEAR_RING: return "ring";
	case K_CUDA_LINEAR_GEMV: return "gemv";
	case K_CUDA_LINEAR_SPLITK: return "splitk";
	case K_CUDA_LINEAR_STREAM: return "stream";
	case K_CUDA_LINEAR_CUBLAS: return "cublas";
	case K_CUDA_LINEAR_GENERIC: return "generic";
	default: return "?";
	}
}

// ---- context ----------------------------------------------------------------

extern "C" void k_cuda_linear_destroy(struct k_cuda_linear *ctx)
{
	if (!ctx)
		return;
	if (ctx->blas)
		cublasDestroy(ctx->blas);
	k_cuda_lin_lt_destroy(ctx);
	k_cuda_lin_split_destroy(ctx);
	free(ctx->kind_cache);
	free(ctx->round_log);
	cudaFree(ctx->blas_ws);
	cudaFree(ctx->xb);
	cudaFree(ctx->st_ws);
	cudaFree(ctx->st_cnt);
	free(ctx);
}

extern "C" int k_cuda_linear_create(struct k_cuda_linear **out, cudaStream_t stream, int max_M,
				    int max_K)
{
	struct k_cuda_linear *ctx;
	int ret;

	*out = NULL;
	if (max_M < 1 || max_K < 1)
		return -EINVAL;
	ctx = (struct k_cuda_linear *)calloc(1, sizeof(*ctx));
	if (!ctx)
		return -ENOMEM;
	ctx->stream = stream;
	ctx->max_M = max_M;
	ctx->max_K = max_K;
	ctx->dev = -1;
	ctx->pdl = 1;
	ctx->pdl_ok = 1;
	ret = LIN_CUDA(-1, cudaGetDevice(&ctx->dev));
	if (ret)
		goto err;
	ret = LIN_CUDA(ctx->dev, cudaDeviceGetAttribute(&ctx->n_sm, cudaDevAttrMultiProcessorCount,
							ctx->dev));
	if (ret)
		goto err;
	ret = LIN_CUDA(ctx->dev, cudaMalloc((void **)&ctx->xb,
					    (size_t)max_M * max_K * sizeof(uint16_t)));
	if (ret)
		goto err;
	ret = LIN_CUDA(ctx->dev, cudaMalloc(&ctx->blas_ws, LIN_BLAS_WS_BYTES));
	if (ret)
		goto err;
	ret = LIN_BLAS(ctx->dev, cublasCreate(&ctx->blas));
	if (ret)
		goto err;
	// cublasSetStream resets the workspace to the default pool: set the stream first
	ret = LIN_BLAS(ctx->dev, cublasSetStream(ctx->blas, stream));
	if (!ret)
		ret = LIN_BLAS(ctx->dev, cublasSetWorkspace(ctx->blas, ctx->blas_ws,
							    LIN_BLAS_WS_BYTES));
	if (!ret)
		ret = k_cuda_lin_gemv_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_lt_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_split_setup(ctx);
	if (!ret && !(ctx->kind_cache = (struct lin_kind_entry *)calloc(LIN_KIND_CACHE,
									 sizeof(*ctx->kind_cache))))
		ret = -ENOMEM;
	if (!ret && !(ctx->round_log = (struct lin_round_entry *)calloc(LIN_ROUND_LOG,
									 sizeof(*ctx->round_log))))
		ret = -ENOMEM;
	if (!ret)
		ret = k_cuda_lin_stream_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_splitk_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_qmma_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_qtile_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_qwg_setup(ctx);
	if (!ret)
		ret = k_cuda_lin_qgemv_setup(ctx);
	if (ret)
		goto err;
	ctx->pdl_ok = ctx->pdl;
	*out = ctx;
	return 0;
err:
	k_cuda_linear_destroy(ctx);
	return ret;
}

extern "C" void k_cuda_linear_set_shared(struct k_cuda_linear *ctx, int shared)
{
	if (ctx)
		ctx->shared = shared != 0;
}

// ---- launchers --------------------------------------------------------------

// x rounded to bf16 into the scratch, then y^T (N, M) = w (K, N col-major)^T x^T (K, M):
// through cuBLASLt with a timed algorithm for decode-sized calls on large matrices
// (linear_lt.cu), else cublasGemmEx. ready: xb holds bf16(x) already. y: fp32, or bf16
// where y_bf16 (fp32 accumulation either way).
static int lin_cublas(struct k_cuda_linear *ctx, void *y, bool y_bf16, const float *x,
		      const uint16_t *w, int M, int N, int K, int accumulate, bool ready)
{
	const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
	bool done = false;
	int ret;

	ret = ready ? 0 : k_cuda_lin_to_bf16(ctx, ctx->xb, x, (size_t)M * K);
	if (!ret && !lin_small_weights(N, K))
		ret = k_cuda_lin_lt(ctx, y, y_bf16, ctx->xb, w, M, N, K, accumulate, &done);
	if (ret || done)
		return ret;
	// beta = 0: cuBLAS does not read y, so poisoned or stale outputs are fine
	return LIN_BLAS(ctx->dev, cublasGemmEx(ctx->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha,
					       w, CUDA_R_16BF, K, ctx->xb, CUDA_R_16BF, K, &beta,
					       y, y_bf16 ? CUDA_R_16BF : CUDA_R_32F, N,
					       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Whether x is the one whose bf16 form a producer left in the scratch (good for this
// one call); -EINVAL where it left only that form and kind reads fp32 x.
int k_cuda_lin_take_ready(struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind,
			  const float *x, int M, int N, int K, bool *ready)
{
	*ready = x == ctx->ready_x && M == ctx->ready_M && K == ctx->ready_K;
	ctx->ready_x = nullptr;
	if (*ready && ctx->ready_only && !k_cuda_linear_kind_reads_bf16(kind)) {
		k_cuda_log("cuda linear: M %d N %d K %d: x was written in bf16 only, but the %s "
			   "kernel reads fp32 x", M, N, K, k_cuda_linear_kind_name(kind));
		return -EINVAL;
	}
	return 0;
}

static bool lin_args_ok(const struct k_cuda_linear *ctx, const float *y, const float *x,
			const uint16_t *w, int M, int N, int K)
{
	return ctx && y && x && w && M >= 1 && N >= 1 && K >= 1 && M <= ctx->max_M &&
	       K <= ctx->max_K;
}

// KDEC_LINEAR_RING_STREAM: which kernel a block of M <= 8 rows of the ring kind takes.
// The cluster streaming form (linear_qmma.cu, the quantized decode's form for Llama's
// fp8 gate/up at 88% of the floor where the decode GEMV reached 68% on bf16, session 22)
// where its clusters leave room on the GPU, by k_cuda_linear_q_choose's rule for
// quantized weights (1), or wherever it has a plan (2); the decode GEMV otherwise, and
// for the SwiGLU form, which only that one has (0: always).
static bool lin_ring_stream(const struct k_cuda_linear *ctx, int M, int N, int K, int xf)
{
	const int mode = k_cuda_tuning()->linear_ring_stream;
	int S;

	if (!mode || xf == LIN_QG_X_SWIGLU)
		return false;
	S = k_cuda_lin_qmma_split(ctx, true, &k_cuda_lin_bf16_q, M, N, K);
	return S > 0 && (mode == 2 || !k_cuda_lin_qstream_fills(ctx, S, N));
}

// The ring GEMV over blocks of up to K_CUDA_LINEAR_RING_M rows (one launch at decode
// sizes); xf: what x is (LIN_QG_X_SWIGLU: gate_up rows of 2K).
static int lin_ring(struct k_cuda_linear *ctx, float *y, const float *x, const uint16_t *w,
		    int M, int N, int K, int accumulate, int xf, const struct k_cuda_xnorm *nrm)
{
	const size_t xs = xf == LIN_QG_X_SWIGLU ? 2 * (size_t)K : (size_t)K;
	int ret = 0;

	for (int m0 = 0; m0 < M && !ret; m0 += K_CUDA_LINEAR_RING_M) {
		const int mb = M - m0 < K_CUDA_LINEAR_RING_M ? M - m0 : K_CUDA_LINEAR_RING_M;
		struct k_cuda_xnorm n = {};

		if (nrm)
			n = { nrm->w, nrm->eps, nrm->out ? nrm->out + (size_t)m0 * K : nullptr };
		if (lin_ring_stream(ctx, mb, N, K, xf))
			ret = k_cuda_lin_qmma(ctx, true, y + (size_t)m0 * N, x + (size_t)m0 * xs, w,
					      &k_cuda_lin_bf16_q, mb, N, K, accumulate,
					      nrm ? &n : nullptr);
		else
			ret = k_cuda_lin_qgemv(ctx, y + (size_t)m0 * N, x + (size_t)m0 * xs, w,
					       &k_cuda_lin_bf16_q, mb, N, K, accumulate, xf,
					       nrm ? &n : nullptr);
	}
	return ret;
}

extern "C" int k_cuda_linear_norm_run(struct k_cuda_linear *ctx, float *y, const float *x,
				      const struct k_cuda_xnorm *norm, const uint16_t *w, int M,
				      int N, int K, int accumulate)
{
	bool ready;

	if (!lin_args_ok(ctx, y, x, w, M, N, K) || M > K_CUDA_LINEAR_RING_M || !norm ||
	    !norm->w || ((uintptr_t)norm->w & 15) || ((uintptr_t)norm->out & 15) ||
	    k_cuda_linear_choose_tuned(ctx, x, w, M, N, K) != K_CUDA_LINEAR_RING ||
	    (norm->out && norm->out < x + (size_t)M * K && x < norm->out + (size_t)M * K))
		return -EINVAL;	// out overlapping x: row block 0 would write what others read
	// clears any bf16 mark: the ring reads fp32 x
	if (k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_RING, x, M, N, K, &ready))
		return -EINVAL;
	return lin_ring(ctx, y, x, w, M, N, K, accumulate != 0, LIN_QG_X_NORM, norm);
}

extern "C" int k_cuda_linear_swiglu_run(struct k_cuda_linear *ctx, float *y, const float *gate_up,
					const uint16_t *w, int M, int N, int K, int accumulate)
{
	bool ready;

	if (!lin_args_ok(ctx, y, gate_up, w, M, N, K) || M > K_CUDA_LINEAR_RING_M ||
	    k_cuda_linear_choose_tuned(ctx, gate_up, w, M, N, K) != K_CUDA_LINEAR_RING)
		return -EINVAL;
	if (k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_RING, gate_up, M, N, K, &ready))
		return -EINVAL;
	return lin_ring(ctx, y, gate_up, w, M, N, K, accumulate != 0, LIN_QG_X_SWIGLU, nullptr);
}

// The launch of one kind, x's bf16 copy already in ctx->xb where ready.
static int lin_launch(struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind, float *y,
		      const float *x, const uint16_t *w, int M, int N, int K, int accumulate,
		      bool ready)
{
	switch (kind) {
	case K_CUDA_LINEAR_RING:
		return lin_ring(ctx, y, x, w, M, N, K, accumulate, LIN_QG_X_PLAIN, nullptr);
	case K_CUDA_LINEAR_GEMV:
		return k_cuda_lin_gemv(ctx, y, x, w, M, N, K, accumulate);
	case K_CUDA_LINEAR_SPLITK:
		return k_cuda_lin_splitk(ctx, y, x, w, M, N, K, accumulate);
	case K_CUDA_LINEAR_STREAM:
		return k_cuda_lin_stream(ctx, y, x, w, M, N, K, accumulate, ready);
	case K_CUDA_LINEAR_CUBLAS:
		return lin_cublas(ctx, y, false, x, w, M, N, K, accumulate, ready);
	case K_CUDA_LINEAR_GENERIC:
		return k_cuda_lin_generic(ctx, y, x, w, M, N, K, accumulate);
	default:
		return -EINVAL;
	}
}

extern "C" int k_cuda_linear_run_kind(struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind,
				      float *y, const float *x, const uint16_t *w, int M, int N,
				      int K, int accumulate)
{
	bool ready;

	if (!lin_args_ok(ctx, y, x, w, M, N, K) || !k_cuda_linear_supports(kind, x, w, M, N, K))
		return -EINVAL;
	if (k_cuda_lin_take_ready(ctx, kind, x, M, N, K, &ready))
		return -EINVAL;
	return lin_launch(ctx, kind, y, x, w, M, N, K, accumulate != 0, ready);
}

// ---- KDEC_LINEAR_RING_TUNE: the ring kind where it times faster -----------------

/* The ring is kept only where it times at least 3% faster alone: session 28 (H100)
 * kept it on ties (DeepSeek-V2-Lite batch 1: 10.53 against 10.59 us, 44.64 against
 * 44.93) and that step ran 1.6% slower in the graph, while the shapes it won by 7-17%
 * (batch 8) made theirs 3% faster. */
#define LIN_RING_TUNE_MARGIN	0.97f

static int lin_kind_find(const struct k_cuda_linear *ctx, int Mb, int N, int K)
{
	for (int i = 0; i < ctx->kind_n; i++) {
		const struct lin_kind_entry *e = &ctx->kind_cache[i];

		if (e->M == Mb && e->N == N && e->K == K)
			return e->kind;
	}
	return -1;
}

// k_cuda_lin_time's view of one kind's launch into the timing scratch.
struct lin_kind_call {
	enum k_cuda_linear_kind kind;
	const float *x;
	const uint16_t *w;
	int M, N, K;
	bool ready;
	float *ys;
};

static int lin_kind_run(const struct k_cuda_linear *ctx, void *arg)
{
	const struct lin_kind_call *c = (const struct lin_kind_call *)arg;

	// in a capture: no kernel of either kind tunes or keeps anything there
	return lin_launch(const_cast<struct k_cuda_linear *>(ctx), c->kind, c->ys, c->x, c->w,
			  c->M, c->N, c->K, 0, c->ready);
}

// Times `kind` and the ring kind on this call's x and w (y into scratch), each run once
// untimed first so that their own tunings (cuBLASLt's algorithm, the ring's K split)
// are done outside the capture as the real call's are, and keeps the faster for the
// shape at its bucket M (= M here). Where a timing fails, `kind` is kept.
static enum k_cuda_linear_kind lin_kind_tune(struct k_cuda_linear *ctx, const float *x,
					     const uint16_t *w, int M, int N, int K,
					     enum k_cuda_linear_kind kind)
{
	const bool ready = x == ctx->ready_x && M == ctx->ready_M && K == ctx->ready_K;
	enum k_cuda_linear_kind pick = kind;
	struct lin_time_scratch ts;
	float t_kind = -1.0f, t_ring = -1.0f;

	if (k_cuda_lin_time_scratch_get(ctx, (size_t)M * N * sizeof(float), &ts))
		return kind;	// no room: untimed, not kept (the next call tries again)
	struct lin_kind_call a = { kind, x, w, M, N, K, ready, (float *)ts.ys };
	struct lin_kind_call r = { K_CUDA_LINEAR_RING, x, w, M, N, K, false, (float *)ts.ys };

	if (!lin_kind_run(ctx, &a) && !lin_kind_run(ctx, &r)) {
		t_kind = k_cuda_lin_time(ctx, &ts, lin_kind_run, &a, NULL);
		t_ring = k_cuda_lin_time(ctx, &ts, lin_kind_run, &r, NULL);
	}
	k_cuda_lin_time_scratch_put(&ts);
	cudaGetLastError();
	if (t_kind > 0 && t_ring > 0 && t_ring < LIN_RING_TUNE_MARGIN * t_kind)
		pick = K_CUDA_LINEAR_RING;
	if (k_cuda_tuning()->lt_log)
		k_cuda_log("cuda linear: M %d N %d K %d: %s %.2f us, ring %.2f us: kept %s", M, N,
			   K, k_cuda_linear_kind_name(kind), t_kind * 1e3, t_ring * 1e3,
			   k_cuda_linear_kind_name(pick));
	ctx->kind_cache[ctx->kind_n++] = lin_kind_entry{ M, N, K, (int)pick };
	return pick;
}

// The ring picked where `plain` reads fp32 x: w's x rounded at M's bucket by the tuning
// alone, which the CPU reference must know to round as the GPU did (k_cuda_linear_rounds_x).
static enum k_cuda_linear_kind lin_note_rounding(struct k_cuda_linear *ctx,
						 enum k_cuda_linear_kind plain,
						 enum k_cuda_linear_kind pick, const uint16_t *w,
						 int M, int N, int K)
{
	const int Mb = k_cuda_lin_bucket(M);

	if (pick != K_CUDA_LINEAR_RING ||
	    (plain != K_CUDA_LINEAR_GEMV && plain != K_CUDA_LINEAR_GENERIC))
		return pick;
	for (int i = 0; i < ctx->round_n; i++)
		if (ctx->round_log[i].w == w && ctx->round_log[i].M == Mb)
			return pick;
	if (ctx->round_n < LIN_ROUND_LOG)
		ctx->round_log[ctx->round_n++] = lin_round_entry{ w, Mb, N, K };
	return pick;
}

extern "C" enum k_cuda_linear_kind k_cuda_linear_choose_tuned(struct k_cuda_linear *ctx,
							       const float *x, const uint16_t *w,
							       int M, int N, int K)
{
	enum k_cuda_linear_kind kind = k_cuda_linear_choose(x, w, M, N, K);
	int found;

	// KDEC_LINEAR_FP32X (test_golden's GPU run with nothing rounded): never the ring,
	// whatever an earlier call kept
	if (!ctx || !ctx->kind_cache || !k_cuda_tuning()->linear_ring_tune ||
	    k_cuda_tuning()->linear_fp32x ||
	    kind == K_CUDA_LINEAR_RING || M > K_CUDA_LINEAR_RING_M || M > ctx->max_M ||
	    K > ctx->max_K || !k_cuda_linear_supports(K_CUDA_LINEAR_RING, x, w, M, N, K) ||
	    (ctx->ready_only && x == ctx->ready_x))	// the ring reads fp32 x, never written
		return kind;
	if ((found = lin_kind_find(ctx, k_cuda_lin_bucket(M), N, K)) >= 0)
		return lin_note_rounding(ctx, kind, (enum k_cuda_linear_kind)found, w, M, N, K);
	if (k_cuda_lin_bucket(M) != M || ctx->kind_n >= LIN_KIND_CACHE ||
	    !k_cuda_lin_stream_runs(ctx))
		return kind;
	return lin_note_rounding(ctx, kind, lin_kind_tune(ctx, x, w, M, N, K, kind), w, M, N, K);
}

extern "C" int k_cuda_linear_rounds_x(const struct k_cuda_linear *ctx, const uint16_t *w, int K,
				      int M)
{
	const int Mb = k_cuda_lin_bucket(M);

	for (int i = 0; ctx && i < ctx->round_n; i++) {
		const struct lin_round_entry *e = &ctx->round_log[i];

		if (e->M == Mb && e->K == K && w >= e->w && w < e->w + (size_t)e->N * e->K &&
		    (size_t)(w - e->w) % (size_t)K == 0)
			return 1;
	}
	return -1;
}

extern "C" int k_cuda_linear_bf16_out(struct k_cuda_linear *ctx, uint16_t *y, const float *x,
				      const uint16_t *w, int M, int N, int K)
{
	bool ready;

	if (!lin_args_ok(ctx, (const float *)y, x, w, M, N, K) ||
	    k_cuda_linear_choose(x, w, M, N, K) != K_CUDA_LINEAR_CUBLAS)
		return -EOPNOTSUPP;
	if (k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_CUBLAS, x, M, N, K, &ready))
		return -EINVAL;
	return lin_cublas(ctx, y, true, x, w, M, N, K, 0, ready);
}

extern "C" int k_cuda_linear(struct k_cuda_linear *ctx, float *y, const float *x,
			     const uint16_t *w, int M, int N, int K, int accumulate)
{
	return k_cuda_linear_run_kind(ctx, k_cuda_linear_choose_tuned(ctx, x, w, M, N, K), y, x, w,
				      M, N, K, accumulate);
}

/* misaligned x or w (or K % 8): the kernel that takes any. cuBLAS too, though it
 * accepts any alignment: fed x one float off 16 bytes (test_cuda_linear), cuBLAS at
 * N = 40000, K = 256 gave 0.42 relative error on H200 and is not used so. */
extern "C" enum k_cuda_linear_kind k_cuda_linear_choose(const float *x, const uint16_t *w, int M,
							 int N, int K)
{
	enum k_cuda_linear_kind kind = k_cuda_linear_pick(M, N, K);

	if (!k_cuda_linear_supports(kind, x, w, M, N, K) || !lin_vec_ok(x, w, K))
		kind = K_CUDA_LINEAR_GENERIC;
	return kind;
}

extern "C" uint16_t *k_cuda_linear_x_scratch(struct k_cuda_linear *ctx, int M, int K)
{
	return ctx && M >= 1 && K >= 1 && M <= ctx->max_M && K <= ctx->max_K ? ctx->xb : nullptr;
}

extern "C" void k_cuda_linear_x_ready(struct k_cuda_linear *ctx, const float *x, int M, int K)
{
	if (!ctx)
		return;
	ctx->ready_x = x;
	ctx->ready_M = M;
	ctx->ready_K = K;
	ctx->ready_only = false;
}

extern "C" int k_cuda_linear_kind_reads_bf16(enum k_cuda_linear_kind kind)
{
	return kind == K_CUDA_LINEAR_STREAM || kind == K_CUDA_LINEAR_CUBLAS;
}

extern "C" void k_cuda_linear_x_ready_only(struct k_cuda_linear *ctx, const float *x, int M,
					   int K)
{
	k_cuda_linear_x_ready(ctx, x, M, K);
	if (ctx && x)
		ctx->ready_only = true;
}

extern "C" void k_cuda_linear_set_pdl(struct k_cuda_linear *ctx, int on)
{
	if (ctx)
		ctx->pdl = on && ctx->pdl_ok;
}

extern "C" void k_cuda_linear_describe(const struct k_cuda_linear *ctx,
				       enum k_cuda_linear_kind kind, int M, int N, int K,
				       char *buf, size_t len)
{
	if (!len)
		return;
	switch (kind) {
	case K_CUDA_LINEAR_RING: {	// a launch's rows: at most K_CUDA_LINEAR_RING_M
		const int mb = M < K_CUDA_LINEAR_RING_M ? M : K_CUDA_LINEAR_RING_M;

		if (ctx && lin_ring_stream(ctx, mb, N, K, LIN_QG_X_PLAIN))
			k_cuda_lin_qmma_describe(ctx, true, &k_cuda_lin_bf16_q, mb, N, K, buf, len);
		else if (ctx)
			k_cuda_lin_qgemv_describe(ctx, &k_cuda_lin_bf16_q, M, N, K, buf, len);
		else
			snprintf(buf, len, "ring");
		break;
	}
	case K_CUDA_LINEAR_GEMV:
		snprintf(buf, len, "gemv grid=%dx%d (2 rows/warp, x rows %s)", (N + 7) / 8,
			 M == 1 ? 1 : (M + 1) / 2, M == 1 ? "1" : "2 per CTA");
		break;
	case K_CUDA_LINEAR_SPLITK:
		if (ctx)
			k_cuda_lin_splitk_describe(ctx, M, N, K, buf, len);
		else
			snprintf(buf, len, "splitk");
		break;
	case K_CUDA_LINEAR_STREAM:
		if (ctx)
			k_cuda_lin_stream_describe(ctx, M, N, K, buf, len);
		else
			snprintf(buf, len, "stream");
		break;
	case K_CUDA_LINEAR_CUBLAS:
		snprintf(buf, len, "cublas: to_bf16 + cublasGemmEx bf16 x bf16 -> fp32");
		break;
	case K_CUDA_LINEAR_GENERIC:
		snprintf(buf, len, "generic grid=%dx%d (1 output/warp)", (N + 7) / 8,
			 M < 65535 ? M : 65535);
		break;
	default:
		snprintf(buf, len, "?");
		break;
	}
}
