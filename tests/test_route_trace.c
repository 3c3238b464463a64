/* The routing trace and test_golden's flip criterion on the CPU, where CI runs them:
 * a recorded routing forced back changes nothing; one decision forced to another
 * expert changes that token's row and the later ones and nothing before; the file
 * round-trips and bad files are refused with their line; k_cpu_moe_route_margin is
 * the gap between the k-th choice and the next; and goldenflip.h's judge fails a
 * flip that is no near-tie (a wrong router) and a row that moved without a flip (a
 * kernel error), and passes rows within tolerance. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine.h"
#include "daemon/model/model.h"
#include "tests/testutil.h"
#include "tests/goldentest.h"
#include "tests/goldenflip.h"

#define TOL 1e-4


/* An engine_opts.x_bf16_at: mode 0 rounds every weight's x to bf16, 1 only `only`'s, 2
 * none decided (-1), 3 every weight's to f16 (a GPU's quantized kernels); counts its
 * calls and those at more than one row. */
struct x_at_arg {
	int mode, calls, other_m;
	const struct model_tensor *only;
};

static int x_at(void *arg, const struct model_tensor *w, int M)
{
	struct x_at_arg *a = arg;

	a->calls++;
	a->other_m += M != 1;
	return a->mode == 0 ? 1 : a->mode == 1 ? (w == a->only ? 1 : -1) : a->mode == 3 ? 2 : -1;
}

static struct model *m;
static struct engine *e1, *e2;	/* two CPU engines: "GPU" and reference roles */
static int32_t *toks;
static int n_toks, vocab;

static const float *bias_of(void *arg, int layer)
{
	(void)arg;
	return m->layers[layer].router_bias;
}

/* base's row 3 scaled by 1 + f: a row f (rel L2) from base's */
static void scaled_row(float *out, const float *base, double f)
{
	memcpy(out, base, sizeof(float) * (size_t)n_toks * vocab);
	for (int v = 0; v < vocab; v++)
		out[(size_t)3 * vocab + v] *= (float)(1 + f);
}

/* The bf16-precision cause and its near misses: the row (got), the CPU run with the GPU's
 * GEMM inputs (cpux) and the GPU run with nothing rounded (gx; < 0: none), in tolerances
 * from the reference row; what the judge must say. */
struct precision_case {
	const char *name;
	double got, cpux, gx;
	int fails, gemm_ok;
};

static const struct precision_case precision[] = {
	{ "gemm inputs", 2.0, 1.6, -1, 0, 1 },		/* cpux 0.4 tol from the row */
	{ "gemm inputs not it", 2.0, 0.4, -1, 1, 0 },	/* cpux 1.6 tol from the row */
	{ "gemm inputs too small", 1.2, 0.3, -1, 1, 0 },	/* rounding moves the row 0.3 tol */
	{ "precision room", 2.5, 1.0, 0, 0, 1 },	/* room tol + 2 x 1 = 3 tol */
	{ "precision room too small", 2.5, 0.2, 0, 1, 0 },	/* room 1.4 tol */
	{ "precision, kernels off", 2.5, 1.0, 1.5, 1, 0 },	/* gx 1.5 tol from the CPU */
};

/* The two causes besides a flip (goldenflip.h), with the own routing (no flip) and base
 * as the reference: the bf16 cache (the forced CPU row itself half the tolerance off)
 * and bf16 precision (the CPU row with the GPU's GEMM inputs close, or the GPU with
 * nothing rounded right and the row within the measured room), each against its near
 * miss. */
