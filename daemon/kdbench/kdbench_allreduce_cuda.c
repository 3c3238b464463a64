/* kdbench allreduce --backend cuda: the fused one-shot all-reduce + residual + RMSNorm
 * (kernels/cuda/comm) with N virtual ranks on one GPU, p50/p99 of one reduction
 * replayed as a CUDA graph, beside its floors: the same graph with nothing in it (the
 * launch floor), the bytes through HBM, and for real peers the bytes over NVLink. And
 * NCCL where the build has it and the library loads: NCCL refuses two ranks on one
 * GPU, so what one GPU allows is a one-rank ncclAllReduce, NCCL's launch floor. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/kdbench/kdbench.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "daemon/backend/cuda/nccl_lib.h"	/* NCCL loaded at run time, as the engine loads it */
#include "daemon/base/clock.h"
#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define ARC_MAX_ROWS 64
#define ARC_CHAIN 32		/* reductions in the back-to-back graph */
#define ARC_NVLINK_GBS 450.0	/* H200 NVLink 4: 900 GB/s both ways, 450 each way */
#define ARC_WARM_S 0.3		/* busy first, so that the clocks are up before timing */

struct arc {
	int tp, width, iters, warmup;
	struct k_cuda_ar *ar;
	cudaStream_t st[K_CUDA_AR_MAX_RANKS];
	cudaEvent_t fork, join[K_CUDA_AR_MAX_RANKS], t0, t1;
	struct k_cuda_ar_io io[K_CUDA_AR_MAX_RANKS];
	float *h;		/* (ARC_MAX_ROWS, width) rank 0's: add_rmsnorm's addend */
	double *us;		/* (warmup + iters) */
};

static int arc_ok(cudaError_t e, const char *what)
{
	if (e == cudaSuccess)
		return 1;
	fprintf(stderr, "kdbench allreduce: %s: %s\n", what, cudaGetErrorString(e));
	return 0;
}

/* What a graph replays: 0 nothing (the fork and join alone, a 4-byte memset per
 * stream), 1 one reduction a launch per rank, 2 one reduction in one launch, 3
 * ARC_CHAIN reductions in one launch each, 4 ARC_CHAIN k_cuda_add_rmsnorm of the same
 * rows (the op that tp 1 runs where tp N runs the reduction). */
static int arc_record(struct arc *b, int what, int rows)
{
	int ok = arc_ok(cudaEventRecord(b->fork, b->st[0]), "fork");

	for (int r = 1; r < b->tp; r++)
		ok &= arc_ok(cudaStreamWaitEvent(b->st[r], b->fork, 0), "fork wait");
	if (what == 0)
		for (int r = 0; r < b->tp; r++)
			ok &= arc_ok(cudaMemsetAsync(b->io[r].out, 0, 4, b->st[r]), "memset");
	for (int r = 0; what == 1 && r < b->tp; r++)
		ok &= k_cuda_ar_fused(b->ar, r, b->st[r], &b->io[r], rows, b->width, 1e-5f) == 0;
	for (int i = 0; i < (what == 2 ? 1 : what == 3 ? ARC_CHAIN : 0); i++)
		ok &= k_cuda_ar_fused_all(b->ar, b->st[0], b->io, rows, b->width, 1e-5f) == 0;
	for (int i = 0; what == 4 && i < ARC_CHAIN; i++)
		ok &= k_cuda_add_rmsnorm(b->st[0], b->io[0].residual, b->h, b->io[0].out, b->io[0].gamma,
					 rows, b->width, 1e-5f) == 0;
	for (int r = 1; r < b->tp; r++) {
		ok &= arc_ok(cudaEventRecord(b->join[r], b->st[r]), "join");
		ok &= arc_ok(cudaStreamWaitEvent(b->st[0], b->join[r], 0), "join wait");
	}
	return ok ? 0 : -1;
}

/* p50/p99 us of warmup + iters replays of x on b->st[0], each timed by events (the
 * first warmup left out). */
