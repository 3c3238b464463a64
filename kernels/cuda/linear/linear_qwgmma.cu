// The quantized tile kernel on warpgroup tensor cores (wgmma, sm_90a) for decode batches
// of 9..64 rows, W8A16 fp8 and W4A16 int4 (qw4_kernel, below): linear_qtile.cu's
// pipeline (cp.async stages carrying 64 bytes of each weight row and the same k of every
// x row, weights issued before the PDL wait, K split over CTAs whose partial tiles are
// added in split order), with the products on wgmma.mma_async instead of mma.sync.
// linear_qtile.cu's k_cuda_lin_qtile hands it its calls where the device runs it
// (KDEC_LINEAR_QWG). The layout below is fp8's; int4's differs where qw4_kernel's
// comments say.
//
// Why: the mma.sync tile kernel is bound by the tensor cores near its floor (its header:
// ~0.5 m16n8k16 a clock per multiprocessor at M = 64 for fp8 at the HBM floor, about what
// mma.sync sustains), so Llama-3.1-8B fp8 at batch 64 ran slower than bf16 on cuBLAS
// (H100: 10.63 against 9.43 ms a step, issue 24). One wgmma m64n64k16 does the work of 32
// such MMAs in one issue and reads x from shared memory itself (no ldmatrix, no x
// registers); wgmma's fp8 x fp8 form would need x quantized to fp8 (3 mantissa bits),
// so the weights come in through registers as f16, exactly as the mma.sync kernels
// convert them, and x stays f16: the same roundings as TILE.
//
// Layout. A CTA owns ROWS = 64 WGS weight rows (WGS warpgroups, one m64 tile each) and
// one K slice; y^T (N, M) = W (N, K) x^T: W is the A operand (registers), x the B operand
// (XROWS = 16/32/64 rows of the wgmma N, from shared memory through a descriptor).
//   Weights: a stage holds bytes [kb, kb + 64) of each row, row r at r * 64. Lane (g, t)
//   of warp q of warpgroup h reads 16 bytes at 16 t of rows 64 h + 16 q + g and + 8 (a
//   quarter warp's rows g, g + 1 are 128 contiguous bytes: 32 banks), which become its A
//   registers of the stage's four k16 steps: step j takes the word j of each row
//   (bytes 16t + 4j .. + 3), bytes 0,1 as k slots 2t, 2t + 1 and bytes 2,3 as 2t + 8, 2t + 9
//   (the mma.sync kernels' order, linear_qmma.cu's header).
//   x: rounded to f16 once per call by qw_x_kernel into the context's scratch, each
//   64-k slab permuted so that slot s of step j holds the k the weights put there:
//   position 16 j + 8 h + 2 t + l holds k 16 t + 4 j + 2 h + l. A stage holds the slab of
//   every x row as one 128-byte line, 16-byte unit u of row m at m * 128 + ((u ^ (m & 7))
//   << 4) from a 1024-byte aligned base: the hardware's 128B swizzle. Descriptor: start >>
//   4, stride byte offset 1024 (8 rows), leading byte offset unused (a k16 step lies in
//   the line: its start advances 32 bytes), mode 1 (128B).
// Scales: block scales' wgmmas go into a temporary over the stages of one scale column
// (the first with scale-d 0), which is then added into the accumulators times the
// column's scale of each row in fp32, as TILE scales a slab's partial sums; one column
// (per channel, per tensor): straight into the accumulators, each row scaled once at
// the end. Scale columns must be constant over 64 k.
// Pipeline: one wgmma group (a stage's four) stays in flight while the next stage's
// barrier, copies and conversions run; a full wait only where block scales add in.
// Accumulators (m64nN, fp32): thread (warp q of its warpgroup, lane g t) holds d[4 i + c]
// for row 16 q + g + 8 (c >> 1) of its m64 tile and x row 8 i + 2 t + (c & 1).
// Proxies: cp.async writes shared memory through the generic proxy and wgmma reads it
// through the async proxy: each thread fences (fence.proxy.async) after its copies land,
// before the barrier that lets the warpgroups issue; a buffer is refilled only after
// every warpgroup's wait_group retired the wgmmas reading it, before the barrier that
// precedes the refill. The configurations, the wgmma PTX and the epilogue:
// linear_qwgmma.cuh.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_qwgmma.cuh"
#include "kernels/cuda/linear/linear_split.cuh"
#include "kernels/cuda/ptx.cuh"

// ---- kernels ----------------------------------------------------------------------------

// 1 into *ok where this image has wgmma (sm_90a), else 0.
__global__ void qw_probe_kernel(int *ok)
{
	*ok = QW_HAVE;
}

