/* config.json -> struct model_config, following what Hugging Face transformers reads.
 * Every value is type- and range-checked; every error is one line naming the key. */
#include "daemon/model/model_config.h"
#include "daemon/model/model_config_internal.h"
#include "format/file_read.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#define CFG_MAX_BYTES (4u << 20)	/* config.json larger than this is not a config */
#define CFG_MAX_HIDDEN (1 << 17)
#define CFG_MAX_VOCAB (1 << 23)
#define CFG_MAX_HEADS 1024
#define CFG_MAX_HEAD_DIM 1024
#define CFG_MAX_WIDTH (1 << 20)		/* intermediate sizes */
#define CFG_MAX_EXPERTS (1 << 14)
#define CFG_MAX_TOKEN_ID (1 << 30)

static const struct {
	const char *name;
	enum model_arch arch;
	int max_pos;		/* transformers' default max_position_embeddings */
} cfg_archs[] = {
	{ "llama", ARCH_LLAMA, 2048 },
	{ "qwen3", ARCH_QWEN3, 32768 },
	{ "qwen3_moe", ARCH_QWEN3_MOE, 32768 },
	{ "deepseek_v2", ARCH_DEEPSEEK_V2, 2048 },
	{ "deepseek_v3", ARCH_DEEPSEEK_V3, 4096 },
	{ "kimi_k2", ARCH_KIMI_K2, 4096 },
};

#define N_ARCHS (sizeof(cfg_archs) / sizeof(cfg_archs[0]))

const char *model_arch_name(enum model_arch arch)
{
	for (size_t i = 0; i < N_ARCHS; i++)
		if (cfg_archs[i].arch == arch)
			return cfg_archs[i].name;
	return "?";
}

static int parse_arch(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	const char *t;
	int rc;

	rc = cfg_str(p, root, "model_type", NULL, &t);
	if (rc)
		return rc;
	if (!t)
		return cfg_fail(p, -EINVAL, "model_type: required but missing");
	for (size_t i = 0; i < N_ARCHS; i++) {
		if (!strcmp(t, cfg_archs[i].name)) {
			cfg->arch = cfg_archs[i].arch;
			snprintf(cfg->model_type, sizeof(cfg->model_type), "%s", t);
			cfg->max_position_embeddings = cfg_archs[i].max_pos;
			return 0;
		}
	}
	return cfg_fail(p, -ENOTSUP, "model_type '%.40s' is not supported (supported: "
			"llama, qwen3, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2)", t);
}

static int parse_dtype(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	const char *t;
	int rc;

	rc = cfg_str(p, root, "dtype", "torch_dtype", &t);
	if (rc)
		return rc;
	if (!t || !strcmp(t, "bfloat16"))
		cfg->dtype = K_BF16;
	else if (!strcmp(t, "float16"))
		cfg->dtype = K_F16;
	else if (!strcmp(t, "float32"))
		cfg->dtype = K_F32;
	else
		return cfg_fail(p, -ENOTSUP, "dtype: '%.40s' is not supported "
				"(bfloat16, float16, float32)", t);
	return 0;
}

/* eos_token_id: one id, a list of ids, or null. */
static int parse_eos(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	json_t *v = cfg_obj_get(root, "eos_token_id");
	json_t *box, *e;
	size_t i;
	int rc;

	cfg->n_eos = 0;
	if (!v)
		return 0;
	if (!json_is_array(v)) {
		rc = cfg_int(p, root, "eos_token_id", NULL, 0, CFG_MAX_TOKEN_ID,
			     &cfg->eos_token_ids[0]);
		if (rc == 0)
			cfg->n_eos = 1;
		return rc;
	}
	if (json_array_size(v) > MODEL_MAX_EOS)
		return cfg_fail(p, -EINVAL, "eos_token_id: %zu ids, at most %d supported",
				json_array_size(v), MODEL_MAX_EOS);
	/* Reuse cfg_int's checks by wrapping each element in an object. */
	box = json_object();
	if (!box)
		return -ENOMEM;
	rc = 0;
	json_array_foreach(v, i, e) {
		if (json_object_set(box, "eos_token_id", e)) {
			rc = -ENOMEM;
			break;
		}
		rc = cfg_int(p, box, "eos_token_id", NULL, 0, CFG_MAX_TOKEN_ID,
			     &cfg->eos_token_ids[cfg->n_eos]);
		if (rc == 1)
			rc = cfg_fail(p, -EINVAL, "eos_token_id: element %zu is null", i);
		if (rc)
			break;
		cfg->n_eos++;
	}
	json_decref(box);
	return rc;
}

