/* The op contract every backend shares: the parameter and layout types that the model,
 * the forward pass and each backend's ops (kernels/cpu, kernels/cuda) pass between them,
 * and the RoPE frequency table all of them rotate by. Types only, plus the table's setup. */
#ifndef KD_KERNELS_OPS_H
#define KD_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/dtype.h"
#include "kernels/quant.h"

/* ---- rotary position embedding ----------------------------------------- */

/* Rotary pairs per head that a rotation's stack buffers hold; k_rope_init refuses more. */
#define K_ROPE_MAX_HALF 1024

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

/* MLA dimensions (DeepSeek-V2/V3). */
struct k_mla_dims {
	int n_heads;
	int nope_dim;	/* qk_nope_head_dim */
	int rope_dim;	/* qk_rope_head_dim */
	int v_dim;	/* v_head_dim */
	int kv_lora;	/* kv_lora_rank */
};

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

/* One expert's weights as stored: gate, up (inter, hidden); down (hidden, inter);
 * each quantized as its *_q says (fmt K_Q_NONE: in the layer's expert dtype). */
struct k_expert {
	const void *gate;
	const void *up;
	const void *down;
	struct k_quant gate_q, up_q, down_q;
};

#endif