// xh (M, K) f16 = x rounded to nearest even (|x| > 65504 becomes inf), each 64-k slab in
// the order the header gives: one 16-byte unit (positions 8u .. 8u + 7 of a slab) a
// thread. K % 64 == 0, x 8-byte aligned.
__global__ void __launch_bounds__(256) qw_x_kernel(uint16_t *xh, const float *x, size_t units,
						    int pdl)
{
	k_cuda_lin_inputs_ready(pdl);	// x is the previous kernel's output
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < units;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int u = (int)(i & 7), j = u >> 1, h = u & 1;
		const float *s = x + (i >> 3) * QW_BK + 4 * j + 2 * h;
		const float2 v0 = *(const float2 *)s, v1 = *(const float2 *)(s + 16);
		const float2 v2 = *(const float2 *)(s + 32), v3 = *(const float2 *)(s + 48);

		((uint4 *)xh)[i] = make_uint4(qm_pack_h2(v0.x, v0.y), qm_pack_h2(v1.x, v1.y),
					      qm_pack_h2(v2.x, v2.y), qm_pack_h2(v3.x, v3.y));
	}
}

// int4: xh (M, K) f16 = x rounded, each 128-k slab permuted so that position 16 j + 8 hi
// + 2 t + l (k16 step j = 2 q + h) holds k 32 t + 8 q + 2 h + hi + 4 l: the order in
// which k_dq_i4x8 pairs a lane's nibbles (its word q, pair p: nibbles p and p + 4; step
// 2 q + h takes pairs 2 h into slots 2 t, 2 t + 1 and 2 h + 1 into 2 t + 8, 2 t + 9). One
// 16-byte unit a thread; K % 128 == 0.
__global__ void __launch_bounds__(256) qw4_x_kernel(uint16_t *xh, const float *x, size_t units,
						     int pdl)
{
	k_cuda_lin_inputs_ready(pdl);	// x is the previous kernel's output
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < units;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int u = (int)(i & 15), j = u >> 1, hi = u & 1, q = j >> 1, h = j & 1;
		const float *b = x + (i >> 4) * QW4_BK + 8 * q + 2 * h + hi;

		((uint4 *)xh)[i] = make_uint4(qm_pack_h2(b[0], b[4]), qm_pack_h2(b[32], b[36]),
					      qm_pack_h2(b[64], b[68]), qm_pack_h2(b[96], b[100]));
	}
}

// The x part of a stage: the permuted slab at k of x rows 0 .. XROWS - 1 (zeros past M
// and past the slice), LINES 128-byte lines a row (fp8 1: 64 k; int4 2: k16 steps 0..3,
// 4..7), each line its own tile of XROWS lines swizzled as the header says: unit u of row
// m in line u >> 3, at 16-byte unit (u & 7) ^ (m & 7) of it.
template <int NT, int WGS, int LINES>
static __device__ __forceinline__ void qw_load_x(unsigned char *xs, const uint16_t *xh,
						 const qf_args &a, int k, int kend, int tid)
{
	using C = qw_cfg<NT, WGS>;
	constexpr int SH = LINES == 2 ? 4 : 3, UPR = 1 << SH, UNITS = C::XROWS * UPR;	// units a row

	static_assert(LINES == 1 || LINES == 2, "one or two lines a row");

#pragma unroll
	for (int j = 0; j < (UNITS + C::THREADS - 1) / C::THREADS; j++) {
		const int i = tid + j * C::THREADS, m = i >> SH, u = i & (UPR - 1);
		const bool ok = m < a.M && k < kend;

		if (UNITS % C::THREADS == 0 || i < UNITS)
			cp_async16(xs + (u >> 3) * (C::XROWS * 128) + m * 128 +
					   (((u & 7) ^ (m & 7)) << 4),
				   ok ? xh + (size_t)m * a.K + k + 8 * u : xh, ok);
	}
}

// A kernel's prologue: the weights of its first AHEAD stages (of BK k, VPB values a
// byte, STAGE bytes apart) issued before the PDL wait, which they do not need, then the
// wait, then those stages' x (LINES lines a row): one cp.async group each, W0.. X0.. .
template <int NT, int WGS, int LINES, int AHEAD, int STAGE, int BK, int VPB>
static __device__ __forceinline__ void qw_prologue(unsigned char *smem, const uint8_t *w,
						   const uint16_t *xh, const qf_args &a, int n0,
						   int k0, int kend, int nst, int tid)
{
	using C = qw_cfg<NT, WGS>;

#pragma unroll
	for (int i = 0; i < AHEAD; i++) {
		if (i < nst)
			qf_load_w64<C::ROWS, C::THREADS, true>(smem + i * STAGE, w, a, n0,
								(k0 + i * BK) / VPB, kend / VPB, tid);
		cp_async_commit();
	}
	k_cuda_lin_inputs_ready(a.pdl);	// x, y and the scales only from here on
#pragma unroll
	for (int i = 0; i < AHEAD; i++) {
		if (i < nst)
			qw_load_x<NT, WGS, LINES>(smem + i * STAGE + C::W_BYTES, xh, a, k0 + i * BK,
						  kend, tid);
		cp_async_commit();
	}
}

