/* Helpers of the CUDA tests and benchmarks: test_gpu_present for every one of them,
 * and device memory in and out. A failed CUDA call is a failed check (CHECK,
 * testutil.h) naming the call, its file and line and the CUDA error, not an exit, so
 * the other cases still run (a sticky error fails them too). */
#ifndef KD_TESTS_CUDATEST_H
#define KD_TESTS_CUDATEST_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
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

/* The KDEC_* variables installed as the daemon installs them, so that a benchmark or a
 * test runs A/B the way kdbench does (without this the built-in defaults apply). 0, or
 * -1 with the malformed variable named on stderr. */
static inline int test_tuning_env(const char *name)
{
	struct k_cuda_tuning t;
	char err[160];

	if (k_cuda_tuning_from_env(&t, err, sizeof(err))) {
		fprintf(stderr, "%s: %s\n", name, err);
		return -1;
	}
	k_cuda_tuning_set(&t);
	return 0;
}

/* CU(call): 1 when the CUDA call succeeded, else a failed check and 0. */
#define CU(call) cu_ok((call), #call, __FILE__, __LINE__)

static inline int cu_ok(cudaError_t e, const char *what, const char *file, int line)
{
	if (e == cudaSuccess)
		return 1;
	test_checks++;
	test_failures++;
	fprintf(stderr, "FAIL %s:%d: %s: %s\n", file, line, what, cudaGetErrorString(e));
	return 0;
}

/* bytes of device memory (16 for 0), or NULL after a failed check. */
static inline void *dalloc(size_t bytes)
{
	void *p = NULL;

	if (!CU(cudaMalloc(&p, bytes ? bytes : 16)))
		return NULL;
	return p;
}

/* A device copy of h's bytes, or NULL after a failed check. The copy has landed when
 * this returns: a cudaMemcpy from pageable memory may return before its DMA reaches the
 * device, and the tests' kernels run on non-blocking streams, which do not wait for the
 * legacy stream's copies. */
static inline void *dup_to_device(const void *h, size_t bytes)
{
	void *d = dalloc(bytes);

	if (d && bytes && CU(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice)))
		CU(cudaDeviceSynchronize());
	return d;
}

/* The device's work finished (a kernel's failure shows here, as a failed check), then
 * bytes of d into h. 1, or 0 after a failed check. */
static inline int to_host(void *h, const void *d, size_t bytes)
{
	return CU(cudaDeviceSynchronize()) && CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

/* n floats of d in a malloc'd host copy (caller frees). */
static inline float *download(const float *d, size_t n)
{
	float *h = malloc(sizeof(float) * (n ? n : 1));

	CU(cudaMemcpy(h, d, sizeof(float) * n, cudaMemcpyDeviceToHost));
	return h;
}

/* bytes of d in a malloc'd host copy (caller frees). */
static inline void *download_bytes(const void *d, size_t bytes)
{
	void *h = malloc(bytes ? bytes : 1);

	if (h)
		CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
	return h;
}

/* bytes of d set to 0xff: a NaN in fp32 and bf16 alike, so an output element a kernel
 * leaves unwritten fails its check. */
static inline void poison(void *d, size_t bytes)
{
	CU(cudaMemset(d, 0xff, bytes));
}

#endif
