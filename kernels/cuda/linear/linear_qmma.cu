// The tensor-core GEMV on quantized weights (the register-load form M <= 8, the streaming
// form up to 64; at M <= 8 k_cuda_linear_q_choose takes the streaming form where
// linear_qgemv.cu's GEMV, which needs no cluster, is not faster): fp8 e4m3 or
// int4 bytes streamed from HBM straight into mma.sync f16 fragments, dequantized in
// registers; K split over the CTAs of a thread-block cluster and reduced through
// distributed shared memory in rank order. Measured at M = 64 (H200): the weights are
// read once, but the kernel is bound by instruction latency (~0.12 MMA a clock per
// multiprocessor, one CTA of 8 warps each) and by the DSMEM reduction where K is split
// over 3-8 CTAs: 12-22% of the HBM floor (docs/PERFORMANCE.md, "Quantized weights").
//
// Why tensor cores at M = 1: at the HBM floor an SM must take 16 bytes of weights a
// clock, 16 fp8 or 32 int4 values. The CUDA-core kernel (linear_q.cu) spends a
// conversion and an fma per value and per x row, and reads 4 bytes of fp32 x for every
// weight byte: 16-32% (fp8) and 7-13% (int4) of the floor on H200. Here one mma takes
// 16 x 16 values of 16 rows, x is read from shared memory once per 16 rows, and a value
// costs half a conversion (two per cvt.rn.f16x2.e4m3x2) or about three operations per
// pair of nibbles (quant_dequant.cuh's k_dq_i4x8: lop3 into a 1024 + v half, subtract,
// scale).
//
// Layout. A CTA of 8 warps owns 128 weight rows (one m16 tile per warp) and one K slice
// [k0, k0 + KC); its x rows [0, M) of that slice sit in shared memory as f16, loaded
// once (x is rounded to f16: 11 significant bits; |x| above 65504 becomes inf). The S
// CTAs of a cluster own the S slices of the same rows.
//
// Fragments. y^T (N, M) = W (N, K) x^T: W is the A operand (16 rows), x the B operand
// (8 columns = x rows 0..7). A dot product does not depend on the order of its k, so
// lane (g, t) loads 16 contiguous bytes of rows g and g + 8 of each 64-byte slab:
//   fp8: k 16t .. 16t+15 of a 64-k slab; MMA j (0..3) takes k 16t+4j .. 16t+4j+3 as its
//        k slots {2t, 2t+1, 2t+8, 2t+9}; scales are per slab (block_cols a multiple of
//        64), applied to the slab's fp32 partial sum.
//   int4: k 32t .. 32t+31 of a 128-k slab, one group (group a multiple of 32): word q
//        holds k 8q .. 8q+7, and (w >> 4p) & 0x000f000f pairs nibbles p and p + 4; MMA
//        j (0..7) takes pairs 2(j&1), 2(j&1)+1 of word j/2. The group scale multiplies
//        the f16 values before the MMA (exact where the scale is an f16: a 4-bit
//        integer times 8 significant bits: bf16 scales such as Kimi-K2's; an f16 scale of
//        more bits rounds the product once, to f16). x
//        is stored in shared memory with each octet as k 0 4 1 5 2 6 3 7, so that a
//        lane's B registers are whole words.
// The lane's B fragment is x row g at the same k: 16-byte shared-memory loads.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_qstream.cuh"
#include "kernels/cuda/ops/rmsnorm_rs.cuh"
#include "kernels/cuda/ptx.cuh"

namespace cg = cooperative_groups;

#define QM_WARPS	8
#define QM_THREADS	(QM_WARPS * 32)
#define QM_ROWS		(QM_WARPS * 16)	/* weight rows per CTA */
#define QM_SLAB_BYTES	64		/* bytes of a row per slab: 4 lanes x 16 */
#define QM_U		8		/* slabs in flight per warp: 8 KB */
#define QM_PREFETCH	1		/* batches of QM_U slabs prefetched before the wait */
#define QM_MAX_SPLIT	8		/* cluster size: the portable limit */
#define QM_PSTRIDE	(QM_ROWS + 4)	/* partial tile (m, row) stride, floats */
#define QM_PART_BYTES	(K_CUDA_LINEAR_Q_MMA_MAX_M * QM_PSTRIDE * 4)
#define QM_MAX_SMEM	(160 << 10)	/* x slice + partial tile per CTA, bytes */

