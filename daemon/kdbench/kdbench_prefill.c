/* kdbench prefill: the time to prefill one prompt of T tokens, for several T, beside
 * the floor that the tensor cores put under it (the prompt's FLOPs / --tc-tflops).
 * Every repetition prefills its own random prompt, so the prefix cache never helps. */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/cli.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/model/model.h"

#define MAX_LENGTHS 16
/* H200 dense bf16 tensor-core rate reached by cuBLAS on an 8192^3 GEMM (measured with
 * contrib/bench/torch_prefill.py --roof on the GPU machine, see docs/PERFORMANCE.md) */
#define DEFAULT_TC_TFLOPS 700.0

struct prefill_args {
	const char *model;
	int lengths[MAX_LENGTHS];
	int n_lengths;
	int reps;
	double tc_tflops;
	const char *out;
	struct model_load_opts load;
	struct engine_opts eng;
};

static void prefill_usage(FILE *f)
{
	fprintf(f,
		"usage: kdbench prefill --model DIR|FILE.gguf|CONFIG.json [--synthetic-weights] [options]\n"
		"\n"
		"  Time to prefill one random prompt of each --tokens length (the median of --reps,\n"
		"  each a fresh prompt, after one untimed warm-up prefill), in forward calls of at\n"
		"  most --chunk tokens, beside its FLOPs and the floor they put under it at\n"
		"  --tc-tflops. FLOPs: 2 per weight each token passes (the routed experts counted\n"
		"  top_k of n_experts; the lm_head for the last token only), plus causal attention,\n"
		"  2 * T * (T + 1) / 2 * heads * (qk_dim + v_dim) per layer.\n"
		"\n"
		"  --tokens LIST         prompt lengths (default 1024,4096,16384,32768)\n"
		"  --chunk N             most tokens per forward call (default: as kdecd runs a\n"
		"                        lone prompt: the backend's rows, %d on cpu, 2048 on cuda)\n"
		"  --reps N              timed prefills per length (default 3)\n"
		"  --backend NAME        cpu or cuda (default cpu)\n"
		"  --synthetic-weights   random weights; --model may be a config.json\n"
		"  --weight-format F     with --synthetic-weights: bf16 (default), fp8-block,\n"
		"                        fp8-channel, fp8-tensor or int4-g32 linear weights\n"
		"  --seed S              seed of the synthetic weights (default 0)\n"
		"  --layers N            keep only the first N layers\n"
		"  --threads N           CPU threads\n"
		"  --log-level L         error, warn, info (default), debug\n"
		"  --tc-tflops X         tensor-core rate of the floor (default %.0f)\n"
		"  --out FILE            append one JSON line per length\n",
		ENGINE_DEFAULT_MAX_ROWS, DEFAULT_TC_TFLOPS);
}

static int num(const char *opt, const char *s, long min, long max, long *out)
{
	return kdbench_parse_num("kdbench prefill", opt, s, min, max, out);
}

static int parse_lengths(const char *s, struct prefill_args *a)
{
	int32_t *v = NULL;
	char err[128];
	int n = 0;

	if (cli_parse_tokens(s, MAX_LENGTHS, &v, &n, err, sizeof(err)) || n == 0) {
		fprintf(stderr, "kdbench prefill: --tokens '%s': want up to %d lengths like 1024,4096\n",
			s, MAX_LENGTHS);
		free(v);
		return -1;
	}
	for (int i = 0; i < n; i++) {
		if (v[i] < 1 || v[i] > (1 << 20)) {
			fprintf(stderr, "kdbench prefill: --tokens %d: want 1..%d\n", v[i], 1 << 20);
			free(v);
			return -1;
		}
		a->lengths[i] = v[i];
	}
	a->n_lengths = n;
	free(v);
	return 0;
}

