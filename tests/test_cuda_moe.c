/* CUDA MoE against the CPU references. Routing: every scoring/selection mode, near
 * ties (quantised logits, one-ulp neighbours, biases that tie exactly); the ids must be
 * identical and the weights within 1e-6 (the kernel is meant to be bit-exact; the line
 * says how many weights differ at all). Experts, both paths (forced with
 * the tuning's moe_path): DeepSeek-V2-Lite and Qwen3-30B-A3B shapes at M 1, 2, 3, 5, 8
 * (64 on the grouped path), small odd shapes (partial k chunks; hidden and inter past
 * one 2048-value batch; the CUDA-core fallback), every row on one expert (64 rows; 130
 * on the small shapes: more than one 64-row pass; small path: more pairs than one dot
 * pass), a row naming one expert twice, an id outside [0, n_experts) (the CPU
 * reference gets a valid id with weight 0 there). Experts nobody chose point at NaN
 * weights, so reading one fails; outputs are poisoned with NaN first, so an element
 * left unwritten fails. Tolerance rel L2 <= 1e-4 (grouped: bf16 hi+lo activations,
 * small: fp32 activations; fp32 accumulation: ~1e-5 expected). The small path runs
 * a single row with moe_small_m1.cu's kernels (the default) and the general ones,
 * which must give the same bits (the tuning's moe_m1; repeated and bad ids too). The
 * grouped path runs again on moe_qtile.cu's tile kernels (KDEC_MOE_QTILE_ROWS; " qtile"
 * in the lines where they take the shape), a hot expert of 64 rows among the cases,
 * then in their wide passes at every M (KDEC_MOE_QTILE_WIDE 1: " qtile-wide"), a hot
 * expert of 130 rows (64, 64, 2) added, then in passes of 16 spread over 3 CTAs an
 * expert (KDEC_MOE_QTILE_SPLIT 3: " qtile-split"; the hot 130 rows 9 passes, 3 a CTA).
 * Experts plus shared expert plus residual (k_cuda_moe_experts_add) against the CPU's
 * ops in forward.c's order (k_cpu_moe_experts, the shared SwiGLU MLP by k_cpu_linear
 * and k_cpu_silu_mul, two adds) on fresh random inputs, both ways too:
 * DeepSeek-V2-Lite (shared 2816 = 2 pieces of 1408) and Qwen3 (no shared expert) at
 * M 1, 2, 5 and the most rows (10 for V2-Lite: 60 pairs; 8 for Qwen3),
 * odd shapes (a shared width not a multiple of inter: a short last piece; 3 and 4
 * pieces; top_k 1 at M 64, the most rows the small path takes), dup and bad ids.
 * y starts as a random residual, so an element left unwritten keeps it and fails;
 * tolerance rel L2 <= 1e-4 of the MLP's part (got - want over want - residual). Where
 * the fused path does not apply (grouped path forced, more than 64 pairs) the call
 * must return 1 and leave y bit for bit as it was. Skips (77) without CUDA or a GPU.
 * KD_TEST_PART=route or experts: only those cases (for compute-sanitizer).
 * KD_TEST_DUMP=FILE: every GPU result of the experts' cases appended to FILE as raw
 * floats, so that two builds' bits can be compared (cmp) on the same seed. Timings:
 * tests/bench/bench_cuda_moe. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "tests/cudatest.h"
#include "tests/moetest.h"

#define W_TOL 1e-6
#define EXPERT_TOL 1e-4
#define N_SETS 8		/* distinct weight sets; expert e uses set e % N_SETS */

static unsigned long long seed = 0x3c0ffee5ull;
static cudaStream_t stream;
static struct k_pool *pool;
static FILE *dump;	/* KD_TEST_DUMP */

/* n GPU results to KD_TEST_DUMP's file, where set. */
static void dump_floats(const float *v, size_t n)
{
	if (dump && fwrite(v, sizeof(float), n, dump) != n)
		CHECK(0, "KD_TEST_DUMP: write failed");
}

/* ---- routing --------------------------------------------------------------- */

/* Logits with many exact and one-ulp ties: values on a 1/4 grid, some nudged. */
static void tie_logits(float *l, size_t n, float amp)
{
	for (size_t i = 0; i < n; i++) {
		float v = roundf(test_randf(&seed) * amp * 4) / 4;
		int k = test_rand_int(0, 3, &seed);

		l[i] = k == 0 ? nextafterf(v, INFINITY) : k == 1 ? nextafterf(v, -INFINITY) : v;
	}
}

