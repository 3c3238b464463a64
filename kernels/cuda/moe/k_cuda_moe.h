/* Mixture of experts on the GPU: the router (k_cpu_moe_route's choices, bit for bit)
 * and the routed experts' SwiGLU MLPs grouped by expert across the batch.
 * Pointers are device memory unless said; launchers return 0, -EINVAL or -EIO (logged),
 * never allocate or synchronise, and can be captured into a CUDA graph. */
#ifndef KD_KERNELS_CUDA_K_CUDA_MOE_H
#define KD_KERNELS_CUDA_K_CUDA_MOE_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Router logits (M, n_experts) -> ids (M, top_k), weights (M, top_k), with the
 * semantics of k_cpu_moe_route: softmax or sigmoid, bias for the choice only,
 * greedy / GROUP_MAX / GROUP_TOP2, renormalise, routed scaling, ties to the lower id.
 * p is a host struct whose bias is a DEVICE pointer (or NULL). The scores use a port
 * of glibc's expf and the CPU's order of every sum, so ids and weights equal the CPU's
 * exactly. Limits: n_experts <= 4096, top_k <= 64 and <= n_experts, n_group <= 256. */
int k_cuda_moe_route(cudaStream_t s, const struct k_moe_route_params *p,
		     const float *logits /* (M, n_experts) */, int M,
		     int32_t *ids /* (M, top_k) */, float *weights /* (M, top_k) */);

struct k_cuda_moe_ws;

/* Scratch of k_cuda_moe_experts for up to max_M rows of one model's shapes: the
 * routing plan, x split into bf16 hi/lo parts, the SwiGLU activations, per-slot
 * outputs, and the shared expert's activations (shared_inter wide; 0: the model has
 * none). Owned by the caller: k_cuda_moe_ws_destroy (accepts NULL). Allocates on the
 * current device; 0, -EINVAL or -ENOMEM. hidden and inter: multiples of 8 for the
 * tensor-core path; other sizes take a slow CUDA-core path. */
int k_cuda_moe_ws_create(struct k_cuda_moe_ws **out, int max_M, int top_k, int n_experts,
			 int hidden, int inter, int shared_inter);
void k_cuda_moe_ws_destroy(struct k_cuda_moe_ws *ws);

/* out[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), out overwritten; expert(x)
 * = down(silu(gate x) * up x). expert_w is a device array of n_experts * 3 device
 * pointers (gate, up, down) to bf16 matrices, each 16-byte aligned: gate and up
 * (inter, hidden), down (hidden, inter). Each used expert's weights are read once for
 * all its rows. Two paths, picked by M * top_k unless k_cuda_tuning()->moe_path forces
 * one (read at each call, like the other moe_* fields; a graph keeps those of its capture):
 * - small (M * top_k <= 64, hidden and inter multiples of 8, x 16-byte aligned): two
 *   launches; bf16 weights times fp32 x and fp32 activations, fp32 accumulation;
 * - grouped (larger M): the (row, slot) pairs are grouped by expert on the device (a
 *   counting sort); x and the activations enter the tensor cores as bf16 hi + lo pairs
 *   (about 16 bits of mantissa), fp32 accumulation.
 * Either is within ~1e-5 relative of k_cpu_moe_experts. Each row's slots are summed in
 * increasing expert id like the CPU, so the result is deterministic and independent of
 * the other rows of the same path (the two paths differ in the last bits).
 * M <= the workspace's max_M; top_k, n_experts, hidden, inter as at creation.
 * An id outside [0, n_experts) contributes nothing. */
int k_cuda_moe_experts(cudaStream_t s, struct k_cuda_moe_ws *ws, float *out /* (M, hidden) */,
		       const float *x /* (M, hidden) */, int M, const int32_t *ids /* (M, top_k) */,
		       const float *weights /* (M, top_k) */, int top_k,
		       const uint16_t *const *expert_w /* (n_experts, 3) */, int n_experts,
		       int hidden, int inter);

/* Routed experts kept quantized as published (kernels/quant.h's layouts): the expert
 * table's pointers are then each matrix's payload (fp8 bytes (N, K), or int4 words
 * (N, ceil(K / 8))), and scales a device table (n_experts, 3) of their scales (gate,
 * up, down: (ceil(N / block_rows), ceil(K / block_cols)) in scale_dtype, K_F32 or
 * K_BF16). Index j of the blocks: 0 gate, 1 up, 2 down. Where hidden and inter are
 * multiples of 32, the payloads 16-byte aligned and every block a power of two (at
 * least 32 columns) or the whole dimension, the vector kernels take them (each 16-byte
 * chunk's partial dot product scaled once); other shapes take the CUDA-core kernels of
 * the grouped path, element by element (value * scale, as the CPU). NULL or fmt
 * K_Q_NONE: bf16 experts. */
