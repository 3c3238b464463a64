/* The CPU reference ops: fp32 activations, weights read as stored (bf16, fp16, fp32),
 * fp32 arithmetic. Every faster path in kdec is checked against these. */
#ifndef KD_KERNELS_CPU_K_CPU_H
#define KD_KERNELS_CPU_K_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/dtype.h"

/* ---- thread pool ------------------------------------------------------- */

/* A fixed set of worker threads that run one parallel-for at a time.
 * Not reentrant: one k_pool_run at a time per pool (the engine thread owns it). */
struct k_pool;

typedef void (*k_pool_fn)(void *arg, int task);

/* n_threads counts the caller, which works too; 1 means no extra threads.
 * Returns 0 or -errno; *out is owned by the caller (k_pool_destroy). */
int k_pool_create(struct k_pool **out, int n_threads);
void k_pool_destroy(struct k_pool *pool);	/* accepts NULL */
int k_pool_threads(const struct k_pool *pool);	/* 1 for NULL */

/* Calls fn(arg, t) for every t in [0, n_tasks) and returns when all are done.
 * pool may be NULL: then the tasks run in order on the caller. */
void k_pool_run(struct k_pool *pool, k_pool_fn fn, void *arg, int n_tasks);

/* ---- elementwise and normalisation ------------------------------------- */

/* out[i, :] = table[ids[i], :]; ids must already be < vocab. */
void k_cpu_embed(float *out /* (n, dim) */, const int32_t *ids /* (n) */, int n,
		 const void *table /* (vocab, dim) */, enum k_dtype dtype, int dim);

/* out = x / sqrt(mean(x^2) + eps) * w over each row of dim values.
 * Rows are `x_stride` / `out_stride` floats apart, so a slice of a wider row can be
 * normalised in place (out == x is allowed). */
void k_cpu_rmsnorm(float *out, int out_stride, const float *x, int x_stride,
		   const void *w /* (dim) */, enum k_dtype dtype, int rows, int dim, float eps);

/* y += x, n floats. */
void k_cpu_add(float *y, const float *x, size_t n);

/* out = silu(gate) * up, n floats; silu(g) = g / (1 + exp(-g)). out may alias gate. */
void k_cpu_silu_mul(float *out, const float *gate, const float *up, size_t n);

/* ---- linear ------------------------------------------------------------ */

/* y = x @ w^T: y (M, N), x (M, K), w (N, K) as stored.
 * Each y[m, n] is one dot product in a fixed order, so a row's result does not
 * depend on M or on the other rows (batch invariance). Parallel over N. */
void k_cpu_linear(struct k_pool *pool, float *y, const float *x, const void *w,
		  enum k_dtype dtype, int M, int N, int K);

/* ---- rotary position embedding ----------------------------------------- */

enum k_rope_type {
	K_ROPE_DEFAULT = 0,
	K_ROPE_LINEAR,		/* positions divided by factor */
	K_ROPE_LLAMA3,		/* Llama 3.x wavelength-banded scaling */
	K_ROPE_YARN,		/* YaRN: ramp between interpolation and extrapolation + mscale */
};

/* Everything a config may say about RoPE; fields unused by a type are ignored. */
struct k_rope_params {
	enum k_rope_type type;
	double theta;			/* base */
	int dim;			/* rotary dims per head (even) */
	int interleaved;		/* 1: pairs (2i, 2i+1); 0: pairs (i, i + dim/2) */
	double factor;			/* linear, llama3, yarn */
	double low_freq_factor;		/* llama3 */
	double high_freq_factor;	/* llama3 */
	double original_max_pos;	/* llama3, yarn */
	double beta_fast, beta_slow;	/* yarn (0 means the defaults 32 and 1) */
	double mscale, mscale_all_dim;	/* yarn (0 means absent) */
	double attention_factor;	/* yarn; <= 0 means derive from factor/mscale */
	int truncate;			/* yarn: floor/ceil the correction range (HF default 1) */
	enum k_dtype freq_dtype;	/* inv_freq is rounded to this type (K_F32: kept) */
};

/* Precomputed frequencies, computed in float32 the way HF transformers does, then
 * rounded to freq_dtype: transformers keeps inv_freq as a buffer in the checkpoint's
 * dtype, so a bf16 checkpoint rotates by bf16-rounded frequencies. */
struct k_rope {
	int dim;		/* rotary dims */
	int interleaved;
	float attn_factor;	/* multiplies cos and sin (YaRN), else 1 */
	float *inv_freq;	/* (dim / 2), owned */
};

/* Returns 0, or -EINVAL for a bad parameter (dim odd or <= 0, factor <= 0, ...). */
int k_rope_init(struct k_rope *rope, const struct k_rope_params *p);
void k_rope_fini(struct k_rope *rope);	/* accepts a zeroed or half-built rope */

/* Rotates x in place. Head h of row r starts at x + r*row_stride + h*head_stride and
 * its first rope->dim values are rotated by angle pos[r] * inv_freq[i]. */
void k_cpu_rope(const struct k_rope *rope, float *x, int n_rows, int n_heads,
		int row_stride, int head_stride, const int32_t *pos /* (n_rows) */);

/* ---- paged KV cache and attention -------------------------------------- */

