// Absorbed multi-head latent attention (DeepSeek-V2/V3) over the latent paged cache:
// q_lat = W_UK^T q_nope per head, attention over [latent ; rope key] by the tiled kernel
// (the heads of a row share each latent tile), out = W_UV o_lat.
#include <cstdlib>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mla.cuh"
#include "kernels/cuda/attn/mla_proj.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/ops.h"

#define MLA_ROWS 16		// query rows per block of the absorb and expand kernels
#define ABS_THREADS 128
#define ABS_COLS 64		// latent columns per absorb block: 32 lanes x 2
#define ABS_SLICES (ABS_THREADS / 32)
#define EXP_THREADS 128
#define EXP_J 32		// outputs per expand block, EXP_J / 4 per warp
#define MLA_TILE_Q 16
#define MLA_CTAS_PER_SM 2
#define MLA_MIN_SPLIT_TOKENS 64
#define MLA_MAX_NOPE 512
#define MLA_MAX_LORA 1024

// ---- kernels ----------------------------------------------------------------

// Block (column chunk, head, row chunk): q_lat[r, h, c] = sum_i q[r, h, i] W_UK[h, i, c]
// for the block's 64 columns. The weight tile (nope, 64) arrives in one burst of 16-byte
// copies (the bytes in flight, not the arithmetic, bound this at small batch); then warp
// s sums the nope rows i = s mod 4 for 2 columns per lane, and the four are added.
// Column chunk 0 also copies the rope part of q.
__global__ void __launch_bounds__(ABS_THREADS)
mla_absorb_kernel(float *__restrict__ q_lat, const float *__restrict__ q,
		  const uint16_t *__restrict__ w, int n_rows, int H, int nope, int rope,
		  int vdim, int L, int vec)
{
	extern __shared__ __align__(16) unsigned char attn_smem[];
	__shared__ float red[ABS_SLICES][MLA_ROWS][ABS_COLS];
	uint16_t *sw = (uint16_t *)attn_smem;	// (nope, ABS_COLS) bf16, zero past L
	float *sq = (float *)(attn_smem + (size_t)nope * ABS_COLS * 2);	// (MLA_ROWS, nope)
	const int h = blockIdx.y, r0 = blockIdx.z * MLA_ROWS, nr = min(MLA_ROWS, n_rows - r0);
	const int qk = nope + rope, wd = L + rope, c0 = blockIdx.x * ABS_COLS;
	const int cp = threadIdx.x % 32, slice = threadIdx.x / 32;
	const uint16_t *wh = w + (size_t)h * (nope + vdim) * L;
	float acc[MLA_ROWS][2] = {};

	if (vec) {
		for (int i = threadIdx.x; i < nope * (ABS_COLS / 8); i += ABS_THREADS) {
			const int row = i / (ABS_COLS / 8), c = c0 + i % (ABS_COLS / 8) * 8;

			cp_async16(sw + i * 8, wh + (size_t)row * L + c, c < L);
		}
	} else {
		for (int i = threadIdx.x; i < nope * ABS_COLS; i += ABS_THREADS) {
			const int row = i / ABS_COLS, c = c0 + i % ABS_COLS;

			sw[i] = c < L ? wh[(size_t)row * L + c] : (uint16_t)0;
		}
	}
	cp_async_commit();
	for (int i = threadIdx.x; i < nr * nope; i += ABS_THREADS)
		sq[i] = q[((size_t)(r0 + i / nope) * H + h) * qk + i % nope];
	cp_async_wait<0>();
	__syncthreads();
	for (int i = slice; i < nope; i += ABS_SLICES) {
		const uint32_t ww = *(const uint32_t *)(sw + i * ABS_COLS + cp * 2);
		const float w0 = bf16_lo(ww), w1 = bf16_hi(ww);

#pragma unroll
		for (int rr = 0; rr < MLA_ROWS; rr++)
			if (rr < nr) {
				const float x = sq[rr * nope + i];

				acc[rr][0] = fmaf(x, w0, acc[rr][0]);
				acc[rr][1] = fmaf(x, w1, acc[rr][1]);
			}
	}
#pragma unroll
	for (int rr = 0; rr < MLA_ROWS; rr++) {
		red[slice][rr][cp * 2] = acc[rr][0];
		red[slice][rr][cp * 2 + 1] = acc[rr][1];
	}
	__syncthreads();
	for (int i = threadIdx.x; i < MLA_ROWS * ABS_COLS; i += ABS_THREADS) {
		const int rr = i / ABS_COLS, cc = i % ABS_COLS, col = c0 + cc;
		float x = 0.0f;

		if (rr >= nr || col >= L)
			continue;
#pragma unroll
		for (int sl = 0; sl < ABS_SLICES; sl++)
			x += red[sl][rr][cc];
		q_lat[((size_t)(r0 + rr) * H + h) * wd + col] = x;
	}
	if (blockIdx.x == 0)
		for (int i = threadIdx.x; i < nr * rope; i += ABS_THREADS) {
			const size_t rh = (size_t)(r0 + i / rope) * H + h;

			q_lat[rh * wd + L + i % rope] = q[rh * qk + nope + i % rope];
		}
}

