/* The GPU KV-cache write and attention kernels against the CPU references
 * (k_cpu_kv_write, k_cpu_attn_gqa, k_cpu_attn_mla; the split merge on its own:
 * test_cuda_merge) on fresh
 * random inputs: shuffled block tables, bf16 caches whose exact values the reference
 * also gets (as fp32), decode and prefill rows, outputs poisoned with NaN first, and a
 * captured graph replayed with new ctx and block tables. One line per case.
 * Skips (77) without CUDA or a GPU. KD_TEST_QUICK=1: only the small cases (for
 * compute-sanitizer); KD_TEST_PART=gqa or mla: only those cases (KV write and q/k
 * post go with gqa); KD_TEST_SEED=n: repeat a run; KD_TEST_TIME=1: time each call,
 * and Llama-3.1-8B's decode attention as a graph at batch 1 and 64 (test_gqa_time). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"

/* Tolerance, relative L2 against the reference. Both sides read the same bf16 K/V (the
 * reference as fp32) and the same fp32 q and weights, and both accumulate in fp32: they
 * differ only in summation order, the exp2 form of the softmax and the split merge,
 * ~1e-6..1e-5 relative at 32k tokens. 2e-4 leaves room for that and still fails on a
 * single wrong token at 32k (~1e-2 with these score spreads). Every output must also be
 * finite: the NaN poison overwritten.
 * The tensor-core decode kernel (attn_mma.cu) rounds q and the probabilities to bf16
 * (2^-9 relative each): ~2e-3..4e-3 relative L2 on these cases, so 1e-2 for it; an
 * indexing or masking error there is off by far more (a whole tile or head: > 1e-1). */
#define ATTN_TOL 2e-4
#define ATTN_TOL_MMA 1e-2
#define Q_AMP_GQA 4.0f	/* q scale: scores of std ~1.3, a softmax that picks tokens */

static unsigned long long seed;
static int quick, timing;
static double attn_tol = ATTN_TOL;	/* of the pass running (see main) */
static const char *attn_path = "";	/* its label prefix */
static int mma_pass;			/* the tensor-core decode kernel's pass */
static struct k_pool *pool;

static float *rand_floats(size_t n, float amp)
{
	float *p = malloc(sizeof(float) * (n ? n : 1));

	for (size_t i = 0; i < n; i++)
		p[i] = test_randf(&seed) * amp;
	return p;
}

static int rand_int(int lo, int hi)	/* [lo, hi] */
{
	return lo + (int)((test_randf(&seed) + 1.0f) * 0.5f * (float)(hi - lo + 1)) % (hi - lo + 1);
}

/* ---- rows, block tables, caches ---------------------------------------- */

/* Query rows and the sequences they belong to, host and device copies. */
struct rows {
	int n_rows, n_seqs, max_ctx, bt;
	int32_t *ctx;		/* (n_rows) */
	int *seq;		/* (n_rows) sequence of each row */
	int *n_tab;		/* (n_seqs) blocks in each table */
	int32_t **tab;		/* (n_seqs) host block tables */
	const int32_t **row_tab;	/* (n_rows) host table of each row (CPU reference) */
	int n_blocks;		/* blocks in the cache */
	int32_t *d_ctx;		/* device (n_rows) */
	int32_t *d_tabs;	/* device: every table, back to back */
	const int32_t **d_row_tab;	/* device (n_rows) device table of each row */
	const int32_t **h_row_dtab;	/* host copy of d_row_tab */
};

static struct rows *rows_new(int n_rows, int n_seqs, int max_ctx)
{
	struct rows *r = calloc(1, sizeof(*r));

	r->n_rows = n_rows;
	r->n_seqs = n_seqs;
	r->max_ctx = max_ctx;
	r->ctx = calloc((size_t)n_rows, sizeof(int32_t));
	r->seq = calloc((size_t)n_rows, sizeof(int));
	return r;
}

/* Decode: n rows of their own sequences; ctx all equal or spread over [1, ctx_max]
 * with both ends present. */
static struct rows *rows_decode(int n, int ctx_max, int spread, int max_ctx)
{
	struct rows *r = rows_new(n, n, max_ctx);

	for (int i = 0; i < n; i++) {
		r->seq[i] = i;
		r->ctx[i] = spread ? rand_int(1, ctx_max) : ctx_max;
	}
	if (spread && n > 1) {
		r->ctx[0] = ctx_max;
		r->ctx[n - 1] = 1;
	}
	return r;
}

/* Prefill: runs[i] consecutive rows of sequence i at positions pos0[i].., so
 * ctx = pos + 1; hint: the n_seqs the kernels are told (0: none). */
static struct rows *rows_prefill(int n_runs, const int *runs, const int *pos0, int max_ctx)
{
	int n = 0, k = 0;
	struct rows *r;

	for (int i = 0; i < n_runs; i++)
		n += runs[i];
	r = rows_new(n, n_runs, max_ctx);
	for (int i = 0; i < n_runs; i++)
		for (int j = 0; j < runs[i]; j++, k++) {
			r->seq[k] = i;
			r->ctx[k] = pos0[i] + j + 1;
		}
	return r;
}

/* Shuffled block tables with room for cap tokens per sequence (at least what its rows
 * see), and their device copies. Returns 0 or -1. */
static int rows_tables(struct rows *r, int bt, int cap)
{
	int used = 0, off = 0;
	int32_t *perm, *all;

	r->bt = bt;
	r->n_tab = calloc((size_t)r->n_seqs, sizeof(int));
	r->tab = calloc((size_t)r->n_seqs, sizeof(int32_t *));
	r->row_tab = calloc((size_t)r->n_rows, sizeof(int32_t *));
	r->h_row_dtab = calloc((size_t)r->n_rows, sizeof(int32_t *));
	for (int i = 0; i < r->n_rows; i++) {
		int need = (r->ctx[i] + bt - 1) / bt;

		if (need > r->n_tab[r->seq[i]])
			r->n_tab[r->seq[i]] = need;
	}
	r->n_blocks = 3;	/* a few blocks no row owns: wrong indexing reads noise */
	for (int s = 0; s < r->n_seqs; s++) {
		if (r->n_tab[s] < (cap + bt - 1) / bt)
			r->n_tab[s] = (cap + bt - 1) / bt;
		r->n_blocks += r->n_tab[s];
	}
	perm = test_shuffled_ids(r->n_blocks, &seed);
	all = malloc(sizeof(int32_t) * (size_t)r->n_blocks);
	for (int s = 0; s < r->n_seqs; s++) {
		r->tab[s] = all + used;
		for (int b = 0; b < r->n_tab[s]; b++, used++)
			all[used] = perm[used];
	}
	free(perm);
	r->d_tabs = dup_to_device(all, sizeof(int32_t) * (size_t)used);
	r->d_ctx = dup_to_device(r->ctx, sizeof(int32_t) * (size_t)r->n_rows);
	for (int i = 0; i < r->n_rows; i++) {
		off = (int)(r->tab[r->seq[i]] - all);
		r->row_tab[i] = r->tab[r->seq[i]];
		r->h_row_dtab[i] = r->d_tabs ? r->d_tabs + off : NULL;
	}
	r->d_row_tab = dup_to_device(r->h_row_dtab, sizeof(int32_t *) * (size_t)r->n_rows);
	return r->d_tabs && r->d_ctx && r->d_row_tab ? 0 : -1;
}

/* New shuffled contents for the same tables, host and device (graph replay). */
static void rows_reshuffle(struct rows *r)
{
	int32_t *perm = test_shuffled_ids(r->n_blocks, &seed), *all = r->tab[0];
	int used = 0;

	for (int s = 0; s < r->n_seqs; s++)
		used += r->n_tab[s];
	memcpy(all, perm, sizeof(int32_t) * (size_t)used);
	free(perm);
	CU(cudaMemcpy(r->d_tabs, all, sizeof(int32_t) * (size_t)used, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(r->d_ctx, r->ctx, sizeof(int32_t) * (size_t)r->n_rows,
		      cudaMemcpyHostToDevice));
}

static void rows_free(struct rows *r)
{
	if (!r)
		return;
	if (r->tab)
		free(r->tab[0]);
	free(r->tab);
	free(r->n_tab);
	free(r->row_tab);
	free(r->h_row_dtab);
	free(r->ctx);
	free(r->seq);
	cudaFree(r->d_tabs);
	cudaFree(r->d_ctx);
	cudaFree((void *)r->d_row_tab);
	free(r);
}

static struct k_cuda_attn_rows rows_gpu(const struct rows *r, int hint)
{
	struct k_cuda_attn_rows g = {
		.n_rows = r->n_rows, .ctx = r->d_ctx, .blocks = r->d_row_tab,
		.max_ctx = r->max_ctx, .n_seqs = hint ? r->n_seqs : 0,
	};
	return g;
}

static struct k_attn_rows rows_cpu(const struct rows *r)
{
	struct k_attn_rows c = {
		.n_rows = r->n_rows, .ctx = r->ctx, .blocks = (const int32_t *const *)r->row_tab,
	};
	return c;
}

/* K/V bytes the rows must read at least: each sequence's longest ctx once. */
static double rows_kv_bytes(const struct rows *r, double bytes_per_token)
{
	double sum = 0;

	for (int s = 0; s < r->n_seqs; s++) {
		int len = 0;

		for (int i = 0; i < r->n_rows; i++)
			if (r->seq[i] == s && r->ctx[i] > len)
				len = r->ctx[i];
		sum += len;
	}
	return sum * bytes_per_token;
}

/* A random bf16 cache of the rows' blocks: host bf16, the same values as fp32, and the
 * device copy. */
struct cache {
	size_t n;		/* values */
	uint16_t *h;
	float *f;
	uint16_t *d;
};

static int cache_new(struct cache *c, const struct rows *r, int width)
{
	c->n = (size_t)r->n_blocks * r->bt * width;
	c->h = malloc(sizeof(uint16_t) * c->n);
	c->f = malloc(sizeof(float) * c->n);
	if (!c->h || !c->f)
		return -1;
	for (size_t i = 0; i < c->n; i++) {
		c->h[i] = k_f32_to_bf16(test_randf(&seed));
		c->f[i] = k_bf16_to_f32(c->h[i]);
	}
	c->d = dup_to_device(c->h, sizeof(uint16_t) * c->n);
	return c->d ? 0 : -1;
}

static void cache_free(struct cache *c)
{
	free(c->h);
	free(c->f);
	cudaFree(c->d);
}

/* ---- checking ------------------------------------------------------------ */

/* One line: label, max abs error, rel L2, unwritten (non-finite) outputs, verdict. */
static void compare(const char *label, const float *got, const float *ref, size_t n)
{
	size_t bad = 0;
	double max_abs = 0, rel, norm = 0;
	int pass;

	for (size_t i = 0; i < n; i++) {
		if (!isfinite(got[i])) {
			bad++;
			continue;
		}
		if (fabs((double)got[i] - ref[i]) > max_abs)
			max_abs = fabs((double)got[i] - ref[i]);
		norm += (double)ref[i] * ref[i];
	}
	rel = bad ? INFINITY : test_rel_l2(got, ref, n);
	pass = bad == 0 && rel <= attn_tol && norm > 0;
	fprintf(stderr, "%s%-72s max_abs %.2e rel_l2 %.2e unwritten %zu %s\n", attn_path, label,
		max_abs, rel, bad, pass ? "PASS" : "FAIL");
	CHECK(pass, "%s%s (tolerance %g)", attn_path, label, attn_tol);
}

static void ctx_range(const struct rows *r, int *lo, int *hi)
{
	*lo = *hi = r->n_rows ? r->ctx[0] : 0;
	for (int i = 0; i < r->n_rows; i++) {
		*lo = r->ctx[i] < *lo ? r->ctx[i] : *lo;
		*hi = r->ctx[i] > *hi ? r->ctx[i] : *hi;
	}
}

/* ---- GQA ------------------------------------------------------------------ */

struct gqa_shape {
	int h, kv, hd;
};

struct gqa_run {
	struct gqa_shape sh;
	struct rows *r;
	int hint;
	struct k_cuda_attn_ws *ws;
	struct cache k, v;
	float *q, *d_q, *d_out;
	float scale;
};

static int gqa_call(struct gqa_run *g, cudaStream_t s)
{
	struct k_cuda_attn_rows gr = rows_gpu(g->r, g->hint);

	return k_cuda_attn_gqa(s, g->ws, g->d_out, g->d_q, g->k.d, g->v.d, g->r->bt, &gr,
			       g->sh.h, g->sh.kv, g->sh.hd, g->scale);
}

static int gqa_call_default(void *g)
{
	return gqa_call(g, 0);
}

static void gqa_label(char *buf, size_t len, const struct gqa_run *g, const char *what)
{
	int lo, hi;

	ctx_range(g->r, &lo, &hi);
	snprintf(buf, len, "gqa %s h%d/kv%d/d%d bt%d rows %d ctx %d..%d max %d seqs %d%s", what,
		 g->sh.h, g->sh.kv, g->sh.hd, g->r->bt, g->r->n_rows, lo, hi, g->r->max_ctx,
		 g->r->n_seqs, g->hint ? " hinted" : "");
}

/* Runs the kernel once (or, with s, as the caller arranged) and checks it. */
static void gqa_check(struct gqa_run *g, const char *what)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd;
	struct k_kv_layer kv = { .k = g->k.f, .v = g->v.f, .n_blocks = g->r->n_blocks,
		.block_tokens = g->r->bt, .width = g->sh.kv * g->sh.hd };
	struct k_attn_rows cr = rows_cpu(g->r);
	float *ref = malloc(sizeof(float) * n), *got = download(g->d_out, n);
	char label[160];

	gqa_label(label, sizeof(label), g, what);
	k_cpu_attn_gqa(pool, ref, g->q, &kv, &cr, g->sh.h, g->sh.kv, g->sh.hd, g->scale);
	compare(label, got, ref, n);
	free(ref);
	free(got);
}

