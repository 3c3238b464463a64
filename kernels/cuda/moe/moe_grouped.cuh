// The grouped path's device arithmetic, shared by its two expert-GEMM kernels
// (moe_experts.cu's expert_mma_kernel, moe_qtile.cu's tile kernels):
// the split bf16 rows (hi + lo) that carry x and the SwiGLU activations, the bf16
// mma.sync, quantized values as exact bf16 pairs, and the SwiGLU of one feature.
// CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_GROUPED_CUH
#define KD_KERNELS_CUDA_MOE_GROUPED_CUH

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe/moe_quant.cuh"
#include "kernels/cuda/quant_dequant.cuh"

namespace {	// each including file's own copy

// bf16 round-to-nearest-even of f, as the low 16 bits (NaN kept quiet).
__device__ __forceinline__ uint32_t bf16_bits(float f)
{
	return k_cuda_bf16_rn(f);
}

// f = hi + lo in bf16: hi = bf16(f), lo = bf16(f - hi) (the difference is exact).
__device__ __forceinline__ void split1(float f, uint32_t &hi, uint32_t &lo)
{
	hi = bf16_bits(f);
	lo = bf16_bits(__fsub_rn(f, __uint_as_float(hi << 16)));
}

// split1 of a and b, as bf16 pairs (a low).
__device__ __forceinline__ void split2(float a, float b, uint32_t *hi, uint32_t *lo)
{
	uint32_t ha, la, hb, lb;

	split1(a, ha, la);
	split1(b, hb, lb);
	*hi = ha | (hb << 16);
	*lo = la | (lb << 16);
}

// Split layout of a row of K values (K % 8 == 0): per 8 values, 4 words of hi pairs then
// 4 words of lo pairs (32 bytes); element pair (2q, 2q+1) of chunk c sits in words
// c*8 + q and c*8 + 4 + q.
__device__ __forceinline__ void split_store(uint32_t *row, int pair, float a, float b)
{
	uint32_t hi, lo;
	int c = pair / 4, q = pair % 4;

	split2(a, b, &hi, &lo);
	row[c * 8 + q] = hi;
	row[c * 8 + 4 + q] = lo;
}

// c += a * b: m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma16816(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
					 uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
	    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The int4 tile kernels' order of a split chunk (moe_qtile.cu): value j of the 8 at
// position split_perm_pos(j), i.e. the chunk holds values 0 2 4 6 1 3 5 7, the order in
// which ex_int4_bf16x8_perm gives a word's pairs, so that each x pair meets its weights.
__device__ __forceinline__ int split_perm_pos(int j)
{
	return (j & 1) * 4 + (j >> 1);
}

// Value k of a split row (K values) on its own, at its chunk's position pos (j: natural,
// split_perm_pos(j): permuted), as split1 forms it.
__device__ __forceinline__ void split_store1(uint32_t *row, int k, int pos, float v)
{
	uint16_t *h = (uint16_t *)row + (size_t)(k >> 3) * 16;
	uint32_t hi, lo;

	split1(v, hi, lo);
	h[pos] = (uint16_t)hi;
	h[8 + pos] = (uint16_t)lo;
}

// Two floats that are exact in bf16 as one bf16 pair (low first): the high halves, one
// PRMT (the shift-and-mask form compiled to two instructions).
__device__ __forceinline__ uint32_t bf16_pair_exact(float2 f)
{
	return __byte_perm(__float_as_uint(f.x), __float_as_uint(f.y), 0x7632);
}

// Eight e4m3 bytes (v.x bytes 0..3 first) as four bf16 pairs in byte order, exactly
// (every e4m3 value is a bf16 number): one cvt to an f16 pair, two to fp32, one PRMT.
__device__ __forceinline__ uint4 ex_fp8_bf16x8(uint2 v)
{
	uint32_t h[4];
	uint4 o;

	k_dq_e4m3x4(v.x, h[0], h[1]);	// the word's halves by name: no shift
	k_dq_e4m3x4(v.y, h[2], h[3]);
	auto pair = [](uint32_t u) {
		__half2 x;

		memcpy(&x, &u, 4);
		return bf16_pair_exact(__half22float2(x));
	};
	o.x = pair(h[0]);
	o.y = pair(h[1]);
	o.z = pair(h[2]);
	o.w = pair(h[3]);
	return o;
}

// A word of eight int4 values (nibble p = value p + 8, low first) as four bf16 pairs:
// pair p holds values 2p, 2p + 1 (the nibbles of byte p), placed by one PRMT of v and
// v >> 4 (byte p of each) under the bf16 exponent of 128 by one LOP3 (128 + n is exact
// in bf16; the mask drops the other nibbles), less 136 in one bf16x2 subtraction
// (exact: -8..7). 13 operations a word.
__device__ __forceinline__ uint4 ex_int4_bf16x8(uint32_t v)
{
	const uint32_t hi = v >> 4;
	const __nv_bfloat162 off = __floats2bfloat162_rn(136.0f, 136.0f);
	uint32_t r[4];

#pragma unroll
	for (int p = 0; p < 4; p++) {
		uint32_t t = k_dq_lop3_and_or(__byte_perm(v, hi, p | ((4 + p) << 8)), 0x000f000fu,
					      0x43004300u);
		__nv_bfloat162 b = __hsub2(*(const __nv_bfloat162 *)&t, off);

		r[p] = *(const uint32_t *)&b;
	}
	return make_uint4(r[0], r[1], r[2], r[3]);
}

// ex_int4_bf16x8's values in the pairs (0, 2), (4, 6), (1, 3), (5, 7): each pair one PRMT
// of the even (v & 0x0f0f0f0f) or odd ((v >> 4) & 0x0f0f0f0f) nibbles, one per byte,
// against the bf16 exponent byte of 128 (the 0x43 of c43), less 136: 11 operations a
// word. The x it meets must be in split_perm_pos's order.
__device__ __forceinline__ uint4 ex_int4_bf16x8_perm(uint32_t v)
{
	const uint32_t c43 = 0x43434343u, lo = v & 0x0f0f0f0fu, hi = (v >> 4) & 0x0f0f0f0fu;
	const uint32_t t[4] = { __byte_perm(lo, c43, 0x4140), __byte_perm(lo, c43, 0x4342),
				__byte_perm(hi, c43, 0x4140), __byte_perm(hi, c43, 0x4342) };
	const __nv_bfloat162 off = __floats2bfloat162_rn(136.0f, 136.0f);
	uint32_t r[4];

#pragma unroll
	for (int p = 0; p < 4; p++) {
		__nv_bfloat162 b = __hsub2(*(const __nv_bfloat162 *)&t[p], off);

		r[p] = *(const uint32_t *)&b;
	}
	return make_uint4(r[0], r[1], r[2], r[3]);
}

// silu(g) * u as k_cpu_silu_mul rounds it: g / (1 + e^-g), then times u.
__device__ __forceinline__ float silu_mul1(float g, float u)
{
	return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

}	// namespace

#endif
