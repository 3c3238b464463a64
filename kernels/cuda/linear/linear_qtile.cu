// The quantized-weight tile kernel for decode batches of 9..64 rows (W8A16 fp8, W4A16
// int4; on compute capability 9.0 both go to the wgmma form, linear_qwgmma.cu, where
// k_cuda_lin_qwg_takes says): weight tiles stream from HBM through a cp.async pipeline in shared memory, each
// warp dequantizes its fragments once for every x row, and K splits over CTAs whose
// partial tiles the last CTA of each tile adds in split order.
//
// Why another kernel (linear_qmma.cu's streaming form covers M <= 64 too): at M = 64 it
// ran at ~0.12 mma.sync a clock per multiprocessor. Its CTA of 8 warps (one m16 tile a
// warp) re-staged x from fp32 in chunks of ~1024 k behind CTA-wide barriers (a loop of
// dependent global loads with nothing else in flight), and split K over clusters whose
// DSMEM reduction summed S remote values per output in a dependent loop. Here, as in the
// bf16 streaming kernel (linear_stream.cu) that runs Llama-3.1-8B at batch 64 near 80%
// of its floor: x is rounded to f16 once per call by a small kernel (int4: each octet
// in the order the fragments want), and each stage brings 64 bytes of each of 128
// weight rows AND that stage's k of every x row through the same cp.async groups, so x
// costs no barrier of its own; a warp owns two m16 tiles (32 rows), so each x fragment
// read from shared memory feeds two MMAs; the split partials go through the context's
// workspace (one pass, all S loads in flight). Measured against a cluster form (H200,
// same call: the S slices a cluster, partials summed through DSMEM by all S ranks):
// that one was 3-8% faster at M = 16 but 35-40% slower at M = 64 where K splits
// (Llama q/k/v 36.4 against 27.0 us, down 65.4 against 46.7), and went back.
//
// Bytes: at M = 64 x costs 2 * 64 bytes a k per CTA against 128 bytes a k of fp8 weights
// (int4: 64): the L2 -> SM traffic is about twice (three times) the weight bytes, all
// from L2 (x is ~0.5 MB). MMAs: 64 rows x 2 FLOP per weight value; fp8 at the HBM floor
// needs ~0.5 m16n8k16 a clock per multiprocessor, about what mma.sync sustains on H200:
// this kernel is bound by the tensor cores near the floor, not by bytes.
//
// Fragments: as linear_qmma.cu (its header says the k order): fp8 64 k a stage, lane
// (g, t) takes 16 bytes (k 16t..16t+15) of weight rows g and g + 8 of each m16 tile and
// the same k of x row g of each n8 tile (32 contiguous bytes of f16 x); int4 128 k a
// stage, 16 bytes = 32 k = one group a lane, x octets stored k 0 4 1 5 2 6 3 7.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_split.cuh"
#include "kernels/cuda/ptx.cuh"

#define QT_WARPS	4
#define QT_THREADS	(QT_WARPS * 32)
#define QT_ROWS		(QT_WARPS * 32)	/* weight rows per CTA: two m16 tiles a warp */
#define QT_SB		64		/* bytes of a weight row per stage: 4 lanes x 16 */
#define QT_STAGES	4		/* buffers; QT_STAGES - 1 stages in flight ahead */
#define QT_AHEAD	(QT_STAGES - 1)
/* Fixed cost of a CTA (prologue, pipeline ramp, epilogue) in stages, for the split. */
#define QT_CTA_OVERHEAD	3
/* Warps a multiprocessor needs before the tensor cores, not latency, bound it (the
 * split model's guess: 4 warps of one CTA leave it about half idle). */
#define QT_FULL_WARPS	8

template <int FMT, int NT> struct qt_cfg {
	static constexpr int SLAB = qm_fmt<FMT>::SLAB;		// k per stage
	static constexpr int XROWS = 8 * NT;			// x rows per launch
	static constexpr int XSTRIDE = (SLAB + 8) * 2;		// bytes a row of x: 16 pad
	static constexpr int W_BYTES = QT_ROWS * QT_SB;		// 8 KB
	static constexpr int X_BYTES = XROWS * XSTRIDE;
	static constexpr int STAGE = W_BYTES + X_BYTES;
	static constexpr int SMEM = QT_STAGES * STAGE;
};

