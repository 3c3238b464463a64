/* config.json's quantization_config: the published layouts kdec loads
 * (docs/MODELS.md "Quantized checkpoints") into cfg->quant; anything else is one
 * -ENOTSUP line naming the format. Which tensors are quantized is decided by the
 * files (model_quant.c), so `ignore` / `modules_to_not_convert` need no parsing
 * beyond their type. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "daemon/model/config_json.h"
#include "daemon/model/model_config.h"
#include "daemon/model/model.h"

#define QUANT_MAX_BLOCK 65536

const char *model_quant_name(const struct model_quant *q, char *buf, size_t n)
{
	switch (q->format) {
	case MODEL_Q_NONE: snprintf(buf, n, "none"); break;
	case MODEL_Q_FP8_BLOCK: snprintf(buf, n, "fp8-block"); break;
	case MODEL_Q_FP8_CHANNEL: snprintf(buf, n, "fp8-channel"); break;
	case MODEL_Q_FP8_TENSOR: snprintf(buf, n, "fp8-tensor"); break;
	case MODEL_Q_INT4_GROUP: snprintf(buf, n, "int4-g%d", q->group_size); break;
	}
	return buf;
}

static int list_or_absent(struct cfg_parse *p, const json_t *q, const char *key)
{
	json_t *v = cfg_obj_get(q, key);

	if (v && !json_is_array(v))
		return cfg_fail(p, -EINVAL, "quantization_config.%s: expected a list of module "
				"names", key);
	return 0;
}

/* DeepSeek-V3 / Kimi-K2: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
 * "dynamic", "weight_block_size": [128, 128]}. */
static int parse_fp8_block(struct cfg_parse *p, const json_t *q, struct model_config *cfg)
{
	json_t *bs = cfg_obj_get(q, "weight_block_size");
	const char *fmt = NULL, *act = NULL;
	int rc;

	if ((rc = cfg_str(p, q, "fmt", NULL, &fmt)) || (rc = cfg_str(p, q, "activation_scheme", NULL, &act)))
		return rc;
	if (fmt && strcmp(fmt, "e4m3"))
		return cfg_fail(p, -ENOTSUP, "quantization_config.fmt: '%.20s' is not supported "
				"(fp8 block-scaled weights: e4m3 only)", fmt);
	if (act && strcmp(act, "dynamic"))
		return cfg_fail(p, -ENOTSUP, "quantization_config.activation_scheme: '%.20s' is not "
				"supported (fp8 block-scaled weights: dynamic only)", act);
	if (!json_is_array(bs) || json_array_size(bs) != 2)
		return cfg_fail(p, -EINVAL, "quantization_config.weight_block_size: expected two "
				"integers (fp8 block-scaled weights, e.g. [128, 128])");
	for (int i = 0; i < 2; i++) {
		json_t *v = json_array_get(bs, (size_t)i);
		json_int_t b = json_is_integer(v) ? json_integer_value(v) : 0;

		if (b < 1 || b > QUANT_MAX_BLOCK)
			return cfg_fail(p, -EINVAL, "quantization_config.weight_block_size[%d]: expected "
					"an integer in [1, %d] (fp8 block-scaled weights)", i, QUANT_MAX_BLOCK);
		*(i ? &cfg->quant.block_cols : &cfg->quant.block_rows) = (int)b;
	}
	cfg->quant.format = MODEL_Q_FP8_BLOCK;
	return list_or_absent(p, q, "modules_to_not_convert");
}

/* Meta's Llama-3.1-405B-Instruct-FP8: {"quant_method": "fbgemm_fp8",
 * "activation_scale_ub": 1200.0, "modules_to_not_convert": [...]}: e4m3 `weight` with an
 * F32 `weight_scale` (N, 1) per row, the fp8-channel layout. Activations are quantized
 * per row at run time there (clipped at activation_scale_ub); kdec computes W8A16. */
static int parse_fbgemm(struct cfg_parse *p, const json_t *q, struct model_config *cfg)
{
	double ub = 0;
	int rc;

	p->prefix = "quantization_config.";
	rc = cfg_num(p, q, "activation_scale_ub", NULL, 1e-30, 1e30, &ub);
	p->prefix = "";
	if (rc < 0)
		return rc;
	cfg->quant.format = MODEL_Q_FP8_CHANNEL;
	return list_or_absent(p, q, "modules_to_not_convert");
}

/* A group's input_activations: absent or dynamic (nothing in the files), or static
 * per tensor in fp8 (one `input_scale` a linear: W8A8 checkpoints such as RedHatAI's
 * FP8 Llama and Qwen). kdec computes W8A16 either way (docs/MODELS.md), so the static
 * scales are checked at load and not applied; *stat says whether they are there. */
