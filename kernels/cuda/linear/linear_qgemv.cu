// The quantized-weight decode GEMV for M <= 8 rows (K_CUDA_LINEAR_Q_GEMV; W8A16 fp8,
// W4A16 int4; and bf16 weights as "format" K_Q_NONE, k_cuda_linear.h's RING kind):
// weights streamed from HBM through a per-warp cp.async ring into mma.sync f16 fragments,
// dequantized in registers, K split over plain CTAs whose partial tiles the last one of
// each row tile adds in split order.
//
// Why another kernel (linear_qmma.cu's streaming form runs the same fragments): that one
// holds the large fp8 matrices at 88% of the HBM floor at M = 1 but the ones under ~60 MB
// at 43-63% (Llama-3.1-8B q/k/v, o_proj, down), a fixed ~4-7 us a call. Its CTAs are 8
// warps of 128 rows and its K split is a thread-block cluster of up to 8 CTAs reduced
// through DSMEM, which the hardware must place whole in one GPC: where its CTAs nearly
// fill two a multiprocessor (a 16.8 MB o_proj: 32 clusters of 8 CTAs of 67 KB, 256 of 264
// slots) a cluster that finds no room waits for a second round, and ncu counts 18% of its
// warps' stall samples in the cluster barrier (docs/results/linear-q-50dc422.txt). Here:
// - a CTA is 4 warps of 16 rows (64 rows): twice as many, half as long CTAs for the same
//   rows, up to four a multiprocessor (48 KB ring + the x slice);
// - no cluster: the split partials go through the context's workspace and the last CTA
//   of a row tile (an atomic count) adds them in split order s = 0 .. S-1, so the sum has
//   the same bits whoever comes last (linear_stream.cu's and linear_qtile.cu's scheme);
// - the split is the one timed fastest for the shape at its M bucket (linear_tune.cu, at
//   the first call outside a capture); untuned (KDEC_LINEAR_Q_TUNE=0, or a shape first
//   seen in a capture) it comes from a model of the per-multiprocessor time
//   (qg_make_plan): the busiest multiprocessor's stages over the rate its warps reach;
// - each warp keeps QG_AHEAD = 5 stages of 2 KB in flight (10 KB; 4 CTAs: 160 KB a
//   multiprocessor), issued before the wait on the previous kernel (weights are constant).
// int4 pairs of values are dequantized with one lop3 each (quant_dequant.cuh's
// k_dq_i4x8: 13 operations a word of 8 values where the shift-mask-subtract form
// before took ~21 in the SASS; the same bits).
//
// Measured (H200, docs/results/linear-q-50dc422.txt, M 1 and 8, fp8 and int4): faster
// than the cluster form where that one's CTAs nearly fill two a multiprocessor (Llama
// q/k/v 10.4 against 12.8 us, o_proj 8.1 against 9.2, down 20.7 against 22.2, Qwen3 q/k/v
// 6.0 against 8.5 at fp8 M = 1), slower where the cluster form runs one wave with room to
// spare (Llama gate/up 37.2 against 31.2: here 1.7 waves of 896 CTAs; Kimi-K2 o_proj 25.1
// against 16.4: two CTAs of 4 warps a multiprocessor, too few warps for the bytes):
// k_cuda_linear_q_choose takes it only in the first case (K_CUDA_LINEAR_Q_GEMV_FILL).
//
// Fragments and the k order: linear_qmma.cu's header (the streaming form's stage of 128
// bytes a row, two slabs: fp8 64 k, int4 128 k a slab; lane (g, t) takes 16 bytes of
// rows g and g + 8 of each slab; x in shared memory as f16, int4 octets k 0 4 1 5 2 6 3 7).
// x (M rows of the CTA's K slice) is rounded to f16 into shared memory once after the
// wait; M * (KC + 8) * 2 bytes, at most QG_MAX_X (the plan splits K further otherwise).
// bf16 weights (K_Q_NONE): a stage is 64 k (128 bytes a row), a slab 32, a lane's 8 k of
// each row against x rounded to bf16 in k order (linear_qfrag.cuh's qm_slab), no scales:
// the same ring, split, PDL start and folded SwiGLU or norm as the quantized forms.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_qstream.cuh"
#include "kernels/cuda/linear/linear_split.cuh"
#include "kernels/cuda/ops/rmsnorm_rs.cuh"
#include "kernels/cuda/quant_dequant.cuh"
#include "kernels/cuda/ptx.cuh"