// Block (output chunk, head, row chunk): out[r, h, j] = W_UV[h, j, :] . o_lat[r, h, :].
// The block's EXP_J weight rows arrive in one burst of 16-byte copies; then a warp takes
// one j at a time, its lanes along the latent, for all the block's rows. Rows in shared
// memory are ls = L rounded up to 4 long, zero padded.
__global__ void __launch_bounds__(EXP_THREADS)
mla_expand_kernel(float *__restrict__ out, const float *__restrict__ o_lat,
		  const uint16_t *__restrict__ w, int n_rows, int H, int nope, int vdim, int L,
		  int vec)
{
	extern __shared__ __align__(16) unsigned char attn_smem[];
	const int ls = (L + 3) / 4 * 4;
	uint16_t *sw = (uint16_t *)attn_smem;				// (EXP_J, ls) bf16
	float *so = (float *)(attn_smem + (size_t)EXP_J * ls * 2);	// (MLA_ROWS, ls)
	const int h = blockIdx.y, r0 = blockIdx.z * MLA_ROWS, nr = min(MLA_ROWS, n_rows - r0);
	const int j0 = blockIdx.x * EXP_J, nj = min(EXP_J, vdim - j0);
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	const uint16_t *wh = w + ((size_t)h * (nope + vdim) + nope + j0) * L;

	if (vec) {	// L % 8 == 0: ls == L
		for (int i = threadIdx.x; i < nj * (L / 8); i += EXP_THREADS)
			cp_async16(sw + i * 8, wh + (size_t)i * 8, true);
	} else {
		for (int i = threadIdx.x; i < nj * ls; i += EXP_THREADS) {
			const int j = i / ls, c = i % ls;

			sw[i] = c < L ? wh[(size_t)j * L + c] : (uint16_t)0;
		}
	}
	cp_async_commit();
	for (int i = threadIdx.x; i < nr * ls; i += EXP_THREADS) {
		const int rr = i / ls, c = i % ls;

		so[i] = c < L ? o_lat[((size_t)(r0 + rr) * H + h) * L + c] : 0.0f;
	}
	cp_async_wait<0>();
	__syncthreads();
	for (int jj = 0; jj < EXP_J / 4; jj++) {
		const int j = warp * (EXP_J / 4) + jj;
		float acc[MLA_ROWS] = {};

		if (j >= nj)
			break;
		for (int c = lane * 4; c < ls; c += 128) {
			const uint2 ww = *(const uint2 *)(sw + j * ls + c);
			const float w0 = bf16_lo(ww.x), w1 = bf16_hi(ww.x);
			const float w2 = bf16_lo(ww.y), w3 = bf16_hi(ww.y);

#pragma unroll
			for (int rr = 0; rr < MLA_ROWS; rr++)
				if (rr < nr) {
					const float4 o = *(const float4 *)(so + rr * ls + c);

					acc[rr] += w0 * o.x + w1 * o.y + w2 * o.z + w3 * o.w;
				}
		}
#pragma unroll
		for (int rr = 0; rr < MLA_ROWS; rr++) {
			if (rr >= nr)
				continue;
			for (int off = 16; off > 0; off >>= 1)
				acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], off);
			if (lane == rr)
				out[((size_t)(r0 + rr) * H + h) * vdim + j0 + j] = acc[rr];
		}
	}
}

// ---- launchers --------------------------------------------------------------

// Tokens per split of the tensor-core kernel, at least (a multiple of ATTN_SPLIT_ALIGN;
// the kernel's mma_mla_floor): at batch 1 a graph sized for the whole cache gives a
// split of 32 tokens per tile of the context, and each split writes a (heads, kv_lora)
// fp32 partial, 32 KB for V2-Lite, that the merge reads. Default: 64 tokens, only
// where the ctx would otherwise fill more than 64 splits (past 2048 tokens), decided
// on the device from each row's ctx. k_cuda_tuning()->mla_split_min
// (KDEC_MLA_SPLIT_MIN=N): a floor of N tokens at every ctx (0: none, the former; 64:
// phase 1's default), mla_split_live (KDEC_MLA_SPLIT_LIVE=M): the split count past which
// the floor applies (0: always; 0 too where KDEC_MLA_SPLIT_MIN alone is set). Read at
// each call: the tests run them.
static void mla_split_floor(attn_tile_args *a)
{
	const int n = k_cuda_tuning()->mla_split_min;
	const int live = k_cuda_tuning()->mla_split_live;

	a->min_split = n <= 0 ? 0 : (min(n, 1 << 20) + ATTN_SPLIT_ALIGN - 1) / ATTN_SPLIT_ALIGN *
					    ATTN_SPLIT_ALIGN;
	a->split_live = max(0, min(live, ATTN_MAX_SPLITS));
}

