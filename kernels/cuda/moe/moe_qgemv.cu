// Quantized routed experts of a decode step (M <= 8 rows; fp8 W8A16, int4 W4A16) as two
// GEMVs over the union of the experts the rows chose, streamed as the dense decode GEMV
// streams a matrix (linear_qgemv.cu: a per-warp cp.async ring of 2 KB stages, mma.sync
// f16 fragments dequantized in registers, linear_qstream.cuh / linear_qfrag.cuh).
//
// Why (issue 24): the small path's CUDA-core kernels (moe_small*.cu) hold bf16 experts
// at 50-74% of the floor but fp8 at 25-47% and int4 at 13-22% at M = 1 (session 7's
// bench_cuda_moe q: Kimi-K2 fp8 175 us for 83 us of bytes): each 16-byte chunk costs
// them 2-4x bf16's instructions and their fixed cost (plan, staging, epilogue) is paid
// per item. The dense GEMV runs the same bytes at 57-88% of the floor (Llama-3.1-8B's
// 117 MB gate/up: 31 us; Kimi-K2's 8 experts' gate/up are 235 MB, their down 117 MB).
// So the experts become two GEMVs:
//   gate/up: the used experts' gate and up matrices as one matrix of n_used * 2 * inter
//     rows (a CTA's 64 rows lie in one expert's gate or up: inter % 64 == 0), K split
//     in S slices over plain CTAs (linear_qgemv.cu's last-CTA sum in split order), out
//     to act (M, n_max * 2 * inter) fp32: union index u's gate at u * 2 inter, its up
//     after; x staged only for the rows that chose the expert (zeros for the others:
//     at M = 8 an expert has ~1 of them);
//   down: a CTA per (64 output rows, used expert): that expert's down rows times
//     silu(gate) * up of the rows that chose it (zeros for the others), staged as f16,
//     its partial tile to the workspace; the last CTA of an output tile adds each row's
//     pairs in increasing expert id, weighted (out overwritten, or += with add).
// Where the gate/up items outnumber the CTAs that fit at once (k_cuda_tuning()->
// moe_qgemv_persist, KDEC_MOE_QGEMV_PERSIST, on) gate/up runs as persistent CTAs, as many
// as fit, each making the union once and walking its (tile, slice) items, the slices
// chosen so the items spread evenly (Kimi-K2 at one row: 512 tiles are 1.3 waves of
// one-item CTAs; persistent, 3 slices: 1536 items on 528 CTAs).
// The union (the distinct valid ids in increasing order, each pair's union index, each
// expert's rows) is computed by every CTA after its PDL wait from the <= 64 ids in
// shared memory, through a bitmap of the chosen experts (mg_union_make); the grids are
// sized for n_max = min(n_experts, M * top_k) experts and the CTAs past n_used return
// at once. Weights are read after the wait (the ids say
// which), so nothing streams before it.
//
// Precision: as the dense quantized GEMV, x and the activations enter the tensor cores
// rounded to f16 (fp8 weights exact in f16, scaled in fp32 per stage; int4 values scaled
// in f16, its group's scale), fp32 accumulation: ~3e-4 relative against the CPU's fp32
// (tests/test_cuda_moe_q.c's QGEMV_TOL 2e-3), where the small path keeps ~1e-5.
// Deterministic: fixed split and expert orders, no atomics on values.
//
// Measured (sessions 19-20, docs/PERFORMANCE.md): every MoE decode step faster than on
// the small path (H100: Qwen3-30B-A3B fp8 batch 1 -11%, batch 8 -19%, int4 batch 8 -48%;
// DeepSeek-V2-Lite fp8 batch 1 -17%; the Kimi-K2 slice's MoE layer -15%), the persistent
// gate/up 1-3% more at batch 8. Kimi-K2's gate/up streams at 57% of the H100's bandwidth
// (its 8 experts stream 14% faster when they are alone in memory than as 8 of 384 spread
// over 17 GB) and Qwen3's small matrices are bound by the round trips after the wait
// (ids, the expert's pointers, its first stages). Session 29 (ncu at 8 rows, H100): the
// union's pair-against-pair loops led the down kernel's stalls and int4's scale
// conversions waited on their loads; without both, Qwen3-30B-A3B int4 batch 8 -9%,
// fp8 -2.5%. Still: gate/up at 12.5% occupancy (x's slice), down 2048 one-item CTAs.
#include <cerrno>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_qstream.cuh"
#include "kernels/cuda/linear/linear_split.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/moe/moe_internal.h"
#include "kernels/cuda/ptx.cuh"

