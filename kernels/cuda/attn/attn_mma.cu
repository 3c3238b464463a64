// Decode attention on the tensor cores: one block per (row, kv head, 16-head chunk,
// split). The block's query vectors are the q heads of one kv head of one row (GQA: the
// group, padded to 16; MLA: 16 of the row's heads, all on the one latent "kv head"), the
// m16 of a bf16 mma.sync; K/V tiles of TK tokens stream through shared memory by
// cp.async, ST stages deep, so the next tiles' loads are in flight while the tensor
// cores work on this one.
//
// Per tile: warp w scores its TK/4 tokens against the 16 queries (S = Q K^T); the
// warps agree on each query's running maximum through shared memory, so they all scale
// by the same factor; the probabilities go to shared memory in bf16; warp w then takes
// its quarter of the value dims for every token of the tile (O += P V). The CUDA-core
// kernels (attn_gqa.cu, attn_tile.cu) keep q and p in fp32; here both enter the tensor
// cores as bf16 (as the rest of the GPU path's activations do), ~3e-3 relative.
// This file: the kernels and the table of their compiled shapes; which shape and how
// many splits a launch takes is attn_mma_launch.cu.
#include <climits>
#include <cstdlib>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mma.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ptx.cuh"

// ---- shared memory ------------------------------------------------------------

// Row strides are odd multiples of 16 bytes, so the 8 rows an ldmatrix phase reads fall
// in 8 different bank groups. QREG (GQA, dk <= 128): q lives in registers as mma
// fragments, staged once through the last K stage (free until the loop's first
// barrier), so it takes no shared memory of its own: 4.3 KB less a block, which lets
// Llama's shape fit 4 blocks an SM where it fit 3 (528 slots for 512 items at batch 64).
// W: warps of the block (MLA's key-split kernel has 2 * MMA_WARPS, see the kernel).
template <int DK, int DV, int TK, int ST, bool VSEP, bool QREG = false, int W = MMA_WARPS>
struct mma_layout {
	static constexpr int QS = DK + 8, KS = DK + 8, VS = VSEP ? DV + 8 : DK + 8, PS = TK + 8;
	static constexpr unsigned q = 0;				// bf16 (MMA_Q, QS)
	static constexpr unsigned k = q + (QREG ? 0u : 2u * MMA_Q * QS);	// bf16 (ST, TK, KS)
	static constexpr unsigned v = k + 2u * ST * TK * KS;		// bf16 (ST, TK, VS)
	static constexpr unsigned p = v + (VSEP ? 2u * ST * TK * VS : 0u);	// bf16 (MMA_Q, PS)
	static constexpr unsigned red = p + 2u * MMA_Q * PS;		// float (W, MMA_Q)
	// float (W - MMA_WARPS, 32, 4): the score fragments of the K-split's second half
	static constexpr unsigned sx = red + 4u * W * MMA_Q;
	static constexpr unsigned total = sx + 4u * (W - MMA_WARPS) * 32 * 4;
	static_assert(DK % 32 == 0 && DV % 64 == 0 && TK % 32 == 0 && ST >= 2, "tile shape");
	static_assert(q % 16 == 0 && k % 16 == 0 && v % 16 == 0 && p % 16 == 0, "alignment");
	static_assert(!QREG || (VSEP && DK <= 128 && TK * KS >= MMA_Q * QS), "q in registers");
};

// ---- kernel -------------------------------------------------------------------

// How a block's threads share the copies of a tile. Where a K row's 16-byte chunks
// divide the block (GQA: 16 of them for head_dim 128), CH consecutive lanes take one
// whole row, so each copy instruction covers whole 128-byte lines (L2 serves full
// lines: with 64 bytes per row and instruction it ran at 81% of its throughput for 65%
// of DRAM's at batch 64), and a thread copies NP tokens of the tile. Otherwise (MLA's
// 72 chunks) T / TK threads share one token, every TPT-th chunk each (T: the
// block's threads, MMA_THREADS but for the MLA K-split kernel).
template <int DK, int TK, int T = MMA_THREADS>
struct mma_fill {
	static constexpr int CH = DK / 8;
	static constexpr bool ROWS = T % CH == 0 && TK % (T / CH) == 0;
	static constexpr int TPP = ROWS ? T / CH : T / TK;	// tokens/pass
	static constexpr int NP = ROWS ? TK / TPP : 1;		// tokens per thread
	static constexpr int TPT = T / TK;			// (not ROWS) threads per token

