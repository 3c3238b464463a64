// The small MoE path (decode at batch 1..8: at most 64 (row, slot) pairs) with its
// weights streamed by the copy engine (Hopper's bulk copies, cp.async.bulk) into a
// ring of shared-memory slots, where the register kernels (moe_small_m1.cu,
// moe_small_gate_up.cu, moe_small.cu) hold them in registers.
//
// Why (issue 23, ncu of the register kernels at Qwen3-30B-A3B's shapes on H200): gate/up
// 21.2 us against an 11.8 us floor, down 17.6 against 5.9, both stalled on global
// loads (long_sb) at 22% occupancy: 128 registers a thread cap the bytes a warp can
// have in flight, and a CTA's rows come in a few register round trips. Here one thread
// asks for whole rows (a slot each: a weight row pair, 2 x hidden or 2 x inter bf16)
// and the copy engine has up to a slot ring's worth in flight per SM (~100 KB), with
// no register cost; the warps only dot what has landed.
//
// Each CTA: TMA_CWARPS consumer warps and one producer warp. Item i of the CTA goes to
// slot i % ns and to consumer warp i % TMA_CWARPS. full[s] completes when its bytes
// land (the producer's expect_tx, then the copies' complete_tx); empty[s] when its
// consumer is done with it (one arrival), after which the producer refills it. The
// producer's lanes issue the first ring's items at once, then lane 0 the rest in order.
// ns is a multiple of TMA_CWARPS, so that a slot always has the same consumer warp,
// which takes its uses in order: a parity wait can then never see the phase of a use
// two ahead of the one it means.
//
// Two pairs: one row (tma_gate_up_kernel, tma_down_kernel: the activations staged in
// shared memory, moe_small_m1.cu's shares) and any rows up to 64 pairs
// (tma_gate_up_rows_kernel, tma_down_rows_kernel: the M x rows staged, the pairs'
// activations read from L2). k_cuda_tuning()'s moe_m1_tma and moe_small_tma pick them
// (KDEC_MOE_M1_TMA, KDEC_MOE_SMALL_TMA); both off until measured on the GPU.
//
// Same results bit for bit as moe_small_m1.cu's kernels (and so as the general ones):
// the same items (moe_small_m1.cuh's gu_row_of, dn_item_of), each dot product lane's
// chunks lane, lane + 32, ... in order through fma8, the same shuffle tree and the same
// epilogue. Only which CTA and warp take an item differs, which no sum depends on.
// The fp32 vectors (x, the activations) are staged with each chunk's two float4 halves
// in two arrays, so that a warp's reads of them hit every bank once.
#include <cerrno>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_small.cuh"

#include "kernels/cuda/moe/moe_small_m1.cuh"

#define TMA_CWARPS 8				// consumer warps per CTA
#define TMA_THREADS (32 * (TMA_CWARPS + 1))	// and one producer warp
#define TMA_GU_SMEM (140 * 1024)	// gate/up CTA's dynamic shared memory: one per SM
					// (16 slots at hidden 2048), leaving room for a down
					// CTA to start beside it
#define TMA_GU_SMEM_BIG (200 * 1024)	// where that leaves fewer than TMA_CWARPS slots
#define TMA_DN_SMEM (80 * 1024)		// down CTA's: two per SM, or one beside gate/up
#define TMA_DN_SMEM_BIG (200 * 1024)	// where that leaves fewer than TMA_CWARPS slots
#define TMA_BAR_BYTES 1024		// the mbarriers' region, ahead of the vectors

namespace {	// kernels and their helpers stay private to this file

// ---- kernels ----------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
		     : "memory");
}

// The barriers' initialisation visible to the copy engine (the async proxy) too.
__device__ __forceinline__ void mbar_init_fence(void)
{
	asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
		     "r"(bytes)
		     : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
	asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Until the phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity)
{
	unsigned done;

	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n\t}"
			     : "=r"(done)
			     : "r"(smem_addr(bar)), "r"(parity)
			     : "memory");
	} while (!done);
}

// bytes (a multiple of 16, both ends 16-byte aligned) from global src to shared dst by
// the copy engine, completing on bar's transaction count. Weights only: after the PDL
// wait like any other global access of these kernels.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
		     " [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
		     "l"(src), "r"(bytes), "r"(smem_addr(bar))
		     : "memory");
}