static int prefill_parse(int argc, char **argv, struct prefill_args *a)
{
	enum { O_TOKENS = 256, O_CHUNK, O_REPS, O_TC, O_OUT };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "config", required_argument, NULL, 'm' },
		{ "tokens", required_argument, NULL, O_TOKENS },
		{ "chunk", required_argument, NULL, O_CHUNK },
		{ "reps", required_argument, NULL, O_REPS },
		KDBENCH_MODEL_OPTIONS,
		{ "tc-tflops", required_argument, NULL, O_TC },
		{ "out", required_argument, NULL, O_OUT },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int most = 0, c;
	long v;

	*a = (struct prefill_args){ .lengths = { 1024, 4096, 16384, 32768 }, .n_lengths = 4,
				    .reps = 3, .tc_tflops = DEFAULT_TC_TFLOPS };
	optind = 1;
	while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
		int r = kdbench_engine_opt("kdbench prefill", c, optarg, &a->load, &a->eng);

		if (r <= 0) {
			if (r < 0)
				return -1;
			continue;
		}
		switch (c) {
		case 'm': a->model = optarg; break;
		case O_TOKENS: if (parse_lengths(optarg, a)) return -1; break;
		case O_CHUNK: if (num("--chunk", optarg, 1, 65536, &v)) return -1; a->eng.max_rows = (int)v; break;
		case O_REPS: if (num("--reps", optarg, 1, 1000, &v)) return -1; a->reps = (int)v; break;
		case O_TC:
			a->tc_tflops = strtod(optarg, NULL);
			if (!(a->tc_tflops > 0 && a->tc_tflops < 1e5)) {
				fprintf(stderr, "kdbench prefill: --tc-tflops '%s': want TFLOPS in (0, 1e5)\n", optarg);
				return -1;
			}
			break;
		case O_OUT: a->out = optarg; break;
		case 'h': prefill_usage(stdout); exit(0);
		default: prefill_usage(stderr); return -1;
		}
	}
	if (optind < argc || !a->model) {
		fprintf(stderr, "kdbench prefill: %s\n", optind < argc ? "unexpected argument" : "--model is required");
		return -1;
	}
	for (int i = 0; i < a->n_lengths; i++)
		most = a->lengths[i] > most ? a->lengths[i] : most;
	/* one prompt at a time, and the warm-up's; released before the next */
	a->eng.kv_tokens = most + 2 * ENGINE_DEFAULT_BLOCK_TOKENS;
	a->eng.host_kv_bytes = -1;
	return 0;
}

/* ---- FLOPs ------------------------------------------------------------------ */

/* FLOPs of prefilling T tokens (see the usage). */
static double prefill_flops(const struct model *m, int T)
{
	const struct model_config *c = &m->cfg;
	double D = c->hidden_size, V = c->vocab_size, weights, attn;
	int64_t params = 0;
	int moe_layers = 0, qk, vd;

	model_count_params(c, &params);
	weights = (double)params - V * D;			/* the embedding is a lookup */
	if (m->lm_head.data != m->embed.data)
		weights -= V * D;				/* lm_head: last row only */
	for (int l = 0; l < c->n_layers; l++)
		moe_layers += m->layers[l].is_moe;
	if (moe_layers)
		weights -= moe_layers * (double)(c->n_experts - c->top_k) * 3.0 * D *
			   c->moe_intermediate_size;
	qk = c->mla ? c->qk_nope_head_dim + c->qk_rope_head_dim : c->head_dim;
	vd = c->mla ? c->v_head_dim : c->head_dim;
	attn = 2.0 * T * (T + 1.0) / 2.0 * c->n_heads * (qk + vd) * c->n_layers;
	return 2.0 * weights * T + 2.0 * V * D + attn;
}

/* ---- one length --------------------------------------------------------------- */

/* Prefills one fresh random prompt of T tokens; its seconds into *s. */
static int prefill_once(struct engine *e, int T, uint64_t *rng, int32_t *prompt, double *s,
			char *err, size_t err_len)
{
	struct k_sample_params sp = { 0 };
	struct engine_seq seq;
	struct engine_req req;
	uint64_t step = 0;
	int32_t tok = 0;
	double t0;
	int ret;

	for (int t = 0; t < T; t++)
		prompt[t] = (int32_t)(kdbench_rng_next(rng) % (uint64_t)e->model->cfg.vocab_size);
	engine_seq_init(&seq);
	req = (struct engine_req){ .seq = &seq, .tokens = prompt, .n_tokens = T };
	t0 = clock_now();
	ret = engine_step_sample(e, &req, 1, &sp, &step, &tok, NULL, err, err_len);
	*s = clock_now() - t0;
	engine_seq_release(e, &seq);
	return ret;
}

