/* Synthetic weights on tiny configs of every architecture (other dims than the golden
 * models: odd head dims, GQA 2:1 to 5:1, mlp_only layers, group-limited routing, YaRN
 * with mscale, fp16 and fp32 checkpoints). Checks the engine against itself where the
 * math says the results must agree:
 *  - prefill == token-by-token decode through the paged cache (rel L2 <= 1e-6),
 *  - a sequence batched with others == the same sequence alone (bit-identical),
 *  - 1 thread == 3 threads (bit-identical), same seed == same weights, other seed differs,
 *  - logits finite. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine.h"
#include "daemon/model/model.h"
#include "kernels/quant.h"
#include "tests/testutil.h"

#define T 37		/* prompt length: crosses block boundaries of 16 and 5 */

static const char *const configs[] = {
	"llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2",
};

static int open_engine(const char *path, uint64_t seed, int threads, int block, struct model **m,
		       struct engine **e)
{
	struct model_load_opts lo = { .synthetic = 1, .seed = seed };
	struct engine_opts eo = { .threads = threads, .block_tokens = block, .kv_tokens = 1024, .max_rows = 24 };
	char err[512] = "";
	int ret;

	*e = NULL;
	ret = model_load(m, path, &lo, err, sizeof(err));
	CHECK(ret == 0, "%s: %s", path, err);
	if (ret)
		return ret;
	ret = engine_create(e, *m, &eo, err, sizeof(err));
	CHECK(ret == 0, "%s engine: %s", path, err);
	return ret;
}

/* Logits of every position of toks: one prefill (all_logits) or one token per step. */
static int run_seq(struct engine *e, const int32_t *toks, int n, int incremental, float *out)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	struct engine_seq s;
	char err[256] = "";
	int ret = 0;

	engine_seq_init(&s);
	if (!incremental) {
		struct engine_req r = { .seq = &s, .tokens = toks, .n_tokens = n, .all_logits = 1 };

		ret = engine_step(e, &r, 1, out, err, sizeof(err));
	}
	for (int t = 0; incremental && t < n && !ret; t++) {
		struct engine_req r = { .seq = &s, .tokens = &toks[t], .n_tokens = 1 };

		ret = engine_step(e, &r, 1, out + (size_t)t * vocab, err, sizeof(err));
	}
	CHECK(ret == 0, "step: %s", err);
	engine_seq_release(e, &s);
	return ret;
}

/* Sequence A interleaved with B and C in shared steps must equal A alone. */
static void check_batch_invariance(struct engine *e, const int32_t *toks, const float *alone)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	struct engine_seq s[3];
	float *got = malloc(3 * vocab * sizeof(float));
	char err[256] = "";
	int pos = 0;

	for (int i = 0; i < 3; i++)
		engine_seq_init(&s[i]);
	/* step 1: A's first 10 tokens with B's 7-token prompt; then all decode together */
	struct engine_req r[3] = {
		{ .seq = &s[1], .tokens = toks + 3, .n_tokens = 7 },
		{ .seq = &s[0], .tokens = toks, .n_tokens = 10 },
	};
	CHECK(engine_step(e, r, 2, got, err, sizeof(err)) == 0, "batched prefill: %s", err);
	CHECK(test_same_floats(got + vocab, alone + 9 * vocab, vocab),
	      "A's logits at 9 differ when batched with a prefill");
	for (pos = 10; pos < T; pos++) {
		r[0] = (struct engine_req){ .seq = &s[2], .tokens = toks + pos % 5, .n_tokens = 1 + pos % 3 };
		r[1] = (struct engine_req){ .seq = &s[0], .tokens = toks + pos, .n_tokens = 1 };
		r[2] = (struct engine_req){ .seq = &s[1], .tokens = toks + 1, .n_tokens = 1 };
		if (engine_step(e, r, 3, got, err, sizeof(err))) {
			CHECK(0, "batched decode: %s", err);
			break;
		}
		if (!test_same_floats(got + vocab, alone + (size_t)pos * vocab, vocab)) {
			CHECK(0, "A's logits at %d differ when batched", pos);
			break;
		}
	}
	for (int i = 0; i < 3; i++)
		engine_seq_release(e, &s[i]);
	free(got);
}