// The ring of one CTA: ns slots of slot_bytes after the barriers and the staged vector.
struct tma_ring {
	uint64_t *full, *empty;		// (ns) mbarriers
	unsigned char *slots;		// (ns, slot_bytes)
	int ns, slot_bytes;
};

// The CTA's dynamic shared memory: barriers (TMA_BAR_BYTES), then vec_bytes of staged
// fp32 vector (returned in *vec), then the slots. Thread 0 initialises the barriers;
// the caller's next __syncthreads publishes them.
__device__ __forceinline__ tma_ring tma_ring_init(unsigned char *smem, int vec_bytes, int ns,
						  int slot_bytes, float4 **vec)
{
	tma_ring r;

	r.full = (uint64_t *)smem;
	r.empty = r.full + ns;
	*vec = (float4 *)(smem + TMA_BAR_BYTES);
	r.slots = smem + TMA_BAR_BYTES + vec_bytes;
	r.ns = ns;
	r.slot_bytes = slot_bytes;
	if (threadIdx.x == 0) {
		for (int s = 0; s < ns; s++) {
			mbar_init(&r.full[s], 1);
			mbar_init(&r.empty[s], 1);
		}
		mbar_init_fence();
	}
	return r;
}

// The producer warp: items 0 .. n - 1, issue(i, slot, bar) asks for item i's bytes
// (its expect_tx on bar, then its copies into slot). The first ring's items one per
// lane at once, the rest by lane 0 in order, each once its slot's consumer has let
// it go.
template <typename Issue>
__device__ __forceinline__ void tma_produce(const tma_ring &r, int n, Issue &issue)
{
	int lane = threadIdx.x % 32;

	for (int i = lane; i < n && i < r.ns; i += 32)
		issue(i, r.slots + (size_t)i * r.slot_bytes, &r.full[i]);
	if (lane == 0)
		for (int i = r.ns; i < n; i++) {
			int s = i % r.ns;

			mbar_wait(&r.empty[s], (unsigned)(i / r.ns - 1) & 1);
			issue(i, r.slots + (size_t)s * r.slot_bytes, &r.full[s]);
		}
	__syncwarp();
}

// Consumer warp w: items w, w + TMA_CWARPS, ... below n, each consume(i, slot) once its
// bytes have landed, then its slot handed back.
template <typename Consume>
__device__ __forceinline__ void tma_consume(const tma_ring &r, int n, Consume &consume)
{
	int warp = threadIdx.x / 32;

	for (int i = warp; i < n; i += TMA_CWARPS) {
		int s = i % r.ns;

		mbar_wait(&r.full[s], (unsigned)(i / r.ns) & 1);
		consume(i, (const uint4 *)(r.slots + (size_t)s * r.slot_bytes));
		__syncwarp();	// every lane's reads of the slot are done
		if (threadIdx.x % 32 == 0)
			mbar_arrive(&r.empty[s]);
	}
}

// Two weight rows (w0, w1 of nc chunks) dotted with the staged fp32 vector (chunk c:
// lo[c], hi[c]), fma8 over the lane's chunks in order: m1's unit_dot's sums.
__device__ __forceinline__ void slot_dot(float &acc0, float &acc1, const uint4 *w0, const uint4 *w1,
					 const float4 *lo, const float4 *hi, int nc, int lane)
{
#pragma unroll 4
	for (int c = lane; c < nc; c += 32) {
		float4 a = lo[c], b = hi[c];

		fma8(acc0, w0[c], a, b);
		fma8(acc1, w1[c], a, b);
	}
}

// Gate/up row pos (gu_row_of's order) where used_g / used_u (shared memory) hold the
// used experts' matrices: no global round trip per row.
__device__ __forceinline__ gu_row tma_gu_row(long long pos, long long Wr,
					     const uint16_t *const *used_g,
					     const uint16_t *const *used_u, const moe_small_shared &sh,
					     int hidden, int inter)
{
	gu_row g;

	if (pos < Wr) {
		g.used = (int)(pos / inter);
		g.f = (int)(pos % inter);
		g.g = (const uint4 *)(used_g[g.used] + (size_t)g.f * hidden);
		g.u = (const uint4 *)(used_u[g.used] + (size_t)g.f * hidden);
	} else {
		g.used = -1;
		g.f = (int)(pos - Wr);
		g.g = (const uint4 *)(sh.gate + (size_t)g.f * hidden);
		g.u = (const uint4 *)(sh.up + (size_t)g.f * hidden);
	}
	return g;
}