static void test_route(const char *name, struct k_moe_route_params p, int M, int ties,
		       int with_bias)
{
	int E = p.n_experts, K = p.top_k, id_bad = 0, w_diff = 0;
	size_t nl = (size_t)M * E, nk = (size_t)M * K;
	float *logits = malloc(sizeof(float) * nl), *bias = malloc(sizeof(float) * E);
	float *w_cpu = malloc(sizeof(float) * nk), *w_gpu = malloc(sizeof(float) * nk);
	int32_t *id_cpu = malloc(sizeof(int32_t) * nk), *id_gpu = malloc(sizeof(int32_t) * nk);
	float *dl, *dbias = NULL, *dw;
	int32_t *dids;
	double max_w = 0;
	int ret;

	if (ties)
		tie_logits(logits, nl, 3);
	else
		for (size_t i = 0; i < nl; i++)
			logits[i] = test_randf(&seed) * 4;
	for (int e = 0; e < E; e++)	/* biases on a grid: biased choices tie too */
		bias[e] = ties ? roundf(test_randf(&seed) * 8) / 64 : test_randf(&seed) * 0.1f;
	p.bias = with_bias ? bias : NULL;
	k_cpu_moe_route(&p, logits, M, id_cpu, w_cpu);

	dl = dup_to_device(logits, sizeof(float) * nl);
	if (with_bias)
		dbias = dup_to_device(bias, sizeof(float) * E);
	dids = dalloc(sizeof(int32_t) * nk);
	dw = dalloc(sizeof(float) * nk);
	CU(cudaMemset(dids, 0xff, sizeof(int32_t) * nk));
	CU(cudaMemset(dw, 0xff, sizeof(float) * nk));
	p.bias = dbias;
	ret = k_cuda_moe_route(stream, &p, dl, M, dids, dw);
	CHECK(ret == 0, "%s: route returned %d", name, ret);
	to_host(id_gpu, dids, sizeof(int32_t) * nk);
	to_host(w_gpu, dw, sizeof(float) * nk);
	for (size_t i = 0; i < nk; i++) {
		double d = fabs((double)w_gpu[i] - (double)w_cpu[i]);

		if (id_gpu[i] != id_cpu[i]) {
			if (id_bad++ < 3)
				fprintf(stderr, "  %s: row %zu slot %zu: id %d, cpu %d\n", name,
					i / K, i % K, id_gpu[i], id_cpu[i]);
		}
		if (w_gpu[i] != w_cpu[i])
			w_diff++;
		if (!(d <= max_w))
			max_w = d;	/* NaN sticks */
	}
	printf("%-12s %-34s M %3d  ids differ %d  weights max_abs %.3g (%d not bit-equal)  %s\n",
	       "moe_route", name, M, id_bad, max_w, w_diff,
	       !id_bad && max_w <= W_TOL ? "PASS" : "FAIL");
	CHECK(!id_bad && max_w <= W_TOL, "%s M %d: %d ids differ, weights %.3g", name, M, id_bad, max_w);
	cudaFree(dl);
	cudaFree(dbias);
	cudaFree(dids);
	cudaFree(dw);
	free(logits);
	free(bias);
	free(w_cpu);
	free(w_gpu);
	free(id_cpu);
	free(id_gpu);
}

