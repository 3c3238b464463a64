// MLA's expand projection on tensor cores, out[r, h] = W_UV[h] o_lat[r, h] (see
// mla_proj.cu), and its variant that merges the attention's split partials as it
// stages its rows, a cluster of a head's blocks sharing that merge.
#include <cstdlib>

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/mla_proj.cuh"
#include "kernels/cuda/attn/mla_proj_tile.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ptx.cuh"

#define EXP_MMA_SMALL_ROWS 16	// up to here the expand blocks take 8 outputs, past it 16
/* Rows up to which the expand merges the splits itself by default (k_cuda_tuning's
 * mla_fold_rows): none. Measured on H200 (DeepSeek-V2-Lite, batch 1, step p50) before
 * the cluster (each block merged the whole head again): folding 3.155 ms, the merge
 * kernel 3.022; with the cluster, which reads each partial once (see
 * mla_expand_mma_kernel), 2.782 against 2.751 (docs/results/cuda-final-e3af145.txt):
 * still no faster. KDEC_MLA_FOLD_ROWS=1 on. */
#define EXP_FOLD_NJ 16		// outputs per merging expand block: half the blocks (and
				// merged copies) of 8, one block per SM at DeepSeek's dims
#define MERGE_BATCH 32		// partial loads a merging thread has in flight at once
#define MERGE_BATCH_1 64	// the same, one float a load (a cluster rank's few columns)
#define EXP_FOLD_CLUSTER 8	// most expand blocks of a head that share one merge

namespace cg = cooperative_groups;

