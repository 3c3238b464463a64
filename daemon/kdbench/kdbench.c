/* kdbench: run the engine in-process on a model. `logits` writes float32 logits for a
 * token list (the correctness oracle's format); `generate` greedy-decodes and reports
 * time to first token and tokens/s. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/base/cli.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/route_trace.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/model/model.h"
#include "format/file_read.h"

#define MAX_TOKENS_ARG (1 << 20)

struct bench_args {
	const char *cmd;
	const char *model;
	const char *tokens;		/* logits: --tokens; generate: --prompt */
	const char *out;
	const char *dump_routing;	/* logits: --dump-routing FILE */
	const char *force_routing;	/* logits: --force-routing FILE */
	long max_tokens;
	int incremental;
	long prefill_first;		/* logits --incremental --prefill N */
	struct spec_opts spec;		/* generate --spec; k == 0: off */
	struct model_load_opts load;
	struct engine_opts eng;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kdbench logits   --model DIR|FILE.gguf --tokens 1,2,3 --out FILE [--incremental [--prefill N]]\n"
		"                        [--dump-routing FILE] [--force-routing FILE] [options]\n"
		"       kdbench generate --model DIR|FILE.gguf --prompt 1,2,3 --max-tokens N [options]\n"
		"       kdbench decode   --model DIR|FILE.gguf|CONFIG.json [--batch 1,8,32,64 --ctx 1024 ...]  (decode --help)\n"
		"       kdbench prefill  --model DIR|FILE.gguf|CONFIG.json [--tokens 1024,4096 ...]  (prefill --help)\n"
		"       kdbench agent    --socket PATH [--sessions N --duration S ...]  (agent --help)\n"
		"       kdbench allreduce [--tp N --bytes 4096,65536 ...]  (allreduce --help)\n"
		"\n"
		"  logits    write float32 little-endian logits, row-major [T, vocab]; row t sees\n"
		"            tokens 0..t. Default: one prefill; --incremental feeds the tokens one\n"
		"            at a time through the KV cache (with --prefill N, the first N tokens\n"
		"            as one prefill first: decode at long positions). MoE models: --dump-routing FILE writes\n"
		"            each layer's chosen experts per token and the router's top-k margin\n"
		"            (text, docs/MODELS.md); --force-routing FILE takes such a file's choices\n"
		"            instead of the engine's own (the reference run on another backend's\n"
		"            routing) and says how many decisions it changed.\n"
		"  generate  greedy-generate N tokens; the new ids go to stdout on one line, timing\n"
		"            (time to first token, tokens/s) to stderr.\n"
		"\n"
		"  --tokens/--prompt @FILE reads the comma-separated ids from FILE.\n"
		"\n"
		"options:\n"
		"  --backend NAME        cpu (default) or cuda\n"
		"  --threads N           CPU threads (default: all online CPUs)\n"
		"  --tp N                tensor-parallel ranks (cpu: threads sharing --threads;\n"
		"                        cuda: 2 or 4 virtual ranks on one GPU, op by op;\n"
		"                        docs/PARALLEL.md) (default 1)\n"
		"  --ep                  with --tp N: expert parallel (each rank a share of the\n"
		"                        routed experts whole)\n"
		"  --mla-cp              with --tp N on an MLA model (cpu, cuda): the latent cache split\n"
		"                        by tokens across the ranks (decode context parallel)\n"
		"  --allreduce A         auto (default), fused or nccl: the cuda ranks' reduction\n"
		"                        (nccl at --tp 1: a one-rank NCCL communicator; kdecd --help)\n"
		"  --gpus LIST|all       the GPUs to run on (cuda): one runs every rank; several,\n"
		"                        one rank each (--tp N = their count)\n"
		"  --synthetic-weights   deterministic random weights; --model may be a config.json\n"
		"  --weight-format F     with --synthetic-weights: bf16 (default), fp8-block,\n"
		"                        fp8-channel, fp8-tensor or int4-g32 linear weights\n"
		"  --seed S              seed of the synthetic weights (default 0)\n"
		"  --layers N            keep only the first N layers (benchmarks of huge configs)\n"
		"  --kv-tokens N         KV cache capacity in tokens (default %d)\n"
		"  --block-size N        tokens per KV block (default %d)\n"
		"  --kv-bf16             cpu: round the cached K/V to bf16 as the cuda backend\n"
		"                        stores them (the cache's share of a GPU row's error)\n"
		"  --x-bf16              cpu: round the linear layers' inputs to bf16 where the\n"
		"                        cuda backend's tensor-core kernels do (3+ rows)\n"
		"  --decode-path P       auto (default), standard or latency (kdecd --help)\n"
		"  --no-graphs           every step op by op (tp > 1 on cuda: the ranks' eager path)\n"
		"  --spec ngram:k=N[,n=M]  generate: n-gram speculative decoding, N drafts per\n"
		"                        step matching the last M..1 tokens (default M %d)\n"
		"  --log-level L         error, warn, info (default), debug\n"
		"  --version, --help\n",
		ENGINE_DEFAULT_KV_TOKENS, ENGINE_DEFAULT_BLOCK_TOKENS, SPEC_DEFAULT_N);
}