// ---- kernel -------------------------------------------------------------------

struct qm_args {
	int M, N, K;
	int KC;			// k per CTA (a multiple of the slab)
	int KX;			// k of x in shared memory at a time (streaming form, M > 8)
	int row_bytes;		// bytes of a weight row
	int block_rows;
	int bc_shift;		// k >> bc_shift = scale column (31: one column)
	int scale_cols;
	int accumulate;
	int pdl;
};

// x rows [0, M), k [k0, k0 + KC) into shared memory as f16, bf16 for bf16 weights
// (K_Q_NONE) (row stride KC + 8 halves),
// zeros past K; int4 octets reordered k 0 4 1 5 2 6 3 7. NM: x is an RMSNorm's input,
// each value staged w * (x * rs[m]) as k_cuda_rmsnorm writes it (the GEMV's norm form,
// linear_qgemv.cu's header), and written to nrm.out by the CTAs of row block 0.
template <int FMT, bool NM = false>
static __device__ __forceinline__ void qm_stage_x(uint4 *xs, const float *x, int M, int K,
						  int k0, int KC, const k_cuda_xnorm *nrm = nullptr,
						  const float *rs = nullptr)
{
	const int per_row = KC / 8, xs_row = (KC + 8) / 8;	// 16-byte units

	for (int i = threadIdx.x; i < M * per_row; i += QM_THREADS) {
		const int m = i / per_row, u = i % per_row, k = k0 + 8 * u;
		float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;

		if (k < K) {	// K % 16 == 0: the octet is all in or all out
			const float4 *p = (const float4 *)(x + (size_t)m * K + k);

			a = p[0];
			b = p[1];
			if (NM) {
				const float4 *pw = (const float4 *)(nrm->w + k);

				a = k_rms_scale4(pw[0], a, rs[m]);
				b = k_rms_scale4(pw[1], b, rs[m]);
				if (nrm->out && blockIdx.x == 0) {
					float4 *po = (float4 *)(nrm->out + (size_t)m * K + k);

					po[0] = a;
					po[1] = b;
				}
			}
		}
		xs[m * xs_row + qm_xunit<FMT>(u)] = FMT == K_Q_NONE ? qm_pack_x8_bf16(a, b)
							     : qm_pack_x8<FMT == K_Q_INT4>(a, b);
	}
}

// The S partial tiles of this CTA's rows, summed in cluster-rank order; rank s writes
// its 1/S of the (M, 128) outputs.
template <int NT>
static __device__ void qm_cluster_reduce(float *y, const float (&acc)[NT][4], float *part,
					 const qm_args &a, int n0, int warp, int g, int t)
{
	cg::cluster_group cluster = cg::this_cluster();
	const int S = (int)cluster.num_blocks(), s = (int)cluster.block_rank();
	const int E = a.M * QM_ROWS, per = (E + S - 1) / S, e1 = min(E, (s + 1) * per);

#pragma unroll
	for (int nt = 0; nt < NT; nt++) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int m = 8 * nt + 2 * t + (c & 1), r = warp * 16 + g + (c >> 1) * 8;

			if (m < a.M)
				part[m * QM_PSTRIDE + r] = acc[nt][c];
		}
	}
	cluster.sync();
	for (int e = s * per + (int)threadIdx.x; e < e1; e += QM_THREADS) {
		const int m = e / QM_ROWS, r = e % QM_ROWS, n = n0 + r;

		if (n < a.N) {
			float sum = 0.f;
			float *p = y + (size_t)m * a.N + n;

			for (int q = 0; q < S; q++)
				sum += cluster.map_shared_rank(part, q)[m * QM_PSTRIDE + r];
			*p = a.accumulate ? *p + sum : sum;
		}
	}
	cluster.sync();		// the partials stay until every rank has read them
}