static int ct_inputs(struct cfg_parse *p, const char *key, const json_t *in, int *stat)
{
	const char *type = NULL, *strategy = NULL;
	int dynamic = 0, bits = 0, sym = 1, rc;

	*stat = 0;
	if (!in || json_is_null(in))
		return 0;
	if (!json_is_object(in))
		return cfg_fail(p, -EINVAL, "quantization_config.config_groups.%.40s.input_activations: "
				"expected an object or null (compressed-tensors)", key);
	p->prefix = "quantization_config.config_groups.*.input_activations.";
	rc = cfg_bool(p, in, "dynamic", &dynamic);
	if (!rc && !dynamic && (!(rc = cfg_str(p, in, "type", NULL, &type)) &&
				!(rc = cfg_str(p, in, "strategy", NULL, &strategy)) &&
				(rc = cfg_int(p, in, "num_bits", NULL, 1, 64, &bits)) >= 0))
		rc = cfg_bool(p, in, "symmetric", &sym);
	p->prefix = "";
	if (rc < 0)
		return rc;
	if (dynamic)
		return 0;
	if (!type || strcmp(type, "float") || bits != 8 || !strategy || strcmp(strategy, "tensor") || !sym)
		return cfg_fail(p, -ENOTSUP, "quantization_config.config_groups.%.40s.input_activations: "
				"static type %.10s, %d bits, strategy %.10s%s is not supported (static "
				"activation scales: fp8 float symmetric per tensor only)", key,
				type ? type : "?", bits, strategy ? strategy : "?", sym ? "" : ", asymmetric");
	*stat = 1;
	return 0;
}

/* The one weights scheme of the config groups (all groups must say the same, and the
 * same of their input activations). */
static const json_t *ct_weights(struct cfg_parse *p, const json_t *q, int *stat, int *rc)
{
	json_t *groups = cfg_obj_get(q, "config_groups"), *first = NULL, *g;
	const char *key;

	*rc = 0;
	if (!json_is_object(groups) || !json_object_size(groups)) {
		*rc = cfg_fail(p, -EINVAL, "quantization_config.config_groups: expected an object "
			       "of at least one group (compressed-tensors)");
		return NULL;
	}
	json_object_foreach(groups, key, g) {
		json_t *w = cfg_obj_get(g, "weights");
		int s;

		if (!json_is_object(w)) {
			*rc = cfg_fail(p, -EINVAL, "quantization_config.config_groups.%.40s.weights: "
				       "expected an object (compressed-tensors)", key);
			return NULL;
		}
		if ((*rc = ct_inputs(p, key, cfg_obj_get(g, "input_activations"), &s)))
			return NULL;
		if (first && (!cfg_values_equal(first, w) || s != *stat)) {
			*rc = cfg_fail(p, -ENOTSUP, "quantization_config.config_groups: groups with "
				       "different weight or input schemes are not supported "
				       "(compressed-tensors)");
			return NULL;
		}
		first = w;
		*stat = s;
	}
	return first;
}

/* actorder "group" stores a weight_g_idx permutation kdec does not apply; null,
 * false and "weight" (an order of quantization only) leave the layout plain. */
static int actorder_ok(const json_t *w)
{
	json_t *a = cfg_obj_get(w, "actorder");

	return !a || json_is_false(a) || (json_is_string(a) && !strcmp(json_string_value(a), "weight"));
}

/* compressed-tensors: float-quantized fp8 per channel / per tensor, or pack-quantized
 * int4 symmetric groups. */
