/* The oracle: each reference model in tests/data/golden (HF transformers float32 logits
 * from bf16 weights) must be reproduced by the engine, by one prefill, by incremental
 * decode through the paged KV cache, and with all cases batched into one step; greedy
 * decoding must give transformers' 40 tokens.
 * KDEC_TEST_BACKEND=cpu (default): <= 1e-4 relative L2 per row (fp32 throughout).
 * KDEC_TEST_BACKEND=cuda: <= 2e-2 (bf16 weights, KV cache and tensor-core inputs);
 * a greedy token may differ only where the engine's own top-two gap is within that
 * error, or where the CPU reference with the GPU's roundings picks the GPU's token
 * too (check_greedy). Every row beyond tolerance fails, on the GPU too, unless a
 * measured cause explains it (goldenflip.h): on the GPU each path runs again on the
 * CPU reference engine with the GPU's expert choices forced (MoE) and its KV cache
 * (and a quantized checkpoint's MLA kv_b, dequantized at load) rounded to bf16 like
 * the GPU's, then with the GEMM inputs rounded too, and once more on the GPU with
 * nothing rounded but the cache; a bad row must be a near-tie routing flip, or what
 * the GPU's bf16 precision measurably does to that row. One "fidelity:" line per model
 * and path gives worst and median row error, argmax agreement, rows explained by each
 * cause, and the flip rate (docs/MODELS.md's table). Checkpoints stored in fp16/fp32
 * are skipped on the GPU, which keeps bf16 weights: their references are not its
 * oracle. Exits 77 when the backend has no device. */
#include "config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/engine/engine.h"
#include "daemon/model/model.h"
#include "tests/testutil.h"
#include "tests/goldentest.h"
#include "tests/goldenflip.h"
#ifdef KD_HAVE_CUDA
#include "kernels/cuda/k_cuda_tuning.h"
#endif

#define CPU_ROW_TOL 1e-4
#define CUDA_ROW_TOL 2e-2
#define MAX_CASES 8

static const char *backend = "cpu";
static double row_tol = CPU_ROW_TOL;

/* A quantized model on the GPU: its linears and (since session 8's qmoe) its routed MoE
 * experts read the quantized bytes (x rounded to f16 for the tensor-core kernels), its
 * MLA kv_b is dequantized to bf16 at load. Its rows are judged against the reference
 * (transformers on the exact dequantized weights) at the GPU tolerance, as a bf16
 * model's (H200, 1de3db9: dense rows to 1.1e-2), but for the models below: kimi_k2_int4's
 * rows reached 0.57 with 4 and 15 rows unexplained (routing flips) when its experts
 * were rounded to bf16 at load, so only its greedy tokens are held.
 * KDEC_GOLDEN_QUANT_ROWS=0: greedy only for every quantized model (as before issue 24's
 * kernels); =all: rows judged for every one, the models below included. */
static const char *const quant_greedy_only[] = { "quant/kimi_k2_int4" };

static int quant_on_gpu;

/* The model in hand on the GPU: the CPU reference engine that replays its routing
 * (MoE models only; NULL otherwise) and the traces of the two runs. */
static struct engine *ref_e, *ref_ex;	/* the CPU reference: cache rounded as the GPU's;
					 * and GEMM inputs too (goldenflip.h) */
static struct route_trace *trace_gpu, *trace_cpu, *trace_cpux, *trace_prefill, *trace_x;

/* golden/: the shared references; reference/: made by contrib/make_reference.py from
 * tests/data/tiny configs (other dims, fp16 and fp32 checkpoints, kimi_k2); quant/:
 * the published quantized layouts (contrib/make_quant_reference.py), whose reference
 * is transformers on the dequantized weights in fp32 (the same tolerance on the GPU). */
static const char *const models[] = {
	"golden/llama3", "golden/qwen3", "golden/qwen3_moe", "golden/deepseek_v2", "golden/deepseek_v3",
	"reference/llama", "reference/qwen3", "reference/qwen3_moe", "reference/deepseek_v2",
	"reference/deepseek_v3", "reference/kimi_k2",
	"quant/llama_fp8_block", "quant/deepseek_v3_fp8_block", "quant/llama_fp8_channel",
	"quant/qwen3_fp8_tensor", "quant/llama_fp8_tensor_static", "quant/llama_int4",
	"quant/kimi_k2_int4", "quant/qwen3_moe_int4",
};

