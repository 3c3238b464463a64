// The routed experts on the GPU, grouped by expert across the batch: a counting sort
// of the (row, slot) pairs by expert, one tensor-core pass over each used expert's
// gate/up weights (SwiGLU fused into its epilogue), one over its down weights, then a
// combine that sums each row's slots in increasing expert id like k_cpu_moe_experts.
// Small batches (M * top_k <= MOE_SMALL_MAX_PAIRS) take moe_small.cu instead: two
// CUDA-core launches, no plan or combine. k_cuda_tuning()->moe_path (KDEC_MOE_PATH)
// may force one path (small only where it fits).
// k_cuda_moe_experts_add runs the small path with the shared expert and the residual
// add folded in (moe_fused 0: it declines, the caller runs the separate ops).
//
// Bytes: each used expert's 3 * inter * hidden bf16 weights once per call; the
// activations are small beside them (M * top_k rows). The weights are the B operand
// of mma.m16n8k16 (8 output features), the expert's rows the A operand (16 rows per
// tile): x and the SwiGLU output are stored as bf16 hi + lo pairs and each product is
// done twice (hi, lo), so the result carries ~16 bits of x's mantissa.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/moe/moe_grouped.cuh"
#include "kernels/cuda/moe/moe_quant.cuh"

#define PLAN_THREADS 256
#define EX_THREADS 128		// 4 warps split K
#define EX_WARPS 4
#define EX_MT 4			// m16 tiles per pass: 64 of an expert's rows
#define EX_ROWS (EX_MT * 16)
#define EX_KU 4			// 32-wide k chunks per warp in flight
#define EX_MAX_TOPK 64
#define EX_MAX_EXPERTS 4096
#define FB_WARPS 8		// fallback: one output feature per warp
#define COMBINE_THREADS 256
/* Auto path: small up to this many (row, slot) pairs. Measured end to end on H200
 * (kdbench decode, ctx 1024, commit 9ba981b, docs/results/cuda-ab-9ba981b.txt): the
 * small path wins at batch 4 and 8 on both models, although the expert kernels alone time
 * slower there (test_cuda_moe at batch 8: 306 vs 215 us): the grouped path's plan and
 * combine launches and their dependent steps cost more than the small path loses.
 * DeepSeek-V2-Lite (top 6) 5.35 vs 5.71 ms at batch 4, 7.83 vs 7.94 at 8; Qwen3-30B-A3B
 * (top 8) 7.10 vs 7.71 and 10.62 vs 11.14. So the small path takes batch 8 of top-8. */
#define MOE_SMALL_AUTO_PAIRS 64

struct k_cuda_moe_ws {
	int max_M, top_k, n_experts, hidden, inter;
	int shared_inter;	// the shared expert's width; 0: none
	int n_sm;		// the device's SMs: sizes the small path's grids
	int *plan;		// n_used, then 4 arrays of max_M * top_k (see ex_plan)
	uint32_t *xs;		// (max_M, hidden) x as split bf16 (see split_store)
	uint32_t *hs;		// (max_M * top_k, inter) SwiGLU out, split (fallback, small: fp32)
	float *y;		// (max_M * top_k, hidden) expert output of each (row, slot)
	float *sh_act;		// (MOE_SMALL_MAX_PAIRS, shared_inter) the shared expert's
				// SwiGLU out (small path)
	unsigned *bar;		// (2) moe_lat.cu's grid barrier: arrivals, generation
	struct moe_qgemv_ws qg;	// moe_qgemv.cu's, for the largest of its calls up to max_M
};

