// The routed experts at small batch (M * top_k <= 64 (row, slot) pairs), where every
// kernel is latency-bound: two launches instead of plan, gate/up, down and combine.
// This file: the down kernel and the launcher; gate/up is moe_small_gate_up.cu, the
// helpers both use moe_small.cuh.
//
// gate/up: one wave of CTAs shares the (used expert, feature) rows evenly and writes
// silu(gate x) * up x per pair (see its file).
// down: a CTA owns SM_DCOLS output columns of every row; its warps dot the used
// experts' down rows of those columns with the pairs' activations, then it sums each
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
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_small.cuh"

namespace {	// kernels and their helpers stay private to this file

// One item as its warp sees it: two weight rows w0 and w1 (nc chunks each) against
// total pairs' fp32 rows (pair p is i = pairs[p], or p where pairs is NULL; its row
// at src + i * ld4); the two sums to dst[i * SM_DCOLS] and the next.
struct dot_job {
	const uint4 *w0, *w1;
	const float4 *src;
	const int *pairs;
	float *dst;
	int nc, ld4, total;
	mq_row r0, r1;		// quantized rows' scales (bf16: unset)
};

// The warp's sums per pair (acc0, acc1: lane partials) into the job's dst.
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
		if (lane == 0) {
			j.dst[i * SM_DCOLS] = s0;
			j.dst[i * SM_DCOLS + 1] = s1;
		}
	}
}

// The job's pair offsets p0 .. p0 + SM_RP - 1 (the last one repeated past np).
__device__ __forceinline__ void job_offsets(const dot_job &j, int p0, int np, int *off)
{
#pragma unroll
	for (int r = 0; r < SM_RP; r++) {	// row * ld4 < 64 * 4 * inter / 4: an int
		int p = p0 + min(r, np - 1);

		off[r] = (j.pairs ? j.pairs[p] : p) * j.ld4;
	}
}