/* Features these model classes allow but kdec does not compute. */
static int parse_unsupported(struct cfg_parse *p, const json_t *root)
{
	const char *act;
	int bias = 0, mlp_bias = 0;
	int rc;

	rc = cfg_bool(p, root, "attention_bias", &bias);
	if (!rc && bias)
		return cfg_fail(p, -ENOTSUP, "attention_bias: true is not supported");
	if (!rc)
		rc = cfg_bool(p, root, "mlp_bias", &mlp_bias);
	if (!rc && mlp_bias)
		return cfg_fail(p, -ENOTSUP, "mlp_bias: true is not supported");
	if (!rc)
		rc = cfg_str(p, root, "hidden_act", NULL, &act);
	if (!rc && act && strcmp(act, "silu"))
		return cfg_fail(p, -ENOTSUP, "hidden_act: '%.40s' is not supported (silu only)",
				act);
	return rc;
}

static int parse_common(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	double eps;
	int rc;

	rc = cfg_req_int(p, root, "vocab_size", NULL, 1, CFG_MAX_VOCAB, &cfg->vocab_size, NULL);
	if (!rc)
		rc = cfg_req_int(p, root, "hidden_size", NULL, 1, CFG_MAX_HIDDEN,
				 &cfg->hidden_size, NULL);
	if (!rc)
		rc = cfg_req_int(p, root, "num_hidden_layers", NULL, 1, MODEL_MAX_LAYERS,
				 &cfg->n_layers, NULL);
	if (!rc)
		rc = cfg_req_int(p, root, "num_attention_heads", NULL, 1, CFG_MAX_HEADS,
				 &cfg->n_heads, NULL);
	if (!rc)
		rc = cfg_req_num(p, root, "rms_norm_eps", 1e-30, 0.5, &eps, NULL);
	if (rc)
		return rc;
	cfg->rms_norm_eps = (float)eps;
	rc = cfg_int(p, root, "intermediate_size", NULL, 1, CFG_MAX_WIDTH,
		     &cfg->intermediate_size);
	if (rc == 1)
		rc = 0;
	if (!rc)
		rc = cfg_int(p, root, "max_position_embeddings", NULL, 1, CFG_MAX_POS,
			     &cfg->max_position_embeddings);
	if (rc < 0)
		return rc;
	rc = parse_dtype(p, root, cfg);
	if (!rc)
		rc = cfg_bool(p, root, "tie_word_embeddings", &cfg->tie_word_embeddings);
	if (!rc)
		rc = parse_unsupported(p, root);
	if (rc)
		return rc;
	cfg->bos_token_id = -1;
	rc = cfg_int(p, root, "bos_token_id", NULL, 0, CFG_MAX_TOKEN_ID, &cfg->bos_token_id);
	if (rc < 0)
		return rc;
	return parse_eos(p, root, cfg);
}

