// fp8 weights at larger M on the fp8 tensor cores (K_CUDA_LINEAR_Q_LT8): cuBLASLt's
// block-scaled fp8 GEMM (Hopper, cuBLAS >= 12.9), weights as published (e4m3; one fp32
// scale a 128 x 128 block: BLK128x128_32F, or one a row) against x split into two e4m3
// rows with one fp32 scale a 128 values each (VEC128_32F).
//
// Why split x: one e4m3 row keeps 4 significant bits, a relative L2 error of 2-3% on x
// and on y (contrib/device/lt8_split_emu.py), where the project's other kinds round x to
// f16 (2-3e-4) and its bf16 path to bf16 (~2e-3). Two rows, x ~ s1 q1 + s2 q2 with q2 the
// e4m3 of what q1 leaves, keep ~8 bits of each 128-value block: 4-7e-4 on y, between
// f16 and bf16. Both rows are columns of the one GEMM, so the weights are read once; a
// second kernel adds each row's two outputs.
//
// Per call, on the caller's scratch (lq8_layout), with Mp = M rounded up to 16 (64 past
// 64 rows: few shapes to ask cuBLASLt about; the 2Mp scales of a block start 16-byte
// aligned; rows M..Mp-1 of each half are zeros): the split (hi rows 0..Mp-1, lo rows
// Mp..2Mp-1, e4m3) and its scales (K / 128, 2Mp) fp32 (a block's 2Mp scales contiguous:
// cuBLAS's layout for VEC128 on a K x 2Mp operand), the GEMM into d (2Mp, N) fp32 ((N,
// 2Mp) where it has an algorithm only with x as its A operand), then y (+)= d[m] +
// d[Mp + m], m < M. d stays fp32: a bf16 d would round each half before the add, the
// precision the split is there to keep, so a shape with no fp32-out algorithm declines.
// The weight's scales: 128 x 128 blocks are already cuBLAS's BLK128x128 layout for a
// K x N operand (ceil(N / 128) rows of K / 128 scales, each row padded to a multiple of 4)
// exactly where K / 128 is a multiple of 4 (K % 512 == 0); one scale a row over all of K
// (fp8 per channel, or per tensor) is written out per call as VEC128 scales of the weight
// (K / 128, N) fp32, N contiguous (lq8_wscale_kernel: N K / 32 bytes, ~3% of the
// weight's), for cuBLAS's 1 x 128 by 1 x 128 form. VEC128 scales are outer-dimension
// contiguous, each k block's row 16-byte aligned (as PyTorch's scaled_mm passes them:
// strides (1, M); DeepGEMM's M-major, TMA-aligned LHS scales): hence Mp, and N % 4 == 0
// for a weight's; cuBLAS asks N % 4 == 0 of the 128 x 128 form too ("M and N must be
// multiples of 4", its block-scaling section).
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"

#define LQ8_BLOCK	128	/* values a scale covers, along K and (weights) along N */
#define LQ8_E4M3_MAX	448.0f
#define LQ8_WARPS	8	/* split kernel: warps a CTA, a (row, block) a warp */
#define LQ8_CACHE	256	/* shapes a context keeps descriptors for (then the oldest go) */
/* Where the scratch cannot hold all M rows (prefill chunks), passes of a multiple of
 * this many rows, each reading the weights again (at these M the GEMM is bound by its
 * arithmetic, not the weights' bytes). */
#define LQ8_PASS_ROWS	64

// One shape's descriptors and the heuristic's algorithm; the scale pointers are set on
// op before each call (cuBLASLt reads them when the call is queued or captured).
struct lin_lt8_entry {
	int M2, N, K;
	int walign;			/* the weight's address alignment asked for: 16 or 256 */
	int arrange;			/* KDEC_LINEAR_QLT8 when made: 1 either, 2 w as A, 3 x as A */
	bool ok;			/* false: cuBLASLt has no algorithm for it (declined) */
	bool x_first;			/* the split x is cuBLAS's A: d is (N, M2), not (M2, N) */
	bool w_vec;			/* the weight's scales VEC128 (rows scaled), else BLK128x128 */
	struct lin_lt_descs g;		/* the layouts: a, b, c (d's, as C and D) */
	cublasLtMatmulAlgo_t algo;
};

