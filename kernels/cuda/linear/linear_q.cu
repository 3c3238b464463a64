// Quantized-weight linears: the choice between the decode GEMV for M <= 8
// (linear_qgemv.cu), the tensor-core streaming GEMV (linear_qmma.cu),
// the tile kernel for 9..64 rows (linear_qtile.cu), an f16 copy for the GEMMs, and the
// CUDA-core GEMV here (W8A16 fp8, W4A16 int4: one warp per weight row, the row's bytes streamed in 16-byte loads, each value
// dequantized in registers, multiplied into fp32 x, the block's partial sum scaled
// once), plus the dequantization kernel. Layouts: kernels/quant.h.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"

#define LQ_WARPS	4	/* warps (rows) per CTA */
#define LQ_MT		4	/* x rows per pass; more are walked in passes */
#define LQ_U		8	/* 16-byte loads per lane in flight */

static __device__ __forceinline__ float lq_warp_sum(float v)
{
#pragma unroll
	for (int off = 16; off > 0; off >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, off);
	return v;
}

// Two e4m3 bytes (low byte first) as floats, exactly (e4m3 values are all halves).
static __device__ __forceinline__ float2 lq_e4m3x2(uint16_t v)
{
	__half2 h(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3));

	return __half22float2(h);
}

// Scale i, fp32 or f16 as q says.
static __device__ __forceinline__ float lq_sc(const struct k_quant &q, size_t i)
{
	return q.scale_dtype == K_F16 ? __half2float(((const __half *)q.scale)[i])
				      : ((const float *)q.scale)[i];
}

static __device__ __forceinline__ float lq_scale(const struct k_quant &q, int n, int k)
{
	return lq_sc(q, (size_t)(n / q.block_rows) * (size_t)q.scale_cols + (size_t)(k / q.block_cols));
}

// The vectorised row: the row read as 16-byte chunks (16 fp8 or 32 int4 values), lane
// l taking chunks l, l + 32, ..., LQ_U of them loaded before any is used (so a warp
// has LQ_U * 512 bytes in flight, each load instruction 512 contiguous bytes); each
// chunk lies in one scale block, so its partial dot product is scaled once.
template <int FMT>
static __global__ void __launch_bounds__(LQ_WARPS * 32)
lq_vector(float *__restrict__ y, const float *__restrict__ x, const uint8_t *__restrict__ w,
	  struct k_quant q, int M, int N, int K, int accumulate)
{
	constexpr int VPC = FMT == K_Q_INT4 ? 32 : 16;	// values per 16-byte chunk
	const int lane = threadIdx.x & 31, n = blockIdx.x * LQ_WARPS + (threadIdx.x >> 5);
	const int chunks = K / VPC;
	const size_t srow = (size_t)(n / q.block_rows) * (size_t)q.scale_cols;

	if (n >= N)
		return;
	const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)n * (size_t)chunks * 16);
	for (int m0 = 0; m0 < M; m0 += LQ_MT) {
		float acc[LQ_MT] = { 0 };

		for (int base = 0; base < chunks; base += 32 * LQ_U) {
			uint4 r[LQ_U];

#pragma unroll
			for (int u = 0; u < LQ_U; u++) {
				int c = base + u * 32 + lane;

				r[u] = c < chunks ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
			}
#pragma unroll
			for (int u = 0; u < LQ_U; u++) {
				const int c = base + u * 32 + lane, k0 = c * VPC;
				const uint32_t words[4] = { r[u].x, r[u].y, r[u].z, r[u].w };
				float v[VPC];

				if (c >= chunks)
					break;
				if (FMT == K_Q_INT4) {
#pragma unroll
					for (int i = 0; i < 32; i++)
						v[i] = (float)((int)((words[i / 8] >> (4 * (i % 8))) & 0xfu) - 8);
				} else {
#pragma unroll
					for (int i = 0; i < 8; i++) {
						float2 f = lq_e4m3x2((uint16_t)(words[i / 2] >> (16 * (i % 2))));

						v[2 * i] = f.x;
						v[2 * i + 1] = f.y;
					}
				}
				const float s = lq_sc(q, srow + (size_t)(k0 / q.block_cols));
#pragma unroll
				for (int mi = 0; mi < LQ_MT; mi++) {
					if (m0 + mi >= M)
						break;
					const float4 *xr = reinterpret_cast<const float4 *>(x + (size_t)(m0 + mi) * K + k0);
					float part = 0.0f;

#pragma unroll
					for (int i = 0; i < VPC / 4; i++) {
						float4 xv = __ldg(xr + i);

						part = fmaf(v[4 * i], xv.x, part);
						part = fmaf(v[4 * i + 1], xv.y, part);
						part = fmaf(v[4 * i + 2], xv.z, part);
						part = fmaf(v[4 * i + 3], xv.w, part);
					}
					acc[mi] = fmaf(part, s, acc[mi]);
				}
			}
		}
#pragma unroll
		for (int mi = 0; mi < LQ_MT; mi++) {
			float r = lq_warp_sum(acc[mi]);

			if (lane == 0 && m0 + mi < M) {
				float *o = y + (size_t)(m0 + mi) * N + n;

				*o = accumulate ? *o + r : r;
			}
		}
	}
}

