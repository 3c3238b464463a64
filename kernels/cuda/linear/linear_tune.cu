// What the tuned linear launches share: how a launch is timed (captured alone into a
// graph, replayed from a cold L2 as a decode step replays its weights: cuBLASLt's
// candidates in linear_lt.cu, the quantized kernels' K splits), the scratch a tuning
// times into, and the cache of the K splits kept (linear_qgemv.cu, linear_qtile.cu).
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/quant.h"

#define LIN_TIME_REPS	5	/* timed replays; the median counts */

struct lin_split_entry {
	int kind;		/* enum k_cuda_linear_q_kind */
	int fmt, f16s;		/* k_quant fmt, scales in f16 */
	int M, N, K;		/* M: the bucket */
	int S;			/* the split kept */
};

int k_cuda_lin_time_scratch_get(const struct k_cuda_linear *ctx, size_t ys_bytes,
				struct lin_time_scratch *s)
{
	int ret;

	*s = lin_time_scratch{};
	if (cudaMalloc(&s->ys, ys_bytes) != cudaSuccess ||
	    cudaMalloc(&s->flush, LIN_TIME_FLUSH_BYTES) != cudaSuccess) {
		cudaGetLastError();
		k_cuda_lin_time_scratch_put(s);
		return -ENOMEM;
	}
	if ((ret = LIN_CUDA(ctx->dev, cudaEventCreate(&s->e0))) ||
	    (ret = LIN_CUDA(ctx->dev, cudaEventCreate(&s->e1))))
		k_cuda_lin_time_scratch_put(s);
	return ret;
}

void k_cuda_lin_time_scratch_put(struct lin_time_scratch *s)
{
	if (s->e0)
		cudaEventDestroy(s->e0);
	if (s->e1)
		cudaEventDestroy(s->e1);
	cudaFree(s->flush);
	cudaFree(s->ys);
	*s = lin_time_scratch{};
}

float k_cuda_lin_time(const struct k_cuda_linear *ctx, const struct lin_time_scratch *s,
		      lin_enqueue_fn enqueue, void *arg, int *nodes)
{
	float ms[LIN_TIME_REPS], t = -1.0f;
	cudaGraph_t g = NULL;
	cudaGraphExec_t ge = NULL;
	size_t n = 0;
	int r, ok;

	if (cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
		cudaGetLastError();
		return -1.0f;
	}
	ok = enqueue(ctx, arg) == 0;
	if (cudaStreamEndCapture(ctx->stream, &g) != cudaSuccess || !ok ||
	    cudaGraphGetNodes(g, NULL, &n) != cudaSuccess ||
	    cudaGraphInstantiate(&ge, g, 0) != cudaSuccess ||
	    cudaGraphLaunch(ge, ctx->stream) != cudaSuccess)	// first replay untimed
		goto out;
	for (r = 0; r < LIN_TIME_REPS; r++) {
		if (cudaMemsetAsync(s->flush, r, LIN_TIME_FLUSH_BYTES, ctx->stream) != cudaSuccess ||
		    cudaEventRecord(s->e0, ctx->stream) != cudaSuccess ||
		    cudaGraphLaunch(ge, ctx->stream) != cudaSuccess ||
		    cudaEventRecord(s->e1, ctx->stream) != cudaSuccess ||
		    cudaEventSynchronize(s->e1) != cudaSuccess ||
		    cudaEventElapsedTime(&ms[r], s->e0, s->e1) != cudaSuccess)
			goto out;
	}
	for (r = 1; r < LIN_TIME_REPS; r++)	// insertion sort of five
		for (int j = r; j > 0 && ms[j] < ms[j - 1]; j--) {
			float x = ms[j];

			ms[j] = ms[j - 1];
			ms[j - 1] = x;
		}
	t = ms[LIN_TIME_REPS / 2];
	if (nodes)
		*nodes = (int)n;
out:
	if (t < 0)
		cudaGetLastError();
	if (ge)
		cudaGraphExecDestroy(ge);
	if (g)
		cudaGraphDestroy(g);
	return t;
}

// ---- the K splits kept ---------------------------------------------------------

int k_cuda_lin_bucket(int M)
{
	int b = 1;

	while (b < M)
		b *= 2;
	return b;
}