static int test_file_exists(const char *path)
{
	return access(path, R_OK) == 0;
}

struct gcase {
	int32_t *tokens;
	int n;
	float *ref;		/* (n, vocab) */
};

/* One way of running the cases: fills got with its output rows and rows with their
 * (sequence, position); returns 0 or engine_step's error (err). */
typedef int (*path_fn)(struct engine *e, const struct gcase *cs, int n, float *got,
		       char *err, size_t err_len);

static int run_prefill(struct engine *e, const struct gcase *c, int n, float *got, char *err,
		       size_t err_len)
{
	struct engine_seq seq;
	int ret;

	(void)n;
	engine_seq_init(&seq);
	struct engine_req r = { .seq = &seq, .tokens = c->tokens, .n_tokens = c->n, .all_logits = 1 };
	ret = engine_step(e, &r, 1, got, err, err_len);
	engine_seq_release(e, &seq);
	return ret;
}

static int run_incremental(struct engine *e, const struct gcase *c, int n, float *got, char *err,
			   size_t err_len)
{
	int vocab = e->model->cfg.vocab_size, ret = 0;
	struct engine_seq seq;

	(void)n;
	engine_seq_init(&seq);
	for (int t = 0; t < c->n && !ret; t++) {
		struct engine_req one = { .seq = &seq, .tokens = &c->tokens[t], .n_tokens = 1 };

		ret = engine_step(e, &one, 1, got + (size_t)t * vocab, err, err_len);
	}
	engine_seq_release(e, &seq);
	return ret;
}

/* All cases at once: several sequences in one step (all but the last token), then each
 * decoded one more time together; last-row logits only: rows i (prefill) and n + i. */
static int run_batched(struct engine *e, const struct gcase *cs, int n, float *got, char *err,
		       size_t err_len)
{
	int vocab = e->model->cfg.vocab_size, ret;
	struct engine_seq seq[MAX_CASES];
	struct engine_req r[MAX_CASES];

	for (int i = 0; i < n; i++) {
		engine_seq_init(&seq[i]);
		r[i] = (struct engine_req){ .seq = &seq[i], .tokens = cs[i].tokens, .n_tokens = cs[i].n - 1 };
	}
	ret = engine_step(e, r, n, got, err, err_len);
	for (int i = 0; i < n && !ret; i++)
		r[i] = (struct engine_req){ .seq = &seq[i], .tokens = &cs[i].tokens[cs[i].n - 1], .n_tokens = 1 };
	if (!ret)
		ret = engine_step(e, r, n, got + (size_t)n * vocab, err, err_len);
	for (int i = 0; i < n; i++)
		engine_seq_release(e, &seq[i]);
	return ret;
}

static const float *model_bias(void *arg, int layer)
{
	const struct model *m = arg;

	return m->layers[layer].router_bias;
}

/* Decisions the two traces both hold and of those where they chose other experts. */
static void trace_agreement(const struct route_trace *a, const struct route_trace *b, long *both,
			    long *differ)
{
	*both = *differ = 0;
	for (long k = 0; k < (long)a->max_seqs * a->n_layers * a->max_pos; k++)
		if (a->have[k] && b->have[k]) {
			(*both)++;
			*differ += flip_sets_differ(a->ids + k * a->top_k, b->ids + k * b->top_k, a->top_k);
		}
}

/* The path once more on the GPU, with the first run's routing forced (MoE), every
 * linear layer reading its input in fp32 (KDEC_LINEAR_FP32X's kernels) instead of
 * rounded to bf16 as the tensor-core GEMMs take it, and attention on the CUDA-core
 * kernels (KDEC_ATTN_MMA=0: no bf16 q and p tiles): the GPU's kernels with nothing
 * rounded but the cache (goldenflip.h). Fills gx and returns 0, or 1 where there is no
 * such switch (no CUDA), or engine_step's error. */
static int run_fp32x(struct engine *e, path_fn run, const struct gcase *cs, int n, float *gx,
		     char *err, size_t err_len)
{
#ifdef KD_HAVE_CUDA
	struct k_cuda_tuning was = *k_cuda_tuning(), t = was;
	int ret;

	t.linear_fp32x = 1;
	t.attn_mma = 0;
	k_cuda_tuning_set(&t);
	if (trace_gpu) {
		route_trace_clear(trace_x);
		if (route_trace_force_from(trace_x, trace_gpu)) {
			k_cuda_tuning_set(&was);
			snprintf(err, err_len, "forcing the GPU's routing");
			return -EINVAL;
		}
	}
	engine_set_route_trace(e, trace_gpu ? trace_x : NULL);
	ret = run(e, cs, n, gx, err, err_len);
	engine_set_route_trace(e, NULL);
	k_cuda_tuning_set(&was);
	return ret;
#else
	(void)e, (void)run, (void)cs, (void)n, (void)gx, (void)err, (void)err_len;
	return 1;
#endif
}

