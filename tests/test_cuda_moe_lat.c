/* The latency path's MoE layer (k_cuda_moe_lat: router + routing + gate/up in one
 * launch with a grid barrier, down + combine + shared expert + residual in a second)
 * against the CPU reference, at the shapes of every MoE model kdec supports:
 * Qwen3-30B-A3B (128 experts, top 8, softmax), DeepSeek-V2-Lite (64, top 6, shared
 * 2816), DeepSeek-V3 (256, top 8, sigmoid, 8 groups keep 4, bias, scaling 2.5, shared
 * 2048) and Kimi-K2 (384, top 8, one group, bias, scaling 2.827), hidden 2048 / 7168,
 * at M 1, 2, 5 and 8, on random inputs (x, residual, router, experts).
 * - logits: against k_cpu_linear of the same x and router, rel L2 <= 1e-5 (fp32
 *   accumulation in another order);
 * - ids: k_cpu_moe_route run on the kernel's own logits must choose exactly the same
 *   ids, and give the same weights within 1e-6 (the router is meant to be bit-exact);
 * - y: against y0 + k_cpu_moe_experts + the shared SwiGLU MLP (forward.c's unfused
 *   ops) with those ids, rel L2 <= 1e-4 of the MLP's part (bf16 weights, fp32 x and
 *   activations, fp32 accumulation: ~1e-6 expected);
 * - the standard path's kernels must give the same bits: its router (the GEMV that
 *   linear_fp32x runs) the same logits, then k_cuda_moe_route and
 *   k_cuda_moe_experts_add on them the same y;
 * - 40 calls in a row (the barrier's words reused, as graph replays reuse them) give
 *   the first call's y bit for bit;
 * M 1 takes the single-row gate/up (moe_small_m1.cuh), the others the general one.
 * - 9 rows (past K_CUDA_MOE_LAT_MAX_ROWS) declines (1) and leaves y as it was.
 * Experts nobody chose point at NaN weights, so reading one fails. Skips (77) without
 * CUDA or a GPU. The timings: tests/bench/bench_cuda_moe ("moe_lat" lines).
 * KD_TEST_QUICK=1 (compute-sanitizer's racecheck, whose cost grows with every shared
 * memory access: the full shapes took 380 s for 5 cases): each model's routing as it is
 * (experts, top-k, groups, bias: the same warp picks and plans), hidden 512, expert and
 * shared widths 128 and 256, M 1, 2 and 8 (the single-row and general gate/up, the most
 * rows), 3 repeats. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "tests/cudatest.h"

#define LOGIT_TOL 1e-5
#define W_TOL 1e-6
#define Y_TOL 1e-4
#define N_SETS 2		/* distinct expert weight sets; expert e uses set e % N_SETS */
#define REPEATS 40
#define QUICK_REPEATS 3

static unsigned long long seed = 0x1a7e5c7ull;
static cudaStream_t stream;
static struct k_pool *pool;
static struct k_cuda_linear *lin;
static int repeats = REPEATS;	/* QUICK_REPEATS under KD_TEST_QUICK */

struct lat_model {
	const char *name;
	int hidden, inter, n_experts, top_k, shared;
	struct k_moe_route_params p;
};

/* The weights of one model's layer, host and device. */
struct lat_weights {
	uint16_t *h_router, *d_router;
	uint16_t *h[N_SETS][3], *d[N_SETS][3];
	uint16_t *h_sh[3], *d_sh[3];
	uint16_t *nan;
	float *h_bias, *d_bias;
};

static uint16_t *rand_bf16(size_t n, float amp)
{
	uint16_t *v = malloc(sizeof(uint16_t) * n);

	for (size_t i = 0; i < n; i++)
		v[i] = k_f32_to_bf16(test_randf(&seed) * amp);
	return v;
}