// Any shape: element by element, the value and scale of each.
static __global__ void __launch_bounds__(LQ_WARPS * 32)
lq_generic(float *__restrict__ y, const float *__restrict__ x, const uint8_t *__restrict__ w,
	   struct k_quant q, int M, int N, int K, int accumulate)
{
	const int lane = threadIdx.x & 31, n = blockIdx.x * LQ_WARPS + (threadIdx.x >> 5);
	const size_t row_bytes = q.fmt == K_Q_INT4 ? (size_t)(K + 7) / 8 * 4 : (size_t)K;

	if (n >= N)
		return;
	const uint8_t *wr = w + (size_t)n * row_bytes;
	for (int m = 0; m < M; m++) {
		float acc = 0.0f;

		for (int k = lane; k < K; k += 32) {
			float v;

			if (q.fmt == K_Q_INT4)
				v = (float)((int)((wr[k / 2] >> (4 * (k % 2))) & 0xfu) - 8);
			else
				v = lq_e4m3x2(wr[k]).x;
			acc = fmaf(v * lq_scale(q, n, k), x[(size_t)m * K + k], acc);
		}
		acc = lq_warp_sum(acc);
		if (lane == 0) {
			float *o = y + (size_t)m * N + n;

			*o = accumulate ? *o + acc : acc;
		}
	}
}

extern "C" int k_cuda_linear_q_vector(const struct k_quant *q, int K)
{
	int bc_ok = q->block_cols % 32 == 0 || q->block_cols >= K;

	return K % 32 == 0 && bc_ok && (q->fmt == K_Q_FP8 || q->fmt == K_Q_INT4);
}

extern "C" int k_cuda_linear_q(cudaStream_t stream, float *y, const float *x, const void *w,
			       const struct k_quant *q, int M, int N, int K, int accumulate)
{
	dim3 grid((unsigned)((N + LQ_WARPS - 1) / LQ_WARPS)), block(LQ_WARPS * 32);
	const uint8_t *wb = (const uint8_t *)w;

	if (!y || !x || !w || !q || !q->scale || (q->scale_dtype != K_F32 && q->scale_dtype != K_F16) ||
	    M <= 0 || N <= 0 ||
	    K <= 0 || q->block_rows <= 0 || q->block_cols <= 0 ||
	    (q->fmt != K_Q_FP8 && q->fmt != K_Q_INT4))
		return -EINVAL;
	/* 16-byte loads need 16-byte aligned rows and x */
	if (k_cuda_linear_q_vector(q, K) && !((uintptr_t)w & 15) && !((uintptr_t)x & 15)) {
		if (q->fmt == K_Q_INT4)
			lq_vector<K_Q_INT4><<<grid, block, 0, stream>>>(y, x, wb, *q, M, N, K, accumulate);
		else
			lq_vector<K_Q_FP8><<<grid, block, 0, stream>>>(y, x, wb, *q, M, N, K, accumulate);
	} else {
		lq_generic<<<grid, block, 0, stream>>>(y, x, wb, *q, M, N, K, accumulate);
	}
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess) {
		k_cuda_log("k_cuda_linear_q: launch failed (M %d N %d K %d): %s", M, N, K,
			   cudaGetErrorString(e));
		return -EIO;
	}
	return 0;
}