static int gqa_setup(struct gqa_run *g, struct gqa_shape sh, int bt, struct rows *r, int hint,
		     int cap)
{
	size_t nq = (size_t)r->n_rows * sh.h * sh.hd;

	memset(g, 0, sizeof(*g));
	g->sh = sh;
	g->r = r;
	g->hint = hint;
	g->scale = 1.0f / sqrtf((float)sh.hd);
	if (rows_tables(r, bt, cap) || cache_new(&g->k, r, sh.kv * sh.hd) ||
	    cache_new(&g->v, r, sh.kv * sh.hd))
		return -1;
	g->q = rand_floats(nq, Q_AMP_GQA);
	g->d_q = dup_to_device(g->q, sizeof(float) * nq);
	g->d_out = dalloc(sizeof(float) * nq);
	if (!g->d_q || !g->d_out)
		return -1;
	return k_cuda_attn_ws_create(&g->ws, r->n_rows, sh.h, sh.hd, r->max_ctx) ? -1 : 0;
}

static void gqa_teardown(struct gqa_run *g)
{
	k_cuda_attn_ws_destroy(g->ws);
	cache_free(&g->k);
	cache_free(&g->v);
	free(g->q);
	cudaFree(g->d_q);
	cudaFree(g->d_out);
	rows_free(g->r);
}

/* k_cuda_attn_gqa_bf16 on the same inputs: the fp32 output bit for bit that of
 * k_cuda_attn_gqa, and, where it reports writing it, the bf16 copy that output rounded
 * to nearest even; it must write it for decode rows (no prefill hint). */
static void gqa_bf16_check(struct gqa_run *g)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd, bad = 0;
	struct k_cuda_attn_rows gr = rows_gpu(g->r, g->hint);
	float *want = download(g->d_out, n), *got;
	uint16_t *db = NULL, *hb = malloc(sizeof(uint16_t) * n);
	int ret;

	CU(cudaMalloc((void **)&db, sizeof(uint16_t) * n));
	CU(cudaMemset(db, 0xff, sizeof(uint16_t) * n));
	CU(cudaMemset(g->d_out, 0xff, sizeof(float) * n));
	ret = k_cuda_attn_gqa_bf16(0, g->ws, g->d_out, db, g->d_q, g->k.d, g->v.d, g->r->bt, &gr,
				   g->sh.h, g->sh.kv, g->sh.hd, g->scale);
	CHECK(ret >= 0 && (g->hint || ret == 1), "k_cuda_attn_gqa_bf16: %d", ret);
	CU(cudaDeviceSynchronize());
	got = download(g->d_out, n);
	CU(cudaMemcpy(hb, db, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
	for (size_t i = 0; i < n; i++)
		bad += memcmp(&got[i], &want[i], sizeof(float)) != 0 ||
		       (ret == 1 && hb[i] != k_f32_to_bf16(want[i]));
	CHECK(!bad, "gqa bf16 output (wrote %d): %zu of %zu values differ", ret, bad, n);
	cudaFree(db);
	free(hb);
	free(want);
	free(got);
}

/* The tensor-core pass: the same inputs with knob=val give the default's output (in
 * g->d_out) bit for bit. KDEC_ATTN_MMA_FOLD=1, the split merge in the attention kernel
 * (the default is its own launch): both sum the same partials in the same order.
 * KDEC_ATTN_MMA_EARLY=0, every copy after the PDL wait: the same copies, issued later. */
static void gqa_same_bits(struct gqa_run *g, const char *knob, const char *val)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd, bad = 0;
	float *want = download(g->d_out, n), *got = NULL;
	int ret;

	setenv(knob, val, 1);
	CU(cudaMemset(g->d_out, 0xff, sizeof(float) * n));
	ret = gqa_call(g, 0);
	unsetenv(knob);
	CHECK(ret == 0, "k_cuda_attn_gqa (%s=%s): %d", knob, val, ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		got = download(g->d_out, n);
		for (size_t i = 0; i < n; i++)
			bad += memcmp(&got[i], &want[i], sizeof(float)) != 0;
		CHECK(!bad, "gqa default vs %s=%s: %zu of %zu values differ", knob, val, bad, n);
		/* leave the default's output for the next comparison */
		CU(cudaMemcpy(g->d_out, want, sizeof(float) * n, cudaMemcpyHostToDevice));
	}
	free(want);
	free(got);
}

/* q in registers (default) against q in shared memory (KDEC_ATTN_MMA_QREG=0): the
 * same mma on the same values, but the shapes fit 4 and 3 blocks an SM, so the split
 * rule may pick different counts: both forced to 2 splits, then bit for bit. */
static void gqa_qreg_check(struct gqa_run *g)
{
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd;
	int ret;

	setenv("KDEC_ATTN_DEC_SPLITS", "2", 1);
	CU(cudaMemset(g->d_out, 0xff, sizeof(float) * n));
	ret = gqa_call(g, 0);
	CHECK(ret == 0, "k_cuda_attn_gqa (2 splits): %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize()))
		gqa_same_bits(g, "KDEC_ATTN_MMA_QREG", "0");
	unsetenv("KDEC_ATTN_DEC_SPLITS");
}

static void gqa_fold_check(struct gqa_run *g)
{
	gqa_same_bits(g, "KDEC_ATTN_MMA_FOLD", "1");
	gqa_same_bits(g, "KDEC_ATTN_MMA_EARLY", "0");
	gqa_qreg_check(g);	/* last: leaves the 2-split output */
}

static void gqa_case(struct gqa_shape sh, int bt, struct rows *r, int hint)
{
	struct gqa_run g;
	size_t n = (size_t)r->n_rows * sh.h * sh.hd;
	int ret;

	if (gqa_setup(&g, sh, bt, r, hint, 0)) {
		CHECK(0, "gqa setup h%d/kv%d/d%d", sh.h, sh.kv, sh.hd);
		gqa_teardown(&g);
		return;
	}
	CU(cudaMemset(g.d_out, 0xff, sizeof(float) * n));	/* NaN */
	ret = gqa_call(&g, 0);
	CHECK(ret == 0, "k_cuda_attn_gqa: %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		gqa_check(&g, "");
		gqa_bf16_check(&g);
		if (mma_pass)
			gqa_fold_check(&g);
	}
	if (timing && ret == 0) {
		char label[160];
		double us = time_us(gqa_call_default, &g);
		double gb = rows_kv_bytes(r, 4.0 * sh.kv * sh.hd) / (us * 1e3);

		gqa_label(label, sizeof(label), &g, "");
		fprintf(stderr, "%-72s time %.1f us, %.0f GB/s of K/V read (floor 4250)\n", label,
			us, gb);
	}
	gqa_teardown(&g);
}

/* One captured launch replayed with new ctx and new block tables. */
static void gqa_graph_case(struct gqa_shape sh, int bt, int n_rows, int max_ctx)
{
	struct rows *r = rows_decode(n_rows, max_ctx / 8, 1, max_ctx);
	size_t n = (size_t)n_rows * sh.h * sh.hd;
	cudaStream_t s = NULL;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	struct gqa_run g;
	int ret = -1;

	if (gqa_setup(&g, sh, bt, r, 0, max_ctx) || !CU(cudaStreamCreate(&s)))
		goto out;
	if (!CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	ret = gqa_call(&g, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)))
		goto out;
	for (int round = 0; round < 2; round++) {
		if (round == 1) {	/* longer contexts, new tables, same graph */
			for (int i = 0; i < n_rows; i++)
				r->ctx[i] = rand_int(1, max_ctx);
			r->ctx[0] = max_ctx;
		}
		rows_reshuffle(r);
		CU(cudaMemset(g.d_out, 0xff, sizeof(float) * n));
		if (CU(cudaGraphLaunch(exec, s)) && CU(cudaStreamSynchronize(s)))
			gqa_check(&g, round ? "graph replay 2" : "graph replay 1");
	}
out:
	CHECK(ret == 0, "gqa graph case: %d", ret);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	if (s)
		cudaStreamDestroy(s);
	gqa_teardown(&g);
}

/* Median of the graph's replays, each after a 256 MB memset (L2 holds 50 MB: the
 * K/V comes from HBM as in a model step, where the layer's other weights passed
 * between). The graph is what a step replays, launch gaps and PDL included. */
#define GQA_TIME_RUNS 25
#define GQA_FLUSH_BYTES (256u << 20)