static void weights_make(struct lat_weights *w, const struct lat_model *s)
{
	size_t ne = (size_t)s->hidden * s->inter, ns = (size_t)s->hidden * s->shared;
	size_t big = ne > ns ? ne : ns;
	float amp = 1.0f / sqrtf((float)s->hidden);
	uint16_t *nan = malloc(sizeof(uint16_t) * big);

	memset(w, 0, sizeof(*w));
	w->h_router = rand_bf16((size_t)s->n_experts * s->hidden, amp);
	w->d_router = dup_to_device(w->h_router, sizeof(uint16_t) * s->n_experts * s->hidden);
	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			w->h[k][j] = rand_bf16(ne, j == 2 ? 1.0f / sqrtf((float)s->inter) : amp);
			w->d[k][j] = dup_to_device(w->h[k][j], sizeof(uint16_t) * ne);
		}
	for (int j = 0; s->shared && j < 3; j++) {
		w->h_sh[j] = rand_bf16(ns, j == 2 ? 1.0f / sqrtf((float)s->shared) : amp);
		w->d_sh[j] = dup_to_device(w->h_sh[j], sizeof(uint16_t) * ns);
	}
	for (size_t i = 0; i < big; i++)
		nan[i] = 0x7fc0;
	w->nan = dup_to_device(nan, sizeof(uint16_t) * big);
	free(nan);
	if (s->p.bias || s->p.scoring == K_MOE_SIGMOID) {
		w->h_bias = malloc(sizeof(float) * s->n_experts);
		for (int e = 0; e < s->n_experts; e++)
			w->h_bias[e] = test_randf(&seed) * 0.05f;
		w->d_bias = dup_to_device(w->h_bias, sizeof(float) * s->n_experts);
	}
}

static void weights_free(struct lat_weights *w)
{
	free(w->h_router);
	cudaFree(w->d_router);
	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			free(w->h[k][j]);
			cudaFree(w->d[k][j]);
		}
	for (int j = 0; j < 3; j++) {
		free(w->h_sh[j]);
		cudaFree(w->d_sh[j]);
	}
	cudaFree(w->nan);
	free(w->h_bias);
	cudaFree(w->d_bias);
}