// A lane's two weight rows within the tile (rows g and g + 8 of its warp's 16; the
// accumulators' and the A registers' rows) and their scales: scale(k, b) is row a's (b 0)
// or row b's (b 1) scale of the column holding k, 0 past N (L1 hits after the first: a
// column spans 32 k or more and its block's rows).
template <typename ST> struct qw_lane_rows {
	int ra, rb;
	bool oka, okb;
	size_t srowa, srowb;	// the rows' first scales

	__device__ __forceinline__ qw_lane_rows(const qf_args &a, int n0, int warp, int g)
		: ra(16 * warp + g), rb(16 * warp + g + 8), oka(n0 + ra < a.N), okb(n0 + rb < a.N),
		  srowa((size_t)((oka ? n0 + ra : 0) / a.block_rows) * (size_t)a.scale_cols),
		  srowb((size_t)((okb ? n0 + rb : 0) / a.block_rows) * (size_t)a.scale_cols)
	{
	}

	__device__ __forceinline__ float scale(const ST *sc, const qf_args &a, int k, int b) const
	{
		return (b ? okb : oka) ? qm_scale(sc, (b ? srowb : srowa) + (size_t)(k >> a.bc_shift))
				       : 0.f;
	}
};

// grid (tiles, S): blockIdx.x the ROWS-row tile, blockIdx.y the K slice [s KC, s KC +
// KC). xh: x (M, K) in f16 as qw_x_kernel wrote it; ws: (tiles * S, XROWS, ROWS) fp32
// partials; cnt: (tiles) arrival counters, zero between launches; spread: every CTA of
// the grid is resident at once, so the S CTAs of a tile wait for each other and each sum
// 1/S of it (else the last to arrive sums it all, one multiprocessor reading S partial
// tiles: at M 64 and 256 rows, S x 64 KB). Needs K % 64 == 0,
// KC % 64 == 0, w rows 16-byte aligned, M <= XROWS, a scale column constant over 64 k.
// PC: one scale column (per channel): the products accumulate unscaled and each row is
// scaled once at the end (the fp32 sum of the row times its scale, rounded once more).
template <typename ST, bool PC, int NT, int WGS>
__global__ void __launch_bounds__(qw_cfg<NT, WGS>::THREADS, qw_cfg<NT, WGS>::MIN_BLOCKS)
qw_kernel(float *y, const uint16_t *xh, const uint8_t *__restrict__ w,
	  const ST *__restrict__ scale, qf_args a, float *ws, unsigned *cnt, int spread)
{
	using C = qw_cfg<NT, WGS>;
	extern __shared__ unsigned char qw_smem_raw[];
	unsigned char *smem = (unsigned char *)(((uintptr_t)qw_smem_raw + QW_ALIGN - 1) &
						~(uintptr_t)(QW_ALIGN - 1));
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
	const int n0 = blockIdx.x * C::ROWS, k0 = blockIdx.y * a.KC, kend = min(a.K, k0 + a.KC);
	const int nst = k0 < kend ? (kend - k0 + QW_BK - 1) / QW_BK : 0;
	const qw_lane_rows<ST> lr(a, n0, warp, g);
	const int ra = lr.ra, rb = lr.rb;
	float acc[C::ACC] = {}, tmp[C::ACC] = {};	// tmp: unused where PC

	// weights are constant: the first stages stream in while the previous kernel drains
	qw_prologue<NT, WGS, 1, QW_AHEAD, C::STAGE, QW_BK, 1>(smem, w, xh, a, n0, k0, kend, nst,
							       tid);
	// Groups so far: W0..W4 X0..X4; then one (W, X) group per stage. Stage i sits in
	// buffer i % QW_STAGES. Iteration i issues stage i's wgmmas (its A registers
	// converted the iteration before) and waits for stage i - 1's to retire (one wgmma
	// group stays in flight); then waits for stage i + 1's copies (its last group has
	// QW_AHEAD - 2 newer ones), refills the buffer of stage i - 1 with stage i +
	// QW_AHEAD, and converts stage i + 1's weights into the A registers stage i - 1
	// used. Block scales: the temporary sums the stages of one scale column and is
	// added in, times the column's scales, at the column's last stage (every 64 k for
	// 64-wide columns, every 128 k for DeepSeek's 128 x 128 blocks), after a full wait.
	uint32_t af[2][4][4];
	auto load_a = [&](uint32_t (&f)[4][4], const unsigned char *st) {
		const uint4 va = *(const uint4 *)(st + ra * QW_BK + 16 * t);
		const uint4 vb = *(const uint4 *)(st + rb * QW_BK + 16 * t);
		const uint32_t wa[4] = { va.x, va.y, va.z, va.w }, wb[4] = { vb.x, vb.y, vb.z, vb.w };

#pragma unroll
		for (int q = 0; q < 4; q++) {
			qm_e4m3x4(wa[q], f[q][0], f[q][2]);
			qm_e4m3x4(wb[q], f[q][1], f[q][3]);
		}
	};
	int fresh = 1;	// the temporary holds nothing yet (block scales)

	cp_async_wait<QW_AHEAD - 1>();
	QW_ASM("fence.proxy.async.shared::cta;" ::: "memory");
	__syncthreads();	// stage 0 visible
	if (nst > 0)
		load_a(af[0], smem);
	for (int i0 = 0; i0 < nst; i0 += QW_STAGES) {
#pragma unroll
		for (int j = 0; j < QW_STAGES; j++) {
			const int i = i0 + j, nx = i + QW_AHEAD, k = k0 + i * QW_BK;
			const unsigned char *st = smem + j * C::STAGE;
			const uint64_t xd = qw_desc((uint32_t)__cvta_generic_to_shared(st + C::W_BYTES));

			if (i >= nst)
				break;
			qw_fence();
#pragma unroll
			for (int q = 0; q < 4; q++) {	// k16 step q: 32 bytes into each line
				if constexpr (PC)
					qw_mma<NT>::run(acc, af[j & 1][q], xd + (uint64_t)(2 * q), 1);
				else
					qw_mma<NT>::run(tmp, af[j & 1][q], xd + (uint64_t)(2 * q),
							q > 0 || !fresh);
			}
			qw_commit();
			qw_wait<1>();	// stage i - 1's wgmmas retired: its buffer, its A registers
			cp_async_wait<QW_AHEAD - 2>();
			QW_ASM("fence.proxy.async.shared::cta;" ::: "memory");
			__syncthreads();	// stage i + 1 visible; stage i - 1's buffer free
			if (nx < nst) {
				unsigned char *sn = smem + ((j + QW_AHEAD) % QW_STAGES) * C::STAGE;

				qf_load_w64<C::ROWS, C::THREADS, false>(sn, w, a, n0, k0 + nx * QW_BK,
									 kend, tid);
				qw_load_x<NT, WGS, 1>(sn + C::W_BYTES, xh, a, k0 + nx * QW_BK, kend, tid);
			}
			cp_async_commit();
			if (i + 1 < nst)
				load_a(af[(j + 1) & 1], smem + ((j + 1) % QW_STAGES) * C::STAGE);
			if constexpr (!PC) {
				fresh = i + 1 >= nst || ((k + QW_BK) >> a.bc_shift) != (k >> a.bc_shift);
				if (fresh) {	// the column's last stage
					const float sa = lr.scale(scale, a, k, 0), sb = lr.scale(scale, a, k, 1);

					qw_wait<0>();
#pragma unroll
					for (int e = 0; e < C::ACC; e++)
						acc[e] = fmaf(tmp[e], e & 2 ? sb : sa, acc[e]);
				}
			}
		}
	}
	qw_wait<0>();
	cp_async_wait<0>();
	if constexpr (PC) {
		const float sa = lr.scale(scale, a, 0, 0), sb = lr.scale(scale, a, 0, 1);

#pragma unroll
		for (int e = 0; e < C::ACC; e++)
			acc[e] *= e & 2 ? sb : sa;
	}

	qw_store<NT, WGS>(y, acc, a, ws, cnt, spread, n0, ra, rb);
}

