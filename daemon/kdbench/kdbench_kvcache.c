/* kdbench kvcache: the numbers of docs/KVCACHE.md.
 *   compress  ratio and MB/s of the host-tier codec on real KV pages of the reference
 *             models (tests/data/golden): fp32 as the CPU backend stores them and
 *             converted to bf16, with and without the byte shuffle, zstd levels 1 and 3;
 *   restore   a session of 1k/8k/32k tokens offloaded and restored, against computing
 *             the same history again (prefill), on a small synthetic model;
 *   blocks    what the block size changes: compression ratio, prefill and decode time.
 * Tables go to stdout as markdown. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/base/cli.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/model/model.h"
#include "kernels/dtype.h"

#define MIN_TIMED_S 0.3		/* each codec figure runs at least this long */

/* The restore benchmark's model: Llama-shaped, small enough for 32k-token prefills
 * on a few CPU cores, with the KV width of a real GQA model's layer (2 x 64). */
static const char bench_config[] =
	"{\"model_type\": \"llama\", \"vocab_size\": 4096, \"hidden_size\": 256,"
	" \"intermediate_size\": 768, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
	" \"num_key_value_heads\": 2, \"head_dim\": 64, \"rms_norm_eps\": 1e-5,"
	" \"max_position_embeddings\": 65536, \"rope_theta\": 500000.0, \"torch_dtype\": \"bfloat16\"}";

struct kvb_args {
	const char *golden;
	const char *part;
	int threads;
	int tokens;		/* per reference model, for the codec figures */
	int32_t *hist;		/* restore: history lengths */
	int n_hist;
};

static void kvb_usage(FILE *f)
{
	fprintf(f,
		"usage: kdbench kvcache [--part compress|restore|blocks|all] [options]\n"
		"\n"
		"  --golden DIR      reference models (default $top_srcdir/tests/data/golden, else\n"
		"                    tests/data/golden)\n"
		"  --tokens N        tokens of KV per reference model for the codec (default 1024)\n"
		"  --histories LIST  restore: history lengths (default 1024,8192,32768)\n"
		"  --threads N       CPU threads (default: all online CPUs)\n");
}

/* ---- helpers ---------------------------------------------------------------- */

/* CPU seconds of the whole process (all threads): on a shared machine the fairer
 * measure of work than wall time. */
static double cpu_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int open_engine(const char *path, int synthetic, int bt, int kv_tokens, int threads,
		       struct model **m, struct engine **e)
{
	struct model_load_opts lo = { .synthetic = synthetic, .seed = 1 };
	struct engine_opts eo = { .threads = threads, .block_tokens = bt, .kv_tokens = kv_tokens,
				  .session_quota_blocks = 1 << 30 };
	char err[512] = "";
	int ret;

	*e = NULL;
	if ((ret = model_load(m, path, &lo, err, sizeof(err)))) {
		fprintf(stderr, "kdbench kvcache: %s\n", err);
		return ret;
	}
	if ((ret = engine_create(e, *m, &eo, err, sizeof(err)))) {
		fprintf(stderr, "kdbench kvcache: %s\n", err);
		model_destroy(*m);
		*m = NULL;
	}
	return ret;
}

/* The prompt of the first case of golden.json with the longest prompt, then random
 * ids up to n: real inputs first, varied ones after. */
static int32_t *golden_tokens(const char *dir, int n, int vocab)
{
	char path[1024];
	json_t *root, *cases;
	int32_t *t = malloc((size_t)n * sizeof(*t));
	unsigned long long s = 0x9e3779b97f4a7c15ULL;
	size_t best = 0;
	int k = 0;

	snprintf(path, sizeof(path), "%s/golden.json", dir);
	root = json_load_file(path, 0, NULL);
	cases = root ? json_object_get(root, "cases") : NULL;
	for (size_t i = 0; cases && i < json_array_size(cases); i++) {
		json_t *toks = json_object_get(json_array_get(cases, i), "tokens");

		if (json_array_size(toks) > json_array_size(json_object_get(json_array_get(cases, best), "tokens")))
			best = i;
	}
	if (cases) {
		json_t *toks = json_object_get(json_array_get(cases, best), "tokens");

		for (; k < n && k < (int)json_array_size(toks); k++)
			t[k] = (int32_t)json_integer_value(json_array_get(toks, (size_t)k));
	}
	json_decref(root);
	for (; k < n; k++) {
		s ^= s << 13, s ^= s >> 7, s ^= s << 17;
		t[k] = (int32_t)(s % (unsigned long long)vocab);
	}
	return t;
}