// m1_gate_up_kernel's work with the rows streamed into slots (2 * hidden bf16: gate,
// then up). Grid: one CTA per SM; CTA b takes its gate_up_share of the rows. Dynamic
// shared memory: barriers, x row 0 (hidden fp32, as lo / hi halves), ns slots.
__global__ void __launch_bounds__(TMA_THREADS, 1)
tma_gate_up_kernel(const uint16_t *const *expert_w, const float *x, const int32_t *ids, int n,
		   int E, int hidden, int inter, float *act, moe_small_shared sh, int ns,
		   int sh_down_early)
{
	extern __shared__ __align__(128) unsigned char smem_gu[];
	__shared__ small_plan sp;
	__shared__ const uint16_t *used_g[MOE_SMALL_MAX_PAIRS], *used_u[MOE_SMALL_MAX_PAIRS];
	int nc = hidden / 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	float4 *xv;
	tma_ring r = tma_ring_init(smem_gu, hidden * 4, ns, hidden * 4, &xv);
	const float4 *xlo = xv, *xhi = xv + nc;
	long long Wr, lo, hi;

	if (threadIdx.x < SM_THREADS) {	// m1_gate_up_kernel's hints, before the wait
		prefetch_shared_gate_up(sh, hidden);
		if (sh_down_early && sh.inter) {
			size_t all = (size_t)hidden * sh.inter * 2;
			size_t a = all * blockIdx.x / gridDim.x, b = all * (blockIdx.x + 1) / gridDim.x;

			a &= ~(size_t)127;
			prefetch_l2((const char *)sh.down + a, b - a, threadIdx.x, SM_THREADS);
		}
	}
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	if (threadIdx.x < sp.n_used) {	// one round trip for every used expert's rows
		used_g[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x]];
		used_u[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x] + 1];
	}
	__syncthreads();	// and the barriers of tma_ring_init
	gate_up_share(sp, inter, sh.inter, Wr, lo, hi);
	int items = (int)(hi - lo);
	auto row = [&](int i) {
		return tma_gu_row(lo + i, Wr, used_g, used_u, sh, hidden, inter);
	};

	if (warp == TMA_CWARPS) {
		auto issue = [&](int i, unsigned char *slot, uint64_t *bar) {
			gu_row g = row(i);

			mbar_expect_tx(bar, (unsigned)hidden * 4);
			bulk_load(slot, g.g, (unsigned)hidden * 2, bar);
			bulk_load(slot + (size_t)hidden * 2, g.u, (unsigned)hidden * 2, bar);
		};
		tma_produce(r, items, issue);
		return;
	}
	for (int c = threadIdx.x; c < nc; c += 32 * TMA_CWARPS) {	// x row 0, as halves
		xv[c] = ((const float4 *)x)[2 * c];
		xv[nc + c] = ((const float4 *)x)[2 * c + 1];
	}
	asm volatile("bar.sync 1, %0;" ::"n"(32 * TMA_CWARPS) : "memory");	// consumers only
	auto consume = [&](int i, const uint4 *w) {
		float ag = 0.0f, au = 0.0f;

		slot_dot(ag, au, w, w + nc, xlo, xhi, nc, lane);
		ag = warp_sum(ag);
		au = warp_sum(au);
		if (lane == 0)
			gu_row_store(sp, row(i), silu_mul(ag, au), act, sh, inter);
	};
	tma_consume(r, items, consume);
}

