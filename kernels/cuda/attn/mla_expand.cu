// MLA's expand projection on tensor cores, out[r, h] = W_UV[h] o_lat[r, h] (see
// mla_proj.cu).
#include <cstdlib>

#include <cuda_bf16.h>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/mla_proj.cuh"
#include "kernels/cuda/attn/mla_proj_tile.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ptx.cuh"

#define EXP_MMA_SMALL_ROWS 16	// up to here the expand blocks take 8 outputs, past it 16
/* Not here: the split merge folded into the expand, a thread-block cluster of a head's
 * blocks sharing it (KDEC_MLA_FOLD_ROWS, removed in session 35): on H200
 * (DeepSeek-V2-Lite, batch 1, step p50) 2.782 ms against 2.751 with the merge kernel
 * (docs/results/cuda-final-e3af145.txt); in the history at e164f96. */

namespace {	// kernels and their helpers stay private to this file

// Block (output chunk of NT x 8, head, row chunk of MT x 16): the block's o_lat rows
// (as wide) and the chunk's W_UV rows (NT * 8, ls) arrive in one burst, zero padded; warp w takes
// the k16 steps w, w + 4, ... for every row and output, and the four partial tiles are
// added in a fixed order through shared memory (the tiles' space, reused).
template <int MT, int NT>
__global__ void __launch_bounds__(PROJ_THREADS)
mla_expand_mma_kernel(float *__restrict__ out, const float *o_lat,
		      const uint16_t *__restrict__ w, int n_rows, int H, int nope, int vdim, int L,
		      int vec)
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
	stage_a(sa, as, o_lat + ((size_t)r0 * H + h) * L, (size_t)H * L, nr, L,
		L % 4 == 0 && (uintptr_t)o_lat % 16 == 0);
	cp_async_commit();
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
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<1, 1>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(mla_expand_mma_kernel<2, 2>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	if (attn_mla_carveout(mla_expand_mma_kernel<1, 1>) ||
	    attn_mla_carveout(mla_expand_mma_kernel<2, 2>))
		return -EIO;
	return 0;
}

static size_t expand_smem(int R, int L, int mr, int nj)
{
	const size_t k16 = (size_t)(L + 15) / 16 * 16, am = (size_t)proj_a_rows(R, mr);
	const size_t tiles = am * (k16 + 8) * 4 + (size_t)nj * (k16 + PROJ_PAD) * 2;
	const size_t red = sizeof(float) * PROJ_WARPS * mr * nj;

	return tiles > red ? tiles : red;
}

int mla_expand_mma(cudaStream_t s, float *out, const float *o_lat, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec)
{
	const int small = R <= EXP_MMA_SMALL_ROWS, mr = small ? 16 : 32, nj = small ? 8 : 16;
	const size_t smem = expand_smem(R, d->kv_lora, mr, nj);
	const dim3 grid(attn_cdiv(d->v_dim, nj), d->n_heads, attn_cdiv(R, mr));

	if (!proj_mma_env() || smem > (size_t)exp_smem_optin)
		return 1;
	if (small)	// more blocks, each a shorter burst
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<1, 1>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec));
	else
		K_CUDA_TRY(k_cuda_launch_pdl(s, grid, PROJ_THREADS, smem, mla_expand_mma_kernel<2, 2>,
					     out, o_lat, w, R, d->n_heads, d->nope_dim, d->v_dim,
					     d->kv_lora, vec));
	K_CUDA_TRY_LAUNCHED("mla_expand_mma_kernel");
	return 0;
}
