// RMSNorm on the GPU, plain and fused with the residual add before it. Follows
// k_cpu_rmsnorm's arithmetic: sum of squares in fp64, the mean rounded once to fp32,
// rs = 1 / sqrtf(var + eps), out = w * (x * rs); so results match it to the last bit
// except where the fp64 sum's order moves the rounded mean (about never).
#include "kernels/cuda/k_cuda_ops.h"
#include "kernels/cuda/launch_check.cuh"

#define RMSNORM_THREADS 256		// block-per-row variant
#define RMSNORM_WARP_MAX_DIM 1024	// up to this, one warp per row (head norms, ...)
#define RMSNORM_ROWS_PER_CTA 8		// warp variant: rows (warps) per block

namespace {	// kernels and their helpers stay private to this file

// ---- kernels ----------------------------------------------------------------

__device__ __forceinline__ double warp_sum_d(double v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

// Pass 1 over a row, elements lane, lane + step, ...: with r, x += r is written back
// first. Each product is exact in fp64, so only the order of the sum differs from the
// CPU's.
__device__ __forceinline__ double row_sumsq(float *x, const float *r, int dim, int lane, int step)
{
	double ss = 0.0;

	for (int i = lane; i < dim; i += step) {
		float v = x[i];

		if (r) {
			v = __fadd_rn(v, r[i]);
			x[i] = v;
		}
		ss += (double)v * (double)v;
	}
	return ss;
}

__device__ __forceinline__ float row_rs(double ss, int dim, float eps)
{
	float var = (float)(ss / dim);

	return 1.0f / sqrtf(var + eps);	// torch.rsqrt: sqrt, then divide (IEEE, no fast math)
}

// Pass 2 over the same elements as pass 1, by the same thread: so out may alias x or r.
__device__ __forceinline__ void row_scale(float *out, const float *x, const float *w, int dim,
					  float rs, int lane, int step)
{
	for (int i = lane; i < dim; i += step)
		out[i] = __fmul_rn(w[i], __fmul_rn(x[i], rs));
}

// One warp per row. r (fused form) has x's stride. x is written only when r is set.
__global__ void rmsnorm_warp_kernel(float *out, int out_stride, float *x, int x_stride,
				    const float *r, const float *w, int rows, int dim, float eps)
{
	int row = blockIdx.x * RMSNORM_ROWS_PER_CTA + threadIdx.x / 32;
	int lane = threadIdx.x % 32;
	float *xr;
	double ss;

	if (row >= rows)
		return;
	xr = x + (size_t)row * x_stride;
	ss = warp_sum_d(row_sumsq(xr, r ? r + (size_t)row * x_stride : nullptr, dim, lane, 32));
	row_scale(out + (size_t)row * out_stride, xr, w, dim, row_rs(ss, dim, eps), lane, 32);
}

// One block per row.
__global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_block_kernel(float *out, int out_stride, float *x, int x_stride, const float *r,
		     const float *w, int dim, float eps)
{
	__shared__ double part[RMSNORM_THREADS / 32];
	int row = blockIdx.x, t = threadIdx.x;
	float *xr = x + (size_t)row * x_stride;
	double ss;

	ss = warp_sum_d(row_sumsq(xr, r ? r + (size_t)row * x_stride : nullptr, dim, t,
				  RMSNORM_THREADS));
	if (t % 32 == 0)
		part[t / 32] = ss;
	__syncthreads();
	ss = 0.0;
	for (int i = 0; i < RMSNORM_THREADS / 32; i++)	// same order in every thread
		ss += part[i];
	row_scale(out + (size_t)row * out_stride, xr, w, dim, row_rs(ss, dim, eps), t,
		  RMSNORM_THREADS);
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static bool rmsnorm_use_warp(int dim)
{
	return dim <= RMSNORM_WARP_MAX_DIM;
}

static int rmsnorm_launch(cudaStream_t s, float *out, int out_stride, float *x, int x_stride,
			  const float *r, const float *w, int rows, int dim, float eps)
{
	if (rows < 0 || dim <= 0 || out_stride < dim || x_stride < dim)
		return -EINVAL;
	if (rows == 0)
		return 0;
	if (rmsnorm_use_warp(dim)) {
		int blocks = (rows + RMSNORM_ROWS_PER_CTA - 1) / RMSNORM_ROWS_PER_CTA;

		rmsnorm_warp_kernel<<<blocks, RMSNORM_ROWS_PER_CTA * 32, 0, s>>>(
			out, out_stride, x, x_stride, r, w, rows, dim, eps);
	} else {
		rmsnorm_block_kernel<<<rows, RMSNORM_THREADS, 0, s>>>(out, out_stride, x, x_stride,
								       r, w, dim, eps);
	}
	return K_CUDA_LAUNCHED(r ? "add_rmsnorm" : "rmsnorm");
}

extern "C" int k_cuda_rmsnorm(cudaStream_t s, float *out, int out_stride, const float *x,
			      int x_stride, const float *w, int rows, int dim, float eps)
{
	// x is written only in the fused form (r != NULL).
	return rmsnorm_launch(s, out, out_stride, const_cast<float *>(x), x_stride, nullptr, w,
			      rows, dim, eps);
}

extern "C" int k_cuda_add_rmsnorm(cudaStream_t s, float *x, const float *r, float *out,
				  const float *w, int rows, int dim, float eps)
{
	if (!r)
		return -EINVAL;
	return rmsnorm_launch(s, out, dim, x, dim, r, w, rows, dim, eps);
}