static int prefill(struct engine *e, struct engine_seq *s, const int32_t *t, int n)
{
	float *l = malloc((size_t)e->model->cfg.vocab_size * sizeof(float));
	struct engine_req r = { .seq = s, .tokens = t, .n_tokens = n };
	char err[256] = "";
	int ret = engine_step(e, &r, 1, l, err, sizeof(err));

	if (ret)
		fprintf(stderr, "kdbench kvcache: prefill of %d tokens: %s\n", n, err);
	free(l);
	return ret;
}

/* Every full block of a fresh sequence over n tokens, fp32, back to back: malloc'd. */
static uint8_t *kv_pages(struct engine *e, const int32_t *t, int n, int *n_blocks)
{
	struct engine_seq s;
	uint8_t *pages = NULL;

	engine_seq_init(&s);
	*n_blocks = n / e->pool.block_tokens;
	if (!prefill(e, &s, t, n) && (pages = malloc(e->block_bytes * (size_t)*n_blocks))) {
		for (int b = 0; b < *n_blocks; b++)
			engine_block_read(e, s.blocks[b], pages + e->block_bytes * (size_t)b);
	}
	engine_seq_release(e, &s);
	return pages;
}

/* ---- codec figures -------------------------------------------------------- */

struct codec_result {
	double ratio;		/* raw / compressed */
	double c_mbs, d_mbs;	/* MB/s of raw data */
};

/* Compresses and decompresses n blocks of block_bytes each, for at least
 * MIN_TIMED_S each way; checks the round trip. */
static int codec_measure(const uint8_t *pages, int n, size_t block_bytes, size_t elem, int level,
			 int shuffle, struct codec_result *res)
{
	struct kv_codec c;
	size_t bound, zsum = 0;
	uint8_t *z, *out;
	size_t *zb;
	double t0, t;
	int reps = 0, ret;

	if ((ret = kv_codec_init(&c, block_bytes, elem, level, shuffle)))
		return ret;
	bound = kv_codec_bound(&c);
	z = malloc(bound * (size_t)n);
	zb = calloc((size_t)n, sizeof(*zb));
	out = malloc(block_bytes);
	t0 = clock_now();
	do {
		zsum = 0;
		for (int b = 0; b < n; b++) {
			kv_codec_compress(&c, z + bound * (size_t)b, bound, &zb[b], pages + block_bytes * (size_t)b);
			zsum += zb[b];
		}
		reps++;
	} while ((t = clock_now() - t0) < MIN_TIMED_S);
	res->ratio = (double)(block_bytes * (size_t)n) / (double)zsum;
	res->c_mbs = (double)(block_bytes * (size_t)n) * reps / t / 1e6;
	reps = 0;
	t0 = clock_now();
	do {
		for (int b = 0; b < n; b++) {
			if (kv_codec_decompress(&c, out, z + bound * (size_t)b, zb[b]) ||
			    memcmp(out, pages + block_bytes * (size_t)b, block_bytes)) {
				fprintf(stderr, "kdbench kvcache: round trip of block %d failed\n", b);
				ret = -EIO;
			}
		}
		reps++;
	} while (!ret && (t = clock_now() - t0) < MIN_TIMED_S);
	res->d_mbs = (double)(block_bytes * (size_t)n) * reps / t / 1e6;
	kv_codec_fini(&c);
	free(z);
	free(zb);
	free(out);
	return ret;
}

static uint16_t *to_bf16(const uint8_t *pages, size_t floats)
{
	uint16_t *h = malloc(floats * sizeof(*h));

	for (size_t i = 0; i < floats; i++) {
		float f;

		memcpy(&f, pages + 4 * i, 4);
		h[i] = k_f32_to_bf16(f);
	}
	return h;
}

