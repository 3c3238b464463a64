/* Tensor parallel on the CPU backend (docs/PARALLEL.md): for every golden and reference
 * model and tp = 2, 3, 4, 8, an engine of that many ranks (threads, each over its own
 * shard) must give tp 1's logits within 1e-5 relative L2 per row, by one prefill, by
 * incremental decode and with the cases batched; where the shapes do not split, the
 * engine must refuse with one line naming tp and the numbers. MoE models run twice:
 * tensor-parallel experts (a slice of each per rank) and expert parallel (a share of
 * the experts whole per rank, --ep). Then synthetic variants
 * of tests/data/tiny configs with shapes the checkpoints lack (tp 3; KV heads
 * replicated). The reference models' odd vocabularies split unevenly. The checkpoints'
 * tp N engines build their shards from the files mapped (as kdecd --tp does); tp 1
 * runs on the model read whole. Every tp engine's greedy ids (drawn by vocabulary
 * slices) equal the argmax of its gathered logits; the slices' merge equals
 * k_cpu_sample's greedy pick on rows with ties and NaNs; the reduction with the next
 * RMSNorm fused gives the bits of the reduction followed by the norm. The GGUF
 * checkpoints (tests/data/gguf-golden) run the same way, their tp N shards read from
 * the mapped file slice by slice (nothing of the model dequantized whole), byte-equal to
 * those cut from the model read whole; the Q8_0 one's MLP columns split inside its
 * 32-element blocks (each rank dequantizes the blocks its columns touch). How the ranks' decode steps are
 * captured into graphs follows from their devices (backend_tp_graph_kind: one graph
 * where all share one, a graph each where none shares, op by op for a mix); the cpu
 * ranks capture none. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/forward.h"
#include "daemon/engine/forward_tp.h"
#include "daemon/engine/route_trace.h"
#include "daemon/engine/tp_comm.h"
#include "daemon/model/model.h"
#include "daemon/model/model_shard.h"
#include "format/gguf.h"
#include "kernels/cpu/k_cpu.h"
#include "kernels/cpu/k_cpu_sample.h"
#include "tests/testutil.h"
#include "tests/goldentest.h"

#define TP_ROW_TOL 1e-5
#define MAX_CASES 4
#define INCR_MAX 64	/* incremental steps per case: positions to 63 go through the
			 * paged cache one token a step; the rest is prefill's (keeps the
			 * ASan run of 8 ranks on 2 cores short) */

static const char *const models[] = {
	"golden/llama3", "golden/qwen3", "golden/qwen3_moe", "golden/deepseek_v2", "golden/deepseek_v3",
	"reference/llama", "reference/qwen3", "reference/qwen3_moe", "reference/deepseek_v2",
	"reference/deepseek_v3", "reference/kimi_k2",
	/* quantized checkpoints: shards of payloads and scales (fp8 128x128 blocks; int4
	 * groups of 32, nibbles repacked where a rank's columns start inside a word;
	 * qwen3_moe_int4's o_proj columns split inside groups: restated in smaller ones) */
	"quant/deepseek_v3_fp8_block", "quant/kimi_k2_int4", "quant/qwen3_moe_int4",
};
static const int tps[] = { 2, 3, 4, 8 };
/* tests/data/gguf-golden (bf16; made from the golden checkpoints by llama.cpp's
 * converter): their tp N shards dequantized slice by slice from the mapped file */
static const char *const gguf_models[] = {
	"llama3", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",	/* llama31_rope: one head */
};

struct tcase {
	int32_t *tokens;
	int n;
};

/* Rows of every path, back to back: prefill (n rows), incremental (up to INCR_MAX),
 * batched (2 per case); returns the rows written or -1 with the error said. */
static int run_paths(struct engine *e, const struct tcase *cs, int nc, float *out, const char *what)
{
	int vocab = e->model->cfg.vocab_size, rows = 0, ret = 0;
	struct engine_seq seq[MAX_CASES];
	struct engine_req r[MAX_CASES];
	char err[512] = "";

	for (int i = 0; i < nc && !ret; i++) {	/* one prefill per case, every row's logits */
		engine_seq_init(&seq[0]);
		r[0] = (struct engine_req){ .seq = &seq[0], .tokens = cs[i].tokens, .n_tokens = cs[i].n,
					    .all_logits = 1 };
		ret = engine_step(e, r, 1, out + (size_t)rows * vocab, err, sizeof(err));
		engine_seq_release(e, &seq[0]);
		rows += cs[i].n;
	}
	for (int i = 0; i < nc && !ret; i++) {	/* incremental: one token a step */
		engine_seq_init(&seq[0]);
		for (int t = 0; t < cs[i].n && t < INCR_MAX && !ret; t++, rows++) {
			r[0] = (struct engine_req){ .seq = &seq[0], .tokens = &cs[i].tokens[t], .n_tokens = 1 };
			ret = engine_step(e, r, 1, out + (size_t)rows * vocab, err, sizeof(err));
		}
		engine_seq_release(e, &seq[0]);
	}
	for (int i = 0; i < nc; i++) {	/* batched: all cases in one step, then one decode */
		engine_seq_init(&seq[i]);
		r[i] = (struct engine_req){ .seq = &seq[i], .tokens = cs[i].tokens, .n_tokens = cs[i].n - 1 };
	}
	if (!ret)
		ret = engine_step(e, r, nc, out + (size_t)rows * vocab, err, sizeof(err));
	rows += nc;
	for (int i = 0; i < nc && !ret; i++)
		r[i] = (struct engine_req){ .seq = &seq[i], .tokens = &cs[i].tokens[cs[i].n - 1], .n_tokens = 1 };
	if (!ret)
		ret = engine_step(e, r, nc, out + (size_t)rows * vocab, err, sizeof(err));
	rows += nc;
	for (int i = 0; i < nc; i++)
		engine_seq_release(e, &seq[i]);
	CHECK(ret == 0, "%s: step: %s", what, err);
	return ret ? -1 : rows;
}