static void check_config(const char *top, const char *name)
{
	char path[1024];
	struct model *m = NULL, *m2 = NULL;
	struct engine *e = NULL, *e2 = NULL;
	float *pre, *inc, *other;
	int32_t toks[T];
	size_t vocab, n;
	double err_inc;
	int finite = 1;

	snprintf(path, sizeof(path), "%s/tests/data/tiny/%s.json", top, name);
	if (open_engine(path, 7, 1, 16, &m, &e))
		goto out;
	vocab = (size_t)m->cfg.vocab_size;
	n = (size_t)T * vocab;
	pre = malloc(n * sizeof(float));
	inc = malloc(n * sizeof(float));
	other = malloc(n * sizeof(float));
	for (int t = 0; t < T; t++)
		toks[t] = (int32_t)((t * 7919u + 13u) % vocab);

	run_seq(e, toks, T, 0, pre);
	run_seq(e, toks, T, 1, inc);
	for (size_t i = 0; i < n; i++)
		finite &= isfinite(pre[i]);
	CHECK(finite, "%s: logits finite", name);
	err_inc = test_rel_l2(inc, pre, n);
	fprintf(stderr, "  %-12s prefill vs incremental rel L2 %.2e\n", name, err_inc);
	CHECK(err_inc <= 1e-6, "%s: prefill vs incremental %.3g", name, err_inc);
	check_batch_invariance(e, toks, inc);

	/* 3 threads, 5-token blocks: same numbers */
	if (!open_engine(path, 7, 3, 5, &m2, &e2)) {
		run_seq(e2, toks, T, 0, other);
		CHECK(test_same_floats(other, pre, n), "%s: 3 threads / block 5 differ from 1 thread", name);
	}
	engine_destroy(e2);
	model_destroy(m2);
	/* another seed: other weights */
	if (!open_engine(path, 8, 1, 16, &m2, &e2)) {
		run_seq(e2, toks, T, 0, other);
		err_inc = test_rel_l2(other, pre, n);	/* +inf where seed 8 gave a non-finite logit */
		CHECK(err_inc > 1e-2 && isfinite(err_inc), "%s: seed 8 gives the same logits as seed 7 (rel L2 %.3g)",
		      name, err_inc);
	}
	engine_destroy(e2);
	model_destroy(m2);
	free(pre);
	free(inc);
	free(other);
out:
	engine_destroy(e);
	model_destroy(m);
}

/* --weight-format: the linear weights stored quantized (embedding, lm_head and router
 * not), the engine's logits finite and prefill == decode, and the decode floor's bytes
 * those of the formats as published (payload + scales, counted here from the formats'
 * own definitions) in place of bf16; int4 values of mean 0 (int4_mean). */
static double quant_bytes(enum model_qformat f, double N, double K)
{
	switch (f) {
	case MODEL_Q_FP8_BLOCK: return N * K + ceil(N / 128) * ceil(K / 128) * 4;
	case MODEL_Q_FP8_CHANNEL: return N * K + N * 2;
	case MODEL_Q_FP8_TENSOR: return N * K + 2;
	case MODEL_Q_INT4_GROUP: return N * ceil(K / 8) * 4 + N * ceil(K / 32) * 2;
	default: return 2 * N * K;
	}
}

/* The int4 values (nibble - 8) of a synthetic weight's payload: their mean, and how
 * many are -8. Uniform nibbles (mean -0.5) made every output of a matrix share one
 * offset, which grew through the layers until every token routed to the same experts
 * (model_synthetic.c's plan_quant). */
static double int4_mean(const struct model_tensor *w, long *n_min)
{
	const uint8_t *b = w->data;
	const size_t n = (size_t)w->rows * k_quant_row_bytes(K_Q_INT4, w->cols);
	double sum = 0;

	*n_min = 0;
	for (size_t i = 0; i < n; i++)
		for (int h = 0; h < 2; h++) {
			const int v = ((b[i] >> (4 * h)) & 15) - 8;

			sum += v;
			*n_min += v == -8;
		}
	return sum / (2.0 * (double)n);
}

