// The warpgroup tensor-core (wgmma, sm_90a) weight-streaming kernel for decode batches of
// 9..64 rows: the linear_stream.cu pipeline (cp.async stages of swizzled 128-byte rows,
// weights issued before the PDL wait, K split over CTAs), with the products on
// wgmma.mma_async instead of mma.sync. The K slices of a tile are added in slice order
// either by the S CTAs of a thread-block cluster through distributed shared memory, each
// summing 1/S of the tile (the default), or by the last CTA of the tile through a global
// workspace (ctx->wg_cluster = 0): the same bits, but the latter round-trips 32 KB per
// CTA at M = 64 through L2 and leaves one CTA summing S of them alone at the end.
//
// Why: at M = 64 and 4.25 TB/s an SM must sustain ~1040 bf16 flop/clk, ~80% of what
// mma.sync issues on H200, so linear_stream is bound by instruction issue there and
// cuBLAS leaves the Llama-3.1-8B layers at 61-85% of the HBM floor. wgmma does twice the
// work per issue and reads both operands from shared memory itself (no ldmatrix).
//
// Layout. A CTA owns ROWS (128 or 256) weight rows and one K slice; each of its 2 or 4
// warpgroups (4 warps) one m64 tile of 64 rows, against all x rows: a warpgroup per
// tile rather than one with several tiles gives the copies, the fragment stores and
// the split reduction more threads, so more loads in flight. Every stage carries the x
// rows (XROWS x 64 k) beside the weights: at M = 64 that adds 50% to the bytes an SM
// loads with 128 rows and 25% with 256 (one CTA per SM then, 5 stages). y^T (N, M) = W (N, K) x^T:
// W is the A operand (the 64 rows of an m64 tile, k contiguous), x the B operand
// (XROWS = 16/32/64 rows, k contiguous), both K-major in shared memory with the 128-byte
// swizzle: a stage holds 64 k (one 128-byte line) of every row, 16-byte chunk c of row
// r at r * 128 + ((c ^ (r & 7)) << 4) from a 1024-byte aligned base, which is the
// address pattern the hardware's 128B mode applies (address bits 4-6 ^= bits 7-9). The
// descriptors: start >> 4, stride byte offset 1024 (from one 8-row group to the next),
// leading byte offset unused (each k16 step lies inside the 128-byte line: its start
// advances 32 bytes), mode 1 = 128B.
//
// Accumulators (m64nN, fp32): thread (warp w of its warpgroup, lane l) holds d[4i + c]
// for weight row 16w + l/4 + 8 (c >> 1) of its m64 tile and x row 8i + 2 (l % 4) +
// (c & 1).
//
// Proxies: cp.async writes shared memory through the generic proxy and wgmma reads it
// through the async proxy, so each thread fences (fence.proxy.async) after its copies
// land and before the barrier that lets the warpgroup issue wgmma on them; a buffer is
// refilled only after wgmma.wait_group 0 has retired every read of it.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cooperative_groups.h>
#include <cuda.h>		// CUtensorMap (the encoder comes from the runtime's entry point)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "kernels/cuda/attn_ptx.cuh"
#include "kernels/cuda/linear_internal.h"

namespace cg = cooperative_groups;

#define WG_BK		64	/* k per stage: one 128-byte line of each row */
#define WG_ALIGN	1024	/* the 128B swizzle pattern repeats every 8 rows of 128 bytes */
/* Fixed cost of a CTA (prologue, epilogue, pipeline ramp) in stages, for the split. */
#define WG_CTA_OVERHEAD	3

/* NT n8 tiles of x rows; ROWS weight rows per CTA (128: 2 warpgroups, 2 CTAs per SM;
 * 256: 4 warpgroups, 1 CTA per SM, each stage's x shared by twice the weight rows). */
template <int NT, int ROWS> struct wg_cfg {
	static_assert(ROWS == 128 || ROWS == 256, "one m64 tile per warpgroup, 2 or 4");
	static constexpr int THREADS = ROWS * 2;		// one warpgroup per 64 rows
	static constexpr int MIN_BLOCKS = ROWS == 128 ? 2 : 1;	// per SM (launch bounds)
	static constexpr int STAGES = ROWS == 128 ? 4 : 5;	// buffers
	static constexpr int AHEAD = STAGES - 1;		// stages in flight ahead
	static constexpr int XROWS = NT * 8;			// x rows per launch: the wgmma N
	static constexpr int ACC = NT * 4;			// fp32 accumulators per m64 tile
	static constexpr int W_BYTES = ROWS * WG_BK * 2;	// 16, 32 KB
	static constexpr int X_BYTES = XROWS * WG_BK * 2;	// 2, 4, 8 KB
	static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;	// multiples of WG_ALIGN
	static constexpr int SMEM = STAGES * STAGE_BYTES + WG_ALIGN;	// + alignment slack
	// Row stride (floats) of a partial tile (x row, weight row) in shared memory for
	// the cluster reduction: +4 puts the 4 x rows a warp's fragment store spans (2
	// apart) on banks 8 apart, so the 32 lanes hit 32 banks.
	static constexpr int PSTRIDE = ROWS + 4;
	static_assert(XROWS * PSTRIDE * 4 <= STAGES * STAGE_BYTES,
		      "the cluster reduction's partial tile reuses the stages");
	static_assert(SMEM <= 227 * 1024, "one CTA per SM at most");
};