static double graph_us(int (*call)(void *, cudaStream_t), void *arg, void *flush)
{
	cudaStream_t s = NULL;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	cudaEvent_t e0 = NULL, e1 = NULL;
	float ms[GQA_TIME_RUNS];
	double us = 0;
	int ret = -1;

	if (!CU(cudaStreamCreate(&s)) || !CU(cudaEventCreate(&e0)) || !CU(cudaEventCreate(&e1)))
		goto out;
	if (!CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	ret = call(arg, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)))
		goto out;
	for (int i = 0; i < 3; i++)
		CU(cudaGraphLaunch(exec, s));
	for (int i = 0; i < GQA_TIME_RUNS; i++) {
		CU(cudaMemsetAsync(flush, i & 0xff, GQA_FLUSH_BYTES, s));
		CU(cudaEventRecord(e0, s));
		CU(cudaGraphLaunch(exec, s));
		CU(cudaEventRecord(e1, s));
		CU(cudaEventSynchronize(e1));
		CU(cudaEventElapsedTime(&ms[i], e0, e1));
	}
	us = test_median(ms, GQA_TIME_RUNS) * 1e3;
out:
	CHECK(ret == 0, "timing graph: %d", ret);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
	if (s)
		cudaStreamDestroy(s);
	return us;
}

static int gqa_call_stream(void *g, cudaStream_t s)
{
	return gqa_call(g, s);
}

static double gqa_graph_us(struct gqa_run *g, void *flush)
{
	return graph_us(gqa_call_stream, g, flush);
}

/* KD_TEST_TIME=1, tensor-core pass: Llama-3.1-8B's decode attention (32 q heads, 8 kv,
 * head dim 128, 16-token blocks) at batch 1 and 64, ctx 1024, the merge as its own
 * launch (default) against the merge folded into the kernel (KDEC_ATTN_MMA_FOLD=1), beside the HBM
 * floor of the K/V bytes at 4.25 TB/s. */
static void test_gqa_time(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 };
	static const int batches[] = { 1, 64 };
	void *flush = dalloc(GQA_FLUSH_BYTES);

	for (size_t b = 0; flush && b < 2; b++) {
		struct rows *r = rows_decode(batches[b], 1024, 0, 1024);
		double floor_us, fold, launch, both;	/* fold: KDEC_ATTN_MMA_FOLD=1 */
		struct gqa_run g;
		char label[160];

		if (gqa_setup(&g, llama, 16, r, 0, 0)) {
			CHECK(0, "gqa timing setup");
			gqa_teardown(&g);
			continue;
		}
		floor_us = rows_kv_bytes(r, 4.0 * llama.kv * llama.hd) / 4.25e6;
		launch = gqa_graph_us(&g, flush);
		setenv("KDEC_ATTN_MMA_FOLD", "1", 1);
		fold = gqa_graph_us(&g, flush);
		unsetenv("KDEC_ATTN_MMA_FOLD");
		setenv("KDEC_ATTN_MMA_EARLY", "0", 1);
		setenv("KDEC_ATTN_MMA_QREG", "0", 1);
		both = gqa_graph_us(&g, flush);
		unsetenv("KDEC_ATTN_MMA_QREG");
		unsetenv("KDEC_ATTN_MMA_EARLY");
		gqa_label(label, sizeof(label), &g, "graph");
		fprintf(stderr, "%s%-72s default %.1f us, KDEC_ATTN_MMA_FOLD=1 %.1f us, and "
			"KDEC_ATTN_MMA_EARLY=0 KDEC_ATTN_MMA_QREG=0 (main's path) %.1f us; floor %.1f us "
			"(%.0f%% / %.0f%% / %.0f%% of it)\n", attn_path, label, launch, fold, both,
			floor_us, 100 * floor_us / launch, 100 * floor_us / fold,
			100 * floor_us / both);
		/* batch 64: each split count the workspace holds (4 at its max rows) */
		for (int n = 1; batches[b] > 1 && n <= 4; n++) {
			char want[8];

			snprintf(want, sizeof(want), "%d", n);
			setenv("KDEC_ATTN_DEC_SPLITS", want, 1);
			launch = gqa_graph_us(&g, flush);
			setenv("KDEC_ATTN_MMA_FOLD", "1", 1);
			fold = gqa_graph_us(&g, flush);
			unsetenv("KDEC_ATTN_MMA_FOLD");
			setenv("KDEC_ATTN_MMA_QREG", "0", 1);
			both = gqa_graph_us(&g, flush);
			unsetenv("KDEC_ATTN_MMA_QREG");
			unsetenv("KDEC_ATTN_DEC_SPLITS");
			fprintf(stderr, "%s%-72s KDEC_ATTN_DEC_SPLITS=%d: default %.1f us, "
				"KDEC_ATTN_MMA_FOLD=1 %.1f us, KDEC_ATTN_MMA_QREG=0 %.1f us\n",
				attn_path, label, n, launch, fold, both);
		}
		gqa_teardown(&g);
	}
	cudaFree(flush);
}

/* ---- qkv_post: the early-load kernel against the one before it ------------------ */

/* k_cuda_qkv_post (norm, rope, q out, K/V append) with KDEC_QKV_POST_EARLY=0 (the
 * kernel that loads one input after another) and by default (every load at once):
 * the same arithmetic, so q and both caches must agree bit for bit, unwritten cache
 * (slot -1 rows, other slots) still poisoned in both. test_cuda_ops checks the values
 * against the CPU. KD_TEST_TIME=1: both timed as a graph (cold L2). */
struct qkv_run {
	struct k_cuda_qkv_args a;
	size_t nq, ncache;
};

/* qkv_post's arguments for rows of the fused projection src (rows, (H + 2 KV) * D:
 * q, k, v side by side); norm (2 D: q's weights, then k's) or NULL, eps 1e-6, rope over
 * rope_dim dims (interleaved il) at pos with the inverse frequencies fr. */
static struct k_cuda_qkv_args packed_qkv_args(const float *src, int rows, int H, int KV, int D,
					      const float *norm, const float *fr, int rope_dim,
					      int il, const int32_t *pos, const int32_t *slots,
					      float *q, uint16_t *k_cache, uint16_t *v_cache)
{
	const long rs = (long)(H + 2 * KV) * D;

	return (struct k_cuda_qkv_args){
		.q = q, .q_src = src, .k_src = src + (size_t)H * D,
		.v_src = src + (size_t)(H + KV) * D, .q_rs = rs, .k_rs = rs, .v_rs = rs,
		.rows = rows, .n_heads = H, .kv_heads = KV, .head_dim = D, .q_norm = norm,
		.k_norm = norm ? norm + D : NULL, .eps = 1e-6f, .inv_freq = fr,
		.rope_dim = rope_dim, .interleaved = il, .attn_factor = 1.0f, .pos = pos,
		.k_cache = k_cache, .v_cache = v_cache, .slots = slots,
	};
}

static int qkv_call(void *p, cudaStream_t s)
{
	return k_cuda_qkv_post(s, &((struct qkv_run *)p)->a);
}

static void qkv_poison(struct qkv_run *q)
{
	CU(cudaMemset(q->a.q, 0xff, sizeof(float) * q->nq));
	CU(cudaMemset(q->a.k_cache, 0xff, sizeof(uint16_t) * q->ncache));
	CU(cudaMemset(q->a.v_cache, 0xff, sizeof(uint16_t) * q->ncache));
}

/* q, then the k and v caches, on the host as bytes. */
static unsigned char *qkv_result(struct qkv_run *q)
{
	size_t bq = sizeof(float) * q->nq, bc = sizeof(uint16_t) * q->ncache;
	unsigned char *h = malloc(bq + 2 * bc);

	CU(cudaMemcpy(h, q->a.q, bq, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bq, q->a.k_cache, bc, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bq + bc, q->a.v_cache, bc, cudaMemcpyDeviceToHost));
	return h;
}

static void qkv_case(int rows, int H, int KV, int D, int rope_dim, int qk_norm, int il,
		     void *flush)
{
	const int nk = KV * D, n_slots = rows + 5;
	const size_t nsrc = (size_t)rows * (H + 2 * KV) * D;
	float *src = rand_floats(nsrc, 2.0f), *w = rand_floats(2 * (size_t)D, 1.0f);
	float *fr = rand_floats((size_t)rope_dim / 2 + 1, 1.0f);
	int32_t *pos = malloc(sizeof(int32_t) * rows), *slots = malloc(sizeof(int32_t) * rows);
	float *dsrc, *dw, *dfr, *dq;
	int32_t *dpos, *dslots;
	uint16_t *dk, *dv;
	unsigned char *old = NULL, *got = NULL;
	struct qkv_run q;
	size_t bytes, bad = 0;
	int ret0, ret1;

	for (int i = 0; i <= rope_dim / 2; i++)
		fr[i] = fabsf(fr[i]);
	for (int r = 0; r < rows; r++) {
		pos[r] = rand_int(0, 32767);
		slots[r] = r == rows / 2 && rows > 1 ? -1 : (r * 7 + 3) % n_slots;
	}
	dsrc = dup_to_device(src, sizeof(float) * nsrc);
	dw = dup_to_device(w, sizeof(float) * 2 * D);
	dfr = dup_to_device(fr, sizeof(float) * (rope_dim / 2 + 1));
	dpos = dup_to_device(pos, sizeof(int32_t) * rows);
	dslots = dup_to_device(slots, sizeof(int32_t) * rows);
	memset(&q, 0, sizeof(q));
	q.nq = (size_t)rows * H * D;
	q.ncache = (size_t)n_slots * nk;
	dq = dalloc(sizeof(float) * q.nq);
	dk = dalloc(sizeof(uint16_t) * q.ncache);
	dv = dalloc(sizeof(uint16_t) * q.ncache);
	q.a = packed_qkv_args(dsrc, rows, H, KV, D, qk_norm ? dw : NULL, dfr, rope_dim, il, dpos,
			      dslots, dq, dk, dv);
	setenv("KDEC_QKV_POST_EARLY", "0", 1);
	qkv_poison(&q);
	ret0 = qkv_call(&q, 0);
	if (ret0 == 0 && CU(cudaDeviceSynchronize()))
		old = qkv_result(&q);
	unsetenv("KDEC_QKV_POST_EARLY");
	qkv_poison(&q);
	ret1 = qkv_call(&q, 0);
	if (ret1 == 0 && CU(cudaDeviceSynchronize()))
		got = qkv_result(&q);
	CHECK(ret0 == 0 && ret1 == 0 && old && got, "qkv_post: %d / %d", ret0, ret1);
	bytes = sizeof(float) * q.nq + 2 * sizeof(uint16_t) * q.ncache;
	for (size_t i = 0; old && got && i < bytes; i++)
		bad += old[i] != got[i];
	fprintf(stderr, "qkv_post early vs old rows %d H %d KV %d D %d rope %d%s%s: "
		"%zu of %zu bytes differ %s\n", rows, H, KV, D, rope_dim, qk_norm ? " qknorm" : "",
		il ? " il" : "", bad, bytes, bad ? "FAIL" : "PASS");
	CHECK(!bad, "qkv_post early vs old: %zu bytes differ", bad);
	if (timing && flush) {
		double t_new = graph_us(qkv_call, &q, flush), t_old;

		setenv("KDEC_QKV_POST_EARLY", "0", 1);
		t_old = graph_us(qkv_call, &q, flush);
		unsetenv("KDEC_QKV_POST_EARLY");
		fprintf(stderr, "qkv_post graph rows %d H %d KV %d D %d%s: early %.1f us, "
			"KDEC_QKV_POST_EARLY=0 %.1f us\n", rows, H, KV, D,
			qk_norm ? " qknorm" : "", t_new, t_old);
	}
	cudaFree(dsrc), cudaFree(dw), cudaFree(dfr), cudaFree(dpos), cudaFree(dslots);
	cudaFree(dq), cudaFree(dk), cudaFree(dv);
	free(src), free(w), free(fr), free(pos), free(slots), free(old), free(got);
}

