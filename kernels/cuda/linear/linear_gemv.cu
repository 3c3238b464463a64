// The CUDA-core linear kernels: the GEMV for M <= 2 (fp32 x, weights streamed in 16-byte
// loads), the scalar fallback for any shape, and the fp32 -> bf16 rounding of x for cuBLAS.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/linear_internal.h"

#define GEMV_WARPS	4	/* warps per CTA */
#define GEMV_ROWS	2	/* weight rows per warp: each x load feeds both */
#define GEMV_U		8	/* 16-byte loads per row and lane in flight: 8 KB per warp */
#define GEMV_PREFETCH	2	/* batches prefetched into L2 before waiting (PDL) */
#define GEMV_MAX_GY	65535	/* gridDim.y limit; larger M is walked in launches */

#define GENERIC_WARPS	8

// ---- kernels ----------------------------------------------------------------

static __device__ __forceinline__ float lin_bf16_lo(uint32_t v)
{
	return __uint_as_float(v << 16);
}

static __device__ __forceinline__ float lin_bf16_hi(uint32_t v)
{
	return __uint_as_float(v & 0xffff0000u);
}

// acc + w[0..7] . (a, b), in increasing k.
static __device__ __forceinline__ float lin_dot8(uint4 w, float4 a, float4 b, float acc)
{
	acc = fmaf(lin_bf16_lo(w.x), a.x, acc);
	acc = fmaf(lin_bf16_hi(w.x), a.y, acc);
	acc = fmaf(lin_bf16_lo(w.y), a.z, acc);
	acc = fmaf(lin_bf16_hi(w.y), a.w, acc);
	acc = fmaf(lin_bf16_lo(w.z), b.x, acc);
	acc = fmaf(lin_bf16_hi(w.z), b.y, acc);
	acc = fmaf(lin_bf16_lo(w.w), b.z, acc);
	acc = fmaf(lin_bf16_hi(w.w), b.w, acc);
	return acc;
}

static __device__ __forceinline__ float lin_warp_sum(float v)
{
#pragma unroll
	for (int off = 16; off > 0; off >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, off);
	return v;
}

// Chunk c (8 bf16) of each of the warp's rows; zeros past the row or past N.
static __device__ __forceinline__ void gemv_load(uint4 (&wv)[GEMV_ROWS],
						 const uint16_t *const (&wr)[GEMV_ROWS],
						 const bool (&rok)[GEMV_ROWS], int c, int nc)
{
#pragma unroll
	for (int r = 0; r < GEMV_ROWS; r++)
		wv[r] = k_cuda_lin_ld_stream(wr[r] + (c < nc ? c : 0) * 8, c < nc && rok[r]);
}

// acc[r][m] += w row r, chunk c . x row m0 + m, chunk c.
template <int MT>
static __device__ __forceinline__ void gemv_fma(float (&acc)[GEMV_ROWS][MT],
						const uint4 (&wv)[GEMV_ROWS], const float *x,
						int m0, int M, int K, int c)
{
#pragma unroll
	for (int m = 0; m < MT; m++) {
		if (m0 + m < M) {
			const float4 *xp = (const float4 *)(x + (size_t)(m0 + m) * K) + 2 * c;
			const float4 a = xp[0], b = xp[1];

#pragma unroll
			for (int r = 0; r < GEMV_ROWS; r++)
				acc[r][m] = lin_dot8(wv[r], a, b, acc[r][m]);
		}
	}
}