/* One layer's cache. A token's row is at slot = block * block_tokens + offset.
 * GQA: k and v are (n_blocks, block_tokens, kv_heads, head_dim).
 * MLA: only k is used: (n_blocks, block_tokens, width) with width = kv_lora + rope_dim;
 *      the latent first, then the rotated rope part. */
struct k_kv_layer {
	float *k;
	float *v;
	int n_blocks;
	int block_tokens;
	int width;		/* floats per token in k (and in v for GQA) */
};

/* Copies row r of src (n_rows, width) into slot slots[r]. Slots must be in range. */
void k_cpu_kv_write(float *cache, int width, const float *src, int n_rows,
		    const int32_t *slots /* (n_rows) */);

/* Which cache rows a query row attends to: the first ctx tokens of its sequence,
 * found through its block table. */
struct k_attn_rows {
	int n_rows;
	int max_ctx;			/* bound on every ctx[r]; GPU launches are sized by it */
	int n_seqs;			/* sequences among the rows (runs sharing a table); 0:
					 * one per row. A hint for GPU kernel choice only */
	const int32_t *ctx;		/* (n_rows) tokens visible to row r (its pos + 1) */
	const int32_t *const *blocks;	/* (n_rows) pointer to the row's block table */
};

/* Causal GQA attention over the paged cache.
 * q, out: (n_rows, n_heads, head_dim); head h reads kv head h / (n_heads / kv_heads).
 * Softmax in fp32 with max subtraction. Parallel over (row, head). */
void k_cpu_attn_gqa(struct k_pool *pool, float *out, const float *q,
		    const struct k_kv_layer *kv, const struct k_attn_rows *rows,
		    int n_heads, int kv_heads, int head_dim, float scale);

/* MLA dimensions (DeepSeek-V2/V3). */
struct k_mla_dims {
	int n_heads;
	int nope_dim;	/* qk_nope_head_dim */
	int rope_dim;	/* qk_rope_head_dim */
	int v_dim;	/* v_head_dim */
	int kv_lora;	/* kv_lora_rank */
};

/* Absorbed MLA decode/prefill over a latent cache (width kv_lora + rope_dim).
 * q: (n_rows, n_heads, nope_dim + rope_dim), rope part already rotated.
 * w_kv_b: kv_b_proj weight (n_heads * (nope_dim + v_dim), kv_lora) as stored:
 *   per head, nope_dim rows of W_UK then v_dim rows of W_UV.
 * score(t) = (W_UK^T q_nope) . c_t + q_pe . kpe_t; out = W_UV (sum_t p_t c_t).
 * out: (n_rows, n_heads, v_dim). Returns 0 or -ENOMEM. */
int k_cpu_attn_mla(struct k_pool *pool, float *out, const float *q,
		   const void *w_kv_b, enum k_dtype dtype, const struct k_kv_layer *kv,
		   const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale);

/* The same attention computed the textbook way: expand every cached latent into
 * per-head K = [W_UK c ; kpe] and V = W_UV c, then attend. Used by tests to show
 * that the absorbed form is exact. Returns 0 or -ENOMEM. */
int k_cpu_attn_mla_expanded(float *out, const float *q, const void *w_kv_b,
			    enum k_dtype dtype, const struct k_kv_layer *kv,
			    const struct k_attn_rows *rows, const struct k_mla_dims *d,
			    float scale);

/* ---- mixture of experts ------------------------------------------------ */

enum k_moe_scoring {
	K_MOE_SOFTMAX = 0,	/* Qwen3-MoE, DeepSeek-V2 */
	K_MOE_SIGMOID,		/* DeepSeek-V3, Kimi-K2 */
};

enum k_moe_select {
	K_MOE_GREEDY = 0,	/* plain top-k over scores */
	K_MOE_GROUP_MAX,	/* DeepSeek-V2 group_limited_greedy: group score = max */
	K_MOE_GROUP_TOP2,	/* DeepSeek-V3 noaux_tc: group score = sum of top-2 biased scores */
};

struct k_moe_route_params {
	int n_experts;
	int top_k;
	enum k_moe_scoring scoring;
	enum k_moe_select select;
	int n_group;		/* groups for the group-limited methods (divides n_experts) */
	int topk_group;		/* groups kept */
	int norm_topk_prob;	/* renormalise the chosen weights to sum 1 */
	float routed_scaling;	/* multiplies the final weights */
	const float *bias;	/* (n_experts) e_score_correction_bias, or NULL; choice only */
};

/* Router logits (M, n_experts) -> ids (M, top_k) and weights (M, top_k).
 * Scores: softmax or sigmoid in fp32. Choice uses score + bias; weights use the
 * unbiased score. Ties go to the lower expert id. */
void k_cpu_moe_route(const struct k_moe_route_params *p, const float *logits, int M,
		     int32_t *ids, float *weights);

/* One expert's weights as stored: gate, up (inter, hidden); down (hidden, inter). */
struct k_expert {
	const void *gate;
	const void *up;
	const void *down;
};

/* out[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), out (M, hidden) overwritten.
 * Reads only the experts that some row chose; rows that chose the same expert are
 * computed together; an id outside [0, n_experts) contributes nothing. Returns 0 or
 * -ENOMEM. */
int k_cpu_moe_experts(struct k_pool *pool, float *out, const float *x, int M,
		      const int32_t *ids, const float *weights, int top_k,
		      const struct k_expert *experts, int n_experts, enum k_dtype dtype,
		      int hidden, int inter);

#endif
