// The latency path's MoE layer (issue 23, --decode-path latency) at batch 1..8: the
// router, the top-k choice, the chosen experts' gate/up and SiLU, the shared expert's,
// then down, the weighted combine and the residual add, in two launches where the
// standard path takes four (router GEMV, moe_route, gate/up, down).
//
// Launch 1 (lat_route_gate_up_kernel), a grid that is all resident at once:
//   A. the router logits (E, M): one warp per expert row, x in fp32, the arithmetic of
//      the router GEMV (linear_gemv.cu: two partial sums by 32-chunk parity, lane
//      chunks in order, then the shuffle tree), so the logits and hence the choice are
//      the standard path's bit for bit;
//   a grid barrier (arrival counter and generation word in the workspace);
//   B. every CTA routes the M rows itself (one warp per row, moe_route.cuh's route_row,
//      k_cpu_moe_route's arithmetic), builds the plan and takes its even share of the
//      (used expert, feature) rows and the shared expert's, as the small path's gate/up
//      does (gate_up_segment; one row: moe_small_m1.cuh's pipelined units). CTA 0 also
//      writes the ids and weights for launch 2.
//   Before its PDL wait it asks L2 for its router rows and shared-expert rows
//   (weights).
// Launch 2: the small path's down kernel (moe_small.cu) with the residual add and the
// shared expert's down rows folded in, launched without programmatic serialisation
// (it reads the ids before its wait).
//
// Measured on H200 (docs/PERFORMANCE.md, issue 23): correct and the standard path's
// bits, but launch 1 takes longer than the router GEMV, moe_route and gate/up it
// replaces except on Kimi-K2's shapes at one row, so --decode-path auto keeps the
// standard path elsewhere.
//
// Precision: as the small path (bf16 weights times fp32 x and activations, fp32
// accumulation, each row's slots summed in increasing expert id): its results bit for
// bit, given the same ids.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_route.cuh"
#include "kernels/cuda/moe/moe_small.cuh"
#include "kernels/cuda/moe/moe_small_m1.cuh"

#define LAT_ROUTER_U 8		// 16-byte router chunks per lane in flight (GEMV_U's)

