// The routed experts at small batch (M * top_k <= 64 (row, slot) pairs), where every
// kernel is latency-bound: two launches instead of plan, gate/up, down and combine.
//
// gate/up: one wave of CTAs shares the (used expert, feature) rows evenly; each CTA
// streams its rows of gate and up once with 16-byte loads against the fp32 x rows of
// the expert's pairs, and writes silu(gate x) * up x per pair. Staged (hidden <= 2048,
// the default): each warp has two features' rows in flight, one by cp.async into a
// shared-memory stage, one in registers, and reads x through L1; otherwise (or with
// KDEC_MOE_GATE_STAGED=0) one feature's rows in registers (SM_KB chunks per row and
// lane) against x rows staged in shared memory.
// down: a CTA owns SM_DCOLS output columns of every row; its warps dot the used
// experts' down rows of those columns with the pairs' activations (two items' rows in
// flight per warp, one by cp.async into shared memory, one into registers; rows
// longer than 2048 or KDEC_MOE_DOWN_STAGED=0: registers only), then it sums each
// row's pairs in increasing (expert id, pair) order, k_cpu_moe_experts's order, so no
// combine kernel is needed. Each CTA derives the plan (which pairs chose which expert)
// from the <= 64 ids itself, so no plan kernel either.
//
// The shared expert (DeepSeek; k_cuda_moe_experts_add) rides along as one more slot
// that every row takes with weight 1: gate/up shares its rows out with the routed
// ones, down cuts its rows into inter-long pieces as extra items, and its output and
// the residual join each row's sum last, the order of the separate ops.
//
// Precision: bf16 weights times fp32 x / activations, fp32 FMA accumulation: each dot
// product is one fixed order (lane's chunks, then a shuffle tree), independent of the
// other rows.
#include <cstdint>

#include "kernels/cuda/attn_ptx.cuh"
#include "kernels/cuda/k_cuda_moe.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe_internal.h"

#define SM_THREADS 256
#define SM_WARPS 8
#define SM_CTAS_PER_SM 2	// gate/up grid: one wave at this occupancy
#define SM_RP 4			// pairs per dot pass (accumulators per lane and row; 8 spills)
#define SM_KB 8			// 16-byte chunks per lane and weight row in flight (2048 values)
#define SM_DCOLS 8		// down: output columns per CTA (pairs of columns per item)
#define SM_X_SMEM_MAX (96 * 1024)	// gate/up: bytes of fp32 x rows per CTA
#define SM_DSTAGE_SMEM_MAX (64 * 1024)	// down, staged: bytes of weight stages per CTA
					// (two CTAs and their static arrays fit an SM)
#define SM_DPREFETCH (128 * 1024)	// down: bytes asked of L2 per CTA before the wait
					// (times ~2 CTAs per SM: well inside the 50 MB L2)