	__device__ static int tok(int j)
	{
		return ROWS ? (int)threadIdx.x / CH + j * TPP : (int)threadIdx.x / TPT;
	}
};

// The cache blocks (table entries) of this thread's tokens of the tile at t0, -1 past
// te: loaded one tile ahead of their use, so the copies never wait for the table.
// EARLY: before the kernel's PDL wait (the table is a settled step input), through
// launch_check.cuh's early loads.
template <int DK, int TK, int T = MMA_THREADS, bool EARLY = false>
__device__ __forceinline__ void mma_page(int32_t (&pg)[mma_fill<DK, TK, T>::NP],
					 const attn_tile_args &a, const int32_t *table, int t0,
					 int te)
{
	using F = mma_fill<DK, TK, T>;

#pragma unroll
	for (int j = 0; j < F::NP; j++) {
		const int t = t0 + F::tok(j);

		const int32_t *e = table + attn_div_q(a.bt, (uint32_t)t);

		pg[j] = t >= te ? -1 : EARLY ? k_cuda_pdl_early(e) : __ldg(e);
	}
}

// 16 bytes of a K/V row into a stage: EARLY before the PDL wait (see mma_issue).
template <bool EARLY>
__device__ __forceinline__ void mma_cp16(uint16_t *smem, const uint16_t *gmem, bool valid)
{
	if (EARLY)
		k_cuda_pdl_early_cp16(smem, gmem, valid);
	else
		cp_async16(smem, gmem, valid);
}

// Tokens [t0, t0 + TK) of the block's row into stage buffers (see mma_fill); chunks past
// dk (dv) and tokens past te (page -1) are zero-filled, never read. MLA with its cache
// append in the kernel just before (a.early): the tokens from fresh up to te are not
// issued (late false: no copy, not even a zero fill, may target their rows before the
// PDL wait) or only they are (late true: their copies after the wait). EARLY: issued
// before that wait (tokens settled before the step), through k_cuda_pdl_early_cp16.
template <int DK, int DV, int TK, bool VSEP, int T = MMA_THREADS, bool EARLY = false>
__device__ __forceinline__ void mma_issue(const attn_tile_args &a,
					  const int32_t (&pg)[mma_fill<DK, TK, T>::NP], uint16_t *sk,
					  uint16_t *sv, int t0, int kvh, int fresh = INT_MAX,
					  bool late = false)
{
	using F = mma_fill<DK, TK, T>;
	constexpr int KS = DK + 8, VS = VSEP ? DV + 8 : KS;
	static_assert(!F::ROWS || !VSEP || DV == DK, "whole-row copies assume dv == dk");

#pragma unroll
	for (int j = 0; j < F::NP; j++) {
		const int tok = F::tok(j), t = t0 + tok;
		const bool ok = pg[j] >= 0;
		size_t slot = 0;

		if (!VSEP && (t >= fresh && ok) != late)	// (GQA: never)
			continue;
		if (ok)
			slot = (size_t)pg[j] * a.bt.d + (t - attn_div_q(a.bt, (uint32_t)t) * a.bt.d);
		const uint16_t *krow = a.k + slot * a.k_stride + kvh * a.k_hoff;
		const uint16_t *vrow = VSEP ? a.v + slot * a.v_stride + kvh * a.v_hoff : nullptr;

		if (F::ROWS) {
			const int c = threadIdx.x % F::CH;

			mma_cp16<EARLY>(sk + tok * KS + c * 8, krow + c * 8, ok && c * 8 < a.dk);
			if (VSEP)
				mma_cp16<EARLY>(sv + tok * VS + c * 8, vrow + c * 8, ok && c * 8 < a.dv);
		} else {
			const int sub = threadIdx.x % F::TPT;
#pragma unroll
			for (int c = sub; c < DK / 8; c += F::TPT)
				mma_cp16<EARLY>(sk + tok * KS + c * 8, krow + c * 8, ok && c * 8 < a.dk);
			if (VSEP)
#pragma unroll
				for (int c = sub; c < DV / 8; c += F::TPT)
					mma_cp16<EARLY>(sv + tok * VS + c * 8, vrow + c * 8,
						   ok && c * 8 < a.dv);
		}
	}
}

// ---- GQA: qkv_post folded in (POST): attn_mma_post.cuh ------------------------

#include "kernels/cuda/attn/attn_mma_post.cuh"

