// The two per-head projections around absorbed MLA attention, on tensor cores:
// absorb q_lat[r, h, :L] = q_nope[r, h] W_UK[h] and expand out[r, h] = W_UV[h] o_lat[r, h].
// mma.sync m16n8k16 bf16 with fp32 accumulation; the fp32 activations enter as two bf16
// halves (hi + lo, about 16 significant bits) against the exact bf16 weights, so results
// stay within ~1e-5 of the fp32 CUDA-core kernels. Each block stages its activation rows
// and an 8 KB weight tile (DeepSeek dims) in one burst of 16-byte copies, 256 blocks, so
// a decode step's 2 MB per projection is in flight at once; past 16 rows the tensor
// cores keep 64 rows as cheap as one.
#include <cstdlib>

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/mla_proj.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ops/mla_cache_row.cuh"
#include "kernels/cuda/ptx.cuh"

#define PROJ_THREADS 128
#define PROJ_WARPS (PROJ_THREADS / 32)
#define PROJ_MROWS 64		// query rows per block: four m16 tiles
#define PROJ_MT (PROJ_MROWS / 16)
#define PROJ_PAD 8		// bf16 per smem row past the data: rows fall on other banks
#define ABS_MMA_COLS (PROJ_WARPS * 8)	// latent columns per absorb block: one n8 tile a warp
#define EXP_MMA_SMALL_ROWS 16	// up to here the expand blocks take 8 outputs, past it 16
/* Rows up to which the expand merges the splits itself by default (k_cuda_tuning's
 * mla_fold_rows): none. Measured on
 * H200 (DeepSeek-V2-Lite, batch 1, step p50) before the cluster (each block merged the
 * whole head again): folding 3.155 ms, the merge kernel 3.022; with the cluster, which
 * reads each partial once (see mla_expand_mma_kernel), 2.782 against 2.751
 * (docs/results/cuda-final-e3af145.txt): still no faster. KDEC_MLA_FOLD_ROWS=1 on. */
#define EXP_FOLD_NJ 16		// outputs per merging expand block: half the blocks (and
				// merged copies) of 8, one block per SM at DeepSeek's dims
#define MERGE_BATCH 32		// partial loads a merging thread has in flight at once
#define MERGE_BATCH_1 64	// the same, one float a load (a cluster rank's few columns)
#define EXP_FOLD_CLUSTER 8	// most expand blocks of a head that share one merge
#define ABS_POST_ROWS 8		// rows up to which the absorb launch takes mla_post's work
#define POST_MAX_LORA 2048	// latent values of a row (mla_post's bound), in registers
#define POST_PER (POST_MAX_LORA / PROJ_THREADS)
#define POST_MAX_HALF 512	// rotary pairs: the cos/sin table in shared memory

namespace cg = cooperative_groups;

namespace {	// kernels and their helpers stay private to this file

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
					 uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x = hi + lo + O(2^-16 x): hi is x rounded to bf16, lo the rest rounded to bf16.
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
	const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
	const float2 hf = __bfloat1622float2(h);
	const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);

	hi = *(const uint32_t *)&h;
	lo = *(const uint32_t *)&l;
}

// The A fragments (hi and lo) of rows m0 + g and m0 + g + 8, columns k0 + 2t (+1, +8,
// +9) of an fp32 tile in shared memory with row stride as and nr rows, zero past them
// (as % 32 == 8: the eight rows of a fragment fall on distinct banks).
__device__ __forceinline__ void load_a(uint32_t (&hi)[4], uint32_t (&lo)[4], const float *sa,
				       int as, int m0, int k0, int nr)
{
	const int g = threadIdx.x % 32 / 4, k = k0 + 2 * (threadIdx.x % 4);
	const int ra = m0 + g, rb = ra + 8;
	const float *pa = sa + ra * as + k, *pb = sa + rb * as + k;
	const float2 z = make_float2(0.0f, 0.0f);
	const float2 a0 = ra < nr ? *(const float2 *)pa : z, a1 = rb < nr ? *(const float2 *)pb : z;
	const float2 a2 = ra < nr ? *(const float2 *)(pa + 8) : z;
	const float2 a3 = rb < nr ? *(const float2 *)(pb + 8) : z;

	split_pair(a0.x, a0.y, hi[0], lo[0]);
	split_pair(a1.x, a1.y, hi[1], lo[1]);
	split_pair(a2.x, a2.y, hi[2], lo[2]);
	split_pair(a3.x, a3.y, hi[3], lo[3]);
}

// Rows 0 .. nr - 1 of an fp32 activation tile into shared memory (nr, as): row r from
// x + r * rs, its first n values, zero past n. vec: n, rs and x allow 16-byte copies.
__device__ __forceinline__ void stage_a(float *sa, int as, const float *x, size_t rs, int nr,
					int n, bool vec)
{
	if (vec) {
		for (int i = threadIdx.x; i < nr * (as / 4); i += PROJ_THREADS) {
			const int r = i / (as / 4), c = i % (as / 4) * 4;
			const bool ok = c < n;

			cp_async16(sa + r * as + c, ok ? x + (size_t)r * rs + c : x, ok);
		}
		return;
	}
	for (int i = threadIdx.x; i < nr * as; i += PROJ_THREADS) {
		const int r = i / as, c = i % as;

		sa[i] = c < n ? x[(size_t)r * rs + c] : 0.0f;
	}
}