static void test_route_all(void)
{
	const struct {
		const char *name;
		struct k_moe_route_params p;
		int bias;
	} cfg[] = {
		{ "v2lite softmax greedy", { .n_experts = 64, .top_k = 6, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GREEDY, .routed_scaling = 1 }, 0 },
		{ "qwen3 softmax norm", { .n_experts = 128, .top_k = 8, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GREEDY, .norm_topk_prob = 1, .routed_scaling = 1 }, 0 },
		{ "v2 group_max", { .n_experts = 160, .top_k = 6, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GROUP_MAX, .n_group = 8, .topk_group = 3,
			.routed_scaling = 16 }, 0 },
		{ "v2 group_max 1 group", { .n_experts = 64, .top_k = 6, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GROUP_MAX, .n_group = 8, .topk_group = 1,
			.routed_scaling = 1 }, 0 },
		{ "v3 sigmoid top2 bias", { .n_experts = 256, .top_k = 8, .scoring = K_MOE_SIGMOID,
			.select = K_MOE_GROUP_TOP2, .n_group = 8, .topk_group = 4,
			.norm_topk_prob = 1, .routed_scaling = 2.5f }, 1 },
		/* groups of 32: moe_route's register form scores them across the warp */
		{ "group_max 4 groups of 32", { .n_experts = 128, .top_k = 6,
			.scoring = K_MOE_SOFTMAX, .select = K_MOE_GROUP_MAX, .n_group = 4,
			.topk_group = 2, .routed_scaling = 16 }, 0 },
		{ "top2 2 groups of 32 bias", { .n_experts = 64, .top_k = 4,
			.scoring = K_MOE_SIGMOID, .select = K_MOE_GROUP_TOP2, .n_group = 2,
			.topk_group = 1, .norm_topk_prob = 1, .routed_scaling = 2.5f }, 1 },
		{ "kimi-k2 sigmoid 1 group bias", { .n_experts = 384, .top_k = 8,
			.scoring = K_MOE_SIGMOID, .select = K_MOE_GROUP_TOP2, .n_group = 1,
			.topk_group = 1, .norm_topk_prob = 1, .routed_scaling = 2.827f }, 1 },
		{ "v2 group_max all kept", { .n_experts = 64, .top_k = 6, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GROUP_MAX, .n_group = 8, .topk_group = 8,
			.routed_scaling = 1 }, 0 },
		{ "sigmoid greedy bias", { .n_experts = 384, .top_k = 8, .scoring = K_MOE_SIGMOID,
			.select = K_MOE_GREEDY, .norm_topk_prob = 1, .routed_scaling = 2.827f }, 1 },
		{ "tiny odd", { .n_experts = 7, .top_k = 3, .scoring = K_MOE_SOFTMAX,
			.select = K_MOE_GREEDY, .norm_topk_prob = 1, .routed_scaling = 1 }, 0 },
		/* the routing of tests/data/reference/deepseek_v3 and kimi_k2 */
		{ "ref v3 8e 2g top1g", { .n_experts = 8, .top_k = 2, .scoring = K_MOE_SIGMOID,
			.select = K_MOE_GROUP_TOP2, .n_group = 2, .topk_group = 1,
			.routed_scaling = 2.5f }, 1 },
		{ "ref kimi 12e 3g top2g", { .n_experts = 12, .top_k = 4, .scoring = K_MOE_SIGMOID,
			.select = K_MOE_GROUP_TOP2, .n_group = 3, .topk_group = 2,
			.norm_topk_prob = 1, .routed_scaling = 2.827f }, 1 },
		{ "tiny top2 groups of 1", { .n_experts = 6, .top_k = 4, .scoring = K_MOE_SIGMOID,
			.select = K_MOE_GROUP_TOP2, .n_group = 6, .topk_group = 3,
			.routed_scaling = 1 }, 1 },
		/* past 48 KB of shared memory with the bias's copy: the bias from global */
		{ "4000e softmax greedy bias", { .n_experts = 4000, .top_k = 8,
			.scoring = K_MOE_SOFTMAX, .select = K_MOE_GREEDY, .norm_topk_prob = 1,
			.routed_scaling = 1 }, 1 },
	};
	const int Ms[] = { 1, 5, 64, 257 };

	for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++)
		for (int m = 0; m < 4; m++)
			for (int ties = 0; ties < 2; ties++) {
				char name[64];

				snprintf(name, sizeof(name), "%s%s", cfg[c].name, ties ? " ties" : "");
				test_route(name, cfg[c].p, Ms[m], ties, cfg[c].bias);
			}
}

/* ---- experts --------------------------------------------------------------- */

/* N_SETS random expert weight sets on host and device, and one NaN expert. */
struct weights {
	uint16_t *h[N_SETS][3];
	uint16_t *d[N_SETS][3];
	uint16_t *nan;	/* device: NaN bf16, big enough for any of the three */
};

static void weights_make(struct weights *w, const struct moe_shape *s)
{
	size_t n = (size_t)s->hidden * s->inter;
	uint16_t *nan = malloc(sizeof(uint16_t) * n);

	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			w->h[k][j] = malloc(sizeof(uint16_t) * n);
			for (size_t i = 0; i < n; i++)	/* ~1/sqrt(K) so outputs stay O(1) */
				w->h[k][j][i] = k_f32_to_bf16(test_randf(&seed) * 0.05f);
			w->d[k][j] = dup_to_device(w->h[k][j], sizeof(uint16_t) * n);
		}
	for (size_t i = 0; i < n; i++)
		nan[i] = 0x7fc0;
	w->nan = dup_to_device(nan, sizeof(uint16_t) * n);
	free(nan);
}

static void weights_free(struct weights *w)
{
	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			free(w->h[k][j]);
			cudaFree(w->d[k][j]);
		}
	cudaFree(w->nan);
}

#define EX_DUP 1		/* row 0 names its slot 0 expert in slot 1 too */
#define EX_BAD_ID 2		/* the last row's last slot names no expert */

/* A case's routing: ids and weights (moe_make_ids, then flags), the CPU's copies (a bad
 * id becomes a valid one adding 0: the CPU cannot take it), and the device pointer
 * table in which an expert nobody chose points at NaN weights (it must not be read); ex
 * the host experts for the CPU. Returns the number of experts used. */
static int case_routing(const struct moe_shape *s, const struct weights *w, int M, int hot,
			int flags, int32_t *ids, float *wts, int32_t *cpu_ids, float *cpu_wts,
			struct k_expert *ex, const uint16_t **table, unsigned char *used)
{
	size_t nk = (size_t)M * s->top_k;
	int n_used = 0;

