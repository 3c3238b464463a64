// GQA prefill attention on the tensor cores, flash-attention-2 style: a block takes
// 16 MW W consecutive query vectors (prefill rows x the q heads of one kv head), staged
// once as bf16, and streams the K/V tiles of their sequence through shared memory
// (cp.async, ST stages); each warp keeps S = Q K^T, the online softmax and O += P V of
// its MW m16 tiles of queries in registers, each K and V fragment serving all of them
// (q and p enter mma.sync as bf16, p straight from the score registers; fp32
// accumulation: ~3e-3 relative, as the decode kernel of attn_mma.cu). Rows of another
// sequence in the same tile are taken in runs, as attn_tile.cu does; long contexts over
// few tiles split the context over blocks and merge (attn_ws.cu).
#include <cstdint>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mma.cuh"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ptx.cuh"

// Splits along the context: none shorter than this many tokens (each costs a partial
// and its share of the merge).
#define PF_MIN_SPLIT_TOKENS 256

// ---- shared memory ------------------------------------------------------------

// K and V tiles (ST, TK, KS) bf16 each, after the block's Q tile (NQ, KS) bf16; the row
// stride is an odd multiple of 16 bytes, so the 8 rows an ldmatrix phase reads fall in 8
// different bank groups.
template <int DK, int TK, int ST, int NQ>
struct pf_layout {
	static constexpr int KS = DK + 8;
	static constexpr unsigned q = 0;
	static constexpr unsigned k = q + 2u * NQ * KS;
	static constexpr unsigned v = k + 2u * ST * TK * KS;
	static constexpr unsigned total = v + 2u * ST * TK * KS;
	static_assert(DK % 32 == 0 && TK % 16 == 0 && ST >= 2, "tile shape");
};

// How the block's threads share a tile's copies: CH consecutive threads take one K (and
// V) row of 16-byte chunks, whole 128-byte lines per instruction; a thread copies NP
// tokens of the tile, TPP apart.
template <int DK, int TK, int W>
struct pf_fill {
	static constexpr int CH = DK / 8;
	static constexpr int TPP = W * 32 / CH;
	static constexpr int NP = TK / TPP;
	static_assert(W * 32 % CH == 0 && TK % TPP == 0, "whole rows per pass");
};

// ---- kernel -------------------------------------------------------------------

// The cache blocks (table entries) of this thread's tokens of the tile at t0, -1 from
// te on: loaded a tile ahead of their copies, so those never wait for the table.
template <int DK, int TK, int W>
__device__ __forceinline__ void pf_page(int32_t (&pg)[pf_fill<DK, TK, W>::NP],
					const attn_tile_args &a, const int32_t *table, int t0, int te)
{
	using F = pf_fill<DK, TK, W>;

#pragma unroll
	for (int j = 0; j < F::NP; j++) {
		const int t = t0 + (int)threadIdx.x / F::CH + j * F::TPP;

		pg[j] = t < te ? __ldg(table + attn_div_q(a.bt, (uint32_t)t)) : -1;
	}
}

// Tokens [t0, t0 + TK) of kv head kvh into the stage at sk / sv; chunks past dk and
// tokens without a page are zero-filled, never read.
template <int DK, int TK, int W>
__device__ __forceinline__ void pf_issue(const attn_tile_args &a,
					 const int32_t (&pg)[pf_fill<DK, TK, W>::NP], uint16_t *sk,
					 uint16_t *sv, int t0, int kvh)
{
	using F = pf_fill<DK, TK, W>;
	constexpr int KS = DK + 8;
	const int c = threadIdx.x % F::CH;
	const bool dim_ok = c * 8 < a.dk;

#pragma unroll
	for (int j = 0; j < F::NP; j++) {
		const int tok = (int)threadIdx.x / F::CH + j * F::TPP, t = t0 + tok;
		const bool ok = pg[j] >= 0 && dim_ok;
		size_t slot = 0;

		if (pg[j] >= 0)
			slot = (size_t)pg[j] * a.bt.d + (t - attn_div_q(a.bt, (uint32_t)t) * a.bt.d);
		cp_async16(sk + tok * KS + c * 8, a.k + slot * a.k_stride + kvh * a.k_hoff + c * 8, ok);
		cp_async16(sv + tok * KS + c * 8, a.v + slot * a.v_stride + kvh * a.v_hoff + c * 8, ok);
	}
}

