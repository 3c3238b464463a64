/* kdbench decode: the latency of one decode step at each batch size, beside the
 * floor that HBM bandwidth puts under it (bytes the step must read / bandwidth).
 * Each batch size gets its own sequences, prefilled with distinct random prompts. */
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
#include "daemon/engine/route_trace.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/model/model.h"
#ifdef KD_HAVE_CUDA
#include "kernels/cuda/k_cuda.h"
#endif

#define MAX_BATCHES 16

struct decode_args {
	const char *model;
	int batches[MAX_BATCHES];
	int n_batches;
	int ctx, steps, warmup, no_graphs;
	int profile_step;	/* --profile-step: the last step of each batch in a profiler range */
	double hbm_tbs;
	const char *out;
	enum fwd_path paths[3];	/* --decode-path: each batch size on each, in turn */
	int n_paths;
	struct model_load_opts load;
	struct engine_opts eng;
};

struct decode_result {
	int batch, ctx;
	double prefill_s;
	double p50_ms, p90_ms, min_ms;
	double replay_ms;	/* p50 of the step's graph replayed alone (launch + sync), 0 without */
	double gpu_ms;		/* p50 of the steps' time on the GPU's queue (input copy + graph) */
	double stage_ms, launch_ms, wait_ms;	/* p50 host ms: staging, copy + launch calls,
						 * the wait for the ids (forward.h) */
	double var_ms;		/* p50 of replays on the timed steps' tokens in turn */
	double var2_ms;		/* the same on the first two steps' tokens, alternating */
	int launches;
	double weight_gb, kv_gb, floor_ms;
	double layer_us;	/* one decoder layer alone (forward_layer_time), 0 without graphs */
	double layer_floor_us;	/* that layer's bytes (weights touched, its KV share) / hbm_tbs */
	int layer_launches;	/* its kernels */
	int latency;		/* the bucket's graph takes the latency path */
	double experts;		/* MoE: distinct routed experts a layer of a traced step read
				 * (mean over the MoE layers), which the floors count; 0: dense */
	int last_experts;	/* ... the last layer's */
};

#define LAYER_REPS 8		/* the layer graph issues the layer this many times */

static void decode_usage(FILE *f)
{
	fprintf(f,
		"usage: kdbench decode --model DIR|FILE.gguf|CONFIG.json [--synthetic-weights] [options]\n"
		"\n"
		"  Median latency of a decode step at each batch size after a prefill of --ctx\n"
		"  random tokens per sequence, with the bytes the step must read (weights it\n"
		"  touches + KV cache) and the floor those bytes put under it at --hbm-tbs.\n"
		"  replay_ms: the step's graph replayed alone (0 without graphs); p50 minus it is\n"
		"  what the host adds to a step. layer_us: one decoder layer alone (the last: an\n"
		"  MoE layer in MoE models), no embedding, final norm or lm_head: a graph of that\n"
		"  layer issued 8 times over on the step's inputs, median of 16 replays / 8\n"
		"  (0 without graphs); lay_lch: its launches. path: the decode path the batch's\n"
		"  graph took. gpu_ms: the step's time on the GPU (input copy and graph, CUDA\n"
		"  events); stage/launch/wait_ms: host time staging the inputs, in the copy and\n"
		"  launch calls, waiting for the ids; var_ms: the graph replayed alone on the\n"
		"  timed steps' tokens in turn (routing as the steps had it); var2_ms: on the\n"
		"  first two steps' tokens, alternating. All medians. lay_fl_us: that layer's\n"
		"  floor (its weights as the step touches them and its share of the KV cache at\n"
		"  --hbm-tbs); lay_fl%%: the floor over layer_us. experts (MoE models): the\n"
		"  distinct routed experts a MoE layer read in one more step, traced op by op\n"
		"  after the timed ones (mean over the MoE layers; the batch's rows share them),\n"
		"  and uni: what uniform routing would choose; read_GB and both floors count the\n"
		"  traced experts.\n"
		"\n"
		"  --batch LIST          batch sizes (default 1,8,32,64)\n"
		"  --ctx N               context per sequence before the timed steps (default 1024)\n"
		"  --steps N             timed steps per batch size (default 64)\n"
		"  --warmup N            untimed steps first (default 8)\n"
		"  --backend NAME        cpu or cuda (default cpu)\n"
		"  --synthetic-weights   random weights; --model may be a config.json\n"
		"  --weight-format F     with --synthetic-weights: bf16 (default), fp8-block,\n"
		"                        fp8-channel, fp8-tensor or int4-g32 linear weights\n"
		"  --layers N            keep only the first N layers\n"
		"  --kv-tokens N         KV cache capacity (default: what the largest batch needs)\n"
		"  --threads N           CPU threads\n"
		"  --tp N                tensor-parallel ranks (cpu: threads; cuda: 2 or 4 virtual\n"
		"                        ranks on one GPU, op by op, no graphs; default 1)\n"
		"  --ep                  with --tp N: expert parallel\n"
		"  --mla-cp              with --tp N: MLA latent cache split by tokens\n"
		"  --allreduce A         auto (default), fused or nccl: the cuda ranks' reduction\n"
		"                        (nccl at --tp 1: a one-rank NCCL communicator)\n"
		"  --gpus LIST|all       the GPUs to run on (cuda): one runs every rank; several,\n"
		"                        one rank each (--tp N = their count)\n"
		"  --no-graphs           run every step op by op\n"
		"  --decode-path LIST    auto (default), standard or latency, or several of them\n"
		"                        (standard,latency): every batch size on each in turn,\n"
		"                        one model load (docs/PERFORMANCE.md)\n"
		"  --profile-step        the last timed step of each batch size runs inside a\n"
		"                        profiler range (ncu --profile-from-start off)\n"
		"  --hbm-tbs X           bandwidth of the floor in TB/s (default %.2f)\n"
		"  --out FILE            append one JSON line per batch size\n"
		"  --seed S              seed of the synthetic weights (default 0)\n"
		"  --log-level L         error, warn, info (default), debug\n",
		KDBENCH_HBM_TBS);
}

