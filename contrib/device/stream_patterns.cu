// Which weight-streaming pattern of a one-row (M = 1) bf16 dot-product kernel reads HBM
// at its floor on an H200? The MoE single-row kernels (moe_small_m1.cu) stream their
// rows at 50-60% of the floor; this sweeps the pattern's knobs on the same arithmetic
// (16-byte bf16 chunks times fp32 x from shared memory, fp32 sums, a warp's shuffle
// tree per row) over buffers far larger than L2 or rotated copies of them.
//   RPW: rows a warp streams together (2: gate and up); UC: 16-byte chunks per lane in
//   one unit; D: units in flight per warp (a register ring); W: warps per CTA; C: CTAs
//   per SM (the grid is one wave: n_sm * C CTAs, each a contiguous block of rows).
//   batch_kernel: a group of RB whole rows loaded per warp before any FMA, in one wave
//   or one group per warp over as many CTAs as that takes.
// Prints per shape and pattern: us per call, TB/s, % of 4.25 TB/s; "plain read" is the
// same bytes read with 8 independent 16-byte loads per thread at full occupancy.
// Build (repository root): nvcc -O3 -arch=sm_90a -std=c++17 -I. -o stream_patterns
// contrib/device/stream_patterns.cu
// (a study, not part of the build; results: docs/results/stream-patterns-h200.txt).
//   ring (tma_kernel): the per-SM share in flight at once in shared memory by bulk copies.
//   async (async_kernel): stream_kernel's units through a per-warp ring of S units in
//   shared memory filled by cp.async, each lane its own slots, a commit group a unit and
//   cp.async.wait_group(S - 1): ptxas gives register loads one scoreboard and no partial
//   waits (session 13's SASS reading: stream_kernel's D units were ~1 in flight at each
//   wait, which is why D 2..8 measured alike), cp.async groups complete in order.
//   `stream_patterns check`: the ring's checks alone (for compute-sanitizer);
//   `stream_patterns only SHAPE`: one shape's rows, no checks (for ncu).
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#include "kernels/cuda/moe/moe_small.cuh"
#include "kernels/cuda/ptx.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// fma8 (the small MoE kernels' bf16 dot product) and warp_sum: moe_small.cuh's own.

// At the last unit of the warp's row group g: each of its RPW rows' warp sum into y
// (rows of [lo, hi) only), the sums cleared.
template <int RPW, int W>
__device__ __forceinline__ void rows_flush(float (&acc)[RPW], float *y, long long lo, long long hi,
					   int g)
{
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

#pragma unroll
	for (int r = 0; r < RPW; r++) {
		float s = warp_sum(acc[r]);
		long long row = lo + (long long)(warp + W * g) * RPW + r;
		if (lane == 0 && row < hi)
			y[row] = s;
		acc[r] = 0.f;
	}
}

template <int RPW, int UC, int D, int W, int C, int LD>
__global__ void __launch_bounds__(W * 32, C)
stream_kernel(const uint16_t *w, const float *x, float *y, int R, int nc)
{
	extern __shared__ float4 xs[];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	long long lo = (long long)R * blockIdx.x / gridDim.x, hi = (long long)R * (blockIdx.x + 1) / gridDim.x;
	int groups = (int)((hi - lo + RPW - 1) / RPW);			// row groups of the CTA
	int ulen = 32 * UC, nu = (nc + ulen - 1) / ulen;		// units per row
	int my = warp < groups ? (groups - warp + W - 1) / W : 0;	// the warp's row groups
	int K = my * nu;
	uint4 buf[D][RPW][UC];
	float acc[RPW];

	auto rowp = [&](int g, int r) {
		long long row = lo + (long long)(warp + W * g) * RPW + r;
		return row < hi ? (const uint4 *)(w + row * (long long)nc * 8) : (const uint4 *)nullptr;
	};
	auto load = [&](int k, uint4 (&b)[RPW][UC]) {
		int g = k / nu, cb = k % nu * ulen;
#pragma unroll
		for (int r = 0; r < RPW; r++) {
			const uint4 *p = rowp(g, r);
#pragma unroll
			for (int u = 0; u < UC; u++) {
				int c = cb + 32 * u + lane;
				if (LD == 0)
					b[r][u] = p && c < nc ? __ldcs(p + c) : make_uint4(0, 0, 0, 0);
				else
					b[r][u] = p && c < nc ? __ldg(p + c) : make_uint4(0, 0, 0, 0);
			}
		}
	};
#pragma unroll
	for (int d = 0; d < D; d++)
		if (d < K)
			load(d, buf[d]);
	for (int q = threadIdx.x; q < nc * 2; q += W * 32)
		xs[q] = ((const float4 *)x)[q];
	__syncthreads();
#pragma unroll
	for (int r = 0; r < RPW; r++)
		acc[r] = 0.f;
	for (int k0 = 0; k0 < K; k0 += D) {
#pragma unroll
		for (int d = 0; d < D; d++) {
			int k = k0 + d;
			if (k >= K)
				break;
			int cb = k % nu * ulen;
#pragma unroll
			for (int u = 0; u < UC; u++) {
				int c = cb + 32 * u + lane;
				if (c < nc) {
					float4 a = xs[2 * c], b = xs[2 * c + 1];
#pragma unroll
					for (int r = 0; r < RPW; r++)
						fma8(acc[r], buf[d][r][u], a, b);
				}
			}
			if (k + D < K)
				load(k + D, buf[d]);
			if (k % nu == nu - 1)
				rows_flush<RPW, W>(acc, y, lo, hi, k / nu);
		}
	}
}


