// The split-K tensor-core kernel for 2 < M <= 64: weights stream straight from HBM into
// mma.sync fragments; x is rounded to bf16 in shared memory; K splits over a cluster.
//
// Layout. A CTA of 16 warps owns 256 weight rows (one m16 tile per warp) and one K slice;
// the S CTAs of a thread-block cluster own the S slices of the same rows and add their
// partial tiles through distributed shared memory, in rank order (no atomics). With
// S = 1 a CTA walks several 256-row groups instead (gridDim.y groups apart).
//
// Fragments. y^T (N, M) = W (N, K) x^T: W is the A operand (16 rows), x the B operand
// (8 columns = 8 rows of x per m-tile). A dot product does not depend on the order of
// its k, so lane (g, t) loads 16 contiguous bytes, k = 8t .. 8t+7 of a 32-wide chunk, of
// rows g and g+8, and uses them as the k slots {2t, 2t+1, 2t+8, 2t+9} of two MMAs
// (k 8t..8t+3 in the first, 8t+4..8t+7 in the second); its B fragment for both is the
// same 16 bytes of x (k 8t .. 8t+7 of x row g), one 16-byte shared-memory load.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/linear/linear_internal.h"

namespace cg = cooperative_groups;

#define SK_WARPS	16
#define SK_THREADS	(SK_WARPS * 32)
#define SK_ROWS		(SK_WARPS * 16)		/* weight rows per CTA */
/* Row stride (floats) of the partial tile (m, row) in the cluster reduction: +4 makes
 * the fragment stores of a warp hit 32 different banks. */
#define SK_PSTRIDE	(SK_ROWS + 4)
/* Fixed cost of a wave of CTAs (prologue, reduction, tail) in batches of weights, for
 * choosing the split. */
#define SK_WAVE_OVERHEAD	1
/* Batches of weights prefetched into L2 before waiting for the previous kernel (PDL). */
#define SK_PREFETCH	2

// Compile-time shape of one instantiation: MT m8-tiles of x rows.
template <int MT> struct sk_cfg {
	// k32 chunks per batch: weights in flight per thread are U * 32 bytes; fewer at
	// MT = 8, whose accumulators need the registers.
	static constexpr int U = MT == 8 ? 4 : 8;
	static constexpr int BK = U * 32;		// k per batch
	static constexpr int XS = BK + 32;		// x stage row stride, bf16
	static constexpr int XROWS = MT * 8;		// x rows in a stage
	static constexpr int XQ = BK / 4;		// float4 per x stage row
	static constexpr int XV = XROWS * XQ / SK_THREADS;	// float4 per thread per stage
	static constexpr int XS_BYTES = 2 * XROWS * XS * 2;	// two stages
	static constexpr int PART_BYTES = XROWS * SK_PSTRIDE * 4;
	static_assert(XROWS * XQ % SK_THREADS == 0, "x stage must split evenly over threads");
	static_assert(XV >= 1, "x stage too small");
	static_assert((2 * XS) % 128 == 64, "x stage rows must alternate bank halves");
};

template <int MT> static int sk_smem_bytes(int S)
{
	using C = sk_cfg<MT>;

	return S > 1 && C::PART_BYTES > C::XS_BYTES ? C::PART_BYTES : C::XS_BYTES;
}

// ---- kernels ----------------------------------------------------------------

static __device__ __forceinline__ void sk_mma(float (&c)[4], uint32_t a0, uint32_t a1,
					      uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
	    "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t sk_pack_bf16(float lo, float hi)
{
	__nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);	// .x (low half) = lo
	uint32_t u;

	memcpy(&u, &h, sizeof(u));
	return u;
}

// Weight rows of a lane: g * SK_ROWS + warp * 16 + {grp, grp + 8}; rows past N read as 0.
struct sk_rows {
	const uint16_t *a, *b;	// row starts (clamped to row 0 when out of range)
	bool a_ok, b_ok;
};

