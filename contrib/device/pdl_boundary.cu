// What one kernel boundary of a decode step's chain costs, and how much of it the way a
// kernel waits for its predecessor decides. A decode step at batch 1 is ~10 dependent
// kernels a layer (docs/PERFORMANCE.md, "Where a decode layer's time goes"); the layer
// traces put 1-4 us between one kernel's end and the next's for kernels that move almost
// no bytes. This times a chain of S identical steps, each needing all of its
// predecessor's output (every CTA reads the whole 16 KB vector the last step wrote, as a
// GEMV reads all of x, and writes its slice of the next), replayed as one CUDA graph:
//   plain    launched in stream order (no programmatic launch): the graph's own edge
//   pdl      programmatic launch, griddepcontrol.wait then launch_dependents (kdec's
//            k_cuda_pdl_wait: the wait returns once the predecessor grid has completed
//            and its writes are visible)
//   flag     programmatic launch, but the wait is a spin on a counter the predecessor's
//            CTAs bump (release) after their stores; launch_dependents after the spin
//   persist  one kernel of G CTAs runs all S steps, a grid barrier between them (a
//            megakernel's boundary: the lower bound of any launch-based scheme)
// G: CTAs a step (256 threads each); W: bytes of weights each step streams (its own
// slice of a buffer far larger than L2, read after the step's wait, summed into its
// output so the loads stay), 0 for the bare boundary.
// Prints us a step for each mode beside the bytes' floor (W / 3.35 or 4.25 TB/s is the
// caller's to apply: the GPU's name is printed first).
// Build (repository root): nvcc -O3 -arch=sm_90a -std=c++17 -o pdl_boundary
// contrib/device/pdl_boundary.cu (a study, not part of the build).
// Measured (session 23, one H100, docs/results/session23.txt; docs/PERFORMANCE.md,
// "Session 23"): with no weights, us a step at G 16 / 132 / 264: plain 1.71 / 1.84 /
// 2.08, pdl 1.42 / 1.56 / 1.78, flag 1.80 / 1.91 / 2.56, persist 1.75 / 1.92 / 2.41.
// Programmatic launch is the cheapest boundary of the four; a counter spin, or the grid
// barrier of one persistent kernel, costs 0.3-0.8 us more a step: what a dependent step
// costs is its data's round trips, not the launch. (The persist rows with weights also
// measure that kernel's weaker load loop: 61.8 us for 1 MB on one CTA against 34.)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                          \
	do {                                                                           \
		cudaError_t e_ = (x);                                                  \
		if (e_ != cudaSuccess) {                                               \
			printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x,               \
			       cudaGetErrorString(e_));                                \
			exit(1);                                                       \
		}                                                                      \
	} while (0)

#define THREADS 256
#define N 4096		// floats of the vector a step passes on

enum { PLAIN, PDL, FLAG, PERSIST };

static __device__ __forceinline__ unsigned ld_acquire(const unsigned *p)
{
	unsigned v;

	asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
	return v;
}

static __device__ __forceinline__ void spin_until(const unsigned *p, unsigned target)
{
	if (threadIdx.x == 0)
		while (ld_acquire(p) < target)
			;
	__syncthreads();
}

static __device__ __forceinline__ void arrive(unsigned *p)
{
	__syncthreads();	// every thread's stores before thread 0's release
	if (threadIdx.x == 0) {
		__threadfence();
		atomicAdd(p, 1u);
	}
}

