// The small-batch MoE kernels, second form (KDEC_MOE_SMALL_V2, on by default): the
// same items, the same per-pair dot products in the same order as moe_small_gate_up.cu
// and moe_small.cu (bit for bit), but each warp streams its weight rows through a ring
// of nst shared-memory stages filled by bulk copies (cp.async.bulk, one lane issues,
// an mbarrier per stage counts the bytes). Why: the first form held a row's loads in
// registers (128 a thread at two CTAs per SM: gate/up spilled) and issued the next
// item's loads only after the last item's arithmetic, so an SM had ~1 item per warp
// in flight and sat at 36-56% of HBM bandwidth. Here a warp always has nst - 1 items
// in flight while it dots one (gate/up at V2-Lite batch 1: 8 warps x 2 x 8 KB = 128 KB
// per SM besides the stage in use; Little's law wants ~48 KB per SM), and the copies
// cost no registers and one instruction per row.
//
// Both kernels start their shared-expert items into the stages before the PDL wait
// (the weights are constants; the ids are not final yet), so HBM is busy while the
// router finishes and while each CTA derives its plan.
//
// gate/up: one CTA per SM (the ring takes most of the shared memory), each with an
// even share of the shared expert's rows and of the routed (slot, feature) rows; x
// is staged in shared memory once, each row's 8-value
// chunks split into a lo half and a hi half so that the lanes' 16-byte reads are
// consecutive (the first form's stride of 32 bytes was a 2-way bank conflict).
// down: the first form's grid (SM_DCOLS columns per CTA, two CTAs per SM), its items
// (the shared expert's first), its L2 hints before the PDL wait and its final sums,
// with the ring in place of the cp.async stage and the register item.
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe_internal.h"
#include "kernels/cuda/moe_small.cuh"

namespace {	// kernels and their helpers stay private to this file

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void v2_mbar_init(uint64_t *bar)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

// The barrier inits, visible to the async proxy (the bulk copies).
__device__ __forceinline__ void v2_mbar_init_fence()
{
	asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void v2_mbar_wait(uint64_t *bar, unsigned parity)
{
	uint32_t done;

	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n}"
			     : "=r"(done)
			     : "r"(smem_u32(bar)), "r"(parity)
			     : "memory");
	} while (!done);
}

// bytes (a multiple of 16, both ends 16-byte aligned) from src to the stage dst,
// counted on bar.
__device__ __forceinline__ void v2_bulk(void *dst, const void *src, unsigned bytes, uint64_t *bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
		     " [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
		     "l"(src), "r"(bytes), "r"(smem_u32(bar))
		     : "memory");
}

// One lane: the job's two rows (nc chunks each) into stage (rows at stage and stage +
// ncm), completing bar's phase. The fence orders the warp's reads of the stage's last
// contents (generic proxy, done: __syncwarp before) before the copy's writes.
__device__ __forceinline__ void v2_issue(const dot_job &j, uint4 *stage, int ncm, uint64_t *bar)
{
	unsigned bytes = (unsigned)j.nc * 16;

	asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
		     "r"(2 * bytes)
		     : "memory");
	v2_bulk(stage, j.w0, bytes, bar);
	v2_bulk(stage + ncm, j.w1, bytes, bar);
}

// job_run_staged with the fp32 rows read as XPERM lays them: XPERM, a staged x row
// whose chunk c is at src[off + c] (values 0-3) and src[off + nc + c] (4-7); else the
// natural layout (src[off + 2c], src[off + 2c + 1]). The lane's chunks in dot2_rows's
// order, so the same sums bit for bit.
template <bool GATE, bool XPERM>
__device__ __forceinline__ void v2_run(const dot_job &j, const uint4 *stage, int ncm, int lane)
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
				lo = j.src[off[r] + (XPERM ? c : 2 * c)];
				hi = j.src[off[r] + (XPERM ? j.nc + c : 2 * c + 1)];
				fma8(a0[r], wa, lo, hi);
				fma8(a1[r], wb, lo, hi);
			}
		}
		job_store<GATE>(j, p0, np, a0, a1, lane);
	}
}