// qm_slab for NT n8 tiles of x (rows 8 nt + g, nt < NT): each weight fragment is
// dequantized once and multiplied into every tile. xp: the lane's first unit of x row g
// in this slab; xs_row: units a row; M: rows of x (tiles past it read zeros).
template <int FMT, int NT>
static __device__ __forceinline__ void qw_slab(float (&acc)[NT][4], const uint4 &wa,
					       const uint4 &wb, float sa, float sb, const uint4 *xp,
					       int xs_row, int sw, int g, int M)
{
	const uint4 z = make_uint4(0, 0, 0, 0);
	const uint32_t wa_[4] = { wa.x, wa.y, wa.z, wa.w }, wb_[4] = { wb.x, wb.y, wb.z, wb.w };

	if (FMT == K_Q_FP8) {
		uint32_t af[4][4];

#pragma unroll
		for (int j = 0; j < 4; j++) {
			qm_e4m3x4(wa_[j], af[j][0], af[j][2]);
			qm_e4m3x4(wb_[j], af[j][1], af[j][3]);
		}
#pragma unroll
		for (int nt = 0; nt < NT; nt++) {
			const bool in = 8 * nt + g < M;
			const uint4 *xq = xp + (size_t)8 * nt * xs_row;
			const uint4 x0 = in ? xq[0] : z, x1 = in ? xq[1] : z;
			const uint32_t xw[8] = { x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w };
			float tmp[4] = { 0.f, 0.f, 0.f, 0.f };

#pragma unroll
			for (int j = 0; j < 4; j++)
				qm_mma(tmp, af[j][0], af[j][1], af[j][2], af[j][3], xw[2 * j],
				       xw[2 * j + 1]);
			acc[nt][0] = fmaf(tmp[0], sa, acc[nt][0]);
			acc[nt][1] = fmaf(tmp[1], sa, acc[nt][1]);
			acc[nt][2] = fmaf(tmp[2], sb, acc[nt][2]);
			acc[nt][3] = fmaf(tmp[3], sb, acc[nt][3]);
		}
	} else {
		const __half2 ha = __float2half2_rn(sa), hb = __float2half2_rn(sb);

#pragma unroll
		for (int q = 0; q < 4; q++) {
			uint32_t af[2][4], fa[4], fb[4];

			k_dq_i4x8(wa_[q], ha, fa);
			k_dq_i4x8(wb_[q], hb, fb);
#pragma unroll
			for (int h = 0; h < 2; h++) {
				af[h][0] = fa[2 * h];
				af[h][1] = fb[2 * h];
				af[h][2] = fa[2 * h + 1];
				af[h][3] = fb[2 * h + 1];
			}
#pragma unroll
			for (int nt = 0; nt < NT; nt++) {
				const uint4 xq = 8 * nt + g < M ? xp[(size_t)8 * nt * xs_row + (q ^ sw)] : z;

				qm_mma(acc[nt], af[0][0], af[0][1], af[0][2], af[0][3], xq.x, xq.y);
				qm_mma(acc[nt], af[1][0], af[1][1], af[1][2], af[1][3], xq.z, xq.w);
			}
		}
	}
}

