// The small-batch MoE path at one row (M = 1: decode at batch 1), where every pair
// dots the same x row and each used expert's down rows the same activation row. Same
// work, grids and sums as the general kernels (moe_small_gate_up.cu, moe_small.cu),
// bit for bit, but each warp streams its weight rows as a pipeline of units (M1_UC
// 16-byte chunks per lane and row, two units in registers): the next unit's loads are
// issued as soon as the last one's registers are free, so a warp's bytes in flight
// never drop to zero between rows, and the loads of the first units are issued before
// the CTA stages x (gate/up) or the activations (down) into shared memory, where every
// dot product then reads them (no L1/L2 round trip inside the dot loop).
//
// Per lane the chunks come in the general kernels' order (lane, lane + 32, ...) and
// the sums go through the same shuffle tree, so the results equal theirs exactly.
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_small.cuh"

#include "kernels/cuda/moe/moe_small_m1.cuh"

namespace {	// kernels and their helpers stay private to this file
// small_gate_up_kernel at M = 1 (n = top_k pairs, all of x row 0): the same grid and
// share of rows per CTA. Warp w takes the CTA's rows w, w + SM_WARPS, ... as a stream of
// units (nu per row). act (n, inter): every pair of a used expert gets its value (a
// repeated id: the same dot product); sh.act (1, sh.inter). Dynamic shared memory: x
// row 0 (hidden fp32).
// F: the routed experts' format (quantized: wq, no shared expert).
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
m1_gate_up_kernel(const uint16_t *const *expert_w, moe_wq wq, const float *x, const int32_t *ids,
		  int n, int E, int hidden, int inter, float *act, moe_small_shared sh, int bal,
		  int sh_down_early)
{
	extern __shared__ float4 xs4[];		// (hidden / 4)
	__shared__ small_plan sp;

	prefetch_shared_gate_up(sh, hidden);
	if (sh_down_early && sh.inter) {	// the down kernel's shared rows too (see launcher)
		size_t all = (size_t)hidden * sh.inter * 2;
		size_t a = all * blockIdx.x / gridDim.x, b = all * (blockIdx.x + 1) / gridDim.x;

		a &= ~(size_t)127;
		prefetch_l2((const char *)sh.down + a, b - a, threadIdx.x, SM_THREADS);
	}
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	m1_gate_up_body<F>(sp, expert_w, x, hidden, inter, act, sh, bal, (float4 *)xs4, wq);
}

// Down item q (small_down_kernel's order: (used expert, column pair), then (shared
// piece, column pair)): its two rows, their length in chunks, and where its fp32
// activations start in the staged rows (float4 units).
struct dn_item {
	const uint4 *w0, *w1;
	int nc, src4, used, piece, cp;
	mq_row r0, r1;		// quantized: the rows' scales
};

// F: the routed experts' format (quantized: used_s their down scales as wq says).
template <int F = MQ_BF16>
__device__ __forceinline__ dn_item dn_item_of(int q, int n_routed, int n_used,
					      const uint16_t *const *used_w,
					      const void *const *used_s, const moe_wq &wq,
					      const moe_small_shared &sh, int c0, int inter)
{
	int cps = SM_DCOLS / 2;
	dn_item it;

	it.cp = q % cps;
	if (q < n_routed) {
		int c = c0 + 2 * it.cp;

		it.used = q / cps;
		it.piece = -1;
		it.nc = inter / MQ_VPC(F);
		it.w0 = (const uint4 *)used_w[it.used] + (size_t)c * it.nc;
		it.w1 = it.w0 + it.nc;
		it.src4 = it.used * (inter / 4);
		if (F != MQ_BF16) {
			it.r0 = mq_row_of(wq, used_s[it.used], 2, c);
			it.r1 = mq_row_of(wq, used_s[it.used], 2, c + 1);
		}
	} else {
		int k = (q - n_routed) / cps, ka = k * inter;	// piece k: [ka, ka + inter)
		const uint16_t *w = sh.down + (size_t)(c0 + 2 * it.cp) * sh.inter + ka;

		it.used = -1;
		it.piece = k;
		it.w0 = (const uint4 *)w;
		it.w1 = (const uint4 *)(w + sh.inter);
		it.nc = min(inter, sh.inter - ka) / 8;
		it.src4 = (n_used * inter + ka) / 4;
	}
	return it;
}

// small_down_kernel at M = 1: the same grid, items and epilogue (the general
// kernel's order of sums). Each used expert's activations (of its first pair: a
// repeated id has the same ones) and the shared expert's are staged in shared memory
// while the warps' first units load. Dynamic shared memory: (max_used * inter +
// sh.inter) fp32, max_used = min(n, E).
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
m1_down_kernel(const uint16_t *const *expert_w, moe_wq wq, const float *act, const int32_t *ids,
	       const float *weights, int top_k, int E, int hidden, int inter,
	       moe_small_shared sh, int add, int bal, int early, float *out)
{
	extern __shared__ float4 as4[];		// (max_used * inter + sh.inter) / 4
	__shared__ small_plan sp;
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// pair's expert output
	__shared__ float yss[MOE_SMALL_SH_PIECES][SM_DCOLS];	// shared-expert pieces
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];		// pair's routing weight
	__shared__ const uint16_t *pre_w[MOE_SMALL_MAX_PAIRS];	// pair's down matrix (hint)
	__shared__ const uint16_t *used_w[MOE_SMALL_MAX_PAIRS];	// used expert's down matrix
	__shared__ const void *used_s[MOE_SMALL_MAX_PAIRS];	// and its scales (quantized)
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = top_k;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, nc = inter / MQ_VPC(F);
	int ul = unit_len(nc, bal), nu = (nc + ul - 1) / ul, n_routed, n_all, K;