static int parse_batches(const char *s, struct decode_args *a)
{
	int32_t *v = NULL;
	char err[128];
	int n = 0;

	if (cli_parse_tokens(s, MAX_BATCHES, &v, &n, err, sizeof(err)) || n == 0) {
		fprintf(stderr, "kdbench decode: --batch '%s': want up to %d sizes like 1,8,32,64\n", s,
			MAX_BATCHES);
		free(v);
		return -1;
	}
	for (int i = 0; i < n; i++) {
		if (v[i] < 1 || v[i] > 1024) {
			fprintf(stderr, "kdbench decode: --batch %d: want 1..1024\n", v[i]);
			free(v);
			return -1;
		}
		a->batches[i] = v[i];
	}
	a->n_batches = n;
	free(v);
	return 0;
}

/* "standard,latency": the paths in turn; the engine starts on the first. */
static int parse_paths(const char *s, struct decode_args *a)
{
	char buf[64], *save = NULL, *t;

	if (strlen(s) >= sizeof(buf))
		goto bad;
	strcpy(buf, s);
	a->n_paths = 0;
	for (t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		if (a->n_paths == 3 || fwd_path_parse(t, &a->paths[a->n_paths]))
			goto bad;
		a->n_paths++;
	}
	if (!a->n_paths)
		goto bad;
	a->eng.decode_path = fwd_path_name(a->paths[0]);
	return 0;
bad:
	fprintf(stderr, "kdbench decode: --decode-path '%s': want up to 3 of auto, standard, latency, "
		"comma-separated\n", s);
	return -1;
}

static int num(const char *opt, const char *s, long min, long max, long *out)
{
	return kdbench_parse_num("kdbench decode", opt, s, min, max, out);
}

