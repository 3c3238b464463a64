/* The paged KV cache on the GPU and attention over it: bf16 cache writes, GQA and absorbed
 * MLA (DeepSeek) attention for decode and prefill rows. C entry points; every function
 * returns 0 or a negative errno (-EINVAL: a size this code does not handle, logged;
 * -EIO: a CUDA call failed, logged with call, file and line).
 *
 * Graph safety: the launch configuration of every call (grid, splits, shared memory)
 * depends only on host values (n_rows, heads, dims, block_tokens, max_ctx), never on the
 * ctx or block-table contents in device memory, and no call allocates or synchronises;
 * a step can be captured once and replayed with new ctx and block tables. */
#ifndef KD_KERNELS_CUDA_K_CUDA_ATTN_H
#define KD_KERNELS_CUDA_K_CUDA_ATTN_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

struct k_mla_dims;	/* kernels/cpu/k_cpu.h */

/* ---- cache layout -----------------------------------------------------------
 * One layer's cache is bf16 (passed as uint16_t), (n_blocks, block_tokens, width):
 *   GQA: separate K and V arrays, width = kv_heads * head_dim (head-major in a token row);
 *   MLA: one array, width = kv_lora + rope_dim (normalised latent, then the rotated key).
 * A token's row is slot = block * block_tokens + offset, as on the CPU. */

/* cache[slots[r], :] = bf16(src[r, :width]) for each row r (round to nearest even).
 * src: device (n_rows, src_stride) fp32; slots: device (n_rows); a negative slot skips
 * the row (padding rows of a captured batch). Slots must be inside the cache. */
int k_cuda_kv_write(cudaStream_t s, uint16_t *cache, int width, const float *src,
		    int src_stride, int n_rows, const int32_t *slots);

/* Which cache rows each query row attends to: the first ctx[r] tokens of its sequence,
 * through its block table. Rows of one sequence are consecutive and share one table
 * pointer (prefill); decode rows are one per sequence. The struct lives in host memory. */
struct k_cuda_attn_rows {
	int n_rows;
	const int32_t *ctx;		/* device (n_rows): tokens visible to row r (pos + 1) */
	const int32_t *const *blocks;	/* device (n_rows): device pointer to row r's table */
	int max_ctx;			/* host: bound on every ctx[r] (the capacity) */
	int n_seqs;			/* host hint: sequences among the rows (runs of rows
					 * sharing a table); 0 means one per row (decode).
					 * Picks the prefill kernel; results never depend on it */
};

/* Device scratch of the attention calls: split partials, and MLA's absorbed query and
 * latent output. max_dim is the widest per-head vector: head_dim (GQA) or
 * kv_lora + rope_dim (MLA). One call at a time per workspace (one stream).
 * Allocates device memory, so not while a stream is being captured.
 * *out is owned by the caller: k_cuda_attn_ws_destroy (accepts NULL). */
struct k_cuda_attn_ws;
int k_cuda_attn_ws_create(struct k_cuda_attn_ws **out, int max_rows, int max_heads,
			  int max_dim, int max_ctx);
void k_cuda_attn_ws_destroy(struct k_cuda_attn_ws *ws);

/* Causal GQA attention over the paged cache, fp32 softmax and accumulation.
 * q, out: device (n_rows, n_heads, head_dim) fp32; head h reads kv head
 * h / (n_heads / kv_heads). head_dim 1..256 (64 and 128 are the fast shapes). */
int k_cuda_attn_gqa(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out, const float *q,
		    const uint16_t *k_cache, const uint16_t *v_cache, int block_tokens,
		    const struct k_cuda_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
		    float scale);

/* k_cuda_attn_gqa that also writes out rounded to bf16 (nearest even), (n_rows, n_heads *
 * head_dim) contiguous, into out_bf16 where it runs the decode kernel (rows of distinct
 * sequences) or the tensor-core prefill kernel, for a linear layer that takes bf16
 * input next. Returns 1 when it wrote out_bf16, 0 when not (the tiled prefill kernel
 * ran), or an error as k_cuda_attn_gqa. */