namespace {	// kernels stay private to this file

// x (M, K) fp32 into q (2Mp, K) e4m3 and sc (K / 128, 2Mp) fp32: warp (m, kb), m < Mp,
// takes x[m][128 kb, 128 kb + 128), 4 values a lane (zeros past row M). s1 = amax / 448,
// q1 = e4m3(x / s1), r = x - q1 s1 (fp32), s2 = amax(r) / 448, q2 = e4m3(r / s2); an
// all-zero block gets scale 1 and zeros. Every operation rounded as written (no
// contraction), so that the test's host copy of it gives the same bits.
__global__ void __launch_bounds__(LQ8_WARPS * 32)
lq8_split_kernel(uint8_t *q, float *sc, const float *x, int M, int Mp, int K)
{
	const int lane = threadIdx.x % 32, kbs = K / LQ8_BLOCK;
	const long item = (long)blockIdx.x * LQ8_WARPS + threadIdx.x / 32;
	const int m = (int)(item / kbs), kb = (int)(item % kbs);

	if (m >= Mp)
		return;
	const size_t off = (size_t)kb * LQ8_BLOCK + 4 * lane, at = (size_t)m * K + off;
	const float4 v4 = m < M ? *(const float4 *)(x + at) : make_float4(0, 0, 0, 0);
	float v[4] = { v4.x, v4.y, v4.z, v4.w }, r[4], a = 0.0f, s1, s2;
	uint8_t q1[4], q2[4];

	for (int i = 0; i < 4; i++)
		a = fmaxf(a, fabsf(v[i]));
	for (int o = 16; o; o >>= 1)
		a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
	s1 = a > 0.0f ? __fdiv_rn(a, LQ8_E4M3_MAX) : 1.0f;
	a = 0.0f;
	for (int i = 0; i < 4; i++) {
		q1[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(v[i], s1), __NV_SATFINITE, __NV_E4M3);
		__half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q1[i], __NV_E4M3);
		r[i] = __fsub_rn(v[i], __fmul_rn(__half2float(__half(h)), s1));
		a = fmaxf(a, fabsf(r[i]));
	}
	for (int o = 16; o; o >>= 1)
		a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
	s2 = a > 0.0f ? __fdiv_rn(a, LQ8_E4M3_MAX) : 1.0f;
	for (int i = 0; i < 4; i++)
		q2[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(r[i], s2), __NV_SATFINITE, __NV_E4M3);
	*(uint32_t *)(q + at) = q1[0] | q1[1] << 8 | q1[2] << 16 | (uint32_t)q1[3] << 24;
	*(uint32_t *)(q + (size_t)(Mp + m) * K + off) =
		q2[0] | q2[1] << 8 | q2[2] << 16 | (uint32_t)q2[3] << 24;
	if (lane == 0) {
		sc[(size_t)kb * 2 * Mp + m] = s1;
		sc[(size_t)kb * 2 * Mp + Mp + m] = s2;
	}
}

// sw (K / 128, N) = scale[n / block_rows]: a scale per row over all of K, as cuBLAS's
// VEC128 scales of a K x N operand (N contiguous).
__global__ void lq8_wscale_kernel(float *sw, const float *scale, int N, int kbs, int block_rows)
{
	const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;

	if (i < (size_t)N * kbs)
		sw[i] = scale[(int)(i % N) / block_rows];
}