#define QG_WARPS	4
#define QG_THREADS	(QG_WARPS * 32)
#define QG_ROWS		(QG_WARPS * 16)	/* weight rows per CTA: one m16 tile a warp */
#define QG_STAGES	6		/* ring slots a warp */
#define QG_AHEAD	(QG_STAGES - 1)	/* stages in flight ahead of the one computed */
#define QG_RING		(QG_WARPS * QG_STAGES * QS_WSTAGE)	/* 48 KB */
#define QG_MAX_X	(64 << 10)	/* bytes of the x slice in shared memory, at most */
#define QG_MAX_SPLIT	LIN_ST_MAX_SPLIT
#define QG_PART		(K_CUDA_LINEAR_Q_MMA_MAX_M * QG_ROWS)	/* floats of a partial tile */
/* The plan's model (qg_make_plan), in stages of a warp: a CTA's fixed cost (x staged
 * behind the wait, ramp, epilogue) and the extra cost of a split (partials out, the last
 * CTA's sum); the warps a multiprocessor needs before bytes, not latency, bound it are
 * k_cuda_tuning's linear_qgemv_warps (8: a warp has 10 KB in flight, ~5-6 warps cover
 * ~32 KB/us at ~1.5-2 us of latency). */
#define QG_CTA_OVERHEAD	2
#define QG_SPLIT_COST	1
/* LIN_QG_X_NORM's shared scratch past the x slice: the norm's partial sums (8 doubles)
 * and the rows' scales (8 floats) */
#define QG_NORM_SMEM	(K_RMS_BLOCK_THREADS / 32 * 8 + K_CUDA_LINEAR_Q_MMA_MAX_M * 4)

// x slice bytes in shared memory: M rows of KC + 8 halves (a multiple of 16)
static __host__ __device__ __forceinline__ long qg_x_bytes(int M, int KC)
{
	return (long)M * (KC + 8) * 2;
}

// ---- kernel -------------------------------------------------------------------

// What x is to the GEMV (qg_stage_x forms the f16 x it multiplies from it):
//   LIN_QG_X_PLAIN  x itself;
//   LIN_QG_X_SWIGLU a SwiGLU's gate_up (M, 2K): x = k_cuda_silu_mul(gate, up), as
//                   k_cuda_silu_mul_rows would have written it;
//   LIN_QG_X_NORM   an RMSNorm's input (M, K): x = w * (x * rs) as k_cuda_rmsnorm
//                   writes it (rs of the whole row, rmsnorm_rs.cuh: the same bits), and
//                   the CTAs of row tile 0 write it to the norm's out as well.
// A norm folded in costs each CTA the whole row (K fp32 a row, from L2) before its
// slice; it spares the norm's own launch and the round trip between the two.

