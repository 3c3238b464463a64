// The weight-streaming tensor-core kernel for decode batches (M <= 64 per launch): tiles
// of weights flow from HBM through a cp.async pipeline in shared memory into mma.sync,
// x comes in bf16 (the producer's copy in the context scratch, or rounded first), and K
// splits over CTAs whose partial tiles the last CTA of each tile adds in split order.
//
// Why another kernel: at these M a linear layer is a stream of its weights, and what
// decides its speed is how soon every SM has enough bytes in flight and how evenly the
// work ends. cuBLAS picks tiles for arithmetic and leaves the small-N layers of a decode
// step at 60-70% of the HBM floor (Llama-3.1-8B q/k/v and o_proj, DeepSeek-V2-Lite's
// 2048-wide projections; docs/results/cuda-linear-d134451.txt). Here each CTA keeps
// three 16 KB stages of weights in flight from its first instruction (issued before
// the wait on the previous kernel: weights are constant), and the split along K is
// chosen so the CTAs fill whole waves of the resident slots.
//
// Layout. A CTA owns ST_ROWS (128) weight rows and one K slice; warp w the rows
// 32w .. 32w+31 (two m16 tiles) against every n8 tile of x rows (NT of them).
// y^T (N, M) = W (N, K) x^T: W is the A operand (row-major, k contiguous), x the B
// operand (x rows with k contiguous = column-major B), both read with ldmatrix from
// 128-byte rows whose 16-byte chunks are swizzled by (row & 7), so the 8 rows of an
// 8x8 matrix fall in 8 different bank groups.
//
// Split K. With S slices, CTA (tile, s) writes its fp32 partial tile to the context's
// workspace, fences, and counts itself on the tile's counter; the CTA that counts last
// sums the S partials in order s = 0 .. S-1 (the same bits whoever comes last), writes
// y and resets the counter for the next launch or graph replay.
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_split.cuh"
#include "kernels/cuda/ptx.cuh"

#define ST_WARPS	4
#define ST_THREADS	(ST_WARPS * 32)
#define ST_ROWS		(ST_WARPS * 32)	/* weight rows per CTA: two m16 tiles per warp */
#define ST_BK		64	/* k per stage: one 128-byte line of each weight row */
#define ST_STAGES	4	/* buffers; ST_STAGES - 1 stages in flight ahead */
#define ST_AHEAD	(ST_STAGES - 1)
/* Fixed cost of a CTA (prologue, epilogue, pipeline ramp) in stages, for the split. */
#define ST_CTA_OVERHEAD	3

template <int NT> struct st_cfg {
	static constexpr int XROWS = NT * 8;			// x rows per launch
	static constexpr int W_BYTES = ST_ROWS * ST_BK * 2;	// 16 KB
	static constexpr int X_BYTES = XROWS * ST_BK * 2;
	static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
	static constexpr int SMEM = ST_STAGES * STAGE_BYTES;
};

// ---- kernel -------------------------------------------------------------------

// Byte offset of (row, 16-byte chunk) in a tile of 128-byte rows.
static __device__ __forceinline__ uint32_t st_swz(int row, int chunk)
{
	return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

static __device__ __forceinline__ void st_ldsm_x4(uint32_t (&r)[4], uint32_t addr)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(addr));
}

static __device__ __forceinline__ void st_ldsm_x2(uint32_t &r0, uint32_t &r1, uint32_t addr)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
		     : "=r"(r0), "=r"(r1)
		     : "r"(addr));
}