int kdbench_parse_num(const char *who, const char *opt, const char *s, long min, long max,
		      long *out)
{
	if (cli_parse_long(s, min, max, out)) {
		fprintf(stderr, "%s: %s '%s': want an integer in [%ld, %ld]\n", who, opt, s, min,
			max);
		return -1;
	}
	return 0;
}

int kdbench_engine_opt(const char *who, int c, const char *arg, struct model_load_opts *load,
		       struct engine_opts *eng)
{
	char err[256];
	long v;

	switch (c) {
	case KDBENCH_O_BACKEND: eng->backend = arg; return 0;
	case KDBENCH_O_SYNTH: load->synthetic = 1; return 0;
	case KDBENCH_O_EP: eng->ep = 1; return 0;
	case KDBENCH_O_MLA_CP: eng->mla_cp = 1; return 0;
	case KDBENCH_O_THREADS:
		if (kdbench_parse_num(who, "--threads", arg, 1, 1024, &v))
			return -1;
		eng->threads = (int)v;
		return 0;
	case KDBENCH_O_WFMT:
		if (model_weight_format_parse(arg, &load->weight_format, err, sizeof(err)))
			break;
		return 0;
	case KDBENCH_O_SEED:
		if (kdbench_parse_num(who, "--seed", arg, 0, __LONG_MAX__, &v))
			return -1;
		load->seed = (uint64_t)v;
		return 0;
	case KDBENCH_O_LAYERS:
		if (kdbench_parse_num(who, "--layers", arg, 1, MODEL_MAX_LAYERS, &v))
			return -1;
		load->n_layers = (int)v;
		return 0;
	case KDBENCH_O_LOG:
		if (!log_level_parse(arg, &log_threshold))
			return 0;
		snprintf(err, sizeof(err), "--log-level '%s': want error, warn, info or debug", arg);
		break;
	case KDBENCH_O_KV:
		if (kdbench_parse_num(who, "--kv-tokens", arg, 1, 1L << 28, &v))
			return -1;
		eng->kv_tokens = (int)v;
		return 0;
	case KDBENCH_O_TP:
		if (kdbench_parse_num(who, "--tp", arg, 1, 64, &v))
			return -1;
		eng->tp = (int)v;
		return 0;
	case KDBENCH_O_GPUS:
		if (cli_parse_gpus(arg, eng->gpus, ENGINE_MAX_GPUS, &eng->n_gpus, err, sizeof(err)))
			break;
		return 0;
	case KDBENCH_O_ALLRED:
		if (!backend_allreduce_parse(arg, &eng->allreduce))
			return 0;
		snprintf(err, sizeof(err), "--allreduce '%s': want auto, fused or nccl", arg);
		break;
	default:
		return 1;
	}
	fprintf(stderr, "%s: %s\n", who, err);
	return -1;
}

static int parse_num(const char *opt, const char *s, long min, long max, long *out)
{
	return kdbench_parse_num("kdbench", opt, s, min, max, out);
}