// stream_kernel's units through a cp.async ring: slot k % S of the warp's ring holds
// unit k's RPW x UC chunks, lane-private (entry ((slot * RPW + r) * UC + u) * 32 + lane);
// the same FMAs in the same order as stream_kernel, so y equals its bits.
template <int RPW, int UC, int S, int W, int C>
__global__ void __launch_bounds__(W * 32, C)
async_kernel(const uint16_t *w, const float *x, float *y, int R, int nc)
{
	extern __shared__ float4 xs[];	// x (nc * 2 float4), then the warps' rings
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	long long lo = (long long)R * blockIdx.x / gridDim.x, hi = (long long)R * (blockIdx.x + 1) / gridDim.x;
	int groups = (int)((hi - lo + RPW - 1) / RPW);
	int ulen = 32 * UC, nu = (nc + ulen - 1) / ulen;
	int my = warp < groups ? (groups - warp + W - 1) / W : 0;
	int K = my * nu;
	uint4 *ring = (uint4 *)(xs + nc * 2) + (size_t)warp * S * RPW * UC * 32;
	float acc[RPW];

	auto rowp = [&](int g, int r) {
		long long row = lo + (long long)(warp + W * g) * RPW + r;
		return row < hi ? (const uint4 *)(w + row * (long long)nc * 8) : (const uint4 *)nullptr;
	};
	auto load = [&](int k) {	// unit k into its slot, one commit group (empty past K)
		if (k < K) {
			int g = k / nu, cb = k % nu * ulen;
#pragma unroll
			for (int r = 0; r < RPW; r++) {
				const uint4 *p = rowp(g, r);
#pragma unroll
				for (int u = 0; u < UC; u++) {
					int c = cb + 32 * u + lane;
					bool ok = p && c < nc;

					cp_async16(ring + ((size_t)((k % S) * RPW + r) * UC + u) * 32 + lane,
						   ok ? p + c : (const uint4 *)w, ok);
				}
			}
		}
		cp_async_commit();
	};
#pragma unroll
	for (int d = 0; d < S; d++)
		load(d);
	for (int q = threadIdx.x; q < nc * 2; q += W * 32)
		xs[q] = ((const float4 *)x)[q];
	__syncthreads();
#pragma unroll
	for (int r = 0; r < RPW; r++)
		acc[r] = 0.f;
	for (int k = 0; k < K; k++) {
		int cb = k % nu * ulen;

		cp_async_wait<S - 1>();	// unit k is in
#pragma unroll
		for (int u = 0; u < UC; u++) {
			int c = cb + 32 * u + lane;
			if (c < nc) {
				float4 a = xs[2 * c], b = xs[2 * c + 1];
#pragma unroll
				for (int r = 0; r < RPW; r++)
					fma8(acc[r], ring[((size_t)((k % S) * RPW + r) * UC + u) * 32 + lane], a, b);
			}
		}
		load(k + S);	// into the slot just read
		if (k % nu == nu - 1)
			rows_flush<RPW, W>(acc, y, lo, hi, k / nu);
	}
	cp_async_wait<0>();
}