static __device__ __forceinline__ void st_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
					      uint32_t b1)
{
	asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
	    "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
	    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The weight part of a stage: rows n0 .. n0+127, k k0 .. k0+63 (zeros past N or kend).
// EARLY: issued before the PDL wait (k_cuda_pdl_early_cp16).
template <bool EARLY = false>
static __device__ __forceinline__ void st_load_w(unsigned char *ws, const uint16_t *w, int N,
						 int K, int n0, int k0, int kend, int tid)
{
#pragma unroll
	for (int j = 0; j < ST_ROWS * 8 / ST_THREADS; j++) {
		const int i = tid + j * ST_THREADS, r = i >> 3, c = i & 7, k = k0 + c * 8;
		const bool ok = n0 + r < N && k < kend;

		if (EARLY)
			k_cuda_pdl_early_cp16(ws + st_swz(r, c), ok ? w + (size_t)(n0 + r) * K + k : w,
					      ok);
		else
			cp_async16(ws + st_swz(r, c), ok ? w + (size_t)(n0 + r) * K + k : w, ok);
	}
}

// The x part of a stage: x rows 0 .. XROWS-1 (zeros past M), same k.
template <int NT>
static __device__ __forceinline__ void st_load_x(unsigned char *xs, const uint16_t *xb, int M,
						 int K, int k0, int kend, int tid)
{
	for (int i = tid; i < st_cfg<NT>::XROWS * 8; i += ST_THREADS) {
		const int r = i >> 3, c = i & 7, k = k0 + c * 8;
		const bool ok = r < M && k < kend;

		cp_async16(xs + st_swz(r, c), ok ? xb + (size_t)r * K + k : xb, ok);
	}
}

// One stage's 4 k16 steps: the warp's two m16 weight tiles against the NT x tiles.
template <int NT>
static __device__ __forceinline__ void st_compute(float (&acc)[2][NT][4], uint32_t wsa,
						  uint32_t xsa, int warp, int lane)
{
#pragma unroll
	for (int kk = 0; kk < ST_BK / 16; kk++) {
		uint32_t a[2][4], b[NT][2];

#pragma unroll
		for (int t = 0; t < 2; t++)	// lanes 0-15: rows, k 0-7; 16-31: rows, k 8-15
			st_ldsm_x4(a[t], wsa + st_swz(warp * 32 + t * 16 + (lane & 15),
						      kk * 2 + (lane >> 4)));
		if (NT == 1) {
			st_ldsm_x2(b[0][0], b[0][1], xsa + st_swz(lane & 7, kk * 2 + ((lane >> 3) & 1)));
		} else {
#pragma unroll
			for (int p = 0; p < NT / 2; p++) {
				const int q = lane >> 3;	// matrix: (x rows +0/+8) x (k 0-7/8-15)
				uint32_t r[4];

				st_ldsm_x4(r, xsa + st_swz(p * 16 + (q >> 1) * 8 + (lane & 7),
							   kk * 2 + (q & 1)));
				b[2 * p][0] = r[0];
				b[2 * p][1] = r[1];
				b[2 * p + 1][0] = r[2];
				b[2 * p + 1][1] = r[3];
			}
		}
#pragma unroll
		for (int t = 0; t < 2; t++)
#pragma unroll
			for (int j = 0; j < NT; j++)
				st_mma(acc[t][j], a[t], b[j][0], b[j][1]);
	}
}

// grid (tiles, S): blockIdx.x the 128-row tile, blockIdx.y the K slice [s KS, s KS + KS).
// xb: bf16 x (M, K) row-major; ws: (tiles * S, XROWS, ST_ROWS) fp32 partials; cnt:
// (tiles) arrival counters, zero between launches. Needs K % 8 == 0, w and xb 16-byte
// aligned, M <= XROWS.
template <int NT>
__global__ void __launch_bounds__(ST_THREADS)
st_kernel(float *y, const uint16_t *xb, const uint16_t *__restrict__ w, int M, int N, int K,
	  int KS, int accumulate, float *ws, unsigned *cnt, int pdl)
{
	using C = st_cfg<NT>;
	extern __shared__ __align__(128) unsigned char st_smem[];
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
	const int g = lane >> 2, t4 = lane & 3;
	const int tile = blockIdx.x, S = gridDim.y, s = blockIdx.y;
	const int n0 = tile * ST_ROWS, k0 = s * KS, kend = min(K, k0 + KS);
	const int nb = (kend - k0 + ST_BK - 1) / ST_BK;
	const uint32_t smem = (uint32_t)__cvta_generic_to_shared(st_smem);
	float acc[2][NT][4];

#pragma unroll
	for (int t = 0; t < 2; t++)
#pragma unroll
		for (int j = 0; j < NT; j++)
			acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.f;

	// weights are constant: the first stages stream in while the previous kernel drains
#pragma unroll
	for (int i = 0; i < ST_AHEAD; i++) {
		if (i < nb)
			st_load_w<true>(st_smem + i * C::STAGE_BYTES, w, N, K, n0, k0 + i * ST_BK, kend,
					tid);
		cp_async_commit();
	}
	k_cuda_lin_inputs_ready(pdl);	// x and y only from here on
#pragma unroll
	for (int i = 0; i < ST_AHEAD; i++) {
		if (i < nb)
			st_load_x<NT>(st_smem + i * C::STAGE_BYTES + C::W_BYTES, xb, M, K,
				      k0 + i * ST_BK, kend, tid);
		cp_async_commit();
	}
	// groups so far: W0 W1 W2 X0 X1 X2; then one (W, X) group per iteration. Before
	// iteration i, stage i's last group has exactly ST_AHEAD - 1 newer ones.
	for (int i = 0; i < nb; i++) {
		const int nx = i + ST_AHEAD;

		cp_async_wait<ST_AHEAD - 1>();
		__syncthreads();	// stage i visible; stage i - 1's buffer free
		if (nx < nb) {
			unsigned char *st = st_smem + (nx % ST_STAGES) * C::STAGE_BYTES;

			st_load_w(st, w, N, K, n0, k0 + nx * ST_BK, kend, tid);
			st_load_x<NT>(st + C::W_BYTES, xb, M, K, k0 + nx * ST_BK, kend, tid);
		}
		cp_async_commit();
		const uint32_t st = smem + (i % ST_STAGES) * C::STAGE_BYTES;

		st_compute<NT>(acc, st, st + C::W_BYTES, warp, lane);
	}
	cp_async_wait<0>();

	if (S == 1) {
		lin_store_tiles<NT>(y, acc, M, N, n0, accumulate, warp, g, t4);
		return;
	}
	float *part = ws + ((size_t)tile * S + s) * C::XROWS * ST_ROWS;

#pragma unroll
	for (int t = 0; t < 2; t++)
#pragma unroll
		for (int j = 0; j < NT; j++)
#pragma unroll
			for (int c = 0; c < 4; c++) {
				const int r = lin_frag_row(warp, t, g, c);
				const int m = lin_frag_m(j, t4, c);

				__stcg(part + m * ST_ROWS + r, acc[t][j][c]);
			}
	if (!lin_split_last(cnt, tile, S))
		return;
	lin_split_sum4<ST_ROWS, ST_THREADS, 2>(y, ws + (size_t)tile * S * C::XROWS * ST_ROWS,
					       (size_t)C::XROWS * ST_ROWS, M, N, n0, S, accumulate, tid);
	if (tid == 0)
		cnt[tile] = 0;
}

// ---- launchers ----------------------------------------------------------------

static int st_nt_index(int M)
{
	return M <= 8 ? 0 : M <= 16 ? 1 : M <= 32 ? 2 : 3;
}

static const int st_smem_of[LIN_ST_N_NT] = {
	st_cfg<1>::SMEM, st_cfg<2>::SMEM, st_cfg<4>::SMEM, st_cfg<8>::SMEM,
};

struct st_plan {
	int nt;		// n8 tiles of x rows
	int tiles;	// 128-row weight tiles
	int S;		// K slices
	int KS;		// k per slice (a multiple of ST_BK)
	int waves;	// of the resident slots
};

// Every split S of the K stages is tried: time ~ waves * (stages per slice + overhead),
// a wave being the CTAs resident at once; ties go to the smaller split. Splits need
// the workspace: at most LIN_ST_MAX_UNITS CTAs.
static void st_make_plan(const struct k_cuda_linear *ctx, int M, int N, int K, struct st_plan *p)
{
	const int ni = st_nt_index(M);
	const int tiles = (N + ST_ROWS - 1) / ST_ROWS, nbk = (K + ST_BK - 1) / ST_BK;
	const long slots = ctx->st_cap[ni] > 0 ? ctx->st_cap[ni] : 1;
	long best = -1;

	p->nt = 1 << ni;
	p->tiles = tiles;
	p->S = 1;
	p->KS = nbk * ST_BK;
	p->waves = (int)((tiles + slots - 1) / slots);
	for (int S = 1; S <= LIN_ST_MAX_SPLIT && S <= nbk; S++) {
		const int kb = (nbk + S - 1) / S;
		const long units = (long)tiles * S, waves = (units + slots - 1) / slots;
		long cost;

		if ((nbk + kb - 1) / kb != S)	// the same slices as a smaller S
			continue;
		if (S > 1 && units > LIN_ST_MAX_UNITS)
			break;
		cost = waves * (kb + ST_CTA_OVERHEAD);
		if (best < 0 || cost < best) {
			best = cost;
			p->S = S;
			p->KS = kb * ST_BK;
			p->waves = (int)waves;
		}
	}
}

template <int NT>
static int st_launch(const struct k_cuda_linear *ctx, const struct st_plan *p, float *y,
		     const uint16_t *xb, const uint16_t *w, int M, int N, int K, int accumulate)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};

	cfg.gridDim = dim3(p->tiles, p->S, 1);
	cfg.blockDim = dim3(ST_THREADS, 1, 1);
	cfg.dynamicSmemBytes = st_cfg<NT>::SMEM;
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return LIN_CUDA(ctx->dev, cudaLaunchKernelEx(&cfg, st_kernel<NT>, y, xb, w, M, N, K, p->KS,
						     accumulate, ctx->st_ws, ctx->st_cnt,
						     ctx->pdl));
}