// The warp's items t = first, first + SM_WARPS, ... below rows through its ring (nst
// stages of two rows of ncm chunks at ring, barriers bars); job(t) rebuilds item t.
// The first min(nst, count) items were issued already (v2_prime).
template <bool GATE, bool XPERM, typename Job>
__device__ __forceinline__ void v2_ring(Job job, int first, int rows, uint4 *ring, uint64_t *bars,
					int nst, int ncm, int lane)
{
	int k = 0;

	for (int t = first; t < rows; t += SM_WARPS, k++) {	// warp-uniform
		int s = k % nst;
		uint4 *stage = ring + (size_t)s * 2 * ncm;

		v2_mbar_wait(&bars[s], (unsigned)(k / nst) & 1);
		v2_run<GATE, XPERM>(job(t), stage, ncm, lane);
		__syncwarp();	// every lane is done with the stage
		if (lane == 0 && t + nst * SM_WARPS < rows)
			v2_issue(job(t + nst * SM_WARPS), stage, ncm, &bars[s]);
	}
}

// Lane 0 issues the warp's first items (t = first + k SM_WARPS, k < nst) that lie in
// [begin, end), item k into stage k: before the PDL wait those that need no ids
// (begin 0, end the shared expert's items), after it the rest.
template <typename Job>
__device__ __forceinline__ void v2_prime(Job job, int first, int begin, int end, uint4 *ring,
					 uint64_t *bars, int nst, int ncm, int lane)
{
	if (lane == 0)
		for (int k = 0; k < nst && first + k * SM_WARPS < end; k++)
			if (first + k * SM_WARPS >= begin)
				v2_issue(job(first + k * SM_WARPS), ring + (size_t)k * 2 * ncm, ncm,
					 &bars[k]);
}

// The warp's barriers, initialised by its lane 0 (made visible by a later
// __syncthreads: small_plan_build's).
__device__ __forceinline__ void v2_bars_init(uint64_t *bars, int nst, int lane)
{
	if (lane == 0) {
		for (int s = 0; s < nst; s++)
			v2_mbar_init(&bars[s]);
		v2_mbar_init_fence();
	}
}

// small_gate_up_kernel's work (gate_up_job_of's rows) through per-warp rings, split
// over the grid as two even shares, the shared expert's (known before the PDL wait)
// and the routed rows'. Dynamic shared memory: the M = n / top_k x
// rows (hidden / 4 float4 each, chunk c's lo half at c, hi half at hidden / 8 + c),
// then the rings (SM_WARPS, nst, 2, hidden / 8) uint4.
__global__ void __launch_bounds__(SM_THREADS, 1)
small_gate_up_v2_kernel(const uint16_t *const *expert_w, const float *x, const int32_t *ids,
			int n, int top_k, int E, int hidden, int inter, int nst, float *act,
			moe_small_shared sh)
{
	extern __shared__ uint4 gdyn[];
	__shared__ small_plan sp;
	__shared__ uint64_t bars[SM_WARPS][MOE_SMALL_V2_MAX_ST];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ncm = hidden / 8, M = n / top_k;
	int G = gridDim.x, b = blockIdx.x;
	int sa = (int)((long long)sh.inter * b / G), ns = (int)((long long)sh.inter * (b + 1) / G) - sa;
	float4 *xs = (float4 *)gdyn;
	uint4 *ring = gdyn + (size_t)M * 2 * ncm + (size_t)warp * nst * 2 * ncm;
	long long Wr = 0, ra = 0;
	int rows;

	// The CTA's rows t: its share of the shared expert's features first (sa + t, t <
	// ns: known before the wait), then its share of the routed (slot, feature) rows
	// (gate_up_job_of's position ra + t - ns).
	auto job = [&](int t) {
		dot_job j = t < ns ? gate_up_job_of(sa + t, 0, sp, expert_w, x, sh, n, top_k, hidden,
						    inter, act)
				   : gate_up_job_of(ra + t - ns, Wr, sp, expert_w, x, sh, n, top_k,
						    hidden, inter, act);

		j.src = xs;	// the staged rows: row m at m * hidden / 4, as in x
		return j;
	};
	v2_bars_init(bars[warp], nst, lane);
	// Launched early under PDL, while the router still picks the experts: the shared
	// expert's rows do not depend on its choice, so they start into the stages now.
	v2_prime(job, warp, 0, ns, ring, bars[warp], nst, ncm, lane);
	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	Wr = (long long)sp.n_used * inter;
	ra = Wr * b / G;
	rows = ns + (int)(Wr * (b + 1) / G - ra);
	v2_prime(job, warp, ns, rows, ring, bars[warp], nst, ncm, lane);
	for (int q = threadIdx.x; q < M * ncm; q += SM_THREADS) {
		int m = q / ncm, c = q % ncm;
		const float4 *xr = (const float4 *)(x + (size_t)m * hidden);

		xs[(size_t)m * 2 * ncm + c] = xr[2 * c];
		xs[(size_t)m * 2 * ncm + ncm + c] = xr[2 * c + 1];
	}
	__syncthreads();
	v2_ring<true, true>(job, warp, rows, ring, bars[warp], nst, ncm, lane);
}