static double rel_l2(const float *got, const float *want, const float *base, size_t n)
{
	double num = 0, den = 0;

	for (size_t i = 0; i < n; i++) {
		double d = (double)got[i] - want[i], r = (double)want[i] - (base ? base[i] : 0);

		num += d * d;
		den += r * r;
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* want = y0 + routed experts (ids, wts) + shared MLP of x: forward.c's unfused ops. */
static void cpu_layer(const struct lat_model *s, const struct lat_weights *w, float *want,
		      const float *y0, const float *x, int M, const int32_t *ids, const float *wts)
{
	size_t nx = (size_t)M * s->hidden, ni = (size_t)M * (s->shared ? s->shared : 1);
	float *mlp = malloc(sizeof(float) * nx), *down = malloc(sizeof(float) * nx);
	float *gate = malloc(sizeof(float) * ni), *up = malloc(sizeof(float) * ni);
	struct k_expert *ex = malloc(sizeof(*ex) * s->n_experts);

	for (int e = 0; e < s->n_experts; e++)
		ex[e] = (struct k_expert){ .gate = w->h[e % N_SETS][0], .up = w->h[e % N_SETS][1],
					   .down = w->h[e % N_SETS][2] };
	CHECK(k_cpu_moe_experts(pool, mlp, x, M, ids, wts, s->top_k, ex, s->n_experts, K_BF16,
				s->hidden, s->inter) == 0, "cpu experts");
	if (s->shared) {
		k_cpu_linear(pool, gate, x, w->h_sh[0], K_BF16, M, s->shared, s->hidden);
		k_cpu_linear(pool, up, x, w->h_sh[1], K_BF16, M, s->shared, s->hidden);
		k_cpu_silu_mul(gate, gate, up, ni);
		k_cpu_linear(pool, down, gate, w->h_sh[2], K_BF16, M, s->hidden, s->shared);
		k_cpu_add(mlp, down, nx);
	}
	memcpy(want, y0, sizeof(float) * nx);
	k_cpu_add(want, mlp, nx);
	free(mlp);
	free(down);
	free(gate);
	free(up);
	free(ex);
}

/* The device expert table: only the experts the CPU chose (want_ids) get their weights,
 * the others NaN, so a kernel that reads an expert it should not fails. */
static const uint16_t **table_for(const struct lat_model *s, const struct lat_weights *w,
				  const int32_t *ids, int n)
{
	const uint16_t **t = calloc((size_t)s->n_experts * 3, sizeof(*t));
	unsigned char *used = calloc((size_t)s->n_experts, 1);

	for (int i = 0; i < n; i++)
		used[ids[i]] = 1;
	for (int e = 0; e < s->n_experts; e++)
		for (int j = 0; j < 3; j++)
			t[3 * e + j] = used[e] ? w->d[e % N_SETS][j] : w->nan;
	free(used);
	return t;
}

struct lat_dev {
	float *x, *y, *logits, *logits2, *wts, *wts2, *y2;
	int32_t *ids, *ids2;
	const uint16_t **table;
};

/* The kernel's call, with the shared expert where the model has one. */
static int lat_call(const struct lat_model *s, const struct lat_weights *w,
		    struct k_cuda_moe_ws *ws, const struct lat_dev *d, float *y, int M)
{
	struct k_cuda_moe_shared sh = { w->d_sh[0], w->d_sh[1], w->d_sh[2], s->shared };
	struct k_moe_route_params p = s->p;

	p.bias = w->d_bias;
	return k_cuda_moe_lat(stream, ws, y, d->x, M, w->d_router, &p, d->logits, d->ids, d->wts,
			      (const uint16_t *const *)d->table, NULL, s->n_experts, s->hidden,
			      s->inter, s->shared ? &sh : NULL);
}

static void test_case(const struct lat_model *s, const struct lat_weights *w,
		      struct k_cuda_moe_ws *ws, int M)
{
	size_t nx = (size_t)M * s->hidden, nl = (size_t)M * s->n_experts, nk = (size_t)M * s->top_k;
	float *x = malloc(sizeof(float) * nx), *y0 = malloc(sizeof(float) * nx);
	float *want = malloc(sizeof(float) * nx), *got = malloc(sizeof(float) * nx);
	float *got2 = malloc(sizeof(float) * nx), *lg = malloc(sizeof(float) * nl);
	float *lg_cpu = malloc(sizeof(float) * nl), *wts = malloc(sizeof(float) * nk);
	float *wts_cpu = malloc(sizeof(float) * nk);
	int32_t *ids = malloc(sizeof(int32_t) * nk), *ids_cpu = malloc(sizeof(int32_t) * nk);
	struct k_moe_route_params pc = s->p, pd = s->p;
	struct k_cuda_moe_shared sh = { w->d_sh[0], w->d_sh[1], w->d_sh[2], s->shared };
	struct lat_dev d = { 0 };
	const uint16_t **table;
	double e_lg, e_y, max_w = 0;
	int id_bad = 0, ret, same_std, same_lg, same_rep = 1, ok;

	for (size_t i = 0; i < nx; i++) {
		x[i] = test_randf(&seed);
		y0[i] = test_randf(&seed);
	}
	pc.bias = w->h_bias;
	pd.bias = w->d_bias;
	/* the CPU's choice from the CPU's logits picks the experts the table gets */
	k_cpu_linear(pool, lg_cpu, x, w->h_router, K_BF16, M, s->n_experts, s->hidden);
	k_cpu_moe_route(&pc, lg_cpu, M, ids_cpu, wts_cpu);
	table = table_for(s, w, ids_cpu, (int)nk);
	d.x = dup_to_device(x, sizeof(float) * nx);
	d.y = dup_to_device(y0, sizeof(float) * nx);
	d.y2 = dup_to_device(y0, sizeof(float) * nx);
	d.logits = dalloc(sizeof(float) * nl);
	d.logits2 = dalloc(sizeof(float) * nl);
	d.ids = dalloc(sizeof(int32_t) * nk);
	d.ids2 = dalloc(sizeof(int32_t) * nk);
	d.wts = dalloc(sizeof(float) * nk);
	d.wts2 = dalloc(sizeof(float) * nk);
	d.table = dup_to_device(table, sizeof(*table) * 3 * s->n_experts);

	ret = lat_call(s, w, ws, &d, d.y, M);
	CHECK(ret == 0, "%s M %d: k_cuda_moe_lat returned %d", s->name, M, ret);
	CU(cudaStreamSynchronize(stream));
	to_host(lg, d.logits, sizeof(float) * nl);
	to_host(ids, d.ids, sizeof(int32_t) * nk);
	to_host(wts, d.wts, sizeof(float) * nk);
	to_host(got, d.y, sizeof(float) * nx);

	/* the reference, routed from the kernel's own logits */
	e_lg = rel_l2(lg, lg_cpu, NULL, nl);
	k_cpu_moe_route(&pc, lg, M, ids_cpu, wts_cpu);
	for (size_t i = 0; i < nk; i++) {
		double dw = fabs((double)wts[i] - wts_cpu[i]);

		id_bad += ids[i] != ids_cpu[i];
		if (!(dw <= max_w))
			max_w = dw;
	}
	cpu_layer(s, w, want, y0, x, M, ids_cpu, wts_cpu);
	e_y = rel_l2(got, want, y0, nx);

	/* the standard path's kernels: the same bits */
	ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, d.logits2, d.x, w->d_router, M,
				     s->n_experts, s->hidden, 0);
	CU(cudaStreamSynchronize(stream));
	to_host(lg_cpu, d.logits2, sizeof(float) * nl);
	same_lg = ret == 0 && !memcmp(lg, lg_cpu, sizeof(float) * nl);
	if (!ret)
		ret = k_cuda_moe_route(stream, &pd, d.logits2, M, d.ids2, d.wts2);
	if (!ret)
		ret = k_cuda_moe_experts_add(stream, ws, d.y2, d.x, M, d.ids2, d.wts2, s->top_k,
					     (const uint16_t *const *)d.table, s->n_experts,
					     s->hidden, s->inter, s->shared ? &sh : NULL);
	CHECK(ret == 0, "%s M %d: the standard kernels returned %d", s->name, M, ret);
	CU(cudaStreamSynchronize(stream));
	to_host(got2, d.y2, sizeof(float) * nx);
	same_std = !memcmp(got, got2, sizeof(float) * nx);

	/* many calls: the barrier's words come back ready each time */
	for (int r = 0; r < repeats && same_rep; r++) {
		CU(cudaMemcpy(d.y2, y0, sizeof(float) * nx, cudaMemcpyHostToDevice));
		ret = lat_call(s, w, ws, &d, d.y2, M);
		CU(cudaStreamSynchronize(stream));
		to_host(got2, d.y2, sizeof(float) * nx);
		same_rep = ret == 0 && !memcmp(got, got2, sizeof(float) * nx);
	}
	ok = e_lg <= LOGIT_TOL && !id_bad && max_w <= W_TOL && e_y <= Y_TOL && same_std &&
	     same_lg && same_rep;
	printf("%-10s %-18s M %d  logits %.2g  ids differ %d  weights %.2g  y rel_l2 %.3g  "
	       "standard: logits %s, y %s  %d repeats %s  %s\n", "moe_lat", s->name, M, e_lg, id_bad,
	       max_w, e_y, same_lg ? "same bits" : "DIFFER", same_std ? "same bits" : "DIFFER",
	       repeats, same_rep ? "same" : "DIFFER", ok ? "PASS" : "FAIL");
	CHECK(e_lg <= LOGIT_TOL, "%s M %d: logits rel L2 %.3g", s->name, M, e_lg);
	CHECK(!id_bad && max_w <= W_TOL, "%s M %d: %d ids differ, weights %.3g", s->name, M,
	      id_bad, max_w);
	CHECK(e_y <= Y_TOL, "%s M %d: y rel L2 %.3g", s->name, M, e_y);
	CHECK(same_std, "%s M %d: y differs from the standard path's kernels", s->name, M);
	CHECK(same_lg, "%s M %d: logits differ from the standard router GEMV's", s->name, M);
	CHECK(same_rep, "%s M %d: a repeated call gave another y", s->name, M);

	cudaFree(d.x);
	cudaFree(d.y);
	cudaFree(d.y2);
	cudaFree(d.logits);
	cudaFree(d.logits2);
	cudaFree(d.ids);
	cudaFree(d.ids2);
	cudaFree(d.wts);
	cudaFree(d.wts2);
	cudaFree((void *)d.table);
	free((void *)table);
	free(x);
	free(y0);
	free(want);
	free(got);
	free(got2);
	free(lg);
	free(lg_cpu);
	free(wts);
	free(wts_cpu);
	free(ids);
	free(ids_cpu);
}

/* Past the rows it takes: 1, nothing launched, y untouched. */
static void test_decline(const struct lat_model *s, const struct lat_weights *w,
			 struct k_cuda_moe_ws *ws)
{
	int M = K_CUDA_MOE_LAT_MAX_ROWS + 1, ret, same;
	size_t nx = (size_t)M * s->hidden;
	float *y0 = malloc(sizeof(float) * nx), *got = malloc(sizeof(float) * nx);
	struct lat_dev d = { 0 };

	for (size_t i = 0; i < nx; i++)
		y0[i] = test_randf(&seed);
	d.x = dup_to_device(y0, sizeof(float) * nx);
	d.y = dup_to_device(y0, sizeof(float) * nx);
	d.logits = dalloc(sizeof(float) * M * s->n_experts);
	d.ids = dalloc(sizeof(int32_t) * M * s->top_k);
	d.wts = dalloc(sizeof(float) * M * s->top_k);
	d.table = dalloc(sizeof(void *) * 3 * s->n_experts);
	ret = lat_call(s, w, ws, &d, d.y, M);
	CU(cudaStreamSynchronize(stream));
	to_host(got, d.y, sizeof(float) * nx);
	same = !memcmp(got, y0, sizeof(float) * nx);
	printf("%-10s %-18s M %d  declined %d, y %s  %s\n", "moe_lat", s->name, M, ret,
	       same ? "untouched" : "WRITTEN", ret == 1 && same ? "PASS" : "FAIL");
	CHECK(ret == 1 && same, "%s M %d: returned %d, y %s", s->name, M, ret,
	      same ? "untouched" : "written");
	cudaFree(d.x);
	cudaFree(d.y);
	cudaFree(d.logits);
	cudaFree(d.ids);
	cudaFree(d.wts);
	cudaFree((void *)d.table);
	free(y0);
	free(got);
}

static const struct lat_model models[] = {
	{ "qwen3-30b-a3b", 2048, 768, 128, 8, 0,
	  { 128, 8, K_MOE_SOFTMAX, K_MOE_GREEDY, 0, 0, 1, 1.0f, NULL } },
	{ "deepseek-v2-lite", 2048, 1408, 64, 6, 2816,
	  { 64, 6, K_MOE_SOFTMAX, K_MOE_GREEDY, 1, 1, 0, 1.0f, NULL } },
	{ "deepseek-v3", 7168, 2048, 256, 8, 2048,
	  { 256, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 8, 4, 1, 2.5f, NULL } },
	{ "kimi-k2", 7168, 2048, 384, 8, 2048,
	  { 384, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 1, 1, 1, 2.827f, NULL } },
};

/* The racecheck-sized form of model m (KD_TEST_QUICK): its routing whole, its widths cut. */
static struct lat_model quick_model(const struct lat_model *m)
{
	struct lat_model q = *m;

	q.hidden = 512;
	q.inter = 128;
	q.shared = m->shared ? 256 : 0;
	return q;
}

int main(void)
{
	static const int rows[] = { 1, 2, 5, 8 }, quick_rows[] = { 1, 2, 8 };
	int quick = test_env_flag("KD_TEST_QUICK");
	const int *rs = quick ? quick_rows : rows;
	size_t n_rows = quick ? sizeof(quick_rows) / sizeof(quick_rows[0]) : sizeof(rows) / sizeof(rows[0]);

	if (!test_gpu_present("test_cuda_moe_lat"))
		return 77;
	if (quick)
		repeats = QUICK_REPEATS;
	CU(cudaStreamCreate(&stream));
	if (k_pool_create(&pool, 16))
		return 1;
	CHECK(k_cuda_linear_create(&lin, stream, K_CUDA_MOE_LAT_MAX_ROWS, 7168) == 0, "linear context");
	for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
		const struct lat_model sq = quick_model(&models[i]), *s = quick ? &sq : &models[i];
		struct k_cuda_moe_ws *ws = NULL;
		struct lat_weights w;

		weights_make(&w, s);
		CHECK(k_cuda_moe_ws_create(&ws, K_CUDA_MOE_LAT_MAX_ROWS + 1, s->top_k, s->n_experts,
					   s->hidden, s->inter, s->shared) == 0, "%s: workspace",
		      s->name);
		for (size_t r = 0; ws && r < n_rows; r++)
			test_case(s, &w, ws, rs[r]);
		if (ws)
			test_decline(s, &w, ws);
		k_cuda_moe_ws_destroy(ws);
		weights_free(&w);
	}
	k_pool_destroy(pool);
	k_cuda_linear_destroy(lin);
	cudaStreamDestroy(stream);
	return test_result("test_cuda_moe_lat");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_moe_lat: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
