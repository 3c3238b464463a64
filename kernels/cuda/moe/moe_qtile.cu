// The grouped path's expert GEMMs as tile kernels (fp8, int4 groups of 32; bf16 from 2048
// rows a call, KDEC_MOE_QTILE_BF16) where a call has at most
// k_cuda_tuning()->moe_qtile_rows rows (KDEC_MOE_QTILE_ROWS, 4096; 64 before session 34),
// in place of expert_mma_kernel, which reads its weights with narrow per-lane loads (16
// bytes of bf16, 8 of fp8, 4 of int4: the same 8 values), one scale load per 32-k chunk,
// and splits K over its 4 warps with a shared-memory reduction: 63% (bf16), 12% (fp8) and
// 6% (int4) of the floor at 64 rows on H200 (docs/PERFORMANCE.md, "Quantized MoE
// experts"). The form is the dense quantized tile kernel's (linear_qtile.cu). Measured
// (H200, session 18): Qwen3-30B-A3B fp8 batch 64 2.4x faster a step than on
// expert_mma_kernel (43.5 -> 18.1 ms), int4 1.35x (17.5 -> 12.9), DeepSeek-V2-Lite fp8
// 2.15x; bf16 experts 12% slower (25.7 -> 28.8 ms), so at decode they stay on
// expert_mma_kernel unless KDEC_MOE_QTILE_BF16=1.
//
// A CTA owns 128 weight rows of one used expert (gate/up: 64 features, their gate rows
// and their up rows, so a lane forms the SwiGLU of its own accumulators; down: 128
// features) and streams them over the whole K in 64-byte slabs through a 4-buffer
// cp.async pipeline, with the same slab of its expert rows' split x (bf16 hi + lo, the
// plan kernel's xs, or the gate/up kernel's activations) in the same copy groups. Its
// expert rows go 16 a pass (two n8 tiles; those past the pass's rows skipped), or in wide
// passes of 64 (int4 32) in calls of k_cuda_tuning()->moe_qtile_wide rows or more
// (KDEC_MOE_QTILE_WIDE, 256: prefill chunks, which take the tile kernels whatever
// KDEC_MOE_QTILE_ROWS says); an expert with more rows than a pass streams its weights
// once a pass, its passes spread over up to 8 CTAs (xt_splits, KDEC_MOE_QTILE_SPLIT).
// Measured (H100, session 32), Qwen3-30B-A3B's experts alone at 2048 rows: int4 1.76 ms
// (16-row passes 1.88, expert_mma_kernel 5.08), fp8 1.62 (2.94, 4.26), bf16 1.99 (5.66,
// 3.31); kdbench prefill of 2048 tokens int4 295 -> 214 ms, fp8 262 -> 183, but bf16 210
// -> 221 (one CTA an expert's passes; spread over 8, session 34: 115).
//
// Arithmetic as expert_mma_kernel's: the weights are (or become, moe_grouped.cuh) exact
// bf16 pairs in registers, each product is taken twice (x hi, x lo: ~16 bits of x), fp32
// accumulators; a scale multiplies each partial sum it covers in fp32: fp8 a slab's
// (64 k; blocks of 64 or more columns), int4 a group's (each mma.sync takes the 16 k of
// one group: lane t the word t of group G, i.e. k 32 G + 8 t .. + 7). No K split, so
// no partials. Not bit-identical to expert_mma_kernel (another order of the sums).
// contrib/check_moe_qtile.py models the index arithmetic below (no GPU needed).
//
// Counted in the SASS (nvcc 13.0, sm_90a, cuobjdump of contrib/fetch-cuobjdump.sh), one
// warp's slab of 32 weight rows x 64 bytes with two n8 tiles: bf16 ~110 instructions (32
// k), fp8 ~350 (64 k; 96 of them the e4m3 -> bf16 conversion; one chain of 8 dependent
// mma.sync a tile had ptxas pad ~40 NOPs a slab, four chains of 4 need ~3), int4 ~510
// (128 k; 176 the conversion, 11 operations a word). An SM's share of HBM at the
// floor gives a warp-slab's 2 KB ~141 clocks on H100 (14.5 B/clk), ~111 on H200: 564 or
// 444 issue slots. So int4 (and fp8 on H200) are near issue-bound at their floor.

#include <algorithm>
#include <cerrno>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_grouped.cuh"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/ptx.cuh"

