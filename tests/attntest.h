/* The fixtures of the attention tests and benchmark: query rows over shuffled block
 * tables, bf16 caches whose exact values the CPU reference also gets, the comparison
 * line, and the GQA and MLA runs (set-up, one call, the check against the CPU).
 * Include after tests/cudatest.h; a program sets attn_seed and attn_pool first. */
#ifndef KD_TESTS_ATTNTEST_H
#define KD_TESTS_ATTNTEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "tests/cudatest.h"

/* Tolerance, relative L2 against the reference. Both sides read the same bf16 K/V (the
 * reference as fp32) and the same fp32 q and weights, and both accumulate in fp32: they
 * differ only in summation order, the exp2 form of the softmax and the split merge,
 * ~1e-6..1e-5 relative at 32k tokens. 2e-4 leaves room for that and still fails on a
 * single wrong token at 32k (~1e-2 with these score spreads). Every output must also be
 * finite: the NaN poison overwritten.
 * The tensor-core decode and prefill kernels (attn_mma.cu, attn_prefill.cu) round q and
 * the probabilities to bf16 (2^-9 relative each): ~2e-3..4e-3 relative L2 on these
 * cases, so 1e-2 for them; an indexing or masking error there is off by far more (a
 * whole tile or head: > 1e-1). */
#define ATTN_TOL 2e-4
#define ATTN_TOL_MMA 1e-2
#define Q_AMP_GQA 4.0f	/* q scale: scores of std ~1.3, a softmax that picks tokens */

static unsigned long long attn_seed;	/* the inputs' random state (test_seed) */
static struct k_pool *attn_pool;	/* the CPU reference's threads */
static double attn_tol = ATTN_TOL;	/* of the pass running (attn_pass) */
static const char *attn_path = "";	/* its label prefix */

/* A test's start: the device, the seed (KD_TEST_SEED repeats a run) and the
 * tolerances on stderr, and the CPU reference's thread pool. 0, or -1 without one. */
static inline int attn_begin(const char *name, int quick)
{
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	char dev[128];
	double gib;
	int major, minor;

	attn_seed = test_seed();
	CHECK(k_cuda_device_describe(0, dev, sizeof(dev), &gib, &major, &minor) == 0, "describe");
	fprintf(stderr, "device 0: %s, %.1f GiB, sm_%d%d; seed %llu%s (KD_TEST_SEED repeats it); "
		"tolerance rel L2 %g (tensor-core kernels %g)\n", dev, gib, major, minor, attn_seed,
		quick ? ", quick" : "", ATTN_TOL, ATTN_TOL_MMA);
	if (k_pool_create(&attn_pool, cpus > 16 ? 16 : cpus > 0 ? (int)cpus : 1)) {
		fprintf(stderr, "%s: no thread pool\n", name);
		return -1;
	}
	return 0;
}

/* A test's end: the pool freed, the defaults installed again; test_result. */
static inline int attn_end(const char *name)
{
	k_pool_destroy(attn_pool);
	k_cuda_tuning_set(NULL);
	return test_result(name);
}

/* The pass that follows: the CUDA-core kernels (mma 0: fp32, ATTN_TOL) or the
 * tensor-core decode kernels (ATTN_TOL_MMA), by the attn_mma knob; lines tagged so.
 * Other knobs as installed. */
