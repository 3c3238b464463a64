/* The MoE router and the choice in one launch (k_cuda_moe_router) against the two
 * launches it replaces on the standard path (the router GEMV that linear_fp32x runs,
 * then k_cuda_moe_route) and against the CPU reference, at the routing of every MoE
 * model kdec supports: Qwen3-30B-A3B (128 experts, top 8, softmax), DeepSeek-V2-Lite
 * (64, top 6), DeepSeek-V3 (256, top 8, sigmoid, 8 groups keep 4, bias, scaling 2.5)
 * and Kimi-K2 (384, top 8, one group, bias, scaling 2.827), hidden 2048 / 7168, M 1, 2,
 * 3, 5 and 8, on random x, router and bias:
 * - logits, ids and weights: the standard launches' bits exactly (the fused kernel is
 *   meant to change the launch count, not one bit of the choice);
 * - the CPU: k_cpu_linear's logits within 1e-5 relative L2 (fp32 sums in another
 *   order), and k_cpu_moe_route on the kernel's own logits chooses the same ids with
 *   weights within 1e-6;
 * - a CUDA graph of the call replayed 12 times on fresh x uploaded between replays
 *   (the ticket word must come back to zero each time, as in decode): each replay's
 *   ids and weights equal the standard launches' on that x;
 * - 9 rows, and 2,048 experts (routing scratch past its shared memory), decline (1)
 *   and write nothing.
 * Skips (77) without CUDA or a GPU. */
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
#define REPLAYS 12
#define INTER 64		/* the workspace's expert width: unused by the router */

static unsigned long long seed = 0x70e7e4ull;
static cudaStream_t stream;
static struct k_pool *pool;
static struct k_cuda_linear *lin;

struct rt_model {
	const char *name;
	int hidden, n_experts, top_k;
	struct k_moe_route_params p;
};

static const struct rt_model models[] = {
	{ "qwen3-30b-a3b", 2048, 128, 8, { 128, 8, K_MOE_SOFTMAX, K_MOE_GREEDY, 0, 0, 1, 1.0f, NULL } },
	{ "deepseek-v2-lite", 2048, 64, 6, { 64, 6, K_MOE_SOFTMAX, K_MOE_GREEDY, 1, 1, 0, 1.0f, NULL } },
	{ "deepseek-v3", 7168, 256, 8,
	  { 256, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 8, 4, 1, 2.5f, NULL } },
	{ "kimi-k2", 7168, 384, 8, { 384, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 1, 1, 1, 2.827f, NULL } },
};

struct rt_dev {
	float *x, *lg, *lg2, *w, *w2;
	int32_t *ids, *ids2;
};

static uint16_t *rand_bf16(size_t n, float amp)
{
	uint16_t *v = malloc(sizeof(uint16_t) * n);

	for (size_t i = 0; i < n; i++)
		v[i] = k_f32_to_bf16(test_randf(&seed) * amp);
	return v;
}

