// The tensor-core absorb and expand projections of MLA (mla_proj.cu, mla_expand.cu), for
// attn_mla.cu. CUDA C++ only. Shapes as k_cuda_attn_mla: q (R, H, nope + rope), q_lat
// (R, H, L + rope), o_lat (R, H, L), out (R, H, v), w the kv_b weight (H * (nope + v), L)
// bf16.
#ifndef KD_KERNELS_CUDA_MLA_PROJ_CUH
#define KD_KERNELS_CUDA_MLA_PROJ_CUH

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/ops.h"

// Sets the kernels' shared-memory opt-in; once per device, before any launch. 0 or -EIO.
int mla_proj_prepare(int smem_optin);

// 0: launched; 1: declined (k_cuda_tuning()->mla_proj_mma 0, or the tiles exceed shared
// memory): the caller runs its own kernels; -EIO: the launch failed. vec: L % 8 == 0 and
// w 16-byte aligned. Launch configuration from the host arguments only (graph-safe).
int mla_absorb_mma(cudaStream_t s, float *q_lat, const float *q, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec);
// mla_absorb_mma with mla_post's work (p, k_cuda_mla_post) in the same launch, for
// 1..8 rows: q read unrotated from p's source rows (q_src_pe, or q_pe in place; never
// written), its rope part rotated straight into q_lat, and a block a row for the
// latent's norm, the key's rotation and the cache append, all bit for bit as
// mla_post then mla_absorb_mma. 0: launched; 1: declined (the caller runs the two);
// -EIO. The attention after it must copy this step's cache rows after its PDL wait.
int mla_absorb_post_mma(cudaStream_t s, float *q_lat, const k_cuda_mla_post_args *p,
			const uint16_t *w, int R, const k_mla_dims *d, int vec);
// expand: out (R, H, v) from o_lat (R, H, L).
int mla_expand_mma(cudaStream_t s, float *out, const float *o_lat, const uint16_t *w, int R,
		   const k_mla_dims *d, int vec);

#endif