// ---- dequantization to bf16 ----------------------------------------------------

template <typename ST>
static __device__ __forceinline__ float dq_scale(const ST *s, size_t i)
{
	if constexpr (sizeof(ST) == 2)
		return __half2float(((const __half *)s)[i]);
	else
		return ((const float *)s)[i];
}

template <bool F16>
static __device__ __forceinline__ uint16_t dq_out(float f)
{
	if constexpr (F16)
		return __half_as_ushort(__float2half_rn(f));
	else
		return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// Eight values k .. k+7 of row n per thread: one scale (block_cols % 8 == 0), 16-byte
// stores. Needs K % 8 == 0.
template <typename ST, bool F16>
static __global__ void dq_vec8(uint16_t *__restrict__ dst, const uint8_t *__restrict__ w,
			       const ST *__restrict__ sc, struct k_quant q, int N, int K)
{
	const size_t units = (size_t)N * (size_t)(K / 8);
	const size_t row_bytes = q.fmt == K_Q_INT4 ? (size_t)K / 2 : (size_t)K;

	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < units;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int n = (int)(i / (size_t)(K / 8)), k = (int)(i % (size_t)(K / 8)) * 8;
		const float s = dq_scale(sc, (size_t)(n / q.block_rows) * (size_t)q.scale_cols +
						     (size_t)(k / q.block_cols));
		float v[8];
		uint4 o;

		if (q.fmt == K_Q_INT4) {
			const uint32_t word = *(const uint32_t *)(w + (size_t)n * row_bytes + k / 2);

#pragma unroll
			for (int j = 0; j < 8; j++)
				v[j] = (float)((int)((word >> (4 * j)) & 0xfu) - 8);
		} else {
			const uint2 b = *(const uint2 *)(w + (size_t)n * row_bytes + k);
			const uint32_t words[2] = { b.x, b.y };

#pragma unroll
			for (int j = 0; j < 4; j++) {
				float2 f = lq_e4m3x2((uint16_t)(words[j / 2] >> (16 * (j % 2))));

				v[2 * j] = f.x;
				v[2 * j + 1] = f.y;
			}
		}
		o.x = (uint32_t)dq_out<F16>(v[0] * s) | (uint32_t)dq_out<F16>(v[1] * s) << 16;
		o.y = (uint32_t)dq_out<F16>(v[2] * s) | (uint32_t)dq_out<F16>(v[3] * s) << 16;
		o.z = (uint32_t)dq_out<F16>(v[4] * s) | (uint32_t)dq_out<F16>(v[5] * s) << 16;
		o.w = (uint32_t)dq_out<F16>(v[6] * s) | (uint32_t)dq_out<F16>(v[7] * s) << 16;
		*(uint4 *)(dst + (size_t)n * K + k) = o;
	}
}

// Any shape: element by element.
template <typename ST, bool F16>
static __global__ void dq_generic(uint16_t *__restrict__ dst, const uint8_t *__restrict__ w,
				  const ST *__restrict__ sc, struct k_quant q, int N, int K)
{
	const size_t total = (size_t)N * (size_t)K;
	const size_t row_bytes = q.fmt == K_Q_INT4 ? (size_t)(K + 7) / 8 * 4 : (size_t)K;

	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int n = (int)(i / (size_t)K), k = (int)(i % (size_t)K);
		const uint8_t *r = w + (size_t)n * row_bytes;
		const float s = dq_scale(sc, (size_t)(n / q.block_rows) * (size_t)q.scale_cols +
						     (size_t)(k / q.block_cols));
		float v = q.fmt == K_Q_INT4 ? (float)((int)((r[k / 2] >> (4 * (k % 2))) & 0xfu) - 8)
					    : lq_e4m3x2(r[k]).x;

		dst[i] = dq_out<F16>(v * s);
	}
}