static int parse_args(int argc, char **argv, struct bench_args *a)
{
	enum { O_BLOCK = 256, O_MAXTOK, O_INCR, O_VERSION, O_SPEC, O_DUMP_RT, O_FORCE_RT,
	       O_PREFILL, O_KV_BF16, O_X_BF16, O_PATH, O_NOGRAPH };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "tokens", required_argument, NULL, 't' },
		{ "prompt", required_argument, NULL, 'p' },
		{ "out", required_argument, NULL, 'o' },
		{ "max-tokens", required_argument, NULL, O_MAXTOK },
		{ "incremental", no_argument, NULL, O_INCR },
		{ "dump-routing", required_argument, NULL, O_DUMP_RT },
		{ "prefill", required_argument, NULL, O_PREFILL },
		{ "force-routing", required_argument, NULL, O_FORCE_RT },
		{ "spec", required_argument, NULL, O_SPEC },
		KDBENCH_MODEL_OPTIONS,
		KDBENCH_RANK_OPTIONS,
		{ "block-size", required_argument, NULL, O_BLOCK },
		{ "kv-bf16", no_argument, NULL, O_KV_BF16 },
		{ "x-bf16", no_argument, NULL, O_X_BF16 },
		{ "decode-path", required_argument, NULL, O_PATH },
		{ "no-graphs", no_argument, NULL, O_NOGRAPH },
		{ "version", no_argument, NULL, O_VERSION },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c;

	if (argc < 2 || argv[1][0] == '-') {
		if (argc >= 2 && !strcmp(argv[1], "--version")) {
			printf("kdbench (kdec) %s\n", PACKAGE_VERSION);
			exit(0);
		}
		usage(argc >= 2 && !strcmp(argv[1], "--help") ? stdout : stderr);
		exit(argc >= 2 && !strcmp(argv[1], "--help") ? 0 : 2);
	}
	a->cmd = argv[1];
	a->max_tokens = -1;
	optind = 2;
	while ((c = getopt_long(argc, argv, "m:t:p:o:h", opts, NULL)) != -1) {
		int r = kdbench_engine_opt("kdbench", c, optarg, &a->load, &a->eng);

		if (r <= 0) {
			if (r < 0)
				return -1;
			continue;
		}
		switch (c) {
		case 'm': a->model = optarg; break;
		case 't': a->tokens = optarg; break;
		case 'p': a->tokens = optarg; break;
		case 'o': a->out = optarg; break;
		case O_INCR: a->incremental = 1; break;
		case O_DUMP_RT: a->dump_routing = optarg; break;
		case O_PREFILL:
			if (parse_num("--prefill", optarg, 0, MAX_TOKENS_ARG, &a->prefill_first))
				return -1;
			break;
		case O_FORCE_RT: a->force_routing = optarg; break;
		case O_SPEC: {
			char err[256];

			if (spec_parse(optarg, &a->spec, err, sizeof(err))) {
				fprintf(stderr, "kdbench: %s\n", err);
				return -1;
			}
			break;
		}
		case O_PATH: a->eng.decode_path = optarg; break;
		case O_NOGRAPH: a->eng.no_graphs = 1; break;
		case O_MAXTOK:
			if (parse_num("--max-tokens", optarg, 1, MAX_TOKENS_ARG, &a->max_tokens))
				return -1;
			break;
		case O_BLOCK:
			if (parse_num("--block-size", optarg, 1, 4096, &v))
				return -1;
			a->eng.block_tokens = (int)v;
			break;
		case O_KV_BF16:
			a->eng.kv_bf16 = 1;
			break;
		case O_X_BF16:
			a->eng.x_bf16 = BACKEND_X_BF16_MIN_M;
			break;
		case O_VERSION:
			printf("kdbench (kdec) %s\n", PACKAGE_VERSION);
			exit(0);
		case 'h':
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kdbench: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	if (!a->model) {
		fprintf(stderr, "kdbench %s: --model DIR|FILE.gguf is required\n", a->cmd);
		return -1;
	}
	return 0;
}

static int open_engine(const struct bench_args *a, struct model **m, struct engine **e)
{
	char err[512] = "";
	double t0 = clock_now(), t1;
	int64_t params = 0;
	struct model_load_opts lo = a->load;
	int ret;

	lo.mapped = a->eng.tp > 1;	/* tensor parallel: shards read straight from the files */
	ret = model_load(m, a->model, &lo, err, sizeof(err));
	if (ret) {
		fprintf(stderr, "kdbench: %s\n", err[0] ? err : strerror(-ret));
		return ret;
	}
	t1 = clock_now();
	ret = engine_create(e, *m, &a->eng, err, sizeof(err));
	if (ret) {
		fprintf(stderr, "kdbench: %s\n", err[0] ? err : strerror(-ret));
		return ret;
	}
	model_count_params(&(*m)->cfg, &params);
	log_info("model %s: %s, %d layers, hidden %d, vocab %d, %.3f B parameters, %.1f MiB of %sweights, "
		 "loaded in %.3f s; KV cache %.1f MiB (%d blocks of %d tokens)",
		 a->model, (*m)->cfg.model_type, (*m)->cfg.n_layers, (*m)->cfg.hidden_size,
		 (*m)->cfg.vocab_size, (double)params / 1e9, (double)(*m)->weight_bytes / (1 << 20),
		 (*m)->synthetic ? "synthetic " : "", t1 - t0, (double)(*e)->fwd->kv_bytes / (1 << 20),
		 (*e)->pool.n_blocks, (*e)->pool.block_tokens);
	return 0;
}

static int write_all(const char *path, const float *v, size_t n)
{
	FILE *f = fopen(path, "wb");
	int ok;

	if (!f) {
		fprintf(stderr, "kdbench: %s: %s\n", path, strerror(errno));
		return -errno;
	}
	ok = fwrite(v, sizeof(float), n, f) == n;
	ok = (fclose(f) == 0) && ok;
	if (!ok) {
		fprintf(stderr, "kdbench: %s: write failed: %s\n", path, strerror(errno));
		return -EIO;
	}
	return 0;
}

static const float *layer_bias(void *arg, int layer)
{
	const struct model *m = arg;

	return m->layers[layer].router_bias;
}

/* --force-routing / --dump-routing: a trace attached to e for n tokens (NULL where
 * neither is asked for). 0 or -errno, said on stderr. */
static int routing_begin(const struct bench_args *a, struct engine *e, int n,
			 struct route_trace **t)
{
	const struct model_config *c = &e->model->cfg;
	char err[256] = "";
	FILE *f;
	int ret;

	*t = NULL;
	if (!a->dump_routing && !a->force_routing)
		return 0;
	if (a->eng.tp > 1 && a->force_routing) {	/* it would force rank 0's routing alone */
		fprintf(stderr, "kdbench logits: --force-routing with --tp %d: not built (one rank's "
			"routing of several; --dump-routing records rank 0's, which every rank shares)\n",
			a->eng.tp);
		return -ENOTSUP;
	}
	if (c->n_experts <= 0) {
		fprintf(stderr, "kdbench logits: --dump-routing/--force-routing: %s has no experts\n",
			a->model);
		return -EINVAL;
	}
	if ((ret = route_trace_create(t, c->n_layers, c->n_experts, c->top_k, 1, n))) {
		fprintf(stderr, "kdbench logits: routing trace: %s\n", strerror(-ret));
		return ret;
	}
	if (a->force_routing) {
		if (!(f = fopen(a->force_routing, "r"))) {
			fprintf(stderr, "kdbench logits: %s: %s\n", a->force_routing, strerror(errno));
			return -errno;
		}
		ret = route_trace_read_force(*t, f, err, sizeof(err));
		fclose(f);
		if (ret) {
			fprintf(stderr, "kdbench logits: %s: %s\n", a->force_routing, err);
			return ret;
		}
	}
	engine_set_route_trace(e, *t);
	return 0;
}

/* Says what forcing changed and writes --dump-routing: this run's own choices. */
static int routing_end(const struct bench_args *a, struct engine *e, struct route_trace *t)
{
	FILE *f;
	int ret;

	engine_set_route_trace(e, NULL);
	if (a->force_routing)
		fprintf(stderr, "kdbench logits: forced routing: %ld decisions replaced, %ld of them "
			"another set of experts than this engine's own\n", t->n_forced, t->n_differ);
	if (!a->dump_routing)
		return 0;
	if (!(f = fopen(a->dump_routing, "w"))) {
		fprintf(stderr, "kdbench logits: %s: %s\n", a->dump_routing, strerror(errno));
		return -errno;
	}
	ret = route_trace_write(t, f, &e->model->cfg.route, layer_bias, e->model);
	if (fclose(f) || ret) {
		fprintf(stderr, "kdbench logits: %s: write failed\n", a->dump_routing);
		return -EIO;
	}
	return 0;
}

static int cmd_logits(const struct bench_args *a, struct engine *e, const int32_t *ids, int n)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	struct route_trace *trace = NULL;
	struct engine_seq seq;
	char err[256] = "";
	float *logits;
	int ret = 0;

	if (!a->out) {
		fprintf(stderr, "kdbench logits: --out FILE is required\n");
		return -EINVAL;
	}
	logits = malloc((size_t)n * vocab * sizeof(float));
	if (!logits) {
		fprintf(stderr, "kdbench logits: %d x %zu logits need %.2f GiB: out of memory\n", n, vocab,
			(double)n * (double)vocab * sizeof(float) / (1u << 30));
		return -ENOMEM;
	}
	if ((ret = routing_begin(a, e, n, &trace))) {
		route_trace_destroy(trace);
		free(logits);
		return ret;
	}
	engine_seq_init(&seq);
	if (a->incremental) {
		int t = 0;

		if (a->prefill_first > 0 && a->prefill_first <= n) {
			struct engine_req r = { .seq = &seq, .tokens = ids, .n_tokens = (int)a->prefill_first,
						.all_logits = 1 };

			ret = engine_step(e, &r, 1, logits, err, sizeof(err));
			t = (int)a->prefill_first;
		} else if (a->prefill_first > n) {
			snprintf(err, sizeof(err), "--prefill %ld: more than the %d tokens", a->prefill_first, n);
			ret = -EINVAL;
		}
		for (; t < n && !ret; t++) {
			struct engine_req r = { .seq = &seq, .tokens = &ids[t], .n_tokens = 1 };

			ret = engine_step(e, &r, 1, logits + (size_t)t * vocab, err, sizeof(err));
		}
	} else {
		struct engine_req r = { .seq = &seq, .tokens = ids, .n_tokens = n, .all_logits = 1 };

		ret = engine_step(e, &r, 1, logits, err, sizeof(err));
	}
	if (ret)
		fprintf(stderr, "kdbench logits: %s\n", err);
	else
		ret = write_all(a->out, logits, (size_t)n * vocab);
	if (trace && !ret)
		ret = routing_end(a, e, trace);
	engine_set_route_trace(e, NULL);
	route_trace_destroy(trace);
	engine_seq_release(e, &seq);
	free(logits);
	return ret;
}

