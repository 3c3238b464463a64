/* model_config_parse: every arch, both rope spellings, the errors and their messages,
 * and the real config.json files in tests/data. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "daemon/model/model_config.h"
#include "tests/testutil.h"

static char err[512];

static const char *LLAMA =
	"{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":128,"
	"\"num_hidden_layers\":3,\"num_attention_heads\":8,\"num_key_value_heads\":2,"
	"\"intermediate_size\":352,\"rms_norm_eps\":1e-5,\"max_position_embeddings\":4096,"
	"\"rope_theta\":500000.0,\"rope_scaling\":{\"factor\":8.0,\"low_freq_factor\":1.0,"
	"\"high_freq_factor\":4.0,\"original_max_position_embeddings\":64,"
	"\"rope_type\":\"llama3\"}}";

static const char *QWEN3_MOE =
	"{\"model_type\":\"qwen3_moe\",\"vocab_size\":512,\"hidden_size\":128,"
	"\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
	"\"head_dim\":32,\"rms_norm_eps\":1e-6,\"num_experts\":8,\"num_experts_per_tok\":2,"
	"\"moe_intermediate_size\":64,\"norm_topk_prob\":true,\"rope_theta\":1000000}";

static const char *DSV2 =
	"{\"model_type\":\"deepseek_v2\",\"vocab_size\":512,\"hidden_size\":128,"
	"\"num_hidden_layers\":3,\"num_attention_heads\":4,\"intermediate_size\":256,"
	"\"rms_norm_eps\":1e-6,\"kv_lora_rank\":32,\"qk_nope_head_dim\":32,"
	"\"qk_rope_head_dim\":16,\"v_head_dim\":32,\"q_lora_rank\":null,"
	"\"n_routed_experts\":8,\"n_shared_experts\":2,\"num_experts_per_tok\":2,"
	"\"moe_intermediate_size\":48,\"first_k_dense_replace\":1,\"n_group\":null,"
	"\"topk_method\":\"greedy\",\"rope_parameters\":{\"rope_theta\":10000.0,"
	"\"rope_type\":\"default\"}}";

static const char *DSV3 =
	"{\"model_type\":\"deepseek_v3\",\"vocab_size\":512,\"hidden_size\":128,"
	"\"num_hidden_layers\":3,\"num_attention_heads\":4,\"intermediate_size\":256,"
	"\"rms_norm_eps\":1e-6,\"kv_lora_rank\":32,\"qk_nope_head_dim\":32,"
	"\"qk_rope_head_dim\":16,\"v_head_dim\":32,\"q_lora_rank\":64,"
	"\"n_routed_experts\":16,\"n_shared_experts\":1,\"num_experts_per_tok\":4,"
	"\"moe_intermediate_size\":48,\"first_k_dense_replace\":1,\"n_group\":4,"
	"\"topk_group\":2,\"routed_scaling_factor\":2.5,\"max_position_embeddings\":4096,"
	"\"rope_parameters\":{\"beta_fast\":32.0,\"beta_slow\":1.0,\"factor\":4.0,"
	"\"mscale\":1.0,\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":64,"
	"\"rope_theta\":10000.0,\"rope_type\":\"yarn\"}}";

/* base overlaid by patch; a patch value "DEL" removes the key. */
static int parse_patch(struct model_config *cfg, const char *base, const char *patch)
{
	json_t *b = json_loads(base, 0, NULL);
	json_t *p = patch ? json_loads(patch, 0, NULL) : json_object();
	const char *key;
	json_t *v;
	char *text;
	int rc;

	if (!b || !p) {
		fprintf(stderr, "bad test JSON: %s\n", b ? patch : base);
		exit(1);
	}
	json_object_foreach(p, key, v) {
		if (json_is_string(v) && !strcmp(json_string_value(v), "DEL"))
			json_object_del(b, key);
		else
			json_object_set(b, key, v);
	}
	text = json_dumps(b, JSON_COMPACT);
	rc = model_config_parse(cfg, text, strlen(text), err, sizeof(err));
	free(text);
	json_decref(b);
	json_decref(p);
	return rc;
}

/* Expects rc and an error line that names want1 (and want2 if given). */
static void expect_err(const char *base, const char *patch, int want_rc, const char *want1,
		       const char *want2, int line)
{
	struct model_config cfg;
	int rc = parse_patch(&cfg, base, patch);

	CHECK(rc == want_rc, "line %d: %s: rc %d, want %d (%s)", line, patch, rc, want_rc, err);
	CHECK(strstr(err, "config.json: ") == err, "line %d: message '%s'", line, err);
	CHECK(!strchr(err, '\n'), "line %d: message has a newline", line);
	CHECK(!want1 || strstr(err, want1), "line %d: '%s' lacks '%s'", line, err, want1);
	CHECK(!want2 || strstr(err, want2), "line %d: '%s' lacks '%s'", line, err, want2);
}