// small_down_kernel<STAGED> with the warp's items through its ring (nst stages of two
// inter-long rows: dynamic shared memory (SM_WARPS, nst, 2, inter / 8) uint4). Grid,
// items (the shared pieces first), L2 hints and sums as there.
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
small_down_v2_kernel(const uint16_t *const *expert_w, const float *act, const int32_t *ids,
		     const float *weights, int M, int top_k, int E, int hidden, int inter, int nst,
		     moe_small_shared sh, int add, float *out)
{
	extern __shared__ uint4 ddyn[];
	__shared__ small_plan sp;
	__shared__ uint64_t bars[SM_WARPS][MOE_SMALL_V2_MAX_ST];
	__shared__ float ys[MOE_SMALL_MAX_PAIRS][SM_DCOLS];
	__shared__ float yss[MOE_SMALL_SH_PIECES][MOE_SMALL_MAX_PAIRS][SM_DCOLS];
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];
	__shared__ const uint16_t *pre_w[MOE_SMALL_MAX_PAIRS];
	__shared__ const uint16_t *used_w[MOE_SMALL_MAX_PAIRS];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = M * top_k, ncm = inter / 8;
	int c0 = blockIdx.x * SM_DCOLS, cps = SM_DCOLS / 2;
	int pieces = (sh.inter + inter - 1) / inter, n_routed, n_all;
	size_t row_bytes = (size_t)inter * 2;
	uint4 *ring = ddyn + (size_t)warp * nst * 2 * ncm;

	// The CTA's items q: the shared expert's (piece, column pair) first (q < n_sh:
	// known before the wait), then (used expert, column pair) (down_job_of's q - n_sh).
	int n_sh = pieces * cps;
	auto job = [&](int q) {
		return q < n_sh ? down_job_of(q, 0, sp, used_w, act, sh, M, c0, inter, &ys[0][0],
					      &yss[0][0][0])
				: down_job_of(q - n_sh, n_routed, sp, used_w, act, sh, M, c0, inter,
					      &ys[0][0], &yss[0][0][0]);
	};

	n_routed = 0;
	v2_bars_init(bars[warp], nst, lane);
	// Launched early under PDL: the shared expert's rows start into the stages now;
	// the rows the ids (maybe not final yet) name are asked of L2, as small_down_kernel.
	v2_prime(job, warp, 0, n_sh, ring, bars[warp], nst, ncm, lane);
	{
		int lines = (int)((row_bytes + 127) / 128);
		// the whole budget: the shared rows go to the stages, not to L2
		int pairs = min(n, (int)(SM_DPREFETCH / (row_bytes * SM_DCOLS)));

		if (threadIdx.x < pairs) {
			int v = __ldcg(ids + threadIdx.x);

			pre_w[threadIdx.x] = v >= 0 && v < E ? expert_w[3 * v + 2] : nullptr;
		}
		__syncthreads();
		for (int q = threadIdx.x; q < pairs * SM_DCOLS * lines; q += SM_THREADS) {
			int i = q / (SM_DCOLS * lines), col = c0 + q / lines % SM_DCOLS;
			const uint16_t *w = pre_w[i];

			if (w && col < hidden)
				prefetch_l2((const char *)(w + (size_t)col * inter) +
						    (size_t)(q % lines) * 128, 1, 0, 1);
		}
	}
	k_cuda_pdl_wait();
	if (threadIdx.x < n)
		sw[threadIdx.x] = weights[threadIdx.x];
	small_plan_build(sp, ids, n, E);
	if (threadIdx.x < sp.n_used)
		used_w[threadIdx.x] = expert_w[3 * sp.used_e[threadIdx.x] + 2];
	__syncthreads();

	n_routed = sp.n_used * cps;
	n_all = n_sh + n_routed;
	v2_prime(job, warp, n_sh, n_all, ring, bars[warp], nst, ncm, lane);
	v2_ring<false, false>(job, warp, n_all, ring, bars[warp], nst, ncm, lane);
	__syncthreads();

	// small_down_kernel's sums, in its order.
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