/* Grouped-query attention: llama, qwen3, qwen3_moe. */
static int parse_gqa(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	int rc;

	cfg->n_kv_heads = cfg->n_heads;
	rc = cfg_int(p, root, "num_key_value_heads", NULL, 1, CFG_MAX_HEADS, &cfg->n_kv_heads);
	if (rc < 0)
		return rc;
	if (cfg->n_heads % cfg->n_kv_heads)
		return cfg_fail(p, -EINVAL, "num_key_value_heads: %d does not divide "
				"num_attention_heads %d", cfg->n_kv_heads, cfg->n_heads);
	rc = cfg_int(p, root, "head_dim", NULL, 1, CFG_MAX_HEAD_DIM, &cfg->head_dim);
	if (rc < 0)
		return rc;
	if (rc == 1) {
		if (cfg->hidden_size % cfg->n_heads)
			return cfg_fail(p, -EINVAL, "num_attention_heads: %d does not divide "
					"hidden_size %d (and head_dim is not given)",
					cfg->n_heads, cfg->hidden_size);
		cfg->head_dim = cfg->hidden_size / cfg->n_heads;
	}
	cfg->qk_norm = cfg->arch == ARCH_QWEN3 || cfg->arch == ARCH_QWEN3_MOE;
	cfg->rope.dim = cfg->head_dim;
	return 0;
}

/* Multi-head latent attention: deepseek_v2, deepseek_v3, kimi_k2. */
static int parse_mla(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	const char *why = "for MLA";
	int rc;

	cfg->mla = 1;
	rc = cfg_req_int(p, root, "kv_lora_rank", NULL, 1, 1 << 14, &cfg->kv_lora_rank, why);
	if (!rc)
		rc = cfg_req_int(p, root, "qk_nope_head_dim", NULL, 1, CFG_MAX_HEAD_DIM,
				 &cfg->qk_nope_head_dim, why);
	if (!rc)
		rc = cfg_req_int(p, root, "qk_rope_head_dim", NULL, 1, CFG_MAX_HEAD_DIM,
				 &cfg->qk_rope_head_dim, why);
	if (!rc)
		rc = cfg_req_int(p, root, "v_head_dim", NULL, 1, CFG_MAX_HEAD_DIM,
				 &cfg->v_head_dim, why);
	if (rc)
		return rc;
	cfg->q_lora_rank = 0;
	rc = cfg_int(p, root, "q_lora_rank", NULL, 1, 1 << 16, &cfg->q_lora_rank);
	if (rc < 0)
		return rc;
	cfg->n_kv_heads = cfg->n_heads;
	cfg->head_dim = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
	cfg->rope.dim = cfg->qk_rope_head_dim;
	cfg->rope.interleaved = 1;
	if (cfg->arch != ARCH_DEEPSEEK_V2)
		return cfg_bool(p, root, "rope_interleave", &cfg->rope.interleaved);
	return 0;
}

void model_config_route_defaults(struct model_config *cfg)
{
	cfg->route.n_experts = cfg->n_experts;
	cfg->route.top_k = cfg->top_k;
	cfg->route.n_group = 1;
	cfg->route.topk_group = 1;
	cfg->route.routed_scaling = 1.0f;
	cfg->route.scoring = K_MOE_SOFTMAX;
	cfg->route.select = K_MOE_GREEDY;
	cfg->route.bias = NULL;
}

/* Expert count, top-k and expert width: every MoE arch has them. */
static int parse_experts(struct cfg_parse *p, const json_t *root, struct model_config *cfg,
			 const char *key, const char *alias)
{
	const char *why = "for a mixture-of-experts model";
	int rc;

	rc = cfg_req_int(p, root, key, alias, 1, CFG_MAX_EXPERTS, &cfg->n_experts, NULL);
	if (!rc)
		rc = cfg_req_int(p, root, "num_experts_per_tok", NULL, 1, cfg->n_experts,
				 &cfg->top_k, why);
	if (!rc)
		rc = cfg_req_int(p, root, "moe_intermediate_size", NULL, 1, CFG_MAX_WIDTH,
				 &cfg->moe_intermediate_size, why);
	if (rc)
		return rc;
	model_config_route_defaults(cfg);
	return 0;
}

