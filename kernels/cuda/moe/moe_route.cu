// The MoE router on the GPU: one warp per row, k_cpu_moe_route's arithmetic step for
// step (glibc's expf ported, the softmax sum and the weight sums in the CPU's order,
// the same group scores and argmax tie rule), so the chosen ids and the weights equal
// the CPU's exactly, near-ties included.
//
// Latency is all that counts here (one warp, 64..256 values): after the PDL wait the
// chain holds one round trip for the logits and nothing else from memory (the expf table
// sits in the lanes' registers, the bias in shared memory, both read before the wait),
// warp maxima are one redux.sync on order-preserving keys, and the top-k rounds rescan
// only the lane that owned the last winner.
#include <climits>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_route.cuh"

namespace {	// kernels and their helpers stay private to this file

// One warp per row; shared: score (E), choice (E), bias (E where bias_smem) floats,
// flag (E) bytes. The logits come into score in one round trip; the constants (expf
// table, bias) are read before the PDL wait. bias_smem 0: a bias too large for shared
// memory is read from global memory where used.
__global__ void __launch_bounds__(32)
moe_route_kernel(k_moe_route_params p, const float *logits, int32_t *ids, float *weights,
		 int bias_smem)
{
	extern __shared__ float smem[];
	__shared__ float gs[ROUTE_MAX_GROUPS], w[ROUTE_MAX_TOPK];
	__shared__ unsigned char keep[ROUTE_MAX_GROUPS];
	int E = p.n_experts, m = blockIdx.x;
	float *sbias = bias_smem ? smem + 2 * E : NULL;
	route_scratch r = { smem, smem + E, gs, w, (unsigned char *)(smem + (bias_smem ? 3 : 2) * E),
			    keep };
	uint64_t tab = expf_tab_lane();
	const float *lg = logits + (size_t)m * E, *bias = sbias ? sbias : p.bias;

	if (sbias)
		for (int e = threadIdx.x; e < E; e += 32)
			sbias[e] = k_cuda_pdl_early(p.bias + e);	// a weight
	k_cuda_pdl_wait();	// launched early under PDL: the logits are the router's output
	for (int e = threadIdx.x; e < E; e += 32)
		r.score[e] = lg[e];
	__syncwarp();
	route_row(p, r.score, bias, tab, r, ids + (size_t)m * p.top_k,
		  weights + (size_t)m * p.top_k);
}

}	// namespace

// ---- launchers --------------------------------------------------------------

bool moe_route_params_ok(const struct k_moe_route_params *p)
{
	if (p->n_experts <= 0 || p->n_experts > ROUTE_MAX_EXPERTS || p->top_k <= 0 ||
	    p->top_k > ROUTE_MAX_TOPK || p->top_k > p->n_experts)
		return false;
	if (p->select != K_MOE_GREEDY && p->n_group > 0)
		return p->n_group <= ROUTE_MAX_GROUPS && p->n_experts % p->n_group == 0;
	return true;
}

extern "C" int k_cuda_moe_route(cudaStream_t s, const struct k_moe_route_params *p,
				const float *logits, int M, int32_t *ids, float *weights)
{
	size_t smem;
	int bias_smem;

	if (M < 0 || !moe_route_params_ok(p))
		return -EINVAL;
	if (M == 0)
		return 0;
	// The bias's shared copy while the whole stays under the 48 KB a launch gets
	// without opting in (the static arrays take under 2 KB): up to ~3500 experts.
	smem = (size_t)p->n_experts * (3 * sizeof(float) + 1);
	bias_smem = p->bias && smem <= 46 * 1024;
	if (!bias_smem)
		smem = (size_t)p->n_experts * (2 * sizeof(float) + 1);
	// Programmatic dependent launch: scheduled while the router GEMM drains.
	k_cuda_launch_pdl(s, dim3(M), dim3(32), smem, moe_route_kernel, *p, logits, ids, weights,
			  bias_smem);
	return K_CUDA_LAUNCHED("moe_route");
}
