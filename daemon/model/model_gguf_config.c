/* GGUF metadata -> struct model_config: the {arch}.* keys llama.cpp's converter writes,
 * mapped onto the numbers config.json would have given. Every value is type- and
 * range-checked; every error is one line naming the file and the key. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/model/model_gguf.h"
#include "format/file_read.h"

#define META_MAX_HIDDEN (1 << 17)
#define META_MAX_VOCAB (1 << 23)
#define META_MAX_HEADS 1024
#define META_MAX_HEAD_DIM 1024
#define META_MAX_WIDTH (1 << 20)
#define META_MAX_EXPERTS (1 << 14)
#define META_MAX_POS (1 << 30)
#define META_MAX_TOKEN_ID (1 << 30)

/* ggml's general.file_type values that say the weights' float type. */
#define FTYPE_ALL_F32 0
#define FTYPE_MOSTLY_F16 1
#define FTYPE_MOSTLY_BF16 32

/* llama.cpp's {arch}.expert_gating_func */
#define GATING_SOFTMAX 1
#define GATING_SIGMOID 2

#define ROPE_2PI 6.28318530717958647692

static const struct {
	const char *gguf;	/* general.architecture */
	enum model_arch arch;
	const char *model_type;	/* the Hugging Face name kdec reports */
} meta_archs[] = {
	{ "llama", ARCH_LLAMA, "llama" },
	{ "qwen3", ARCH_QWEN3, "qwen3" },
	{ "qwen3moe", ARCH_QWEN3_MOE, "qwen3_moe" },
	{ "deepseek2", ARCH_DEEPSEEK_V2, "deepseek_v2" },
};

struct meta {
	const struct gguf_file *f;
	const char *name;	/* the file, for messages */
	char arch[32];		/* general.architecture */
	char *err;
	size_t err_len;
	char key[160];
};