namespace {	// kernels and their helpers stay private to this file

// w x + a, per component, each an fmaf (as the merge kernel's scalar loop).
__device__ __forceinline__ float4 fma4(float w, float4 x, float4 a)
{
	return make_float4(fmaf(w, x.x, a.x), fmaf(w, x.y, a.y), fmaf(w, x.z, a.z),
			   fmaf(w, x.w, a.w));
}

// Split partials of the latent attention for the expand kernel to merge as it stages
// its rows (attn_ws.cu's merge, folded in): o (n_splits, R, H, L), each split's output
// normalised by its own sum, and lse (n_splits, R, H) its log2-sum-exp2, -inf where the
// split saw no token (its o is then never read). n_splits 1: o_lat is read as is.
struct proj_parts {
	const float *o, *lse;
	int n_splits;
};

// stage_merged's COLS case (the cluster ranks' shares): columns [c0, c0 + n_cols) of
// each of nr rows, a float a thread and pass, MERGE_BATCH_1 loads in flight.
__device__ __forceinline__ void merge_cols(float *sa, int as, const float *o, size_t sstride,
					int H, int h, int r0, int nr, int L, const int *live,
					const float *wts, const int *n_live, int ns, int c0,
					int n_cols)
{
	const int ss = (int)sstride;	// mla_expand_folds: the partials index in an int

	for (int i = threadIdx.x; i < nr * n_cols; i += PROJ_THREADS) {
		const int rr = i / n_cols, c = c0 + i % n_cols;
		const int n = n_live[rr], n4 = n & ~3, *lv = live + rr * ns;
		const float *wv = wts + rr * ns;
		const float *po = o + ((size_t)(r0 + rr) * H + h) * L + c;
		float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

		for (int j0 = 0; c < L && j0 < n; j0 += MERGE_BATCH_1) {
			float x[MERGE_BATCH_1];

#pragma unroll
			for (int k = 0; k < MERGE_BATCH_1; k++)
				if (j0 + k < n)
					x[k] = po[lv[j0 + k] * ss];
#pragma unroll
			for (int k = 0; k < MERGE_BATCH_1; k++) {
				const int j = j0 + k;

				if (j < n4)
					acc[k % 4] = fmaf(wv[j], x[k], acc[k % 4]);
				else if (j < n)
					acc[0] = fmaf(wv[j], x[k], acc[0]);
			}
		}
		sa[rr * as + c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
	}
}

// Rows r0 .. r0 + nr - 1 of head h merged from the partials into sa (nr, as), zero past
// L (L % 4 == 0, parts 16-byte aligned), with the merge kernel's arithmetic in its order
// (so o_lat is bit for bit what attn_merge writes): warp w lists the live splits of rows
// w, w + 4, ... and their weights (live, wts: (nr, n_splits); n_live: (nr)); then each
// float4 of a row sums w_i o(live_i) with four accumulators, MERGE_BATCH loads at a
// time in flight. Only the float4 columns [q0, q1) of each row (a cluster rank's share).
template <bool COLS>
__device__ __forceinline__ void stage_merged(float *sa, int as, const proj_parts p, int R, int H,
					     int h, int r0, int nr, int L, int *live, float *wts,
					     int *n_live, int q0, int q1)
{
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ns = p.n_splits;
	const size_t per_split = (size_t)R * H, sstride = per_split * L;

	for (int rr = warp; rr < nr; rr += PROJ_WARPS) {
		const size_t rh = (size_t)(r0 + rr) * H + h;
		const int base = merge_list(p.lse, ns, rh, per_split, live + rr * ns, wts + rr * ns);

		if (lane == 0)
			n_live[rr] = base;
	}
	__syncthreads();
	const int nq = q1 - q0;

	// COLS (the cluster's ranks: a share of the columns, 64 floats a row at batch 1): a
	// float a thread, so more threads work and MERGE_BATCH_1 loads are in flight (33
	// splits cost one memory latency, not two); the same sums in the same order. Not
	// both paths in one kernel: together they spill.
	if constexpr (COLS) {
		if (nq > 0)
			merge_cols(sa, as, p.o, sstride, H, h, r0, nr, L, live, wts, n_live, ns,
				   q0 * 4, nq * 4);
	} else {
		for (int i = threadIdx.x; i < nr * nq; i += PROJ_THREADS) {
			const int rr = i / nq, c = (q0 + i % nq) * 4, n = n_live[rr];
			const int *lv = live + rr * ns;
			const float *wv = wts + rr * ns;
			const float *po = p.o + ((size_t)(r0 + rr) * H + h) * L + c;
			const int n4 = n & ~3;
			float4 acc[4];

#pragma unroll
			for (int k = 0; k < 4; k++)
				acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
			// MERGE_BATCH loads in flight, then their sums: the merge kernel's order
			// (split j into accumulator j % 4 up to n4, the rest into the first), so a
			// row of 33 splits (batch 1, ctx 1024) costs two memory latencies, not nine
			for (int j0 = 0; c < L && j0 < n; j0 += MERGE_BATCH) {
				float4 o[MERGE_BATCH];

#pragma unroll
				for (int k = 0; k < MERGE_BATCH; k++)
					if (j0 + k < n)
						o[k] = *(const float4 *)(po + lv[j0 + k] * sstride);
#pragma unroll
				for (int k = 0; k < MERGE_BATCH; k++) {
					const int j = j0 + k;

					if (j < n4)
						acc[k % 4] = fma4(wv[j], o[k], acc[k % 4]);
					else if (j < n)
						acc[0] = fma4(wv[j], o[k], acc[0]);
				}
			}
			*(float4 *)(sa + rr * as + c) = make_float4(
				(acc[0].x + acc[1].x) + (acc[2].x + acc[3].x),
				(acc[0].y + acc[1].y) + (acc[2].y + acc[3].y),
				(acc[0].z + acc[1].z) + (acc[2].z + acc[3].z),
				(acc[0].w + acc[1].w) + (acc[2].w + acc[3].w));
		}
	}
}

// Block (output chunk of NT x 8, head, row chunk of MT x 16): the block's o_lat rows
// (as wide) and the chunk's W_UV rows (NT * 8, ls) arrive in one burst, zero padded; warp w takes
// the k16 steps w, w + 4, ... for every row and output, and the four partial tiles are
// added in a fixed order through shared memory (the tiles' space, reused). With split
// partials (FOLD, parts.n_splits > 1) the rows are merged from them instead of read
// from o_lat, while the weight tile is in flight; the split lists follow the tiles.
// CLU: the blocks of a thread-block cluster (along x: the same head and rows, other
// outputs) share that merge: rank k merges its share of the float4 columns into its
// own tile, then copies the others' shares from theirs (distributed shared memory), so
// each partial is read from L2 once a head, not once a block (33 splits at batch 1:
// 1 MB, not 8 x 1 MB).
template <int MT, int NT, bool FOLD, bool CLU = false>
__global__ void __launch_bounds__(PROJ_THREADS)
mla_expand_mma_kernel(float *__restrict__ out, const float *o_lat,
		      const uint16_t *__restrict__ w, int n_rows, int H, int nope, int vdim, int L,
		      int vec, const proj_parts parts)
{
	extern __shared__ __align__(16) unsigned char proj_smem[];
	constexpr int NJ = NT * 8, MR = MT * 16;
	const int nks = (L + 15) / 16, as = nks * 16 + 8, ls = nks * 16 + PROJ_PAD;
	const int am = proj_a_rows(n_rows, MR);	// as the launcher sized the tile
	float *sa = (float *)proj_smem;					// (am, as)
	uint16_t *sw = (uint16_t *)(proj_smem + (size_t)am * as * 4);	// (NJ, ls) bf16
	float *red = (float *)proj_smem;		// (PROJ_WARPS, MR, NJ), after the tiles
	const int h = blockIdx.y, r0 = blockIdx.z * MR, nr = min(MR, n_rows - r0);
	const int j0 = blockIdx.x * NJ, nj = min(NJ, vdim - j0), nmt = (nr + 15) / 16;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const uint16_t *wh = w + ((size_t)h * (nope + vdim) + nope + j0) * L;
	float acc[MT][NT][4] = {};

	if (vec) {	// L % 8 == 0 and w 16-byte aligned
		for (int i = threadIdx.x; i < NJ * (ls / 8); i += PROJ_THREADS) {
			const int j = i / (ls / 8), c = i % (ls / 8) * 8;
			const bool ok = j < nj && c < L;

			k_cuda_pdl_early_cp16(sw + j * ls + c, ok ? wh + (size_t)j * L + c : wh, ok);
		}
	} else {
		for (int i = threadIdx.x; i < NJ * ls; i += PROJ_THREADS) {
			const int j = i / ls, c = i % ls;

			sw[i] = j < nj && c < L ? k_cuda_pdl_early(wh + (size_t)j * L + c) : (uint16_t)0;
		}
	}
	k_cuda_pdl_wait();	// the weight copies above overlap the attention's tail
	if (FOLD && parts.n_splits > 1) {
		unsigned char *lists = proj_smem + (size_t)am * as * 4 + (size_t)NJ * ls * 2;
		int *live = (int *)lists;				// (am, n_splits)
		float *wts = (float *)(live + am * parts.n_splits);	// (am, n_splits)

		cp_async_commit();
		if constexpr (CLU) {
			cg::cluster_group cl = cg::this_cluster();
			const int nb = (int)cl.num_blocks(), rk = (int)cl.block_rank();
			const int q4 = as / 4, per = (q4 + nb - 1) / nb;	// float4s a rank

			stage_merged<true>(sa, as, parts, n_rows, H, h, r0, nr, L, live, wts,
					   (int *)(wts + am * parts.n_splits), rk * per,
					   min(q4, (rk + 1) * per));
			cl.sync();	// every rank's share written (release / acquire)
			for (int i = threadIdx.x; i < nr * q4; i += PROJ_THREADS) {
				const int o = i % q4 / per, at = i / q4 * as + i % q4 * 4;

				if (o != rk)
					*(float4 *)(sa + at) =
						*(const float4 *)(cl.map_shared_rank(sa, o) + at);
			}
			// every rank done reading the others' tiles (red below reuses them,
			// and a block's shared memory goes when it exits)
			cl.sync();
		} else {
			stage_merged<false>(sa, as, parts, n_rows, H, h, r0, nr, L, live, wts,
					    (int *)(wts + am * parts.n_splits), 0, as / 4);
		}
	} else {
		stage_a(sa, as, o_lat + ((size_t)r0 * H + h) * L, (size_t)H * L, nr, L,
			L % 4 == 0 && (uintptr_t)o_lat % 16 == 0);
		cp_async_commit();
	}
	cp_async_wait<0>();
	__syncthreads();
#pragma unroll 2
	for (int ks = warp; ks < nks; ks += PROJ_WARPS) {
		uint32_t b[NT][2];

#pragma unroll
		for (int nt = 0; nt < NT; nt++) {
			const uint16_t *bp = sw + (nt * 8 + g) * ls + ks * 16 + 2 * t;

			b[nt][0] = *(const uint32_t *)bp;
			b[nt][1] = *(const uint32_t *)(bp + 8);
		}
#pragma unroll
		for (int mt = 0; mt < MT; mt++) {
			uint32_t hi[4], lo[4];

			if (mt >= nmt)
				break;
			load_a(hi, lo, sa, as, mt * 16, ks * 16, nr);
#pragma unroll
			for (int nt = 0; nt < NT; nt++) {
				mma_bf16(acc[mt][nt], hi, b[nt][0], b[nt][1]);
				mma_bf16(acc[mt][nt], lo, b[nt][0], b[nt][1]);
			}
		}
	}
	__syncthreads();	// every warp is done with the tiles: red takes their place
#pragma unroll
	for (int mt = 0; mt < MT; mt++) {
		if (mt >= nmt)
			break;
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int half = 0; half < 2; half++) {
				float *rp = red + (warp * MR + mt * 16 + g + half * 8) * NJ + nt * 8 + 2 * t;

				rp[0] = acc[mt][nt][half * 2];
				rp[1] = acc[mt][nt][half * 2 + 1];
			}
	}
	__syncthreads();
	for (int i = threadIdx.x; i < nr * NJ; i += PROJ_THREADS) {
		const int rr = i / NJ, jj = i % NJ;
		float x = 0.0f;

		if (jj >= nj)
			continue;
#pragma unroll
		for (int wp = 0; wp < PROJ_WARPS; wp++)
			x += red[(wp * MR + rr) * NJ + jj];
		out[((size_t)(r0 + rr) * H + h) * vdim + j0 + jj] = x;
	}
}

}	// namespace

