// The router's choices renumbered into one expert-parallel rank's share (docs/PARALLEL.md):
// the rank holds experts [e0, e0 + ne) whole, renumbered from 0; another rank's expert
// becomes -1, an id the experts kernels skip (its rows contribute nothing here).
#include <cstdint>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/launch_check.cuh"

#define SHARD_EXPERTS_THREADS 256

namespace {	// kernels stay private to this file

__global__ void shard_experts_kernel(int32_t *ids, int n, int e0, int ne)
{
	const int i = blockIdx.x * blockDim.x + threadIdx.x;

	if (i < n) {
		const int32_t id = ids[i];

		ids[i] = id >= e0 && id < e0 + ne ? id - e0 : -1;
	}
}

}	// namespace

extern "C" int k_cuda_experts_shard(cudaStream_t s, int32_t *ids, int n, int e0, int ne)
{
	if (n < 0 || e0 < 0 || ne <= 0) {
		k_cuda_log("k_cuda_experts_shard: %d ids, experts %d..%d", n, e0, e0 + ne);
		return -EINVAL;
	}
	if (n == 0)
		return 0;
	shard_experts_kernel<<<(n + SHARD_EXPERTS_THREADS - 1) / SHARD_EXPERTS_THREADS,
			       SHARD_EXPERTS_THREADS, 0, s>>>(ids, n, e0, ne);
	return K_CUDA_LAUNCHED("shard_experts");
}