static __device__ __forceinline__ sk_rows sk_rows_of(const uint16_t *w, int N, int K, int g,
						     int warp, int grp)
{
	int ra = g * SK_ROWS + warp * 16 + grp, rb = ra + 8;
	sk_rows r;

	r.a_ok = ra < N;
	r.b_ok = rb < N;
	r.a = w + (size_t)(r.a_ok ? ra : 0) * K;
	r.b = w + (size_t)(r.b_ok ? rb : 0) * K;
	return r;
}

// Chunk u of the batch at k0: k = k0 + 32u + 8t .. +8 of both rows (zeros past kend).
template <int MT>
static __device__ __forceinline__ void sk_load_w(uint4 (&wv)[2], const sk_rows &r, int k0,
						 int u, int kend, int tig)
{
	int k = k0 + u * 32 + tig * 8;
	bool in = k < kend;

	wv[0] = k_cuda_lin_ld_stream(r.a + (in ? k : 0), in && r.a_ok);
	wv[1] = k_cuda_lin_ld_stream(r.b + (in ? k : 0), in && r.b_ok);
}

// One k32 chunk: the lane's 16 bytes of rows grp and grp + 8 against each m-tile of x;
// xk is the stage at this chunk and lane (k 32u + 8t).
template <int MT>
static __device__ __forceinline__ void sk_mma_chunk(float (&acc)[MT][4], const uint4 (&wv)[2],
						    const uint16_t *xk, int grp)
{
#pragma unroll
	for (int j = 0; j < MT; j++) {
		const uint4 bx = *(const uint4 *)(xk + (j * 8 + grp) * sk_cfg<MT>::XS);

		// k 8t .. 8t+3, then k 8t+4 .. 8t+7
		sk_mma(acc[j], wv[0].x, wv[1].x, wv[0].y, wv[1].y, bx.x, bx.y);
		sk_mma(acc[j], wv[0].z, wv[1].z, wv[0].w, wv[1].w, bx.z, bx.w);
	}
}

// What sk_load_w would read in the first SK_PREFETCH batches from k0, into L2.
template <int MT>
static __device__ __forceinline__ void sk_prefetch_w(const sk_rows &r, int k0, int kend, int tig)
{
#pragma unroll
	for (int u = 0; u < sk_cfg<MT>::U * SK_PREFETCH; u++) {
		int k = k0 + u * 32 + tig * 8;

		if (k < kend) {
			if (r.a_ok)
				k_cuda_lin_prefetch(r.a + k);
			if (r.b_ok)
				k_cuda_lin_prefetch(r.b + k);
		}
	}
}

// x rows [0, XROWS) x k [k0, k0 + BK) into registers; zeros past M and past kend.
template <int MT>
static __device__ __forceinline__ void sk_load_x(float4 (&xv)[sk_cfg<MT>::XV], const float *x,
						 int M, int K, int k0, int kend, int tid)
{
	using C = sk_cfg<MT>;
#pragma unroll
	for (int v = 0; v < C::XV; v++) {
		int f = tid + v * SK_THREADS;
		int m = f / C::XQ, k = k0 + (f % C::XQ) * 4;

		// K % 8 == 0 and k % 4 == 0: the 4 floats are all in or all out
		xv[v] = m < M && k < kend ? *(const float4 *)(x + (size_t)m * K + k)
					  : make_float4(0.f, 0.f, 0.f, 0.f);
	}
}

template <int MT>
static __device__ __forceinline__ void sk_store_x(uint16_t *stage,
						  const float4 (&xv)[sk_cfg<MT>::XV], int tid)
{
	using C = sk_cfg<MT>;
#pragma unroll
	for (int v = 0; v < C::XV; v++) {
		int f = tid + v * SK_THREADS;
		int m = f / C::XQ, kk = (f % C::XQ) * 4;
		uint2 p;

		p.x = sk_pack_bf16(xv[v].x, xv[v].y);
		p.y = sk_pack_bf16(xv[v].z, xv[v].w);
		*(uint2 *)(stage + m * C::XS + kk) = p;
	}
}