// ---- launchers --------------------------------------------------------------

static int exp_smem_optin;	// set by mla_expand_prepare: the most a block may ask for

int mla_expand_prepare(int smem_optin)
{
	exp_smem_optin = smem_optin;
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, 1, false>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<2, 2, false>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	if (attn_mla_carveout(mla_expand_mma_kernel<1, 1, false>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<2, 2, false>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>))
		return -EIO;
	return 0;
}

static size_t expand_smem(int R, int L, int mr, int nj, int n_splits)
{
	const size_t k16 = (size_t)(L + 15) / 16 * 16, am = (size_t)proj_a_rows(R, mr);
	const size_t tiles = am * (k16 + 8) * 4 + (size_t)nj * (k16 + PROJ_PAD) * 2 +
			     (n_splits > 1 ? am * ((size_t)n_splits * 8 + 4) : 0);
	const size_t red = sizeof(float) * PROJ_WARPS * mr * nj;

	return tiles > red ? tiles : red;
}

// k_cuda_tuning()->mla_fold_rows (KDEC_MLA_FOLD_ROWS=n): the expand merges the
// attention's splits itself up to n rows (default 0: never, the merge kernel runs).
// Each of a head's expand blocks merges the head's partials again (bytes ~ rows x live
// splits x L x 4 per block), which a row or two repay by the launch and round trip
// they spare.
// Read at each call (a host lookup per layer): the tests run both paths.
static int fold_rows_env(void)
{
	return k_cuda_tuning()->mla_fold_rows;
}