int k_cuda_lin_stream(const struct k_cuda_linear *ctx, float *y, const float *x,
		      const uint16_t *w, int M, int N, int K, int accumulate, bool ready)
{
	int ret = 0;

	if (!ready)
		ret = k_cuda_lin_to_bf16(ctx, ctx->xb, x, (size_t)M * K);
	for (int m0 = 0; m0 < M && !ret; m0 += LIN_ST_MAX_M) {
		const int mc = M - m0 < LIN_ST_MAX_M ? M - m0 : LIN_ST_MAX_M;
		float *yc = y + (size_t)m0 * N;
		const uint16_t *xc = ctx->xb + (size_t)m0 * K;
		struct st_plan p;

		st_make_plan(ctx, mc, N, K, &p);
		switch (p.nt) {
		case 1: ret = st_launch<1>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		case 2: ret = st_launch<2>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		case 4: ret = st_launch<4>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		default: ret = st_launch<8>(ctx, &p, yc, xc, w, mc, N, K, accumulate); break;
		}
	}
	return ret;
}

int k_cuda_lin_stream_describe(const struct k_cuda_linear *ctx, int M, int N, int K, char *buf,
			       size_t len)
{
	struct st_plan p;

	st_make_plan(ctx, M < LIN_ST_MAX_M ? M : LIN_ST_MAX_M, N, K, &p);
	return snprintf(buf, len, "stream nt=%d grid=%dx%d k/slice=%d waves=%d cap=%d smem=%d%s",
			p.nt, p.tiles, p.S, p.KS, p.waves, ctx->st_cap[st_nt_index(M)],
			st_smem_of[st_nt_index(M)], M > LIN_ST_MAX_M ? " (per 64 rows)" : "");
}

