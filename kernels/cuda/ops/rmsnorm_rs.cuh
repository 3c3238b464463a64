// RMSNorm's scale of a row, rs = 1 / sqrt(mean(x^2) + eps), as rmsnorm.cu computes it:
// the sum of squares in fp64 in one fixed order, so every kernel that includes this
// gets the same bits. rmsnorm.cu's kernels use the pieces; a kernel that folds the norm
// into its own input staging (linear_qgemv.cu) calls k_rms_rs_cta.
//
// The order: dim <= K_RMS_WARP_MAX_DIM, one warp a row (lane l sums elements l, l + 32,
// ... in turn, then one xor-shuffle tree); past it, K_RMS_BLOCK_THREADS threads a row
// (thread t sums t, t + 256, ..., a shuffle tree a warp, then the 8 warps' sums in
// order). Each square is exact in fp64; the order fixes the rest.
#pragma once

#include <cuda_runtime.h>

#define K_RMS_BLOCK_THREADS	256	/* rmsnorm.cu's block-per-row variant */
#define K_RMS_WARP_MAX_DIM	1024	/* up to this, one warp a row */

// The xor tree leaves the same value in every lane (each step adds two values that
// the partner lane adds in the other order: the same sum).
static __device__ __forceinline__ double k_rms_warp_sum_d(double v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

static __device__ __forceinline__ float k_rms_row_rs(double ss, int dim, float eps)
{
	float var = (float)(ss / dim);

	return 1.0f / sqrtf(var + eps);	// torch.rsqrt: sqrt, then divide (IEEE, no fast math)
}

// w * (x * rs), each product rounded (rmsnorm.cu's output), four at a time.
static __device__ __forceinline__ float4 k_rms_scale4(const float4 &w, const float4 &x, float rs)
{
	return make_float4(__fmul_rn(w.x, __fmul_rn(x.x, rs)), __fmul_rn(w.y, __fmul_rn(x.y, rs)),
			   __fmul_rn(w.z, __fmul_rn(x.z, rs)), __fmul_rn(w.w, __fmul_rn(x.w, rs)));
}

// One lane's sum in the order above: elements i0, i0 + step, ... below dim.
static __device__ __forceinline__ double k_rms_lane_sumsq(const float *x, int dim, int i0,
							 int step)
{
	double ss = 0.0;

	for (int i = i0; i < dim; i += step) {
		const double v = (double)x[i];

		ss += v * v;
	}
	return ss;
}

// rs of row x (dim floats), by a CTA of THREADS (a multiple of 32, at most
// K_RMS_BLOCK_THREADS, dividing it): every thread must call it, every thread gets rs.
// part: K_RMS_BLOCK_THREADS / 32 doubles of shared memory, free for the call (a
// barrier at its end, so it may be reused after). Thread t of warp w stands for the
// block order's threads w * 32 + lane + j * THREADS (j < VT); it loads K_RMS_CHUNK values
// of each of them before it adds any, so a row of up to K_RMS_CHUNK * 256 values costs
// one round trip to L2, not one a value.
#define K_RMS_CHUNK	16
template <int THREADS>
static __device__ __forceinline__ float k_rms_rs_cta(const float *x, int dim, float eps,
						     double *part)
{
	static_assert(THREADS % 32 == 0 && K_RMS_BLOCK_THREADS % THREADS == 0, "CTA size");
	constexpr int VW = K_RMS_BLOCK_THREADS / 32;	// warps of the block order
	constexpr int VT = K_RMS_BLOCK_THREADS / THREADS;	// its threads a thread stands for
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	double ss[VT];

	if (dim <= K_RMS_WARP_MAX_DIM)	// the warp order: every warp alike, no barrier
		return k_rms_row_rs(k_rms_warp_sum_d(k_rms_lane_sumsq(x, dim, lane, 32)), dim, eps);
#pragma unroll
	for (int j = 0; j < VT; j++)
		ss[j] = 0.0;
	for (int c0 = 0; c0 < dim; c0 += K_RMS_CHUNK * K_RMS_BLOCK_THREADS) {
		float v[VT][K_RMS_CHUNK];

#pragma unroll
		for (int j = 0; j < VT; j++)
#pragma unroll
			for (int k = 0; k < K_RMS_CHUNK; k++) {
				const int i = c0 + (warp + j * (THREADS / 32)) * 32 + lane +
					      k * K_RMS_BLOCK_THREADS;

				v[j][k] = i < dim ? x[i] : 0.0f;
			}
#pragma unroll
		for (int j = 0; j < VT; j++)
#pragma unroll
			for (int k = 0; k < K_RMS_CHUNK; k++)	// zeros past dim add nothing
				ss[j] += (double)v[j][k] * (double)v[j][k];
	}
#pragma unroll
	for (int j = 0; j < VT; j++) {
		const double s = k_rms_warp_sum_d(ss[j]);

		if (lane == 0)
			part[warp + j * (THREADS / 32)] = s;
	}
	__syncthreads();
	double sum = 0.0;

	for (int i = 0; i < VW; i++)	// same order in every thread
		sum += part[i];
	__syncthreads();	// part is free again
	return k_rms_row_rs(sum, dim, eps);
}

// rs of M rows (row stride dim) into rs[0 .. M) in shared memory, every thread of the CTA
// calling (k_rms_rs_cta's terms); rs is readable by all after it returns.
template <int THREADS>
static __device__ __forceinline__ void k_rms_rs_rows_cta(float *rs, double *part, const float *x,
							 int M, int dim, float eps)
{
	for (int m = 0; m < M; m++) {
		const float r = k_rms_rs_cta<THREADS>(x + (size_t)m * dim, dim, eps, part);

		if (threadIdx.x == 0)
			rs[m] = r;
	}
	__syncthreads();
}