// y rows m, columns n of this lane's accumulators, written straight from the fragments.
template <int MT>
static __device__ __forceinline__ void sk_store_y(float *y, const float (&acc)[MT][4], int M,
						  int N, int n0, int tig, int accumulate)
{
#pragma unroll
	for (int j = 0; j < MT; j++) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			int m = j * 8 + tig * 2 + (c & 1), n = n0 + (c >> 1) * 8;

			if (m < M && n < N) {
				float *p = y + (size_t)m * N + n;

				*p = accumulate ? *p + acc[j][c] : acc[j][c];
			}
		}
	}
}

// The S partial tiles of row group g, summed in cluster-rank order; rank s writes its
// 1/S of the (M, 256) outputs.
template <int MT>
static __device__ void sk_cluster_reduce(float *y, const float (&acc)[MT][4], float *part,
					 int M, int N, int g, int warp, int grp, int tig,
					 int accumulate)
{
	cg::cluster_group cluster = cg::this_cluster();
	const int S = (int)cluster.num_blocks(), s = (int)cluster.block_rank();
	const int E = M * SK_ROWS, per = (E + S - 1) / S;
	const int e1 = min(E, (s + 1) * per);

	// the main loop ended with __syncthreads(): nobody reads the x stages any more
#pragma unroll
	for (int j = 0; j < MT; j++) {
#pragma unroll
		for (int c = 0; c < 4; c++) {
			int m = j * 8 + tig * 2 + (c & 1), r = warp * 16 + grp + (c >> 1) * 8;

			part[m * SK_PSTRIDE + r] = acc[j][c];
		}
	}
	cluster.sync();
	for (int e = s * per + (int)threadIdx.x; e < e1; e += SK_THREADS) {
		int m = e / SK_ROWS, r = e % SK_ROWS, n = g * SK_ROWS + r;

		if (n < N) {
			float sum = 0.f;
			float *p = y + (size_t)m * N + n;

			for (int q = 0; q < S; q++)
				sum += cluster.map_shared_rank(part, q)[m * SK_PSTRIDE + r];
			*p = accumulate ? *p + sum : sum;
		}
	}
	cluster.sync();		// keep the partials alive until every rank has read them
}

