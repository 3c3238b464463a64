// Asks L2 for the heads of a weight matrix's rows, so that a GEMV launched later finds
// part of its bytes there: a branch of the step runs it while a latency-bound chain (an
// attention) leaves HBM idle. A hint: nothing is written, results never depend on it.
// One bulk prefetch a row (cp.async.bulk.prefetch.L2, sm_90) where the head is a
// multiple of 16 bytes and every row 16-byte aligned (the launcher checks); a
// prefetch.global.L2 per 128-byte line otherwise.
#include <cerrno>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define PF_THREADS 128

namespace {	// kernels and their helpers stay private to this file

struct pf_args {
	k_cuda_l2_rows r[K_CUDA_L2_PREFETCH_MAX];
	int n;
	int bulk;	// 1: every range takes the bulk form
};

// Thread t of the grid takes rows t, t + grid size, ... of every range.
__global__ void __launch_bounds__(PF_THREADS) l2_prefetch_kernel(pf_args a)
{
	long t = (long)blockIdx.x * PF_THREADS + threadIdx.x, step = (long)gridDim.x * PF_THREADS;

	for (int i = 0; i < a.n; i++) {
		const k_cuda_l2_rows r = a.r[i];

		for (long row = t; row < r.rows; row += step) {
			const char *p = (const char *)r.base + (size_t)row * r.pitch;
#if __CUDA_ARCH__ >= 900
			if (a.bulk) {
				asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
					     : : "l"(p), "r"(r.head) : "memory");
				continue;
			}
#endif
			for (unsigned o = 0; o < r.head; o += 128)
				asm volatile("prefetch.global.L2 [%0];" : : "l"(p + o));
		}
	}
}

}	// namespace

extern "C" int k_cuda_l2_prefetch(cudaStream_t s, const struct k_cuda_l2_rows *r, int n)
{
	pf_args a = {};
	long rows = 0;

	if (n < 0 || n > K_CUDA_L2_PREFETCH_MAX || (n && !r))
		return -EINVAL;
	a.bulk = 1;
	for (int i = 0; i < n; i++) {
		if (!r[i].base || r[i].rows < 0 || (r[i].rows > 1 && r[i].head > r[i].pitch))
			return -EINVAL;
		if (r[i].head % 16 || r[i].pitch % 16 || (uintptr_t)r[i].base % 16)
			a.bulk = 0;
		if (r[i].rows && r[i].head) {
			a.r[a.n++] = r[i];
			rows += r[i].rows;
		}
	}
	if (!rows)
		return 0;
	// a few rows a thread: each bulk request is one instruction
	long blocks = (rows + PF_THREADS * 4 - 1) / (PF_THREADS * 4);
	l2_prefetch_kernel<<<(unsigned)(blocks < 264 ? blocks : 264), PF_THREADS, 0, s>>>(a);
	return K_CUDA_LAUNCHED("l2_prefetch");
}