	prefetch_down_before_wait(expert_w, ids, n, E, sh, c0, hidden, (size_t)nc * 16, pre_w);
	// Before the wait: ids and weights are final here. This kernel is launched right
	// after gate/up (k_cuda_moe_small_run), so it starts only once every gate/up CTA has
	// passed its own wait, i.e. once the kernel that wrote them has completed. So the
	// plan and (early) the first weight units (constants) are in hand before the wait;
	// only the activations, gate/up's output, are read after it. One wait on every
	// path, so that tests/pdl_order.sh can follow it in the SASS.
	if (threadIdx.x < n)
		sw[threadIdx.x] = k_cuda_pdl_early(weights + threadIdx.x);
	small_plan_build<true>(sp, ids, n, E);	// its barriers publish sw too
	if (threadIdx.x < sp.n_used) {
		used_w[threadIdx.x] = k_cuda_pdl_early(expert_w + 3 * sp.used_e[threadIdx.x] + 2);
		if (F != MQ_BF16)	// a constant table, like expert_w
			used_s[threadIdx.x] = k_cuda_pdl_early(wq.scales + 3 * sp.used_e[threadIdx.x] + 2);
	}
	__syncthreads();

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	K = warp < n_all ? (n_all - warp + SM_WARPS - 1) / SM_WARPS * nu : 0;
	auto item = [&](int k) {
		return dn_item_of<F>(warp + SM_WARPS * (k / nu), n_routed, sp.n_used, used_w, used_s,
				     wq, sh, c0, inter);
	};
	auto load = [&](int k, uint4 *w0, uint4 *w1) {
		dn_item it = item(k);
		int cb = k % nu * ul;

		unit_load(w0, w1, it.w0, it.w1, cb, min(cb + ul, it.nc), lane);
	};
	auto load_early = [&](int k, uint4 *w0, uint4 *w1) {
		dn_item it = item(k);
		int cb = k % nu * ul;

		unit_load<true>(w0, w1, it.w0, it.w1, cb, min(cb + ul, it.nc), lane);
	};
	uint4 wa0[M1_UC], wa1[M1_UC], wb0[M1_UC], wb1[M1_UC];
	float a0 = 0.0f, a1 = 0.0f;
	// quantized: each buffer's scales (a: even units, b: odd), loaded with its weights
	float sa0[M1_UC], sa1[M1_UC], sb0[M1_UC], sb1[M1_UC];
	auto load_q = [&](int k, uint4 *w0, uint4 *w1) {
		dn_item it = item(k);
		int cb = k % nu * ul, ce = min(cb + ul, it.nc);

		unit_load(w0, w1, it.w0, it.w1, cb, ce, lane);
		if (k & 1)
			unit_scales<F>(sb0, sb1, it.r0, it.r1, cb, ce, lane);
		else
			unit_scales<F>(sa0, sa1, it.r0, it.r1, cb, ce, lane);
	};
	auto load_q_early = [&](int k, uint4 *w0, uint4 *w1) {
		dn_item it = item(k);
		int cb = k % nu * ul, ce = min(cb + ul, it.nc);

		unit_load<true>(w0, w1, it.w0, it.w1, cb, ce, lane);
		if (k & 1)
			unit_scales<F, true>(sb0, sb1, it.r0, it.r1, cb, ce, lane);
		else
			unit_scales<F, true>(sa0, sa1, it.r0, it.r1, cb, ce, lane);
	};