namespace {	// kernels and their helpers stay private to this file

struct lat_args {
	const uint16_t *router;		// (E, hidden) bf16
	k_moe_route_params p;		// bias: device pointer or NULL
	const uint16_t *const *expert_w;
	const float *x;			// (M, hidden)
	float *logits;			// (M, E)
	int32_t *ids;			// (M, top_k)
	float *weights;			// (M, top_k)
	float *act;			// (M * top_k, inter)
	unsigned *bar;			// (2) arrivals, generation
	moe_small_shared sh;
	int M, hidden, inter, rp;
	int route_stride;		// bytes of one warp's routing scratch
	int m1;				// M = 1 gate/up by moe_small_m1.cuh's units: -1 no,
					// else their bal
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p)
{
	unsigned v;

	asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
	return v;
}

// Every CTA of the grid waits here until all have arrived; the grid is resident as a
// whole (the launcher sizes it by the occupancy), so the spin ends. The generation is
// read before arriving, and the last arriver resets the count before it moves the
// generation on, so the two words are ready for the next barrier and the next replay.
__device__ void lat_grid_barrier(unsigned *bar)
{
	__syncthreads();
	if (threadIdx.x == 0) {
		unsigned gen = ld_acquire(bar + 1);

		__threadfence();
		if (atomicAdd(bar, 1u) == gridDim.x - 1) {
			atomicExch(bar, 0u);
			__threadfence();
			atomicAdd(bar + 1, 1u);
		} else {
			while (ld_acquire(bar + 1) == gen)
				__nanosleep(32);
		}
		__threadfence();
	}
	__syncthreads();
}

// Phase A: logits[m, e] for the warp's expert rows e, all M rows of x at once; the
// router GEMV's order of operations (see the file comment).
__device__ void lat_router(const lat_args &a)
{
	int E = a.p.n_experts, nc = a.hidden / 8, lane = threadIdx.x % 32;
	int gw = blockIdx.x * SM_WARPS + threadIdx.x / 32, nw = gridDim.x * SM_WARPS;

	for (int e = gw; e < E; e += nw) {
		const uint4 *w = (const uint4 *)(a.router + (size_t)e * a.hidden);
		float acc0[K_CUDA_MOE_LAT_MAX_ROWS], acc1[K_CUDA_MOE_LAT_MAX_ROWS];

#pragma unroll
		for (int m = 0; m < K_CUDA_MOE_LAT_MAX_ROWS; m++)
			acc0[m] = acc1[m] = 0.0f;
		// LAT_ROUTER_U chunks per lane loaded before any is used (the GEMV keeps as
		// many in flight); the FMAs then go in the GEMV's order.
		for (int c0 = 0; c0 < nc; c0 += 32 * LAT_ROUTER_U) {
			uint4 wv[LAT_ROUTER_U];

#pragma unroll
			for (int u = 0; u < LAT_ROUTER_U; u++) {
				int c = c0 + 32 * u + lane;

				wv[u] = c < nc ? __ldcs(w + c) : make_uint4(0, 0, 0, 0);
			}
#pragma unroll
			for (int u = 0; u < LAT_ROUTER_U; u++) {
				int c = c0 + 32 * u + lane;

				if (c >= nc)
					break;
#pragma unroll
				for (int m = 0; m < K_CUDA_MOE_LAT_MAX_ROWS; m++) {
					const float4 *xp;

					if (m >= a.M)
						break;
					xp = (const float4 *)(a.x + (size_t)m * a.hidden) + 2 * c;
					if ((c >> 5) & 1)
						fma8(acc1[m], wv[u], xp[0], xp[1]);
					else
						fma8(acc0[m], wv[u], xp[0], xp[1]);
				}
			}
		}
#pragma unroll
		for (int m = 0; m < K_CUDA_MOE_LAT_MAX_ROWS; m++) {
			float v;

			if (m >= a.M)
				break;
			v = warp_sum(acc0[m] + acc1[m]);
			if (lane == 0)
				a.logits[(size_t)m * E + e] = v;
		}
	}
}

// Phase B's first half: warp m < M routes row m from the logits into s_ids / s_w
// (M * top_k each); CTA 0 also publishes them for launch 2. scratch: the CTA's
// dynamic shared memory, route_stride bytes per warp.
__device__ void lat_route(const lat_args &a, char *scratch, int32_t *s_ids, float *s_w)
{
	int E = a.p.n_experts, K = a.p.top_k, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	int G = a.p.n_group > 0 ? a.p.n_group : 1;
	uint64_t tab = expf_tab_lane();

	if (warp < a.M) {
		char *base = scratch + (size_t)warp * a.route_stride;
		route_scratch r;

		r.score = (float *)base;
		r.choice = r.score + E;
		r.gs = r.choice + E;
		r.w = r.gs + G;
		r.flag = (unsigned char *)(r.w + K);
		r.keep = r.flag + E;
		for (int e = lane; e < E; e += 32)
			r.score[e] = __ldcg(a.logits + (size_t)warp * E + e);
		__syncwarp();
		route_row(a.p, r.score, a.p.bias, tab, r, s_ids + warp * K, s_w + warp * K);
		if (blockIdx.x == 0)
			for (int j = lane; j < K; j += 32) {
				a.ids[warp * K + j] = s_ids[warp * K + j];
				a.weights[warp * K + j] = s_w[warp * K + j];
			}
	}
	__syncthreads();
}

__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
lat_route_gate_up_kernel(lat_args a)
{
	extern __shared__ float4 smem4[];	// routing scratch, then the staged x rows
	__shared__ small_plan sp;
	__shared__ int32_t s_ids[MOE_SMALL_MAX_PAIRS];
	__shared__ float s_w[MOE_SMALL_MAX_PAIRS];
	int n = a.M * a.p.top_k, E = a.p.n_experts;
	long long Wr, lo, hi;

	// Weights, before the wait: the warp's router row (phase A's loads then find it
	// in L2) and the CTA's share of the shared expert's gate/up rows.
	for (int e = blockIdx.x * SM_WARPS + threadIdx.x / 32; e < E; e += gridDim.x * SM_WARPS)
		prefetch_l2(a.router + (size_t)e * a.hidden, (size_t)a.hidden * 2, threadIdx.x % 32, 32);
	prefetch_shared_gate_up(a.sh, a.hidden);
	k_cuda_pdl_wait();	// x is the RMSNorm's output
	lat_router(a);
	lat_grid_barrier(a.bar);
	lat_route(a, (char *)smem4, s_ids, s_w);
	small_plan_build<false, true>(sp, s_ids, n, E);
	if (a.m1 >= 0) {	// one row: moe_small_m1.cu's pipelined units
		m1_gate_up_body(sp, a.expert_w, a.x, a.hidden, a.inter, a.act, a.sh, a.m1, smem4);
		return;
	}
	gate_up_share(sp, a.inter, a.sh.inter, Wr, lo, hi);
	for (long long pos = lo; pos < hi;) {	// CTA-uniform
		if (pos < Wr) {
			int u = (int)(pos / a.inter), fa = (int)(pos % a.inter), e = sp.used_e[u];
			int fb = (int)min((long long)a.inter, fa + (hi - pos));

			gate_up_segment(smem4, a.expert_w[3 * e], a.expert_w[3 * e + 1],
					sp.sorted + sp.used_start[u], sp.used_n[u], fa, fb, a.x,
					a.p.top_k, a.hidden, a.inter, a.rp, a.act);
			pos += fb - fa;
		} else {
			int fa = (int)(pos - Wr), fb = (int)min((long long)a.sh.inter, fa + (hi - pos));

			gate_up_segment(smem4, a.sh.gate, a.sh.up, nullptr, a.M, fa, fb, a.x, 1,
					a.hidden, a.sh.inter, a.rp, a.sh.act);
			pos += fb - fa;
		}
	}
}

// One warp's routing scratch (lat_route's layout), 16-byte multiple.
size_t lat_route_stride(int E, int top_k, int n_group)
{
	size_t G = n_group > 0 ? (size_t)n_group : 1;
	size_t b = (2 * (size_t)E + G + (size_t)top_k) * sizeof(float) + (size_t)E + G;

	return (b + 15) / 16 * 16;
}

}	// namespace