// Item q of small_down_kernel's CTA: (used expert, column pair) below n_routed, then
// (shared piece, column pair). Every item's columns lie inside hidden (a multiple of
// SM_DCOLS: k_cuda_moe_small_fits). ys (MOE_SMALL_MAX_PAIRS, SM_DCOLS), yss
// (MOE_SMALL_SH_PIECES, MOE_SMALL_MAX_PAIRS, SM_DCOLS); used_w (sp.n_used) the used
// experts' down matrices, in format F (quantized: used_s their scales, as wq says).
template <int F>
__device__ __forceinline__ dot_job down_job_of(int q, int n_routed, const small_plan &sp,
					       const uint16_t *const *used_w,
					       const void *const *used_s, const moe_wq &wq,
					       const float *act, const moe_small_shared &sh, int M,
					       int c0, int inter, float *ys, float *yss)
{
	int cps = SM_DCOLS / 2, cp = q % cps, c = c0 + 2 * cp;
	dot_job j;

	if (q < n_routed) {
		int u = q / cps, nc = inter / MQ_VPC(F);
		const uint4 *w = (const uint4 *)used_w[u] + (size_t)c * nc;

		j.w0 = w;
		j.w1 = w + nc;
		j.src = (const float4 *)act;
		j.pairs = sp.sorted + sp.used_start[u];
		j.dst = ys + 2 * cp;
		j.nc = nc;
		j.ld4 = inter / 4;
		j.total = sp.used_n[u];
		if (F != MQ_BF16) {
			j.r0 = mq_row_of(wq, used_s[u], 2, c);
			j.r1 = mq_row_of(wq, used_s[u], 2, c + 1);
		}
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

// Registers only (the down kernel's register path): SM_KB chunks per lane and row
// at a time.
template <int F>
__device__ void down_job_run(const dot_job &j, int lane)
{
	for (int p0 = 0; p0 < j.total; p0 += SM_RP) {
		int np = min(SM_RP, j.total - p0), off[SM_RP];
		float a0[SM_RP], a1[SM_RP];

		job_offsets(j, p0, np, off);
		if (F == MQ_BF16)
			dot2_rows(j.w0, j.w1, j.nc, j.src, off, np, a0, a1, lane);
		else
			dot2_rows<F>(j.w0, j.w1, j.nc, j.src, off, np, a0, a1, lane, j.r0, j.r1);
		job_store(j, p0, np, a0, a1, lane);
	}
}

// Grid (hidden / SM_DCOLS). The CTA's items go round the warps: (used expert, column
// pair), expert-major so that warps share the pairs' activations in L1, then (shared
// piece, column pair): the shared expert's rows cut into inter-long pieces, so that
// every item streams about as many bytes and the warps stay even. Each pair's dot
// product (a piece's) is one item's, so ys and yss need no reduction across warps.
// add 0: out (M, hidden) overwritten, rows without a valid pair included (zeros);
// add 1: out += (routed sum + shared expert), the separate ops' order. F: the routed
// experts' format (quantized: wq, and no shared expert).
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_down_kernel(const uint16_t *const *expert_w, moe_wq wq, const float *act,
		  const int32_t *ids, const float *weights, int M, int top_k, int E, int hidden,
		  int inter, moe_small_shared sh, int add, float *out)
{
	__shared__ small_plan sp;
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// pair's expert output
	__shared__ float yss[MOE_SMALL_SH_PIECES][MOE_SMALL_MAX_PAIRS][SM_DCOLS];	// row's
								// shared-expert pieces
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];		// pair's routing weight
	__shared__ const uint16_t *pre_w[MOE_SMALL_MAX_PAIRS];	// pair's down matrix (hint)
	__shared__ const uint16_t *used_w[MOE_SMALL_MAX_PAIRS];	// used expert's down matrix
	__shared__ const void *used_s[MOE_SMALL_MAX_PAIRS];	// and its scales (quantized)
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = M * top_k;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, n_routed, n_all;

	prefetch_down_before_wait(expert_w, ids, n, E, sh, c0, hidden,
				  (size_t)inter / MQ_VPC(F) * 16, pre_w);
	// The plan before the wait: launched right after gate/up, this kernel starts only
	// once every gate/up CTA has passed its own wait, so the kernel that wrote ids and
	// weights has completed (see m1_down_kernel; k_cuda_moe_small_run keeps the two
	// launches adjacent, tests/pdl_order.sh checks every kernel's trigger follows its
	// wait). The activations come after the wait.
	if (threadIdx.x < n)
		sw[threadIdx.x] = k_cuda_pdl_early(weights + threadIdx.x);
	small_plan_build<true>(sp, ids, n, E);	// its barriers publish sw too
	// Every used expert's matrix looked up at once: one round trip for the CTA where
	// each warp would otherwise wait on one per item of a new expert.
	if (threadIdx.x < sp.n_used) {
		used_w[threadIdx.x] = k_cuda_pdl_early(expert_w + 3 * sp.used_e[threadIdx.x] + 2);
		if (F != MQ_BF16)	// a constant table, like expert_w
			used_s[threadIdx.x] = k_cuda_pdl_early(wq.scales + 3 * sp.used_e[threadIdx.x] + 2);
	}
	k_cuda_pdl_wait();	// and a barrier after it: used_w is published
	__syncthreads();

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	// Jobs are rebuilt where used (a few shared-memory reads), not held: registers
	// go to the weights.
	auto job = [&](int q) {
		return down_job_of<F>(q, n_routed, sp, used_w, used_s, wq, act, sh, M, c0, inter,
				      &ys[0][0], &yss[0][0][0]);
	};
	for (int q = warp; q < n_all; q += SM_WARPS)
		down_job_run<F>(job(q), lane);
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

int k_cuda_moe_small_setup(void)
{
	return moe_small_gate_up_setup() || moe_small_m1_setup() ? -EIO : 0;
}

// Not here: asking L2 for each warp's rows two turns ahead (KDEC_MOE_PREFETCH_AHEAD,
// removed in session 12; in the history at 088d0ac) cost V2-Lite batch 1 3.213 ms a step
// against 2.856 without on H200 (Qwen3 4.036 against 3.823; likely the prefetches take
// HBM slots from the demand loads of the same step). moe_m1 0 (KDEC_MOE_M1=0): a single
// row (M = 1) takes the general register kernels rather than moe_small_m1.cu's pipelined
// pair (same results bit for bit). Not here either: one gate/up CTA an SM at M = 1,
// leaving room for a down CTA to start its plan beside them (KDEC_MOE_M1_GU_CTAS=1,
// removed in session 35): Qwen3-30B-A3B batch 1 4.189 ms a step against 3.997 (H100,
// session 14).

int k_cuda_moe_small_run(cudaStream_t s, float *act, float *out, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const uint16_t *const *expert_w, const struct moe_wq &wq, int n_experts,
			 int hidden, int inter, const struct moe_small_shared &sh, int add, int n_sm)
{
	int n = M * top_k, max_used = n < n_experts ? n : n_experts;
	// One wave at SM_CTAS_PER_SM, but no CTA with less than a feature per warp at the
	// most experts; staged x rows bounded by the rows an expert can get (router ids
	// are distinct per row; the shared expert has every row) and by the shared-memory
	// budget.
	long long most = (long long)max_used * ((inter + SM_WARPS - 1) / SM_WARPS) +
			 (sh.inter + SM_WARPS - 1) / SM_WARPS;
	int ctas = SM_CTAS_PER_SM * (n_sm > 0 ? n_sm : 1);
	const struct k_cuda_tuning *tun = k_cuda_tuning();
	int rp = SM_X_SMEM_MAX / (hidden * (int)sizeof(float));
	int ret;

	rp = rp < M ? rp : M;
	// A failed launch is also the runtime's last error, which K_CUDA_LAUNCHED reports.
	ctas = ctas < most ? ctas : (int)most;
	if (M == 1 && tun->moe_m1 &&
	    moe_small_m1_fits(top_k, n_experts, hidden, inter, sh.inter)) {
		moe_small_m1_launch(s, ctas, expert_w, wq, x, ids, weights, top_k, n_experts, hidden,
				    inter, act, sh, add, out);
		return K_CUDA_LAUNCHED("moe small m1");
	}
	// Launch order: gate/up, then down at once. Down reads ids and weights before its
	// wait, settled only because gate/up (launched in between) waits for the router
	// before it lets down start; nothing may be launched between these two.
	moe_small_gate_up_launch(s, ctas, rp, expert_w, wq, x, ids, n, top_k, n_experts,
				 hidden, inter, act, sh);
	if ((ret = K_CUDA_LAUNCHED("moe small gate/up")))
		return ret;
	if (wq.fmt == MQ_BF16)
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), 0,
				  small_down_kernel<MQ_BF16>, expert_w, wq, (const float *)act, ids,
				  weights, M, top_k, n_experts, hidden, inter, sh, add, out);
	else if (wq.fmt == MQ_INT4)
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), 0,
				  small_down_kernel<MQ_INT4>, expert_w, wq, (const float *)act, ids,
				  weights, M, top_k, n_experts, hidden, inter, sh, add, out);
	else
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), 0,
				  small_down_kernel<MQ_FP8>, expert_w, wq, (const float *)act, ids,
				  weights, M, top_k, n_experts, hidden, inter, sh, add, out);
	return K_CUDA_LAUNCHED("moe small down");
}

// moe_lat.cu's second launch: the down kernel as k_cuda_moe_small_run launches it with
// add 1, but without programmatic serialisation: the launch before it (moe_lat's
// router + gate/up) writes the ids and weights this kernel reads before its wait.
void moe_small_down_launch_plain(cudaStream_t s, const uint16_t *const *expert_w,
				 const float *act, const int32_t *ids, const float *weights, int M,
				 int top_k, int n_experts, int hidden, int inter,
				 const struct moe_small_shared &sh, float *out)
{
	small_down_kernel<MQ_BF16><<<hidden / SM_DCOLS, SM_THREADS, 0, s>>>(
		expert_w, moe_wq{}, act, ids, weights, M, top_k, n_experts, hidden, inter, sh, 1, out);
}