static void check_causes(const float *base, const struct flip_row *rows,
			 const struct route_trace *rec, const struct k_moe_route_params *route)
{
	size_t n = (size_t)n_toks * vocab;
	float *got = malloc(sizeof(float) * n), *cpu = malloc(sizeof(float) * n);
	float *gx = malloc(sizeof(float) * n), *cpux = malloc(sizeof(float) * n);
	struct flip_stats st;
	int fails;

	scaled_row(got, base, 1.5 * TOL);
	scaled_row(cpu, base, 0.8 * TOL);
	fails = flip_judge("cache", got, base, cpu, NULL, NULL, rows, n_toks, vocab, TOL, rec, rec, route,
			   bias_of, NULL, &st);
	CHECK(fails == 0 && st.bad == 1 && st.cache_ok == 1,
	      "a row the cache alone moves 0.8 tol, the GPU 0.7 tol from it: explained (%d failed)", fails);
	scaled_row(got, base, 1.15 * TOL);
	scaled_row(cpu, base, 0.2 * TOL);
	fails = flip_judge("cache too small", got, base, cpu, NULL, NULL, rows, n_toks, vocab, TOL, rec, rec,
			   route, bias_of, NULL, &st);
	CHECK(fails == 1 && st.cache_ok == 0, "a row the cache moves only 0.2 tol: a kernel error (%d)",
	      fails);

	/* bf16 precision, with the CPU row as the reference (cpu = base, so the cache
	 * explains nothing): the forced CPU run that rounds the GEMM inputs as the GPU does
	 * (cpux), and the GPU with nothing rounded (gx, room tol + 2 x |cpux - cpu|) */
	memcpy(cpu, base, sizeof(float) * n);
	for (size_t i = 0; i < sizeof(precision) / sizeof(precision[0]); i++) {
		const struct precision_case *c = &precision[i];

		scaled_row(got, base, c->got * TOL);
		scaled_row(cpux, base, c->cpux * TOL);
		if (c->gx >= 0)
			scaled_row(gx, base, c->gx * TOL);
		fails = flip_judge(c->name, got, base, cpu, cpux, c->gx >= 0 ? gx : NULL, rows, n_toks,
				   vocab, TOL, rec, rec, route, bias_of, NULL, &st);
		CHECK(fails == c->fails && st.gemm_ok == c->gemm_ok && st.cache_ok == 0,
		      "%s: the row %.1f tol off, the CPU with the GPU's GEMM inputs %.1f tol, the GPU "
		      "with nothing rounded %.1f tol: want %s, got %d failed (gemm_ok %d)", c->name,
		      c->got, c->cpux, c->gx, c->fails ? "a kernel error" : "bf16 precision", fails,
		      st.gemm_ok);
	}
	/* the fp32-input GPU run alone (no measured sensitivity) explains nothing */
	/* the fp32-input GPU run alone (no measured sensitivity) explains nothing */
	scaled_row(got, base, 2 * TOL);
	memcpy(gx, base, sizeof(float) * n);
	fails = flip_judge("fp32 inputs alone", got, base, cpu, NULL, gx, rows, n_toks, vocab, TOL, rec,
			   rec, route, bias_of, NULL, &st);
	CHECK(fails == 1 && st.fp32x_worst == 0, "an fp32-input row equal to the reference "
	      "explains nothing (%d)", fails);
	free(got);
	free(cpu);
	free(cpux);
	free(gx);
}

static int prefill(struct engine *e, struct route_trace *t, float *out)
{
	struct engine_seq seq;
	char err[256] = "";
	int ret;

	engine_set_route_trace(e, t);
	engine_seq_init(&seq);
	struct engine_req r = { .seq = &seq, .tokens = toks, .n_tokens = n_toks, .all_logits = 1 };
	ret = engine_step(e, &r, 1, out, err, sizeof(err));
	CHECK(ret == 0, "prefill: %s", err);
	engine_seq_release(e, &seq);
	engine_set_route_trace(e, NULL);
	return ret;
}

/* The first layer with experts. */
static int first_moe_layer(void)
{
	for (int l = 0; l < m->cfg.n_layers; l++)
		if (m->layers[l].is_moe)
			return l;
	return -1;
}