// grid (row blocks, S), cluster (1, S): blockIdx.x the 128 rows, blockIdx.y the K slice
// and cluster rank. Needs K % 16 (fp8) or % 32 (int4) == 0, w rows and x 16-byte aligned,
// M <= 8, the scale column constant over a slab (fp8) or a lane's 32 k (int4).
template <int FMT, typename ST>
__global__ void __launch_bounds__(QM_THREADS, 2)
qm_kernel(float *y, const float *x, const uint8_t *__restrict__ w, const ST *__restrict__ scale,
	  qm_args a)
{
	using F = qm_fmt<FMT>;
	extern __shared__ __align__(16) unsigned char qm_smem[];
	uint4 *xs = (uint4 *)qm_smem;
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
	const int n0 = blockIdx.x * QM_ROWS, ra = n0 + warp * 16 + g, rb = ra + 8;
	const int k0 = blockIdx.y * a.KC, kend = min(a.K, k0 + a.KC);
	const int ns = k0 < kend ? (kend - k0 + F::SLAB - 1) / F::SLAB : 0;
	const bool aok = ra < a.N, bok = rb < a.N;
	const uint8_t *pa = w + (size_t)(aok ? ra : 0) * a.row_bytes + (size_t)(k0 / F::SLAB) * QM_SLAB_BYTES + 16 * t;
	const uint8_t *pb = w + (size_t)(bok ? rb : 0) * a.row_bytes + (size_t)(k0 / F::SLAB) * QM_SLAB_BYTES + 16 * t;
	const size_t sra = (size_t)((aok ? ra : 0) / a.block_rows) * a.scale_cols;
	const size_t srb = (size_t)((bok ? rb : 0) / a.block_rows) * a.scale_cols;
	const int xs_row = (a.KC + 8) / 8;
	float acc[4] = { 0.f, 0.f, 0.f, 0.f };
	uint4 wa[QM_U], wb[QM_U];
	float sa[QM_U], sb[QM_U];

	// the first slabs into L2 while the previous kernel drains (PDL): weights are constant
	if (k_cuda_lin_early_cta(a.pdl)) {
#pragma unroll
		for (int u = 0; u < QM_U * QM_PREFETCH; u++) {
			if (u < ns && k0 + u * F::SLAB + t * F::VPC < kend) {
				if (aok)
					k_cuda_lin_prefetch(pa + u * QM_SLAB_BYTES);
				if (bok)
					k_cuda_lin_prefetch(pb + u * QM_SLAB_BYTES);
			}
		}
	}
	k_cuda_lin_inputs_ready(a.pdl);	// x and y only from here on

	// slab s of the lane's rows: its 16 bytes and scales (zeros past the slice)
	auto load = [&](int u, int s) {
		const int k = k0 + s * F::SLAB + t * F::VPC;
		const bool in = s < ns && k < kend;
		// fp8: the slab's scale multiplies a sum over all four lanes' k, so it is
		// taken whenever the slab is, even where this lane's 16 bytes lie past K
		const bool sin = FMT == K_Q_INT4 ? in : s < ns;
		const int sc = (FMT == K_Q_INT4 ? k : k0 + s * F::SLAB) >> a.bc_shift;

		wa[u] = k_cuda_lin_ld_stream(pa + (in ? s : 0) * QM_SLAB_BYTES, in && aok);
		wb[u] = k_cuda_lin_ld_stream(pb + (in ? s : 0) * QM_SLAB_BYTES, in && bok);
		sa[u] = sin && aok ? qm_scale(scale, sra + sc) : 0.f;
		sb[u] = sin && bok ? qm_scale(scale, srb + sc) : 0.f;
	};
#pragma unroll
	for (int u = 0; u < QM_U; u++)
		load(u, u);
	qm_stage_x<FMT>(xs, x, a.M, a.K, k0, a.KC);
	__syncthreads();

	const uint4 *xr = xs + g * xs_row + (FMT == K_Q_INT4 ? 4 * t : 2 * t);
	const bool xin = g < a.M;
	const int sw = FMT == K_Q_INT4 ? (t >> 1) << 1 : 0;

	for (int s0 = 0; s0 < ns; s0 += QM_U) {
#pragma unroll
		for (int u = 0; u < QM_U; u++) {
			const int s = s0 + u;

			if (s < ns)
				qm_slab<FMT>(acc, wa[u], wb[u], sa[u], sb[u], xr + s * (F::SLAB / 8),
					     sw, xin);
			if (s + QM_U < ns)
				load(u, s + QM_U);
		}
	}

	if (gridDim.y == 1) {
		qm_store_acc<1>(y, reinterpret_cast<const float (&)[1][4]>(acc), a, ra, rb, t);
		return;
	}
	__syncthreads();	// the x slice is read: its room takes the partial tile
	qm_cluster_reduce<1>(y, reinterpret_cast<const float (&)[1][4]>(acc), (float *)qm_smem, a,
			     n0, warp, g, t);
}

// ---- the streaming form: weights through a cp.async ring in shared memory -------
//
// Measured on H200 (bench_cuda_linear_q, first round): qm_kernel's register loads, 64
// bytes of each of 8 rows per instruction, held every large matrix at 2.0 TB/s (fp8)
// and 1.7 (int4), 48% and 40% of the floor, whatever the grid. Here each warp copies
// its 16 rows 128 bytes a row (one whole L2 line; 4 rows per instruction) into its own
// ring of QS_STAGES stages with cp.async, QS_AHEAD stages in flight from before the
// wait on the previous kernel (weights are constant), and reads its fragments back
// with 16-byte shared-memory loads: a stage is two slabs. No CTA-wide barrier in the
// loop: a warp waits only for its own copies (cp.async.wait_group, __syncwarp).