static void check_weight_formats(const char *top)
{
	static const char *const fmts[] = { "fp8-block", "fp8-channel", "fp8-tensor", "int4-g32" };
	char path[1024], err[512] = "";
	double bf16_bytes = 0;
	int32_t toks[T];

	snprintf(path, sizeof(path), "%s/tests/data/tiny/llama.json", top);
	for (int t = 0; t < T; t++)
		toks[t] = (int32_t)((t * 37 + 11) % 301);
	for (int i = -1; i < 4; i++) {
		struct model_load_opts lo = { .synthetic = 1, .seed = 5 };
		struct engine_opts eo = { .threads = 2, .kv_tokens = 256, .max_rows = 24 };
		struct model *m = NULL;
		struct engine *e = NULL;
		double want, delta = 0;
		float *pre = NULL, *inc = NULL;
		size_t n;

		if (i >= 0)
			CHECK(model_weight_format_parse(fmts[i], &lo.weight_format, err, sizeof(err)) == 0,
			      "%s: %s", fmts[i], err);
		if (model_load(&m, path, &lo, err, sizeof(err)) || engine_create(&e, m, &eo, err, sizeof(err))) {
			CHECK(0, "%s: %s", i >= 0 ? fmts[i] : "bf16", err);
			engine_destroy(e);
			model_destroy(m);
			continue;
		}
		n = (size_t)T * (size_t)m->cfg.vocab_size;
		if (i < 0) {
			CHECK(m->n_quantized == 0, "bf16: nothing quantized");
			bf16_bytes = engine_weight_bytes(m, 1);
			goto next;
		}
		CHECK(m->n_quantized == 7 * m->cfg.n_layers && m->lm_head.q.fmt == K_Q_NONE &&
		      m->embed.q.fmt == K_Q_NONE && m->layers[0].w_down.q.fmt != K_Q_NONE,
		      "%s: %d quantized", fmts[i], m->n_quantized);
		for (int l = 0; l < m->cfg.n_layers; l++) {
			const struct model_layer *L = &m->layers[l];
			const struct model_tensor *w[] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate,
							    &L->w_up, &L->w_down };

			for (size_t k = 0; k < sizeof(w) / sizeof(w[0]); k++)
				delta += quant_bytes(lo.weight_format.format, (double)w[k]->rows, (double)w[k]->cols) -
					 2.0 * (double)w[k]->rows * (double)w[k]->cols;
		}
		if (lo.weight_format.format == MODEL_Q_INT4_GROUP) {
			long n_min;
			double mean = int4_mean(&m->layers[0].w_down, &n_min);

			CHECK(fabs(mean) < 0.05 && n_min == 0, "%s: w_down's values of mean %.3f "
			      "(want 0), %ld of -8 (want none)", fmts[i], mean, n_min);
		}
		want = bf16_bytes + delta;
		CHECK(fabs(engine_weight_bytes(m, 1) - want) < 0.5, "%s: floor bytes %.0f, want %.0f",
		      fmts[i], engine_weight_bytes(m, 1), want);
		fprintf(stderr, "  llama %-12s decode bytes %.0f (bf16 %.0f)\n", fmts[i],
			engine_weight_bytes(m, 1), bf16_bytes);
		pre = malloc(n * sizeof(float));
		inc = malloc(n * sizeof(float));
		if (pre && inc && !run_seq(e, toks, T, 0, pre) && !run_seq(e, toks, T, 1, inc)) {
			double d = 0, r = 0;
			int finite = 1;

			for (size_t j = 0; j < n; j++) {
				finite &= isfinite(pre[j]) != 0;
				d += (pre[j] - inc[j]) * (double)(pre[j] - inc[j]);
				r += pre[j] * (double)pre[j];
			}
			CHECK(finite && r > 0, "%s: logits finite and not all zero", fmts[i]);
			CHECK(sqrt(d / r) <= 1e-6, "%s: prefill vs decode %g", fmts[i], sqrt(d / r));
		}
		free(pre);
		free(inc);
next:
		engine_destroy(e);
		model_destroy(m);
	}
	{
		struct model_load_opts lo = { .synthetic = 0 };
		struct model *m = NULL;

		model_weight_format_parse("int4-g32", &lo.weight_format, err, sizeof(err));
		snprintf(path, sizeof(path), "%s/tests/data/reference/llama", top);
		CHECK(model_load(&m, path, &lo, err, sizeof(err)) == -EINVAL && strstr(err, "--synthetic-weights"),
		      "--weight-format on a checkpoint: %s", err);
		model_destroy(m);
		CHECK(model_weight_format_parse("int4-g33", &lo.weight_format, err, sizeof(err)) == -EINVAL &&
		      strstr(err, "int4-g33"), "bad format name: %s", err);
	}
}

/* The tensor list of full-size configs, counted: it must add up to the parameter
 * counts the model authors publish (fp8 scales and DeepSeek's MTP layer excluded). */
static void check_full_size(const char *top)
{
	static const struct {
		const char *file;
		double lo, hi;		/* published total, +-0.5% */
	} cases[] = {
		{ "llama3.1-8b.json", 8.03e9 * 0.995, 8.03e9 * 1.005 },
		{ "llama3.1-70b.json", 70.6e9 * 0.995, 70.6e9 * 1.005 },
		{ "qwen3-8b.json", 8.19e9 * 0.995, 8.19e9 * 1.005 },
		{ "qwen3-30b-a3b.json", 30.5e9 * 0.995, 30.5e9 * 1.005 },
		{ "deepseek-v2-lite.json", 15.7e9 * 0.995, 15.7e9 * 1.005 },
		{ "deepseek-v3.json", 671e9 * 0.995, 671e9 * 1.005 },
		{ "kimi-k2.json", 1.0e12, 1.05e12 },	/* published as "1T" / 1.04T */
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct model_config cfg;
		char path[1024], err[512] = "";
		int64_t n = 0;
		int ret;

		snprintf(path, sizeof(path), "%s/tests/data/configs/%s", top, cases[i].file);
		ret = model_config_load_file(&cfg, path, err, sizeof(err));
		CHECK(ret == 0, "%s: %s", path, err);
		if (ret)
			continue;
		CHECK(model_count_params(&cfg, &n) == 0, "%s: count", cases[i].file);
		fprintf(stderr, "  %-22s %8.3f B parameters\n", cases[i].file, (double)n / 1e9);
		CHECK(n >= cases[i].lo && n <= cases[i].hi, "%s: %lld parameters, want %.4g..%.4g",
		      cases[i].file, (long long)n, cases[i].lo, cases[i].hi);
	}
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";

	for (size_t i = 0; i < sizeof(configs) / sizeof(configs[0]); i++)
		check_config(top, configs[i]);
	check_full_size(top);
	check_weight_formats(top);
	return test_result("test_synthetic");
}
