/* Quantized checkpoints (tests/data/quant, contrib/make_quant_reference.py): the exact
 * dequantization (e4m3 decode, int4 nibble order and offset, scale indexing), that the
 * published layouts load with their weights kept quantized, and that every malformed
 * scale is refused at load with one line naming the tensor and the format: a scale
 * missing, of the wrong shape, dtype or block size, NaN or inf, a packed shape or
 * weight_shape that disagrees, fp8 without a quantization_config, scales beside an
 * unquantized weight, a W8A8 checkpoint's static input scale missing or not > 0. The bad checkpoints are rewritten from the good ones here. */
#include <errno.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/model/model.h"
#include "kernels/quant.h"
#include "tests/testutil.h"

static char err[1024];
static const char *top = ".";

/* ---- the dequantization itself ------------------------------------------- */

static void test_e4m3(void)
{
	int finite = 0;

	CHECK(k_e4m3_to_f32(0x00) == 0.0f && signbit(k_e4m3_to_f32(0x80)), "zeros");
	CHECK(k_e4m3_to_f32(0x7e) == 448.0f && k_e4m3_to_f32(0xfe) == -448.0f, "max 448");
	CHECK(k_e4m3_to_f32(0x38) == 1.0f && k_e4m3_to_f32(0x3c) == 1.5f, "1, 1.5");
	CHECK(k_e4m3_to_f32(0x08) == 0x1p-6f && k_e4m3_to_f32(0x01) == 0x1p-9f &&
	      k_e4m3_to_f32(0x07) == 7 * 0x1p-9f, "subnormals");
	CHECK(isnan(k_e4m3_to_f32(0x7f)) && isnan(k_e4m3_to_f32(0xff)), "NaN");
	/* every other byte: finite, and increasing over the positive codes */
	for (int b = 1; b < 0x7f; b++) {
		finite += isfinite(k_e4m3_to_f32((uint8_t)b));
		CHECK(k_e4m3_to_f32((uint8_t)b) > k_e4m3_to_f32((uint8_t)(b - 1)), "order at %#x", b);
		CHECK(k_e4m3_to_f32((uint8_t)(b | 0x80)) == -k_e4m3_to_f32((uint8_t)b), "sign %#x", b);
	}
	CHECK(finite == 126, "%d finite positive codes", finite);
	/* the encoder: every code back to itself, midpoints to the even neighbour,
	 * saturation at 448, NaN kept */
	for (int b = 0; b < 0x7f; b++) {
		float v = k_e4m3_to_f32((uint8_t)b), next = k_e4m3_to_f32((uint8_t)(b + 1));

		CHECK(k_f32_to_e4m3(v) == b && k_f32_to_e4m3(-v) == (b | 0x80), "encode %#x", b);
		if (b + 1 < 0x7f) {
			float mid = (v + next) / 2;	/* exact: both share a quantum or v is 0 */
			int even = b & 1 ? b + 1 : b;

			CHECK(k_f32_to_e4m3(mid) == even, "midpoint of %#x: %#x", b, k_f32_to_e4m3(mid));
			CHECK(k_f32_to_e4m3(nextafterf(mid, 0)) == b &&
			      k_f32_to_e4m3(nextafterf(mid, 1000)) == b + 1, "around the midpoint of %#x", b);
		}
	}
	CHECK(k_f32_to_e4m3(448.0f) == 0x7e && k_f32_to_e4m3(470.0f) == 0x7e &&
	      k_f32_to_e4m3(-1e30f) == 0xfe && k_f32_to_e4m3(INFINITY) == 0x7e, "saturation");
	CHECK(k_f32_to_e4m3(NAN) == 0x7f && k_f32_to_e4m3(0x1p-11f) == 0 &&
	      k_f32_to_e4m3(0x1p-10f) == 0 && k_f32_to_e4m3(0x1.8p-10f) == 1, "NaN, underflow");
}