// Both want the largest shared-memory carve-out (gate/up: one CTA of ~218 KB per SM;
// down: two of ~110 KB), not whatever split the driver would pick.
int moe_small_v2_setup(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_v2_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						MOE_SMALL_V2_GU_SMEM)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_gate_up_v2_kernel,
						cudaFuncAttributePreferredSharedMemoryCarveout,
						cudaSharedmemCarveoutMaxShared)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_down_v2_kernel,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						MOE_SMALL_V2_DOWN_SMEM)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(small_down_v2_kernel,
						cudaFuncAttributePreferredSharedMemoryCarveout,
						cudaSharedmemCarveoutMaxShared)) ? -EIO : 0;
}

// Stages per warp: as many as fit the budget after fixed bytes, at most
// MOE_SMALL_V2_MAX_ST; under 2 (no copy in flight while the warp dots) the caller
// takes the first form.
static int v2_stages(size_t budget, size_t fixed, int len)
{
	size_t level = (size_t)SM_WARPS * 2 * (size_t)len * 2;	// one stage of every warp
	size_t st = fixed < budget ? (budget - fixed) / level : 0;

	return st < MOE_SMALL_V2_MAX_ST ? (int)st : MOE_SMALL_V2_MAX_ST;
}

int moe_small_v2_gate_up_stages(int M, int hidden)
{
	return v2_stages(MOE_SMALL_V2_GU_SMEM, (size_t)M * hidden * sizeof(float), hidden);
}

int moe_small_v2_down_stages(int inter)
{
	return v2_stages(MOE_SMALL_V2_DOWN_SMEM, 0, inter);
}

void moe_small_v2_gate_up_launch(cudaStream_t s, int ctas, int nst,
				 const uint16_t *const *expert_w, const float *x,
				 const int32_t *ids, int n, int top_k, int n_experts, int hidden,
				 int inter, float *act, const struct moe_small_shared &sh)
{
	size_t smem = (size_t)(n / top_k) * hidden * sizeof(float) +
		      (size_t)SM_WARPS * nst * 2 * (hidden / 8) * sizeof(uint4);

	k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), smem, small_gate_up_v2_kernel, expert_w,
			  x, ids, n, top_k, n_experts, hidden, inter, nst, act, sh);
}

void moe_small_v2_down_launch(cudaStream_t s, int nst, const uint16_t *const *expert_w,
			      const float *act, const int32_t *ids, const float *weights, int M,
			      int top_k, int n_experts, int hidden, int inter,
			      const struct moe_small_shared &sh, int add, float *out)
{
	size_t smem = (size_t)SM_WARPS * nst * 2 * (inter / 8) * sizeof(uint4);

	k_cuda_launch_pdl(s, dim3(hidden / SM_DCOLS), dim3(SM_THREADS), smem, small_down_v2_kernel,
			  expert_w, act, ids, weights, M, top_k, n_experts, hidden, inter, nst, sh,
			  add, out);
}