// All of a group's loads first: each warp takes groups of RB rows, loads every chunk of
// them (CPL 16-byte chunks per lane and row: the whole row) before any FMA. ONE_WAVE:
// n_sm * C CTAs walk the groups; else one group per warp, as many CTAs as that takes.
template <int RB, int CPL, int W, int C, bool ONE_WAVE>
__global__ void __launch_bounds__(W * 32, C)
batch_kernel(const uint16_t *w, const float *x, float *y, int R, int nc)
{
	extern __shared__ float4 xs[];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	int groups = (R + RB - 1) / RB;
	int g0 = ONE_WAVE ? blockIdx.x * W + warp : blockIdx.x * W + warp;
	int gs = ONE_WAVE ? gridDim.x * W : groups;
	uint4 b[RB][CPL];

	for (int q = threadIdx.x; q < nc * 2; q += W * 32)
		xs[q] = ((const float4 *)x)[q];
	__syncthreads();
	for (int g = g0; g < groups; g += gs) {
#pragma unroll
		for (int r = 0; r < RB; r++) {
			long long row = (long long)g * RB + r;
			const uint4 *p = (const uint4 *)(w + row * (long long)nc * 8);
#pragma unroll
			for (int u = 0; u < CPL; u++) {
				int c = 32 * u + lane;
				b[r][u] = row < R && c < nc ? __ldcs(p + c) : make_uint4(0, 0, 0, 0);
			}
		}
#pragma unroll
		for (int r = 0; r < RB; r++) {
			float acc = 0.f;
#pragma unroll
			for (int u = 0; u < CPL; u++) {
				int c = 32 * u + lane;
				if (c < nc)
					fma8(acc, b[r][u], xs[2 * c], xs[2 * c + 1]);
			}
			acc = warp_sum(acc);
			long long row = (long long)g * RB + r;
			if (lane == 0 && row < R)
				y[row] = acc;
		}
	}
}


// Shared-memory ring fed by bulk copies (TMA, cp.async.bulk): one CTA per SM owns a
// contiguous block of rows; slots of SR whole rows (<= 16 KB), NS slots (<= ~200 KB in
// flight per SM, no registers held). Every slot's copy is issued at the start; a warp
// takes rows r = warp, warp + W, ... of the block, waits for its slot's mbarrier, dots
// the row from shared memory; the warp that finishes a slot's last row re-issues the
// slot for the rows NS slots on. A warp may reach slot s + NS's rows before another
// warp finished slot s's, and a parity wait cannot tell phase p from p - 2, so a warp
// first waits until its slot's copy is issued (`issued`): without that guard the first
// H200 run faulted on Kimi-K2's shapes (one-row slots); with it, not yet run.
__device__ __forceinline__ void mbar_init(unsigned long long *m, unsigned n)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(m)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(unsigned long long *m, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(m)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, unsigned long long *m)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
		     ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
		     "r"((unsigned)__cvta_generic_to_shared(m)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long *m, unsigned parity)
{
	asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}"
		     ::"r"((unsigned)__cvta_generic_to_shared(m)), "r"(parity) : "memory");
}

template <int W, int NS>
__global__ void __launch_bounds__(W * 32, 1)
tma_kernel(const uint16_t *w, const float *x, float *y, int R, int nc, int SR)
{
	extern __shared__ __align__(128) unsigned char sm[];
	__shared__ unsigned long long full[NS];
	__shared__ unsigned done[NS];
	__shared__ int issued[NS];	// uses of each ring entry issued so far (phases)
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	size_t rb = (size_t)nc * 16;
	long long lo = (long long)R * blockIdx.x / gridDim.x, hi = (long long)R * (blockIdx.x + 1) / gridDim.x;
	int n = (int)(hi - lo), nslot = (n + SR - 1) / SR;
	float4 *xs = (float4 *)(sm + (size_t)NS * SR * rb);

	auto issue = [&](int s) {	// slot s (of the block) into ring entry s % NS
		int r0 = s * SR, cnt = min(SR, n - r0);
		unsigned bytes = (unsigned)(cnt * rb);
		mbar_expect(&full[s % NS], bytes);
		bulk_copy(sm + (size_t)(s % NS) * SR * rb, w + (lo + r0) * (long long)nc * 8, bytes, &full[s % NS]);
		*(volatile int *)&issued[s % NS] = s / NS + 1;
	};
	if (threadIdx.x == 0) {
		for (int i = 0; i < NS; i++) {
			mbar_init(&full[i], 1);
			done[i] = 0;
			issued[i] = 0;
		}
		asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
		for (int s = 0; s < nslot && s < NS; s++)
			issue(s);
	}
	for (int q = threadIdx.x; q < nc * 2; q += W * 32)
		xs[q] = ((const float4 *)x)[q];
	__syncthreads();
	for (int r = warp; r < n; r += W) {
		int s = r / SR, e = s % NS;
		const uint4 *row = (const uint4 *)(sm + (size_t)e * SR * rb + (size_t)(r % SR) * rb);
		float acc = 0.f;

		// a parity wait cannot tell phase p from p - 2: wait until slot s's copy is
		// issued (entry e's phase s / NS began), then for its completion
		while (*(volatile int *)&issued[e] <= s / NS)
			;
		mbar_wait(&full[e], (unsigned)(s / NS) & 1);
		for (int c = lane; c < nc; c += 32)
			fma8(acc, row[c], xs[2 * c], xs[2 * c + 1]);
		acc = warp_sum(acc);
		if (lane == 0) {
			int cnt = min(SR, n - s * SR);
			y[lo + r] = acc;
			if (atomicAdd(&done[e], 1u) == (unsigned)cnt - 1) {	// the slot's last row
				done[e] = 0;
				if (s + NS < nslot) {
					asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
					issue(s + NS);
				}
			}
		}
		__syncwarp();
	}
}