#define MG_WARPS	4
#define MG_THREADS	(MG_WARPS * 32)
#define MG_ROWS		(MG_WARPS * 16)		/* weight rows a CTA: an m16 tile a warp */
#define MG_STAGES	6			/* ring slots a warp */
#define MG_AHEAD	(MG_STAGES - 1)
#define MG_RING		(MG_WARPS * MG_STAGES * QS_WSTAGE)	/* 48 KB */
#define MG_MAX_X	(64 << 10)		/* bytes of a CTA's x slice, at most */
#define MG_MAX_SPLIT	8
#define MG_PAIRS	64			/* M * top_k, at most */
#define MG_MAX_E	1024			/* experts, at most: the union's bitmap */
#define MG_PART		(MOE_QGEMV_MAX_M * MG_ROWS)	/* floats of a partial tile */
#define MG_CTAS_WANTED	2			/* gate/up CTAs a multiprocessor, at least */

namespace {	// kernels and their helpers stay private to this file

// The rows' choice as the CTA sees it (shared memory): pair i = m * top_k + j.
struct mg_union {
	int n_used;			// distinct valid experts
	int e[MG_PAIRS];		// pair i's expert, -1: outside [0, n_experts)
	int u[MG_PAIRS];		// pair i's union index (-1: none)
	int used[MG_PAIRS];		// union index -> expert, increasing
	unsigned rows[MG_PAIRS];	// union index -> bit m: row m chose it
	unsigned char ord[MG_PAIRS];	// row m's slots by union index, at m * top_k
	unsigned bits[MG_MAX_E / 32];	// bit x: expert x chosen
	int below[MG_MAX_E / 32];	// chosen experts in the words before word w
};

// Every thread of the CTA (MG_THREADS >= MG_PAIRS, >= MG_MAX_E / 32). EARLY: before the
// PDL wait (the ids then come from a kernel two or more launches back, or a copy
// before the step). A pair's union index is the number of chosen experts of lower id:
// a bitmap of the chosen ones and its words' prefix counts, where each pair compared
// itself with every other (64 x 64 steps at M = 8: ncu, session 29, put that loop's
// branches at the top of the down kernel's stalls).
template <bool EARLY>
__device__ void mg_union_make(mg_union &un, const int32_t *ids, int M, int top_k, int E)
{
	const int i = threadIdx.x, n = M * top_k, nw = (E + 31) / 32;

	if (i < MG_PAIRS)
		un.rows[i] = 0;
	if (i < nw)
		un.bits[i] = 0;
	if (i < n) {
		const int v = EARLY ? k_cuda_pdl_early(ids + i) : ids[i];

		un.e[i] = v >= 0 && v < E ? v : -1;
	}
	__syncthreads();
	if (i < n && un.e[i] >= 0)
		atomicOr(&un.bits[un.e[i] >> 5], 1u << (un.e[i] & 31));
	__syncthreads();
	if (i < 32) {	// warp 0: the words' exclusive prefix of chosen experts
		const int c = i < nw ? __popc(un.bits[i]) : 0;
		int incl = c;

		for (int off = 1; off < 32; off <<= 1) {
			const int o = __shfl_up_sync(0xffffffffu, incl, off);

			if (i >= off)
				incl += o;
		}
		un.below[i] = incl - c;
		if (i == 31)
			un.n_used = incl;
	}
	__syncthreads();
	if (i < n) {
		const int v = un.e[i];
		const int r = v < 0 ? -1 : un.below[v >> 5] +
					   __popc(un.bits[v >> 5] & ((1u << (v & 31)) - 1u));

		un.u[i] = r;
		if (v >= 0) {
			atomicOr(&un.rows[r], 1u << (i / top_k));
			un.used[r] = v;	// every pair of the expert writes the same id
		}
	}
	__syncthreads();
}

// Row m's slots in increasing union index (expert id), then slot; invalid ones last.
// Threads m < M; the caller synchronises after.
__device__ void mg_row_order(mg_union &un, int M, int top_k)
{
	const int m = threadIdx.x;

	if (m >= M)
		return;
	unsigned char *o = un.ord + m * top_k;
	const int *u = un.u + m * top_k;

	for (int j = 0; j < top_k; j++) {
		const unsigned key = (unsigned)u[j];	// -1: past every index
		int p = j;

		while (p > 0 && (unsigned)u[o[p - 1]] > key) {
			o[p] = o[p - 1];
			p--;
		}
		o[p] = (unsigned char)j;
	}
}

struct mg_args {
	const uint8_t *const *ew;	// (E, 3) payloads: gate, up, down
	const void *const *es;		// (E, 3) their scales
	const int32_t *ids;		// (M, top_k)
	const float *wts;		// (M, top_k)
	const float *x;			// (M, hidden)
	float *act;			// (M, n_max * 2 inter) gate/up out: u's gate at u * 2 inter
	float *part;			// partial tiles, MG_PART floats each
	unsigned *cnt_gu, *cnt_d;	// arrival counts of gate/up and down tiles, zero between
	float *out;			// (M, hidden)
	int M, top_k, E, H, I, n_max;
	int KC;				// gate/up: k a slice (a multiple of the stage; slices:
					// gridDim.y)
	int KCd;			// down: inter rounded up to whole stages
	int add;			// out += (else out =)
	int brows[3], kshift[3], scols[3];	// moe_wq's, per matrix
};

template <int FMT>
__device__ __forceinline__ qf_args mg_qf(const mg_args &a, int j, int N, int K, int KC)
{
	return qf_args{ a.M, N, K, KC, FMT == K_Q_INT4 ? K / 2 : K, a.brows[j], a.kshift[j],
			a.scols[j], 0, 0 };
}

// x rows [0, M) of row stride rs, k [k0, k0 + KC) into shared memory as f16 (row stride
// KC + 8 halves), zeros past K and for rows not in mask; SW: x = k_cuda_silu_mul(x[k],
// x[up + k]) (a SwiGLU's gate and up). linear_qgemv.cu's qg_stage_x with a row stride
// and a row mask: all of a thread's loads before any store.
template <int FMT, bool SW>
__device__ __forceinline__ void mg_stage_x(uint4 *xs, const float *x, size_t rs, int up, int M,
					   unsigned mask, int K, int k0, int KC)
{
	constexpr int XU = SW ? 2 : 4;
	const int per_row = KC / 8, xs_row = (KC + 8) / 8, total = M * per_row;

	for (int i0 = threadIdx.x; i0 < total; i0 += XU * MG_THREADS) {
		float4 a[XU], b[XU], ua[XU], ub[XU];

#pragma unroll
		for (int v = 0; v < XU; v++) {
			const int i = i0 + v * MG_THREADS, m = i / per_row, k = k0 + 8 * (i % per_row);

			a[v] = b[v] = ua[v] = ub[v] = make_float4(0.f, 0.f, 0.f, 0.f);
			if (i < total && k < K && (mask >> m & 1)) {
				const float4 *p = (const float4 *)(x + m * rs + k);

				a[v] = p[0];
				b[v] = p[1];
				if (SW) {
					ua[v] = p[up / 4];
					ub[v] = p[up / 4 + 1];
				}
			}
		}
#pragma unroll
		for (int v = 0; v < XU; v++) {
			const int i = i0 + v * MG_THREADS, m = i / per_row, u = i % per_row;

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
			xs[m * xs_row + qm_xunit<FMT>(u)] = qm_pack_x8<FMT == K_Q_INT4>(a[v], b[v]);
		}
	}
}

// A warp's stream of one matrix: the 2-byte scales converted at their use (RAW; why:
// linear_qstream.cuh).
template <int FMT, typename ST> using mg_stream = qs_warp<FMT, ST, qf_args, MG_AHEAD, true>;

// A warp's m16 tile of one matrix against the staged x: qs_warp's ring over the slice,
// qm_slab's fragments; acc as linear_qgemv.cu's (accumulator c of lane (g, t): x row
// 2t + (c & 1), weight row g + 8 (c >> 1)). The caller has issued qw.start().
template <int FMT, typename ST>
__device__ __forceinline__ void mg_run(const mg_stream<FMT, ST> &qw,
				       const uint4 *xs, int M, int KC, float (&acc)[4])
{
	using F = qm_fmt<FMT>;
	float sr[MG_STAGES][4];
	const int xs_row = (KC + 8) / 8, g = qw.g, t = qw.t;
	const uint4 *xr = xs + g * xs_row + (FMT == K_Q_INT4 ? 4 * t : 2 * t);
	const bool xin = g < M;
	const int sw = FMT == K_Q_INT4 ? (t >> 1) << 1 : 0;

#pragma unroll
	for (int i = 0; i < MG_AHEAD; i++)
		qw.scales(sr[i], i);
	__syncthreads();	// x staged
	qw.run(sr, [](int) {},
	       [&](int i, int h, const uint4 &wa, const uint4 &wb, float sa, float sb) {
		       qm_slab<FMT>(acc, wa, wb, sa, sb, xr + (2 * i + h) * (F::SLAB / 8), sw, xin);
	       });
	cp_async_wait<0>();
}

// One gate/up item: the 64 rows of tile `tile` (union index tile / (2 inter / 64)'s gate
// or up rows) times K slice s of S, to act (one slice) or its partial tile (the last of
// the tile's S CTAs sums them in split order). The whole CTA; un made, uix < n_used.
template <int FMT, typename ST>
__device__ __forceinline__ void mg_gate_up_item(const mg_args &a, const mg_union &un,
						unsigned char *smem, int tile, int s, int S)
{
	const int tid = threadIdx.x, warp = tid >> 5;
	const int tpe = 2 * a.I / MG_ROWS, uix = tile / tpe, r0 = tile % tpe * MG_ROWS;
	const int j = r0 < a.I ? 0 : 1, e = un.used[uix];
	const qf_args q = mg_qf<FMT>(a, j, a.I, a.H, a.KC);
	const mg_stream<FMT, ST> qw(q, a.ew[3 * e + j], (const ST *)a.es[3 * e + j],
				    smem + warp * MG_STAGES * QS_WSTAGE, r0 - j * a.I + warp * 16,
				    s * a.KC);
	float acc[4] = { 0.f, 0.f, 0.f, 0.f };

	qw.start();	// x: only the rows that chose the expert (down reads no other)
	mg_stage_x<FMT, false>((uint4 *)(smem + MG_RING), a.x, (size_t)a.H, 0, a.M,
			       un.rows[uix], a.H, qw.k0, a.KC);
	mg_run<FMT, ST>(qw, (const uint4 *)(smem + MG_RING), a.M, a.KC, acc);

	// act row m, column uix * 2I + r0 + r (r: the CTA's row)
	const size_t rs = (size_t)a.n_max * 2 * a.I;
	float *y = a.act + (size_t)uix * 2 * a.I + r0;

	if (S == 1) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int m = 2 * qw.t + (c & 1), r = warp * 16 + qw.g + 8 * (c >> 1);

			if (m < a.M)
				y[m * rs + r] = acc[c];
		}
		return;
	}
	float *part = a.part + ((size_t)tile * S + s) * MG_PART;