/* Vocabulary-split sampling: the token of each case's every prefill row, drawn by the
 * ranks' slices (engine_step_sample without logits), must be exactly k_cpu_sample's
 * draw from that row's gathered logits (rows of got, the prefills first). Greedy (topk
 * 0): every row greedy, each rank's argmax; topk 1: (ranks with host memory) top_k 1,
 * 5, 40, FWD_TP_TOPK_MAX in turn with temperature, top-p on every other row, greedy
 * rows mixed in, each row its own seed and step: each rank's top-k pairs. */
static void check_draws(struct engine *e, const struct tcase *cs, int nc, const float *got,
			const char *what, int topk)
{
	static const int ks[] = { 1, 5, 40, FWD_TP_TOPK_MAX };
	int vocab = e->model->cfg.vocab_size, row = 0, bad = 0, ret = 0, total = 0;
	struct k_sample_params p[256] = { 0 };
	uint64_t steps[256] = { 0 };
	int32_t ids[256];
	float *work = malloc(sizeof(float) * K_CPU_SAMPLE_WORK((size_t)vocab));
	char err[512] = "";

	for (int i = 0; i < nc && !ret && work; i++) {
		struct engine_seq seq;
		struct engine_req r = { .seq = &seq, .tokens = cs[i].tokens, .n_tokens = cs[i].n,
					.all_logits = 1 };

		if (cs[i].n > 256) {
			row += cs[i].n;
			continue;
		}
		for (int t = 0; topk && t < cs[i].n; t++) {
			p[t] = (struct k_sample_params){ .temperature = t % 7 == 3 ? 0.0f : 0.7f + 0.1f * (t % 5),
							 .top_k = ks[t % 4], .top_p = t % 2 ? 0.9f : 0.0f,
							 .seed = 1000u + 17u * (unsigned)t };
			steps[t] = (uint64_t)(t * 3 + i);
		}
		engine_seq_init(&seq);
		ret = engine_step_sample(e, &r, 1, p, steps, ids, NULL, err, sizeof(err));
		engine_seq_release(e, &seq);
		for (int t = 0; !ret && t < cs[i].n; t++, row++) {
			bad += ids[t] != k_cpu_sample(got + (size_t)row * vocab, vocab, &p[t], steps[t], work);
			total++;
		}
	}
	CHECK(work && ret == 0 && bad == 0, "%s: %s draws by vocabulary slices: %d of %d rows differ "
	      "from k_cpu_sample over the gathered logits (%d: %s)", what, topk ? "top-k" : "greedy",
	      bad, total, ret, err);
	free(work);
}

/* The reduction with the next RMSNorm fused (tp_comm_reduce_norm): n ranks as threads,
 * each with its partials and a copy of the same residual; every rank must end with the
 * bits of the plain reduction (the sum in rank order added to the residual) followed by
 * k_cpu_rmsnorm, residual and norm alike, for rows that do and do not divide by n. */
#define RN_W 40
#define RN_ROWS 7

struct rn_rank {
	struct tp_comm *c;
	int r, rows;
	float part[RN_ROWS * RN_W], res[RN_ROWS * RN_W], out[RN_ROWS * RN_W];
	const uint16_t *gamma;
	int ret;
};

static void *rn_main(void *arg)
{
	struct rn_rank *k = arg;
	struct tp_norm norm = { .gamma = k->gamma, .dtype = K_BF16, .width = RN_W, .eps = 1e-5f,
				.out = k->out };

	/* out == part: the engine's buffers may be the same */
	norm.out = k->r % 2 ? k->part : k->out;
	k->ret = tp_comm_reduce_norm(k->c, k->r, k->part, (size_t)k->rows * RN_W, k->res, &norm);
	if (norm.out == k->part)
		memcpy(k->out, k->part, sizeof(k->out));
	return NULL;
}