// ---- kernels ------------------------------------------------------------------

// xh (M, K) f16 = x rounded to nearest even (|x| > 65504 becomes inf), one octet of k a
// thread; PERM (int4): each octet stored as k 0 4 1 5 2 6 3 7. K % 8 == 0, x 16-byte
// aligned.
template <bool PERM>
__global__ void __launch_bounds__(256)
qt_x_kernel(uint16_t *xh, const float *x, size_t octets, int pdl)
{
	k_cuda_lin_inputs_ready(pdl);	// x is the previous kernel's output
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < octets;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float4 a = ((const float4 *)x)[2 * i], b = ((const float4 *)x)[2 * i + 1];

		((uint4 *)xh)[i] = qm_pack_x8<PERM>(a, b);
	}
}

// The x part of a stage: k [k, k + SLAB) of x rows 0 .. XROWS-1 (zeros past M and past
// the slice), row m at m * XSTRIDE, int4 units placed by qm_xunit.
template <int FMT, int NT>
static __device__ __forceinline__ void qt_load_x(unsigned char *xs, const uint16_t *xh,
						 const qf_args &a, int k, int kend, int tid)
{
	using C = qt_cfg<FMT, NT>;
	constexpr int UPR = C::SLAB / 8;	// 16-byte units a row

#pragma unroll
	for (int j = 0; j < C::XROWS * UPR / QT_THREADS; j++) {
		const int i = tid + j * QT_THREADS, m = i / UPR, u = i % UPR, kk = k + 8 * u;
		const bool ok = m < a.M && kk < kend;

		cp_async16(xs + m * C::XSTRIDE + 16 * qm_xunit<FMT>(u),
			   ok ? xh + (size_t)m * a.K + kk : xh, ok);
	}
}

// The scales of a stage starting at k for the lane's four rows (c: m16 tile c >> 1, row
// g + 8 (c & 1)): fp8 the stage's column (the sum over all four lanes' k is scaled, so
// it is taken whenever the stage is), int4 the group of the lane's 32 k. Zeros where no
// scale exists (past N, past the slice).
template <int FMT, typename ST>
static __device__ __forceinline__ void qt_scales(float (&sr)[4], const ST *scale, const qf_args &a,
						 const size_t (&srow)[4], const bool (&rok)[4], int k,
						 int kend, int t)
{
	const int kk = FMT == K_Q_INT4 ? k + 32 * t : k;

#pragma unroll
	for (int c = 0; c < 4; c++)
		sr[c] = rok[c] && kk < kend ? qm_scale(scale, srow[c] + (size_t)(kk >> a.bc_shift)) : 0.f;
}

