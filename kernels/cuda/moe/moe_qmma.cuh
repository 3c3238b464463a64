// Quantized experts on the tensor cores at M = 1..8 rows (moe_qmma.cu): the split
// activations' layout, one k step of 16 weight rows against each pair's activations
// with mma.m16n8k16 (f16 in, fp32 accumulate), the groups of pairs. CUDA C++ only.
//
// The MMA (lane (g, t) = (lane / 4, lane % 4)): A = 16 weight rows (g and g + 8 of each
// lane), dequantized in registers from the stored bytes by quant_dequant.cuh (e4m3 and
// int4 - 8 are exact in f16). A "step" is 4 16-byte chunks of a row, one a lane of the
// quad (t = 0..3): lane t's k slots {2t, 2t + 1, 2t + 8, 2t + 9} of each MMA take values
// of its own chunk only, so every lane's products share one weight scale (a scale block
// holds whole chunks: moe_wq_vector). B's 8 columns are 4 groups x {hi, lo}: column 2t
// holds the f16 high part of the activations at lane t's k values, column 2t + 1 their
// f16 low part, zero at the other lanes' k values. So D[row][2t] + D[row][2t + 1] is
// the dot product of the row with the activations over lane t's chunk alone, and lane
// (g, t) holds exactly D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]: its own
// chunk's partial sums, which it scales in fp32 once (its weight scale times the
// activations' factor, below) into its accumulators. One pair a column group: an MMA
// does 16 rows x 4 values x 4 lanes, 1 of 4 of the tensor core's products useful (n8
// holds one pair's hi and lo for 4 chunks); the instructions still drop because one
// warp instruction does 256 weight values, against 8 FFMA a lane before.
//
// The activations (x of gate/up, SwiGLU outputs of down) as B: every 16 values scaled by
// a power of two f (the largest |value| then in [2^14, 2^15): no f16 overflow, the low
// part normal) and split into f16 hi + lo (22 bits of mantissa); 1 / f per 16 values
// beside (the lane multiplies its partial sums by it, exactly). Layout of a row of K
// values (K a multiple of 4 chunks): per step s, 8 blocks (t, h) = 2t + h of NU =
// VPC / 8 units of 16 bytes, each block the h part of chunk 4s + t in the order the
// MMAs take it (fp8: natural; int4: each 8 values as (0, 4), (1, 5), (2, 6), (3, 7), the
// pairs k_dq_i4x8_raw makes); units swizzled inside a block (mqm_unit) so that the 8
// lanes that load B (lane (g, g / 2): column g) hit 8 distinct bank groups in shared
// memory. 4 bytes a value, as fp32.
#ifndef KD_KERNELS_CUDA_MOE_QMMA_CUH
#define KD_KERNELS_CUDA_MOE_QMMA_CUH

#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>

#include "kernels/cuda/moe/moe_small.cuh"
#include "kernels/cuda/quant_dequant.cuh"

#define MQM_NPP 2		// pairs of one expert dotted per pass over its weights
#define MQM_CHUNKS 4		// chunks of a row per step (a quad's lanes)
#define MQM_FG 16		// values per activation factor

