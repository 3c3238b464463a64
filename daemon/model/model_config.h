/* A model's config.json, parsed and checked: the numbers every other part of kdec
 * reads about the architecture. Both rope spellings are accepted. */
#ifndef KD_DAEMON_MODEL_CONFIG_H
#define KD_DAEMON_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"

#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_EOS 8

enum model_arch {
	ARCH_LLAMA = 0,		/* llama: Llama 3.x */
	ARCH_QWEN3,		/* qwen3: per-head q/k RMSNorm */
	ARCH_QWEN3_MOE,		/* qwen3_moe: + softmax top-k experts */
	ARCH_DEEPSEEK_V2,	/* deepseek_v2: MLA (maybe no q-LoRA), softmax routing */
	ARCH_DEEPSEEK_V3,	/* deepseek_v3: MLA + q-LoRA, sigmoid group-limited routing */
	ARCH_KIMI_K2,		/* kimi_k2: the DeepSeek-V3 architecture */
};

enum model_qformat {
	MODEL_Q_NONE = 0,
	MODEL_Q_FP8_BLOCK,	/* quant_method fp8: e4m3 + weight_scale_inv per block */
	MODEL_Q_FP8_CHANNEL,	/* compressed-tensors float-quantized, strategy channel */
	MODEL_Q_FP8_TENSOR,	/* compressed-tensors float-quantized, strategy tensor */
	MODEL_Q_INT4_GROUP,	/* compressed-tensors pack-quantized int4 symmetric, group */
};

struct model_quant {
	enum model_qformat format;
	int block_rows, block_cols;	/* fp8 block: weight_block_size */
	int group_size;			/* int4: weights per scale along a row */
	int input_scales;		/* fp8: static per-tensor `input_scale` beside each
					 * quantized weight (checked at load, not applied) */
};

struct model_config {
	char model_type[32];
	enum model_arch arch;
	enum k_dtype dtype;		/* torch_dtype / dtype; K_BF16 if absent */

	int vocab_size;
	int hidden_size;
	int n_layers;			/* num_hidden_layers */
	int n_heads;			/* num_attention_heads */
	int n_kv_heads;			/* num_key_value_heads (GQA); = n_heads if absent */
	int head_dim;			/* GQA head dim: head_dim, else hidden_size / n_heads */
	int intermediate_size;		/* dense MLP width */
	float rms_norm_eps;
	int max_position_embeddings;
	int tie_word_embeddings;	/* lm_head shares embed_tokens */
	int qk_norm;			/* qwen3: RMSNorm of each q and k head before rope */

	struct k_rope_params rope;	/* dim = head_dim (GQA) or qk_rope_head_dim (MLA) */
	float attn_scale;		/* softmax scale, YaRN mscale^2 folded in for MLA */

	int bos_token_id;		/* -1 if absent */
	int n_eos;
	int eos_token_ids[MODEL_MAX_EOS];

	/* MLA (deepseek_v2 / deepseek_v3 / kimi_k2) */
	int mla;
	int q_lora_rank;		/* 0: no q-LoRA (plain q_proj) */
	int kv_lora_rank;
	int qk_nope_head_dim;
	int qk_rope_head_dim;
	int v_head_dim;

	/* MoE; n_experts == 0 means every layer is dense */
	int n_experts;			/* num_experts / num_local_experts / n_routed_experts */
	int top_k;			/* num_experts_per_tok */
	int moe_intermediate_size;
	int n_shared_experts;		/* deepseek: shared MLP of n * moe_intermediate_size */
	int first_k_dense;		/* deepseek first_k_dense_replace */
	int moe_layer_freq;		/* deepseek: MoE where (l % freq) == 0 past first_k_dense */
	int decoder_sparse_step;	/* qwen3_moe: MoE where (l + 1) % step == 0 */
	uint8_t mlp_only[MODEL_MAX_LAYERS / 8];	/* qwen3_moe mlp_only_layers bitmap */
	struct k_moe_route_params route;	/* bias pointer left NULL here */

	/* quantization_config: how the quantized weights are stored (docs/MODELS.md);
	 * which tensors are quantized is what the files hold (ignored modules are simply
	 * stored in their dtype). */
	struct model_quant quant;
};

/* Parses config.json text (len bytes, need not be NUL-terminated).
 * Returns 0, or -EINVAL / -ENOTSUP / -ENOMEM with one line in err naming the key. */
int model_config_parse(struct model_config *cfg, const char *json, size_t len,
		       char *err, size_t err_len);

/* Reads and parses DIR/config.json (capped at 4 MiB). */
int model_config_load(struct model_config *cfg, const char *dir, char *err, size_t err_len);

/* The same for a config file given by its path. */
int model_config_load_file(struct model_config *cfg, const char *path, char *err, size_t err_len);

/* Whether layer l has a mixture-of-experts MLP (else a dense one). */
int model_config_layer_is_moe(const struct model_config *cfg, int l);

/* Whether some layer has a dense MLP: then intermediate_size is required. Checked by
 * both config readers. */
int model_config_has_dense_layer(const struct model_config *cfg);

/* cfg->attn_scale from head_dim and the rope: 1 / sqrt(head_dim), with YaRN's
 * mscale(factor, mscale_all_dim)^2 folded in for MLA. Set by both config readers. */
void model_config_set_attn_scale(struct model_config *cfg);

/* cfg->route as every MoE family starts it, once n_experts and top_k are read: all
 * experts, one group, scale 1, softmax scores, greedy top-k, no bias; the family's
 * reader changes what differs. Set by both config readers. */
void model_config_route_defaults(struct model_config *cfg);

const char *model_arch_name(enum model_arch arch);

/* "fp8-block", "fp8-channel", "fp8-tensor", "int4-g32" style names (the group size
 * of q is used for int4); "none". Written into buf (n bytes); returns buf. */
const char *model_quant_name(const struct model_quant *q, char *buf, size_t n);

/* quantization_config of root into cfg->quant (model_config_quant.c); 0, or -EINVAL
 * / -ENOTSUP with one line naming the key and the format. */
struct cfg_parse;
int cfg_parse_quant(struct cfg_parse *p, const void *root, struct model_config *cfg);

#endif