#define XT_THREADS	128		/* 4 warps */
#define XT_ROWS		128		/* weight rows a CTA: two m16 tiles a warp */
#define XT_GLU_FEATS	64		/* gate/up: features a CTA (their gate and up rows) */
#define XT_SB		64		/* bytes of a weight row a slab */
#define XT_STAGES	4		/* buffers; XT_STAGES - 1 slabs in flight ahead */
#define XT_AHEAD	(XT_STAGES - 1)
#define XT_NO_ROW	0xffffffffu	/* an x unit of no expert row (past the pass's rows) */

namespace {	// kernels and their helpers stay private to this file

// W (wide): a pass takes 64 expert rows (int4: 32, its x slabs being 4 times fp8's), for
// calls whose experts have many rows (prefill): each pass streams the CTA's weights once,
// so 4 (int4 2) times fewer passes read them 4 (2) times less, and each x slab meets 4
// (2) times the MMA work. Narrow: 16 rows a pass, for calls of a few rows an expert.
template <int F, bool W> struct xt_cfg {
	static constexpr int SLAB = F == MQ_INT4 ? 128 : F == MQ_FP8 ? 64 : 32;	// k a slab
	static constexpr int XU = 16;				// bytes: 8 bf16 of hi or of lo
	static constexpr int XROW = SLAB * 4;			// bytes of a split row's slab
	static constexpr int UPR = XROW / XU;			// its 16-byte units
	static constexpr int XSTRIDE = XROW + 16;		// 16 mod 128: see xt_xpos
	static constexpr int XROWS = !W ? 16 : F == MQ_INT4 ? 32 : 64;	// expert rows a pass
	static constexpr int NT = XROWS / 8;			// their n8 tiles
	static constexpr int W_BYTES = XT_ROWS * XT_SB;
	static constexpr int X_BYTES = XROWS * XSTRIDE;
	static constexpr int S_BYTES = F == MQ_INT4 ? XT_ROWS * 16 : 0;	// 4 scales a row
	static constexpr int STAGE = W_BYTES + X_BYTES + S_BYTES;
	static constexpr int SMEM = XT_STAGES * STAGE;
	static constexpr int XPT = XROWS * UPR / XT_THREADS;	// x units a thread
	// CTAs per SM: as many as the shared memory holds (narrow bf16: 4, its registers)
	static constexpr int MIN_CTAS = !W ? (F == MQ_INT4 ? 3 : 4) : F == MQ_BF16 ? 3 : 2;
	static constexpr int J_UNROLL = F == MQ_FP8 ? XT_STAGES : 1;	// see the slab loop
	static_assert(XPT * XT_THREADS == XROWS * UPR && MIN_CTAS * SMEM <= 227 * 1024,
		      "xt_cfg: a pass's x units spread over the threads; shared memory fits");
};

// Where 16-byte unit j of a split row's slab sits in its shared row (a position): units
// 8..15 of every 16 swap their halves' pairs (j ^ 2), so that a quarter warp's four lanes
// of one row read four different bank groups (bf16: units 2t + h; fp8: 4t + i; int4: 8G
// + 2t + h) and the next row (XSTRIDE = 16 mod 128) the other four.
__device__ __forceinline__ int xt_xpos(int j)
{
	return j ^ (((j >> 3) & 1) << 1);
}

// Where 16-byte unit c of weight row r sits in its shared row: int4 reads word t of unit
// (group) G of rows g and g + 8 (4-byte loads), so units rotate by (r >> 1) & 3 and the 8
// rows of a warp's load fall in 32 different banks; bf16 and fp8 read unit t whole
// (16-byte loads, already conflict-free).
template <int F>
__device__ __forceinline__ int xt_wpos(int r, int c)
{
	return F == MQ_INT4 ? c ^ ((r >> 1) & 3) : c;
}

// Weight row r of the CTA (0..127): its matrix (0 gate, 1 up, 2 down) and feature.
// Gate/up: warp w's m16 tile 0 holds gate rows f0 + 16 w + i, tile 1 the up rows of the
// same features; down: row f0 + r.
template <bool GLU>
__device__ __forceinline__ void xt_row(int r, int f0, int &mat, int &feat)
{
	if (GLU) {
		mat = (r >> 4) & 1;
		feat = f0 + 16 * (r >> 5) + (r & 15);
	} else {
		mat = 2;
		feat = f0 + r;
	}
}

// a[j] for a j known only at run time, without indexing the kernel's parameter (which
// would copy it to local memory).
__device__ __forceinline__ int xt_pick(const int (&a)[3], int j)
{
	return j == 0 ? a[0] : j == 1 ? a[1] : a[2];
}

// The scale row of matrix mat's feature feat of expert e, in elements of esz bytes; past
// N the last row's (its weight rows are zeros there, so any finite scale will do).
__device__ __forceinline__ const char *xt_scale_row(const moe_wq &wq, int e, int mat, int feat,
						    int N, int esz)
{
	return (const char *)wq.scales[3 * e + mat] +
	       (size_t)(min(feat, N - 1) >> xt_pick(wq.rshift, mat)) * xt_pick(wq.scols, mat) * esz;
}

// Element col of a scale row as stored (bf16: its 16 bits), no arithmetic on the loaded
// value, so that the load's wait falls at the use (xt_scale_cook), slabs later; with the
// conversion beside the load, each thread waited for it at once (SASS).
__device__ __forceinline__ uint32_t xt_scale_raw(const char *row, int col, bool sbf16)
{
	return sbf16 ? (uint32_t)__ldg((const unsigned short *)row + col)
		     : __float_as_uint(__ldg((const float *)row + col));
}

__device__ __forceinline__ float xt_scale_cook(uint32_t raw, bool sbf16)
{
	return __uint_as_float(sbf16 ? raw << 16 : raw);
}

// One slab of an fp8 CTA: the warp's two m16 tiles (rows g, g + 8 of each: 16 bytes, k
// 16t .. 16t + 15, as 8 bf16 pairs) against the pass's n8 tiles of expert rows (two where
// `two`; x row g of each: units 4t .. 4t + 3 = hi, lo of k 16t .. + 7, hi, lo of k 16t +
// 8 .. + 15). Pair q of a lane is k 16t + 2q, + 1 in weights and x alike; mma step s
// takes pairs 2s (its k slots 2t, 2t + 1) and 2s + 1 (slots 2t + 8, 2t + 9). sr: the
// slab's scale of rows (mt, g + 8 h) at 2 mt + h, as stored (xt_scale_raw).
template <int NT>
__device__ __forceinline__ void xt_slab_fp8(float (&acc)[2][NT][4], const unsigned char *ws,
					    const unsigned char *xs, const uint32_t (&sraw)[4],
					    bool sbf16, int nts, int warp, int g, int t)
{
	using C = xt_cfg<MQ_FP8, false>;	// XSTRIDE: the same either width
	uint32_t pa[2][8], pb[2][8];

#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int r = warp * 32 + mt * 16 + g;
		const uint4 va = *(const uint4 *)(ws + r * XT_SB + 16 * t);
		const uint4 vb = *(const uint4 *)(ws + (r + 8) * XT_SB + 16 * t);
		const uint4 a0 = ex_fp8_bf16x8(make_uint2(va.x, va.y));
		const uint4 a1 = ex_fp8_bf16x8(make_uint2(va.z, va.w));
		const uint4 b0 = ex_fp8_bf16x8(make_uint2(vb.x, vb.y));
		const uint4 b1 = ex_fp8_bf16x8(make_uint2(vb.z, vb.w));

		pa[mt][0] = a0.x, pa[mt][1] = a0.y, pa[mt][2] = a0.z, pa[mt][3] = a0.w;
		pa[mt][4] = a1.x, pa[mt][5] = a1.y, pa[mt][6] = a1.z, pa[mt][7] = a1.w;
		pb[mt][0] = b0.x, pb[mt][1] = b0.y, pb[mt][2] = b0.z, pb[mt][3] = b0.w;
		pb[mt][4] = b1.x, pb[mt][5] = b1.y, pb[mt][6] = b1.z, pb[mt][7] = b1.w;
	}
#pragma unroll
	for (int nt = 0; nt < NT; nt++) {
		if (nt >= nts)	// past the pass's rows (warp-uniform)
			break;
		const unsigned char *xr = xs + (8 * nt + g) * C::XSTRIDE;
		const uint4 h0 = *(const uint4 *)(xr + 16 * xt_xpos(4 * t));
		const uint4 l0 = *(const uint4 *)(xr + 16 * xt_xpos(4 * t + 1));
		const uint4 h1 = *(const uint4 *)(xr + 16 * xt_xpos(4 * t + 2));
		const uint4 l1 = *(const uint4 *)(xr + 16 * xt_xpos(4 * t + 3));
		const uint32_t xh[8] = { h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w };
		const uint32_t xl[8] = { l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w };

		// four independent chains of 4 mma (the two tiles' hi and lo products), so
		// that each mma.sync's latency is covered by the other chains'
		float th[2][4] = {}, tl[2][4] = {};

#pragma unroll
		for (int s = 0; s < 4; s++)
#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
				mma16816(th[mt], pa[mt][2 * s], pb[mt][2 * s], pa[mt][2 * s + 1],
					 pb[mt][2 * s + 1], xh[2 * s], xh[2 * s + 1]);
				mma16816(tl[mt], pa[mt][2 * s], pb[mt][2 * s], pa[mt][2 * s + 1],
					 pb[mt][2 * s + 1], xl[2 * s], xl[2 * s + 1]);
			}
#pragma unroll
		for (int mt = 0; mt < 2; mt++)
#pragma unroll
			for (int c = 0; c < 4; c++)
				acc[mt][nt][c] = fmaf(th[mt][c] + tl[mt][c],
						      xt_scale_cook(sraw[2 * mt + (c >> 1)], sbf16),
						      acc[mt][nt][c]);
	}
}