	moe_make_ids(ids, wts, M, s, hot, &seed);
	if ((flags & EX_DUP) && s->top_k > 1)
		ids[1] = ids[0];
	memcpy(cpu_ids, ids, sizeof(int32_t) * nk);
	memcpy(cpu_wts, wts, sizeof(float) * nk);
	if (flags & EX_BAD_ID) {
		ids[nk - 1] = (nk & 1) ? -1 : s->n_experts + 2;
		cpu_ids[nk - 1] = 0;
		cpu_wts[nk - 1] = 0.0f;
	}
	for (size_t i = 0; i < nk; i++)
		if (ids[i] >= 0 && ids[i] < s->n_experts)
			used[ids[i]] = 1;
	for (int e = 0; e < s->n_experts; e++) {
		int k = e % N_SETS;

		ex[e] = (struct k_expert){ .gate = w->h[k][0], .up = w->h[k][1], .down = w->h[k][2] };
		for (int j = 0; j < 3; j++)
			table[3 * e + j] = used[e] ? w->d[k][j] : w->nan;
		n_used += used[e];
	}
	return n_used;
}

static void test_experts(const struct moe_shape *s, struct weights *w, struct k_cuda_moe_ws *ws,
			 int M, int hot, int flags, enum k_cuda_moe_path path)
{
	size_t nx = (size_t)M * s->hidden, nk = (size_t)M * s->top_k;
	float *x = malloc(sizeof(float) * nx), *want = malloc(sizeof(float) * nx);
	float *got = malloc(sizeof(float) * nx), *wts = malloc(sizeof(float) * nk);
	int32_t *ids = malloc(sizeof(int32_t) * nk), *cpu_ids = malloc(sizeof(int32_t) * nk);
	float *cpu_wts = malloc(sizeof(float) * nk);
	struct k_expert *ex = calloc((size_t)s->n_experts, sizeof(*ex));
	const uint16_t **table = calloc((size_t)s->n_experts * 3, sizeof(*table));
	unsigned char *used = calloc((size_t)s->n_experts, 1);
	void *dtable;
	float *dx, *dw, *dout;
	int32_t *dids;
	int ret, n_used = 0;
	char shape[112];

	for (size_t i = 0; i < nx; i++)
		x[i] = test_randf(&seed) * 2;
	n_used = case_routing(s, w, M, hot, flags, ids, wts, cpu_ids, cpu_wts, ex, table, used);
	CHECK(k_cpu_moe_experts(pool, want, x, M, cpu_ids, cpu_wts, s->top_k, ex, s->n_experts,
				K_BF16, s->hidden, s->inter) == 0, "cpu experts");
	dtable = dup_to_device(table, sizeof(*table) * (size_t)s->n_experts * 3);
	dx = dup_to_device(x, sizeof(float) * nx);
	dw = dup_to_device(wts, sizeof(float) * nk);
	dids = dup_to_device(ids, sizeof(int32_t) * nk);
	dout = dalloc(sizeof(float) * nx);
	CU(cudaMemset(dout, 0xff, sizeof(float) * nx));
	moe_set_path(path);
	ret = k_cuda_moe_experts(stream, ws, dout, dx, M, dids, dw, s->top_k,
				 (const uint16_t *const *)dtable, s->n_experts, s->hidden, s->inter);
	CHECK(ret == 0, "moe_experts returned %d", ret);
	to_host(got, dout, sizeof(float) * nx);
	dump_floats(got, nx);
	{
		double rel = test_rel_l2(got, want, nx), max_abs = 0;
		int bad = 0;

		for (size_t i = 0; i < nx; i++) {
			double d = fabs((double)got[i] - (double)want[i]);

			if (!(d <= max_abs))
				max_abs = d;
			bad |= got[i] != got[i];
		}
		snprintf(shape, sizeof(shape), "%s M %d (%d experts used)%s%s%s%s", s->name, M,
			 n_used, hot >= 0 ? " hot" : "", flags & EX_DUP ? " dup" : "",
			 flags & EX_BAD_ID ? " bad-id" : "",
			 path == K_CUDA_MOE_PATH_SMALL || !k_cuda_moe_qtile_takes(NULL, s->hidden,
			 s->inter, M) ? "" : k_cuda_moe_qtile_wide(M) ? " qtile-wide" :
			 k_cuda_tuning()->moe_qtile_split > 1 ? " qtile-split" : " qtile");
		printf("%-12s %-7s %-62s max_abs %.3g rel_l2 %.3g%s  %s\n", "moe_experts",
		       moe_path_name(path), shape, max_abs, rel, bad ? "  NaN" : "",
		       !bad && rel <= EXPERT_TOL ? "PASS" : "FAIL");
		CHECK(!bad && rel <= EXPERT_TOL, "%s: rel %.3g", shape, rel);
	}
	cudaFree(dtable);
	cudaFree(dx);
	cudaFree(dw);
	cudaFree(dids);
	cudaFree(dout);
	free(x);
	free(want);
	free(got);
	free(wts);
	free(ids);
	free(cpu_ids);
	free(cpu_wts);
	free(ex);
	free(table);
	free(used);
}