static int cmd_generate(const struct bench_args *a, struct engine *e, const int32_t *ids, int n)
{
	struct k_sample_params greedy = { .temperature = 0 };
	struct engine_seq seq;
	struct engine_req r;
	char err[256] = "";
	double t0, t_first, t_end;
	uint64_t step = 0;
	int32_t tok;
	int ret;

	if (a->max_tokens < 1) {
		fprintf(stderr, "kdbench generate: --max-tokens N is required\n");
		return -EINVAL;
	}
	if (a->spec.k)
		return kdbench_generate_spec(e, ids, n, a->max_tokens, &a->spec);
	engine_seq_init(&seq);
	t0 = clock_now();
	r = (struct engine_req){ .seq = &seq, .tokens = ids, .n_tokens = n };
	ret = engine_step_sample(e, &r, 1, &greedy, &step, &tok, NULL, err, sizeof(err));
	t_first = t_end = clock_now();
	for (long i = 0; !ret && i < a->max_tokens; i++) {
		printf("%s%d", i ? " " : "", tok);
		fflush(stdout);
		if (i + 1 == a->max_tokens)
			break;
		r = (struct engine_req){ .seq = &seq, .tokens = &tok, .n_tokens = 1 };
		step = (uint64_t)i + 1;
		ret = engine_step_sample(e, &r, 1, &greedy, &step, &tok, NULL, err, sizeof(err));
		t_end = clock_now();
	}
	printf("\n");
	fflush(stdout);	/* the ids before the timing when both go to one terminal */
	if (ret) {
		fprintf(stderr, "kdbench generate: %s\n", err);
	} else {
		double decode = t_end - t_first;

		fprintf(stderr, "prompt %d tokens: time to first token %.2f ms (%.1f tokens/s prefill)\n",
			n, (t_first - t0) * 1e3, n / (t_first - t0));
		if (a->max_tokens > 1)
			fprintf(stderr, "decode %ld tokens: %.2f ms/token, %.1f tokens/s\n",
				a->max_tokens - 1, decode * 1e3 / (double)(a->max_tokens - 1),
				(double)(a->max_tokens - 1) / decode);
	}
	engine_seq_release(e, &seq);
	return ret;
}