// x rows [0, M), k [k0, k0 + KC) into shared memory as f16 (row stride KC + 8 halves),
// zeros past K; int4 octets reordered k 0 4 1 5 2 6 3 7 and placed by qm_xunit. A
// thread's octets XU at a time, all loads before any store: at M = 8 and a 3584-k
// slice a thread has 28 octets, whose dependent L2 round trips one at a time would cost
// more than the slice's weights. XF: what x is (above); nrm and rs (the rows' norm
// scales) for LIN_QG_X_NORM only.
#define QG_XU	4
template <int FMT, int XF>
static __device__ __forceinline__ void qg_stage_x(uint4 *xs, const float *x, int M, int K,
						  int k0, int KC, const k_cuda_xnorm &nrm,
						  const float *rs)
{
	constexpr bool SW = XF == LIN_QG_X_SWIGLU, NM = XF == LIN_QG_X_NORM;
	constexpr int XU = SW || NM ? QG_XU / 2 : QG_XU;	// twice the floats loaded
	const int per_row = KC / 8, xs_row = (KC + 8) / 8, total = M * per_row;	// 16-byte units
	const size_t x_rs = SW ? 2 * (size_t)K : (size_t)K;
	const bool nout = NM && nrm.out && blockIdx.x == 0;

	for (int i0 = threadIdx.x; i0 < total; i0 += XU * QG_THREADS) {
		float4 a[XU], b[XU], ua[XU], ub[XU];

#pragma unroll
		for (int v = 0; v < XU; v++) {
			const int i = i0 + v * QG_THREADS, m = i / per_row, k = k0 + 8 * (i % per_row);

			a[v] = b[v] = ua[v] = ub[v] = make_float4(0.f, 0.f, 0.f, 0.f);
			if (i < total && k < K) {	// K % 16 == 0: the octet is all in or all out
				const float4 *p = (const float4 *)(x + m * x_rs + k);

				a[v] = p[0];
				b[v] = p[1];
				if (SW) {
					ua[v] = p[K / 4];
					ub[v] = p[K / 4 + 1];
				}
				if (NM) {	// the norm's weights of the octet
					const float4 *pw = (const float4 *)(nrm.w + k);

					ua[v] = pw[0];
					ub[v] = pw[1];
				}
			}
		}
#pragma unroll
		for (int v = 0; v < XU; v++) {
			const int i = i0 + v * QG_THREADS, m = i / per_row, u = i % per_row;

			if (i >= total)
				break;
			if (SW) {
				a[v] = make_float4(k_cuda_silu_mul(a[v].x, ua[v].x),
						   k_cuda_silu_mul(a[v].y, ua[v].y),
						   k_cuda_silu_mul(a[v].z, ua[v].z),
						   k_cuda_silu_mul(a[v].w, ua[v].w));
				b[v] = make_float4(k_cuda_silu_mul(b[v].x, ub[v].x),
						   k_cuda_silu_mul(b[v].y, ub[v].y),
						   k_cuda_silu_mul(b[v].z, ub[v].z),
						   k_cuda_silu_mul(b[v].w, ub[v].w));
			}
			if (NM) {	// zeros past K stay zeros
				a[v] = k_rms_scale4(ua[v], a[v], rs[m]);
				b[v] = k_rms_scale4(ub[v], b[v], rs[m]);
				if (nout && k0 + 8 * u < K) {
					float4 *po = (float4 *)(nrm.out + (size_t)m * K + k0 + 8 * u);

					po[0] = a[v];
					po[1] = b[v];
				}
			}
			xs[m * xs_row + qm_xunit<FMT>(u)] =
				FMT == K_Q_NONE ? qm_pack_x8_bf16(a[v], b[v])
						: qm_pack_x8<FMT == K_Q_INT4>(a[v], b[v]);
		}
	}
}