// int4 (W4A16): grid, workspace and counters as qw_kernel; each lane's 32 k of a stage
// are one group (a power of two >= 32 wide), whose scale multiplies the f16 values
// before the MMA, as TILE scales them (k_dq_i4x8). A stage's eight wgmmas go in two
// groups of four, each from its half of the lane's words (A registers of 16 words each,
// alternating): converting a half waits only for the same half of the stage before,
// so one wgmma group stays in flight. Needs K % 128 == 0, KC % 128 == 0.
template <typename ST, int NT, int WGS>
__global__ void __launch_bounds__(qw_cfg<NT, WGS>::THREADS, qw_cfg<NT, WGS>::MIN_BLOCKS)
qw4_kernel(float *y, const uint16_t *xh, const uint8_t *__restrict__ w,
	   const ST *__restrict__ scale, qf_args a, float *ws, unsigned *cnt, int spread)
{
	using C = qw_cfg<NT, WGS>;
	using F = qw4_cfg<NT, WGS>;
	extern __shared__ unsigned char qw_smem_raw[];
	unsigned char *smem = (unsigned char *)(((uintptr_t)qw_smem_raw + QW_ALIGN - 1) &
						~(uintptr_t)(QW_ALIGN - 1));
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
	const int n0 = blockIdx.x * C::ROWS, k0 = blockIdx.y * a.KC, kend = min(a.K, k0 + a.KC);
	const int nst = k0 < kend ? (kend - k0 + QW4_BK - 1) / QW4_BK : 0;
	const qw_lane_rows<ST> lr(a, n0, warp, g);
	const int ra = lr.ra, rb = lr.rb;
	float acc[C::ACC] = {};
	uint32_t af[2][4][4];	// [half][k16 step of the half][register]
	uint4 va, vb;		// the lane's 16 bytes of rows a, b of the stage to come
	__half2 ha, hb;		// their group scales

	qw_prologue<NT, WGS, 2, F::AHEAD, F::STAGE, QW4_BK, 2>(smem, w, xh, a, n0, k0, kend, nst,
							       tid);
	auto fetch = [&](const unsigned char *st, int k) {	// stage st's words and scales
		const int kk = k + 32 * t;

		va = *(const uint4 *)(st + ra * 64 + 16 * t);
		vb = *(const uint4 *)(st + rb * 64 + 16 * t);
		ha = __float2half2_rn(lr.scale(scale, a, kk, 0));
		hb = __float2half2_rn(lr.scale(scale, a, kk, 1));
	};
	auto convert = [&](uint32_t (&f)[4][4], uint32_t wa0, uint32_t wa1, uint32_t wb0,
			   uint32_t wb1) {	// words q = 2 half + 0, 1 -> steps 4 half + 0..3
		const uint32_t wa[2] = { wa0, wa1 }, wb[2] = { wb0, wb1 };

#pragma unroll
		for (int q = 0; q < 2; q++) {
			uint32_t fa[4], fb[4];

			k_dq_i4x8(wa[q], ha, fa);
			k_dq_i4x8(wb[q], hb, fb);
#pragma unroll
			for (int h = 0; h < 2; h++) {
				f[2 * q + h][0] = fa[2 * h];
				f[2 * q + h][1] = fb[2 * h];
				f[2 * q + h][2] = fa[2 * h + 1];
				f[2 * q + h][3] = fb[2 * h + 1];
			}
		}
	};

	cp_async_wait<F::AHEAD - 1>();
	QW_ASM("fence.proxy.async.shared::cta;" ::: "memory");
	__syncthreads();	// stage 0 visible
	if (nst > 0)
		fetch(smem, k0);
	for (int i0 = 0; i0 < nst; i0 += F::STAGES) {
#pragma unroll
		for (int j = 0; j < F::STAGES; j++) {
			const int i = i0 + j, nx = i + F::AHEAD;
			const unsigned char *st = smem + j * F::STAGE;
			const uint64_t xd = qw_desc((uint32_t)__cvta_generic_to_shared(st + C::W_BYTES));

			if (i >= nst)
				break;
			qw_wait<1>();	// the stage before: its first half's wgmmas retired
			convert(af[0], va.x, va.y, vb.x, vb.y);
			qw_fence();
#pragma unroll
			for (int q = 0; q < 4; q++)	// k16 step q: 32 bytes into line 0
				qw_mma<NT>::run(acc, af[0][q], xd + (uint64_t)(2 * q), 1);
			qw_commit();
			qw_wait<1>();	// ... and its second half's
			convert(af[1], va.z, va.w, vb.z, vb.w);
			qw_fence();
#pragma unroll
			for (int q = 0; q < 4; q++)	// steps 4..7: line 1
				qw_mma<NT>::run(acc, af[1][q], xd + (uint64_t)((F::X_HALF >> 4) + 2 * q), 1);
			qw_commit();
			cp_async_wait<F::AHEAD - 2>();
			QW_ASM("fence.proxy.async.shared::cta;" ::: "memory");
			__syncthreads();	// stage i + 1 visible; stage i - 1's buffer free
			if (nx < nst) {
				unsigned char *sn = smem + ((j + F::AHEAD) % F::STAGES) * F::STAGE;

				qf_load_w64<C::ROWS, C::THREADS, false>(sn, w, a, n0,
									 (k0 + nx * QW4_BK) / 2,
									 kend / 2, tid);
				qw_load_x<NT, WGS, 2>(sn + C::W_BYTES, xh, a, k0 + nx * QW4_BK, kend, tid);
			}
			cp_async_commit();
			if (i + 1 < nst)
				fetch(smem + ((j + 1) % F::STAGES) * F::STAGE, k0 + (i + 1) * QW4_BK);
		}
	}
	qw_wait<0>();
	cp_async_wait<0>();
	qw_store<NT, WGS>(y, acc, a, ws, cnt, spread, n0, ra, rb);
}