int k_cuda_attn_gqa_bf16(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			 uint16_t *out_bf16, const float *q, const uint16_t *k_cache,
			 const uint16_t *v_cache, int block_tokens,
			 const struct k_cuda_attn_rows *rows, int n_heads, int kv_heads,
			 int head_dim, float scale);

/* k_cuda_qkv_post(post) then k_cuda_attn_gqa_bf16(q = post->q, the caches post's, its
 * heads and head_dim), for rows that are each the only new token of their sequence (a
 * decode step: every row its own sequence, n_seqs 0 or n_rows, at its last position
 * ctx - 1, appended at its slot). Where the tensor-core decode kernel runs them (group
 * <= 16, k_cuda_tuning()->qkv_in_attn not 0), in one launch fewer: q normed and rotated as the
 * attention stages it, each row's K/V appended by the block whose split holds its last
 * token, before that block copies it; post->q is then not written. The cache rows are
 * qkv_post's bits and out the two calls' (q's fp32 values are qkv_post's). Returns as
 * k_cuda_attn_gqa_bf16. */
struct k_cuda_qkv_args;		/* kernels/cuda/ops/k_cuda_ops.h */
int k_cuda_attn_gqa_qkv(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			uint16_t *out_bf16, const struct k_cuda_qkv_args *post, int block_tokens,
			const struct k_cuda_attn_rows *rows, float scale);

/* Absorbed MLA over the latent cache: q_lat = W_UK^T q_nope per head, scores over the
 * latent and the rope key, softmax, o_lat = sum_t p_t c_t, out = W_UV o_lat.
 * q: device (n_rows, n_heads, nope_dim + rope_dim) fp32, rope part rotated;
 * w_kv_b: device (n_heads * (nope_dim + v_dim), kv_lora) bf16 as stored: per head
 *   nope_dim rows of W_UK then v_dim rows of W_UV;
 * out: device (n_rows, n_heads, v_dim) fp32. */
int k_cuda_attn_mla(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out, const float *q,
		    const uint16_t *w_kv_b, const uint16_t *cache, int block_tokens,
		    const struct k_cuda_attn_rows *rows, const struct k_mla_dims *d, float scale);

/* k_cuda_mla_post(post) then k_cuda_attn_mla(q = post->q_pe - nope_dim): at 1..8 rows
 * (tensor-core projections on) in one launch fewer, the absorb launch doing mla_post's
 * work (q's rope part rotated straight into the absorbed query, the latent normalised
 * and appended by extra blocks) and the attention copying this step's cache rows after
 * its wait; then q itself is never written (only mla_post's source read). The results
 * (out, the cache rows) are the two calls' bit for bit. post: as k_cuda_mla_post, its
 * rows n_rows, its heads and dims d's. */
struct k_cuda_mla_post_args;	/* kernels/cuda/ops/k_cuda_ops.h */
int k_cuda_attn_mla_post(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			 const struct k_cuda_mla_post_args *post, const uint16_t *w_kv_b,
			 const uint16_t *cache, int block_tokens,
			 const struct k_cuda_attn_rows *rows, const struct k_mla_dims *d,
			 float scale);

/* The log-sum-exp merge of split partials that the attention calls run internally,
 * exposed for its test: out(r, h, :dim) = sum_s w_s part_o(s, r, h, :) with
 * w_s = exp2(part_lse(s, r, h) - max) / sum (base 2); splits with lse -inf are skipped
 * without reading their partial; 0 where every split is -inf.
 * part_o: device (n_splits, n_rows, n_heads, dim) fp32; part_lse: device (n_splits,
 * n_rows, n_heads); out row r head h at out + r * out_rs + h * out_hs (floats); out_bf16
 * NULL or at the same offsets, out rounded to bf16 (nearest even). ws: only its device
 * facts are used. n_splits 1..128. k_cuda_tuning()->attn_merge_batched 0 (the default):
 * the 4-loads-at-a-time kernel. */
int k_cuda_attn_merge(cudaStream_t s, const struct k_cuda_attn_ws *ws, const float *part_o,
		      const float *part_lse, int n_splits, int n_rows, int n_heads, int dim,
		      float *out, long out_rs, long out_hs, uint16_t *out_bf16);

#ifdef __cplusplus
}
#endif

#endif