// grid (row tiles, S): blockIdx.x the 64 rows, blockIdx.y the K slice [s KC, s KC + KC).
// ws: (tiles * S, QG_PART) fp32 partials, cnt: (tiles) arrival counters, zero between
// launches (S > 1 only). Needs K % 16 (fp8) or % 32 (int4) == 0, w rows and x 16-byte
// aligned, M <= 8, the scale column constant over a stage (fp8) or a lane's 32 k (int4).
// XF: what x is (qg_stage_x), nrm its norm (LIN_QG_X_NORM).
template <int FMT, typename ST, int XF>
__global__ void __launch_bounds__(QG_THREADS, 4)
qg_kernel(float *y, const float *x, const uint8_t *__restrict__ w, const ST *__restrict__ scale,
	  qf_args a, float *ws, unsigned *cnt, k_cuda_xnorm nrm)
{
	using F = qm_fmt<FMT>;
	extern __shared__ __align__(16) unsigned char qg_smem[];
	uint4 *xs = (uint4 *)(qg_smem + QG_RING);
	const int tid = threadIdx.x, warp = tid >> 5;
	const int tile = blockIdx.x, S = gridDim.y, s = blockIdx.y, n0 = tile * QG_ROWS;
	const qs_warp<FMT, ST, qf_args, QG_AHEAD> qw(a, w, scale,
						     qg_smem + warp * QG_STAGES * QS_WSTAGE,
						     n0 + warp * 16, s * a.KC);
	const int g = qw.g, t = qw.t, xs_row = (a.KC + 8) / 8;
	float acc[4] = { 0.f, 0.f, 0.f, 0.f };
	float sr[QG_STAGES][4];

	qw.start();	// weights stream in while the previous kernel drains
	k_cuda_lin_inputs_ready(a.pdl);	// x, y and the scales only from here on
#pragma unroll
	for (int i = 0; i < QG_AHEAD; i++)
		qw.scales(sr[i], i);
	if constexpr (XF == LIN_QG_X_NORM) {	// its scratch past the x slice
		double *part = (double *)(qg_smem + QG_RING + qg_x_bytes(a.M, a.KC));
		float *rs = (float *)(part + K_RMS_BLOCK_THREADS / 32);

		k_rms_rs_rows_cta<QG_THREADS>(rs, part, x, a.M, a.K, nrm.eps);
		qg_stage_x<FMT, XF>(xs, x, a.M, a.K, qw.k0, a.KC, nrm, rs);
	} else {
		qg_stage_x<FMT, XF>(xs, x, a.M, a.K, qw.k0, a.KC, nrm, nullptr);
	}
	__syncthreads();

	const uint4 *xr = xs + g * xs_row + F::VPC / 8 * t;	// the lane's first unit of a slab
	const bool xin = g < a.M;
	const int sw = FMT == K_Q_INT4 ? (t >> 1) << 1 : 0;

	qw.run(sr, [](int) {},
	       [&](int i, int h, const uint4 &wa, const uint4 &wb, float sa, float sb) {
		       qm_slab<FMT>(acc, wa, wb, sa, sb, xr + (2 * i + h) * (F::SLAB / 8), sw, xin);
	       });
	cp_async_wait<0>();

	// accumulator c of lane (g, t): x row 2t + (c & 1), weight row g + 8 (c >> 1)
	if (S == 1) {
		qm_store_acc<1>(y, reinterpret_cast<const float (&)[1][4]>(acc), a, qw.ra, qw.rb, t);
		return;
	}
	float *part = ws + ((size_t)tile * S + s) * QG_PART;

#pragma unroll
	for (int c = 0; c < 4; c++) {
		const int m = 2 * t + (c & 1), r = warp * 16 + g + 8 * (c >> 1);

		if (m < a.M)
			__stcg(part + m * QG_ROWS + r, acc[c]);
	}
	if (!lin_split_last(cnt, tile, S))
		return;
	const float *tp = ws + (size_t)tile * S * QG_PART;

	// all S loads of an output issued before the adds, in split order (one output a
	// thread: not linear_split.cuh's float4 sum of stream and qtile, kept as measured)
	for (int e = tid; e < a.M * QG_ROWS; e += QG_THREADS) {
		const int m = e / QG_ROWS, n = n0 + e % QG_ROWS;
		float v[QG_MAX_SPLIT], sum;

#pragma unroll
		for (int q = 0; q < QG_MAX_SPLIT; q++)
			v[q] = q < S ? __ldcg(tp + (size_t)q * QG_PART + e) : 0.f;
		sum = v[0];
#pragma unroll
		for (int q = 1; q < QG_MAX_SPLIT; q++)
			if (q < S)
				sum += v[q];
		if (n < a.N) {
			float *p = y + (size_t)m * a.N + n;

			*p = a.accumulate ? *p + sum : sum;
		}
	}
	if (tid == 0)
		cnt[tile] = 0;
}

// ---- launchers ----------------------------------------------------------------

static int qg_stage_k(const struct k_quant *q)
{
	return q->fmt == K_Q_INT4  ? qs_fmt<K_Q_INT4>::SK
	       : q->fmt == K_Q_NONE ? qs_fmt<K_Q_NONE>::SK
				    : qs_fmt<K_Q_FP8>::SK;
}

