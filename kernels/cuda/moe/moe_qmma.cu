// Quantized routed experts (fp8, int4) at small batch (M * top_k <= 64 pairs) on the
// tensor cores: two launches, gate/up + SwiGLU and down, the small path's plan and
// order of sums, each k step of 16 weight rows dequantized in registers and multiplied
// with mma.m16n8k16 (moe_qmma.cuh: the fragment layout, the split activations).
// k_cuda_tuning()->moe_qmma (KDEC_MOE_QMMA=1) picks it where moe_qmma_fits; the CUDA-core
// kernels (moe_small*.cu) stay the fall-back.
//
// Counted (per lane; round 3's SASS in docs/PERFORMANCE.md): the CUDA-core dots cost
// 3.0 (fp8) and 3.8 (int4) warp instructions a value, each product's x read from shared
// memory and multiplied on a CUDA core. Here, planned before it was written: the
// conversion (fp8: 2 cvt a word of 4 values, 0.5 a value; int4: k_dq_i4x8_raw, 9 a word
// of 8, 1.1 a value), one MMA per 256 values of the warp and pair, one LDS.128 of B per
// 2 MMAs (8 lanes), 3 fp32 operations per 16 values (the partial sums scaled once).
// Then read off the SASS of one step of mqm_step (sm_90a), gate/up at one pair: fp8 ~67
// instructions for 64 values (32 F2FP, 8 HMMA, 3 LDS, 12 FADD/FMUL/FFMA), int4 ~205 for
// 128 (144 LOP3/HADD2/HFMA2/SHF, 16 HMMA, 6 LDS, 24 fp32): 1.05 and 1.6 a value, ~1.7
// and ~1.9 with each unit's weight loads, scales and cursor (estimated, ~40 a unit); a
// further pair of the same expert ~+0.35. Shared memory: gate/up's B is 0.125 B a weight
// value (2 B before: the fp32 x of every value), conflict-free; down's B comes from L2,
// 4 B an activation per CTA, as the fp32 activations did.
//
// gate/up: one wave of CTAs shares the items (group of pairs, 16-feature tile) evenly;
// the 8 warps split each item's k steps (warp w: steps w, w + 8, ...), each warp's
// steps a pipeline of register units (moe_small_m1.cuh's unit_stream), the partial sums
// reduced in shared memory in a fixed order, then silu(gate) * up written as down's B
// (split, with its factors) straight into act. x rows of a group's pairs are staged
// split in shared memory (again only where the group's rows differ from the last).
// down: a CTA owns 16 output columns of every row; its warps split each group's k
// steps and leave each pair's sums per warp in shared memory; then each row's pairs are
// summed in increasing (expert id, pair) order, the small path's epilogue.
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_qmma.cuh"
#include "kernels/cuda/moe/moe_small_m1.cuh"

#define MQM_X_SMEM SM_X_SMEM_MAX	// gate/up: bytes of split x rows per CTA

static_assert(M1_UC == 4, "a unit is 4 chunks: 2 tiles (or steps) x rows g, g + 8");