// One slab of a bf16 CTA: the warp's two m16 tiles (rows g, g + 8: 16 bytes, k 8t ..
// 8t + 7, 4 bf16 pairs) against x unit t (hi and lo) of each of the pass's n8 tiles,
// straight into the accumulators (no scale).
template <int NT>
__device__ __forceinline__ void xt_slab_bf16(float (&acc)[2][NT][4], const unsigned char *ws,
					     const unsigned char *xs, int nts, int warp, int g, int t)
{
	using C = xt_cfg<MQ_BF16, false>;
	uint4 pa[2], pb[2];

#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int r = warp * 32 + mt * 16 + g;

		pa[mt] = *(const uint4 *)(ws + r * XT_SB + 16 * t);
		pb[mt] = *(const uint4 *)(ws + (r + 8) * XT_SB + 16 * t);
	}
#pragma unroll
	for (int nt = 0; nt < NT; nt++) {
		if (nt >= nts)
			break;
		const unsigned char *xr = xs + (8 * nt + g) * C::XSTRIDE;
		const uint4 xh = *(const uint4 *)(xr + 16 * xt_xpos(2 * t));
		const uint4 xl = *(const uint4 *)(xr + 16 * xt_xpos(2 * t + 1));

#pragma unroll
		for (int mt = 0; mt < 2; mt++) {
			mma16816(acc[mt][nt], pa[mt].x, pb[mt].x, pa[mt].y, pb[mt].y, xh.x, xh.y);
			mma16816(acc[mt][nt], pa[mt].x, pb[mt].x, pa[mt].y, pb[mt].y, xl.x, xl.y);
			mma16816(acc[mt][nt], pa[mt].z, pb[mt].z, pa[mt].w, pb[mt].w, xh.z, xh.w);
			mma16816(acc[mt][nt], pa[mt].z, pb[mt].z, pa[mt].w, pb[mt].w, xl.z, xl.w);
		}
	}
}