// ---- PTX --------------------------------------------------------------------------

// nvcc -arch=sm_90a also builds compute_90 PTX, which has no wgmma: there the kernel
// traps (the device runs the sm_90a image; the PTX would only be JIT-compiled for
// another architecture, where the launch is never made on purpose).
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define WG_ASM(...)	asm volatile(__VA_ARGS__)
#else
#define WG_ASM(...)	__trap()
#endif

// Shared-memory matrix descriptor of a K-major, 128B-swizzled tile at shared address
// addr (1024-byte aligned, or advanced by k16 steps of 32 bytes within its lines).
static __device__ __forceinline__ uint64_t wg_desc(uint32_t addr)
{
	return (uint64_t)((addr & 0x3ffff) >> 4) |		// start address, bits 0-13
	       ((uint64_t)1 << 16) |				// leading byte offset: unused
	       ((uint64_t)(1024 >> 4) << 32) |			// stride byte offset, 8 rows
	       ((uint64_t)1 << 62);				// 128B swizzle
}

// ---- TMA (ctx->wg_tma) ----------------------------------------------------------------
// One thread per CTA issues each stage as two tensor copies (cp.async.bulk.tensor: the
// weight box ROWS x 64 k, the x box XROWS x 64 k) that signal the stage's mbarrier with
// their byte count; every thread waits on that barrier's phase. The tensor maps carry the
// 128B swizzle, the same pattern wg_swz writes, and fill rows past N or M and k past K
// with zeros (counted in the bytes).

static __device__ __forceinline__ void wg_mbar_init(uint32_t bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(bar), "r"(count) : "memory");
}

// Makes the barrier inits visible to the async proxy (the tensor copies) and the cluster.
static __device__ __forceinline__ void wg_mbar_init_fence()
{
	asm volatile("fence.mbarrier_init.release.cluster;" : : : "memory");
}

// This thread's arrival (the barrier's only one) with bytes more to come.
static __device__ __forceinline__ void wg_mbar_expect(uint32_t bar, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
		     : : "r"(bar), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void wg_mbar_wait(uint32_t bar, unsigned parity)
{
	uint32_t done;

	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n}"
			     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
	} while (!done);
}