static int decode_parse(int argc, char **argv, struct decode_args *a)
{
	enum { O_BATCH = 256, O_CTX, O_STEPS, O_WARM, O_NOGRAPH, O_PROFILE, O_HBM, O_OUT,
	       O_PATH };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "config", required_argument, NULL, 'm' },
		{ "batch", required_argument, NULL, O_BATCH },
		{ "ctx", required_argument, NULL, O_CTX },
		{ "steps", required_argument, NULL, O_STEPS },
		{ "warmup", required_argument, NULL, O_WARM },
		KDBENCH_MODEL_OPTIONS,
		KDBENCH_RANK_OPTIONS,
		{ "no-graphs", no_argument, NULL, O_NOGRAPH },
		{ "decode-path", required_argument, NULL, O_PATH },
		{ "profile-step", no_argument, NULL, O_PROFILE },
		{ "hbm-tbs", required_argument, NULL, O_HBM },
		{ "out", required_argument, NULL, O_OUT },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c;

	*a = (struct decode_args){ .ctx = 1024, .steps = 64, .warmup = 8, .hbm_tbs = KDBENCH_HBM_TBS,
				   .batches = { 1, 8, 32, 64 }, .n_batches = 4 };
	optind = 1;
	while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
		int r = kdbench_engine_opt("kdbench decode", c, optarg, &a->load, &a->eng);

		if (r <= 0) {
			if (r < 0)
				return -1;
			continue;
		}
		switch (c) {
		case 'm': a->model = optarg; break;
		case O_BATCH: if (parse_batches(optarg, a)) return -1; break;
		case O_CTX: if (num("--ctx", optarg, 1, 1 << 22, &v)) return -1; a->ctx = (int)v; break;
		case O_STEPS: if (num("--steps", optarg, 1, 1 << 20, &v)) return -1; a->steps = (int)v; break;
		case O_WARM: if (num("--warmup", optarg, 0, 1 << 20, &v)) return -1; a->warmup = (int)v; break;
		case O_NOGRAPH: a->no_graphs = 1; break;
		case O_PATH: if (parse_paths(optarg, a)) return -1; break;
		case O_PROFILE: a->profile_step = 1; break;
		case O_HBM:
			a->hbm_tbs = strtod(optarg, NULL);
			if (!(a->hbm_tbs > 0 && a->hbm_tbs < 1000)) {
				fprintf(stderr, "kdbench decode: --hbm-tbs '%s': want TB/s in (0, 1000)\n", optarg);
				return -1;
			}
			break;
		case O_OUT: a->out = optarg; break;
		case 'h': decode_usage(stdout); exit(0);
		default: decode_usage(stderr); return -1;
		}
	}
	if (optind < argc || !a->model) {
		fprintf(stderr, "kdbench decode: %s\n", optind < argc ? "unexpected argument" : "--model is required");
		return -1;
	}
	if (!a->eng.kv_tokens) {
		int most = 0, bt = ENGINE_DEFAULT_BLOCK_TOKENS;

		for (int i = 0; i < a->n_batches; i++)
			most = a->batches[i] > most ? a->batches[i] : most;
		a->eng.kv_tokens = most * ((a->ctx + a->warmup + a->steps + 2 * bt) / bt * bt);
	}
	return 0;
}

/* ---- one batch size --------------------------------------------------------- */

/* --profile-step: the last step of each batch size runs inside a profiler range (ncu
 * --profile-from-start off), so a kernel profile holds exactly one decode step. */
static void profile_range(const struct decode_args *a, int s, int on)
{
#ifdef KD_HAVE_CUDA
	if (a->profile_step && s == a->warmup + a->steps - 1)
		k_cuda_profile_range(on);
#else
	(void)a, (void)s, (void)on;
#endif
}

/* The median of n replays of the bucket's sampled decode graph on its own, inputs as
 * the last step left them (it writes the same K/V again): the step's GPU time plus
 * one launch and sync, so p50 minus this is what the host adds to a step. */
static double replay_p50(struct engine *e, int bucket, double *times, int n)
{
	void *graph = bucket < FWD_N_BUCKETS && e->fwd->use_graphs ? e->fwd->graphs[bucket][1] : NULL;
	struct backend *be = e->be;

	if (!graph)
		return 0;
	for (int i = 0; i < n; i++) {
		double t0 = clock_now();

		if (be->ops->graph_launch(be, graph) || be->ops->sync(be))
			return 0;
		times[i] = clock_now() - t0;
	}
	qsort(times, (size_t)n, sizeof(*times), kdbench_cmp_double);
	return times[n / 2] * 1e3;
}