// One slab of an int4 CTA: per group G (32 k) of the slab, word t of the group of rows
// g, g + 8 (k 32 G + 8 t .. + 7, 4 bf16 pairs in ex_int4_bf16x8_perm's order, which is
// the order of the x chunks: split_perm_pos) against x unit 4 G + t (hi and lo) of
// each of the pass's n8 tiles; each group's two mma steps into a temporary that the
// group's fp32 scale of each row multiplies. ss: the slab's scales, 16 bytes a weight
// row (bf16: 4 values in the first 8; else 4 fp32).
template <int NT>
__device__ __forceinline__ void xt_slab_int4(float (&acc)[2][NT][4], const unsigned char *ws,
					     const unsigned char *xs, const unsigned char *ss,
					     bool sbf16, int nts, int warp, int g, int t)
{
	using C = xt_cfg<MQ_INT4, false>;
	const int rot = (g >> 1) & 3;	// xt_wpos of rows g and g + 8
	uint32_t wa[2][4], wb[2][4];
	float sc[2][2][4];		// [mt][h][G]

#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int r = warp * 32 + mt * 16 + g;

#pragma unroll
		for (int G = 0; G < 4; G++) {
			wa[mt][G] = *(const uint32_t *)(ws + r * XT_SB + 16 * (G ^ rot) + 4 * t);
			wb[mt][G] = *(const uint32_t *)(ws + (r + 8) * XT_SB + 16 * (G ^ rot) + 4 * t);
		}
#pragma unroll
		for (int h = 0; h < 2; h++) {
			const unsigned char *sp = ss + (r + 8 * h) * 16;

			if (sbf16) {
				const uint2 v = *(const uint2 *)sp;

				sc[mt][h][0] = __uint_as_float(v.x << 16);
				sc[mt][h][1] = __uint_as_float(v.x & 0xffff0000u);
				sc[mt][h][2] = __uint_as_float(v.y << 16);
				sc[mt][h][3] = __uint_as_float(v.y & 0xffff0000u);
			} else {
				const float4 v = *(const float4 *)sp;

				sc[mt][h][0] = v.x, sc[mt][h][1] = v.y, sc[mt][h][2] = v.z, sc[mt][h][3] = v.w;
			}
		}
	}