// One stage: the warp's two m16 weight tiles against the NT n8 tiles of x. Each weight
// fragment is dequantized once; each x fragment is read once for both tiles.
template <int FMT, int NT>
static __device__ __forceinline__ void qt_compute(float (&acc)[2][NT][4], const unsigned char *ws,
						  const unsigned char *xs, const float (&sr)[4],
						  int warp, int g, int t)
{
	using C = qt_cfg<FMT, NT>;
	uint32_t wa[2][4], wb[2][4];

#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int r = warp * 32 + mt * 16 + g;
		const uint4 va = *(const uint4 *)(ws + r * QT_SB + 16 * t);
		const uint4 vb = *(const uint4 *)(ws + (r + 8) * QT_SB + 16 * t);

		wa[mt][0] = va.x, wa[mt][1] = va.y, wa[mt][2] = va.z, wa[mt][3] = va.w;
		wb[mt][0] = vb.x, wb[mt][1] = vb.y, wb[mt][2] = vb.z, wb[mt][3] = vb.w;
	}
	if constexpr (FMT == K_Q_FP8) {
		const unsigned char *xp = xs + g * C::XSTRIDE + 32 * t;
		uint32_t af[2][4][4];

#pragma unroll
		for (int mt = 0; mt < 2; mt++)
#pragma unroll
			for (int j = 0; j < 4; j++) {
				qm_e4m3x4(wa[mt][j], af[mt][j][0], af[mt][j][2]);
				qm_e4m3x4(wb[mt][j], af[mt][j][1], af[mt][j][3]);
			}
#pragma unroll
		for (int nt = 0; nt < NT; nt++) {
			const uint4 x0 = *(const uint4 *)(xp + nt * 8 * C::XSTRIDE);
			const uint4 x1 = *(const uint4 *)(xp + nt * 8 * C::XSTRIDE + 16);
			const uint32_t xw[8] = { x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w };

#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
				float tmp[4] = { 0.f, 0.f, 0.f, 0.f };

#pragma unroll
				for (int j = 0; j < 4; j++)
					qm_mma(tmp, af[mt][j][0], af[mt][j][1], af[mt][j][2],
					       af[mt][j][3], xw[2 * j], xw[2 * j + 1]);
				acc[mt][nt][0] = fmaf(tmp[0], sr[2 * mt], acc[mt][nt][0]);
				acc[mt][nt][1] = fmaf(tmp[1], sr[2 * mt], acc[mt][nt][1]);
				acc[mt][nt][2] = fmaf(tmp[2], sr[2 * mt + 1], acc[mt][nt][2]);
				acc[mt][nt][3] = fmaf(tmp[3], sr[2 * mt + 1], acc[mt][nt][3]);
			}
		}
	} else {
		const unsigned char *xp = xs + g * C::XSTRIDE + 64 * t;
		const int sw = (t >> 1) << 1;	// qm_xunit: units 4t + q sit at 4t + (q ^ sw)
		__half2 hs[4];

#pragma unroll
		for (int c = 0; c < 4; c++)
			hs[c] = __float2half2_rn(sr[c]);
#pragma unroll
		for (int q = 0; q < 4; q++) {
			uint32_t af[2][2][4];

#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
				uint32_t fa[4], fb[4];

				k_dq_i4x8(wa[mt][q], hs[2 * mt], fa);
				k_dq_i4x8(wb[mt][q], hs[2 * mt + 1], fb);
#pragma unroll
				for (int h = 0; h < 2; h++) {
					af[mt][h][0] = fa[2 * h];
					af[mt][h][1] = fb[2 * h];
					af[mt][h][2] = fa[2 * h + 1];
					af[mt][h][3] = fb[2 * h + 1];
				}
			}
#pragma unroll
			for (int nt = 0; nt < NT; nt++) {
				const uint4 xq = *(const uint4 *)(xp + nt * 8 * C::XSTRIDE + 16 * (q ^ sw));

#pragma unroll
				for (int mt = 0; mt < 2; mt++) {
					qm_mma(acc[mt][nt], af[mt][0][0], af[mt][0][1], af[mt][0][2],
					       af[mt][0][3], xq.x, xq.y);
					qm_mma(acc[mt][nt], af[mt][1][0], af[mt][1][1], af[mt][1][2],
					       af[mt][1][3], xq.z, xq.w);
				}
			}
		}
	}
}

