// The single-row (M = 1) gate/up of the small MoE path as device code: moe_small_m1.cu's
// kernel and moe_lat.cu's fused launch share it (each warp's weight rows a pipeline
// of register units, see moe_small_m1.cu). CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_SMALL_M1_CUH
#define KD_KERNELS_CUDA_MOE_SMALL_M1_CUH

#include <cstdint>

#include "kernels/cuda/moe/moe_small.cuh"

#define M1_UC 4		// 16-byte chunks per lane and row in one unit (2 KB of a row)
#define M1_UNIT (32 * M1_UC)	// chunks of a row in one unit
#define M1_ACT_SMEM_MAX (96 * 1024)	// down: bytes of staged activations per CTA
					// (two CTAs and their static arrays fit an SM)

namespace {	// each including file's own copy

// A row of nc chunks in units of ulen chunks each (a multiple of 32, at most M1_UNIT):
// as few units as M1_UNIT allows, evenly long where bal (a 176-chunk row: 96 + 80, not
// 128 + 48, so that the second unit keeps as many bytes in flight as the first).
__device__ __forceinline__ int unit_len(int nc, int bal)
{
	int nu = (nc + M1_UNIT - 1) / M1_UNIT;

	return bal ? ((nc + nu - 1) / nu + 31) / 32 * 32 : M1_UNIT;
}

// acc += the unit's weights w (chunks cb + 32 b + lane below ce) dotted with the fp32
// row at s4 (shared memory, VPC / 4 float4 per chunk). F: the rows' format (quantized:
// r0, r1 their scales; each chunk's partial sum scaled once).
template <int F = MQ_BF16>
__device__ __forceinline__ void unit_dot(float &acc0, float &acc1, const uint4 *w0,
					 const uint4 *w1, const float4 *s4, int cb, int ce, int lane,
					 const mq_row &r0 = {}, const mq_row &r1 = {})
{
#pragma unroll
	for (int b = 0; b < M1_UC; b++) {
		int c = cb + 32 * b + lane;

		if (c >= ce)
			break;
		if (F == MQ_BF16) {
			float4 lo = s4[2 * c], hi = s4[2 * c + 1];

			fma8(acc0, w0[b], lo, hi);
			fma8(acc1, w1[b], lo, hi);
		} else {
			const float4 *x4 = s4 + MQ_VPC(F) / 4 * c;

			acc0 = fmaf(mq_chunk_dot<F>(w0[b], x4, 0.0f), mq_scale(r0, c * MQ_VPC(F)), acc0);
			acc1 = fmaf(mq_chunk_dot<F>(w1[b], x4, 0.0f), mq_scale(r1, c * MQ_VPC(F)), acc1);
		}
	}
}

// The unit's chunks (cb + 32 b + lane below ce) of two weight rows into registers
// (zeros past ce).
// EARLY: issued before the PDL wait (weights: k_cuda_pdl_early).
template <bool EARLY = false>
__device__ __forceinline__ void unit_load(uint4 *w0, uint4 *w1, const uint4 *r0, const uint4 *r1,
					  int cb, int ce, int lane)
{
	const uint4 zero = make_uint4(0, 0, 0, 0);

#pragma unroll
	for (int b = 0; b < M1_UC; b++) {
		int c = cb + 32 * b + lane;

		w0[b] = c >= ce ? zero : EARLY ? k_cuda_pdl_early(r0 + c) : __ldcs(r0 + c);
		w1[b] = c >= ce ? zero : EARLY ? k_cuda_pdl_early(r1 + c) : __ldcs(r1 + c);
	}
}

// Quantized units: the scales of the unit's chunks of two rows (zeros past ce) into
// registers as its weights load, so that the dot products wait on no load of their
// own: their stored bits (mq_scale_raw), made floats where used (unit_dot_qs). EARLY:
// issued before the PDL wait.
template <int F, bool EARLY = false>
__device__ __forceinline__ void unit_scales(float (&s0)[M1_UC], float (&s1)[M1_UC],
					    const mq_row &r0, const mq_row &r1, int cb, int ce,
					    int lane)
{
#pragma unroll
	for (int b = 0; b < M1_UC; b++) {
		int c = cb + 32 * b + lane;

		s0[b] = c >= ce ? 0.0f : mq_scale_raw<EARLY>(r0, c * MQ_VPC(F));
		s1[b] = c >= ce ? 0.0f : mq_scale_raw<EARLY>(r1, c * MQ_VPC(F));
	}
}

// unit_dot of quantized rows with their chunks' scales in registers (unit_scales: the
// stored bits, bf16 ones where sbf16); the fp32 row starts at float4 base4 of the
// staged rows s4, which are swizzled (mq_swz; base4 a multiple of 8).
template <int F>
__device__ __forceinline__ void unit_dot_qs(float &acc0, float &acc1, const uint4 *w0,
					    const uint4 *w1, const float4 *s4, int base4, int cb,
					    int ce, int lane, const float (&s0)[M1_UC],
					    const float (&s1)[M1_UC], int sbf16)
{
#pragma unroll
	for (int b = 0; b < M1_UC; b++) {
		int c = cb + 32 * b + lane;
		float p0 = 0.0f, p1 = 0.0f;

		if (c >= ce)
			break;
		mq_chunk_dot2<F>(w0[b], w1[b], s4, base4 + MQ_VPC(F) / 4 * c, p0, p1);
		acc0 = fmaf(p0, mq_scale_cook(s0[b], sbf16), acc0);
		acc1 = fmaf(p1, mq_scale_cook(s1[b], sbf16), acc1);
	}
}

// The warp's units 0 .. K - 1 through two register buffers (a: even units, b: odd).
// unit_prime issues the first two (load(k, w0, w1)); the CTA may stage its shared rows
// meanwhile. unit_stream then consumes each unit (consume(k, w0, w1)), and its buffer
// at once takes the loads of the unit two on.
template <typename Load>
__device__ __forceinline__ void unit_prime(int K, uint4 (&a0)[M1_UC], uint4 (&a1)[M1_UC],
					   uint4 (&b0)[M1_UC], uint4 (&b1)[M1_UC], Load &load)
{
	if (K > 0)
		load(0, a0, a1);
	if (K > 1)
		load(1, b0, b1);
}

template <typename Load, typename Consume>
__device__ __forceinline__ void unit_stream(int K, uint4 (&a0)[M1_UC], uint4 (&a1)[M1_UC],
					    uint4 (&b0)[M1_UC], uint4 (&b1)[M1_UC], Load &load,
					    Consume &consume)
{
	for (int k = 0; k < K; k += 2) {	// warp-uniform
		consume(k, a0, a1);
		if (k + 2 < K)
			load(k + 2, a0, a1);
		if (k + 1 < K) {
			consume(k + 1, b0, b1);
			if (k + 3 < K)
				load(k + 3, b0, b1);
		}
	}
}

// Gate/up row pos of the CTA's share (the general kernel's order: used experts'
// features, then the shared expert's): its gate and up rows, and the used expert u
// (-1: the shared expert) with the feature f.
struct gu_row {
	const uint4 *g, *u;
	int used, f;
	mq_row sg, su;		// quantized: the rows' scales
};

// The used experts' gate and up matrices (and scales), looked up once a CTA into shared
// memory (gu_used_load): a unit's row then costs a shared-memory read, not a global
// load of its expert's pointer that its weight loads wait for (one round trip a unit,
// SASS of session 13).
struct gu_used {
	const uint16_t *g[MOE_SMALL_MAX_PAIRS], *u[MOE_SMALL_MAX_PAIRS];	// (n_used)
	const void *sg[MOE_SMALL_MAX_PAIRS], *su[MOE_SMALL_MAX_PAIRS];		// quantized
};

// The whole CTA calls it, after the plan; ends with a barrier.
template <int F = MQ_BF16>
__device__ __forceinline__ void gu_used_load(gu_used &pu, const small_plan &sp,
					     const uint16_t *const *expert_w, const moe_wq &wq)
{
	for (int i = threadIdx.x; i < sp.n_used; i += blockDim.x) {
		int e = sp.used_e[i];

		pu.g[i] = expert_w[3 * e];
		pu.u[i] = expert_w[3 * e + 1];
		if (F != MQ_BF16) {
			pu.sg[i] = wq.scales[3 * e];
			pu.su[i] = wq.scales[3 * e + 1];
		}
	}
	__syncthreads();
}

// F: the routed experts' format (quantized: wq; no shared expert then).
template <int F = MQ_BF16>
__device__ __forceinline__ gu_row gu_row_of(long long pos, long long Wr, const gu_used &pu,
					    const moe_wq &wq, const moe_small_shared &sh,
					    int hidden, int inter)
{
	gu_row r;

	if (pos < Wr) {
		int u = (int)(pos / inter), nc = hidden / MQ_VPC(F);

		r.used = u;
		r.f = (int)(pos % inter);
		r.g = (const uint4 *)pu.g[u] + (size_t)r.f * nc;
		r.u = (const uint4 *)pu.u[u] + (size_t)r.f * nc;
		if (F != MQ_BF16) {
			r.sg = mq_row_of(wq, pu.sg[u], 0, r.f);
			r.su = mq_row_of(wq, pu.su[u], 1, r.f);
		}
	} else {
		r.used = -1;
		r.f = (int)(pos - Wr);
		r.g = (const uint4 *)(sh.gate + (size_t)r.f * hidden);
		r.u = (const uint4 *)(sh.up + (size_t)r.f * hidden);
	}
	return r;
}

// m1_gate_up_kernel's work after the plan (also moe_lat.cu's at one row): the CTA's
// share of the (used expert, feature) rows and the shared expert's, each warp's rows
// a stream of units whose first loads go out before x row 0 is staged in xs4 (hidden
// fp32 of shared memory). act and sh.act as m1_gate_up_kernel's. F and wq: the routed
// experts' format (quantized: no shared expert). The whole CTA calls it.
template <int F = MQ_BF16>
__device__ __forceinline__ void m1_gate_up_body(const small_plan &sp,
						const uint16_t *const *expert_w, const float *x,
						int hidden, int inter, float *act,
						const moe_small_shared &sh, int bal, float4 *xs4,
						const moe_wq &wq = {})
{
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nc = hidden / MQ_VPC(F);
	int ul = unit_len(nc, bal), nu = (nc + ul - 1) / ul;
	long long Wr, lo, hi;
	int rows, K;
	__shared__ gu_used pu;

	gu_used_load<F>(pu, sp, expert_w, wq);
	gate_up_share(sp, inter, sh.inter, Wr, lo, hi);
	rows = (int)(hi - lo);
	K = warp < rows ? (rows - warp + SM_WARPS - 1) / SM_WARPS * nu : 0;	// warp's units

	// Unit k: chunks from (k % nu) * ul of the warp's row k / nu.
	auto row = [&](int k) {
		return gu_row_of<F>(lo + warp + (long long)SM_WARPS * (k / nu), Wr, pu, wq, sh,
				    hidden, inter);
	};
	auto load = [&](int k, uint4 *g, uint4 *u) {
		gu_row r = row(k);
		int cb = k % nu * ul;

		unit_load(g, u, r.g, r.u, cb, min(cb + ul, nc), lane);
	};
	uint4 ga[M1_UC], ua[M1_UC], gb[M1_UC], ub[M1_UC];
	float ag = 0.0f, au = 0.0f;
	// quantized: each buffer's scales (a: even units, b: odd), loaded with its weights
	float sga[M1_UC], sua[M1_UC], sgb[M1_UC], sub[M1_UC];
	auto load_q = [&](int k, uint4 *g, uint4 *u) {
		gu_row r = row(k);
		int cb = k % nu * ul, ce = min(cb + ul, nc);

		unit_load(g, u, r.g, r.u, cb, ce, lane);
		if (k & 1)
			unit_scales<F>(sgb, sub, r.sg, r.su, cb, ce, lane);
		else
			unit_scales<F>(sga, sua, r.sg, r.su, cb, ce, lane);
	};

	if (F != MQ_BF16)
		unit_prime(K, ga, ua, gb, ub, load_q);
	else
		unit_prime(K, ga, ua, gb, ub, load);
	for (int q = threadIdx.x; q < hidden / 4; q += SM_THREADS)
		xs4[F == MQ_BF16 ? q : mq_swz(q)] = ((const float4 *)x)[q];	// quantized: swizzled
	__syncthreads();

	// The unit's sums; at a row's last unit, silu(gate x) * up x to its pairs.
	auto consume = [&](int k, const uint4 *g, const uint4 *u) {
		int cb = k % nu * ul;

		if (F == MQ_BF16)
			unit_dot(ag, au, g, u, xs4, cb, min(cb + ul, nc), lane);
		else if (k & 1)
			unit_dot_qs<F>(ag, au, g, u, xs4, 0, cb, min(cb + ul, nc), lane, sgb, sub,
				       wq.sbf16);
		else
			unit_dot_qs<F>(ag, au, g, u, xs4, 0, cb, min(cb + ul, nc), lane, sga, sua,
				       wq.sbf16);
		if (k % nu == nu - 1) {
			gu_row r = row(k);
			float s0 = warp_sum(ag), s1 = warp_sum(au);

			if (lane == 0) {
				float v = silu_mul(s0, s1);

				if (r.used < 0) {
					sh.act[r.f] = v;
				} else {
					const int *pairs = sp.sorted + sp.used_start[r.used];

					for (int p = 0; p < sp.used_n[r.used]; p++)
						act[(size_t)pairs[p] * inter + r.f] = v;
				}
			}
			ag = au = 0.0f;
		}
	};
	if (F != MQ_BF16)
		unit_stream(K, ga, ua, gb, ub, load_q, consume);
	else
		unit_stream(K, ga, ua, gb, ub, load, consume);
}

}	// namespace

#endif