#pragma unroll
	for (int G = 0; G < 4; G++) {
		uint4 pa[2], pb[2];

#pragma unroll
		for (int mt = 0; mt < 2; mt++) {
			pa[mt] = ex_int4_bf16x8_perm(wa[mt][G]);
			pb[mt] = ex_int4_bf16x8_perm(wb[mt][G]);
		}
#pragma unroll
		for (int nt = 0; nt < NT; nt++) {
			if (nt >= nts)
				break;
			const unsigned char *xr = xs + (8 * nt + g) * C::XSTRIDE;
			const uint4 xh = *(const uint4 *)(xr + 16 * xt_xpos(8 * G + 2 * t));
			const uint4 xl = *(const uint4 *)(xr + 16 * xt_xpos(8 * G + 2 * t + 1));

#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
				float tmp[4] = { 0.f, 0.f, 0.f, 0.f };

				mma16816(tmp, pa[mt].x, pb[mt].x, pa[mt].y, pb[mt].y, xh.x, xh.y);
				mma16816(tmp, pa[mt].x, pb[mt].x, pa[mt].y, pb[mt].y, xl.x, xl.y);
				mma16816(tmp, pa[mt].z, pb[mt].z, pa[mt].w, pb[mt].w, xh.z, xh.w);
				mma16816(tmp, pa[mt].z, pb[mt].z, pa[mt].w, pb[mt].w, xl.z, xl.w);
#pragma unroll
				for (int c = 0; c < 4; c++)
					acc[mt][nt][c] = fmaf(tmp[c], sc[mt][c >> 1][G], acc[mt][nt][c]);
			}
		}
	}
}