struct qg_plan {
	int tiles;	// 64-row tiles
	int S;		// K slices
	int KC;		// k per slice
	int smem;	// dynamic shared memory of a CTA
	int per_sm;	// CTAs the busiest multiprocessor runs
	int bps;	// CTAs resident a multiprocessor
};

// The plan with split S (K in S slices of whole stages) and its modelled cost: the
// busiest multiprocessor's CTAs x (stages a slice + fixed cost), at a rate that grows
// with the warps it holds at once up to linear_qgemv_warps, plus QG_SPLIT_COST where S >
// 1. false where S gives no plan of its own: its slices are a smaller S's, the x slice
// passes QG_MAX_X, or the partials pass the workspace. n_sm, bps_regs, smem_sm (a
// multiprocessor's shared memory), smem_cta (a CTA's beyond the dynamic part): 0 for a
// plan without a context (does any split fit: supports).
static bool qg_plan_at(int n_sm, int bps_regs, int smem_sm, int smem_cta, int sk, int M, int N,
		       int K, int S, struct qg_plan *p, double *cost)
{
	const int full = k_cuda_tuning()->linear_qgemv_warps;
	const int tiles = (N + QG_ROWS - 1) / QG_ROWS, nst = (K + sk - 1) / sk;
	const long ws_floats = (long)LIN_ST_MAX_UNITS * LIN_ST_MAX_M * 128;
	int kb, KC, smem, bps;
	long xb, ctas, per_sm, conc;

	if (S < 1 || S > QG_MAX_SPLIT || S > nst)
		return false;
	kb = (nst + S - 1) / S;
	KC = kb * sk;
	xb = qg_x_bytes(M, KC);
	ctas = (long)tiles * S;
	if ((nst + kb - 1) / kb != S || xb > QG_MAX_X)	// the same slices as a smaller S
		return false;
	if (S > 1 && (tiles > LIN_ST_MAX_UNITS || ctas * QG_PART > ws_floats))
		return false;
	smem = QG_RING + (int)xb;
	bps = smem_sm > 0 ? smem_sm / (smem + smem_cta) : 1;
	if (bps_regs > 0 && bps > bps_regs)
		bps = bps_regs;
	if (bps < 1)
		bps = 1;
	per_sm = n_sm > 0 ? (ctas + n_sm - 1) / n_sm : 1;
	conc = per_sm < bps ? per_sm : bps;
	*cost = (double)per_sm * (kb + QG_CTA_OVERHEAD) *
		(conc * QG_WARPS < full ? (double)full / (conc * QG_WARPS) : 1.0) +
		(S > 1 ? QG_SPLIT_COST : 0);
	*p = qg_plan{ tiles, S, KC, smem, (int)per_sm, bps };
	return true;
}

// The model's pick over every split (ties to the smaller); -EINVAL where none fits.
static int qg_make_plan(int n_sm, int bps_regs, int smem_sm, int smem_cta, int sk, int M,
			int N, int K, struct qg_plan *p)
{
	double best = -1, cost;
	struct qg_plan c;

	for (int S = 1; S <= QG_MAX_SPLIT; S++)
		if (qg_plan_at(n_sm, bps_regs, smem_sm, smem_cta, sk, M, N, K, S, &c, &cost) &&
		    (best < 0 || cost < best - 1e-9)) {
			best = cost;
			*p = c;
		}
	return best < 0 ? -EINVAL : 0;
}

// Why its split is tuned (linear_tune.cu), not taken from this model: the model assumes
// a multiprocessor saturates at linear_qgemv_warps warps, and measured on an H100
// (session 15) no one value suits every shape: 16 makes Llama-3.1-8B's down 9-14% faster
// at M = 1 (fp8 26.1 -> 23.9 us, int4 22.7 -> 19.5) where 32 makes Qwen3-30B-A3B's q/k/v
// slower (int4 7.0 -> 9.5 us). A model's shapes are few and fixed, so each is timed.

