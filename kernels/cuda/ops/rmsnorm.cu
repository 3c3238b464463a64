// RMSNorm on the GPU, plain and fused with the residual add before it. Follows
// k_cpu_rmsnorm's arithmetic: sum of squares in fp64, the mean rounded once to fp32,
// rs = 1 / sqrtf(var + eps), out = w * (x * rs); so results match it to the last bit
// except where the fp64 sum's order moves the rounded mean (about never). The order and
// rs are rmsnorm_rs.cuh's, shared with the kernels that fold the norm into their input.
#include <cuda_bf16.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ops/rmsnorm_rs.cuh"

#define RMSNORM_THREADS K_RMS_BLOCK_THREADS	// block-per-row variant
#define RMSNORM_WARP_MAX_DIM K_RMS_WARP_MAX_DIM	// up to this, one warp a row (head norms, ...)
#define RMSNORM_ROWS_PER_CTA 8		// warp variant: rows (warps) per block

namespace {	// kernels and their helpers stay private to this file

__device__ __forceinline__ uint16_t bf16_bits(float f)
{
	const __nv_bfloat16 h = __float2bfloat16_rn(f);

	return __bfloat16_as_ushort(h);
}

// ---- kernels ----------------------------------------------------------------

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

// Pass 2 over the same elements as pass 1, by the same thread: so out may alias x or r.
// ob (NULL or dim bf16): the output rounded to nearest even as well, for a linear next.
__device__ __forceinline__ void row_scale(float *out, uint16_t *ob, const float *x, const float *w,
					  int dim, float rs, int lane, int step)
{
	for (int i = lane; i < dim; i += step) {
		const float o = __fmul_rn(w[i], __fmul_rn(x[i], rs));

		out[i] = o;
		if (ob)
			ob[i] = bf16_bits(o);
	}
}

// The same two passes with each thread's PER values (elements lane + k * step) held in
// registers: every load is issued before the first use. The loops above cannot do
// that, since out may alias x and x is written in the fused form, so each of their
// loads waits for the store before it; this is the form for dims up to 32 x step.
template <int PER>
__device__ __forceinline__ double regs_sumsq(float (&v)[PER], float *x, const float *r, int dim,
					     int lane, int step)
{
	double ss = 0.0;

#pragma unroll
	for (int k = 0; k < PER; k++)
		v[k] = lane + k * step < dim ? x[lane + k * step] : 0.0f;
	if (r) {
#pragma unroll
		for (int k = 0; k < PER; k++)
			if (lane + k * step < dim)
				v[k] = __fadd_rn(v[k], r[lane + k * step]);
#pragma unroll
		for (int k = 0; k < PER; k++)
			if (lane + k * step < dim)
				x[lane + k * step] = v[k];
	}
#pragma unroll
	for (int k = 0; k < PER; k++)
		ss += (double)v[k] * (double)v[k];	// zeros past dim add nothing
	return ss;
}

template <int PER>
__device__ __forceinline__ void regs_scale(float *out, uint16_t *ob, const float (&v)[PER],
					   const float *w, int dim, float rs, int lane, int step)
{
	float wv[PER];

#pragma unroll
	for (int k = 0; k < PER; k++)
		wv[k] = lane + k * step < dim ? w[lane + k * step] : 0.0f;
#pragma unroll
	for (int k = 0; k < PER; k++)
		if (lane + k * step < dim) {
			const float o = __fmul_rn(wv[k], __fmul_rn(v[k], rs));

			out[lane + k * step] = o;
			if (ob)
				ob[lane + k * step] = bf16_bits(o);
		}
}

// One warp per row. r (fused form) has x's stride. x is written only when r is set.
// PER > 0: dim <= 32 * PER, values in registers; PER == 0: any dim, two loops.
// pdl-order: relay rmsnorm_warp_kernel
template <int PER>
__global__ void rmsnorm_warp_kernel(float *out, int out_stride, float *x, int x_stride,
				    const float *r, const float *w, int rows, int dim, float eps,
				    uint16_t *ob, int relay)
{
	int row = blockIdx.x * RMSNORM_ROWS_PER_CTA + threadIdx.x / 32;
	int lane = threadIdx.x % 32;
	const float *rr;
	float *xr;
	double ss;

	k_cuda_pdl_relay(relay);
	k_cuda_pdl_wait();
	if (row >= rows)
		return;
	xr = x + (size_t)row * x_stride;
	rr = r ? r + (size_t)row * x_stride : nullptr;
	if (ob)
		ob += (size_t)row * dim;
	if constexpr (PER > 0) {
		float v[PER > 0 ? PER : 1];

		ss = k_rms_warp_sum_d(regs_sumsq<PER>(v, xr, rr, dim, lane, 32));
		regs_scale<PER>(out + (size_t)row * out_stride, ob, v, w, dim,
				k_rms_row_rs(ss, dim, eps), lane, 32);
	} else {
		ss = k_rms_warp_sum_d(row_sumsq(xr, rr, dim, lane, 32));
		row_scale(out + (size_t)row * out_stride, ob, xr, w, dim,
			  k_rms_row_rs(ss, dim, eps), lane, 32);
	}
}

// One block per row; PER as in the warp kernel, with RMSNORM_THREADS for 32.
// The reduction is already the shortest chain for the fixed order: one shuffle tree,
// one shared-memory step, then the warps' sums in order in every thread.
// pdl-order: relay rmsnorm_block_kernel
template <int PER>
__global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_block_kernel(float *out, int out_stride, float *x, int x_stride, const float *r,
		     const float *w, int dim, float eps, uint16_t *ob, int relay)
{
	__shared__ double part[RMSNORM_THREADS / 32];
	int row = blockIdx.x, t = threadIdx.x;
	float *xr = x + (size_t)row * x_stride;
	const float *rr = r ? r + (size_t)row * x_stride : nullptr;
	float v[PER > 0 ? PER : 1];
	double ss;

	k_cuda_pdl_relay(relay);
	k_cuda_pdl_wait();
	if constexpr (PER > 0)
		ss = k_rms_warp_sum_d(regs_sumsq<PER>(v, xr, rr, dim, t, RMSNORM_THREADS));
	else
		ss = k_rms_warp_sum_d(row_sumsq(xr, rr, dim, t, RMSNORM_THREADS));
	if (t % 32 == 0)
		part[t / 32] = ss;
	__syncthreads();
	ss = 0.0;
	for (int i = 0; i < RMSNORM_THREADS / 32; i++)	// same order in every thread
		ss += part[i];
	if (ob)
		ob += (size_t)row * dim;
	if constexpr (PER > 0)
		regs_scale<PER>(out + (size_t)row * out_stride, ob, v, w, dim,
				k_rms_row_rs(ss, dim, eps), t, RMSNORM_THREADS);
	else
		row_scale(out + (size_t)row * out_stride, ob, xr, w, dim,
			  k_rms_row_rs(ss, dim, eps), t, RMSNORM_THREADS);
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static bool rmsnorm_use_warp(int dim)
{
	return dim <= RMSNORM_WARP_MAX_DIM;
}

typedef void (*rmsnorm_warp_fn)(float *, int, float *, int, const float *, const float *, int,
				int, float, uint16_t *, int);
typedef void (*rmsnorm_block_fn)(float *, int, float *, int, const float *, const float *, int,
				 float, uint16_t *, int);

// Values per lane: dim <= 1024, so one of 4, 8, 16, 32.
static rmsnorm_warp_fn rmsnorm_warp_pick(int dim)
{
	const int per = (dim + 31) / 32;

	return per <= 4 ? rmsnorm_warp_kernel<4>
	       : per <= 8 ? rmsnorm_warp_kernel<8>
	       : per <= 16 ? rmsnorm_warp_kernel<16> : rmsnorm_warp_kernel<32>;
}

// Values per thread: past 32 (dim > 8192) the two-loop form.
static rmsnorm_block_fn rmsnorm_block_pick(int dim)
{
	const int per = (dim + RMSNORM_THREADS - 1) / RMSNORM_THREADS;

	return per <= 8 ? rmsnorm_block_kernel<8>
	       : per <= 16 ? rmsnorm_block_kernel<16>
	       : per <= 32 ? rmsnorm_block_kernel<32> : rmsnorm_block_kernel<0>;
}

static int rmsnorm_launch(cudaStream_t s, float *out, int out_stride, float *x, int x_stride,
			  const float *r, const float *w, int rows, int dim, float eps, uint16_t *ob)
{
	if (rows < 0 || dim <= 0 || out_stride < dim || x_stride < dim)
		return -EINVAL;
	if (rows == 0)
		return 0;
	if (rmsnorm_use_warp(dim))
		k_cuda_launch_pdl(s, (rows + RMSNORM_ROWS_PER_CTA - 1) / RMSNORM_ROWS_PER_CTA,
				  RMSNORM_ROWS_PER_CTA * 32, 0, rmsnorm_warp_pick(dim), out,
				  out_stride, x, x_stride, r, w, rows, dim, eps, ob,
				  k_cuda_pdl_relay_enabled(K_CUDA_RELAY_NORM));
	else
		k_cuda_launch_pdl(s, rows, RMSNORM_THREADS, 0, rmsnorm_block_pick(dim), out,
				  out_stride, x, x_stride, r, w, dim, eps, ob,
				  k_cuda_pdl_relay_enabled(K_CUDA_RELAY_NORM));
	return K_CUDA_LAUNCHED(r ? "add_rmsnorm" : "rmsnorm");
}

extern "C" int k_cuda_rmsnorm(cudaStream_t s, float *out, int out_stride, const float *x,
			      int x_stride, const float *w, int rows, int dim, float eps)
{
	// x is written only in the fused form (r != NULL).
	return rmsnorm_launch(s, out, out_stride, const_cast<float *>(x), x_stride, nullptr, w,
			      rows, dim, eps, nullptr);
}

extern "C" int k_cuda_rmsnorm_bf16(cudaStream_t s, float *out, int out_stride, const float *x,
				   int x_stride, const float *w, int rows, int dim, float eps,
				   uint16_t *out_bf16)
{
	return rmsnorm_launch(s, out, out_stride, const_cast<float *>(x), x_stride, nullptr, w,
			      rows, dim, eps, out_bf16);
}

extern "C" int k_cuda_add_rmsnorm(cudaStream_t s, float *x, const float *r, float *out,
				  const float *w, int rows, int dim, float eps)
{
	if (!r)
		return -EINVAL;
	return rmsnorm_launch(s, out, dim, x, dim, r, w, rows, dim, eps, nullptr);
}