/* The median of replays of the bucket's sampled graph, each on the tokens of the next
 * timed step in turn (toks: steps x B), cycling through the first `distinct` steps':
 * the graph's time when its routing moves as the steps' did (distinct = steps), or
 * between two routings only (2), beside replay_p50's on one step's inputs. 0 without
 * graphs. */
static double replay_var_p50(struct engine *e, int B, const int32_t *toks, int steps, int distinct,
			     double *times)
{
	for (int i = 0; i < steps; i++)
		if (forward_replay_tokens(e->fwd, B, toks + (size_t)(i % distinct) * B, &times[i]))
			return 0;
	qsort(times, (size_t)steps, sizeof(*times), kdbench_cmp_double);
	return times[steps / 2];
}

static double p50_of(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), kdbench_cmp_double);
	return v[n / 2];
}

/* The routed experts one more decode step reads (MoE models): the step run op by op
 * under a routing trace of its position, each MoE layer's distinct experts over the
 * batch counted; r->experts the mean over the layers that routed, r->last_experts the
 * last layer's (0 for dense models). The rows' tokens and sample steps move on by one.
 * 0 or -errno with one line in err. */
static int trace_experts(struct engine *e, struct engine_seq *seqs, struct engine_req *reqs,
			 int B, const struct k_sample_params *sp, uint64_t *steps, int32_t *tok,
			 struct decode_result *r, char *err, size_t err_len)
{
	const struct model_config *c = &e->model->cfg;
	struct route_trace *t = NULL;
	int ret, moe = 0, sum = 0;

	if (c->n_experts <= 0)
		return 0;
	if ((ret = route_trace_create(&t, c->n_layers, c->n_experts, c->top_k, B, 1))) {
		snprintf(err, err_len, "routing trace for %d rows: %s", B, strerror(-ret));
		return ret;
	}
	t->pos_base = seqs[0].n_tokens;	/* every row is at the same position */
	for (int i = 0; i < B; i++) {
		reqs[i] = (struct engine_req){ .seq = &seqs[i], .tokens = &tok[i], .n_tokens = 1 };
		steps[i]++;
	}
	engine_set_route_trace(e, t);
	ret = engine_step_sample(e, reqs, B, sp, steps, tok, NULL, err, err_len);
	engine_set_route_trace(e, NULL);
	for (int l = 0; !ret && l < c->n_layers; l++) {
		int n = route_trace_experts(t, l);

		moe += n > 0;
		sum += n;
		if (l == c->n_layers - 1)
			r->last_experts = n;
	}
	if (!ret && !moe) {
		snprintf(err, err_len, "routing trace: no MoE layer of %d recorded a choice", c->n_layers);
		ret = -EIO;
	}
	if (!ret)
		r->experts = (double)sum / moe;
	route_trace_destroy(t);
	return ret;
}