// m1_down_kernel's work with each item's two rows streamed into a slot (2 * inter
// bf16: row 2 cp, then 2 cp + 1, of a used expert or of a shared piece). Grid (hidden /
// SM_DCOLS). Dynamic shared memory: barriers, the used experts' activations and the
// shared expert's ((max_used * inter + sh.inter) fp32, as lo / hi halves), ns slots.
__global__ void __launch_bounds__(TMA_THREADS, 2)
tma_down_kernel(const uint16_t *const *expert_w, const float *act, const int32_t *ids,
		const float *weights, int top_k, int E, int hidden, int inter,
		moe_small_shared sh, int add, int ns, int vec_bytes, float *out)
{
	extern __shared__ __align__(128) unsigned char smem_dn[];
	__shared__ small_plan sp;
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// pair's expert output
	__shared__ float yss[MOE_SMALL_SH_PIECES][SM_DCOLS];	// shared-expert pieces
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];		// pair's routing weight
	__shared__ const uint16_t *pre_w[MOE_SMALL_MAX_PAIRS];	// pair's down matrix (hint)
	__shared__ const uint16_t *used_w[MOE_SMALL_MAX_PAIRS];	// used expert's down matrix
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = top_k;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, n_routed, n_all;
	float4 *av;
	tma_ring r = tma_ring_init(smem_dn, vec_bytes, ns, inter * 4, &av);

	// m1_down_kernel's steps before the wait: L2 hints for the CTA's rows, the
	// weights and the plan from the settled ids, the used experts' matrices.
	prefetch_down_before_wait(expert_w, ids, n, E, sh, c0, hidden, inter, pre_w);
	if (threadIdx.x < n)
		sw[threadIdx.x] = k_cuda_pdl_early(weights + threadIdx.x);
	small_plan_build<true>(sp, ids, n, E);
	if (threadIdx.x < sp.n_used)
		used_w[threadIdx.x] = k_cuda_pdl_early(expert_w + 3 * sp.used_e[threadIdx.x] + 2);
	__syncthreads();	// used_w, and the barriers of tma_ring_init
	k_cuda_pdl_wait();

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	int nv = (sp.n_used * inter + sh.inter) / 8;	// staged chunks
	const float4 *alo = av, *ahi = av + vec_bytes / 32;
	auto item = [&](int q) {
		return dn_item_of(q, n_routed, sp.n_used, used_w, sh, c0, inter);
	};

	if (warp == TMA_CWARPS) {
		auto issue = [&](int q, unsigned char *slot, uint64_t *bar) {
			dn_item it = item(q);

			mbar_expect_tx(bar, (unsigned)it.nc * 32);
			bulk_load(slot, it.w0, (unsigned)it.nc * 16, bar);
			bulk_load(slot + (size_t)inter * 2, it.w1, (unsigned)it.nc * 16, bar);
		};
		tma_produce(r, n_all, issue);
	} else {
		// the used experts' activation rows (of their first pair), then the shared
		// expert's row: chunk c of the staged vector as its lo / hi halves
		int rc = inter / 8, routed = sp.n_used * rc;

		for (int c = threadIdx.x; c < nv; c += 32 * TMA_CWARPS) {
			const float4 *s;

			if (c < routed)
				s = (const float4 *)(act + (size_t)sp.sorted[sp.used_start[c / rc]] *
								   inter) + 2 * (c % rc);
			else
				s = (const float4 *)sh.act + 2 * (c - routed);
			av[c] = __ldcg(s);
			av[vec_bytes / 32 + c] = __ldcg(s + 1);
		}
		asm volatile("bar.sync 1, %0;" ::"n"(32 * TMA_CWARPS) : "memory");
		auto consume = [&](int q, const uint4 *w) {
			dn_item it = item(q);
			int src = it.src4 / 2;	// float4 units of m1's staging: 2 per chunk
			float a0 = 0.0f, a1 = 0.0f;

			slot_dot(a0, a1, w, w + inter / 8, alo + src, ahi + src, it.nc, lane);
			a0 = warp_sum(a0);
			a1 = warp_sum(a1);
			if (lane == 0)
				dn_item_store(sp, it, a0, a1, ys, yss);
		};
		tma_consume(r, n_all, consume);
	}
	__syncthreads();
	m1_down_epilogue(sp, ys, yss, sw, pieces, c0, hidden, add, out);
}

// ---- any number of rows (M * top_k <= MOE_SMALL_MAX_PAIRS): the general kernels' bits