#define QS_STAGES	4
#define QS_AHEAD	(QS_STAGES - 1)
#define QS_RING		(QM_WARPS * QS_STAGES * QS_WSTAGE)	/* 64 KB */

// NT n8 tiles of x rows (M <= 8 NT). NT = 1: the decode GEMV, x slice [k0, k0 + KC) in
// shared memory at once. NT > 1 (8 < M <= 64): every weight fragment is dequantized
// once for all M rows (the weights are read once whatever M), and x goes into shared
// memory KX k at a time (an M = 64 slice does not fit beside the ring), the CTA's warps
// meeting at a barrier between chunks; one CTA a multiprocessor. NM (NT = 1 only): x is
// an RMSNorm's input, nrm its norm (qm_stage_x).
template <int FMT, typename ST, int NT, bool NM = false>
__global__ void __launch_bounds__(QM_THREADS, NT == 1 ? 2 : 1)
qs_kernel(float *y, const float *x, const uint8_t *__restrict__ w, const ST *__restrict__ scale,
	  qm_args a, k_cuda_xnorm nrm)
{
	using F = qm_fmt<FMT>;
	constexpr int SK = qs_fmt<FMT>::SK;
	extern __shared__ __align__(16) unsigned char qm_smem[];
	uint4 *xs = (uint4 *)(qm_smem + QS_RING);
	const int tid = threadIdx.x, warp = tid >> 5, n0 = blockIdx.x * QM_ROWS;
	const qs_warp<FMT, ST, qm_args, QS_AHEAD> qw(a, w, scale,
						     qm_smem + warp * QS_STAGES * QS_WSTAGE,
						     n0 + warp * 16, blockIdx.y * a.KC);
	const int g = qw.g, t = qw.t, k0 = qw.k0;
	const int KX = NT == 1 ? a.KC : a.KX, xs_row = (KX + 8) / 8, spc = KX / SK;
	float acc[NT][4] = {};
	float sr[QS_STAGES][4];

	qw.start();	// weights stream in while the previous kernel drains
	k_cuda_lin_inputs_ready(a.pdl);	// x and y only from here on
#pragma unroll
	for (int i = 0; i < QS_AHEAD; i++)
		qw.scales(sr[i], i);
	if constexpr (NM) {
		static_assert(NT == 1, "the norm form stages x once");
		__shared__ double part[K_RMS_BLOCK_THREADS / 32];
		__shared__ float rs[K_CUDA_LINEAR_Q_MMA_MAX_M];

		k_rms_rs_rows_cta<QM_THREADS>(rs, part, x, a.M, a.K, nrm.eps);
		qm_stage_x<FMT, true>(xs, x, a.M, a.K, k0, KX, &nrm, rs);
	} else {
		qm_stage_x<FMT>(xs, x, a.M, a.K, k0, KX);
	}
	__syncthreads();

	const uint4 *xr = xs + g * xs_row + F::VPC / 8 * t;	// the lane's first unit of a slab
	const bool xin = g < a.M;
	const int sw = FMT == K_Q_INT4 ? (t >> 1) << 1 : 0;
	int ic = 0;	// the first stage of the x chunk in shared memory

	qw.run(sr,
	       [&](int i) {
		       if (NT > 1 && i - ic == spc) {	// the next chunk of x (i: the same in the CTA)
			       ic = i;
			       __syncthreads();	// every warp is done with the last one
			       qm_stage_x<FMT>(xs, x, a.M, a.K, k0 + i * SK, KX);
			       __syncthreads();
		       }
	       },
	       [&](int i, int h, const uint4 &wa, const uint4 &wb, float sa, float sb) {
		       if constexpr (NT == 1)
			       qm_slab<FMT>(acc[0], wa, wb, sa, sb, xr + (2 * i + h) * (F::SLAB / 8),
					    sw, xin);
		       else
			       qw_slab<FMT, NT>(acc, wa, wb, sa, sb,
						xr + (2 * (i - ic) + h) * (F::SLAB / 8), xs_row, sw,
						g, a.M);
	       });
	cp_async_wait<0>();

	if (gridDim.y == 1) {
		qm_store_acc<NT>(y, acc, a, qw.ra, qw.rb, t);
		return;
	}
	__syncthreads();	// every warp is past its ring: it takes the partial tile (M x
				// 132 floats <= 33 KB of the 64 KB ring)
	qm_cluster_reduce<NT>(y, acc, (float *)qm_smem, a, n0, warp, g, t);
}