// ---- launchers --------------------------------------------------------------------------

static int qw_nt_index(int M)
{
	return M <= 16 ? 0 : M <= 32 ? 1 : 2;
}

// KDEC_LINEAR_QWG_ROWS where it forces the rows a CTA (128 or 256), else 0.
static int qw_rows_forced(void)
{
	const int rows = k_cuda_tuning()->linear_qwg_rows;

	return rows == 128 || rows == 256 ? rows : 0;
}

// Warpgroups a CTA by default: the forced rows', else 4 (256 rows, x half the weight
// bytes a stage at M 64) above 32 rows and 2 up to 32.
static int qw_wgs(int M)
{
	const int rows = qw_rows_forced();

	return rows ? rows / 64 : M > 32 ? 4 : 2;
}

// The tuning's candidates c = 1 .. QW_CANDIDATES: split c at the default rows, split c -
// 8 at the other (only where KDEC_LINEAR_QWG_ROWS leaves the rows free); the split
// cache keeps c under a key of the rows setting.
#define QW_CANDIDATES(rows_free)	((rows_free) ? 2 * LIN_ST_MAX_SPLIT : LIN_ST_MAX_SPLIT)
static_assert(2 * LIN_ST_MAX_SPLIT <= LIN_SPLIT_MAX, "the tuning times both rows' splits");

static int qw_candidate_wgs(int M, int c)
{
	const int wgs = qw_wgs(M);

	return c > LIN_ST_MAX_SPLIT ? 6 - wgs : wgs;
}