// The lane's queries: in each of the warp's MW m16 tiles, accumulator rows lane / 4 and
// lane / 4 + 8; query i is tile i / 2, row half i % 2.
template <int MW>
struct pf_query {
	int r[2 * MW], h[2 * MW];	// row and q head
	bool ok[2 * MW];		// a query of the call (the last tile may run past them)
};

// q * qscale in bf16 into the block's Q tile (W * MW * 16, DK + 8), zeros past dk and
// for query vectors past the call's: every load issued before the first store.
template <int DK, int W, int MW>
__device__ __forceinline__ void pf_stage_q(const attn_tile_args &a, uint16_t *sq, int qi0, int nq)
{
	constexpr int QV = DK / 4, NQ = W * MW * 16, PER = (NQ * QV + W * 32 - 1) / (W * 32);
	float4 x[PER];

#pragma unroll
	for (int j = 0; j < PER; j++) {
		const int i = threadIdx.x + j * W * 32, q = i / QV, c = i % QV, qi = qi0 + q;

		x[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		if (q < NQ && qi < nq && c * 4 < a.dk)
			x[j] = *(const float4 *)(a.q + (size_t)(qi / a.group) * a.q_rs +
						 (size_t)(blockIdx.y * a.group + qi % a.group) * a.q_hs + c * 4);
	}
#pragma unroll
	for (int j = 0; j < PER; j++) {
		const int i = threadIdx.x + j * W * 32, q = i / QV, c = i % QV;

		if (q < NQ)
			*(uint2 *)(sq + q * (DK + 8) + c * 4) =
				make_uint2(pack_bf16(x[j].x * a.qscale, x[j].y * a.qscale),
					   pack_bf16(x[j].z * a.qscale, x[j].w * a.qscale));
	}
}

// The run's online-softmax state of the lane's queries (base 2) and its share of their
// outputs: o[m][n] holds dims 8 n + 2 (lane % 4) and the next, rows as the scores.
template <int DK, int MW>
struct pf_acc {
	float o[MW][DK / 8][4];
	float m[2 * MW], l[2 * MW];
	int lim[2 * MW];	// tokens t < lim[i] count for query i (-1: not in the run)
};

// One tile of the warp's queries: S = Q K^T over the TK tokens at kb (q from the warp's
// rows of sq), masked per query, the online softmax, then O += P V with V at vb (p from
// the score registers as bf16). Each K and V fragment serves the MW m16 tiles.
template <int DK, int TK, int MW>
__device__ __forceinline__ void pf_tile(const uint16_t *sq, const uint16_t *kb,
					const uint16_t *vb, int t0, pf_acc<DK, MW> &s_)
{
	constexpr int KS = DK + 8, NT = TK / 8, NO = DK / 8;
	const int lane = threadIdx.x % 32;
	float s[MW][NT][4];

#pragma unroll
	for (int m = 0; m < MW; m++)
#pragma unroll
		for (int j = 0; j < NT; j++)
			s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.0f;
#pragma unroll
	for (int kk = 0; kk < DK / 16; kk++) {
		uint32_t qa[MW][4];

#pragma unroll
		for (int m = 0; m < MW; m++)
			ldsm_x4(qa[m], sq + (m * 16 + lane % 16) * KS + kk * 16 + lane / 16 * 8);
#pragma unroll
		for (int j = 0; j < NT; j += 2) {
			uint32_t kf[4];

			ldsm_x4(kf, kb + (j * 8 + lane / 16 * 8 + lane % 8) * KS + kk * 16 +
					    lane / 8 % 2 * 8);
#pragma unroll
			for (int m = 0; m < MW; m++) {
				mma_bf16(s[m][j], qa[m], kf[0], kf[1]);
				mma_bf16(s[m][j + 1], qa[m], kf[2], kf[3]);
			}
		}
	}

	// The causal mask (and the split's end, in lim), the new running maxima.
	float mx[2 * MW], base[2 * MW], al[2 * MW];

#pragma unroll
	for (int i = 0; i < 2 * MW; i++)
		mx[i] = s_.m[i];
#pragma unroll
	for (int m = 0; m < MW; m++)
#pragma unroll
		for (int j = 0; j < NT; j++)
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int t = t0 + j * 8 + lane % 4 * 2 + e;

				if (t >= s_.lim[2 * m])
					s[m][j][e] = -INFINITY;
				if (t >= s_.lim[2 * m + 1])
					s[m][j][2 + e] = -INFINITY;
				mx[2 * m] = fmaxf(mx[2 * m], s[m][j][e]);
				mx[2 * m + 1] = fmaxf(mx[2 * m + 1], s[m][j][2 + e]);
			}
#pragma unroll
	for (int i = 0; i < 2 * MW; i++) {
		mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
		mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
		al[i] = attn_rescale(s_.m[i], mx[i]);
		base[i] = mx[i] == -INFINITY ? 0.0f : mx[i];	// nothing seen yet: p = 0
		s_.m[i] = mx[i];
		s_.l[i] *= al[i];
	}
#pragma unroll
	for (int m = 0; m < MW; m++)
#pragma unroll
		for (int n = 0; n < NO; n++) {
			s_.o[m][n][0] *= al[2 * m];
			s_.o[m][n][1] *= al[2 * m];
			s_.o[m][n][2] *= al[2 * m + 1];
			s_.o[m][n][3] *= al[2 * m + 1];
		}

	// P as A fragments: the score tiles 2 ks and 2 ks + 1 are the k step ks's halves.
#pragma unroll
	for (int ks = 0; ks < TK / 16; ks++) {
		uint32_t pa[MW][4];

#pragma unroll
		for (int m = 0; m < MW; m++)
#pragma unroll
			for (int h = 0; h < 2; h++) {
				const float *x = s[m][2 * ks + h];
				const float p0 = exp2f(x[0] - base[2 * m]), p1 = exp2f(x[1] - base[2 * m]);
				const float p2 = exp2f(x[2] - base[2 * m + 1]);
				const float p3 = exp2f(x[3] - base[2 * m + 1]);

				s_.l[2 * m] += p0 + p1;
				s_.l[2 * m + 1] += p2 + p3;
				pa[m][2 * h] = pack_bf16(p0, p1);
				pa[m][2 * h + 1] = pack_bf16(p2, p3);
			}
#pragma unroll
		for (int n = 0; n < NO; n += 2) {
			uint32_t vf[4];

			ldsm_x4_t(vf, vb + (ks * 16 + lane % 8 + lane / 8 % 2 * 8) * KS + n * 8 +
					      lane / 16 * 8);
#pragma unroll
			for (int m = 0; m < MW; m++) {
				mma_bf16(s_.o[m][n], pa[m], vf[0], vf[1]);
				mma_bf16(s_.o[m][n + 1], pa[m], vf[2], vf[3]);
			}
		}
	}
}

