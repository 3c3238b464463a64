/* Draws by vocabulary slices on CUDA ranks (issue 25; docs/PARALLEL.md "Vocabulary-split
 * sampling"): at tp 2 and 4 (virtual ranks on one GPU), graphs on and off, every token
 * an engine draws by slices (engine_step_sample without logits: each rank's argmax, or
 * its best 64 pairs from k_cuda_topk_slice with the row's top_k chosen on the host)
 * must be k_cpu_sample's draw over the same engine's gathered row of the same step, bit
 * for bit. Rows as test_tp's check_draws: top_k 1, 5, 40, 64 in turn with temperature,
 * top-p on every other row, greedy rows mixed in, each row its own seed and step.
 * Paths: a prefill of 80 rows with every row's logits (the eager path, two lm_head
 * calls of 64 and 16 rows), then decode steps of one and of four sequences (the
 * replayed graphs, the top-k launch after the replay; checked to have replayed where
 * graphs are on); each decode step runs once gathering the logits, is rolled back
 * (engine_seq_truncate) and runs again drawing, so both see the same cache.
 * Models: the directories named on the command line (test_cuda_tp.sh passes the golden
 * ones: one chunk a slice) and a synthetic llama of a 151937-token vocabulary (slices
 * of 75969 and 37985: the chunked launch and its merge). Exits 77 without a GPU. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include "daemon/engine/engine.h"
#include "daemon/engine/forward.h"
#include "daemon/engine/forward_tp.h"
#include "daemon/model/model.h"
#include "daemon/model/model_shard.h"
#include "kernels/cpu/k_cpu_sample.h"
#include "tests/cudatest.h"

#define PREFILL 80	/* more than FWD_LOGIT_ROWS: two lm_head calls */
#define DECODE 5	/* decode steps per batch */
#define MAX_SEQS 4

static const char synth_config[] =
	"{\"model_type\": \"llama\", \"vocab_size\": 151937, \"hidden_size\": 64,"
	" \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
	" \"num_key_value_heads\": 4, \"head_dim\": 16, \"rms_norm_eps\": 1e-5,"
	" \"max_position_embeddings\": 4096, \"tie_word_embeddings\": false,"
	" \"rope_theta\": 500000.0, \"torch_dtype\": \"bfloat16\"}\n";

struct draws {
	struct engine *e;
	int vocab, bad, rows;
	float *logits;		/* (PREFILL, vocab) gathered rows of a step */
	float *work;		/* K_CPU_SAMPLE_WORK(vocab) */
	struct k_sample_params p[PREFILL];
	uint64_t steps[PREFILL];
	int32_t ids[PREFILL];
};

/* Row t's parameters (salt: the step), as test_tp's check_draws. */
static void params_for(struct draws *d, int n, int salt)
{
	static const int ks[] = { 1, 5, 40, FWD_TP_TOPK_MAX };

	for (int t = 0; t < n; t++) {
		int u = t + salt;

		d->p[t] = (struct k_sample_params){ .temperature = u % 7 == 3 ? 0.0f : 0.7f + 0.1f * (u % 5),
						    .top_k = ks[u % 4], .top_p = u % 2 ? 0.9f : 0.0f,
						    .seed = 1000u + 17u * (unsigned)u };
		d->steps[t] = (uint64_t)(u * 3 + 1);
	}
}

/* The n drawn ids against k_cpu_sample over the n gathered rows. */
static void compare(struct draws *d, int n, const char *what)
{
	int bad = 0;

	for (int t = 0; t < n; t++)
		bad += d->ids[t] != k_cpu_sample(d->logits + (size_t)t * d->vocab, d->vocab, &d->p[t],
						  d->steps[t], d->work);
	if (bad)
		fprintf(stderr, "  %s: %d of %d draws differ from k_cpu_sample\n", what, bad, n);
	d->bad += bad;
	d->rows += n;
}

/* One prefill of PREFILL rows, every row out: gathered, then drawn on a fresh sequence. */
static int prefill_path(struct draws *d, const char *what)
{
	int32_t tokens[PREFILL];
	struct engine_seq a, b;
	struct engine_req r;
	char err[512] = "";
	int ret;

	for (int t = 0; t < PREFILL; t++)
		tokens[t] = (t * 37 + 11) % d->vocab;
	params_for(d, PREFILL, 0);
	engine_seq_init(&a);
	r = (struct engine_req){ .seq = &a, .tokens = tokens, .n_tokens = PREFILL, .all_logits = 1 };
	ret = engine_step(d->e, &r, 1, d->logits, err, sizeof(err));
	engine_seq_release(d->e, &a);
	engine_seq_init(&b);
	r.seq = &b;
	if (!ret)
		ret = engine_step_sample(d->e, &r, 1, d->p, d->steps, d->ids, NULL, err, sizeof(err));
	engine_seq_release(d->e, &b);
	CHECK(ret == 0, "%s: prefill: %s", what, err);
	if (!ret)
		compare(d, PREFILL, what);
	return ret;
}

/* n sequences, each a short prompt, then DECODE steps of one token each: gathered,
 * rolled back, drawn. */
