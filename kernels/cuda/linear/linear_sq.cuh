// Row squares: a linear whose output y is an RMSNorm's input leaves, with y, each row's
// sums of squares over its 64-column tiles (fp64, sq[tile * 8 + m]), so that the GEMV
// after the norm, which folds the norm into its x staging, reads T = ceil(dim / 64)
// doubles a row for rs instead of the whole row (k_cuda_linear_sq_request). Every
// square is exact in fp64; the tiles' sums and their sum go in fixed orders, so the bits
// are the same run to run, though not k_cuda_rmsnorm's order: rs may differ from it in
// the last bit (test_cuda_linear_q holds the fold to the two-launch form).
#ifndef KD_KERNELS_CUDA_LINEAR_SQ_CUH
#define KD_KERNELS_CUDA_LINEAR_SQ_CUH

#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/ops/rmsnorm_rs.cuh"

// The xor tree of a warp's fp64 values: every lane gets the same sum.
static __device__ __forceinline__ double lin_sq_warp_sum(double v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

// Producer: vals (shared, M rows of K_CUDA_LINEAR_SQ_COLS floats: a tile's final
// outputs, zeros past N) to sq[tile * K_CUDA_LINEAR_RING_M + m], m < M: warp w takes rows
// w, w + WARPS, ..., lane l columns l and l + 32. The CTA's threads all call it after a
// barrier that published vals.
template <int WARPS>
static __device__ __forceinline__ void lin_sq_tile(double *sq, const float *vals, int M, int tile)
{
	static_assert(K_CUDA_LINEAR_SQ_COLS == 64, "two columns a lane");
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

	for (int m = warp; m < M; m += WARPS) {
		const double a = vals[m * K_CUDA_LINEAR_SQ_COLS + lane];
		const double b = vals[m * K_CUDA_LINEAR_SQ_COLS + lane + 32];
		const double s = lin_sq_warp_sum(a * a + b * b);

		if (lane == 0)
			sq[(size_t)tile * K_CUDA_LINEAR_RING_M + m] = s;
	}
}

// Consumer: rs[m] (shared) = 1 / sqrt(mean + eps) of rows m < M of a dim-wide norm input
// from its producer's tile sums: warp w rows w, w + WARPS, ..., lane l tiles l, l + 32,
// ... in turn, then the xor tree; k_rms_row_rs's arithmetic. The CTA's threads all call
// it (a barrier at its end publishes rs).
template <int WARPS>
static __device__ __forceinline__ void lin_sq_rs_rows(float *rs, const double *sq, int M, int dim,
						      float eps)
{
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int T = (dim + K_CUDA_LINEAR_SQ_COLS - 1) / K_CUDA_LINEAR_SQ_COLS;

	for (int m = warp; m < M; m += WARPS) {
		double s = 0.0;

		for (int t = lane; t < T; t += 32)
			s += __ldcg(sq + (size_t)t * K_CUDA_LINEAR_RING_M + m);
		s = lin_sq_warp_sum(s);
		if (lane == 0)
			rs[m] = k_rms_row_rs(s, dim, eps);
	}
	__syncthreads();
}

#endif