int attn_mla_prepare(int smem_optin)
{
	K_CUDA_TRY(cudaFuncSetAttribute(mla_absorb_kernel,
					cudaFuncAttributeMaxDynamicSharedMemorySize,
					smem_optin - (int)sizeof(float) * ABS_SLICES * MLA_ROWS * ABS_COLS));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_kernel,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	return mla_proj_prepare(smem_optin);
}

static int mla_check(const k_mla_dims *d)
{
	if (d->nope_dim < 1 || d->nope_dim > MLA_MAX_NOPE || d->rope_dim < 0 || d->v_dim < 1 ||
	    d->kv_lora < 1 || d->kv_lora > MLA_MAX_LORA)
		ATTN_INVAL("k_cuda_attn_mla: nope %d, rope %d, v %d, kv_lora %d unsupported "
			   "(nope 1..%d, kv_lora 1..%d)", d->nope_dim, d->rope_dim, d->v_dim,
			   d->kv_lora, MLA_MAX_NOPE, MLA_MAX_LORA);
	return 0;
}

void attn_mla_tile_args(attn_tile_args *a, k_cuda_attn_ws *ws, const float *q_lat,
			const uint16_t *cache, int block_tokens, const int32_t *ctx,
			const int32_t *const *blocks, int R, const k_mla_dims *d, float qscale)
{
	const int H = d->n_heads, L = d->kv_lora, wd = L + d->rope_dim;

	a->out = ws->o_lat;
	a->out_rs = (long)H * L;
	a->out_hs = L;
	a->part_o = ws->part_o;
	a->part_lse = ws->part_lse;
	a->q = q_lat;
	a->q_rs = (long)H * wd;
	a->q_hs = wd;
	a->k = cache;
	a->v = nullptr;		// the values are the latent: the key's first L dims
	a->k_stride = a->v_stride = wd;
	a->k_hoff = a->v_hoff = 0;
	a->ctx = ctx;
	a->blocks = blocks;
	a->bt = attn_div_make((uint32_t)block_tokens);
	a->n_rows = R;
	a->n_heads = H;
	a->group = H;
	a->kv_heads = 1;
	a->dk = wd;
	a->dv = L;
	a->qscale = qscale;
	a->early = 0;
	a->vec = wd % 8 == 0 && (uintptr_t)cache % 16 == 0;
	mla_split_floor(a);
}

// The latent attention proper: o_lat (R, H, L) from q_lat (R, H, L + rope), its splits
// merged. fresh: the launch just before appended this step's cache rows (the absorb
// took mla_post's work), so the tensor-core kernel copies them after its PDL wait, not
// before (the tiled kernel waits for everything).
static int mla_attend(cudaStream_t s, k_cuda_attn_ws *ws, const uint16_t *cache,
		      int block_tokens, const k_cuda_attn_rows *rows, const k_mla_dims *d,
		      float qscale, bool fresh)
{
	const int R = rows->n_rows, H = d->n_heads, L = d->kv_lora;
	const long tiles = attn_cdiv(R * H, MLA_TILE_Q);
	attn_tile_args a;

	attn_mla_tile_args(&a, ws, ws->q_lat, cache, block_tokens, rows->ctx, rows->blocks, R, d,
			   qscale);
	a.early = fresh;
	if (attn_mma_usable(&a)) {	// the tensor-core decode kernel
		int ret = attn_mma_run(s, ws, &a, rows->max_ctx, nullptr, 0);

		if (ret || a.n_splits == 1)
			return ret;
		return attn_merge(s, ws, a.n_splits, R, H, L, a.out, a.out_rs, a.out_hs, nullptr);
	}
	a.n_splits = attn_pick_splits(ws, tiles, (long)MLA_CTAS_PER_SM * ws->n_sm, rows->max_ctx,
				      MLA_MIN_SPLIT_TOKENS, (size_t)R * H * L, (size_t)R * H);
	return attn_tile_launch(s, ws, MLA_TILE_Q, &a);
}