// The box at (c0 = k, c1 = row) of map into shared memory dst, completing on bar.
static __device__ __forceinline__ void wg_tma_2d(uint32_t dst, const CUtensorMap *map, int c0,
						 int c1, uint32_t bar)
{
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile"
		     ".mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
		     : : "r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

static __device__ __forceinline__ void wg_fence_proxy_async()
{
	asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

static __device__ __forceinline__ void wg_fence()
{
	WG_ASM("wgmma.fence.sync.aligned;" ::: "memory");
}

static __device__ __forceinline__ void wg_commit()
{
	WG_ASM("wgmma.commit_group.sync.aligned;" ::: "memory");
}

static __device__ __forceinline__ void wg_wait_all()
{
	WG_ASM("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across the
// asynchronous wgmma that owns it (the asm statements do not say when it lands).
template <int R> static __device__ __forceinline__ void wg_fence_regs(float (&d)[R])
{
#pragma unroll
	for (int i = 0; i < R; i++)
		asm volatile("" : "+f"(d[i]) : : "memory");
}

// The products. scale-d is a predicate (true: add to d); then the immediates scale A
// and B by 1 and transpose neither (both K-major).

// d (64 x 16) += A (64 x 16, descriptor a) B^T (B 16 x 16, descriptor b), both K-major.
static __device__ __forceinline__ void wg_mma_n16(float (&d)[8], uint64_t a, uint64_t b)
{
	WG_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t"
	       "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
	       "{%0, %1, %2, %3, %4, %5, %6, %7}, "
	       "%8, %9, p, 1, 1, 0, 0;\n}"
	       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
	         "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
	       : "l"(a), "l"(b), "r"(1));
}

// d (64 x 32) += A (64 x 16, descriptor a) B^T (B 32 x 16, descriptor b), both K-major.
static __device__ __forceinline__ void wg_mma_n32(float (&d)[16], uint64_t a, uint64_t b)
{
	WG_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
	       "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
	       "{%0, %1, %2, %3, %4, %5, %6, %7,"
	       "%8, %9, %10, %11, %12, %13, %14, %15}, "
	       "%16, %17, p, 1, 1, 0, 0;\n}"
	       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
	         "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
	         "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
	         "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
	       : "l"(a), "l"(b), "r"(1));
}

// d (64 x 64) += A (64 x 16, descriptor a) B^T (B 64 x 16, descriptor b), both K-major.
static __device__ __forceinline__ void wg_mma_n64(float (&d)[32], uint64_t a, uint64_t b)
{
	WG_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
	       "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
	       "{%0, %1, %2, %3, %4, %5, %6, %7,"
	       "%8, %9, %10, %11, %12, %13, %14, %15,"
	       "%16, %17, %18, %19, %20, %21, %22, %23,"
	       "%24, %25, %26, %27, %28, %29, %30, %31}, "
	       "%32, %33, p, 1, 1, 0, 0;\n}"
	       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
	         "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
	         "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
	         "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
	         "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
	         "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
	         "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
	         "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
	       : "l"(a), "l"(b), "r"(1));
}

template <int NT>
static __device__ __forceinline__ void wg_mma(float (&d)[NT * 4], uint64_t a, uint64_t b)
{
	if constexpr (NT == 2)
		wg_mma_n16(d, a, b);
	else if constexpr (NT == 4)
		wg_mma_n32(d, a, b);
	else
		wg_mma_n64(d, a, b);
}

// ---- kernel -----------------------------------------------------------------------

// Byte offset of (row, 16-byte chunk) in a tile of 128-byte rows (128B swizzle).
static __device__ __forceinline__ uint32_t wg_swz(int row, int chunk)
{
	return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// The weight part of a stage: rows n0 .. n0+ROWS-1, k k0 .. k0+63 (zeros past N or kend).
template <int ROWS>
static __device__ __forceinline__ void wg_load_w(unsigned char *ws, const uint16_t *w, int N,
						 int K, int n0, int k0, int kend, int tid)
{
	constexpr int T = wg_cfg<2, ROWS>::THREADS;

#pragma unroll
	for (int j = 0; j < ROWS * 8 / T; j++) {
		const int i = tid + j * T, r = i >> 3, c = i & 7, k = k0 + c * 8;
		const bool ok = n0 + r < N && k < kend;

		cp_async16(ws + wg_swz(r, c), ok ? w + (size_t)(n0 + r) * K + k : w, ok);
	}
}

// The x part of a stage: x rows 0 .. XROWS-1 (zeros past M), same k.
template <int NT, int ROWS>
static __device__ __forceinline__ void wg_load_x(unsigned char *xs, const uint16_t *xb, int M,
						 int K, int k0, int kend, int tid)
{
#pragma unroll
	for (int i = tid; i < wg_cfg<NT, ROWS>::XROWS * 8; i += wg_cfg<NT, ROWS>::THREADS) {
		const int r = i >> 3, c = i & 7, k = k0 + c * 8;
		const bool ok = r < M && k < kend;

		cp_async16(xs + wg_swz(r, c), ok ? xb + (size_t)r * K + k : xb, ok);
	}
}

// One stage: 4 k16 steps of the warpgroup's m64 weight tile (wsa: its first row)
// against the x tile, issued as one wgmma group and retired before returning (the
// caller then may refill any buffer).
template <int NT>
static __device__ __forceinline__ void wg_compute(float (&acc)[NT * 4], uint32_t wsa,
						  uint32_t xsa)
{
	wg_fence_regs(acc);
	wg_fence();
#pragma unroll
	for (int kk = 0; kk < WG_BK / 16; kk++)
		wg_mma<NT>(acc, wg_desc(wsa + kk * 32), wg_desc(xsa + kk * 32));
	wg_commit();
	wg_wait_all();
	wg_fence_regs(acc);
}

// Accumulator c (0..3) of n8 group i, for warp w (of the CTA: warpgroup w / 4) and
// lane l: its weight row within the CTA's tile and its x row.
static __device__ __forceinline__ int wg_frag_row(int warp, int lane, int c)
{
	return warp * 16 + (lane >> 2) + (c >> 1) * 8;
}

static __device__ __forceinline__ int wg_frag_m(int i, int lane, int c)
{
	return i * 8 + (lane & 3) * 2 + (c & 1);
}

// The S partial tiles of this CTA's weight tile, added in split order into y by the CTA
// that arrived last; tp: (S, XROWS, ROWS) fp32.
template <int NT, int ROWS>
static __device__ __forceinline__ void wg_reduce(float *y, const float *tp, int M, int N, int n0,
						 int S, int accumulate, int tid)
{
	constexpr int TILE = wg_cfg<NT, ROWS>::XROWS * ROWS, WG_ROWS = ROWS;
	constexpr int WG_THREADS = wg_cfg<NT, ROWS>::THREADS;

	// 2 x 4 outputs per thread and step, all 2 S loads issued before the adds (in split
	// order) and the stores: the sum is latency-bound, not bandwidth-bound (at M = 64
	// and S = 8 a tile's partials are 256 KB)
	for (int e0 = tid * 4; e0 < M * WG_ROWS; e0 += 2 * WG_THREADS * 4) {
		float4 v[2][LIN_ST_MAX_SPLIT];

#pragma unroll
		for (int h = 0; h < 2; h++) {
			const int e = e0 + h * WG_THREADS * 4;

#pragma unroll
			for (int q = 0; q < LIN_ST_MAX_SPLIT; q++)
				if (q < S && e < M * WG_ROWS)
					v[h][q] = __ldcg((const float4 *)(tp + (size_t)q * TILE + e));
		}
#pragma unroll
		for (int h = 0; h < 2; h++) {
			const int e = e0 + h * WG_THREADS * 4, m = e / WG_ROWS, r = e % WG_ROWS;

			if (e >= M * WG_ROWS)
				break;
			float sum[4] = { v[h][0].x, v[h][0].y, v[h][0].z, v[h][0].w };

#pragma unroll
			for (int q = 1; q < LIN_ST_MAX_SPLIT; q++)
				if (q < S) {
					sum[0] += v[h][q].x;
					sum[1] += v[h][q].y;
					sum[2] += v[h][q].z;
					sum[3] += v[h][q].w;
				}
#pragma unroll
			for (int i = 0; i < 4; i++)
				if (n0 + r + i < N) {
					float *p = y + (size_t)m * N + n0 + r + i;

					*p = accumulate ? *p + sum[i] : sum[i];
				}
		}
	}
}

// The cluster's S partial tiles of its weight tile, in rank (= slice) order, as
// wg_reduce adds them: each CTA writes its tile into its own (idle) stage buffers, then
// sums 1/S of the tile's outputs from all S CTAs' shared memory into y. No global
// workspace, no counter, no CTA that sums alone; part: 1024-aligned shared memory.
template <int NT, int ROWS>
static __device__ __forceinline__ void wg_cluster_reduce(float *y, const float (&acc)[NT * 4],
							 float *part, int M, int N, int n0,
							 int accumulate, int warp, int lane, int tid)
{
	constexpr int Q = ROWS / 4;	// float4 groups per partial row
	constexpr int WG_PSTRIDE = wg_cfg<NT, ROWS>::PSTRIDE;
	constexpr int WG_THREADS = wg_cfg<NT, ROWS>::THREADS;
	cg::cluster_group cluster = cg::this_cluster();
	const int S = (int)cluster.num_blocks(), s = (int)cluster.block_rank();
	const int E = M * Q, per = (E + S - 1) / S, e1 = min(E, (s + 1) * per);

	__syncthreads();	// both warpgroups' last wgmma (reads of the stages) retired
#pragma unroll
	for (int i = 0; i < NT; i++)
#pragma unroll
		for (int c = 0; c < 4; c++)
			part[wg_frag_m(i, lane, c) * WG_PSTRIDE + wg_frag_row(warp, lane, c)] =
				acc[4 * i + c];
	cluster.sync();		// every rank's partials written and visible
	for (int e = s * per + tid; e < e1; e += WG_THREADS) {
		const int m = e / Q, r = (e % Q) * 4;
		const float *src = part + m * WG_PSTRIDE + r;
		float4 v[LIN_ST_MAX_SPLIT];

		// all S loads in flight before the adds: distributed shared memory has
		// ~L2-like latency
#pragma unroll
		for (int q = 0; q < LIN_ST_MAX_SPLIT; q++)
			if (q < S)
				v[q] = *(const float4 *)cluster.map_shared_rank(src, q);
		float sum[4] = { v[0].x, v[0].y, v[0].z, v[0].w };

#pragma unroll
		for (int q = 1; q < LIN_ST_MAX_SPLIT; q++)
			if (q < S) {
				sum[0] += v[q].x;
				sum[1] += v[q].y;
				sum[2] += v[q].z;
				sum[3] += v[q].w;
			}
#pragma unroll
		for (int i = 0; i < 4; i++)
			if (n0 + r + i < N) {
				float *p = y + (size_t)m * N + n0 + r + i;

				*p = accumulate ? *p + sum[i] : sum[i];
			}
	}
	cluster.sync();		// keep the partials alive until every rank has read them
}

// grid (tiles, S): blockIdx.x the ROWS-row tile, blockIdx.y the K slice [s KS, s KS + KS).
// xb: bf16 x (M, K) row-major. cl: launched in clusters of (1, S, 1), which reduce in
// shared memory; otherwise ws: (tiles * S, XROWS, ROWS) fp32 partials and cnt:
// (tiles) arrival counters, zero between launches. Needs K % 8 == 0, w and xb 16-byte
// aligned, M <= XROWS.
template <int NT, int ROWS, bool TMA>
__global__ void __launch_bounds__(wg_cfg<NT, ROWS>::THREADS, wg_cfg<NT, ROWS>::MIN_BLOCKS)
wg_kernel(float *y, const uint16_t *xb, const uint16_t *__restrict__ w, int M, int N, int K,
	  int KS, int accumulate, int cl, float *ws, unsigned *cnt, int pdl,
	  const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx)
{
	using C = wg_cfg<NT, ROWS>;
	constexpr int WG_ROWS = ROWS, WG_STAGES = C::STAGES, WG_AHEAD = C::AHEAD;
	extern __shared__ __align__(128) unsigned char wg_smem_raw[];
	__shared__ bool wg_last;
	__shared__ __align__(8) uint64_t wg_bar[wg_cfg<NT, ROWS>::STAGES];	// TMA only
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
	const int tile = blockIdx.x, S = gridDim.y, s = blockIdx.y;
	const int n0 = tile * WG_ROWS, k0 = s * KS, kend = min(K, k0 + KS);
	const int nb = (kend - k0 + WG_BK - 1) / WG_BK;
	const uint32_t raw = (uint32_t)__cvta_generic_to_shared(wg_smem_raw);
	// the swizzle atoms must start on 1024 bytes; dynamic shared memory follows wg_last
	const uint32_t pad = (WG_ALIGN - (raw & (WG_ALIGN - 1))) & (WG_ALIGN - 1);
	unsigned char *smem_p = wg_smem_raw + pad;
	const uint32_t smem = raw + pad;
	float acc[C::ACC];

#pragma unroll
	for (int i = 0; i < C::ACC; i++)
		acc[i] = 0.f;

	const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(wg_bar);

	if constexpr (TMA) {
		// weights are constant: the first stages stream in while the previous kernel
		// drains; each stage's barrier expects its weight and x bytes at once
		if (tid == 0) {
			for (int b = 0; b < WG_STAGES; b++)
				wg_mbar_init(bar0 + 8 * b, 1);
			wg_mbar_init_fence();
			for (int i = 0; i < WG_AHEAD && i < nb; i++) {
				wg_mbar_expect(bar0 + 8 * i, C::STAGE_BYTES);
				wg_tma_2d(smem + i * C::STAGE_BYTES, &tw, k0 + i * WG_BK, n0,
					  bar0 + 8 * i);
			}
		}
		k_cuda_lin_inputs_ready(pdl);	// x and y only from here on
		if (tid == 0)
			for (int i = 0; i < WG_AHEAD && i < nb; i++)
				wg_tma_2d(smem + i * C::STAGE_BYTES + C::W_BYTES, &tx,
					  k0 + i * WG_BK, 0, bar0 + 8 * i);
		__syncthreads();	// the barriers initialised before anyone waits on them
	} else {
		// weights are constant: the first stages stream in while the previous kernel
		// drains
#pragma unroll
		for (int i = 0; i < WG_AHEAD; i++) {
			if (i < nb)
				wg_load_w<ROWS>(smem_p + i * C::STAGE_BYTES, w, N, K, n0,
						k0 + i * WG_BK, kend, tid);
			cp_async_commit();
		}
		k_cuda_lin_inputs_ready(pdl);	// x and y only from here on
#pragma unroll
		for (int i = 0; i < WG_AHEAD; i++) {
			if (i < nb)
				wg_load_x<NT, ROWS>(smem_p + i * C::STAGE_BYTES + C::W_BYTES, xb, M,
						    K, k0 + i * WG_BK, kend, tid);
			cp_async_commit();
		}
	}
	// groups so far: W0 .. W(AHEAD-1), X0 .. X(AHEAD-1); then one (W, X) group per
	// iteration. Before iteration i, stage i's last group has exactly AHEAD - 1 newer ones.
	// (TMA: stage i is use i / STAGES of its buffer's barrier, whose phase parity that is)
	for (int i = 0; i < nb; i++) {
		const int nx = i + WG_AHEAD;

		if constexpr (TMA) {
			wg_mbar_wait(bar0 + 8 * (i % WG_STAGES), (unsigned)(i / WG_STAGES) & 1);
			__syncthreads();	// stage i - 1's buffer retired (wait_group 0)
			if (tid == 0 && nx < nb) {
				const int b = nx % WG_STAGES;
				const uint32_t st = smem + b * C::STAGE_BYTES;

				wg_mbar_expect(bar0 + 8 * b, C::STAGE_BYTES);
				wg_tma_2d(st, &tw, k0 + nx * WG_BK, n0, bar0 + 8 * b);
				wg_tma_2d(st + C::W_BYTES, &tx, k0 + nx * WG_BK, 0, bar0 + 8 * b);
			}
		} else {
			cp_async_wait<WG_AHEAD - 1>();
			wg_fence_proxy_async();	// this thread's copies, visible to wgmma
			__syncthreads();	// everyone's; stage i - 1's buffer retired
			if (nx < nb) {
				unsigned char *st = smem_p + (nx % WG_STAGES) * C::STAGE_BYTES;

				wg_load_w<ROWS>(st, w, N, K, n0, k0 + nx * WG_BK, kend, tid);
				wg_load_x<NT, ROWS>(st + C::W_BYTES, xb, M, K, k0 + nx * WG_BK, kend,
						    tid);
			}
			cp_async_commit();
		}
		const uint32_t st = smem + (i % WG_STAGES) * C::STAGE_BYTES;

		wg_compute<NT>(acc, st + wg * 64 * 128, st + C::W_BYTES);
	}
	if constexpr (!TMA)
		cp_async_wait<0>();	// (empty groups only: every stage was waited for)

	if (S == 1) {
#pragma unroll
		for (int i = 0; i < NT; i++)
#pragma unroll
			for (int c = 0; c < 4; c++) {
				const int n = n0 + wg_frag_row(warp, lane, c);
				const int m = wg_frag_m(i, lane, c);

				if (m < M && n < N) {
					float *p = y + (size_t)m * N + n;

					*p = accumulate ? *p + acc[4 * i + c] : acc[4 * i + c];
				}
			}
		return;
	}
	if (cl) {
		wg_cluster_reduce<NT, ROWS>(y, acc, (float *)smem_p, M, N, n0, accumulate, warp,
					    lane, tid);
		return;
	}
	float *part = ws + ((size_t)tile * S + s) * C::XROWS * WG_ROWS;

#pragma unroll
	for (int i = 0; i < NT; i++)
#pragma unroll
		for (int c = 0; c < 4; c++)
			__stcg(part + wg_frag_m(i, lane, c) * WG_ROWS + wg_frag_row(warp, lane, c),
			       acc[4 * i + c]);
	__threadfence();	// partials visible device-wide before this CTA counts
	__syncthreads();
	if (tid == 0)
		wg_last = atomicAdd(cnt + tile, 1u) == (unsigned)S - 1;
	__syncthreads();
	if (!wg_last)
		return;
	__threadfence();	// every other CTA's partials, which its count published
	wg_reduce<NT, ROWS>(y, ws + (size_t)tile * S * C::XROWS * WG_ROWS, M, N, n0, S, accumulate,
			    tid);
	if (tid == 0)
		cnt[tile] = 0;
}

// ---- launchers --------------------------------------------------------------------

/* Instantiations for 2, 4, 8 n8 tiles of x rows (M <= 16, 32, 64 per launch). */
static int wg_nt_index(int M)
{
	return M <= 16 ? 0 : M <= 32 ? 1 : 2;
}

/* Instantiations for 128 and 256 weight rows per CTA. */
static int wg_rows_index(int rows)
{
	return rows == 256;
}

static const int wg_smem_of[2][LIN_WG_N_NT] = {
	{ wg_cfg<2, 128>::SMEM, wg_cfg<4, 128>::SMEM, wg_cfg<8, 128>::SMEM },
	{ wg_cfg<2, 256>::SMEM, wg_cfg<4, 256>::SMEM, wg_cfg<8, 256>::SMEM },
};

struct wg_plan {
	int nt;		// n8 tiles of x rows
	int rows;	// weight rows per CTA
	int tiles;	// weight tiles of rows
	int S;		// K slices
	int KS;		// k per slice (a multiple of WG_BK)
	int waves;	// of the resident slots
	int cl;		// S > 1 in clusters of (1, S, 1), reduced in their shared memory
	int cap;	// resident slots
	int tma;	// stages loaded by tensor copies (ctx->wg_tma where the maps encode)
};

// cuTensorMapEncodeTiled from the driver, through the runtime (no libcuda link); NULL
// where the driver has none: then the cp.async path only.
static PFN_cuTensorMapEncodeTiled_v12000 wg_encode;

// A 2-D bf16 tensor map of rows x cols (row-major, cols contiguous) with boxes of
// box_rows x 64 cols, 128B-swizzled, zeros outside. 0 or -EIO.
static int wg_map(CUtensorMap *map, const uint16_t *base, int rows, int cols, int box_rows)
{
	const cuuint64_t dim[2] = { (cuuint64_t)cols, (cuuint64_t)rows };
	const cuuint64_t stride[1] = { (cuuint64_t)cols * sizeof(uint16_t) };
	const cuuint32_t box[2] = { WG_BK, (cuuint32_t)box_rows };
	const cuuint32_t estride[2] = { 1, 1 };
	CUresult r;

	r = wg_encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dim, stride, box,
		      estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
		      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
	if (r != CUDA_SUCCESS) {
		fprintf(stderr, "cuda: cuTensorMapEncodeTiled (%d x %d, box %d x %d) failed: %d\n",
			rows, cols, box_rows, WG_BK, (int)r);
		return -EIO;
	}
	return 0;
}

// KDEC_LINEAR_WGMMA_SPLIT (experiments): the largest split tried, 1..LIN_ST_MAX_SPLIT.
static int wg_max_split(void)
{
	static int max;

	if (!max) {
		const char *e = getenv("KDEC_LINEAR_WGMMA_SPLIT");
		const int v = e ? atoi(e) : 0;

		max = v >= 1 && v <= LIN_ST_MAX_SPLIT ? v : LIN_ST_MAX_SPLIT;
	}
	return max;
}

// As linear_stream's plan: every split S of the K stages is tried, time ~ waves *
// (stages per slice + overhead), ties to the smaller split. With ctx->wg_cluster the
// resident slots are those of clusters of S (sizes that cannot launch are skipped);
// otherwise the partial tiles must fit the shared workspace (LIN_ST_MAX_UNITS tiles
// of 128 rows).
static void wg_make_plan(const struct k_cuda_linear *ctx, int M, int N, int K, struct wg_plan *p)
{
	const int ni = wg_nt_index(M), ri = wg_rows_index(ctx->wg_rows), rows = ri ? 256 : 128;
	const int tiles = (N + rows - 1) / rows, nbk = (K + WG_BK - 1) / WG_BK;
	const int *ccap = ctx->wg_ccap[ri][ni];
	const long slots1 = ccap[1] > 0 ? ccap[1] : 1;
	long best = -1;

	p->nt = 2 << ni;
	p->rows = rows;
	p->tiles = tiles;
	p->S = 1;
	p->KS = nbk * WG_BK;
	p->waves = (int)((tiles + slots1 - 1) / slots1);
	p->cl = 0;
	p->cap = (int)slots1;
	p->tma = ctx->wg_tma && wg_encode;
	for (int S = 1; S <= wg_max_split() && S <= nbk; S++) {
		const int kb = (nbk + S - 1) / S;
		const long units = (long)tiles * S;
		long slots = slots1, waves, cost;

		if ((nbk + kb - 1) / kb != S)	// the same slices as a smaller S
			continue;
		if (S > 1 && ctx->wg_cluster) {
			slots = ccap[S];
			if (slots < 1)
				continue;
		} else if (S > 1 && units * (rows / 128) > LIN_ST_MAX_UNITS) {
			break;
		}
		waves = (units + slots - 1) / slots;
		cost = waves * (kb + WG_CTA_OVERHEAD);
		if (best < 0 || cost < best) {
			best = cost;
			p->S = S;
			p->KS = kb * WG_BK;
			p->waves = (int)waves;
			p->cl = S > 1 && ctx->wg_cluster;
			p->cap = (int)slots;
		}
	}
}

// The cluster-size attribute (1, S, 1); returns the number of attributes filled.
static int wg_cluster_attr(cudaLaunchAttribute *attr, int S)
{
	if (S <= 1)
		return 0;
	attr->id = cudaLaunchAttributeClusterDimension;
	attr->val.clusterDim.x = 1;
	attr->val.clusterDim.y = S;
	attr->val.clusterDim.z = 1;
	return 1;
}

template <int NT, int ROWS, bool TMA>
static int wg_launch(const struct k_cuda_linear *ctx, const struct wg_plan *p, float *y,
		     const uint16_t *xb, const uint16_t *w, int M, int N, int K, int accumulate)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[2] = {};
	CUtensorMap tw = {}, tx = {};

	if (TMA && (wg_map(&tw, w, N, K, ROWS) || wg_map(&tx, xb, M, K, NT * 8)))
		return -EIO;
	cfg.gridDim = dim3(p->tiles, p->S, 1);
	cfg.blockDim = dim3(wg_cfg<NT, ROWS>::THREADS, 1, 1);
	cfg.dynamicSmemBytes = wg_cfg<NT, ROWS>::SMEM;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = p->cl ? wg_cluster_attr(attr, p->S) : 0;
	cfg.numAttrs += k_cuda_lin_pdl_attr(ctx, attr + cfg.numAttrs);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, wg_kernel<NT, ROWS, TMA>, y, xb, w, M,
						     N, K, p->KS, accumulate, p->cl, ctx->st_ws,
						     ctx->st_cnt, ctx->pdl, tw, tx));
}