// Two weight rows dotted with an fp32 row in global memory (chunk c: src[2 c] and
// src[2 c + 1]): dot2_rows's sums for one pair.
__device__ __forceinline__ void slot_dot_global(float &acc0, float &acc1, const uint4 *w0,
						const uint4 *w1, const float4 *src, int nc, int lane)
{
#pragma unroll 4
	for (int c = lane; c < nc; c += 32) {
		float4 a = src[2 * c], b = src[2 * c + 1];

		fma8(acc0, w0[c], a, b);
		fma8(acc1, w1[c], a, b);
	}
}

// small_gate_up_kernel's work with the rows streamed into slots: each row pair dotted
// with the x row of every pair of its used expert (act (n, inter), pair i at row i),
// or of every row (the shared expert: sh.act (M, sh.inter)). Grid: one CTA per SM.
// Dynamic shared memory: barriers, the M x rows (each as lo / hi halves), ns slots.
__global__ void __launch_bounds__(TMA_THREADS, 1)
tma_gate_up_rows_kernel(const uint16_t *const *expert_w, const float *x, const int32_t *ids,
			int n, int top_k, int E, int hidden, int inter, float *act,
			moe_small_shared sh, int ns)
{
	extern __shared__ __align__(128) unsigned char smem_gr[];
	__shared__ small_plan sp;
	__shared__ const uint16_t *used_g[MOE_SMALL_MAX_PAIRS], *used_u[MOE_SMALL_MAX_PAIRS];
	int nc = hidden / 8, M = n / top_k, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	float4 *xv;
	tma_ring r = tma_ring_init(smem_gr, M * hidden * 4, ns, hidden * 4, &xv);
	long long Wr, lo, hi;

	if (threadIdx.x < SM_THREADS)
		prefetch_shared_gate_up(sh, hidden);
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	if (threadIdx.x < sp.n_used) {
		used_g[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x]];
		used_u[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x] + 1];
	}
	__syncthreads();	// and the barriers of tma_ring_init
	gate_up_share(sp, inter, sh.inter, Wr, lo, hi);
	int items = (int)(hi - lo);

	if (warp == TMA_CWARPS) {
		auto issue = [&](int i, unsigned char *slot, uint64_t *bar) {
			gu_row g = tma_gu_row(lo + i, Wr, used_g, used_u, sh, hidden, inter);

			mbar_expect_tx(bar, (unsigned)hidden * 4);
			bulk_load(slot, g.g, (unsigned)hidden * 2, bar);
			bulk_load(slot + (size_t)hidden * 2, g.u, (unsigned)hidden * 2, bar);
		};
		tma_produce(r, items, issue);
		return;
	}
	for (int q = threadIdx.x; q < M * nc; q += 32 * TMA_CWARPS) {	// row m: lo, hi
		int m = q / nc, c = q % nc;
		const float4 *xr = (const float4 *)(x + (size_t)m * hidden);

		xv[2 * m * nc + c] = xr[2 * c];
		xv[2 * m * nc + nc + c] = xr[2 * c + 1];
	}
	asm volatile("bar.sync 1, %0;" ::"n"(32 * TMA_CWARPS) : "memory");	// consumers only
	auto dot_store = [&](const uint4 *w, int m, float *dst) {
		float ag = 0.0f, au = 0.0f;

		slot_dot(ag, au, w, w + nc, xv + 2 * m * nc, xv + 2 * m * nc + nc, nc, lane);
		ag = warp_sum(ag);
		au = warp_sum(au);
		if (lane == 0)
			*dst = silu_mul(ag, au);
	};
	auto consume = [&](int i, const uint4 *w) {
		gu_row g = tma_gu_row(lo + i, Wr, used_g, used_u, sh, hidden, inter);

		if (g.used >= 0) {
			const int *pairs = sp.sorted + sp.used_start[g.used];

			for (int p = 0; p < sp.used_n[g.used]; p++)
				dot_store(w, pairs[p] / top_k, act + (size_t)pairs[p] * inter + g.f);
		} else {
			for (int m = 0; m < M; m++)
				dot_store(w, m, sh.act + (size_t)m * sh.inter + g.f);
		}
	};
	tma_consume(r, items, consume);
}