int k_cuda_lin_split_find(const struct k_cuda_linear *ctx, int kind, const struct k_quant *q,
			  int M, int N, int K)
{
	const int Mb = k_cuda_lin_bucket(M), f16s = q->scale_dtype == K_F16;

	if (!ctx->split_cache || !k_cuda_tuning()->linear_q_tune)
		return 0;
	for (int i = 0; i < ctx->split_n; i++) {
		const struct lin_split_entry *e = &ctx->split_cache[i];

		if (e->kind == kind && e->fmt == (int)q->fmt && e->f16s == f16s && e->M == Mb &&
		    e->N == N && e->K == K)
			return e->S;
	}
	return 0;
}

bool k_cuda_lin_stream_runs(const struct k_cuda_linear *ctx)
{
	cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;

	return cudaStreamIsCapturing(ctx->stream, &cs) == cudaSuccess &&
	       cs == cudaStreamCaptureStatusNone;
}

bool k_cuda_lin_split_wanted(const struct k_cuda_linear *ctx, int kind, const struct k_quant *q,
			     int M, int N, int K)
{
	return k_cuda_tuning()->linear_q_tune && ctx->split_cache &&
	       ctx->split_n < LIN_SPLIT_CACHE && k_cuda_lin_bucket(M) == M &&
	       !k_cuda_lin_split_find(ctx, kind, q, M, N, K) && k_cuda_lin_stream_runs(ctx);
}

void k_cuda_lin_split_keep(struct k_cuda_linear *ctx, int kind, const struct k_quant *q, int M,
			   int N, int K, int S)
{
	if (ctx->split_cache && ctx->split_n < LIN_SPLIT_CACHE && S > 0)
		ctx->split_cache[ctx->split_n++] = lin_split_entry{ kind, (int)q->fmt,
								    q->scale_dtype == K_F16,
								    k_cuda_lin_bucket(M), N, K, S };
}

// k_cuda_lin_time's view of one split's launch.
struct lin_split_call {
	lin_split_enqueue_fn enqueue;
	void *arg;
	int S;
	float *ys;
};

static int lin_split_run(const struct k_cuda_linear *ctx, void *arg)
{
	const struct lin_split_call *c = (const struct lin_split_call *)arg;

	return c->enqueue(ctx, c->arg, c->S, c->ys);
}

int k_cuda_lin_split_tune(const struct k_cuda_linear *ctx, const char *what, int M, int N, int K,
			  int max_S, int model_S, lin_split_enqueue_fn enqueue, void *arg)
{
	float ms[LIN_SPLIT_MAX + 1] = { 0 }, best = -1.0f;
	struct lin_time_scratch ts;
	int pick = model_S, ret;

	if (max_S > LIN_SPLIT_MAX)
		max_S = LIN_SPLIT_MAX;
	if ((ret = k_cuda_lin_time_scratch_get(ctx, (size_t)M * N * 4, &ts))) {
		if (ret == -ENOMEM)
			k_cuda_log("%s: M %d N %d K %d not tuned: no room on device %d for %zu MB "
				   "of timing scratch; the model's split %d stays", what, M, N, K,
				   ctx->dev, ((size_t)M * N * 4 + LIN_TIME_FLUSH_BYTES) >> 20,
				   model_S);
		return model_S;
	}
	for (int S = 1; S <= max_S; S++) {
		struct lin_split_call c = { enqueue, arg, S, (float *)ts.ys };

		ms[S] = k_cuda_lin_time(ctx, &ts, lin_split_run, &c, NULL);
		if (ms[S] > 0 && (best < 0 || ms[S] < best)) {
			best = ms[S];
			pick = S;
		}
	}
	if (k_cuda_tuning()->lt_log) {
		char line[256];
		int n = 0;

		for (int S = 1; S <= max_S && n < (int)sizeof(line) - 24; S++)
			if (ms[S] > 0)
				n += snprintf(line + n, sizeof(line) - n, " S%d %.2f", S, ms[S] * 1e3);
		k_cuda_log("%s: M %d N %d K %d: kept split %d (the model's %d); us:%s", what, M, N,
			   K, pick, model_S, line);
	}
	k_cuda_lin_time_scratch_put(&ts);
	return pick;
}

int k_cuda_lin_split_setup(struct k_cuda_linear *ctx)
{
	ctx->split_cache = (struct lin_split_entry *)calloc(LIN_SPLIT_CACHE,
							    sizeof(*ctx->split_cache));
	return ctx->split_cache ? 0 : -ENOMEM;
}

void k_cuda_lin_split_destroy(struct k_cuda_linear *ctx)
{
	free(ctx->split_cache);
	ctx->split_cache = NULL;
}