static int arc_replays(struct arc *b, cudaGraphExec_t x, double *p50, double *p99)
{
	int ok = 1;

	for (int i = 0; ok && i < b->warmup + b->iters; i++) {
		float ms = 0;

		ok = arc_ok(cudaEventRecord(b->t0, b->st[0]), "event") &&
		     arc_ok(cudaGraphLaunch(x, b->st[0]), "replay") &&
		     arc_ok(cudaEventRecord(b->t1, b->st[0]), "event") &&
		     arc_ok(cudaEventSynchronize(b->t1), "replay") &&
		     arc_ok(cudaEventElapsedTime(&ms, b->t0, b->t1), "elapsed");
		b->us[i] = ms * 1e3;
	}
	if (!ok)
		return -1;
	qsort(b->us + b->warmup, (size_t)b->iters, sizeof(double), kdbench_cmp_double);
	*p50 = b->us[b->warmup + b->iters / 2];
	*p99 = b->us[b->warmup + (b->iters * 99) / 100];
	return 0;
}

/* p50/p99 us of replays of the graph arc_record(what, rows) captures; warm: replayed
 * back to back for ARC_WARM_S first. */
static int arc_time(struct arc *b, int what, int rows, int warm, double *p50, double *p99)
{
	cudaGraph_t g = NULL;
	cudaGraphExec_t x = NULL;
	int ok;

	ok = arc_ok(cudaStreamBeginCapture(b->st[0], cudaStreamCaptureModeThreadLocal), "capture");
	if (ok && arc_record(b, what, rows))
		ok = 0;
	ok &= arc_ok(cudaStreamEndCapture(b->st[0], &g), "end capture");
	ok = ok && arc_ok(cudaGraphInstantiate(&x, g, 0), "instantiate");
	if (ok && warm) {	/* replays back to back for ARC_WARM_S */
		const double t0 = clock_now();

		while (ok && clock_now() - t0 < ARC_WARM_S) {
			for (int i = 0; ok && i < 50; i++)
				ok = arc_ok(cudaGraphLaunch(x, b->st[0]), "replay");
			ok = ok && arc_ok(cudaStreamSynchronize(b->st[0]), "replay");
		}
	}
	ok = ok && arc_replays(b, x, p50, p99) == 0;
	if (x)
		cudaGraphExecDestroy(x);
	if (g)
		cudaGraphDestroy(g);
	return ok ? 0 : -1;
}

static int arc_setup(struct arc *b)
{
	const size_t e = (size_t)ARC_MAX_ROWS * b->width;
	int devs[K_CUDA_AR_MAX_RANKS] = { 0 }, ok = 1;
	void *p;

	if (k_cuda_ar_create(&b->ar, b->tp, devs, K_CUDA_AR_BF16, ARC_MAX_ROWS, b->width))
		return -1;
	ok &= arc_ok(cudaEventCreateWithFlags(&b->fork, cudaEventDisableTiming), "event");
	ok &= arc_ok(cudaEventCreate(&b->t0), "event") && arc_ok(cudaEventCreate(&b->t1), "event");
	for (int r = 0; ok && r < b->tp; r++) {
		ok &= arc_ok(cudaStreamCreateWithFlags(&b->st[r], cudaStreamNonBlocking), "stream");
		ok &= arc_ok(cudaEventCreateWithFlags(&b->join[r], cudaEventDisableTiming), "event");
		/* partial 2 bytes, residual, gamma, out 4 and out_bf16 2 bytes per value */
		ok = ok && arc_ok(cudaMalloc(&p, e * 18 + 4 * (size_t)b->width), "cudaMalloc");
		if (!ok)
			break;
		/* 0x3c: every bf16 and fp32 value about 0.01, no sentinel, no NaN */
		ok &= arc_ok(cudaMemset(p, 0x3c, e * 18 + 4 * (size_t)b->width), "memset");
		b->io[r] = (struct k_cuda_ar_io){ .partial = p, .residual = (float *)((char *)p + e * 2),
						  .out = (float *)((char *)p + e * 6),
						  .out_bf16 = (uint16_t *)((char *)p + e * 10),
						  .gamma = (float *)((char *)p + e * 12) };
		if (r == 0)	/* after gamma: e * 2 >= 4 * width bytes */
			b->h = (float *)((char *)p + e * 14);
	}
	ok = ok && arc_ok(cudaDeviceSynchronize(), "setup");
	/* one reduction outside any capture: the kernels loaded before the first graph */
	ok = ok && k_cuda_ar_fused_all(b->ar, b->st[0], b->io, 1, b->width, 1e-5f) == 0;
	return ok && arc_ok(cudaDeviceSynchronize(), "first reduction") ? 0 : -1;
}