// small_down_kernel's work with each item's two rows streamed into a slot, dotted with
// the activation row of every pair of its used expert, or of every row (a shared
// piece), read from global memory (L2: 64 pairs' rows do not fit shared memory beside
// a ring). Grid (hidden / SM_DCOLS). Dynamic shared memory: barriers, ns slots.
__global__ void __launch_bounds__(TMA_THREADS, 2)
tma_down_rows_kernel(const uint16_t *const *expert_w, const float *act, const int32_t *ids,
		     const float *weights, int M, int top_k, int E, int hidden, int inter,
		     moe_small_shared sh, int add, int ns, float *out)
{
	extern __shared__ __align__(128) unsigned char smem_dr[];
	__shared__ small_plan sp;
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// pair's expert output
	__shared__ float yss[MOE_SMALL_SH_PIECES][MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// row's
								// shared-expert pieces
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];		// pair's routing weight
	__shared__ const uint16_t *pre_w[MOE_SMALL_MAX_PAIRS];	// pair's down matrix (hint)
	__shared__ const uint16_t *used_w[MOE_SMALL_MAX_PAIRS];	// used expert's down matrix
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = M * top_k;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, n_routed, n_all;
	float4 *none;
	tma_ring r = tma_ring_init(smem_dr, 0, ns, inter * 4, &none);

	// small_down_kernel's steps before the wait (see there)
	prefetch_down_before_wait(expert_w, ids, n, E, sh, c0, hidden, inter, pre_w);
	if (threadIdx.x < n)
		sw[threadIdx.x] = k_cuda_pdl_early(weights + threadIdx.x);
	small_plan_build<true>(sp, ids, n, E);
	if (threadIdx.x < sp.n_used)
		used_w[threadIdx.x] = k_cuda_pdl_early(expert_w + 3 * sp.used_e[threadIdx.x] + 2);
	__syncthreads();	// used_w, and the barriers of tma_ring_init
	k_cuda_pdl_wait();

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	auto item = [&](int q) {
		return dn_item_of(q, n_routed, sp.n_used, used_w, sh, c0, inter);
	};
	if (warp == TMA_CWARPS) {
		auto issue = [&](int q, unsigned char *slot, uint64_t *bar) {
			dn_item it = item(q);

			mbar_expect_tx(bar, (unsigned)it.nc * 32);
			bulk_load(slot, it.w0, (unsigned)it.nc * 16, bar);
			bulk_load(slot + (size_t)inter * 2, it.w1, (unsigned)it.nc * 16, bar);
		};
		tma_produce(r, n_all, issue);
	} else {
		auto consume = [&](int q, const uint4 *w) {
			dn_item it = item(q);
			int np = it.used >= 0 ? sp.used_n[it.used] : M;

			for (int p = 0; p < np; p++) {
				const float *src;
				float a0 = 0.0f, a1 = 0.0f, *dst;

				if (it.used >= 0) {
					int i = sp.sorted[sp.used_start[it.used] + p];

					src = act + (size_t)i * inter;
					dst = &ys[i][2 * it.cp];
				} else {
					src = sh.act + (size_t)p * sh.inter + (size_t)it.piece * inter;
					dst = &yss[it.piece][p][2 * it.cp];
				}
				slot_dot_global(a0, a1, w, w + inter / 8, (const float4 *)src, it.nc,
						lane);
				a0 = warp_sum(a0);
				a1 = warp_sum(a1);
				if (lane == 0) {
					dst[0] = a0;
					dst[1] = a1;
				}
			}
		};
		tma_consume(r, n_all, consume);
	}
	__syncthreads();
	small_down_epilogue(sp, ys, yss, sw, M, top_k, pieces, c0, hidden, add, out);
}

}	// namespace

// ---- launchers ----------------------------------------------------------------------

// Slots of slot bytes that fit budget after the barriers and vec bytes (0: none).
static int tma_slots(size_t budget, size_t vec, size_t slot)
{
	return budget > TMA_BAR_BYTES + vec ? (int)((budget - TMA_BAR_BYTES - vec) / slot) : 0;
}

