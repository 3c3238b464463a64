// Quantized experts in registers (W8A16 fp8, W4A16 int4; kernels/quant.h's layouts): a
// 16-byte chunk of a weight row as float values, four at a time, and its scale. The
// small kernels (moe_small.cuh, moe_small_m1.cuh) dot each chunk's values with fp32 x
// into a partial sum that its one scale then multiplies (every chunk lies in one scale
// block: k_cuda_moe_quant_ok); fp32 accumulation throughout. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_QUANT_CUH
#define KD_KERNELS_CUDA_MOE_QUANT_CUH

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/quant_dequant.cuh"

namespace {	// each including file's own copy

// Two e4m3 bytes (low first) as floats, exactly (every e4m3 value is an f16).
__device__ __forceinline__ float2 mq_e4m3x2(uint32_t v)
{
	__half2 h(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3));

	return __half22float2(h);
}

// Byte k of x (a value 0..15) less 8 as a float, exactly: the byte under the exponent of
// 2^23 (one PRMT), less 2^23 + 8.
__device__ __forceinline__ float mq_b2f(uint32_t x, int k)
{
	return __uint_as_float(__byte_perm(x, 0x4b000000u, 0x7540 + k)) - 8388616.0f;
}

__device__ __forceinline__ uint32_t mq_word(uint4 w, int i)
{
	return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// Values 4 i .. 4 i + 3 of a chunk (i a compile-time constant after unrolling).
template <int F>
__device__ __forceinline__ float4 mq_quad(uint4 w, int i)
{
	if (F == MQ_FP8) {	// 4 bytes a word: two cvt to f16 pairs (exact), then fp32
		uint32_t lo, hi;
		__half2 a, b;

		k_dq_e4m3x4(mq_word(w, i), lo, hi);
		memcpy(&a, &lo, 4);
		memcpy(&b, &hi, 4);
		float2 fa = __half22float2(a), fb = __half22float2(b);

		return make_float4(fa.x, fa.y, fb.x, fb.y);
	}
	// int4: 8 nibbles a word, low first; the even ones in the bytes of lo, the odd ones
	// in hi's (two ops a word, shared by its two quads)
	uint32_t v = mq_word(w, i / 2), lo = v & 0x0f0f0f0fu, hi = (v >> 4) & 0x0f0f0f0fu;
	int h = 2 * (i % 2);

	return make_float4(mq_b2f(lo, h), mq_b2f(hi, h), mq_b2f(lo, h + 1), mq_b2f(hi, h + 1));
}

// A quantized weight row's scales: its scale row and how a column finds its scale.
struct mq_row {
	const void *s;		// the row's scale row (NULL: no row)
	int kshift;		// column k's scale: s[k >> kshift]
	int sbf16;		// bf16 scales (else fp32)
};

// Row n of matrix j (0 gate, 1 up, 2 down) of the expert whose scales start at base.
__device__ __forceinline__ mq_row mq_row_of(const moe_wq &wq, const void *base, int j, int n)
{
	mq_row r;
	size_t i = (size_t)(n >> wq.rshift[j]) * (size_t)wq.scols[j];

	r.s = base ? (const char *)base + i * (wq.sbf16 ? 2 : 4) : nullptr;
	r.kshift = wq.kshift[j];
	r.sbf16 = wq.sbf16;
	return r;
}

// mq_scale in two halves, so that the load's wait moves to where the scale is used:
// mq_scale_raw loads the stored bits (bf16: the 16 bits, unshifted, as a float's bit
// pattern) with no arithmetic on them, EARLY: before the PDL wait (weights' scales are
// constants: k_cuda_pdl_early's loads); mq_scale_cook (at the use) makes the float. With
// the conversion beside the load, ptxas waited for each 2-byte load at once, inside
// the branch on sbf16: up to 8 round trips a unit in the m1 kernels (SASS, session 13).
template <bool EARLY = false>
__device__ __forceinline__ float mq_scale_raw(const mq_row &r, int k)
{
	int i = k >> r.kshift;
	uint32_t b;

	if (!r.s)
		return 0.0f;
	if (r.sbf16)
		b = EARLY ? k_cuda_pdl_early((const unsigned short *)r.s + i)
			  : __ldg((const unsigned short *)r.s + i);
	else
		b = __float_as_uint(EARLY ? k_cuda_pdl_early((const float *)r.s + i)
					  : __ldg((const float *)r.s + i));
	return __uint_as_float(b);
}

__device__ __forceinline__ float mq_scale_cook(float raw, int sbf16)
{
	return sbf16 ? __uint_as_float(__float_as_uint(raw) << 16) : raw;
}

// The scale of the chunk of values from column k, in one piece.
__device__ __forceinline__ float mq_scale(const mq_row &r, int k)
{
	return mq_scale_cook(mq_scale_raw(r, k), r.sbf16);
}

// part += chunk w (values from column c * VPC) dotted with the fp32 values at x4
// (VPC / 4 float4).
template <int F>
__device__ __forceinline__ float mq_chunk_dot(uint4 w, const float4 *x4, float part)
{
#pragma unroll
	for (int i = 0; i < MQ_VPC(F) / 4; i++) {
		float4 v = mq_quad<F>(w, i), xv = x4[i];

		part = fmaf(v.x, xv.x, part);
		part = fmaf(v.y, xv.y, part);
		part = fmaf(v.z, xv.z, part);
		part = fmaf(v.w, xv.w, part);
	}
	return part;
}

// Staged fp32 rows (x, activations) where quantized chunks read them: float4 q is kept
// at mq_swz(q), its low three bits XORed with the next three (a permutation within each
// aligned group of 8 float4, 128 bytes). Why: lane c of a warp reads the VPC fp32 values
// of its chunk c, 64 (fp8) or 128 (int4) bytes after lane c - 1's, so unswizzled every
// LDS.128 of a quarter warp falls on 2 (fp8) or 1 (int4) of the 8 16-byte bank groups:
// 4x or 8x the shared-memory wavefronts, which bound the quantized kernels (the fp32 x
// of a value is 2-8x its stored bytes). Swizzled, the 8 lanes of a quarter warp hit 8
// distinct groups, for any row start that is a multiple of 8 float4 (32 fp32 values:
// hidden and inter are, moe_wq_vector). bf16 rows keep the plain layout.
__device__ __forceinline__ int mq_swz(int q)
{
	return q ^ ((q >> 3) & 7);
}

// p0 += chunk w0, p1 += chunk w1 (values from the same columns) dotted with the fp32
// values of float4 q0 .. q0 + VPC / 4 - 1 of the swizzled rows s4 (mq_swz): each x
// value read once for both rows. q0 a multiple of VPC / 4, so the chunk's float4 stay
// in one swizzle group (int4: the whole group; fp8: half of one, the XOR key shared).
template <int F>
__device__ __forceinline__ void mq_chunk_dot2(uint4 w0, uint4 w1, const float4 *s4, int q0,
					      float &p0, float &p1)
{
	int b = mq_swz(q0);	// = q0 ^ key; float4 q0 + i is at b ^ i

#pragma unroll
	for (int i = 0; i < MQ_VPC(F) / 4; i++) {
		float4 a = mq_quad<F>(w0, i), c = mq_quad<F>(w1, i), xv = s4[b ^ i];

		p0 = fmaf(a.x, xv.x, p0);
		p0 = fmaf(a.y, xv.y, p0);
		p0 = fmaf(a.z, xv.z, p0);
		p0 = fmaf(a.w, xv.w, p0);
		p1 = fmaf(c.x, xv.x, p1);
		p1 = fmaf(c.y, xv.y, p1);
		p1 = fmaf(c.z, xv.z, p1);
		p1 = fmaf(c.w, xv.w, p1);
	}
}

}	// namespace

#endif