#pragma unroll
	for (int c = 0; c < 4; c++) {
		const int m = 2 * qw.t + (c & 1), r = warp * 16 + qw.g + 8 * (c >> 1);

		if (m < a.M)
			__stcg(part + m * MG_ROWS + r, acc[c]);
	}
	if (!lin_split_last(a.cnt_gu, tile, S))
		return;
	const float *tp = a.part + (size_t)tile * S * MG_PART;

	for (int el = tid; el < a.M * MG_ROWS; el += MG_THREADS) {
		float v[MG_MAX_SPLIT], sum;

#pragma unroll
		for (int p = 0; p < MG_MAX_SPLIT; p++)
			v[p] = p < S ? __ldcg(tp + (size_t)p * MG_PART + el) : 0.f;
		sum = v[0];
#pragma unroll
		for (int p = 1; p < MG_MAX_SPLIT; p++)
			if (p < S)
				sum += v[p];
		y[el / MG_ROWS * rs + el % MG_ROWS] = sum;
	}
	if (tid == 0)
		a.cnt_gu[tile] = 0;
}

// grid (n_max * 2 inter / 64, S): CTA (x, y) is item (tile x, slice y); the CTAs of
// union indices past n_used return at once.
template <int FMT, typename ST>
__global__ void __launch_bounds__(MG_THREADS, 4) mg_gate_up_kernel(mg_args a)
{
	extern __shared__ __align__(16) unsigned char mg_smem[];
	__shared__ mg_union un;

	k_cuda_pdl_wait();	// the ids and x are the previous kernels'
	mg_union_make<false>(un, a.ids, a.M, a.top_k, a.E);
	if ((int)blockIdx.x / (2 * a.I / MG_ROWS) >= un.n_used)
		return;
	mg_gate_up_item<FMT, ST>(a, un, mg_smem, blockIdx.x, blockIdx.y, gridDim.y);
}

