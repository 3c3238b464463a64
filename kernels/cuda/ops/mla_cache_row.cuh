// The cache row of an MLA step's token, as mla_post writes it (mla_post.cu) and the
// absorb launch's post blocks write it too (mla_proj.cu; the default at batch <= 8,
// k_cuda_tuning()->mla_post_in_absorb 0 returns mla_post's launch).
#ifndef KD_KERNELS_CUDA_MLA_CACHE_ROW_CUH
#define KD_KERNELS_CUDA_MLA_CACHE_ROW_CUH

#include <cstdint>

#include "kernels/cuda/device_util.cuh"

// [latent ; key] rounded to bf16 into dst (L + pe_dim): the latent, lat[k] the value
// threadIdx.x + k * T (zero past L), times rs (its RMS, as rmsnorm.cu's row_rs) and
// norm; the key's first 2 * half values rotated pair by pair (pairs step apart, partners
// gap apart) by the table c, sn (half each), the rest of pe_dim copied. The block's T
// threads together.
template <int T, int PER>
__device__ __forceinline__ void mla_cache_row(uint16_t *dst, const float (&lat)[PER],
					      const float *norm, float rs, const float *kv,
					      const float *c, const float *sn, int L, int half,
					      int step, int gap, int pe_dim)
{
#pragma unroll
	for (int k = 0; k < PER; k++) {
		const int i = threadIdx.x + k * T;

		if (i < L)
			dst[i] = k_cuda_bf16_rn(__fmul_rn(norm[i], __fmul_rn(lat[k], rs)));
	}
	for (int i = threadIdx.x; i < half; i += T) {	// each key pair once
		float o1, o2;

		k_cuda_rope_rotate(kv[L + i * step], kv[L + i * step + gap], c[i], sn[i], o1, o2);
		dst[L + i * step] = k_cuda_bf16_rn(o1);
		dst[L + i * step + gap] = k_cuda_bf16_rn(o2);
	}
	for (int i = 2 * half + threadIdx.x; i < pe_dim; i += T)	// unrotated tail
		dst[L + i] = k_cuda_bf16_rn(kv[L + i]);
}

#endif