static void check_reduce_norm(void)
{
	static struct rn_rank ranks[8];
	uint16_t gamma[RN_W];
	uint64_t x = 3;
	int bad = 0, cases = 0;

	for (int i = 0; i < RN_W; i++)
		gamma[i] = (uint16_t)(0x3f80 + i);	/* bf16 1.0 .. */
	for (int n = 2; n <= 8; n *= 2)
		for (int rows = 1; rows <= RN_ROWS; rows += 3, cases++) {
			struct tp_comm c;
			pthread_t th[8];
			float res[RN_ROWS * RN_W], want[RN_ROWS * RN_W];
			size_t m = (size_t)rows * RN_W;

			for (size_t i = 0; i < m; i++) {
				x = x * 6364136223846793005ull + 1442695040888963407ull;
				res[i] = (float)((int64_t)(x >> 40) - (1 << 23)) / (1 << 21);
			}
			for (int r = 0; r < n; r++) {
				ranks[r] = (struct rn_rank){ .c = &c, .r = r, .rows = rows, .gamma = gamma };
				memcpy(ranks[r].res, res, m * sizeof(float));
				for (size_t i = 0; i < m; i++) {
					x = x * 6364136223846793005ull + 1442695040888963407ull;
					ranks[r].part[i] = (float)((int64_t)(x >> 40) - (1 << 23)) / (1 << 20);
				}
			}
			for (size_t i = 0; i < m; i++) {	/* the plain reduction, then the op */
				float sum = ranks[0].part[i];

				for (int r = 1; r < n; r++)
					sum += ranks[r].part[i];
				res[i] += sum;
			}
			k_cpu_rmsnorm(want, RN_W, res, RN_W, gamma, K_BF16, rows, RN_W, 1e-5f);
			if (tp_comm_init(&c, n, m)) {
				bad++;
				continue;
			}
			for (int r = 0; r < n; r++)
				pthread_create(&th[r], NULL, rn_main, &ranks[r]);
			for (int r = 0; r < n; r++)
				pthread_join(th[r], NULL);
			for (int r = 0; r < n; r++)
				bad += ranks[r].ret != 0 || memcmp(ranks[r].res, res, m * sizeof(float)) ||
				       memcmp(ranks[r].out, want, m * sizeof(float));
			tp_comm_fini(&c);
		}
	CHECK(bad == 0, "tp_comm_reduce_norm: %d rank results differ from the reduction followed by "
	      "k_cpu_rmsnorm", bad);
	fprintf(stderr, "  reduction + residual + RMSNorm fused: %d cases (tp 2, 4, 8; 1, 4, 7 rows), "
		"bit for bit as reduction then norm\n", cases);
}

/* The merge of the slices' argmaxes is the whole row's argmax by kernels/cpu/sample.c's
 * rule, on rows made of few values (ties across slices), NaNs and all-NaN slices,
 * for uneven splits. */
static void check_argmax_merge(void)
{
	static const float vals[] = { -1.0f, 0.0f, 2.0f, 2.0f, NAN, -INFINITY };
	struct k_sample_params greedy = { 0 };
	uint64_t x = 5;
	int bad = 0, cases = 0;

	for (int vocab = 1; vocab <= 41; vocab += 4)
		for (int n = 1; n <= 8 && n <= vocab; n++)
			for (int k = 0; k < 50; k++, cases++) {
				float l[41], v[8];
				int32_t ids[8], want;

				for (int i = 0; i < vocab; i++) {
					x = x * 6364136223846793005ull + 1442695040888963407ull;
					l[i] = vals[(x >> 33) % (k < 10 ? 6 : 4 + (k % 2))];
				}
				if (k % 7 == 0)	/* a whole first slice of NaN */
					for (int i = 0; i < vocab / n; i++)
						l[i] = NAN;
				for (int r = 0; r < n; r++) {
					int v0, vn;

					model_shard_vocab(vocab, r, n, &v0, &vn);
					ids[r] = v0 + forward_tp_argmax(l + v0, vn, &v[r]);
				}
				want = k_cpu_sample(l, vocab, &greedy, 0, NULL);
				bad += forward_tp_argmax_merge(v, ids, n, 1) != want;
			}
	CHECK(bad == 0, "argmax merge: %d of %d rows differ from k_cpu_sample's greedy pick", bad, cases);
	fprintf(stderr, "  argmax merge of vocabulary slices: %d rows with ties and NaNs, as k_cpu_sample\n",
		cases);
}

/* backend_tp_graph_kind's choice (forward_tp_graph.c acts on it): every rank on one
 * device, one graph of all; every rank on its own, a graph each (the path that waits
 * for a multi-GPU machine); some sharing and some not, none. */