static void test_dequant(void)
{
	/* int4, one row of 16 (two words), groups of 8: nibble i of word w is column 8w + i */
	uint32_t words[2] = { 0x76543210u, 0xfedcba98u };
	uint16_t scales[2] = { k_f32_to_bf16(0.5f), k_f32_to_bf16(-2.0f) };
	struct k_quant q = { .fmt = K_Q_INT4, .scale = scales, .scale_dtype = K_BF16,
			     .block_rows = 1, .block_cols = 8, .scale_cols = 2 };
	/* fp8 block 2x2 of a 3x3 weight: the last row and column are partial blocks */
	uint8_t w8[9] = { 0x38, 0x40, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0xb8 };
	float s8[4] = { 1, 2, 3, 4 };
	struct k_quant q8 = { .fmt = K_Q_FP8, .scale = s8, .scale_dtype = K_F32, .block_rows = 2,
			      .block_cols = 2, .scale_cols = 2 };
	float v[16];

	k_quant_row_to_f32(v, words, &q, 16, 0, 0, 16);
	for (int k = 0; k < 16; k++)
		CHECK(v[k] == (float)(k - 8) * (k < 8 ? 0.5f : -2.0f), "int4 col %d: %g", k, (double)v[k]);
	k_quant_row_to_f32(v, words, &q, 16, 0, 5, 6);
	CHECK(v[0] == -1.5f && v[5] == -4.0f, "int4 from column 5: %g %g", (double)v[0], (double)v[5]);
	k_quant_row_to_f32(v, w8, &q8, 3, 0, 0, 3);
	CHECK(v[0] == 1 && v[1] == 2 && v[2] == 2, "fp8 row 0: %g %g %g", (double)v[0], (double)v[1], (double)v[2]);
	k_quant_row_to_f32(v, w8, &q8, 3, 2, 0, 3);
	CHECK(v[0] == 3 && v[1] == 3 && v[2] == -4, "fp8 row 2: %g %g %g", (double)v[0], (double)v[1], (double)v[2]);
	CHECK(k_quant_bytes(&q8, 3, 3) == 9 + 16 && k_quant_bytes(&q, 1, 16) == 8 + 4, "bytes");
}

/* ---- checkpoints rewritten ------------------------------------------------- */

struct tensor {
	char name[160];
	char dtype[16];
	int ndim;
	int64_t shape[4];
	unsigned char *data;
	size_t n;
};

struct ckpt {
	struct tensor t[512];
	int n;
};

static int read_ckpt(struct ckpt *c, const char *path)
{
	FILE *f = fopen(path, "rb");
	uint64_t hlen;
	char *h;
	json_t *root, *v;
	const char *key;
	long size;

	c->n = 0;
	if (!f)
		return -1;
	fseek(f, 0, SEEK_END);
	size = ftell(f);
	fseek(f, 0, SEEK_SET);
	if (fread(&hlen, 8, 1, f) != 1 || (long)hlen > size)
		return fclose(f), -1;
	h = malloc(hlen + 1);
	if (fread(h, 1, hlen, f) != hlen)
		return free(h), fclose(f), -1;
	root = json_loadb(h, hlen, 0, NULL);
	free(h);
	json_object_foreach(root, key, v) {
		struct tensor *t;
		json_t *off = json_object_get(v, "data_offsets"), *sh = json_object_get(v, "shape");
		long b, e;

		if (!strcmp(key, "__metadata__") || c->n >= 512)
			continue;
		t = &c->t[c->n++];
		snprintf(t->name, sizeof(t->name), "%s", key);
		snprintf(t->dtype, sizeof(t->dtype), "%s", json_string_value(json_object_get(v, "dtype")));
		t->ndim = (int)json_array_size(sh);
		for (int i = 0; i < t->ndim && i < 4; i++)
			t->shape[i] = json_integer_value(json_array_get(sh, (size_t)i));
		b = (long)json_integer_value(json_array_get(off, 0));
		e = (long)json_integer_value(json_array_get(off, 1));
		t->n = (size_t)(e - b);
		t->data = malloc(t->n + 1);
		fseek(f, 8 + (long)hlen + b, SEEK_SET);
		if (fread(t->data, 1, t->n, f) != t->n)
			t->n = 0;
	}
	json_decref(root);
	fclose(f);
	return 0;
}

static void free_ckpt(struct ckpt *c)
{
	for (int i = 0; i < c->n; i++)
		free(c->t[i].data);
	c->n = 0;
}

