// The fragment arithmetic the quantized tensor-core kernels share (linear_qmma.cu's
// GEMV, linear_qtile.cu's tile kernel, linear_qgemv.cu's decode GEMV): their arguments,
// the formats' slab sizes, the f16 mma.sync, x rounded to f16 and the int4 layout of x
// in shared memory, scale reads, one slab of a warp's m16 tile against one n8 tile of x
// and the store of its accumulators; the values themselves into f16 pairs through
// kernels/cuda/quant_dequant.cuh.
// The k orders these imply are documented at the top of linear_qmma.cu.
#ifndef KD_KERNELS_CUDA_LINEAR_QFRAG_CUH
#define KD_KERNELS_CUDA_LINEAR_QFRAG_CUH

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/quant_dequant.cuh"
#include "kernels/quant.h"

// A launch's shape and quantization, as the kernels read them.
struct qf_args {
	int M, N, K;
	int KC;			// k per CTA: its K slice (a multiple of the kernel's stage)
	int row_bytes;		// bytes of a weight row
	int block_rows;
	int bc_shift;		// k >> bc_shift = scale column (31: one column)
	int scale_cols;
	int accumulate;
	int pdl;
};

// A lane takes 16 bytes of a row's 64-byte slab: fp8 16 k, int4 32 k (one group); K_Q_NONE
// (bf16 weights, linear_qgemv.cu only) 8 k.
template <int FMT> struct qm_fmt {
	static constexpr int SLAB = FMT == K_Q_INT4 ? 128 : FMT == K_Q_NONE ? 32 : 64;	// k a slab
	static constexpr int VPC = SLAB / 4;			// k per lane and slab
	static constexpr int VPB = FMT == K_Q_INT4 ? 2 : 1;	// values a byte (fp8, int4)

	// bytes of a row that hold its first k values (k a multiple of the lane's VPC)
	static __host__ __device__ __forceinline__ constexpr int bytes(int k)
	{
		return FMT == K_Q_NONE ? 2 * k : k / VPB;
	}
};

