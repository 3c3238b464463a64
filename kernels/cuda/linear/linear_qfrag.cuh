// The fragment arithmetic the quantized tensor-core kernels share (linear_qmma.cu's
// GEMV, linear_qtile.cu's tile kernel, linear_qgemv.cu's decode GEMV): the f16 mma.sync,
// the int4 layout of x in shared memory, scale reads; the values themselves into f16
// pairs through kernels/cuda/quant_dequant.cuh.
// The k orders these imply are documented at the top of linear_qmma.cu.
#ifndef KD_KERNELS_CUDA_LINEAR_QFRAG_CUH
#define KD_KERNELS_CUDA_LINEAR_QFRAG_CUH

#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>

#include "kernels/cuda/quant_dequant.cuh"
#include "kernels/quant.h"

// c += a (m16 x k16, f16, row) b (k16 x n8, f16, col), fp32 accumulators.
static __device__ __forceinline__ void qm_mma(float (&c)[4], uint32_t a0, uint32_t a1,
					      uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
	    "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes 0,1 and 2,3 of w (e4m3) as two f16 pairs, exactly; the low byte in the low half.
// int4 words: quant_dequant.cuh's k_dq_i4x8.
static __device__ __forceinline__ void qm_e4m3x4(uint32_t w, uint32_t &lo, uint32_t &hi)
{
	k_dq_e4m3x4(w, lo, hi);
}

// Index of the 16-byte unit holding x octet u of a row in shared memory: for int4, units
// 8..15 of every 16 swap halves so that the four lanes of a row (units 4t + q) fall in
// four different bank groups.
template <int FMT>
static __device__ __forceinline__ int qm_xunit(int u)
{
	return FMT == K_Q_INT4 ? u ^ (((u >> 3) & 1) << 1) : u;
}

static __device__ __forceinline__ uint32_t qm_pack_h2(float lo, float hi)
{
	__half2 h = __floats2half2_rn(lo, hi);
	uint32_t u;

	memcpy(&u, &h, 4);
	return u;
}

template <typename ST>
static __device__ __forceinline__ float qm_scale(const ST *s, size_t i)
{
	if constexpr (sizeof(ST) == 2)
		return __half2float(__ldg((const __half *)s + i));
	else
		return __ldg((const float *)s + i);
}

// ---- host ----------------------------------------------------------------------

static inline int qm_pow2_shift(int v)
{
	int s = 0;

	while ((1 << s) < v)
		s++;
	return (1 << s) == v ? s : -1;
}

// The shift that maps k to its scale column, or -1 where the scales do not fit the
// kernel: one column per `unit` k (fp8: a 64-k slab, or 128 for the streaming form's
// stage; int4: a lane's 32 k); powers of two, or one column for the row.
static inline int qm_bc_shift(const struct k_quant *q, int K, int unit)
{
	int sh;

	if (q->block_cols >= K)
		return 31;
	sh = qm_pow2_shift(q->block_cols);
	return sh >= 0 && q->block_cols % unit == 0 ? sh : -1;
}

#endif
