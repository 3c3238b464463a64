// Quantized weight values into f16 pairs in registers, for the tensor-core kernels that
// take W8A16 fp8 e4m3 and W4A16 int4 (kernels/quant.h's layouts): the linear kernels
// (linear/linear_qfrag.cuh) and, later, the MoE experts. Both conversions are exact
// before the scale; where a scale is applied here it rounds once, in f16.
#ifndef KD_KERNELS_CUDA_QUANT_DEQUANT_CUH
#define KD_KERNELS_CUDA_QUANT_DEQUANT_CUH

#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>

// Bytes 0,1 and 2,3 of w (e4m3) as two f16 pairs, exactly; the low byte in the low half.
// One cvt a pair.
static __device__ __forceinline__ void k_dq_e4m3x4(uint32_t w, uint32_t &lo, uint32_t &hi)
{
	asm("{\n\t.reg .b16 l, h;\n\t"
	    "mov.b32 {l, h}, %2;\n\t"
	    "cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
	    "cvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
	    : "=r"(lo), "=r"(hi)
	    : "r"(w));
}

// (w & mask) | bits in one instruction (immLut 0xea = (0xf0 & 0xcc) | 0xaa).
static __device__ __forceinline__ uint32_t k_dq_lop3_and_or(uint32_t w, uint32_t mask,
							     uint32_t bits)
{
	uint32_t r;

	asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "r"(mask), "r"(bits));
	return r;
}

// A word of eight int4 values (nibble p = value p, stored as value + 8, symmetric) as four
// f16 pairs nibble - 8, exactly: o[p] holds nibbles p (low half) and p + 4. The
// magic-number conversion: (w & 0x000f000f) | 0x64006400 is the pair 1024 + nibble
// (nibbles 0, 4), (w & 0x00f000f0) | 0x64006400 is 1024 + 16 nibble (nibbles 1, 5), the
// same of w >> 8 nibbles 2, 6 and 3, 7; one hsub2 (- 1032) or hfma2 (/ 16 - 72) makes
// nibble - 8 exactly. 9 operations a word (one lop3 and one hsub2 or hfma2 a pair, one
// shift). For kernels that scale later, in fp32 (moe/moe_qmma.cuh).
static __device__ __forceinline__ void k_dq_i4x8_raw(uint32_t w, uint32_t (&o)[4])
{
	const uint32_t lo = 0x000f000fu, hi = 0x00f000f0u, ex = 0x64006400u;
	const __half2 b1032 = __half2half2(__ushort_as_half((unsigned short)0x6408u));
	const __half2 r16 = __half2half2(__ushort_as_half((unsigned short)0x2c00u));	// 1/16
	const __half2 m72 = __half2half2(__ushort_as_half((unsigned short)0xd480u));	// -72
	const uint32_t w8 = w >> 8;
	const uint32_t v[4] = { k_dq_lop3_and_or(w, lo, ex), k_dq_lop3_and_or(w, hi, ex),
				k_dq_lop3_and_or(w8, lo, ex), k_dq_lop3_and_or(w8, hi, ex) };

#pragma unroll
	for (int p = 0; p < 4; p++) {
		__half2 h;

		memcpy(&h, &v[p], 4);
		h = p & 1 ? __hfma2(h, r16, m72) : __hsub2(h, b1032);
		memcpy(&o[p], &h, 4);
	}
}

// k_dq_i4x8_raw's pairs times s: (nibble - 8) * s, one hmul2 a pair rounding once to
// f16. 13 operations a word, against 15-21 for a shift, mask, or and subtract a pair.
static __device__ __forceinline__ void k_dq_i4x8(uint32_t w, __half2 s, uint32_t (&o)[4])
{
	k_dq_i4x8_raw(w, o);
#pragma unroll
	for (int p = 0; p < 4; p++) {
		__half2 h;

		memcpy(&h, &o[p], 4);
		h = __hmul2(h, s);
		memcpy(&o[p], &h, 4);
	}
}

#endif