// Plain read: every thread 8 independent 16-byte loads in flight, grid-stride, the
// tail (fewer than 8 strides left: all of a 25 MB buffer at this grid) loaded too.
// Session 8's version skipped the tail, so its Qwen3 rows read nothing (down) or 2/3
// of the bytes (gate/up): its "plain read" figures for them were wrong.
__global__ void empty_kernel() {}

__global__ void __launch_bounds__(256) read_kernel(const uint4 *p, size_t n, unsigned *sink)
{
	size_t i = (size_t)blockIdx.x * 256 + threadIdx.x, st = (size_t)gridDim.x * 256;
	unsigned a = 0;
	for (; i < n; i += 8 * st) {
		uint4 v[8];
#pragma unroll
		for (int u = 0; u < 8; u++)
			v[u] = i + u * st < n ? __ldcs(p + i + u * st) : make_uint4(0, 0, 0, 0);
#pragma unroll
		for (int u = 0; u < 8; u++)
			a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
	}
	if (a == 0x12345678u)
		*sink = a;
}

struct shape { const char *name; int row_bytes; int rows; };
static int n_sm;

// us per call of launch(i), i the call's index (its rotated copy): single, the median of
// 20 calls (after 4) each alone between two events, which adds the launch and the
// events' own cost (~5 us, the empty kernel's row); b2b, the median of 5 runs (after 2)
// of 16 calls back to back between two events, divided by 16: the launches overlap the
// kernels before them, so this is about the kernel alone. Session 8's tables were single.
struct timing {
	double single, b2b;
};

template <typename Launch>
static timing time_calls(Launch launch)
{
	cudaEvent_t a, b;
	std::vector<float> t, tb;

	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	for (int it = 0; it < 24; it++) {	// one call between two events
		float ms;

		CK(cudaEventRecord(a));
		launch(it);
		CK(cudaEventRecord(b));
		CK(cudaEventSynchronize(b));
		CK(cudaEventElapsedTime(&ms, a, b));
		if (it >= 4)
			t.push_back(ms * 1000.f);
	}
	for (int it = 0; it < 7; it++) {	// 16 calls back to back between two events
		float ms;

		CK(cudaEventRecord(a));
		for (int c = 0; c < 16; c++)
			launch(it * 16 + c);
		CK(cudaEventRecord(b));
		CK(cudaEventSynchronize(b));
		CK(cudaEventElapsedTime(&ms, a, b));
		if (it >= 2)
			tb.push_back(ms * 1000.f / 16);
	}
	CK(cudaGetLastError());
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	std::sort(t.begin(), t.end());
	std::sort(tb.begin(), tb.end());
	return { t[t.size() / 2], tb[tb.size() / 2] };
}