// The run's output of the lane's queries in it, or this split's normalised partial and
// its log2-sum-exp2.
template <int DK, int MW>
__device__ __forceinline__ void pf_store(const attn_tile_args &a, const pf_query<MW> &qy,
					 pf_acc<DK, MW> &s_, int split, uint16_t *out_bf16)
{
	const int lane = threadIdx.x % 32;

#pragma unroll
	for (int i = 0; i < 2 * MW; i++) {
		s_.l[i] += __shfl_xor_sync(0xffffffffu, s_.l[i], 1);
		s_.l[i] += __shfl_xor_sync(0xffffffffu, s_.l[i], 2);
	}
#pragma unroll
	for (int i = 0; i < 2 * MW; i++) {
		const float l = s_.l[i], inv = l > 0.0f ? 1.0f / l : 0.0f;
		const size_t rh = (size_t)qy.r[i] * a.n_heads + qy.h[i];
		const size_t sp = (size_t)split * a.n_rows * a.n_heads + rh;

		if (s_.lim[i] < 0)	// not in this run
			continue;
		if (a.n_splits > 1 && lane % 4 == 0)
			a.part_lse[sp] = l > 0.0f ? s_.m[i] + log2f(l) : -INFINITY;
#pragma unroll
		for (int n = 0; n < DK / 8; n++) {
			const int d = n * 8 + lane % 4 * 2;
			const float x0 = s_.o[i / 2][n][2 * (i % 2)] * inv;
			const float x1 = s_.o[i / 2][n][2 * (i % 2) + 1] * inv;

			if (d >= a.dv)
				continue;
			if (a.n_splits > 1) {	// dv is even and so is d: one 8-byte store
				*(float2 *)(a.part_o + sp * a.dv + d) = make_float2(x0, x1);
			} else {
				const size_t at = (size_t)qy.r[i] * a.out_rs + (size_t)qy.h[i] * a.out_hs + d;

				a.out[at] = x0;
				a.out[at + 1] = x1;
				if (out_bf16) {
					out_bf16[at] = attn_bf16(x0);
					out_bf16[at + 1] = attn_bf16(x1);
				}
			}
		}
	}
}