#define EXPECT_ERR(base, patch, rc, w1, w2) expect_err(base, patch, rc, w1, w2, __LINE__)

static void expect_ok(struct model_config *cfg, const char *base, const char *patch, int line)
{
	int rc = parse_patch(cfg, base, patch);

	CHECK(rc == 0, "line %d: %s: rc %d (%s)", line, patch ? patch : "", rc, err);
}

#define EXPECT_OK(cfg, base, patch) expect_ok(cfg, base, patch, __LINE__)

static void test_llama(void)
{
	struct model_config a, b;

	EXPECT_OK(&a, LLAMA, NULL);
	CHECK(a.arch == ARCH_LLAMA && !strcmp(a.model_type, "llama"), "arch");
	CHECK(a.head_dim == 16 && a.n_kv_heads == 2 && a.n_layers == 3, "dims");
	CHECK(a.dtype == K_BF16 && a.bos_token_id == -1 && a.n_eos == 0, "defaults");
	CHECK(!a.tie_word_embeddings && !a.qk_norm && !a.mla && !a.n_experts &&
	      !a.quant.format, "flags");
	CHECK(a.rope.type == K_ROPE_LLAMA3 && a.rope.dim == 16 && !a.rope.interleaved, "rope");
	CHECK_NEAR(a.rope.theta, 500000, 0, "theta");
	CHECK_NEAR(a.rope.factor, 8, 0, "factor");
	CHECK_NEAR(a.rope.low_freq_factor, 1, 0, "low");
	CHECK_NEAR(a.rope.high_freq_factor, 4, 0, "high");
	CHECK_NEAR(a.rope.original_max_pos, 64, 0, "orig");
	CHECK_NEAR(a.attn_scale, 0.25, 1e-7, "attn_scale");
	CHECK_NEAR(a.rms_norm_eps, 1e-5, 1e-12, "eps");
	CHECK(!model_config_layer_is_moe(&a, 0), "dense");

	/* The newer spelling gives the same rope. */
	EXPECT_OK(&b, LLAMA, "{\"rope_theta\":\"DEL\",\"rope_scaling\":\"DEL\","
		  "\"rope_parameters\":{\"rope_theta\":500000,\"factor\":8.0,"
		  "\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
		  "\"original_max_position_embeddings\":64,\"rope_type\":\"llama3\"}}");
	CHECK(!memcmp(&a.rope, &b.rope, sizeof(a.rope)), "rope_parameters == rope_scaling");
	/* Both spellings, agreeing. */
	EXPECT_OK(&b, LLAMA, "{\"rope_parameters\":{\"rope_theta\":500000,\"factor\":8,"
		  "\"rope_type\":\"llama3\"}}");
	CHECK(!memcmp(&a.rope, &b.rope, sizeof(a.rope)), "merged spellings");

	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}}");
	CHECK(b.rope.type == K_ROPE_LINEAR && b.rope.factor == 2, "type key");
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":null,\"rope_theta\":\"DEL\"}");
	CHECK(b.rope.type == K_ROPE_DEFAULT && b.rope.theta == 10000, "default rope");
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4}}");
	CHECK(b.rope.type == K_ROPE_YARN && b.rope.original_max_pos == 4096 &&
	      b.rope.beta_fast == 32 && b.rope.beta_slow == 1 && b.rope.mscale == 0 &&
	      b.rope.attention_factor == -1 && b.rope.truncate == 1, "yarn defaults");
	CHECK_NEAR(b.attn_scale, 0.25, 1e-7, "GQA ignores mscale");
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4,"
		  "\"truncate\":false,\"attention_factor\":1.5}}");
	CHECK(!b.rope.truncate && b.rope.attention_factor == 1.5, "yarn options");
	/* No factor: transformers stretches max_position_embeddings over the original. */
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"yarn\",\"factor\":null,"
		  "\"original_max_position_embeddings\":1024}}");
	CHECK(b.rope.factor == 4 && b.rope.original_max_pos == 1024, "yarn derived factor");
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"yarn\","
		  "\"original_max_position_embeddings\":512}}");
	CHECK(b.rope.factor == 8, "yarn factor absent");
	EXPECT_OK(&b, LLAMA, "{\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,"
		  "\"original_max_position_embeddings\":512}}");
	CHECK(b.rope.factor == 2, "explicit yarn factor wins");
	EXPECT_ERR(LLAMA, "{\"max_position_embeddings\":1073741824,\"rope_scaling\":"
		   "{\"type\":\"yarn\",\"original_max_position_embeddings\":1}}", -EINVAL,
		   "rope_scaling.factor: missing", "out of range");

	EXPECT_OK(&b, LLAMA, "{\"dtype\":\"float16\",\"tie_word_embeddings\":true,"
		  "\"bos_token_id\":5,\"eos_token_id\":[7,8,9],\"hidden_size\":128.0}");
	CHECK(b.dtype == K_F16 && b.tie_word_embeddings && b.bos_token_id == 5, "misc");
	CHECK(b.n_eos == 3 && b.eos_token_ids[2] == 9 && b.hidden_size == 128, "eos");
	EXPECT_OK(&b, LLAMA, "{\"torch_dtype\":\"float32\",\"eos_token_id\":2,"
		  "\"head_dim\":32,\"num_key_value_heads\":null}");
	CHECK(b.dtype == K_F32 && b.n_eos == 1 && b.eos_token_ids[0] == 2, "torch_dtype");
	CHECK(a.rope.freq_dtype == K_BF16 && b.rope.freq_dtype == K_F32, "freq_dtype");
	CHECK(b.head_dim == 32 && b.n_kv_heads == 8 && b.rope.dim == 32, "head_dim key");
	EXPECT_OK(&b, LLAMA, "{\"quantization_config\":{\"quant_method\":\"fp8\",\"fmt\":\"e4m3\","
		  "\"weight_block_size\":[128,64]}}");
	CHECK(b.quant.format == MODEL_Q_FP8_BLOCK && b.quant.block_rows == 128 &&
	      b.quant.block_cols == 64 && b.rope.type == K_ROPE_LLAMA3, "fp8 parses");
	EXPECT_OK(&b, LLAMA, "{\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
		  "\"format\":\"pack-quantized\",\"config_groups\":{\"group_0\":{\"weights\":"
		  "{\"type\":\"int\",\"num_bits\":4,\"strategy\":\"group\",\"group_size\":32,"
		  "\"symmetric\":true,\"dynamic\":false}}},\"ignore\":[\"lm_head\"]}}");
	CHECK(b.quant.format == MODEL_Q_INT4_GROUP && b.quant.group_size == 32, "int4 parses");
	EXPECT_OK(&b, LLAMA, "{\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
		  "\"format\":\"float-quantized\",\"config_groups\":{\"g\":{\"weights\":"
		  "{\"type\":\"float\",\"num_bits\":8,\"strategy\":\"channel\",\"symmetric\":true},"
		  "\"input_activations\":{\"dynamic\":true,\"num_bits\":8,\"type\":\"float\"}}}}}");
	CHECK(b.quant.format == MODEL_Q_FP8_CHANNEL && !b.quant.input_scales, "fp8 channel parses");
	EXPECT_OK(&b, LLAMA, "{\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
		  "\"format\":\"float-quantized\",\"config_groups\":{\"g\":{\"weights\":"
		  "{\"type\":\"float\",\"num_bits\":8,\"strategy\":\"tensor\",\"symmetric\":true},"
		  "\"input_activations\":{\"dynamic\":false,\"num_bits\":8,\"type\":\"float\","
		  "\"strategy\":\"tensor\",\"symmetric\":true}}}}}");
	CHECK(b.quant.format == MODEL_Q_FP8_TENSOR && b.quant.input_scales == 1,
	      "fp8 tensor with static input scales parses");
	EXPECT_OK(&b, LLAMA, "{\"quantization_config\":{\"quant_method\":\"fbgemm_fp8\","
		  "\"activation_scale_ub\":1200.0,\"modules_to_not_convert\":[\"lm_head\"]}}");
	CHECK(b.quant.format == MODEL_Q_FP8_CHANNEL && !b.quant.input_scales, "fbgemm_fp8 parses");
}

