/* Sampling on the GPU by the procedure of kernels/k_sample.h (the reference is
 * k_cpu_sample): greedy, temperature, top-k, top-p, u = k_sample_uniform(seed, step).
 * Penalties, min-p and logprobs are not here: rows with k_sample_host_only set are
 * drawn again on the host (engine_step_sample_ext). Only the token ids need to come
 * back to the host. Pointers are device memory unless
 * said; 0, -EINVAL or -EIO (logged); no allocation or synchronisation in
 * k_cuda_sample, so it can be captured into a CUDA graph. */
#ifndef KD_KERNELS_CUDA_K_CUDA_SAMPLE_H
#define KD_KERNELS_CUDA_K_CUDA_SAMPLE_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/k_sample.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What k_cuda_sample needs prepared on the current device: its kernel's shared-memory
 * limit and two slots per row for max_M rows, in which the blocks of a greedy row
 * split over several combine their maxima (calls of more rows take a block per row).
 * vocab: the largest vocabulary to sample from (<= 2^23). Owned by the caller:
 * k_cuda_sample_ws_destroy (accepts NULL). 0, -EINVAL, -ENOMEM or -EIO. Calls that
 * share a ws must not run concurrently. */
struct k_cuda_sample_ws;

int k_cuda_sample_ws_create(struct k_cuda_sample_ws **out, int max_M, int vocab);
void k_cuda_sample_ws_destroy(struct k_cuda_sample_ws *ws);

/* ids[m] = the token drawn from logits row m by params[m] at output index steps[m].
 * Greedy (temperature <= 0): the highest logit, ties to the lower id, NaN never wins.
 * Otherwise candidates are ranked by logit (ties: lower id, NaN excluded) and the
 * probabilities exp(l / T - max) are summed in 2^-40 fixed point, exactly and in any
 * order; the CPU sums in fp32, so the two can differ only where u or top_p falls within
 * fp32 rounding of a boundary. Deterministic: the same inputs give the same ids.
 * One block per row; a greedy row takes several where the rows leave SMs idle. */
int k_cuda_sample(cudaStream_t s, struct k_cuda_sample_ws *ws, int32_t *ids /* (M) */,
		  const float *logits /* (M, vocab) */, int M, int vocab,
		  const struct k_sample_params *params /* (M) */, const uint64_t *steps /* (M) */);

#ifdef __cplusplus
}
#endif

#endif
