// Small device helpers the kernels share.
#ifndef KD_KERNELS_CUDA_DEVICE_UTIL_CUH
#define KD_KERNELS_CUDA_DEVICE_UTIL_CUH

#include <cstdint>

// fp32 -> bf16 bits, round to nearest even, a NaN kept a NaN (quiet): bit for bit what
// the CPU's k_f32_to_bf16 gives, so caches written on either side compare equal.
__device__ __forceinline__ uint16_t k_cuda_bf16_rn(float f)
{
	uint32_t u = __float_as_uint(f);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

// silu(g) * u = g / (1 + e^-g) * u in fp32, each operation rounded to nearest: the one
// SwiGLU product of the elementwise kernels and of the GEMV that computes its x so
// (linear_qgemv.cu), so the two give the same bits.
__device__ __forceinline__ float k_cuda_silu_mul(float g, float u)
{
	float s = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));

	return __fmul_rn(s, u);
}

// Sum of v over a block of THREADS threads (a multiple of 32), in double, the same
// value in every thread: warp trees, then the warps' sums in order. red: shared
// (THREADS / 32). Has a barrier: every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ double k_cuda_block_sum_d(double v, double *red)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	if (threadIdx.x % 32 == 0)
		red[threadIdx.x / 32] = v;
	__syncthreads();
	v = 0.0;
	for (int w = 0; w < THREADS / 32; w++)
		v += red[w];
	return v;
}

// RoPE's cos and sin at angle p * inv_freq: fp64 sincos rounded to fp32, each scaled by
// attn_factor, as the CPU reference rounds them (rope.cu, qkv_post.cu, mla_post.cu).
__device__ __forceinline__ void k_cuda_rope_cs(float p, float inv_freq, float attn_factor,
					       float &c, float &sn)
{
	double sd, cd;

	sincos((double)__fmul_rn(p, inv_freq), &sd, &cd);
	c = __fmul_rn((float)cd, attn_factor);
	sn = __fmul_rn((float)sd, attn_factor);
}

// The pair (x1, x2) rotated by (c, sn), every product and sum rounded (no FMA), as the
// CPU reference.
__device__ __forceinline__ void k_cuda_rope_rotate(float x1, float x2, float c, float sn,
						   float &o1, float &o2)
{
	o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn));
	o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
}

#endif