// mla_fold_cluster 0 (KDEC_MLA_FOLD_CLUSTER=0): every merging expand block merges its
// head's partials itself (no cluster). Read at each call: the tests run both.
static bool fold_cluster_env(void)
{
	return k_cuda_tuning()->mla_fold_cluster != 0;
}

// Blocks of a cluster sharing a head's merge: the most (up to EXP_FOLD_CLUSTER, a
// power of 2: the portable cluster sizes) that divides the head's blocks; 1: none.
static int fold_cluster(int blocks_x)
{
	int c = EXP_FOLD_CLUSTER;

	if (!fold_cluster_env())
		return 1;
	while (c > 1 && blocks_x % c)
		c /= 2;
	return c;
}

int mla_expand_folds(int R, const k_mla_dims *d, int n_splits)
{
	return proj_mma_env() && R <= fold_rows_env() && R <= EXP_MMA_SMALL_ROWS &&
	       d->kv_lora % 4 == 0 && n_splits <= ATTN_MAX_SPLITS &&
	       (size_t)n_splits * R * d->n_heads * d->kv_lora <= 0x7fffffffu &&
	       expand_smem(R, d->kv_lora, 16, EXP_FOLD_NJ, n_splits) <= (size_t)exp_smem_optin;
}

int mla_expand_mma(cudaStream_t s, float *out, const float *o_lat, const float *part_o,
		   const float *part_lse, int n_splits, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec)
{
	const int small = R <= EXP_MMA_SMALL_ROWS, mr = small ? 16 : 32, nj = small ? 8 : 16;
	const proj_parts parts = { part_o, part_lse, n_splits };
	const proj_parts none = { nullptr, nullptr, 1 };

	if (n_splits > 1) {	// the caller checked mla_expand_folds
		const dim3 grid(attn_cdiv(d->v_dim, EXP_FOLD_NJ), d->n_heads, attn_cdiv(R, 16));

		const size_t smem = expand_smem(R, d->kv_lora, 16, EXP_FOLD_NJ, n_splits);
		const int cl = fold_cluster((int)grid.x);
		auto fold = mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true>;
		auto fold_cl = mla_expand_mma_kernel<1, EXP_FOLD_NJ / 8, true, true>;

		if (!mla_expand_folds(R, d, n_splits))
			ATTN_INVAL("mla_expand_mma: %d rows of %d splits cannot be merged here", R,
				   n_splits);
		if (cl > 1) {	// a cluster of cl blocks along x shares each head's merge
			cudaLaunchConfig_t cfg = {};
			cudaLaunchAttribute attr[2] = {};

			attr[0].id = cudaLaunchAttributeClusterDimension;
			attr[0].val.clusterDim.x = cl;
			attr[0].val.clusterDim.y = 1;
			attr[0].val.clusterDim.z = 1;
			attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
			attr[1].val.programmaticStreamSerializationAllowed = 1;
			cfg.gridDim = grid;
			cfg.blockDim = dim3(PROJ_THREADS);
			cfg.dynamicSmemBytes = smem;
			cfg.stream = s;
			cfg.attrs = attr;
			cfg.numAttrs = k_cuda_pdl_enabled() ? 2 : 1;
			K_CUDA_TRY(cudaLaunchKernelEx(&cfg, fold_cl, out, o_lat, w, R, d->n_heads,
						      d->nope_dim, d->v_dim, d->kv_lora, vec, parts));
		} else {
			K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, fold, out, o_lat, w,
						     R, d->n_heads, d->nope_dim, d->v_dim, d->kv_lora,
						     vec, parts));
		}
		K_CUDA_TRY_LAUNCHED("mla_expand_mma_kernel");
		return 0;
	}

	const size_t smem = expand_smem(R, d->kv_lora, mr, nj, 1);
	const dim3 grid(attn_cdiv(d->v_dim, nj), d->n_heads, attn_cdiv(R, mr));

	if (!proj_mma_env() || smem > (size_t)exp_smem_optin)
		return 1;
	if (small)	// more blocks, each a shorter burst
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<1, 1, false>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec, none));
	else
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<2, 2, false>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec, none));
	K_CUDA_TRY_LAUNCHED("mla_expand_mma_kernel");
	return 0;
}