// c += a (m16 x k16, f16, row) b (k16 x n8, f16, col), fp32 accumulators.
static __device__ __forceinline__ void qm_mma(float (&c)[4], uint32_t a0, uint32_t a1,
					      uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
	    "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += a (m16 x k16, bf16, row) b (k16 x n8, bf16, col), fp32 accumulators.
static __device__ __forceinline__ void qm_mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1,
						   uint32_t a2, uint32_t a3, uint32_t b0,
						   uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
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

// The weight part of a tile kernel's stage (linear_qtile.cu, linear_qwgmma.cu): bytes
// [kb, kb + 64) of weight rows n0 .. n0 + ROWS - 1 into ws, row r at r * 64 (a quarter
// warp reading rows g and g + 1 of its fragments touches 32 different banks), by THREADS
// threads; zeros past N and past kb_end. EARLY: issued before the PDL wait.
template <int ROWS, int THREADS, bool EARLY>
static __device__ __forceinline__ void qf_load_w64(unsigned char *ws, const uint8_t *w,
						   const qf_args &a, int n0, int kb, int kb_end,
						   int tid)
{
	static_assert(ROWS * 4 % THREADS == 0, "whole 16-byte units a thread");
#pragma unroll
	for (int j = 0; j < ROWS * 4 / THREADS; j++) {
		const int i = tid + j * THREADS, r = i >> 2, c = i & 3, b = kb + 16 * c;
		const bool ok = n0 + r < a.N && b < kb_end;
		const uint8_t *src = ok ? w + (size_t)(n0 + r) * a.row_bytes + b : w;

		if (EARLY)
			k_cuda_pdl_early_cp16(ws + r * 64 + 16 * c, src, ok);
		else
			cp_async16(ws + r * 64 + 16 * c, src, ok);
	}
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

// x octet k 0..7 (a: k 0..3, b: k 4..7) rounded to f16, as one 16-byte unit; PERM
// (int4): stored as k 0 4 1 5 2 6 3 7, so that a lane's B registers are whole words.
template <bool PERM>
static __device__ __forceinline__ uint4 qm_pack_x8(const float4 &a, const float4 &b)
{
	uint4 o;

	if (PERM) {
		o.x = qm_pack_h2(a.x, b.x);
		o.y = qm_pack_h2(a.y, b.y);
		o.z = qm_pack_h2(a.z, b.z);
		o.w = qm_pack_h2(a.w, b.w);
	} else {
		o.x = qm_pack_h2(a.x, a.y);
		o.y = qm_pack_h2(a.z, a.w);
		o.z = qm_pack_h2(b.x, b.y);
		o.w = qm_pack_h2(b.z, b.w);
	}
	return o;
}

static __device__ __forceinline__ uint32_t qm_pack_b2(float lo, float hi)
{
	__nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
	uint32_t u;

	memcpy(&u, &h, 4);
	return u;
}

// x octet k 0..7 rounded to bf16 (round to nearest even, as the bf16 linear kinds round
// x), in k order: the x of bf16 weights.
static __device__ __forceinline__ uint4 qm_pack_x8_bf16(const float4 &a, const float4 &b)
{
	return make_uint4(qm_pack_b2(a.x, a.y), qm_pack_b2(a.z, a.w), qm_pack_b2(b.x, b.y),
			  qm_pack_b2(b.z, b.w));
}

template <typename ST>
static __device__ __forceinline__ float qm_scale(const ST *s, size_t i)
{
	if constexpr (std::is_same<ST, __nv_bfloat16>::value)	// the MoE experts' scales
		return __bfloat162float(__ldg((const __nv_bfloat16 *)s + i));
	else if constexpr (sizeof(ST) == 2)
		return __half2float(__ldg((const __half *)s + i));
	else
		return __ldg((const float *)s + i);
}

// qm_scale in two halves, for a scale loaded stages ahead of its use (linear_qstream.cuh's
// RAW): the load's raw bits now, in a float register as they are (2-byte scales
// zero-extended), and the conversion at the use. A 2-byte scale converted at its load
// makes the warp wait there for the load (ncu, session 29: the int4 union GEMV's
// bf16 -> f32 shifts held ~10% of its stall samples). The same value as qm_scale.
template <typename ST>
static __device__ __forceinline__ float qm_scale_raw(const ST *s, size_t i)
{
	if constexpr (sizeof(ST) == 2)
		return __uint_as_float((unsigned)__ldg((const unsigned short *)s + i));
	else
		return __ldg((const float *)s + i);
}

template <typename ST>
static __device__ __forceinline__ float qm_scale_use(float raw)
{
	if constexpr (std::is_same<ST, __nv_bfloat16>::value)
		return __uint_as_float(__float_as_uint(raw) << 16);
	else if constexpr (sizeof(ST) == 2)
		return __half2float(__ushort_as_half((unsigned short)__float_as_uint(raw)));
	else
		return raw;
}

// One slab of the lane's two rows g and g + 8 (wa, wb: their 16 bytes; sa, sb: their
// scales), x row g: fp8 the slab's four MMAs into a temporary, scaled once in fp32; int4
// values scaled in f16 before the MMA (the lane's 32 k are one group), into acc; bf16
// (K_Q_NONE, no scales) two bf16 MMAs, the lane's 8 k of each row split 4 and 4: the
// MMA's k 2t, 2t+1, 2t+8, 2t+9 are the lane's k 0..3 of its 8, in the weights and in x
// alike (x unit t of the slab: x in k order, no permutation).
// xp: the lane's first 16-byte unit of x in this slab; sw: the int4 unit swizzle of
// the lane (qm_xunit: units 4t + q of a 16-unit slab sit at 4t + (q ^ sw)); xin: x row g
// exists (zeros otherwise).
template <int FMT>
static __device__ __forceinline__ void qm_slab(float (&acc)[4], const uint4 &wa, const uint4 &wb,
					       float sa, float sb, const uint4 *xp, int sw, bool xin)
{
	if (FMT == K_Q_NONE) {
		const uint4 xq = xin ? xp[0] : make_uint4(0, 0, 0, 0);

		qm_mma_bf16(acc, wa.x, wb.x, wa.y, wb.y, xq.x, xq.y);
		qm_mma_bf16(acc, wa.z, wb.z, wa.w, wb.w, xq.z, xq.w);
	} else if (FMT == K_Q_FP8) {
		float tmp[4] = { 0.f, 0.f, 0.f, 0.f };
		const uint4 z = make_uint4(0, 0, 0, 0);
		const uint4 x0 = xin ? xp[0] : z, x1 = xin ? xp[1] : z;
		const uint32_t wa_[4] = { wa.x, wa.y, wa.z, wa.w }, wb_[4] = { wb.x, wb.y, wb.z, wb.w };
		const uint32_t xw[8] = { x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w };

#pragma unroll
		for (int j = 0; j < 4; j++) {
			uint32_t a0, a1, a2, a3;

			qm_e4m3x4(wa_[j], a0, a2);
			qm_e4m3x4(wb_[j], a1, a3);
			qm_mma(tmp, a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1]);
		}
		acc[0] = fmaf(tmp[0], sa, acc[0]);
		acc[1] = fmaf(tmp[1], sa, acc[1]);
		acc[2] = fmaf(tmp[2], sb, acc[2]);
		acc[3] = fmaf(tmp[3], sb, acc[3]);
	} else {
		const __half2 ha = __float2half2_rn(sa), hb = __float2half2_rn(sb);
		const uint32_t wa_[4] = { wa.x, wa.y, wa.z, wa.w }, wb_[4] = { wb.x, wb.y, wb.z, wb.w };

#pragma unroll
		for (int q = 0; q < 4; q++) {
			const uint4 xq = xin ? xp[q ^ sw] : make_uint4(0, 0, 0, 0);
			uint32_t fa[4], fb[4];

			k_dq_i4x8(wa_[q], ha, fa);
			k_dq_i4x8(wb_[q], hb, fb);
			qm_mma(acc, fa[0], fb[0], fa[1], fb[1], xq.x, xq.y);
			qm_mma(acc, fa[2], fb[2], fa[3], fb[3], xq.z, xq.w);
		}
	}
}

// y (M, N) (+)= the accumulators of a warp's m16 tile (rows ra = row0 + g, rb = ra + 8)
// against NT n8 tiles of x, where K is not split: accumulator c of lane (g, t) and tile
// nt is x row 8 nt + 2t + (c & 1), weight row ra (c < 2) or rb.
template <int NT, typename A>
static __device__ __forceinline__ void qm_store_acc(float *y, const float (&acc)[NT][4],
						    const A &a, int ra, int rb, int t)
{
#pragma unroll
	for (int nt = 0; nt < NT; nt++) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int m = 8 * nt + 2 * t + (c & 1), n = c < 2 ? ra : rb;

			if (m < a.M && n < a.N) {
				float *p = y + (size_t)m * a.N + n;

				*p = a.accumulate ? *p + acc[nt][c] : acc[nt][c];
			}
		}
	}
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

// The arguments of a launch over K slices of KC k; unit: qm_bc_shift's (the caller has
// checked that the scales fit it).
static inline qf_args qf_make_args(const struct k_quant *q, int M, int N, int K, int KC,
				   int unit, int accumulate, int pdl)
{
	return qf_args{ M, N, K, KC, (int)k_quant_row_bytes(q->fmt, K), q->block_rows,
			qm_bc_shift(q, K, unit), (int)q->scale_cols, accumulate, pdl };
}

#endif