static void check_graph_kind(void)
{
	static const struct {
		int n, devs[8];
		enum backend_tp_graph want;
	} cases[] = {
		{ 2, { 0, 0 }, BACKEND_TP_GRAPH_ONE },
		{ 4, { 3, 3, 3, 3 }, BACKEND_TP_GRAPH_ONE },
		{ 2, { 0, 1 }, BACKEND_TP_GRAPH_PER_RANK },
		{ 8, { 0, 1, 2, 3, 4, 5, 6, 7 }, BACKEND_TP_GRAPH_PER_RANK },
		{ 4, { 7, 2, 5, 0 }, BACKEND_TP_GRAPH_PER_RANK },
		{ 4, { 0, 0, 1, 1 }, BACKEND_TP_GRAPH_NONE },
		{ 3, { 0, 1, 0 }, BACKEND_TP_GRAPH_NONE },
		{ 8, { 0, 1, 2, 3, 4, 5, 6, 6 }, BACKEND_TP_GRAPH_NONE },
		{ 1, { 0 }, BACKEND_TP_GRAPH_NONE },
	};
	char err[256];
	const struct backend_ops *cpu = backend_find("cpu", err, sizeof(err));

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		CHECK(backend_tp_graph_kind(cases[i].devs, cases[i].n) == cases[i].want,
		      "graph kind of case %zu: %d, want %d", i,
		      (int)backend_tp_graph_kind(cases[i].devs, cases[i].n), (int)cases[i].want);
	CHECK(cpu && !cpu->tp_capture_begin && !cpu->tp_graph_kind,
	      "the cpu backend's ranks capture no graphs");
	fprintf(stderr, "  graph kind of the ranks' devices: %zu cases\n", sizeof(cases) / sizeof(cases[0]));
}

static const char *const mode_names[] = { "", " ep", " mla-cp" };

/* mode: 0 the experts sliced, 1 expert parallel (--ep), 2 the MLA latent cache split
 * by tokens (--mla-cp, decode context parallel). */
static struct engine *open_engine(struct model *m, int tp, int mode, char *err, size_t err_len,
				  int *ret)
{
	/* two threads in all, shared among the ranks: CI has two cores */
	struct engine_opts eo = { .backend = "cpu", .threads = 2, .tp = tp, .ep = mode == 1,
				  .mla_cp = mode == 2, .kv_tokens = 1024, .block_tokens = 16,
				  .max_rows = 64 };
	struct engine *e = NULL;

	*ret = engine_create(&e, m, &eo, err, err_len);
	return e;
}

/* tp's refusal: one line that names tp and what it does not divide. */
static void check_refusal(struct model *m, const char *name, int tp, int mode)
{
	char err[512] = "", want[32];
	int ret;
	struct engine *e = open_engine(m, tp, mode, err, sizeof(err), &ret);

	snprintf(want, sizeof(want), "tp %d ", tp);
	CHECK(!e && ret == -EINVAL, "%s: tp %d: the shapes do not split, yet engine_create gave %d",
	      name, tp, ret);
	CHECK(strstr(err, want) && (strstr(err, "does not divide") || strstr(err, "more than")) &&
	      !strchr(err, '\n'), "%s: tp %d: refusal '%s'", name, tp, err);
	fprintf(stderr, "  %-22s tp %d%s refused: %s\n", name, tp, mode_names[mode], err);
	engine_destroy(e);
}

/* --mla-cp where it cannot run (a model without MLA; one rank): one line. */
static void check_cp_refused(struct model *m, const char *name, int tp)
{
	char err[512] = "";
	int ret;
	struct engine *e = open_engine(m, tp, 2, err, sizeof(err), &ret);

	CHECK(!e && ret == -EINVAL && strstr(err, "--mla-cp") && !strchr(err, '\n'),
	      "%s: tp %d mla-cp gave %d, '%s'", name, tp, ret, err);
	fprintf(stderr, "  %-22s tp %d mla-cp refused: %s\n", name, tp, err);
	engine_destroy(e);
}

/* Every tp of tps[] against tp 1 on model m over the cases, the experts of a MoE model
 * sliced and (ep) whole, an MLA model's latent cache also split by tokens (mla-cp; its
 * KV bytes per rank 1/tp of tp 1's, and one row): within tolerance on every row of every path where the shapes
 * split, refused with one line where they do not. The ranks' shards are built from mt:
 * m itself, or the same checkpoint mapped (shards read straight from the files). */