static void write_ckpt(const struct ckpt *c, const char *path)
{
	json_t *root = json_object();
	size_t off = 0;
	char *h;
	uint64_t hlen;
	FILE *f;

	for (int i = 0; i < c->n; i++) {
		const struct tensor *t = &c->t[i];
		json_t *sh;

		if (!t->name[0])
			continue;
		sh = json_array();
		for (int d = 0; d < t->ndim; d++)
			json_array_append_new(sh, json_integer(t->shape[d]));
		json_object_set_new(root, t->name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype,
							     "shape", sh, "data_offsets", (json_int_t)off,
							     (json_int_t)(off + t->n)));
		off += t->n;
	}
	h = json_dumps(root, JSON_COMPACT);
	hlen = strlen(h);
	f = fopen(path, "wb");
	fwrite(&hlen, 8, 1, f);
	fwrite(h, 1, hlen, f);
	for (int i = 0; i < c->n; i++)
		if (c->t[i].name[0])
			fwrite(c->t[i].data, 1, c->t[i].n, f);
	fclose(f);
	free(h);
	json_decref(root);
}

static struct tensor *find(struct ckpt *c, const char *name)
{
	for (int i = 0; i < c->n; i++)
		if (!strcmp(c->t[i].name, name))
			return &c->t[i];
	return NULL;
}

static char dir[64];

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st, (void)flag, (void)ftw;
	return remove(path);
}

/* The model folder `name` into dir: its config.json with the first `from` replaced by
 * `to` (from NULL: as is), its single weight file rewritten from c. */
static void stage(const char *name, const struct ckpt *c, const char *from, const char *to)
{
	char src[512], dst[512];
	FILE *f;
	char cfg[16384];
	size_t n;
	char *p;

	snprintf(src, sizeof(src), "%s/tests/data/quant/%s/config.json", top, name);
	f = fopen(src, "r");
	n = f ? fread(cfg, 1, sizeof(cfg) - 1, f) : 0;
	if (f)
		fclose(f);
	cfg[n] = '\0';
	snprintf(dst, sizeof(dst), "%s/config.json", dir);
	f = fopen(dst, "w");
	if (from && (p = strstr(cfg, from))) {
		fwrite(cfg, 1, (size_t)(p - cfg), f);
		fputs(to, f);
		fputs(p + strlen(from), f);
	} else {
		CHECK(!from, "%s: config has no '%s'", name, from);
		fputs(cfg, f);
	}
	fclose(f);
	snprintf(dst, sizeof(dst), "%s/model.safetensors", dir);
	write_ckpt(c, dst);
}

static void expect_load(const char *what, int want_ok, const char *want1, const char *want2)
{
	struct model *m = NULL;
	int rc = model_load(&m, dir, NULL, err, sizeof(err));

	if (want_ok) {
		CHECK(rc == 0, "%s: should load: %s", what, err);
	} else {
		CHECK(rc < 0, "%s: loaded, should be refused", what);
		CHECK(!strchr(err, '\n') && err[0], "%s: not one line: '%s'", what, err);
		CHECK(!want1 || strstr(err, want1), "%s: '%s' lacks '%s'", what, err, want1);
		CHECK(!want2 || strstr(err, want2), "%s: '%s' lacks '%s'", what, err, want2);
		if (rc < 0)
			fprintf(stderr, "  refused (%s): %s\n", what, err);
	}
	model_destroy(m);
}

/* The tensors of the good checkpoint of `model` into c, for a test to change. */
static int load_good(struct ckpt *c, const char *model)
{
	char path[512];

	snprintf(path, sizeof(path), "%s/tests/data/quant/%s/model.safetensors", top, model);
	if (read_ckpt(c, path)) {
		CHECK(0, "%s: cannot read", path);
		return -1;
	}
	return 0;
}

static void set_f32(struct tensor *t, size_t i, float v)
{
	if (!strcmp(t->dtype, "F32")) {
		memcpy(t->data + 4 * i, &v, 4);
	} else {
		uint16_t h = k_f32_to_bf16(v);

		memcpy(t->data + 2 * i, &h, 2);
	}
}

#define L0 "model.layers.0."

/* Element i of scale tensor t set to v, the checkpoint of model staged and refused. */
static void expect_bad_scale(const char *model, const struct ckpt *c, struct tensor *t, size_t i,
			     float v, const char *what, const char *want1, const char *want2)
{
	set_f32(t, i, v);
	stage(model, c, NULL, NULL);
	expect_load(what, 0, want1, want2);
}