// ---- launcher -----------------------------------------------------------------------

// The shared-memory budget of launch 1: the larger of the routing scratch and rp x
// rows, rp as many as fit K_CUDA_MOE_LAT_SMEM (at least one).
#define K_CUDA_MOE_LAT_SMEM SM_X_SMEM_MAX

extern "C" int k_cuda_moe_lat_config(struct k_cuda_moe_lat_cfg *cfg, int M, int top_k,
				     int n_experts, int hidden, int inter, int n_group,
				     const struct k_cuda_moe_shared *sh,
				     const struct k_cuda_moe_quant *q, const float *x, char *why,
				     size_t why_len)
{
	size_t route, xrow = (size_t)hidden * sizeof(float);
	static unsigned long long setup_done;	// a bit a device (an attribute is per device)
	int dev = 0;

	*cfg = (struct k_cuda_moe_lat_cfg){ SM_THREADS, 1, K_CUDA_MOE_LAT_MAX_ROWS, 0, 0, 0 };
	if (q && q->fmt != K_Q_NONE) {	// its launch 1 streams bf16 expert rows only
		snprintf(why, why_len, "experts kept %s (the latency MoE reads bf16 experts; "
			 "the standard ops dequantize in registers)",
			 q->fmt == K_Q_INT4 ? "int4" : "fp8");
		return 1;
	}
	if (M < 1 || M > K_CUDA_MOE_LAT_MAX_ROWS) {
		snprintf(why, why_len, "%d rows (the latency MoE takes 1..%d)", M,
			 K_CUDA_MOE_LAT_MAX_ROWS);
		return 1;
	}
	if (!k_cuda_moe_small_fits(M, top_k, hidden, inter, x, sh) || hidden % SM_DCOLS) {
		snprintf(why, why_len, "shape outside the small path (%d rows x top %d, hidden %d, inter %d%s)",
			 M, top_k, hidden, inter, sh ? ", shared expert" : "");
		return 1;
	}
	route = lat_route_stride(n_experts, top_k, n_group) * (size_t)M;
	if (route > K_CUDA_MOE_LAT_SMEM || xrow > K_CUDA_MOE_LAT_SMEM) {
		snprintf(why, why_len, "%d experts or hidden %d past the shared-memory budget",
			 n_experts, hidden);
		return 1;
	}
	cfg->rp = (int)(K_CUDA_MOE_LAT_SMEM / xrow) < M ? (int)(K_CUDA_MOE_LAT_SMEM / xrow) : M;
	cfg->smem = (size_t)cfg->rp * xrow > route ? (size_t)cfg->rp * xrow : route;
	if (K_CUDA_CALL(cudaGetDevice(&dev)))
		return -EIO;
	if (dev >= 64 || !(__atomic_load_n(&setup_done, __ATOMIC_RELAXED) >> dev & 1)) {
		if (K_CUDA_CALL(cudaFuncSetAttribute(lat_route_gate_up_kernel,
						     cudaFuncAttributeMaxDynamicSharedMemorySize,
						     K_CUDA_MOE_LAT_SMEM)))
			return -EIO;
		if (dev < 64)	// ranks on other GPUs may ask at once
			__atomic_fetch_or(&setup_done, 1ull << dev, __ATOMIC_RELAXED);
	}
	if (K_CUDA_CALL(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
		    &cfg->ctas_per_sm, lat_route_gate_up_kernel, SM_THREADS, cfg->smem)))
		return -EIO;
	if (cfg->ctas_per_sm < 1) {
		snprintf(why, why_len, "no CTA of %zu bytes of shared memory fits an SM", cfg->smem);
		return 1;
	}
	return 0;
}