// grid (feature tiles, used experts x splits): block (x, S u + j) takes tile x of used
// expert u (none past *pl.n_used) in its passes j, j + S, j + 2 S, ... (S = splits), so
// that an expert with many rows has its passes spread over S CTAs. GLU: gate/up rows of
// features [64 x, 64 x + 64) against x rows (a_src: the plan's split x, (M, K =
// hidden)), silu(gate) * up into hs (split, (A, N = inter)) at each pair's sorted
// position; down: rows [128 x, 128 x + 128) against hs rows (a_src, K = inter), into y
// (A, N = hidden) at each pair's index. K a multiple of the slab (fp8 64, int4 128);
// int4 scales in groups of 32 (wq.kshift 5), fp8 blocks of 64 columns or more; weight
// rows and scale tensors 16-byte aligned. int4: a_src's chunks (and so the gate/up
// kernel's hs) in split_perm_pos's order.
template <bool GLU, int F, bool W>
__global__ void __launch_bounds__(XT_THREADS, xt_cfg<F, W>::MIN_CTAS)
xt_kernel(ex_plan pl, const uint16_t *const *expert_w, moe_wq wq, const uint32_t *a_src,
	  int top_k, int K, int N, uint32_t *hs, float *y, int splits)
{
	using C = xt_cfg<F, W>;
	extern __shared__ __align__(128) unsigned char xt_smem[];
	__shared__ int s_src[C::XROWS];	// the pass's a_src rows (-1: none)
	__shared__ int s_dst[C::XROWS];	// their hs row (GLU) or y row (down)
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
	const int u = blockIdx.y / splits, first = (blockIdx.y % splits) * C::XROWS;

	if (u >= *pl.n_used || first >= pl.used_n[u])	// no expert, or no pass of it here
		return;
	const int e = pl.used_e[u], start = pl.used_start[u], n = pl.used_n[u];
	const int f0 = blockIdx.x * (GLU ? XT_GLU_FEATS : XT_ROWS), nst = K / C::SLAB;
	const size_t rb = F == MQ_INT4 ? (size_t)K / 2 : F == MQ_FP8 ? (size_t)K : (size_t)K * 2;
	const int esz = wq.sbf16 ? 2 : 4;
	// This thread's weight units: rows (tid >> 2) + 32 j (one matrix: bit 4 of the row is
	// tid's bit 6), unit tid & 3; wsrc at j = 0, rows 16 (gate/up) or 32 apart.
	int wmat, wfeat;

	xt_row<GLU>(tid >> 2, f0, wmat, wfeat);
	const int wstep = GLU ? 16 : 32;
	const uint8_t *wsrc = (const uint8_t *)expert_w[3 * e + wmat] + (size_t)wfeat * rb +
			      16 * (tid & 3);
	int wdst[4];

#pragma unroll
	for (int j = 0; j < 4; j++) {
		const int r = (tid >> 2) + 32 * j;

		wdst[j] = r * XT_SB + 16 * xt_wpos<F>(r, tid & 3);
	}
	// int4: this thread copies row tid's 4 scales a slab; fp8: the lane's rows (mt,
	// g + 8 h) at 2 mt + h take one each into registers (kshift: their matrices')
	const char *ssrc[F == MQ_FP8 ? 4 : 1];
	int ksh[2];

	if constexpr (F == MQ_INT4) {
		int mat, feat;

		xt_row<GLU>(tid, f0, mat, feat);
		ssrc[0] = xt_scale_row(wq, e, mat, feat, N, esz);
	} else if constexpr (F == MQ_FP8) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int mt = c >> 1, h = c & 1;
			const int mat = GLU ? mt : 2;
			const int feat = f0 + (GLU ? 16 * warp : 32 * warp + 16 * mt) + g + 8 * h;

			ssrc[c] = xt_scale_row(wq, e, mat, feat, N, esz);
		}
		ksh[0] = wq.kshift[GLU ? 0 : 2];
		ksh[1] = wq.kshift[GLU ? 1 : 2];
	}

	for (int c0 = first; c0 < n; c0 += splits * C::XROWS) {
		const int rows = min(C::XROWS, n - c0), nts = (rows + 7) / 8;
		float acc[2][C::NT][4] = {};
		uint32_t sr[XT_STAGES][4];	// fp8: scales as stored, by buffer slot

		__syncthreads();	// the last pass is done with s_src, s_dst and the buffers
		if (tid < C::XROWS) {
			const int pos = start + c0 + tid;
			const bool in = tid < rows;

			s_src[tid] = !in ? -1 : GLU ? pl.sorted[pos] / top_k : pos;
			s_dst[tid] = !in ? -1 : GLU ? pos : pl.sorted[pos];
		}
		__syncthreads();
		// this thread's x units of the pass: unit q of row m, as 16-byte indices into
		// a_src at slab 0 (XT_NO_ROW: none; moe_qtile_takes keeps them below 2^31)
		uint32_t xidx[C::XPT];

#pragma unroll
		for (int j = 0; j < C::XPT; j++) {
			const int v = tid + j * XT_THREADS, m = v / C::UPR, q = v % C::UPR;
			const int src = s_src[m];

			xidx[j] = src < 0 ? XT_NO_ROW : (uint32_t)src * (uint32_t)(K / 4) + q;
		}
		// Slab i into buffer slot: the weights, the expert rows' x, int4's scales in one
		// copy group; fp8's scales into registers sr[slot].
		auto load = [&](int i, int slot) {
			unsigned char *st = xt_smem + slot * C::STAGE;
			const int k0 = i * C::SLAB;

#pragma unroll
			for (int j = 0; j < 4; j++)
				cp_async16(st + wdst[j], wsrc + (size_t)(wstep * j) * rb + i * XT_SB,
					   wfeat + wstep * j < N);
#pragma unroll
			for (int j = 0; j < C::XPT; j++) {
				const int v = tid + j * XT_THREADS, m = v / C::UPR, q = v % C::UPR;
				const bool ok = xidx[j] != XT_NO_ROW;

				cp_async16(st + C::W_BYTES + m * C::XSTRIDE + 16 * xt_xpos(q),
					   (const uint4 *)a_src + (ok ? xidx[j] + k0 / 4 : 0), ok);
			}
			if constexpr (F == MQ_INT4)
				if (esz == 2)	// 4 bf16 scales or 4 fp32
					cp_async8(st + C::W_BYTES + C::X_BYTES + tid * 16,
						  ssrc[0] + (size_t)(k0 >> 5) * esz);
				else
					cp_async16(st + C::W_BYTES + C::X_BYTES + tid * 16,
						   ssrc[0] + (size_t)(k0 >> 5) * esz, true);
			else if constexpr (F == MQ_FP8) {
#pragma unroll
				for (int c = 0; c < 4; c++)
					sr[slot][c] = xt_scale_raw(ssrc[c], k0 >> ksh[c >> 1], wq.sbf16);
			}
		};

#pragma unroll
		for (int i = 0; i < XT_AHEAD; i++) {
			if (i < nst)
				load(i, i);
			cp_async_commit();
		}
		// One copy group a slab; before slab i, its group has exactly XT_AHEAD - 1
		// newer ones. Slab i sits in slot i % XT_STAGES = j (fp8: the loop over j
		// unrolled, so sr stays in registers; else not, one copy of the slab's code).
		for (int i0 = 0; i0 < nst; i0 += XT_STAGES) {
#pragma unroll(C::J_UNROLL)
			for (int j = 0; j < XT_STAGES; j++) {
				const int i = i0 + j, nx = i + XT_AHEAD;

				if (i >= nst)
					break;
				cp_async_wait<XT_AHEAD - 1>();
				__syncthreads();	// slab i visible; slab i - 1's buffer free
				if (nx < nst)
					load(nx, (j + XT_AHEAD) % XT_STAGES);
				cp_async_commit();
				const unsigned char *st = xt_smem + j * C::STAGE;

				if constexpr (F == MQ_FP8)
					xt_slab_fp8(acc, st, st + C::W_BYTES, sr[j], wq.sbf16, nts, warp,
						    g, t);
				else if constexpr (F == MQ_BF16)
					xt_slab_bf16(acc, st, st + C::W_BYTES, nts, warp, g, t);
				else
					xt_slab_int4(acc, st, st + C::W_BYTES, st + C::W_BYTES + C::X_BYTES,
						     wq.sbf16, nts, warp, g, t);
			}
		}
		cp_async_wait<0>();

		// accumulator c of tile (mt, nt): weight row (mt, g + 8 (c >> 1)), expert row
		// 8 nt + 2 t + (c & 1) of the pass
#pragma unroll
		for (int nt = 0; nt < C::NT; nt++)
#pragma unroll
			for (int c = 0; c < 4; c++) {
				const int m = 8 * nt + 2 * t + (c & 1);

				if (m >= rows)
					continue;
				if (GLU) {
					const int f = f0 + 16 * warp + g + 8 * (c >> 1);

					if (f < N)	// int4: in the order its down kernel reads
						split_store1(hs + (size_t)s_dst[m] * N, f,
							     F == MQ_INT4 ? split_perm_pos(f & 7) : f & 7,
							     silu_mul1(acc[0][nt][c], acc[1][nt][c]));
				} else {
#pragma unroll
					for (int mt = 0; mt < 2; mt++) {
						const int f = f0 + 32 * warp + 16 * mt + g + 8 * (c >> 1);

						if (f < N)
							y[(size_t)s_dst[m] * N + f] = acc[mt][nt][c];
					}
				}
			}
	}
}

