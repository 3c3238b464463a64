/* Helpers of the CUDA tests: test_gpu_present for every one of them; for those that
 * check kernels case by case (test_cuda_attn, test_cuda_merge), a failed CUDA call is a
 * failed check (CHECK, testutil.h), not an exit, so the other cases still run. Include
 * after testutil.h and the CUDA runtime. */
#ifndef KD_TESTS_CUDATEST_H
#define KD_TESTS_CUDATEST_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "tests/testutil.h"

/* Whether this machine has a CUDA device; without one it says that test name is
 * skipped, and the test returns 77 (automake's skip). */
static inline int test_gpu_present(const char *name)
{
	int count = 0;

	k_cuda_device_count(&count);
	if (count == 0)
		fprintf(stderr, "%s: skipped: no CUDA device on this machine\n", name);
	return count > 0;
}

#define CUDATEST_TIME_RUNS 15	/* calls per time_us, after one warm-up */

#define CU(call) cu_ok((call), #call, __LINE__)

static inline int cu_ok(cudaError_t e, const char *what, int line)
{
	if (e == cudaSuccess)
		return 1;
	CHECK(0, "line %d: %s: %s", line, what, cudaGetErrorString(e));
	return 0;
}

static inline void *dalloc(size_t bytes)
{
	void *p = NULL;

	if (!CU(cudaMalloc(&p, bytes ? bytes : 16)))
		return NULL;
	return p;
}

static inline void *dup_to_device(const void *h, size_t bytes)
{
	void *d = dalloc(bytes);

	if (d && bytes)
		CU(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
	return d;
}

static inline float *download(const float *d, size_t n)
{
	float *h = malloc(sizeof(float) * n);

	CU(cudaMemcpy(h, d, sizeof(float) * n, cudaMemcpyDeviceToHost));
	return h;
}

/* Median time of one call over runs (1..CUDATEST_MAX_RUNS) after one warm-up call, for
 * KD_TEST_TIME. flush (NULL: none): a buffer of flush_bytes memset before each timed run
 * (outside the events), so that the call's inputs are not in L2. */
#define CUDATEST_MAX_RUNS 64
static inline double time_runs_us(int (*call)(void *), void *arg, int runs, void *flush,
				  size_t flush_bytes)
{
	cudaEvent_t a, b;
	float ms[CUDATEST_MAX_RUNS];

	if (runs < 1 || runs > CUDATEST_MAX_RUNS || !CU(cudaEventCreate(&a)) ||
	    !CU(cudaEventCreate(&b)))
		return 0;
	call(arg);
	for (int i = 0; i < runs; i++) {
		if (flush)
			cudaMemsetAsync(flush, i, flush_bytes, 0);
		cudaEventRecord(a, 0);
		call(arg);
		cudaEventRecord(b, 0);
		cudaEventSynchronize(b);
		cudaEventElapsedTime(&ms[i], a, b);
	}
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	return test_median(ms, runs) * 1000.0;
}

/* The same, CUDATEST_TIME_RUNS runs with warm caches. */
static inline double time_us(int (*call)(void *), void *arg)
{
	return time_runs_us(call, arg, CUDATEST_TIME_RUNS, NULL, 0);
}

#endif
