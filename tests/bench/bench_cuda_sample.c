/* Sampling benchmark on the GPU: k_cuda_sample over realistic rows of a 151936-token
 * vocabulary (Qwen's), greedy, top-k, top-p and the full vocabulary, at 1 and 64 rows,
 * each beside the floor of one read of the logits. The checks of the same kernel:
 * test_cuda_sample. Usage: bench_cuda_sample. Exits 77 without CUDA or a GPU. */
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/sample/k_cuda_sample.h"
#include "tests/cudatest.h"
#include "tests/sampletest.h"
#include "tests/bench/cudabench.h"

#define BIG_VOCAB 151936
#define ROWS 64

static unsigned long long seed = 0x5a3b1eull;
static cudaStream_t stream;
static struct k_cuda_sample_ws *ws;

/* One call's time (median of 20 after 3) on M realistic rows. */
static void time_sample(const float *dl, int M, int vocab, const struct sample_cfg *c,
			const char *what)
{
	struct k_sample_params p[ROWS], *dp = dalloc(sizeof(p));
	uint64_t steps[ROWS], *ds = dalloc(sizeof(steps));
	int32_t *di = dalloc(sizeof(int32_t) * ROWS);
	cudaEvent_t ev[21];
	float ms[20];

	sample_params_for(p, steps, M, c, 1, 5);
	CU(cudaMemcpy(dp, p, sizeof(*dp) * M, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(ds, steps, sizeof(*ds) * M, cudaMemcpyHostToDevice));
	for (int i = 0; i < 21; i++)
		CU(cudaEventCreate(&ev[i]));
	for (int i = 0; i < 3; i++)
		k_cuda_sample(stream, ws, di, dl, M, vocab, dp, ds);
	CU(cudaEventRecord(ev[0], stream));
	for (int i = 0; i < 20; i++) {
		k_cuda_sample(stream, ws, di, dl, M, vocab, dp, ds);
		CU(cudaEventRecord(ev[i + 1], stream));
	}
	CU(cudaEventSynchronize(ev[20]));
	for (int i = 0; i < 20; i++)
		CU(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
	printf("sample time  vocab %6d M %2d %-24s %7.1f us "
	       "(one read of the logits, the floor: %.1f us)\n",
	       vocab, M, what, test_median(ms, 20) * 1e3, bench_floor_us((double)M * vocab * 4));
	for (int i = 0; i < 21; i++)
		cudaEventDestroy(ev[i]);
	cudaFree(dp);
	cudaFree(ds);
	cudaFree(di);
}

static void time_all(int vocab)
{
	const struct sample_cfg cfgs[] = { { 0, 0, 0 }, { 0.7f, 50, 0 }, { 0.8f, 40, 0.95f },
					   { 1.0f, 0, 0.9f }, { 1.0f, 0, 0 } };
	const char *names[] = { "greedy", "T 0.7 top_k 50", "T 0.8 top_k 40 top_p .95",
				"T 1 top_p 0.9", "T 1 (full vocab)" };
	size_t n = (size_t)ROWS * vocab;
	float *l = malloc(sizeof(float) * n), *dl = dalloc(sizeof(float) * n);

	for (int r = 0; r < ROWS; r++)
		sample_make_logits(l + (size_t)r * vocab, vocab, 2, &seed);	/* realistic rows */
	CU(cudaMemcpy(dl, l, sizeof(float) * n, cudaMemcpyHostToDevice));
	for (int c = 0; c < 5; c++) {
		time_sample(dl, 1, vocab, &cfgs[c], names[c]);
		time_sample(dl, ROWS, vocab, &cfgs[c], names[c]);
	}
	free(l);
	cudaFree(dl);
}

int main(void)
{
	if (bench_begin("bench_cuda_sample"))
		return 77;
	CU(cudaStreamCreate(&stream));
	if (k_cuda_sample_ws_create(&ws, ROWS, BIG_VOCAB)) {
		fprintf(stderr, "bench_cuda_sample: no workspace\n");
		return 1;
	}
	time_all(BIG_VOCAB);
	k_cuda_sample_ws_destroy(ws);
	cudaStreamDestroy(stream);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_sample: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