// Rows of an activation tile in shared memory: the row chunk mr, or all rows when fewer
// (a small tile lets more blocks share a multiprocessor).
__host__ __device__ __forceinline__ int proj_a_rows(int n_rows, int mr)
{
	return n_rows < mr ? n_rows : mr;
}

// w x + a, per component, each an fmaf (as the merge kernel's scalar loop).
__device__ __forceinline__ float4 fma4(float w, float4 x, float4 a)
{
	return make_float4(fmaf(w, x.x, a.x), fmaf(w, x.y, a.y), fmaf(w, x.z, a.z),
			   fmaf(w, x.w, a.w));
}

// Split partials of the latent attention for the expand kernel to merge as it stages
// its rows (attn_ws.cu's merge, folded in): o (n_splits, R, H, L), each split's output
// normalised by its own sum, and lse (n_splits, R, H) its log2-sum-exp2, -inf where the
// split saw no token (its o is then never read). n_splits 1: o_lat is read as is.
struct proj_parts {
	const float *o, *lse;
	int n_splits;
};

// stage_merged's COLS case (the cluster ranks' shares): columns [c0, c0 + n_cols) of
// each of nr rows, a float a thread and pass, MERGE_BATCH_1 loads in flight.
__device__ __forceinline__ void merge_cols(float *sa, int as, const float *o, size_t sstride,
					int H, int h, int r0, int nr, int L, const int *live,
					const float *wts, const int *n_live, int ns, int c0,
					int n_cols)
{
	const int ss = (int)sstride;	// mla_expand_folds: the partials index in an int

	for (int i = threadIdx.x; i < nr * n_cols; i += PROJ_THREADS) {
		const int rr = i / n_cols, c = c0 + i % n_cols;
		const int n = n_live[rr], n4 = n & ~3, *lv = live + rr * ns;
		const float *wv = wts + rr * ns;
		const float *po = o + ((size_t)(r0 + rr) * H + h) * L + c;
		float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

		for (int j0 = 0; c < L && j0 < n; j0 += MERGE_BATCH_1) {
			float x[MERGE_BATCH_1];

#pragma unroll
			for (int k = 0; k < MERGE_BATCH_1; k++)
				if (j0 + k < n)
					x[k] = po[lv[j0 + k] * ss];
#pragma unroll
			for (int k = 0; k < MERGE_BATCH_1; k++) {
				const int j = j0 + k;

				if (j < n4)
					acc[k % 4] = fmaf(wv[j], x[k], acc[k % 4]);
				else if (j < n)
					acc[0] = fmaf(wv[j], x[k], acc[0]);
			}
		}
		sa[rr * as + c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
	}
}

// Rows r0 .. r0 + nr - 1 of head h merged from the partials into sa (nr, as), zero past
// L (L % 4 == 0, parts 16-byte aligned), with the merge kernel's arithmetic in its order
// (so o_lat is bit for bit what attn_merge writes): warp w lists the live splits of rows
// w, w + 4, ... and their weights (live, wts: (nr, n_splits); n_live: (nr)); then each
// float4 of a row sums w_i o(live_i) with four accumulators, MERGE_BATCH loads at a
// time in flight. Only the float4 columns [q0, q1) of each row (a cluster rank's share).
template <bool COLS>
__device__ __forceinline__ void stage_merged(float *sa, int as, const proj_parts p, int R, int H,
					     int h, int r0, int nr, int L, int *live, float *wts,
					     int *n_live, int q0, int q1)
{
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ns = p.n_splits;
	const size_t per_split = (size_t)R * H, sstride = per_split * L;

	for (int rr = warp; rr < nr; rr += PROJ_WARPS) {
		const size_t rh = (size_t)(r0 + rr) * H + h;
		const int base = merge_list(p.lse, ns, rh, per_split, live + rr * ns, wts + rr * ns);

		if (lane == 0)
			n_live[rr] = base;
	}
	__syncthreads();
	const int nq = q1 - q0;

	// COLS (the cluster's ranks: a share of the columns, 64 floats a row at batch 1): a
	// float a thread, so more threads work and MERGE_BATCH_1 loads are in flight (33
	// splits cost one memory latency, not two); the same sums in the same order. Not
	// both paths in one kernel: together they spill.
	if constexpr (COLS) {
		if (nq > 0)
			merge_cols(sa, as, p.o, sstride, H, h, r0, nr, L, live, wts, n_live, ns,
				   q0 * 4, nq * 4);
	} else {
		for (int i = threadIdx.x; i < nr * nq; i += PROJ_THREADS) {
			const int rr = i / nq, c = (q0 + i % nq) * 4, n = n_live[rr];
			const int *lv = live + rr * ns;
			const float *wv = wts + rr * ns;
			const float *po = p.o + ((size_t)(r0 + rr) * H + h) * L + c;
			const int n4 = n & ~3;
			float4 acc[4];

#pragma unroll
			for (int k = 0; k < 4; k++)
				acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
			// MERGE_BATCH loads in flight, then their sums: the merge kernel's order
			// (split j into accumulator j % 4 up to n4, the rest into the first), so a
			// row of 33 splits (batch 1, ctx 1024) costs two memory latencies, not nine
			for (int j0 = 0; c < L && j0 < n; j0 += MERGE_BATCH) {
				float4 o[MERGE_BATCH];

#pragma unroll
				for (int k = 0; k < MERGE_BATCH; k++)
					if (j0 + k < n)
						o[k] = *(const float4 *)(po + lv[j0 + k] * sstride);
#pragma unroll
				for (int k = 0; k < MERGE_BATCH; k++) {
					const int j = j0 + k;

					if (j < n4)
						acc[k % 4] = fma4(wv[j], o[k], acc[k % 4]);
					else if (j < n)
						acc[0] = fma4(wv[j], o[k], acc[0]);
				}
			}
			*(float4 *)(sa + rr * as + c) = make_float4(
				(acc[0].x + acc[1].x) + (acc[2].x + acc[3].x),
				(acc[0].y + acc[1].y) + (acc[2].y + acc[3].y),
				(acc[0].z + acc[1].z) + (acc[2].z + acc[3].z),
				(acc[0].w + acc[1].w) + (acc[2].w + acc[3].w));
		}
	}
}

// ---- mla_post's work in the absorb launch (k_cuda_attn_mla_post) ----

// mla_post.cu's rotation and cos/sin of pair i at position p, the same rounded
// operations: the folded launch's q_lat and cache rows are those of mla_post and the
// absorb, bit for bit.
__device__ __forceinline__ void post_cs(const k_cuda_mla_post_args &a, float p, int i, float &c,
					float &sn)
{
	k_cuda_rope_cs(p, a.inv_freq[i], a.attn_factor, c, sn);
}

// Bytes of shared memory a post block uses: the latent sum's warp partials, then the
// row's cos/sin table (2, half).
__host__ __device__ __forceinline__ size_t post_smem(int rot_dim)
{
	return (size_t)2 * PROJ_WARPS * sizeof(double) + (size_t)rot_dim * sizeof(float);
}

// A post block (row r): mla_post's cache work for the row, the latent RMS-normalised and
// the rope key rotated, [latent ; key] rounded to bf16 into the row's slot. The cos/sin
// table goes before the PDL wait (pos and inv_freq are inputs of the step, as in
// mla_post). The sum of squares in mla_post's order: its 256 threads' sums, each of
// these 128 threads holding two of them (its values k even, then odd), the same warp
// trees and the eight warps' sums in order, so the cache row is mla_post's bit for bit.
__device__ __forceinline__ void absorb_post_row(const k_cuda_mla_post_args &a, int r,
						unsigned char *smem)
{
	double *red = (double *)smem;				// (2 * PROJ_WARPS)
	float *cs = (float *)(smem + 2 * PROJ_WARPS * sizeof(double));	// (2, half)
	const int L = a.kv_lora, half = a.rot_dim / 2, lane = threadIdx.x % 32;
	const int step = a.interleaved ? 2 : 1, gap = a.interleaved ? 1 : half;
	const int32_t slot = a.slots[r];	// a step input (as pos): before the wait
	const float *kv = a.kv + (size_t)r * a.kv_rs;
	float lat[POST_PER];
	double s0 = 0.0, s1 = 0.0, ss = 0.0;

	if (slot < 0)	// a padding row: no cache entry (its q is the absorb blocks')
		return;
	for (int i = threadIdx.x; i < half; i += PROJ_THREADS)
		post_cs(a, (float)a.pos[r], i, cs[i], cs[half + i]);
	k_cuda_pdl_wait();	// kv_a comes from the projection just before
#pragma unroll
	for (int k = 0; k < POST_PER; k++) {
		const int i = threadIdx.x + k * PROJ_THREADS;

		lat[k] = i < L ? kv[i] : 0.0f;
	}
#pragma unroll
	for (int k = 0; k < POST_PER; k += 2) {	// zeros past L add nothing
		s0 += (double)lat[k] * (double)lat[k];
		s1 += (double)lat[k + 1] * (double)lat[k + 1];
	}
	for (int o = 16; o > 0; o >>= 1) {
		s0 += __shfl_xor_sync(0xffffffffu, s0, o);
		s1 += __shfl_xor_sync(0xffffffffu, s1, o);
	}
	if (lane == 0) {
		red[threadIdx.x / 32] = s0;
		red[PROJ_WARPS + threadIdx.x / 32] = s1;
	}
	__syncthreads();	// also publishes the cos/sin table
	for (int wp = 0; wp < 2 * PROJ_WARPS; wp++)
		ss += red[wp];

	uint16_t *dst = a.cache + (size_t)slot * (size_t)(L + a.pe_dim);
	const float rs = 1.0f / sqrtf((float)(ss / L) + a.eps);	// as rmsnorm.cu's row_rs

	mla_cache_row<PROJ_THREADS>(dst, lat, a.norm, rs, kv, cs, cs + half, L, half, step, gap,
				    a.pe_dim);
}

// Block (column chunk of 32, head, row chunk of 64): warp w owns columns c0 + 8w .. +7
// for every row and all of nope. The block's q rows (nks * 16 wide, rows q_rs apart)
// and the weight tile (nks * 16, 32) arrive in one burst of 16-byte copies, zero past
// nope and L. The blocks of a head also copy the rope part of q, each a share. POST
// (k_cuda_attn_mla_post): q is mla_post's source, unrotated; the blocks of y 0 are
// post blocks (x the row: absorb_post_row), the heads' y 1 .. H, and the rope part
// goes into q_lat rotated as mla_post would rotate it (its cos/sin, where a thread has
// one pair, computed before the wait).
template <bool POST>
__global__ void __launch_bounds__(PROJ_THREADS)
mla_absorb_mma_kernel(float *__restrict__ q_lat, const float *__restrict__ q, long q_rs,
		      const uint16_t *__restrict__ w, int n_rows, int H, int nope, int rope,
		      int vdim, int L, int vec, const k_cuda_mla_post_args pa)
{
	extern __shared__ __align__(16) unsigned char proj_smem[];
	constexpr int LS = ABS_MMA_COLS + PROJ_PAD;
	const int nks = (nope + 15) / 16, as = nks * 16 + 8;

	if (POST && blockIdx.y == 0) {
		if ((int)blockIdx.x < n_rows)
			absorb_post_row(pa, blockIdx.x, proj_smem);
		return;
	}

	const int h = POST ? blockIdx.y - 1 : blockIdx.y;
	const int r0 = blockIdx.z * PROJ_MROWS, nr = min(PROJ_MROWS, n_rows - r0);
	const int am = proj_a_rows(n_rows, PROJ_MROWS);	// as the launcher sized the tile
	float *sa = (float *)proj_smem;					// (am, as)
	uint16_t *sw = (uint16_t *)(proj_smem + (size_t)am * as * 4);	// (nks * 16, LS)
	const int qk = nope + rope, wd = L + rope, c0 = blockIdx.x * ABS_MMA_COLS;
	const int nmt = (nr + 15) / 16;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const uint16_t *wh = w + (size_t)h * (nope + vdim) * L;
	float acc[PROJ_MT][4] = {};

	if (vec) {	// L % 8 == 0 and w 16-byte aligned
		for (int i = threadIdx.x; i < nks * 16 * (ABS_MMA_COLS / 8); i += PROJ_THREADS) {
			const int k = i / (ABS_MMA_COLS / 8), cc = i % (ABS_MMA_COLS / 8) * 8;
			const bool ok = k < nope && c0 + cc < L;

			cp_async16(sw + k * LS + cc, ok ? wh + (size_t)k * L + c0 + cc : wh, ok);
		}
	} else {
		for (int i = threadIdx.x; i < nks * 16 * ABS_MMA_COLS; i += PROJ_THREADS) {
			const int k = i / ABS_MMA_COLS, cc = i % ABS_MMA_COLS;

			sw[k * LS + cc] = k < nope && c0 + cc < L ? wh[(size_t)k * L + c0 + cc]
								  : (uint16_t)0;
		}
	}
	// POST: the rotary pairs of q's rope part, nr * hp (the tail past them),
	// shared out over the column chunks; a thread's first pair's cos/sin before the wait.
	const int hp = POST ? pa.rot_dim / 2 : 1, nrot = POST ? nr * hp : 0;
	const int i0 = blockIdx.x * PROJ_THREADS + threadIdx.x;
	float pc = 0.0f, ps = 0.0f;

	if (POST && i0 < nrot)
		post_cs(pa, (float)pa.pos[r0 + i0 / hp], i0 % hp, pc, ps);
	// The weights are constants: their copies go out before the wait for the kernel
	// that wrote q (mla_post, or POST the projection), so with programmatic launch they
	// overlap its tail.
	k_cuda_pdl_wait();
	stage_a(sa, as, q + (size_t)r0 * q_rs + (size_t)h * qk, (size_t)q_rs, nr, nope,
		nope % 4 == 0 && qk % 4 == 0 && q_rs % 4 == 0 && (uintptr_t)q % 16 == 0);
	cp_async_commit();
	// the rope part of q, shared out over the column chunks and in flight with the
	// tiles (one block copying it all, a load at a time, took 15 us at 64 rows)
	if (POST) {
		const int step = pa.interleaved ? 2 : 1, gap = pa.interleaved ? 1 : hp;
		const int nt = rope - pa.rot_dim;	// unrotated values past the pairs

		for (int i = i0; i < nrot + nr * nt; i += gridDim.x * PROJ_THREADS) {
			if (i < nrot) {
				const int rr = i / hp, j = i % hp;
				const float *src = q + (size_t)(r0 + rr) * q_rs + (size_t)h * qk +
						   nope + j * step;
				float *dst = q_lat + ((size_t)(r0 + rr) * H + h) * wd + L + j * step;
				float c = pc, sn = ps;

				if (i != i0)
					post_cs(pa, (float)pa.pos[r0 + rr], j, c, sn);
				k_cuda_rope_rotate(src[0], src[gap], c, sn, dst[0], dst[gap]);
			} else {
				const int rr = (i - nrot) / nt, j = pa.rot_dim + (i - nrot) % nt;

				q_lat[((size_t)(r0 + rr) * H + h) * wd + L + j] =
					q[(size_t)(r0 + rr) * q_rs + (size_t)h * qk + nope + j];
			}
		}
	} else {
		for (int i = i0; i < nr * rope; i += gridDim.x * PROJ_THREADS) {
			const size_t rh = (size_t)(r0 + i / rope) * H + h;

			q_lat[rh * wd + L + i % rope] = q[rh * qk + nope + i % rope];
		}
	}
	cp_async_wait<0>();
	__syncthreads();
#pragma unroll 4	// the smem loads of later steps overlap the mma chain
	for (int ks = 0; ks < nks; ks++) {
		const uint16_t *bp = sw + (ks * 16 + 2 * t) * LS + warp * 8 + g;
		const uint32_t b0 = (uint32_t)bp[0] | (uint32_t)bp[LS] << 16;
		const uint32_t b1 = (uint32_t)bp[8 * LS] | (uint32_t)bp[9 * LS] << 16;

#pragma unroll
		for (int mt = 0; mt < PROJ_MT; mt++) {
			uint32_t hi[4], lo[4];

			if (mt >= nmt)
				break;
			load_a(hi, lo, sa, as, mt * 16, ks * 16, nr);
			mma_bf16(acc[mt], hi, b0, b1);
			mma_bf16(acc[mt], lo, b0, b1);
		}
	}
#pragma unroll
	for (int mt = 0; mt < PROJ_MT; mt++) {
		const int col = c0 + warp * 8 + 2 * t;

		if (mt >= nmt)
			break;
#pragma unroll
		for (int half = 0; half < 2; half++) {
			const int rr = mt * 16 + g + half * 8;
			float *dst = q_lat + ((size_t)(r0 + rr) * H + h) * wd + col;

			if (rr >= nr)
				continue;
			if (col < L)
				dst[0] = acc[mt][half * 2];
			if (col + 1 < L)
				dst[1] = acc[mt][half * 2 + 1];
		}
	}
}

// Block (output chunk of NT x 8, head, row chunk of MT x 16): the block's o_lat rows
// (as wide) and the chunk's W_UV rows (NT * 8, ls) arrive in one burst, zero padded; warp w takes
// the k16 steps w, w + 4, ... for every row and output, and the four partial tiles are
// added in a fixed order through shared memory (the tiles' space, reused). With split
// partials (FOLD, parts.n_splits > 1) the rows are merged from them instead of read
// from o_lat, while the weight tile is in flight; the split lists follow the tiles.
// CLU: the blocks of a thread-block cluster (along x: the same head and rows, other
// outputs) share that merge: rank k merges its share of the float4 columns into its
// own tile, then copies the others' shares from theirs (distributed shared memory), so
// each partial is read from L2 once a head, not once a block (33 splits at batch 1:
// 1 MB, not 8 x 1 MB).
template <int MT, int NT, bool FOLD, bool CLU = false>
__global__ void __launch_bounds__(PROJ_THREADS)
mla_expand_mma_kernel(float *__restrict__ out, const float *__restrict__ o_lat,
		      const uint16_t *__restrict__ w, int n_rows, int H, int nope, int vdim, int L,
		      int vec, const proj_parts parts)
{
	extern __shared__ __align__(16) unsigned char proj_smem[];
	constexpr int NJ = NT * 8, MR = MT * 16;
	const int nks = (L + 15) / 16, as = nks * 16 + 8, ls = nks * 16 + PROJ_PAD;
	const int am = proj_a_rows(n_rows, MR);	// as the launcher sized the tile
	float *sa = (float *)proj_smem;					// (am, as)
	uint16_t *sw = (uint16_t *)(proj_smem + (size_t)am * as * 4);	// (NJ, ls) bf16
	float *red = (float *)proj_smem;		// (PROJ_WARPS, MR, NJ), after the tiles
	const int h = blockIdx.y, r0 = blockIdx.z * MR, nr = min(MR, n_rows - r0);
	const int j0 = blockIdx.x * NJ, nj = min(NJ, vdim - j0), nmt = (nr + 15) / 16;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const uint16_t *wh = w + ((size_t)h * (nope + vdim) + nope + j0) * L;
	float acc[MT][NT][4] = {};

	if (vec) {	// L % 8 == 0 and w 16-byte aligned
		for (int i = threadIdx.x; i < NJ * (ls / 8); i += PROJ_THREADS) {
			const int j = i / (ls / 8), c = i % (ls / 8) * 8;
			const bool ok = j < nj && c < L;

			cp_async16(sw + j * ls + c, ok ? wh + (size_t)j * L + c : wh, ok);
		}
	} else {
		for (int i = threadIdx.x; i < NJ * ls; i += PROJ_THREADS) {
			const int j = i / ls, c = i % ls;

			sw[i] = j < nj && c < L ? wh[(size_t)j * L + c] : (uint16_t)0;
		}
	}
	k_cuda_pdl_wait();	// the weight copies above overlap the attention's tail
	if (FOLD && parts.n_splits > 1) {
		unsigned char *lists = proj_smem + (size_t)am * as * 4 + (size_t)NJ * ls * 2;
		int *live = (int *)lists;				// (am, n_splits)
		float *wts = (float *)(live + am * parts.n_splits);	// (am, n_splits)

		cp_async_commit();
		if constexpr (CLU) {
			cg::cluster_group cl = cg::this_cluster();
			const int nb = (int)cl.num_blocks(), rk = (int)cl.block_rank();
			const int q4 = as / 4, per = (q4 + nb - 1) / nb;	// float4s a rank

			stage_merged<true>(sa, as, parts, n_rows, H, h, r0, nr, L, live, wts,
					   (int *)(wts + am * parts.n_splits), rk * per,
					   min(q4, (rk + 1) * per));
			cl.sync();	// every rank's share written (release / acquire)
			for (int i = threadIdx.x; i < nr * q4; i += PROJ_THREADS) {
				const int o = i % q4 / per, at = i / q4 * as + i % q4 * 4;

				if (o != rk)
					*(float4 *)(sa + at) =
						*(const float4 *)(cl.map_shared_rank(sa, o) + at);
			}
			// every rank done reading the others' tiles (red below reuses them,
			// and a block's shared memory goes when it exits)
			cl.sync();
		} else {
			stage_merged<false>(sa, as, parts, n_rows, H, h, r0, nr, L, live, wts,
					    (int *)(wts + am * parts.n_splits), 0, as / 4);
		}
	} else {
		stage_a(sa, as, o_lat + ((size_t)r0 * H + h) * L, (size_t)H * L, nr, L,
			L % 4 == 0 && (uintptr_t)o_lat % 16 == 0);
		cp_async_commit();
	}
	cp_async_wait<0>();
	__syncthreads();
#pragma unroll 2
	for (int ks = warp; ks < nks; ks += PROJ_WARPS) {
		uint32_t b[NT][2];

#pragma unroll
		for (int nt = 0; nt < NT; nt++) {
			const uint16_t *bp = sw + (nt * 8 + g) * ls + ks * 16 + 2 * t;

			b[nt][0] = *(const uint32_t *)bp;
			b[nt][1] = *(const uint32_t *)(bp + 8);
		}
#pragma unroll
		for (int mt = 0; mt < MT; mt++) {
			uint32_t hi[4], lo[4];

			if (mt >= nmt)
				break;
			load_a(hi, lo, sa, as, mt * 16, ks * 16, nr);
#pragma unroll
			for (int nt = 0; nt < NT; nt++) {
				mma_bf16(acc[mt][nt], hi, b[nt][0], b[nt][1]);
				mma_bf16(acc[mt][nt], lo, b[nt][0], b[nt][1]);
			}
		}
	}
	__syncthreads();	// every warp is done with the tiles: red takes their place
#pragma unroll
	for (int mt = 0; mt < MT; mt++) {
		if (mt >= nmt)
			break;
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int half = 0; half < 2; half++) {
				float *rp = red + (warp * MR + mt * 16 + g + half * 8) * NJ + nt * 8 + 2 * t;

				rp[0] = acc[mt][nt][half * 2];
				rp[1] = acc[mt][nt][half * 2 + 1];
			}
	}
	__syncthreads();
	for (int i = threadIdx.x; i < nr * NJ; i += PROJ_THREADS) {
		const int rr = i / NJ, jj = i % NJ;
		float x = 0.0f;

		if (jj >= nj)
			continue;
#pragma unroll
		for (int wp = 0; wp < PROJ_WARPS; wp++)
			x += red[(wp * MR + rr) * NJ + jj];
		out[((size_t)(r0 + rr) * H + h) * vdim + j0 + jj] = x;
	}
}