/* A shared expert of width si on host and device; bf16 like the layer's weights. */
struct shared_w {
	uint16_t *h[3];	/* gate, up (si, hidden); down (hidden, si) */
	uint16_t *d[3];
};

static void shared_make(struct shared_w *w, int hidden, int si)
{
	size_t n = (size_t)hidden * si;

	for (int j = 0; j < 3; j++) {
		w->h[j] = malloc(sizeof(uint16_t) * n);
		for (size_t i = 0; i < n; i++)
			w->h[j][i] = k_f32_to_bf16(test_randf(&seed) * 0.05f);
		w->d[j] = dup_to_device(w->h[j], sizeof(uint16_t) * n);
	}
}

static void shared_free(struct shared_w *w)
{
	for (int j = 0; j < 3; j++) {
		free(w->h[j]);
		cudaFree(w->d[j]);
	}
}

/* want (M, hidden) = y0 + (routed + shared(x)): the ops forward.c runs unfused. */
static void cpu_experts_add(const struct moe_shape *s, float *want, const float *y0, const float *x,
			    int M, const int32_t *ids, const float *wts, const struct k_expert *ex,
			    const struct shared_w *sw, int si)
{
	size_t nx = (size_t)M * s->hidden, ni = (size_t)M * (si > 0 ? si : 1);
	float *mlp = malloc(sizeof(float) * nx), *down = malloc(sizeof(float) * nx);
	float *gate = malloc(sizeof(float) * ni), *up = malloc(sizeof(float) * ni);

	CHECK(k_cpu_moe_experts(pool, mlp, x, M, ids, wts, s->top_k, ex, s->n_experts, K_BF16,
				s->hidden, s->inter) == 0, "cpu experts");
	if (si > 0) {
		k_cpu_linear(pool, gate, x, sw->h[0], K_BF16, M, si, s->hidden);
		k_cpu_linear(pool, up, x, sw->h[1], K_BF16, M, si, s->hidden);
		k_cpu_silu_mul(gate, gate, up, ni);
		k_cpu_linear(pool, down, gate, sw->h[2], K_BF16, M, s->hidden, si);
		k_cpu_add(mlp, down, nx);
	}
	memcpy(want, y0, sizeof(float) * nx);
	k_cpu_add(want, mlp, nx);
	free(mlp);
	free(down);
	free(gate);
	free(up);
}

/* k_cuda_moe_experts_add at M rows; fused 0: the call must decline (1), y untouched. */
/* One experts_add case: random x (M, hidden) and residual y0, routing by case_routing
 * (host and device copies), freed by ex_case_free. */
struct ex_case {
	size_t nx, nk;
	float *x, *y0, *wts, *cpu_wts;		/* host */
	int32_t *ids, *cpu_ids;
	struct k_expert *ex;
	const uint16_t **table;
	unsigned char *used;
	float *dx, *dw;				/* device */
	int32_t *dids;
	void *dtable;
};

static void ex_case_make(struct ex_case *c, const struct moe_shape *s, struct weights *w, int M,
			 int flags)
{
	c->nx = (size_t)M * s->hidden;
	c->nk = (size_t)M * s->top_k;
	c->x = malloc(sizeof(float) * c->nx);
	c->y0 = malloc(sizeof(float) * c->nx);
	c->wts = malloc(sizeof(float) * c->nk);
	c->cpu_wts = malloc(sizeof(float) * c->nk);
	c->ids = malloc(sizeof(int32_t) * c->nk);
	c->cpu_ids = malloc(sizeof(int32_t) * c->nk);
	c->ex = calloc((size_t)s->n_experts, sizeof(*c->ex));
	c->table = calloc((size_t)s->n_experts * 3, sizeof(*c->table));
	c->used = calloc((size_t)s->n_experts, 1);
	for (size_t i = 0; i < c->nx; i++) {
		c->x[i] = test_randf(&seed) * 2;
		c->y0[i] = test_randf(&seed) * 4;
	}
	case_routing(s, w, M, -1, flags, c->ids, c->wts, c->cpu_ids, c->cpu_wts, c->ex, c->table,
		     c->used);
	c->dtable = dup_to_device(c->table, sizeof(*c->table) * (size_t)s->n_experts * 3);
	c->dx = dup_to_device(c->x, sizeof(float) * c->nx);
	c->dw = dup_to_device(c->wts, sizeof(float) * c->nk);
	c->dids = dup_to_device(c->ids, sizeof(int32_t) * c->nk);
}

static void ex_case_free(struct ex_case *c)
{
	cudaFree(c->dtable);
	cudaFree(c->dx);
	cudaFree(c->dw);
	cudaFree(c->dids);
	free(c->x);
	free(c->y0);
	free(c->wts);
	free(c->cpu_wts);
	free(c->ids);
	free(c->cpu_ids);
	free(c->ex);
	free(c->table);
	free(c->used);
}