// grid (S, groups): blockIdx.x is the K slice [s * KS, (s + 1) * KS) and the cluster
// rank; blockIdx.y the first 256-row group, then every gridDim.y-th (S = 1 only).
template <int MT>
__global__ void __launch_bounds__(SK_THREADS, 1)
sk_kernel(float *y, const float *x, const uint16_t *__restrict__ w, int M, int N, int K, int KS,
	  int accumulate, int pdl)
{
	using C = sk_cfg<MT>;
	extern __shared__ __align__(16) unsigned char sk_smem[];
	uint16_t *xs = (uint16_t *)sk_smem;	// (2, XROWS, XS) bf16 stages
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
	const int grp = lane >> 2, tig = lane & 3;
	const int S = gridDim.x, ks = blockIdx.x * KS, kend = min(K, ks + KS);
	const int nb = ks < kend ? (kend - ks + C::BK - 1) / C::BK : 0;	// slice batches
	const int G = (N + SK_ROWS - 1) / SK_ROWS;
	const int ng = (int)blockIdx.y < G ? (G - 1 - (int)blockIdx.y) / (int)gridDim.y + 1 : 0;
	const int total = ng * nb;
	const bool x_fixed = nb == 1;	// every batch sees the same x: stage it once
	float acc[MT][4];
	uint4 wv[C::U][2];
	float4 xv[C::XV];

#pragma unroll
	for (int j = 0; j < MT; j++)
		acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
	if (total > 0) {
		int i = 0, b = 0;	// group index and batch of the current iteration
		sk_rows r = sk_rows_of(w, N, K, blockIdx.y, warp, grp);

		// the first batches into L2 while the previous kernel drains (PDL)
		if (k_cuda_lin_early_cta(pdl))
			sk_prefetch_w<MT>(r, ks, kend, tig);
		k_cuda_lin_inputs_ready(pdl);	// x and y only from here on
#pragma unroll
		for (int u = 0; u < C::U; u++)
			sk_load_w<MT>(wv[u], r, ks, u, kend, tig);
		sk_load_x<MT>(xv, x, M, K, ks, kend, tid);
		sk_store_x<MT>(xs, xv, tid);
		__syncthreads();
		for (int it = 0; it < total; it++) {
			const int g = blockIdx.y + i * gridDim.y;
			const bool more = it + 1 < total;
			const int ni = b + 1 == nb ? i + 1 : i, nbt = b + 1 == nb ? 0 : b + 1;
			const int nk0 = ks + nbt * C::BK;
			const uint16_t *stage = xs + (x_fixed ? 0 : (it & 1) * C::XROWS * C::XS);
			sk_rows nr = sk_rows_of(w, N, K, blockIdx.y + ni * gridDim.y, warp, grp);

			if (more && !x_fixed)
				sk_load_x<MT>(xv, x, M, K, nk0, kend, tid);
			if (b == 0) {
#pragma unroll
				for (int j = 0; j < MT; j++)
					acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
			}
			// chunk u of this batch, then at once chunk u of the next: the loads
			// in flight never drain while the warp computes
#pragma unroll
			for (int u = 0; u < C::U; u++) {
				sk_mma_chunk<MT>(acc, wv[u], stage + u * 32 + tig * 8, grp);
				if (more)
					sk_load_w<MT>(wv[u], nr, nk0, u, kend, tig);
			}
			if (more && !x_fixed)
				sk_store_x<MT>(xs + ((it + 1) & 1) * C::XROWS * C::XS, xv, tid);
			if (S == 1 && b == nb - 1)
				sk_store_y<MT>(y, acc, M, N, g * SK_ROWS + warp * 16 + grp, tig,
					       accumulate);
			__syncthreads();
			i = ni;
			b = nbt;
		}
	} else {
		k_cuda_lin_inputs_ready(pdl);
	}
	if (S > 1)	// then gridDim.y == G: one group per CTA, the same in the whole cluster
		sk_cluster_reduce<MT>(y, acc, (float *)sk_smem, M, N, blockIdx.y, warp, grp, tig,
				      accumulate);
}

// ---- launchers --------------------------------------------------------------

static int sk_mt_index(int M)
{
	return M <= 8 ? 0 : M <= 16 ? 1 : M <= 32 ? 2 : 3;
}

struct sk_plan {
	int mt;		// m8 tiles
	int S;		// K slices = cluster size
	int gy;		// gridDim.y
	int KS;		// k per slice (a multiple of the batch)
	int smem;	// dynamic shared memory, bytes
	int resident;	// CTAs resident at once (the first wave)
};

// k per batch and shared memory of the instantiation sk_mt_index picks.
static const int sk_bk[LIN_SK_N_MT] = {
	sk_cfg<1>::BK, sk_cfg<2>::BK, sk_cfg<4>::BK, sk_cfg<8>::BK,
};

static int sk_smem_of(int mi, int S)
{
	switch (mi) {
	case 0: return sk_smem_bytes<1>(S);
	case 1: return sk_smem_bytes<2>(S);
	case 2: return sk_smem_bytes<4>(S);
	default: return sk_smem_bytes<8>(S);
	}
}

