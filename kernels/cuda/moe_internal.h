// Between the MoE launcher (moe_experts.cu) and its small-batch path (moe_small.cu):
// CUDA C++ only, not part of the C interface (k_cuda_moe.h).
#ifndef KD_KERNELS_CUDA_MOE_INTERNAL_H
#define KD_KERNELS_CUDA_MOE_INTERNAL_H

#include <cstdint>

#include <cuda_runtime.h>

#define MOE_SMALL_MAX_PAIRS 64	// (row, slot) pairs a small-batch call may have

// Whether the small-batch path can run this call: M * top_k <= MOE_SMALL_MAX_PAIRS,
// hidden and inter multiples of 8 (16-byte weight loads), one fp32 x row fits the
// shared-memory budget, x 16-byte aligned.
bool k_cuda_moe_small_fits(int M, int top_k, int hidden, int inter, const float *x);

// Once per process before the first launch (not a stream operation, so never inside
// a capture): lets the gate/up kernel use its shared-memory budget. 0 or -EIO.
int k_cuda_moe_small_setup(void);

// out (M, hidden) = the routed experts' sum, overwritten; act (M * top_k, inter) fp32
// scratch (16-byte aligned) for the SwiGLU activations. n_sm: the device's SM count,
// sizes the grids. Two launches, both with programmatic dependent launch.
int k_cuda_moe_small_run(cudaStream_t s, float *act, float *out, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const uint16_t *const *expert_w, int n_experts, int hidden, int inter,
			 int n_sm);

#endif
