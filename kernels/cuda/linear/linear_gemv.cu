// The CUDA-core linear kernels: the GEMV for M <= 2 (fp32 x, weights streamed in 16-byte
// loads), the scalar fallback for any shape, and the fp32 -> bf16 rounding of x for cuBLAS.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/linear_gemv.cuh"
#include "kernels/cuda/linear/linear_internal.h"

#define GENERIC_WARPS	8

// ---- kernels ----------------------------------------------------------------

// gemv_block (linear_gemv.cuh) as a kernel of its own.
template <int MT, int KW>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(float *y, const float *x, const uint16_t *__restrict__ w, int M, int N, int K,
	    int accumulate, int pdl)
{
	gemv_block<MT, KW>(y, x, w, M, N, K, accumulate, pdl);
}

// One warp per output y[m, n]: lane l sums k = l, l + 32, ...; any K, any alignment.
__global__ void __launch_bounds__(GENERIC_WARPS * 32)
generic_kernel(float *y, const float *x, const uint16_t *__restrict__ w, int M, int N, int K,
	       int accumulate, int pdl)
{
	const int lane = threadIdx.x & 31;
	const int n = blockIdx.x * GENERIC_WARPS + (threadIdx.x >> 5);

	k_cuda_lin_inputs_ready(pdl);
	if (n >= N)
		return;
	for (int m = blockIdx.y; m < M; m += gridDim.y) {
		const uint16_t *wr = w + (size_t)n * K;
		const float *xr = x + (size_t)m * K;
		float acc = 0.f;

		for (int k = lane; k < K; k += 32)
			acc = fmaf(lin_bf16_lo(wr[k]), xr[k], acc);
		acc = lin_warp_sum(acc);
		if (lane == 0) {
			float *p = y + (size_t)m * N + n;

			*p = accumulate ? *p + acc : acc;
		}
	}
}

// dst[i] = bf16(src[i]), four at a time where src is 16-byte aligned.
__global__ void to_bf16_kernel(uint16_t *dst, const float *src, size_t n, int pdl)
{
	const size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, done = 0;

	k_cuda_lin_inputs_ready(pdl);
	if (((uintptr_t)src & 15) == 0) {
		const size_t n4 = n / 4;

		for (size_t j = i; j < n4; j += stride) {
			float4 v = ((const float4 *)src)[j];
			__nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
			__nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
			uint2 p;

			memcpy(&p.x, &lo, sizeof(p.x));
			memcpy(&p.y, &hi, sizeof(p.y));
			*(uint2 *)(dst + 4 * j) = p;
		}
		done = n4 * 4;
	}
	for (size_t j = done + i; j < n; j += stride) {
		__nv_bfloat16 h = __float2bfloat16_rn(src[j]);

		memcpy(dst + j, &h, sizeof(h));
	}
}

// ---- launchers --------------------------------------------------------------

// cudaLaunchKernelEx with the context's stream and attributes.
template <typename... KArgs, typename... Args>
static int lin_launch(const struct k_cuda_linear *ctx, const char *what, dim3 grid, int threads,
		      void (*kernel)(KArgs...), Args... args)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};

	cfg.gridDim = grid;
	cfg.blockDim = dim3(threads, 1, 1);
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return k_cuda_call_status_on(cudaLaunchKernelEx(&cfg, kernel, args...), what, __FILE__,
				     __LINE__, ctx->dev);
}

template <int MT>
static int gemv_launch(const struct k_cuda_linear *ctx, float *y, const float *x,
		       const uint16_t *w, int M, int N, int K, int accumulate)
{
	const int rows_per_cta = GEMV_WARPS * GEMV_ROWS;
	const int gx = (N + rows_per_cta - 1) / rows_per_cta;
	// A grid that, a CTA a row pair, still holds at most two CTAs a multiprocessor (a MoE
	// router: Kimi-K2's 384 x 7168 took 10.3 us for 5.5 MB at batch 1 on the H100, each
	// warp walking all 7168 k): the CTA's warps split K, where each still gets two
	// 32-chunk groups.
	const bool split = gx * GEMV_WARPS <= ctx->n_sm * 2 && K / 8 >= 32 * 2 * GEMV_WARPS &&
			   k_cuda_tuning()->linear_gemv_split;
	const int gxs = split ? (N + GEMV_ROWS - 1) / GEMV_ROWS : gx;
	void (*kernel)(float *, const float *, const uint16_t *, int, int, int, int, int) =
		split ? gemv_kernel<MT, GEMV_WARPS> : gemv_kernel<MT, 1>;

	// gridDim.y covers at most GEMV_MAX_GY groups of MT rows per launch
	for (int m0 = 0; m0 < M; m0 += GEMV_MAX_GY * MT) {
		int mc = M - m0 < GEMV_MAX_GY * MT ? M - m0 : GEMV_MAX_GY * MT, ret;

		ret = lin_launch(ctx, "gemv_kernel", dim3(gxs, (mc + MT - 1) / MT), GEMV_WARPS * 32,
				 kernel, y + (size_t)m0 * N, x + (size_t)m0 * K, w, mc, N, K,
				 accumulate, ctx->pdl ? ctx->gemv_resident : 0);
		if (ret)
			return ret;
	}
	return 0;
}

int k_cuda_lin_gemv(const struct k_cuda_linear *ctx, float *y, const float *x,
		    const uint16_t *w, int M, int N, int K, int accumulate)
{
	if (M == 1)
		return gemv_launch<1>(ctx, y, x, w, M, N, K, accumulate);
	return gemv_launch<2>(ctx, y, x, w, M, N, K, accumulate);
}

int k_cuda_lin_gemv_setup(struct k_cuda_linear *ctx)
{
	int b1 = 0, b2 = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
					 &b1, gemv_kernel<1, 1>, GEMV_WARPS * 32, 0));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
						 &b2, gemv_kernel<2, 1>, GEMV_WARPS * 32, 0));
	ctx->gemv_resident = (b1 < b2 ? b1 : b2) * ctx->n_sm;
	return ret;
}

int k_cuda_lin_generic(const struct k_cuda_linear *ctx, float *y, const float *x,
		       const uint16_t *w, int M, int N, int K, int accumulate)
{
	dim3 grid((N + GENERIC_WARPS - 1) / GENERIC_WARPS, M < 65535 ? M : 65535);

	return lin_launch(ctx, "generic_kernel", grid, GENERIC_WARPS * 32, generic_kernel, y, x, w,
			  M, N, K, accumulate, ctx->pdl);
}

int k_cuda_lin_to_bf16(const struct k_cuda_linear *ctx, uint16_t *dst, const float *src, size_t n)
{
	size_t blocks = (n / 4 + 255) / 256;

	if (blocks < 1)
		blocks = 1;
	if (blocks > (size_t)ctx->n_sm * 8)
		blocks = (size_t)ctx->n_sm * 8;
	return lin_launch(ctx, "to_bf16_kernel", dim3((unsigned)blocks), 256, to_bf16_kernel, dst,
			  src, n, ctx->pdl);
}
