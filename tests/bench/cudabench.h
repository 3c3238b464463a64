/* Helpers of the CUDA benchmarks: a call's median time from events around it (warm, or
 * with L2 flushed before each run), a captured graph's median replay (of one call, or
 * of many over rotated weight copies), and the HBM
 * floor each table prints beside its figures. Include after tests/cudatest.h. */
#ifndef KD_TESTS_BENCH_CUDABENCH_H
#define KD_TESTS_BENCH_CUDABENCH_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "tests/cudatest.h"
#include "tests/testutil.h"

#define BENCH_HBM_BYTES_PER_S 4.25e12	/* the H200's measured read bandwidth (DEVICE.md) */
#define BENCH_FLUSH_BYTES ((size_t)256 << 20)	/* > 4x the L2: a memset of it evicts it */
#define BENCH_MAX_RUNS 64
#define BENCH_WARM_RUNS 15	/* bench_time_us's runs */
#define BENCH_GRAPH_RUNS 25	/* bench_graph_us's replays */

/* Microseconds to move bytes at BENCH_HBM_BYTES_PER_S: the floor of a memory-bound call. */
static inline double bench_floor_us(double bytes)
{
	return bytes / BENCH_HBM_BYTES_PER_S * 1e6;
}

/* A BENCH_FLUSH_BYTES device buffer, made once; NULL after a failed check. */
static inline void *bench_flush_buffer(void)
{
	static void *flush;

	if (!flush)
		flush = dalloc(BENCH_FLUSH_BYTES);
	return flush;
}

/* Median time of one call(arg) on the default stream over runs (1..BENCH_MAX_RUNS)
 * after one warm-up call; flush (NULL: none): a buffer of flush_bytes memset before
 * each timed run, outside the events, so that the call's inputs are not in L2. 0 after
 * a failed check. */
static inline double bench_runs_us(int (*call)(void *), void *arg, int runs, void *flush,
				   size_t flush_bytes)
{
	cudaEvent_t a = NULL, b = NULL;
	float ms[BENCH_MAX_RUNS];
	double us = 0;

	if (runs < 1 || runs > BENCH_MAX_RUNS || !CU(cudaEventCreate(&a)) ||
	    !CU(cudaEventCreate(&b)))
		goto out;
	if (call(arg))
		goto out;
	for (int i = 0; i < runs; i++) {
		if (flush)
			CU(cudaMemsetAsync(flush, i, flush_bytes, 0));
		CU(cudaEventRecord(a, 0));
		call(arg);
		CU(cudaEventRecord(b, 0));
		CU(cudaEventSynchronize(b));
		CU(cudaEventElapsedTime(&ms[i], a, b));
	}
	us = test_median(ms, runs) * 1000.0;
out:
	if (a)
		cudaEventDestroy(a);
	if (b)
		cudaEventDestroy(b);
	return us;
}

/* The same, BENCH_WARM_RUNS runs with warm caches. */
static inline double bench_time_us(int (*call)(void *), void *arg)
{
	return bench_runs_us(call, arg, BENCH_WARM_RUNS, NULL, 0);
}

/* Median of BENCH_GRAPH_RUNS replays of a graph that captures call(arg, stream), after 3
 * untimed ones, each behind a BENCH_FLUSH_BYTES memset of flush (L2 holds 50 MB: the
 * inputs come from HBM as in a model step, where the layer's other weights passed
 * between). The graph is what a step replays, launch gaps and programmatic dependent
 * launches included. 0 after a failed check. */