static int run_length(const struct prefill_args *a, struct engine *e, int T, FILE *out)
{
	int32_t *prompt = malloc((size_t)T * sizeof(int32_t));
	double *t = calloc((size_t)a->reps, sizeof(double)), flops, p50, floor_ms;
	uint64_t rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)T;
	char err[512] = "";
	int ret = -ENOMEM;

	if (!prompt || !t)
		goto out;
	for (int r = 0; r < a->reps; r++)
		if ((ret = prefill_once(e, T, &rng, prompt, &t[r], err, sizeof(err)))) {
			fprintf(stderr, "kdbench prefill: %d tokens: %s\n", T, err[0] ? err : strerror(-ret));
			goto out;
		}
	qsort(t, (size_t)a->reps, sizeof(*t), kdbench_cmp_double);
	p50 = t[a->reps / 2] * 1e3;
	flops = prefill_flops(e->model, T);
	floor_ms = flops / (a->tc_tflops * 1e12) * 1e3;
	printf("%7d %6d %10.2f %10.2f %11.0f %10.1f %9.2f %8.2f %6.0f%%\n", T, e->fwd->max_rows, p50,
	       t[0] * 1e3, T / (p50 * 1e-3), flops / (p50 * 1e-3) / 1e12, flops / 1e12, floor_ms,
	       100 * floor_ms / p50);
	fflush(stdout);
	if (out)
		fprintf(out, "{\"model\":\"%s\",\"backend\":\"%s\",\"layers\":%d,\"tokens\":%d,\"chunk\":%d,"
			"\"reps\":%d,\"ms_p50\":%.3f,\"ms_min\":%.3f,\"tok_s\":%.1f,\"tflop\":%.4f,"
			"\"tflops\":%.2f,\"tc_tflops\":%.1f,\"floor_ms\":%.3f}\n",
			a->model, e->be->ops->name, e->model->cfg.n_layers, T, e->fwd->max_rows, a->reps,
			p50, t[0] * 1e3, T / (p50 * 1e-3), flops / 1e12, flops / (p50 * 1e-3) / 1e12,
			a->tc_tflops, floor_ms);
	ret = 0;
out:
	free(prompt);
	free(t);
	return ret;
}

int kdbench_prefill_main(int argc, char **argv)
{
	struct prefill_args a;
	struct model *m = NULL;
	struct engine *e = NULL;
	int32_t warm[512];
	uint64_t rng = 1;
	char err[512] = "";
	FILE *out = NULL;
	double s;
	int ret;

	if (prefill_parse(argc, argv, &a))
		return 2;
	if ((ret = model_load(&m, a.model, &a.load, err, sizeof(err))) ||
	    (ret = engine_create(&e, m, &a.eng, err, sizeof(err)))) {
		fprintf(stderr, "kdbench prefill: %s\n", err[0] ? err : strerror(-ret));
		goto out;
	}
	if (a.out && !(out = fopen(a.out, "a"))) {
		fprintf(stderr, "kdbench prefill: %s: %s\n", a.out, strerror(errno));
		ret = -errno;
		goto out;
	}
	/* the first prefill pays one-time costs (tuning, lazy allocations): untimed */
	if ((ret = prefill_once(e, a.lengths[0] < 512 ? a.lengths[0] : 512, &rng, warm, &s, err,
				sizeof(err)))) {
		fprintf(stderr, "kdbench prefill: warm-up: %s\n", err[0] ? err : strerror(-ret));
		goto out;
	}
	printf("# kdbench prefill: %s (%s, %d layers), backend %s, %d reps, floor at %.0f TFLOPS\n",
	       a.model, m->cfg.model_type, m->cfg.n_layers, e->be->ops->name, a.reps, a.tc_tflops);
	printf("%7s %6s %10s %10s %11s %10s %9s %8s %7s\n", "tokens", "chunk", "p50_ms", "min_ms",
	       "tok/s", "TFLOPS", "TFLOP", "floor_ms", "floor%");
	for (int i = 0; i < a.n_lengths && !ret; i++)
		ret = run_length(&a, e, a.lengths[i], out);
out:
	if (out)
		fclose(out);
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}