namespace {	// kernels and their helpers stay private to this file

// ---- kernels: plan ----------------------------------------------------------

// Exclusive block scan of two ints over PLAN_THREADS threads; *ta, *tb get totals.
__device__ void block_scan2(int a, int b, int *ea, int *eb, int *ta, int *tb)
{
	__shared__ int sa[PLAN_THREADS / 32], sb[PLAN_THREADS / 32];
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32, ia = a, ib = b, oa = 0, ob = 0;

	for (int o = 1; o < 32; o <<= 1) {
		int va = __shfl_up_sync(0xffffffffu, ia, o), vb = __shfl_up_sync(0xffffffffu, ib, o);

		if (lane >= o) {
			ia += va;
			ib += vb;
		}
	}
	if (lane == 31) {
		sa[warp] = ia;
		sb[warp] = ib;
	}
	__syncthreads();
	*ta = *tb = 0;
	for (int w = 0; w < PLAN_THREADS / 32; w++) {
		if (w < warp) {
			oa += sa[w];
			ob += sb[w];
		}
		*ta += sa[w];
		*tb += sb[w];
	}
	*ea = oa + ia - a;
	*eb = ob + ib - b;
}

// Block m splits x row m (when xs is set; perm: each chunk in the int4 tile kernels'
// order, split_perm_pos); block 0 also builds the plan: counts per
// expert, the used experts in increasing id, and the pairs grouped by expert with the
// order of i = m * top_k + j kept inside each group (a stable counting sort).
// Shared: s_ids (n), s_cnt (E), s_fill (E) ints.
__global__ void __launch_bounds__(PLAN_THREADS)
moe_plan_kernel(ex_plan pl, const int32_t *ids, int n, int E, const float *x, int hidden,
		uint32_t *xs, int perm)
{
	extern __shared__ int psm[];
	int *s_ids = psm, *s_cnt = psm + n, *s_fill = s_cnt + E;
	int tid = threadIdx.x, per = (E + PLAN_THREADS - 1) / PLAN_THREADS;
	int e0 = min(E, tid * per), e1 = min(E, e0 + per);
	int cnt = 0, used = 0, ex_cnt, ex_used, tot_cnt, tot_used;

	if (xs && !perm)
		for (int p = tid; p < hidden / 2; p += PLAN_THREADS) {
			const float *xr = x + (size_t)blockIdx.x * hidden;

			split_store(xs + (size_t)blockIdx.x * hidden, p, xr[2 * p], xr[2 * p + 1]);
		}
	else if (xs)	// the int4 tile kernels' order (split_perm_pos)
		for (int k = tid; k < hidden; k += PLAN_THREADS)
			split_store1(xs + (size_t)blockIdx.x * hidden, k, split_perm_pos(k & 7),
				     x[(size_t)blockIdx.x * hidden + k]);
	if (blockIdx.x != 0)
		return;

	for (int e = tid; e < E; e += PLAN_THREADS)
		s_cnt[e] = 0;
	__syncthreads();
	for (int i = tid; i < n; i += PLAN_THREADS) {
		int v = ids[i];

		s_ids[i] = v >= 0 && v < E ? v : -1;
		if (v >= 0 && v < E)
			atomicAdd(&s_cnt[v], 1);
	}
	__syncthreads();
	for (int e = e0; e < e1; e++) {
		cnt += s_cnt[e];
		used += s_cnt[e] > 0;
	}
	block_scan2(cnt, used, &ex_cnt, &ex_used, &tot_cnt, &tot_used);
	for (int e = e0; e < e1; e++) {
		s_fill[e] = ex_cnt;
		if (s_cnt[e]) {
			pl.used_e[ex_used] = e;
			pl.used_start[ex_used] = ex_cnt;
			pl.used_n[ex_used] = s_cnt[e];
			ex_used++;
		}
		ex_cnt += s_cnt[e];
	}
	if (tid == 0)
		*pl.n_used = tot_used;
	__syncthreads();

	// Warp 0 places the pairs 32 at a time in order: lanes with the same expert take
	// consecutive places by lane, the leader advances the expert's fill.
	if (tid < 32)
		for (int c = 0; c < n; c += 32) {
			int i = c + tid, e = i < n ? s_ids[i] : -1;
			unsigned same = __match_any_sync(0xffffffffu, e);
			int base = e >= 0 ? s_fill[e] : 0;

			__syncwarp();
			if (e >= 0) {
				pl.sorted[base + __popc(same & ((1u << tid) - 1))] = i;
				if (tid == __ffs(same) - 1)
					s_fill[e] = base + __popc(same);
			}
			__syncwarp();
		}
}

// ---- kernels: expert GEMMs --------------------------------------------------

// One 32-wide k chunk into one m16 tile: lane (g, t) holds the 8 consecutive k values
// 8t..8t+7 of its A rows (ha/la: row g, hb/lb: row g + 8) and of its weight rows (w0,
// w1: feature g of tiles 0 and 1). mma's k slots {2t, 2t+1, 2t+8, 2t+9} take values
// 0-3 in the first step and 4-7 in the second, the same mapping for A and B, so every
// product pairs x and w of one k.
__device__ __forceinline__ void mma_chunk(float (*acc)[4], uint4 ha, uint4 la, uint4 hb, uint4 lb,
					  uint4 w0, uint4 w1)
{
	mma16816(acc[0], ha.x, hb.x, ha.y, hb.y, w0.x, w0.y);
	mma16816(acc[0], la.x, lb.x, la.y, lb.y, w0.x, w0.y);
	mma16816(acc[1], ha.x, hb.x, ha.y, hb.y, w1.x, w1.y);
	mma16816(acc[1], la.x, lb.x, la.y, lb.y, w1.x, w1.y);
	mma16816(acc[0], ha.z, hb.z, ha.w, hb.w, w0.z, w0.w);
	mma16816(acc[0], la.z, lb.z, la.w, lb.w, w0.z, w0.w);
	mma16816(acc[1], ha.z, hb.z, ha.w, hb.w, w1.z, w1.w);
	mma16816(acc[1], la.z, lb.z, la.w, lb.w, w1.z, w1.w);
}

// A lane's B fragment of a quantized row (row: its payload bytes): the 8 values from
// column k0 as bf16 pairs, exactly (e4m3 values and int4's -8..7 are all bf16 numbers).
template <int F>
__device__ __forceinline__ uint4 ex_qfrag(const uint8_t *row, int k0)
{
	if (F == MQ_FP8)
		return ex_fp8_bf16x8(__ldcs((const uint2 *)(row + k0)));
	return ex_int4_bf16x8(__ldcs((const unsigned *)(row + k0 / 2)));
}

// Block (feature tile, used expert u). GLU: gate and up rows f0..f0+7 (f0 = 8 * x)
// of the expert, A = x rows of its pairs, out = silu(gate) * up into hs (split) at the
// pair's sorted position. Down: rows f0..f0+15 (f0 = 16 * x), A = hs rows, out into
// y at the pair's index. K (% 8 == 0) is split over the 4 warps and reduced in shared
// memory in a fixed order; warp w finishes m16 tile w.
// F: the experts' format. Quantized (wq), each lane's B fragment is dequantized from the
// payload (the values, exact in bf16), each 32-wide k chunk's products go to a partial
// accumulator that the chunk's scales (of the lane's two output columns) multiply
// into acc: no bf16 copy of the weights, and the same precision as bf16 weights.
template <bool GLU, int F = MQ_BF16>
__global__ void __launch_bounds__(EX_THREADS)
expert_mma_kernel(ex_plan pl, const uint16_t *const *expert_w, const uint4 *a_src, int top_k,
		  int K, int N, uint32_t *hs, float *y, moe_wq wq = {})
{
	__shared__ float red[EX_WARPS][EX_MT * 8][32];
	const uint4 zero = make_uint4(0, 0, 0, 0);
	int u = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	int g = lane / 4, t = lane % 4, kw = K / 4;	// kw: uint4 per split row
	int e, start, n, f0, n_kc = (K + 31) / 32;
	const uint16_t *w0, *w1;
	bool v0, v1;
	const size_t rb = F == MQ_INT4 ? (size_t)K / 2 : F == MQ_FP8 ? (size_t)K : (size_t)K * 2;
	mq_row sr[2][2];	// quantized: scales of the lane's output columns 2t, 2t + 1 per tile

	if (u >= *pl.n_used)
		return;
	e = pl.used_e[u];
	start = pl.used_start[u];
	n = pl.used_n[u];
	if (F != MQ_BF16) {
		if (GLU) {
			f0 = blockIdx.x * 8;
			v0 = v1 = f0 + g < N;
			w0 = (const uint16_t *)((const uint8_t *)expert_w[3 * e] + (size_t)(f0 + g) * rb);
			w1 = (const uint16_t *)((const uint8_t *)expert_w[3 * e + 1] + (size_t)(f0 + g) * rb);
		} else {
			f0 = blockIdx.x * 16;
			v0 = f0 + g < N;
			v1 = f0 + 8 + g < N;
			w0 = (const uint16_t *)((const uint8_t *)expert_w[3 * e + 2] + (size_t)(f0 + g) * rb);
			w1 = (const uint16_t *)((const uint8_t *)w0 + 8 * rb);
		}
#pragma unroll
		for (int tile = 0; tile < 2; tile++)
#pragma unroll
			for (int h = 0; h < 2; h++) {
				int j = GLU ? tile : 2, col = f0 + (GLU ? 0 : 8 * tile) + 2 * t + h;

				sr[tile][h] = mq_row_of(wq, col < N ? wq.scales[3 * e + j] : nullptr, j,
							col);
			}
	} else if (GLU) {
		f0 = blockIdx.x * 8;
		v0 = v1 = f0 + g < N;
		w0 = expert_w[3 * e] + (size_t)(f0 + g) * K;
		w1 = expert_w[3 * e + 1] + (size_t)(f0 + g) * K;
	} else {
		f0 = blockIdx.x * 16;
		v0 = f0 + g < N;
		v1 = f0 + 8 + g < N;
		w0 = expert_w[3 * e + 2] + (size_t)(f0 + g) * K;
		w1 = w0 + (size_t)8 * K;
	}

	for (int c0 = 0; c0 < n; c0 += EX_ROWS) {
		int n_mt = (min(EX_ROWS, n - c0) + 15) / 16;
		float acc[EX_MT][2][4];
		int arow[EX_MT][2];	// A row of tile rows g and g + 8; -1: padding

#pragma unroll
		for (int mt = 0; mt < EX_MT; mt++)
#pragma unroll
			for (int h = 0; h < 2; h++) {
				int tok = c0 + mt * 16 + g + 8 * h;

				arow[mt][h] = tok >= n ? -1 :
					GLU ? pl.sorted[start + tok] / top_k : start + tok;
#pragma unroll
				for (int i = 0; i < 4; i++)
					acc[mt][h][i] = 0.0f;
			}

		for (int kc = warp; kc < n_kc; kc += EX_WARPS * EX_KU) {
			uint4 wv[EX_KU][2];

#pragma unroll
			for (int q = 0; q < EX_KU; q++) {
				int k0 = (kc + q * EX_WARPS) * 32 + 8 * t;
				bool in = kc + q * EX_WARPS < n_kc && k0 < K;

				if (F == MQ_BF16) {
					wv[q][0] = in && v0 ? __ldcs((const uint4 *)(w0 + k0)) : zero;
					wv[q][1] = in && v1 ? __ldcs((const uint4 *)(w1 + k0)) : zero;
				} else {
					wv[q][0] = in && v0 ? ex_qfrag<F>((const uint8_t *)w0, k0) : zero;
					wv[q][1] = in && v1 ? ex_qfrag<F>((const uint8_t *)w1, k0) : zero;
				}
			}
#pragma unroll
			for (int q = 0; q < EX_KU; q++) {
				int k0 = (kc + q * EX_WARPS) * 32 + 8 * t;
				float s[2][2];

				if (kc + q * EX_WARPS >= n_kc)	// warp-uniform
					break;
				if (F != MQ_BF16)
#pragma unroll
					for (int tile = 0; tile < 2; tile++)
#pragma unroll
						for (int h = 0; h < 2; h++)
							s[tile][h] = mq_scale(sr[tile][h],
									      (kc + q * EX_WARPS) * 32);
#pragma unroll
				for (int mt = 0; mt < EX_MT; mt++) {
					uint4 ha = zero, la = zero, hb = zero, lb = zero;

					if (mt >= n_mt)		// warp-uniform
						break;
					if (arow[mt][0] >= 0 && k0 < K) {
						const uint4 *p = a_src + (size_t)arow[mt][0] * kw + k0 / 4;

						ha = __ldg(p);
						la = __ldg(p + 1);
					}
					if (arow[mt][1] >= 0 && k0 < K) {
						const uint4 *p = a_src + (size_t)arow[mt][1] * kw + k0 / 4;

						hb = __ldg(p);
						lb = __ldg(p + 1);
					}
					if (F == MQ_BF16) {
						mma_chunk(acc[mt], ha, la, hb, lb, wv[q][0], wv[q][1]);
					} else {
						float part[2][4] = {};

						mma_chunk(part, ha, la, hb, lb, wv[q][0], wv[q][1]);
#pragma unroll
						for (int tile = 0; tile < 2; tile++)
#pragma unroll
							for (int i = 0; i < 4; i++)
								acc[mt][tile][i] = fmaf(part[tile][i], s[tile][i % 2],
											acc[mt][tile][i]);
					}
				}
			}
		}

#pragma unroll
		for (int mt = 0; mt < EX_MT; mt++)
#pragma unroll
			for (int i = 0; i < 8; i++)
				red[warp][mt * 8 + i][lane] = acc[mt][i / 4][i % 4];
		__syncthreads();
		if (warp < n_mt) {
			float v[8];
			int ta = c0 + warp * 16 + g, tb = ta + 8;

			for (int i = 0; i < 8; i++) {
				v[i] = red[0][warp * 8 + i][lane];
				for (int w = 1; w < EX_WARPS; w++)
					v[i] = __fadd_rn(v[i], red[w][warp * 8 + i][lane]);
			}
			// v[0..3]: tile 0 (rows ta: 0, 1; tb: 2, 3), v[4..7]: tile 1; columns
			// 2t, 2t + 1 of the tile.
			if (GLU && v0) {
				int pair = f0 / 2 + t;

				if (ta < n)
					split_store(hs + (size_t)(start + ta) * N, pair,
						    silu_mul1(v[0], v[4]), silu_mul1(v[1], v[5]));
				if (tb < n)
					split_store(hs + (size_t)(start + tb) * N, pair,
						    silu_mul1(v[2], v[6]), silu_mul1(v[3], v[7]));
			} else if (!GLU) {
				for (int tile = 0; tile < 2; tile++) {
					int f = f0 + 8 * tile + 2 * t;

					if (f >= N)
						continue;
					if (ta < n)
						*(float2 *)(y + (size_t)pl.sorted[start + ta] * N + f) =
							make_float2(v[4 * tile], v[4 * tile + 1]);
					if (tb < n)
						*(float2 *)(y + (size_t)pl.sorted[start + tb] * N + f) =
							make_float2(v[4 * tile + 2], v[4 * tile + 3]);
				}
			}
		}
		__syncthreads();	// red is reused by the next 64 rows
	}
}

// ---- kernels: CUDA-core fallback for sizes that are not multiples of 8 ----------

__device__ __forceinline__ float warp_sum(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

__device__ __forceinline__ float dot_bf16(const uint16_t *w, const float *x, int K, int lane)
{
	float s = 0.0f;

	for (int k = lane; k < K; k += 32)
		s = fmaf(__uint_as_float((uint32_t)w[k] << 16), x[k], s);
	return warp_sum(s);
}

// Row n of quantized matrix j (payload w, scales sc) dotted with x, element by element as
// k_cpu_linear_q has it: value * scale in fp32, then times x (any shape and blocks).
template <int F>
__device__ __forceinline__ float dot_q(const void *w, const void *sc, const moe_wq &wq, int j,
				       int n, const float *x, int K, int lane)
{
	const uint8_t *r = (const uint8_t *)w + (size_t)n * (F == MQ_INT4 ? (size_t)(K + 7) / 8 * 4
									  : (size_t)K);
	size_t srow = (size_t)(n / wq.brows[j]) * (size_t)wq.scols[j];
	float s = 0.0f;

	for (int k = lane; k < K; k += 32) {
		size_t i = srow + (size_t)(k / wq.bcols[j]);
		float sv = wq.sbf16 ? __uint_as_float((uint32_t)((const uint16_t *)sc)[i] << 16)
				    : ((const float *)sc)[i];
		float v = F == MQ_INT4 ? (float)((int)((r[k / 2] >> (4 * (k % 2))) & 0xfu) - 8)
				       : mq_e4m3x2(r[k]).x;

		s = fmaf(v * sv, x[k], s);
	}
	return warp_sum(s);
}

template <int F>
__device__ __forceinline__ float dot_w(const uint16_t *const *expert_w, const moe_wq &wq, int e,
				       int j, int n, const float *x, int K, int lane)
{
	if (F == MQ_BF16)
		return dot_bf16(expert_w[3 * e + j] + (size_t)n * K, x, K, lane);
	return dot_q<F>(expert_w[3 * e + j], wq.scales[3 * e + j], wq, j, n, x, K, lane);
}

// One warp per (feature, used expert), every row of the expert in turn; GLU writes fp32
// SwiGLU values into hs (as floats) at the sorted position, down writes y. F: the
// experts' format (quantized: any shape, the scales as wq says).
template <bool GLU, int F = MQ_BF16>
__global__ void __launch_bounds__(FB_WARPS * 32)
expert_fallback_kernel(ex_plan pl, const uint16_t *const *expert_w, const float *a_src,
		       int top_k, int K, int N, float *hs, float *y, moe_wq wq = {})
{
	int u = blockIdx.y, lane = threadIdx.x % 32;
	int f = blockIdx.x * FB_WARPS + threadIdx.x / 32, e, start, n;

	if (u >= *pl.n_used || f >= N)
		return;
	e = pl.used_e[u];
	start = pl.used_start[u];
	n = pl.used_n[u];
	for (int r = 0; r < n; r++) {
		int i = pl.sorted[start + r];

		if (GLU) {
			const float *xr = a_src + (size_t)(i / top_k) * K;
			float gsum = dot_w<F>(expert_w, wq, e, 0, f, xr, K, lane);
			float usum = dot_w<F>(expert_w, wq, e, 1, f, xr, K, lane);

			if (lane == 0)
				hs[(size_t)(start + r) * N + f] = silu_mul1(gsum, usum);
		} else {
			float s = dot_w<F>(expert_w, wq, e, 2, f, a_src + (size_t)(start + r) * K, K,
					   lane);

			if (lane == 0)
				y[(size_t)i * N + f] = s;
		}
	}
}

// ---- kernels: combine -------------------------------------------------------

// out[m, c] = sum over row m's valid slots, by increasing (expert id, slot), of
// y[m * top_k + j, c] * w[m, j]: k_cpu_moe_experts's order, each product rounded.
__global__ void __launch_bounds__(COMBINE_THREADS)
moe_combine_kernel(float *out, const float *y, const int32_t *ids, const float *w, int top_k,
		   int E, int hidden)
{
	__shared__ int order[EX_MAX_TOPK];
	__shared__ int n_ord;
	int m = blockIdx.x, c = blockIdx.y * COMBINE_THREADS + threadIdx.x;
	const int32_t *id = ids + (size_t)m * top_k;
	float acc = 0.0f;

	if (threadIdx.x == 0) {
		int cnt = 0;
		long long prev = -1;

		for (;;) {
			long long best = -1;

			for (int j = 0; j < top_k; j++) {
				long long key = (long long)id[j] * EX_MAX_TOPK + j;

				if (id[j] >= 0 && id[j] < E && key > prev && (best < 0 || key < best))
					best = key;
			}
			if (best < 0)
				break;
			order[cnt++] = (int)(best % EX_MAX_TOPK);
			prev = best;
		}
		n_ord = cnt;
	}
	__syncthreads();
	if (c >= hidden)
		return;
	for (int q = 0; q < n_ord; q++) {
		size_t i = (size_t)m * top_k + order[q];

		acc = __fadd_rn(acc, __fmul_rn(y[i * hidden + c], w[i]));
	}
	out[(size_t)m * hidden + c] = acc;
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static ex_plan ws_plan(const k_cuda_moe_ws *ws)
{
	int A = ws->max_M * ws->top_k;
	ex_plan pl;

	pl.n_used = ws->plan;
	pl.used_e = ws->plan + 1;
	pl.used_start = pl.used_e + A;
	pl.used_n = pl.used_start + A;
	pl.sorted = pl.used_n + A;
	return pl;
}

static size_t plan_smem(int n, int E)
{
	return sizeof(int) * ((size_t)n + 2 * (size_t)E);
}

// The tensor-core path needs whole 16-byte chunks of every row.
static bool moe_use_mma(int hidden, int inter)
{
	return hidden % 8 == 0 && inter % 8 == 0;
}

// At a few pairs the weights are read once per pair either way, and the grouped
// path's plan and combine launches cost as much as its expert passes save.
static bool moe_use_small(int M, int top_k, int hidden, int inter, const float *x,
			  const k_cuda_moe_shared *sh)
{
	const int path = k_cuda_tuning()->moe_path;

	if (path == K_CUDA_MOE_PATH_GROUPED ||
	    (path == K_CUDA_MOE_PATH_AUTO && (long)M * top_k > MOE_SMALL_AUTO_PAIRS))
		return false;
	return k_cuda_moe_small_fits(M, top_k, hidden, inter, x, sh);
}

extern "C" void k_cuda_moe_ws_destroy(struct k_cuda_moe_ws *ws)
{
	if (!ws)
		return;
	cudaFree(ws->plan);
	cudaFree(ws->xs);
	cudaFree(ws->hs);
	cudaFree(ws->y);
	cudaFree(ws->sh_act);
	cudaFree(ws->bar);
	cudaFree(ws->qg.act);
	cudaFree(ws->qg.part);
	cudaFree(ws->qg.cnt_gu);
	free(ws);
}

struct moe_ws_parts moe_ws_parts_of(const struct k_cuda_moe_ws *ws)
{
	return moe_ws_parts{ ws->max_M, ws->top_k, ws->n_experts, ws->hidden, ws->inter,
			     ws->shared_inter, ws->n_sm, (float *)ws->hs, ws->sh_act, ws->bar };
}

// moe_qgemv.cu's workspace: the largest act, partials and counts of its calls at M <=
// min(max_M, MOE_QGEMV_MAX_M) in either format and gate/up form (their splits differ); none where it
// takes no call of these shapes.
static int moe_qgemv_ws_alloc(k_cuda_moe_ws *ws)
{
	moe_qgemv_ws &q = ws->qg;
	struct moe_qgemv_plan p;

	q.n_sm = ws->n_sm;
	for (int M = 1; M <= ws->max_M && M <= MOE_QGEMV_MAX_M; M++)
		for (int f = MQ_FP8; f <= MQ_INT4; f++)
			for (int persist = 0; persist < 2; persist++) {	// either gate/up form
				if (!moe_qgemv_make_plan(f, M, ws->top_k, ws->n_experts, ws->hidden,
							 ws->inter, ws->n_sm, persist, &p))
					continue;
				q.act_floats = std::max(q.act_floats, p.act_floats);
				q.part_floats = std::max(q.part_floats, p.part_floats);
				q.cnt = std::max(q.cnt, p.cnt);
			}
	if (!q.cnt)
		return 0;
	if (cudaMalloc(&q.act, sizeof(float) * q.act_floats) != cudaSuccess ||
	    cudaMalloc(&q.part, sizeof(float) * q.part_floats) != cudaSuccess ||
	    cudaMalloc(&q.cnt_gu, 2 * sizeof(unsigned) * q.cnt) != cudaSuccess ||
	    cudaMemset(q.cnt_gu, 0, 2 * sizeof(unsigned) * q.cnt) != cudaSuccess) {
		cudaGetLastError();
		q.cnt = 0;
		return -ENOMEM;
	}
	q.cnt_d = q.cnt_gu + q.cnt;
	return 0;
}

extern "C" int k_cuda_moe_ws_create(struct k_cuda_moe_ws **out, int max_M, int top_k,
				    int n_experts, int hidden, int inter, int shared_inter)
{
	k_cuda_moe_ws *ws;
	size_t A = (size_t)max_M * top_k, smem = plan_smem((int)A, n_experts);
	int dev = 0;

	*out = nullptr;
	if (max_M <= 0 || top_k <= 0 || top_k > EX_MAX_TOPK || n_experts <= 0 ||
	    n_experts > EX_MAX_EXPERTS || hidden <= 0 || inter <= 0 || A > (1u << 20) ||
	    shared_inter < 0)
		return -EINVAL;
	ws = (k_cuda_moe_ws *)calloc(1, sizeof(*ws));
	if (!ws)
		return -ENOMEM;
	ws->max_M = max_M;
	ws->top_k = top_k;
	ws->n_experts = n_experts;
	ws->hidden = hidden;
	ws->inter = inter;
	ws->shared_inter = shared_inter;
	if (K_CUDA_CALL(cudaGetDevice(&dev)) ||
	    K_CUDA_CALL(cudaDeviceGetAttribute(&ws->n_sm, cudaDevAttrMultiProcessorCount, dev)) ||
	    k_cuda_moe_small_setup() || moe_qtile_setup() || moe_qgemv_setup()) {
		k_cuda_moe_ws_destroy(ws);
		return -EIO;
	}
	if (cudaMalloc(&ws->plan, sizeof(int) * (1 + 4 * A)) != cudaSuccess ||
	    cudaMalloc(&ws->xs, sizeof(uint32_t) * (size_t)max_M * hidden) != cudaSuccess ||
	    cudaMalloc(&ws->hs, sizeof(uint32_t) * A * inter) != cudaSuccess ||
	    cudaMalloc(&ws->y, sizeof(float) * A * hidden) != cudaSuccess ||
	    cudaMalloc(&ws->bar, 2 * sizeof(unsigned)) != cudaSuccess ||
	    cudaMemset(ws->bar, 0, 2 * sizeof(unsigned)) != cudaSuccess ||
	    (shared_inter > 0 &&
	     cudaMalloc(&ws->sh_act, sizeof(float) * MOE_SMALL_MAX_PAIRS * (size_t)shared_inter) !=
		     cudaSuccess)) {
		cudaGetLastError();
		k_cuda_moe_ws_destroy(ws);
		return -ENOMEM;
	}
	if (moe_qgemv_ws_alloc(ws)) {
		k_cuda_moe_ws_destroy(ws);
		return -ENOMEM;
	}
	// The plan keeps the ids and two per-expert arrays in shared memory.
	if (smem > 48 * 1024 &&
	    K_CUDA_CALL(cudaFuncSetAttribute(moe_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
					     (int)smem))) {
		k_cuda_moe_ws_destroy(ws);
		return -EINVAL;
	}
	*out = ws;
	return 0;
}

template <int F>
static int moe_run_mma(cudaStream_t s, k_cuda_moe_ws *ws, const ex_plan &pl,
		       const uint16_t *const *expert_w, const moe_wq &wq, int max_used)
{
	dim3 g1((ws->inter + 7) / 8, max_used), g2((ws->hidden + 15) / 16, max_used);
	int ret;

	expert_mma_kernel<true, F><<<g1, EX_THREADS, 0, s>>>(pl, expert_w, (const uint4 *)ws->xs,
							      ws->top_k, ws->hidden, ws->inter,
							      ws->hs, nullptr, wq);
	if ((ret = K_CUDA_LAUNCHED("moe gate/up")))
		return ret;
	expert_mma_kernel<false, F><<<g2, EX_THREADS, 0, s>>>(pl, expert_w, (const uint4 *)ws->hs,
							       ws->top_k, ws->inter, ws->hidden,
							       nullptr, ws->y, wq);
	return K_CUDA_LAUNCHED("moe down");
}

template <int F>
static int moe_run_fallback_f(cudaStream_t s, k_cuda_moe_ws *ws, const ex_plan &pl,
			      const float *x, const uint16_t *const *expert_w, const moe_wq &wq,
			      int max_used)
{
	dim3 g1((ws->inter + FB_WARPS - 1) / FB_WARPS, max_used);
	dim3 g2((ws->hidden + FB_WARPS - 1) / FB_WARPS, max_used);
	int ret;

	expert_fallback_kernel<true, F><<<g1, FB_WARPS * 32, 0, s>>>(pl, expert_w, x, ws->top_k,
								      ws->hidden, ws->inter,
								      (float *)ws->hs, nullptr, wq);
	if ((ret = K_CUDA_LAUNCHED("moe gate/up (fallback)")))
		return ret;
	expert_fallback_kernel<false, F><<<g2, FB_WARPS * 32, 0, s>>>(pl, expert_w,
								       (const float *)ws->hs,
								       ws->top_k, ws->inter,
								       ws->hidden, nullptr, ws->y, wq);
	return K_CUDA_LAUNCHED("moe down (fallback)");
}

// The CUDA-core kernels: shapes the tensor cores do not take, and quantized experts
// the vector kernels do not (moe_wq_vector).
static int moe_run_fallback(cudaStream_t s, k_cuda_moe_ws *ws, const ex_plan &pl,
			    const float *x, const uint16_t *const *expert_w, const moe_wq &wq,
			    int max_used)
{
	if (wq.fmt == MQ_FP8)
		return moe_run_fallback_f<MQ_FP8>(s, ws, pl, x, expert_w, wq, max_used);
	if (wq.fmt == MQ_INT4)
		return moe_run_fallback_f<MQ_INT4>(s, ws, pl, x, expert_w, wq, max_used);
	return moe_run_fallback_f<MQ_BF16>(s, ws, pl, x, expert_w, wq, max_used);
}

// ---- quantized experts ----------------------------------------------------------

// log2 of v where v is a power of two, else -1.
static int log2_exact(long long v)
{
	int l = 0;

	if (v <= 0 || (v & (v - 1)))
		return -1;
	while ((1ll << l) < v)
		l++;
	return l;
}

// The shift that maps an index below n to its block of b: 31 where one block covers all.
static int block_shift(int b, int n)
{
	return b >= n ? 31 : log2_exact(b);
}

extern "C" int k_cuda_moe_quant_ok(const struct k_cuda_moe_quant *q, int hidden, int inter)
{
	(void)hidden;
	(void)inter;
	if (!q || q->fmt == K_Q_NONE)
		return 0;
	if ((q->fmt != K_Q_FP8 && q->fmt != K_Q_INT4) ||
	    (q->scale_dtype != K_F32 && q->scale_dtype != K_BF16) || !q->scales)
		return -EINVAL;
	for (int j = 0; j < 3; j++)
		if (q->block_rows[j] <= 0 || q->block_cols[j] <= 0)
			return -EINVAL;
	return 0;
}

struct moe_wq moe_wq_of(const struct k_cuda_moe_quant *q, int hidden, int inter)
{
	moe_wq w = {};

	if (!q || q->fmt == K_Q_NONE)
		return w;
	w.fmt = q->fmt == K_Q_INT4 ? MQ_INT4 : MQ_FP8;
	w.scales = q->scales;
	w.sbf16 = q->scale_dtype == K_BF16;
	for (int j = 0; j < 3; j++) {
		int N = j < 2 ? inter : hidden, K = j < 2 ? hidden : inter;

		w.brows[j] = q->block_rows[j];
		w.bcols[j] = q->block_cols[j];
		w.rshift[j] = block_shift(q->block_rows[j], N);
		w.kshift[j] = block_shift(q->block_cols[j], K);
		w.scols[j] = (K + q->block_cols[j] - 1) / q->block_cols[j];
	}
	return w;
}

bool moe_wq_vector(const moe_wq &wq, int hidden, int inter)
{
	if (wq.fmt == MQ_BF16)
		return true;
	if (hidden % 32 || inter % 32)
		return false;
	for (int j = 0; j < 3; j++)
		if (wq.rshift[j] < 0 || wq.kshift[j] < 0 || wq.kshift[j] < 5)
			return false;	// kshift 5: blocks of 32 columns; 31: one block
	return true;
}

extern "C" int k_cuda_moe_qtile_takes(const struct k_cuda_moe_quant *q, int hidden, int inter,
				      int M)
{
	moe_wq wq;

	if (k_cuda_moe_quant_ok(q, hidden, inter) || !moe_use_mma(hidden, inter))
		return 0;	// (q NULL: bf16 experts)
	wq = moe_wq_of(q, hidden, inter);
	return moe_wq_vector(wq, hidden, inter) && moe_qtile_takes(wq, hidden, inter, M);
}

extern "C" int k_cuda_moe_qtile_wide(int M)
{
	return moe_qtile_wide(M);
}

// Whether a quantized call of M rows that the small path would run (small: its
// moe_use_small) takes moe_qgemv.cu's GEMVs instead.
static bool moe_use_qgemv(const k_cuda_moe_ws *ws, const moe_wq &wq, bool small, int M,
			  const float *x)
{
	return small && moe_wq_vector(wq, ws->hidden, ws->inter) &&
	       moe_qgemv_takes(wq, M, ws->top_k, ws->n_experts, ws->hidden, ws->inter, x, ws->qg);
}

// Whether a quantized call of M rows that the small path would run (small) goes to the
// grouped path's tile kernels instead: experts past their format's union-GEMV rows
// (moe_qgemv_fmt_rows: int4 past 2, fp8 at least 4096 wide past 2) and up to
// moe_qgemv_rows, where the tile kernels take the call (k_cuda_tuning.h says why).
static bool moe_q_tiles(const moe_wq &wq, bool small, int M, int hidden, int inter)
{
	return small && (wq.fmt == MQ_INT4 || wq.fmt == MQ_FP8) &&
	       M > moe_qgemv_fmt_rows(wq.fmt, hidden) && M <= k_cuda_tuning()->moe_qgemv_rows &&
	       moe_use_mma(hidden, inter) && moe_wq_vector(wq, hidden, inter) &&
	       moe_qtile_takes(wq, hidden, inter, M);
}

extern "C" int k_cuda_moe_qgemv_takes(const struct k_cuda_moe_ws *ws,
				      const struct k_cuda_moe_quant *q, int M)
{
	alignas(16) static const float aligned[4] = {};	// an x it takes: only its address
	moe_wq wq;

	if (!ws || !q || k_cuda_moe_quant_ok(q, ws->hidden, ws->inter) || M > ws->max_M)
		return 0;
	wq = moe_wq_of(q, ws->hidden, ws->inter);
	return moe_use_qgemv(ws, wq, true, M, aligned);
}

extern "C" int k_cuda_moe_experts(cudaStream_t s, struct k_cuda_moe_ws *ws, float *out,
				  const float *x, int M, const int32_t *ids, const float *weights,
				  int top_k, const uint16_t *const *expert_w, int n_experts,
				  int hidden, int inter)
{
	return k_cuda_moe_experts_q(s, ws, out, x, M, ids, weights, top_k, expert_w, nullptr,
				    n_experts, hidden, inter);
}

extern "C" int k_cuda_moe_experts_q(cudaStream_t s, struct k_cuda_moe_ws *ws, float *out,
				    const float *x, int M, const int32_t *ids,
				    const float *weights, int top_k,
				    const uint16_t *const *expert_w,
				    const struct k_cuda_moe_quant *q, int n_experts, int hidden,
				    int inter)
{
	ex_plan pl;
	bool mma = moe_use_mma(hidden, inter), vec, small, qtile;
	int n, max_used, ret;
	moe_wq wq;

	if (!ws || M < 0 || M > ws->max_M || top_k != ws->top_k || n_experts != ws->n_experts ||
	    hidden != ws->hidden || inter != ws->inter || k_cuda_moe_quant_ok(q, hidden, inter))
		return -EINVAL;
	if (M == 0)
		return 0;
	wq = moe_wq_of(q, hidden, inter);
	vec = moe_wq_vector(wq, hidden, inter);
	small = vec && moe_use_small(M, top_k, hidden, inter, x, nullptr);
	if (moe_use_qgemv(ws, wq, small, M, x))
		return moe_qgemv_run(s, ws->qg, out, x, M, ids, weights, top_k, expert_w, wq,
				     n_experts, hidden, inter, 0);
	if (moe_q_tiles(wq, small, M, hidden, inter))
		small = false;
	if (small)
		return k_cuda_moe_small_run(s, (float *)ws->hs, out, x, M, ids, weights, top_k,
					    expert_w, wq, n_experts, hidden, inter, moe_small_shared{}, 0,
					    ws->n_sm);
	mma = mma && vec;
	qtile = mma && moe_qtile_takes(wq, hidden, inter, M);
	pl = ws_plan(ws);
	n = M * top_k;
	max_used = n < n_experts ? n : n_experts;
	moe_plan_kernel<<<M, PLAN_THREADS, plan_smem(n, n_experts), s>>>(
		pl, ids, n, n_experts, x, hidden, mma ? ws->xs : nullptr,
		qtile && wq.fmt == MQ_INT4);
	if ((ret = K_CUDA_LAUNCHED("moe plan")))
		return ret;
	if (!mma)
		ret = moe_run_fallback(s, ws, pl, x, expert_w, wq, max_used);
	else if (qtile)
		ret = moe_qtile_run(s, pl, expert_w, wq, ws->xs, ws->hs, ws->y, M, top_k, hidden,
				    inter, max_used);
	else if (wq.fmt == MQ_FP8)
		ret = moe_run_mma<MQ_FP8>(s, ws, pl, expert_w, wq, max_used);
	else if (wq.fmt == MQ_INT4)
		ret = moe_run_mma<MQ_INT4>(s, ws, pl, expert_w, wq, max_used);
	else
		ret = moe_run_mma<MQ_BF16>(s, ws, pl, expert_w, wq, max_used);
	if (ret)
		return ret;
	moe_combine_kernel<<<dim3(M, (hidden + COMBINE_THREADS - 1) / COMBINE_THREADS),
			     COMBINE_THREADS, 0, s>>>(out, ws->y, ids, weights, top_k, n_experts,
						      hidden);
	return K_CUDA_LAUNCHED("moe combine");
}

extern "C" int k_cuda_moe_experts_add(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y,
				      const float *x, int M, const int32_t *ids,
				      const float *weights, int top_k,
				      const uint16_t *const *expert_w, int n_experts, int hidden,
				      int inter, const struct k_cuda_moe_shared *sh)
{
	return k_cuda_moe_experts_add_q(s, ws, y, x, M, ids, weights, top_k, expert_w, nullptr,
					n_experts, hidden, inter, sh);
}

extern "C" int k_cuda_moe_experts_add_q(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y,
					const float *x, int M, const int32_t *ids,
					const float *weights, int top_k,
					const uint16_t *const *expert_w,
					const struct k_cuda_moe_quant *q, int n_experts, int hidden,
					int inter, const struct k_cuda_moe_shared *sh)
{
	moe_small_shared ss = {};
	moe_wq wq;
	bool small;

	if (!ws || M < 0 || M > ws->max_M || top_k != ws->top_k || n_experts != ws->n_experts ||
	    hidden != ws->hidden || inter != ws->inter || (sh && sh->inter > ws->shared_inter) ||
	    k_cuda_moe_quant_ok(q, hidden, inter))
		return -EINVAL;
	if (M == 0)
		return 0;
	wq = moe_wq_of(q, hidden, inter);
	small = moe_use_small(M, top_k, hidden, inter, x, nullptr);
	if (!sh && moe_use_qgemv(ws, wq, small, M, x))
		return moe_qgemv_run(s, ws->qg, y, x, M, ids, weights, top_k, expert_w, wq,
				     n_experts, hidden, inter, 1);
	if (moe_q_tiles(wq, small, M, hidden, inter))
		return 1;	// the caller's k_cuda_moe_experts_q, then its add
	if (!k_cuda_tuning()->moe_fused || !moe_use_small(M, top_k, hidden, inter, x, sh) ||
	    (sh && wq.fmt != MQ_BF16) || !moe_wq_vector(wq, hidden, inter))
		return 1;
	if (sh)
		ss = moe_small_shared{ sh->gate, sh->up, sh->down, sh->inter, ws->sh_act };
	return k_cuda_moe_small_run(s, (float *)ws->hs, y, x, M, ids, weights, top_k, expert_w, wq,
				    n_experts, hidden, inter, ss, 1, ws->n_sm);
}