// k_cuda_tuning()->mla_proj_mma 0 (KDEC_CUDA_MLA_PROJ=0): the CUDA-core kernels of
// attn_mla.cu instead (A/B timing).
int proj_mma_env(void)
{
	return k_cuda_tuning()->mla_proj_mma != 0;
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static int proj_smem_optin;	// set by mla_proj_prepare: the most a block may ask for

int mla_proj_prepare(int smem_optin)
{
	proj_smem_optin = smem_optin;
	K_CUDA_TRY(cudaFuncSetAttribute(mla_absorb_mma_kernel<false>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_absorb_mma_kernel<true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, 1, false>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<2, 2, false>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	if (attn_mla_carveout(mla_absorb_mma_kernel<false>) ||
	    attn_mla_carveout(mla_absorb_mma_kernel<true>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<1, 1, false>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<2, 2, false>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>))
		return -EIO;
	return 0;
}

// The absorb tile's bytes: the q rows and the weight tile.
static size_t absorb_smem(int R, const k_mla_dims *d)
{
	const size_t k16 = (size_t)(d->nope_dim + 15) / 16 * 16;

	return (size_t)proj_a_rows(R, PROJ_MROWS) * (k16 + 8) * 4 +
	       k16 * (ABS_MMA_COLS + PROJ_PAD) * 2;
}

int mla_absorb_mma(cudaStream_t s, float *q_lat, const float *q, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec)
{
	const size_t smem = absorb_smem(R, d);
	const k_cuda_mla_post_args none = {};

	if (!proj_mma_env() || smem > (size_t)proj_smem_optin)
		return 1;
	K_CUDA_TRY(k_cuda_launch_pdl(s, dim3(attn_cdiv(d->kv_lora, ABS_MMA_COLS), d->n_heads,
					     attn_cdiv(R, PROJ_MROWS)),
				     PROJ_THREADS, smem, mla_absorb_mma_kernel<false>, q_lat, q,
				     (long)d->n_heads * (d->nope_dim + d->rope_dim), w, R,
				     d->n_heads, d->nope_dim, d->rope_dim, d->v_dim, d->kv_lora, vec,
				     none));
	K_CUDA_TRY_LAUNCHED("mla_absorb_mma_kernel");
	return 0;
}

// Whether the absorb launch can take p's work: a few rows (a post block each, one per
// column chunk at most), p's shapes those of d, and mla_post's own bounds.
static bool absorb_post_fits(int R, const k_mla_dims *d, const k_cuda_mla_post_args *p)
{
	const int qk = d->nope_dim + d->rope_dim;
	const long q_rs = p->q_src_pe ? p->q_src_rs : p->q_rs;

	return R >= 1 && R <= ABS_POST_ROWS && R <= attn_cdiv(d->kv_lora, ABS_MMA_COLS) &&
	       p->rows == R && p->n_heads == d->n_heads && p->q_hs == qk &&
	       q_rs >= (long)d->n_heads * qk && p->kv_lora == d->kv_lora &&
	       p->kv_lora <= POST_MAX_LORA && p->pe_dim == d->rope_dim &&
	       p->rot_dim >= 0 && p->rot_dim % 2 == 0 && p->rot_dim <= p->pe_dim &&
	       p->rot_dim / 2 <= POST_MAX_HALF && (p->rot_dim == 0 || p->inv_freq) &&
	       p->kv_rs >= (long)p->kv_lora + p->pe_dim && p->q_pe && p->kv && p->norm &&
	       p->pos && p->slots && p->cache;
}

int mla_absorb_post_mma(cudaStream_t s, float *q_lat, const k_cuda_mla_post_args *p,
			const uint16_t *w, int R, const k_mla_dims *d, int vec)
{
	size_t smem = absorb_smem(R, d);
	const float *q = (p->q_src_pe ? p->q_src_pe : p->q_pe) - d->nope_dim;
	const long q_rs = p->q_src_pe ? p->q_src_rs : p->q_rs;

	if (post_smem(p->rot_dim) > smem)
		smem = post_smem(p->rot_dim);
	if (!proj_mma_env() || smem > (size_t)proj_smem_optin || !absorb_post_fits(R, d, p))
		return 1;
	K_CUDA_TRY(k_cuda_launch_pdl(s, dim3(attn_cdiv(d->kv_lora, ABS_MMA_COLS), d->n_heads + 1, 1),
				     PROJ_THREADS, smem, mla_absorb_mma_kernel<true>, q_lat, q, q_rs,
				     w, R, d->n_heads, d->nope_dim, d->rope_dim, d->v_dim,
				     d->kv_lora, vec, *p));
	K_CUDA_TRY_LAUNCHED("mla_absorb_mma_kernel");
	return 0;
}

// The expand tile's bytes: the o_lat rows and the weight rows, with the split lists
// after them when it merges n_splits > 1 partials, or the partial sums where larger.
static size_t expand_smem(int R, int L, int mr, int nj, int n_splits)
{
	const size_t k16 = (size_t)(L + 15) / 16 * 16, am = (size_t)proj_a_rows(R, mr);
	const size_t tiles = am * (k16 + 8) * 4 + (size_t)nj * (k16 + PROJ_PAD) * 2 +
			     (n_splits > 1 ? am * ((size_t)n_splits * 8 + 4) : 0);
	const size_t red = sizeof(float) * PROJ_WARPS * mr * nj;

	return tiles > red ? tiles : red;
}

// k_cuda_tuning()->mla_fold_rows (KDEC_MLA_FOLD_ROWS=n): the expand merges the
// attention's splits itself up to n rows (default 0: never, the merge kernel runs).
// Each of a head's expand blocks merges the head's partials again (bytes ~ rows x live
// splits x L x 4 per block), which a row or two repay by the launch and round trip
// they spare.
// Read at each call (a host lookup per layer): the tests run both paths.
static int fold_rows_env(void)
{
	return k_cuda_tuning()->mla_fold_rows;
}

// mla_fold_cluster 0 (KDEC_MLA_FOLD_CLUSTER=0): every merging expand block merges its
// head's partials itself (no cluster). Read at each call: the tests run both.
static bool fold_cluster_env(void)
{
	return k_cuda_tuning()->mla_fold_cluster != 0;
}

// Blocks of a cluster sharing a head's merge: the most (up to EXP_FOLD_CLUSTER, a
// power of 2: the portable cluster sizes) that divides the head's blocks; 1: none.
static int fold_cluster(int blocks_x)
{
	int c = EXP_FOLD_CLUSTER;

	if (!fold_cluster_env())
		return 1;
	while (c > 1 && blocks_x % c)
		c /= 2;
	return c;
}

int mla_expand_folds(int R, const k_mla_dims *d, int n_splits)
{
	return proj_mma_env() && R <= fold_rows_env() && R <= EXP_MMA_SMALL_ROWS &&
	       d->kv_lora % 4 == 0 && n_splits <= ATTN_MAX_SPLITS &&
	       (size_t)n_splits * R * d->n_heads * d->kv_lora <= 0x7fffffffu &&
	       expand_smem(R, d->kv_lora, 16, EXP_FOLD_NJ, n_splits) <= (size_t)proj_smem_optin;
}

int mla_expand_mma(cudaStream_t s, float *out, const float *o_lat, const float *part_o,
		   const float *part_lse, int n_splits, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec)
{
	const int small = R <= EXP_MMA_SMALL_ROWS, mr = small ? 16 : 32, nj = small ? 8 : 16;
	const proj_parts parts = { part_o, part_lse, n_splits };
	const proj_parts none = { nullptr, nullptr, 1 };

	if (n_splits > 1) {	// the caller checked mla_expand_folds
		const dim3 grid(attn_cdiv(d->v_dim, EXP_FOLD_NJ), d->n_heads, attn_cdiv(R, 16));

		const size_t smem = expand_smem(R, d->kv_lora, 16, EXP_FOLD_NJ, n_splits);
		const int cl = fold_cluster((int)grid.x);
		auto fold = mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>;
		auto fold_cl = mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>;

		if (!mla_expand_folds(R, d, n_splits))
			ATTN_INVAL("mla_expand_mma: %d rows of %d splits cannot be merged here", R,
				   n_splits);
		if (cl > 1) {	// a cluster of cl blocks along x shares each head's merge
			cudaLaunchConfig_t cfg = {};
			cudaLaunchAttribute attr[2] = {};

			attr[0].id = cudaLaunchAttributeClusterDimension;
			attr[0].val.clusterDim.x = cl;
			attr[0].val.clusterDim.y = 1;
			attr[0].val.clusterDim.z = 1;
			attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
			attr[1].val.programmaticStreamSerializationAllowed = 1;
			cfg.gridDim = grid;
			cfg.blockDim = dim3(PROJ_THREADS);
			cfg.dynamicSmemBytes = smem;
			cfg.stream = s;
			cfg.attrs = attr;
			cfg.numAttrs = k_cuda_pdl_enabled() ? 2 : 1;
			K_CUDA_TRY(cudaLaunchKernelEx(&cfg, fold_cl, out, o_lat, w, R, d->n_heads,
						      d->nope_dim, d->v_dim, d->kv_lora, vec, parts));
		} else {
			K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, fold, out, o_lat, w,
						     R, d->n_heads, d->nope_dim, d->v_dim, d->kv_lora,
						     vec, parts));
		}
		K_CUDA_TRY_LAUNCHED("mla_expand_mma_kernel");
		return 0;
	}

	const size_t smem = expand_smem(R, d->kv_lora, mr, nj, 1);
	const dim3 grid(attn_cdiv(d->v_dim, nj), d->n_heads, attn_cdiv(R, mr));

	if (!proj_mma_env() || smem > (size_t)proj_smem_optin)
		return 1;
	if (small)	// more blocks, each a shorter burst
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<1, 1, false>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec, none));
	else
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<2, 2, false>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec, none));
	K_CUDA_TRY_LAUNCHED("mla_expand_mma_kernel");
	return 0;
}
