// The bf16 GEMV for M <= 2 rows of fp32 x (linear_gemv.cu's gemv_kernel) as a CTA's
// device function, so that a kernel with more to do after it (moe_route.cu's router
// whose last CTA routes) computes the same bits. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_LINEAR_GEMV_CUH
#define KD_KERNELS_CUDA_LINEAR_GEMV_CUH

#include <cstdint>

#include "kernels/cuda/linear/linear_internal.h"

#define GEMV_WARPS	4	/* warps per CTA */
#define GEMV_ROWS	2	/* weight rows per warp: each x load feeds both */
#define GEMV_U		8	/* 16-byte loads per row and lane in flight: 8 KB per warp */
#define GEMV_PREFETCH	2	/* batches prefetched into L2 before waiting (PDL) */
#define GEMV_MAX_GY	65535	/* gridDim.y limit; larger M is walked in launches */


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
static __device__ __forceinline__ void gemv_block(float *y, const float *x,
						  const uint16_t *__restrict__ w, int M, int N,
						  int K, int accumulate, int pdl)
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
	if (row0 >= N)	// no rows (KW > 1: the whole CTA); after the wait, which a caller's
		return;	// code after this function may rely on
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

#endif