static int decode_path(struct draws *d, int n, const char *what)
{
	struct engine_seq s[MAX_SEQS];
	struct engine_req r[MAX_SEQS];
	int32_t prompt[MAX_SEQS][3], tok[MAX_SEQS];
	char err[512] = "";
	int ret = 0;

	for (int i = 0; i < n; i++) {
		for (int t = 0; t < 3; t++)
			prompt[i][t] = (i * 101 + t * 7 + 3) % d->vocab;
		engine_seq_init(&s[i]);
		r[i] = (struct engine_req){ .seq = &s[i], .tokens = prompt[i], .n_tokens = 3 };
	}
	ret = engine_step(d->e, r, n, d->logits, err, sizeof(err));
	for (int k = 0; k < DECODE && !ret; k++) {
		for (int i = 0; i < n; i++) {
			tok[i] = (k * 13 + i * 5 + 2) % d->vocab;
			r[i] = (struct engine_req){ .seq = &s[i], .tokens = &tok[i], .n_tokens = 1 };
		}
		params_for(d, n, 3 * k + n);
		ret = engine_step(d->e, r, n, d->logits, err, sizeof(err));
		for (int i = 0; i < n && !ret; i++)
			ret = engine_seq_truncate(d->e, &s[i], s[i].n_tokens - 1);
		if (!ret)
			ret = engine_step_sample(d->e, r, n, d->p, d->steps, d->ids, NULL, err, sizeof(err));
		if (!ret)
			compare(d, n, what);
	}
	for (int i = 0; i < n; i++)
		engine_seq_release(d->e, &s[i]);
	CHECK(ret == 0, "%s: decode of %d: %d %s", what, n, ret, err);
	return ret;
}

static void check_engine(struct model *m, const char *name, int tp, int no_graphs)
{
	struct engine_opts eo = { .backend = "cuda", .tp = tp, .kv_tokens = 1024, .block_tokens = 16,
				  .max_rows = 128, .no_graphs = no_graphs };
	struct draws d = { .vocab = m->cfg.vocab_size };
	char err[512] = "", what[160];
	uint64_t replays;
	int ret;

	snprintf(what, sizeof(what), "%s tp %d%s", name, tp, no_graphs ? " --no-graphs" : "");
	if (model_shard_check(&m->cfg, tp, 0, err, sizeof(err))) {
		fprintf(stderr, "  %s: refused (%s)\n", what, err);
		return;
	}
	ret = engine_create(&d.e, m, &eo, err, sizeof(err));
	CHECK(ret == 0, "%s: %s", what, err);
	if (ret)
		return;
	d.logits = malloc(sizeof(float) * PREFILL * (size_t)d.vocab);
	d.work = malloc(sizeof(float) * K_CPU_SAMPLE_WORK((size_t)d.vocab));
	replays = d.e->fwd->graph_replays;
	if (d.logits && d.work && !prefill_path(&d, what) && !decode_path(&d, 1, what))
		decode_path(&d, MAX_SEQS, what);
	CHECK(d.bad == 0, "%s: %d of %d draws by slices differ from k_cpu_sample over the gathered "
	      "rows", what, d.bad, d.rows);
	/* graphs on: the decode steps replayed them (one graph of every rank's step) */
	CHECK(no_graphs || d.e->fwd->graph_replays > replays, "%s: no decode step replayed a graph",
	      what);
	fprintf(stderr, "  %-36s %d draws (greedy and top-k) as k_cpu_sample over the gathered rows, "
		"%llu graph replays\n", what, d.rows,
		(unsigned long long)(d.e->fwd->graph_replays - replays));
	engine_destroy(d.e);
	free(d.logits);
	free(d.work);
}

static void check_model(struct model *m, const char *name)
{
	for (int tp = 2; tp <= 4; tp += 2)
		for (int ng = 0; ng <= 1; ng++)
			check_engine(m, name, tp, ng);
}

int main(int argc, char **argv)
{
	char dir[] = "/tmp/kd_tp_draws.XXXXXX", path[sizeof(dir) + 16], err[512] = "";
	struct model_load_opts synth = { .synthetic = 1, .seed = 7 };
	struct model *m = NULL;
	FILE *f;

	if (!test_gpu_present("test_cuda_tp_draws"))
		return 77;
	for (int i = 1; i < argc; i++) {
		CHECK(model_load(&m, argv[i], NULL, err, sizeof(err)) == 0, "%s: %s", argv[i], err);
		if (m)
			check_model(m, argv[i]);
		model_destroy(m);
		m = NULL;
	}
	if (!mkdtemp(dir)) {
		CHECK(0, "mkdtemp: %s", strerror(errno));
		return test_result("test_cuda_tp_draws");
	}
	snprintf(path, sizeof(path), "%s/config.json", dir);
	f = fopen(path, "w");
	CHECK(f && fputs(synth_config, f) >= 0 && fclose(f) == 0, "%s: cannot write", path);
	CHECK(model_load(&m, path, &synth, err, sizeof(err)) == 0, "synthetic 151937-token llama: %s", err);
	if (m)
		check_model(m, "synthetic llama, vocab 151937");
	model_destroy(m);
	unlink(path);
	rmdir(dir);
	return test_result("test_cuda_tp_draws");
}

#else
int main(void)
{
	fprintf(stderr, "test_cuda_tp_draws: skipped: built without CUDA\n");
	return 77;
}
#endif