// Persistent form (k_cuda_tuning()->moe_qgemv_persist): a grid of at most the CTAs that
// fit at once, each making the union once and then walking items i = x, x + grid, ...
// of the n_used * (2 inter / 64) * S that exist (tile i / S, slice i % S): no CTA of a
// second wave waits for a slot and pays the wait, the union and its pointers again, and
// the plan's S balances the items over the CTAs. (Giving the CTAs of one multiprocessor
// neighbouring items, the same rows of one expert, measured no different: session 20.)
template <int FMT, typename ST>
__global__ void __launch_bounds__(MG_THREADS, 4) mg_gate_up_persist_kernel(mg_args a, int S)
{
	extern __shared__ __align__(16) unsigned char mg_smem[];
	__shared__ mg_union un;

	k_cuda_pdl_wait();
	mg_union_make<false>(un, a.ids, a.M, a.top_k, a.E);
	const int items = un.n_used * (2 * a.I / MG_ROWS) * S;

	for (int i = blockIdx.x; i < items; i += gridDim.x) {
		if (i != (int)blockIdx.x)
			__syncthreads();	// every warp done with the x slice and its ring
		mg_gate_up_item<FMT, ST>(a, un, mg_smem, i / S, i % S, S);
	}
}

// grid (ceil(hidden / 64), n_max): CTA (x, u) multiplies union index u's down rows
// [64 x, 64 x + 64) by its rows' activations; the last of a tile's n_used CTAs combines.
template <int FMT, typename ST>
__global__ void __launch_bounds__(MG_THREADS, 4) mg_down_kernel(mg_args a)
{
	extern __shared__ __align__(16) unsigned char mg_smem[];
	__shared__ mg_union un;
	const int tid = threadIdx.x, warp = tid >> 5, tile = blockIdx.x, uix = blockIdx.y;
	const int n0 = tile * MG_ROWS;
	float acc[4] = { 0.f, 0.f, 0.f, 0.f };

	// The ids are the gate/up kernel's inputs, written before it started: the union,
	// the expert's rows and the first stages of its weights before the wait, while
	// gate/up drains (as the dense GEMV streams its weights before its wait).
	mg_union_make<true>(un, a.ids, a.M, a.top_k, a.E);
	const int e = uix < un.n_used ? un.used[uix] : 0;
	const qf_args q = mg_qf<FMT>(a, 2, a.H, a.I, a.KCd);
	const mg_stream<FMT, ST> qw(
		q, k_cuda_pdl_early(a.ew + 3 * e + 2),
		(const ST *)k_cuda_pdl_early(a.es + 3 * e + 2),
		mg_smem + warp * MG_STAGES * QS_WSTAGE, n0 + warp * 16, 0);

	if (uix < un.n_used)
		qw.start();
	k_cuda_pdl_wait();	// act is the gate/up kernel's
	if (un.n_used == 0 && uix == 0) {	// no valid id at all: the sum is 0
		for (int el = tid; el < a.M * MG_ROWS; el += MG_THREADS)
			if (n0 + el % MG_ROWS < a.H && !a.add)
				a.out[(size_t)(el / MG_ROWS) * a.H + n0 + el % MG_ROWS] = 0.f;
		return;
	}
	if (uix >= un.n_used)
		return;
	mg_stage_x<FMT, true>((uint4 *)(mg_smem + MG_RING), a.act + (size_t)uix * 2 * a.I,
			      (size_t)a.n_max * 2 * a.I, a.I, a.M, un.rows[uix], a.I, 0, a.KCd);
	mg_run<FMT, ST>(qw, (const uint4 *)(mg_smem + MG_RING), a.M, a.KCd, acc);

	float *part = a.part + ((size_t)tile * a.n_max + uix) * MG_PART;

#pragma unroll
	for (int c = 0; c < 4; c++) {
		const int m = 2 * qw.t + (c & 1), r = warp * 16 + qw.g + 8 * (c >> 1);

		if (m < a.M)
			__stcg(part + m * MG_ROWS + r, acc[c]);
	}
	if (!lin_split_last(a.cnt_d, tile, un.n_used))
		return;
	mg_row_order(un, a.M, a.top_k);
	__syncthreads();

	// out[m][n] (+)= sum of w * partial over row m's pairs in increasing expert id; the
	// loads of 8 pairs in flight at once
	const float *tp = a.part + (size_t)tile * a.n_max * MG_PART;

	for (int el = tid; el < a.M * MG_ROWS; el += MG_THREADS) {
		const int m = el / MG_ROWS, r = el % MG_ROWS;
		const unsigned char *o = un.ord + m * a.top_k;
		float sum = 0.f;

		if (n0 + r >= a.H)
			continue;
		for (int j0 = 0; j0 < a.top_k; j0 += 8) {
			float v[8], w[8];
			int uu[8];	// the pair's union index, -1: none (past top_k too)

#pragma unroll
			for (int p = 0; p < 8; p++) {
				const int jj = j0 + p, k = jj < a.top_k ? o[jj] : 0;

				uu[p] = jj < a.top_k ? un.u[m * a.top_k + k] : -1;
				v[p] = uu[p] >= 0 ? __ldcg(tp + (size_t)uu[p] * MG_PART + el) : 0.f;
				w[p] = uu[p] >= 0 ? a.wts[m * a.top_k + k] : 0.f;
			}
#pragma unroll
			for (int p = 0; p < 8; p++)
				if (uu[p] >= 0)
					sum = fmaf(w[p], v[p], sum);
		}
		float *y = a.out + (size_t)m * a.H + n0 + r;

		*y = a.add ? *y + sum : sum;
	}
	if (tid == 0)
		a.cnt_d[tile] = 0;
}

}	// namespace

