// The MoE router on the GPU: one warp per row, k_cpu_moe_route's arithmetic step for
// step (glibc's expf ported, the softmax sum and the weight sums in the CPU's order,
// the same group scores and argmax tie rule), so the chosen ids and the weights equal
// the CPU's exactly, near-ties included.
//
// Latency is all that counts here (one warp, 64..384 values): after the PDL wait the
// chain holds one round trip for the logits and nothing else from memory (the expf table
// sits in the lanes' registers, the bias in shared memory, both read before the wait),
// warp maxima are one redux.sync on order-preserving keys, and the top-k rounds rescan
// only the lane that owned the last winner. Where a row's experts fit 16 a lane and no
// group is masked, they stay in registers (moe_route_reg_kernel): session 21 measured
// moe_route at 4.4-23.6 us a layer alone in a chain (bench_cuda_moe route, H100), most
// of it one lane at a time walking shared memory.
#include <climits>
#include <cstdint>

#include "kernels/cuda/k_cuda_tuning.h"
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

// The same for a row whose experts fit NPL a lane (E <= 32 NPL) and whose groups, if
// any, are all kept (no mask: Qwen3, DeepSeek-V2-Lite, Kimi-K2) or 32 experts each
// (DeepSeek-V3: a group is one register index across the warp): lane l holds experts l,
// l + 32, ... in registers, so a top-k round's rescan of the winner's lane is NPL
// register compares instead of NPL shared-memory round trips (route_row's, ~60 cycles
// each with one warp on the multiprocessor). The arithmetic is route_row's, step for
// step: the softmax sum still one lane's walk in index order (through shared memory),
// the same expf, divisions, group scores (the group's first maximum in index order and
// the largest of the rest, as the CPU's walk keeps them), ties and weight sums, so ids
// and weights are the same bits.
// MASK: the groups are scored and all but topk_group masked (an instantiation apart:
// the scoring's registers and code slowed the unmasked rows by 20-35% in one kernel).
template <int NPL, bool MASK>
__global__ void __launch_bounds__(32)
moe_route_reg_kernel(k_moe_route_params p, const float *logits, int32_t *ids, float *weights,
		     int bias_smem)
{
	extern __shared__ float smem[];
	__shared__ float w[ROUTE_MAX_TOPK];
	const int E = p.n_experts, K = p.top_k, lane = threadIdx.x, m = blockIdx.x;
	float *score = smem, *sbias = bias_smem ? smem + E : NULL;
	const uint64_t tab = expf_tab_lane();
	const float *lg = logits + (size_t)m * E, *bias = sbias ? sbias : p.bias;
	float v[NPL], sc[NPL];
	unsigned taken = 0;	// bit i: expert i * 32 + lane chosen (or past E)
	float sum = 0.0f;

	if (sbias)
		for (int e = lane; e < E; e += 32)
			sbias[e] = k_cuda_pdl_early(p.bias + e);	// a weight
	k_cuda_pdl_wait();	// the logits are the router's output
#pragma unroll
	for (int i = 0; i < NPL; i++)
		v[i] = i * 32 + lane < E ? lg[i * 32 + lane] : 0.0f;
	if (p.scoring == K_MOE_SOFTMAX) {	// route_softmax
		unsigned mk = 0;
		float mx;

#pragma unroll
		for (int i = 0; i < NPL; i++)
			if (i * 32 + lane < E)
				mk = max(mk, ord_key(v[i]));
		mx = ord_float(__reduce_max_sync(0xffffffffu, mk));
#pragma unroll
		for (int i = 0; i < NPL; i++) {	// warp-uniform: glibc_expf shuffles
			sc[i] = glibc_expf(__fsub_rn(i * 32 + lane < E ? v[i] : mx, mx), tab);
			if (i * 32 + lane < E)
				score[i * 32 + lane] = sc[i];
		}
		__syncwarp();
		if (lane == 0) {
#pragma unroll 8
			for (int e = 0; e < E; e++)
				sum = __fadd_rn(sum, score[e]);
		}
		sum = __shfl_sync(0xffffffffu, sum, 0);
#pragma unroll
		for (int i = 0; i < NPL; i++)
			sc[i] = __fdiv_rn(sc[i], sum);
	} else {
#pragma unroll
		for (int i = 0; i < NPL; i++)	// warp-uniform: glibc_expf shuffles
			sc[i] = __fdiv_rn(1.0f, __fadd_rn(1.0f, glibc_expf(
							 i * 32 + lane < E ? -v[i] : 0.0f, tab)));
	}
	// the choice values (score + bias); experts past E never a candidate
#pragma unroll
	for (int i = 0; i < NPL; i++) {
		const int e = i * 32 + lane;

		v[i] = e < E && bias ? __fadd_rn(sc[i], bias[e]) : sc[i];
		if (e >= E)
			taken |= 1u << i;
	}
	unsigned masked = 0;	// bit g: group g (experts g * 32 + lane) dropped
	if (MASK) {
		const int top2 = p.select == K_MOE_GROUP_TOP2;
		float gs[NPL];
		unsigned keep = 0;

#pragma unroll
		for (int g = 0; g < NPL; g++) {	// route_group_score of group g
			const unsigned k = ord_key(v[g]);
			const int ia = warp_pick(k, lane);
			float s = __shfl_sync(0xffffffffu, v[g], ia);

			if (top2) {
				const int ib = warp_pick(lane == ia ? 0u : k, lane == ia ? INT_MAX : lane);

				s = __fadd_rn(s, __shfl_sync(0xffffffffu, v[g], ib));
			}
			gs[g] = s;
		}
		for (int i = 0; i < p.topk_group; i++) {	// route_argmax over the groups
			int best = -1;
			float bv = 0.0f;

#pragma unroll
			for (int g = 0; g < NPL; g++)
				if (g < p.n_group && !(keep >> g & 1) && (best < 0 || gs[g] > bv)) {
					best = g;
					bv = gs[g];
				}
			keep |= 1u << best;
		}
#pragma unroll
		for (int g = 0; g < NPL; g++)
			if (!(keep >> g & 1)) {
				masked |= 1u << g;
				v[g] = top2 ? -INFINITY : 0.0f;
			}
	}
	for (int j = 0; j < K; j++) {
		unsigned key = 0;
		int idx = INT_MAX;

		// this lane's best untaken: increasing index and ">" keep the lowest of a tie
#pragma unroll
		for (int i = 0; i < NPL; i++)
			if (!(taken >> i & 1)) {
				const unsigned k = ord_key(v[i]);

				if (idx == INT_MAX || k > key) {
					key = k;
					idx = i * 32 + lane;
				}
			}
		const int e = warp_pick(key, idx);

		if (e >= 0 && e % 32 == lane) {
			const int i = e / 32;

			taken |= 1u << i;
			ids[(size_t)m * K + j] = e;
			// V2 takes its weights from the masked scores, V3 from the raw ones
#pragma unroll
			for (int t = 0; t < NPL; t++)
				if (t == i)
					w[j] = masked >> t & 1 && p.select == K_MOE_GROUP_MAX ? 0.0f
											: sc[t];
		}
	}
	__syncwarp();
	route_finish(p, w, weights + (size_t)m * K);
}

