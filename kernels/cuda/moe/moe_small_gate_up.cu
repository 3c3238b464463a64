// The gate/up half of the small-batch MoE path (see moe_small.cu): one wave of CTAs
// shares the (used expert, feature) rows, then the shared expert's, evenly; each CTA
// streams its rows of gate and up once against the fp32 x rows of the slot's pairs and
// writes silu(gate x) * up x per pair, with the pairs' x rows staged in shared memory.
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_small.cuh"

namespace {	// kernels and their helpers stay private to this file

// One wave of CTAs shares the n_used * inter (expert, feature) rows, then the shared
// expert's sh.inter (prefetched before the wait), evenly: CTA b takes
// [W b / G, W (b + 1) / G) of them in that order, at most a few slots. Dynamic shared
// memory: rp fp32 x rows of hidden. act (n, inter): silu(gate x) * up x of pair i at
// row i; sh.act (n / top_k, sh.inter): the shared expert's of row m at row m.
// F: the routed experts' format (quantized: wq; then no shared expert).
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_gate_up_kernel(const uint16_t *const *expert_w, moe_wq wq, const float *x,
		     const int32_t *ids, int n, int top_k, int E, int hidden, int inter, int rp,
		     float *act, moe_small_shared sh)
{
	extern __shared__ float4 xs4[];		// (rp, hidden / 4)
	__shared__ small_plan sp;
	long long Wr, lo, hi;

	prefetch_shared_gate_up(sh, hidden);
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	gate_up_share(sp, inter, sh.inter, Wr, lo, hi);
	for (long long pos = lo; pos < hi;) {	// CTA-uniform
		if (pos < Wr) {
			int u = (int)(pos / inter), fa = (int)(pos % inter), e = sp.used_e[u];
			int fb = (int)min((long long)inter, fa + (hi - pos));

			if (F == MQ_BF16)
				gate_up_segment(xs4, expert_w[3 * e], expert_w[3 * e + 1],
						sp.sorted + sp.used_start[u], sp.used_n[u], fa, fb, x,
						top_k, hidden, inter, rp, act);
			else
				gate_up_segment<F>(xs4, expert_w[3 * e], expert_w[3 * e + 1],
						   sp.sorted + sp.used_start[u], sp.used_n[u], fa, fb,
						   x, top_k, hidden, inter, rp, act, wq,
						   wq.scales[3 * e], wq.scales[3 * e + 1]);
			pos += fb - fa;
		} else {
			int fa = (int)(pos - Wr), fb = (int)min((long long)sh.inter, fa + (hi - pos));

			gate_up_segment(xs4, sh.gate, sh.up, nullptr, n / top_k, fa, fb, x, 1,
					hidden, sh.inter, rp, sh.act);
			pos += fb - fa;
		}
	}
}

}	// namespace

// ---- launchers ----------------------------------------------------------------------

int moe_small_gate_up_setup(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_kernel<MQ_BF16>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_X_SMEM_MAX)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_kernel<MQ_FP8>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_X_SMEM_MAX)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_kernel<MQ_INT4>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_X_SMEM_MAX)) ? -EIO : 0;
}

void moe_small_gate_up_launch(cudaStream_t s, int ctas, int rp,
			      const uint16_t *const *expert_w, const struct moe_wq &wq,
			      const float *x, const int32_t *ids, int n, int top_k, int n_experts,
			      int hidden, int inter, float *act, const struct moe_small_shared &sh)
{
	size_t smem = (size_t)rp * hidden * sizeof(float);
	if (wq.fmt == MQ_BF16)
		k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), smem, small_gate_up_kernel<MQ_BF16>,
				  expert_w, wq, x, ids, n, top_k, n_experts, hidden, inter, rp, act,
				  sh);
	else if (wq.fmt == MQ_INT4)
		k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), smem, small_gate_up_kernel<MQ_INT4>,
				  expert_w, wq, x, ids, n, top_k, n_experts, hidden, inter, rp, act,
				  sh);
	else
		k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), smem, small_gate_up_kernel<MQ_FP8>,
				  expert_w, wq, x, ids, n, top_k, n_experts, hidden, inter, rp, act,
				  sh);
}