// grid (tiles, S): blockIdx.x the 128-row tile, blockIdx.y the K slice [s KC, s KC + KC).
// xh: x (M, K) in f16 as qt_x_kernel wrote it; ws: (tiles * S, XROWS, QT_ROWS) fp32
// partials; cnt: (tiles) arrival counters, zero between launches. Needs K % 16 (fp8) or
// % 32 (int4) == 0, w rows 16-byte aligned, M <= XROWS, a scale column constant over
// a stage (fp8) or a lane's 32 k (int4).
template <int FMT, typename ST, int NT>
__global__ void __launch_bounds__(QT_THREADS)
qt_kernel(float *y, const uint16_t *xh, const uint8_t *__restrict__ w, const ST *__restrict__ scale,
	  qf_args a, float *ws, unsigned *cnt)
{
	using C = qt_cfg<FMT, NT>;
	constexpr int VPB = qm_fmt<FMT>::VPB;	// values a byte
	extern __shared__ __align__(128) unsigned char qt_smem[];
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
	const int tile = blockIdx.x, S = gridDim.y, s = blockIdx.y;
	const int n0 = tile * QT_ROWS, k0 = s * a.KC, kend = min(a.K, k0 + a.KC);
	const int nst = k0 < kend ? (kend - k0 + C::SLAB - 1) / C::SLAB : 0;
	const int kb0 = k0 / VPB, kb_end = kend / VPB;	// in bytes of a row
	size_t srow[4];
	bool rok[4];
	float acc[2][NT][4] = {};
	float sr[QT_STAGES][4];

#pragma unroll
	for (int c = 0; c < 4; c++) {
		const int n = n0 + lin_frag_row(warp, c >> 1, g, 2 * (c & 1));

		rok[c] = n < a.N;
		srow[c] = (size_t)((rok[c] ? n : 0) / a.block_rows) * (size_t)a.scale_cols;
	}
	// weights are constant: the first stages stream in while the previous kernel drains
#pragma unroll
	for (int i = 0; i < QT_AHEAD; i++) {
		if (i < nst)
			qf_load_w64<QT_ROWS, QT_THREADS, true>(qt_smem + i * C::STAGE, w, a, n0,
								kb0 + i * QT_SB, kb_end, tid);
		cp_async_commit();
	}
	k_cuda_lin_inputs_ready(a.pdl);	// x, y and the scales only from here on
#pragma unroll
	for (int i = 0; i < QT_AHEAD; i++) {
		if (i < nst)
			qt_load_x<FMT, NT>(qt_smem + i * C::STAGE + C::W_BYTES, xh, a, k0 + i * C::SLAB,
					   kend, tid);
		cp_async_commit();
		qt_scales<FMT, ST>(sr[i], scale, a, srow, rok, k0 + i * C::SLAB, kend, t);
	}
	// groups so far: W0 W1 W2 X0 X1 X2; then one (W, X) group per stage. Before stage
	// i, its last group has exactly QT_AHEAD - 1 newer ones. Stage i sits in buffer
	// i % QT_STAGES = j, its scales in sr[j] (the loop over j unrolled: registers).
	for (int i0 = 0; i0 < nst; i0 += QT_STAGES) {
#pragma unroll
		for (int j = 0; j < QT_STAGES; j++) {
			const int i = i0 + j, nx = i + QT_AHEAD, slot = (j + QT_AHEAD) % QT_STAGES;

			if (i >= nst)
				break;
			cp_async_wait<QT_AHEAD - 1>();
			__syncthreads();	// stage i visible; stage i - 1's buffer free
			if (nx < nst) {
				unsigned char *st = qt_smem + slot * C::STAGE;

				qf_load_w64<QT_ROWS, QT_THREADS, false>(st, w, a, n0, kb0 + nx * QT_SB,
									 kb_end, tid);
				qt_load_x<FMT, NT>(st + C::W_BYTES, xh, a, k0 + nx * C::SLAB, kend, tid);
				qt_scales<FMT, ST>(sr[slot], scale, a, srow, rok, k0 + nx * C::SLAB, kend, t);
			}
			cp_async_commit();
			const unsigned char *st = qt_smem + j * C::STAGE;

			qt_compute<FMT, NT>(acc, st, st + C::W_BYTES, sr[j], warp, g, t);
		}
	}
	cp_async_wait<0>();

	if (S == 1) {
		lin_store_tiles<NT>(y, acc, a.M, a.N, n0, a.accumulate, warp, g, t);
		return;
	}
	float *part = ws + ((size_t)tile * S + s) * C::XROWS * QT_ROWS;

#pragma unroll
	for (int mt = 0; mt < 2; mt++)
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int c = 0; c < 4; c++) {
				const int m = lin_frag_m(nt, t, c);

				if (m < a.M)
					__stcg(part + m * QT_ROWS + lin_frag_row(warp, mt, g, c), acc[mt][nt][c]);
			}
	if (!lin_split_last(cnt, tile, S))
		return;
	lin_split_sum4<QT_ROWS, QT_THREADS, 0>(y, ws + (size_t)tile * S * C::XROWS * QT_ROWS,
					       (size_t)C::XROWS * QT_ROWS, a.M, a.N, n0, S,
					       a.accumulate, tid);
	if (tid == 0)
		cnt[tile] = 0;
}