struct k_cuda_moe_quant {
	enum k_qfmt fmt;		/* K_Q_FP8 or K_Q_INT4 */
	enum k_dtype scale_dtype;	/* K_F32 or K_BF16 */
	int block_rows[3], block_cols[3];
	const void *const *scales;	/* (n_experts, 3) device pointers */
};

/* 0 where the kernels take q (NULL / K_Q_NONE included): fp8 or int4, fp32 or bf16
 * scales, a scale table, positive blocks; else -EINVAL. */
int k_cuda_moe_quant_ok(const struct k_cuda_moe_quant *q, int hidden, int inter);

/* k_cuda_moe_experts with the experts quantized as q says (NULL: bf16, the same call).
 * At up to k_cuda_tuning()->moe_qgemv_rows rows (8) the small path's calls take
 * moe_qgemv.cu's two GEMVs over the chosen experts' union instead (tensor cores, x
 * and the activations in f16: ~3e-4 relative, see k_cuda_moe_qgemv_takes); int4
 * experts only up to moe_qgemv_int4_rows (KDEC_MOE_QGEMV_INT4_ROWS, 2), fp8 experts of
 * hidden >= moe_qgemv_fp8_hidden (4096) up to moe_qgemv_fp8_rows (KDEC_MOE_QGEMV_FP8_ROWS,
 * 2), and past that the grouped path's tile kernels where they take the call.
 * Both paths read the quantized bytes: the small one dequantizes each weight chunk in
 * registers (W8A16 / W4A16 on the CUDA cores), the grouped one each tensor-core B
 * fragment (the fp8 or int4 values are exact in bf16; the scale multiplies each
 * 32-wide k chunk's fp32 partial sums; with k_cuda_moe_qtile_takes, the tile kernels'
 * A fragments, the scale each slab's or group's sums), so no bf16 copy of an expert is
 * ever made.
 * Shapes outside the vector kernels (see struct k_cuda_moe_quant) take the grouped
 * path's CUDA-core kernels at any M.
 * Within ~1e-5 relative of k_cpu_moe_experts on the same quantized experts (the union
 * GEMVs: ~3e-4). */
int k_cuda_moe_experts_q(cudaStream_t s, struct k_cuda_moe_ws *ws, float *out, const float *x,
			 int M, const int32_t *ids, const float *weights, int top_k,
			 const uint16_t *const *expert_w, const struct k_cuda_moe_quant *q,
			 int n_experts, int hidden, int inter);

/* 1 where a grouped-path call of M rows with experts quantized as q (NULL: bf16) takes
 * the tile kernels of moe_qtile.cu (M up to k_cuda_tuning()->moe_qtile_rows,
 * KDEC_MOE_QTILE_ROWS, or from moe_qtile_wide's, KDEC_MOE_QTILE_WIDE, to 4096; bf16 only
 * with moe_qtile_bf16; and the shapes: hidden and inter multiples of 32 for bf16, 64 for
 * fp8 with scale blocks of >= 64 columns, 128 for int4 in groups of 32; scale tensors
 * 16-byte aligned), else 0 (the grouped path's expert_mma_kernel). For tests and
 * benchmarks that name the kernel. */
int k_cuda_moe_qtile_takes(const struct k_cuda_moe_quant *q, int hidden, int inter, int M);

/* 1 where such a call takes the tile kernels' wide passes (64 expert rows, int4 32, in
 * place of 16): M >= k_cuda_tuning()->moe_qtile_wide (KDEC_MOE_QTILE_WIDE), else 0. */
int k_cuda_moe_qtile_wide(int M);

/* 1 where a call of M rows on ws's shapes with experts quantized as q (fp8 or int4) on
 * the small path takes moe_qgemv.cu's GEMVs over the union of the chosen experts (M <=
 * k_cuda_tuning()->moe_qgemv_rows, KDEC_MOE_QGEMV_ROWS, also <= the format's
 * moe_qgemv_int4_rows or (hidden >= moe_qgemv_fp8_hidden) moe_qgemv_fp8_rows; M <= 8,
 * M * top_k <= 64, hidden a multiple of 32, inter of 64, scale columns of whole 128
 * (fp8) or 32 (int4) k, the workspace sized for its split; x and the activations
 * rounded to f16: ~1e-3 relative), else 0. For tests and benchmarks that name the kernels. */
int k_cuda_moe_qgemv_takes(const struct k_cuda_moe_ws *ws, const struct k_cuda_moe_quant *q,
			   int M);

/* The shared expert of a DeepSeek MoE layer: one SwiGLU MLP that every row takes with
 * weight 1 (routed_scaling_factor does not touch it). bf16, each 16-byte aligned. */