static void test_experts_add(const struct moe_shape *s, struct weights *w,
			     const struct shared_w *sw, int si, struct k_cuda_moe_ws *ws, int M,
			     int flags, enum k_cuda_moe_path path, int fused)
{
	struct ex_case c;
	struct k_cuda_moe_shared sh = { sw->d[0], sw->d[1], sw->d[2], si };
	double num = 0, den = 0, rel;
	float *want, *got, *dy;
	int ret, bad = 0, moved = 0;
	char shape[112];

	ex_case_make(&c, s, w, M, flags);
	want = malloc(sizeof(float) * c.nx);
	got = malloc(sizeof(float) * c.nx);
	cpu_experts_add(s, want, c.y0, c.x, M, c.cpu_ids, c.cpu_wts, c.ex, sw, si);
	dy = dup_to_device(c.y0, sizeof(float) * c.nx);
	moe_set_path(path);
	ret = k_cuda_moe_experts_add(stream, ws, dy, c.dx, M, c.dids, c.dw, s->top_k,
				     (const uint16_t *const *)c.dtable, s->n_experts, s->hidden,
				     s->inter, si > 0 ? &sh : NULL);
	to_host(got, dy, sizeof(float) * c.nx);
	dump_floats(got, c.nx);
	for (size_t i = 0; i < c.nx; i++) {
		double d = (double)got[i] - want[i], m = (double)want[i] - c.y0[i];

		num += d * d;
		den += m * m;
		bad |= got[i] != got[i];
		moved |= memcmp(&got[i], &c.y0[i], sizeof(float)) != 0;
	}
	rel = den > 0 ? sqrt(num / den) : sqrt(num);
	snprintf(shape, sizeof(shape), "%s shared %d M %d%s%s", s->name, si, M,
		 flags & EX_DUP ? " dup" : "", flags & EX_BAD_ID ? " bad-id" : "");
	if (fused) {
		printf("%-12s %-7s %-62s rel_l2 %.3g%s  %s\n", "experts_add", moe_path_name(path), shape,
		       rel, bad ? "  NaN" : "", ret == 0 && !bad && rel <= EXPERT_TOL ? "PASS" : "FAIL");
		CHECK(ret == 0 && !bad && rel <= EXPERT_TOL, "%s: ret %d rel %.3g", shape, ret, rel);
	} else {
		printf("%-12s %-7s %-62s declined %s\n", "experts_add", moe_path_name(path), shape,
		       ret == 1 && !moved ? "PASS" : "FAIL");
		CHECK(ret == 1 && !moved, "%s: ret %d, y %s", shape, ret, moved ? "changed" : "kept");
	}
	cudaFree(dy);
	free(want);
	free(got);
	ex_case_free(&c);
}

/* One row (M = 1) on the small path, moe_small_m1.cu's kernels against the general
 * ones (the tuning's moe_m1): the same bits from k_cuda_moe_experts (add 0, output
 * poisoned first) and from k_cuda_moe_experts_add (shared expert si, residual y0). */
static void test_m1_bits(const struct moe_shape *s, struct weights *w, const struct shared_w *sw,
			 int si, struct k_cuda_moe_ws *ws, int flags)
{
	struct ex_case c;
	struct k_cuda_moe_shared sh = { sw->d[0], sw->d[1], sw->d[2], si };
	float *got[2][2], *dy;
	int ret = 0, diff[2] = { 0, 0 };
	size_t nx;

	ex_case_make(&c, s, w, 1, flags);
	nx = c.nx;
	dy = dalloc(sizeof(float) * nx);
	moe_set_path(K_CUDA_MOE_PATH_SMALL);
	for (int m1 = 0; m1 < 2; m1++) {
		moe_set_m1(m1);
		got[m1][0] = malloc(sizeof(float) * nx);
		got[m1][1] = malloc(sizeof(float) * nx);
		CU(cudaMemset(dy, 0xff, sizeof(float) * nx));
		ret |= k_cuda_moe_experts(stream, ws, dy, c.dx, 1, c.dids, c.dw, s->top_k,
					  (const uint16_t *const *)c.dtable, s->n_experts, s->hidden,
					  s->inter);
		to_host(got[m1][0], dy, sizeof(float) * nx);
		CU(cudaMemcpy(dy, c.y0, sizeof(float) * nx, cudaMemcpyHostToDevice));
		ret |= k_cuda_moe_experts_add(stream, ws, dy, c.dx, 1, c.dids, c.dw, s->top_k,
					      (const uint16_t *const *)c.dtable, s->n_experts,
					      s->hidden, s->inter, si > 0 ? &sh : NULL);
		to_host(got[m1][1], dy, sizeof(float) * nx);
	}
	moe_set_m1(-1);
	for (int op = 0; op < 2; op++)
		for (size_t i = 0; i < nx; i++)
			/* finite too: both outputs start as NaN, so two kernels that wrote
			 * nothing would have the same bits */
			diff[op] += !test_same_floats(&got[0][op][i], &got[1][op][i], 1);
	printf("%-12s %-34s shared %4d%s%s  experts: %d of %zu differ, experts_add: %d  %s\n",
	       "m1 bits", s->name, si, flags & EX_DUP ? " dup" : "", flags & EX_BAD_ID ? " bad-id" : "",
	       diff[0], nx, diff[1], ret == 0 && !diff[0] && !diff[1] ? "PASS" : "FAIL");
	CHECK(ret == 0 && !diff[0] && !diff[1], "m1 bits %s shared %d: ret %d, %d and %d differ",
	      s->name, si, ret, diff[0], diff[1]);
	for (int m1 = 0; m1 < 2; m1++) {
		free(got[m1][0]);
		free(got[m1][1]);
	}
	cudaFree(dy);
	ex_case_free(&c);
}