static void test_fp8_block(void)
{
	static struct ckpt c;
	struct model *m = NULL;
	struct tensor *t;
	char path[512];
	int rc;

	snprintf(path, sizeof(path), "%s/tests/data/quant/llama_fp8_block", top);
	rc = model_load(&m, path, NULL, err, sizeof(err));
	CHECK(rc == 0, "llama_fp8_block: %s", err);
	if (m) {
		const struct model_tensor *d = &m->layers[0].w_down;

		CHECK(d->q.fmt == K_Q_FP8 && d->q.block_rows == 128 && d->q.scale_cols == 2 &&
		      d->q.scale_dtype == K_F32, "down_proj kept fp8, 2 blocks along K");
		CHECK(m->lm_head.q.fmt == K_Q_NONE && m->lm_head.dtype == K_BF16, "lm_head stays bf16");
	}
	model_destroy(m);
	if (load_good(&c, "llama_fp8_block"))
		return;
	stage("llama_fp8_block", &c, NULL, NULL);
	expect_load("fp8 block, rewritten unchanged", 1, NULL, NULL);

	t = find(&c, L0 "mlp.down_proj.weight_scale_inv");
	t->name[0] = '\0';		/* missing */
	stage("llama_fp8_block", &c, NULL, NULL);
	expect_load("scale missing", 0, "mlp.down_proj.weight_scale_inv' is missing", "fp8-block");
	snprintf(t->name, sizeof(t->name), L0 "mlp.down_proj.weight_scale_inv");

	stage("llama_fp8_block", &c, "\"weight_block_size\"",
	      "\"weight_block_size\": [64, 64], \"published_block_size\"");
	expect_load("wrong block size", 0, "expected [3, 2] for weight [144, 96]", "fp8-block");

	t->shape[1] = 1, t->shape[0] = 2, t->n = 8;	/* wrong shape */
	stage("llama_fp8_block", &c, NULL, NULL);
	expect_load("scale shape", 0, "shape [2, 1], expected [1, 2]", "down_proj.weight_scale_inv");
	t->shape[0] = 1, t->shape[1] = 2;

	expect_bad_scale("llama_fp8_block", &c, t, 1, NAN, "NaN scale", "is nan, not finite", "fp8-block");
	expect_bad_scale("llama_fp8_block", &c, t, 1, INFINITY, "inf scale", "is inf, not finite",
			 "down_proj.weight_scale_inv");
	set_f32(t, 1, 0.01f);

	snprintf(t->dtype, sizeof(t->dtype), "I32");
	stage("llama_fp8_block", &c, NULL, NULL);
	expect_load("scale dtype", 0, "dtype I32, expected F32", "fp8-block");
	snprintf(t->dtype, sizeof(t->dtype), "F32");

	stage("llama_fp8_block", &c, "\"quant_method\": \"fp8\"", "\"quant_method\": \"fp8\", \"x\": 1");
	expect_load("an unknown key is fine", 1, NULL, NULL);
	free_ckpt(&c);
}

static void test_fp8_plain_and_strays(void)
{
	static struct ckpt c;
	struct tensor *t, *s;

	if (load_good(&c, "llama_fp8_channel"))
		return;
	stage("llama_fp8_channel", &c, NULL, NULL);
	expect_load("fp8 channel, rewritten unchanged", 1, NULL, NULL);
	t = find(&c, L0 "self_attn.q_proj.weight_scale");
	CHECK(t && t->ndim == 2 && t->shape[1] == 1, "channel scale (N, 1)");
	if (!t)
		return free_ckpt(&c);
	t->shape[0] -= 1, t->n -= 2;
	stage("llama_fp8_channel", &c, NULL, NULL);
	expect_load("channel scale rows", 0, "q_proj.weight_scale", "fp8-channel");
	t->shape[0] += 1, t->n += 2;

	/* fp8 weights under a config that does not say how they are scaled */
	stage("llama_fp8_channel", &c, "\"quantization_config\"", "\"no_quantization_config\"");
	expect_load("fp8 without quantization_config", 0, "F8_E4M3", "quantization_config");

	/* a bf16 weight (an ignored module) with scales beside it */
	s = find(&c, "lm_head.weight");
	CHECK(s && !strcmp(s->dtype, "BF16"), "lm_head stored bf16");
	if (s && c.n < 512) {
		struct tensor *x = &c.t[c.n++];

		*x = *t;
		x->data = malloc(t->n);
		memcpy(x->data, t->data, t->n);
		snprintf(x->name, sizeof(x->name), "lm_head.weight_scale");
	}
	stage("llama_fp8_channel", &c, NULL, NULL);
	expect_load("scale beside bf16", 0, "lm_head.weight_scale", "not quantized");
	free_ckpt(&c);
}