/* The path on a reference engine with the GPU's routing forced (MoE; a dense model
 * has no traces); 0 or engine_step's error. */
static int run_forced(struct engine *ref, struct route_trace *t, path_fn run,
		      const struct gcase *cs, int n, float *out, char *err, size_t err_len)
{
	int ret;

	if (t) {
		route_trace_clear(t);
		if (route_trace_force_from(t, trace_gpu)) {
			snprintf(err, err_len, "forcing the GPU's routing");
			return -EINVAL;
		}
	}
	engine_set_route_trace(ref, t);
	ret = run(ref, cs, n, out, err, err_len);
	engine_set_route_trace(ref, NULL);
	return ret;
}

/* Runs one path on the engine (recording its routing where the model has a reference
 * engine) and, for MoE models on the GPU, again on the two references with that routing
 * forced and once more on the GPU with fp32 GEMM inputs (run_fp32x); then every row
 * is judged (goldenflip.h). */
static void check_path(struct engine *e, const char *name, const char *path, path_fn run,
		       const struct gcase *cs, int n, const float *ref, const struct flip_row *rows,
		       int n_rows)
{
	int vocab = e->model->cfg.vocab_size, fails;
	float *got = malloc((size_t)n_rows * vocab * sizeof(float));
	float *cpu = ref_e ? malloc((size_t)n_rows * vocab * sizeof(float)) : NULL;
	float *gx = ref_e ? malloc((size_t)n_rows * vocab * sizeof(float)) : NULL;
	float *cpux = ref_e ? malloc((size_t)n_rows * vocab * sizeof(float)) : NULL;
	struct flip_stats st;
	char err[256] = "", what[96];
	int ret;

	snprintf(what, sizeof(what), "%s %s", name, path);
	if (trace_gpu) {
		route_trace_clear(trace_gpu);
		engine_set_route_trace(e, trace_gpu);
	}
	ret = run(e, cs, n, got, err, sizeof(err));
	engine_set_route_trace(e, NULL);
	CHECK(ret == 0, "%s: %s", what, err);
	if (ref_e && !ret) {
		ret = run_forced(ref_e, trace_cpu, run, cs, n, cpu, err, sizeof(err));
		CHECK(ret == 0, "%s: the CPU run with the GPU's routing: %s", what, err);
	}
	if (ref_e && !ret) {
		ret = run_forced(ref_ex, trace_cpux, run, cs, n, cpux, err, sizeof(err));
		CHECK(ret == 0, "%s: the CPU run with the GPU's routing and GEMM inputs: %s", what,
		      err);
	}
	if (ref_e && !ret) {
		int rx = run_fp32x(e, run, cs, n, gx, err, sizeof(err));

		CHECK(rx >= 0, "%s: the GPU run with fp32 GEMM inputs: %s", what, err);
		if (rx) {
			free(gx);
			gx = NULL;
		}
	}
	if (!ret) {
		fails = flip_judge(what, got, ref, cpu, cpux, gx, rows, n_rows, vocab, row_tol,
				   trace_gpu, trace_cpu, &e->model->cfg.route, model_bias,
				   (void *)e->model, &st);
		fprintf(stderr, "  fidelity: %-22s %-14s rows %4d worst %.2e median %.2e argmax %d/%d "
			"over %d flips %d cache %d gemm-in %d flip-rate %ld/%ld same-routing-worst %.2e "
			"fp32-in-worst %.2e bf16-in-worst %.2e tol %g\n", name, path, st.rows, st.worst,
			st.median, st.argmax_ok, st.rows, st.bad, st.flips_ok, st.cache_ok, st.gemm_ok,
			st.flipped, st.decisions, st.same_route_worst, st.fp32x_worst, st.bf16x_worst,
			row_tol);
		CHECK(fails == 0, "%s: %d of %d rows over %g unexplained (worst %.3g)", what, fails,
		      n_rows, row_tol, st.worst);
	}
	free(got);
	free(cpu);
	free(cpux);
	free(gx);
}