static int qw_split_key(void)
{
	return QW_SPLIT_KIND + 2 * (qw_rows_forced() / 128);	// free, 128, 256
}

struct qw_plan {
	int nt;		// n8 tiles of x rows
	int wgs;	// warpgroups a CTA
	int tiles;	// ROWS-row weight tiles
	int S;		// K slices
	int KS;		// k per slice
	int per_sm;	// CTAs a multiprocessor runs (some one fewer)
	int spread;	// S > 1 and every CTA resident at once: the tile's sum spread over its S
};

// The plan with split S and its modelled cost (a multiprocessor's CTAs x (stages a slice
// + overhead), CTAs resident at once counted as parallel); false where S gives no plan of
// its own or the split's partials overflow the workspace.
static bool qw_plan_at(const struct k_cuda_linear *ctx, int fi, int M, int N, int K, int wgs,
		       int S, struct qw_plan *p, long *cost)
{
	const int bk = fi ? QW4_BK : QW_BK, ni = qw_nt_index(M), rows = 64 * wgs, nst = K / bk;
	const int tiles = (N + rows - 1) / rows;
	const int bps = ctx->qw_bps[fi][ni][wgs == 4] > 0 ? ctx->qw_bps[fi][ni][wgs == 4] : 1;
	const long n_sm = ctx->n_sm > 0 ? ctx->n_sm : 1;
	const long part = (long)(16 << ni) * rows;	// floats a CTA's partial tile: XROWS x rows
	int kb;
	long units, per_sm, waves;

	if (S < 1 || S > LIN_ST_MAX_SPLIT || S > nst)
		return false;
	kb = (nst + S - 1) / S;
	units = (long)tiles * S;
	if ((nst + kb - 1) / kb != S ||
	    (S > 1 && units * part > (long)LIN_ST_MAX_UNITS * LIN_ST_MAX_M * 128))
		return false;
	per_sm = (units + n_sm - 1) / n_sm;
	waves = (per_sm + bps - 1) / bps;
	*cost = waves * (kb + QW_CTA_OVERHEAD) * bps;
	*p = qw_plan{ 2 << ni, wgs, tiles, S, kb * bk, (int)per_sm,
		      S > 1 && per_sm <= bps && !ctx->shared };
	return true;
}

// The format index of the kernel's tables: 0 fp8, 1 int4.
static int qw_fi(const struct k_quant *q)
{
	return q->fmt == K_Q_INT4;
}

static void qw_make_plan(const struct k_cuda_linear *ctx, int fi, int M, int N, int K,
			 struct qw_plan *p)
{
	long best = -1, cost;
	struct qw_plan c;

	for (int S = 1; S <= LIN_ST_MAX_SPLIT; S++)
		if (qw_plan_at(ctx, fi, M, N, K, qw_wgs(M), S, &c, &cost) &&
		    (best < 0 || cost < best)) {
			best = cost;
			*p = c;
		}
}

static void qw_ctx_plan(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
			int K, struct qw_plan *p)
{
	const int c = k_cuda_lin_split_find(ctx, qw_split_key(), q, M, N, K);
	long cost;

	if (!c || !qw_plan_at(ctx, qw_fi(q), M, N, K, qw_candidate_wgs(M, c),
			      (c - 1) % LIN_ST_MAX_SPLIT + 1, p, &cost))
		qw_make_plan(ctx, qw_fi(q), M, N, K, p);
}

// The kernels by variant: 0 fp8 with block scales, 1 fp8 with one scale column, 2 int4.
template <typename ST, int VAR, int NT, int WGS> struct qw_var {
	static constexpr int SMEM = VAR == 2 ? qw4_cfg<NT, WGS>::SMEM : qw_cfg<NT, WGS>::SMEM;
	static constexpr int UNIT = VAR == 2 ? 32 : QW_BK;	// qm_bc_shift's unit
	typedef void (*fn_t)(float *, const uint16_t *, const uint8_t *, const ST *, qf_args,
			     float *, unsigned *, int);
	static fn_t fn()
	{
		if constexpr (VAR == 2)
			return qw4_kernel<ST, NT, WGS>;
		else
			return qw_kernel<ST, VAR == 1, NT, WGS>;
	}
};

template <typename ST, int VAR, int NT, int WGS>
static int qw_launch(const struct k_cuda_linear *ctx, const struct qw_plan *p, float *y,
		     const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	using V = qw_var<ST, VAR, NT, WGS>;
	using C = qw_cfg<NT, WGS>;
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};
	const qf_args a = qf_make_args(q, M, N, K, p->KS, V::UNIT, accumulate, ctx->pdl);
	const size_t part_floats = (size_t)p->tiles * p->S * C::XROWS * C::ROWS;

	// the plan keeps a split's partial tiles inside the workspace; a launch past it would
	// write over whatever follows, so none is made
	if (p->S > 1 && (part_floats > (size_t)LIN_ST_MAX_UNITS * LIN_ST_MAX_M * 128 ||
			 p->tiles > LIN_ST_MAX_UNITS)) {
		k_cuda_log("cuda: wgmma tile kernel: %d tiles x split %d of %d x %d partials exceed "
			   "the %d-unit workspace on device %d", p->tiles, p->S, C::XROWS, C::ROWS,
			   LIN_ST_MAX_UNITS, ctx->dev);
		return -EINVAL;
	}

	cfg.gridDim = dim3(p->tiles, p->S, 1);
	cfg.blockDim = dim3(qw_cfg<NT, WGS>::THREADS, 1, 1);
	cfg.dynamicSmemBytes = V::SMEM;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, V::fn(), y, (const uint16_t *)ctx->xb,
						     (const uint8_t *)w, (const ST *)q->scale, a,
						     ctx->st_ws, ctx->st_cnt, p->spread));
}