static void compare_tps(struct model *m, struct model *mt, const char *name, const struct tcase *cs,
			int nc)
{
	struct engine *e;
	float *want, *got;
	char err[512] = "";
	int total = 0, rows, ret;
	size_t kv1 = 0;

	for (int i = 0; i < nc; i++)
		total += cs[i].n;
	want = malloc((size_t)(2 * total + 2 * nc) * (size_t)m->cfg.vocab_size * sizeof(float));
	got = malloc((size_t)(2 * total + 2 * nc) * (size_t)m->cfg.vocab_size * sizeof(float));
	e = open_engine(m, 1, 0, err, sizeof(err), &ret);
	CHECK(e != NULL, "%s: tp 1: %s", name, err);
	rows = e ? run_paths(e, cs, nc, want, name) : -1;
	kv1 = e ? e->fwd->kv_bytes : 0;
	engine_destroy(e);
	for (int k = 0; rows > 0 && k < 3 * (int)(sizeof(tps) / sizeof(tps[0])); k++) {
		int tp = tps[k / 3], mode = k % 3, ep = mode == 1, bad = 0, n;
		double worst = 0;

		if ((ep && m->cfg.n_experts <= 0) || (mode == 2 && !m->cfg.mla))
			continue;
		if (model_shard_check(&m->cfg, tp, ep, err, sizeof(err))) {
			check_refusal(mt, name, tp, mode);
			continue;
		}
		e = open_engine(mt, tp, mode, err, sizeof(err), &ret);
		CHECK(e != NULL, "%s: tp %d%s: %s", name, tp, mode_names[mode], err);
		if (!e)
			continue;
		if (mode == 2) {	/* each rank ceil(T / tp) + 1 of tp 1's T cache rows */
			const struct model_config *c = &m->cfg;
			size_t row = (size_t)(c->kv_lora_rank + c->qk_rope_head_dim) * sizeof(float) *
				     (size_t)c->n_layers, T = kv1 / row;
			size_t want_kv = (size_t)tp * ((T + (size_t)tp - 1) / (size_t)tp + 1) * row;

			CHECK(e->fwd->kv_bytes == want_kv, "%s: tp %d mla-cp: %zu bytes of KV cache in "
			      "all, want %zu (tp 1: %zu)", name, tp, e->fwd->kv_bytes, want_kv, kv1);
			fprintf(stderr, "  %-22s tp %d mla-cp: KV cache %.1f KiB a rank (tp 1: %.1f KiB)\n",
				name, tp, (double)e->fwd->kv_bytes / tp / 1024, (double)kv1 / 1024);
		}
		CHECK(e->fwd->tp != NULL, "%s: tp %d: the engine runs one rank", name, tp);
		memset(got, 0xff, (size_t)rows * m->cfg.vocab_size * sizeof(float));	/* NaN */
		n = run_paths(e, cs, nc, got, name);
		for (int i = 0; i < n; i++) {
			size_t off = (size_t)i * m->cfg.vocab_size;
			double rel = test_rel_l2(got + off, want + off, (size_t)m->cfg.vocab_size);

			if (!(rel <= TP_ROW_TOL))
				bad++;
			worst = rel > worst || rel != rel ? rel : worst;
		}
		CHECK(n == rows && bad == 0, "%s: tp %d%s: %d of %d rows beyond %g (worst %.3g)", name,
		      tp, mode_names[mode], bad, rows, TP_ROW_TOL, worst);
		if (n == rows) {
			check_draws(e, cs, nc, got, name, 0);
			check_draws(e, cs, nc, got, name, 1);
		}
		fprintf(stderr, "  %-22s tp %d%s: %d rows (prefill, incremental, batched), worst %.2e\n",
			name, tp, mode_names[mode], n, worst);
		engine_destroy(e);
	}
	free(want);
	free(got);
}

/* A routing trace records rank 0's routing (every rank's: the router and its input are
 * replicated): a step with one runs and records it; a trace that forces choices would
 * change rank 0's alone: a step with one is refused with a line saying so. */
static void check_trace_refused(struct model *m, const char *name)
{
	struct route_trace *t = NULL, *forced = NULL;
	struct engine_seq seq;
	struct engine_req r;
	char err[512] = "";
	int32_t tok = 1;
	float *logits = malloc(sizeof(float) * (size_t)m->cfg.vocab_size);
	int ret;
	struct engine *e = open_engine(m, 2, 0, err, sizeof(err), &ret);

	CHECK(e && logits && route_trace_create(&t, m->cfg.n_layers, m->cfg.n_experts, m->cfg.top_k,
						 1, 8) == 0 &&
	      route_trace_create(&forced, m->cfg.n_layers, m->cfg.n_experts, m->cfg.top_k, 1, 8) == 0,
	      "%s: tp 2 with a trace: %s", name, err);
	if (e && t && forced && logits) {
		engine_set_route_trace(e, t);
		engine_seq_init(&seq);
		r = (struct engine_req){ .seq = &seq, .tokens = &tok, .n_tokens = 1 };
		ret = engine_step(e, &r, 1, logits, err, sizeof(err));
		CHECK(ret == 0 && t->have[0], "%s: tp 2 with a recording trace: %d (%s), recorded %d",
		      name, ret, err, t->have[0]);
		engine_seq_release(e, &seq);
		CHECK(route_trace_force_from(forced, t) == 0, "%s: forced choices", name);
		engine_set_route_trace(e, forced);
		engine_seq_init(&seq);
		r = (struct engine_req){ .seq = &seq, .tokens = &tok, .n_tokens = 1 };
		err[0] = 0;
		ret = engine_step(e, &r, 1, logits, err, sizeof(err));
		CHECK(ret != 0 && strstr(err, "forced routing with tp 2"),
		      "%s: tp 2 ran a step with forced routing (%d: %s)", name, ret, err);
		engine_seq_release(e, &seq);
		engine_set_route_trace(e, NULL);
	}
	route_trace_destroy(forced);
	route_trace_destroy(t);
	engine_destroy(e);
	free(logits);
}

