// What the tensor-core decode attention's two halves share: attn_mma.cu (the kernels and
// the table of their compiled shapes) and attn_mma_launch.cu (the host side: which
// shape, how many splits, the launch); its mma.sync and ldmatrix wrappers serve the
// prefill kernel (attn_prefill.cu) too. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_ATTN_MMA_CUH
#define KD_KERNELS_CUDA_ATTN_MMA_CUH

#include <cstdint>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define MMA_Q 16		// query vectors per block: the m of m16n8k16
#define MMA_MIN_SPLIT_TOKENS 32

// ---- PTX (the decode and prefill tensor-core kernels) ----------------------------

#ifdef __CUDACC__
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t *p)
{
	const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);

	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const uint16_t *p)
{
	const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);

	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(a));
}

// c += a b: a (16 x 16, row), b (16 x 8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
					 uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to bf16 (nearest even) in one cvt instruction, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
	uint32_t v;

	asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(hi), "f"(lo));
	return v;
}
#endif

// One compiled shape: its kernel, dynamic shared memory and blocks per SM.
struct mma_shape {
	int dk, dv, tk;
	bool vsep, qreg, post;
	int threads;
	void (*kernel)(const attn_tile_args, int, uint16_t *, const k_cuda_qkv_args);
	unsigned smem;
	int per_sm;		// resident blocks per SM (from the occupancy query), 0 unusable
};

// The compiled shapes (attn_mma.cu), in the order mma_find tries them; per_sm is
// written by attn_mma_prepare at every workspace's creation.
extern mma_shape attn_mma_shapes[];
extern const int attn_mma_n_shapes;

#endif