static double rel_l2(const float *got, const float *want, size_t n)
{
	double num = 0, den = 0;

	for (size_t i = 0; i < n; i++) {
		double d = (double)got[i] - want[i];

		num += d * d;
		den += (double)want[i] * want[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The standard path's two launches into lg2 / ids2 / w2. */
static int standard(const struct rt_model *s, const struct k_moe_route_params *pd,
		    const uint16_t *d_router, const struct rt_dev *d, int M)
{
	int ret = k_cuda_linear_run_kind(lin, K_CUDA_LINEAR_GEMV, d->lg2, d->x, d_router, M,
					 s->n_experts, s->hidden, 0);

	return ret ? ret : k_cuda_moe_route(stream, pd, d->lg2, M, d->ids2, d->w2);
}

/* Whether the fused outputs equal the standard ones bit for bit (logits too if lg). */
static int same_bits(const struct rt_dev *d, int M, int E, int K, int lg)
{
	size_t nl = (size_t)M * E, nk = (size_t)M * K;
	void *a = download_bytes(d->ids, sizeof(int32_t) * nk), *b = download_bytes(d->ids2, sizeof(int32_t) * nk);
	void *c = download_bytes(d->w, sizeof(float) * nk), *e = download_bytes(d->w2, sizeof(float) * nk);
	void *f = lg ? download_bytes(d->lg, sizeof(float) * nl) : NULL;
	void *g = lg ? download_bytes(d->lg2, sizeof(float) * nl) : NULL;
	int same = !memcmp(a, b, sizeof(int32_t) * nk) && !memcmp(c, e, sizeof(float) * nk) &&
		   (!lg || !memcmp(f, g, sizeof(float) * nl));

	free(a);
	free(b);
	free(c);
	free(e);
	free(f);
	free(g);
	return same;
}

static void fill_x(float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] = test_randf(&seed);
}

static void test_case(const struct rt_model *s, const uint16_t *h_router, const uint16_t *d_router,
		      const float *h_bias, const float *d_bias, struct k_cuda_moe_ws *ws, int M)
{
	size_t nx = (size_t)M * s->hidden, nl = (size_t)M * s->n_experts, nk = (size_t)M * s->top_k;
	float *x = malloc(sizeof(float) * nx), *lg = malloc(sizeof(float) * nl);
	float *lg_cpu = malloc(sizeof(float) * nl), *w = malloc(sizeof(float) * nk);
	float *w_cpu = malloc(sizeof(float) * nk);
	int32_t *ids = malloc(sizeof(int32_t) * nk), *ids_cpu = malloc(sizeof(int32_t) * nk);
	struct k_moe_route_params pc = s->p, pd = s->p;
	struct rt_dev d;
	cudaGraph_t graph;
	cudaGraphExec_t exec;
	double e_lg, max_w = 0;
	int ret, ret2, id_bad = 0, same, same_rep = 1, r;

	pc.bias = (float *)h_bias;
	pd.bias = (float *)d_bias;
	fill_x(x, nx);
	d.x = dup_to_device(x, sizeof(float) * nx);
	d.lg = dalloc(sizeof(float) * nl);
	d.lg2 = dalloc(sizeof(float) * nl);
	d.w = dalloc(sizeof(float) * nk);
	d.w2 = dalloc(sizeof(float) * nk);
	d.ids = dalloc(sizeof(int32_t) * nk);
	d.ids2 = dalloc(sizeof(int32_t) * nk);
	poison(d.lg, sizeof(float) * nl);
	poison(d.w, sizeof(float) * nk);
	poison(d.ids, sizeof(int32_t) * nk);

	ret = k_cuda_moe_router(stream, ws, d.x, M, d_router, s->hidden, &pd, d.lg, d.ids, d.w);
	ret2 = standard(s, &pd, d_router, &d, M);
	CU(cudaStreamSynchronize(stream));
	CHECK(ret == 0 && ret2 == 0, "%s M %d: fused %d, standard %d", s->name, M, ret, ret2);
	same = same_bits(&d, M, s->n_experts, s->top_k, 1);

	/* the CPU: logits, then its choice on the kernel's logits */
	to_host(lg, d.lg, sizeof(float) * nl);
	to_host(ids, d.ids, sizeof(int32_t) * nk);
	to_host(w, d.w, sizeof(float) * nk);
	k_cpu_linear(pool, lg_cpu, x, h_router, K_BF16, M, s->n_experts, s->hidden);
	e_lg = rel_l2(lg, lg_cpu, nl);
	k_cpu_moe_route(&pc, lg, M, ids_cpu, w_cpu);
	for (size_t i = 0; i < nk; i++) {
		double dw = fabs((double)w[i] - w_cpu[i]);

		id_bad += ids[i] != ids_cpu[i];
		if (!(dw <= max_w))
			max_w = dw;
	}

	/* graph replays on fresh x, as decode steps */
	CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
	ret = k_cuda_moe_router(stream, ws, d.x, M, d_router, s->hidden, &pd, d.lg, d.ids, d.w);
	CU(cudaStreamEndCapture(stream, &graph));
	CHECK(ret == 0, "%s M %d: captured call returned %d", s->name, M, ret);
	CU(cudaGraphInstantiate(&exec, graph, 0));
	for (r = 0; r < REPLAYS && same_rep; r++) {
		fill_x(x, nx);
		CU(cudaMemcpy(d.x, x, sizeof(float) * nx, cudaMemcpyHostToDevice));
		poison(d.ids, sizeof(int32_t) * nk);
		CU(cudaGraphLaunch(exec, stream));
		ret2 = standard(s, &pd, d_router, &d, M);
		CU(cudaStreamSynchronize(stream));
		same_rep = ret2 == 0 && same_bits(&d, M, s->n_experts, s->top_k, 1);
	}
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);

	printf("moe_router %-17s M %d  standard: %s  logits vs cpu %.2g  ids differ %d  "
	       "weights %.2g  %d graph replays %s  %s\n", s->name, M, same ? "same bits" : "DIFFER",
	       e_lg, id_bad, max_w, r, same_rep ? "same" : "DIFFER",
	       same && e_lg <= LOGIT_TOL && !id_bad && max_w <= W_TOL && same_rep ? "PASS" : "FAIL");
	CHECK(same, "%s M %d: logits, ids or weights differ from the standard launches'", s->name, M);
	CHECK(e_lg <= LOGIT_TOL, "%s M %d: logits rel L2 %.3g against the CPU", s->name, M, e_lg);
	CHECK(!id_bad && max_w <= W_TOL, "%s M %d: %d ids differ from the CPU's choice, weights %.3g",
	      s->name, M, id_bad, max_w);
	CHECK(same_rep, "%s M %d: graph replay %d differs from the standard launches", s->name, M, r);

	cudaFree(d.x);
	cudaFree(d.lg);
	cudaFree(d.lg2);
	cudaFree(d.w);
	cudaFree(d.w2);
	cudaFree(d.ids);
	cudaFree(d.ids2);
	free(x);
	free(lg);
	free(lg_cpu);
	free(w);
	free(w_cpu);
	free(ids);
	free(ids_cpu);
}

/* A call it does not take: 1, and the outputs keep their poison. */
static void test_decline(const char *what, struct k_cuda_moe_ws *ws, const struct k_moe_route_params *p,
			 int hidden, int M)
{
	size_t nx = (size_t)M * hidden, nk = (size_t)M * p->top_k;
	float *x = malloc(sizeof(float) * nx);
	uint16_t *router = rand_bf16((size_t)p->n_experts * hidden, 0.05f);
	void *d_router = dup_to_device(router, sizeof(uint16_t) * p->n_experts * hidden), *before, *after;
	float *d_x, *d_lg = dalloc(sizeof(float) * M * p->n_experts), *d_w = dalloc(sizeof(float) * nk);
	int32_t *d_ids = dalloc(sizeof(int32_t) * nk);
	int ret, same;

	fill_x(x, nx);
	d_x = dup_to_device(x, sizeof(float) * nx);
	poison(d_ids, sizeof(int32_t) * nk);
	before = download_bytes(d_ids, sizeof(int32_t) * nk);
	ret = k_cuda_moe_router(stream, ws, d_x, M, d_router, hidden, p, d_lg, d_ids, d_w);
	CU(cudaStreamSynchronize(stream));
	after = download_bytes(d_ids, sizeof(int32_t) * nk);
	same = !memcmp(before, after, sizeof(int32_t) * nk);
	printf("moe_router %-17s M %d  declined %d, ids %s  %s\n", what, M, ret,
	       same ? "untouched" : "WRITTEN", ret == 1 && same ? "PASS" : "FAIL");
	CHECK(ret == 1 && same, "%s M %d: returned %d, ids %s", what, M, ret, same ? "untouched" : "written");
	cudaFree(d_router);
	cudaFree(d_x);
	cudaFree(d_lg);
	cudaFree(d_w);
	cudaFree(d_ids);
	free(router);
	free(x);
	free(before);
	free(after);
}

int main(void)
{
	static const int rows[] = { 1, 2, 3, 5, 8 };
	struct k_moe_route_params wide = { 2048, 8, K_MOE_SOFTMAX, K_MOE_GREEDY, 0, 0, 1, 1.0f, NULL };

	if (!test_gpu_present("test_cuda_moe_router"))
		return 77;
	CU(cudaStreamCreate(&stream));
	if (k_pool_create(&pool, 16))
		return 1;
	CHECK(k_cuda_linear_create(&lin, stream, K_CUDA_MOE_LAT_MAX_ROWS, 7168) == 0, "linear context");
	for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
		const struct rt_model *s = &models[i];
		size_t nr = (size_t)s->n_experts * s->hidden;
		uint16_t *h_router = rand_bf16(nr, 1.0f / sqrtf((float)s->hidden));
		void *d_router = dup_to_device(h_router, sizeof(uint16_t) * nr);
		float *h_bias = NULL, *d_bias = NULL;
		struct k_cuda_moe_ws *ws = NULL;

		if (s->p.scoring == K_MOE_SIGMOID) {
			h_bias = malloc(sizeof(float) * s->n_experts);
			for (int e = 0; e < s->n_experts; e++)
				h_bias[e] = test_randf(&seed) * 0.05f;
			d_bias = dup_to_device(h_bias, sizeof(float) * s->n_experts);
		}
		CHECK(k_cuda_moe_ws_create(&ws, K_CUDA_MOE_LAT_MAX_ROWS + 1, s->top_k, s->n_experts,
					   s->hidden, INTER, 0) == 0, "%s: workspace", s->name);
		for (size_t j = 0; ws && j < sizeof(rows) / sizeof(rows[0]); j++)
			test_case(s, h_router, d_router, h_bias, d_bias, ws, rows[j]);
		if (ws && i == 0)
			test_decline("9 rows", ws, &s->p, s->hidden, K_CUDA_MOE_LAT_MAX_ROWS + 1);
		k_cuda_moe_ws_destroy(ws);
		cudaFree(d_router);
		cudaFree(d_bias);
		free(h_router);
		free(h_bias);
	}
	{	/* 2,048 experts: the routing scratch of 4 warps passes 48 KB */
		struct k_cuda_moe_ws *ws = NULL;

		CHECK(k_cuda_moe_ws_create(&ws, 1, 8, 2048, 512, INTER, 0) == 0, "wide workspace");
		if (ws)
			test_decline("2048 experts", ws, &wide, 512, 1);
		k_cuda_moe_ws_destroy(ws);
	}
	k_cuda_linear_destroy(lin);
	k_pool_destroy(pool);
	cudaStreamDestroy(stream);
	return test_result("test_cuda_moe_router");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_moe_router: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