// One step's work for this CTA: the sum of the whole input vector (L2-coherent loads:
// written by another SM), plus its share of the step's weights, into its slice of out.
static __device__ __forceinline__ void step_work(const float *in, float *out,
						 const uint4 *w, size_t w16)
{
	__shared__ float red[THREADS / 32];
	float s = 0.f;

	for (int i = threadIdx.x; i < N / 4; i += THREADS) {
		float4 v = __ldcg((const float4 *)in + i);

		s += v.x + v.y + v.z + v.w;
	}
	if (w16) {	// this CTA's contiguous share, a 16-byte load a thread an iteration
		size_t per = (w16 + gridDim.x - 1) / gridDim.x, lo = per * blockIdx.x;
		size_t hi = lo + per < w16 ? lo + per : w16;
		uint4 acc = make_uint4(0, 0, 0, 0);

		for (size_t i = lo + threadIdx.x; i < hi; i += THREADS) {
			uint4 v = __ldcs(w + i);

			acc.x ^= v.x;
			acc.y ^= v.y;
			acc.z ^= v.z;
			acc.w ^= v.w;
		}
		s += (float)((acc.x ^ acc.y ^ acc.z ^ acc.w) & 1);
	}
	for (int o = 16; o; o >>= 1)
		s += __shfl_xor_sync(0xffffffffu, s, o);
	if (threadIdx.x % 32 == 0)
		red[threadIdx.x / 32] = s;
	__syncthreads();
	s = 0.f;
	for (int i = 0; i < THREADS / 32; i++)
		s += red[i];
	const int per = (N + gridDim.x - 1) / gridDim.x;
	for (int i = blockIdx.x * per + threadIdx.x; i < (blockIdx.x + 1) * per && i < N;
	     i += THREADS)
		out[i] = __ldcg(in + i) * 0.5f + s * 1e-9f;
}

template <int MODE>
__global__ void __launch_bounds__(THREADS)
step_kernel(const float *in, float *out, const uint4 *w, size_t w16, unsigned *ctr, int idx,
	    unsigned target)
{
	if (MODE == PDL) {
		asm volatile("griddepcontrol.wait;" ::: "memory");
		asm volatile("griddepcontrol.launch_dependents;");
	} else if (MODE == FLAG) {
		if (idx > 0)
			spin_until(ctr + idx - 1, target);
		asm volatile("griddepcontrol.launch_dependents;");
	}
	step_work(in, out, w, w16);
	if (MODE == FLAG)
		arrive(ctr + idx);
}

__global__ void __launch_bounds__(THREADS)
persist_kernel(float *buf, const uint4 *w, size_t w16, unsigned *ctr, int S)
{
	for (int s = 0; s < S; s++) {
		step_work(buf + (size_t)(s % 2) * N, buf + (size_t)((s + 1) % 2) * N,
			  w + (size_t)s * w16, w16);
		arrive(ctr + s);
		spin_until(ctr + s, gridDim.x);
	}
}

template <typename... KArgs, typename... Args>
static void launch(cudaStream_t st, bool pdl, int G, void (*k)(KArgs...), Args... args)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute at[1] = {};

	at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[0].val.programmaticStreamSerializationAllowed = 1;
	cfg.gridDim = dim3(G);
	cfg.blockDim = dim3(THREADS);
	cfg.stream = st;
	cfg.attrs = at;
	cfg.numAttrs = pdl ? 1 : 0;
	CK(cudaLaunchKernelEx(&cfg, k, args...));
}

// us a step of S steps in mode MODE, G CTAs, w16 16-byte units of weights a step.
static double run(int mode, int G, int S, size_t w16, float *buf, const uint4 *w,
		  unsigned *ctr, cudaStream_t st)
{
	cudaGraph_t g;
	cudaGraphExec_t ge;
	cudaEvent_t e0, e1;
	const int R = 50;
	float ms;

	CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
	CK(cudaMemsetAsync(ctr, 0, sizeof(unsigned) * S, st));
	if (mode == PERSIST) {
		launch(st, false, G, persist_kernel, buf, w, w16, ctr, S);
	} else {
		for (int s = 0; s < S; s++) {
			float *in = buf + (size_t)(s % 2) * N, *out = buf + (size_t)((s + 1) % 2) * N;
			const uint4 *ws = w + (size_t)s * w16;

			if (mode == PLAIN)
				launch(st, false, G, step_kernel<PLAIN>, (const float *)in, out, ws,
				       w16, ctr, s, (unsigned)G);
			else if (mode == PDL)
				launch(st, s > 0, G, step_kernel<PDL>, (const float *)in, out, ws,
				       w16, ctr, s, (unsigned)G);
			else
				launch(st, s > 0, G, step_kernel<FLAG>, (const float *)in, out, ws,
				       w16, ctr, s, (unsigned)G);
		}
	}
	CK(cudaStreamEndCapture(st, &g));
	CK(cudaGraphInstantiate(&ge, g, 0));
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	for (int i = 0; i < 5; i++)
		CK(cudaGraphLaunch(ge, st));
	CK(cudaEventRecord(e0, st));
	for (int i = 0; i < R; i++)
		CK(cudaGraphLaunch(ge, st));
	CK(cudaEventRecord(e1, st));
	CK(cudaEventSynchronize(e1));
	CK(cudaEventElapsedTime(&ms, e0, e1));
	CK(cudaGraphExecDestroy(ge));
	CK(cudaGraphDestroy(g));
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	return ms * 1e3 / R / S;
}