// MLA's split floor at this ctx: a.min_split tokens, or (a.split_live > 0) no more of
// them than keeps at most a.split_live splits holding tokens. Measured at batch 1
// (V2-Lite, cold): ctx 1024 ran faster with 33 one-tile splits than with 17 of two
// (20.5 / 22.0 us), ctx 4096 slower with 128 than with 64 (27.7 / 25.9 us): below 64
// splits a block's second tile costs more than the merge's extra partials, past it
// less. With 64, ctx <= 2048 keeps the 32-token splits, longer ones get 64.
__device__ __forceinline__ int mma_mla_floor(const attn_tile_args &a, int ctx)
{
	return a.split_live > 0 ? min(a.min_split, attn_split_len(ctx, a.split_live))
				: a.min_split;
}

// W warps: MMA_WARPS, or (MLA, one n8 tile of tokens per warp) 2 * MMA_WARPS, where
// warps w and w + MMA_WARPS score the same tokens over the two halves of the 576 key
// dims (KH = 2): at batch 1 a block holds one or two tiles, and the dependent chain of
// each warp's k16 steps, value columns and partial stores, not bandwidth, is its time;
// twice the warps halve each of them. The second half's scores reach the first through
// shared memory (one more barrier per tile); the first half alone runs the softmax.
// POST (GQA, q in registers, group <= MMA_Q): qkv_post's work in the launch, p its
// arguments (see mma_post_kv); the others ignore p.
//
// One function of ~450 lines on purpose: it is one software pipeline. The cp.async
// commit groups and their waits are counted across the prologue (tiles issued before
// and after the PDL wait), the tile loop and the epilogue, and the running maxima and
// sums, the o accumulators and (QREG) q's fragments stay in registers throughout;
// helpers would have to take all of that by reference and be force-inlined, and the
// wait counts would then be split from the commits they count. The phases are marked
// by the comments inside.
// pdl-order: relay attn_mma_kernel
template <int DK, int DV, int TK, int ST, bool VSEP, bool QREG = false, int W = MMA_WARPS,
	  bool POST = false>