// KW 1: warp (blockIdx.x * GEMV_WARPS + warp) owns weight rows 2 * that + {0, 1} and x
// rows blockIdx.y * MT + {0 .. MT-1}. Lane l reads 16-byte chunks l, l + 32, ... of each
// row; as soon as chunk u of a batch is used, chunk u of the next batch is requested, so
// a warp keeps GEMV_ROWS * GEMV_U loads in flight. KW = GEMV_WARPS (a grid of fewer CTAs
// than multiprocessors: the MoE routers, 64-384 rows): the CTA's warps share one row
// pair, warp ws taking the 32-chunk groups ws, ws + KW, ... of each row, and their sums
// are added in warp order. Needs K % 8 == 0, x and w 16-byte aligned.
template <int MT, int KW>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(float *y, const float *x, const uint16_t *__restrict__ w, int M, int N, int K,
	    int accumulate, int pdl)
{
	static_assert(KW == 1 || KW == GEMV_WARPS, "a CTA's warps split K all or none");
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int ws = KW == 1 ? 0 : warp;	// the warp's K share
	const int row0 = (blockIdx.x * (GEMV_WARPS / KW) + (KW == 1 ? warp : 0)) * GEMV_ROWS;
	const int m0 = blockIdx.y * MT;
	const int nc = K >> 3;		// 16-byte chunks per row
	const int ng = (nc + 31) >> 5;	// 32-chunk groups per row
	const uint16_t *wr[GEMV_ROWS];
	bool rok[GEMV_ROWS];
	float acc[2][GEMV_ROWS][MT];	// two partial sums (even, odd u) for more ILP
	uint4 wv[GEMV_U][GEMV_ROWS];
	// the chunk lane reads in the warp's j-th group
	auto chunk = [&](int j) { return (j * KW + ws) * 32 + lane; };

	if (row0 >= N)
		return;	// KW > 1: the whole CTA
#pragma unroll
	for (int r = 0; r < GEMV_ROWS; r++) {
		rok[r] = row0 + r < N;
		wr[r] = w + (size_t)(rok[r] ? row0 + r : row0) * K;
#pragma unroll
		for (int m = 0; m < MT; m++)
			acc[0][r][m] = acc[1][r][m] = 0.f;
	}
	// the first batches into L2 while the previous kernel drains (PDL)
	if (k_cuda_lin_early_cta(pdl)) {
#pragma unroll
		for (int u = 0; u < GEMV_U * GEMV_PREFETCH; u++) {
			int c = chunk(u);

#pragma unroll
			for (int r = 0; r < GEMV_ROWS; r++)
				if (c < nc && rok[r])
					k_cuda_lin_prefetch(wr[r] + c * 8);
		}
	}
	k_cuda_lin_inputs_ready(pdl);	// x and y only from here on
#pragma unroll
	for (int u = 0; u < GEMV_U; u++)
		gemv_load(wv[u], wr, rok, chunk(u), nc);
	for (int j0 = 0; j0 * KW + ws < ng; j0 += GEMV_U) {
		const bool more = (j0 + GEMV_U) * KW + ws < ng;

#pragma unroll
		for (int u = 0; u < GEMV_U; u++) {
			const int c = chunk(j0 + u);

			if (c < nc)
				gemv_fma<MT>(acc[u & 1], wv[u], x, m0, M, K, c);
			if (more)
				gemv_load(wv[u], wr, rok, chunk(j0 + u + GEMV_U), nc);
		}
	}
	__shared__ float part[KW][GEMV_ROWS][MT];	// KW > 1: each warp's sums
#pragma unroll
	for (int r = 0; r < GEMV_ROWS; r++) {
#pragma unroll
		for (int m = 0; m < MT; m++) {
			float v = lin_warp_sum(acc[0][r][m] + acc[1][r][m]);

			if (KW > 1 && lane == 0)
				part[ws][r][m] = v;
			if (KW == 1 && lane == 0 && rok[r] && m0 + m < M) {
				float *p = y + (size_t)(m0 + m) * N + row0 + r;

				*p = accumulate ? *p + v : v;
			}
		}
	}
	if (KW > 1) {
		__syncthreads();
		if (threadIdx.x < GEMV_ROWS * MT) {
			const int r = threadIdx.x / MT, m = threadIdx.x % MT;
			float v = part[0][r][m];

#pragma unroll
			for (int s = 1; s < KW; s++)
				v += part[s][r][m];
			if (rok[r] && m0 + m < M) {
				float *p = y + (size_t)(m0 + m) * N + row0 + r;

				*p = accumulate ? *p + v : v;
			}
		}
	}
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