/* The fused experts + shared + residual at one shape (si 0: no shared expert). */
static void test_experts_add_shape(const struct moe_shape *s, int si)
{
	struct k_cuda_moe_ws *ws;
	struct shared_w sw;
	struct weights w;
	int most = 64 / s->top_k;	/* rows the small path takes */
	int ret = k_cuda_moe_ws_create(&ws, 130, s->top_k, s->n_experts, s->hidden, s->inter, si);

	CHECK(ret == 0, "ws create %d", ret);
	if (ret)
		return;
	weights_make(&w, s);
	shared_make(&sw, s->hidden, si > 0 ? si : 8);
	for (int m = 0; m < 4; m++) {
		int M = (int[]){ 1, 2, 5, most }[m];

		test_experts_add(s, &w, &sw, si, ws, M, 0, K_CUDA_MOE_PATH_SMALL, 1);
	}
	moe_set_m1(0);	/* M = 1 above took moe_small_m1.cu's kernels */
	printf("(general kernels at M 1)\n");
	test_experts_add(s, &w, &sw, si, ws, 1, 0, K_CUDA_MOE_PATH_SMALL, 1);
	moe_set_m1(-1);
	test_m1_bits(s, &w, &sw, si, ws, 0);
	test_m1_bits(s, &w, &sw, si, ws, EX_DUP | EX_BAD_ID);
	test_experts_add(s, &w, &sw, si, ws, most > 3 ? 3 : 1, EX_DUP | EX_BAD_ID,
			 K_CUDA_MOE_PATH_SMALL, 1);
	test_experts_add(s, &w, &sw, si, ws, 1, 0, K_CUDA_MOE_PATH_GROUPED, 0);
	test_experts_add(s, &w, &sw, si, ws, most + 1, 0, K_CUDA_MOE_PATH_AUTO, 0);
	/* auto: 64 rows are past the small path's share (64 pairs) at any top_k > 1 */
	if (s->top_k > 1)	/* at top_k 1, 64 rows are the small path's own (above) */
		test_experts_add(s, &w, &sw, si, ws, 64, 0, K_CUDA_MOE_PATH_AUTO, 0);
	if (si > 0) {	/* wider than the workspace was made for */
		struct k_cuda_moe_shared sh = { sw.d[0], sw.d[1], sw.d[2], si + 8 };

		CHECK(k_cuda_moe_experts_add(stream, ws, NULL, NULL, 1, NULL, NULL, s->top_k, NULL,
					     s->n_experts, s->hidden, s->inter, &sh) == -EINVAL,
		      "shared wider than the workspace");
	}
	shared_free(&sw);
	weights_free(&w);
	k_cuda_moe_ws_destroy(ws);
}