// ---- launchers ----------------------------------------------------------------

#define QS_MAX_SMEM	(200 << 10)	/* the streaming form: ring + x slice, bytes */
#define QS_SMEM_2CTA	(113 << 10)	/* two CTAs fit a multiprocessor up to this */

static int qm_unit(const struct k_quant *q, bool stream)
{
	return q->fmt == K_Q_INT4 ? 32 : stream ? 128 : 64;
}

static int qm_smem_bytes(int M, int KC, bool stream)
{
	int xb = M * (KC + 8) * 2;

	if (stream)
		return QS_RING + xb;
	return xb > QM_PART_BYTES ? xb : QM_PART_BYTES;
}

// The streaming form's x chunk at M > 8: KC, or the most whole units that fit beside
// the ring.
static int qs_kx(int M, int KC, int unit)
{
	const int most = ((QS_MAX_SMEM - QS_RING) / (2 * M) - 8) / unit * unit;

	return M <= K_CUDA_LINEAR_Q_MMA_MAX_M || KC <= most ? KC : most;
}

static bool qm_args_ok(const struct k_quant *q, const float *x, const void *w, int M, int N, int K,
		       bool stream)
{
	return q && x && w && M >= 1 &&
	       M <= (stream ? K_CUDA_LINEAR_Q_STREAM_MAX_M : K_CUDA_LINEAR_Q_MMA_MAX_M) && N >= 1 && K >= 1 &&
	       q->block_rows >= 1 && q->block_cols >= 1 && q->scale &&
	       (q->scale_dtype == K_F32 || q->scale_dtype == K_F16) && !((uintptr_t)x & 15) &&
	       !((uintptr_t)w & 15) && ((q->fmt == K_Q_FP8 && K % 16 == 0) ||
					(q->fmt == K_Q_INT4 && K % 32 == 0));
}

extern "C" int k_cuda_linear_q_mma_supports(const struct k_quant *q, const float *x,
					    const void *w, int M, int N, int K)
{
	return qm_args_ok(q, x, w, M, N, K, false) && qm_bc_shift(q, K, qm_unit(q, false)) >= 0;
}

extern "C" int k_cuda_linear_q_stream_supports(const struct k_quant *q, const float *x,
					       const void *w, int M, int N, int K)
{
	return qm_args_ok(q, x, w, M, N, K, true) && qm_bc_shift(q, K, qm_unit(q, true)) >= 0;
}

struct qm_plan {
	int blocks, S, KC, KX, smem, slots;
};

// CTAs of `smem` bytes resident on the GPU at once (the streaming form at M > 8: one a
// multiprocessor, its launch bounds).
static int qm_slots(const struct k_cuda_linear *ctx, int smem, bool stream, int M)
{
	int bps = stream ? (smem <= QS_SMEM_2CTA && M <= K_CUDA_LINEAR_Q_MMA_MAX_M ? 2 : 1)
			 : ctx->qm_bps;

	return (bps > 0 ? bps : 1) * ctx->n_sm;
}

// The split: S CTAs per 128 rows, the most (up to 8) whose CTAs are all resident at
// once; S = 1 where even that is more than a wave. Then as many more as the x slice
// needs to fit in shared memory (the streaming form at M > 8 takes x in chunks
// instead: qs_kx). unit: k per slab (per stage, streaming).
static int qm_make_plan(const struct k_cuda_linear *ctx, int unit, bool stream, int M, int N,
			int K, struct qm_plan *p)
{
	const int nu = (K + unit - 1) / unit, max_smem = stream ? QS_MAX_SMEM : QM_MAX_SMEM;

	p->blocks = (N + QM_ROWS - 1) / QM_ROWS;
	p->S = 1;
	for (;;) {
		const int S = p->S + 1, kc = (nu + S - 1) / S * unit;
		const int kx = stream ? qs_kx(M, kc, unit) : kc;

		if (S > QM_MAX_SPLIT || S > nu ||
		    (long)p->blocks * S > (long)qm_slots(ctx, qm_smem_bytes(M, kx, stream), stream, M))
			break;
		p->S = S;
	}
	for (;;) {
		p->KC = (nu + p->S - 1) / p->S * unit;
		p->KX = stream ? qs_kx(M, p->KC, unit) : p->KC;
		p->smem = qm_smem_bytes(M, p->KX, stream);
		p->slots = qm_slots(ctx, p->smem, stream, M);
		if (p->KX < unit)
			return -EINVAL;
		if (p->smem <= max_smem)
			return 0;
		if (p->S >= QM_MAX_SPLIT || p->S >= nu)
			return -EINVAL;
		p->S++;
	}
}