template <typename ST, bool F16>
static void dq_launch(cudaStream_t stream, uint16_t *dst, const uint8_t *w, const struct k_quant *q,
		      int N, int K)
{
	const ST *sc = (const ST *)q->scale;
	const size_t units = (size_t)N * (size_t)K / 8;
	const unsigned blocks = (unsigned)(units / 256 + 1 < 132 * 16 ? units / 256 + 1 : 132 * 16);

	if (K % 8 == 0 && q->block_cols % 8 == 0 && !((uintptr_t)w & 7) && !((uintptr_t)dst & 15))
		dq_vec8<ST, F16><<<blocks, 256, 0, stream>>>(dst, w, sc, *q, N, K);
	else
		dq_generic<ST, F16><<<blocks, 256, 0, stream>>>(dst, w, sc, *q, N, K);
}

extern "C" int k_cuda_quant_dequant(cudaStream_t stream, uint16_t *dst, enum k_dtype out,
				    const void *w, const struct k_quant *q, int N, int K)
{
	const uint8_t *wb = (const uint8_t *)w;

	if (!dst || !w || !q || !q->scale || N < 1 || K < 1 || q->block_rows < 1 ||
	    q->block_cols < 1 || (q->fmt != K_Q_FP8 && q->fmt != K_Q_INT4) ||
	    (q->scale_dtype != K_F32 && q->scale_dtype != K_F16) || (out != K_BF16 && out != K_F16))
		return -EINVAL;
	if (q->scale_dtype == K_F16)
		out == K_F16 ? dq_launch<__half, true>(stream, dst, wb, q, N, K)
			     : dq_launch<__half, false>(stream, dst, wb, q, N, K);
	else
		out == K_F16 ? dq_launch<float, true>(stream, dst, wb, q, N, K)
			     : dq_launch<float, false>(stream, dst, wb, q, N, K);
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess) {
		k_cuda_log("k_cuda_quant_dequant: launch failed (N %d K %d): %s", N, K,
			   cudaGetErrorString(e));
		return -EIO;
	}
	return 0;
}

