// Greedy sampling by vocabulary slices on the GPU (docs/PARALLEL.md): each rank's best
// logit of each row of its slice, as (value, id) pairs, so that only 8 bytes a row
// cross to the host instead of the slice. The rule is kernels/cpu/sample.c's scan
// (forward_tp_argmax): the highest value, the lower index on ties, NaNs passed over,
// the last index where the whole row is NaN. As a reduction: prefer a number to a
// NaN, then the greater value, then the lower index; of two NaNs the higher index.
// That order is total, so any tree of it gives the scan's answer.
#include <cstdint>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/launch_check.cuh"

#define ARGMAX_THREADS 512

namespace {	// kernels stay private to this file

// Whether (v, i) beats (w, j) under the scan's rule (i != j).
__device__ __forceinline__ bool beats(float v, int i, float w, int j)
{
	const bool nv = v != v, nw = w != w;

	if (nv || nw)
		return nv && nw ? i > j : nw;
	return v > w || (v == w && i < j);
}

// One CTA per row: each thread scans a stride of the row, then warps and CTA combine.
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_slice_kernel(float *best_v, int32_t *best_i, const float *logits, int vn, int v0)
{
	__shared__ float sv[ARGMAX_THREADS / 32];
	__shared__ int si[ARGMAX_THREADS / 32];
	const float *row = logits + (size_t)blockIdx.x * vn;
	float v = row[0];	// element 0 seeds every thread: a member of the row either way
	int i = 0;

	for (int k = threadIdx.x; k < vn; k += blockDim.x) {
		const float x = row[k];

		if (k != i && beats(x, k, v, i))
			v = x, i = k;
	}
	for (int o = 16; o > 0; o >>= 1) {
		const float w = __shfl_xor_sync(0xffffffffu, v, o);
		const int j = __shfl_xor_sync(0xffffffffu, i, o);

		if (j != i && beats(w, j, v, i))
			v = w, i = j;
	}
	if (threadIdx.x % 32 == 0) {
		sv[threadIdx.x / 32] = v;
		si[threadIdx.x / 32] = i;
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		for (int w = 1; w < (int)(blockDim.x / 32); w++)
			if (si[w] != i && beats(sv[w], si[w], v, i))
				v = sv[w], i = si[w];
		best_v[blockIdx.x] = v;
		best_i[blockIdx.x] = v0 + i;
	}
}

}	// namespace

extern "C" int k_cuda_argmax_slice(cudaStream_t s, void *best, const float *logits, int rows,
				   int vn, int v0)
{
	if (!best || !logits || rows < 1 || vn < 1 || v0 < 0) {
		k_cuda_log("k_cuda_argmax_slice: %d rows of %d values from %d", rows, vn, v0);
		return -EINVAL;
	}
	argmax_slice_kernel<<<rows, ARGMAX_THREADS, 0, s>>>((float *)best, (int32_t *)best + rows,
							    logits, vn, v0);
	return K_CUDA_LAUNCHED("argmax_slice");
}