// y (M, N) = d[m] + d[Mp + m] (y += where accumulate), a thread an element; d (2Mp, N),
// or (N, 2Mp) where x_first.
__global__ void lq8_combine_kernel(float *y, const float *d, int M, int Mp, int N, int accumulate,
				   int x_first)
{
	const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	const size_t m = i / N, n = i % N;

	if (i >= (size_t)M * N)
		return;
	const size_t hi = x_first ? n * 2 * Mp + m : i, lo = x_first ? hi + Mp : (size_t)Mp * N + i;
	float s = __fadd_rn(d[hi], d[lo]);

	y[i] = accumulate ? __fadd_rn(y[i], s) : s;
}

}	// namespace

// ---- the scratch ------------------------------------------------------------------

static size_t lq8_align(size_t v)
{
	return (v + 255) & ~(size_t)255;
}

// The split's rows a half: M rounded up to 16, past 64 rows to 64 (a decode batch of 17
// to 64 rows is one of three shapes, a prefill chunk one of few).
static int lq8_mp(int M)
{
	return M <= 64 ? (M + 15) & ~15 : (M + 63) & ~63;
}

// 128 x 128 blocks in cuBLAS's layout (K % 512), not a row's one scale.
static bool lq8_blocks(const struct k_quant *q, int K)
{
	return q->block_rows == LQ8_BLOCK && q->block_cols == LQ8_BLOCK &&
	       q->scale_cols == K / LQ8_BLOCK && K % 512 == 0;
}

// Offsets into the scratch: q (2Mp, K) e4m3, sc (K / 128, 2Mp) fp32, sw (K / 128, N) fp32
// (w_vec only: a row's one scale written out; none for 128 x 128 blocks), d (2Mp, N)
// fp32; the total in *bytes.
static void lq8_layout(int M, int N, int K, bool w_vec, size_t *sc_off, size_t *sw_off,
		       size_t *d_off, size_t *bytes)
{
	const size_t m2 = 2 * (size_t)lq8_mp(M), kbs = (size_t)K / LQ8_BLOCK;

	*sc_off = lq8_align(m2 * K);
	*sw_off = *sc_off + lq8_align(kbs * m2 * sizeof(float));
	*d_off = *sw_off + (w_vec ? lq8_align(kbs * N * sizeof(float)) : 0);
	*bytes = *d_off + m2 * N * sizeof(float);
}

extern "C" size_t k_cuda_linear_q_lt8_scratch(const struct k_quant *q, int M, int N, int K)
{
	size_t sc, sw, d, bytes;

	lq8_layout(M, N, K, !lq8_blocks(q, K), &sc, &sw, &d, &bytes);
	return bytes;
}

extern "C" int k_cuda_linear_q_lt8_supports(const struct k_quant *q, const float *x,
					    const void *w, int M, int N, int K)
{
	const bool blocks = q && lq8_blocks(q, K);

	// the scales of 128 x 128 blocks are cuBLAS's operand (16-byte aligned); a row's one
	// scale is read by lq8_wscale_kernel only
	return q && x && w && q->fmt == K_Q_FP8 && q->scale_dtype == K_F32 && M >= 1 && N >= 1 &&
	       K % LQ8_BLOCK == 0 && N % 4 == 0 &&
	       (blocks || (q->scale_cols == 1 && q->block_rows >= 1)) &&
	       (uintptr_t)x % 16 == 0 && (uintptr_t)w % 16 == 0 &&
	       (!blocks || (uintptr_t)q->scale % 16 == 0);
}

// What cuBLASLt may assume of the weight's address: the heuristic's default is 256 bytes;
// a weight stacked after another in the arena may sit at 16.
static int lq8_walign(const void *w)
{
	return (uintptr_t)w % 256 ? 16 : 256;
}

// ---- cuBLASLt ---------------------------------------------------------------------