// ---- launchers ----------------------------------------------------------------

static int qt_fmt_index(const struct k_quant *q)
{
	return q->fmt == K_Q_INT4 ? 1 : 0;
}

static int qt_nt_index(int M)
{
	return M <= 16 ? 0 : M <= 32 ? 1 : 2;
}

extern "C" int k_cuda_linear_q_tile_supports(const struct k_quant *q, const float *x,
					     const void *w, int M, int N, int K)
{
	return q && x && w && M >= 1 && M <= K_CUDA_LINEAR_Q_TILE_MAX_M && N >= 1 && K >= 1 &&
	       (q->fmt == K_Q_FP8 || q->fmt == K_Q_INT4) && q->block_rows >= 1 &&
	       q->block_cols >= 1 && q->scale &&
	       (q->scale_dtype == K_F32 || q->scale_dtype == K_F16) && !((uintptr_t)x & 15) &&
	       !((uintptr_t)w & 15) && K % (q->fmt == K_Q_INT4 ? 32 : 16) == 0 &&
	       qm_bc_shift(q, K, q->fmt == K_Q_INT4 ? 32 : 64) >= 0;
}

// Shared memory of a CTA (format index, n8 tiles), bytes.
static int qt_smem_bytes(int fi, int nt)
{
	static const int smem[2][3] = {
		{ qt_cfg<K_Q_FP8, 2>::SMEM, qt_cfg<K_Q_FP8, 4>::SMEM, qt_cfg<K_Q_FP8, 8>::SMEM },
		{ qt_cfg<K_Q_INT4, 2>::SMEM, qt_cfg<K_Q_INT4, 4>::SMEM, qt_cfg<K_Q_INT4, 8>::SMEM },
	};

	return smem[fi][nt <= 2 ? 0 : nt <= 4 ? 1 : 2];
}

struct qt_plan {
	int nt;		// n8 tiles of x rows
	int tiles;	// 128-row weight tiles
	int S;		// K slices
	int KS;		// k per slice
	int per_sm;	// CTAs a multiprocessor runs (some one fewer)
};

// The plan with split S of the stages and its modelled cost: a multiprocessor's time ~
// its CTAs x (stages a slice + overhead), at a rate that grows with the warps it holds at
// once up to QT_FULL_WARPS. false where S gives no plan of its own: its slices are a
// smaller S's, or S > 1 needs more CTAs than the workspace holds (LIN_ST_MAX_UNITS).
static bool qt_plan_at(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
		       int K, int S, struct qt_plan *p, long *cost)
{
	const int fi = qt_fmt_index(q), ni = qt_nt_index(M), slab = fi ? 128 : 64;
	const int tiles = (N + QT_ROWS - 1) / QT_ROWS, nst = (K + slab - 1) / slab;
	const int bps = ctx->qt_bps[fi][ni] > 0 ? ctx->qt_bps[fi][ni] : 1;
	const long n_sm = ctx->n_sm > 0 ? ctx->n_sm : 1;
	int kb;
	long units, per_sm, warps;

	if (S < 1 || S > LIN_ST_MAX_SPLIT || S > nst)
		return false;
	kb = (nst + S - 1) / S;
	units = (long)tiles * S;
	if ((nst + kb - 1) / kb != S || (S > 1 && units > LIN_ST_MAX_UNITS))
		return false;
	per_sm = (units + n_sm - 1) / n_sm;
	warps = (per_sm < bps ? per_sm : bps) * QT_WARPS;
	*cost = per_sm * (kb + QT_CTA_OVERHEAD) * QT_FULL_WARPS /
		(warps < QT_FULL_WARPS ? warps : QT_FULL_WARPS);
	*p = qt_plan{ 2 << ni, tiles, S, kb * slab, (int)per_sm };
	return true;
}

// The model's pick over every split (ties to the smaller; S 1 always gives a plan).
static void qt_make_plan(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
			 int K, struct qt_plan *p)
{
	long best = -1, cost;
	struct qt_plan c;

	for (int S = 1; S <= LIN_ST_MAX_SPLIT; S++)
		if (qt_plan_at(ctx, q, M, N, K, S, &c, &cost) && (best < 0 || cost < best)) {
			best = cost;
			*p = c;
		}
}