static void test_qkv_post(void)
{
	void *flush = timing ? dalloc(GQA_FLUSH_BYTES) : NULL;

	qkv_case(64, 32, 8, 128, 128, 0, 0, flush);	/* Llama-3.1-8B batch 64 */
	qkv_case(1, 32, 8, 128, 128, 0, 0, flush);	/* batch 1 */
	qkv_case(64, 32, 8, 128, 128, 1, 0, flush);	/* Qwen3: q/k RMSNorm */
	qkv_case(7, 12, 4, 24, 16, 1, 1, NULL);		/* odd, partial interleaved rope */
	qkv_case(5, 6, 2, 200, 64, 1, 0, NULL);		/* two values a thread */
	qkv_case(3, 4, 2, 512, 512, 1, 1, NULL);	/* the widest head */
	qkv_case(2, 4, 4, 40, 0, 0, 0, NULL);		/* no rope */
	cudaFree(flush);
}

/* ---- qkv_post folded into the decode attention (k_cuda_attn_gqa_qkv) ----------- */

/* Decode rows (each its own sequence, the new token at ctx - 1) with their raw q/k/v
 * rows of a fused projection, run through k_cuda_attn_gqa_qkv twice: with
 * KDEC_QKV_IN_ATTN=0 (qkv_post's launch, then the attention: the reference) and =1
 * (the attention launch doing qkv_post's work at any split count; by default it does
 * only where the rows take one split). Before each
 * run the caches are reset to the same random contents with the new tokens' rows
 * poisoned (bf16 NaN) and out, out_bf16 poisoned. Checked: both caches bit for bit the
 * reference's (the new rows written, nothing else touched), out and out_bf16 bit for
 * bit where the fold keeps qkv_post's arithmetic (it does: q's fp32 values are
 * qkv_post's, the same mma after), with a hard bound of rel L2 1e-5 and every value
 * finite, the bit differences printed. One row writes no K/V (slot -1) where rows > 2.
 * KD_TEST_TIME=1 (flush given): both timed as a graph, cold L2. */
#define FOLD_TOL 1e-5

struct fold_run {
	struct rows *r;
	struct k_cuda_attn_ws *ws;
	struct k_cuda_qkv_args a;
	struct cache k, v;
	float *d_out;
	uint16_t *d_outb;
	float scale;
	size_t n_out;
};

static int fold_call(void *p, cudaStream_t s)
{
	struct fold_run *f = p;
	struct k_cuda_attn_rows gr = rows_gpu(f->r, 0);
	int ret = k_cuda_attn_gqa_qkv(s, f->ws, f->d_out, f->d_outb, &f->a, f->r->bt, &gr,
				      f->scale);

	return ret < 0 ? ret : ret == 1 ? 0 : -EPROTO;	/* decode rows: bf16 written */
}

/* Caches back to their random contents, the rows this step writes poisoned. */
static void fold_reset(struct fold_run *f, const int32_t *slots)
{
	const size_t w = (size_t)f->a.kv_heads * f->a.head_dim;

	CU(cudaMemcpy(f->k.d, f->k.h, sizeof(uint16_t) * f->k.n, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(f->v.d, f->v.h, sizeof(uint16_t) * f->v.n, cudaMemcpyHostToDevice));
	for (int i = 0; i < f->r->n_rows; i++)
		if (slots[i] >= 0) {
			CU(cudaMemset(f->k.d + slots[i] * w, 0xff, sizeof(uint16_t) * w));
			CU(cudaMemset(f->v.d + slots[i] * w, 0xff, sizeof(uint16_t) * w));
		}
	CU(cudaMemset(f->d_out, 0xff, sizeof(float) * f->n_out));
	CU(cudaMemset(f->d_outb, 0xff, sizeof(uint16_t) * f->n_out));
}

/* out, out_bf16, k cache, v cache on the host as bytes. */
static unsigned char *fold_result(struct fold_run *f)
{
	size_t bo = sizeof(float) * f->n_out, bb = sizeof(uint16_t) * f->n_out;
	size_t bc = sizeof(uint16_t) * f->k.n;
	unsigned char *h = malloc(bo + bb + 2 * bc);

	CU(cudaMemcpy(h, f->d_out, bo, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo, f->d_outb, bb, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo + bb, f->k.d, bc, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo + bb + bc, f->v.d, bc, cudaMemcpyDeviceToHost));
	return h;
}

static void fold_case(struct gqa_shape sh, int rope_dim, int qk_norm, int il, int bt,
		      struct rows *r, const char *name, void *flush)
{
	const int H = sh.h, KV = sh.kv, D = sh.hd, R = r->n_rows, width = KV * D;
	const size_t nsrc = (size_t)R * (H + 2 * KV) * D;
	float *src = NULL, *w = NULL, *fr = NULL;
	int32_t *pos = malloc(sizeof(int32_t) * R), *slots = malloc(sizeof(int32_t) * R);
	float *dsrc = NULL, *dw = NULL, *dfr = NULL, *dq = NULL;
	int32_t *dpos = NULL, *dslots = NULL;
	unsigned char *ref = NULL, *got = NULL;
	struct fold_run f;
	size_t bo, bad_out = 0, bad_outb = 0, bad_cache = 0, left = 0;
	int ret0 = -1, ret1 = -1, lo, hi;
	double rel = INFINITY;

	memset(&f, 0, sizeof(f));
	f.r = r;
	f.scale = 1.0f / sqrtf((float)D);
	f.n_out = (size_t)R * H * D;
	if (rows_tables(r, bt, r->max_ctx) || cache_new(&f.k, r, width) ||
	    cache_new(&f.v, r, width) || k_cuda_attn_ws_create(&f.ws, R, H, D, r->max_ctx)) {
		CHECK(0, "fold setup");
		goto out;
	}
	src = rand_floats(nsrc, 2.0f);
	w = rand_floats(2 * (size_t)D, 1.0f);
	fr = malloc(sizeof(float) * (rope_dim / 2 + 1));
	for (int i = 0; i <= rope_dim / 2; i++)	/* Llama's base; long positions below */
		fr[i] = powf(500000.0f, -2.0f * (float)i / (float)(rope_dim ? rope_dim : 1));
	for (int i = 0; i < 2 * D; i++)
		w[i] += 1.0f;
	for (int i = 0; i < R; i++) {
		const int t = r->ctx[i] - 1;

		pos[i] = t;
		slots[i] = r->tab[r->seq[i]][t / bt] * bt + t % bt;
	}
	if (R > 2)
		slots[R / 2] = -1;
	dsrc = dup_to_device(src, sizeof(float) * nsrc);
	dw = dup_to_device(w, sizeof(float) * 2 * D);
	dfr = dup_to_device(fr, sizeof(float) * (rope_dim / 2 + 1));
	dpos = dup_to_device(pos, sizeof(int32_t) * R);
	dslots = dup_to_device(slots, sizeof(int32_t) * R);
	dq = dalloc(sizeof(float) * f.n_out);
	f.d_out = dalloc(sizeof(float) * f.n_out);
	f.d_outb = dalloc(sizeof(uint16_t) * f.n_out);
	f.a = packed_qkv_args(dsrc, R, H, KV, D, qk_norm ? dw : NULL, dfr, rope_dim, il, dpos,
			      dslots, dq, f.k.d, f.v.d);
	setenv("KDEC_QKV_IN_ATTN", "0", 1);
	fold_reset(&f, slots);
	ret0 = fold_call(&f, 0);
	if (ret0 == 0 && CU(cudaDeviceSynchronize()))
		ref = fold_result(&f);
	setenv("KDEC_QKV_IN_ATTN", "1", 1);	/* folded at any split count */
	fold_reset(&f, slots);
	ret1 = fold_call(&f, 0);
	if (ret1 == 0 && CU(cudaDeviceSynchronize()))
		got = fold_result(&f);
	unsetenv("KDEC_QKV_IN_ATTN");
	CHECK(ret0 == 0 && ret1 == 0 && ref && got, "attn_gqa_qkv: %d / %d", ret0, ret1);
	bo = sizeof(float) * f.n_out;
	if (ref && got) {
		const float *ro = (const float *)ref, *go = (const float *)got;
		const uint16_t *rb = (const uint16_t *)(ref + bo), *gb = (const uint16_t *)(got + bo);
		const uint16_t *rk = rb + f.n_out, *gk = gb + f.n_out;
		int finite = 1;

		for (size_t i = 0; i < f.n_out; i++) {
			bad_out += memcmp(&ro[i], &go[i], sizeof(float)) != 0;
			bad_outb += rb[i] != gb[i];
			finite &= isfinite(go[i]) && isfinite(ro[i]) && gb[i] != 0xffff;
		}
		for (size_t i = 0; i < 2 * f.k.n; i++)
			bad_cache += rk[i] != gk[i];
		for (int i = 0; i < R; i++)	/* the new rows: none left poisoned */
			for (int j = 0; slots[i] >= 0 && j < width; j++)
				left += gk[(size_t)slots[i] * width + j] == 0xffff ||
					gk[f.k.n + (size_t)slots[i] * width + j] == 0xffff;
		rel = finite ? test_rel_l2(go, ro, f.n_out) : INFINITY;
	}
	ctx_range(r, &lo, &hi);
	fprintf(stderr, "%sqkv fold %s h%d/kv%d/d%d rope %d%s%s bt%d rows %d ctx %d..%d: out rel_l2 "
		"%.2e, %zu fp32 / %zu bf16 values differ (0 expected), cache %zu differ, %zu "
		"unwritten %s\n", attn_path, name, H, KV, D, rope_dim, qk_norm ? " qknorm" : "",
		il ? " il" : "", bt, R, lo, hi, rel, bad_out, bad_outb, bad_cache, left,
		rel <= FOLD_TOL && !bad_cache && !left ? "PASS" : "FAIL");
	CHECK(rel <= FOLD_TOL && !bad_cache && !left,
	      "qkv fold %s rows %d: rel %g, cache %zu differ, %zu unwritten", name, R, rel,
	      bad_cache, left);
	if (timing && flush && ret0 == 0 && ret1 == 0) {
		double t_fold, t_sep, floor_us;

		setenv("KDEC_QKV_IN_ATTN", "1", 1);
		t_fold = graph_us(fold_call, &f, flush);
		setenv("KDEC_QKV_IN_ATTN", "0", 1);
		t_sep = graph_us(fold_call, &f, flush);
		unsetenv("KDEC_QKV_IN_ATTN");
		floor_us = rows_kv_bytes(r, 4.0 * KV * D) / 4.25e6;
		fprintf(stderr, "%sqkv fold %s graph rows %d ctx %d..%d: qkv_post + attention "
			"(KDEC_QKV_IN_ATTN=0) %.1f us, folded %.1f us (%.1f us saved); KV floor "
			"%.1f us at 4.25 TB/s\n", attn_path, name, R, lo, hi, t_sep, t_fold,
			t_sep - t_fold, floor_us);
	}
out:
	k_cuda_attn_ws_destroy(f.ws);
	cache_free(&f.k);
	cache_free(&f.v);
	cudaFree(dsrc), cudaFree(dw), cudaFree(dfr), cudaFree(dpos), cudaFree(dslots);
	cudaFree(dq), cudaFree(f.d_out), cudaFree(f.d_outb);
	free(src), free(w), free(fr), free(pos), free(slots), free(ref), free(got);
	rows_free(r);
}

/* Llama-3.1-8B (32 q / 8 kv heads, head 128, full rope), Qwen3 (q/k RMSNorm, 64 / 4:
 * a 16-head group), a head_dim 64 shape with partial interleaved rope, and a group of
 * 20 (the fold does not apply: the separate launches, the same results), at batch 1,
 * 3, 64, contexts 1..1024 and ~4000; then 3 splits at batch 64 (merge launch and the
 * merge in the last split) and every copy after the wait. Timing: Llama and Qwen3 at
 * batch 1 and 64, ctx 1024. */
static void test_qkv_fold(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, qwen3 = { 64, 4, 128 },
		d64 = { 12, 4, 64 }, d96 = { 8, 2, 96 }, g20 = { 40, 2, 128 };
	void *flush = timing ? dalloc(GQA_FLUSH_BYTES) : NULL;
	const int big = quick ? 300 : 4000;

	fold_case(llama, 128, 0, 0, 16, rows_decode(1, 1024, 0, 1024), "llama", flush);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 0, 1024), "llama", flush);
	fold_case(llama, 128, 0, 0, 16, rows_decode(3, 1024, 1, 1024), "llama", NULL);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama", NULL);
	fold_case(llama, 128, 0, 0, 16, rows_decode(1, big - 3, 0, big), "llama", NULL);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, big, 1, big), "llama", NULL);
	fold_case(llama, 128, 0, 0, 16, rows_decode(5, 1, 0, 64), "llama ctx1", NULL);
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(1, 1024, 0, 1024), "qwen3", flush);
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(64, 1024, 0, 1024), "qwen3", flush);
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(3, big, 1, big), "qwen3", NULL);
	fold_case(qwen3, 128, 1, 0, 7, rows_decode(33, 1000, 1, 1000), "qwen3", NULL);
	fold_case(d64, 32, 1, 1, 16, rows_decode(3, 700, 1, 700), "d64", NULL);
	fold_case(d64, 64, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "d64", NULL);
	fold_case(d96, 64, 1, 0, 16, rows_decode(3, 300, 1, 300), "d96", NULL);
	fold_case(g20, 128, 1, 0, 16, rows_decode(3, 500, 1, 500), "group20 (no fold)", NULL);
	/* 3 splits at batch 64, merged by the last split (the arrive path) */
	setenv("KDEC_ATTN_DEC_SPLITS", "3", 1);
	setenv("KDEC_ATTN_MMA_FOLD", "1", 1);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama splits3 fold",
		  NULL);
	unsetenv("KDEC_ATTN_MMA_FOLD");
	fold_case(qwen3, 128, 1, 0, 16, rows_decode(64, 1024, 1, 1024), "qwen3 splits3", NULL);
	unsetenv("KDEC_ATTN_DEC_SPLITS");
	/* every copy after the wait */
	setenv("KDEC_ATTN_MMA_EARLY", "0", 1);
	fold_case(llama, 128, 0, 0, 16, rows_decode(64, 1024, 1, 1024), "llama early0", NULL);
	unsetenv("KDEC_ATTN_MMA_EARLY");
	cudaFree(flush);
}