// The GEMM of the split x q (col-major K x M2) and w (col-major K x N), both e4m3 with
// K-major scales (w's BLK128x128, or VEC128 where w_vec; q's VEC128), d in fp32. In
// cuBLAS's column-major terms: d (N x M2, so row-major (M2, N)) = w^T q, w as A; or,
// x_first, d (M2 x N, row-major (N, M2)) = q^T w, q as A (NVIDIA's sample's arrangement:
// A 1 x 128, B 128 x 128). Both TN, as fp8 on Hopper must be. The weight's operand may
// be only walign-byte aligned; the scratch's are 256. Status of the heuristic query:
// *found 0 where it offers nothing for this.
static int lq8_entry_make(const struct k_cuda_linear *ctx, struct lin_lt8_entry *e, int M2,
			  int N, int K, bool w_vec, int walign, bool x_first, bool *found)
{
	const cublasOperation_t t = CUBLAS_OP_T;
	const cublasLtMatmulMatrixScale_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
					  ws_mode = w_vec ? vec : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
	const cublasLtMatmulMatrixScale_t sa = x_first ? vec : ws_mode, sb = x_first ? ws_mode : vec;
	const int rows = x_first ? M2 : N, cols = x_first ? N : M2;	/* of d, column-major */
	const size_t ws = LIN_BLAS_WS_BYTES;
	const uint32_t wa = (uint32_t)walign;
	cublasLtMatmulPreference_t pref = NULL;
	cublasLtMatmulHeuristicResult_t res = {};
	int n = 0, ret;

	*e = {};
	*found = false;
	ret = LIN_LT(ctx->dev, cublasLtMatmulDescCreate(&e->g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulDescSetAttribute(
			e->g.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulDescSetAttribute(
			e->g.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sa, sizeof(sa)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulDescSetAttribute(
			e->g.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sb, sizeof(sb)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatrixLayoutCreate(&e->g.a, CUDA_R_8F_E4M3, K, rows, K));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatrixLayoutCreate(&e->g.b, CUDA_R_8F_E4M3, K, cols, K));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatrixLayoutCreate(&e->g.c, CUDA_R_32F, rows, cols, rows));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulPreferenceCreate(&pref));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulPreferenceSetAttribute(
			pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulPreferenceSetAttribute(
			pref, x_first ? CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES
				      : CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &wa, sizeof(wa)));
	// NOT_SUPPORTED from the heuristic is an answer (no kernel for this type), not an error
	if (!ret && cublasLtMatmulAlgoGetHeuristic(ctx->lt, e->g.op, e->g.a, e->g.b, e->g.c, e->g.c,
						   pref, 1, &res, &n) == CUBLAS_STATUS_SUCCESS && n > 0) {
		e->algo = res.algo;
		*found = true;
	}
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	if (ret || !*found)
		k_cuda_lin_lt_descs_free(&e->g);
	e->x_first = x_first;
	e->w_vec = w_vec;
	return ret;
}

// The cached entry of (M2, N, K, w_vec, walign, KDEC_LINEAR_QLT8), made on first use:
// w as A, then the split x as A (the first cuBLASLt has an fp32-out algorithm for; 2 or
// 3 in KDEC_LINEAR_QLT8 ask for only the one, as the test does for each), else declined
// (ok false, logged once a shape). Its index, or -1 on an error (*err). With the cache
// full, the oldest entry but keep goes (a graph keeps what a captured call read).
static int lq8_entry(struct k_cuda_linear *ctx, int M2, int N, int K, bool w_vec, int walign,
		     int keep, int *err)
{
	const int arrange = k_cuda_tuning()->linear_qlt8;
	struct lin_lt8_entry *e;
	bool found = false;
	int at;

	*err = 0;
	for (int i = 0; i < ctx->lt8_n; i++) {
		const struct lin_lt8_entry *c = &ctx->lt8_cache[i];

		if (c->M2 == M2 && c->N == N && c->K == K && c->w_vec == w_vec &&
		    c->walign == walign && c->arrange == arrange)
			return i;
	}
	if (!ctx->lt8_cache) {
		ctx->lt8_cache = (struct lin_lt8_entry *)calloc(LQ8_CACHE, sizeof(*ctx->lt8_cache));
		if (!ctx->lt8_cache) {
			*err = -ENOMEM;
			return -1;
		}
	}
	if (ctx->lt8_n < LQ8_CACHE) {
		at = ctx->lt8_n++;
	} else {
		at = ctx->lt8_next++ % LQ8_CACHE;
		if (at == keep)
			at = ctx->lt8_next++ % LQ8_CACHE;
		k_cuda_lin_lt_descs_free(&ctx->lt8_cache[at].g);
	}
	e = &ctx->lt8_cache[at];
	for (int v = 0; v < 2 && !found && !*err; v++)
		if (arrange < 2 || arrange - 2 == v)
			*err = lq8_entry_make(ctx, e, M2, N, K, w_vec, walign, v == 1, &found);
	e->M2 = *err ? -1 : M2;	/* an error leaves a free slot no lookup matches */
	e->N = N;
	e->K = K;
	e->w_vec = w_vec;
	e->walign = walign;
	e->arrange = arrange;
	e->ok = found;
	if (*err)
		return -1;
	if (!found)
		k_cuda_log("cuda linear: cuBLASLt offers no block-scaled fp8 GEMM for %d x %d x %d "
			   "(e4m3, %s and 1 x 128 scales, fp32 out%s, weight %d-byte aligned): the "
			   "other quantized kinds take it", N, M2, K, w_vec ? "1 x 128" : "128 x 128",
			   arrange == 2 ? ", weight as A" : arrange == 3 ? ", x as A" : "", walign);
	return at;
}

extern "C" int k_cuda_linear_q_lt8_available(struct k_cuda_linear *ctx, const struct k_quant *q,
					     int M, int N, int K)
{
	int err, i;

	if (!ctx || !ctx->lt || !q || M < 1 || N < 1 || K < LQ8_BLOCK || K % LQ8_BLOCK)
		return 0;
	i = lq8_entry(ctx, 2 * lq8_mp(M), N, K, !lq8_blocks(q, K), 256, -1, &err);
	return err ? err : ctx->lt8_cache[i].ok;
}

void k_cuda_lin_qlt8_destroy(struct k_cuda_linear *ctx)
{
	for (int i = 0; i < ctx->lt8_n; i++)
		k_cuda_lin_lt_descs_free(&ctx->lt8_cache[i].g);
	free(ctx->lt8_cache);
	ctx->lt8_cache = NULL;
	ctx->lt8_n = 0;
	ctx->lt8_next = 0;
}

extern "C" size_t k_cuda_linear_q_lt8_cublaslt_version(void)
{
	return cublasLtGetVersion();
}

// One pass: rows [0, M) of x into y through entry e (its shape: 2 lq8_mp(M), N, K).
static int lq8_pass(struct k_cuda_linear *ctx, const struct lin_lt8_entry *e, float *y,
		    const float *x, const void *w, const struct k_quant *q, int M, int N, int K,
		    int accumulate, void *scratch)
{
	const int Mp = lq8_mp(M);
	const long items = (long)Mp * (K / LQ8_BLOCK);
	const size_t n = (size_t)M * N;
	const unsigned grid = (unsigned)((n + 255) / 256);
	const float one = 1.0f, zero = 0.0f;
	size_t sc_off, sw_off, d_off, bytes;
	const void *bscale, *wscale = q->scale;
	const void *xq;
	void *d;
	int ret;

	lq8_layout(M, N, K, e->w_vec, &sc_off, &sw_off, &d_off, &bytes);
	xq = scratch;
	bscale = (char *)scratch + sc_off;
	d = (char *)scratch + d_off;
	if (e->w_vec) {	// a row's one scale as VEC128 scales of the weight
		const int kbs = K / LQ8_BLOCK;
		const size_t ns = (size_t)kbs * N;

		wscale = (char *)scratch + sw_off;
		lq8_wscale_kernel<<<(unsigned)((ns + 255) / 256), 256, 0, ctx->stream>>>(
			(float *)wscale, (const float *)q->scale, N, kbs, q->block_rows);
		if ((ret = LIN_LAUNCHED(ctx->dev, "lq8_wscale_kernel")))
			return ret;
	}
	lq8_split_kernel<<<(unsigned)((items + LQ8_WARPS - 1) / LQ8_WARPS), LQ8_WARPS * 32, 0,
			   ctx->stream>>>((uint8_t *)scratch, (float *)bscale, x, M, Mp, K);
	if ((ret = LIN_LAUNCHED(ctx->dev, "lq8_split_kernel")))
		return ret;
	ret = LIN_LT(ctx->dev, cublasLtMatmulDescSetAttribute(
		e->g.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, e->x_first ? &bscale : &wscale,
		sizeof(bscale)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmulDescSetAttribute(
			e->g.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, e->x_first ? &wscale : &bscale,
			sizeof(bscale)));
	if (!ret)
		ret = LIN_LT(ctx->dev, cublasLtMatmul(ctx->lt, e->g.op, &one, e->x_first ? xq : w, e->g.a,
						      e->x_first ? w : xq, e->g.b, &zero, d, e->g.c, d,
						      e->g.c, &e->algo, ctx->blas_ws, LIN_BLAS_WS_BYTES,
						      ctx->stream));
	if (ret)
		return ret;
	lq8_combine_kernel<<<grid, 256, 0, ctx->stream>>>(y, (const float *)d, M, Mp, N, accumulate,
							  e->x_first);
	return LIN_LAUNCHED(ctx->dev, "lq8_combine_kernel");
}

extern "C" int k_cuda_linear_q_lt8_pass_rows(const struct k_quant *q, int M, int N, int K,
					     size_t scratch_bytes)
{
	if (k_cuda_linear_q_lt8_scratch(q, M, N, K) <= scratch_bytes)
		return M;
	for (int mc = M / LQ8_PASS_ROWS * LQ8_PASS_ROWS; mc >= LQ8_PASS_ROWS; mc -= LQ8_PASS_ROWS)
		if (k_cuda_linear_q_lt8_scratch(q, mc, N, K) <= scratch_bytes)
			return mc;
	return 0;
}

int k_cuda_lin_qlt8(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		    const struct k_quant *q, int M, int N, int K, int accumulate, void *scratch,
		    size_t scratch_bytes)
{
	const int mc = k_cuda_linear_q_lt8_pass_rows(q, M, N, K, scratch_bytes);
	const int rest = mc ? M % mc : 0, wa = lq8_walign(w);
	int full, last = -1, ret = 0;

	if (!ctx->lt || !scratch || !mc || (uintptr_t)scratch % 256 ||
	    !k_cuda_linear_q_lt8_supports(q, x, w, M, N, K))
		return -EINVAL;
	// every shape's algorithm before anything is queued: a decline leaves y untouched
	if ((full = lq8_entry(ctx, 2 * lq8_mp(mc), N, K, !lq8_blocks(q, K), wa, -1, &ret)) < 0)
		return ret;
	if (rest && (last = lq8_entry(ctx, 2 * lq8_mp(rest), N, K, !lq8_blocks(q, K), wa, full,
				      &ret)) < 0)
		return ret;
	if (!ctx->lt8_cache[full].ok || (last >= 0 && !ctx->lt8_cache[last].ok))
		return 1;
	for (int m0 = 0; m0 < M && !ret; m0 += mc) {
		const int rows = M - m0 < mc ? M - m0 : mc;

		ret = lq8_pass(ctx, &ctx->lt8_cache[rows == mc ? full : last], y + (size_t)m0 * N,
			       x + (size_t)m0 * K, w, q, rows, N, K, accumulate, scratch);
	}
	return ret;
}

int k_cuda_lin_qlt8_describe(int M, char *buf, size_t len)
{
	return snprintf(buf, len, "lt8: x split to 2 x %d e4m3 rows, cuBLASLt block-scaled fp8 "
			"(128 x 128 / 1 x 128 scales), the two halves added", lq8_mp(M));
}