static int parse_moe_qwen3(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	json_t *list = cfg_obj_get(root, "mlp_only_layers");
	json_t *e;
	size_t i;
	int rc;

	rc = parse_experts(p, root, cfg, "num_experts", "num_local_experts");
	if (rc)
		return rc;
	cfg->route.scoring = K_MOE_SOFTMAX;
	cfg->route.select = K_MOE_GREEDY;
	cfg->decoder_sparse_step = 1;
	rc = cfg_int(p, root, "decoder_sparse_step", NULL, 1, MODEL_MAX_LAYERS,
		     &cfg->decoder_sparse_step);
	if (!rc || rc == 1)
		rc = cfg_bool(p, root, "norm_topk_prob", &cfg->route.norm_topk_prob);
	if (rc)
		return rc;
	if (list && !json_is_array(list))
		return cfg_fail(p, -EINVAL, "mlp_only_layers: expected a list of layer indices");
	json_array_foreach(list, i, e) {
		long long l;

		if (!json_is_integer(e))
			return cfg_fail(p, -EINVAL, "mlp_only_layers: element %zu is not an integer",
					i);
		l = json_integer_value(e);
		if (l < 0 || l >= cfg->n_layers)
			return cfg_fail(p, -EINVAL, "mlp_only_layers: layer %lld is out of range "
					"[0, %d)", l, cfg->n_layers);
		cfg->mlp_only[l / 8] |= (uint8_t)(1u << (l % 8));
	}
	return 0;
}

/* Group-limited selection: groups divide the experts and can supply top_k of them. */
static int check_groups(struct cfg_parse *p, const json_t *root, struct model_config *cfg,
			int required)
{
	struct k_moe_route_params *r = &cfg->route;
	int rc;

	rc = required ? cfg_req_int(p, root, "n_group", NULL, 1, r->n_experts, &r->n_group,
				    "for group-limited routing")
		      : cfg_int(p, root, "n_group", NULL, 1, r->n_experts, &r->n_group);
	if (rc < 0)
		return rc;
	rc = required ? cfg_req_int(p, root, "topk_group", NULL, 1, r->n_group,
				    &r->topk_group, "for group-limited routing")
		      : cfg_int(p, root, "topk_group", NULL, 1, r->n_group, &r->topk_group);
	if (rc < 0)
		return rc;
	if (r->n_experts % r->n_group)
		return cfg_fail(p, -EINVAL, "n_group: %d does not divide the %d experts",
				r->n_group, r->n_experts);
	if (r->topk_group > r->n_group)
		return cfg_fail(p, -EINVAL, "topk_group: %d is more than n_group %d",
				r->topk_group, r->n_group);
	if (r->select == K_MOE_GROUP_TOP2 && r->n_experts / r->n_group < 2)
		return cfg_fail(p, -EINVAL, "n_group: %d groups of %d experts; noaux_tc needs "
				"at least 2 per group", r->n_group, r->n_experts / r->n_group);
	if ((long long)r->top_k > (long long)r->topk_group * (r->n_experts / r->n_group))
		return cfg_fail(p, -EINVAL, "num_experts_per_tok: %d is more than the %d experts "
				"in topk_group %d groups", r->top_k,
				r->topk_group * (r->n_experts / r->n_group), r->topk_group);
	return 0;
}

/* What deepseek_v2 and deepseek_v3 share: layer placement and scaling. */
static int parse_moe_deepseek_common(struct cfg_parse *p, const json_t *root,
				     struct model_config *cfg)
{
	double scale = 1.0;
	int rc;

	cfg->moe_layer_freq = 1;
	rc = cfg_int(p, root, "first_k_dense_replace", NULL, 0, cfg->n_layers,
		     &cfg->first_k_dense);
	if (rc >= 0)
		rc = cfg_int(p, root, "moe_layer_freq", NULL, 1, MODEL_MAX_LAYERS,
			     &cfg->moe_layer_freq);
	if (rc >= 0)
		rc = cfg_num(p, root, "routed_scaling_factor", NULL, 1e-6, 1e6, &scale);
	if (rc >= 0)
		rc = cfg_bool(p, root, "norm_topk_prob", &cfg->route.norm_topk_prob);
	if (rc < 0)
		return rc;
	cfg->route.routed_scaling = (float)scale;
	return 0;
}

