// Embedding lookup on the GPU: one bf16 table row per token, widened to fp32.
// The reference is k_cpu_embed; the result is exact (a bf16 value widens exactly).
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define EMBED_THREADS 256

namespace {	// kernels and their helpers stay private to this file

// ---- kernels ----------------------------------------------------------------

__device__ __forceinline__ float bf16_lo(uint32_t u)
{
	return __uint_as_float(u << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t u)
{
	return __uint_as_float(u & 0xffff0000u);
}

// Eight values per thread: one 16-byte load, two 16-byte stores. Row = blockIdx.x.
__global__ void embed_vec8_kernel(float *out, const int32_t *ids, const uint16_t *table, int dim)
{
	int row = blockIdx.x;
	int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
	const uint4 *src;
	float4 *dst;
	uint4 v;

	if (c >= dim)
		return;
	src = (const uint4 *)(table + (size_t)ids[row] * (size_t)dim + c);
	dst = (float4 *)(out + (size_t)row * (size_t)dim + c);
	v = __ldg(src);
	dst[0] = make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
	dst[1] = make_float4(bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w));
}

// Any dim and alignment: one value per thread.
__global__ void embed_scalar_kernel(float *out, const int32_t *ids, const uint16_t *table, int dim)
{
	int row = blockIdx.x;
	int c = blockIdx.y * blockDim.x + threadIdx.x;

	if (c >= dim)
		return;
	out[(size_t)row * dim + c] =
		__uint_as_float((uint32_t)table[(size_t)ids[row] * (size_t)dim + c] << 16);
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static bool embed_can_vec8(const float *out, const uint16_t *table, int dim)
{
	return dim % 8 == 0 && ((uintptr_t)out % 16) == 0 && ((uintptr_t)table % 16) == 0;
}

extern "C" int k_cuda_embed(cudaStream_t s, float *out, const int32_t *ids, int n,
			    const uint16_t *table, int dim)
{
	if (n < 0 || dim <= 0)
		return -EINVAL;
	if (n == 0)
		return 0;
	if (embed_can_vec8(out, table, dim)) {
		dim3 grid(n, (dim / 8 + EMBED_THREADS - 1) / EMBED_THREADS);

		embed_vec8_kernel<<<grid, EMBED_THREADS, 0, s>>>(out, ids, table, dim);
	} else {
		dim3 grid(n, (dim + EMBED_THREADS - 1) / EMBED_THREADS);

		embed_scalar_kernel<<<grid, EMBED_THREADS, 0, s>>>(out, ids, table, dim);
	}
	return K_CUDA_LAUNCHED("embed");
}