__global__ void __launch_bounds__(W * 32)
attn_mma_kernel(const attn_tile_args a, int n_hc, uint16_t *out_bf16, const k_cuda_qkv_args p)
{
	using L = mma_layout<DK, DV, TK, ST, VSEP, QREG, W>;
	constexpr int T = W * 32;		// threads
	constexpr int KH = W / MMA_WARPS;	// warps per token group: halves of the key dims
	constexpr int NT = TK / 32;		// n8 tiles of tokens per warp (S phase)
	constexpr int WT = TK / MMA_WARPS;	// tokens per warp (S phase)
	constexpr int DVW = DV / W;		// value dims per warp (PV phase)
	constexpr int NV = DVW / 8;		// n8 tiles of value dims per warp
	// tiles issued before the loop: every stage where the K-split kernel runs (MLA)
	constexpr int PRE = KH == 2 ? ST : ST - 1;
	static_assert(KH == 1 || (KH == 2 && !VSEP && NT == 1 && DK > 128 && DK % 64 == 0 &&
				  DV % (8 * 16) == 0), "the K-split is MLA's 32-token tiles");
	static_assert(!POST || (VSEP && QREG && W == MMA_WARPS &&
				mma_post_scratch<DK>::total <= 2u * TK * L::KS),
		      "qkv_post folded in: GQA, q in registers, its scratch in a K stage");
	extern __shared__ __align__(16) unsigned char attn_smem[];
	uint16_t *sk = (uint16_t *)(attn_smem + L::k);
	uint16_t *sq = QREG ? sk + (ST - 1) * TK * L::KS : (uint16_t *)(attn_smem + L::q);
	uint16_t *sv = (uint16_t *)(attn_smem + L::v), *sp = (uint16_t *)(attn_smem + L::p);
	float *red = (float *)(attn_smem + L::red);
	float4 *sx = (float4 *)(attn_smem + L::sx);
	// the kv heads of a row side by side in x: their K/V rows are neighbours in the cache
	const int split = blockIdx.y, hc = blockIdx.x;
	const int r = blockIdx.z, kvh = hc / n_hc, g0 = (hc % n_hc) * MMA_Q;
	const int ng = min(MMA_Q, a.group - g0), h0 = kvh * a.group + g0;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	// the warp's tokens (tg) and half of the key dims (kh); with KH 1 the warp and 0
	const int tg = KH == 1 ? warp : warp % MMA_WARPS, kh = KH == 1 ? 0 : warp / MMA_WARPS;
	const int qr0 = lane / 4, qr1 = qr0 + 8;	// the two query rows of a lane's accumulators
	// GQA: K/V of this step's token come from the kernel just before (qkv_post), so
	// q and those tokens wait for it. Tokens below ctx - n_rows are none of them (a
	// row's sequence appends at most n_rows tokens this step, at its last positions),
	// and the ctx and block tables are the step's inputs, written before its first
	// kernel: with a.early the first tiles that lie wholly below go out before the wait,
	// overlapping qkv_post's tail (KDEC_ATTN_MMA_EARLY=0: everything waits). MLA: that
	// kernel is the absorb projection, which wrote only q_lat and itself waited for
	// mla_post (the cache append) before letting this launch start; so the block table
	// and the first tiles' copies go out before the wait, overlapping the absorb's
	// tail, and only q waits (k_cuda_attn_mla keeps that order). Where the absorb
	// launch makes the append itself (a.early, k_cuda_attn_mla_post), the rows of
	// tokens from ctx - n_rows (this step's) are copied after the wait instead.
	// One wait on every path (tests/pdl_order.sh reads that off the SASS): before it only
	// the early loads of the settled step inputs (ctx, block table) and the early copies
	// of tokens older than the step; KDEC_ATTN_MMA_EARLY=0 (GQA) issues no copy before it.
	const bool early = VSEP && a.early;

	k_cuda_pdl_relay(a.relay);
	// MLA: splits of at least mma_mla_floor tokens, the ones past ctx empty (a graph
	// sizes the splits for the whole cache; at a short ctx each would hold one tile, and
	// the merge reads a 32 KB partial per split). GQA never reads the fields.
	const int ctx = k_cuda_pdl_early(a.ctx + r);
	const int per = VSEP ? attn_split_len(ctx, a.n_splits)
			     : max(attn_split_len(ctx, a.n_splits), mma_mla_floor(a, ctx));
	const int tb = (int)min((long)ctx, (long)split * per), te = min(ctx, tb + per);
	const int n_tiles = (te - tb + TK - 1) / TK;
	const int32_t *table = k_cuda_pdl_early(a.blocks + r);
	float o[NV][4], m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
	// POST: the block whose split holds the row's new token (ctx - 1) appends its K/V
	// (with no token, split 0: qkv_post writes the row's slot whatever its ctx)
	const bool post_kv = POST && (ctx > 0 ? tb < ctx && te == ctx : split == 0);
	unsigned char *post_sc = (unsigned char *)(sk + (ST - 1) * TK * L::KS);
	float2 *post_cs = (float2 *)(post_sc + mma_post_scratch<DK>::cs);

	// A split past the row's context (graphs size the splits for the whole cache: at
	// batch 1 most are) says so in its log-sum-exp and stops: the merge never reads its
	// partial, so it neither stages q nor writes (n_heads, dv) zeros.
	if (n_tiles == 0 && a.n_splits > 1) {
		k_cuda_pdl_wait();
		if (post_kv) {
			mma_post_cs_table(p, r, post_cs);
			__syncthreads();
			mma_post_kv<DK>(p, r, kvh, (float *)(post_sc + mma_post_scratch<DK>::k),
					(double *)(post_sc + mma_post_scratch<DK>::red), post_cs);
		}
		if (threadIdx.x < ng)
			a.part_lse[(size_t)split * a.n_rows * a.n_heads + (size_t)r * a.n_heads + h0 +
				   threadIdx.x] = -INFINITY;
		return;
	}

	// q * qscale in bf16, rows past the chunk and dims past dk zero: every load issued
	// before the first store (one memory latency, not one per row). The loads go out
	// first, the stores wait until the first tiles' copies are issued: the block table's
	// load and the K/V fetch behind it do not queue behind q's arrival.
	int32_t pg[mma_fill<DK, TK, T>::NP];
	int pre = 0;	// GQA early: the tiles (a prefix) issued before the wait

	if (early) {
		// POST: this step's only token of the row is its last
		const int old_end = POST ? ctx - 1 : ctx - a.n_rows;

#pragma unroll
		for (int s = 0; s < ST - 1; s++)
			if (s == pre && s < n_tiles && tb + (s + 1) * TK <= old_end) {
				mma_page<DK, TK, T, true>(pg, a, table, tb + s * TK, te);
				mma_issue<DK, DV, TK, VSEP, T, true>(a, pg, sk + s * TK * L::KS,
								     sv + s * TK * L::VS,
								     tb + s * TK, kvh);
				cp_async_commit();
				pre = s + 1;
			}
	}
	// MLA, a.early: this block holds tokens of this step (block-uniform); its first
	// iteration then waits for every copy so far, the late group included.
	const int fresh = !VSEP && a.early ? ctx - a.n_rows : INT_MAX;
	const bool refresh = !VSEP && fresh < te;
	// MLA: the first tiles before the wait (see above). The K-split kernel fills every
	// stage here, their table entries loaded together (one latency, not one per tile),
	// and issues no tile at the top of its first iteration (below): with a 64-token
	// split floor a block's second tile is in flight with its first instead of behind it.
	int32_t pgs[VSEP ? 1 : PRE][mma_fill<DK, TK, T>::NP];

	if (!VSEP) {
#pragma unroll
		for (int s = 0; s < PRE; s++)
			mma_page<DK, TK, T, true>(pgs[s], a, table, tb + s * TK, te);
#pragma unroll
		for (int s = 0; s < PRE; s++) {
			if (s < n_tiles)
				mma_issue<DK, DV, TK, VSEP, T, true>(a, pgs[s], sk + s * TK * L::KS,
								     sv + s * TK * L::VS,
								     tb + s * TK, kvh, fresh, false);
			cp_async_commit();
		}
	}
	k_cuda_pdl_wait();
	if (refresh) {	// MLA: this step's rows, written by the launch just before
#pragma unroll
		for (int s = 0; s < PRE; s++)
			if (s < n_tiles)
				mma_issue<DK, DV, TK, VSEP, T>(a, pgs[VSEP ? 0 : s], sk + s * TK * L::KS,
							       sv + s * TK * L::VS, tb + s * TK, kvh,
							       fresh, true);
		cp_async_commit();
	}
	constexpr int QV = DK / 4, QPT = (MMA_Q * QV + T - 1) / T;
	float4 qx[QPT];

#pragma unroll
	for (int j = 0; j < QPT; j++) {
		const int i = threadIdx.x + j * T, g = i / QV, c = i % QV;

		qx[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		if (i < MMA_Q * QV && g < ng && c * 4 < a.dk)
			qx[j] = *(const float4 *)(a.q + (size_t)r * a.q_rs + (size_t)(h0 + g) * a.q_hs +
						  c * 4);
	}
	// POST: before any copy that may hold the new token (the early ones do not); the
	// other blocks make the angles' table after their copies go out
	if (post_kv) {
		mma_post_cs_table(p, r, post_cs);
		__syncthreads();
		mma_post_kv<DK>(p, r, kvh, (float *)(post_sc + mma_post_scratch<DK>::k),
				(double *)(post_sc + mma_post_scratch<DK>::red), post_cs);
	}
#pragma unroll
	for (int n = 0; n < NV; n++)
		o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

#pragma unroll
	for (int s = 0; s < ST - 1 && VSEP; s++) {
		if (s < pre)	// went out before the wait
			continue;
		if (s < n_tiles) {
			mma_page<DK, TK, T>(pg, a, table, tb + s * TK, te);
			mma_issue<DK, DV, TK, VSEP, T>(a, pg, sk + s * TK * L::KS,
						       sv + s * TK * L::VS, tb + s * TK, kvh);
		}
		cp_async_commit();
	}
	if (POST) {	// qkv_post's q from the raw projection (a.q), in place
		float c[4], sn[4];
		float *sc = (float *)(post_sc + mma_post_scratch<DK>::q) +
			    warp * MMA_POST_WARP_FLOATS;

		if (!post_kv) {
			mma_post_cs_table(p, r, post_cs);
			__syncthreads();
		}
		mma_post_cs<(POST ? QV : 32)>(p, post_cs, c, sn);
#pragma unroll
		for (int j = 0; j < QPT; j++)	// (warp-uniform) heads past the chunk stay 0
			if ((warp * 32 + j * T) / QV < ng)
				mma_post_q<(POST ? QV : 32)>(p, qx[j], sc, c, sn);
	}
#pragma unroll
	for (int j = 0; j < QPT; j++) {
		const int i = threadIdx.x + j * T, g = i / QV, c = i % QV;

		if (i < MMA_Q * QV)
			*(uint2 *)(sq + g * L::QS + c * 4) =
				make_uint2(pack_bf16(qx[j].x * a.qscale, qx[j].y * a.qscale),
					   pack_bf16(qx[j].z * a.qscale, qx[j].w * a.qscale));
	}
	// QREG: q's A fragments, read before the loop's first barrier lets tile ST - 1's
	// copies into the stage that holds them.
	uint32_t qf[QREG ? DK / 16 : 1][4];

	if (QREG) {
		__syncthreads();	// q staged
#pragma unroll
		for (int kk = 0; kk < (QREG ? DK / 16 : 0); kk++)
			ldsm_x4(qf[kk], sq + (lane % 16) * L::QS + kk * 16 + lane / 16 * 8);
	}
	mma_page<DK, TK, T>(pg, a, table, tb + PRE * TK, te);
	for (int it = 0; it < n_tiles; it++) {
		const int buf = it % ST, t0 = tb + it * TK;
		const uint16_t *kb = sk + buf * TK * L::KS;
		const uint16_t *vb = (VSEP ? sv + buf * TK * L::VS : kb);
		float s[NT][4];

		// commit groups so far: tiles 0 .. it + ST - 2 (ST at it 0 where PRE is ST),
		// and (refresh) the late rows of the first PRE after them
		if (!VSEP && refresh && it == 0)
			cp_async_wait<0>();
		else if (PRE == ST && it == 0)
			cp_async_wait<ST - 1>();
		else
			cp_async_wait<ST - 2>();
		__syncthreads();	// tile it landed; every warp is done with tile it - 1
		if (PRE < ST || it > 0) {	// tile it + ST - 1 into tile it - 1's buffer
			const int nx = it + ST - 1, nb = nx % ST;

			if (nx < n_tiles) {
				mma_issue<DK, DV, TK, VSEP, T>(a, pg, sk + nb * TK * L::KS,
							       sv + nb * TK * L::VS, tb + nx * TK,
							       kvh);
				mma_page<DK, TK, T>(pg, a, table, tb + (nx + 1) * TK, te);
			}
			cp_async_commit();
		}

		// S = Q K^T over the warp's WT tokens.
#pragma unroll
		for (int j = 0; j < NT; j++)
			s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
		if (QREG && NT == 2) {	// the same mma as below, q from registers
#pragma unroll
			for (int kk = 0; kk < (QREG ? DK / 16 : 0); kk++) {
				uint32_t kf[4];

				ldsm_x4(kf, kb + (warp * WT + lane / 16 * 8 + lane % 8) * L::KS +
						    kk * 16 + lane / 8 % 2 * 8);
				mma_bf16(s[0], qf[kk], kf[0], kf[1]);
				mma_bf16(s[NT - 1], qf[kk], kf[2], kf[3]);
			}
		} else if (QREG) {
#pragma unroll
			for (int kk = 0; kk < (QREG ? DK / 16 : 0); kk += 2) {
				uint32_t kf[4];

				ldsm_x4(kf, kb + (warp * WT + lane % 8) * L::KS + kk * 16 + lane / 8 * 8);
				mma_bf16(s[0], qf[kk], kf[0], kf[1]);
				mma_bf16(s[0], qf[kk + 1], kf[2], kf[3]);
			}
		} else if (NT == 2) {
#pragma unroll 4
			for (int kk = 0; kk < DK / 16; kk++) {
				uint32_t qa[4], kf[4];

				ldsm_x4(qa, sq + (lane % 16) * L::QS + kk * 16 + lane / 16 * 8);
				ldsm_x4(kf, kb + (tg * WT + lane / 16 * 8 + lane % 8) * L::KS +
						    kk * 16 + lane / 8 % 2 * 8);
				mma_bf16(s[0], qa, kf[0], kf[1]);
				mma_bf16(s[NT - 1], qa, kf[2], kf[3]);
			}
		} else if (DK <= 128) {
#pragma unroll 4
			for (int kk = 0; kk < DK / 16; kk += 2) {
				uint32_t qa[4], qb[4], kf[4];

				ldsm_x4(qa, sq + (lane % 16) * L::QS + kk * 16 + lane / 16 * 8);
				ldsm_x4(qb, sq + (lane % 16) * L::QS + kk * 16 + 16 + lane / 16 * 8);
				ldsm_x4(kf, kb + (tg * WT + lane % 8) * L::KS + kk * 16 + lane / 8 * 8);
				mma_bf16(s[0], qa, kf[0], kf[1]);
				mma_bf16(s[0], qb, kf[2], kf[3]);
			}
		} else {
			// MLA's 36 k16 steps (18 a warp where KH is 2): two accumulators, so
			// the dependent chain of mma latencies (the kernel's critical path at
			// batch 1) is half as long.
			constexpr int KK = DK / 16 / KH;
			float s1[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

#pragma unroll 6
			for (int kk = kh * KK; kk < (kh + 1) * KK; kk += 2) {
				uint32_t qa[4], qb[4], kf[4];

				ldsm_x4(qa, sq + (lane % 16) * L::QS + kk * 16 + lane / 16 * 8);
				ldsm_x4(qb, sq + (lane % 16) * L::QS + kk * 16 + 16 + lane / 16 * 8);
				ldsm_x4(kf, kb + (tg * WT + lane % 8) * L::KS + kk * 16 + lane / 8 * 8);
				mma_bf16(s[0], qa, kf[0], kf[1]);
				mma_bf16(s1, qb, kf[2], kf[3]);
			}
#pragma unroll
			for (int e = 0; e < 4; e++)
				s[0][e] += s1[e];
			if (KH == 2) {	// the second half's scores to the first: same fragment
				if (kh)
					sx[tg * 32 + lane] = make_float4(s[0][0], s[0][1], s[0][2],
									 s[0][3]);
				__syncthreads();
				if (!kh) {
					const float4 x = sx[tg * 32 + lane];

					s[0][0] += x.x;
					s[0][1] += x.y;
					s[0][2] += x.z;
					s[0][3] += x.w;
				}
			}
		}

		// Mask past te, per-warp row maxima, shared.
		float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
		for (int j = 0; j < NT; j++)
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int t = t0 + tg * WT + j * 8 + lane % 4 * 2 + e;

				if (t >= te)
					s[j][e] = s[j][2 + e] = -INFINITY;
				mx0 = fmaxf(mx0, s[j][e]);
				mx1 = fmaxf(mx1, s[j][2 + e]);
			}
#pragma unroll
		for (int off = 1; off < 4; off <<= 1) {
			mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
			mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
		}
		if (lane % 4 == 0 && !kh) {	// the second half's s is partial: not a score
			red[warp * MMA_Q + qr0] = mx0;
			red[warp * MMA_Q + qr1] = mx1;
		}
		__syncthreads();
		float n0 = m0, n1 = m1;
#pragma unroll
		for (int w = 0; w < MMA_WARPS; w++) {	// the first half's warps
			n0 = fmaxf(n0, red[w * MMA_Q + qr0]);
			n1 = fmaxf(n1, red[w * MMA_Q + qr1]);
		}
		// Every tile holds a token below te, so n0 and n1 are finite here.
		const float al0 = exp2f(m0 - n0), al1 = exp2f(m1 - n1);

		m0 = n0;
		m1 = n1;
		l0 *= al0;
		l1 *= al1;
#pragma unroll
		for (int j = 0; j < NT && !kh; j++) {	// P: the first half (l stays 0 in the second)
			const int c = tg * WT + j * 8 + lane % 4 * 2;
			const float p0 = exp2f(s[j][0] - n0), p1 = exp2f(s[j][1] - n0);
			const float p2 = exp2f(s[j][2] - n1), p3 = exp2f(s[j][3] - n1);

			l0 += p0 + p1;
			l1 += p2 + p3;
			*(uint32_t *)(sp + qr0 * L::PS + c) = pack_bf16(p0, p1);
			*(uint32_t *)(sp + qr1 * L::PS + c) = pack_bf16(p2, p3);
		}
#pragma unroll
		for (int n = 0; n < NV; n++) {
			o[n][0] *= al0;
			o[n][1] *= al0;
			o[n][2] *= al1;
			o[n][3] *= al1;
		}
		__syncthreads();	// P complete

		// O += P V over the warp's value dims.
#pragma unroll
		for (int ks = 0; ks < TK / 16; ks++) {
			uint32_t pa[4];

			ldsm_x4(pa, sp + (lane % 16) * L::PS + ks * 16 + lane / 16 * 8);
#pragma unroll
			for (int n = 0; n < NV; n += 2) {
				uint32_t vf[4];

				ldsm_x4_t(vf, vb + (ks * 16 + lane % 8 + lane / 8 % 2 * 8) * L::VS +
						      warp * DVW + n * 8 + lane / 16 * 8);
				mma_bf16(o[n], pa, vf[0], vf[1]);
				mma_bf16(o[n + 1], pa, vf[2], vf[3]);
			}
		}
	}
	cp_async_wait<0>();

	// Row sums: the lane quad, then the warps (each summed its own tokens).
#pragma unroll
	for (int off = 1; off < 4; off <<= 1) {
		l0 += __shfl_xor_sync(0xffffffffu, l0, off);
		l1 += __shfl_xor_sync(0xffffffffu, l1, off);
	}
	__syncthreads();	// the last tile's maxima are read
	if (lane % 4 == 0) {
		red[warp * MMA_Q + qr0] = l0;
		red[warp * MMA_Q + qr1] = l1;
	}
	__syncthreads();
	l0 = l1 = 0.0f;
#pragma unroll
	for (int w = 0; w < W; w++) {
		l0 += red[w * MMA_Q + qr0];
		l1 += red[w * MMA_Q + qr1];
	}

	// The output, or this split's normalised partial and its log2-sum-exp2.
#pragma unroll
	for (int half = 0; half < 2; half++) {
		const int g = half ? qr1 : qr0;
		const float l = half ? l1 : l0, m = half ? m1 : m0, inv = l > 0.0f ? 1.0f / l : 0.0f;
		const size_t rh = (size_t)r * a.n_heads + h0 + g;

		if (g >= ng)
			continue;
		if (a.n_splits > 1 && lane % 4 == 0 && warp == 0)
			a.part_lse[(size_t)split * a.n_rows * a.n_heads + rh] =
				l > 0.0f ? m + log2f(l) : -INFINITY;
#pragma unroll
		for (int n = 0; n < NV; n++) {
			const int d = warp * DVW + n * 8 + lane % 4 * 2;
			const float x0 = o[n][2 * half] * inv, x1 = o[n][2 * half + 1] * inv;

			if (d >= a.dv)
				continue;
			if (a.n_splits > 1) {
				float *po = a.part_o +
					    ((size_t)split * a.n_rows * a.n_heads + rh) * a.dv + d;

				// dv is even (mma_find) and d is: one 8-byte store
				*(float2 *)po = make_float2(x0, x1);
			} else {
				const size_t at = (size_t)r * a.out_rs + (size_t)(h0 + g) * a.out_hs + d;

				a.out[at] = x0;
				if (out_bf16)
					out_bf16[at] = attn_bf16(x0);
				if (d + 1 < a.dv) {
					a.out[at + 1] = x1;
					if (out_bf16)
						out_bf16[at + 1] = attn_bf16(x1);
				}
			}
		}
	}
}

// ---- the compiled shapes (attn_mma_launch.cu picks among them) ------------------

template <int DK, int DV, int TK, int ST, bool VSEP, bool QREG = false, int W = MMA_WARPS,
	  bool POST = false>
static mma_shape mma_make()
{
	return { DK, DV, TK, VSEP, QREG, POST, W * 32,
		 attn_mma_kernel<DK, DV, TK, ST, VSEP, QREG, W, POST>,
		 mma_layout<DK, DV, TK, ST, VSEP, QREG, W>::total, 0 };
}

mma_shape attn_mma_shapes[] = {
	mma_make<64, 64, 64, 2, true>(),	// GQA head_dim <= 64
	mma_make<128, 128, 32, 3, true>(),	// GQA head_dim <= 128 (Llama, Qwen3)
	mma_make<128, 128, 64, 2, true>(),	// the same, longer tiles (KDEC_ATTN_MMA_TK=64)
	// MLA, the key dims split (mla_ksplit in attn_mma_launch.cu)
	mma_make<576, 512, 32, 2, false, false, 2 * MMA_WARPS>(),
	mma_make<576, 512, 32, 2, false>(),	// MLA kv_lora <= 512, + rope <= 64 (DeepSeek)
	// GQA's shapes with q in registers (the default; KDEC_ATTN_MMA_QREG=0: the above)
	mma_make<64, 64, 64, 2, true, true>(),
	mma_make<128, 128, 32, 3, true, true>(),
	mma_make<128, 128, 64, 2, true, true>(),
	// the same with qkv_post's work folded in (k_cuda_attn_gqa_qkv; only those pick them)
	mma_make<64, 64, 64, 2, true, true, MMA_WARPS, true>(),
	mma_make<128, 128, 32, 3, true, true, MMA_WARPS, true>(),
	mma_make<128, 128, 64, 2, true, true, MMA_WARPS, true>(),
};
const int attn_mma_n_shapes = sizeof(attn_mma_shapes) / sizeof(attn_mma_shapes[0]);
