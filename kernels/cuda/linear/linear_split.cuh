// The split-K epilogue the workspace kernels share (linear_stream.cu's bf16 kernel,
// linear_qtile.cu's and linear_qgemv.cu's quantized ones): each CTA of a row tile
// writes its partial tile to the context's workspace, and the last to arrive (an atomic
// count) adds the S partials in split order s = 0 .. S-1, so the sum has the same bits
// whoever comes last. Also the accumulator layout of the two-m16-tile warps (stream,
// qtile): the rows and x rows behind a lane's accumulators and their direct store.
#ifndef KD_KERNELS_CUDA_LINEAR_SPLIT_CUH
#define KD_KERNELS_CUDA_LINEAR_SPLIT_CUH

#include "kernels/cuda/linear/linear_internal.h"

// Accumulator c (0..3) of the warp's m16 tile mt and n8 tile nt, for lane (g, t): its
// weight row within the CTA's tile (two m16 tiles a warp) and its x row.
static __device__ __forceinline__ int lin_frag_row(int warp, int mt, int g, int c)
{
	return warp * 32 + mt * 16 + g + (c >> 1) * 8;
}

static __device__ __forceinline__ int lin_frag_m(int nt, int t, int c)
{
	return nt * 8 + 2 * t + (c & 1);
}

// y (M, N) (+)= the CTA's accumulators where S == 1: two m16 tiles a warp, NT n8 tiles.
template <int NT>
static __device__ __forceinline__ void lin_store_tiles(float *y, const float (&acc)[2][NT][4],
							int M, int N, int n0, int accumulate,
							int warp, int g, int t)
{
#pragma unroll
	for (int mt = 0; mt < 2; mt++)
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int c = 0; c < 4; c++) {
				const int n = n0 + lin_frag_row(warp, mt, g, c), m = lin_frag_m(nt, t, c);

				if (m < M && n < N) {
					float *p = y + (size_t)m * N + n;

					*p = accumulate ? *p + acc[mt][nt][c] : acc[mt][nt][c];
				}
			}
}

// After the CTA stored its partial tile: true in the CTA that arrives last at
// cnt[tile] of the S of its row tile (the whole CTA returns the same), which then sees
// every other CTA's partials. Its caller resets cnt[tile] once it has summed them.
static __device__ __forceinline__ bool lin_split_last(unsigned *cnt, int tile, int S)
{
	__shared__ bool last;

	__threadfence();	// partials visible device-wide before this CTA counts
	__syncthreads();
	if (threadIdx.x == 0)
		last = atomicAdd(cnt + tile, 1u) == (unsigned)S - 1;
	__syncthreads();
	if (!last)
		return false;
	__threadfence();	// every other CTA's partials, which its count published
	return true;
}

// The sum of the S partial tiles from tp (split q at tp + q * PART floats, ROWS floats an
// x row) into y rows [0, M), columns n0 + [0, ROWS), over the tile's elements [e0, e1)
// (x row e / ROWS, column e % ROWS; e0, e1 multiples of 4): 4 outputs a thread and step,
// all S loads issued before the adds (in split order): the sum is latency-bound, not
// bandwidth-bound. tid: threadIdx.x. UNROLL: the step loop's unroll (0: the compiler's).
template <int ROWS, int THREADS, int UNROLL>
static __device__ __forceinline__ void lin_split_sum4_span(float *y, const float *tp, size_t PART,
							    int M, int N, int n0, int S,
							    int accumulate, int tid, int e0, int e1)
{
	auto step = [&](int e) {
		const int m = e / ROWS, r = e % ROWS;
		float4 v[LIN_ST_MAX_SPLIT];
		float sum[4];

#pragma unroll
		for (int q = 0; q < LIN_ST_MAX_SPLIT; q++)
			if (q < S)
				v[q] = __ldcg((const float4 *)(tp + (size_t)q * PART + e));
		sum[0] = v[0].x;
		sum[1] = v[0].y;
		sum[2] = v[0].z;
		sum[3] = v[0].w;
#pragma unroll
		for (int q = 1; q < LIN_ST_MAX_SPLIT; q++)
			if (q < S) {
				sum[0] += v[q].x;
				sum[1] += v[q].y;
				sum[2] += v[q].z;
				sum[3] += v[q].w;
			}
#pragma unroll
		for (int i = 0; i < 4; i++)
			if (n0 + r + i < N) {
				float *p = y + (size_t)m * N + n0 + r + i;

				*p = accumulate ? *p + sum[i] : sum[i];
			}
	};

	if constexpr (UNROLL > 0) {
#pragma unroll UNROLL
		for (int e = e0 + tid * 4; e < e1; e += THREADS * 4)
			step(e);
	} else {
		for (int e = e0 + tid * 4; e < e1; e += THREADS * 4)
			step(e);
	}
}

// The last CTA's sum of the whole tile (lin_split_sum4_span over every element).
template <int ROWS, int THREADS, int UNROLL>
static __device__ __forceinline__ void lin_split_sum4(float *y, const float *tp, size_t PART,
						       int M, int N, int n0, int S, int accumulate,
						       int tid)
{
	lin_split_sum4_span<ROWS, THREADS, UNROLL>(y, tp, PART, M, N, n0, S, accumulate, tid, 0,
						   M * ROWS);
}

// After the CTA stored its partial tile, where all S CTAs of every tile are resident at
// once: waits until all S of its tile have stored theirs (cnt[tile] counts them).
// Then each sums its 1/S of the tile (lin_split_sum4_span) and calls lin_split_done.
static __device__ __forceinline__ void lin_split_all(unsigned *cnt, int tile, int S)
{
	__threadfence();	// partials visible device-wide before this CTA counts
	__syncthreads();
	if (threadIdx.x == 0) {
		atomicAdd(cnt + tile, 1u);
		while (*(volatile unsigned *)(cnt + tile) < (unsigned)S)
			__nanosleep(64);
	}
	__syncthreads();
	__threadfence();	// every other CTA's partials, which their counts published
}

// A CTA's share summed: the last of the S resets cnt[tile] for the next launch.
static __device__ __forceinline__ void lin_split_done(unsigned *cnt, int tile, int S)
{
	__syncthreads();
	if (threadIdx.x == 0 && atomicAdd(cnt + tile, 1u) == 2 * (unsigned)S - 1)
		cnt[tile] = 0;
}

#endif
