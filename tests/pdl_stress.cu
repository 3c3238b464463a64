// Device side of test_cuda_pdl: a producer that lets its dependent launch at once, then
// spins and only then writes, and checkers that compare the consumer's output with
// what this replay's producer wrote (a generation counter makes every replay's values
// new, so a read of the previous replay's buffer shows). Plain C entry points.
#include <cstdint>

#include <cuda_runtime.h>

#include "tests/pdl_stress.h"

namespace {

// Replay g's value of element (a, b): small integers, exact in fp32 sums.
__device__ __forceinline__ float gen_value(unsigned g, unsigned a, unsigned b)
{
	return (float)((g * 7u + a * 3u + b) % 61u) - 30.0f;
}

// Replay g's greedy winner of row r in a vocabulary of n.
__device__ __forceinline__ unsigned gen_pos(unsigned g, unsigned r, unsigned n)
{
	return (g * 2654435761u + r * 40503u) % n;
}

__device__ __forceinline__ void spin(long long cycles)
{
	const long long t0 = clock64();

	while (clock64() - t0 < cycles)
		;
}

// The producer: its dependents may launch at once (the trigger comes first), then it
// spins and writes. mode MERGE: part_o (n_splits, rows * heads, dim) = gen_value(g, s,
// (rh * dim + d)), part_lse 0 (equal weights); mode LOGITS: rows of n zeros with 1 at
// gen_pos.
__global__ void producer_kernel(int mode, float *a, float *b, int n_splits, int rows, int n,
				const unsigned *gen, long long cycles)
{
	const unsigned g = *gen;
	const size_t stride = (size_t)gridDim.x * blockDim.x;
	const size_t i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;

	cudaTriggerProgrammaticLaunchCompletion();
	spin(cycles);
	if (mode == PDL_STRESS_MERGE) {
		const size_t per = (size_t)rows * n;

		for (size_t i = i0; i < (size_t)n_splits * per; i += stride)
			a[i] = gen_value(g, (unsigned)(i / per), (unsigned)(i % per));
		for (size_t i = i0; i < (size_t)n_splits * rows; i += stride)
			b[i] = 0.0f;
	} else {
		for (size_t i = i0; i < (size_t)rows * n; i += stride)
			a[i] = i % n == gen_pos(g, (unsigned)(i / n), n) ? 1.0f : 0.0f;
	}
}

// One block: compares and counts mismatches into errors[0], then advances the
// generation for the next replay. MERGE: out (rows * heads, dim) must be the mean of
// the splits' values (n_splits a power of two: exact). LOGITS: ids (rows).
__global__ void check_kernel(int mode, const float *out, const int32_t *ids, int n_splits,
			     int rows, int n, unsigned *gen, unsigned long long *errors)
{
	const unsigned g = *gen;
	unsigned long long bad = 0;

	if (mode == PDL_STRESS_MERGE) {
		const size_t per = (size_t)rows * n;

		for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
			float s = 0.0f;

			for (int sp = 0; sp < n_splits; sp++)
				s += gen_value(g, (unsigned)sp, (unsigned)i);
			bad += out[i] != s / (float)n_splits;
		}
	} else {
		for (int r = threadIdx.x; r < rows; r += blockDim.x)
			bad += ids[r] != (int32_t)gen_pos(g, (unsigned)r, (unsigned)n);
	}
	if (bad)
		atomicAdd(errors, bad);
	__syncthreads();
	if (threadIdx.x == 0)
		*gen = g + 1;
}

// The planted consumer (the stress's positive control): copies src to dst BEFORE its
// wait, as a kernel with the fixed hazard would.
__global__ void early_copy_kernel(float *dst, const float *src, size_t n)
{
	const size_t stride = (size_t)gridDim.x * blockDim.x;

	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
		dst[i] = src[i];
	cudaGridDependencySynchronize();
}

}	// namespace

extern "C" int pdl_stress_produce(cudaStream_t s, int mode, float *a, float *b, int n_splits,
				  int rows, int n, const unsigned *gen, long long cycles)
{
	producer_kernel<<<132, 256, 0, s>>>(mode, a, b, n_splits, rows, n, gen, cycles);
	return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

extern "C" int pdl_stress_check(cudaStream_t s, int mode, const float *out, const int32_t *ids,
				int n_splits, int rows, int n, unsigned *gen,
				unsigned long long *errors)
{
	check_kernel<<<1, 256, 0, s>>>(mode, out, ids, n_splits, rows, n, gen, errors);
	return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

extern "C" int pdl_stress_early_copy(cudaStream_t s, float *dst, const float *src, size_t n)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};

	attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	attr[0].val.programmaticStreamSerializationAllowed = 1;
	cfg.gridDim = dim3(132);
	cfg.blockDim = dim3(256);
	cfg.stream = s;
	cfg.attrs = attr;
	cfg.numAttrs = 1;
	return cudaLaunchKernelEx(&cfg, early_copy_kernel, dst, src, n) == cudaSuccess ? 0 : -1;
}
