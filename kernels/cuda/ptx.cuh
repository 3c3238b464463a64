// The inline PTX the attention kernels use, in one place: asynchronous 16-byte copies
// from global to shared memory (sm_80+), zero-filled where the source is out of range,
// and 8-byte ones (the MoE tile kernels' int4 scales).
#ifndef KD_KERNELS_CUDA_ATTN_PTX_CUH
#define KD_KERNELS_CUDA_ATTN_PTX_CUH

#include <cstdint>

// 16 bytes gmem -> smem, or 16 zero bytes where !valid (gmem is then not read).
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid)
{
	uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
	int n = valid ? 16 : 0;

	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
		     "r"(n)
		     : "memory");
}

// 8 bytes gmem -> smem (cp.async.cg takes only 16; .ca caches in L1 too), both 8-byte
// aligned.
__device__ __forceinline__ void cp_async8(void *smem, const void *gmem)
{
	uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);

	asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit()
{
	asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most n of this thread's committed groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

#endif
