// The MoE router and the top-k choice in one launch at 1..K_CUDA_MOE_LAT_MAX_ROWS rows
// (decode), where the standard path takes two: the router GEMV (linear_fp32x) and
// moe_route. A Qwen3-30B-A3B layer at batch 1 spent ~11 us on that pair (graph replays,
// bench_cuda_moe: 46.7 us for the MoE against 35.8 for its experts alone) to read a
// 0.5 MB router, a floor of 0.12 us: the cost is two launches' latency chains, not
// bytes.
//
// One warp per expert row (moe_router.cuh: the GEMV's arithmetic, so the logits are its
// bits). The row's first chunks are loaded before the PDL wait (a weight), so at most
// a few rounds to memory follow it. Each CTA then takes a ticket; the one that takes
// the last routes every row (moe_route.cuh's route_row, k_cpu_moe_route's arithmetic)
// from the logits the others published, and hands the ticket word back at zero for the
// next call or graph replay. No grid barrier: no CTA ever waits for another.
#include <cerrno>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_route.cuh"
#include "kernels/cuda/moe/moe_router.cuh"

#define RT_WARPS 4		// expert rows per CTA: E / 4 CTAs (16 at 64 experts, 96 at 384)
#define RT_SMEM_MAX (48 * 1024)	// routing scratch of RT_WARPS warps, without opting in

namespace {	// kernels stay private to this file

// Grid ceil(E / RT_WARPS) x RT_WARPS warps; dynamic shared memory RT_WARPS routing
// scratches of stride bytes (used by the last CTA only). ticket: a word at zero.
__global__ void __launch_bounds__(RT_WARPS * 32)
moe_router_kernel(const uint16_t *router, k_moe_route_params p, const float *x, int M,
		  int hidden, float *logits, int32_t *ids, float *weights, unsigned *ticket,
		  int stride)
{
	extern __shared__ __align__(16) char scratch[];
	__shared__ int last;
	int E = p.n_experts, K = p.top_k, nc = hidden / 8;
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, e = blockIdx.x * RT_WARPS + warp;
	const uint4 *w = (const uint4 *)(router + (size_t)(e < E ? e : 0) * hidden);
	uint64_t tab = expf_tab_lane();
	uint4 first[ROUTER_U];

	if (e < E)
		router_load<true>(first, w, 0, nc, lane);
	k_cuda_pdl_wait();	// x is the RMSNorm's output
	if (e < E) {
		router_row(w, first, x, M, hidden, logits, E, e);
		__threadfence();	// this warp's logits before the CTA's ticket
	}
	__syncthreads();
	if (threadIdx.x == 0)
		last = atomicAdd(ticket, 1u) == gridDim.x - 1;
	__syncthreads();
	if (!last)
		return;
	__threadfence();	// every CTA published its logits before its ticket
	if (threadIdx.x == 0)
		*ticket = 0;	// no other CTA touches it again in this launch
	for (int m = warp; m < M; m += RT_WARPS) {	// warp-uniform
		route_scratch r = route_scratch_at(scratch + (size_t)warp * stride, E, K, p.n_group);

		for (int i = lane; i < E; i += 32)
			r.score[i] = __ldcg(logits + (size_t)m * E + i);
		__syncwarp();
		route_row(p, r.score, p.bias, tab, r, ids + (size_t)m * K, weights + (size_t)m * K);
	}
}

}	// namespace

// ---- launcher -----------------------------------------------------------------------

extern "C" int k_cuda_moe_router(cudaStream_t s, struct k_cuda_moe_ws *ws, const float *x,
				 int M, const uint16_t *router, int hidden,
				 const struct k_moe_route_params *p, float *logits, int32_t *ids,
				 float *weights)
{
	struct moe_ws_parts w;
	k_moe_route_params dp;
	size_t stride;

	if (!ws || !p || !x || !router || !logits || !ids || !weights || !moe_route_params_ok(p) ||
	    M < 0 || hidden <= 0)
		return -EINVAL;
	w = moe_ws_parts_of(ws);
	if (p->n_experts != w.n_experts || p->top_k != w.top_k || hidden != w.hidden)
		return -EINVAL;
	if (M == 0)
		return 0;
	if (M > K_CUDA_MOE_LAT_MAX_ROWS || M > w.max_M || hidden % 8 ||
	    (((uintptr_t)x | (uintptr_t)router) & 15))
		return 1;	// the GEMV's 16-byte loads, the warp's row registers
	dp = *p;
	if (dp.select == K_MOE_GREEDY)
		dp.n_group = 0;	// route_scratch_at's layout: no group scratch
	stride = route_scratch_bytes(dp.n_experts, dp.top_k, dp.n_group);
	if (stride * RT_WARPS > RT_SMEM_MAX)
		return 1;	// past ~1,000 experts
	k_cuda_launch_pdl(s, dim3((dp.n_experts + RT_WARPS - 1) / RT_WARPS), dim3(RT_WARPS * 32),
			  stride * RT_WARPS, moe_router_kernel, router, dp, x, M, hidden, logits, ids,
			  weights, w.bar + 2, (int)stride);
	return K_CUDA_LAUNCHED("moe router");
}