	if (F != MQ_BF16) {
		if (early)
			unit_prime(K, wa0, wa1, wb0, wb1, load_q_early);
		k_cuda_pdl_wait();
		if (!early)
			unit_prime(K, wa0, wa1, wb0, wb1, load_q);
	} else {
		if (early)
			unit_prime(K, wa0, wa1, wb0, wb1, load_early);
		k_cuda_pdl_wait();
		if (!early)
			unit_prime(K, wa0, wa1, wb0, wb1, load);
	}
	{	// the used experts' activation rows, then the shared expert's row
		int r4 = inter / 4, routed4 = sp.n_used * r4, all4 = routed4 + sh.inter / 4;

		for (int q = threadIdx.x; q < all4; q += SM_THREADS) {
			const float4 *s;

			if (q < routed4)
				s = (const float4 *)(act + (size_t)sp.sorted[sp.used_start[q / r4]] *
								   inter) + q % r4;
			else
				s = (const float4 *)sh.act + (q - routed4);
			as4[F == MQ_BF16 ? q : mq_swz(q)] = __ldcg(s);	// quantized: swizzled
		}
	}
	__syncthreads();

	auto consume = [&](int k, const uint4 *w0, const uint4 *w1) {
		dn_item it = item(k);
		int cb = k % nu * ul;

		if (F == MQ_BF16)
			unit_dot(a0, a1, w0, w1, as4 + it.src4, cb, min(cb + ul, it.nc), lane);
		else if (k & 1)
			unit_dot_qs<F>(a0, a1, w0, w1, as4, it.src4, cb, min(cb + ul, it.nc), lane,
				       sb0, sb1, wq.sbf16);
		else
			unit_dot_qs<F>(a0, a1, w0, w1, as4, it.src4, cb, min(cb + ul, it.nc), lane,
				       sa0, sa1, wq.sbf16);
		if (k % nu == nu - 1) {
			float s0 = warp_sum(a0), s1 = warp_sum(a1);

			if (lane == 0 && it.used < 0) {
				yss[it.piece][2 * it.cp] = s0;
				yss[it.piece][2 * it.cp + 1] = s1;
			} else if (lane == 0) {
				const int *pairs = sp.sorted + sp.used_start[it.used];

				for (int p = 0; p < sp.used_n[it.used]; p++) {
					ys[pairs[p]][2 * it.cp] = s0;
					ys[pairs[p]][2 * it.cp + 1] = s1;
				}
			}
			a0 = a1 = 0.0f;
		}
	};
	if (F != MQ_BF16)
		unit_stream(K, wa0, wa1, wb0, wb1, load_q, consume);
	else
		unit_stream(K, wa0, wa1, wb0, wb1, load, consume);
	__syncthreads();

	// small_down_kernel's epilogue at M = 1: routed pairs in increasing (expert id,
	// pair) order, products rounded, then the shared pieces in order, then the residual.
	for (int cc = threadIdx.x; cc < SM_DCOLS; cc += SM_THREADS) {
		float acc = 0.0f;

		if (c0 + cc >= hidden)
			continue;
		for (int p = 0; p < sp.n_valid; p++) {
			int i = sp.sorted[p];

			acc = __fadd_rn(acc, __fmul_rn(ys[i][cc], sw[i]));
		}
		if (pieces) {
			float t = yss[0][cc];

			for (int k = 1; k < pieces; k++)
				t = __fadd_rn(t, yss[k][cc]);
			acc = __fadd_rn(acc, t);
		}
		if (add)
			acc = __fadd_rn(out[c0 + cc], acc);
		out[c0 + cc] = acc;
	}
}

}	// namespace

