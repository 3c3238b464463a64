// Rotary position embedding on the GPU, the rotation of k_cpu_rope: the fp32 angle
// pos * inv_freq, cos and sin in fp64 rounded to fp32 and scaled by attn_factor, each
// product rounded before the sum (no FMA). Matches the CPU to the last bit except where
// fp64 cos/sin differ from glibc's in a rounding that survives the cast (about never).
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define ROPE_THREADS 128
#define ROPE_MAX_HALF 1024	// rotary pairs per head, as kernels/cpu/rope.c
#define ROPE_HEADS_PER_CTA 8	// heads sharing one cos/sin table

namespace {	// kernels and their helpers stay private to this file

// ---- kernels ----------------------------------------------------------------

// Block (row r, heads h0..h0+7): the cos/sin of row r's angles once into shared memory,
// then every (head, pair) of the block.
__global__ void __launch_bounds__(ROPE_THREADS)
rope_kernel(const float *inv_freq, int half, int interleaved, float attn_factor, float *x,
	    int n_heads, int row_stride, int head_stride, const int32_t *pos)
{
	__shared__ float cs[2][ROPE_MAX_HALF];
	int r = blockIdx.x, h0 = blockIdx.y * ROPE_HEADS_PER_CTA;
	int nh = min(ROPE_HEADS_PER_CTA, n_heads - h0);
	int step = interleaved ? 2 : 1, gap = interleaved ? 1 : half;
	float p = (float)pos[r];
	float *xr = x + (size_t)r * row_stride;

	for (int i = threadIdx.x; i < half; i += ROPE_THREADS)
		k_cuda_rope_cs(p, inv_freq[i], attn_factor, cs[0][i], cs[1][i]);
	__syncthreads();
	for (int it = threadIdx.x; it < nh * half; it += ROPE_THREADS) {
		int h = h0 + it / half, i = it % half;
		float *p1 = xr + (size_t)h * head_stride + i * step;
		float *p2 = p1 + gap;

		k_cuda_rope_rotate(*p1, *p2, cs[0][i], cs[1][i], *p1, *p2);
	}
}

}	// namespace

// ---- launchers --------------------------------------------------------------

extern "C" int k_cuda_rope(cudaStream_t s, const float *inv_freq, int dim, int interleaved,
			   float attn_factor, float *x, int n_rows, int n_heads, int row_stride,
			   int head_stride, const int32_t *pos)
{
	dim3 grid;

	if (dim <= 0 || dim % 2 || dim / 2 > ROPE_MAX_HALF || n_rows < 0 || n_heads < 0)
		return -EINVAL;
	if (n_rows == 0 || n_heads == 0)
		return 0;
	grid = dim3(n_rows, (n_heads + ROPE_HEADS_PER_CTA - 1) / ROPE_HEADS_PER_CTA);
	rope_kernel<<<grid, ROPE_THREADS, 0, s>>>(inv_freq, dim / 2, interleaved != 0, attn_factor,
						  x, n_heads, row_stride, head_stride, pos);
	return K_CUDA_LAUNCHED("rope");
}