static int parse_ct(struct cfg_parse *p, const json_t *q, struct model_config *cfg)
{
	const char *format = NULL, *status = NULL, *type = NULL, *strategy = NULL;
	const json_t *w;
	int rc, bits = 0, sym = 0, dyn = 0, group = 0, stat = 0;
	char what[64];

	if ((rc = cfg_str(p, q, "format", NULL, &format)) ||
	    (rc = cfg_str(p, q, "quantization_status", NULL, &status)))
		return rc;
	if (status && strcmp(status, "compressed"))
		return cfg_fail(p, -ENOTSUP, "quantization_config.quantization_status: '%.20s' is "
				"not supported (compressed-tensors checkpoints as saved: compressed)",
				status);
	if (cfg_obj_get(q, "kv_cache_scheme"))
		return cfg_fail(p, -ENOTSUP, "quantization_config.kv_cache_scheme: a quantized KV "
				"cache is not supported (compressed-tensors)");
	if (!format || (strcmp(format, "float-quantized") && strcmp(format, "pack-quantized")))
		return cfg_fail(p, -ENOTSUP, "quantization_config.format: compressed-tensors '%.40s' "
				"is not supported (float-quantized fp8 per channel/tensor, "
				"pack-quantized int4 groups)", format ? format : "(none)");
	if (!(w = ct_weights(p, q, &stat, &rc)))
		return rc;
	snprintf(what, sizeof(what), "compressed-tensors %s", format);
	p->prefix = "quantization_config.config_groups.*.weights.";
	if ((rc = cfg_str(p, w, "type", NULL, &type)) || (rc = cfg_str(p, w, "strategy", NULL, &strategy)) ||
	    (rc = cfg_int(p, w, "num_bits", NULL, 1, 64, &bits)) < 0 ||
	    (rc = cfg_bool(p, w, "symmetric", &sym)) || (rc = cfg_bool(p, w, "dynamic", &dyn)) ||
	    (rc = cfg_int(p, w, "group_size", NULL, 1, QUANT_MAX_BLOCK, &group)) < 0) {
		p->prefix = "";
		return rc;
	}
	p->prefix = "";
	if (!strcmp(format, "float-quantized") && type && !strcmp(type, "float") && bits == 8 && sym &&
	    !dyn && strategy && (!strcmp(strategy, "channel") || !strcmp(strategy, "tensor")))
		cfg->quant.format = strcmp(strategy, "channel") ? MODEL_Q_FP8_TENSOR : MODEL_Q_FP8_CHANNEL;
	else if (!strcmp(format, "pack-quantized") && type && !strcmp(type, "int") && bits == 4 && sym &&
		 !dyn && strategy && !strcmp(strategy, "group") && group > 0 && actorder_ok(w))
		cfg->quant.format = MODEL_Q_INT4_GROUP, cfg->quant.group_size = group;
	if (!cfg->quant.format)
		return cfg_fail(p, -ENOTSUP, "quantization_config: %s weights type %.10s, %d bits, "
				"strategy %.10s%s%s are not supported (fp8 float symmetric per channel "
				"or tensor; int4 symmetric groups)", what, type ? type : "?", bits,
				strategy ? strategy : "?", sym ? "" : ", asymmetric", dyn ? ", dynamic" : "");
	if (stat && cfg->quant.format == MODEL_Q_INT4_GROUP)
		return cfg_fail(p, -ENOTSUP, "quantization_config.config_groups.*.input_activations: "
				"static activation scales with int4 weights are not supported "
				"(compressed-tensors pack-quantized: dynamic or none)");
	cfg->quant.input_scales = stat;
	return list_or_absent(p, q, "ignore");
}

int cfg_parse_quant(struct cfg_parse *p, const void *root_, struct model_config *cfg)
{
	const json_t *root = root_;
	json_t *q = cfg_obj_get(root, "quantization_config");
	const char *m = NULL;
	int rc;

	if (!q)
		return 0;
	if (!json_is_object(q))
		return cfg_fail(p, -EINVAL, "quantization_config: expected an object");
	p->prefix = "quantization_config.";
	rc = cfg_str(p, q, "quant_method", NULL, &m);
	p->prefix = "";
	if (rc)
		return rc;
	if (m && !strcmp(m, "fp8"))
		return parse_fp8_block(p, q, cfg);
	if (m && !strcmp(m, "compressed-tensors"))
		return parse_ct(p, q, cfg);
	if (m && !strcmp(m, "fbgemm_fp8"))
		return parse_fbgemm(p, q, cfg);
	return cfg_fail(p, -ENOTSUP, "quantization_config: quant_method '%.40s' is not supported "
			"(fp8 block-scaled, fbgemm_fp8, compressed-tensors float-quantized fp8 or "
			"pack-quantized int4)", m ? m : "(none)");
}

int model_weight_format_parse(const char *s, struct model_quant *q, char *err, size_t err_len)
{
	int g = 0, n = 0;

	memset(q, 0, sizeof(*q));
	if (!strcmp(s, "bf16") || !strcmp(s, "none"))
		return 0;
	if (!strcmp(s, "fp8-block")) {
		q->format = MODEL_Q_FP8_BLOCK;
		q->block_rows = q->block_cols = 128;
		return 0;
	}
	if (!strcmp(s, "fp8-channel") || !strcmp(s, "fp8-tensor")) {
		q->format = strcmp(s, "fp8-channel") ? MODEL_Q_FP8_TENSOR : MODEL_Q_FP8_CHANNEL;
		return 0;
	}
	if (sscanf(s, "int4-g%d%n", &g, &n) == 1 && !s[n] && g >= 8 && g <= QUANT_MAX_BLOCK && g % 8 == 0) {
		q->format = MODEL_Q_INT4_GROUP;
		q->group_size = g;
		return 0;
	}
	snprintf(err, err_len, "--weight-format '%.40s': expected bf16, fp8-block, fp8-channel, "
		 "fp8-tensor or int4-gN (N a multiple of 8, e.g. int4-g32)", s);
	return -EINVAL;
}