static void check_case(struct engine *e, const char *name, int ci, const struct gcase *c)
{
	struct flip_row *rows = malloc(sizeof(*rows) * (size_t)c->n);
	char path[32];

	for (int t = 0; t < c->n; t++)
		rows[t] = (struct flip_row){ 0, t };
	snprintf(path, sizeof(path), "case%d-prefill", ci);
	check_path(e, name, path, run_prefill, c, 1, c->ref, rows, c->n);
	if (trace_gpu) {	/* the prefill's routing kept, to set beside the incremental one */
		struct route_trace *t = trace_prefill;

		trace_prefill = trace_gpu;
		trace_gpu = t;
	}
	snprintf(path, sizeof(path), "case%d-incr", ci);
	check_path(e, name, path, run_incremental, c, 1, c->ref, rows, c->n);
	if (trace_gpu) {
		long both, differ;

		trace_agreement(trace_prefill, trace_gpu, &both, &differ);
		fprintf(stderr, "  fidelity: %-22s case%d routing: prefill and incremental on %s differ "
			"in %ld of %ld decisions\n", name, ci, backend, differ, both);
	}
	free(rows);
}

static void check_batched(struct engine *e, const char *name, const struct gcase *cs, int n)
{
	int vocab = e->model->cfg.vocab_size;
	float *ref = malloc((size_t)2 * n * vocab * sizeof(float));
	struct flip_row rows[2 * MAX_CASES];

	for (int i = 0; i < n; i++)
		if (!cs[i].ref || cs[i].n < 2) {
			free(ref);
			return;
		}
	for (int i = 0; i < n; i++) {
		memcpy(ref + (size_t)i * vocab, cs[i].ref + (size_t)(cs[i].n - 2) * vocab,
		       sizeof(float) * (size_t)vocab);
		memcpy(ref + (size_t)(n + i) * vocab, cs[i].ref + (size_t)(cs[i].n - 1) * vocab,
		       sizeof(float) * (size_t)vocab);
		rows[i] = (struct flip_row){ i, cs[i].n - 2 };
		rows[n + i] = (struct flip_row){ i, cs[i].n - 1 };
	}
	check_path(e, name, "batched", run_batched, cs, n, ref, rows, 2 * n);
	free(ref);
}

/* Greedy with the reference's tokens fed back: the prompt, then each of want in turn.
 * tok[i]: e's choice before output token i; lead[i] (lead may be NULL): by how much its
 * logit beats want[i]'s, in units of the row's rms (0 where they agree). 0 or
 * engine_step's error. */
static int greedy_choices(struct engine *e, const int32_t *prompt, int n_prompt,
			  const int32_t *want, int n_want, int32_t *tok, double *lead, char *err,
			  size_t err_len)
{
	int vocab = e->model->cfg.vocab_size, ret;
	float *logits = malloc((size_t)vocab * sizeof(float));
	struct engine_seq seq;
	struct engine_req r;

	if (!logits)
		return -ENOMEM;
	engine_seq_init(&seq);
	r = (struct engine_req){ .seq = &seq, .tokens = prompt, .n_tokens = n_prompt };
	ret = engine_step(e, &r, 1, logits, err, err_len);
	for (int i = 0; ret == 0 && i < n_want; i++) {
		double sq = 0;

		tok[i] = 0;
		for (int v = 0; v < vocab; v++) {
			tok[i] = logits[v] > logits[tok[i]] ? v : tok[i];
			sq += (double)logits[v] * logits[v];
		}
		if (lead)
			lead[i] = (logits[tok[i]] - logits[want[i]]) / sqrt(sq / vocab);
		r = (struct engine_req){ .seq = &seq, .tokens = &want[i], .n_tokens = 1 };
		if (i + 1 < n_want)
			ret = engine_step(e, &r, 1, logits, err, err_len);
	}
	engine_seq_release(e, &seq);
	free(logits);
	return ret;
}

/* The reference's greedy continuation, token by token. A token may differ where the
 * engine's lead is within its error (on the GPU, 3 x the row tolerance: a near-tie),
 * or, on the GPU, where the CPU reference engine with the GPU's roundings (ref_ex: its
 * cache, the weights it keeps in bf16, its GEMM inputs in bf16 or f16) chooses the
 * same token at that step: the GPU's precision moved the choice, as it measurably does
 * on the CPU (a routing flip that rounding causes changes the logits by far more than
 * the row tolerance). Anything else fails. */