// bf16 weights (k_cuda_lin_qgemv's q for them: K_Q_NONE, no scales)
const struct k_quant k_cuda_lin_bf16_q = { K_Q_NONE, NULL, K_BF16, 1, 1, 0 };

// The bf16 form's shapes: K % 8 == 0 (whole 16-byte units of a row and x octets), M <=
// 8, a plan (an x slice within QG_MAX_X, and at most LIN_ST_MAX_UNITS row tiles where K
// must split: Llama-3.1-8B's 128256-row LM head at 8 rows has none); and for a call x
// and w 16-byte aligned.
bool k_cuda_lin_bf16_gemv_shape_ok(int M, int N, int K)
{
	struct qg_plan p = {};

	return M >= 1 && M <= K_CUDA_LINEAR_Q_MMA_MAX_M && N >= 1 && K >= 8 && K % 8 == 0 &&
	       !qg_make_plan(0, 0, 0, 0, qs_fmt<K_Q_NONE>::SK, M, N, K, &p);
}

bool k_cuda_lin_bf16_gemv_supports(const float *x, const void *w, int M, int N, int K)
{
	return x && w && !((uintptr_t)x & 15) && !((uintptr_t)w & 15) &&
	       k_cuda_lin_bf16_gemv_shape_ok(M, N, K);
}

extern "C" int k_cuda_linear_q_gemv_supports(const struct k_quant *q, const float *x,
					     const void *w, int M, int N, int K)
{
	struct qg_plan p = {};

	return q && x && w && M >= 1 && M <= K_CUDA_LINEAR_Q_MMA_MAX_M && N >= 1 && K >= 1 &&
	       (q->fmt == K_Q_FP8 || q->fmt == K_Q_INT4) && q->block_rows >= 1 &&
	       q->block_cols >= 1 && q->scale &&
	       (q->scale_dtype == K_F32 || q->scale_dtype == K_F16) && !((uintptr_t)x & 15) &&
	       !((uintptr_t)w & 15) && K % (q->fmt == K_Q_INT4 ? 32 : 16) == 0 &&
	       qm_bc_shift(q, K, q->fmt == K_Q_INT4 ? 32 : 128) >= 0 &&
	       !qg_make_plan(0, 0, 0, 0, qg_stage_k(q), M, N, K, &p);
}

// The plan of an M-row call: its bucket's tuned split where there is one (and it holds
// M's x slice), else the model's.
static int qg_ctx_plan(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
		       int K, struct qg_plan *p)
{
	const int S = k_cuda_lin_split_find(ctx, K_CUDA_LINEAR_Q_GEMV, q, M, N, K);
	double cost;

	if (S && qg_plan_at(ctx->n_sm, ctx->qg_bps, ctx->qg_smem_sm, ctx->qg_smem_cta,
			    qg_stage_k(q), M, N, K, S, p, &cost))
		return 0;
	return qg_make_plan(ctx->n_sm, ctx->qg_bps, ctx->qg_smem_sm, ctx->qg_smem_cta, qg_stage_k(q),
			    M, N, K, p);
}

template <int FMT, typename ST, int XF>
static int qg_launch(const struct k_cuda_linear *ctx, const struct qg_plan *p, float *y,
		     const float *x, const void *w, const struct k_quant *q, int M, int N, int K,
		     int accumulate, const struct k_cuda_xnorm &nrm)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};
	// bf16: rows of 2K bytes, no scales (one block of one column)
	const qf_args a = FMT == K_Q_NONE
				  ? qf_args{ M, N, K, p->KC, 2 * K, 1, 31, 0, accumulate, ctx->pdl }
				  : qf_make_args(q, M, N, K, p->KC, FMT == K_Q_INT4 ? 32 : 128,
						 accumulate, ctx->pdl);

	cfg.gridDim = dim3(p->tiles, p->S, 1);
	cfg.blockDim = dim3(QG_THREADS, 1, 1);
	cfg.dynamicSmemBytes = p->smem + (XF == LIN_QG_X_NORM ? QG_NORM_SMEM : 0);
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qg_kernel<FMT, ST, XF>, y, x,
						     (const uint8_t *)w, (const ST *)q->scale, a,
						     ctx->st_ws, ctx->st_cnt, nrm));
}