/* Quantization configs kdec cannot load: one line naming the key and the format. */
static void test_quant_errors(void)
{
	static const char *ct = "{\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
				"\"format\":\"%s\",\"config_groups\":{\"g\":{\"weights\":{%s}%s}}}}";
	char patch[512];

	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fp8\"}}", -EINVAL,
		   "weight_block_size", "fp8 block-scaled");
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":"
		   "[128,0]}}", -EINVAL, "weight_block_size[1]", "fp8 block-scaled");
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fp8\",\"fmt\":\"e5m2\","
		   "\"weight_block_size\":[128,128]}}", -ENOTSUP, "'e5m2'", "e4m3 only");
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fp8\",\"activation_scheme\":"
		   "\"static\",\"weight_block_size\":[128,128]}}", -ENOTSUP, "static", "dynamic only");
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"awq\"}}", -ENOTSUP, "'awq'",
		   "compressed-tensors");
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fbgemm_fp8\","
		   "\"activation_scale_ub\":\"big\"}}", -EINVAL, "activation_scale_ub", NULL);
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"fbgemm_fp8\","
		   "\"modules_to_not_convert\":\"lm_head\"}}", -EINVAL, "modules_to_not_convert", "list");
	snprintf(patch, sizeof(patch), ct, "marlin-24", "\"type\":\"int\"", "");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "'marlin-24'", "pack-quantized");
	snprintf(patch, sizeof(patch), ct, "pack-quantized",
		 "\"type\":\"int\",\"num_bits\":4,\"strategy\":\"group\",\"group_size\":128,"
		 "\"symmetric\":false", "");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "asymmetric", "pack-quantized");
	snprintf(patch, sizeof(patch), ct, "float-quantized",
		 "\"type\":\"float\",\"num_bits\":8,\"strategy\":\"channel\",\"symmetric\":true",
		 ",\"input_activations\":{\"dynamic\":false,\"num_bits\":8}");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "input_activations", "static activation scales");
	snprintf(patch, sizeof(patch), ct, "float-quantized",
		 "\"type\":\"float\",\"num_bits\":8,\"strategy\":\"channel\",\"symmetric\":true",
		 ",\"input_activations\":{\"dynamic\":false,\"num_bits\":8,\"type\":\"float\","
		 "\"strategy\":\"channel\"}");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "strategy channel", "per tensor only");
	snprintf(patch, sizeof(patch), ct, "float-quantized",
		 "\"type\":\"float\",\"num_bits\":8,\"strategy\":\"channel\",\"symmetric\":true",
		 ",\"input_activations\":{\"dynamic\":\"local\"}");
	EXPECT_ERR(LLAMA, patch, -EINVAL, "input_activations.dynamic", NULL);
	snprintf(patch, sizeof(patch), ct, "pack-quantized",
		 "\"type\":\"int\",\"num_bits\":4,\"strategy\":\"group\",\"group_size\":32,"
		 "\"symmetric\":true", ",\"input_activations\":{\"dynamic\":false,\"num_bits\":8,"
		 "\"type\":\"float\",\"strategy\":\"tensor\"}");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "int4 weights", "static activation scales");
	snprintf(patch, sizeof(patch), ct, "float-quantized",
		 "\"type\":\"float\",\"num_bits\":8,\"strategy\":\"block\",\"symmetric\":true", "");
	EXPECT_ERR(LLAMA, patch, -ENOTSUP, "strategy block", "float-quantized");
}