int main(int argc, char **argv)
{
	struct bench_args a = { 0 };
	struct model *m = NULL;
	struct engine *e = NULL;
	int32_t *ids = NULL;
	char err[256];
	int n = 0, ret;

	if (argc >= 2 && !strcmp(argv[1], "decode"))
		return kdbench_decode_main(argc - 1, argv + 1);
	if (argc >= 2 && !strcmp(argv[1], "prefill"))
		return kdbench_prefill_main(argc - 1, argv + 1);
	if (argc >= 2 && !strcmp(argv[1], "kvcache"))
		return kdbench_kvcache_main(argc - 1, argv + 1);
	if (argc >= 2 && !strcmp(argv[1], "ipc"))
		return kdbench_ipc_main(argc - 1, argv + 1);
	if (argc >= 2 && !strcmp(argv[1], "agent"))
		return kdbench_agent_main(argc - 1, argv + 1);
	if (argc >= 2 && !strcmp(argv[1], "allreduce"))
		return kdbench_allreduce_main(argc - 1, argv + 1);

	if (parse_args(argc, argv, &a))
		return 2;
	if (strcmp(a.cmd, "logits") && strcmp(a.cmd, "generate")) {
		fprintf(stderr, "kdbench: unknown command '%s' (logits, generate)\n", a.cmd);
		return 2;
	}
	if (!a.tokens) {
		fprintf(stderr, "kdbench %s: %s is required\n", a.cmd,
			!strcmp(a.cmd, "logits") ? "--tokens 1,2,3" : "--prompt 1,2,3");
		return 2;
	}
	if (a.tokens[0] == '@') {	/* @FILE: the list in a file (past the argument limit) */
		char *text = NULL;
		size_t len;

		if ((ret = file_read_all(a.tokens + 1, (size_t)MAX_TOKENS_ARG * 12, &text, &len, err,
					 sizeof(err)))) {
			fprintf(stderr, "kdbench %s: %s\n", a.cmd, err);
			return 2;
		}
		while (len && (text[len - 1] == '\n' || text[len - 1] == ' '))
			text[--len] = '\0';
		ret = cli_parse_tokens(text, MAX_TOKENS_ARG, &ids, &n, err, sizeof(err));
		free(text);
	} else {
		ret = cli_parse_tokens(a.tokens, MAX_TOKENS_ARG, &ids, &n, err, sizeof(err));
	}
	if (ret) {
		fprintf(stderr, "kdbench %s: %s\n", a.cmd, err);
		return 2;
	}
	ret = open_engine(&a, &m, &e);
	if (!ret)
		ret = !strcmp(a.cmd, "logits") ? cmd_logits(&a, e, ids, n) : cmd_generate(&a, e, ids, n);
	engine_destroy(e);
	model_destroy(m);
	free(ids);
	return ret ? 1 : 0;
}