// The two kernels' rings for these shapes: slots and dynamic shared memory of each
// (gu_*, dn_*; dn_vec: bytes of the staged activations). false where either ring
// would have fewer than TMA_CWARPS slots in its larger budget.
static bool tma_plan(int top_k, int n_experts, int hidden, int inter, int sh_inter, int *gu_ns,
		     size_t *gu_smem, int *dn_ns, size_t *dn_smem, size_t *dn_vec)
{
	int max_used = top_k < n_experts ? top_k : n_experts;
	int pieces = (sh_inter + inter - 1) / inter;
	int gu_items = max_used * inter + sh_inter;	// at most, in one CTA
	int dn_items = (max_used + pieces) * (SM_DCOLS / 2);
	size_t xv = (size_t)hidden * 4, gslot = (size_t)hidden * 4, dslot = (size_t)inter * 4;
	size_t av = ((size_t)max_used * inter + (size_t)sh_inter) * 4;
	int g, d;

	g = tma_slots(TMA_GU_SMEM, xv, gslot);
	if (g < TMA_CWARPS)
		g = tma_slots(TMA_GU_SMEM_BIG, xv, gslot);
	d = tma_slots(TMA_DN_SMEM, av, dslot);
	if (d < TMA_CWARPS)
		d = tma_slots(TMA_DN_SMEM_BIG, av, dslot);
	// no more slots than a CTA can have items (rounded up: TMA_CWARPS at least), a
	// multiple of TMA_CWARPS (see the file comment), within the barriers' region
	g = g < gu_items + TMA_CWARPS - 1 ? g : gu_items + TMA_CWARPS - 1;
	d = d < dn_items + TMA_CWARPS - 1 ? d : dn_items + TMA_CWARPS - 1;
	g = (g < TMA_BAR_BYTES / 16 ? g : TMA_BAR_BYTES / 16) / TMA_CWARPS * TMA_CWARPS;
	d = (d < TMA_BAR_BYTES / 16 ? d : TMA_BAR_BYTES / 16) / TMA_CWARPS * TMA_CWARPS;
	if (g < TMA_CWARPS || d < TMA_CWARPS)
		return false;
	*gu_ns = g;
	*gu_smem = TMA_BAR_BYTES + xv + (size_t)g * gslot;
	*dn_ns = d;
	*dn_vec = av;
	*dn_smem = TMA_BAR_BYTES + av + (size_t)d * dslot;
	return true;
}

bool moe_small_tma_fits(int top_k, int n_experts, int hidden, int inter, int sh_inter)
{
	int g, d;
	size_t gs, ds, dv;

	return top_k <= MOE_SMALL_MAX_PAIRS && hidden % 8 == 0 && inter % 8 == 0 &&
	       sh_inter % 8 == 0 && sh_inter <= MOE_SMALL_SH_PIECES * inter &&
	       tma_plan(top_k, n_experts, hidden, inter, sh_inter, &g, &gs, &d, &ds, &dv);
}

int moe_small_tma_setup(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(tma_gate_up_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						TMA_GU_SMEM_BIG)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(tma_down_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						TMA_DN_SMEM_BIG)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(tma_gate_up_rows_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						TMA_GU_SMEM_BIG)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(tma_down_rows_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						TMA_DN_SMEM_BIG)) ? -EIO : 0;
}

// As moe_small_m1_launch (the same launch order and PDL reasoning: down reads the ids
// and weights before its wait), gate/up on n_sm CTAs. -EINVAL where the shapes do not
// fit (moe_small_tma_fits), nothing launched; else 0, a failed launch being the
// runtime's last error.
int moe_small_tma_launch(cudaStream_t s, int n_sm, const uint16_t *const *expert_w,
			 const float *x, const int32_t *ids, const float *weights, int top_k,
			 int n_experts, int hidden, int inter, float *act,
			 const struct moe_small_shared &sh, int add, float *out)
{
	const struct k_cuda_tuning *tun = k_cuda_tuning();
	int gu_ns, dn_ns;
	size_t gu_smem, dn_smem, dn_vec;

	if (!moe_small_tma_fits(top_k, n_experts, hidden, inter, sh.inter) ||
	    !tma_plan(top_k, n_experts, hidden, inter, sh.inter, &gu_ns, &gu_smem, &dn_ns, &dn_smem,
		      &dn_vec))
		return -EINVAL;
	k_cuda_launch_pdl(s, dim3(n_sm > 0 ? n_sm : 1), dim3(TMA_THREADS), gu_smem,
			  tma_gate_up_kernel, expert_w, x, ids, top_k, n_experts, hidden, inter, act,
			  sh, gu_ns, (int)(tun->moe_sh_down_early != 0));
	if (cudaPeekAtLastError() != cudaSuccess)
		return 0;
	k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(TMA_THREADS), dn_smem, tma_down_kernel,
			  expert_w, (const float *)act, ids, weights, top_k, n_experts, hidden, inter,
			  sh, add, dn_ns, (int)dn_vec, out);
	return 0;
}