static int run_batch(const struct decode_args *a, struct engine *e, int B, struct decode_result *res)
{
	const struct model_config *c = &e->model->cfg;
	struct engine_seq *seqs = calloc((size_t)B, sizeof(*seqs));
	struct engine_req *reqs = calloc((size_t)B, sizeof(*reqs));
	struct k_sample_params *sp = calloc((size_t)B, sizeof(*sp));
	uint64_t *steps = calloc((size_t)B, sizeof(*steps)), rng = 0x9E3779B97F4A7C15ull * (uint64_t)B;
	int32_t *prompt = malloc((size_t)a->ctx * (size_t)B * sizeof(int32_t));
	int32_t *tok = calloc((size_t)B, sizeof(int32_t));
	double *times = calloc((size_t)a->steps, sizeof(double)), t0;
	double *split = calloc((size_t)a->steps * 4, sizeof(double));	/* gpu, stage, launch, wait */
	int32_t *toks = malloc((size_t)a->steps * (size_t)B * sizeof(int32_t));
	int n_split = 0;
	char err[512] = "";
	int ret = -ENOMEM, size = 1, bucket = 0;

	if (!seqs || !reqs || !sp || !steps || !prompt || !tok || !times || !split || !toks)
		goto out;
	for (int i = 0; i < B; i++) {
		engine_seq_init(&seqs[i]);
		for (int t = 0; t < a->ctx; t++)
			prompt[(size_t)i * a->ctx + t] = (int32_t)(kdbench_rng_next(&rng) % (uint64_t)c->vocab_size);
		reqs[i] = (struct engine_req){ .seq = &seqs[i], .tokens = prompt + (size_t)i * a->ctx,
					       .n_tokens = a->ctx };
	}
	t0 = clock_now();
	if ((ret = engine_step_sample(e, reqs, B, sp, steps, tok, NULL, err, sizeof(err))))
		goto fail;
	res->prefill_s = clock_now() - t0;
	for (int s = 0; s < a->warmup + a->steps; s++) {
		for (int i = 0; i < B; i++) {
			reqs[i] = (struct engine_req){ .seq = &seqs[i], .tokens = &tok[i], .n_tokens = 1 };
			steps[i] = (uint64_t)s + 1;
		}
		if (s >= a->warmup)
			memcpy(toks + (size_t)(s - a->warmup) * B, tok, (size_t)B * sizeof(int32_t));
		e->fwd->time_steps = 1;
		e->fwd->step_gpu_ms = -1;	/* a step not replayed from a graph leaves it */
		t0 = clock_now();
		profile_range(a, s, 1);
		if ((ret = engine_step_sample(e, reqs, B, sp, steps, tok, NULL, err, sizeof(err))))
			goto fail;
		profile_range(a, s, 0);
		if (s >= a->warmup) {
			times[s - a->warmup] = clock_now() - t0;
			if (e->fwd->step_gpu_ms >= 0) {
				split[n_split] = e->fwd->step_gpu_ms;
				split[a->steps + n_split] = e->fwd->step_stage_ms;
				split[2 * a->steps + n_split] = e->fwd->step_launch_ms;
				split[3 * a->steps + n_split] = e->fwd->step_wait_ms;
				n_split++;
			}
		}
	}
	e->fwd->time_steps = 0;
	qsort(times, (size_t)a->steps, sizeof(*times), kdbench_cmp_double);
	res->batch = B;
	res->ctx = a->ctx;
	res->min_ms = times[0] * 1e3;
	res->p50_ms = times[a->steps / 2] * 1e3;
	res->p90_ms = times[(a->steps * 9) / 10 < a->steps ? (a->steps * 9) / 10 : a->steps - 1] * 1e3;
	while (size < B)
		size *= 2, bucket++;
	res->launches = bucket < FWD_N_BUCKETS ? e->fwd->graph_nodes[bucket][1] : 0;
	res->replay_ms = replay_p50(e, bucket, times, a->steps);
	if (n_split) {
		res->gpu_ms = p50_of(split, n_split);
		res->stage_ms = p50_of(split + a->steps, n_split);
		res->launch_ms = p50_of(split + 2 * a->steps, n_split);
		res->wait_ms = p50_of(split + 3 * a->steps, n_split);
	}
	if (res->replay_ms > 0) {
		res->var_ms = replay_var_p50(e, B, toks, a->steps, a->steps, times);
		res->var2_ms = replay_var_p50(e, B, toks, a->steps, a->steps < 2 ? 1 : 2, times);
	}
	res->latency = bucket < FWD_N_BUCKETS && e->fwd->bucket_lat[bucket] > 0;
	if (res->replay_ms > 0 &&
	    forward_layer_time(e->fwd, B, c->n_layers - 1, LAYER_REPS, 16, &res->layer_us,
			       &res->layer_launches))
		res->layer_us = 0, res->layer_launches = 0;
	/* the routed experts the floors count: those a traced step read, not the
	 * uniform estimate (a prompt's own tokens share experts; session 29 measured a
	 * batch of distinct prompts routing as uniformly as the estimate says) */
	if ((ret = trace_experts(e, seqs, reqs, B, sp, steps, tok, res, err, sizeof(err))))
		goto fail;
	res->weight_gb = engine_weight_bytes_at(e->model, B, c->n_experts > 0 ?
						res->experts / c->n_experts : 0) / 1e9;
	/* KV read by the median step: contexts ctx + warmup + steps / 2, bf16 or fp32 */
	res->kv_gb = engine_kv_bytes(e, B * (a->ctx + a->warmup + a->steps / 2.0)) / 1e9;
	res->floor_ms = (res->weight_gb + res->kv_gb) / (a->hbm_tbs * 1e3) * 1e3;
	res->layer_floor_us = (engine_last_layer_bytes_at(e->model, B, c->n_experts > 0 ?
			       (double)res->last_experts / c->n_experts : 0) / 1e9 +
			       res->kv_gb / c->n_layers) / (a->hbm_tbs * 1e3) * 1e6;
	ret = 0;
	goto out;

fail:
	fprintf(stderr, "kdbench decode: batch %d: %s\n", B, err);
out:
	for (int i = 0; seqs && i < B; i++)
		engine_seq_release(e, &seqs[i]);
	free(seqs);
	free(reqs);
	free(sp);
	free(steps);
	free(prompt);
	free(tok);
	free(times);
	free(split);
	free(toks);
	return ret;
}