static void test_margin(void)
{
	struct k_moe_route_params p = { .n_experts = 4, .top_k = 2, .scoring = K_MOE_SOFTMAX,
					.routed_scaling = 1 };
	const float lg[4] = { 1.0f, 3.0f, 2.0f, 2.5f };
	double s = exp(1.0) + exp(3.0) + exp(2.0) + exp(2.5);
	float w[2];
	int32_t ids[2] = { 2, 0 };

	/* picks 1 and 3; the next best is 2: margin = p3 - p2 */
	CHECK_NEAR(k_cpu_moe_route_margin(&p, lg, NULL), (exp(2.5) - exp(2.0)) / s, 1e-6, "margin");
	p.norm_topk_prob = 1;
	CHECK(k_cpu_moe_route_forced(&p, lg, ids, w) == 0, "forced");
	CHECK_NEAR(w[0], exp(2.0) / (exp(2.0) + exp(1.0)), 1e-6, "forced weight 0");
	CHECK_NEAR(w[1], exp(1.0) / (exp(2.0) + exp(1.0)), 1e-6, "forced weight 1");
	ids[1] = 4;
	CHECK(k_cpu_moe_route_forced(&p, lg, ids, w) == -EINVAL, "forced id out of range");
	p.top_k = 4;
	CHECK(isinf(k_cpu_moe_route_margin(&p, lg, NULL)), "top_k = n_experts: no tie possible");
}

/* A file with one line changed: 0 when it reads, else the read's error. */
static int read_text(struct route_trace *t, const char *text, char *err, size_t len)
{
	FILE *f = tmpfile();
	int ret;

	fputs(text, f);
	rewind(f);
	ret = route_trace_read_force(t, f, err, len);
	fclose(f);
	return ret;
}