template <int NT> static int st_setup_nt(struct k_cuda_linear *ctx, int ni)
{
	int ret, bps = 0;

	ret = LIN_CUDA(ctx->dev, cudaFuncSetAttribute(st_kernel<NT>,
				cudaFuncAttributeMaxDynamicSharedMemorySize, st_cfg<NT>::SMEM));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps,
					st_kernel<NT>, ST_THREADS, st_cfg<NT>::SMEM));
	if (ret)
		return ret;
	if (bps < 1) {
		k_cuda_log("cuda: streaming linear kernel (nt %d, %d bytes of shared memory) fits "
			   "no multiprocessor of device %d", NT, st_cfg<NT>::SMEM, ctx->dev);
		return -EIO;
	}
	ctx->st_cap[ni] = bps * ctx->n_sm;
	return 0;
}

int k_cuda_lin_stream_setup(struct k_cuda_linear *ctx)
{
	const size_t ws_bytes = (size_t)LIN_ST_MAX_UNITS * LIN_ST_MAX_M * ST_ROWS * sizeof(float);
	int ret;

	ret = st_setup_nt<1>(ctx, 0);
	if (!ret)
		ret = st_setup_nt<2>(ctx, 1);
	if (!ret)
		ret = st_setup_nt<4>(ctx, 2);
	if (!ret)
		ret = st_setup_nt<8>(ctx, 3);
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaMalloc((void **)&ctx->st_ws, ws_bytes));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaMalloc((void **)&ctx->st_cnt,
						    LIN_ST_MAX_UNITS * sizeof(unsigned)));
	if (!ret)	// counters start at zero and every launch leaves them so
		ret = LIN_CUDA(ctx->dev, cudaMemsetAsync(ctx->st_cnt, 0,
						    LIN_ST_MAX_UNITS * sizeof(unsigned), ctx->stream));
	if (!ret)
		ret = LIN_CUDA(ctx->dev, cudaStreamSynchronize(ctx->stream));
	return ret;
}