// ---- host -------------------------------------------------------------------

static long mg_x_bytes(int M, int KC)
{
	return (long)M * (KC + 8) * 2;
}

// CTAs of dynamic shared memory smem a multiprocessor holds at once (228 KB, 1 KB of it
// reserved a CTA, the union's static share; the launch bounds' 4 at most)
static int mg_ctas_per_sm(int smem)
{
	const int per = smem + (int)sizeof(mg_union) + 16 + 1024, n = (228 << 10) / per;

	return n < 4 ? n : 4;
}

// The launch shape of a call, or false where the kernels do not take it. persist: the
// gate/up in its persistent form (p->ctas CTAs walking the items: as many as fit at
// once, at most persist of them where persist > 1).
bool moe_qgemv_make_plan(int fmt, int M, int top_k, int n_experts, int hidden, int inter,
			 int n_sm, int persist, struct moe_qgemv_plan *p)
{
	const int sk = fmt == MQ_INT4 ? qs_fmt<K_Q_INT4>::SK : qs_fmt<K_Q_FP8>::SK;
	const int nst = (hidden + sk - 1) / sk, want = k_cuda_tuning()->moe_qgemv_split;
	size_t gu_parts, d_parts;
	double best_bal = 0.;
	bool best_enough = false;
	int best = 0;

	if ((fmt != MQ_FP8 && fmt != MQ_INT4) || M < 1 || M > MOE_QGEMV_MAX_M || top_k < 1 ||
	    M * top_k > MG_PAIRS || n_experts < 1 || n_experts > MG_MAX_E || hidden < 32 ||
	    hidden % 32 ||
	    inter % MG_ROWS || n_sm < 1)
		return false;
	*p = {};
	p->n_max = n_experts < M * top_k ? n_experts : M * top_k;
	p->gu_tiles = p->n_max * 2 * inter / MG_ROWS;
	p->d_tiles = (hidden + MG_ROWS - 1) / MG_ROWS;
	p->KCd = (inter + sk - 1) / sk * sk;
	if (mg_x_bytes(M, p->KCd) > MG_MAX_X)
		return false;
	// the fewest K slices whose x slice fits and whose CTAs give every multiprocessor
	// MG_CTAS_WANTED (else the most that fit); k_cuda_tuning()->moe_qgemv_split, where
	// it fits, instead. Persistent, where that many items outnumber the CTAs that fit
	// at once: the fewest slices whose busiest CTA's items are within 10% of the mean
	// (items / ctas against ceil(items / ctas)), else the best balanced.
	for (int S = 1; S <= MG_MAX_SPLIT && S <= nst; S++) {
		const int kb = (nst + S - 1) / S;
		const long items = (long)p->gu_tiles * S;
		const bool enough = items >= (long)MG_CTAS_WANTED * n_sm;

		if ((nst + kb - 1) / kb != S || mg_x_bytes(M, kb * sk) > MG_MAX_X ||
		    (want && S < want))
			continue;
		const long fit = (long)n_sm * mg_ctas_per_sm(MG_RING + (int)mg_x_bytes(M, kb * sk));
		const long ctas = persist > 1 && persist < fit ? persist : fit;
		const double bal = items <= ctas ? 1. : (double)items / ctas /
							      (double)((items + ctas - 1) / ctas);

		// (enough only grows with S: before the first enough S, best_enough is false)
		if (!persist || want || !best_enough || bal > best_bal + 1e-9) {
			best = S;
			best_bal = bal;
			best_enough = enough;
			p->KC = kb * sk;
			p->ctas = (int)(items < ctas ? items : ctas);
		}
		if (want || (enough && (!persist || bal >= 0.9)))
			break;
	}
	if (!best)
		return false;
	p->S = best;
	// persistent only where the items outnumber the CTAs that fit (else it is the
	// plain grid with a loop around it)
	p->persist = persist && (long)p->gu_tiles * best > p->ctas;
	p->gu_smem = MG_RING + (int)mg_x_bytes(M, p->KC);
	p->d_smem = MG_RING + (int)mg_x_bytes(M, p->KCd);
	p->act_floats = (size_t)M * p->n_max * 2 * inter;
	gu_parts = p->S > 1 ? (size_t)p->gu_tiles * p->S : 0;	// one slice: no partials
	d_parts = (size_t)p->d_tiles * p->n_max;
	p->part_floats = (size_t)MG_PART * (d_parts > gu_parts ? d_parts : gu_parts);
	p->cnt = p->gu_tiles > p->d_tiles ? p->gu_tiles : p->d_tiles;
	return true;
}