static void test_file(struct route_trace *rec)
{
	const struct model_config *c = &m->cfg;
	struct route_trace *t;
	char err[256] = "", head[128], bad[256];
	FILE *f = tmpfile();
	long keys = (long)rec->max_seqs * rec->n_layers * rec->max_pos;
	int K = c->top_k;

	CHECK(route_trace_write(rec, f, &c->route, bias_of, NULL) == 0, "write");
	rewind(f);
	CHECK(route_trace_create(&t, c->n_layers, c->n_experts, K, 1, n_toks) == 0, "create");
	CHECK(route_trace_read_force(t, f, err, sizeof(err)) == 0, "read back: %s", err);
	fclose(f);
	CHECK(!memcmp(t->have_force, rec->have, (size_t)keys), "the same decisions");
	CHECK(!memcmp(t->force, rec->ids, sizeof(int32_t) * (size_t)(keys * K)), "the same experts");

	snprintf(head, sizeof(head), "kdec-routing 1 layers %d experts %d top_k %d\n", c->n_layers,
		 c->n_experts, K);
	CHECK(read_text(t, "routing 1\n", err, sizeof(err)) == -EINVAL, "bad header");
	snprintf(bad, sizeof(bad), "kdec-routing 1 layers %d experts %d top_k %d\n", c->n_layers + 1,
		 c->n_experts, K);
	CHECK(read_text(t, bad, err, sizeof(err)) == -EINVAL && strstr(err, "the model has"),
	      "another model's file: %s", err);
	snprintf(bad, sizeof(bad), "%s0 %d 0 %d", head, first_moe_layer(), c->n_experts);
	CHECK(read_text(t, bad, err, sizeof(err)) == -EINVAL && strstr(err, "line 2"),
	      "expert out of range: %s", err);
	snprintf(bad, sizeof(bad), "%s0 %d %d 0 1\n", head, first_moe_layer(), n_toks);
	CHECK(read_text(t, bad, err, sizeof(err)) == -EINVAL && strstr(err, "position"),
	      "position out of range: %s", err);
	if (K >= 2) {
		snprintf(bad, sizeof(bad), "%s0 %d 0 1 1", head, first_moe_layer());
		for (int j = 2; j < K; j++)
			strcat(bad, " 2");
		strcat(bad, "\n");
		CHECK(read_text(t, bad, err, sizeof(err)) == -EINVAL && strstr(err, "twice"),
		      "an expert twice: %s", err);
	}
	route_trace_destroy(t);
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	struct engine_opts eo = { .backend = "cpu", .threads = 2, .kv_tokens = 1024,
				  .block_tokens = 16, .max_rows = 128 };
	char dir[1024], path[1200], err[512] = "";
	struct route_trace *rec, *force;
	float *base, *again, *moved, *ref, *noisy;
	struct flip_row *rows;
	struct flip_stats st;
	json_t *g, *c;
	int l, p, K, E;
	long k;

	test_margin();
	snprintf(dir, sizeof(dir), "%s/tests/data/golden/deepseek_v3", top);
	snprintf(path, sizeof(path), "%s/golden.json", dir);
	g = json_load_file(path, 0, NULL);
	CHECK(g != NULL, "%s", path);
	CHECK(model_load(&m, dir, NULL, err, sizeof(err)) == 0, "load: %s", err);
	CHECK(engine_create(&e1, m, &eo, err, sizeof(err)) == 0 &&
	      engine_create(&e2, m, &eo, err, sizeof(err)) == 0, "engines: %s", err);
	if (!g || !e1 || !e2)
		return test_result("test_route_trace");
	c = json_array_get(json_object_get(g, "cases"), 1);
	toks = golden_ids(json_object_get(c, "tokens"), &n_toks);
	vocab = m->cfg.vocab_size;
	K = m->cfg.top_k;
	E = m->cfg.n_experts;
	snprintf(path, sizeof(path), "%s/%s", dir, json_string_value(json_object_get(c, "logits")));
	ref = golden_read_floats(path, (size_t)n_toks * vocab);
	base = malloc(sizeof(float) * (size_t)n_toks * vocab);
	again = malloc(sizeof(float) * (size_t)n_toks * vocab);
	moved = malloc(sizeof(float) * (size_t)n_toks * vocab);
	noisy = malloc(sizeof(float) * (size_t)n_toks * vocab);
	rows = malloc(sizeof(*rows) * (size_t)n_toks);
	for (int t = 0; t < n_toks; t++)
		rows[t] = (struct flip_row){ 0, t };
	CHECK(route_trace_create(&rec, m->cfg.n_layers, E, K, 1, n_toks) == 0 &&
	      route_trace_create(&force, m->cfg.n_layers, E, K, 1, n_toks) == 0, "traces");

	/* recorded, then forced back: nothing changes */
	prefill(e1, rec, base);
	CHECK(rec->n_seqs == 1, "one sequence: %d", rec->n_seqs);
	route_trace_force_from(force, rec);
	prefill(e1, force, again);
	CHECK(force->n_forced == 0 && !memcmp(base, again, sizeof(float) * (size_t)n_toks * vocab),
	      "own routing forced: %ld replaced, logits %s", force->n_forced,
	      memcmp(base, again, sizeof(float) * (size_t)n_toks * vocab) ? "differ" : "same");
	test_file(rec);

	/* one decision forced to the best expert left out: rows before it are unchanged */
	l = first_moe_layer();
	p = n_toks / 2;
	k = route_trace_index(force, 0, l, p);
	{
		float choice[4096];
		unsigned char taken[4096] = { 0 };
		struct k_moe_route_params rp = m->cfg.route;
		int best = -1;

		rp.bias = m->layers[l].router_bias;
		k_cpu_moe_route_margin(&rp, rec->logits + k * E, choice);
		for (int j = 0; j < K; j++)
			taken[rec->ids[k * K + j]] = 1;
		for (int e = 0; e < E; e++)
			if (!taken[e] && isfinite(choice[e]) && (best < 0 || choice[e] > choice[best]))
				best = e;
		CHECK(best >= 0, "an expert left out");
		force->force[k * K + K - 1] = best;
	}
	route_trace_clear(force);
	prefill(e1, force, moved);
	/* (later decisions may come out in another order and are forced back too) */
	CHECK(force->n_forced >= 1 && force->n_differ == 1, "one flip forced: %ld, %ld differ",
	      force->n_forced, force->n_differ);
	CHECK(!memcmp(base, moved, sizeof(float) * (size_t)p * vocab), "rows before the flip unchanged");
	CHECK(test_rel_l2(moved + (size_t)p * vocab, base + (size_t)p * vocab, (size_t)vocab) > TOL,
	      "the flipped row moved");

	/* the judge: the same flip forced on the reference engine reproduces the rows, but
	 * the two engines' router logits are equal, so it is no near-tie: failed */
	{
		struct route_trace *cpu_t;
		float *cpu = malloc(sizeof(float) * (size_t)n_toks * vocab);
		int fails;

		route_trace_create(&cpu_t, m->cfg.n_layers, E, K, 1, n_toks);
		route_trace_force_from(cpu_t, force);
		prefill(e2, cpu_t, cpu);
		CHECK(!memcmp(cpu, moved, sizeof(float) * (size_t)n_toks * vocab),
		      "the forced reference run gives the forced run's rows");
		fails = flip_judge("forced flip", moved, ref, cpu, NULL, NULL, rows, n_toks, vocab, TOL, force,
				   cpu_t, &m->cfg.route, bias_of, NULL, &st);
		CHECK(st.bad > 0 && fails == st.bad && st.flips_ok == 0,
		      "a flip at no near-tie fails: %d bad, %d failed, %d explained", st.bad, fails,
		      st.flips_ok);
		CHECK(st.flipped == 1, "one decision flipped of %ld: %ld", st.decisions, st.flipped);

		/* the unchanged run passes */
		fails = flip_judge("own routing", base, ref, base, NULL, NULL, rows, n_toks, vocab, TOL, rec, rec,
				   &m->cfg.route, bias_of, NULL, &st);
		CHECK(fails == 0 && st.bad == 0 && st.flipped == 0, "own routing: %d failed", fails);

		/* a row moved without any flip: a kernel error */
		memcpy(noisy, base, sizeof(float) * (size_t)n_toks * vocab);
		for (int v = 0; v < vocab; v++)
			noisy[(size_t)3 * vocab + v] *= 1.01f;
		fails = flip_judge("kernel error", noisy, ref, base, NULL, NULL, rows, n_toks, vocab, TOL, rec, rec,
				   &m->cfg.route, bias_of, NULL, &st);
		CHECK(fails == 1 && st.bad == 1, "a moved row without a flip fails: %d", fails);
		fails = flip_judge("dense", noisy, ref, NULL, NULL, NULL, rows, n_toks, vocab, TOL, NULL, NULL,
				   &m->cfg.route, bias_of, NULL, &st);
		CHECK(fails == 1, "without a reference run every bad row fails: %d", fails);
		check_causes(base, rows, rec, &m->cfg.route);
		free(cpu);
		route_trace_destroy(cpu_t);
	}

	/* x_bf16 (the reference with the GPU's GEMM inputs): a prefill's rows move by about
	 * bf16's rounding, not more; a one-token step (the GPU's fp32-x GEMV) is unchanged */
	{
		struct engine_opts xo = { .backend = "cpu", .threads = 2,
					   .x_bf16 = BACKEND_X_BF16_MIN_M };
		struct engine *ex = NULL;
		struct engine_seq seq;
		double worst = 0;

		CHECK(engine_create(&ex, m, &xo, err, sizeof(err)) == 0, "x_bf16 engine: %s", err);
		prefill(ex, NULL, again);
		for (int t = 0; t < n_toks; t++) {
			double d = test_rel_l2(again + (size_t)t * vocab, base + (size_t)t * vocab,
					       (size_t)vocab);

			worst = d > worst ? d : worst;
		}
		CHECK(worst > 1e-6 && worst < 2e-2, "x_bf16 prefill: worst row %.3g from fp32 inputs "
		      "(bf16 rounding: between 1e-6 and 2e-2)", worst);
		engine_seq_init(&seq);
		struct engine_req r = { .seq = &seq, .tokens = toks, .n_tokens = 1 };
		CHECK(engine_step(ex, &r, 1, again, err, sizeof(err)) == 0, "x_bf16 step: %s", err);
		CHECK(!memcmp(again, base, sizeof(float) * (size_t)vocab),
		      "x_bf16: a one-token step equals fp32 inputs' (row 0)");
		engine_seq_release(ex, &seq);
		engine_destroy(ex);

		/* x_bf16 = 1 (every linear rounds, as the ring kind does): the one-token
		 * step moves too, by about bf16's rounding */
		xo.x_bf16 = 1;
		ex = NULL;
		CHECK(engine_create(&ex, m, &xo, err, sizeof(err)) == 0, "x_bf16 = 1 engine: %s", err);
		engine_seq_init(&seq);
		CHECK(engine_step(ex, &r, 1, again, err, sizeof(err)) == 0, "x_bf16 = 1 step: %s", err);
		worst = test_rel_l2(again, base, (size_t)vocab);
		CHECK(worst > 1e-6 && worst < 2e-2, "x_bf16 = 1: the one-token step %.3g from fp32 "
		      "inputs' (bf16 rounding: between 1e-6 and 2e-2)", worst);
		engine_seq_release(ex, &seq);
		engine_destroy(ex);

		/* x_bf16_at (a GPU engine's run-time choices: engine_linear_rounds_x) before the
		 * rows' rule: 1 for every weight is x_bf16 = 1's step, bit for bit; 1 for one
		 * weight alone moves the step, but less than all do; -1 leaves the rule; 2 (f16,
		 * 3 more significant bits) moves it less than bf16 does */
		float *all = malloc(sizeof(float) * (size_t)vocab);

		CHECK(all != NULL, "x_bf16_at: memory");
		for (int mode = 0; all && mode < 4; mode++) {
			struct x_at_arg xa = { .mode = mode, .only = &m->layers[0].wo };

			xo.x_bf16 = BACKEND_X_BF16_MIN_M;
			xo.x_bf16_at = x_at;
			xo.x_bf16_arg = &xa;
			ex = NULL;
			CHECK(engine_create(&ex, m, &xo, err, sizeof(err)) == 0, "x_bf16_at engine: %s", err);
			engine_seq_init(&seq);
			CHECK(engine_step(ex, &r, 1, mode ? again : all, err, sizeof(err)) == 0,
			      "x_bf16_at step: %s", err);
			CHECK(xa.calls > 0 && xa.other_m == 0, "x_bf16_at: %d calls, %d not at 1 row",
			      xa.calls, xa.other_m);
			if (mode == 1) {
				worst = test_rel_l2(again, base, (size_t)vocab);
				CHECK(worst > 1e-7 && test_rel_l2(again, all, (size_t)vocab) > 1e-7,
				      "x_bf16_at one weight: %.3g from fp32, and not all's", worst);
			} else if (mode == 2) {
				CHECK(!memcmp(again, base, sizeof(float) * (size_t)vocab),
				      "x_bf16_at -1 at 1 row: fp32 inputs' step");
			} else if (mode == 3) {
				worst = test_rel_l2(again, base, (size_t)vocab);
				CHECK(worst > 1e-8 && worst < test_rel_l2(all, base, (size_t)vocab) / 2,
				      "x_bf16_at 2 (f16): %.3g from fp32, under half of bf16's %.3g",
				      worst, test_rel_l2(all, base, (size_t)vocab));
			}
			engine_seq_release(ex, &seq);
			engine_destroy(ex);
		}
		xo.x_bf16 = 1;
		xo.x_bf16_at = NULL;
		CHECK(engine_create(&ex, m, &xo, err, sizeof(err)) == 0, "x_bf16 = 1 engine: %s", err);
		engine_seq_init(&seq);
		CHECK(engine_step(ex, &r, 1, again, err, sizeof(err)) == 0, "x_bf16 = 1 step: %s", err);
		CHECK(all && !memcmp(again, all, sizeof(float) * (size_t)vocab),
		      "x_bf16_at 1 for every weight: x_bf16 = 1's step bit for bit");
		engine_seq_release(ex, &seq);
		engine_destroy(ex);
		free(all);
	}

	/* a trace too small for the step: one clear error, the engine goes on */
	{
		struct route_trace *small;
		struct engine_seq seq;

		route_trace_create(&small, m->cfg.n_layers, E, K, 1, 4);
		engine_set_route_trace(e1, small);
		engine_seq_init(&seq);
		struct engine_req r = { .seq = &seq, .tokens = toks, .n_tokens = n_toks, .all_logits = 1 };
		CHECK(engine_step(e1, &r, 1, again, err, sizeof(err)) != 0 && strstr(err, "past the trace"),
		      "trace too small: %s", err);
		engine_seq_release(e1, &seq);
		engine_set_route_trace(e1, NULL);
		route_trace_destroy(small);
		prefill(e1, NULL, again);
		CHECK(!memcmp(base, again, sizeof(float) * (size_t)n_toks * vocab), "then runs as before");
	}

	route_trace_destroy(rec);
	route_trace_destroy(force);
	free(base);
	free(again);
	free(moved);
	free(noisy);
	free(ref);
	free(rows);
	free(toks);
	engine_destroy(e1);
	engine_destroy(e2);
	model_destroy(m);
	json_decref(g);
	return test_result("test_route_trace");
}