static void check_model(const char *top, const char *name)
{
	char dir[1024], path[1200], err[512] = "";
	struct tcase cs[MAX_CASES] = { 0 };
	struct model_load_opts mapped = { .mapped = 1 };
	struct model *m = NULL, *mt = NULL;
	json_error_t jerr;
	json_t *g, *cases;
	int nc = 0;

	if (name[0] == '/')	/* KDEC_TP_EXTRA: a folder of the same format */
		snprintf(dir, sizeof(dir), "%s", name);
	else
		snprintf(dir, sizeof(dir), "%s/tests/data/%s", top, name);
	snprintf(path, sizeof(path), "%s/golden.json", dir);
	g = json_load_file(path, 0, &jerr);
	CHECK(g != NULL, "%s: %s", path, jerr.text);
	if (!g)
		return;
	CHECK(model_load(&m, dir, NULL, err, sizeof(err)) == 0, "%s: load: %s", name, err);
	CHECK(model_load(&mt, dir, &mapped, err, sizeof(err)) == 0 && mt->mapped, "%s: load mapped: %s",
	      name, err);
	cases = json_object_get(g, "cases");
	for (size_t i = 0; m && i < json_array_size(cases) && nc < MAX_CASES; i++, nc++)
		cs[nc].tokens = golden_ids(json_object_get(json_array_get(cases, i), "tokens"), &cs[nc].n);
	if (m && mt)
		compare_tps(m, mt, name, cs, nc);
	if (m && !strcmp(name, "golden/qwen3_moe"))
		check_trace_refused(m, name);
	if (m && !strcmp(name, "golden/llama3"))
		check_cp_refused(m, name, 2);
	if (m && !strcmp(name, "golden/deepseek_v3"))	/* one rank: nothing to split over */
		check_cp_refused(m, name, 1);
	for (int i = 0; i < nc; i++)
		free(cs[i].tokens);
	model_destroy(mt);
	model_destroy(m);
	json_decref(g);
}

/* Every rank's shard cut from mt (mapped, or a lazy synthetic model) byte for byte the
 * one cut from m (the same model read or made whole), at every tp of tps[] the shapes
 * split, experts sliced and (a MoE model) whole. */
static void check_shards_equal(const struct model *m, const struct model *mt, const char *name,
			       const char *how)
{
	char err[512] = "";

	for (size_t k = 0; k < sizeof(tps) / sizeof(tps[0]); k++) {
		for (int ep = 0; ep <= (m->cfg.n_experts > 0); ep++) {
			int n = tps[k];

			if (model_shard_check(&m->cfg, n, ep, err, sizeof(err)))
				continue;
			for (int r = 0; r < n; r++) {
				struct model *sw = NULL, *sm = NULL;

				CHECK(model_shard_create(&sw, m, r, n, ep, err, sizeof(err)) == 0 &&
				      model_shard_create(&sm, mt, r, n, ep, err, sizeof(err)) == 0,
				      "%s: tp %d%s rank %d: %s", name, n, ep ? " ep" : "", r, err);
				CHECK(sw && sm && sw->weight_bytes == sm->weight_bytes &&
				      !memcmp(sw->shard_buf, sm->shard_buf, sw->weight_bytes),
				      "%s: tp %d%s rank %d: the shard %s differs", name, n, ep ? " ep" : "",
				      r, how);
				/* a shared expert: every rank its 1/n of the rows, expert parallel too
				 * (whole on rank 0 only where n does not divide them) */
				for (int l = 0; sw && l < m->cfg.n_layers; l++) {
					const struct model_tensor *g = &m->layers[l].w_gate;
					int64_t want = !m->layers[l].is_moe || g->rows % n == 0 ? g->rows / n
						       : r == 0 ? g->rows : 0;

					if (g->data && (sw->layers[l].w_gate.data ? sw->layers[l].w_gate.rows : 0) != want)
						CHECK(0, "%s: tp %d%s rank %d layer %d: %lld shared-expert rows, want %lld",
						      name, n, ep ? " ep" : "", r, l,
						      (long long)sw->layers[l].w_gate.rows, (long long)want);
				}
				model_destroy(sw);
				model_destroy(sm);
			}
			fprintf(stderr, "  %-22s tp %d%s: shards %s equal those of the model whole\n",
				name, n, ep ? " ep" : "", how);
		}
	}
}

/* A GGUF checkpoint at tp 2, 3, 4, 8 (where the shapes split): its mapped load holds
 * no weight dequantized (the shards dequantize their slices), each rank's shard equals
 * byte for byte the one cut from the model read whole, and the engines on the mapped
 * model give tp 1's logits. */
