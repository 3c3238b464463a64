// What attn_mla.cu shares with attn_mla_cp.cu (MLA decode context parallel): the absorb
// and expand launches of k_cuda_attn_mla and the arguments of its latent attention, so a
// rank's parts run the very kernels (and roundings) of the whole attention. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_ATTN_MLA_CUH
#define KD_KERNELS_CUDA_ATTN_MLA_CUH

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/ops.h"

// ws->q_lat (R, d->n_heads, L + rope) = [W_UK^T q_nope ; q_pe] of q (R, H, nope + rope):
// k_cuda_attn_mla's absorb (the tensor-core projection, or the CUDA-core kernel where it
// declines). 0 or -EIO.
int attn_mla_absorb(cudaStream_t s, k_cuda_attn_ws *ws, const float *q, const uint16_t *w_kv_b,
		    int R, const k_mla_dims *d);

// out (R, H, v) = W_UV o_lat from ws->o_lat (R, H, L): k_cuda_attn_mla's expand. 0 or
// -EIO.
int attn_mla_expand(cudaStream_t s, k_cuda_attn_ws *ws, float *out, const uint16_t *w_kv_b,
		    int R, const k_mla_dims *d);

// a: the latent attention of q_lat (R, d->n_heads, L + rope) over cache through ctx and
// blocks (device), out ws->o_lat, partials ws->part_o / part_lse, the split floor of the
// tuning, early off: what k_cuda_attn_mla launches (the caller may repoint out and
// the partials).
void attn_mla_tile_args(attn_tile_args *a, k_cuda_attn_ws *ws, const float *q_lat,
			const uint16_t *cache, int block_tokens, const int32_t *ctx,
			const int32_t *const *blocks, int R, const k_mla_dims *d, float qscale);

#endif