template <int F, bool W>
int xt_attr(void)
{
	return K_CUDA_CALL(cudaFuncSetAttribute(xt_kernel<true, F, W>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						xt_cfg<F, W>::SMEM)) ||
	       K_CUDA_CALL(cudaFuncSetAttribute(xt_kernel<false, F, W>,
						cudaFuncAttributeMaxDynamicSharedMemorySize,
						xt_cfg<F, W>::SMEM));
}

// The CTAs each used expert's passes are spread over (xt_kernel's splits) in a call of M
// rows: k_cuda_tuning()->moe_qtile_split where not 0; 0 (the default): a CTA a pass of
// an expert that every row chose (ceil(M / XROWS) passes), to 8. A prefill chunk routes
// most rows to a few experts (kdbench's synthetic Qwen3-30B-A3B, 2048 random tokens:
// from layer 1 on, the hottest expert takes 1780-2034 of 2048 rows, 28-32 wide passes,
// where the chunk has ~300 in all), and one CTA ran such an expert's passes one after the
// other while the rest of the GPU idled: measured (H100, session 34) a 2048-token
// prefill of Qwen3-30B-A3B int4 216 -> 131 ms, fp8 181 -> 117, bf16 221 -> 115 at 8
// CTAs an expert against 1, decode batch 64 fp8 -1.6% at 4. The CTAs past an expert's
// passes return at once. Decode calls of <= 16 rows get 1. grid.y stays within 65535
// (max_used <= 4096).
template <int F, bool W>
int xt_splits(int M, int max_used)
{
	const int set = k_cuda_tuning()->moe_qtile_split, R = xt_cfg<F, W>::XROWS;
	const int want = set > 0 ? set : std::min(8, std::max(1, (M + R - 1) / R));

	return std::min(want, 65535 / std::max(max_used, 1));
}