/* Meta's fbgemm_fp8 (Llama-3.1-405B-Instruct-FP8): the fp8-channel layout under another
 * quantization_config; the fp8-channel checkpoint relabelled so loads the same values. */
static void test_fp8_fbgemm(void)
{
	static struct ckpt c;
	struct model *a = NULL, *b = NULL;
	char path[512];
	float ra[512], rb[512];
	int same = 1;

	snprintf(path, sizeof(path), "%s/tests/data/quant/llama_fp8_channel", top);
	CHECK(model_load(&a, path, NULL, err, sizeof(err)) == 0, "llama_fp8_channel: %s", err);
	if (load_good(&c, "llama_fp8_channel"))
		return model_destroy(a);
	stage("llama_fp8_channel", &c, "\"quantization_config\"",
	      "\"quantization_config\": {\"quant_method\": \"fbgemm_fp8\", \"activation_scale_ub\": "
	      "1200.0, \"modules_to_not_convert\": [\"lm_head\"]}, \"compressed_tensors_config\"");
	CHECK(model_load(&b, dir, NULL, err, sizeof(err)) == 0, "fbgemm_fp8: %s", err);
	if (a && b) {
		const struct model_tensor *x = &a->layers[1].w_down, *y = &b->layers[1].w_down;

		CHECK(b->cfg.quant.format == MODEL_Q_FP8_CHANNEL && y->q.fmt == K_Q_FP8 &&
		      y->q.block_rows == 1 && y->q.block_cols == y->cols && y->cols <= 512,
		      "fbgemm_fp8: per-row fp8");
		for (int64_t r = 0; r < x->rows && y->cols <= 512; r++) {
			k_quant_row_to_f32(ra, x->data, &x->q, x->cols, r, 0, x->cols);
			k_quant_row_to_f32(rb, y->data, &y->q, y->cols, r, 0, y->cols);
			same &= !memcmp(ra, rb, sizeof(float) * (size_t)x->cols);
		}
		CHECK(same, "fbgemm_fp8: down_proj dequantizes as fp8-channel");
	}
	model_destroy(a);
	model_destroy(b);
	stage("llama_fp8_channel", &c, "\"quantization_config\"",
	      "\"quantization_config\": {\"quant_method\": \"fbgemm_fp8\", \"activation_scale_ub\": "
	      "-3}, \"compressed_tensors_config\"");
	expect_load("fbgemm_fp8 negative activation_scale_ub", 0, "activation_scale_ub", "-3");
	free_ckpt(&c);
}

/* W8A8 static checkpoints: every quantized linear's input_scale present, one value,
 * finite and > 0 (checked, not applied: the reference computes W8A16 too). */
static void test_fp8_static_inputs(void)
{
	static struct ckpt c;
	struct tensor *t;

	if (load_good(&c, "llama_fp8_tensor_static"))
		return;
	stage("llama_fp8_tensor_static", &c, NULL, NULL);
	expect_load("fp8 tensor with static input scales, rewritten unchanged", 1, NULL, NULL);
	t = find(&c, L0 "mlp.up_proj.input_scale");
	CHECK(t && !strcmp(t->dtype, "BF16") && t->ndim == 1 && t->shape[0] == 1,
	      "input_scale bf16 [1]");
	if (!t)
		return free_ckpt(&c);
	t->name[0] = '\0';
	stage("llama_fp8_tensor_static", &c, NULL, NULL);
	expect_load("input_scale missing", 0, "up_proj.input_scale' is missing", "fp8-tensor");
	snprintf(t->name, sizeof(t->name), L0 "mlp.up_proj.input_scale");
	expect_bad_scale("llama_fp8_tensor_static", &c, t, 0, 0.0f, "input_scale zero",
			 "up_proj.input_scale' is 0, expected a value > 0", "static input scales");
	expect_bad_scale("llama_fp8_tensor_static", &c, t, 0, -0.5f, "input_scale negative",
			 "is -0.5, expected a value > 0", "fp8-tensor");
	expect_bad_scale("llama_fp8_tensor_static", &c, t, 0, NAN, "input_scale NaN",
			 "up_proj.input_scale': scale 0", "not finite");
	set_f32(t, 0, 0.01f);
	t->ndim = 2, t->shape[0] = 1, t->shape[1] = 1;	/* [1, 1]: one value, fine */
	stage("llama_fp8_tensor_static", &c, NULL, NULL);
	expect_load("input_scale [1, 1]", 1, NULL, NULL);
	/* without the config's static input_activations the same files load: an
	 * input_scale nobody asked for is a tensor kdec does not use */
	stage("llama_fp8_tensor_static", &c, "\"dynamic\": false", "\"dynamic\": true");
	expect_load("input_scale beside dynamic input activations", 1, NULL, NULL);
	free_ckpt(&c);
}