// dst (n) f16 = src (n) fp32, rounded to nearest even (|x| > 65504 becomes inf).
static __global__ void lq_to_f16(uint16_t *__restrict__ dst, const float *__restrict__ src, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

// The DEQUANT kind: the weight into wtmp as f16 (value * scale rounded once: 11
// significant bits, where bf16 keeps 8), x into the context's scratch as f16, then one
// cuBLAS GEMM with fp32 accumulation. Both kernels go without programmatic dependent
// launch: wtmp may be what the kernel before reads.
static int lq_dequant_gemm(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
			   const struct k_quant *q, int M, int N, int K, int accumulate,
			   uint16_t *wtmp)
{
	const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
	const size_t n = (size_t)M * K;
	cublasStatus_t st;
	int ret;

	if (M > ctx->max_M || K > ctx->max_K)
		return -EINVAL;
	if ((ret = k_cuda_quant_dequant(ctx->stream, wtmp, K_F16, w, q, N, K)))
		return ret;
	lq_to_f16<<<(unsigned)(n / 256 + 1 < 1024 ? n / 256 + 1 : 1024), 256, 0, ctx->stream>>>(
		ctx->xb, x, n);
	if ((ret = LIN_LAUNCHED(ctx->dev, "lq_to_f16")))
		return ret;
	st = cublasGemmEx(ctx->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, wtmp, CUDA_R_16F, K,
			  ctx->xb, CUDA_R_16F, K, &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
			  CUBLAS_GEMM_DEFAULT);
	if (st != CUBLAS_STATUS_SUCCESS) {
		k_cuda_log("cublas: cublasGemmEx (f16, M %d N %d K %d) failed on device %d: %s", M, N,
			   K, ctx->dev, cublasGetStatusString(st));
		return -EIO;
	}
	return 0;
}

// ---- the choice ------------------------------------------------------------------

extern "C" const char *k_cuda_linear_q_kind_name(enum k_cuda_linear_q_kind kind)
{
	switch (kind) {
	case K_CUDA_LINEAR_Q_STREAM: return "stream";
	case K_CUDA_LINEAR_Q_MMA: return "mma";
	case K_CUDA_LINEAR_Q_TILE: return "tile";
	case K_CUDA_LINEAR_Q_DEQUANT: return "dequant";
	case K_CUDA_LINEAR_Q_WARP: return "warp";
	case K_CUDA_LINEAR_Q_GEMV: return "gemv";
	default: return "?";
	}
}

// y = x w^T over M rows by launches of at most mp rows of x (each launch reads the
// weights again): run is a kernel of the GEMV's or the tile's signature.
typedef int (*lq_launch)(struct k_cuda_linear *, float *, const float *, const void *,
			 const struct k_quant *, int, int, int, int);

static int lq_chunks(lq_launch run, struct k_cuda_linear *ctx, float *y, const float *x,
		     const void *w, const struct k_quant *q, int M, int mp, int N, int K,
		     int accumulate)
{
	int ret = 0;

	for (int m0 = 0; m0 < M && !ret; m0 += mp)
		ret = run(ctx, y + (size_t)m0 * N, x + (size_t)m0 * K, w, q, M - m0 < mp ? M - m0 : mp,
			  N, K, accumulate);
	return ret;
}

static int lq_qgemv(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		    const struct k_quant *q, int M, int N, int K, int accumulate)
{
	return k_cuda_lin_qgemv(ctx, y, x, w, q, M, N, K, accumulate, LIN_QG_X_PLAIN, NULL);
}

static bool lq_dequant_ok(const struct k_quant *q, int N, int K, size_t wtmp_elems)
{
	return wtmp_elems >= (size_t)N * (size_t)K && q &&
	       (q->scale_dtype == K_F32 || q->scale_dtype == K_F16);
}

extern "C" enum k_cuda_linear_q_kind k_cuda_linear_q_pick(const struct k_quant *q,
							  const float *x, const void *w, int M,
							  int N, int K, size_t wtmp_elems)
{
	const int m8 = M < K_CUDA_LINEAR_Q_MMA_MAX_M ? M : K_CUDA_LINEAR_Q_MMA_MAX_M;

	if (M <= K_CUDA_LINEAR_Q_STREAM_MAX_M && k_cuda_linear_q_stream_supports(q, x, w, M, N, K))
		return K_CUDA_LINEAR_Q_STREAM;
	if (M <= K_CUDA_LINEAR_Q_PASS_MAX_M && k_cuda_linear_q_mma_supports(q, x, w, m8, N, K))
		return K_CUDA_LINEAR_Q_MMA;
	if (lq_dequant_ok(q, N, K, wtmp_elems))
		return K_CUDA_LINEAR_Q_DEQUANT;
	return K_CUDA_LINEAR_Q_WARP;
}

extern "C" enum k_cuda_linear_q_kind k_cuda_linear_q_choose(const struct k_cuda_linear *ctx,
							    const struct k_quant *q, const float *x,
							    const void *w, int M, int N, int K,
							    size_t wtmp_elems)
{
	enum k_cuda_linear_q_kind kind = k_cuda_linear_q_pick(q, x, w, M, N, K, wtmp_elems);
	// STREAM's split where it may keep 9..16 rows (0: not asked, or no plan)
	const int split = kind == K_CUDA_LINEAR_Q_STREAM && M > K_CUDA_LINEAR_Q_MMA_MAX_M &&
				  M <= K_CUDA_LINEAR_Q_TILE_MIN_STREAM_M
				  ? k_cuda_lin_qmma_split(ctx, true, q, M, N, K) : 0;

	if (M <= K_CUDA_LINEAR_Q_MMA_MAX_M && k_cuda_tuning()->linear_qgemv &&
	    k_cuda_linear_q_gemv_supports(q, x, w, M, N, K)) {
		// STREAM's clusters: S a row block of 128, all at once where they find room
		const int S = kind == K_CUDA_LINEAR_Q_STREAM ? k_cuda_lin_qmma_split(ctx, true, q, M, N, K) : 0;

		if (kind != K_CUDA_LINEAR_Q_STREAM || k_cuda_lin_qstream_fills(ctx, S, N))
			return K_CUDA_LINEAR_Q_GEMV;
	}
	if (M > K_CUDA_LINEAR_Q_MMA_MAX_M && M <= K_CUDA_LINEAR_Q_TILE_MAX_M && M <= ctx->max_M &&
	    K <= ctx->max_K && k_cuda_linear_q_tile_supports(q, x, w, M, N, K) &&
	    !(split >= 1 && split <= K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT))
		return K_CUDA_LINEAR_Q_TILE;
	if (kind == K_CUDA_LINEAR_Q_STREAM && M > K_CUDA_LINEAR_Q_MMA_MAX_M &&
	    lq_dequant_ok(q, N, K, wtmp_elems) && M <= ctx->max_M && K <= ctx->max_K &&
	    k_cuda_lin_qmma_split(ctx, true, q, M, N, K) > K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT)
		return K_CUDA_LINEAR_Q_DEQUANT;
	return kind;
}

extern "C" int k_cuda_linear_q_run(struct k_cuda_linear *ctx, int kind, float *y,
				   const float *x, const void *w, const struct k_quant *q, int M,
				   int N, int K, int accumulate, uint16_t *wtmp, size_t wtmp_elems)
{
	bool ready;
	int ret;

	if (!ctx || !y || !x || !w || !q || M < 1 || N < 1 || K < 1)
		return -EINVAL;
	if (kind < 0)
		kind = k_cuda_linear_q_choose(ctx, q, x, w, M, N, K, wtmp ? wtmp_elems : 0);
	switch (kind) {
	case K_CUDA_LINEAR_Q_STREAM:
	case K_CUDA_LINEAR_Q_MMA: {
		const bool stream = kind == K_CUDA_LINEAR_Q_STREAM;
		const int most = stream ? K_CUDA_LINEAR_Q_STREAM_MAX_M : K_CUDA_LINEAR_Q_MMA_MAX_M;
		const int mp = M < most ? M : most;

		if (stream ? !k_cuda_linear_q_stream_supports(q, x, w, mp, N, K)
			   : !k_cuda_linear_q_mma_supports(q, x, w, mp, N, K))
			return -EINVAL;
		// fp32 x, as the GEMV reads it
		if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
			return ret;
		// mp rows of x a launch (64 STREAM, 8 MMA); more rows read the weights again
		for (int m0 = 0; m0 < M && !ret; m0 += mp)
			ret = k_cuda_lin_qmma(ctx, stream, y + (size_t)m0 * N, x + (size_t)m0 * K, w, q,
					      M - m0 < mp ? M - m0 : mp, N, K, accumulate, NULL);
		return ret;
	}
	case K_CUDA_LINEAR_Q_GEMV: {
		const int mp = M < K_CUDA_LINEAR_Q_MMA_MAX_M ? M : K_CUDA_LINEAR_Q_MMA_MAX_M;

		if (!k_cuda_linear_q_gemv_supports(q, x, w, mp, N, K))
			return -EINVAL;
		// fp32 x, as the GEMV reads it
		if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
			return ret;
		// 8 rows of x a launch; more rows read the weights again
		return lq_chunks(lq_qgemv, ctx, y, x, w, q, M, mp, N, K, accumulate);
	}
	case K_CUDA_LINEAR_Q_TILE: {
		const int mp = M < K_CUDA_LINEAR_Q_TILE_MAX_M ? M : K_CUDA_LINEAR_Q_TILE_MAX_M;

		if (!k_cuda_linear_q_tile_supports(q, x, w, mp, N, K) || mp > ctx->max_M ||
		    K > ctx->max_K)
			return -EINVAL;
		// fp32 x, rounded to f16 into the scratch: the bf16 copy there goes
		if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
			return ret;
		return lq_chunks(k_cuda_lin_qtile, ctx, y, x, w, q, M, mp, N, K, accumulate);
	}
	case K_CUDA_LINEAR_Q_DEQUANT:
		if (!wtmp || !lq_dequant_ok(q, N, K, wtmp_elems))
			return -EINVAL;
		// fp32 x, rounded to f16 into the scratch: the bf16 copy there goes
		if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
			return ret;
		return lq_dequant_gemm(ctx, y, x, w, q, M, N, K, accumulate, wtmp);
	case K_CUDA_LINEAR_Q_WARP:
		if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
			return ret;
		return k_cuda_linear_q(ctx->stream, y, x, w, q, M, N, K, accumulate);
	default:
		return -EINVAL;
	}
}

extern "C" int k_cuda_linear_q_gemv_swiglu(struct k_cuda_linear *ctx, float *y,
					   const float *gate_up, const void *w,
					   const struct k_quant *q, int M, int N, int K, int accumulate)
{
	bool ready;
	int ret;

	if (!ctx || !y || !gate_up || !w || !q || M < 1 || M > K_CUDA_LINEAR_Q_MMA_MAX_M ||
	    N < 1 || K < 1 || !k_cuda_linear_q_gemv_supports(q, gate_up, w, M, N, K))
		return -EINVAL;
	// clears any bf16 mark: the GEMV reads fp32 gate_up
	if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, gate_up, M, N, K, &ready)))
		return ret;
	return k_cuda_lin_qgemv(ctx, y, gate_up, w, q, M, N, K, accumulate, LIN_QG_X_SWIGLU, NULL);
}