// Whether ws holds what plan p needs.
static bool mg_fits(const struct moe_qgemv_plan &p, const struct moe_qgemv_ws &ws)
{
	return p.act_floats <= ws.act_floats && p.part_floats <= ws.part_floats && p.cnt <= ws.cnt;
}

template <int FMT, typename ST>
static int mg_setup_one(void)
{
	K_CUDA_TRY(cudaFuncSetAttribute(mg_gate_up_kernel<FMT, ST>,
					cudaFuncAttributeMaxDynamicSharedMemorySize,
					MG_RING + MG_MAX_X));
	K_CUDA_TRY(cudaFuncSetAttribute(mg_gate_up_persist_kernel<FMT, ST>,
					cudaFuncAttributeMaxDynamicSharedMemorySize,
					MG_RING + MG_MAX_X));
	K_CUDA_TRY(cudaFuncSetAttribute(mg_down_kernel<FMT, ST>,
					cudaFuncAttributeMaxDynamicSharedMemorySize,
					MG_RING + MG_MAX_X));
	return 0;
}

int moe_qgemv_setup(void)
{
	int ret = mg_setup_one<K_Q_FP8, float>();

	if (!ret)
		ret = mg_setup_one<K_Q_FP8, __nv_bfloat16>();
	if (!ret)
		ret = mg_setup_one<K_Q_INT4, float>();
	return ret ? ret : mg_setup_one<K_Q_INT4, __nv_bfloat16>();
}

