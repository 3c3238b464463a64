// The MoE router's logits as device code, for the kernels that compute them inside a
// MoE launch (moe_router.cu's router + routing, moe_lat.cu's latency layer): one warp
// per expert row, x (M <= K_CUDA_MOE_LAT_MAX_ROWS rows) in fp32, with the arithmetic of
// the router GEMV that linear_fp32x runs (linear_gemv.cu's gemv_kernel: each lane's
// 16-byte chunks c = lane, lane + 32, ... in increasing order, two partial sums by the
// parity of c / 32, then the xor shuffle tree of their sum), so that the logits, and
// with them the choice, are the standard path's bit for bit. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_ROUTER_CUH
#define KD_KERNELS_CUDA_MOE_ROUTER_CUH

#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_small.cuh"

#define ROUTER_U 8		// 16-byte chunks per lane in flight (the GEMV's GEMV_U)
#define ROUTER_MAX_ROWS K_CUDA_MOE_LAT_MAX_ROWS

namespace {	// each including file's own copy

// The lane's chunks c0 + 32 u + lane (u < ROUTER_U) of a row of nc chunks, zeros past
// it. EARLY: issued before the PDL wait (the router is a weight: k_cuda_pdl_early).
template <bool EARLY>
__device__ __forceinline__ void router_load(uint4 (&wv)[ROUTER_U], const uint4 *w, int c0, int nc,
					    int lane)
{
#pragma unroll
	for (int u = 0; u < ROUTER_U; u++) {
		int c = c0 + 32 * u + lane;

		wv[u] = c >= nc ? make_uint4(0, 0, 0, 0) : EARLY ? k_cuda_pdl_early(w + c) : __ldcs(w + c);
	}
}

// acc0 / acc1[m] += those chunks . x row m, in the GEMV's order (even / odd c / 32).
__device__ __forceinline__ void router_fma(float (&acc0)[ROUTER_MAX_ROWS],
					   float (&acc1)[ROUTER_MAX_ROWS],
					   const uint4 (&wv)[ROUTER_U], const float *x, int M,
					   int hidden, int c0, int nc, int lane)
{
#pragma unroll
	for (int u = 0; u < ROUTER_U; u++) {
		int c = c0 + 32 * u + lane;

		if (c >= nc)
			break;
#pragma unroll
		for (int m = 0; m < ROUTER_MAX_ROWS; m++) {
			const float4 *xp;

			if (m >= M)
				break;
			xp = (const float4 *)(x + (size_t)m * hidden) + 2 * c;
			if ((c >> 5) & 1)
				fma8(acc1[m], wv[u], xp[0], xp[1]);
			else
				fma8(acc0[m], wv[u], xp[0], xp[1]);
		}
	}
}

// logits[m, e] (rows of E) for the warp's expert row w (hidden bf16, 16-byte aligned)
// and x rows 0 .. M - 1. first: the row's first ROUTER_U chunks per lane, already
// loaded (router_load, e.g. before the PDL wait). The whole warp calls it.
__device__ __forceinline__ void router_row(const uint4 *w, const uint4 (&first)[ROUTER_U],
					   const float *x, int M, int hidden, float *logits, int E,
					   int e)
{
	int nc = hidden / 8, lane = threadIdx.x % 32;
	float acc0[ROUTER_MAX_ROWS], acc1[ROUTER_MAX_ROWS];
	uint4 wv[ROUTER_U];

#pragma unroll
	for (int m = 0; m < ROUTER_MAX_ROWS; m++)
		acc0[m] = acc1[m] = 0.0f;
	router_fma(acc0, acc1, first, x, M, hidden, 0, nc, lane);
	for (int c0 = 32 * ROUTER_U; c0 < nc; c0 += 32 * ROUTER_U) {
		router_load<false>(wv, w, c0, nc, lane);
		router_fma(acc0, acc1, wv, x, M, hidden, c0, nc, lane);
	}
#pragma unroll
	for (int m = 0; m < ROUTER_MAX_ROWS; m++) {
		float v;

		if (m >= M)
			break;
		v = warp_sum(acc0[m] + acc1[m]);
		if (lane == 0)
			logits[(size_t)m * E + e] = v;
	}
}

}	// namespace

#endif