/* The tensor-core pass: shapes where the last split merges (2..8 splits), with the
 * merge-launch bits compared by gqa_case: Llama at batch 64 (3 splits), an odd batch
 * (2), group 16 (a 16-head chunk per block), contexts up to 32k (7 splits, some
 * empty). */
static void test_gqa_fold(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, g16 = { 32, 2, 128 },
		odd = { 10, 2, 40 };

	gqa_case(llama, 16, rows_decode(64, 1024, 0, 1024), 0);
	gqa_case(llama, 16, rows_decode(33, quick ? 200 : 1000, 1, 1000), 0);
	gqa_case(g16, 16, rows_decode(64, quick ? 200 : 2000, 1, 2000), 0);
	gqa_case(odd, 7, rows_decode(45, quick ? 200 : 1000, 1, 1000), 0);
	gqa_case(llama, 16, rows_decode(8, quick ? 300 : 32768, 1, 32768), 0);
}

/* ---- MLA ------------------------------------------------------------------ */

struct mla_run {
	struct k_mla_dims d;
	struct rows *r;
	int hint;
	struct k_cuda_attn_ws *ws;
	struct cache c;
	float *q, *d_q, *d_out;
	uint16_t *w, *d_w;
	float scale;
};

static int mla_call(struct mla_run *m, cudaStream_t s)
{
	struct k_cuda_attn_rows gr = rows_gpu(m->r, m->hint);

	return k_cuda_attn_mla(s, m->ws, m->d_out, m->d_q, m->d_w, m->c.d, m->r->bt, &gr, &m->d,
			       m->scale);
}

static int mla_call_default(void *m)
{
	return mla_call(m, 0);
}

static void mla_label(char *buf, size_t len, const struct mla_run *m, const char *what)
{
	int lo, hi;

	ctx_range(m->r, &lo, &hi);
	snprintf(buf, len, "mla %s h%d nope%d rope%d v%d lora%d bt%d rows %d ctx %d..%d max %d%s",
		 what, m->d.n_heads, m->d.nope_dim, m->d.rope_dim, m->d.v_dim, m->d.kv_lora,
		 m->r->bt, m->r->n_rows, lo, hi, m->r->max_ctx, m->hint ? " hinted" : "");
}

static void mla_check(struct mla_run *m, const char *what)
{
	size_t n = (size_t)m->r->n_rows * m->d.n_heads * m->d.v_dim;
	struct k_kv_layer kv = { .k = m->c.f, .n_blocks = m->r->n_blocks,
		.block_tokens = m->r->bt, .width = m->d.kv_lora + m->d.rope_dim };
	struct k_attn_rows cr = rows_cpu(m->r);
	float *ref = malloc(sizeof(float) * n), *got = download(m->d_out, n);
	char label[160];
	int ret;

	mla_label(label, sizeof(label), m, what);
	ret = k_cpu_attn_mla(pool, ref, m->q, m->w, K_BF16, &kv, &cr, &m->d, m->scale);
	CHECK(ret == 0, "k_cpu_attn_mla: %d", ret);
	compare(label, got, ref, n);
	free(ref);
	free(got);
}

static int mla_setup(struct mla_run *m, struct k_mla_dims d, int bt, struct rows *r, int hint,
		     int cap)
{
	int qk = d.nope_dim + d.rope_dim;
	size_t nq = (size_t)r->n_rows * d.n_heads * qk;
	size_t nw = (size_t)d.n_heads * (d.nope_dim + d.v_dim) * d.kv_lora;
	size_t no = (size_t)r->n_rows * d.n_heads * d.v_dim;

	memset(m, 0, sizeof(*m));
	m->d = d;
	m->r = r;
	m->hint = hint;
	m->scale = 1.0f / sqrtf((float)qk);
	if (rows_tables(r, bt, cap) || cache_new(&m->c, r, d.kv_lora + d.rope_dim))
		return -1;
	m->q = rand_floats(nq, 1.0f);
	m->w = malloc(sizeof(uint16_t) * nw);
	for (size_t i = 0; i < nw; i++)
		m->w[i] = k_f32_to_bf16(test_randf(&seed));
	m->d_q = dup_to_device(m->q, sizeof(float) * nq);
	m->d_w = dup_to_device(m->w, sizeof(uint16_t) * nw);
	m->d_out = dalloc(sizeof(float) * no);
	if (!m->d_q || !m->d_w || !m->d_out)
		return -1;
	return k_cuda_attn_ws_create(&m->ws, r->n_rows, d.n_heads, d.kv_lora + d.rope_dim,
				     r->max_ctx) ? -1 : 0;
}

static void mla_teardown(struct mla_run *m)
{
	k_cuda_attn_ws_destroy(m->ws);
	cache_free(&m->c);
	free(m->q);
	free(m->w);
	cudaFree(m->d_q);
	cudaFree(m->d_w);
	cudaFree(m->d_out);
	rows_free(m->r);
}

static void mla_case(struct k_mla_dims d, int bt, struct rows *r, int hint)
{
	struct mla_run m;
	size_t n = (size_t)r->n_rows * d.n_heads * d.v_dim;
	int ret;

	if (mla_setup(&m, d, bt, r, hint, 0)) {
		CHECK(0, "mla setup h%d lora%d", d.n_heads, d.kv_lora);
		mla_teardown(&m);
		return;
	}
	CU(cudaMemset(m.d_out, 0xff, sizeof(float) * n));
	ret = mla_call(&m, 0);
	CHECK(ret == 0, "k_cuda_attn_mla: %d", ret);
	if (ret == 0 && CU(cudaDeviceSynchronize()))
		mla_check(&m, "");
	if (timing && ret == 0) {
		char label[160];
		double us = time_us(mla_call_default, &m);
		double gb = rows_kv_bytes(r, 2.0 * (d.kv_lora + d.rope_dim)) / (us * 1e3);

		mla_label(label, sizeof(label), &m, "");
		fprintf(stderr, "%-72s time %.1f us, %.0f GB/s of latent read (floor 4250)\n",
			label, us, gb);
	}
	mla_teardown(&m);
}

static void mla_graph_case(struct k_mla_dims d, int bt, int n_rows, int max_ctx)
{
	struct rows *r = rows_decode(n_rows, max_ctx / 8, 1, max_ctx);
	size_t n = (size_t)n_rows * d.n_heads * d.v_dim;
	cudaStream_t s = NULL;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	struct mla_run m;
	int ret = -1;

	if (mla_setup(&m, d, bt, r, 0, max_ctx) || !CU(cudaStreamCreate(&s)))
		goto out;
	if (!CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	ret = mla_call(&m, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)))
		goto out;
	for (int round = 0; round < 2; round++) {
		if (round == 1) {
			for (int i = 0; i < n_rows; i++)
				r->ctx[i] = rand_int(1, max_ctx);
			r->ctx[0] = max_ctx;
		}
		rows_reshuffle(r);
		CU(cudaMemset(m.d_out, 0xff, sizeof(float) * n));
		if (CU(cudaGraphLaunch(exec, s)) && CU(cudaStreamSynchronize(s)))
			mla_check(&m, round ? "graph replay 2" : "graph replay 1");
	}
out:
	CHECK(ret == 0, "mla graph case: %d", ret);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	if (s)
		cudaStreamDestroy(s);
	mla_teardown(&m);
}

/* Median microseconds of k_cuda_attn_mla over 25 calls after one, each behind a 256 MB
 * memset that leaves neither the latent cache nor w_kv_b in L2 (as in a step, where
 * the other layers' weights pass through it); 0 without a scratch buffer. */
#define MLA_AB_RUNS 25
static double mla_time_cold(struct mla_run *m)
{
	static void *flush;
	const size_t flush_bytes = (size_t)256 << 20;

	if (!flush && !(flush = dalloc(flush_bytes)))
		return 0;
	return time_runs_us(mla_call_default, m, MLA_AB_RUNS, flush, flush_bytes);
}

/* The MLA knobs side by side on one set of inputs: each checked against the reference
 * (output poisoned first) and, with KD_TEST_TIME=1, timed cold (absorb, attention,
 * merge and expand together; ncu or nsys for the kernels one by one). */