int moe_qgemv_fmt_rows(int fmt, int hidden)
{
	const struct k_cuda_tuning *t = k_cuda_tuning();

	if (fmt == MQ_INT4)
		return min(t->moe_qgemv_rows, t->moe_qgemv_int4_rows);
	return hidden >= t->moe_qgemv_fp8_hidden ? min(t->moe_qgemv_rows, t->moe_qgemv_fp8_rows)
						 : t->moe_qgemv_rows;
}

bool moe_qgemv_takes(const struct moe_wq &wq, int M, int top_k, int n_experts, int hidden,
		     int inter, const float *x, const struct moe_qgemv_ws &ws)
{
	struct moe_qgemv_plan p;
	const int unit = wq.fmt == MQ_INT4 ? 32 : 128;	// k a scale column must hold

	if ((wq.fmt != MQ_FP8 && wq.fmt != MQ_INT4) || M > moe_qgemv_fmt_rows(wq.fmt, hidden) ||
	    ((uintptr_t)x & 15) ||
	    !moe_qgemv_make_plan(wq.fmt, M, top_k, n_experts, hidden, inter, ws.n_sm,
				 k_cuda_tuning()->moe_qgemv_persist, &p) ||
	    !mg_fits(p, ws))
		return false;
	for (int j = 0; j < 3; j++)	// whole columns per scale column, any block of rows
		if (wq.kshift[j] != 31 && (wq.kshift[j] < 0 || wq.bcols[j] % unit))
			return false;
	return true;
}