template <int FMT, typename ST, bool STREAM>
static int qm_launch(const struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		     const struct k_quant *q, int M, int N, int K, int accumulate,
		     const struct k_cuda_xnorm *nrm)
{
	const struct k_cuda_xnorm none = {};
	const int unit = STREAM ? qs_fmt<FMT>::SK : qm_fmt<FMT>::SLAB;
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[2] = {};
	struct qm_plan p;
	qm_args a;

	if (qm_make_plan(ctx, unit, STREAM, M, N, K, &p) || (nrm && (!STREAM || M > 8)) ||
	    (FMT == K_Q_NONE && (!STREAM || M > 8)))
		return -EINVAL;
	a = FMT == K_Q_NONE	// bf16: rows of 2K bytes, no scales (bc_shift 31: one column)
		    ? qm_args{ M, N, K, p.KC, p.KX, 2 * K, 1, 31, 0, accumulate, 0 }
		    : qm_args{ M, N, K, p.KC, p.KX, (int)k_quant_row_bytes(q->fmt, K), q->block_rows,
			       qm_bc_shift(q, K, qm_unit(q, STREAM)), (int)q->scale_cols, accumulate, 0 };
	a.pdl = ctx->pdl ? (p.slots < p.blocks * p.S ? p.slots : p.blocks * p.S) : 0;
	cfg.gridDim = dim3(p.blocks, p.S, 1);
	cfg.blockDim = dim3(QM_THREADS, 1, 1);
	cfg.dynamicSmemBytes = p.smem;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	if (p.S > 1) {
		attr[0].id = cudaLaunchAttributeClusterDimension;
		attr[0].val.clusterDim.x = 1;
		attr[0].val.clusterDim.y = p.S;
		attr[0].val.clusterDim.z = 1;
		cfg.numAttrs = 1;
	}
	cfg.numAttrs += k_cuda_lin_pdl_attr(ctx, attr + cfg.numAttrs);
	if (STREAM) {
		const uint8_t *wb = (const uint8_t *)w;
		const ST *sc = (const ST *)q->scale;

		if (nrm)
			return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qs_kernel<FMT, ST, 1, true>, y,
								     x, wb, sc, a, *nrm));
		if (M <= 8)
			return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qs_kernel<FMT, ST, 1>, y, x,
								     wb, sc, a, none));
		if constexpr (FMT == K_Q_NONE) {	// bf16: the decode form only (qw_slab
			return -EINVAL;			// has no bf16 fragments)
		} else {
			if (M <= 16)
				return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qs_kernel<FMT, ST, 2>,
									     y, x, wb, sc, a, none));
			if (M <= 32)
				return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qs_kernel<FMT, ST, 4>,
									     y, x, wb, sc, a, none));
			return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qs_kernel<FMT, ST, 8>, y, x,
								     wb, sc, a, none));
		}
	}
	if constexpr (FMT == K_Q_NONE)
		return -EINVAL;
	else
		return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, qm_kernel<FMT, ST>, y, x,
							     (const uint8_t *)w, (const ST *)q->scale, a));
}

template <int FMT, typename ST> static int qm_setup_one(struct k_cuda_linear *ctx)
{
	int bps = 0, ret;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qm_kernel<FMT, ST>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QM_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<FMT, ST, 1>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<FMT, ST, 1, true>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<FMT, ST, 2>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<FMT, ST, 4>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<FMT, ST, 8>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)	// at a typical slice: 8 rows of 1024 k
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps,
					qm_kernel<FMT, ST>, QM_THREADS, qm_smem_bytes(8, 1024, false)));
	if (!ret && (ctx->qm_bps == 0 || bps < ctx->qm_bps))
		ctx->qm_bps = bps > 0 ? bps : 1;
	return ret;
}

