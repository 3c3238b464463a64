// MLA decode context parallel on the GPU (k_cuda_mla_cp.h): a rank's rows of the split
// latent cache, its heads absorbed into the rows every rank reads, every head over its
// tokens as split partials of k_cuda_attn_mla's own attention kernels, and its heads
// merged over every rank's partials by attn_merge and expanded.
#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mla.cuh"
#include "kernels/cuda/attn/k_cuda_mla_cp.h"
#include "kernels/cuda/attn/mla_proj.cuh"

#define CP_ROWS_THREADS 128
#define CP_TILE_Q 16		// attn_mla.cu's MLA_TILE_Q: query vectors per tiled block
#define CP_MMA_Q 16		// query heads per block of the tensor-core kernel (MMA_Q)
#define CP_CTAS_PER_SM 2	// attn_mla.cu's MLA_CTAS_PER_SM
#define CP_MIN_SPLIT_TOKENS 64	// a split of a part's context, at least (MLA_MIN_SPLIT_TOKENS)

// ---- kernels ----------------------------------------------------------------

// Thread i: row i's local cache row and the tokens of it this part holds.
__global__ void mla_cp_rows_kernel(int32_t *__restrict__ local_slots, int32_t *__restrict__ ctx_part,
				   const int32_t *__restrict__ slots, const int32_t *__restrict__ ctx,
				   int n_rows, int part, int n_parts, int trash)
{
	const int i = blockIdx.x * CP_ROWS_THREADS + threadIdx.x;

	if (i >= n_rows)
		return;
	const int s = slots[i], c = ctx[i];

	local_slots[i] = s < 0 ? -1 : s % n_parts == part ? s / n_parts : trash;
	// positions t < c with t % n_parts == part (block_tokens % n_parts == 0)
	ctx_part[i] = c > part ? (c - part + n_parts - 1) / n_parts : 0;
}

// ---- launchers --------------------------------------------------------------

extern "C" int k_cuda_mla_cp_rows(cudaStream_t s, int32_t *local_slots, int32_t *ctx_part,
				  const int32_t *slots, const int32_t *ctx, int n_rows, int part,
				  int n_parts, int trash)
{
	if (n_rows < 0 || n_parts < 1 || part < 0 || part >= n_parts || trash < 0)
		ATTN_INVAL("k_cuda_mla_cp_rows: %d rows, part %d of %d, trash %d unsupported",
			   n_rows, part, n_parts, trash);
	if (n_rows == 0)
		return 0;
	mla_cp_rows_kernel<<<attn_cdiv(n_rows, CP_ROWS_THREADS), CP_ROWS_THREADS, 0, s>>>(
		local_slots, ctx_part, slots, ctx, n_rows, part, n_parts, trash);
	K_CUDA_TRY_LAUNCHED("mla_cp_rows_kernel");
	return 0;
}

extern "C" int k_cuda_mla_absorb(cudaStream_t s, struct k_cuda_attn_ws *ws, float *qa, long qa_rs,
				 const float *q, const uint16_t *w_kv_b, int n_rows,
				 const struct k_mla_dims *d)
{
	const int wd = d ? d->kv_lora + d->rope_dim : 0;
	int ret;

	if (!ws || !d || n_rows < 0 || n_rows > ws->max_rows || d->n_heads < 1 ||
	    d->n_heads > ws->max_heads || wd > ws->max_dim || qa_rs < (long)d->n_heads * wd)
		ATTN_INVAL("k_cuda_mla_absorb: %d rows of %d heads (width %d, row stride %ld) do "
			   "not fit the workspace", n_rows, d ? d->n_heads : 0, wd, qa_rs);
	if (n_rows == 0)
		return 0;
	if ((ret = attn_mla_absorb(s, ws, q, w_kv_b, n_rows, d)))
		return ret;
	// the heads' rows into the shared rows (the absorb writes (R, H, wd) contiguous)
	K_CUDA_TRY(cudaMemcpy2DAsync(qa, sizeof(float) * qa_rs, ws->q_lat,
				     sizeof(float) * d->n_heads * wd, sizeof(float) * d->n_heads * wd,
				     n_rows, cudaMemcpyDeviceToDevice, s));
	return 0;
}

extern "C" int k_cuda_attn_mla_part_splits(const struct k_cuda_attn_ws *ws, int n_rows,
					   int n_heads, int kv_lora, int max_ctx, int n_parts,
					   int ranks_per_gpu, size_t cap_floats)
{
	const size_t part = (size_t)n_rows * n_heads * kv_lora, lse = (size_t)n_rows * n_heads;
	const long base = (long)n_rows * attn_cdiv(n_heads, CP_MMA_Q);
	const long target = (long)CP_CTAS_PER_SM * ws->n_sm / (ranks_per_gpu > 0 ? ranks_per_gpu : 1);
	const int ctx = n_parts > 0 ? attn_cdiv(max_ctx, n_parts) : max_ctx;
	long n = base >= target ? 1 : (target + base - 1) / base;

	if (n_rows < 1 || n_heads < 1 || kv_lora < 1 || n_parts < 1)
		return 0;
	n = n < attn_cdiv(ctx, CP_MIN_SPLIT_TOKENS) ? n : attn_cdiv(ctx, CP_MIN_SPLIT_TOKENS);
	n = n < 2 ? 2 : n;	// at least two: only split partials carry their lse
	n = n < ATTN_MAX_SPLITS / n_parts ? n : ATTN_MAX_SPLITS / n_parts;
	if ((size_t)n * part > ws->part_floats)
		n = (long)(ws->part_floats / part);
	if ((size_t)n * lse > ws->lse_floats)
		n = (long)(ws->lse_floats / lse);
	if ((size_t)n * part > cap_floats)
		n = (long)(cap_floats / part);
	return n < 2 ? 0 : (int)n;
}