// Split and grid for one launch: every split S of the nbk batches is tried; a wave
// holds cap[S] / S row groups; the cost is waves * (batches per slice + overhead).
// With S = 1 a CTA walks ceil(G / gy) groups, so gy spreads them evenly.
static void sk_make_plan(const struct k_cuda_linear *ctx, int M, int N, int K, struct sk_plan *p)
{
	const int mi = sk_mt_index(M);
	const int bk = sk_bk[mi];
	const int G = (N + SK_ROWS - 1) / SK_ROWS, nbk = (K + bk - 1) / bk;
	long best = -1;
	int best_S = 1, best_kb = nbk, best_waves = 1;

	for (int S = 1; S <= LIN_SK_MAX_SPLIT && S <= nbk; S++) {
		int kb = (nbk + S - 1) / S, per_wave, waves;
		long cost;

		if ((nbk + kb - 1) / kb != S)	// the same slices as a smaller S
			continue;
		if (S > 1 && G > 65535)	// gridDim.y would overflow: walk groups instead
			continue;
		per_wave = ctx->sk_cap[mi][S] / S;
		if (per_wave < 1)
			continue;
		waves = (G + per_wave - 1) / per_wave;
		cost = (long)waves * (kb + SK_WAVE_OVERHEAD);
		if (best < 0 || cost < best) {
			best = cost;
			best_S = S;
			best_kb = kb;
			best_waves = waves;
		}
	}
	p->mt = 1 << mi;
	p->S = best_S;
	p->KS = best_kb * bk;
	p->gy = best_S > 1 ? G : (G + best_waves - 1) / best_waves;	// <= cap[1] for S = 1
	p->smem = sk_smem_of(mi, p->S);
	p->resident = ctx->sk_cap[mi][p->S] > 0 ? ctx->sk_cap[mi][p->S] : 1;
}

// The cluster-size attribute for S > 1; returns the number of attributes filled.
static int sk_cluster_attr(cudaLaunchAttribute *attr, int S)
{
	if (S <= 1)
		return 0;
	attr->id = cudaLaunchAttributeClusterDimension;
	attr->val.clusterDim.x = S;
	attr->val.clusterDim.y = 1;
	attr->val.clusterDim.z = 1;
	return 1;
}

template <int MT>
static int sk_launch(const struct k_cuda_linear *ctx, const struct sk_plan *p, float *y,
		     const float *x, const uint16_t *w, int M, int N, int K, int accumulate)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[2] = {};

	cfg.gridDim = dim3(p->S, p->gy, 1);
	cfg.blockDim = dim3(SK_THREADS, 1, 1);
	cfg.dynamicSmemBytes = p->smem;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = sk_cluster_attr(attr, p->S);
	cfg.numAttrs += k_cuda_lin_pdl_attr(ctx, attr + cfg.numAttrs);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, sk_kernel<MT>, y, x, w, M, N, K, p->KS,
						     accumulate, ctx->pdl ? p->resident : 0));
}

int k_cuda_lin_splitk(const struct k_cuda_linear *ctx, float *y, const float *x,
		      const uint16_t *w, int M, int N, int K, int accumulate)
{
	for (int m0 = 0; m0 < M; m0 += LIN_SK_MAX_M) {
		int mc = M - m0 < LIN_SK_MAX_M ? M - m0 : LIN_SK_MAX_M, ret;
		float *yc = y + (size_t)m0 * N;
		const float *xc = x + (size_t)m0 * K;
		struct sk_plan p;

		sk_make_plan(ctx, mc, N, K, &p);
		switch (p.mt) {
		case 1: ret = sk_launch<1>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		case 2: ret = sk_launch<2>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		case 4: ret = sk_launch<4>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		default: ret = sk_launch<8>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		}
		if (ret)
			return ret;
	}
	return 0;
}

