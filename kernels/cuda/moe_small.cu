// The routed experts at small batch (M * top_k <= 64 (row, slot) pairs), where every
// kernel is latency-bound: two launches instead of plan, gate/up, down and combine.
// This file: the down kernel and the launcher; gate/up is moe_small_gate_up.cu, the
// helpers both use moe_small.cuh.
//
// gate/up: one wave of CTAs shares the (used expert, feature) rows evenly and writes
// silu(gate x) * up x per pair (see its file).
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
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/k_cuda_moe.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe_internal.h"
#include "kernels/cuda/moe_small.cuh"

namespace {	// kernels and their helpers stay private to this file

// Item q of small_down_kernel's CTA: (used expert, column pair) below n_routed, then
// (shared piece, column pair). Every item's columns lie inside hidden (a multiple of
// SM_DCOLS: k_cuda_moe_small_fits). ys (MOE_SMALL_MAX_PAIRS, SM_DCOLS), yss
// (MOE_SMALL_SH_PIECES, MOE_SMALL_MAX_PAIRS, SM_DCOLS); used_w (sp.n_used) the used
// experts' down matrices.
__device__ __forceinline__ dot_job down_job_of(int q, int n_routed, const small_plan &sp,
					       const uint16_t *const *used_w, const float *act,
					       const moe_small_shared &sh, int M, int c0, int inter,
					       float *ys, float *yss)
{
	int cps = SM_DCOLS / 2, cp = q % cps, c = c0 + 2 * cp;
	dot_job j;

	j.div = 1;
	j.dst_ld = SM_DCOLS;
	if (q < n_routed) {
		int u = q / cps;
		const uint16_t *w = used_w[u] + (size_t)c * inter;

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
		  moe_small_shared sh, int add, int ahead, float *out)
{
	extern __shared__ uint4 stages[];	// STAGED: (SM_WARPS, 2, inter / 8)
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

	prefetch_down_before_wait(expert_w, ids, n, E, sh, c0, hidden, inter, pre_w);
	// The plan before the wait: launched right after gate/up, this kernel starts only
	// once every gate/up CTA has passed its own wait, so the kernel that wrote ids and
	// weights has completed (see m1_down_kernel). The activations come after the wait.
	if (threadIdx.x < n)
		sw[threadIdx.x] = __ldcg(weights + threadIdx.x);
	small_plan_build(sp, ids, n, E);	// its barriers publish sw too
	// Every used expert's matrix looked up at once: one round trip for the CTA where
	// each warp would otherwise wait on one per item of a new expert.
	if (threadIdx.x < sp.n_used)
		used_w[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x] + 2];
	k_cuda_pdl_wait();	// and a barrier after it: used_w is published
	__syncthreads();

	n_routed = sp.n_used * cps;
	n_all = n_routed + pieces * cps;
	// Jobs are rebuilt where used (a few shared-memory reads), not held: registers
	// go to the weights.
	auto job = [&](int q) {
		return down_job_of(q, n_routed, sp, used_w, act, sh, M, c0, inter, &ys[0][0],
				   &yss[0][0][0]);
	};
	if (STAGED) {
		// The warp's items alternate: even ones through its shared-memory stage
		// (cp.async), odd ones through registers, each in flight while the warp dots
		// the other, so two items' rows stream per warp.
		int ncm = inter / 8;
		uint4 *mine = stages + (size_t)warp * 2 * ncm;	// the warp's stage: two rows

		if (warp < n_all)
			job_issue(job(warp), mine, ncm, lane);
		cp_async_commit();
		for (int q = warp; q < n_all; q += 2 * SM_WARPS) {	// warp-uniform
			bool odd = q + SM_WARPS < n_all;
			uint4 wa[SM_KB], wb[SM_KB];

			if (odd)
				job_load(job(q + SM_WARPS), wa, wb, lane);
			cp_async_wait<0>();	// item q's rows are in the stage
			job_run_staged<false>(job(q), mine, ncm, lane);
			if (q + 2 * SM_WARPS < n_all)	// the stage is free again
				job_issue(job(q + 2 * SM_WARPS), mine, ncm, lane);
			cp_async_commit();
			if (odd)
				job_run_loaded<false>(job(q + SM_WARPS), wa, wb, lane);
		}
		cp_async_wait<0>();
	} else {
		// ahead: the warp's next two items' rows are asked of L2 while it dots this
		// one, so each item's loads wait on L2 rather than HBM (one item in registers
		// at a time: no room for a second).
		if (ahead && warp + SM_WARPS < n_all)
			job_prefetch(job(warp + SM_WARPS), lane);
		for (int q = warp; q < n_all; q += SM_WARPS) {
			if (ahead && q + 2 * SM_WARPS < n_all)
				job_prefetch(job(q + 2 * SM_WARPS), lane);
			down_job_run(job(q), lane);
		}
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
	return moe_small_gate_up_setup() || moe_small_m1_setup() ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_down_kernel<true>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						SM_DSTAGE_SMEM_MAX)) ? -EIO : 0;
}