// The register form's experts a lane for E experts: 0 where it does not take them.
static int route_reg_npl(const struct k_moe_route_params *p)
{
	const int E = p->n_experts;

	if (route_masks_groups(*p) && (E != 32 * p->n_group || p->topk_group < 1))
		return 0;	// a mask over groups that are not 32 experts: route_row's form
	return E <= 64 ? 2 : E <= 128 ? 4 : E <= 256 ? 8 : E <= 512 ? 16 : 0;
}

template <int NPL>
void route_reg_launch(cudaStream_t s, const struct k_moe_route_params *p, bool mask,
		      const float *logits, int M, int32_t *ids, float *weights, int bias_smem,
		      size_t smem)
{
	if (mask)
		k_cuda_launch_pdl(s, dim3(M), dim3(32), smem, moe_route_reg_kernel<NPL, true>, *p,
				  logits, ids, weights, bias_smem);
	else
		k_cuda_launch_pdl(s, dim3(M), dim3(32), smem, moe_route_reg_kernel<NPL, false>, *p,
				  logits, ids, weights, bias_smem);
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
	if (k_cuda_tuning()->moe_route_reg && route_reg_npl(p)) {
		const bool mask = route_masks_groups(*p);

		smem = (size_t)p->n_experts * 2 * sizeof(float);
		bias_smem = p->bias != NULL;
		switch (route_reg_npl(p)) {
		case 2:
			route_reg_launch<2>(s, p, mask, logits, M, ids, weights, bias_smem, smem);
			break;
		case 4:
			route_reg_launch<4>(s, p, mask, logits, M, ids, weights, bias_smem, smem);
			break;
		case 8:
			route_reg_launch<8>(s, p, mask, logits, M, ids, weights, bias_smem, smem);
			break;
		default:
			route_reg_launch<16>(s, p, mask, logits, M, ids, weights, bias_smem, smem);
			break;
		}
		return K_CUDA_LAUNCHED("moe_route");
	}
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