static void test_errors(void)
{
	static const char *required[] = { "vocab_size", "hidden_size", "num_hidden_layers",
					  "num_attention_heads", "intermediate_size",
					  "rms_norm_eps", "model_type" };
	char patch[128];

	for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
		snprintf(patch, sizeof(patch), "{\"%s\":\"DEL\"}", required[i]);
		EXPECT_ERR(LLAMA, patch, -EINVAL, required[i], "missing");
		snprintf(patch, sizeof(patch), "{\"%s\":null}", required[i]);
		EXPECT_ERR(LLAMA, patch, -EINVAL, required[i], "missing");
	}
	EXPECT_ERR(LLAMA, "{\"model_type\":\"mistral\"}", -ENOTSUP, "'mistral'", "supported:");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":\"128\"}", -EINVAL, "hidden_size", "integer");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":128.5}", -EINVAL, "hidden_size", "128.5");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":1e300}", -EINVAL, "hidden_size", NULL);
	EXPECT_ERR(LLAMA, "{\"hidden_size\":true}", -EINVAL, "hidden_size", NULL);
	EXPECT_ERR(LLAMA, "{\"hidden_size\":[128]}", -EINVAL, "hidden_size", "array");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":{\"a\":1}}", -EINVAL, "hidden_size", "object");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":0}", -EINVAL, "hidden_size", "out of range");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":-4}", -EINVAL, "hidden_size", "-4");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":9223372036854775807}", -EINVAL, "hidden_size", NULL);
	EXPECT_ERR(LLAMA, "{\"num_hidden_layers\":2000}", -EINVAL, "num_hidden_layers", "2000");
	EXPECT_ERR(LLAMA, "{\"num_key_value_heads\":3}", -EINVAL, "num_key_value_heads", "3");
	EXPECT_ERR(LLAMA, "{\"hidden_size\":130}", -EINVAL, "hidden_size 130", NULL);
	EXPECT_ERR(LLAMA, "{\"rms_norm_eps\":\"small\"}", -EINVAL, "rms_norm_eps", NULL);
	EXPECT_ERR(LLAMA, "{\"head_dim\":15}", -EINVAL, "head_dim", "even");
	EXPECT_ERR(LLAMA, "{\"dtype\":\"bfloat16\",\"torch_dtype\":\"float16\"}", -EINVAL,
		   "dtype and torch_dtype", "contradictory");
	EXPECT_ERR(LLAMA, "{\"dtype\":\"int8\"}", -ENOTSUP, "dtype", "'int8'");
	EXPECT_ERR(LLAMA, "{\"eos_token_id\":[1,2,3,4,5,6,7,8,9]}", -EINVAL, "eos_token_id",
		   "9 ids");
	EXPECT_ERR(LLAMA, "{\"eos_token_id\":[1,\"x\"]}", -EINVAL, "eos_token_id", NULL);
	EXPECT_ERR(LLAMA, "{\"eos_token_id\":\"x\"}", -EINVAL, "eos_token_id", NULL);
	EXPECT_ERR(LLAMA, "{\"bos_token_id\":-3}", -EINVAL, "bos_token_id", NULL);
	EXPECT_ERR(LLAMA, "{\"attention_bias\":true}", -ENOTSUP, "attention_bias", NULL);
	EXPECT_ERR(LLAMA, "{\"attention_bias\":1}", -EINVAL, "attention_bias", NULL);
	EXPECT_ERR(LLAMA, "{\"hidden_act\":\"gelu\"}", -ENOTSUP, "hidden_act", "'gelu'");
	EXPECT_ERR(LLAMA, "{\"tie_word_embeddings\":\"yes\"}", -EINVAL, "tie_word_embeddings",
		   NULL);
	EXPECT_ERR(LLAMA, "{\"quantization_config\":{\"quant_method\":\"awq\"}}", -ENOTSUP,
		   "quantization_config", "'awq'");
	EXPECT_ERR("[1,2]", NULL, -EINVAL, "JSON object", NULL);

	/* rope */
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":{\"type\":\"linear\",\"rope_type\":\"yarn\","
		   "\"factor\":2}}", -EINVAL, "rope_scaling.rope_type and rope_scaling.type",
		   "contradictory");
	EXPECT_ERR(LLAMA, "{\"rope_parameters\":{\"rope_type\":\"llama3\",\"factor\":4}}",
		   -EINVAL, "rope_parameters.factor and rope_scaling.factor", "contradictory");
	EXPECT_ERR(LLAMA, "{\"rope_parameters\":{\"rope_type\":\"yarn\",\"factor\":8}}",
		   -EINVAL, "rope_parameters and rope_scaling", "contradictory");
	EXPECT_ERR(LLAMA, "{\"rope_parameters\":{\"rope_theta\":10000}}", -EINVAL,
		   "rope_theta and rope_parameters.rope_theta", "contradictory");
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
		   "\"high_freq_factor\":4,\"original_max_position_embeddings\":64}}", -EINVAL,
		   "rope_scaling.low_freq_factor", "missing");
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":{\"rope_type\":\"linear\"}}", -EINVAL,
		   "rope_scaling.factor", "missing");
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":\"4\"}}",
		   -EINVAL, "rope_scaling.factor", NULL);
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2}}", -ENOTSUP,
		   "rope_scaling.rope_type", "'dynamic'");
	EXPECT_ERR(LLAMA, "{\"rope_scaling\":[1]}", -EINVAL, "rope_scaling", NULL);
	EXPECT_ERR(LLAMA, "{\"partial_rotary_factor\":0.5}", -ENOTSUP, "partial_rotary_factor",
		   NULL);
}