template <int NT, int ROWS>
static int wg_launch_nr(const struct k_cuda_linear *ctx, const struct wg_plan *p, float *y,
			const uint16_t *xb, const uint16_t *w, int M, int N, int K, int accumulate)
{
	return p->tma ? wg_launch<NT, ROWS, true>(ctx, p, y, xb, w, M, N, K, accumulate)
		      : wg_launch<NT, ROWS, false>(ctx, p, y, xb, w, M, N, K, accumulate);
}

int k_cuda_lin_wgmma(const struct k_cuda_linear *ctx, float *y, const float *x,
		     const uint16_t *w, int M, int N, int K, int acc, bool ready)
{
	int ret = 0;

	if (!ready)
		ret = k_cuda_lin_to_bf16(ctx, ctx->xb, x, (size_t)M * K);
	for (int m0 = 0; m0 < M && !ret; m0 += LIN_ST_MAX_M) {
		const int mc = M - m0 < LIN_ST_MAX_M ? M - m0 : LIN_ST_MAX_M;
		float *yc = y + (size_t)m0 * N;
		const uint16_t *xc = ctx->xb + (size_t)m0 * K;
		struct wg_plan p;

		wg_make_plan(ctx, mc, N, K, &p);
		switch (p.nt * 1000 + p.rows) {
		case 2128: ret = wg_launch_nr<2, 128>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		case 4128: ret = wg_launch_nr<4, 128>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		case 8128: ret = wg_launch_nr<8, 128>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		case 2256: ret = wg_launch_nr<2, 256>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		case 4256: ret = wg_launch_nr<4, 256>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		default: ret = wg_launch_nr<8, 256>(ctx, &p, yc, xc, w, mc, N, K, acc); break;
		}
	}
	return ret;
}