static int meta_fail(struct meta *g, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int meta_fail(struct meta *g, int rc, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	rc = file_vfail(g->err, g->err_len, rc, g->name, fmt, ap);
	va_end(ap);
	return rc;
}

/* {arch}.suffix, or the key itself for the general./tokenizer. namespaces. */
static const struct gguf_kv *meta_kv(struct meta *g, const char *suffix)
{
	if (!strncmp(suffix, "tokenizer.", 10) || !strncmp(suffix, "general.", 8))
		snprintf(g->key, sizeof(g->key), "%s", suffix);
	else
		snprintf(g->key, sizeof(g->key), "%s.%s", g->arch, suffix);
	return gguf_find_kv(g->f, g->key);
}

/* Integer key in [lo, hi]: 0 (set), 1 (absent, *out untouched) or -EINVAL. */
static int meta_int(struct meta *g, const char *suffix, long long lo, long long hi, int *out,
		    int required)
{
	const struct gguf_kv *kv = meta_kv(g, suffix);
	int64_t v;

	if (!kv)
		return required ? meta_fail(g, -EINVAL, "%s: required but missing", g->key) : 1;
	if (gguf_kv_int(kv, &v))
		return meta_fail(g, -EINVAL, "%s: expected an integer (value type %d)", g->key,
				 (int)kv->type);
	if (v < lo || v > hi)
		return meta_fail(g, -EINVAL, "%s: %lld is out of range [%lld, %lld]", g->key,
				 (long long)v, lo, hi);
	*out = (int)v;
	return 0;
}

static int meta_num(struct meta *g, const char *suffix, double lo, double hi, double *out,
		    int required)
{
	const struct gguf_kv *kv = meta_kv(g, suffix);
	double v;

	if (!kv)
		return required ? meta_fail(g, -EINVAL, "%s: required but missing", g->key) : 1;
	if (gguf_kv_float(kv, &v))
		return meta_fail(g, -EINVAL, "%s: expected a number (value type %d)", g->key,
				 (int)kv->type);
	if (!isfinite(v) || v < lo || v > hi)
		return meta_fail(g, -EINVAL, "%s: %g is out of range [%g, %g]", g->key, v, lo, hi);
	*out = v;
	return 0;
}

/* Boolean key; absent leaves *out untouched. 0 or -EINVAL. */
static int meta_bool(struct meta *g, const char *suffix, int *out)
{
	const struct gguf_kv *kv = meta_kv(g, suffix);

	if (kv && gguf_kv_bool(kv, out))
		return meta_fail(g, -EINVAL, "%s: expected a bool (value type %d)", g->key,
				 (int)kv->type);
	return 0;
}

static int meta_arch(struct meta *g, struct model_config *cfg)
{
	int rc = gguf_get_str(g->f, "general.architecture", g->arch, sizeof(g->arch));

	if (rc == -ENOENT)
		return meta_fail(g, -EINVAL, "general.architecture: required but missing");
	if (rc)
		return meta_fail(g, -EINVAL, "general.architecture: not a short string");
	for (size_t i = 0; i < sizeof(meta_archs) / sizeof(meta_archs[0]); i++) {
		if (!strcmp(g->arch, meta_archs[i].gguf)) {
			cfg->arch = meta_archs[i].arch;
			snprintf(cfg->model_type, sizeof(cfg->model_type), "%s",
				 meta_archs[i].model_type);
			return 0;
		}
	}
	return meta_fail(g, -ENOTSUP, "general.architecture '%.31s' is not supported "
			 "(supported: llama, qwen3, qwen3moe, deepseek2)", g->arch);
}

/* The float type the weights were written in: it rounds the rope frequencies the way
 * transformers does for a model held in that dtype (see model_config_rope.c). */
static enum k_dtype meta_dtype(struct meta *g)
{
	const struct gguf_tensor *t;
	int ft;

	if (meta_int(g, "general.file_type", 0, 1 << 16, &ft, 0) == 0)
		return ft == FTYPE_MOSTLY_BF16 ? K_BF16 : ft == FTYPE_MOSTLY_F16 ? K_F16 : K_F32;
	t = gguf_find_tensor(g->f, "token_embd.weight");
	if (t && t->type == GGUF_TT_BF16)
		return K_BF16;
	if (t && t->type == GGUF_TT_F16)
		return K_F16;
	return K_F32;
}

static int meta_vocab(struct meta *g, struct model_config *cfg)
{
	const struct gguf_kv *tokens = gguf_find_kv(g->f, "tokenizer.ggml.tokens");
	const struct gguf_tensor *embd = gguf_find_tensor(g->f, "token_embd.weight");
	int rc = meta_int(g, "vocab_size", 1, META_MAX_VOCAB, &cfg->vocab_size, 0);

	if (rc <= 0)
		return rc;
	if (tokens && tokens->type == GGUF_VT_ARRAY && tokens->n >= 1 && tokens->n <= META_MAX_VOCAB) {
		cfg->vocab_size = (int)tokens->n;
		return 0;
	}
	if (embd && embd->n_dims == 2 && embd->ne[1] >= 1 && embd->ne[1] <= META_MAX_VOCAB) {
		cfg->vocab_size = (int)embd->ne[1];
		return 0;
	}
	return meta_fail(g, -EINVAL, "%s.vocab_size: missing, and neither tokenizer.ggml.tokens "
			 "nor token_embd.weight gives the vocabulary size", g->arch);
}

/* bos, and every id that ends a turn: eos, eot, eom (Llama 3 stops on all three). */
static int meta_tokens(struct meta *g, struct model_config *cfg)
{
	static const char *const stops[] = { "tokenizer.ggml.eos_token_id",
					     "tokenizer.ggml.eot_token_id",
					     "tokenizer.ggml.eom_token_id" };
	int rc, id;

	cfg->bos_token_id = -1;
	rc = meta_int(g, "tokenizer.ggml.bos_token_id", 0, META_MAX_TOKEN_ID, &cfg->bos_token_id, 0);
	if (rc < 0)
		return rc;
	cfg->n_eos = 0;
	for (size_t i = 0; i < sizeof(stops) / sizeof(stops[0]); i++) {
		int dup = 0;

		rc = meta_int(g, stops[i], 0, META_MAX_TOKEN_ID, &id, 0);
		if (rc < 0)
			return rc;
		if (rc)
			continue;
		for (int j = 0; j < cfg->n_eos; j++)
			dup |= cfg->eos_token_ids[j] == id;
		if (!dup && cfg->n_eos < MODEL_MAX_EOS)
			cfg->eos_token_ids[cfg->n_eos++] = id;
	}
	return 0;
}

static int meta_common(struct meta *g, struct model_config *cfg)
{
	double eps;
	int rc;

	rc = meta_int(g, "embedding_length", 1, META_MAX_HIDDEN, &cfg->hidden_size, 1);
	if (!rc)
		rc = meta_int(g, "block_count", 1, MODEL_MAX_LAYERS, &cfg->n_layers, 1);
	if (!rc)
		rc = meta_int(g, "attention.head_count", 1, META_MAX_HEADS, &cfg->n_heads, 1);
	if (!rc)
		rc = meta_num(g, "attention.layer_norm_rms_epsilon", 1e-30, 0.5, &eps, 1);
	if (rc)
		return rc;
	cfg->rms_norm_eps = (float)eps;
	cfg->max_position_embeddings = 2048;
	rc = meta_int(g, "context_length", 1, META_MAX_POS, &cfg->max_position_embeddings, 0);
	if (rc >= 0)
		rc = meta_int(g, "feed_forward_length", 1, META_MAX_WIDTH, &cfg->intermediate_size, 0);
	if (rc < 0)
		return rc;
	rc = meta_vocab(g, cfg);
	if (rc)
		return rc;
	cfg->dtype = meta_dtype(g);
	/* llama.cpp's converter leaves out output.weight when the head is tied. */
	cfg->tie_word_embeddings = !gguf_find_tensor(g->f, "output.weight");
	return meta_tokens(g, cfg);
}

static int meta_gqa(struct meta *g, struct model_config *cfg)
{
	int rc, v_len = 0, rope_dim = 0, experts = 0;

	/* llama.cpp also files Mixtral-style MoE under llama; kdec's llama is dense */
	rc = meta_int(g, "expert_count", 0, META_MAX_EXPERTS, &experts, 0);
	if (rc < 0)
		return rc;
	if (experts > 0 && cfg->arch != ARCH_QWEN3_MOE)
		return meta_fail(g, -ENOTSUP, "%s.expert_count: %d; a mixture-of-experts %s "
				 "(Mixtral-style) is not supported", g->arch, experts, g->arch);

	cfg->n_kv_heads = cfg->n_heads;
	rc = meta_int(g, "attention.head_count_kv", 1, META_MAX_HEADS, &cfg->n_kv_heads, 0);
	if (rc < 0)
		return rc;
	if (cfg->n_heads % cfg->n_kv_heads)
		return meta_fail(g, -EINVAL, "%s.attention.head_count_kv: %d does not divide "
				 "head_count %d", g->arch, cfg->n_kv_heads, cfg->n_heads);
	rc = meta_int(g, "attention.key_length", 1, META_MAX_HEAD_DIM, &cfg->head_dim, 0);
	if (rc < 0)
		return rc;
	if (rc == 1) {
		if (cfg->hidden_size % cfg->n_heads)
			return meta_fail(g, -EINVAL, "%s.attention.head_count: %d does not divide "
					 "embedding_length %d (and key_length is not given)",
					 g->arch, cfg->n_heads, cfg->hidden_size);
		cfg->head_dim = cfg->hidden_size / cfg->n_heads;
	}
	rc = meta_int(g, "attention.value_length", 1, META_MAX_HEAD_DIM, &v_len, 0);
	if (rc == 0 && v_len != cfg->head_dim)
		return meta_fail(g, -ENOTSUP, "%s.attention.value_length: %d differs from key_length "
				 "%d; kdec needs equal q/k/v head sizes", g->arch, v_len, cfg->head_dim);
	if (rc < 0)
		return rc;
	rc = meta_int(g, "rope.dimension_count", 1, META_MAX_HEAD_DIM, &rope_dim, 0);
	if (rc == 0 && rope_dim != cfg->head_dim)
		return meta_fail(g, -ENOTSUP, "%s.rope.dimension_count: %d is not the head size %d "
				 "(partial rotary is not supported)", g->arch, rope_dim, cfg->head_dim);
	if (rc < 0)
		return rc;
	cfg->qk_norm = cfg->arch == ARCH_QWEN3 || cfg->arch == ARCH_QWEN3_MOE;
	cfg->rope.dim = cfg->head_dim;
	return 0;
}

/* MLA. The converter stores deepseek2 as MQA over the latent (head_count_kv 1,
 * key_length kv_lora + rope); the per-head sizes are key_length_mla/value_length_mla
 * (older files: key_length/value_length). */
static int meta_mla(struct meta *g, struct model_config *cfg)
{
	int rc, k_len = 0, v_len = 0;

	cfg->mla = 1;
	rc = meta_int(g, "attention.kv_lora_rank", 1, 1 << 14, &cfg->kv_lora_rank, 1);
	if (!rc)
		rc = meta_int(g, "rope.dimension_count", 2, META_MAX_HEAD_DIM, &cfg->qk_rope_head_dim, 1);
	if (rc)
		return rc;
	rc = meta_int(g, "attention.q_lora_rank", 1, 1 << 16, &cfg->q_lora_rank, 0);
	if (rc < 0)
		return rc;
	if (rc == 1)
		cfg->q_lora_rank = 0;
	rc = meta_int(g, "attention.key_length_mla", 1, 2 * META_MAX_HEAD_DIM, &k_len, 0);
	if (rc == 1)
		rc = meta_int(g, "attention.key_length", 1, 2 * META_MAX_HEAD_DIM, &k_len, 1);
	if (rc)
		return rc;
	rc = meta_int(g, "attention.value_length_mla", 1, META_MAX_HEAD_DIM, &v_len, 0);
	if (rc == 1)
		rc = meta_int(g, "attention.value_length", 1, META_MAX_HEAD_DIM, &v_len, 1);
	if (rc)
		return rc;
	if (k_len <= cfg->qk_rope_head_dim)
		return meta_fail(g, -EINVAL, "%s: key length %d leaves no room for rope dims %d",
				 g->key, k_len, cfg->qk_rope_head_dim);
	cfg->qk_nope_head_dim = k_len - cfg->qk_rope_head_dim;
	cfg->v_head_dim = v_len;
	cfg->n_kv_heads = cfg->n_heads;
	cfg->head_dim = k_len;
	cfg->rope.dim = cfg->qk_rope_head_dim;
	/* llama.cpp rotates deepseek2 as adjacent pairs and its converter keeps HF's rows. */
	cfg->rope.interleaved = 1;
	return 0;
}

static int meta_experts(struct meta *g, struct model_config *cfg)
{
	int rc;

	rc = meta_int(g, "expert_used_count", 1, cfg->n_experts, &cfg->top_k, 1);
	if (!rc)
		rc = meta_int(g, "expert_feed_forward_length", 1, META_MAX_WIDTH,
			      &cfg->moe_intermediate_size, 1);
	if (rc)
		return rc;
	model_config_route_defaults(cfg);
	return 0;
}

/* qwen3moe: every layer with a router is MoE; llama.cpp always renormalises the top-k. */
static int meta_moe_qwen3(struct meta *g, struct model_config *cfg)
{
	char name[64];
	int rc;

	rc = meta_int(g, "expert_count", 1, META_MAX_EXPERTS, &cfg->n_experts, 1);
	if (!rc)
		rc = meta_experts(g, cfg);
	if (rc)
		return rc;
	cfg->route.norm_topk_prob = 1;
	rc = meta_bool(g, "expert_weights_norm", &cfg->route.norm_topk_prob);
	if (rc)
		return rc;
	cfg->decoder_sparse_step = 1;
	for (int l = 0; l < cfg->n_layers; l++) {
		snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp.weight", l);
		if (!gguf_find_tensor(g->f, name))
			cfg->mlp_only[l / 8] |= (uint8_t)(1u << (l % 8));
	}
	return 0;
}

static int meta_groups(struct meta *g, struct model_config *cfg)
{
	struct k_moe_route_params *r = &cfg->route;
	int rc;

	rc = meta_int(g, "expert_group_count", 1, r->n_experts, &r->n_group, 0);
	if (rc >= 0)
		rc = meta_int(g, "expert_group_used_count", 1, r->n_group, &r->topk_group, 0);
	if (rc < 0)
		return rc;
	if (r->n_experts % r->n_group)
		return meta_fail(g, -EINVAL, "%s.expert_group_count: %d does not divide the %d "
				 "experts", g->arch, r->n_group, r->n_experts);
	if (r->select == K_MOE_GROUP_TOP2 && r->n_experts / r->n_group < 2)
		return meta_fail(g, -EINVAL, "%s.expert_group_count: %d groups of %d experts; "
				 "sigmoid group routing needs at least 2 per group", g->arch,
				 r->n_group, r->n_experts / r->n_group);
	if ((long long)r->top_k > (long long)r->topk_group * (r->n_experts / r->n_group))
		return meta_fail(g, -EINVAL, "%s.expert_used_count: %d is more than the experts in "
				 "%d groups", g->arch, r->top_k, r->topk_group);
	return 0;
}

/* deepseek2: DeepSeek-V2 (softmax) or V3 (sigmoid + correction bias). Files without
 * expert_gating_func predate it: llama.cpp then assumes softmax, but a converter that
 * wrote exp_probs_b had a sigmoid router (the bias only exists there). */
static int meta_moe_deepseek(struct meta *g, struct model_config *cfg)
{
	double scale = 1.0;
	char name[64];
	int rc, gating = 0;

	rc = meta_int(g, "expert_count", 0, META_MAX_EXPERTS, &cfg->n_experts, 0);
	if (rc < 0)
		return rc;
	if (rc == 1 || cfg->n_experts == 0) {	/* a dense DeepSeek-V2 */
		cfg->n_experts = 0;
		return 0;
	}
	rc = meta_experts(g, cfg);
	if (!rc)
		rc = meta_int(g, "expert_shared_count", 0, 64, &cfg->n_shared_experts, 0);
	if (rc >= 0)
		rc = meta_int(g, "leading_dense_block_count", 0, cfg->n_layers, &cfg->first_k_dense, 0);
	if (rc >= 0)
		rc = meta_num(g, "expert_weights_scale", 1e-6, 1e6, &scale, 0);
	if (rc >= 0)
		rc = meta_bool(g, "expert_weights_norm", &cfg->route.norm_topk_prob);
	if (rc >= 0)
		rc = meta_int(g, "expert_gating_func", 0, 255, &gating, 0);
	if (rc < 0)
		return rc;
	cfg->route.routed_scaling = (float)scale;
	cfg->moe_layer_freq = 1;
	if (!gating) {
		snprintf(name, sizeof(name), "blk.%d.exp_probs_b.bias", cfg->first_k_dense);
		gating = gguf_find_tensor(g->f, name) ? GATING_SIGMOID : GATING_SOFTMAX;
	}
	if (gating == GATING_SIGMOID) {
		cfg->arch = ARCH_DEEPSEEK_V3;
		snprintf(cfg->model_type, sizeof(cfg->model_type), "deepseek_v3");
		cfg->route.scoring = K_MOE_SIGMOID;
		cfg->route.select = K_MOE_GROUP_TOP2;
	} else if (gating == GATING_SOFTMAX) {
		cfg->route.scoring = K_MOE_SOFTMAX;
		cfg->route.select = K_MOE_GREEDY;
	} else {
		return meta_fail(g, -ENOTSUP, "%s.expert_gating_func: %d is not supported "
				 "(1 softmax, 2 sigmoid)", g->arch, gating);
	}
	rc = meta_groups(g, cfg);
	/* DeepSeek-V2's group_limited_greedy: the group's best expert ranks the group. */
	if (!rc && gating == GATING_SOFTMAX && cfg->route.n_group > 1)
		cfg->route.select = K_MOE_GROUP_MAX;
	return rc;
}

/* ---- rope ----------------------------------------------------------------- */

/* HF default inverse frequencies in float32 (as kernels/cpu/rope.c computes them). */
static float rope_base_inv(const struct k_rope_params *p, int i)
{
	return 1.0f / powf((float)p->theta, (float)(2 * i) / (float)p->dim);
}

/* Whether p (a llama3 rope) gives inv_freq[i] = base_inv[i] / factors[i] within
 * float32 noise. */
static int rope_matches(const struct k_rope_params *p, const float *factors)
{
	struct k_rope_params q = *p;
	struct k_rope r;
	int ok = 1;

	q.freq_dtype = K_F32;
	if (k_rope_init(&r, &q))
		return 0;
	for (int i = 0; i < p->dim / 2 && ok; i++) {
		double want = rope_base_inv(p, i) / factors[i];

		ok = fabs(r.inv_freq[i] - want) <= 1e-5 * want;
	}
	k_rope_fini(&r);
	return ok;
}

/* Wavelength bounds (as 1/wavelength: u for the low-frequency edge, v for the high)
 * that reproduce the factors: the llama3 formula depends on its parameters only
 * through factor, original/low_freq_factor and original/high_freq_factor. Points
 * between the edges fix the line x = u + s (v - u); with one or none, any bounds in
 * the gaps around them give the same table, so pick some there. */
static void rope_llama3_edges(const double *x, const double *s, int n, double lo_max,
			      double hi_min, double *u, double *v)
{
	double ms = 0, mx = 0, cov = 0, var = 0;
	int k = -1, nb = 0;

	for (int i = 0; i < n; i++) {
		if (s[i] < 0)
			continue;
		k = i;
		nb++;
		ms += s[i];
		mx += x[i];
	}
	if (nb >= 2) {
		ms /= nb;
		mx /= nb;
		for (int i = 0; i < n; i++) {
			if (s[i] < 0)
				continue;
			cov += (s[i] - ms) * (x[i] - mx);
			var += (s[i] - ms) * (s[i] - ms);
		}
	}
	if (nb >= 2 && var > 0) {
		*u = mx - cov / var * ms;
		*v = *u + cov / var;
		return;
	}
	if (nb >= 1) {
		*u = lo_max > 0 ? (lo_max + x[k]) / 2 : x[k] / 2;
		*v = *u + (x[k] - *u) / s[k];
		for (int it = 0; it < 64 && !(*v < hi_min); it++) {
			*u = (*u + x[k]) / 2;
			*v = *u + (x[k] - *u) / s[k];
		}
		return;
	}
	if (isfinite(hi_min)) {
		*u = lo_max + (hi_min - lo_max) / 3;
		*v = lo_max + 2 * (hi_min - lo_max) / 3;
	} else {
		*u = lo_max * 1.5;
		*v = lo_max * 3;
	}
}

/* llama.cpp keeps Llama 3's rope scaling as rope_freqs.weight, (dim/2) divisors of the
 * default frequencies. k_rope_params says llama3 by its HF parameters, so derive a set
 * that reproduces the divisors (low_freq_factor 1, original = the low edge) and prove
 * it by computing the table; a table that no llama3 parameters give is refused. */
static int meta_rope_freqs(struct meta *g, struct model_config *cfg, const struct gguf_tensor *t)
{
	struct k_rope_params *p = &cfg->rope;
	int half = p->dim / 2;
	float factors[1024];
	double x[1024], s[1024], factor = 1, lo_max = 0, hi_min = INFINITY, u, v;

	if (t->type != GGUF_TT_F32 || t->n_dims != 1 || t->ne[0] != half || half > 1024)
		return meta_fail(g, -EINVAL, "tensor 'rope_freqs.weight': type %u shape [%lld], "
				 "expected F32 [%d]", t->type, (long long)t->ne[0], half);
	memcpy(factors, t->data, (size_t)half * sizeof(float));
	for (int i = 0; i < half; i++) {
		if (!(factors[i] >= 1.0f) || !isfinite(factors[i]))
			return meta_fail(g, -ENOTSUP, "tensor 'rope_freqs.weight': factor %d is %g; "
					 "only llama3-style factors >= 1 are supported", i,
					 (double)factors[i]);
		if (factors[i] > factor)
			factor = factors[i];
	}
	if (factor == 1)
		return 0;	/* all ones: plain rope */
	for (int i = 0; i < half; i++) {
		x[i] = rope_base_inv(p, i) / ROPE_2PI;	/* 1 / wavelength */
		s[i] = -1;
		if (factors[i] == 1.0f)
			hi_min = x[i] < hi_min ? x[i] : hi_min;
		else if (factors[i] == (float)factor)
			lo_max = x[i] > lo_max ? x[i] : lo_max;
		else
			s[i] = (1.0 / factors[i] - 1.0 / factor) / (1.0 - 1.0 / factor);
	}
	rope_llama3_edges(x, s, half, lo_max, hi_min, &u, &v);
	p->type = K_ROPE_LLAMA3;
	p->factor = factor;
	p->low_freq_factor = 1.0;
	if (u > 0 && v > u) {
		/* The published values are round (8192, 4): prefer them when they fit. */
		p->original_max_pos = round(1.0 / u);
		p->high_freq_factor = round(v / u * 1000) / 1000;
		if (p->high_freq_factor > 1 && rope_matches(p, factors))
			return 0;
		p->original_max_pos = 1.0 / u;
		p->high_freq_factor = v / u;
		if (rope_matches(p, factors))
			return 0;
	}
	return meta_fail(g, -ENOTSUP, "tensor 'rope_freqs.weight': these %d factors (max %g) "
			 "are not a llama3 rope scaling; kdec cannot express them", half, factor);
}

static int meta_rope_scaling(struct meta *g, struct model_config *cfg, const char *type)
{
	struct k_rope_params *p = &cfg->rope;
	double log_mul = 0;
	int rc, orig = cfg->max_position_embeddings;

	rc = meta_num(g, "rope.scaling.factor", 1e-6, 1e6, &p->factor, 1);
	if (rc)
		return rc;
	if (!strcmp(type, "linear")) {
		p->type = K_ROPE_LINEAR;
		return 0;
	}
	if (strcmp(type, "yarn"))
		return meta_fail(g, -ENOTSUP, "%s.rope.scaling.type: '%.40s' is not supported "
				 "(none, linear, yarn; llama3 as rope_freqs.weight)", g->arch, type);
	p->type = K_ROPE_YARN;
	p->beta_fast = 32;
	p->beta_slow = 1;
	p->attention_factor = -1;
	p->truncate = 1;
	rc = meta_int(g, "rope.scaling.original_context_length", 1, META_MAX_POS, &orig, 0);
	if (rc >= 0)
		rc = meta_num(g, "rope.scaling.yarn_beta_fast", 0, 1e6, &p->beta_fast, 0);
	if (rc >= 0)
		rc = meta_num(g, "rope.scaling.yarn_beta_slow", 0, 1e6, &p->beta_slow, 0);
	if (rc >= 0)
		rc = meta_num(g, "rope.scaling.attn_factor", 1e-6, 1e6, &p->attention_factor, 0);
	if (rc >= 0)
		rc = meta_num(g, "rope.scaling.yarn_log_multiplier", 0, 100, &log_mul, 0);
	if (rc < 0)
		return rc;
	p->original_max_pos = orig;
	/* deepseek2 stores 0.1 * mscale_all_dim, and llama.cpp applies it to both the
	 * softmax scale and the rope (so mscale = mscale_all_dim, HF's attention factor 1). */
	if (rc == 0 && log_mul > 0)
		p->mscale = p->mscale_all_dim = log_mul / 0.1;
	return 0;
}

static int meta_rope(struct meta *g, struct model_config *cfg)
{
	const struct gguf_tensor *freqs = gguf_find_tensor(g->f, "rope_freqs.weight");
	char type[32] = "none";
	double scale_linear = 0;
	int rc;

	cfg->rope.theta = 10000.0;
	rc = meta_num(g, "rope.freq_base", 1e-6, 1e12, &cfg->rope.theta, 0);
	if (rc < 0)
		return rc;
	meta_kv(g, "rope.scaling.type");
	rc = gguf_get_str(g->f, g->key, type, sizeof(type));
	if (rc && rc != -ENOENT)
		return meta_fail(g, -EINVAL, "%s: expected a short string", g->key);
	rc = meta_num(g, "rope.scale_linear", 1e-6, 1e6, &scale_linear, 0);	/* older files */
	if (rc < 0)
		return rc;
	if (rc == 0 && !strcmp(type, "none") && scale_linear != 1.0) {
		cfg->rope.type = K_ROPE_LINEAR;
		cfg->rope.factor = scale_linear;
	}
	rc = 0;
	if (strcmp(type, "none")) {
		rc = meta_rope_scaling(g, cfg, type);
	}
	if (!rc && freqs) {
		if (cfg->rope.type != K_ROPE_DEFAULT || cfg->mla)
			return meta_fail(g, -ENOTSUP, "rope_freqs.weight together with rope scaling "
					 "'%s' is not supported", type);
		rc = meta_rope_freqs(g, cfg, freqs);
	}
	if (rc)
		return rc;
	cfg->rope.freq_dtype = cfg->dtype;
	if (cfg->rope.dim <= 0 || cfg->rope.dim % 2)
		return meta_fail(g, -EINVAL, "rotary dim %d must be even", cfg->rope.dim);
	return 0;
}

int model_gguf_config(struct model_config *cfg, const struct gguf_file *f, const char *name,
		      char *err, size_t err_len)
{
	struct meta g = { .f = f, .name = name, .err = err, .err_len = err_len };
	int rc;

	memset(cfg, 0, sizeof(*cfg));
	rc = meta_arch(&g, cfg);
	if (!rc)
		rc = meta_common(&g, cfg);
	if (rc)
		return rc;
	rc = cfg->arch == ARCH_DEEPSEEK_V2 ? meta_mla(&g, cfg) : meta_gqa(&g, cfg);
	if (!rc && cfg->arch == ARCH_QWEN3_MOE)
		rc = meta_moe_qwen3(&g, cfg);
	if (!rc && cfg->arch == ARCH_DEEPSEEK_V2)
		rc = meta_moe_deepseek(&g, cfg);
	if (!rc)
		rc = meta_rope(&g, cfg);
	if (rc)
		return rc;
	model_config_set_attn_scale(cfg);
	if (model_config_has_dense_layer(cfg) && !cfg->intermediate_size)
		return meta_fail(&g, -EINVAL, "%s.feed_forward_length: required (the model has "
				 "dense MLP layers) but missing", g.arch);
	return 0;
}