static void arc_free(struct arc *b)
{
	cudaDeviceSynchronize();
	for (int r = 0; r < b->tp; r++) {
		cudaFree((void *)b->io[r].partial);
		if (b->st[r])
			cudaStreamDestroy(b->st[r]);
		if (b->join[r])
			cudaEventDestroy(b->join[r]);
	}
	if (b->fork)
		cudaEventDestroy(b->fork);
	if (b->t0)
		cudaEventDestroy(b->t0);
	if (b->t1)
		cudaEventDestroy(b->t1);
	k_cuda_ar_destroy(b->ar);
	free(b->us);
}

#ifdef KD_HAVE_NCCL
/* p50/p99 of a one-rank bf16 sum of bytes, captured; -1 with a line when NCCL is absent. */
static int arc_nccl_time(struct arc *b, const long *bytes, int n_sizes)
{
	struct nccl_lib nc;
	ncclComm_t comm = NULL;
	int dev = 0, ret = -1;
	char why[256], ver[16];
	void *buf = NULL;

	if (nccl_lib_open(&nc, why, sizeof(why))) {
		printf("# nccl: %s: no NCCL rows\n", why);
		return -1;
	}
	if (nc.comm_init_all(&comm, 1, &dev) != ncclSuccess) {
		printf("# nccl: %s loaded but a one-rank communicator failed: no NCCL rows\n",
		       NCCL_LIB_NAME);
		comm = NULL;
		goto out;
	}
	if (!arc_ok(cudaMalloc(&buf, (size_t)bytes[n_sizes - 1]), "cudaMalloc"))
		goto out;
	nccl_lib_version(&nc, ver, sizeof(ver));
	printf("# nccl %s: NCCL cannot put two ranks on one GPU (a communicator holds each device "
	       "once), so the row below is one rank's ncclAllReduce (bf16 sum, captured, replayed): "
	       "NCCL's launch floor on one GPU, no data crosses\n", ver);
	printf("%10s %10s %10s\n", "bytes", "nccl1_p50", "nccl1_p99");
	for (int i = 0; i < n_sizes; i++) {
		cudaGraph_t g = NULL;
		cudaGraphExec_t x = NULL;
		double p50 = 0, p99 = 0;
		int ok = arc_ok(cudaStreamBeginCapture(b->st[0], cudaStreamCaptureModeThreadLocal),
				"capture");

		ok = ok && nc.all_reduce(buf, buf, (size_t)bytes[i] / 2, ncclBfloat16, ncclSum, comm,
					 b->st[0]) == ncclSuccess;
		ok &= arc_ok(cudaStreamEndCapture(b->st[0], &g), "end capture");
		ok = ok && arc_ok(cudaGraphInstantiate(&x, g, 0), "instantiate");
		ok = ok && arc_replays(b, x, &p50, &p99) == 0;
		if (x)
			cudaGraphExecDestroy(x);
		if (g)
			cudaGraphDestroy(g);
		if (!ok) {
			fprintf(stderr, "kdbench allreduce: nccl one-rank all-reduce of %ld bytes failed\n",
				bytes[i]);
			goto out;
		}
		printf("%10ld %10.1f %10.1f\n", bytes[i], p50, p99);
	}
	ret = 0;
out:
	if (buf)
		cudaFree(buf);
	if (comm)
		nc.comm_destroy(comm);
	nccl_lib_close(&nc);
	return ret;
}
#endif

/* Bytes through one GPU's memory per reduction of rows x width, all tp ranks: each
 * reads its partial, writes it into tp buffers, reads its tp slots, resets the tp
 * slots of the launch before (same size), reads and writes the fp32 residual, writes
 * out (fp32) and out_bf16. */
static double arc_hbm_bytes(int tp, long rows, long width)
{
	const double p = 2.0 * rows * width;

	return tp * ((8.0 + 3.0 * tp) * p);
}