template <int F, bool W>
int xt_run(cudaStream_t s, const ex_plan &pl, const uint16_t *const *expert_w, const moe_wq &wq,
	   const uint32_t *xs, uint32_t *hs, float *y, int M, int top_k, int hidden, int inter,
	   int max_used)
{
	const int splits = xt_splits<F, W>(M, max_used);
	const dim3 g1((inter + XT_GLU_FEATS - 1) / XT_GLU_FEATS, max_used * splits);
	const dim3 g2((hidden + XT_ROWS - 1) / XT_ROWS, max_used * splits);
	const int smem = xt_cfg<F, W>::SMEM;
	int ret;

	xt_kernel<true, F, W><<<g1, XT_THREADS, smem, s>>>(pl, expert_w, wq, xs, top_k, hidden,
							    inter, hs, nullptr, splits);
	if ((ret = K_CUDA_LAUNCHED("moe gate/up (qtile)")))
		return ret;
	xt_kernel<false, F, W><<<g2, XT_THREADS, smem, s>>>(pl, expert_w, wq, hs, top_k, inter,
							     hidden, nullptr, y, splits);
	return K_CUDA_LAUNCHED("moe down (qtile)");
}

template <int F>
int xt_run_width(cudaStream_t s, const ex_plan &pl, const uint16_t *const *expert_w,
		 const moe_wq &wq, const uint32_t *xs, uint32_t *hs, float *y, int M, int top_k,
		 int hidden, int inter, int max_used, bool wide)
{
	return wide ? xt_run<F, true>(s, pl, expert_w, wq, xs, hs, y, M, top_k, hidden, inter,
				      max_used)
		    : xt_run<F, false>(s, pl, expert_w, wq, xs, hs, y, M, top_k, hidden, inter,
				       max_used);
}

}	// namespace

bool moe_qtile_wide(int M)
{
	const int w = k_cuda_tuning()->moe_qtile_wide;

	return w > 0 && M >= w;
}

// bf16 experts: on the tile kernels from moe_qtile_bf16 rows a call (2048: the prefill
// chunks measured faster there; 1: every call; 0: never)
static bool moe_qtile_bf16_takes(int M)
{
	const int b = k_cuda_tuning()->moe_qtile_bf16;

	return b > 0 && M >= b;
}

int moe_qtile_setup(void)
{
	return xt_attr<MQ_BF16, false>() || xt_attr<MQ_FP8, false>() || xt_attr<MQ_INT4, false>() ||
	       xt_attr<MQ_BF16, true>() || xt_attr<MQ_FP8, true>() || xt_attr<MQ_INT4, true>() ?
	       -EIO : 0;
}

bool moe_qtile_takes(const moe_wq &wq, int hidden, int inter, int M)
{
	const int slab = wq.fmt == MQ_INT4 ? 128 : wq.fmt == MQ_FP8 ? 64 : 32;

	// up to moe_qtile_rows (every call by default), or a prefill chunk's wide passes;
	// hidden, inter < 2^15 and M <= 4096 (the knobs' bound): the kernels' 32-bit x unit
	// indices (rows < M * top_k <= 2^18, K / 4 units a row) stay below 2^31
	if ((M > k_cuda_tuning()->moe_qtile_rows && !moe_qtile_wide(M)) || M > 4096 ||
	    hidden % slab || inter % slab || hidden >= 32768 || inter >= 32768 ||
	    (wq.fmt == MQ_BF16 && !moe_qtile_bf16_takes(M)))
		return false;
	for (int j = 0; j < 3 && wq.fmt != MQ_BF16; j++)
		if (wq.rshift[j] < 0 || (wq.fmt == MQ_INT4 ? wq.kshift[j] != 5 : wq.kshift[j] < 6))
			return false;
	return true;
}

int moe_qtile_run(cudaStream_t s, const ex_plan &pl, const uint16_t *const *expert_w,
		  const moe_wq &wq, const uint32_t *xs, uint32_t *hs, float *y, int M, int top_k,
		  int hidden, int inter, int max_used)
{
	const bool w = moe_qtile_wide(M);

	if (wq.fmt == MQ_INT4)
		return xt_run_width<MQ_INT4>(s, pl, expert_w, wq, xs, hs, y, M, top_k, hidden,
					     inter, max_used, w);
	if (wq.fmt == MQ_FP8)
		return xt_run_width<MQ_FP8>(s, pl, expert_w, wq, xs, hs, y, M, top_k, hidden,
					    inter, max_used, w);
	return xt_run_width<MQ_BF16>(s, pl, expert_w, wq, xs, hs, y, M, top_k, hidden, inter,
				     max_used, w);
}