namespace {	// kernels and their helpers stay private to this file

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

// ---- kernels: helpers -----------------------------------------------------------

// The plan from ids (n <= MOE_SMALL_MAX_PAIRS <= blockDim.x); the whole CTA calls it.
// O(n) per pair, which at n <= 64 is cheaper than a launch of its own.
__device__ void small_plan_build(small_plan &sp, const int32_t *ids, int n, int E)
{
	int i = threadIdx.x;

	if (i < n) {
		int v = ids[i];

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
// absent) dotted with np <= SM_RP fp32 rows src + off[r] (2 * nc float4 each, shared
// or global): acc0[r], acc1[r]. Lane takes chunks lane, lane + 32, ...; the loads of
// SM_KB chunks per row are issued before any is used. 32-bit offsets, not pointers:
// registers are what limits the loads in flight.
__device__ __forceinline__ void dot2_rows(const uint4 *w0, const uint4 *w1, int nc,
					  const float4 *src, const int *off, int np, float *acc0,
					  float *acc1, int lane)
{
	const uint4 zero = make_uint4(0, 0, 0, 0);

#pragma unroll
	for (int r = 0; r < SM_RP; r++)
		acc0[r] = acc1[r] = 0.0f;
	for (int c0 = 0; c0 < nc; c0 += 32 * SM_KB) {
		uint4 wa[SM_KB], wb[SM_KB];

#pragma unroll
		for (int b = 0; b < SM_KB; b++) {
			int c = c0 + 32 * b + lane;

			wa[b] = c < nc ? __ldcs(w0 + c) : zero;
			wb[b] = c < nc && w1 ? __ldcs(w1 + c) : zero;
		}
#pragma unroll
		for (int b = 0; b < SM_KB; b++) {
			int c = c0 + 32 * b + lane;

			if (c >= nc)
				break;
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

// ---- kernels ------------------------------------------------------------------------

// Features [fa, fb) of one slot's gate and up (inter, hidden): stage up to rp of its
// total pairs' x rows (all of them unless a row repeats the expert or the budget is
// small), then per feature dot them SM_RP at a time (a second group re-reads the two
// weight rows just fetched, from L1/L2). Pair p is i = pairs[p] (pairs NULL: i = p),
// of x row i / top_k, its activations act row i. The whole CTA calls it.
__device__ void gate_up_segment(float4 *xs4, const uint16_t *gate, const uint16_t *up,
				const int *pairs, int total, int fa, int fb, const float *x,
				int top_k, int hidden, int inter, int rp, float *act)
{
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nc = hidden / 8, q4 = hidden / 4;

	if (fa + warp < fb) {	// the first rows start coming while x is staged
		prefetch_l2(gate + (size_t)(fa + warp) * hidden, (size_t)hidden * 2, lane, 32);
		prefetch_l2(up + (size_t)(fa + warp) * hidden, (size_t)hidden * 2, lane, 32);
	}
	for (int p0 = 0; p0 < total; p0 += rp) {
		int ns = min(rp, total - p0);

		__syncthreads();	// the last rows are done with xs4
		for (int q = threadIdx.x; q < ns * q4; q += SM_THREADS) {
			int r = q / q4, c = q % q4, i = pairs ? pairs[p0 + r] : p0 + r;

			xs4[q] = ((const float4 *)(x + (size_t)(i / top_k) * hidden))[c];
		}
		__syncthreads();

		for (int f = fa + warp; f < fb; f += SM_WARPS)
			for (int g0 = 0; g0 < ns; g0 += SM_RP) {
				int np = min(SM_RP, ns - g0), off[SM_RP];
				float ag[SM_RP], au[SM_RP];

#pragma unroll
				for (int r = 0; r < SM_RP; r++)
					off[r] = (g0 + min(r, np - 1)) * q4;
				dot2_rows((const uint4 *)(gate + (size_t)f * hidden),
					  (const uint4 *)(up + (size_t)f * hidden), nc, xs4, off, np,
					  ag, au, lane);
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

// One wave of CTAs shares the n_used * inter (expert, feature) rows, then the shared
// expert's sh.inter (prefetched before the wait), evenly: CTA b takes [W b / G, W (b + 1) / G) of them in that
// order, at most a few slots. Dynamic shared memory: rp fp32 x rows of hidden. act
// (n, inter): silu(gate x) * up x of pair i at row i; sh.act (n / top_k, sh.inter):
// the shared expert's of row m at row m.
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_gate_up_kernel(const uint16_t *const *expert_w, const float *x, const int32_t *ids,
		     int n, int top_k, int E, int hidden, int inter, int rp, float *act,
		     moe_small_shared sh)
{
	extern __shared__ float4 xs4[];		// (rp, hidden / 4)
	__shared__ small_plan sp;
	long long Wr, W, lo, hi;

	prefetch_shared_gate_up(sh, hidden);
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	Wr = (long long)sp.n_used * inter;
	W = Wr + sh.inter;
	lo = W * blockIdx.x / gridDim.x;
	hi = W * (blockIdx.x + 1) / gridDim.x;
	for (long long pos = lo; pos < hi;) {	// CTA-uniform
		if (pos < Wr) {
			int u = (int)(pos / inter), fa = (int)(pos % inter), e = sp.used_e[u];
			int fb = (int)min((long long)inter, fa + (hi - pos));

			gate_up_segment(xs4, expert_w[3 * e], expert_w[3 * e + 1],
					sp.sorted + sp.used_start[u], sp.used_n[u], fa, fb, x, top_k,
					hidden, inter, rp, act);
			pos += fb - fa;
		} else {
			int fa = (int)(pos - Wr), fb = (int)min((long long)sh.inter, fa + (hi - pos));

			gate_up_segment(xs4, sh.gate, sh.up, nullptr, n / top_k, fa, fb, x, 1,
					hidden, sh.inter, rp, sh.act);
			pos += fb - fa;
		}
	}
}

// One item as its warp sees it: two weight rows w0 and w1 (nc chunks each) against
// total pairs' fp32 rows (pair p is i = pairs[p], or p where pairs is NULL; its row
// at src + (i / div) * ld4). Down: the two sums to dst[i * dst_ld] and the next;
// gate/up (w0 gate, w1 up): silu(gate) * up to dst[i * dst_ld].
struct dot_job {
	const uint4 *w0, *w1;
	const float4 *src;
	const int *pairs;
	float *dst;
	int nc, ld4, total, div, dst_ld;
};

// Item q of small_down_kernel's CTA: (used expert, column pair) below n_routed, then
// (shared piece, column pair). Every item's columns lie inside hidden (a multiple of
// SM_DCOLS: k_cuda_moe_small_fits). ys (MOE_SMALL_MAX_PAIRS, SM_DCOLS), yss
// (MOE_SMALL_SH_PIECES, MOE_SMALL_MAX_PAIRS, SM_DCOLS).
__device__ __forceinline__ dot_job down_job_of(int q, int n_routed, const small_plan &sp,
					       const uint16_t *const *expert_w, const float *act,
					       const moe_small_shared &sh, int M, int c0, int inter,
					       float *ys, float *yss)
{
	int cps = SM_DCOLS / 2, cp = q % cps, c = c0 + 2 * cp;
	dot_job j;

	j.div = 1;
	j.dst_ld = SM_DCOLS;
	if (q < n_routed) {
		int u = q / cps;
		const uint16_t *w = expert_w[3 * sp.used_e[u] + 2] + (size_t)c * inter;

		j.w0 = (const uint4 *)w;
		j.w1 = (const uint4 *)(w + inter);
		j.src = (const float4 *)act;
		j.pairs = sp.sorted + sp.used_start[u];
		j.dst = ys + 2 * cp;
		j.nc = inter / 8;
		j.ld4 = inter / 4;
		j.total = sp.used_n[u];
	} else {
		int k = (q - n_routed) / cps, ka = k * inter;	// piece k: [ka, ka + inter)
		const uint16_t *w = sh.down + (size_t)c * sh.inter + ka;

		j.w0 = (const uint4 *)w;
		j.w1 = (const uint4 *)(w + sh.inter);
		j.src = (const float4 *)(sh.act + ka);
		j.pairs = nullptr;
		j.dst = yss + k * MOE_SMALL_MAX_PAIRS * SM_DCOLS + 2 * cp;
		j.nc = min(inter, sh.inter - ka) / 8;
		j.ld4 = sh.inter / 4;
		j.total = M;
	}
	return j;
}

// Row pos of the staged gate/up kernel's (slot, feature) order: feature pos % inter
// of used expert pos / inter below Wr = n_used * inter, then the shared expert's
// feature pos - Wr. x (n / top_k, hidden); act (n, inter), sh.act (n / top_k, sh.inter).
__device__ __forceinline__ dot_job gate_up_job_of(long long pos, long long Wr,
						  const small_plan &sp,
						  const uint16_t *const *expert_w, const float *x,
						  const moe_small_shared &sh, int n, int top_k,
						  int hidden, int inter, float *act)
{
	dot_job j;

	j.src = (const float4 *)x;
	j.nc = hidden / 8;
	j.ld4 = hidden / 4;
	if (pos < Wr) {
		int u = (int)(pos / inter), f = (int)(pos % inter), e = sp.used_e[u];

		j.w0 = (const uint4 *)(expert_w[3 * e] + (size_t)f * hidden);
		j.w1 = (const uint4 *)(expert_w[3 * e + 1] + (size_t)f * hidden);
		j.pairs = sp.sorted + sp.used_start[u];
		j.total = sp.used_n[u];
		j.div = top_k;
		j.dst = act + f;
		j.dst_ld = inter;
	} else {
		int f = (int)(pos - Wr);

		j.w0 = (const uint4 *)(sh.gate + (size_t)f * hidden);
		j.w1 = (const uint4 *)(sh.up + (size_t)f * hidden);
		j.pairs = nullptr;
		j.total = n / top_k;
		j.div = 1;
		j.dst = sh.act + f;
		j.dst_ld = sh.inter;
	}
	return j;
}

// The warp's sums per pair (acc0, acc1: lane partials) into the job's dst.
template <bool GATE>
__device__ __forceinline__ void job_store(const dot_job &j, int p0, int np, const float *acc0,
					  const float *acc1, int lane)
{
#pragma unroll
	for (int r = 0; r < SM_RP; r++) {
		float s0, s1;
		int i;

		if (r >= np)
			break;
		s0 = warp_sum(acc0[r]);
		s1 = warp_sum(acc1[r]);
		i = j.pairs ? j.pairs[p0 + r] : p0 + r;
		if (lane == 0 && GATE) {
			j.dst[(size_t)i * j.dst_ld] = silu_mul(s0, s1);
		} else if (lane == 0) {
			j.dst[i * j.dst_ld] = s0;
			j.dst[i * j.dst_ld + 1] = s1;
		}
	}
}

// The job's pair offsets p0 .. p0 + SM_RP - 1 (the last one repeated past np).
__device__ __forceinline__ void job_offsets(const dot_job &j, int p0, int np, int *off)
{
#pragma unroll
	for (int r = 0; r < SM_RP; r++) {	// row * ld4 < 64 * 4 * inter / 4: an int
		int p = p0 + min(r, np - 1);

		off[r] = (j.pairs ? j.pairs[p] : p) / j.div * j.ld4;
	}
}

// Registers only (the down kernel's register path): SM_KB chunks per lane and row
// at a time.
__device__ void down_job_run(const dot_job &j, int lane)
{
	for (int p0 = 0; p0 < j.total; p0 += SM_RP) {
		int np = min(SM_RP, j.total - p0), off[SM_RP];
		float a0[SM_RP], a1[SM_RP];

		job_offsets(j, p0, np, off);
		dot2_rows(j.w0, j.w1, j.nc, j.src, off, np, a0, a1, lane);
		job_store<false>(j, p0, np, a0, a1, lane);
	}
}

// The lane's chunks (c = lane, lane + 32, ...) of the job's two rows into registers,
// all of them (nc <= 32 * SM_KB: the staged predicates); they stay in flight until used.
__device__ __forceinline__ void job_load(const dot_job &j, uint4 *wa, uint4 *wb, int lane)
{
	const uint4 zero = make_uint4(0, 0, 0, 0);

#pragma unroll
	for (int b = 0; b < SM_KB; b++) {
		int c = 32 * b + lane;

		wa[b] = c < j.nc ? __ldcs(j.w0 + c) : zero;
		wb[b] = c < j.nc ? __ldcs(j.w1 + c) : zero;
	}
}

// The job against its weights in registers (job_load), every pass of SM_RP pairs
// from the same registers; chunks in dot2_rows's order, so the same sums bit for bit.
template <bool GATE>
__device__ __forceinline__ void job_run_loaded(const dot_job &j, const uint4 *wa, const uint4 *wb,
					       int lane)
{
	for (int p0 = 0; p0 < j.total; p0 += SM_RP) {
		int np = min(SM_RP, j.total - p0), off[SM_RP];
		float a0[SM_RP], a1[SM_RP];

		job_offsets(j, p0, np, off);
#pragma unroll
		for (int r = 0; r < SM_RP; r++)
			a0[r] = a1[r] = 0.0f;
#pragma unroll
		for (int b = 0; b < SM_KB; b++) {
			int c = 32 * b + lane;

			if (c >= j.nc)
				break;
#pragma unroll
			for (int r = 0; r < SM_RP; r++) {
				float4 lo, hi;

				if (r >= np)
					break;
				lo = j.src[off[r] + 2 * c];
				hi = j.src[off[r] + 2 * c + 1];
				fma8(a0[r], wa[b], lo, hi);
				fma8(a1[r], wb[b], lo, hi);
			}
		}
		job_store<GATE>(j, p0, np, a0, a1, lane);
	}
}

// Asynchronous copy: the lane's chunks (c = lane, lane + 32, ...) of both rows into
// stage (rows 0 and 1 at stage and stage + ncm). The lane alone reads them back
// (job_run_staged), so no barrier is needed between copy and use.
__device__ __forceinline__ void job_issue(const dot_job &j, uint4 *stage, int ncm, int lane)
{
	for (int c = lane; c < j.nc; c += 32) {
		cp_async16(stage + c, j.w0 + c, true);
		cp_async16(stage + ncm + c, j.w1 + c, true);
	}
}

// The job against its weights staged by job_issue; the lane's chunks in the order
// dot2_rows takes them, so the sums equal the register path's bit for bit.
template <bool GATE>
__device__ void job_run_staged(const dot_job &j, const uint4 *stage, int ncm, int lane)
{
	for (int p0 = 0; p0 < j.total; p0 += SM_RP) {
		int np = min(SM_RP, j.total - p0), off[SM_RP];
		float a0[SM_RP], a1[SM_RP];

		job_offsets(j, p0, np, off);
#pragma unroll
		for (int r = 0; r < SM_RP; r++)
			a0[r] = a1[r] = 0.0f;
		for (int c = lane; c < j.nc; c += 32) {
			uint4 wa = stage[c], wb = stage[ncm + c];

#pragma unroll
			for (int r = 0; r < SM_RP; r++) {
				float4 lo, hi;

				if (r >= np)
					break;
				lo = j.src[off[r] + 2 * c];
				hi = j.src[off[r] + 2 * c + 1];
				fma8(a0[r], wa, lo, hi);
				fma8(a1[r], wb, lo, hi);
			}
		}
		job_store<GATE>(j, p0, np, a0, a1, lane);
	}
}

// small_gate_up_kernel's work and grid, each warp with two rows in flight at a time
// like small_down_kernel's STAGED path: its items (the CTA's rows lo + warp, lo + warp
// + SM_WARPS, ...) alternate between a shared-memory stage (cp.async) and registers.
// x is read through L1 (M rows, every warp's), not staged, so the warps share nothing
// and the CTA needs no barrier after the plan. Dynamic shared memory: the stages,
// (SM_WARPS, 2, hidden / 8) uint4. Rows of at most 32 * SM_KB chunks.
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_gate_up_staged_kernel(const uint16_t *const *expert_w, const float *x, const int32_t *ids,
			    int n, int top_k, int E, int hidden, int inter, float *act,
			    moe_small_shared sh)
{
	extern __shared__ uint4 gstages[];	// (SM_WARPS, 2, hidden / 8)
	__shared__ small_plan sp;
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ncm = hidden / 8;
	uint4 *mine = gstages + (size_t)warp * 2 * ncm;	// the warp's stage: two rows
	long long Wr, W, lo, hi;
	int rows;

	prefetch_shared_gate_up(sh, hidden);
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	Wr = (long long)sp.n_used * inter;
	W = Wr + sh.inter;
	lo = W * blockIdx.x / gridDim.x;
	hi = W * (blockIdx.x + 1) / gridDim.x;
	rows = (int)(hi - lo);

	if (warp < rows)
		job_issue(gate_up_job_of(lo + warp, Wr, sp, expert_w, x, sh, n, top_k, hidden, inter,
					 act),
			  mine, ncm, lane);
	cp_async_commit();
	for (int t = warp; t < rows; t += 2 * SM_WARPS) {	// warp-uniform
		bool odd = t + SM_WARPS < rows;
		uint4 wa[SM_KB], wb[SM_KB];

		if (odd)
			job_load(gate_up_job_of(lo + t + SM_WARPS, Wr, sp, expert_w, x, sh, n, top_k,
						hidden, inter, act),
				 wa, wb, lane);
		cp_async_wait<0>();	// row t's gate and up are in the stage
		job_run_staged<true>(gate_up_job_of(lo + t, Wr, sp, expert_w, x, sh, n, top_k,
						    hidden, inter, act),
				     mine, ncm, lane);
		if (t + 2 * SM_WARPS < rows)	// the stage is free again
			job_issue(gate_up_job_of(lo + t + 2 * SM_WARPS, Wr, sp, expert_w, x, sh, n,
						 top_k, hidden, inter, act),
				  mine, ncm, lane);
		cp_async_commit();
		if (odd)
			job_run_loaded<true>(gate_up_job_of(lo + t + SM_WARPS, Wr, sp, expert_w, x, sh,
							    n, top_k, hidden, inter, act),
					     wa, wb, lane);
	}
	cp_async_wait<0>();
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

// Grid (hidden / SM_DCOLS). The CTA's items go round the warps: (used expert, column
// pair), expert-major so that warps share the pairs' activations in L1, then (shared
// piece, column pair): the shared expert's rows cut into inter-long pieces, so that
// every item streams about as many bytes and the warps stay even. Each pair's dot
// product (a piece's) is one item's, so ys and yss need no reduction across warps.
// STAGED: each warp has a stage of dynamic shared memory (SM_WARPS * 2 * inter / 8
// uint4) besides its registers, so two of its items stream at once (see below): twice
// the bytes in flight of the register path, which loads an item's rows only after the
// last item's arithmetic and holds one item at a time.
// add 0: out (M, hidden) overwritten, rows without a valid pair included (zeros);
// add 1: out += (routed sum + shared expert), the separate ops' order.
template <bool STAGED>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_down_kernel(const uint16_t *const *expert_w, const float *act, const int32_t *ids,
		  const float *weights, int M, int top_k, int E, int hidden, int inter,
		  moe_small_shared sh, int add, float *out)
{
	extern __shared__ uint4 stages[];	// STAGED: (SM_WARPS, 2, inter / 8)
	__shared__ small_plan sp;
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// pair's expert output
	__shared__ float yss[MOE_SMALL_SH_PIECES][MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// row's
								// shared-expert pieces
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];		// pair's routing weight
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = M * top_k;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, n_routed, n_all;
	size_t row_bytes = (size_t)inter * 2, sh_bytes = (size_t)sh.inter * 2 * SM_DCOLS;

	// Launched early under PDL: the ids may come from the kernel before the previous
	// one, so ask L2 for the down rows they name while gate/up drains, up to a budget
	// that keeps them there until used; the shared expert's rows first, as they do not
	// depend on the ids. Only a hint: the plan is built after the wait.
	if (sh.inter)
		prefetch_down_rows(sh.down, c0, hidden, (size_t)sh.inter * 2);
	{
		int lines = (int)((row_bytes + 127) / 128);
		size_t left = SM_DPREFETCH > sh_bytes ? SM_DPREFETCH - sh_bytes : 0;
		int pairs = min(n, (int)(left / (row_bytes * SM_DCOLS)));

		for (int q = threadIdx.x; q < pairs * SM_DCOLS * lines; q += SM_THREADS) {
			int i = q / (SM_DCOLS * lines), col = c0 + q / lines % SM_DCOLS;
			int v = __ldcg(ids + i);

			if (v >= 0 && v < E && col < hidden)
				prefetch_l2((const char *)(expert_w[3 * v + 2] + (size_t)col * inter) +
						    (size_t)(q % lines) * 128, 1, 0, 1);
		}
	}
	k_cuda_pdl_wait();
	if (threadIdx.x < n)
		sw[threadIdx.x] = weights[threadIdx.x];
	small_plan_build(sp, ids, n, E);	// its barriers publish sw too

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	if (STAGED) {
		// The warp's items alternate: even ones through its shared-memory stage
		// (cp.async), odd ones through registers, each in flight while the warp dots
		// the other, so two items' rows stream per warp.
		int ncm = inter / 8;
		uint4 *mine = stages + (size_t)warp * 2 * ncm;	// the warp's stage: two rows

		if (warp < n_all)
			job_issue(down_job_of(warp, n_routed, sp, expert_w, act, sh, M, c0,
						   inter, &ys[0][0], &yss[0][0][0]),
				       mine, ncm, lane);
		cp_async_commit();
		for (int q = warp; q < n_all; q += 2 * SM_WARPS) {	// warp-uniform
			bool odd = q + SM_WARPS < n_all;
			uint4 wa[SM_KB], wb[SM_KB];

			// Jobs are rebuilt where used (a few shared-memory reads), not held:
			// registers go to the odd item's rows.
			if (odd)
				job_load(down_job_of(q + SM_WARPS, n_routed, sp, expert_w, act, sh,
							  M, c0, inter, &ys[0][0], &yss[0][0][0]),
					      wa, wb, lane);
			cp_async_wait<0>();	// item q's rows are in the stage
			job_run_staged<false>(down_job_of(q, n_routed, sp, expert_w, act, sh, M, c0,
							inter, &ys[0][0], &yss[0][0][0]),
					    mine, ncm, lane);
			if (q + 2 * SM_WARPS < n_all)	// the stage is free again
				job_issue(down_job_of(q + 2 * SM_WARPS, n_routed, sp, expert_w,
							   act, sh, M, c0, inter, &ys[0][0],
							   &yss[0][0][0]),
					       mine, ncm, lane);
			cp_async_commit();
			if (odd)
				job_run_loaded<false>(down_job_of(q + SM_WARPS, n_routed, sp, expert_w,
								act, sh, M, c0, inter, &ys[0][0],
								&yss[0][0][0]),
						    wa, wb, lane);
		}
		cp_async_wait<0>();
	} else {
		for (int q = warp; q < n_all; q += SM_WARPS)
			down_job_run(down_job_of(q, n_routed, sp, expert_w, act, sh, M, c0, inter,
						 &ys[0][0], &yss[0][0][0]),
				     lane);
	}
	__syncthreads();

	// k_cpu_moe_experts's order: increasing expert id, then pair; products rounded.
	// Then the shared expert (its pieces in order) and the residual, as the ops add.
	for (int q = threadIdx.x; q < M * SM_DCOLS; q += SM_THREADS) {
		int m = q / SM_DCOLS, cc = q % SM_DCOLS;
		float acc = 0.0f;

		if (c0 + cc >= hidden)
			continue;
		for (int p = 0; p < sp.n_valid; p++) {
			int i = sp.sorted[p];

			if (i / top_k == m)
				acc = __fadd_rn(acc, __fmul_rn(ys[i][cc], sw[i]));
		}
		if (pieces) {
			float t = yss[0][m][cc];

			for (int k = 1; k < pieces; k++)
				t = __fadd_rn(t, yss[k][m][cc]);
			acc = __fadd_rn(acc, t);
		}
		if (add)
			acc = __fadd_rn(out[(size_t)m * hidden + c0 + cc], acc);
		out[(size_t)m * hidden + c0 + cc] = acc;
	}
}

}	// namespace

// ---- launchers ----------------------------------------------------------------------

bool k_cuda_moe_small_fits(int M, int top_k, int hidden, int inter, const float *x,
			   const struct k_cuda_moe_shared *sh)
{
	bool ok = M > 0 && top_k > 0 && (long)M * top_k <= MOE_SMALL_MAX_PAIRS &&
		  hidden % 8 == 0 && inter % 8 == 0 &&
		  (size_t)hidden * sizeof(float) <= SM_X_SMEM_MAX && (uintptr_t)x % 16 == 0;

	if (!ok || !sh)
		return ok;
	return sh->inter > 0 && sh->inter % 8 == 0 &&
	       sh->inter <= (long)MOE_SMALL_SH_PIECES * inter && (uintptr_t)sh->gate % 16 == 0 &&
	       (uintptr_t)sh->up % 16 == 0 && (uintptr_t)sh->down % 16 == 0;
}

// The staged kernels leave the L1 / shared-memory split to the driver, which sizes it
// for their occupancy (two CTAs per SM) and leaves the rest to L1 for x and act.
int k_cuda_moe_small_setup(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_X_SMEM_MAX)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_staged_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_DSTAGE_SMEM_MAX)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_down_kernel<true>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_DSTAGE_SMEM_MAX)) ? -EIO : 0;
}

// A staged kernel's weight stages for rows of len values, in bytes: SM_WARPS warps,
// 2 rows each.
static size_t stage_bytes(int len)
{
	return (size_t)SM_WARPS * 2 * (size_t)(len / 8) * sizeof(uint4);
}

// KDEC_MOE_GATE_STAGED, KDEC_MOE_DOWN_STAGED: 0 keeps that kernel's register-only
// path; -1: not read yet.
static int gate_staged = -1, down_staged = -1;

static bool env_on(int *v, const char *name)
{
	if (*v < 0) {
		const char *e = getenv(name);

		*v = !(e && e[0] == '0');
	}
	return *v != 0;
}

// Whether a kernel streams rows of len values through a shared-memory stage besides
// its registers: by default, where a row fits the lane's registers in one go
// (len <= 32 * SM_KB * 8 = 2048) and the stages fit their budget.
static bool use_staged(int *v, const char *name, int len)
{
	return env_on(v, name) && len / 8 <= 32 * SM_KB && stage_bytes(len) <= SM_DSTAGE_SMEM_MAX;
}

int k_cuda_moe_small_run(cudaStream_t s, float *act, float *out, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const uint16_t *const *expert_w, int n_experts, int hidden, int inter,
			 const struct moe_small_shared &sh, int add, int n_sm)
{
	int n = M * top_k, max_used = n < n_experts ? n : n_experts;
	// One wave at SM_CTAS_PER_SM, but no CTA with less than a feature per warp at the
	// most experts; staged x rows bounded by the rows an expert can get (router ids
	// are distinct per row; the shared expert has every row) and by the shared-memory
	// budget.
	long long most = (long long)max_used * ((inter + SM_WARPS - 1) / SM_WARPS) +
			 (sh.inter + SM_WARPS - 1) / SM_WARPS;
	int ctas = SM_CTAS_PER_SM * (n_sm > 0 ? n_sm : 1);
	int rp = SM_X_SMEM_MAX / (hidden * (int)sizeof(float));
	int ret;

	rp = rp < M ? rp : M;
	// A failed launch is also the runtime's last error, which K_CUDA_LAUNCHED reports.
	ctas = ctas < most ? ctas : (int)most;
	if (use_staged(&gate_staged, "KDEC_MOE_GATE_STAGED", hidden))
		k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), stage_bytes(hidden),
				  small_gate_up_staged_kernel, expert_w, x, ids, n, top_k, n_experts,
				  hidden, inter, act, sh);
	else
		k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS),
				  (size_t)rp * hidden * sizeof(float), small_gate_up_kernel, expert_w,
				  x, ids, n, top_k, n_experts, hidden, inter, rp, act, sh);
	if ((ret = K_CUDA_LAUNCHED("moe small gate/up")))
		return ret;
	if (use_staged(&down_staged, "KDEC_MOE_DOWN_STAGED", inter))
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS),
				  stage_bytes(inter), small_down_kernel<true>, expert_w,
				  (const float *)act, ids, weights, M, top_k, n_experts, hidden, inter,
				  sh, add, out);
	else
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), 0,
				  small_down_kernel<false>, expert_w, (const float *)act, ids, weights,
				  M, top_k, n_experts, hidden, inter, sh, add, out);
	return K_CUDA_LAUNCHED("moe small down");
}