struct k_cuda_moe_shared {
	const uint16_t *gate;	/* (inter, hidden) */
	const uint16_t *up;	/* (inter, hidden) */
	const uint16_t *down;	/* (hidden, inter) */
	int inter;		/* n_shared_experts * moe_intermediate_size */
};

/* y (M, hidden) += k_cuda_moe_experts's sum + sh's MLP of x (sh NULL: none), summed as
 * the separate ops would: y + (routed + shared). Where the small path runs this call
 * (see k_cuda_moe_experts) and k_cuda_tuning()->moe_fused is on, its two launches do all of
 * it: the shared expert's rows stream beside the routed ones as one more slot and the
 * down kernel adds into y; y is read and written there, nowhere else. Elsewhere it
 * launches nothing and returns 1: the caller runs the separate ops (k_cuda_moe_experts,
 * the dense MLP, the add). sh->inter <= the workspace's shared_inter and a multiple of
 * 8, at most 4 * inter. 0, 1, -EINVAL or -EIO. */
int k_cuda_moe_experts_add(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y /* (M, hidden) */,
			   const float *x /* (M, hidden) */, int M,
			   const int32_t *ids /* (M, top_k) */, const float *weights /* (M, top_k) */,
			   int top_k, const uint16_t *const *expert_w /* (n_experts, 3) */,
			   int n_experts, int hidden, int inter, const struct k_cuda_moe_shared *sh);

/* k_cuda_moe_experts_add with the routed experts quantized as q says (NULL: bf16, the
 * same call). With quantized experts the fused small path runs only without a shared
 * expert (sh NULL) and at shapes the vector kernels take; otherwise it returns 1 and the
 * caller runs the separate ops (the shared expert's bf16 rows and the experts' quantized
 * ones are different streams). */
int k_cuda_moe_experts_add_q(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y,
			     const float *x, int M, const int32_t *ids, const float *weights,
			     int top_k, const uint16_t *const *expert_w,
			     const struct k_cuda_moe_quant *q, int n_experts, int hidden, int inter,
			     const struct k_cuda_moe_shared *sh);

/* ---- the latency path's MoE layer (moe_lat.cu; issue 23) ---- */

#define K_CUDA_MOE_LAT_MAX_ROWS 8

/* How k_cuda_moe_lat runs a call of these shapes. Launch 1 (router + routing + gate/up)
 * is a grid with a barrier inside, so it is sized to be resident as a whole. */
struct k_cuda_moe_lat_cfg {
	int threads;		/* per CTA of launch 1 (and of launch 2, the small down kernel) */
	int ctas_per_sm;	/* launch 1's resident CTAs per SM at smem (the grid's bound) */
	int max_rows;		/* K_CUDA_MOE_LAT_MAX_ROWS */
	int rp;			/* x rows staged in shared memory per pass */
	size_t smem;		/* launch 1's dynamic shared memory: routing scratch / x rows */
	int reserved;
};

/* 0: k_cuda_moe_lat takes these shapes (cfg filled); 1: it does not, with the reason
 * in why (one line with the numbers); -EIO. q (NULL: bf16): quantized experts are
 * refused (1): its fused launch reads bf16 experts only; the standard ops run them. n_group: the group count of a group-limited
 * choice, else 0. Not a stream operation. */
int k_cuda_moe_lat_config(struct k_cuda_moe_lat_cfg *cfg, int M, int top_k, int n_experts,
			  int hidden, int inter, int n_group, const struct k_cuda_moe_shared *sh,
			  const struct k_cuda_moe_quant *q, const float *x, char *why,
			  size_t why_len);

/* y (M, hidden) += the MoE layer of x (M, hidden): router (n_experts, hidden) bf16 with
 * x in fp32, the choice of k_cuda_moe_route by p (bias a DEVICE pointer), the routed
 * experts and the shared expert sh (NULL: none) as k_cuda_moe_experts_add sums them.
 * logits (M, n_experts), ids and weights (M, p->top_k) are written on the way (the
 * standard path's values bit for bit). Two launches; M <= K_CUDA_MOE_LAT_MAX_ROWS and
 * the small path's shapes (k_cuda_moe_lat_config): 1 where not, nothing launched.
 * At M = 1 (with k_cuda_tuning()->moe_m1) gate/up takes moe_small_m1.cu's pipelined
 * units. 0, 1, -EINVAL or -EIO. */
int k_cuda_moe_lat(cudaStream_t s, struct k_cuda_moe_ws *ws, float *y, const float *x, int M,
		   const uint16_t *router, const struct k_moe_route_params *p, float *logits,
		   int32_t *ids, float *weights, const uint16_t *const *expert_w,
		   const struct k_cuda_moe_quant *q, int n_experts, int hidden, int inter,
		   const struct k_cuda_moe_shared *sh);

#ifdef __cplusplus
}
#endif

#endif
