// What the tensor-core decode attention's two halves share: attn_mma.cu (the kernels and
// the table of their compiled shapes) and attn_mma_launch.cu (the host side: which
// shape, how many splits, the launch). CUDA C++ only.
#ifndef KD_KERNELS_CUDA_ATTN_MMA_CUH
#define KD_KERNELS_CUDA_ATTN_MMA_CUH

#include <cstdint>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define MMA_Q 16		// query vectors per block: the m of m16n8k16
#define MMA_MIN_SPLIT_TOKENS 32
// GQA's split merge folded into the last split (attn_mma.cu): at most this many splits,
// the lists and partials a thread holds.
#define MMA_FOLD_MAX_SPLITS 8

// One compiled shape: its kernel, dynamic shared memory and blocks per SM.
struct mma_shape {
	int dk, dv, tk;
	bool vsep, qreg, post;
	int threads;
	void (*kernel)(const attn_tile_args, int, uint16_t *, const k_cuda_qkv_args);
	unsigned smem;
	int per_sm;		// resident blocks per SM (from the occupancy query), 0 unusable
};

// The compiled shapes (attn_mma.cu), in the order mma_find tries them; per_sm is
// written by attn_mma_prepare at every workspace's creation.
extern mma_shape attn_mma_shapes[];
extern const int attn_mma_n_shapes;

#endif