// One table row: the pattern's registers and occupancy (kernel k; none for the plain
// read), us per call, TB/s and % of the 4.25 TB/s floor.
static void report(const shape &s, const char *tag, const void *k, int threads, size_t smem, timing tm,
		   const char *extra)
{
	double bytes = (double)s.row_bytes * s.rows;
	char kern[40] = "";

	if (k) {
		cudaFuncAttributes fa;
		int occ = 0;

		CK(cudaFuncGetAttributes(&fa, k));
		CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, threads, smem));
		snprintf(kern, sizeof(kern), "regs %3d occ %d", fa.numRegs, occ);
	}
	double us = tm.b2b;

	printf("%-14s %-28s %-16s %9.2f us  %5.2f TB/s  %3.0f%%  (alone %7.2f us)%s\n", s.name, tag, kern, us,
	       bytes / us / 1e6, 100.0 * bytes / us / 1e6 / 4.25, tm.single, extra);
}

template <int RPW, int UC, int D, int W, int C, int LD>
static void run(const char *tag, const shape &s, std::vector<uint16_t *> &bufs, const float *x, float *y)
{
	auto k = stream_kernel<RPW, UC, D, W, C, LD>;
	int nc = s.row_bytes / 16, grid = n_sm * C;
	size_t smem = (size_t)nc * 32;

	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
	timing us = time_calls([&](int i) {
		k<<<grid, W * 32, smem>>>(bufs[i % bufs.size()], x, y, s.rows, nc);
	});
	report(s, tag, (const void *)k, W * 32, smem, us, "");
}

template <int RPW, int UC, int S, int W, int C>
static void runa(const char *tag, const shape &s, std::vector<uint16_t *> &bufs, const float *x, float *y)
{
	auto k = async_kernel<RPW, UC, S, W, C>;
	int nc = s.row_bytes / 16, grid = n_sm * C;
	size_t smem = (size_t)nc * 32 + (size_t)W * S * RPW * UC * 32 * 16;

	if (smem * C > 227 * 1024)
		return;
	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	timing us = time_calls([&](int i) {
		k<<<grid, W * 32, smem>>>(bufs[i % bufs.size()], x, y, s.rows, nc);
	});
	report(s, tag, (const void *)k, W * 32, smem, us, "");
}