extern "C" int k_cuda_linear_q_norm_run(struct k_cuda_linear *ctx, int kind, float *y,
					const float *x, const struct k_cuda_xnorm *norm,
					const void *w, const struct k_quant *q, int M, int N, int K,
					int accumulate)
{
	const bool gemv = kind == K_CUDA_LINEAR_Q_GEMV;
	bool ready;
	int ret;

	if (!ctx || !y || !x || !norm || !norm->w || ((uintptr_t)norm->w & 15) ||
	    ((uintptr_t)norm->out & 15) || M < 1 || M > K_CUDA_LINEAR_Q_MMA_MAX_M || N < 1 ||
	    K < 1 || (!gemv && kind != K_CUDA_LINEAR_Q_STREAM) ||
	    !(gemv ? k_cuda_linear_q_gemv_supports(q, x, w, M, N, K)
		   : k_cuda_linear_q_stream_supports(q, x, w, M, N, K)) ||
	    (norm->out && norm->out < x + (size_t)M * K && x < norm->out + (size_t)M * K))
		return -EINVAL;	// out overlapping x: row block 0 would write what others read
	// clears any bf16 mark: these kinds read fp32 x
	if ((ret = k_cuda_lin_take_ready(ctx, K_CUDA_LINEAR_GEMV, x, M, N, K, &ready)))
		return ret;
	if (gemv)
		return k_cuda_lin_qgemv(ctx, y, x, w, q, M, N, K, accumulate, LIN_QG_X_NORM, norm);
	return k_cuda_lin_qmma(ctx, true, y, x, w, q, M, N, K, accumulate, norm);
}

extern "C" void k_cuda_linear_q_describe(const struct k_cuda_linear *ctx,
					 enum k_cuda_linear_q_kind kind, const struct k_quant *q,
					 int M, int N, int K, char *buf, size_t len)
{
	if (kind == K_CUDA_LINEAR_Q_TILE)
		k_cuda_lin_qtile_describe(ctx, q, M, N, K, buf, len);
	else if (kind == K_CUDA_LINEAR_Q_GEMV)
		k_cuda_lin_qgemv_describe(ctx, q, M, N, K, buf, len);
	else if (kind == K_CUDA_LINEAR_Q_STREAM || kind == K_CUDA_LINEAR_Q_MMA)
		k_cuda_lin_qmma_describe(ctx, kind == K_CUDA_LINEAR_Q_STREAM, q, M, N, K, buf, len);
	else if (kind == K_CUDA_LINEAR_Q_DEQUANT)
		snprintf(buf, len, "dequant to f16 (%.1f MB written), then cublas f16",
			 (double)N * K * 2 / 1e6);
	else
		snprintf(buf, len, "warp grid=%d", (N + LQ_WARPS - 1) / LQ_WARPS);
}
