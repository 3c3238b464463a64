// KV-cache append on the GPU: fp32 rows of new keys / values / latents rounded to bf16
// into their slots of the paged cache (layout in k_cuda_attn.h).
#include "kernels/cuda/attn/attn_common.cuh"

// Threads per block; each moves 8 values (two 16-byte loads, one 16-byte store).
#define KVW_THREADS 128

// ---- kernels ----------------------------------------------------------------

__device__ __forceinline__ uint32_t kvw_pack(float lo, float hi)
{
	return k_cuda_bf16_rn(lo) | (k_cuda_bf16_rn(hi) << 16);
}

// Block (row, part): row's values part * KVW_THREADS * 8 onwards, strided by the grid.
__global__ void __launch_bounds__(KVW_THREADS)
kv_write_kernel(uint16_t *__restrict__ cache, int width, const float *__restrict__ src,
		int src_stride, const int32_t *__restrict__ slots, int vec)
{
	const int r = blockIdx.x;
	const int32_t slot = slots[r];
	const float *in = src + (size_t)r * src_stride;
	uint16_t *dst;

	if (slot < 0)
		return;
	dst = cache + (size_t)slot * width;
	if (vec) {
		for (int c = (blockIdx.y * KVW_THREADS + threadIdx.x) * 8; c < width;
		     c += gridDim.y * KVW_THREADS * 8) {
			float4 a = *(const float4 *)(in + c), b = *(const float4 *)(in + c + 4);
			uint4 o;

			o.x = kvw_pack(a.x, a.y);
			o.y = kvw_pack(a.z, a.w);
			o.z = kvw_pack(b.x, b.y);
			o.w = kvw_pack(b.z, b.w);
			*(uint4 *)(dst + c) = o;
		}
	} else {
		for (int c = blockIdx.y * KVW_THREADS + threadIdx.x; c < width;
		     c += gridDim.y * KVW_THREADS)
			dst[c] = (uint16_t)k_cuda_bf16_rn(in[c]);
	}
}

// ---- launchers --------------------------------------------------------------

// 16-byte path: whole 8-value groups, every row start 16-byte aligned on both sides.
static int kvw_vec_ok(const uint16_t *cache, int width, const float *src, int src_stride)
{
	return width % 8 == 0 && src_stride % 4 == 0 && (uintptr_t)cache % 16 == 0 &&
	       (uintptr_t)src % 16 == 0;
}

extern "C" int k_cuda_kv_write(cudaStream_t s, uint16_t *cache, int width, const float *src,
			       int src_stride, int n_rows, const int32_t *slots)
{
	int vec, per_block, parts;

	if (width <= 0 || src_stride < width || n_rows < 0 || n_rows > 0x7fffffff)
		ATTN_INVAL("k_cuda_kv_write: width %d, src_stride %d, n_rows %d unsupported",
			   width, src_stride, n_rows);
	if (n_rows == 0)
		return 0;
	vec = kvw_vec_ok(cache, width, src, src_stride);
	per_block = vec ? KVW_THREADS * 8 : KVW_THREADS;
	parts = attn_cdiv(width, per_block);
	if (parts > 64)
		parts = 64;
	kv_write_kernel<<<dim3(n_rows, parts), KVW_THREADS, 0, s>>>(cache, width, src, src_stride,
								    slots, vec);
	K_CUDA_TRY_LAUNCHED("kv_write_kernel");
	return 0;
}