template <int FMT, typename ST>
static int mg_launch(cudaStream_t s, const struct moe_qgemv_plan &p, const mg_args &a)
{
	if (p.persist)
		K_CUDA_TRY(k_cuda_launch_pdl(s, dim3(p.ctas), dim3(MG_THREADS), (size_t)p.gu_smem,
					     mg_gate_up_persist_kernel<FMT, ST>, a, p.S));
	else
		K_CUDA_TRY(k_cuda_launch_pdl(s, dim3(p.gu_tiles, p.S), dim3(MG_THREADS),
					     (size_t)p.gu_smem, mg_gate_up_kernel<FMT, ST>, a));
	K_CUDA_TRY_LAUNCHED("moe qgemv gate/up");
	K_CUDA_TRY(k_cuda_launch_pdl(s, dim3(p.d_tiles, p.n_max), dim3(MG_THREADS), (size_t)p.d_smem,
				     mg_down_kernel<FMT, ST>, a));
	K_CUDA_TRY_LAUNCHED("moe qgemv down");
	return 0;
}

int moe_qgemv_run(cudaStream_t s, const struct moe_qgemv_ws &ws, float *out, const float *x,
		  int M, const int32_t *ids, const float *weights, int top_k,
		  const uint16_t *const *expert_w, const struct moe_wq &wq, int n_experts,
		  int hidden, int inter, int add)
{
	struct moe_qgemv_plan p;
	mg_args a = {};

	if (!moe_qgemv_make_plan(wq.fmt, M, top_k, n_experts, hidden, inter, ws.n_sm,
				 k_cuda_tuning()->moe_qgemv_persist, &p) ||
	    !mg_fits(p, ws))
		return -EINVAL;
	a.ew = (const uint8_t *const *)expert_w;
	a.es = wq.scales;
	a.ids = ids;
	a.wts = weights;
	a.x = x;
	a.act = ws.act;
	a.part = ws.part;
	a.cnt_gu = ws.cnt_gu;
	a.cnt_d = ws.cnt_d;
	a.out = out;
	a.M = M;
	a.top_k = top_k;
	a.E = n_experts;
	a.H = hidden;
	a.I = inter;
	a.n_max = p.n_max;
	a.KC = p.KC;
	a.KCd = p.KCd;
	a.add = add;
	for (int j = 0; j < 3; j++) {
		a.brows[j] = wq.brows[j];
		a.kshift[j] = wq.kshift[j];
		a.scols[j] = wq.scols[j];
	}
	if (wq.fmt == MQ_INT4)
		return wq.sbf16 ? mg_launch<K_Q_INT4, __nv_bfloat16>(s, p, a)
				: mg_launch<K_Q_INT4, float>(s, p, a);
	return wq.sbf16 ? mg_launch<K_Q_FP8, __nv_bfloat16>(s, p, a)
			: mg_launch<K_Q_FP8, float>(s, p, a);
}