// The rows kernels' rings (gate/up: x rows staged; down: no staged vector): false
// where either would have fewer than TMA_CWARPS slots in its larger budget.
static bool tma_rows_plan(int M, int top_k, int n_experts, int hidden, int inter, int sh_inter,
			  int *gu_ns, size_t *gu_smem, int *dn_ns, size_t *dn_smem)
{
	size_t xv = (size_t)M * hidden * 4, gslot = (size_t)hidden * 4, dslot = (size_t)inter * 4;
	int g = tma_slots(TMA_GU_SMEM, xv, gslot), d = tma_slots(TMA_DN_SMEM, 0, dslot);

	(void)top_k;
	(void)n_experts;
	(void)sh_inter;
	if (g < TMA_CWARPS)
		g = tma_slots(TMA_GU_SMEM_BIG, xv, gslot);
	if (d < TMA_CWARPS)
		d = tma_slots(TMA_DN_SMEM_BIG, 0, dslot);
	g = (g < TMA_BAR_BYTES / 16 ? g : TMA_BAR_BYTES / 16) / TMA_CWARPS * TMA_CWARPS;
	d = (d < TMA_BAR_BYTES / 16 ? d : TMA_BAR_BYTES / 16) / TMA_CWARPS * TMA_CWARPS;
	if (g < TMA_CWARPS || d < TMA_CWARPS)
		return false;
	*gu_ns = g;
	*gu_smem = TMA_BAR_BYTES + xv + (size_t)g * gslot;
	*dn_ns = d;
	*dn_smem = TMA_BAR_BYTES + (size_t)d * dslot;
	return true;
}

bool moe_small_tma_rows_fits(int M, int top_k, int n_experts, int hidden, int inter,
			     int sh_inter)
{
	int g, d;
	size_t gs, ds;

	return M >= 1 && (long)M * top_k <= MOE_SMALL_MAX_PAIRS && hidden % 8 == 0 &&
	       inter % 8 == 0 && sh_inter % 8 == 0 && sh_inter <= MOE_SMALL_SH_PIECES * inter &&
	       tma_rows_plan(M, top_k, n_experts, hidden, inter, sh_inter, &g, &gs, &d, &ds);
}

int moe_small_tma_rows_launch(cudaStream_t s, int n_sm, const uint16_t *const *expert_w,
			      const float *x, int M, const int32_t *ids, const float *weights,
			      int top_k, int n_experts, int hidden, int inter, float *act,
			      const struct moe_small_shared &sh, int add, float *out)
{
	int gu_ns, dn_ns;
	size_t gu_smem, dn_smem;

	if (!moe_small_tma_rows_fits(M, top_k, n_experts, hidden, inter, sh.inter) ||
	    !tma_rows_plan(M, top_k, n_experts, hidden, inter, sh.inter, &gu_ns, &gu_smem, &dn_ns,
			   &dn_smem))
		return -EINVAL;
	k_cuda_launch_pdl(s, dim3(n_sm > 0 ? n_sm : 1), dim3(TMA_THREADS), gu_smem,
			  tma_gate_up_rows_kernel, expert_w, x, ids, M * top_k, top_k, n_experts,
			  hidden, inter, act, sh, gu_ns);
	if (cudaPeekAtLastError() != cudaSuccess)
		return 0;
	k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(TMA_THREADS), dn_smem,
			  tma_down_rows_kernel, expert_w, (const float *)act, ids, weights, M, top_k,
			  n_experts, hidden, inter, sh, add, dn_ns, out);
	return 0;
}