static const char *const golden_models[] = { "llama3", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3" };

static int part_compress(const struct kvb_args *a)
{
	printf("\n### Host-tier codec on real KV pages (%d tokens per model, blocks of %d)\n\n", a->tokens,
	       ENGINE_DEFAULT_BLOCK_TOKENS);
	printf("| model | KV layout | dtype | shuffle | zstd | ratio | compress MB/s | decompress MB/s |\n");
	printf("|---|---|---|---|---|---|---|---|\n");
	for (size_t i = 0; i < sizeof(golden_models) / sizeof(golden_models[0]); i++) {
		char dir[1024];
		struct model *m;
		struct engine *e;
		int32_t *t;
		uint8_t *pages;
		uint16_t *half;
		int n;

		snprintf(dir, sizeof(dir), "%s/%s", a->golden, golden_models[i]);
		if (open_engine(dir, 0, ENGINE_DEFAULT_BLOCK_TOKENS, a->tokens + 64, a->threads, &m, &e))
			return 1;
		t = golden_tokens(dir, a->tokens, m->cfg.vocab_size);
		pages = kv_pages(e, t, a->tokens, &n);
		half = pages ? to_bf16(pages, e->block_bytes / 4 * (size_t)n) : NULL;
		for (int dt = 0; half && dt < 2; dt++) {
			for (int sh = 1; sh >= 0; sh--) {
				for (int level = 1; level <= 3; level += 2) {
					struct codec_result r;
					char layout[64];

					if (m->cfg.mla)
						snprintf(layout, sizeof(layout), "MLA %d+%d", m->cfg.kv_lora_rank,
							 m->cfg.qk_rope_head_dim);
					else
						snprintf(layout, sizeof(layout), "GQA %dx%d K+V", m->cfg.n_kv_heads,
							 m->cfg.head_dim);
					if (codec_measure(dt ? pages : (uint8_t *)half, n,
							  dt ? e->block_bytes : e->block_bytes / 2, dt ? 4 : 2, level,
							  sh, &r))
						return 1;
					printf("| %s | %s | %s | %s | %d | %.2f | %.0f | %.0f |\n", golden_models[i],
					       layout, dt ? "fp32" : "bf16", sh ? "yes" : "no", level, r.ratio,
					       r.c_mbs, r.d_mbs);
					fflush(stdout);
				}
			}
		}
		free(half);
		free(pages);
		free(t);
		engine_destroy(e);
		model_destroy(m);
	}
	return 0;
}

/* ---- restore against recompute ---------------------------------------------- */

static char *write_bench_config(void)
{
	char *path = strdup("/tmp/kdbench-kvcache-XXXXXX.json");
	int fd = mkstemps(path, 5);

	if (fd < 0 || write(fd, bench_config, sizeof(bench_config) - 1) != (ssize_t)(sizeof(bench_config) - 1)) {
		perror("kdbench kvcache: config");
		free(path);
		return NULL;
	}
	close(fd);
	return path;
}

static int restore_one(const struct kvb_args *a, const char *cfg, int n)
{
	int bt = ENGINE_DEFAULT_BLOCK_TOKENS;
	struct model *m;
	struct engine *e;
	struct engine_seq s;
	struct kv_session *sess;
	int32_t *t;
	double t_re, t_off, t_rest, c_re, c_rest;
	uint64_t z0;
	int cached = 0, ret;

	engine_seq_init(&s);
	if (open_engine(cfg, 1, bt, n + 2 * bt, a->threads, &m, &e))
		return 1;
	t = golden_tokens("/nonexistent", n + 1, m->cfg.vocab_size);
	/* recompute: the history as one prefill, as the turn of a session */
	ret = engine_session_open(e, "bench", 1, 1, &sess);
	if (!ret)
		ret = engine_seq_start_session(e, &s, sess, t, n, &cached);
	t_re = clock_now();
	c_re = cpu_now();
	if (!ret)
		ret = prefill(e, &s, t + cached, n - cached);
	t_re = clock_now() - t_re;
	c_re = cpu_now() - c_re;
	if (!ret)
		ret = engine_session_save(e, sess, &s);
	engine_seq_release(e, &s);
	/* offloaded, its device copies dropped, restored */
	z0 = e->stats.offloaded_zbytes;
	t_off = clock_now();
	if (!ret)
		ret = engine_session_offload(e, sess);
	t_off = clock_now() - t_off;
	engine_cache_drop(e);
	t_rest = clock_now();
	c_rest = cpu_now();
	if (!ret)
		ret = engine_session_restore(e, sess);
	t_rest = clock_now() - t_rest;
	c_rest = cpu_now() - c_rest;
	if (ret) {
		fprintf(stderr, "kdbench kvcache: session of %d tokens: %s\n", n, strerror(-ret));
	} else {
		double kv = (double)e->block_bytes * kv_pool_blocks_for(&e->pool, n) / (1 << 20);
		double zmb = (double)(e->stats.offloaded_zbytes - z0) / (1 << 20);

		printf("| %d | %.1f | %.1f | %.2f | %.1f | %.1f (%.1f) | %.0f (%.0f) | %.0f (%.0f) |\n", n, kv, zmb,
		       kv / zmb, t_off * 1e3, t_rest * 1e3, c_rest * 1e3, t_re * 1e3, c_re * 1e3, t_re / t_rest,
		       c_re / c_rest);
		fflush(stdout);
	}
	free(t);
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}

static int part_restore(const struct kvb_args *a)
{
	char *cfg = write_bench_config();
	int ret = 0;

	if (!cfg)
		return 1;
	printf("\n### Restore against recompute (CPU backend, %d threads, fp32 KV, blocks of %d)\n\n"
	       "Model: synthetic Llama, hidden 256, 2 layers, 4 query heads and 2 KV heads of 64,\n"
	       "MLP 768, vocab 4096 (KV: 2 KiB per token in fp32).\n\n",
	       a->threads > 0 ? a->threads : (int)sysconf(_SC_NPROCESSORS_ONLN), ENGINE_DEFAULT_BLOCK_TOKENS);
	printf("Times: wall ms (CPU ms of all threads).\n\n");
	printf("| history tokens | KV MiB | compressed MiB | ratio | offload ms | restore ms | recompute ms | recompute / restore |\n");
	printf("|---|---|---|---|---|---|---|---|\n");
	fflush(stdout);
	for (int i = 0; i < a->n_hist && !ret; i++)
		ret = restore_one(a, cfg, a->hist[i]);
	unlink(cfg);
	free(cfg);
	return ret;
}

/* ---- block size ---------------------------------------------------------------- */

static int blocks_one(const struct kvb_args *a, const char *cfg, int bt)
{
	char dir[1024];
	struct model *m;
	struct engine *e;
	struct engine_seq s;
	struct codec_result r = { 0 };
	int32_t *t;
	uint8_t *pages;
	uint16_t *half;
	double t_pre, t_dec;
	float *l;
	int n, ctx = 4096, steps = 32, ret = 1;

	snprintf(dir, sizeof(dir), "%s/llama3", a->golden);
	if (open_engine(dir, 0, bt, a->tokens + 2 * bt, a->threads, &m, &e))
		return 1;
	t = golden_tokens(dir, a->tokens, m->cfg.vocab_size);
	pages = kv_pages(e, t, a->tokens, &n);
	half = pages ? to_bf16(pages, e->block_bytes / 4 * (size_t)n) : NULL;
	if (half)
		codec_measure((uint8_t *)half, n, e->block_bytes / 2, 2, 1, 1, &r);
	free(t);
	free(pages);
	free(half);
	engine_destroy(e);
	model_destroy(m);

	if (open_engine(cfg, 1, bt, ctx + steps + 2 * bt, a->threads, &m, &e))
		return 1;
	t = golden_tokens("/nonexistent", ctx + steps, m->cfg.vocab_size);
	l = malloc((size_t)m->cfg.vocab_size * sizeof(float));
	engine_seq_init(&s);
	t_pre = clock_now();
	if (!prefill(e, &s, t, ctx)) {
		t_pre = clock_now() - t_pre;
		t_dec = clock_now();
		for (int i = 0; i < steps; i++)
			if (prefill(e, &s, t + ctx + i, 1))
				break;
		t_dec = clock_now() - t_dec;
		printf("| %d | %.2f | %.0f | %.2f | %.1f |\n", bt, r.ratio, t_pre * 1e3, t_dec * 1e3 / steps,
		       (double)(bt - 1) / 2);
		fflush(stdout);
		ret = 0;
	}
	engine_seq_release(e, &s);
	free(l);
	free(t);
	engine_destroy(e);
	model_destroy(m);
	return ret;
}

static int part_blocks(const struct kvb_args *a)
{
	static const int sizes[] = { 8, 16, 32, 64, 128 };
	char *cfg = write_bench_config();
	int ret = 0;

	if (!cfg)
		return 1;
	printf("\n### Block size\n\n"
	       "Ratio: bf16, shuffled, zstd 1 on llama3 KV (%d tokens). Prefill: 4096 tokens, decode: ms\n"
	       "per step at 4096 tokens of context, both on the synthetic model above.\n\n", a->tokens);
	printf("| block tokens | ratio | prefill 4k ms | decode ms | tokens recomputed per shared-prefix hit (mean) |\n");
	printf("|---|---|---|---|---|\n");
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && !ret; i++)
		ret = blocks_one(a, cfg, sizes[i]);
	unlink(cfg);
	free(cfg);
	return ret;
}