// Rows [rs, re] of the block share table: their queries attend over this split's part
// of [0, run_max), ST - 1 tiles in flight ahead of the one the warps work on. Tiles past
// the block's last visible token are never loaded; a warp skips the tiles past its own.
template <int DK, int TK, int ST, int W, int MW>
__device__ __forceinline__ void pf_run(const attn_tile_args &a, const uint16_t *sq,
				       const pf_query<MW> &qy, uint16_t *sk, uint16_t *sv,
				       const int32_t *table, int rs, int re, int run_max,
				       uint16_t *out_bf16)
{
	constexpr int KS = DK + 8;
	const int split = blockIdx.z, kvh = blockIdx.y;
	const int per = ((run_max + a.n_splits - 1) / a.n_splits + TK - 1) / TK * TK;
	const int tb = (int)min((long)run_max, (long)split * per), te = min(run_max, tb + per);
	const int nt = (te - tb + TK - 1) / TK;
	int32_t pg[pf_fill<DK, TK, W>::NP];
	pf_acc<DK, MW> s_;
	int wlim = -1;

#pragma unroll
	for (int i = 0; i < 2 * MW; i++) {
		const bool in = qy.ok[i] && qy.r[i] >= rs && qy.r[i] <= re;

		s_.lim[i] = in ? min(a.ctx[qy.r[i]], te) : -1;
		s_.m[i] = -INFINITY;
		s_.l[i] = 0.0f;
		wlim = max(wlim, s_.lim[i]);
	}
#pragma unroll
	for (int m = 0; m < MW; m++)
#pragma unroll
		for (int n = 0; n < DK / 8; n++)
			s_.o[m][n][0] = s_.o[m][n][1] = s_.o[m][n][2] = s_.o[m][n][3] = 0.0f;
	for (int off = 16; off > 0; off >>= 1)
		wlim = max(wlim, __shfl_xor_sync(0xffffffffu, wlim, off));

	__syncthreads();	// the previous run is done with the stages (the first: q staged)
#pragma unroll
	for (int st = 0; st < ST - 1; st++) {
		if (st < nt) {
			pf_page<DK, TK, W>(pg, a, table, tb + st * TK, te);
			pf_issue<DK, TK, W>(a, pg, sk + st * TK * KS, sv + st * TK * KS, tb + st * TK, kvh);
		}
		cp_async_commit();
	}
	pf_page<DK, TK, W>(pg, a, table, tb + (ST - 1) * TK, te);
	for (int it = 0; it < nt; it++) {
		const int buf = it % ST, t0 = tb + it * TK, nx = it + ST - 1;

		cp_async_wait<ST - 2>();	// tiles 0 .. it + ST - 2 committed: tile it landed
		__syncthreads();		// and every warp is done with tile it - 1's stage
		if (nx < nt) {
			pf_issue<DK, TK, W>(a, pg, sk + nx % ST * TK * KS, sv + nx % ST * TK * KS,
					    tb + nx * TK, kvh);
			pf_page<DK, TK, W>(pg, a, table, tb + (nx + 1) * TK, te);
		}
		cp_async_commit();
		if (t0 < wlim)		// (warp-uniform) a token of the tile is the warp's
			pf_tile<DK, TK, MW>(sq, sk + buf * TK * KS, sv + buf * TK * KS, t0, s_);
	}
	cp_async_wait<0>();
	pf_store<DK, MW>(a, qy, s_, split, out_bf16);
}