static void check_gguf(const char *top, const char *file)
{
	int32_t a[] = { 3, 150, 7, 42, 99, 1, 120, 64, 5, 180, 33, 12, 77 };
	int32_t b[] = { 190, 2, 2, 58, 140, 9, 101 };
	struct tcase cs[2] = { { a, (int)(sizeof(a) / sizeof(a[0])) },
			       { b, (int)(sizeof(b) / sizeof(b[0])) } };
	struct model_load_opts mapped = { .mapped = 1 };
	struct model *m = NULL, *mt = NULL;
	char path[1200], name[128], err[512] = "";

	snprintf(path, sizeof(path), "%s/tests/data/gguf-golden/%s.gguf", top, file);
	snprintf(name, sizeof(name), "gguf/%s", file);
	CHECK(model_load(&m, path, NULL, err, sizeof(err)) == 0, "%s: load: %s", name, err);
	CHECK(model_load(&mt, path, &mapped, err, sizeof(err)) == 0, "%s: load mapped: %s", name, err);
	if (!m || !mt)
		goto out;
	for (int i = 0; i < cs[0].n || i < cs[1].n; i++) {	/* a small vocabulary's ids */
		a[i % cs[0].n] %= m->cfg.vocab_size;
		b[i % cs[1].n] %= m->cfg.vocab_size;
	}
	/* the loader's accounting: nothing dequantized, every slot in the mapping */
	CHECK(mt->mapped && mt->gguf && !mt->gguf_buf && !mt->gguf_buf_bytes &&
	      mt->weight_bytes == m->weight_bytes && (const char *)mt->embed.data >=
	      (const char *)mt->gguf->map && (const char *)mt->embed.data <
	      (const char *)mt->gguf->map + mt->gguf->size,
	      "%s: the mapped load read the model whole (mapped %d, %zu bytes dequantized, %zu of %zu "
	      "weight bytes)", name, mt->mapped, mt->gguf_buf_bytes, mt->weight_bytes, m->weight_bytes);
	check_shards_equal(m, mt, name, "read from the mapped file");
	compare_tps(m, mt, name, cs, 2);
out:
	model_destroy(mt);
	model_destroy(m);
}

/* Shapes the checkpoints lack (tp 3, KV heads replicated 3 and 2 times, MLA at 3
 * ranks): tests/data/tiny configs with other head counts and widths, synthetic
 * weights. */
static const struct {
	const char *name, *tiny, *set;
	const char *format;	/* --weight-format of the synthetic weights, or NULL */
	int long_case;		/* a third case of this many tokens (MLA context parallel:
				 * more than a rank's 256-token softmax chunk at tp 2) */
} variants[] = {
	{ "tiny/llama h12 kv6", "llama",
	  "{\"num_attention_heads\": 12, \"num_key_value_heads\": 6, \"head_dim\": 8, \"intermediate_size\": 168}", NULL, 0 },
	{ "tiny/qwen3_moe h6 kv1", "qwen3_moe",
	  "{\"num_attention_heads\": 6, \"num_key_value_heads\": 1, \"moe_intermediate_size\": 24}", NULL, 0 },
	{ "tiny/deepseek_v3 h6", "deepseek_v3",
	  "{\"num_attention_heads\": 6, \"num_key_value_heads\": 6, \"moe_intermediate_size\": 24, \"intermediate_size\": 120}", NULL, 0 },
	/* quantized shards: each rank's slice of the payload and of the scales it uses
	 * (128x128 blocks cut at block starts or kept whole; int4 groups of 32) */
	{ "tiny/llama fp8-block", "llama",
	  "{\"hidden_size\": 256, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64, \"intermediate_size\": 512}",
	  "fp8-block", 0 },
	{ "tiny/qwen3_moe int4-g32", "qwen3_moe",
	  "{\"hidden_size\": 128, \"head_dim\": 32, \"moe_intermediate_size\": 128, \"intermediate_size\": 256}",
	  "int4-g32", 0 },
	{ "tiny/deepseek_v3 fp8-channel", "deepseek_v3", "{}", "fp8-channel", 0 },
	/* MLA at 8 ranks, and a context past the softmax chunks of every rank's part */
	{ "tiny/deepseek_v3 h8 long", "deepseek_v3",
	  "{\"num_attention_heads\": 8, \"num_key_value_heads\": 8, \"moe_intermediate_size\": 24, \"intermediate_size\": 120}",
	  NULL, 700 },
	/* splits inside the scale blocks, restated in smaller blocks of the same scales:
	 * 96 query rows a rank (rank 1's [96, 192) straddles two 128-row blocks: 32-row
	 * blocks; o_proj's columns likewise), and an expert's 40 columns of int4 groups
	 * of 32 at tp 2 (rank 1's from 20: groups of 4, its nibbles off a word) */
	{ "tiny/llama fp8-block cut", "llama",
	  "{\"hidden_size\": 256, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, \"head_dim\": 48, \"intermediate_size\": 512}",
	  "fp8-block", 0 },
	{ "tiny/qwen3_moe int4 cut", "qwen3_moe", "{\"head_dim\": 20}", "int4-g32", 0 },
};