namespace {	// kernels and their helpers stay private to this file

// The warp's partial sums acc[p][r] (lane chunks) summed over the quad's 4 lanes in a
// fixed order; every lane of the quad gets the sum.
template <int R>
__device__ __forceinline__ void mqm_quad_sum(float (&acc)[MQM_NPP][R])
{
#pragma unroll
	for (int p = 0; p < MQM_NPP; p++)
#pragma unroll
		for (int r = 0; r < R; r++) {
			acc[p][r] += __shfl_xor_sync(0xffffffffu, acc[p][r], 1);
			acc[p][r] += __shfl_xor_sync(0xffffffffu, acc[p][r], 2);
		}
}

// Where unit k of a warp's stream is: item it (group q, tile x), unit j of the item's
// nui. load and consume each walk k = 0, 1, 2, ... in turn, so each keeps a cursor and
// steps it (no division a unit).
struct mqm_cur {
	int it, q, x, j;
};

__device__ __forceinline__ void mqm_cur_next(mqm_cur &c, int nui, int T)
{
	if (++c.j < nui)
		return;
	c.j = 0;
	c.it++;
	if (++c.x == T) {
		c.x = 0;
		c.q++;
	}
}

// Grid: one wave. Items (group q, tile f0 = 16 x) for q < gr.n, x < inter / 16; CTA b
// takes [W b / G, W (b + 1) / G). Dynamic shared memory: qp split x rows (hidden / 4
// units each), then their factors (hidden / 16 fp32 each). act (n, inter): each pair's
// silu(gate x) * up x split as down's B (moe_qmma.cuh), fac (n, inter / 16) its factors.
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
mqm_gate_up_kernel(const uint16_t *const *expert_w, moe_wq wq, const float *x, const int32_t *ids,
		  int n, int top_k, int E, int hidden, int inter, int qp, uint4 *act, float *fac)
{
	extern __shared__ uint4 mqm_xs[];
	__shared__ small_plan sp;
	__shared__ mqm_groups gr;
	__shared__ const uint4 *used_w[MOE_SMALL_MAX_PAIRS][2];	// used expert's gate, up
	__shared__ const void *used_s[MOE_SMALL_MAX_PAIRS][2];		// and their scales
	__shared__ float red[2][MQM_NPP][2][16][SM_WARPS];	// item's sums by warp (2 items)
	__shared__ float vt[MQM_NPP][16];			// the tile's SwiGLU values
	constexpr int VPC = MQ_VPC(F);
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const int nc = hidden / VPC, S = nc / MQM_CHUNKS, NUI = (S + SM_WARPS - 1) / SM_WARPS;
	const int T = inter / 16, xu = hidden / 4, xg = hidden / MQM_FG;
	float *xf = (float *)(mqm_xs + (size_t)qp * xu);
	int items, lo, hi, K;
	mqm_cur lc, cc;		// load's and consume's units

	k_cuda_pdl_wait();
	small_plan_build(sp, ids, n, E);
	if (threadIdx.x < sp.n_used) {
		int e = sp.used_e[threadIdx.x];

		for (int m = 0; m < 2; m++) {
			used_w[threadIdx.x][m] = (const uint4 *)expert_w[3 * e + m];
			used_s[threadIdx.x][m] = wq.scales[3 * e + m];
		}
	}
	mqm_groups_build(gr, sp, qp);	// its barrier publishes used_w, used_s
	items = gr.n * T;	// <= 64 * inter / 16
	lo = (int)((long long)items * blockIdx.x / gridDim.x);
	hi = (int)((long long)items * (blockIdx.x + 1) / gridDim.x);
	K = (hi - lo) * NUI;	// the same for every warp: the barriers line up
	lc = mqm_cur{ lo, lo / T, lo % T, 0 };
	cc = lc;

	uint4 wa[M1_UC], wb[M1_UC], na[M1_UC], nb[M1_UC];	// na, nb: unit_stream's 2nd rows, unused
	float sa[4], sb[4];		// the units' scales (a: even units, b: odd)
	float acc[MQM_NPP][4];		// pair p: gate rows g, g + 8, up rows g, g + 8
	uint4 bu[MQM_NPP];		// B units (zero at the lanes that never load them)

#pragma unroll
	for (int p = 0; p < MQM_NPP; p++) {
		bu[p] = make_uint4(0, 0, 0, 0);
#pragma unroll
		for (int r = 0; r < 4; r++)
			acc[p][r] = 0.0f;
	}

	// Unit k: step s of item lo + k / NUI (nothing where s >= S).
	auto load = [&](int k, uint4 *w, uint4 *) {
		int q = lc.q, f0 = lc.x * 16, s = warp + SM_WARPS * lc.j;
		int u = gr.u[q], c = MQM_CHUNKS * s + t;

		mqm_cur_next(lc, NUI, T);
		if (s >= S)
			return;
#pragma unroll
		for (int m = 0; m < 2; m++)
#pragma unroll
			for (int r = 0; r < 2; r++) {
				int row = f0 + g + 8 * r;
				float v = mq_scale(mq_row_of(wq, used_s[u][m], m, row), c * VPC);

				w[2 * m + r] = __ldcs(used_w[u][m] + (size_t)row * nc + c);
				if (k & 1)	// branches, not a pointer: sa, sb stay in registers
					sb[2 * m + r] = v;
				else
					sa[2 * m + r] = v;
			}
	};
	// Whether group q's pairs dot the same x rows as group o's (o < 0: none staged).
	auto same_rows = [&](int q, int o) {
		if (o < 0 || gr.np[q] != gr.np[o])
			return false;
		for (int j = 0; j < gr.np[q]; j++)
			if (mqm_pair(gr, sp, q, j) / top_k != mqm_pair(gr, sp, o, j) / top_k)
				return false;
		return true;
	};
	// Group q's x rows, split, into the slots (the whole CTA).
	auto stage = [&](int q) {
		for (int i = threadIdx.x; i < gr.np[q] * xg; i += SM_THREADS) {
			int j = i / xg, k0 = i % xg * MQM_FG;
			const float4 *src = (const float4 *)(x + (size_t)(mqm_pair(gr, sp, q, j) / top_k) *
								 hidden + k0);
			float v[16];

#pragma unroll
			for (int e = 0; e < 4; e++) {
				float4 f = src[e];

				v[4 * e] = f.x;
				v[4 * e + 1] = f.y;
				v[4 * e + 2] = f.z;
				v[4 * e + 3] = f.w;
			}
			mqm_put16<F>(mqm_xs + (size_t)j * xu, xf + (size_t)j * xg, k0, v);
		}
		__syncthreads();
	};
	// Item it's end: the warps' sums by pair into red, then per pair and feature the
	// sums of the warps in order, SwiGLU, and the tile into act as down's B.
	auto finish = [&](int it, int q, int f0) {
		int buf = (it - lo) & 1, np = gr.np[q];

		mqm_quad_sum(acc);
		if (t == 0)
#pragma unroll
			for (int p = 0; p < MQM_NPP; p++)	// unrolled: acc stays in registers
				if (p < np)
#pragma unroll
				for (int m = 0; m < 2; m++)
#pragma unroll
					for (int r = 0; r < 2; r++)
						red[buf][p][m][g + 8 * r][warp] = acc[p][2 * m + r];
#pragma unroll
		for (int p = 0; p < MQM_NPP; p++)
#pragma unroll
			for (int r = 0; r < 4; r++)
				acc[p][r] = 0.0f;
		__syncthreads();	// red[buf] complete (and red[buf ^ 1] read two items ago)
		if (threadIdx.x < MQM_NPP * 16) {	// whole warps: a pair's 16 lanes in one
			int j = threadIdx.x / 16, r = threadIdx.x % 16;

			if (j < np) {
				float gs = red[buf][j][0][r][0], us = red[buf][j][1][r][0];

				for (int w = 1; w < SM_WARPS; w++) {
					gs = __fadd_rn(gs, red[buf][j][0][r][w]);
					us = __fadd_rn(us, red[buf][j][1][r][w]);
				}
				vt[j][r] = silu_mul(gs, us);
			}
			__syncwarp();
			if (r == 0 && j < np) {
				int i = mqm_pair(gr, sp, q, j);
				float v[16];

#pragma unroll
				for (int e = 0; e < 16; e++)
					v[e] = vt[j][e];
				mqm_put16<F>(act + (size_t)i * (inter / 4), fac + (size_t)i * (inter / MQM_FG),
					    f0, v);
			}
		}
	};
	auto consume = [&](int k, const uint4 *w, const uint4 *) {
		int it = cc.it, j = cc.j, q = cc.q, f0 = cc.x * 16, s = warp + SM_WARPS * j;

		// A new group: its x rows, unless the last group's were the same (M = 1: once).
		// The last item's barrier (finish) has passed: no warp reads the slots.
		mqm_cur_next(cc, NUI, T);
		if (j == 0 && (it == lo || f0 == 0) && !same_rows(q, it == lo ? -1 : q - 1))
			stage(q);
		if (s < S) {
			mqm_bsrc b;

			b.row = mqm_xs;
			b.fac = xf;
			b.np = gr.np[q];
#pragma unroll
			for (int p = 0; p < MQM_NPP; p++)
				b.off[p] = p * xu;	// slot p's factors: xf + p * xg = xf + off / 4
			if (k & 1)
				mqm_step<F, 2, false>(w, sb, s, b, acc, bu, lane);
			else
				mqm_step<F, 2, false>(w, sa, s, b, acc, bu, lane);
		}
		if (j == NUI - 1)
			finish(it, q, f0);
	};
	unit_prime(K, wa, na, wb, nb, load);
	unit_stream(K, wa, na, wb, nb, load, consume);
}

// Grid (hidden / 16): CTA b owns output columns 16 b .. 16 b + 15 of every row. Items:
// the groups (MQM_NPP pairs at most) of every used expert; each warp takes steps w, w +
// 8 of each (2 steps a unit). Then each row's pairs in increasing (expert id, pair)
// order, products rounded, as small_down_kernel sums them; add: out += that.
template <int F>
__global__ void __launch_bounds__(SM_THREADS, SM_CTAS_PER_SM)
mqm_down_kernel(const uint16_t *const *expert_w, moe_wq wq, const uint4 *act, const float *fac,
	       const int32_t *ids, const float *weights, int M, int top_k, int E, int hidden,
	       int inter, int add, float *out)
{
	__shared__ small_plan sp;
	__shared__ mqm_groups gr;
	__shared__ float red[MOE_SMALL_MAX_PAIRS][16][SM_WARPS];	// pair's columns by warp
	__shared__ float sw[MOE_SMALL_MAX_PAIRS];			// pair's routing weight
	__shared__ const uint4 *used_w[MOE_SMALL_MAX_PAIRS];		// used expert's down
	__shared__ const void *used_s[MOE_SMALL_MAX_PAIRS];		// and its scales
	constexpr int VPC = MQ_VPC(F);
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const int nc = inter / VPC, S = nc / MQM_CHUNKS;
	const int NUI = (S + 2 * SM_WARPS - 1) / (2 * SM_WARPS);	// units a group a warp
	const int c0 = blockIdx.x * 16, n = M * top_k;
	int K;
	mqm_cur lc, cc;

	k_cuda_pdl_wait();
	if (threadIdx.x < n)
		sw[threadIdx.x] = weights[threadIdx.x];
	small_plan_build(sp, ids, n, E);	// its barriers publish sw
	if (threadIdx.x < sp.n_used) {
		int e = sp.used_e[threadIdx.x];

		used_w[threadIdx.x] = (const uint4 *)expert_w[3 * e + 2];
		used_s[threadIdx.x] = wq.scales[3 * e + 2];
	}
	mqm_groups_build(gr, sp, MQM_NPP);
	K = gr.n * NUI;
	lc = mqm_cur{ 0, 0, 0, 0 };	// it, x unused (one tile)
	cc = lc;

	uint4 wa[M1_UC], wb[M1_UC], na[M1_UC], nb[M1_UC];
	float sa[4], sb[4];
	float acc[MQM_NPP][2];		// pair p: rows g, g + 8
	uint4 bu[MQM_NPP];

#pragma unroll
	for (int p = 0; p < MQM_NPP; p++) {
		bu[p] = make_uint4(0, 0, 0, 0);
		acc[p][0] = acc[p][1] = 0.0f;
	}

	// Unit k: steps s0 and s0 + 8 of group k / NUI (rows g, g + 8 of each).
	auto load = [&](int k, uint4 *w, uint4 *) {
		int q = lc.q, s0 = warp + 2 * SM_WARPS * lc.j, u = gr.u[q];

		mqm_cur_next(lc, NUI, 1);

#pragma unroll
		for (int h = 0; h < 2; h++) {
			int s = s0 + SM_WARPS * h, c = MQM_CHUNKS * s + t;

			if (s >= S)
				break;
#pragma unroll
			for (int r = 0; r < 2; r++) {
				int row = c0 + g + 8 * r;

				float v = mq_scale(mq_row_of(wq, used_s[u], 2, row), c * VPC);

				w[2 * h + r] = __ldcs(used_w[u] + (size_t)row * nc + c);
				if (k & 1)
					sb[2 * h + r] = v;
				else
					sa[2 * h + r] = v;
			}
		}
	};
	auto consume = [&](int k, const uint4 *w, const uint4 *) {
		int q = cc.q, j = cc.j, s0 = warp + 2 * SM_WARPS * j;
		mqm_bsrc b;

		mqm_cur_next(cc, NUI, 1);

		b.row = act;
		b.fac = fac;
		b.np = gr.np[q];
#pragma unroll
		for (int p = 0; p < MQM_NPP; p++)	// < 64 * inter / 4: an int
			b.off[p] = mqm_pair(gr, sp, q, min(p, b.np - 1)) * (inter / 4);
#pragma unroll
		for (int h = 0; h < 2; h++) {
			int s = s0 + SM_WARPS * h;

			if (s >= S)
				break;
			if (k & 1)
				mqm_step<F, 1, true>(w + 2 * h, sb + 2 * h, s, b, acc, bu, lane);
			else
				mqm_step<F, 1, true>(w + 2 * h, sa + 2 * h, s, b, acc, bu, lane);
		}
		if (j == NUI - 1) {	// the group's sums of this warp, then fresh ones
			mqm_quad_sum(acc);
			if (t == 0)
#pragma unroll
				for (int p = 0; p < MQM_NPP; p++) {
					if (p >= b.np)
						break;
					red[mqm_pair(gr, sp, q, p)][g][warp] = acc[p][0];
					red[mqm_pair(gr, sp, q, p)][g + 8][warp] = acc[p][1];
				}
#pragma unroll
			for (int p = 0; p < MQM_NPP; p++)
				acc[p][0] = acc[p][1] = 0.0f;
		}
	};
	unit_prime(K, wa, na, wb, nb, load);
	unit_stream(K, wa, na, wb, nb, load, consume);
	__syncthreads();

	for (int q = threadIdx.x; q < M * 16; q += SM_THREADS) {
		int m = q / 16, col = q % 16;
		float a = 0.0f;

		for (int p = 0; p < sp.n_valid; p++) {
			int i = sp.sorted[p];

			if (i / top_k == m) {
				float y = red[i][col][0];

				for (int w = 1; w < SM_WARPS; w++)
					y = __fadd_rn(y, red[i][col][w]);
				a = __fadd_rn(a, __fmul_rn(y, sw[i]));
			}
		}
		if (add)
			a = __fadd_rn(out[(size_t)m * hidden + c0 + col], a);
		out[(size_t)m * hidden + c0 + col] = a;
	}
}

// Pairs of a group whose split x rows fit the gate/up kernel's shared memory.
int mqm_qp(int hidden)
{
	int qp = (int)(MQM_X_SMEM / ((size_t)hidden * 4 + (size_t)hidden / MQM_FG * 4));

	return qp < MQM_NPP ? qp : MQM_NPP;
}

template <int F>
void mqm_launch(cudaStream_t s, int ctas, const uint16_t *const *expert_w, const moe_wq &wq,
	       const float *x, const int32_t *ids, const float *weights, int M, int top_k,
	       int n_experts, int hidden, int inter, uint32_t *act, float *fac, int add, float *out)
{
	int qp = mqm_qp(hidden);
	size_t smem = (size_t)qp * ((size_t)hidden * 4 + (size_t)hidden / MQM_FG * 4);

	// Launch order: gate/up, then down at once; down reads nothing before its wait.
	k_cuda_launch_pdl(s, dim3(ctas), dim3(SM_THREADS), smem, mqm_gate_up_kernel<F>, expert_w,
			  wq, x, ids, M * top_k, top_k, n_experts, hidden, inter, qp, (uint4 *)act,
			  fac);
	if (cudaPeekAtLastError() != cudaSuccess)
		return;
	k_cuda_launch_pdl(s, dim3(hidden / 16), dim3(SM_THREADS), 0, mqm_down_kernel<F>, expert_w,
			  wq, (const uint4 *)act, (const float *)fac, ids, weights, M, top_k,
			  n_experts, hidden, inter, add, out);
}

}	// namespace