// The block's query tile at qi0 (query vectors qi = row * group + g), taken in runs of
// consecutive rows that share a block table.
template <int DK, int TK, int ST, int W, int MW>
__device__ __forceinline__ void pf_query_tile(const attn_tile_args &a, uint16_t *sq,
					      uint16_t *sk, uint16_t *sv, int qi0, int nq,
					      uint16_t *out_bf16)
{
	const int r_lo = qi0 / a.group, r_hi = (min(qi0 + W * MW * 16, nq) - 1) / a.group;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	pf_query<MW> qy;

#pragma unroll
	for (int i = 0; i < 2 * MW; i++) {
		const int qi = qi0 + (warp * MW + i / 2) * 16 + lane / 4 + 8 * (i % 2);

		qy.ok[i] = qi < nq;
		qy.r[i] = qy.ok[i] ? qi / a.group : 0;
		qy.h[i] = blockIdx.y * a.group + qi % a.group;
	}
	pf_stage_q<DK, W, MW>(a, sq, qi0, nq);
	for (int rs = r_lo; rs <= r_hi;) {
		const int32_t *const table = a.blocks[rs];
		int re = rs, run_max = a.ctx[rs];

		while (re < r_hi && a.blocks[re + 1] == table)
			run_max = max(run_max, a.ctx[++re]);
		pf_run<DK, TK, ST, W, MW>(a, sq + warp * MW * 16 * (DK + 8), qy, sk, sv, table, rs,
					  re, run_max, out_bf16);
		rs = re + 1;
	}
}

// Block (query tile, kv head, split). PAIR: block x takes tile x and tile T - 1 - x of
// the T tiles: in a causal prompt tile x sees about x + 1 tiles of tokens, so every
// pair sees about T + 1 and the blocks of one wave end together (a 1,024-token Llama
// prefill unpaired: one wave of 256 blocks whose longest sees 32 times the shortest's
// tokens).
template <int DK, int TK, int ST, int W, int MW, int MINB, bool PAIR>
__global__ void __launch_bounds__(W * 32, MINB) attn_prefill_kernel(const attn_tile_args a,
								   uint16_t *out_bf16)
{
	using L = pf_layout<DK, TK, ST, W * MW * 16>;
	constexpr int NQ = W * MW * 16;
	extern __shared__ __align__(16) unsigned char attn_smem[];
	uint16_t *sk = (uint16_t *)(attn_smem + L::k), *sv = (uint16_t *)(attn_smem + L::v);
	uint16_t *sq = (uint16_t *)(attn_smem + L::q);
	const int nq = a.n_rows * a.group, tiles = (nq + NQ - 1) / NQ;
	const int x = blockIdx.x, y = tiles - 1 - x;

	k_cuda_pdl_wait();
	for (int k = 0; k < (PAIR && y > x ? 2 : 1); k++) {	// one body: no second copy
		if (k)						// of its registers
			__syncthreads();	// every warp is done with the first tile's q
		pf_query_tile<DK, TK, ST, W, MW>(a, sq, sk, sv, (k ? y : x) * NQ, nq, out_bf16);
	}
}

// ---- the compiled shapes and the launch ------------------------------------------

struct pf_shape {
	int dk, tk, st, warps, mw;
	bool pair;
	void (*kernel)(const attn_tile_args, uint16_t *);
	unsigned smem;
	int per_sm;		// resident blocks per SM (the occupancy query), 0 unusable
	double tflops;		// its measured rate on long uniform work (the pick's model)
};