static int parse_moe_deepseek_v2(struct cfg_parse *p, const json_t *root,
				 struct model_config *cfg)
{
	const char *s;
	int rc;

	/* No routed experts: a dense DeepSeek-V2. */
	if (!cfg_obj_get(root, "n_routed_experts") && !cfg_obj_get(root, "num_local_experts"))
		return 0;
	rc = parse_experts(p, root, cfg, "n_routed_experts", "num_local_experts");
	if (!rc)
		rc = cfg_req_int(p, root, "n_shared_experts", NULL, 0, 64,
				 &cfg->n_shared_experts, "with n_routed_experts");
	if (!rc)
		rc = parse_moe_deepseek_common(p, root, cfg);
	if (!rc)
		rc = cfg_str(p, root, "scoring_func", NULL, &s);
	if (rc)
		return rc;
	/* HF's port (DeepseekV2TopkRouter) never renormalises and always applies
	 * routed_scaling_factor; the original remote code renormalised when the flag was
	 * set. Every published V2 config has it false, so follow HF, as the references do. */
	cfg->route.norm_topk_prob = 0;
	if (s && strcmp(s, "softmax"))
		return cfg_fail(p, -ENOTSUP, "scoring_func: '%.40s' is not supported for "
				"deepseek_v2 (softmax)", s);
	cfg->route.scoring = K_MOE_SOFTMAX;
	rc = cfg_str(p, root, "topk_method", NULL, &s);
	if (rc)
		return rc;
	if (!s || !strcmp(s, "greedy")) {
		cfg->route.select = K_MOE_GREEDY;
		return 0;
	}
	if (strcmp(s, "group_limited_greedy"))
		return cfg_fail(p, -ENOTSUP, "topk_method: '%.40s' is not supported for "
				"deepseek_v2 (greedy, group_limited_greedy)", s);
	cfg->route.select = K_MOE_GROUP_MAX;
	return check_groups(p, root, cfg, 1);
}

static int parse_moe_deepseek_v3(struct cfg_parse *p, const json_t *root,
				 struct model_config *cfg)
{
	const char *s;
	int rc;

	rc = parse_experts(p, root, cfg, "n_routed_experts", "num_local_experts");
	if (rc)
		return rc;
	cfg->n_shared_experts = 1;
	cfg->route.norm_topk_prob = 1;
	cfg->route.scoring = K_MOE_SIGMOID;
	cfg->route.select = K_MOE_GROUP_TOP2;
	rc = cfg_int(p, root, "n_shared_experts", NULL, 0, 64, &cfg->n_shared_experts);
	if (rc >= 0)
		rc = parse_moe_deepseek_common(p, root, cfg);
	if (!rc)
		rc = cfg_str(p, root, "scoring_func", NULL, &s);
	if (rc)
		return rc;
	if (s && strcmp(s, "sigmoid"))
		return cfg_fail(p, -ENOTSUP, "scoring_func: '%.40s' is not supported for %s "
				"(sigmoid)", s, cfg->model_type);
	rc = cfg_str(p, root, "topk_method", NULL, &s);
	if (rc)
		return rc;
	if (s && strcmp(s, "noaux_tc"))
		return cfg_fail(p, -ENOTSUP, "topk_method: '%.40s' is not supported for %s "
				"(noaux_tc)", s, cfg->model_type);
	return check_groups(p, root, cfg, 0);
}