// Random weights of shape s uploaded, one kernel's y (launch(d, y)) against the register
// kernel's (ref(d, y2)): what row sums differ (the same sums in the same order: none).
template <typename Launch, typename Ref>
static void check_same(const shape &s, const char *what, float *y, Launch launch, Ref ref,
		       unsigned v)
{
	size_t bytes = (size_t)s.row_bytes * s.rows;
	std::vector<uint16_t> h(bytes / 2);
	std::vector<float> a(s.rows), b(s.rows);
	uint16_t *d;
	float *y2;
	int bad = 0;

	for (auto &e : h) {
		v = v * 1664525u + 1013904223u;
		e = (uint16_t)(0x3c00 + (v >> 24));
	}
	CK(cudaMalloc(&d, bytes));
	CK(cudaMalloc(&y2, s.rows * sizeof(float)));
	CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
	launch(d, y);
	ref(d, y2);
	CK(cudaDeviceSynchronize());
	CK(cudaMemcpy(a.data(), y, s.rows * 4, cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(b.data(), y2, s.rows * 4, cudaMemcpyDeviceToHost));
	for (int i = 0; i < s.rows; i++)
		bad += a[i] != b[i];
	printf("%-14s %s check: %d of %d rows differ from the register kernel\n", s.name, what, bad,
	       s.rows);
	cudaFree(d);
	cudaFree(y2);
}

// async_kernel's y against stream_kernel's on random weights.
static void check_async(const shape &s, const float *x, float *y)
{
	int nc = s.row_bytes / 16;
	size_t smem = (size_t)nc * 32 + (size_t)8 * 3 * 2 * 4 * 32 * 16;
	auto k = async_kernel<2, 4, 3, 8, 2>;
	auto k2 = stream_kernel<2, 4, 2, 8, 2, 0>;

	if (smem * 2 > 227 * 1024)
		return;
	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	CK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
	check_same(s, "async", y, [&](const uint16_t *d, float *o) {
		k<<<n_sm * 2, 256, smem>>>(d, x, o, s.rows, nc);
	}, [&](const uint16_t *d, float *o) {
		k2<<<n_sm * 2, 256, nc * 32>>>(d, x, o, s.rows, nc);
	}, 54321);
}

template <int RB, int CPL, int W, int C, bool ONE_WAVE>
static void runb(const char *tag, const shape &s, std::vector<uint16_t *> &bufs, const float *x, float *y)
{
	auto k = batch_kernel<RB, CPL, W, C, ONE_WAVE>;
	int nc = s.row_bytes / 16, groups = (s.rows + RB - 1) / RB;
	int grid = ONE_WAVE ? n_sm * C : (groups + W - 1) / W;
	size_t smem = (size_t)nc * 32;
	char extra[32];

	if (nc > 32 * CPL)
		return;
	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
	timing us = time_calls([&](int i) {
		k<<<grid, W * 32, smem>>>(bufs[i % bufs.size()], x, y, s.rows, nc);
	});
	snprintf(extra, sizeof(extra), "  grid %d", grid);
	report(s, tag, (const void *)k, W * 32, smem, us, extra);
}

template <int W, int NS>
static void runt(const char *tag, const shape &s, std::vector<uint16_t *> &bufs, const float *x, float *y,
		 int slot_bytes)
{
	auto k = tma_kernel<W, NS>;
	int nc = s.row_bytes / 16, SR = std::max(1, slot_bytes / s.row_bytes);
	size_t smem = (size_t)NS * SR * s.row_bytes + (size_t)nc * 32;
	char extra[32];

	if (smem > 227 * 1024)
		return;
	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	timing us = time_calls([&](int i) {
		k<<<n_sm, W * 32, smem>>>(bufs[i % bufs.size()], x, y, s.rows, nc, SR);
	});
	snprintf(extra, sizeof(extra), "  slot %d rows", SR);
	report(s, tag, (const void *)k, W * 32, smem, us, extra);
}

// The ring kernel's y against the register kernel's on random weights.
static void check_tma(const shape &s, const float *x, float *y)
{
	int nc = s.row_bytes / 16, SR = std::max(1, 16384 / s.row_bytes);
	size_t smem = (size_t)12 * SR * s.row_bytes + (size_t)nc * 32;
	auto k = tma_kernel<8, 12>;
	auto k2 = stream_kernel<1, 4, 2, 8, 2, 0>;

	CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	CK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
	check_same(s, "ring", y, [&](const uint16_t *d, float *o) {
		k<<<n_sm, 256, smem>>>(d, x, o, s.rows, nc, SR);
	}, [&](const uint16_t *d, float *o) {
		k2<<<n_sm * 2, 256, nc * 32>>>(d, x, o, s.rows, nc);
	}, 12345);
}

int main(int argc, char **argv)
{
	cudaDeviceProp pr;
	CK(cudaGetDeviceProperties(&pr, 0));
	n_sm = pr.multiProcessorCount;
	shape shapes[] = {
		{ "kimi-gate/up", 14336, 36864 },	// 9 experts x 4096 rows of 7168 bf16: 528 MB
		{ "qwen3-gate/up", 4096, 12288 },	// 8 experts x 1536 rows of 2048: 50 MB
		{ "qwen3-down", 1536, 16384 },		// 8 x 2048 rows of 768: 25 MB
		{ "kimi-down", 4096, 64512 },		// 9 x 7168 rows of 2048: 264 MB
	};
	float *x, *y;
	unsigned *sink;
	CK(cudaMalloc(&x, 64 * 1024));
	CK(cudaMalloc(&y, 64512 * sizeof(float)));
	CK(cudaMalloc(&sink, 4));
	{ std::vector<float> hx(16384); unsigned v = 7; for (auto &e : hx) { v = v * 1664525u + 1013904223u; e = (float)(v >> 8) / 16777216.f - 0.5f; } CK(cudaMemcpy(x, hx.data(), 64 * 1024, cudaMemcpyHostToDevice)); }
	for (auto &s : shapes)	// "check": the ring kernel's checks alone (compute-sanitizer)
		if (argc == 1 || !strcmp(argv[1], "check")) {
			check_tma(s, x, y);
			check_async(s, x, y);
		}
	const char *only = argc > 2 && !strcmp(argv[1], "only") ? argv[2] : nullptr;
	if (argc > 1 && !only)
		return 0;
	printf("# %s, %d SMs; median of 20 calls, each on the next of the rotated copies (>= 400 MB in all)\n", pr.name, n_sm);
	for (auto &s : shapes) {
		if (only && strcmp(only, s.name))
			continue;
		size_t bytes = (size_t)s.row_bytes * s.rows;
		int copies = (int)std::max<size_t>(1, (400ull << 20) / bytes + 1);
		std::vector<uint16_t *> bufs(copies);
		for (auto &p : bufs) {
			CK(cudaMalloc(&p, bytes));
			CK(cudaMemset(p, 0, bytes));
		}
		report(s, "empty kernel (fixed cost)", nullptr, 0, 0, time_calls([&](int) {
			empty_kernel<<<n_sm * 8, 256>>>();
		}), "");
		report(s, "plain read 8x16B/thread", nullptr, 0, 0, time_calls([&](int i) {
			read_kernel<<<n_sm * 8, 256>>>((const uint4 *)bufs[i % copies], bytes / 16, sink);
		}), "");
		run<2, 4, 2, 8, 2, 0>("RPW2 UC4 D2 W8 C2 (m1)", s, bufs, x, y);
		run<2, 4, 2, 8, 2, 1>("RPW2 UC4 D2 W8 C2 ldg", s, bufs, x, y);
		run<2, 2, 4, 8, 2, 0>("RPW2 UC2 D4 W8 C2", s, bufs, x, y);
		run<2, 4, 3, 4, 2, 0>("RPW2 UC4 D3 W4 C2", s, bufs, x, y);
		run<1, 4, 2, 8, 2, 0>("RPW1 UC4 D2 W8 C2", s, bufs, x, y);
		run<1, 4, 4, 8, 2, 0>("RPW1 UC4 D4 W8 C2", s, bufs, x, y);
		run<1, 8, 2, 8, 2, 0>("RPW1 UC8 D2 W8 C2", s, bufs, x, y);
		run<1, 2, 4, 8, 4, 0>("RPW1 UC2 D4 W8 C4", s, bufs, x, y);
		run<1, 4, 2, 8, 3, 0>("RPW1 UC4 D2 W8 C3", s, bufs, x, y);
		run<1, 2, 8, 8, 2, 0>("RPW1 UC2 D8 W8 C2", s, bufs, x, y);
		run<1, 4, 3, 4, 4, 0>("RPW1 UC4 D3 W4 C4", s, bufs, x, y);
		run<2, 4, 2, 8, 1, 0>("RPW2 UC4 D2 W8 C1", s, bufs, x, y);
		runa<2, 4, 3, 8, 2>("async RPW2 UC4 S3 W8 C2", s, bufs, x, y);	// m1 gate/up's
		runa<2, 4, 2, 8, 2>("async RPW2 UC4 S2 W8 C2", s, bufs, x, y);
		runa<2, 2, 6, 8, 2>("async RPW2 UC2 S6 W8 C2", s, bufs, x, y);
		runa<1, 4, 4, 8, 2>("async RPW1 UC4 S4 W8 C2", s, bufs, x, y);	// m1 down's
		runa<1, 3, 4, 8, 2>("async RPW1 UC3 S4 W8 C2", s, bufs, x, y);
		runa<1, 2, 8, 8, 2>("async RPW1 UC2 S8 W8 C2", s, bufs, x, y);
		runa<1, 4, 3, 8, 3>("async RPW1 UC4 S3 W8 C3", s, bufs, x, y);
		runt<8, 12>("ring W8 12x16KB", s, bufs, x, y, 16384);
		runt<8, 6>("ring W8 6x32KB", s, bufs, x, y, 32768);
		runt<16, 12>("ring W16 12x16KB", s, bufs, x, y, 16384);
		runt<8, 24>("ring W8 24x8KB", s, bufs, x, y, 8192);
		runt<8, 4>("ring W8 4x16KB (small ring)", s, bufs, x, y, 16384);
		runb<8, 3, 8, 2, true>("batch RB8 CPL3 W8 C2 wave", s, bufs, x, y);
		runb<8, 3, 8, 2, false>("batch RB8 CPL3 W8 C2 many", s, bufs, x, y);
		runb<4, 3, 8, 3, false>("batch RB4 CPL3 W8 C3 many", s, bufs, x, y);
		runb<2, 3, 4, 8, false>("batch RB2 CPL3 W4 C8 many", s, bufs, x, y);
		runb<3, 8, 8, 2, true>("batch RB3 CPL8 W8 C2 wave", s, bufs, x, y);
		runb<3, 8, 8, 2, false>("batch RB3 CPL8 W8 C2 many", s, bufs, x, y);
		runb<2, 8, 8, 3, false>("batch RB2 CPL8 W8 C3 many", s, bufs, x, y);
		runb<1, 8, 4, 8, false>("batch RB1 CPL8 W4 C8 many", s, bufs, x, y);
		for (auto p : bufs)
			cudaFree(p);
	}
	return 0;
}
