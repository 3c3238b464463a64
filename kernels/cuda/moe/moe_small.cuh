// Device helpers of the small-batch MoE kernels (moe_small_gate_up.cu, moe_small.cu,
// moe_lat.cu):
// the plan each CTA rebuilds from the ids, the dot products, the L2 hints and the gate/up
// segment. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_SMALL_CUH
#define KD_KERNELS_CUDA_MOE_SMALL_CUH

#include <cstdint>

#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_quant.cuh"

#define SM_THREADS 256
#define SM_WARPS 8
#define SM_CTAS_PER_SM 2	// gate/up grid: one wave at this occupancy
#define SM_RP 4			// pairs per dot pass (accumulators per lane and row; 8 spills)
#define SM_KB 8			// 16-byte chunks per lane and weight row in flight (2048 values)
#define SM_DCOLS 8		// down: output columns per CTA (pairs of columns per item)
#define SM_X_SMEM_MAX (96 * 1024)	// gate/up: bytes of fp32 x rows per CTA
#define SM_DPREFETCH (128 * 1024)	// down: bytes asked of L2 per CTA before the wait
					// (times ~2 CTAs per SM: well inside the 50 MB L2)

namespace {	// each including file's own copy

// Which pairs i = m * top_k + j chose which expert, as each CTA rebuilds it.
struct small_plan {
	int n_used;				// distinct valid expert ids
	int n_valid;				// pairs with a valid id
	int id[MOE_SMALL_MAX_PAIRS];		// (n) the pair's expert, -1 outside [0, E)
	int first[MOE_SMALL_MAX_PAIRS];		// (n) 1 at the first pair of each expert
	int below[MOE_SMALL_MAX_PAIRS];		// (n) pairs with a smaller valid id
	int same[MOE_SMALL_MAX_PAIRS];		// (n) pairs with the same id
	int used_e[MOE_SMALL_MAX_PAIRS];	// (n_used) expert ids, increasing
	int used_start[MOE_SMALL_MAX_PAIRS];	// (n_used) first position in sorted
	int used_n[MOE_SMALL_MAX_PAIRS];	// (n_used) its number of pairs
	int sorted[MOE_SMALL_MAX_PAIRS];	// (n_valid) pairs by (expert id, pair)
};

// The plan from ids (n <= MOE_SMALL_MAX_PAIRS <= blockDim.x); the whole CTA calls it.
// O(n) per pair, which at n <= 64 is cheaper than a launch of its own. EARLY: called
// before the PDL wait by a down kernel, where ids are settled (written two launches
// back: see k_cuda_pdl_early); otherwise after it.
// PLAIN: ids in shared memory (moe_lat.cu's CTAs route for themselves), plain loads.
template <bool EARLY = false, bool PLAIN = false>
__device__ void small_plan_build(small_plan &sp, const int32_t *ids, int n, int E)
{
	int i = threadIdx.x;

	if (i < n) {
		int v = PLAIN ? ids[i] : EARLY ? k_cuda_pdl_early(ids + i) : __ldcg(ids + i);

		sp.id[i] = v >= 0 && v < E ? v : -1;
	}
	__syncthreads();
	if (i < n) {
		int v = sp.id[i], below = 0, before = 0, same = 0;

		if (v >= 0) {
			for (int j = 0; j < n; j++) {
				int o = sp.id[j];

				below += o >= 0 && o < v;
				before += j < i && o == v;
				same += o == v;
			}
			sp.sorted[below + before] = i;
		}
		sp.first[i] = v >= 0 && before == 0;
		sp.below[i] = below;
		sp.same[i] = same;
	}
	__syncthreads();
	if (i < n && sp.first[i]) {
		int v = sp.id[i], rank = 0;

		for (int j = 0; j < n; j++)
			rank += sp.first[j] && sp.id[j] < v;
		sp.used_e[rank] = v;
		sp.used_start[rank] = sp.below[i];
		sp.used_n[rank] = sp.same[i];
	}
	if (i == 0) {
		int used = 0, valid = 0;

		for (int j = 0; j < n; j++) {
			used += sp.first[j];
			valid += sp.id[j] >= 0;
		}
		sp.n_used = used;
		sp.n_valid = valid;
	}
	__syncthreads();
}

// CTA b's share [lo, hi) of a gate/up kernel's rows: the used experts' n_used * inter
// (expert, feature) rows, then the shared expert's sh_inter, cut evenly across the grid.
__device__ __forceinline__ void gate_up_share(const small_plan &sp, int inter, int sh_inter,
					      long long &Wr, long long &lo, long long &hi)
{
	long long W;

	Wr = (long long)sp.n_used * inter;
	W = Wr + sh_inter;
	lo = W * blockIdx.x / gridDim.x;
	hi = W * (blockIdx.x + 1) / gridDim.x;
}

__device__ __forceinline__ float warp_sum(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

// acc += the 8 bf16 weights of w times a (values 0-3) and b (values 4-7).
__device__ __forceinline__ void fma8(float &acc, uint4 w, float4 a, float4 b)
{
	acc = fmaf(__uint_as_float(w.x << 16), a.x, acc);
	acc = fmaf(__uint_as_float(w.x & 0xffff0000u), a.y, acc);
	acc = fmaf(__uint_as_float(w.y << 16), a.z, acc);
	acc = fmaf(__uint_as_float(w.y & 0xffff0000u), a.w, acc);
	acc = fmaf(__uint_as_float(w.z << 16), b.x, acc);
	acc = fmaf(__uint_as_float(w.z & 0xffff0000u), b.y, acc);
	acc = fmaf(__uint_as_float(w.w << 16), b.z, acc);
	acc = fmaf(__uint_as_float(w.w & 0xffff0000u), b.w, acc);
}

// The lane's share of two weight rows (w0, w1: nc 16-byte chunks each; w1 may be
// absent) dotted with np <= SM_RP fp32 rows src + off[r] (nc * VPC / 4 float4 each,
// shared or global): acc0[r], acc1[r]. Lane takes chunks lane, lane + 32, ...; the loads
// of SM_KB chunks per row are issued before any is used. 32-bit offsets, not pointers:
// registers are what limits the loads in flight. F: the rows' format; quantized (r0,
// r1: their scales), each chunk's values dot each row into a partial sum that the
// chunk's scale multiplies once. SWZ (quantized): src is rows staged swizzled (mq_swz;
// each off[r] a multiple of 8), as gate_up_segment stages x.
template <int F = MQ_BF16, bool SWZ = false>
__device__ __forceinline__ void dot2_rows(const uint4 *w0, const uint4 *w1, int nc,
					  const float4 *src, const int *off, int np, float *acc0,
					  float *acc1, int lane, mq_row r0 = {}, mq_row r1 = {})
{
	const uint4 zero = make_uint4(0, 0, 0, 0);
	constexpr int Q4 = MQ_VPC(F) / 4;	// float4 of x per chunk
	// chunks per lane and row in flight: quantized chunks hold 2-4x the values and
	// their scales ride along, so half as many fit the registers (no spills)
	constexpr int KB = F == MQ_BF16 ? SM_KB : SM_KB / 2;

#pragma unroll
	for (int r = 0; r < SM_RP; r++)
		acc0[r] = acc1[r] = 0.0f;
	for (int c0 = 0; c0 < nc; c0 += 32 * KB) {
		uint4 wa[KB], wb[KB];
		float sa[KB], sb[KB];	// quantized: the chunks' scales, loaded beside

#pragma unroll
		for (int b = 0; b < KB; b++) {
			int c = c0 + 32 * b + lane;

			wa[b] = c < nc ? __ldcs(w0 + c) : zero;
			wb[b] = c < nc && w1 ? __ldcs(w1 + c) : zero;
			if (F != MQ_BF16) {
				sa[b] = c < nc ? mq_scale(r0, c * MQ_VPC(F)) : 0.0f;
				sb[b] = c < nc ? mq_scale(r1, c * MQ_VPC(F)) : 0.0f;
			}
		}
#pragma unroll
		for (int b = 0; b < KB; b++) {
			int c = c0 + 32 * b + lane;

			if (c >= nc)
				break;
			if (F == MQ_BF16) {
#pragma unroll
				for (int r = 0; r < SM_RP; r++) {
					float4 lo, hi;

					if (r >= np)
						break;
					lo = src[off[r] + 2 * c];
					hi = src[off[r] + 2 * c + 1];
					fma8(acc0[r], wa[b], lo, hi);
					fma8(acc1[r], wb[b], lo, hi);
				}
			} else {
				float s0 = sa[b], s1 = sb[b];
				float p0[SM_RP], p1[SM_RP];	// the chunk's partial sums

#pragma unroll
				for (int r = 0; r < SM_RP; r++)
					p0[r] = p1[r] = 0.0f;
				// Four values of each row at a time (few registers: the loads in
				// flight hold them), each against every pair.
#pragma unroll
				for (int i = 0; i < Q4; i++) {
					float4 va = mq_quad<F>(wa[b], i), vb = mq_quad<F>(wb[b], i);

#pragma unroll
					for (int r = 0; r < SM_RP; r++) {
						if (r >= np)
							break;
						float4 xv = SWZ ? src[mq_swz(off[r] + Q4 * c) ^ i]
								: src[off[r] + Q4 * c + i];

						p0[r] = fmaf(va.x, xv.x, p0[r]);
						p0[r] = fmaf(va.y, xv.y, p0[r]);
						p0[r] = fmaf(va.z, xv.z, p0[r]);
						p0[r] = fmaf(va.w, xv.w, p0[r]);
						p1[r] = fmaf(vb.x, xv.x, p1[r]);
						p1[r] = fmaf(vb.y, xv.y, p1[r]);
						p1[r] = fmaf(vb.z, xv.z, p1[r]);
						p1[r] = fmaf(vb.w, xv.w, p1[r]);
					}
				}
#pragma unroll
				for (int r = 0; r < SM_RP; r++) {
					if (r >= np)
						break;
					acc0[r] = fmaf(p0[r], s0, acc0[r]);
					acc1[r] = fmaf(p1[r], s1, acc1[r]);
				}
			}
		}
	}
}

__device__ __forceinline__ float silu_mul(float g, float u)
{
	return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// Speculative: asks L2 for bytes at p (one 128-byte line per lane step). A hint only,
// never a fault, so it may use values that are not final yet.
__device__ __forceinline__ void prefetch_l2(const void *p, size_t bytes, int lane, int step)
{
	for (size_t o = (size_t)lane * 128; o < bytes; o += (size_t)step * 128)
		asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + o));
}

// Launched early under PDL, while the router still picks the experts: the shared
// expert's rows do not depend on its choice, so each CTA asks L2 for its share of
// them before the wait and the route kernel's time hides their fetch. Only a hint:
// whichever CTA takes a row after the wait finds it in L2. The whole CTA calls it.
__device__ __forceinline__ void prefetch_shared_gate_up(const moe_small_shared &sh, int hidden)
{
	if (sh.inter) {
		int a = (int)((long long)sh.inter * blockIdx.x / gridDim.x);
		int b = (int)((long long)sh.inter * (blockIdx.x + 1) / gridDim.x);

		prefetch_l2(sh.gate + (size_t)a * hidden, (size_t)(b - a) * hidden * 2, threadIdx.x,
			    SM_THREADS);
		prefetch_l2(sh.up + (size_t)a * hidden, (size_t)(b - a) * hidden * 2, threadIdx.x,
			    SM_THREADS);
	}
}

// Asks L2 for the CTA's SM_DCOLS down rows of row_bytes each at down (row stride
// row_bytes); the whole CTA calls it, before the PDL wait.
__device__ __forceinline__ void prefetch_down_rows(const uint16_t *down, int c0, int hidden,
						   size_t row_bytes)
{
	int lines = (int)((row_bytes + 127) / 128);

	for (int q = threadIdx.x; q < SM_DCOLS * lines; q += SM_THREADS) {
		int col = c0 + q / lines;

		if (col < hidden)
			prefetch_l2((const char *)down + (size_t)col * row_bytes +
					    (size_t)(q % lines) * 128, 1, 0, 1);
	}
}

// The down kernels' hint before the PDL wait: the ids may come from the kernel before
// the previous one, so ask L2 for the CTA's down rows (columns c0 ..) that they name
// while gate/up drains, up to a budget that keeps them there until used; the shared
// expert's rows first, as they do not depend on the ids. Only a hint: the plan is
// built after the wait. Each pair's matrix is looked up once (id, then table: two
// round trips for the CTA, not two per loop iteration) into pre_w (shared, n entries).
// The whole CTA calls it.
// row_bytes: a down row's (inter values in the experts' format).
__device__ __forceinline__ void prefetch_down_before_wait(const uint16_t *const *expert_w,
							  const int32_t *ids, int n, int E,
							  const moe_small_shared &sh, int c0,
							  int hidden, size_t row_bytes,
							  const uint16_t **pre_w)
{
	size_t sh_bytes = (size_t)sh.inter * 2 * SM_DCOLS;
	int lines = (int)((row_bytes + 127) / 128);
	size_t left = SM_DPREFETCH > sh_bytes ? SM_DPREFETCH - sh_bytes : 0;
	int pairs = min(n, (int)(left / (row_bytes * SM_DCOLS)));

	if (sh.inter)
		prefetch_down_rows(sh.down, c0, hidden, (size_t)sh.inter * 2);
	if (threadIdx.x < pairs) {
		int v = k_cuda_pdl_early(ids + threadIdx.x);	// settled (see the plan)

		pre_w[threadIdx.x] = v >= 0 && v < E ? k_cuda_pdl_early(expert_w + 3 * v + 2) : nullptr;
	}
	__syncthreads();
	for (int q = threadIdx.x; q < pairs * SM_DCOLS * lines; q += SM_THREADS) {
		int i = q / (SM_DCOLS * lines), col = c0 + q / lines % SM_DCOLS;
		const uint16_t *w = pre_w[i];

		if (w && col < hidden)
			prefetch_l2((const char *)w + (size_t)col * row_bytes +
					    (size_t)(q % lines) * 128, 1, 0, 1);
	}
}

// Features [fa, fb) of one slot's gate and up (inter, hidden): stage up to rp of its
// total pairs' x rows (all of them unless a row repeats the expert or the budget is
// small), then per feature dot them SM_RP at a time (a second group re-reads the two
// weight rows just fetched, from L1/L2). Pair p is i = pairs[p] (pairs NULL: i = p),
// of x row i / top_k, its activations act row i. F: gate and up's format (quantized:
// wq and their scales sg, su). The whole CTA calls it.
template <int F = MQ_BF16>
__device__ void gate_up_segment(float4 *xs4, const uint16_t *gate, const uint16_t *up,
				const int *pairs, int total, int fa, int fb, const float *x,
				int top_k, int hidden, int inter, int rp, float *act,
				const moe_wq &wq = {}, const void *sg = nullptr,
				const void *su = nullptr)
{
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nc = hidden / MQ_VPC(F);
	int q4 = hidden / 4;
	size_t rb = (size_t)nc * 16;	// bytes of a row
	const uint4 *g4 = (const uint4 *)gate, *u4 = (const uint4 *)up;

	// The first rows start coming while x is staged.
	if (fa + warp < fb) {
		prefetch_l2(g4 + (size_t)(fa + warp) * nc, rb, lane, 32);
		prefetch_l2(u4 + (size_t)(fa + warp) * nc, rb, lane, 32);
	}
	for (int p0 = 0; p0 < total; p0 += rp) {
		int ns = min(rp, total - p0);

		__syncthreads();	// the last rows are done with xs4
		for (int q = threadIdx.x; q < ns * q4; q += SM_THREADS) {
			int r = q / q4, c = q % q4, i = pairs ? pairs[p0 + r] : p0 + r;

			// quantized: swizzled (mq_swz), rows start at multiples of 8 float4
			xs4[F == MQ_BF16 ? q : mq_swz(q)] =
				((const float4 *)(x + (size_t)(i / top_k) * hidden))[c];
		}
		__syncthreads();

		for (int f = fa + warp; f < fb; f += SM_WARPS) {
			for (int g0 = 0; g0 < ns; g0 += SM_RP) {
				int np = min(SM_RP, ns - g0), off[SM_RP];
				float ag[SM_RP], au[SM_RP];

#pragma unroll
				for (int r = 0; r < SM_RP; r++)
					off[r] = (g0 + min(r, np - 1)) * q4;
				if (F == MQ_BF16)
					dot2_rows(g4 + (size_t)f * nc, u4 + (size_t)f * nc, nc, xs4, off,
						  np, ag, au, lane);
				else
					dot2_rows<F, true>(g4 + (size_t)f * nc, u4 + (size_t)f * nc, nc, xs4,
						     off, np, ag, au, lane, mq_row_of(wq, sg, 0, f),
						     mq_row_of(wq, su, 1, f));
#pragma unroll
				for (int r = 0; r < SM_RP; r++) {
					float g, v;
					int p = p0 + g0 + r, i;

					if (r >= np)
						break;
					g = warp_sum(ag[r]);
					v = warp_sum(au[r]);
					i = pairs ? pairs[p] : p;
					if (lane == 0)
						act[(size_t)i * inter + f] = silu_mul(g, v);
				}
			}
		}
	}
}

}	// namespace

#endif