// The chain's result against the host's: every mode computes the same values.
static bool check(int mode, int G, float *buf, const uint4 *w, unsigned *ctr, cudaStream_t st)
{
	const int S = 8;
	std::vector<float> h(N), d(N);

	for (int i = 0; i < N; i++)
		h[i] = (float)(i % 97) * 0.01f;
	CK(cudaMemcpy(buf, h.data(), N * 4, cudaMemcpyHostToDevice));
	run(mode, G, S, 0, buf, w, ctr, st);	// 55 replays of S steps: 440 steps, even
	CK(cudaStreamSynchronize(st));
	CK(cudaMemcpy(d.data(), buf, N * 4, cudaMemcpyDeviceToHost));
	for (int r = 0; r < 55 * S; r++) {
		double s = 0;

		for (int i = 0; i < N; i++)
			s += h[i];
		for (int i = 0; i < N; i++)
			h[i] = h[i] * 0.5f + (float)s * 1e-9f;
	}
	for (int i = 0; i < N; i++)
		if (!(fabsf(h[i] - d[i]) <= 1e-5f + 1e-4f * fabsf(h[i]))) {
			printf("check mode %d G %d: [%d] %g, host %g\n", mode, G, i, d[i], h[i]);
			return false;
		}
	return true;
}

int main(void)
{
	const int S = 64, Gs[] = { 1, 16, 32, 132, 264 };
	const size_t wbytes[] = { 0, 1 << 20, 4 << 20 };
	const char *names[] = { "plain", "pdl", "flag", "persist" };
	cudaDeviceProp prop;
	cudaStream_t st;
	float *buf;
	uint4 *w;
	unsigned *ctr;
	int bad = 0;

	CK(cudaGetDeviceProperties(&prop, 0));
	printf("# %s, %d SMs\n", prop.name, prop.multiProcessorCount);
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	CK(cudaMalloc(&buf, 2 * N * 4));
	CK(cudaMalloc(&ctr, S * sizeof(unsigned)));
	CK(cudaMalloc(&w, (size_t)S * (4 << 20)));
	CK(cudaMemset(w, 1, (size_t)S * (4 << 20)));
	CK(cudaMemset(buf, 0, 2 * N * 4));
	for (int m = 0; m < 4; m++)
		for (int G : { 1, 132 })
			bad |= !check(m, G, buf, w, ctr, st);
	printf("# checks %s\n", bad ? "FAILED" : "passed");
	printf("%8s %5s %8s %8s %8s %8s\n", "w_bytes", "G", "plain", "pdl", "flag", "persist");
	for (size_t wb : wbytes) {
		for (int G : Gs) {
			if (G > 2 * prop.multiProcessorCount)
				continue;
			printf("%8zu %5d", wb, G);
			for (int m = 0; m < 4; m++)
				printf(" %8.2f", run(m, G, S, wb / 16, buf, w, ctr, st));
			printf("   us a step (%s...)\n", names[0]);
		}
	}
	return bad;
}