static inline void attn_pass(int mma)
{
	struct k_cuda_tuning t = *k_cuda_tuning();

	t.attn_mma = mma;
	k_cuda_tuning_set(&t);
	attn_tol = mma ? ATTN_TOL_MMA : ATTN_TOL;
	attn_path = mma ? "[mma] " : "[fp32] ";
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

static inline struct rows *rows_new(int n_rows, int n_seqs, int max_ctx)
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
static inline struct rows *rows_decode(int n, int ctx_max, int spread, int max_ctx)
{
	struct rows *r = rows_new(n, n, max_ctx);

	for (int i = 0; i < n; i++) {
		r->seq[i] = i;
		r->ctx[i] = spread ? test_rand_int(1, ctx_max, &attn_seed) : ctx_max;
	}
	if (spread && n > 1) {
		r->ctx[0] = ctx_max;
		r->ctx[n - 1] = 1;
	}
	return r;
}

/* Prefill: runs[i] consecutive rows of sequence i at positions pos0[i].., so
 * ctx = pos + 1; hint: the n_seqs the kernels are told (0: none). */
static inline struct rows *rows_prefill(int n_runs, const int *runs, const int *pos0, int max_ctx)
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
static inline int rows_tables(struct rows *r, int bt, int cap)
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
	perm = test_shuffled_ids(r->n_blocks, &attn_seed);
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
static inline void rows_reshuffle(struct rows *r)
{
	int32_t *perm = test_shuffled_ids(r->n_blocks, &attn_seed), *all = r->tab[0];
	int used = 0;

	for (int s = 0; s < r->n_seqs; s++)
		used += r->n_tab[s];
	memcpy(all, perm, sizeof(int32_t) * (size_t)used);
	free(perm);
	CU(cudaMemcpy(r->d_tabs, all, sizeof(int32_t) * (size_t)used, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(r->d_ctx, r->ctx, sizeof(int32_t) * (size_t)r->n_rows,
		      cudaMemcpyHostToDevice));
}

static inline void rows_free(struct rows *r)
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

static inline struct k_cuda_attn_rows rows_gpu(const struct rows *r, int hint)
{
	struct k_cuda_attn_rows g = {
		.n_rows = r->n_rows, .ctx = r->d_ctx, .blocks = r->d_row_tab,
		.max_ctx = r->max_ctx, .n_seqs = hint ? r->n_seqs : 0,
	};
	return g;
}

static inline struct k_attn_rows rows_cpu(const struct rows *r)
{
	struct k_attn_rows c = {
		.n_rows = r->n_rows, .ctx = r->ctx, .blocks = (const int32_t *const *)r->row_tab,
	};
	return c;
}

/* K/V bytes the rows must read at least: each sequence's longest ctx once. */
static inline double rows_kv_bytes(const struct rows *r, double bytes_per_token)
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

static inline int cache_new(struct cache *c, const struct rows *r, int width)
{
	c->n = (size_t)r->n_blocks * r->bt * width;
	c->h = malloc(sizeof(uint16_t) * c->n);
	c->f = malloc(sizeof(float) * c->n);
	if (!c->h || !c->f)
		return -1;
	for (size_t i = 0; i < c->n; i++) {
		c->h[i] = k_f32_to_bf16(test_randf(&attn_seed));
		c->f[i] = k_bf16_to_f32(c->h[i]);
	}
	c->d = dup_to_device(c->h, sizeof(uint16_t) * c->n);
	return c->d ? 0 : -1;
}

static inline void cache_free(struct cache *c)
{
	free(c->h);
	free(c->f);
	cudaFree(c->d);
}

/* ---- checking ------------------------------------------------------------ */

/* One line: label, max abs error, rel L2, unwritten (non-finite) outputs, verdict. */
static inline void attn_compare(const char *label, const float *got, const float *ref, size_t n)
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

static inline void rows_ctx_range(const struct rows *r, int *lo, int *hi)
{
	*lo = *hi = r->n_rows ? r->ctx[0] : 0;
	for (int i = 0; i < r->n_rows; i++) {
		*lo = r->ctx[i] < *lo ? r->ctx[i] : *lo;
		*hi = r->ctx[i] > *hi ? r->ctx[i] : *hi;
	}
}

/* A captured launch replayed with new ctx and new block tables: call(run, stream) is
 * captured once; two replays, the second over longer contexts (up to r->max_ctx, the
 * first row at it), each after the tables are reshuffled and out (n floats) poisoned,
 * each checked by check(run, label). The capture's result: 0, the call's error, or -1
 * after a failed CUDA call. */
static inline int attn_graph_replays(struct rows *r, int (*call)(void *, cudaStream_t),
				     void (*check)(void *, const char *), void *run, float *out,
				     size_t n)
{
	cudaStream_t s = NULL;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	int ret = -1;

	if (!CU(cudaStreamCreate(&s)) ||
	    !CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	ret = call(run, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0))) {
		ret = ret ? ret : -1;
		goto out;
	}
	for (int round = 0; round < 2; round++) {
		if (round == 1) {	/* longer contexts, new tables, same graph */
			for (int i = 0; i < r->n_rows; i++)
				r->ctx[i] = test_rand_int(1, r->max_ctx, &attn_seed);
			r->ctx[0] = r->max_ctx;
		}
		rows_reshuffle(r);
		poison(out, sizeof(float) * n);
		if (CU(cudaGraphLaunch(exec, s)) && CU(cudaStreamSynchronize(s)))
			check(run, round ? "graph replay 2" : "graph replay 1");
	}
out:
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	if (s)
		cudaStreamDestroy(s);
	return ret;
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

/* One k_cuda_attn_gqa of the run g (a struct gqa_run) on s. */
static inline int gqa_call(void *p, cudaStream_t s)
{
	struct gqa_run *g = p;
	struct k_cuda_attn_rows gr = rows_gpu(g->r, g->hint);

	return k_cuda_attn_gqa(s, g->ws, g->d_out, g->d_q, g->k.d, g->v.d, g->r->bt, &gr,
			       g->sh.h, g->sh.kv, g->sh.hd, g->scale);
}

static inline void gqa_label(char *buf, size_t len, const struct gqa_run *g, const char *what)
{
	int lo, hi;

	rows_ctx_range(g->r, &lo, &hi);
	snprintf(buf, len, "gqa %s h%d/kv%d/d%d bt%d rows %d ctx %d..%d max %d seqs %d%s", what,
		 g->sh.h, g->sh.kv, g->sh.hd, g->r->bt, g->r->n_rows, lo, hi, g->r->max_ctx,
		 g->r->n_seqs, g->hint ? " hinted" : "");
}

/* g's (a struct gqa_run) output against the CPU reference: one line, labelled what. */
static inline void gqa_check(void *p, const char *what)
{
	struct gqa_run *g = p;
	size_t n = (size_t)g->r->n_rows * g->sh.h * g->sh.hd;
	struct k_kv_layer kv = { .k = g->k.f, .v = g->v.f, .n_blocks = g->r->n_blocks,
		.block_tokens = g->r->bt, .width = g->sh.kv * g->sh.hd };
	struct k_attn_rows cr = rows_cpu(g->r);
	float *ref = malloc(sizeof(float) * n), *got = download(g->d_out, n);
	char label[160];

	gqa_label(label, sizeof(label), g, what);
	k_cpu_attn_gqa(attn_pool, ref, g->q, &kv, &cr, g->sh.h, g->sh.kv, g->sh.hd, g->scale);
	attn_compare(label, got, ref, n);
	free(ref);
	free(got);
}

static inline int gqa_setup(struct gqa_run *g, struct gqa_shape sh, int bt, struct rows *r,
			    int hint, int cap)
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
	g->q = test_rand_floats(nq, Q_AMP_GQA, &attn_seed);
	g->d_q = dup_to_device(g->q, sizeof(float) * nq);
	g->d_out = dalloc(sizeof(float) * nq);
	if (!g->d_q || !g->d_out)
		return -1;
	return k_cuda_attn_ws_create(&g->ws, r->n_rows, sh.h, sh.hd, r->max_ctx) ? -1 : 0;
}

static inline void gqa_teardown(struct gqa_run *g)
{
	k_cuda_attn_ws_destroy(g->ws);
	cache_free(&g->k);
	cache_free(&g->v);
	free(g->q);
	cudaFree(g->d_q);
	cudaFree(g->d_out);
	rows_free(g->r);
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

/* One k_cuda_attn_mla of the run m (a struct mla_run) on s. */
static inline int mla_call(void *p, cudaStream_t s)
{
	struct mla_run *m = p;
	struct k_cuda_attn_rows gr = rows_gpu(m->r, m->hint);

	return k_cuda_attn_mla(s, m->ws, m->d_out, m->d_q, m->d_w, m->c.d, m->r->bt, &gr, &m->d,
			       m->scale);
}

static inline void mla_label(char *buf, size_t len, const struct mla_run *m, const char *what)
{
	int lo, hi;

	rows_ctx_range(m->r, &lo, &hi);
	snprintf(buf, len, "mla %s h%d nope%d rope%d v%d lora%d bt%d rows %d ctx %d..%d max %d%s",
		 what, m->d.n_heads, m->d.nope_dim, m->d.rope_dim, m->d.v_dim, m->d.kv_lora,
		 m->r->bt, m->r->n_rows, lo, hi, m->r->max_ctx, m->hint ? " hinted" : "");
}

/* m's (a struct mla_run) output against the CPU reference: one line, labelled what. */
static inline void mla_check(void *p, const char *what)
{
	struct mla_run *m = p;
	size_t n = (size_t)m->r->n_rows * m->d.n_heads * m->d.v_dim;
	struct k_kv_layer kv = { .k = m->c.f, .n_blocks = m->r->n_blocks,
		.block_tokens = m->r->bt, .width = m->d.kv_lora + m->d.rope_dim };
	struct k_attn_rows cr = rows_cpu(m->r);
	float *ref = malloc(sizeof(float) * n), *got = download(m->d_out, n);
	char label[160];
	int ret;

	mla_label(label, sizeof(label), m, what);
	ret = k_cpu_attn_mla(attn_pool, ref, m->q, m->w, K_BF16, &kv, &cr, &m->d, m->scale);
	CHECK(ret == 0, "k_cpu_attn_mla: %d", ret);
	attn_compare(label, got, ref, n);
	free(ref);
	free(got);
}

static inline int mla_setup(struct mla_run *m, struct k_mla_dims d, int bt, struct rows *r,
			    int hint, int cap)
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
	m->q = test_rand_floats(nq, 1.0f, &attn_seed);
	m->w = malloc(sizeof(uint16_t) * nw);
	for (size_t i = 0; i < nw; i++)
		m->w[i] = k_f32_to_bf16(test_randf(&attn_seed));
	m->d_q = dup_to_device(m->q, sizeof(float) * nq);
	m->d_w = dup_to_device(m->w, sizeof(uint16_t) * nw);
	m->d_out = dalloc(sizeof(float) * no);
	if (!m->d_q || !m->d_w || !m->d_out)
		return -1;
	return k_cuda_attn_ws_create(&m->ws, r->n_rows, d.n_heads, d.kv_lora + d.rope_dim,
				     r->max_ctx) ? -1 : 0;
}

static inline void mla_teardown(struct mla_run *m)
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

/* The MLA knobs side by side (test_cuda_attn_mla checks each configuration against the
 * reference, bench_cuda_attn times each): -1 keeps a knob's built-in default. A split
 * floor set without its live count applies at every split count (live 0), as the
 * KDEC_MLA_SPLIT_MIN variable alone does. */
struct mla_ab_cfg {
	const char *name;
	int ksplit, split_min, split_live, merge;
};

static const struct mla_ab_cfg mla_ab_cfgs[] = {
	{ "old (ksplit 0, split_min 0)", 0, 0, -1, -1 },
	{ "ksplit only (split_min 0)", 1, 0, -1, -1 },
	{ "split_min 64 only (ksplit 0)", 0, 64, -1, -1 },
	{ "phase 1 (ksplit, split_min 64 always)", 1, 64, -1, -1 },
	{ "ksplit, split_min 128", 1, 128, -1, -1 },
	{ "default (ksplit, floor past 64 live)", -1, -1, -1, -1 },
	{ "ksplit, floor past 32 live", -1, -1, 32, -1 },
	{ "ksplit, floor past 128 live", -1, -1, 128, -1 },
	{ "default + batched merge", -1, -1, -1, 1 },
};
#define MLA_AB_N (sizeof(mla_ab_cfgs) / sizeof(mla_ab_cfgs[0]))

/* base with c's four MLA knobs (the built-in defaults where c keeps them). */
static inline struct k_cuda_tuning mla_ab_tuning(const struct k_cuda_tuning *base,
						 const struct mla_ab_cfg *c)
{
	struct k_cuda_tuning t = *base, def;

	k_cuda_tuning_defaults(&def);
	t.mla_mma_ksplit = c->ksplit >= 0 ? c->ksplit : def.mla_mma_ksplit;
	t.mla_split_min = c->split_min >= 0 ? c->split_min : def.mla_split_min;
	t.mla_split_live = c->split_live >= 0 ? c->split_live :
			   c->split_min >= 0 ? 0 : def.mla_split_live;
	t.attn_merge_batched = c->merge >= 0 ? c->merge : def.attn_merge_batched;
	return t;
}

#endif