static void check_variant(const char *top, int v)
{
	static const int32_t a[] = { 3, 150, 7, 42, 99, 1, 120, 64, 5, 180, 33, 12, 77 };
	static const int32_t b[] = { 190, 2, 2, 58, 140, 9, 101 };
	struct tcase cs[3] = { { (int32_t *)a, (int)(sizeof(a) / sizeof(a[0])) },
			       { (int32_t *)b, (int)(sizeof(b) / sizeof(b[0])) } };
	int32_t *lc = NULL;
	uint64_t x = 11;
	struct model_load_opts lo = { .synthetic = 1, .seed = 7 };
	char path[1200], tmpl[] = "/tmp/kdec_test_tp.XXXXXX", err[512] = "";
	json_t *cfg, *set;
	struct model *m = NULL;
	json_error_t jerr;

	snprintf(path, sizeof(path), "%s/tests/data/tiny/%s.json", top, variants[v].tiny);
	cfg = json_load_file(path, 0, &jerr);
	set = json_loads(variants[v].set, 0, &jerr);
	CHECK(cfg && set && mkdtemp(tmpl), "%s: config %s", variants[v].name, path);
	if (!cfg || !set) {
		json_decref(cfg);
		json_decref(set);
		return;
	}
	json_object_update(cfg, set);
	snprintf(path, sizeof(path), "%s/config.json", tmpl);
	CHECK(json_dump_file(cfg, path, 0) == 0, "%s: cannot write", path);
	if (variants[v].format)
		CHECK(model_weight_format_parse(variants[v].format, &lo.weight_format, err, sizeof(err)) == 0,
		      "%s: %s", variants[v].name, err);
	CHECK(model_load(&m, path, &lo, err, sizeof(err)) == 0, "%s: load: %s", variants[v].name, err);
	CHECK(!variants[v].format || (m && m->n_quantized > 0), "%s: no weight quantized",
	      variants[v].name);
	if (m) {
		int nc = 2;

		if (variants[v].long_case && (lc = malloc(sizeof(int32_t) * variants[v].long_case))) {
			for (int i = 0; i < variants[v].long_case; i++) {
				x = x * 6364136223846793005ull + 1442695040888963407ull;
				lc[i] = (int32_t)((x >> 33) % (uint64_t)m->cfg.vocab_size);
			}
			cs[nc++] = (struct tcase){ lc, variants[v].long_case };
		}
		/* the same weights made lazily (as kdecd/kdbench --tp N --synthetic-weights
		 * load them): each rank's slices generated alone, never the whole model */
		struct model_load_opts ll = lo;
		struct model *mt = NULL;

		ll.mapped = 1;
		CHECK(model_load(&mt, path, &ll, err, sizeof(err)) == 0 && mt->synth_jobs &&
		      !mt->synthetic_buf, "%s: lazy load: %s", variants[v].name, err);
		if (mt)
			check_shards_equal(m, mt, variants[v].name, "generated alone");
		compare_tps(m, mt ? mt : m, variants[v].name, cs, nc);
		model_destroy(mt);
	}
	free(lc);
	model_destroy(m);
	unlink(path);
	rmdir(tmpl);
	json_decref(cfg);
	json_decref(set);
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";

	fprintf(stderr, "test_tp: cpu backend, tp 2 3 4 8 against tp 1, tolerance %g relative L2 per row\n",
		TP_ROW_TOL);
	check_argmax_merge();
	check_graph_kind();
	check_reduce_norm();
	for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++)
		if (!getenv("KDEC_TP_ONLY") || !strncmp(models[i], getenv("KDEC_TP_ONLY"), strlen(getenv("KDEC_TP_ONLY"))))
			check_model(top, models[i]);
	/* KDEC_TP_EXTRA=DIR[:DIR...]: more checkpoints (absolute folders of the golden
	 * format, e.g. contrib/make_quant_reference.py --seed S --widen W: other dims and
	 * seeds), held to the same criterion */
	if (getenv("KDEC_TP_EXTRA")) {
		char *list = strdup(getenv("KDEC_TP_EXTRA")), *save = NULL;

		for (char *d = list ? strtok_r(list, ":", &save) : NULL; d; d = strtok_r(NULL, ":", &save))
			if (d[0] == '/')
				check_model(top, d);
			else
				CHECK(0, "KDEC_TP_EXTRA: '%s' is not an absolute folder", d);
		free(list);
	}
	if (getenv("KDEC_TP_ONLY"))	/* the named models alone */
		return test_result("test_tp");
	for (size_t i = 0; i < sizeof(gguf_models) / sizeof(gguf_models[0]); i++)
		check_gguf(top, gguf_models[i]);
	/* its MLP's 352 columns split inside Q8_0's 32-element blocks at tp 2 (176 a rank) */
	check_gguf(top, "llama3-q8_0");
	for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++)
		check_variant(top, (int)i);
	return test_result("test_tp");
}