// The plan of an M-row call: its bucket's tuned split (linear_tune.cu) where there is
// one, else the model's.
static void qt_ctx_plan(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
			int K, struct qt_plan *p)
{
	const int S = k_cuda_lin_split_find(ctx, K_CUDA_LINEAR_Q_TILE, q, M, N, K);
	long cost;

	if (!S || !qt_plan_at(ctx, q, M, N, K, S, p, &cost))
		qt_make_plan(ctx, q, M, N, K, p);
}

template <int FMT, typename ST, int NT>
static int qt_launch(const struct k_cuda_linear *ctx, const struct qt_plan *p, float *y,
		     const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};
	const qf_args a = qf_make_args(q, M, N, K, p->KS, FMT == K_Q_INT4 ? 32 : 64, accumulate,
				       ctx->pdl);

	cfg.gridDim = dim3(p->tiles, p->S, 1);
	cfg.blockDim = dim3(QT_THREADS, 1, 1);
	cfg.dynamicSmemBytes = qt_cfg<FMT, NT>::SMEM;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qt_kernel<FMT, ST, NT>, y,
						     (const uint16_t *)ctx->xb, (const uint8_t *)w,
						     (const ST *)q->scale, a, ctx->st_ws, ctx->st_cnt));
}

template <int FMT, typename ST>
static int qt_dispatch(const struct k_cuda_linear *ctx, const struct qt_plan *p, float *y,
		       const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	switch (p->nt) {
	case 2: return qt_launch<FMT, ST, 2>(ctx, p, y, w, q, M, N, K, accumulate);
	case 4: return qt_launch<FMT, ST, 4>(ctx, p, y, w, q, M, N, K, accumulate);
	default: return qt_launch<FMT, ST, 8>(ctx, p, y, w, q, M, N, K, accumulate);
	}
}

// x (M, K) rounded to f16 into the context's scratch, in the fragments' order.
static int qt_x_launch(const struct k_cuda_linear *ctx, const float *x, int M, int K, bool perm)
{
	const size_t octets = (size_t)M * K / 8;
	cudaLaunchAttribute attr[1] = {};
	const cudaLaunchConfig_t cfg = k_cuda_lin_stage_cfg(ctx, octets, attr);

	return perm ? LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qt_x_kernel<true>, ctx->xb, x,
							    octets, ctx->pdl))
		    : LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qt_x_kernel<false>, ctx->xb, x,
							    octets, ctx->pdl));
}

static int qt_run(const struct k_cuda_linear *ctx, const struct qt_plan *p, float *y,
		  const void *w, const struct k_quant *q, int M, int N, int K, int accumulate)
{
	if (q->fmt == K_Q_INT4)
		return q->scale_dtype == K_F16
			       ? qt_dispatch<K_Q_INT4, __half>(ctx, p, y, w, q, M, N, K, accumulate)
			       : qt_dispatch<K_Q_INT4, float>(ctx, p, y, w, q, M, N, K, accumulate);
	return q->scale_dtype == K_F16
		       ? qt_dispatch<K_Q_FP8, __half>(ctx, p, y, w, q, M, N, K, accumulate)
		       : qt_dispatch<K_Q_FP8, float>(ctx, p, y, w, q, M, N, K, accumulate);
}

// A tuning's launch of split S (k_cuda_lin_split_tune), on x already staged in ctx->xb.
struct qt_call {
	const void *w;
	const struct k_quant *q;
	int M, N, K;
};

static int qt_enqueue(const struct k_cuda_linear *ctx, void *arg, int S, float *ys)
{
	const struct qt_call *c = (const struct qt_call *)arg;
	struct qt_plan p = {};
	long cost;

	if (!qt_plan_at(ctx, c->q, c->M, c->N, c->K, S, &p, &cost))
		return -EINVAL;
	return qt_run(ctx, &p, ys, c->w, c->q, c->M, c->N, c->K, 0);
}