/* Every path at one shape; M > 130 is refused. */
static void test_experts_shape(const struct moe_shape *s)
{
	const enum k_cuda_moe_path paths[] = { K_CUDA_MOE_PATH_SMALL, K_CUDA_MOE_PATH_GROUPED };
	struct k_cuda_moe_ws *ws;
	struct weights w;
	int ret = k_cuda_moe_ws_create(&ws, 130, s->top_k, s->n_experts, s->hidden, s->inter, 0);

	CHECK(ret == 0, "ws create %d", ret);
	if (ret)
		return;
	weights_make(&w, s);
	for (int pi = 0; pi < 3; pi++) {	/* small, small with M 1 on the general kernels,
						 * grouped */
		enum k_cuda_moe_path path = paths[pi > 0 ? pi - 1 : 0];

		moe_set_m1(pi != 1);
		for (int m = 0; m < 4; m++)
			test_experts(s, &w, ws, (int[]){ 1, 2, 3, 8 }[m], -1, 0, path);
		test_experts(s, &w, ws, 8, 3, EX_DUP, path);	/* 9 pairs on expert 3 */
		test_experts(s, &w, ws, 1, -1, EX_BAD_ID, path);
		test_experts(s, &w, ws, 3, 2, EX_BAD_ID | EX_DUP, path);
	}
	moe_set_m1(-1);
	/* the grouped path on moe_qtile.cu's tile kernels where they take the shape (" qtile"
	 * in the line: V2-Lite's and Qwen3's; the odd ones keep expert_mma_kernel) */
	moe_set_qtile(130);
	for (int v = 0; v < 3; v++) {	/* 16 rows a pass in one CTA, wide, 16 over 3 CTAs */
		const int wide = v == 1;

		moe_set_qtile_wide(wide);
		moe_set_qtile_split(v == 2 ? 3 : v == 0 ? 1 : -1);
		for (int m = 0; m < 3; m++)
			test_experts(s, &w, ws, (int[]){ 2, 8, 64 }[m], -1, 0,
				     K_CUDA_MOE_PATH_GROUPED);
		test_experts(s, &w, ws, 8, 3, EX_DUP, K_CUDA_MOE_PATH_GROUPED);
		test_experts(s, &w, ws, 3, 2, EX_BAD_ID | EX_DUP, K_CUDA_MOE_PATH_GROUPED);
		/* narrow: 4 passes of 16; wide: one of 64, then 64, 64 and 2; split: 9 of
		 * 16 (the last 2 rows), 3 a CTA */
		test_experts(s, &w, ws, 64, 3, 0, K_CUDA_MOE_PATH_GROUPED);
		if (v)
			test_experts(s, &w, ws, 130, 3, 0, K_CUDA_MOE_PATH_GROUPED);
	}
	moe_set_qtile_split(-1);
	moe_set_qtile_wide(-1);
	moe_set_qtile(-1);
	/* auto: small at 5 rows (up to 64 pairs), grouped at 64 */
	test_experts(s, &w, ws, 5, -1, 0, K_CUDA_MOE_PATH_AUTO);
	test_experts(s, &w, ws, 64, -1, 0, K_CUDA_MOE_PATH_AUTO);
	test_experts(s, &w, ws, 64, 3, 0, K_CUDA_MOE_PATH_AUTO);
	if (s->hidden < 200)	/* more than one 64-row pass; small: the CPU is slow */
		test_experts(s, &w, ws, 130, 1, EX_BAD_ID, K_CUDA_MOE_PATH_AUTO);
	CHECK(k_cuda_moe_experts(stream, ws, NULL, NULL, 131, NULL, NULL, s->top_k, NULL,
				 s->n_experts, s->hidden, s->inter) == -EINVAL, "M > max_M");
	weights_free(&w);
	k_cuda_moe_ws_destroy(ws);
}

static void test_experts_all(void)
{
	const struct moe_shape shapes[] = {
		{ "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 },
		{ "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 },
		{ "tiny 40x24 E5 k2", 40, 24, 5, 2 },
		{ "odd 136x56 E7 k3", 136, 56, 7, 3 },
		{ "wide 2304x2568 E6 k2", 2304, 2568, 6, 2 },	/* past one 2048 batch */
		{ "fallback 30x13 E4 k2", 30, 13, 4, 2 },
	};

	const struct {
		struct moe_shape s;
		int shared;
	} fused[] = {
		{ { "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 }, 2816 },
		{ { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 }, 0 },
		{ { "odd 136x56 E7 k3", 136, 56, 7, 3 }, 96 },		/* pieces 56 + 40 */
		{ { "tiny 40x24 E5 k2", 40, 24, 5, 2 }, 72 },		/* 3 pieces */
		{ { "wide 2304x2568 E6 k2", 2304, 2568, 6, 2 }, 2 * 2568 },
		{ { "k1 64x40 E4 k1", 64, 40, 4, 1 }, 160 },		/* 4 pieces, 64 rows */
	};

	for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++)
		test_experts_shape(&shapes[si]);
	for (size_t si = 0; si < sizeof(fused) / sizeof(fused[0]); si++)
		test_experts_add_shape(&fused[si].s, fused[si].shared);
	moe_set_path(K_CUDA_MOE_PATH_AUTO);
}

int main(void)
{
	const char *part;

	if (!test_gpu_present("test_cuda_moe"))
		return 77;
	if (test_tuning_env("test_cuda_moe"))	/* KDEC_MOE_ROUTE_REG=0: the other form */
		return 1;
	part = test_part("test_cuda_moe", "route", "experts");
	if (getenv("KD_TEST_DUMP") && !(dump = fopen(getenv("KD_TEST_DUMP"), "wb"))) {
		fprintf(stderr, "test_cuda_moe: KD_TEST_DUMP %s: cannot open\n", getenv("KD_TEST_DUMP"));
		return 1;
	}
	CU(cudaStreamCreate(&stream));
	if (k_pool_create(&pool, 16))
		return 1;
	if (test_part_runs(part, "route"))
		test_route_all();
	if (test_part_runs(part, "experts"))
		test_experts_all();
	k_pool_destroy(pool);
	cudaStreamDestroy(stream);
	if (dump)
		fclose(dump);
	return test_result("test_cuda_moe");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_moe: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
