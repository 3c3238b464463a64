// The embedding of one tensor-parallel rank (docs/PARALLEL.md): its shard of the table
// holds the vocabulary rows [v0, v0 + vn); a token in it is looked up, any other token's
// row is zeros, which the ranks' reduction then fills from the rank that holds it.
#include <cstdint>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/launch_check.cuh"

#define SHARD_EMBED_THREADS 256

namespace {	// kernels stay private to this file

__global__ void shard_embed_kernel(float *out, const int32_t *ids, const uint16_t *table, int vn,
				   int dim, int v0)
{
	const int row = blockIdx.x;
	const int c = blockIdx.y * blockDim.x + threadIdx.x;
	const int id = ids[row] - v0;

	if (c >= dim)
		return;
	out[(size_t)row * dim + c] = id >= 0 && id < vn ?
		__uint_as_float((uint32_t)table[(size_t)id * (size_t)dim + c] << 16) : 0.0f;
}

}	// namespace

extern "C" int k_cuda_embed_shard(cudaStream_t s, float *out, const int32_t *ids, int n,
				  const uint16_t *table, int vn, int dim, int v0)
{
	if (n < 0 || dim <= 0 || vn <= 0 || v0 < 0) {
		k_cuda_log("k_cuda_embed_shard: %d rows of %d values, vocabulary rows %d..%d", n, dim,
			   v0, v0 + vn);
		return -EINVAL;
	}
	if (n == 0)
		return 0;
	shard_embed_kernel<<<dim3(n, (dim + SHARD_EMBED_THREADS - 1) / SHARD_EMBED_THREADS),
			     SHARD_EMBED_THREADS, 0, s>>>(out, ids, table, vn, dim, v0);
	return K_CUDA_LAUNCHED("shard_embed");
}