static inline double bench_graph_us(int (*call)(void *, cudaStream_t), void *arg, void *flush)
{
	cudaStream_t s = NULL;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	cudaEvent_t e0 = NULL, e1 = NULL;
	float ms[BENCH_GRAPH_RUNS];
	double us = 0;
	int ret = -1;

	if (!flush || !CU(cudaStreamCreate(&s)) || !CU(cudaEventCreate(&e0)) ||
	    !CU(cudaEventCreate(&e1)))
		goto out;
	if (!CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	ret = call(arg, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)))
		goto out;
	for (int i = 0; i < 3; i++)
		CU(cudaGraphLaunch(exec, s));
	for (int i = 0; i < BENCH_GRAPH_RUNS; i++) {
		CU(cudaMemsetAsync(flush, i & 0xff, BENCH_FLUSH_BYTES, s));
		CU(cudaEventRecord(e0, s));
		CU(cudaGraphLaunch(exec, s));
		CU(cudaEventRecord(e1, s));
		CU(cudaEventSynchronize(e1));
		CU(cudaEventElapsedTime(&ms[i], e0, e1));
	}
	us = test_median(ms, BENCH_GRAPH_RUNS) * 1e3;
out:
	CHECK(ret == 0, "timing graph: %d", ret);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
	if (s)
		cudaStreamDestroy(s);
	return us;
}

/* Median µs of one call(arg, i, s) inside a graph of calls i = 0, 1, ... on stream s:
 * enough of them (at least BENCH_ROTATED_MIN) to cycle whole over `copies` copies of the
 * weights, so each call reads its copy from HBM (the copies outgrow L2); `eager` calls
 * first, outside the capture (kernels load, cuBLAS picks), one untimed replay, then
 * `samples` (<= BENCH_MAX_RUNS) timed. 0 after a failed call (checked, with what). */
#define BENCH_ROTATED_MIN 20
static inline double bench_rotated_us(int (*call)(void *arg, int i, cudaStream_t s), void *arg,
				      cudaStream_t s, int copies, int eager, int samples,
				      const char *what)
{
	int launches = copies < BENCH_ROTATED_MIN ?
			       (BENCH_ROTATED_MIN + copies - 1) / copies * copies : copies;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	cudaEvent_t t0 = NULL, t1 = NULL;
	float ms[BENCH_MAX_RUNS];
	double us = 0;
	int ret = 0;

	samples = samples < 1 ? 1 : samples > BENCH_MAX_RUNS ? BENCH_MAX_RUNS : samples;
	for (int i = 0; i < eager && !ret; i++)
		ret = call(arg, i, s);
	if (ret || !CU(cudaStreamSynchronize(s)) ||
	    !CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
		goto out;
	for (int i = 0; i < launches && !ret; i++)
		ret = call(arg, i, s);
	if (!CU(cudaStreamEndCapture(s, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)) || !CU(cudaEventCreate(&t0)) ||
	    !CU(cudaEventCreate(&t1)) || !CU(cudaGraphLaunch(exec, s)))	/* warm-up */
		goto out;
	for (int i = 0; i < samples; i++) {
		CU(cudaEventRecord(t0, s));
		CU(cudaGraphLaunch(exec, s));
		CU(cudaEventRecord(t1, s));
		CU(cudaEventSynchronize(t1));
		CU(cudaEventElapsedTime(&ms[i], t0, t1));
	}
	us = (double)test_median(ms, samples) * 1000.0 / launches;
out:
	CHECK(ret == 0, "%s failed: %d", what, ret);
	if (t0)
		cudaEventDestroy(t0);
	if (t1)
		cudaEventDestroy(t1);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	return us;
}

/* The device line every benchmark starts with, the KDEC_* variables installed
 * (test_tuning_env); 0, or -1 (said) without a device or with a malformed variable. */
static inline int bench_begin(const char *name)
{
	char dev[128];
	double gib;
	int major, minor;

	if (!test_gpu_present(name) || test_tuning_env(name))
		return -1;
	setvbuf(stdout, NULL, _IOLBF, 0);	/* a run cut off shows its rows */
	if (k_cuda_device_describe(0, dev, sizeof(dev), &gib, &major, &minor) == 0)
		printf("device 0: %s, %.1f GiB, sm_%d%d; floor at %.2f TB/s\n", dev, gib, major,
		       minor, BENCH_HBM_BYTES_PER_S / 1e12);
	return 0;
}

#endif