static void check_greedy(struct engine *e, const char *name, json_t *greedy)
{
	int n_prompt, n_want, first_diff = -1, near = 0, rounding = 0, distinct = 0, ret;
	int32_t *prompt = golden_ids(json_object_get(greedy, "prompt"), &n_prompt);
	int32_t *want = golden_ids(json_object_get(greedy, "output"), &n_want);
	int32_t *tok = calloc((size_t)n_want + 1, sizeof(int32_t));
	int32_t *tok_x = calloc((size_t)n_want + 1, sizeof(int32_t));
	double *lead = calloc((size_t)n_want + 1, sizeof(double));
	int have_x = 0;
	char err[256] = "";

	CHECK(prompt && want && tok && tok_x && lead, "%s greedy: its ids", name);
	if (!prompt || !want || !tok || !tok_x || !lead)
		goto out;
	for (int i = 0; i < n_want; i++) {	/* a continuation of one token repeated proves little */
		int seen = 0;

		for (int j = 0; j < i; j++)
			seen |= want[j] == want[i];
		distinct += !seen;
	}
	CHECK(strncmp(name, "reference/", 10) || distinct >= 12,
	      "%s greedy: the reference continuation has %d different tokens (contrib/make_reference.py "
	      "--greedy picks one with 12 or more)", name, distinct);
	ret = greedy_choices(e, prompt, n_prompt, want, n_want, tok, lead, err, sizeof(err));
	CHECK(ret == 0, "%s greedy: %s", name, err);
	for (int i = 0; ret == 0 && i < n_want; i++) {
		if (tok[i] == want[i])
			continue;
		if (lead[i] <= 3 * row_tol && row_tol > CPU_ROW_TOL) {
			near++;
			continue;
		}
		if (ref_ex && !have_x) {	/* once, at the first such step */
			have_x = 1;
			CHECK(greedy_choices(ref_ex, prompt, n_prompt, want, n_want, tok_x, NULL,
					     err, sizeof(err)) == 0,
			      "%s greedy on the CPU with the GPU's roundings: %s", name, err);
		}
		if (have_x && tok_x[i] == tok[i])
			rounding++;
		else if (first_diff < 0)
			first_diff = i;
	}
	fprintf(stderr, "  %-22s greedy %d tokens (%d different): %s (%d near-ties, %d the GPU's "
		"rounding as the CPU measures it)\n", name, n_want, distinct,
		ret ? "STOPPED" : first_diff >= 0 ? "DIFFERENT" : near + rounding ? "explained" :
		"identical", near, rounding);
	CHECK(first_diff < 0, "%s greedy: first difference at output token %d (the engine's %d, "
	      "the reference's %d, the CPU's with the GPU's roundings %d)", name, first_diff,
	      first_diff < 0 ? 0 : tok[first_diff], first_diff < 0 ? 0 : want[first_diff],
	      first_diff < 0 || !have_x ? -1 : tok_x[first_diff]);
out:
	free(prompt);
	free(want);
	free(tok);
	free(tok_x);
	free(lead);
}

/* KDEC_GOLDEN_GGUF=DIR: load each golden/NAME model from DIR/NAME.gguf instead (made
 * from the same checkpoint by llama.cpp's converter: tests/make_gguf_golden.sh), and
 * hold it to the same references and tolerance. */
static const char *gguf_dir;

/* The fewest rows whose linear-layer inputs the GPU rounds to bf16 (the reference
 * engine's x_bf16): BACKEND_X_BF16_MIN_M on the defaults, where the golden models'
 * small matrices take the fp32-x GEMV at 1-2 rows; 1 where no matrix is small
 * (KDEC_LINEAR_SMALL_MB=0, test_cuda_golden_ring.sh): the ring kind, the streaming
 * kernel and cuBLAS stage x as bf16 at any M. */
static int gpu_x_bf16_rows(void)
{
#ifdef KD_HAVE_CUDA
	if (k_cuda_tuning()->linear_small_mb == 0)
		return 1;
#endif
	return BACKEND_X_BF16_MIN_M;
}

/* The CPU reference engines for a model checked on the GPU (engine gpu), and for a MoE
 * model the routing traces. The one with the GPU's GEMM inputs also asks gpu which
 * weights its timed kernel choices fed bf16 x (KDEC_LINEAR_RING_TUNE's ring at 1-2 rows). */