static void test_qwen(void)
{
	struct model_config c;

	EXPECT_OK(&c, LLAMA, "{\"model_type\":\"qwen3\",\"head_dim\":64,"
		  "\"rope_scaling\":null}");
	CHECK(c.arch == ARCH_QWEN3 && c.qk_norm && c.head_dim == 64, "qwen3");
	CHECK_NEAR(c.attn_scale, 0.125, 1e-7, "qwen3 scale");

	EXPECT_OK(&c, QWEN3_MOE, NULL);
	CHECK(c.arch == ARCH_QWEN3_MOE && c.qk_norm && c.n_experts == 8 && c.top_k == 2, "moe");
	CHECK(c.route.n_experts == 8 && c.route.top_k == 2 && c.route.norm_topk_prob &&
	      c.route.scoring == K_MOE_SOFTMAX && c.route.select == K_MOE_GREEDY &&
	      c.route.n_group == 1 && c.route.topk_group == 1 && c.route.routed_scaling == 1 &&
	      !c.route.bias, "route");
	CHECK(c.moe_intermediate_size == 64 && c.intermediate_size == 0, "widths");
	for (int l = 0; l < 4; l++)
		CHECK(model_config_layer_is_moe(&c, l), "layer %d moe", l);
	CHECK(!model_config_layer_is_moe(&c, 4) && !model_config_layer_is_moe(&c, -1), "range");
	EXPECT_OK(&c, QWEN3_MOE, "{\"num_experts\":\"DEL\",\"num_local_experts\":8,"
		  "\"norm_topk_prob\":\"DEL\"}");
	CHECK(c.n_experts == 8 && !c.route.norm_topk_prob, "alias, norm default false");
	EXPECT_OK(&c, QWEN3_MOE, "{\"num_local_experts\":8.0}");
	EXPECT_OK(&c, QWEN3_MOE, "{\"intermediate_size\":256,\"mlp_only_layers\":[0,3],"
		  "\"decoder_sparse_step\":1}");
	CHECK(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1) &&
	      model_config_layer_is_moe(&c, 2) && !model_config_layer_is_moe(&c, 3), "mlp_only");
	EXPECT_OK(&c, QWEN3_MOE, "{\"intermediate_size\":256,\"decoder_sparse_step\":2}");
	CHECK(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1) &&
	      !model_config_layer_is_moe(&c, 2) && model_config_layer_is_moe(&c, 3), "step");

	EXPECT_ERR(QWEN3_MOE, "{\"num_local_experts\":16}", -EINVAL,
		   "num_experts and num_local_experts", "contradictory");
	EXPECT_ERR(QWEN3_MOE, "{\"mlp_only_layers\":[1]}", -EINVAL, "intermediate_size",
		   "missing");
	EXPECT_ERR(QWEN3_MOE, "{\"mlp_only_layers\":[4]}", -EINVAL, "mlp_only_layers", "4");
	EXPECT_ERR(QWEN3_MOE, "{\"mlp_only_layers\":[\"a\"]}", -EINVAL, "mlp_only_layers",
		   NULL);
	EXPECT_ERR(QWEN3_MOE, "{\"num_experts_per_tok\":9}", -EINVAL, "num_experts_per_tok",
		   "9");
	EXPECT_ERR(QWEN3_MOE, "{\"moe_intermediate_size\":\"DEL\"}", -EINVAL,
		   "moe_intermediate_size", "missing");
	EXPECT_ERR(QWEN3_MOE, "{\"num_experts\":\"DEL\"}", -EINVAL, "num_experts", "missing");
}

