/* Top-k by vocabulary slices on the GPU: k_cuda_topk_slice (the best 64 pairs of each
 * row of a rank's slice) at rows 1, 8, 64 and slices of 16384, 65536 and 151936 values
 * (a 128K-152K vocabulary at tp 8, 2 and 1), each beside the floor of one read of the
 * logits (rows * vn * 4 bytes at 4.25 TB/s). A figure is the mean of 200 launches back
 * to back between two events (the step issues it so, after the replay), after 20 warm
 * ones: the logits stay in L2 where they fit (as lm_head's output does in a step).
 * Each shape in both histogram forms (KDEC_TOPK_MATCH 1: a warp's equal digits one
 * atomic, the default; 0: an atomic an item). The checks of the same kernel:
 * test_cuda_topk_slice. Exits 77 without CUDA or a GPU. */
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "tests/cudatest.h"
#include "tests/bench/cudabench.h"

#define RUNS 200
#define WARM 20

static unsigned long long seed = 0x70b5e1ull;

/* Microseconds a launch of rows x vn takes, back to back; 0 after a failure. */
static double time_topk(cudaStream_t s, void *top, void *ws, size_t ws_bytes, const float *d,
			int rows, int vn)
{
	cudaEvent_t a = NULL, b = NULL;
	float ms = 0;
	int ret = 0;

	if (!CU(cudaEventCreate(&a)) || !CU(cudaEventCreate(&b)))
		return 0;
	for (int i = 0; i < WARM && !ret; i++)
		ret = k_cuda_topk_slice(s, top, ws, ws_bytes, d, rows, vn, 0);
	CU(cudaEventRecord(a, s));
	for (int i = 0; i < RUNS && !ret; i++)
		ret = k_cuda_topk_slice(s, top, ws, ws_bytes, d, rows, vn, 0);
	CU(cudaEventRecord(b, s));
	CU(cudaEventSynchronize(b));
	CU(cudaEventElapsedTime(&ms, a, b));
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	CHECK(ret == 0, "topk_slice %d x %d: %d", rows, vn, ret);
	return ret ? 0 : ms * 1e3 / RUNS;
}

int main(void)
{
	static const int vns[] = { 16384, 65536, 151936 }, rowss[] = { 1, 8, 64 };
	const size_t most = (size_t)64 * 151936;
	cudaStream_t s;
	float *h, *d;
	uint32_t *top;
	void *ws;
	size_t ws_bytes = k_cuda_topk_slice_ws_bytes(64, 151936);

	if (bench_begin("bench_cuda_topk_slice"))
		return 77;
	CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	h = malloc(most * sizeof(float));
	for (size_t i = 0; i < most; i++)	/* spread logits, a few standing out */
		h[i] = test_randf(&seed) * 6 + (test_rand_int(0, 999, &seed) == 0 ? 12 : 0);
	d = dup_to_device(h, most * sizeof(float));
	top = dalloc(sizeof(uint32_t) * (2 * K_CUDA_TOPK_SLICE_K + 1) * 64);
	ws = dalloc(ws_bytes);
	printf("topk_slice (best %d of each row)  rows      vn  match us  atomic us  floor us     bytes\n",
	       K_CUDA_TOPK_SLICE_K);
	for (size_t a = 0; d && top && ws && a < sizeof(vns) / sizeof(vns[0]); a++)
		for (size_t b = 0; b < sizeof(rowss) / sizeof(rowss[0]); b++) {
			double bytes = (double)rowss[b] * vns[a] * 4, us[2];
			struct k_cuda_tuning t;

			for (int m = 0; m < 2; m++) {	/* KDEC_TOPK_MATCH 1, then 0 */
				k_cuda_tuning_defaults(&t);
				t.topk_match = !m;
				k_cuda_tuning_set(&t);
				us[m] = time_topk(s, top, ws, ws_bytes, d, rowss[b], vns[a]);
			}
			printf("topk_slice                        %4d  %6d  %8.2f  %9.2f  %8.2f  %8.0f\n",
			       rowss[b], vns[a], us[0], us[1], bench_floor_us(bytes), bytes);
		}
	k_cuda_tuning_set(NULL);
	cudaFree(ws);
	cudaFree(top);
	cudaFree(d);
	free(h);
	cudaStreamDestroy(s);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_topk_slice: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
