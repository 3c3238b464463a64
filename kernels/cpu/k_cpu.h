/* The CPU reference ops: fp32 activations, weights read as stored (bf16, fp16, fp32),
 * fp32 arithmetic. Every faster path in kdec is checked against these. */
#ifndef KD_KERNELS_CPU_K_CPU_H
#define KD_KERNELS_CPU_K_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"

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
/* The same with w quantized as q says (q NULL or K_Q_NONE: k_cpu_linear): each
 * weight block is dequantized exactly (kernels/quant.h) into fp32 as it is used, so
 * the quantized bytes are all that stay in memory; same order of sums. */
void k_cpu_linear_q(struct k_pool *pool, float *y, const float *x, const void *w,
		    enum k_dtype dtype, const struct k_quant *q, int M, int N, int K);

/* ---- rotary position embedding ----------------------------------------- */

/* Rotates x in place. Head h of row r starts at x + r*row_stride + h*head_stride and
 * its first rope->dim values are rotated by angle pos[r] * inv_freq[i]. */
void k_cpu_rope(const struct k_rope *rope, float *x, int n_rows, int n_heads,
		int row_stride, int head_stride, const int32_t *pos /* (n_rows) */);

/* ---- paged KV cache and attention -------------------------------------- */

/* Copies row r of src (n_rows, width) into slot slots[r]. Slots must be in range. */
void k_cpu_kv_write(float *cache, int width, const float *src, int n_rows,
		    const int32_t *slots /* (n_rows) */);

/* Causal GQA attention over the paged cache.
 * q, out: (n_rows, n_heads, head_dim); head h reads kv head h / (n_heads / kv_heads).
 * Softmax in fp32 with max subtraction. Parallel over (row, head). */
void k_cpu_attn_gqa(struct k_pool *pool, float *out, const float *q,
		    const struct k_kv_layer *kv, const struct k_attn_rows *rows,
		    int n_heads, int kv_heads, int head_dim, float scale);

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

/* MLA decode context parallel (docs/PARALLEL.md): the latent cache split by tokens
 * over n_parts ranks, cache slot s held by part s % n_parts at its row s / n_parts.
 * Each rank absorbs its own heads' q (k_cpu_mla_absorb), the rows of every head are
 * gathered, each rank attends every head over its tokens (k_cpu_attn_mla_part), and
 * each rank merges its heads' partials by log-sum-exp and expands them
 * (k_cpu_mla_merge_expand): k_cpu_attn_mla's result up to the order of the softmax's
 * sums. */

/* qa row r, head h (at qa + r * qa_row_stride + h * (kv_lora + rope_dim)) =
 * [W_UK_h^T q_nope ; q_pe] for the d->n_heads heads of w_kv_b (as k_cpu_attn_mla
 * absorbs them, the same rounding); q (n_rows, n_heads, nope_dim + rope_dim).
 * 0 or -ENOMEM. */
int k_cpu_mla_absorb(float *qa, size_t qa_row_stride, const float *q, const void *w_kv_b,
		     enum k_dtype dtype, int n_rows, const struct k_mla_dims *d);

/* Part `part` of n_parts: for every row and each of n_heads heads of qa (n_rows,
 * n_heads, kv_lora + rope_dim), the online softmax over the row's ctx tokens whose slot
 * this part holds, read at local row slot / n_parts of kv->k (kv's block_tokens is
 * the block tables'): o (n_rows, n_heads, kv_lora) = sum_t exp(s_t - max) c_t, not
 * normalised, ml (n_rows, n_heads, 2) = (max, sum); a row with none of its tokens
 * here gets (-inf, 0) and o = 0. 0, -EINVAL or -ENOMEM. */
int k_cpu_attn_mla_part(struct k_pool *pool, float *o, float *ml, const float *qa,
			const struct k_kv_layer *kv, const struct k_attn_rows *rows, int n_heads,
			int kv_lora, int rope_dim, float scale, int part, int n_parts);

/* The exact log-sum-exp combine of the n_parts partials (o[p], ml[p] as
 * k_cpu_attn_mla_part wrote them over n_heads_all heads) for heads [h0, h0 + d->n_heads),
 * each expanded by its W_UV rows of w_kv_b (d->n_heads heads' rows, as stored) into
 * out (n_rows, d->n_heads, v_dim). 0 or -ENOMEM. */
int k_cpu_mla_merge_expand(float *out, const float *const *o, const float *const *ml, int n_parts,
			   int n_rows, int n_heads_all, int h0, const void *w_kv_b, enum k_dtype dtype,
			   const struct k_mla_dims *d);

/* ---- mixture of experts ------------------------------------------------ */

/* Router logits (M, n_experts) -> ids (M, top_k) and weights (M, top_k).
 * Scores: softmax or sigmoid in fp32. Choice uses score + bias; weights use the
 * unbiased score. Ties go to the lower expert id. */
void k_cpu_moe_route(const struct k_moe_route_params *p, const float *logits, int M,
		     int32_t *ids, float *weights);

/* One row's weights w (top_k) for experts ids (top_k) chosen elsewhere (forced
 * routing: the reference run on another engine's choices), by k_cpu_moe_route's
 * arithmetic: each id's unbiased score, renormalised and scaled in slot order.
 * 0, or -EINVAL for an id outside [0, n_experts). */
int k_cpu_moe_route_forced(const struct k_moe_route_params *p, const float *logits /* (E) */,
			   const int32_t *ids, float *w);

/* How far one row's routing is from a tie: the k-th chosen expert's choice value
 * (score + bias, dropped groups masked) minus the best expert left out, and for the
 * group-limited methods the smaller of that and the last kept group's score minus the
 * best dropped one's. 0 is a tie; +inf where top_k covers every expert. choice (E) or
 * NULL receives the choice values. */
float k_cpu_moe_route_margin(const struct k_moe_route_params *p, const float *logits /* (E) */,
			     float *choice);

/* out[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), out (M, hidden) overwritten.
 * Reads only the experts that some row chose; rows that chose the same expert are
 * computed together; an id outside [0, n_experts) contributes nothing. Returns 0 or
 * -ENOMEM. */
int k_cpu_moe_experts(struct k_pool *pool, float *out, const float *x, int M,
		      const int32_t *ids, const float *weights, int top_k,
		      const struct k_expert *experts, int n_experts, enum k_dtype dtype,
		      int hidden, int inter);

#endif