// W warps of MW m16 tiles of query vectors; MINB: blocks an SM that __launch_bounds__
// asks registers for.
template <int DK, int TK, int ST, int W, int MW, int MINB, bool PAIR>
static pf_shape pf_make(double tflops)
{
	return { DK, TK, ST, W, MW, PAIR, attn_prefill_kernel<DK, TK, ST, W, MW, MINB, PAIR>,
		 pf_layout<DK, TK, ST, W * MW * 16>::total, 0, tflops };
}

// Unpaired, in the order pf_find tries them: the first that holds head_dim.
static pf_shape pf_shapes[] = {
	// head_dim <= 64: 64 query vectors, 64-token tiles; 63 KB, 168 registers
	pf_make<64, 64, 3, 4, 1, 1, false>(0.0),
	// head_dim <= 128 (Llama 3, Qwen3): 128 query vectors (two m16 tiles a warp),
	// 32-token tiles; 87 KB, 255 registers, 2 blocks an SM. Measured on H200 (Llama-3.1-8B
	// heads, 1024 rows over 32k): 263 TFLOPS; one m16 tile a warp with q in registers
	// and 64-token tiles 238, with 32-token tiles at 3 blocks an SM 194, 8 such warps a
	// block 236 (docs/results/cuda-attn-prefill-h200.txt)
	pf_make<128, 32, 3, 4, 2, 1, false>(263.0),
};

// Paired (causal prompts, pf_pick_paired): that 128-vector shape, and 64 query vectors
// (one m16 tile a warp: twice the blocks, 3 an SM) for prompts whose pairs of 128 leave
// SMs idle.
static pf_shape pf_paired[] = {
	pf_make<128, 32, 3, 4, 2, 1, true>(263.0),
	pf_make<128, 32, 3, 4, 1, 2, true>(238.0),	// the rate W0 measured (its nearest)
};

static int pf_prepare_shape(pf_shape &sh, int smem_optin)
{
	if ((int)sh.smem > smem_optin)
		return 0;
	K_CUDA_TRY(cudaFuncSetAttribute(sh.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
					(int)sh.smem));
	K_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sh.per_sm, sh.kernel,
								 sh.warps * 32, sh.smem));
	return 0;
}

int attn_prefill_prepare(int smem_optin)
{
	int ret = 0;

	for (pf_shape &sh : pf_shapes)
		if (!ret)
			ret = pf_prepare_shape(sh, smem_optin);
	for (pf_shape &sh : pf_paired)
		if (!ret)
			ret = pf_prepare_shape(sh, smem_optin);
	return ret;
}

static const pf_shape *pf_find(int dk)
{
	for (const pf_shape &sh : pf_shapes)
		if (sh.per_sm > 0 && dk <= sh.dk)
			return &sh;
	return nullptr;
}

// k_cuda_tuning()->attn_prefill_mma 0 (KDEC_ATTN_PREFILL_MMA=0), or attn_mma 0 (every
// tensor-core attention off): the tiled CUDA-core kernel takes the prefill rows.
int attn_prefill_usable(const attn_tile_args *a)
{
	const struct k_cuda_tuning *t = k_cuda_tuning();

	return t->attn_mma && t->attn_prefill_mma && a->v && a->dk == a->dv && a->dk % 8 == 0 &&
	       a->vec && a->q_rs % 4 == 0 && a->q_hs % 4 == 0 && (uintptr_t)a->q % 16 == 0 &&
	       a->dv % 2 == 0 && pf_find(a->dk) != nullptr;
}