static void mla_ab_case(struct k_mla_dims d, int n_rows, int ctx, int spread, int max_ctx)
{
	/* NULL: the knob unset (its default) */
	static const struct {
		const char *name, *ksplit, *split_min, *split_live, *merge, *fold, *cluster;
	} cfg[] = {
		{ "old (ksplit 0, split_min 0, merge kernel)", "0", "0", NULL, "0", "0", NULL },
		{ "ksplit only (split_min 0)", "1", "0", NULL, "0", "0", NULL },
		{ "split_min 64 only (ksplit 0)", "0", "64", NULL, "0", "0", NULL },
		{ "phase 1 (ksplit, split_min 64 always)", "1", "64", NULL, "0", "0", NULL },
		{ "ksplit, split_min 128", "1", "128", NULL, "0", "0", NULL },
		{ "ksplit, floor past 64 live", NULL, NULL, NULL, "0", "0", NULL },
		{ "ksplit, floor past 32 live", NULL, NULL, "32", "0", "0", NULL },
		{ "ksplit, floor past 128 live", NULL, NULL, "128", "0", "0", NULL },
		{ "floor past 64 + batched merge", NULL, NULL, NULL, "1", "0", NULL },
		{ "floor past 64 + fold, no cluster", NULL, NULL, NULL, "0", "16", "0" },
		{ "new default (+ cluster fold, 1 row)", NULL, NULL, NULL, NULL, NULL, NULL },
		{ "new default, cluster fold to 16 rows", NULL, NULL, NULL, NULL, "16", NULL },
		/* the floor's edge again with the fold's cheaper merge */
		{ "new default, floor past 128 live", NULL, NULL, "128", NULL, NULL, NULL },
		{ "new default, split_min 0", NULL, "0", NULL, NULL, NULL, NULL },
	};
	size_t n = (size_t)n_rows * d.n_heads * d.v_dim;
	struct rows *r = rows_decode(n_rows, ctx, spread, max_ctx);
	struct mla_run m;
	char label[200];

	if (mla_setup(&m, d, 64, r, 0, 0)) {
		CHECK(0, "mla a/b setup");
		mla_teardown(&m);
		return;
	}
	for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++) {
		int ret;

		cfg[c].ksplit ? setenv("KDEC_MLA_MMA_KSPLIT", cfg[c].ksplit, 1)
			      : unsetenv("KDEC_MLA_MMA_KSPLIT");
		cfg[c].split_min ? setenv("KDEC_MLA_SPLIT_MIN", cfg[c].split_min, 1)
				 : unsetenv("KDEC_MLA_SPLIT_MIN");
		cfg[c].split_live ? setenv("KDEC_MLA_SPLIT_LIVE", cfg[c].split_live, 1)
				  : unsetenv("KDEC_MLA_SPLIT_LIVE");
		cfg[c].merge ? setenv("KDEC_ATTN_MERGE", cfg[c].merge, 1) : unsetenv("KDEC_ATTN_MERGE");
		cfg[c].fold ? setenv("KDEC_MLA_FOLD_ROWS", cfg[c].fold, 1)
			    : unsetenv("KDEC_MLA_FOLD_ROWS");
		cfg[c].cluster ? setenv("KDEC_MLA_FOLD_CLUSTER", cfg[c].cluster, 1)
			       : unsetenv("KDEC_MLA_FOLD_CLUSTER");
		snprintf(label, sizeof(label), "[a/b %s]", cfg[c].name);
		CU(cudaMemset(m.d_out, 0xff, sizeof(float) * n));
		ret = mla_call(&m, 0);
		CHECK(ret == 0, "%s k_cuda_attn_mla: %d", label, ret);
		if (ret == 0 && CU(cudaDeviceSynchronize()))
			mla_check(&m, label);
		if (timing && ret == 0)
			fprintf(stderr, "mla a/b batch %d ctx %d%s max %d %-42s cold %.1f us\n",
				n_rows, ctx, spread ? " (spread)" : "", max_ctx, cfg[c].name,
				mla_time_cold(&m));
	}
	unsetenv("KDEC_MLA_MMA_KSPLIT");
	unsetenv("KDEC_MLA_SPLIT_MIN");
	unsetenv("KDEC_MLA_SPLIT_LIVE");
	unsetenv("KDEC_ATTN_MERGE");
	unsetenv("KDEC_MLA_FOLD_ROWS");
	unsetenv("KDEC_MLA_FOLD_CLUSTER");
	mla_teardown(&m);
}

/* ---- MLA: mla_post's work in the absorb launch ----------------------------- */

/* k_cuda_attn_mla_post against k_cuda_mla_post then k_cuda_attn_mla on the same
 * inputs, two copies of one cache: out and every cache value equal bit for bit (the
 * fold does mla_post's rounded operations in its order), and out against the CPU
 * reference over the old path's q and cache (k_cuda_mla_post itself is checked
 * against the CPU in test_cuda_ops). Outputs poisoned with NaN first; the new path's
 * q buffer too where q comes from fused [q | kv_a] rows (the fold must read those,
 * never q). Each row appends its token at ctx - 1, which the attention then reads:
 * the new path's attention must copy that row after its PDL wait. */
struct mla_fold {
	struct mla_run m;	/* dims, rows, the old path's cache and q, w, out */
	uint16_t *d_cache2;	/* the new path's cache */
	float *d_q2, *d_out2;	/* its q (poisoned, fused) and out */
	float *d_src;		/* (rows, src_rs): [q | kv_a] (fused) or kv_a alone */
	float *d_inv;
	int32_t *d_pos, *d_slots;
	struct k_cuda_mla_post_args a_old, a_new;
};

static int fold_old(void *p, cudaStream_t s)
{
	struct mla_fold *f = p;
	int ret = k_cuda_mla_post(s, &f->a_old);

	return ret ? ret : mla_call(&f->m, s);
}

static int fold_new(void *p, cudaStream_t s)
{
	struct mla_fold *f = p;
	struct k_cuda_attn_rows gr = rows_gpu(f->m.r, f->m.hint);

	return k_cuda_attn_mla_post(s, f->m.ws, f->d_out2, &f->a_new, f->m.d_w, f->d_cache2,
				    f->m.r->bt, &gr, &f->m.d, f->m.scale);
}

static int fold_setup(struct mla_fold *f, int rot_dim, int interleaved, int fused)
{
	const struct k_mla_dims *d = &f->m.d;
	const struct rows *r = f->m.r;
	const int R = r->n_rows, H = d->n_heads, qk = d->nope_dim + d->rope_dim;
	const int width = d->kv_lora + d->rope_dim;
	/* rows padded (interleaved cases): the absorb's q loads then one at a time */
	const long src_rs = (fused ? (long)H * qk : 0) + width + (interleaved ? 3 : 0);
	size_t nsrc = (size_t)R * src_rs, nq = (size_t)R * H * qk;
	float *src = rand_floats(nsrc, 1.0f), inv[512];
	int32_t pos[64], slots[64];

	for (int i = 0; i < rot_dim / 2; i++)
		inv[i] = powf(10000.0f, -2.0f * (float)i / (float)rot_dim);
	for (int i = 0; i < R; i++) {	/* the row's token: ctx - 1, in its table */
		pos[i] = r->ctx[i] - 1;
		slots[i] = r->row_tab[i][pos[i] / r->bt] * r->bt + pos[i] % r->bt;
	}
	f->d_src = dup_to_device(src, sizeof(float) * nsrc);
	f->d_inv = dup_to_device(inv, sizeof(float) * (size_t)(rot_dim / 2 + 1));
	f->d_pos = dup_to_device(pos, sizeof(int32_t) * (size_t)R);
	f->d_slots = dup_to_device(slots, sizeof(int32_t) * (size_t)R);
	f->d_cache2 = dup_to_device(f->m.c.h, sizeof(uint16_t) * f->m.c.n);
	f->d_q2 = dup_to_device(f->m.q, sizeof(float) * nq);	/* lora: q in place, both */
	f->d_out2 = dalloc(sizeof(float) * (size_t)R * H * d->v_dim);
	free(src);
	if (!f->d_src || !f->d_inv || !f->d_pos || !f->d_slots || !f->d_cache2 || !f->d_q2 ||
	    !f->d_out2)
		return -1;
	if (fused)	/* the fold must not read q: NaN there shows in out */
		CU(cudaMemset(f->d_q2, 0xff, sizeof(float) * nq));
	f->a_old = (struct k_cuda_mla_post_args){
		.q_pe = f->m.d_q + d->nope_dim, .q_rs = (long)H * qk, .q_hs = qk,
		.q_src_pe = fused ? f->d_src + d->nope_dim : NULL, .q_src_rs = src_rs,
		.nope_dim = d->nope_dim, .n_heads = H,
		.kv = f->d_src + (fused ? (long)H * qk : 0), .kv_rs = src_rs, .rows = R,
		.kv_lora = d->kv_lora, .pe_dim = d->rope_dim,
		.norm = f->d_src,	/* any (kv_lora) fp32 values serve as the norm weight */
		.eps = 1e-6f, .inv_freq = f->d_inv, .rot_dim = rot_dim,
		.interleaved = interleaved, .attn_factor = rot_dim % 4 ? 1.0f : 1.125f,
		.pos = f->d_pos, .cache = f->m.c.d, .slots = f->d_slots,
	};
	f->a_new = f->a_old;
	f->a_new.q_pe = f->d_q2 + d->nope_dim;
	f->a_new.cache = f->d_cache2;
	return 0;
}

static void fold_teardown(struct mla_fold *f)
{
	cudaFree(f->d_cache2);
	cudaFree(f->d_q2);
	cudaFree(f->d_out2);
	cudaFree(f->d_src);
	cudaFree(f->d_inv);
	cudaFree(f->d_pos);
	cudaFree(f->d_slots);
	mla_teardown(&f->m);
}

/* Values of a and b (n of size sz) that differ. */
static size_t fold_diff(const void *a, const void *b, size_t n, size_t sz)
{
	size_t bad = 0;

	for (size_t i = 0; i < n; i++)
		bad += memcmp((const char *)a + i * sz, (const char *)b + i * sz, sz) != 0;
	return bad;
}

static void *fold_download(const void *d, size_t bytes)
{
	void *h = malloc(bytes);

	if (h)
		CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
	return h;
}

/* The checks above on one set of inputs, then (KD_TEST_TIME=1) both paths timed as a
 * graph, cold (a 256 MB memset before each replay), median of GQA_TIME_RUNS. */