int k_cuda_lin_qtile(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		     const struct k_quant *q, int M, int N, int K, int accumulate)
{
	struct qt_plan p = {};
	int ret;

	if (!k_cuda_linear_q_tile_supports(q, x, w, M, N, K) || M > ctx->max_M || K > ctx->max_K)
		return -EINVAL;
	if (k_cuda_lin_qwg_takes(ctx, q, M, N, K))	// fp8 on wgmma (linear_qwgmma.cu)
		return k_cuda_lin_qwg(ctx, y, x, w, q, M, N, K, accumulate);
	if ((ret = qt_x_launch(ctx, x, M, K, q->fmt == K_Q_INT4)))
		return ret;
	if (k_cuda_lin_split_wanted(ctx, K_CUDA_LINEAR_Q_TILE, q, M, N, K)) {
		const struct qt_call c = { w, q, M, N, K };

		qt_make_plan(ctx, q, M, N, K, &p);
		k_cuda_lin_split_keep(ctx, K_CUDA_LINEAR_Q_TILE, q, M, N, K,
				      k_cuda_lin_split_tune(ctx, q->fmt == K_Q_INT4 ? "qtile int4"
									      : "qtile fp8",
							    M, N, K, LIN_ST_MAX_SPLIT, p.S, qt_enqueue,
							    (void *)&c));
	}
	qt_ctx_plan(ctx, q, M, N, K, &p);
	return qt_run(ctx, &p, y, w, q, M, N, K, accumulate);
}

int k_cuda_lin_qtile_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			      int N, int K, char *buf, size_t len)
{
	struct qt_plan p = {};
	const int mc = M < K_CUDA_LINEAR_Q_TILE_MAX_M ? M : K_CUDA_LINEAR_Q_TILE_MAX_M;

	if (k_cuda_lin_qwg_takes(ctx, q, mc, N, K))
		return k_cuda_lin_qwg_describe(ctx, q, M, N, K, buf, len);
	qt_ctx_plan(ctx, q, mc, N, K, &p);
	return snprintf(buf, len, "qtile nt=%d grid=%dx%d k/slice=%d ctas/sm=%d (%d resident) smem=%d",
			p.nt, p.tiles, p.S, p.KS, p.per_sm,
			ctx->qt_bps[qt_fmt_index(q)][qt_nt_index(mc)], qt_smem_bytes(qt_fmt_index(q), p.nt));
}

template <int FMT, typename ST, int NT> static int qt_setup_one(struct k_cuda_linear *ctx, int ni)
{
	const int fi = FMT == K_Q_INT4 ? 1 : 0;
	int bps = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qt_kernel<FMT, ST, NT>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, qt_cfg<FMT, NT>::SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps,
					qt_kernel<FMT, ST, NT>, QT_THREADS, qt_cfg<FMT, NT>::SMEM));
	if (ret)
		return ret;
	if (bps < 1) {
		k_cuda_log("cuda: quantized tile kernel (nt %d, %d bytes of shared memory) fits no "
			   "multiprocessor of device %d", NT, qt_cfg<FMT, NT>::SMEM, ctx->dev);
		return -EIO;
	}
	if (ctx->qt_bps[fi][ni] == 0 || bps < ctx->qt_bps[fi][ni])
		ctx->qt_bps[fi][ni] = bps;
	return 0;
}

template <int FMT, typename ST> static int qt_setup_fmt(struct k_cuda_linear *ctx)
{
	int ret = qt_setup_one<FMT, ST, 2>(ctx, 0);

	if (!ret)
		ret = qt_setup_one<FMT, ST, 4>(ctx, 1);
	if (!ret)
		ret = qt_setup_one<FMT, ST, 8>(ctx, 2);
	return ret;
}

int k_cuda_lin_qtile_setup(struct k_cuda_linear *ctx)
{
	int ret = qt_setup_fmt<K_Q_FP8, float>(ctx);

	if (!ret)
		ret = qt_setup_fmt<K_Q_FP8, __half>(ctx);
	if (!ret)
		ret = qt_setup_fmt<K_Q_INT4, float>(ctx);
	if (!ret)
		ret = qt_setup_fmt<K_Q_INT4, __half>(ctx);
	return ret;
}