static void print_row(const struct decode_result *r, const struct model_config *c)
{
	printf("%5d %6d %9.3f %9.3f %9.3f %9.3f %10.1f %11.1f %8d %9.2f %8.3f %8.3f %6.0f%% %9.1f %8.1f %7d %8s %8.2f %8.3f %8.3f %9.3f %8.3f %8.3f %8.3f %9.1f %6.0f%%",
	       r->batch, r->ctx, r->p50_ms, r->p90_ms, r->min_ms, r->replay_ms, 1e3 / r->p50_ms,
	       r->batch * 1e3 / r->p50_ms, r->launches, r->weight_gb + r->kv_gb, r->kv_gb,
	       r->floor_ms, 100 * r->floor_ms / r->p50_ms, r->p50_ms * 1e3 / c->n_layers,
	       r->layer_us, r->layer_launches, r->latency ? "latency" : "standard", r->prefill_s,
	       r->gpu_ms, r->stage_ms, r->launch_ms, r->wait_ms, r->var_ms, r->var2_ms,
	       r->layer_floor_us, r->layer_us > 0 ? 100 * r->layer_floor_us / r->layer_us : 0);
	if (c->n_experts > 0)
		printf(" %8.1f %6.1f\n", r->experts,
		       c->n_experts * engine_uniform_expert_share(c, r->batch));
	else
		printf(" %8s %6s\n", "-", "-");
}

static void write_json(FILE *f, const struct decode_args *a, const struct engine *e,
		       const struct decode_result *r, const char *asked)
{
	fprintf(f,
		"{\"model\":\"%s\",\"backend\":\"%s\",\"layers\":%d,\"batch\":%d,\"ctx\":%d,\"steps\":%d,"
		"\"graphs\":%d,\"step_ms_p50\":%.4f,\"step_ms_p90\":%.4f,\"step_ms_min\":%.4f,"
		"\"replay_ms_p50\":%.4f,\"tok_s_user\":%.2f,\"tok_s_total\":%.2f,\"launches\":%d,"
		"\"weight_gb\":%.4f,\"kv_gb\":%.4f,\"floor_ms\":%.4f,\"hbm_tbs\":%.2f,\"floor_fraction\":%.4f,\"prefill_s\":%.3f,"
		"\"layer_us\":%.2f,\"layer_launches\":%d,\"decode_path_asked\":\"%s\",\"decode_path\":\"%s\","
		"\"step_gpu_ms_p50\":%.4f,\"stage_ms_p50\":%.4f,\"launch_ms_p50\":%.4f,\"wait_ms_p50\":%.4f,"
		"\"replay_var_ms_p50\":%.4f,\"replay_var2_ms_p50\":%.4f,\"layer_floor_us\":%.2f,"
		"\"routed_experts\":%.2f,\"routed_experts_last\":%d,\"routed_experts_uniform\":%.2f}\n",
		a->model, e->be->ops->name, e->model->cfg.n_layers, r->batch, r->ctx, a->steps,
		!a->no_graphs && e->fwd->use_graphs, r->p50_ms, r->p90_ms, r->min_ms, r->replay_ms,
		1e3 / r->p50_ms, r->batch * 1e3 / r->p50_ms, r->launches, r->weight_gb, r->kv_gb, r->floor_ms,
		a->hbm_tbs, r->floor_ms / r->p50_ms, r->prefill_s, r->layer_us, r->layer_launches,
		asked, r->latency ? "latency" : "standard", r->gpu_ms, r->stage_ms, r->launch_ms,
		r->wait_ms, r->var_ms, r->var2_ms, r->layer_floor_us, r->experts, r->last_experts,
		e->model->cfg.n_experts * engine_uniform_expert_share(&e->model->cfg, r->batch));
}