template <int XF>
static int qg_run_xf(const struct k_cuda_linear *ctx, const struct qg_plan *p, float *y,
		     const float *x, const void *w, const struct k_quant *q, int M, int N, int K,
		     int accumulate, const struct k_cuda_xnorm &n)
{
	if (q->fmt == K_Q_NONE)
		return qg_launch<K_Q_NONE, float, XF>(ctx, p, y, x, w, q, M, N, K, accumulate, n);
	if (q->fmt == K_Q_INT4)
		return q->scale_dtype == K_F16
			       ? qg_launch<K_Q_INT4, __half, XF>(ctx, p, y, x, w, q, M, N, K, accumulate, n)
			       : qg_launch<K_Q_INT4, float, XF>(ctx, p, y, x, w, q, M, N, K, accumulate, n);
	return q->scale_dtype == K_F16
		       ? qg_launch<K_Q_FP8, __half, XF>(ctx, p, y, x, w, q, M, N, K, accumulate, n)
		       : qg_launch<K_Q_FP8, float, XF>(ctx, p, y, x, w, q, M, N, K, accumulate, n);
}

// nrm: LIN_QG_X_NORM's norm (NULL otherwise)
static int qg_run(const struct k_cuda_linear *ctx, const struct qg_plan *p, float *y,
		  const float *x, const void *w, const struct k_quant *q, int M, int N, int K,
		  int accumulate, int xf, const struct k_cuda_xnorm *nrm)
{
	const struct k_cuda_xnorm none = {};

	switch (xf) {
	case LIN_QG_X_SWIGLU:
		return qg_run_xf<LIN_QG_X_SWIGLU>(ctx, p, y, x, w, q, M, N, K, accumulate, none);
	case LIN_QG_X_NORM:
		return qg_run_xf<LIN_QG_X_NORM>(ctx, p, y, x, w, q, M, N, K, accumulate, *nrm);
	default:
		return qg_run_xf<LIN_QG_X_PLAIN>(ctx, p, y, x, w, q, M, N, K, accumulate, none);
	}
}

// A tuning's launch of split S (k_cuda_lin_split_tune): a norm's out is not written
// there (the call that follows writes it).
struct qg_call {
	const float *x;
	const void *w;
	const struct k_quant *q;
	int M, N, K;
	int xf;
	struct k_cuda_xnorm nrm;
};

static int qg_enqueue(const struct k_cuda_linear *ctx, void *arg, int S, float *ys)
{
	const struct qg_call *c = (const struct qg_call *)arg;
	struct qg_plan p = {};
	double cost;

	if (!qg_plan_at(ctx->n_sm, ctx->qg_bps, ctx->qg_smem_sm, ctx->qg_smem_cta,
			qg_stage_k(c->q), c->M, c->N, c->K, S, &p, &cost))
		return -EINVAL;
	return qg_run(ctx, &p, ys, c->x, c->w, c->q, c->M, c->N, c->K, 0, c->xf, &c->nrm);
}