static int parse_moe(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	int rc = 0;

	switch (cfg->arch) {
	case ARCH_QWEN3_MOE:
		rc = parse_moe_qwen3(p, root, cfg);
		break;
	case ARCH_DEEPSEEK_V2:
		rc = parse_moe_deepseek_v2(p, root, cfg);
		break;
	case ARCH_DEEPSEEK_V3:
	case ARCH_KIMI_K2:
		rc = parse_moe_deepseek_v3(p, root, cfg);
		break;
	default:
		break;
	}
	if (rc)
		return rc;
	if (model_config_has_dense_layer(cfg) && !cfg->intermediate_size)
		return cfg_fail(p, -EINVAL, "intermediate_size: required (the model has dense "
				"MLP layers) but missing");
	return 0;
}

/* Quantization is checked last: on its -ENOTSUP (a quant_method other than fp8) the
 * rest of cfg is complete, so a caller that only wants the shapes may still use it. */
static int parse_root(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	int rc;

	rc = parse_arch(p, root, cfg);
	if (!rc)
		rc = parse_common(p, root, cfg);
	if (rc)
		return rc;
	if (cfg->arch == ARCH_DEEPSEEK_V2 || cfg->arch == ARCH_DEEPSEEK_V3 ||
	    cfg->arch == ARCH_KIMI_K2)
		rc = parse_mla(p, root, cfg);
	else
		rc = parse_gqa(p, root, cfg);
	if (!rc)
		rc = parse_moe(p, root, cfg);
	if (!rc)
		rc = cfg_parse_rope(p, root, cfg);
	if (rc)
		return rc;
	return cfg_parse_quant(p, root, cfg);
}

int model_config_parse(struct model_config *cfg, const char *json, size_t len,
		       char *err, size_t err_len)
{
	struct cfg_parse p = { .err = err, .err_len = err_len, .source = "config.json",
				.prefix = "" };
	json_error_t jerr;
	json_t *root;
	int rc;

	memset(cfg, 0, sizeof(*cfg));
	if (err && err_len)
		err[0] = '\0';
	root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return cfg_fail(&p, -EINVAL, "not valid JSON: %s (line %d, column %d)",
				jerr.text, jerr.line, jerr.column);
	if (!json_is_object(root))
		rc = cfg_fail(&p, -EINVAL, "the top level is not a JSON object");
	else
		rc = parse_root(&p, root, cfg);
	json_decref(root);
	return rc;
}

int model_config_load(struct model_config *cfg, const char *dir, char *err, size_t err_len)
{
	char path[4096];

	snprintf(path, sizeof(path), "%s/config.json", dir);
	return model_config_load_file(cfg, path, err, err_len);
}

int model_config_load_file(struct model_config *cfg, const char *path, char *err, size_t err_len)
{
	char none[1], *text;
	size_t len;
	int rc;

	memset(cfg, 0, sizeof(*cfg));
	if (!err || !err_len) {
		err = none;
		err_len = sizeof(none);
	}
	rc = file_read_all(path, CFG_MAX_BYTES, &text, &len, err, err_len);
	if (rc)
		return rc;
	rc = model_config_parse(cfg, text, len, err, err_len);
	free(text);
	return rc;
}

int model_config_layer_is_moe(const struct model_config *cfg, int l)
{
	if (cfg->n_experts == 0 || l < 0 || l >= cfg->n_layers || l >= MODEL_MAX_LAYERS)
		return 0;
	if (cfg->arch == ARCH_QWEN3_MOE) {
		if (cfg->mlp_only[l / 8] & (1u << (l % 8)))
			return 0;
		return cfg->decoder_sparse_step > 0 && (l + 1) % cfg->decoder_sparse_step == 0;
	}
	return l >= cfg->first_k_dense && cfg->moe_layer_freq > 0 &&
	       l % cfg->moe_layer_freq == 0;
}

int model_config_has_dense_layer(const struct model_config *cfg)
{
	for (int l = 0; l < cfg->n_layers; l++)
		if (!model_config_layer_is_moe(cfg, l))
			return 1;
	return 0;
}