int k_cuda_lin_wgmma_describe(const struct k_cuda_linear *ctx, int M, int N, int K, char *buf,
			      size_t len)
{
	const int mc = M < LIN_ST_MAX_M ? M : LIN_ST_MAX_M;
	struct wg_plan p;

	wg_make_plan(ctx, mc, N, K, &p);
	return snprintf(buf, len, "wgmma n=%d rows=%d grid=%dx%d k/slice=%d waves=%d cap=%d "
			"smem=%d %s %s%s", p.nt * 8, p.rows, p.tiles, p.S, p.KS, p.waves, p.cap,
			wg_smem_of[wg_rows_index(p.rows)][wg_nt_index(mc)],
			p.tma ? "tma" : "cp.async", p.S == 1 ? "nosplit" : p.cl ? "cluster" : "ws",
			M > LIN_ST_MAX_M ? " (per 64 rows)" : "");
}

// One instantiation's shared-memory attribute; its occupancy alone (bps) and in clusters
// of S (clusters[S]).
template <int NT, int ROWS, bool TMA>
static int wg_setup_one(struct k_cuda_linear *ctx, int *bps, int (&clusters)[LIN_ST_MAX_SPLIT + 1])
{
	using C = wg_cfg<NT, ROWS>;
	int ret;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(wg_kernel<NT, ROWS, TMA>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(bps,
					wg_kernel<NT, ROWS, TMA>, C::THREADS, C::SMEM));
	if (ret)
		return ret;
	for (int S = 2; S <= LIN_ST_MAX_SPLIT; S++) {
		cudaLaunchConfig_t cfg = {};
		cudaLaunchAttribute attr[1] = {};

		cfg.gridDim = dim3(1, S, 1);
		cfg.blockDim = dim3(C::THREADS, 1, 1);
		cfg.dynamicSmemBytes = C::SMEM;
		cfg.attrs = attr;
		cfg.numAttrs = wg_cluster_attr(attr, S);
		clusters[S] = 0;
		// a cluster size the device refuses is simply never chosen
		if (cudaOccupancyMaxActiveClusters(&clusters[S], wg_kernel<NT, ROWS, TMA>, &cfg) !=
		    cudaSuccess) {
			cudaGetLastError();
			clusters[S] = 0;
		}
	}
	return 0;
}