// ---- launchers ----------------------------------------------------------------------

bool moe_qmma_fits(const struct moe_wq &wq, int M, int top_k, int hidden, int inter,
		   int sh_inter)
{
	int step;

	if (!k_cuda_tuning()->moe_qmma || (wq.fmt != MQ_FP8 && wq.fmt != MQ_INT4) || sh_inter)
		return false;
	step = MQM_CHUNKS * MQ_VPC(wq.fmt);
	return M > 0 && top_k > 0 && (long)M * top_k <= MOE_SMALL_MAX_PAIRS && hidden % step == 0 &&
	       inter % step == 0 && inter / MQM_FG <= hidden && mqm_qp(hidden) >= 1;
}

int moe_qmma_setup(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(mqm_gate_up_kernel<MQ_FP8>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						MQM_X_SMEM)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(mqm_gate_up_kernel<MQ_INT4>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						MQM_X_SMEM)) ? -EIO : 0;
}

int moe_qmma_run(cudaStream_t s, uint32_t *act, float *fac, float *out, const float *x, int M,
		 const int32_t *ids, const float *weights, int top_k,
		 const uint16_t *const *expert_w, const struct moe_wq &wq, int n_experts,
		 int hidden, int inter, int add, int n_sm)
{
	int ctas = SM_CTAS_PER_SM * (n_sm > 0 ? n_sm : 1);

	if (wq.fmt == MQ_INT4)
		mqm_launch<MQ_INT4>(s, ctas, expert_w, wq, x, ids, weights, M, top_k, n_experts,
				   hidden, inter, act, fac, add, out);
	else
		mqm_launch<MQ_FP8>(s, ctas, expert_w, wq, x, ids, weights, M, top_k, n_experts,
				  hidden, inter, act, fac, add, out);
	return K_CUDA_LAUNCHED("moe qmma");
}
