/* The CUDA backend's graph capture against a hand-off left from before it: an RMSNorm
 * queued before capture_begin marks its output's bf16 copy "ready" for the linear
 * layer that usually comes next. A linear captured after it must not take that mark
 * (the copy is a scratch the graph never writes): the graph converts x itself, so a
 * replay reads x as it is at replay time. Checked by changing x after the capture and
 * comparing the replay with the CPU's linear of the new x. Skips (77) without CUDA or
 * a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include "daemon/backend/backend.h"
#include "daemon/model/model.h"
#include "kernels/cpu/k_cpu.h"
#include "tests/cudatest.h"

/* rows: enough that the linear takes a kind reading bf16 x (the GEMV reads fp32) */
#define ROWS	32

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	const struct backend_ops *ops;
	struct backend_opts bo = { 0 };
	struct backend *be = NULL;
	struct model *m = NULL;
	struct k_pool *pool = NULL;
	unsigned long long seed = test_seed();
	char dir[512], err[512] = "";
	void *graph = NULL;
	int nodes = 0;

	if (!test_gpu_present("test_cuda_capture"))
		return 77;
	snprintf(dir, sizeof(dir), "%s/tests/data/golden/llama3", top);
	CHECK(model_load(&m, dir, NULL, err, sizeof(err)) == 0, "load %s: %s", dir, err);
	ops = backend_find("cuda", err, sizeof(err));
	CHECK(ops != NULL, "cuda backend: %s", err);
	if (!m || !ops)
		return test_result("test_cuda_capture");
	CHECK(ops->create(&be, m, &bo, err, sizeof(err)) == 0, "create: %s", err);
	CHECK(k_pool_create(&pool, 2) == 0, "cpu pool");
	if (!be || !pool)
		return test_result("test_cuda_capture");
	/* the linear context and the scratch its bf16 x lives in come with the workspaces */
	CHECK(ops->reserve(be, ROWS, 64, err, sizeof(err)) == 0, "reserve: %s", err);

	const struct model_layer *L = &m->layers[0];
	int K = (int)L->wq.cols, N = (int)L->wq.rows;
	size_t nx = (size_t)ROWS * K, ny = (size_t)ROWS * N;
	float *a = test_rand_floats(nx, 1.0f, &seed), *b = test_rand_floats(nx, 1.0f, &seed);
	float *got = malloc(sizeof(float) * ny), *want = malloc(sizeof(float) * ny);
	float *dx = ops->alloc(be, sizeof(float) * nx), *dn = ops->alloc(be, sizeof(float) * nx);
	float *dy = ops->alloc(be, sizeof(float) * ny);

	CHECK(dx && dn && dy && got && want, "buffers");
	/* the shape once outside any capture (cuBLASLt picks its algorithm then) */
	ops->linear(be, dy, dx, &L->wq, ROWS);
	/* the producer before the capture: RMSNorm of a into dn, its bf16 copy marked ready */
	CHECK(ops->upload(be, dx, a, sizeof(float) * nx) == 0, "upload a");
	ops->rmsnorm(be, dn, K, dx, K, &L->attn_norm, ROWS, K, m->cfg.rms_norm_eps);
	CHECK(ops->capture_begin(be) == 0, "capture_begin");
	ops->linear(be, dy, dn, &L->wq, ROWS);
	CHECK(ops->capture_end(be, &graph, &nodes) == 0 && graph, "capture_end");
	/* x changes after the capture: the replay must read the new x */
	CHECK(ops->upload(be, dn, b, sizeof(float) * nx) == 0, "upload b");
	CHECK(ops->graph_launch(be, graph) == 0, "replay");
	CHECK(ops->sync(be) == 0, "sync");
	CHECK(ops->download(be, got, dy, sizeof(float) * ny) == 0, "download");
	k_cpu_linear(pool, want, b, L->wq.data, L->wq.dtype, ROWS, N, K);
	/* the GEMM's bf16 inputs: ~2^-9 per element; the stale x would give ~1.4 */
	double e = test_rel_l2(got, want, ny);

	CHECK(e <= 1e-2, "the replay's y from the x at replay time: rel L2 %.3g (graph of %d nodes)", e,
	      nodes);
	fprintf(stderr, "test_cuda_capture: replay after x changed: rel L2 %.3g against the CPU\n", e);
	ops->graph_destroy(be, graph);
	ops->free(be, dx);
	ops->free(be, dn);
	ops->free(be, dy);
	ops->destroy(be);
	k_pool_destroy(pool);
	model_destroy(m);
	free(a);
	free(b);
	free(got);
	free(want);
	return test_result("test_cuda_capture");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_capture: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