template <typename ST, int VAR, int WGS>
static int qw_dispatch_nt(const struct k_cuda_linear *ctx, const struct qw_plan *p, float *y,
			  const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	switch (p->nt) {
	case 2: return qw_launch<ST, VAR, 2, WGS>(ctx, p, y, w, q, M, N, K, accumulate);
	case 4: return qw_launch<ST, VAR, 4, WGS>(ctx, p, y, w, q, M, N, K, accumulate);
	default: return qw_launch<ST, VAR, 8, WGS>(ctx, p, y, w, q, M, N, K, accumulate);
	}
}

template <typename ST, int VAR>
static int qw_dispatch_wgs(const struct k_cuda_linear *ctx, const struct qw_plan *p, float *y,
			   const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	return p->wgs == 4 ? qw_dispatch_nt<ST, VAR, 4>(ctx, p, y, w, q, M, N, K, accumulate)
			   : qw_dispatch_nt<ST, VAR, 2>(ctx, p, y, w, q, M, N, K, accumulate);
}

template <typename ST>
static int qw_dispatch_var(const struct k_cuda_linear *ctx, const struct qw_plan *p, float *y,
			   const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	if (q->fmt == K_Q_INT4)
		return qw_dispatch_wgs<ST, 2>(ctx, p, y, w, q, M, N, K, accumulate);
	if (qm_bc_shift(q, K, QW_BK) == 31)	// one scale column
		return qw_dispatch_wgs<ST, 1>(ctx, p, y, w, q, M, N, K, accumulate);
	return qw_dispatch_wgs<ST, 0>(ctx, p, y, w, q, M, N, K, accumulate);
}

static int qw_run(const struct k_cuda_linear *ctx, const struct qw_plan *p, float *y,
		  const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	return q->scale_dtype == K_F16
		       ? qw_dispatch_var<__half>(ctx, p, y, w, q, M, N, K, accumulate)
		       : qw_dispatch_var<float>(ctx, p, y, w, q, M, N, K, accumulate);
}

// x (M, K) rounded to f16 and permuted into the context's scratch.
static int qw_x_launch(const struct k_cuda_linear *ctx, const float *x, int M, int K, bool int4)
{
	const size_t units = (size_t)M * K / 8;
	cudaLaunchAttribute attr[1] = {};
	const cudaLaunchConfig_t cfg = k_cuda_lin_stage_cfg(ctx, units, attr);

	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, int4 ? qw4_x_kernel : qw_x_kernel, ctx->xb,
						     x, units, ctx->pdl));
}

struct qw_call {
	const void *w;
	const struct k_quant *q;
	int M, N, K;
};

// Candidate cand (qw_candidate_wgs) of a tuning.
static int qw_enqueue(const struct k_cuda_linear *ctx, void *arg, int cand, float *ys)
{
	const struct qw_call *c = (const struct qw_call *)arg;
	struct qw_plan p = {};
	long cost;

	if (!qw_plan_at(ctx, qw_fi(c->q), c->M, c->N, c->K, qw_candidate_wgs(c->M, cand),
			(cand - 1) % LIN_ST_MAX_SPLIT + 1, &p, &cost))
		return -EINVAL;
	return qw_run(ctx, &p, ys, c->w, c->q, c->M, c->N, c->K, 0);
}

int k_cuda_lin_qwg_takes(const struct k_cuda_linear *ctx, const struct k_quant *q,
			 int M, int N, int K)
{
	const int bk = q && q->fmt == K_Q_INT4 ? QW4_BK : QW_BK;

	return ctx->qw_ok && k_cuda_tuning()->linear_qwg && q &&
	       (q->fmt == K_Q_FP8 || q->fmt == K_Q_INT4) && M >= 1 &&
	       M <= K_CUDA_LINEAR_Q_TILE_MAX_M && N >= 1 && K >= bk && K % bk == 0 &&
	       qm_bc_shift(q, K, q->fmt == K_Q_INT4 ? 32 : QW_BK) >= 0;
}