int k_cuda_lin_qgemv(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		     const struct k_quant *q, int M, int N, int K, int accumulate, int xf,
		     const struct k_cuda_xnorm *nrm)
{
	struct qg_plan p = {};
	const bool bf16 = q->fmt == K_Q_NONE;

	if (!(bf16 ? k_cuda_lin_bf16_gemv_supports(x, w, M, N, K)
		   : k_cuda_linear_q_gemv_supports(q, x, w, M, N, K)) ||
	    (xf == LIN_QG_X_NORM && !nrm))
		return -EINVAL;
	if (k_cuda_lin_split_wanted(ctx, K_CUDA_LINEAR_Q_GEMV, q, M, N, K) &&
	    !qg_make_plan(ctx->n_sm, ctx->qg_bps, ctx->qg_smem_sm, ctx->qg_smem_cta, qg_stage_k(q),
			  M, N, K, &p)) {
		struct qg_call c = { x, w, q, M, N, K, xf, {} };

		if (nrm)
			c.nrm = { nrm->w, nrm->eps, nullptr };

		k_cuda_lin_split_keep(ctx, K_CUDA_LINEAR_Q_GEMV, q, M, N, K,
				      k_cuda_lin_split_tune(ctx, q->fmt == K_Q_INT4 ? "qgemv int4"
									      : bf16 ? "qgemv bf16"
										     : "qgemv fp8",
							    M, N, K, QG_MAX_SPLIT, p.S, qg_enqueue,
							    (void *)&c));
	}
	if (qg_ctx_plan(ctx, q, M, N, K, &p))
		return -EINVAL;
	return qg_run(ctx, &p, y, x, w, q, M, N, K, accumulate, xf, nrm);
}

int k_cuda_lin_qgemv_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			      int N, int K, char *buf, size_t len)
{
	struct qg_plan p = {};
	const int mc = M < K_CUDA_LINEAR_Q_MMA_MAX_M ? M : K_CUDA_LINEAR_Q_MMA_MAX_M;

	if (qg_ctx_plan(ctx, q, mc, N, K, &p))
		return snprintf(buf, len, "qgemv: no plan");
	return snprintf(buf, len, "qgemv grid=%dx%d k/slice=%d ctas/sm=%d (%d resident) smem=%d",
			p.tiles, p.S, p.KC, p.per_sm, p.bps, p.smem);
}

template <int FMT, typename ST, int XF> static int qg_setup_one(struct k_cuda_linear *ctx)
{
	cudaFuncAttributes fa = {};
	int bps = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qg_kernel<FMT, ST, XF>,
				cudaFuncAttributeMaxDynamicSharedMemorySize,
				QG_RING + QG_MAX_X + (XF == LIN_QG_X_NORM ? QG_NORM_SMEM : 0)));
	if (!ret)	// registers and threads alone: the plan adds the shared memory
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps,
					qg_kernel<FMT, ST, XF>, QG_THREADS, 0));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncGetAttributes(&fa, qg_kernel<FMT, ST, XF>));
	if (ret)
		return ret;
	if (ctx->qg_bps == 0 || bps < ctx->qg_bps)
		ctx->qg_bps = bps > 0 ? bps : 1;
	// a CTA's shared memory beyond the dynamic part: its static part and the 1 KB the
	// system reserves a CTA (sm_80+)
	if ((int)fa.sharedSizeBytes + 1024 > ctx->qg_smem_cta)
		ctx->qg_smem_cta = (int)fa.sharedSizeBytes + 1024;
	return 0;
}

// The five formats' kernels (fp8, int4; fp32 or f16 scales; bf16) of one x form.
template <int XF> static int qg_setup_xf(struct k_cuda_linear *ctx)
{
	int ret = qg_setup_one<K_Q_FP8, float, XF>(ctx);

	if (!ret)
		ret = qg_setup_one<K_Q_NONE, float, XF>(ctx);
	if (!ret)
		ret = qg_setup_one<K_Q_FP8, __half, XF>(ctx);
	if (!ret)
		ret = qg_setup_one<K_Q_INT4, float, XF>(ctx);
	if (!ret)
		ret = qg_setup_one<K_Q_INT4, __half, XF>(ctx);
	return ret;
}

int k_cuda_lin_qgemv_setup(struct k_cuda_linear *ctx)
{
	int smem = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaDeviceGetAttribute(&smem,
				cudaDevAttrMaxSharedMemoryPerMultiprocessor, ctx->dev));
	ctx->qg_smem_sm = smem;
	if (!ret)
		ret = qg_setup_xf<LIN_QG_X_PLAIN>(ctx);
	if (!ret)
		ret = qg_setup_xf<LIN_QG_X_SWIGLU>(ctx);
	if (!ret)
		ret = qg_setup_xf<LIN_QG_X_NORM>(ctx);
	return ret;
}
