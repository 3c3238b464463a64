// The two per-head projections around absorbed MLA attention, on tensor cores:
// absorb q_lat[r, h, :L] = q_nope[r, h] W_UK[h] and expand out[r, h] = W_UV[h] o_lat[r, h].
// mma.sync m16n8k16 bf16 with fp32 accumulation; the fp32 activations enter as two bf16
// halves (hi + lo, about 16 significant bits) against the exact bf16 weights, so results
// stay within ~1e-5 of the fp32 CUDA-core kernels. Each block stages its activation rows
// and an 8 KB weight tile (DeepSeek dims) in one burst of 16-byte copies, 256 blocks, so
// a decode step's 2 MB per projection is in flight at once; past 16 rows the tensor
// cores keep 64 rows as cheap as one.
// This file: the absorb (with mla_post's work folded in) and the kernels' preparation;
// the expand is mla_expand.cu, what both use mla_proj_tile.cuh.
#include <cstdlib>

#include <cuda_bf16.h>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/mla_proj.cuh"
#include "kernels/cuda/attn/mla_proj_tile.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ops/mla_cache_row.cuh"
#include "kernels/cuda/ptx.cuh"

#define PROJ_MROWS 64		// query rows per block: four m16 tiles
#define PROJ_MT (PROJ_MROWS / 16)
#define ABS_MMA_COLS (PROJ_WARPS * 8)	// latent columns per absorb block: one n8 tile a warp
#define ABS_POST_ROWS 8		// rows up to which the absorb launch takes mla_post's work
#define POST_MAX_LORA 2048	// latent values of a row (mla_post's bound), in registers
#define POST_PER (POST_MAX_LORA / PROJ_THREADS)
#define POST_MAX_HALF 512	// rotary pairs: the cos/sin table in shared memory

namespace {	// kernels and their helpers stay private to this file

// ---- mla_post's work in the absorb launch (k_cuda_attn_mla_post) ----

// mla_post.cu's rotation and cos/sin of pair i at position p, the same rounded
// operations: the folded launch's q_lat and cache rows are those of mla_post and the
// absorb, bit for bit.
__device__ __forceinline__ void post_cs(const k_cuda_mla_post_args &a, float p, int i, float &c,
					float &sn)
{
	k_cuda_rope_cs(p, k_cuda_pdl_early(a.inv_freq + i), a.attn_factor, c, sn);	// a constant
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
	const int32_t slot = k_cuda_pdl_early(a.slots + r);	// a step input (as pos)
	const float *kv = a.kv + (size_t)r * a.kv_rs;
	float lat[POST_PER];
	double s0 = 0.0, s1 = 0.0, ss = 0.0;

	if (slot < 0)	// a padding row: no cache entry (its q is the absorb blocks')
		return;
	for (int i = threadIdx.x; i < half; i += PROJ_THREADS)
		post_cs(a, (float)k_cuda_pdl_early(a.pos + r), i, cs[i], cs[half + i]);
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
mla_absorb_mma_kernel(float *__restrict__ q_lat, const float *q, long q_rs,
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

			k_cuda_pdl_early_cp16(sw + k * LS + cc, ok ? wh + (size_t)k * L + c0 + cc : wh,
					      ok);
		}
	} else {
		for (int i = threadIdx.x; i < nks * 16 * ABS_MMA_COLS; i += PROJ_THREADS) {
			const int k = i / ABS_MMA_COLS, cc = i % ABS_MMA_COLS;

			sw[k * LS + cc] = k < nope && c0 + cc < L
						  ? k_cuda_pdl_early(wh + (size_t)k * L + c0 + cc)
						  : (uint16_t)0;
		}
	}
	// POST: the rotary pairs of q's rope part, nr * hp (the tail past them),
	// shared out over the column chunks; a thread's first pair's cos/sin before the wait.
	const int hp = POST ? pa.rot_dim / 2 : 1, nrot = POST ? nr * hp : 0;
	const int i0 = blockIdx.x * PROJ_THREADS + threadIdx.x;
	float pc = 0.0f, ps = 0.0f;

	if (POST && i0 < nrot)
		post_cs(pa, (float)k_cuda_pdl_early(pa.pos + r0 + i0 / hp), i0 % hp, pc, ps);
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
	if (attn_mla_carveout(mla_absorb_mma_kernel<false>) ||
	    attn_mla_carveout(mla_absorb_mma_kernel<true>))
		return -EIO;
	return mla_expand_prepare(smem_optin);
}


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