namespace {	// each including file's own copy

// c += a * b: m16n8k16, f16 in, fp32 accumulate.
__device__ __forceinline__ void mqm_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
				       uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
	    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Unit u (0 .. NU - 1) of block blk (= 2t + h) of step s in a split row (uint4 index).
template <int F>
__device__ __forceinline__ int mqm_unit(int s, int blk, int u)
{
	constexpr int NU = MQ_VPC(F) / 8;
	int key = F == MQ_INT4 ? (blk >> 1) & 3 : (blk >> 2) & 1;

	return (s * 8 + blk) * NU + (u ^ key);
}

// 8 values (natural order) scaled by f as the f16 h part (0 hi, 1 lo), packed in the
// MMAs' order (fp8 natural; int4 0, 4, 1, 5, 2, 6, 3, 7).
template <int F>
__device__ __forceinline__ uint4 mqm_pack8(const float *v, float f, int h)
{
	uint32_t w[4];

#pragma unroll
	for (int q = 0; q < 4; q++) {
		unsigned short p[2];

#pragma unroll
		for (int e = 0; e < 2; e++) {
			int pos = 2 * q + e, i = F == MQ_INT4 ? (pos >> 1) + 4 * (pos & 1) : pos;
			float x = v[i] * f;
			__half hi = __float2half_rn(x);
			__half o = h ? __float2half_rn(x - __half2float(hi)) : hi;

			p[e] = __half_as_ushort(o);
		}
		w[q] = p[0] | (uint32_t)p[1] << 16;
	}
	return make_uint4(w[0], w[1], w[2], w[3]);
}

// Values k0 .. k0 + 15 of a row (k0 a multiple of 16) into the split row (units) and
// its factors (fac: 1 / f per 16 values).
template <int F>
__device__ __forceinline__ void mqm_put16(uint4 *row, float *fac, int k0, const float (&v)[16])
{
	constexpr int VPC = MQ_VPC(F);
	float mx = 0.0f;
	int E, c = k0 / VPC, gh = k0 % VPC / 16;

#pragma unroll
	for (int i = 0; i < 16; i++)
		mx = fmaxf(mx, fabsf(v[i]));
	frexpf(mx, &E);		// mx < 2^E (0: E = 0)
	E = E < -110 ? -110 : E > 126 ? 126 : E;
#pragma unroll
	for (int h = 0; h < 2; h++)
#pragma unroll
		for (int uu = 0; uu < 2; uu++)
			row[mqm_unit<F>(c / 4, 2 * (c % 4) + h, 2 * gh + uu)] =
				mqm_pack8<F>(v + 8 * uu, __int_as_float((127 + 15 - E) << 23), h);
	fac[k0 / 16] = __int_as_float((127 - 15 + E) << 23);
}

// Where the pairs of a pass find their split activations (shared or global memory):
// pair p's split row at row + off[p] (units), its factors at fac + off[p] / 4 (a row of
// K values: K / 4 units, K / 16 factors).
struct mqm_bsrc {
	const uint4 *row;
	const float *fac;
	int off[MQM_NPP];
	int np;				// pairs, 1 .. MQM_NPP
};

// One step s of NMAT 16-row tiles against the np pairs of b: w[2 m], w[2 m + 1] the
// lane's chunks of tile m's rows g and g + 8, sc their scales; acc[p][2 m + r] += the
// lane's chunk's partial sum of row g + 8 r with pair p, scaled once. bu: the B units
// (kept between calls: only lane (g, g / 2) loads them, the others stay zero).
// GLOBAL: b's rows are in global memory (written by an earlier launch), else shared.
template <int F, int NMAT, bool GLOBAL>
__device__ __forceinline__ void mqm_step(const uint4 *w, const float *sc, int s, const mqm_bsrc &b,
					float (&acc)[MQM_NPP][2 * NMAT], uint4 (&bu)[MQM_NPP], int lane)
{
	constexpr int NG = MQ_VPC(F) / MQM_FG;	// factors a chunk (MMAs: 4 a factor)
	const int g = lane / 4, t = lane % 4;
	const bool loads = t == g / 2;		// the lane that holds B's column g

#pragma unroll
	for (int gr = 0; gr < NG; gr++) {
		float d[MQM_NPP][NMAT][4];

#pragma unroll
		for (int p = 0; p < MQM_NPP; p++)
#pragma unroll
			for (int m = 0; m < NMAT; m++)
#pragma unroll
				for (int i = 0; i < 4; i++)
					d[p][m][i] = 0.0f;
#pragma unroll
		for (int mp = 4 * gr; mp < 4 * gr + 4; mp += 2) {	// MMAs mp, mp + 1
			uint32_t a[2 * NMAT][4];	// per row: (a0|a2) of mp, then of mp + 1

#pragma unroll
			for (int r = 0; r < 2 * NMAT; r++) {
				if (F == MQ_FP8) {
					k_dq_e4m3x4(mq_word(w[r], mp), a[r][0], a[r][1]);
					k_dq_e4m3x4(mq_word(w[r], mp + 1), a[r][2], a[r][3]);
				} else {
					k_dq_i4x8_raw(mq_word(w[r], mp / 2), a[r]);
				}
			}
#pragma unroll
			for (int p = 0; p < MQM_NPP; p++) {
				if (p >= b.np)
					break;
				if (loads) {
					const uint4 *q = b.row + b.off[p] + mqm_unit<F>(s, g, mp / 2);

					bu[p] = GLOBAL ? __ldcg(q) : *q;
				}
#pragma unroll
				for (int m = 0; m < NMAT; m++) {
					mqm_mma(d[p][m], a[2 * m][0], a[2 * m + 1][0], a[2 * m][1],
					       a[2 * m + 1][1], bu[p].x, bu[p].y);
					mqm_mma(d[p][m], a[2 * m][2], a[2 * m + 1][2], a[2 * m][3],
					       a[2 * m + 1][3], bu[p].z, bu[p].w);
				}
			}
		}
#pragma unroll
		for (int p = 0; p < MQM_NPP; p++) {
			if (p >= b.np)
				break;
			const float *fp = b.fac + b.off[p] / 4 + (MQM_CHUNKS * s + t) * NG + gr;
			float f = GLOBAL ? __ldcg(fp) : *fp;

#pragma unroll
			for (int m = 0; m < NMAT; m++)
#pragma unroll
				for (int r = 0; r < 2; r++)
					acc[p][2 * m + r] = fmaf(__fadd_rn(d[p][m][2 * r], d[p][m][2 * r + 1]) * f,
								 sc[2 * m + r], acc[p][2 * m + r]);
		}
	}
}

// The passes of a call: used expert u's pairs (the plan's, in order) cut into groups of
// at most qp, in increasing u. At most MOE_SMALL_MAX_PAIRS.
struct mqm_groups {
	int n;
	int u[MOE_SMALL_MAX_PAIRS], p0[MOE_SMALL_MAX_PAIRS], np[MOE_SMALL_MAX_PAIRS];
};

// The whole CTA calls it after small_plan_build.
__device__ __forceinline__ void mqm_groups_build(mqm_groups &gr, const small_plan &sp, int qp)
{
	if (threadIdx.x == 0) {
		int n = 0;

		for (int u = 0; u < sp.n_used; u++)
			for (int p = 0; p < sp.used_n[u]; p += qp) {
				gr.u[n] = u;
				gr.p0[n] = p;
				gr.np[n] = min(qp, sp.used_n[u] - p);
				n++;
			}
		gr.n = n;
	}
	__syncthreads();
}

// Pair j of group q (its index i = m * top_k + slot).
__device__ __forceinline__ int mqm_pair(const mqm_groups &gr, const small_plan &sp, int q, int j)
{
	return sp.sorted[sp.used_start[gr.u[q]] + gr.p0[q] + j];
}

}	// namespace

#endif