// KDEC_MOE_GATE_STAGED=1, KDEC_MOE_DOWN_STAGED=1: that kernel also streams weight rows
// through a shared-memory stage (two items in flight per warp). Off by default: timed
// on H200 (V2-Lite with its shared expert, tests/test_cuda_moe) the staged pair took
// 63.1 us at batch 1 and 582 at batch 8 against 50.9 and 352 for registers only.
// -1: not read yet.
static int gate_staged = -1, down_staged = -1;

// KDEC_MOE_PREFETCH_AHEAD=1: the register-path kernels ask L2 for their next rows
// ahead of time (see small_down_kernel). Off by default: on H200 it cost V2-Lite batch 1
// 3.213 ms a step against 2.856 without (Qwen3 4.036 against 3.823; likely the prefetches
// take HBM slots from the demand loads of the same step); -1: not read yet.
static int prefetch_ahead = -1;

extern "C" void k_cuda_moe_set_prefetch_ahead(int on)
{
	prefetch_ahead = on < 0 ? -1 : on != 0;
}

static bool ahead_on(void)
{
	return moe_env_flag(&prefetch_ahead, "KDEC_MOE_PREFETCH_AHEAD", 0);
}

// KDEC_MOE_M1=0: a single row (M = 1) takes the general register kernels rather
// than moe_small_m1.cu's pipelined pair (same results bit for bit); -1: not read yet.
static int m1_on = -1;

extern "C" void k_cuda_moe_set_m1(int on)
{
	m1_on = on < 0 ? -1 : on != 0;
}

extern "C" void k_cuda_moe_set_staged(int on)
{
	gate_staged = down_staged = on < 0 ? -1 : on != 0;
}

// Whether a kernel streams rows of len values through a shared-memory stage besides
// its registers: where turned on and where a row fits the lane's registers in one go
// (len <= 32 * SM_KB * 8 = 2048) and the stages fit their budget.
static bool use_staged(int *v, const char *name, int len)
{
	return moe_env_flag(v, name, 0) && len / 8 <= 32 * SM_KB &&
	       moe_small_stage_bytes(len) <= SM_DSTAGE_SMEM_MAX;
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
	int rp = SM_X_SMEM_MAX / (hidden * (int)sizeof(float)), ahead = ahead_on();
	int ret;

	rp = rp < M ? rp : M;
	// A failed launch is also the runtime's last error, which K_CUDA_LAUNCHED reports.
	ctas = ctas < most ? ctas : (int)most;
	if (M == 1 && moe_env_flag(&m1_on, "KDEC_MOE_M1", 1) &&
	    !use_staged(&gate_staged, "KDEC_MOE_GATE_STAGED", hidden) &&
	    !use_staged(&down_staged, "KDEC_MOE_DOWN_STAGED", inter) &&
	    moe_small_m1_fits(top_k, n_experts, hidden, inter, sh.inter)) {
		moe_small_m1_launch(s, ctas, expert_w, x, ids, weights, top_k, n_experts, hidden,
				    inter, act, sh, add, out);
		return K_CUDA_LAUNCHED("moe small m1");
	}
	moe_small_gate_up_launch(s, use_staged(&gate_staged, "KDEC_MOE_GATE_STAGED", hidden), ctas,
				 rp, ahead, expert_w, x, ids, n, top_k, n_experts, hidden, inter, act,
				 sh);
	if ((ret = K_CUDA_LAUNCHED("moe small gate/up")))
		return ret;
	if (use_staged(&down_staged, "KDEC_MOE_DOWN_STAGED", inter))
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS),
				  moe_small_stage_bytes(inter), small_down_kernel<true>, expert_w,
				  (const float *)act, ids, weights, M, top_k, n_experts, hidden, inter,
				  sh, add, ahead, out);
	else
		k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), 0,
				  small_down_kernel<false>, expert_w, (const float *)act, ids, weights,
				  M, top_k, n_experts, hidden, inter, sh, add, ahead, out);
	return K_CUDA_LAUNCHED("moe small down");
}