int attn_mla_absorb(cudaStream_t s, k_cuda_attn_ws *ws, const float *q, const uint16_t *w_kv_b,
		    int R, const k_mla_dims *d)
{
	const int vec = d->kv_lora % 8 == 0 && (uintptr_t)w_kv_b % 16 == 0;
	int ret;

	// the tensor-core projections (mla_proj.cu) unless they decline (KDEC_CUDA_MLA_PROJ=0)
	if ((ret = mla_absorb_mma(s, ws->q_lat, q, w_kv_b, R, d, vec)) <= 0)
		return ret;
	const size_t smem = (size_t)d->nope_dim * (ABS_COLS * 2 + MLA_ROWS * 4);

	mla_absorb_kernel<<<dim3(attn_cdiv(d->kv_lora, ABS_COLS), d->n_heads, attn_cdiv(R, MLA_ROWS)),
			    ABS_THREADS, smem, s>>>(ws->q_lat, q, w_kv_b, R, d->n_heads, d->nope_dim,
						    d->rope_dim, d->v_dim, d->kv_lora, vec);
	K_CUDA_TRY_LAUNCHED("mla_absorb_kernel");
	return 0;
}

int attn_mla_expand(cudaStream_t s, k_cuda_attn_ws *ws, float *out, const uint16_t *w_kv_b,
		    int R, const k_mla_dims *d)
{
	const int vec = d->kv_lora % 8 == 0 && (uintptr_t)w_kv_b % 16 == 0;
	int ret;

	if ((ret = mla_expand_mma(s, out, ws->o_lat, w_kv_b, R, d, vec)) <= 0)
		return ret;
	const size_t smem = (size_t)(d->kv_lora + 3) / 4 * 4 * (EXP_J * 2 + MLA_ROWS * 4);

	mla_expand_kernel<<<dim3(attn_cdiv(d->v_dim, EXP_J), d->n_heads, attn_cdiv(R, MLA_ROWS)),
			    EXP_THREADS, smem, s>>>(out, ws->o_lat, w_kv_b, R, d->n_heads, d->nope_dim,
						    d->v_dim, d->kv_lora, vec);
	K_CUDA_TRY_LAUNCHED("mla_expand_kernel");
	return 0;
}

// k_cuda_attn_mla, and (post) k_cuda_mla_post's work before it: in the absorb launch
// where it takes it (mla_absorb_post_mma), else its own launch first and q = post's.
static int mla_run(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out, const float *q,
		   const struct k_cuda_mla_post_args *post, const uint16_t *w_kv_b,
		   const uint16_t *cache, int block_tokens, const struct k_cuda_attn_rows *rows,
		   const struct k_mla_dims *d, float scale)
{
	const float qscale = scale * 1.4426950408889634f;	// log2(e): exp2 in the kernels
	int R, vec, ret;
	bool folded = false;

	if (!d)
		ATTN_INVAL("k_cuda_attn_mla: no dims");
	if ((ret = mla_check(d)) ||
	    (ret = attn_check_rows("k_cuda_attn_mla", ws, rows, block_tokens, d->n_heads,
				   d->kv_lora + d->rope_dim)))
		return ret;
	if (!attn_tile_smem(ws, MLA_TILE_Q, d->kv_lora + d->rope_dim, d->kv_lora, 0))
		ATTN_INVAL("k_cuda_attn_mla: kv_lora %d + rope %d do not fit in shared memory",
			   d->kv_lora, d->rope_dim);
	R = rows->n_rows;
	if (R == 0)
		return 0;
	vec = d->kv_lora % 8 == 0 && (uintptr_t)w_kv_b % 16 == 0;
	if (post) {
		if ((ret = mla_absorb_post_mma(s, ws->q_lat, post, w_kv_b, R, d, vec)) < 0)
			return ret;
		folded = ret == 0;
		if (!folded && (ret = k_cuda_mla_post(s, post)))
			return ret;
	}
	if (!folded && (ret = attn_mla_absorb(s, ws, q, w_kv_b, R, d)))
		return ret;
	if ((ret = mla_attend(s, ws, cache, block_tokens, rows, d, qscale, folded)))
		return ret;
	return attn_mla_expand(s, ws, out, w_kv_b, R, d);
}

extern "C" int k_cuda_attn_mla(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			       const float *q, const uint16_t *w_kv_b, const uint16_t *cache,
			       int block_tokens, const struct k_cuda_attn_rows *rows,
			       const struct k_mla_dims *d, float scale)
{
	return mla_run(s, ws, out, q, nullptr, w_kv_b, cache, block_tokens, rows, d, scale);
}

extern "C" int k_cuda_attn_mla_post(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
				    const struct k_cuda_mla_post_args *post,
				    const uint16_t *w_kv_b, const uint16_t *cache,
				    int block_tokens, const struct k_cuda_attn_rows *rows,
				    const struct k_mla_dims *d, float scale)
{
	if (!post || !post->q_pe || !d)
		ATTN_INVAL("k_cuda_attn_mla_post: no post arguments or dims");
	return mla_run(s, ws, out, post->q_pe - d->nope_dim, post, w_kv_b, cache, block_tokens,
		       rows, d, scale);
}