int k_cuda_lin_splitk_describe(const struct k_cuda_linear *ctx, int M, int N, int K,
			       char *buf, size_t len)
{
	struct sk_plan p;
	int mc = M < LIN_SK_MAX_M ? M : LIN_SK_MAX_M;

	sk_make_plan(ctx, mc, N, K, &p);
	return snprintf(buf, len, "splitk mt=%d split=%d grid=%dx%d k/slice=%d smem=%d cap=%d%s",
			p.mt, p.S, p.S, p.gy, p.KS, p.smem, ctx->sk_cap[sk_mt_index(mc)][p.S],
			M > LIN_SK_MAX_M ? " (per 64 rows)" : "");
}

// Shared-memory limit of one instantiation and how many of its CTAs (per cluster size)
// the device holds at once.
template <int MT> static int sk_setup_mt(struct k_cuda_linear *ctx, int mi)
{
	int smax = sk_smem_bytes<MT>(2), ret, bps = 0;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(sk_kernel<MT>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, smax));
	if (ret)
		return ret;
	ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, sk_kernel<MT>,
				SK_THREADS, sk_smem_bytes<MT>(1)));
	if (ret)
		return ret;
	if (bps < 1) {
		k_cuda_log("cuda: split-K linear kernel (mt %d) fits no multiprocessor of device %d",
			   MT, ctx->dev);
		return -EIO;
	}
	ctx->sk_cap[mi][1] = bps * ctx->n_sm;
	for (int S = 2; S <= LIN_SK_MAX_SPLIT; S++) {
		cudaLaunchConfig_t cfg = {};
		cudaLaunchAttribute attr[1] = {};
		int clusters = 0;

		cfg.gridDim = dim3(S, 1, 1);
		cfg.blockDim = dim3(SK_THREADS, 1, 1);
		cfg.dynamicSmemBytes = sk_smem_bytes<MT>(S);
		cfg.attrs = attr;
		cfg.numAttrs = sk_cluster_attr(attr, S);
		// a cluster size the device refuses is simply never chosen
		if (cudaOccupancyMaxActiveClusters(&clusters, sk_kernel<MT>, &cfg) != cudaSuccess) {
			cudaGetLastError();
			clusters = 0;
		}
		ctx->sk_cap[mi][S] = clusters * S;
	}
	return 0;
}

// An empty launch (N = 0: no memory is touched) with a cluster of 2 and, when ctx->pdl,
// programmatic serialisation; run to completion so that errors show here.
static cudaError_t sk_probe(const struct k_cuda_linear *ctx)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[2] = {};
	const int S = ctx->sk_cap[0][2] > 0 ? 2 : 1;
	cudaError_t e;

	cfg.gridDim = dim3(S, 1, 1);
	cfg.blockDim = dim3(SK_THREADS, 1, 1);
	cfg.dynamicSmemBytes = sk_smem_bytes<1>(S);
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = sk_cluster_attr(attr, S);
	cfg.numAttrs += k_cuda_lin_pdl_attr(ctx, attr + cfg.numAttrs);
	e = cudaLaunchKernelEx(&cfg, sk_kernel<1>, (float *)NULL, (const float *)NULL,
			       (const uint16_t *)NULL, 0, 0, 8, sk_cfg<1>::BK, 0, ctx->pdl);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(ctx->stream);
	return e;
}

int k_cuda_lin_splitk_setup(struct k_cuda_linear *ctx)
{
	int ret;

	ret = sk_setup_mt<1>(ctx, 0);
	if (!ret)
		ret = sk_setup_mt<2>(ctx, 1);
	if (!ret)
		ret = sk_setup_mt<4>(ctx, 2);
	if (!ret)
		ret = sk_setup_mt<8>(ctx, 3);
	if (ret)
		return ret;
	if (ctx->pdl && sk_probe(ctx) != cudaSuccess) {
		k_cuda_log("cuda: device %d refuses programmatic dependent launch of the split-K "
			   "linear kernel (%s); launching without it", ctx->dev,
			   cudaGetErrorString(cudaGetLastError()));
		ctx->pdl = 0;
	}
	return LIN_CUDA(ctx->dev, sk_probe(ctx));
}