static void test_deepseek(void)
{
	struct model_config c;
	double m, want;

	EXPECT_OK(&c, DSV2, NULL);
	CHECK(c.arch == ARCH_DEEPSEEK_V2 && c.mla && c.q_lora_rank == 0, "v2");
	CHECK(c.kv_lora_rank == 32 && c.head_dim == 48 && c.n_kv_heads == 4, "v2 dims");
	CHECK(c.rope.dim == 16 && c.rope.interleaved && c.rope.type == K_ROPE_DEFAULT, "rope");
	CHECK(c.route.scoring == K_MOE_SOFTMAX && c.route.select == K_MOE_GREEDY &&
	      !c.route.norm_topk_prob && c.n_shared_experts == 2, "v2 route");
	CHECK(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1), "dense 0");
	CHECK_NEAR(c.attn_scale, 1 / sqrt(48.0), 1e-7, "v2 scale");
	/* transformers' V2 router ignores norm_topk_prob but always scales. */
	EXPECT_OK(&c, DSV2, "{\"norm_topk_prob\":true,\"routed_scaling_factor\":16}");
	CHECK(!c.route.norm_topk_prob && c.route.routed_scaling == 16, "v2 no renorm");
	EXPECT_OK(&c, DSV2, "{\"topk_method\":\"group_limited_greedy\",\"n_group\":4,"
		  "\"topk_group\":2,\"moe_layer_freq\":2,\"first_k_dense_replace\":0}");
	CHECK(c.route.select == K_MOE_GROUP_MAX && c.route.n_group == 4 &&
	      c.route.topk_group == 2, "group max");
	CHECK(model_config_layer_is_moe(&c, 0) && !model_config_layer_is_moe(&c, 1) &&
	      model_config_layer_is_moe(&c, 2), "freq");
	EXPECT_OK(&c, DSV2, "{\"n_routed_experts\":null,\"n_shared_experts\":\"DEL\"}");
	CHECK(c.n_experts == 0 && !model_config_layer_is_moe(&c, 1), "dense v2");
	EXPECT_ERR(DSV2, "{\"topk_method\":\"group_limited_greedy\"}", -EINVAL, "n_group",
		   "missing");
	EXPECT_ERR(DSV2, "{\"topk_method\":\"group_limited_greedy\",\"n_group\":3,"
		   "\"topk_group\":1}", -EINVAL, "n_group", "3");
	EXPECT_ERR(DSV2, "{\"scoring_func\":\"sigmoid\"}", -ENOTSUP, "scoring_func", NULL);
	EXPECT_ERR(DSV2, "{\"n_shared_experts\":\"DEL\"}", -EINVAL, "n_shared_experts", NULL);
	EXPECT_ERR(DSV2, "{\"kv_lora_rank\":\"DEL\"}", -EINVAL, "kv_lora_rank", "missing");
	EXPECT_ERR(DSV2, "{\"qk_rope_head_dim\":15}", -EINVAL, "qk_rope_head_dim", NULL);

	EXPECT_OK(&c, DSV3, NULL);
	CHECK(c.arch == ARCH_DEEPSEEK_V3 && c.q_lora_rank == 64 && c.rope.interleaved, "v3");
	CHECK(c.route.scoring == K_MOE_SIGMOID && c.route.select == K_MOE_GROUP_TOP2 &&
	      c.route.norm_topk_prob && c.route.n_group == 4 && c.route.topk_group == 2, "v3 r");
	CHECK_NEAR(c.route.routed_scaling, 2.5, 0, "routed scaling");
	CHECK(c.rope.type == K_ROPE_YARN && c.rope.factor == 4 && c.rope.mscale == 1 &&
	      c.rope.mscale_all_dim == 1 && c.rope.original_max_pos == 64, "v3 yarn");
	m = 0.1 * log(4.0) + 1;
	want = 1 / sqrt(48.0) * m * m;
	CHECK_NEAR(c.attn_scale, want, 1e-7, "v3 scale");
	EXPECT_OK(&c, DSV3, "{\"rope_interleave\":false,\"n_group\":\"DEL\","
		  "\"topk_group\":\"DEL\",\"n_shared_experts\":\"DEL\","
		  "\"routed_scaling_factor\":\"DEL\",\"norm_topk_prob\":false}");
	CHECK(!c.rope.interleaved && c.route.n_group == 1 && c.route.topk_group == 1 &&
	      c.n_shared_experts == 1 && c.route.routed_scaling == 1 &&
	      !c.route.norm_topk_prob, "v3 defaults");
	EXPECT_OK(&c, DSV3, "{\"model_type\":\"kimi_k2\"}");
	CHECK(c.arch == ARCH_KIMI_K2 && c.route.select == K_MOE_GROUP_TOP2, "kimi");
	EXPECT_ERR(DSV3, "{\"topk_method\":\"greedy\"}", -ENOTSUP, "topk_method", "'greedy'");
	EXPECT_ERR(DSV3, "{\"scoring_func\":\"softmax\"}", -ENOTSUP, "scoring_func", NULL);
	EXPECT_ERR(DSV3, "{\"topk_group\":5}", -EINVAL, "topk_group", "5");
	EXPECT_ERR(DSV3, "{\"num_experts_per_tok\":9}", -EINVAL, "num_experts_per_tok", "9");
	EXPECT_ERR(DSV3, "{\"n_group\":16}", -EINVAL, "n_group", "16");
	EXPECT_ERR(DSV3, "{\"n_routed_experts\":\"DEL\"}", -EINVAL, "n_routed_experts",
		   "missing");
}

