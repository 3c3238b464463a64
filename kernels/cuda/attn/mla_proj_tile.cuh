// What MLA's two tensor-core projections share (mla_proj.cu: absorb, mla_expand.cu:
// expand): the block shape, the fp32 activations' split into bf16 hi + lo, their staging.
// CUDA C++, included by those two files only.
#ifndef KD_KERNELS_CUDA_MLA_PROJ_TILE_CUH
#define KD_KERNELS_CUDA_MLA_PROJ_TILE_CUH

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/ptx.cuh"

#define PROJ_THREADS 128
#define PROJ_WARPS (PROJ_THREADS / 32)
#define PROJ_PAD 8		// bf16 per smem row past the data: rows fall on other banks

namespace {	// a copy in each of the two files, as when they were one

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
					 uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x = hi + lo + O(2^-16 x): hi is x rounded to bf16, lo the rest rounded to bf16.
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
	const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
	const float2 hf = __bfloat1622float2(h);
	const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);

	hi = *(const uint32_t *)&h;
	lo = *(const uint32_t *)&l;
}

// The A fragments (hi and lo) of rows m0 + g and m0 + g + 8, columns k0 + 2t (+1, +8,
// +9) of an fp32 tile in shared memory with row stride as and nr rows, zero past them
// (as % 32 == 8: the eight rows of a fragment fall on distinct banks).
__device__ __forceinline__ void load_a(uint32_t (&hi)[4], uint32_t (&lo)[4], const float *sa,
				       int as, int m0, int k0, int nr)
{
	const int g = threadIdx.x % 32 / 4, k = k0 + 2 * (threadIdx.x % 4);
	const int ra = m0 + g, rb = ra + 8;
	const float *pa = sa + ra * as + k, *pb = sa + rb * as + k;
	const float2 z = make_float2(0.0f, 0.0f);
	const float2 a0 = ra < nr ? *(const float2 *)pa : z, a1 = rb < nr ? *(const float2 *)pb : z;
	const float2 a2 = ra < nr ? *(const float2 *)(pa + 8) : z;
	const float2 a3 = rb < nr ? *(const float2 *)(pb + 8) : z;

	split_pair(a0.x, a0.y, hi[0], lo[0]);
	split_pair(a1.x, a1.y, hi[1], lo[1]);
	split_pair(a2.x, a2.y, hi[2], lo[2]);
	split_pair(a3.x, a3.y, hi[3], lo[3]);
}

// Rows 0 .. nr - 1 of an fp32 activation tile into shared memory (nr, as): row r from
// x + r * rs, its first n values, zero past n. vec: n, rs and x allow 16-byte copies.
__device__ __forceinline__ void stage_a(float *sa, int as, const float *x, size_t rs, int nr,
					int n, bool vec)
{
	if (vec) {
		for (int i = threadIdx.x; i < nr * (as / 4); i += PROJ_THREADS) {
			const int r = i / (as / 4), c = i % (as / 4) * 4;
			const bool ok = c < n;

			cp_async16(sa + r * as + c, ok ? x + (size_t)r * rs + c : x, ok);
		}
		return;
	}
	for (int i = threadIdx.x; i < nr * as; i += PROJ_THREADS) {
		const int r = i / as, c = i % as;

		sa[i] = c < n ? x[(size_t)r * rs + c] : 0.0f;
	}
}

// Rows of an activation tile in shared memory: the row chunk mr, or all rows when fewer
// (a small tile lets more blocks share a multiprocessor).
__host__ __device__ __forceinline__ int proj_a_rows(int n_rows, int mr)
{
	return n_rows < mr ? n_rows : mr;
}

// k_cuda_tuning()->mla_proj_mma 0 (KDEC_CUDA_MLA_PROJ=0): the CUDA-core kernels of
// attn_mla.cu instead (A/B timing).
inline int proj_mma_env(void)
{
	return k_cuda_tuning()->mla_proj_mma != 0;
}

}	// namespace

// mla_expand.cu's share of mla_proj_prepare: its kernels' shared-memory opt-in (and
// carveout). 0 or -EIO.
int mla_expand_prepare(int smem_optin);

#endif
