/* Linear layers on quantized weights (W8A16 fp8, W4A16 int4; kernels/quant.h's
 * layouts as published): y = x @ w^T with the quantized bytes streamed from device
 * memory and dequantized in registers, fp32 x and accumulation. The decode GEMV of
 * issue 24, tested against k_cpu_linear_q; the backend does not call it yet (it still
 * dequantizes to bf16 at load). */
#ifndef KD_KERNELS_CUDA_K_CUDA_LINEAR_Q_H
#define KD_KERNELS_CUDA_K_CUDA_LINEAR_Q_H

#include <cuda_runtime_api.h>

#include "kernels/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y (M, N) fp32 = x (M, K) fp32 @ w^T (y += with accumulate), w (N, K) quantized as q
 * says with q->scale fp32 in device memory (q->scale_dtype K_F32). One warp per
 * weight row: 16-byte loads of fp8 (16 values) or int4 (32 values) where K, the block
 * and the group allow (K % 32 == 0, block_cols and group multiples of 32 or the whole
 * row), else element by element. Queued on stream; 0 or -EINVAL (sizes, NULL, scale
 * not fp32) or -EIO (a launch failed; logged). */
int k_cuda_linear_q(cudaStream_t stream, float *y, const float *x, const void *w,
		    const struct k_quant *q, int M, int N, int K, int accumulate);

/* Whether k_cuda_linear_q takes the vectorised path for this weight (tests force
 * both paths through shapes). */
int k_cuda_linear_q_vector(const struct k_quant *q, int K);

#ifdef __cplusplus
}
#endif

#endif