static int parse_real(struct model_config *c, const char *name)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	char path[1024];
	size_t len;
	char *text;
	int rc;

	snprintf(path, sizeof(path), "%s/tests/data/configs/%s", top, name);
	text = test_slurp(path, &len);
	CHECK(text, "cannot read %s", path);
	if (!text)
		return -ENOENT;
	rc = model_config_parse(c, text, len, err, sizeof(err));
	free(text);
	return rc;
}

static void test_real(void)
{
	static const char *golden[] = { "llama3", "qwen3", "qwen3_moe", "deepseek_v2",
					"deepseek_v3" };
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	struct model_config c;
	char dir[1024];
	double m;
	int rc;

	rc = parse_real(&c, "llama3.1-8b.json");
	CHECK(rc == 0 && !c.quant.format && c.rope.type == K_ROPE_LLAMA3 && c.rope.factor == 8 &&
	      c.rope.original_max_pos == 8192 && c.head_dim == 128 && c.n_kv_heads == 8,
	      "llama3.1-8b: %s", err);
	rc = parse_real(&c, "llama3.1-70b.json");
	CHECK(rc == 0 && c.n_layers == 80 && c.hidden_size == 8192, "70b: %s", err);
	rc = parse_real(&c, "qwen3-8b.json");
	CHECK(rc == 0 && c.qk_norm && c.rope.theta == 1e6 && c.rope.type == K_ROPE_DEFAULT,
	      "qwen3-8b: %s", err);
	rc = parse_real(&c, "qwen3-30b-a3b.json");
	CHECK(rc == 0 && c.n_experts == 128 && c.top_k == 8 && c.head_dim == 128 &&
	      c.n_kv_heads == 4 && c.route.norm_topk_prob, "qwen3-30b: %s", err);
	rc = parse_real(&c, "deepseek-v2-lite.json");
	CHECK(rc == 0 && c.q_lora_rank == 0 && c.kv_lora_rank == 512 && c.n_experts == 64 &&
	      c.top_k == 6 && c.n_shared_experts == 2 && c.first_k_dense == 1, "v2-lite: %s",
	      err);
	m = 0.1 * 0.707 * log(40.0) + 1;
	CHECK_NEAR(c.attn_scale, m * m / sqrt(192.0), 1e-7, "v2-lite scale");
	CHECK_NEAR(c.rope.mscale, 0.707, 0, "v2-lite mscale");

	/* the published fp8 configs: 128x128 block scales */
	rc = parse_real(&c, "deepseek-v3.json");
	CHECK(rc == 0 && c.quant.format == MODEL_Q_FP8_BLOCK && c.quant.block_rows == 128 &&
	      c.quant.block_cols == 128, "v3: rc %d %s", rc, err);
	m = 0.1 * log(40.0) + 1;
	CHECK_NEAR(c.attn_scale, m * m / sqrt(192.0), 1e-7, "v3 scale");
	CHECK(c.rope.type == K_ROPE_YARN && c.rope.factor == 40 && c.rope.beta_fast == 32 &&
	      c.rope.beta_slow == 1 && c.rope.original_max_pos == 4096 && c.rope.dim == 64 &&
	      c.rope.interleaved && c.rope.theta == 10000, "v3 yarn");
	CHECK(c.n_experts == 256 && c.route.n_group == 8 && c.route.topk_group == 4 &&
	      c.first_k_dense == 3 && c.q_lora_rank == 1536 && c.n_heads == 128, "v3 moe");
	CHECK_NEAR(c.route.routed_scaling, 2.5, 0, "v3 routed");
	CHECK(!model_config_layer_is_moe(&c, 2) && model_config_layer_is_moe(&c, 3) &&
	      model_config_layer_is_moe(&c, 60), "v3 layers");
	rc = parse_real(&c, "kimi-k2.json");
	CHECK(rc == 0 && c.quant.format == MODEL_Q_FP8_BLOCK, "kimi: rc %d %s", rc, err);
	CHECK(c.arch == ARCH_KIMI_K2 && c.n_experts == 384 && c.n_heads == 64 &&
	      c.rope.theta == 50000 && c.rope.factor == 32 && c.rope.beta_fast == 1, "kimi");
	CHECK_NEAR(c.route.routed_scaling, 2.827, 1e-6, "kimi routed");

	for (size_t i = 0; i < sizeof(golden) / sizeof(golden[0]); i++) {
		snprintf(dir, sizeof(dir), "%s/tests/data/golden/%s", top, golden[i]);
		rc = model_config_load(&c, dir, err, sizeof(err));
		CHECK(rc == 0, "%s: %s", dir, err);
	}
	snprintf(dir, sizeof(dir), "%s/tests/data/golden/qwen3", top);
	if (!model_config_load(&c, dir, err, sizeof(err)))
		CHECK(c.tie_word_embeddings && c.n_eos == 0 && c.bos_token_id == -1, "qwen3 golden");
	rc = model_config_load(&c, "/nonexistent", err, sizeof(err));
	CHECK(rc == -ENOENT && strstr(err, "/nonexistent/config.json"), "load: %s", err);
}

static void test_garbage(void)
{
	static const char *bad[] = { "", "{", "nul\0l", "{\"model_type\":\"llama\"", "1",
				     "{\"a\":1,\"a\":2}", "\"str\"" };
	struct model_config c;
	char big[64];
	int rc;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		rc = model_config_parse(&c, bad[i], strlen(bad[i]), err, sizeof(err));
		CHECK(rc == -EINVAL && !strchr(err, '\n'), "garbage %zu: %d %s", i, rc, err);
	}
	/* Not NUL-terminated: parse only len bytes. */
	memset(big, 'x', sizeof(big));
	memcpy(big, "{}", 2);
	rc = model_config_parse(&c, big, 2, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "model_type"), "len honoured: %s", err);
	rc = model_config_parse(&c, "{}", 2, NULL, 0);
	CHECK(rc == -EINVAL, "NULL err buffer");
	CHECK(!strcmp(model_arch_name(ARCH_KIMI_K2), "kimi_k2"), "arch name");
}

int main(void)
{
	test_llama();
	test_errors();
	test_quant_errors();
	test_qwen();
	test_deepseek();
	test_real();
	test_garbage();
	return test_result("test_config");
}