// ctx->wg_ccap[ri][ni]: CTAs resident at once, alone (index 1) and in clusters of S, of
// both the cp.async and the TMA instantiation (the smaller: the plan serves both).
template <int NT, int ROWS> static int wg_setup_nt(struct k_cuda_linear *ctx, int ri, int ni)
{
	int bps[2] = { 0, 0 }, cl[2][LIN_ST_MAX_SPLIT + 1] = {};
	int ret;

	ret = wg_setup_one<NT, ROWS, false>(ctx, &bps[0], cl[0]);
	if (!ret)
		ret = wg_setup_one<NT, ROWS, true>(ctx, &bps[1], cl[1]);
	if (ret)
		return ret;
	if (bps[0] < 1 || bps[1] < 1) {
		fprintf(stderr, "cuda: wgmma linear kernel (n %d, %d rows, %d bytes of shared "
			"memory) fits no multiprocessor of device %d\n", NT * 8, ROWS,
			wg_cfg<NT, ROWS>::SMEM, ctx->dev);
		return -EIO;
	}
	ctx->wg_ccap[ri][ni][1] = (bps[0] < bps[1] ? bps[0] : bps[1]) * ctx->n_sm;
	for (int S = 2; S <= LIN_ST_MAX_SPLIT; S++)
		ctx->wg_ccap[ri][ni][S] = (cl[0][S] < cl[1][S] ? cl[0][S] : cl[1][S]) * S;
	return 0;
}