static void reference_open(struct model *m, int threads, int max_pos, struct engine *gpu)
{
	struct engine_opts eo = { .backend = "cpu", .threads = threads > 8 ? threads : 8,
				  .kv_tokens = 4096, .block_tokens = 16, .max_rows = 128,
				  .kv_bf16 = 1, .w_bf16 = 1 };
	const struct model_config *c = &m->cfg;
	char err[512] = "";

	CHECK(engine_create(&ref_e, m, &eo, err, sizeof(err)) == 0, "reference engine: %s", err);
	eo.x_bf16 = gpu_x_bf16_rows();
	eo.x_bf16_at = engine_linear_rounds_x;
	eo.x_bf16_arg = gpu;
	CHECK(engine_create(&ref_ex, m, &eo, err, sizeof(err)) == 0, "reference engine, GEMM "
	      "inputs in bf16: %s", err);
	if (c->n_experts <= 0) {
		if (!ref_e || !ref_ex) {
			engine_destroy(ref_e);
			engine_destroy(ref_ex);
			ref_e = ref_ex = NULL;
		}
		return;
	}
	CHECK(route_trace_create(&trace_gpu, c->n_layers, c->n_experts, c->top_k, MAX_CASES, max_pos) == 0 &&
	      route_trace_create(&trace_cpu, c->n_layers, c->n_experts, c->top_k, MAX_CASES, max_pos) == 0 &&
	      route_trace_create(&trace_cpux, c->n_layers, c->n_experts, c->top_k, MAX_CASES, max_pos) == 0 &&
	      route_trace_create(&trace_prefill, c->n_layers, c->n_experts, c->top_k, MAX_CASES, max_pos) == 0 &&
	      route_trace_create(&trace_x, c->n_layers, c->n_experts, c->top_k, MAX_CASES, max_pos) == 0,
	      "routing traces");
	if (!ref_e || !ref_ex || !trace_gpu || !trace_cpu || !trace_cpux || !trace_prefill || !trace_x) {
		engine_destroy(ref_e);
		engine_destroy(ref_ex);
		ref_e = ref_ex = NULL;
	}
}

static void reference_close(void)
{
	engine_destroy(ref_e);
	engine_destroy(ref_ex);
	route_trace_destroy(trace_gpu);
	route_trace_destroy(trace_cpu);
	route_trace_destroy(trace_cpux);
	route_trace_destroy(trace_prefill);
	route_trace_destroy(trace_x);
	ref_e = ref_ex = NULL;
	trace_gpu = trace_cpu = trace_cpux = trace_prefill = trace_x = NULL;
}