static void mla_fold_case(struct k_mla_dims d, struct rows *r, int rot_dim, int interleaved,
			  int fused)
{
	const size_t no = (size_t)r->n_rows * d.n_heads * d.v_dim;
	const size_t nq = (size_t)r->n_rows * d.n_heads * (d.nope_dim + d.rope_dim);
	struct mla_fold f;
	float *o1 = NULL, *o2 = NULL, *q1 = NULL;
	uint16_t *c1 = NULL, *c2 = NULL;
	char label[200], what[64];
	int ret;

	memset(&f, 0, sizeof(f));
	label[0] = 0;
	snprintf(what, sizeof(what), "[post in absorb, rope %d%s, %s]", rot_dim,
		 interleaved ? " interleaved" : "", fused ? "fused q" : "q in place");
	if (mla_setup(&f.m, d, 16, r, 0, 0) || fold_setup(&f, rot_dim, interleaved, fused)) {
		CHECK(0, "mla fold setup");
		fold_teardown(&f);
		return;
	}
	CU(cudaMemset(f.m.d_out, 0xff, sizeof(float) * no));
	CU(cudaMemset(f.d_out2, 0xff, sizeof(float) * no));
	ret = fold_old(&f, 0);
	CHECK(ret == 0, "%s old path: %d", what, ret);
	ret = ret ? ret : fold_new(&f, 0);
	CHECK(ret == 0, "%s k_cuda_attn_mla_post: %d", what, ret);
	if (ret == 0 && CU(cudaDeviceSynchronize())) {
		size_t bo, bc;

		o1 = download(f.m.d_out, no);
		o2 = download(f.d_out2, no);
		c1 = fold_download(f.m.c.d, sizeof(uint16_t) * f.m.c.n);
		c2 = fold_download(f.d_cache2, sizeof(uint16_t) * f.m.c.n);
		q1 = download(f.m.d_q, nq);
		bo = fold_diff(o1, o2, no, sizeof(float));
		bc = fold_diff(c1, c2, f.m.c.n, sizeof(uint16_t));
		mla_label(label, sizeof(label), &f.m, what);
		fprintf(stderr, "%s%-72s out %zu of %zu, cache %zu of %zu values differ from "
			"mla_post + attn_mla  %s\n", attn_path, label, bo, no, bc, f.m.c.n,
			bo || bc ? "FAIL" : "PASS");
		CHECK(!bo && !bc, "%s%s: %zu outputs, %zu cache values differ", attn_path, label,
		      bo, bc);
		/* the reference over the old path's q and cache */
		memcpy(f.m.q, q1, sizeof(float) * nq);
		for (size_t i = 0; i < f.m.c.n; i++)
			f.m.c.f[i] = k_bf16_to_f32(c1[i]);
		{
			float *keep = f.m.d_out;

			f.m.d_out = f.d_out2;
			mla_check(&f.m, what);
			f.m.d_out = keep;
		}
	}
	if (timing && ret == 0) {
		static void *flush;
		double old_us, new_us, bytes;

		if (!flush)
			flush = dalloc(GQA_FLUSH_BYTES);
		old_us = flush ? graph_us(fold_old, &f, flush) : 0;
		new_us = flush ? graph_us(fold_new, &f, flush) : 0;
		bytes = rows_kv_bytes(r, 2.0 * (d.kv_lora + d.rope_dim)) +
			2.0 * d.n_heads * (d.nope_dim + d.v_dim) * d.kv_lora;
		fprintf(stderr, "mla post-in-absorb time batch %d %s: mla_post + attn_mla %.1f us, "
			"attn_mla_post %.1f us (%+.1f); HBM floor %.1f us (w_kv_b + latent at "
			"4.25 TB/s), graph, cold L2, median of %d\n", r->n_rows, label,
			old_us, new_us, new_us - old_us, bytes / 4.25e6, GQA_TIME_RUNS);
	}
	free(o1);
	free(o2);
	free(c1);
	free(c2);
	free(q1);
	fold_teardown(&f);
}

/* DeepSeek-V2-Lite's layer (and odd dims: a vec-less absorb, the tiled attention, a
 * partial rope) at batch 1, 3, 8 (folded) and 64 (past the fold: the two launches). */
static void test_mla_post_fold(void)
{
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		odd = { 5, 12, 6, 10, 37 };
	static const int runs[2] = { 3, 2 }, pos0[2] = { 500, 40 };

	mla_fold_case(lite, rows_decode(1, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(1, 1000, 0, 32768), 64, 1, 1);
	mla_fold_case(lite, rows_decode(1, 1, 0, 4096), 64, 0, 0);	/* the only token */
	mla_fold_case(lite, rows_decode(3, 1024, 1, 4096), 64, 0, 1);
	mla_fold_case(lite, rows_decode(8, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(8, 777, 1, 4096), 64, 1, 0);
	mla_fold_case(lite, rows_prefill(2, runs, pos0, 1024), 64, 0, 1);	/* 5 rows, 2 seqs */
	mla_fold_case(odd, rows_decode(2, 333, 1, 1024), 6, 0, 1);
	mla_fold_case(odd, rows_decode(1, 100, 0, 1024), 4, 1, 0);	/* rope 4 of 6 */
	mla_fold_case(odd, rows_decode(3, 333, 1, 1024), 6, 0, 1);	/* 3 rows: 2 chunks */
	if (quick)
		return;
	mla_fold_case(lite, rows_decode(1, 4096, 0, 32768), 64, 0, 1);
	mla_fold_case(lite, rows_decode(64, 1024, 0, 1024), 64, 0, 1);
	mla_fold_case(lite, rows_decode(64, 1024, 1, 4096), 64, 1, 0);
}

/* ---- KV write ------------------------------------------------------------- */

/* n_rows random rows (a few special values among them) into distinct shuffled slots of a
 * poisoned cache, one slot -1; every written value must equal k_f32_to_bf16 bit for bit
 * and every other cache value must keep the poison. */
static void kv_write_case(int width, int pad, int n_rows, int n_slots)
{
	static const float special[] = { 0.0f, -0.0f, 1.00390625f /* tie, to even */,
		1.01171875f /* tie, up */, 3.0e38f, -1e-40f /* subnormal */, INFINITY };
	int stride = width + pad, skipped = n_rows > 3 ? 3 : -1;
	size_t n_src = (size_t)n_rows * stride, n_cache = (size_t)n_slots * width;
	float *src = rand_floats(n_src, 3.0f);
	int32_t *perm = test_shuffled_ids(n_slots, &seed);
	uint16_t *cache = malloc(sizeof(uint16_t) * n_cache);
	float *d_src = NULL;
	int32_t *d_slots = NULL;
	uint16_t *d_cache = dalloc(sizeof(uint16_t) * n_cache);
	size_t wrong = 0, touched = 0;
	char label[160];
	int ret;

	for (size_t i = 0; i < sizeof(special) / sizeof(special[0]) && i < n_src; i++)
		src[i * 5 % n_src] = special[i];
	if (skipped >= 0)
		perm[skipped] = -1;
	d_src = dup_to_device(src, sizeof(float) * n_src);
	d_slots = dup_to_device(perm, sizeof(int32_t) * (size_t)n_rows);
	CU(cudaMemset(d_cache, 0xa5, sizeof(uint16_t) * n_cache));
	ret = k_cuda_kv_write(0, d_cache, width, d_src, stride, n_rows, d_slots);
	CHECK(ret == 0, "k_cuda_kv_write: %d", ret);
	CU(cudaMemcpy(cache, d_cache, sizeof(uint16_t) * n_cache, cudaMemcpyDeviceToHost));
	for (int r = 0; r < n_rows; r++)
		if (perm[r] >= 0)
			for (int c = 0; c < width; c++) {
				uint16_t *dst = cache + (size_t)perm[r] * width + c;

				wrong += *dst != k_f32_to_bf16(src[(size_t)r * stride + c]);
				*dst = 0xa5a5;	/* checked: back to poison for the sweep */
			}
	for (size_t i = 0; i < n_cache; i++)
		touched += cache[i] != 0xa5a5;
	snprintf(label, sizeof(label), "kv_write width %d stride %d rows %d slots %d", width, stride,
		 n_rows, n_slots);
	fprintf(stderr, "%-72s wrong %zu stray %zu %s\n", label, wrong, touched,
		wrong || touched ? "FAIL" : "PASS");
	CHECK(wrong == 0 && touched == 0, "%s", label);
	free(src);
	free(perm);
	free(cache);
	cudaFree(d_src);
	cudaFree(d_slots);
	cudaFree(d_cache);
}

/* ---- cases ---------------------------------------------------------------- */

/* Sizes the kernels must refuse, with -EINVAL. */
static void test_refusals(void)
{
	struct k_cuda_attn_ws *ws = NULL;
	struct k_mla_dims big = { .n_heads = 1, .nope_dim = 16, .rope_dim = 8, .v_dim = 16,
		.kv_lora = 4096 };
	struct k_cuda_attn_rows r = { .n_rows = 1, .max_ctx = 16 };

	if (k_cuda_attn_ws_create(&ws, 4, 8, 4096, 64)) {
		CHECK(0, "ws create");
		return;
	}
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 1, 1, 300, 1.0f) == -EINVAL,
	      "head_dim 300");
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 6, 4, 64, 1.0f) == -EINVAL,
	      "6 heads over 4 kv heads");
	r.n_rows = 5;
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 8, 8, 64, 1.0f) == -EINVAL,
	      "rows over the workspace");
	r.n_rows = 1;
	r.max_ctx = 65;
	CHECK(k_cuda_attn_gqa(0, ws, NULL, NULL, NULL, NULL, 16, &r, 8, 8, 64, 1.0f) == -EINVAL,
	      "max_ctx over the workspace");
	r.max_ctx = 16;
	CHECK(k_cuda_attn_mla(0, ws, NULL, NULL, NULL, NULL, 16, &r, &big, 1.0f) == -EINVAL,
	      "kv_lora 4096");
	k_cuda_attn_ws_destroy(ws);
	fprintf(stderr, "%-72s %s\n", "refusals of unsupported sizes (-EINVAL)", "done");
}

static void test_kv_write(void)
{
	kv_write_case(1024, 0, 37, 4096);	/* 16-byte path */
	kv_write_case(576, 8, 64, 300);		/* MLA width */
	kv_write_case(46, 3, 29, 100);		/* odd: scalar path */
	kv_write_case(40, 1, 7, 7);		/* every slot but the skipped one */
}

static void test_gqa(void)
{
	static const struct gqa_shape shapes[] = {
		{ 32, 8, 128 }, { 8, 8, 64 }, { 12, 4, 24 }, { 10, 2, 40 },
	};
	static const int bts[] = { 16, 64 };

	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		for (size_t b = 0; b < 2; b++) {
			struct gqa_shape sh = shapes[i];
			int bt = bts[b];

			gqa_case(sh, bt, rows_decode(1, 1, 0, 1), 0);
			gqa_case(sh, bt, rows_decode(1, 17, 0, 17), 0);
			gqa_case(sh, bt, rows_decode(7, quick ? 300 : 1000, 1, 1000), 0);
			gqa_case(sh, bt, rows_decode(7, 17, 1, 32768), 0);	/* empty splits */
			if (!quick)
				gqa_case(sh, bt, rows_decode(64, 4096, 1, 4096), 0);
			else
				gqa_case(sh, bt, rows_decode(64, 40, 1, 64), 0);
		}
	gqa_case(shapes[0], 7, rows_decode(5, quick ? 200 : 3000, 1, 3000), 0);	/* bt 7 */
	gqa_case(shapes[0], 16, rows_decode(1, 300, 0, 32768), 0);	/* most splits empty */
	/* beyond the brief: head_dim 20 (no 16-byte path) and 256 (widest) */
	for (size_t i = 0; i < 2; i++) {
		static const struct gqa_shape more[] = { { 6, 2, 20 }, { 4, 2, 256 } };
		int run = 64, pos = quick ? 100 : 2000;

		gqa_case(more[i], 16, rows_decode(7, quick ? 300 : 1000, 1, 1000), 0);
		gqa_case(more[i], 64, rows_prefill(1, &run, &pos, pos + run), 1);
	}
	if (!quick) {
		static const int few[] = { 32768, 20000, 5 };

		for (size_t i = 0; i < 4; i += 3) {
			struct rows *r = rows_decode(3, 32768, 0, 32768);

			memcpy(r->ctx, few, sizeof(few));
			gqa_case(shapes[i], 16, r, 0);
		}
	}
}