int kdbench_decode_main(int argc, char **argv)
{
	struct decode_args a;
	struct model *m = NULL;
	struct engine *e = NULL;
	char err[512] = "", par[128];
	FILE *out = NULL;
	int ret;

	if (decode_parse(argc, argv, &a))
		return 2;
	a.load.mapped = a.eng.tp > 1;	/* tensor parallel: shards read from the files */
	if ((ret = model_load(&m, a.model, &a.load, err, sizeof(err))) ||
	    (ret = engine_create(&e, m, &a.eng, err, sizeof(err)))) {
		fprintf(stderr, "kdbench decode: %s\n", err[0] ? err : strerror(-ret));
		goto out;
	}
	if (a.no_graphs)
		e->fwd->use_graphs = 0;
	if (a.out && !(out = fopen(a.out, "a"))) {
		fprintf(stderr, "kdbench decode: %s: %s\n", a.out, strerror(errno));
		ret = -errno;
		goto out;
	}
	printf("# kdbench decode: %s (%s, %d layers), backend %s%s, ctx %d, %d steps after %d warm-up, floor at %.2f TB/s\n",
	       a.model, m->cfg.model_type, m->cfg.n_layers, e->be->ops->name,
	       e->fwd->use_graphs ? " with graphs" : "", a.ctx, a.steps, a.warmup, a.hbm_tbs);
	engine_parallel_describe(e, par, sizeof(par));
	printf("# parallel: %s\n", par);
	printf("%5s %6s %9s %9s %9s %9s %10s %11s %8s %9s %8s %8s %7s %9s %8s %7s %8s %8s %8s %8s %9s %8s %8s %8s %9s %7s %8s %6s\n", "batch", "ctx",
	       "p50_ms", "p90_ms", "min_ms", "replay_ms", "tok/s/usr", "tok/s_total", "launches",
	       "read_GB", "kv_GB", "floor_ms", "floor%", "us/layer", "layer_us", "lay_lch", "path",
	       "prefill_s", "gpu_ms", "stage_ms", "launch_ms", "wait_ms", "var_ms", "var2_ms",
	       "lay_fl_us", "lay_fl%", "experts", "uni");
	if (!a.n_paths)
		a.paths[a.n_paths++] = FWD_PATH_AUTO;
	for (int pi = 0; pi < a.n_paths && !ret; pi++) {
		char path[160];

		if (pi)
			forward_set_path(e->fwd, a.paths[pi]);
		printf("# decode path asked: %s\n", fwd_path_name(a.paths[pi]));
		for (int i = 0; i < a.n_batches; i++) {
			struct decode_result r = { 0 };

			if ((ret = run_batch(&a, e, a.batches[i], &r)))
				break;
			print_row(&r, &m->cfg);
			/* what issue 23 found: a per-step host walk of every tensor name
			 * (model_count_params, before eab10b6) added 2.2 ms to a Qwen3-30B-A3B
			 * step that replay_ms did not show; say it wherever it comes back */
			if (r.gpu_ms > 0 && r.p50_ms > 1.03 * r.gpu_ms + 0.05)
				printf("# batch %d: the host adds %.3f ms to a step beyond its %.3f ms on the GPU (p50 %.3f)\n",
				       r.batch, r.p50_ms - r.gpu_ms, r.gpu_ms, r.p50_ms);
			fflush(stdout);
			if (out)
				write_json(out, &a, e, &r, fwd_path_name(a.paths[pi]));
		}
		engine_decode_path_describe(e, path, sizeof(path));
		printf("# decode path: %s\n", path);
	}
out:
	if (out)
		fclose(out);
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}