int k_cuda_lin_qwg(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		   const struct k_quant *q, int M, int N, int K, int accumulate)
{
	const int key = qw_split_key();
	struct qw_plan p = {};
	int ret;

	if (!k_cuda_lin_qwg_takes(ctx, q, M, N, K) || M > ctx->max_M || K > ctx->max_K)
		return -EINVAL;
	if ((ret = qw_x_launch(ctx, x, M, K, q->fmt == K_Q_INT4)))
		return ret;
	if (k_cuda_lin_split_wanted(ctx, key, q, M, N, K)) {
		const struct qw_call c = { w, q, M, N, K };

		qw_make_plan(ctx, qw_fi(q), M, N, K, &p);
		// the model's plan is candidate S (default rows)
		k_cuda_lin_split_keep(ctx, key, q, M, N, K,
				      k_cuda_lin_split_tune(ctx, q->fmt == K_Q_INT4
									 ? "qwgmma int4 (S1..8 default rows, "
									   "S9..16 the other)"
									 : "qwgmma fp8 (S1..8 default rows, "
									   "S9..16 the other)",
							    M, N, K, QW_CANDIDATES(!qw_rows_forced()),
							    p.S, qw_enqueue, (void *)&c));
	}
	qw_ctx_plan(ctx, q, M, N, K, &p);
	return qw_run(ctx, &p, y, w, q, M, N, K, accumulate);
}

int k_cuda_lin_qwg_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			    int N, int K, char *buf, size_t len)
{
	struct qw_plan p = {};
	const int mc = M < K_CUDA_LINEAR_Q_TILE_MAX_M ? M : K_CUDA_LINEAR_Q_TILE_MAX_M;

	qw_ctx_plan(ctx, q, mc, N, K, &p);
	return snprintf(buf, len, "qwgmma rows=%d nt=%d grid=%dx%d k/slice=%d ctas/sm=%d (%d resident)%s",
			64 * p.wgs, p.nt, p.tiles, p.S, p.KS, p.per_sm,
			ctx->qw_bps[qw_fi(q)][qw_nt_index(mc)][p.wgs == 4], p.spread ? " spread" : "");
}

template <typename ST, int VAR, int NT, int WGS>
static int qw_setup_one(struct k_cuda_linear *ctx, int ni)
{
	using V = qw_var<ST, VAR, NT, WGS>;
	const int fi = VAR == 2, threads = qw_cfg<NT, WGS>::THREADS;
	int bps = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(V::fn(),
				cudaFuncAttributeMaxDynamicSharedMemorySize, V::SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, V::fn(),
					threads, V::SMEM));
	if (ret)
		return ret;
	if (bps < 1) {
		k_cuda_log("cuda: %s wgmma tile kernel (nt %d, %d rows, %d bytes of shared memory) "
			   "fits no multiprocessor of device %d", fi ? "int4" : "fp8", NT, 64 * WGS,
			   V::SMEM, ctx->dev);
		return -EIO;
	}
	if (ctx->qw_bps[fi][ni][WGS == 4] == 0 || bps < ctx->qw_bps[fi][ni][WGS == 4])
		ctx->qw_bps[fi][ni][WGS == 4] = bps;
	return 0;
}

template <typename ST, int VAR, int WGS> static int qw_setup_wgs(struct k_cuda_linear *ctx)
{
	int ret = qw_setup_one<ST, VAR, 2, WGS>(ctx, 0);

	if (!ret)
		ret = qw_setup_one<ST, VAR, 4, WGS>(ctx, 1);
	if (!ret)
		ret = qw_setup_one<ST, VAR, 8, WGS>(ctx, 2);
	return ret;
}

template <typename ST> static int qw_setup_st(struct k_cuda_linear *ctx)
{
	int ret = 0;

	ret = ret ? ret : qw_setup_wgs<ST, 0, 2>(ctx);
	ret = ret ? ret : qw_setup_wgs<ST, 0, 4>(ctx);
	ret = ret ? ret : qw_setup_wgs<ST, 1, 2>(ctx);
	ret = ret ? ret : qw_setup_wgs<ST, 1, 4>(ctx);
	ret = ret ? ret : qw_setup_wgs<ST, 2, 2>(ctx);
	return ret ? ret : qw_setup_wgs<ST, 2, 4>(ctx);
}

int k_cuda_lin_qwg_setup(struct k_cuda_linear *ctx)
{
	int major = 0, minor = 0, *ok = NULL, have = 0, ret;

	ctx->qw_ok = 0;
	if ((ret = LIN_CUDA(ctx->dev, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
							     ctx->dev))) ||
	    (ret = LIN_CUDA(ctx->dev, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
							     ctx->dev))))
		return ret;
	if (major != 9 || minor != 0)	// sm_90a code runs on compute capability 9.0 only
		return 0;
	if ((ret = LIN_CUDA(ctx->dev, cudaMalloc((void **)&ok, sizeof(int)))))
		return ret;
	qw_probe_kernel<<<1, 1, 0, ctx->stream>>>(ok);
	ret = LIN_LAUNCHED(ctx->dev, "qw_probe_kernel");
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaMemcpyAsync(&have, ok, sizeof(int), cudaMemcpyDeviceToHost,
							 ctx->stream));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaStreamSynchronize(ctx->stream));
	cudaFree(ok);
	if (ret || !have)
		return ret;
	ret = qw_setup_st<float>(ctx);
	if (!ret)
		ret = qw_setup_st<__half>(ctx);
	ctx->qw_ok = !ret;
	return ret;
}