static void test_int4(void)
{
	static struct ckpt c;
	struct tensor *sh, *p, *s;
	struct model *m = NULL;
	char path[512];
	int64_t v;

	snprintf(path, sizeof(path), "%s/tests/data/quant/kimi_k2_int4", top);
	CHECK(model_load(&m, path, NULL, err, sizeof(err)) == 0, "kimi_k2_int4 (sharded): %s", err);
	if (m) {
		const struct model_layer *L = &m->layers[1];

		CHECK(L->is_moe && L->experts[3].down_q.fmt == K_Q_INT4 &&
		      L->experts[3].down_q.block_cols == 32 && L->expert_down.q.fmt == K_Q_INT4,
		      "routed experts kept int4");
		CHECK(L->wq_b.q.fmt == K_Q_NONE && L->w_gate.q.fmt == K_Q_NONE,
		      "attention and shared experts stay bf16 (ignored)");
	}
	model_destroy(m);
	if (load_good(&c, "llama_int4"))
		return;
	stage("llama_int4", &c, NULL, NULL);
	expect_load("int4, rewritten unchanged", 1, NULL, NULL);
	sh = find(&c, L0 "mlp.up_proj.weight_shape");
	p = find(&c, L0 "mlp.up_proj.weight_packed");
	s = find(&c, L0 "mlp.up_proj.weight_scale");
	CHECK(sh && p && s, "int4 tensors present");
	if (!sh || !p || !s)
		return free_ckpt(&c);
	memcpy(&v, sh->data + 8, 8);
	v += 8;
	memcpy(sh->data + 8, &v, 8);
	stage("llama_int4", &c, NULL, NULL);
	expect_load("weight_shape", 0, "up_proj.weight_shape", "int4-g32");
	v -= 8;
	memcpy(sh->data + 8, &v, 8);

	sh->name[0] = '\0';
	stage("llama_int4", &c, NULL, NULL);
	expect_load("weight_shape missing", 0, "up_proj.weight_shape' is missing", "int4-g32");
	snprintf(sh->name, sizeof(sh->name), L0 "mlp.up_proj.weight_shape");

	snprintf(p->dtype, sizeof(p->dtype), "F32");
	stage("llama_int4", &c, NULL, NULL);
	expect_load("packed dtype", 0, "up_proj.weight_packed': F32", "expected I32");
	snprintf(p->dtype, sizeof(p->dtype), "I32");

	stage("llama_int4", &c, "\"group_size\": 32", "\"group_size\": 16");
	expect_load("wrong group size", 0, "q_proj.weight_scale': shape [144, 3], expected [144, 6]", "int4-g16");

	expect_bad_scale("llama_int4", &c, s, 3, -INFINITY, "inf int4 scale", "not finite", "int4-g32");
	expect_bad_scale("llama_int4", &c, s, 3, NAN, "NaN int4 scale", "not finite", "up_proj.weight_scale");
	free_ckpt(&c);
}

int main(void)
{
	char tmpl[] = "/tmp/kdec_test_quant.XXXXXX";

	if (getenv("top_srcdir"))
		top = getenv("top_srcdir");
	test_e4m3();
	test_dequant();
	if (!mkdtemp(tmpl)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(dir, sizeof(dir), "%s", tmpl);
	test_fp8_block();
	test_fp8_plain_and_strays();
	test_fp8_static_inputs();
	test_fp8_fbgemm();
	test_int4();
	nftw(dir, rm_one, 8, FTW_DEPTH | FTW_PHYS);
	return test_result("test_quant");
}
