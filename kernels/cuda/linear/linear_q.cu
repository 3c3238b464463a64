// Quantized-weight GEMV (W8A16 fp8, W4A16 int4): one warp per weight row, the row's
// bytes streamed in 16-byte loads, each value dequantized in registers (e4m3 through
// the hardware fp8 -> half conversion, int4 as nibble - 8), multiplied into fp32 x, the
// block's partial sum scaled once. Layouts: kernels/quant.h.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/k_cuda_linear_q.h"

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

static __device__ __forceinline__ float lq_scale(const float *s, const struct k_quant &q, int n, int k)
{
	return s[(size_t)(n / q.block_rows) * (size_t)q.scale_cols + (size_t)(k / q.block_cols)];
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
	const float *sc = (const float *)q.scale;
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
				const float s = sc[srow + (size_t)(k0 / q.block_cols)];
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
	const float *sc = (const float *)q.scale;

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
			acc = fmaf(v * lq_scale(sc, q, n, k), x[(size_t)m * K + k], acc);
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

	if (!y || !x || !w || !q || !q->scale || q->scale_dtype != K_F32 || M <= 0 || N <= 0 ||
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