int k_cuda_lin_qmma_setup(struct k_cuda_linear *ctx)
{
	int ret = qm_setup_one<K_Q_FP8, float>(ctx);

	if (!ret)	// bf16 weights: the streaming form at M <= 8, plain and over a norm
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<K_Q_NONE, float, 1>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(qs_kernel<K_Q_NONE, float, 1, true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, QS_MAX_SMEM));

	if (!ret)
		ret = qm_setup_one<K_Q_FP8, __half>(ctx);
	if (!ret)
		ret = qm_setup_one<K_Q_INT4, float>(ctx);
	if (!ret)
		ret = qm_setup_one<K_Q_INT4, __half>(ctx);
	return ret;
}

template <bool STREAM>
static int qm_dispatch(const struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		       const struct k_quant *q, int M, int N, int K, int accumulate,
		       const struct k_cuda_xnorm *n)
{
	if (q->fmt == K_Q_NONE)	// bf16 weights (k_cuda_lin_bf16_q)
		return qm_launch<K_Q_NONE, float, STREAM>(ctx, y, x, w, q, M, N, K, accumulate, n);
	if (q->fmt == K_Q_INT4)
		return q->scale_dtype == K_F16
			       ? qm_launch<K_Q_INT4, __half, STREAM>(ctx, y, x, w, q, M, N, K, accumulate, n)
			       : qm_launch<K_Q_INT4, float, STREAM>(ctx, y, x, w, q, M, N, K, accumulate, n);
	return q->scale_dtype == K_F16
		       ? qm_launch<K_Q_FP8, __half, STREAM>(ctx, y, x, w, q, M, N, K, accumulate, n)
		       : qm_launch<K_Q_FP8, float, STREAM>(ctx, y, x, w, q, M, N, K, accumulate, n);
}

int k_cuda_lin_qmma(const struct k_cuda_linear *ctx, bool stream, float *y, const float *x,
		    const void *w, const struct k_quant *q, int M, int N, int K, int accumulate,
		    const struct k_cuda_xnorm *nrm)
{
	return stream ? qm_dispatch<true>(ctx, y, x, w, q, M, N, K, accumulate, nrm)
		      : qm_dispatch<false>(ctx, y, x, w, q, M, N, K, accumulate, nrm);
}

// k per slab (per stage, streaming) of q's format, as qm_launch plans
static int qm_plan_unit(const struct k_quant *q, bool stream)
{
	const int slab = q->fmt == K_Q_INT4 ? 128 : q->fmt == K_Q_NONE ? 32 : 64;

	return stream ? 2 * slab : slab;
}

int k_cuda_lin_qmma_split(const struct k_cuda_linear *ctx, bool stream, const struct k_quant *q,
			  int M, int N, int K)
{
	struct qm_plan p;

	return qm_make_plan(ctx, qm_plan_unit(q, stream), stream, M, N, K, &p) ? 0 : p.S;
}

bool k_cuda_lin_qstream_fills(const struct k_cuda_linear *ctx, int S, int N)
{
	return S >= 2 && (long)((N + QM_ROWS - 1) / QM_ROWS) * S * 100 >=
				 (long)K_CUDA_LINEAR_Q_GEMV_FILL * 2 * ctx->n_sm;
}

int k_cuda_lin_qmma_describe(const struct k_cuda_linear *ctx, bool stream,
			     const struct k_quant *q, int M, int N, int K, char *buf, size_t len)
{
	struct qm_plan p;

	if (qm_make_plan(ctx, qm_plan_unit(q, stream), stream, M, N, K, &p))
		return snprintf(buf, len, "%s: no plan (x slice too large)", stream ? "qstream" : "qmma");
	if (p.KX < p.KC)
		return snprintf(buf, len, "%s grid=%dx%d k/slice=%d x in %d-k chunks smem=%d",
				stream ? "qstream" : "qmma", p.blocks, p.S, p.KC, p.KX, p.smem);
	return snprintf(buf, len, "%s grid=%dx%d k/slice=%d smem=%d", stream ? "qstream" : "qmma",
			p.blocks, p.S, p.KC, p.smem);
}