/* ---- main ------------------------------------------------------------------------ */

static int kvb_parse(int argc, char **argv, struct kvb_args *a)
{
	static const struct option opts[] = {
		{ "part", required_argument, NULL, 'p' },
		{ "golden", required_argument, NULL, 'g' },
		{ "tokens", required_argument, NULL, 'n' },
		{ "histories", required_argument, NULL, 'H' },
		{ "threads", required_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	static char golden[1024];
	const char *hist = "1024,8192,32768", *top = getenv("top_srcdir");
	char err[256];
	long v;
	int c;

	snprintf(golden, sizeof(golden), "%s/tests/data/golden", top ? top : ".");
	*a = (struct kvb_args){ .golden = golden, .part = "all", .tokens = 1024 };
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'p': a->part = optarg; break;
		case 'g': a->golden = optarg; break;
		case 'H': hist = optarg; break;
		case 'n':
		case 't':
			if (cli_parse_long(optarg, 1, c == 'n' ? 1 << 20 : 1024, &v)) {
				fprintf(stderr, "kdbench kvcache: bad number '%s'\n", optarg);
				return 2;
			}
			if (c == 'n')
				a->tokens = (int)v;
			else
				a->threads = (int)v;
			break;
		case 'h': kvb_usage(stdout); exit(0);
		default: kvb_usage(stderr); return 2;
		}
	}
	if (cli_parse_tokens(hist, 64, &a->hist, &a->n_hist, err, sizeof(err))) {
		fprintf(stderr, "kdbench kvcache: --histories: %s\n", err);
		return 2;
	}
	return 0;
}

int kdbench_kvcache_main(int argc, char **argv)
{
	struct kvb_args a;
	int all, ret = 0;

	if ((ret = kvb_parse(argc, argv, &a)))
		return ret;
	log_threshold = LOG_WARN;
	all = !strcmp(a.part, "all");
	if (!all && strcmp(a.part, "compress") && strcmp(a.part, "restore") && strcmp(a.part, "blocks")) {
		fprintf(stderr, "kdbench kvcache: --part %s: compress, restore, blocks or all\n", a.part);
		free(a.hist);
		return 2;
	}
	if (!ret && (all || !strcmp(a.part, "compress")))
		ret = part_compress(&a);
	if (!ret && (all || !strcmp(a.part, "restore")))
		ret = part_restore(&a);
	if (!ret && (all || !strcmp(a.part, "blocks")))
		ret = part_blocks(&a);
	free(a.hist);
	return ret;
}