static void check_model(const char *top, const char *name, int threads)
{
	char dir[1024], path[1200], mpath[1200], err[512] = "";
	struct engine_opts eo = { .backend = backend, .threads = threads, .kv_tokens = 4096,
				  .block_tokens = 16, .max_rows = 128 };
	struct gcase cs[MAX_CASES] = { 0 };
	struct model *m = NULL;
	struct engine *e = NULL;
	json_error_t jerr;
	json_t *g, *cases;
	int n = 0, max_pos = 1;

	if (name[0] == '/')	/* KDEC_GOLDEN_EXTRA: a folder of the same format */
		snprintf(dir, sizeof(dir), "%s", name);
	else
		snprintf(dir, sizeof(dir), "%s/tests/data/%s", top, name);
	snprintf(mpath, sizeof(mpath), "%s", dir);
	if (gguf_dir) {
		if (strncmp(name, "golden/", 7))
			return;
		snprintf(mpath, sizeof(mpath), "%s/%s.gguf", gguf_dir, name + 7);
		if (!test_file_exists(mpath)) {
			test_skip("%s: no %s (tests/make_gguf_golden.sh makes it)", name, mpath);
			return;
		}
	}
	snprintf(path, sizeof(path), "%s/golden.json", dir);
	g = json_load_file(path, 0, &jerr);
	CHECK(g != NULL, "%s: %s", path, jerr.text);
	if (!g)
		return;
	CHECK(model_load(&m, mpath, NULL, err, sizeof(err)) == 0, "%s: load: %s", name, err);
	if (m && row_tol != CPU_ROW_TOL && m->cfg.dtype != K_BF16) {
		fprintf(stderr, "  %-22s skipped on %s: a %s checkpoint; the GPU keeps bf16 weights\n",
			name, backend, k_dtype_name(m->cfg.dtype));
		model_destroy(m);
		json_decref(g);
		return;
	}
	if (m) {
		int ret = engine_create(&e, m, &eo, err, sizeof(err));

		if (ret == -ENODEV || ret == -ENOENT) {
			fprintf(stderr, "test_golden: skipped: backend %s: %s\n", backend, err);
			exit(77);
		}
		CHECK(ret == 0, "%s: engine: %s", name, err);
	}
	cases = json_object_get(g, "cases");
	for (size_t i = 0; e && i < json_array_size(cases) && n < MAX_CASES; i++, n++) {
		json_t *c = json_array_get(cases, i);
		int vocab = m->cfg.vocab_size;

		cs[n].tokens = golden_ids(json_object_get(c, "tokens"), &cs[n].n);
		snprintf(path, sizeof(path), "%s/%s", dir, json_string_value(json_object_get(c, "logits")));
		cs[n].ref = golden_read_floats(path, (size_t)cs[n].n * vocab);
		CHECK(cs[n].ref != NULL, "%s: reference logits", path);
		max_pos = cs[n].n > max_pos ? cs[n].n : max_pos;
	}
	if (e && row_tol != CPU_ROW_TOL)
		reference_open(m, threads, max_pos, e);
	quant_on_gpu = 0;
	if (row_tol != CPU_ROW_TOL && m && m->n_quantized > 0) {
		const char *rows_env = getenv("KDEC_GOLDEN_QUANT_ROWS");
		int all = rows_env && !strcmp(rows_env, "all");

		quant_on_gpu = rows_env && !strcmp(rows_env, "0");
		for (size_t i = 0; !all && i < sizeof(quant_greedy_only) / sizeof(quant_greedy_only[0]); i++)
			quant_on_gpu |= !strcmp(name, quant_greedy_only[i]);
	}
	if (e && quant_on_gpu)
		fprintf(stderr, "  %-22s rows not judged on the GPU (listed greedy-only, or "
			"KDEC_GOLDEN_QUANT_ROWS=0); greedy only\n", name);
	for (int i = 0; e && !quant_on_gpu && i < n; i++)
		if (cs[i].ref)
			check_case(e, name, i, &cs[i]);
	if (e) {
		if (!quant_on_gpu)
			check_batched(e, name, cs, n);
		if (json_object_get(g, "greedy"))
			check_greedy(e, name, json_object_get(g, "greedy"));
	}
	reference_close();
	for (int i = 0; i < n; i++) {
		free(cs[i].tokens);
		free(cs[i].ref);
	}
	engine_destroy(e);
	model_destroy(m);
	json_decref(g);
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";

	if (getenv("KDEC_TEST_BACKEND"))
		backend = getenv("KDEC_TEST_BACKEND");
	gguf_dir = getenv("KDEC_GOLDEN_GGUF");
	if (strcmp(backend, "cpu"))
		row_tol = CUDA_ROW_TOL;
	fprintf(stderr, "test_golden: backend %s, tolerance %g relative L2 per row%s%s\n", backend,
		row_tol, gguf_dir ? ", models from GGUF files in " : "", gguf_dir ? gguf_dir : "");

	/* KDEC_GOLDEN_ONLY=PREFIX: only the bundled models whose name starts so (a GPU run
	 * of one family, e.g. quant/) */
	for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++)
		if (!getenv("KDEC_GOLDEN_ONLY") ||
		    !strncmp(models[i], getenv("KDEC_GOLDEN_ONLY"), strlen(getenv("KDEC_GOLDEN_ONLY"))))
			check_model(top, models[i], i % 2 ? 1 : 3);
	/* KDEC_GOLDEN_EXTRA=DIR[:DIR...]: more references (absolute folders, as
	 * contrib/make_reference.py writes them: other dims and seeds), held to the same
	 * criterion */
	if (getenv("KDEC_GOLDEN_EXTRA")) {
		char *list = strdup(getenv("KDEC_GOLDEN_EXTRA")), *save = NULL;

		for (char *d = strtok_r(list, ":", &save); d; d = strtok_r(NULL, ":", &save))
			if (d[0] == '/')
				check_model(top, d, 3);
			else
				CHECK(0, "KDEC_GOLDEN_EXTRA: '%s' is not an absolute folder", d);
		free(list);
	}
	return test_result("test_golden");
}