static void test_gqa_prefill(void)
{
	static const struct gqa_shape llama = { 32, 8, 128 }, odd = { 12, 4, 24 },
		odd2 = { 10, 2, 40 }, mha = { 8, 8, 64 };
	int run = 256, end = quick ? 300 : 32000, zero = 0, mid = 500;
	/* several sequences in one call: tiles straddle the runs, plus two decode rows */
	int runs[] = { 37, 100, 5, 1, 1 }, pos[] = { 1000, 0, 4000, 3000, 0 };

	gqa_case(llama, 16, rows_prefill(1, &run, &end, end + run), 1);
	gqa_case(llama, 16, rows_prefill(1, &run, &zero, run), 1);
	gqa_case(odd, 64, rows_prefill(1, &run, &end, end + run), 1);
	gqa_case(odd2, 16, rows_prefill(1, &run, &zero, run), 1);
	if (quick) {
		pos[0] = 100;
		pos[2] = 200;
		pos[3] = 150;
	}
	gqa_case(llama, 16, rows_prefill(5, runs, pos, 4096), 1);
	gqa_case(odd2, 7, rows_prefill(5, runs, pos, 4096), 1);
	run = 64;	/* prefill rows through the decode kernel: no hint */
	gqa_case(mha, 16, rows_prefill(1, &run, &mid, mid + run), 0);
	gqa_graph_case(llama, 16, 7, quick ? 256 : 4096);
	gqa_graph_case(odd2, 16, 3, quick ? 256 : 4096);
}

static void test_mla(void)
{
	/* clu2, clu4: the folding expand's clusters of 2 and 4 blocks a head, the float4
	 * columns of a row (14, 30) not a multiple of them, the latent + rope a multiple
	 * of 8 (the tensor-core kernel, whose splits the expand merges) */
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		tiny = { 3, 16, 8, 16, 32 }, odd = { 5, 12, 6, 10, 37 },
		v3 = { 128, 128, 64, 128, 512 }, clu2 = { 4, 16, 12, 32, 36 },
		clu4 = { 3, 16, 4, 64, 100 };
	int run = 64, pos = quick ? 100 : 4000, runs[] = { 20, 1, 9 }, pos3[] = { 50, 7, 0 };

	mla_case(lite, 64, rows_decode(1, 1, 0, 1), 0);
	mla_case(lite, 64, rows_decode(1, quick ? 300 : 1000, 0, 1000), 0);
	/* batch 1 as a graph sizes it: 128 splits of 32 tokens, 33 live (the fold's 32
	 * loads in flight and one more; 17 of 64 with KDEC_MLA_SPLIT_MIN=64), the rest
	 * empty */
	mla_case(lite, 64, rows_decode(1, 1040, 0, 4096), 0);
	/* past 64 splits' worth the default floor of 64 tokens (47 live at 3000), and rows
	 * on both sides of it in one launch: each row's floor from its own ctx */
	mla_case(lite, 64, rows_decode(1, 3000, 0, 32768), 0);
	mla_case(lite, 16, rows_decode(5, quick ? 2500 : 5000, 1, 32768), 0);
	mla_case(lite, 16, rows_decode(7, quick ? 200 : 1000, 1, 32768), 0);
	mla_case(lite, 64, rows_decode(64, quick ? 40 : 4096, 1, quick ? 64 : 4096), 0);
	mla_case(tiny, 16, rows_decode(1, 17, 0, 17), 0);
	mla_case(tiny, 16, rows_decode(1, 300, 0, 32768), 0);	/* 128 splits, most empty */
	mla_case(tiny, 16, rows_decode(64, 300, 1, 300), 0);
	mla_case(odd, 7, rows_decode(7, quick ? 200 : 1000, 1, 1000), 0);
	mla_case(odd, 16, rows_prefill(3, runs, pos3, 80), 1);
	mla_case(v3, 64, rows_decode(2, quick ? 100 : 1000, 1, 1000), 0);
	mla_case(clu2, 16, rows_decode(1, 700, 0, 4096), 0);
	mla_case(clu4, 16, rows_decode(1, 700, 0, 4096), 0);
	mla_case(clu4, 16, rows_decode(9, quick ? 300 : 3000, 1, 4096), 0);
	mla_case(lite, 64, rows_prefill(1, &run, &pos, pos + run), 1);
	if (!quick) {
		mla_case(lite, 64, rows_decode(1, 32768, 0, 32768), 0);
		mla_case(odd, 16, rows_decode(1, 32768, 0, 32768), 0);
	}
	mla_graph_case(tiny, 16, 5, quick ? 256 : 4096);
	mla_graph_case(lite, 64, 3, quick ? 256 : 4096);
	mla_graph_case(lite, 64, 1, quick ? 256 : 4096);	/* the cluster fold's launch */
}

/* DeepSeek-V2-Lite's layer at batch 1 and 64 through each MLA knob (mla_ab_case). */
static void test_mla_ab(void)
{
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },
		odd = { 5, 12, 6, 10, 37 };

	attn_path = "";
	mla_ab_case(lite, 1, 1024, 0, 1024);
	mla_ab_case(lite, 1, 1024, 0, 32768);	/* a graph's splits: 128 */
	mla_ab_case(lite, 1, 1000, 0, 4096);	/* a short last tile */
	mla_ab_case(odd, 3, 333, 1, 4096);
	if (quick)
		return;
	mla_ab_case(lite, 1, 2048, 0, 32768);	/* the default floor's edge: 64 splits */
	mla_ab_case(lite, 1, 3000, 0, 32768);	/* past it: 47 of 64 tokens, not 94 */
	mla_ab_case(lite, 1, 4096, 0, 32768);
	mla_ab_case(lite, 1, 8192, 0, 32768);
	mla_ab_case(lite, 1, 32768, 0, 32768);
	mla_ab_case(lite, 64, 1024, 0, 1024);
	mla_ab_case(lite, 64, 1024, 1, 4096);
	mla_ab_case(lite, 8, 1024, 0, 1024);
}

/* The pass that follows: the CUDA-core kernels (mma 0: fp32, ATTN_TOL) or the
 * tensor-core decode kernels (ATTN_TOL_MMA), by KDEC_ATTN_MMA; lines tagged so. */
static void attn_pass(int mma)
{
	setenv("KDEC_ATTN_MMA", mma ? "1" : "0", 1);
	attn_tol = mma ? ATTN_TOL_MMA : ATTN_TOL;
	attn_path = mma ? "[mma] " : "[fp32] ";
}

/* The KV write, q/k post and GQA cases: the CUDA-core kernels (fp32) first, then the
 * tensor-core decode kernel on the decode-shaped cases, with each tile length it has. */
static void gqa_part(void)
{
	test_refusals();
	test_kv_write();
	test_qkv_post();
	attn_pass(0);
	test_gqa();
	test_gqa_prefill();
	attn_pass(1);
	mma_pass = 1;
	test_gqa();
	test_gqa_fold();
	test_qkv_fold();
	if (timing)
		test_gqa_time();
	if (!quick) {
		setenv("KDEC_ATTN_MMA_TK", "64", 1);
		attn_path = "[mma tk64] ";
		test_gqa();
		unsetenv("KDEC_ATTN_MMA_TK");
	}
	mma_pass = 0;
	unsetenv("KDEC_ATTN_MMA");
}

/* The MLA cases: the CUDA-core kernels (fp32), then the tensor-core kernels under each
 * of their knobs; the carveout last (once asked for at a workspace's creation, it
 * stays). */
static void mla_part(void)
{
	attn_pass(0);
	test_mla();
	test_mla_post_fold();
	attn_pass(1);
	test_mla();
	/* MLA's 4-warp kernel (no key-dim split) and its former split floor */
	setenv("KDEC_MLA_MMA_KSPLIT", "0", 1);
	attn_path = "[mma ksplit0] ";
	test_mla();
	unsetenv("KDEC_MLA_MMA_KSPLIT");
	setenv("KDEC_MLA_SPLIT_MIN", "0", 1);
	attn_path = "[mma split_min0] ";
	test_mla();
	setenv("KDEC_MLA_SPLIT_MIN", "256", 1);
	attn_path = "[mma split_min256] ";
	test_mla();
	/* a floor between the two: min(256, ctx / 4 rounded up to 32) */
	setenv("KDEC_MLA_SPLIT_LIVE", "4", 1);
	attn_path = "[mma split_min256 live4] ";
	test_mla();
	unsetenv("KDEC_MLA_SPLIT_LIVE");
	unsetenv("KDEC_MLA_SPLIT_MIN");
	test_mla_ab();
	attn_path = "[mma] ";
	test_mla_post_fold();
	/* The split merge folded into MLA's expand projection (off by default: the merge
	 * kernel, the cases above): at batch 1 by a cluster of a head's expand blocks
	 * sharing it, at every row count it takes, then each block merging on its own. */
	setenv("KDEC_MLA_FOLD_ROWS", "1", 1);
	attn_path = "[mma fold1] ";
	test_mla();
	setenv("KDEC_MLA_FOLD_ROWS", "16", 1);
	attn_path = "[mma fold16] ";
	test_mla();
	setenv("KDEC_MLA_FOLD_CLUSTER", "0", 1);
	attn_path = "[mma fold16 nocluster] ";
	test_mla();
	setenv("KDEC_MLA_FOLD_ROWS", "1", 1);
	attn_path = "[mma fold1 nocluster] ";
	test_mla();
	unsetenv("KDEC_MLA_FOLD_CLUSTER");
	unsetenv("KDEC_MLA_FOLD_ROWS");
	setenv("KDEC_MLA_CARVEOUT", "1", 1);
	attn_path = "[mma carveout] ";
	test_mla();
	unsetenv("KDEC_MLA_CARVEOUT");
	unsetenv("KDEC_ATTN_MMA");
}

int main(void)
{
	const char *part;
	char name[128];
	double gib;
	int major, minor;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);

	if (!test_gpu_present("test_cuda_attn"))
		return 77;
	part = test_part("test_cuda_attn", "gqa", "mla");
	quick = test_env_flag("KD_TEST_QUICK");
	timing = test_env_flag("KD_TEST_TIME");
	seed = test_seed();
	CHECK(k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor) == 0, "describe");
	fprintf(stderr, "device 0: %s, %.1f GiB, sm_%d%d; seed %llu%s (KD_TEST_SEED repeats it); "
		"tolerance rel L2 %g (tensor-core decode %g)\n", name, gib, major, minor, seed,
		quick ? ", quick" : "", ATTN_TOL, ATTN_TOL_MMA);
	if (k_pool_create(&pool, cpus > 16 ? 16 : cpus > 0 ? (int)cpus : 1)) {
		fprintf(stderr, "test_cuda_attn: no thread pool\n");
		return 1;
	}
	if (test_part_runs(part, "gqa"))
		gqa_part();
	if (test_part_runs(part, "mla"))
		mla_part();
	k_pool_destroy(pool);
	return test_result("test_cuda_attn");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_attn: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