int kdbench_allreduce_cuda(int tp, int iters, int warmup, const long *bytes_in, int n_sizes,
			   int width)
{
	struct arc b = { .tp = tp, .width = width, .iters = iters, .warmup = warmup };
	long bytes[16];
	double f50, f99;
	int count = 0, ctas = 0, threads = 0, ret = 1;

	if (tp > K_CUDA_AR_MAX_RANKS || width < 8 || width % 8 || width > 65536) {
		fprintf(stderr, "kdbench allreduce: --backend cuda: --tp %d (2..%d), --width %d (a "
			"multiple of 8 up to 65536)\n", tp, K_CUDA_AR_MAX_RANKS, width);
		return 2;
	}
	if (n_sizes == 0) {	/* 1, 4, 16 and 64 rows */
		for (; n_sizes < 4; n_sizes++)
			bytes[n_sizes] = 2L * width << (2 * n_sizes);
	}
	for (int i = 0; i < n_sizes; i++) {
		if (bytes_in)
			bytes[i] = bytes_in[i];
		if (bytes[i] % (2L * width) || bytes[i] / (2L * width) < 1 ||
		    bytes[i] / (2L * width) > ARC_MAX_ROWS) {
			fprintf(stderr, "kdbench allreduce: --bytes %ld with --width %d: bf16 rows of "
				"%d bytes, 1..%d of them (a multiple of %d up to %ld)\n", bytes[i], width,
				2 * width, ARC_MAX_ROWS, 2 * width, 2L * width * ARC_MAX_ROWS);
			return 1;
		}
	}
	if (k_cuda_device_count(&count) || count == 0) {
		fprintf(stderr, "kdbench allreduce: --backend cuda: no CUDA device here\n");
		return 1;
	}
	b.us = calloc((size_t)(warmup + iters), sizeof(double));
	if (!b.us || arc_setup(&b) || arc_time(&b, 3, ARC_MAX_ROWS, 1, &f50, &f99) ||
	    arc_time(&b, 0, 1, 0, &f50, &f99))
		goto out;
	if (k_cuda_ar_shape(b.ar, ARC_MAX_ROWS, width, &ctas, &threads))
		goto out;
	printf("# kdbench allreduce: cuda, tp %d virtual ranks on GPU 0 (one process, separate "
	       "buffers standing in for peers), bf16 rows of %d, fused sum + residual + RMSNorm, "
	       "a CTA of %d threads per row, at most %d CTAs per rank (all ranks' CTAs resident "
	       "at once); %d graph replays after %d\n", tp, width, threads, ctas, iters, warmup);
	printf("# launch floor: the same fork/join graph with a 4-byte memset per rank: p50 %.1f us, "
	       "p99 %.1f us; hbm_floor: bytes through one GPU's memory (all ranks) at %.2f TB/s; "
	       "nvl_floor: one real rank's (tp-1) partials over NVLink at %.0f GB/s\n", f50, f99,
	       KDBENCH_HBM_TBS, ARC_NVLINK_GBS);
	printf("%9s %4s %10s %10s %10s %10s %10s %10s %10s %10s\n", "bytes", "rows", "strm_p50",
	       "strm_p99", "one_p50", "one_p99", "chain_us", "addnorm_us", "hbm_floor", "nvl_floor");
	for (int i = 0; i < n_sizes; i++) {
		const int rows = (int)(bytes[i] / (2L * width));
		double s50, s99, o50, o99, c50, c99, a50, a99;

		if (arc_time(&b, 1, rows, 0, &s50, &s99) || arc_time(&b, 2, rows, 0, &o50, &o99) ||
		    arc_time(&b, 3, rows, 0, &c50, &c99) || arc_time(&b, 4, rows, 0, &a50, &a99))
			goto out;
		printf("%9ld %4d %10.1f %10.1f %10.1f %10.1f %10.2f %10.2f %10.2f %10.2f\n", bytes[i], rows,
		       s50, s99, o50, o99, c50 / ARC_CHAIN, a50 / ARC_CHAIN,
		       arc_hbm_bytes(tp, rows, width) / (KDBENCH_HBM_TBS * 1e6),
		       (tp - 1) * (double)bytes[i] / (ARC_NVLINK_GBS * 1e3));
	}
	printf("# strm: a launch per rank on its own stream (the multi-GPU form); one: all ranks in "
	       "one launch (the one-GPU form); chain_us: p50 of a graph of %d one-launch reductions "
	       "back to back / %d; addnorm_us: the same for k_cuda_add_rmsnorm of the rows (fp32, "
	       "what tp 1 runs in its place)\n", ARC_CHAIN, ARC_CHAIN);
#ifdef KD_HAVE_NCCL
	arc_nccl_time(&b, bytes, n_sizes);
#else
	printf("# nccl: not in this build (configure found no NCCL); NCCL cannot put two ranks on "
	       "one GPU in any case\n");
#endif
	ret = 0;
out:
	arc_free(&b);
	return ret;
}

#else

int kdbench_allreduce_cuda(int tp, int iters, int warmup, const long *bytes, int n_sizes, int width)
{
	fprintf(stderr, "kdbench allreduce: --backend cuda: this kdbench is built without CUDA\n");
	return 1;
}

#endif