extern "C" int k_cuda_moe_lat(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y, const float *x,
			      int M, const uint16_t *router, const struct k_moe_route_params *p,
			      float *logits, int32_t *ids, float *weights,
			      const uint16_t *const *expert_w, const struct k_cuda_moe_quant *q,
			      int n_experts, int hidden, int inter, const struct k_cuda_moe_shared *sh)
{
	const struct k_cuda_tuning *tun = k_cuda_tuning();
	struct moe_ws_parts w;
	struct k_cuda_moe_lat_cfg cfg;
	moe_small_shared ss = {};
	lat_args a = {};
	char why[160];
	int ret, n, max_used, ctas;
	long long most;

	if (!ws || !p || !moe_route_params_ok(p) || p->n_experts != n_experts)
		return -EINVAL;
	w = moe_ws_parts_of(ws);
	if (M < 0 || M > w.max_M || p->top_k != w.top_k || n_experts != w.n_experts ||
	    hidden != w.hidden || inter != w.inter || (sh && sh->inter > w.shared_inter))
		return -EINVAL;
	if (M == 0)
		return 0;
	if ((ret = k_cuda_moe_lat_config(&cfg, M, p->top_k, n_experts, hidden, inter,
					 p->select != K_MOE_GREEDY ? p->n_group : 0, sh, q, x, why,
					 sizeof(why))))
		return ret;
	if (sh)
		ss = moe_small_shared{ sh->gate, sh->up, sh->down, sh->inter, w.sh_act };
	// One wave, all resident (the barrier), but no CTA with less than a feature per
	// warp at the most experts (k_cuda_moe_small_run's rule). Any grid covers the
	// router: its warps take the expert rows in turn.
	n = M * p->top_k;
	max_used = n < n_experts ? n : n_experts;
	most = (long long)max_used * ((inter + SM_WARPS - 1) / SM_WARPS) +
	       (ss.inter + SM_WARPS - 1) / SM_WARPS;
	ctas = cfg.ctas_per_sm * (w.n_sm > 0 ? w.n_sm : 1);
	ctas = ctas < most ? ctas : (int)most;
	a.router = router;
	a.p = *p;
	if (a.p.select == K_MOE_GREEDY)
		a.p.n_group = 0;	// lat_route_stride's layout: no group scratch
	a.expert_w = expert_w;
	a.x = x;
	a.logits = logits;
	a.ids = ids;
	a.weights = weights;
	a.act = w.act;
	a.bar = w.bar;
	a.sh = ss;
	a.M = M;
	a.hidden = hidden;
	a.inter = inter;
	a.rp = cfg.rp;
	a.route_stride = (int)lat_route_stride(n_experts, p->top_k, a.p.n_group);
	a.m1 = M == 1 && tun->moe_m1 && moe_small_m1_fits(p->top_k, n_experts, hidden, inter, ss.inter) ?
	       (tun->moe_m1_bal != 0) : -1;
	k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), cfg.smem, lat_route_gate_up_kernel, a);
	if ((ret = K_CUDA_LAUNCHED("moe lat router + gate/up")))
		return ret;
	moe_small_down_launch_plain(s, expert_w, w.act, ids, weights, M, p->top_k, n_experts, hidden,
				    inter, ss, y);
	return K_CUDA_LAUNCHED("moe lat down");
}