extern "C" int k_cuda_attn_mla_part(cudaStream_t s, struct k_cuda_attn_ws *ws, float *part_o,
				    float *part_lse, int n_splits, const float *qa,
				    const uint16_t *cache, int block_tokens,
				    const struct k_cuda_attn_rows *rows, const int32_t *ctx_part,
				    int n_heads, int kv_lora, int rope_dim, float scale, int part,
				    int n_parts)
{
	const k_mla_dims d = { n_heads, 1, rope_dim, 1, kv_lora };	// nope, v unused here
	const int wd = kv_lora + rope_dim;
	attn_tile_args a;
	int ret, R, max_ctx;

	if ((ret = attn_check_rows("k_cuda_attn_mla_part", ws, rows, block_tokens, n_heads, wd)))
		return ret;
	if (n_parts < 1 || part < 0 || part >= n_parts || block_tokens % n_parts || n_splits < 2 ||
	    n_splits > ATTN_MAX_SPLITS || kv_lora < 1 || rope_dim < 0)
		ATTN_INVAL("k_cuda_attn_mla_part: part %d of %d, block_tokens %d (a multiple of the "
			   "parts), %d splits (2..%d), kv_lora %d, rope %d unsupported", part,
			   n_parts, block_tokens, n_splits, ATTN_MAX_SPLITS, kv_lora, rope_dim);
	R = rows->n_rows;
	if ((size_t)n_splits * R * n_heads * kv_lora > ws->part_floats ||
	    (size_t)n_splits * R * n_heads > ws->lse_floats)
		ATTN_INVAL("k_cuda_attn_mla_part: %d splits of %d rows x %d heads exceed the "
			   "workspace", n_splits, R, n_heads);
	if (R == 0)
		return 0;
	max_ctx = attn_cdiv(rows->max_ctx, n_parts);	// every part's ctx_part at most
	// the part's cache is a paged cache of block_tokens / n_parts-token blocks
	attn_mla_tile_args(&a, ws, qa, cache, block_tokens / n_parts, ctx_part, rows->blocks, R,
			   &d, scale * 1.4426950408889634f);
	a.out = nullptr;	// partials only, every one with its lse
	a.part_o = part_o;
	a.part_lse = part_lse;
	if (attn_mma_usable(&a)) {
		if ((ret = attn_mma_run(s, ws, &a, max_ctx, nullptr, n_splits)))
			return ret;
		if (a.n_splits != n_splits)	// the checks above make it take them
			ATTN_INVAL("k_cuda_attn_mla_part: %d splits taken of %d", a.n_splits, n_splits);
		return 0;
	}
	if (!attn_tile_smem(ws, CP_TILE_Q, wd, kv_lora, 0))
		ATTN_INVAL("k_cuda_attn_mla_part: kv_lora %d + rope %d do not fit in shared memory",
			   kv_lora, rope_dim);
	a.n_splits = n_splits;
	return attn_tile_launch(s, ws, CP_TILE_Q, &a);
}

extern "C" int k_cuda_mla_merge_expand(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
				       const float *part_o, const float *part_lse, int n_splits,
				       int n_rows, int n_heads_all, int h0, const uint16_t *w_kv_b,
				       const struct k_mla_dims *d)
{
	const int H = d ? d->n_heads : 0, L = d ? d->kv_lora : 0;
	int ret;

	if (!ws || !d || n_splits < 1 || n_splits > ATTN_MAX_SPLITS || n_rows < 0 ||
	    n_rows > ws->max_rows || H < 1 || h0 < 0 || h0 + H > n_heads_all ||
	    H > ws->max_heads || L + d->rope_dim > ws->max_dim ||
	    (size_t)n_splits * n_rows * H * L > ws->part_floats ||
	    (size_t)n_splits * n_rows * H > ws->lse_floats)
		ATTN_INVAL("k_cuda_mla_merge_expand: %d splits, %d rows, heads %d..%d of %d, "
			   "kv_lora %d unsupported", n_splits, n_rows, h0, h0 + H, n_heads_all, L);
	if (n_rows == 0)
		return 0;
	// the heads' partials of every split, (n_splits, R, H, L) back to back: the layout
	// the merge reads
	K_CUDA_TRY(cudaMemcpy2DAsync(ws->part_o, sizeof(float) * H * L, part_o + (size_t)h0 * L,
				     sizeof(float) * n_heads_all * L, sizeof(float) * H * L,
				     (size_t)n_splits * n_rows, cudaMemcpyDeviceToDevice, s));
	K_CUDA_TRY(cudaMemcpy2DAsync(ws->part_lse, sizeof(float) * H, part_lse + h0,
				     sizeof(float) * n_heads_all, sizeof(float) * H,
				     (size_t)n_splits * n_rows, cudaMemcpyDeviceToDevice, s));
	if ((ret = attn_merge(s, ws, n_splits, n_rows, H, L, ws->o_lat, (long)H * L, L, nullptr)))
		return ret;
	return attn_mla_expand(s, ws, out, w_kv_b, n_rows, d);
}