// Needs k_cuda_lin_stream_setup first: the split workspace and counters are its.
// KDEC_LINEAR_WGMMA_CLUSTER=0: splits through that workspace; KDEC_LINEAR_WGMMA_ROWS=256:
// 256 weight rows per CTA; KDEC_LINEAR_WGMMA_TMA=1: stages by tensor copies
// (k_cuda_linear_set_wgmma_cluster, _rows, _tma).
int k_cuda_lin_wgmma_setup(struct k_cuda_linear *ctx)
{
	const char *e = getenv("KDEC_LINEAR_WGMMA_CLUSTER"), *r = getenv("KDEC_LINEAR_WGMMA_ROWS");
	const char *t = getenv("KDEC_LINEAR_WGMMA_TMA");
	cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
	void *fn = NULL;
	int ret;

	ctx->wg_cluster = !e || atoi(e) != 0;
	ctx->wg_rows = r && atoi(r) == 256 ? 256 : 128;
	ctx->wg_tma = t && atoi(t) != 0;
	if (!wg_encode) {
		if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
						     cudaEnableDefault, &q) == cudaSuccess &&
		    q == cudaDriverEntryPointSuccess && fn)
			wg_encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
		else
			cudaGetLastError();
	}
	ret = wg_setup_nt<2, 128>(ctx, 0, 0);
	if (!ret)
		ret = wg_setup_nt<4, 128>(ctx, 0, 1);
	if (!ret)
		ret = wg_setup_nt<8, 128>(ctx, 0, 2);
	if (!ret)
		ret = wg_setup_nt<2, 256>(ctx, 1, 0);
	if (!ret)
		ret = wg_setup_nt<4, 256>(ctx, 1, 1);
	if (!ret)
		ret = wg_setup_nt<8, 256>(ctx, 1, 2);
	return ret;
}