// Splits along the context: the count whose waves of resident blocks, each block doing
// 1 / n of its tokens, take least time (ties to the fewer), splits of at least
// PF_MIN_SPLIT_TOKENS, no more partials than the workspace holds. 256 new Llama rows
// are 64 blocks: 4 splits fill the 264 slots of 2 blocks an SM; 1024 rows (256 blocks)
// take one. Host values only (graph safety).
static int pf_pick_splits(const k_cuda_attn_ws *ws, long blocks, long slots, int max_ctx,
			  size_t part, size_t lse)
{
	int best = 1;
	double best_cost = 0.0;

	for (int n = 1; n <= ATTN_MAX_SPLITS; n++) {
		const double cost = (double)((blocks * n + slots - 1) / slots) / n;

		if (n > 1 && ((long)max_ctx < (long)n * PF_MIN_SPLIT_TOKENS ||
			      (size_t)n * part > ws->part_floats || (size_t)n * lse > ws->lse_floats))
			break;
		if (n == 1 || cost < best_cost - 1e-9) {
			best = n;
			best_cost = cost;
		}
	}
	return best;
}

// A causal prompt that is most of its own context (its rows see from a few tokens to
// max_ctx: the 1,024 rows of a lone 1k prompt) takes a paired shape, unsplit: of those
// that hold dk, the one whose waves of equal pair blocks, each ~ its query vectors times
// the rows' tokens, at the shape's rate, take least time (ties to the first). NULL:
// the rows see similar context lengths (a chunk deep in a prompt, decode rows): the
// unpaired shape and its splits. KDEC_ATTN_PREFILL_PAIR=0: never.
static const pf_shape *pf_pick_paired(const attn_tile_args *a, int n_sm, int max_ctx)
{
	const pf_shape *best = nullptr, *unpaired = pf_find(a->dk);
	double best_cost = 0.0;

	if (!k_cuda_tuning()->attn_prefill_pair || (long)max_ctx >= 2L * a->n_rows)
		return nullptr;
	for (const pf_shape &sh : pf_paired) {
		const int nq = sh.warps * sh.mw * 16;
		const long blocks = (attn_cdiv(a->n_rows * a->group, nq) + 1) / 2 * a->kv_heads;
		const long slots = (long)sh.per_sm * n_sm;
		double cost;

		if (sh.per_sm <= 0 || !unpaired || sh.dk != unpaired->dk || slots <= 0)
			continue;	// only where the unpaired shape is as wide: no padding
		cost = (double)((blocks + slots - 1) / slots) * nq / sh.tflops;
		if (!best || cost < best_cost - 1e-9) {
			best = &sh;
			best_cost = cost;
		}
	}
	return best;
}

int attn_prefill_launch(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a,
			int max_ctx, uint16_t *out_bf16)
{
	const pf_shape *paired = pf_pick_paired(a, ws->n_sm, max_ctx);
	const pf_shape *sh = paired ? paired : pf_find(a->dk);
	const long tiles = sh ? attn_cdiv(a->n_rows * a->group, sh->warps * sh->mw * 16) : 0;
	dim3 grid;

	if (!sh || !attn_prefill_usable(a))
		ATTN_INVAL("attn_prefill: dk %d dv %d not compiled, or not aligned", a->dk, a->dv);
	if (a->kv_heads > 65535 || tiles < 1)
		ATTN_INVAL("attn_prefill: %d kv heads, %ld tiles unsupported", a->kv_heads, tiles);
	a->n_splits = paired ? 1 :
		      pf_pick_splits(ws, tiles * a->kv_heads, (long)sh->per_sm * ws->n_sm, max_ctx,
				     (size_t)a->n_rows * a->n_heads * a->dv,
				     (size_t)a->n_rows * a->n_heads);
	grid = dim3((unsigned)(paired ? (tiles + 1) / 2 : tiles), a->kv_heads, a->n_splits);
	K_CUDA_TRY(k_cuda_launch_pdl(s, grid, sh->warps * 32, sh->smem, sh->kernel, *a,
				     a->n_splits == 1 ? out_bf16 : nullptr));
	K_CUDA_TRY_LAUNCHED("attn_prefill_kernel");
	if (a->n_splits > 1)
		return attn_merge(s, ws, a->n_splits, a->n_rows, a->n_heads, a->dv, a->out, a->out_rs,
				  a->out_hs, out_bf16);
	return 0;
}