// ---- launchers ----------------------------------------------------------------------

static size_t m1_down_smem(int top_k, int n_experts, int inter, int sh_inter)
{
	int max_used = top_k < n_experts ? top_k : n_experts;

	return ((size_t)max_used * inter + (size_t)sh_inter) * sizeof(float);
}

bool moe_small_m1_fits(int top_k, int n_experts, int hidden, int inter, int sh_inter)
{
	return (size_t)hidden * sizeof(float) <= SM_X_SMEM_MAX &&
	       m1_down_smem(top_k, n_experts, inter, sh_inter) <= M1_ACT_SMEM_MAX;
}

template <int F>
static int m1_setup_fmt(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(m1_gate_up_kernel<F>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_X_SMEM_MAX)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(m1_down_kernel<F>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						M1_ACT_SMEM_MAX)) ? -EIO : 0;
}

int moe_small_m1_setup(void)
{
	return m1_setup_fmt<MQ_BF16>() || m1_setup_fmt<MQ_FP8>() || m1_setup_fmt<MQ_INT4>() ? -EIO
											     : 0;
}

template <int F>
static void m1_launch_fmt(cudaStream_t s, int gate_up_ctas, const uint16_t *const *expert_w,
			  const struct moe_wq &wq, const float *x, const int32_t *ids,
			  const float *weights, int top_k, int n_experts, int hidden, int inter,
			  float *act, const struct moe_small_shared &sh, int add, float *out)
{
	const struct k_cuda_tuning *tun = k_cuda_tuning();
	int bal = tun->moe_m1_bal != 0;

	// Launch order: gate/up, then down at once (see small_down_kernel's launch).
	k_cuda_launch_pdl(s, dim3(gate_up_ctas), dim3(SM_THREADS), (size_t)hidden * sizeof(float),
			  m1_gate_up_kernel<F>, expert_w, wq, x, ids, top_k, n_experts, hidden,
			  inter, act, sh, bal, (int)(tun->moe_sh_down_early != 0));
	if (cudaPeekAtLastError() != cudaSuccess)
		return;
	k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS),
			  m1_down_smem(top_k, n_experts, inter, sh.inter), m1_down_kernel<F>,
			  expert_w, wq, (const float *)act, ids, weights, top_k, n_experts, hidden,
			  inter, sh, add, bal, (int)(tun->moe_down_early != 0), out);
}

// k_cuda_tuning()'s switches of these kernels (A/B runs): moe_m1_bal 0
// (KDEC_MOE_M1_BAL=0): units of M1_UNIT chunks and a short last one. moe_sh_down_early 0
// (KDEC_MOE_SH_DOWN_EARLY=0): the shared expert's down rows are asked of L2 by the down
// kernel alone, before its wait, while gate/up streams its rows (HBM-bound: the two
// compete). By default the gate/up CTAs ask for them too before their own wait, in
// the router's window where HBM is idle, so that down finds them in L2 (60 MB; the
// shared expert is 35 MB at V2-Lite dims). moe_down_early 0 (KDEC_MOE_DOWN_EARLY=0):
// the down kernel issues its first weight loads after its wait (the plan, from settled
// ids, comes before it either way).
void moe_small_m1_launch(cudaStream_t s, int gate_up_ctas, const uint16_t *const *expert_w,
			 const struct moe_wq &wq, const float *x, const int32_t *ids,
			 const float *weights, int top_k, int n_experts, int hidden, int inter,
			 float *act, const struct moe_small_shared &sh, int add, float *out)
{
	if (wq.fmt == MQ_FP8)
		m1_launch_fmt<MQ_FP8>(s, gate_up_ctas, expert_w, wq, x, ids, weights, top_k,
				      n_experts, hidden, inter, act, sh, add, out);
	else if (wq.fmt == MQ_INT4)
		m1_launch_fmt<MQ_INT4>(s, gate_up_ctas, expert_w, wq, x, ids, weights, top_k,
				       n_experts, hidden, inter, act, sh, add, out);
	else
		m1_launch_fmt<MQ_BF16>(s, gate_up_ctas, expert_w, wq, x, ids, weights, top_k,
				       n_experts, hidden, inter, act, sh, add, out);
}
