/* Linear layers on quantized weights (W8A16 fp8, W4A16 int4; kernels/quant.h's
 * layouts as published): y = x @ w^T with the quantized bytes streamed from device
 * memory and dequantized in registers, fp32 accumulation; larger M through a bf16
 * copy of the weight and the bf16 GEMMs. Tested against k_cpu_linear_q. */
#ifndef KD_KERNELS_CUDA_K_CUDA_LINEAR_Q_H
#define KD_KERNELS_CUDA_K_CUDA_LINEAR_Q_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y (M, N) fp32 = x (M, K) fp32 @ w^T (y += with accumulate), w (N, K) quantized as q
 * says with q->scale in device memory (q->scale_dtype K_F32 or K_F16). One warp per
 * weight row: 16-byte loads of fp8 (16 values) or int4 (32 values) where K, the block
 * and the group allow (K % 32 == 0, block_cols and group multiples of 32 or the whole
 * row), else element by element. Queued on stream; 0 or -EINVAL (sizes, NULL, scale
 * not fp32 or f16) or -EIO (a launch failed; logged). */
int k_cuda_linear_q(cudaStream_t stream, float *y, const float *x, const void *w,
		    const struct k_quant *q, int M, int N, int K, int accumulate);

/* Whether k_cuda_linear_q takes the vectorised path for this weight (tests force
 * both paths through shapes). */
int k_cuda_linear_q_vector(const struct k_quant *q, int K);

/* Rows of x the register-load tensor-core GEMV (MMA) takes in one launch (one n8 tile). */
#define K_CUDA_LINEAR_Q_MMA_MAX_M 8
/* Up to this many rows MMA takes them in launches of 8, reading the weights once each:
 * ceil(M / 8) bytes a weight byte, against the DEQUANT kind's ~5 (payload read, f16
 * written and read again: fp8) — fewer up to 32 rows. */
#define K_CUDA_LINEAR_Q_PASS_MAX_M 32
/* Rows of x the streaming form (STREAM) takes in one launch, reading the weights once:
 * up to 8 n8 tiles, each weight fragment dequantized once for all of them. */
#define K_CUDA_LINEAR_Q_STREAM_MAX_M 64
/* Above 8 rows, k_cuda_linear_q_choose takes STREAM only where it splits K over at most
 * this many CTAs (a cluster): its DSMEM reduction of M x 128 partials a CTA costs more
 * than the f16 copy beyond that. Measured on H200 at M = 64 (bench_cuda_linear_q,
 * fp8 and int4, 13 shapes): STREAM faster at S = 1, 2 (Llama q/k/v 35.0 against 38.6 us,
 * gate_up 134 against 167), DEQUANT at S = 3..8 (Llama o_proj 26.3 against 37.2, down
 * 93.2 against 122): the rule picks the faster kind in all 13. */
#define K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT 2

/* At M <= 8 k_cuda_linear_q_choose takes GEMV where STREAM would split K over clusters
 * (S >= 2) whose CTAs fill at least this percent of two a multiprocessor, else STREAM.
 * Measured on H200 (bench_cuda_linear_q, 13 shapes, fp8-block and int4-g32, M 1 and 8,
 * docs/results/linear-q-50dc422.txt): GEMV faster on Llama q/k/v (240 of 264 slots: 10.4
 * against 12.8 us fp8 M 1), o_proj and down (256: 8.1 against 9.2, 20.7 against 22.2) and
 * Qwen3 q/k/v (240: 6.0 against 8.5), where a cluster that finds no room waits for a
 * second round; STREAM faster where its one wave leaves room (Llama gate/up, no split:
 * 31.2 against 37.2; Kimi-K2 o_proj, 224 CTAs: 16.4 against 25.1): the rule picks the
 * faster kind in 49 of the 52 rows (the three others within 6%). */
#define K_CUDA_LINEAR_Q_GEMV_FILL 90

/* Rows of x the tile kernel (TILE) takes in one launch. */
#define K_CUDA_LINEAR_Q_TILE_MAX_M 64
/* Up to this many rows STREAM stays where it splits K over at most
 * K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT CTAs. Measured on H200 at M = 16 (bench_cuda_linear_q,
 * fp8-block): STREAM faster on Llama q/k/v (13.1 against 14.1 us, split 2) and gate_up
 * (47.2 against 51.1, split 1), TILE on o_proj (12.2 against 16.0) and down (30.5
 * against 42.4), both split 4 by STREAM; at M = 64 TILE on all four. */
#define K_CUDA_LINEAR_Q_TILE_MIN_STREAM_M 16

/* The ways k_cuda_linear_q_run computes (k_cuda_linear_q_pick and _choose say which
 * takes a call). */
enum k_cuda_linear_q_kind {
	/* M <= 64: weights copied 128 bytes a row through a cp.async ring in shared memory
	 * into mma.sync f16 fragments (one dequantization for all M rows), x rounded to
	 * f16 in shared memory (in chunks of k at M > 8), K split over a cluster
	 * (linear_qmma.cu); fp8 scale columns of 128 k or more */
	K_CUDA_LINEAR_Q_STREAM = 0,
	/* the same with the weights loaded straight into registers, 64 bytes a row per
	 * instruction: fp8 scale columns of 64 k too */
	K_CUDA_LINEAR_Q_MMA,
	/* 8 < M <= 64 (k_cuda_linear_q_choose; any M <= 64 runs): x rounded to f16 into the
	 * context's scratch first, then 128 weight rows a CTA streamed 64 bytes a row at a
	 * time through a cp.async pipeline together with the same k of every x row, each
	 * warp's two m16 weight tiles dequantized once for all M rows, K split over CTAs
	 * whose partial tiles the last one adds in split order (linear_qtile.cu); on compute
	 * capability 9.0 with K % 64 == 0 (fp8) or % 128 (int4): the same on wgmma, 128 or
	 * 256 rows a CTA (linear_qwgmma.cu, KDEC_LINEAR_QWG) */
	K_CUDA_LINEAR_Q_TILE,
	/* the weight dequantized into an f16 scratch (N, K) (k_cuda_quant_dequant: value *
	 * scale rounded once to 11 significant bits), x rounded to f16, one cuBLAS GEMM
	 * with fp32 accumulation: prefill and large batches */
	K_CUDA_LINEAR_Q_DEQUANT,
	/* k_cuda_linear_q: fp32 x on the CUDA cores, one warp per row; any shape */
	K_CUDA_LINEAR_Q_WARP,
	/* M <= 8 (k_cuda_linear_q_choose's pick where STREAM's clusters would fill the GPU;
	 * more rows in launches of 8): STREAM's
	 * fragments in CTAs of 4 warps (64 rows), each warp's weights through its own
	 * cp.async ring 5 stages deep from before the PDL wait, K split over plain CTAs
	 * whose partials the last one adds in split order (no cluster), the split sized so
	 * every multiprocessor gets about the same bytes; int4 dequantized with one lop3 a
	 * pair (linear_qgemv.cu); fp8 scale columns of 128 k or more */
	K_CUDA_LINEAR_Q_GEMV,
	K_CUDA_LINEAR_Q_N_KINDS,
};

/* Whether the tensor-core GEMV (K_CUDA_LINEAR_Q_MMA) takes this call: M <= 8 (a launch), K % 16 == 0 (fp8) or % 32
 * (int4), x and w 16-byte aligned, scales in device memory as K_F32 or K_F16, fp8
 * scale columns a power of two >= 64 wide or the whole row, int4 groups a power of two
 * >= 32 or the whole row. int4 values are scaled in f16 before the MMA: (v - 8) * s
 * rounded once to f16, exact where s has at most 8 significant bits (|v - 8| has at most
 * 3: bf16 scales such as Kimi-K2's), the scales being f16 normals
 * (k_quant_scale_f16_exact; the backend keeps int4 off these kinds otherwise); fp8 values are
 * scaled in fp32. x is rounded to f16 (|x| > 65504 becomes inf). */
int k_cuda_linear_q_mma_supports(const struct k_quant *q, const float *x, const void *w, int M,
				 int N, int K);
/* The same for K_CUDA_LINEAR_Q_STREAM: M <= K_CUDA_LINEAR_Q_STREAM_MAX_M (a launch), fp8
 * scale columns a power of two >= 128 wide or the whole row. */
int k_cuda_linear_q_stream_supports(const struct k_quant *q, const float *x, const void *w,
				    int M, int N, int K);

/* The same for K_CUDA_LINEAR_Q_GEMV: M <= K_CUDA_LINEAR_Q_MMA_MAX_M (a launch), K % 16 == 0
 * (fp8) or % 32 (int4), fp8 scale columns a power of two >= 128 wide or the whole row,
 * int4 groups a power of two >= 32 or the whole row, and a K split whose x slice (M x
 * KC f16) fits 64 KB of shared memory, with at most 768 row tiles of 64 where K must
 * split; the same roundings as STREAM (x to f16, int4 values scaled in f16, fp8 partial
 * sums scaled in fp32). */
int k_cuda_linear_q_gemv_supports(const struct k_quant *q, const float *x, const void *w,
				  int M, int N, int K);

/* The same for K_CUDA_LINEAR_Q_TILE: M <= K_CUDA_LINEAR_Q_TILE_MAX_M, K % 16 == 0 (fp8)
 * or % 32 (int4), fp8 scale columns a power of two >= 64 wide or the whole row, int4
 * groups a power of two >= 32 or the whole row; the same roundings as MMA (x to f16,
 * int4 values scaled in f16, fp8 partial sums scaled in fp32). The context's scratch
 * must hold x (M <= max_M, K <= max_K): k_cuda_linear_q_run says -EINVAL otherwise. */
int k_cuda_linear_q_tile_supports(const struct k_quant *q, const float *x, const void *w,
				  int M, int N, int K);

/* 1 where the scale s is an f16 normal number exactly (int4 through the tensor-core
 * kinds then rounds (v - 8) * s once to f16, exactly where s has at most 8 significant
 * bits: |v - 8| has at most 3, f16 keeps 11). */
static inline int k_quant_scale_f16_exact(float s)
{
	float a = s < 0 ? -s : s;

	return a >= 0x1p-14f && a <= 65504.0f && k_f16_to_f32(k_f32_to_f16(s)) == s;
}

/* The kind k_cuda_linear_q_run takes: for M <= K_CUDA_LINEAR_Q_STREAM_MAX_M STREAM where
 * supported (one launch), else for M <= K_CUDA_LINEAR_Q_PASS_MAX_M MMA (8 rows a launch);
 * else DEQUANT where a scratch of N * K 16-bit values is given (wtmp_elems); else WARP. */
enum k_cuda_linear_q_kind k_cuda_linear_q_pick(const struct k_quant *q, const float *x,
					       const void *w, int M, int N, int K,
					       size_t wtmp_elems);

/* k_cuda_linear_q_pick's kind, except GEMV at M <= 8 where it runs and STREAM's plan
 * fills the GPU with clusters (K_CUDA_LINEAR_Q_GEMV_FILL; never under KDEC_LINEAR_QGEMV=0),
 * TILE at 8 < M <= 64 where it runs (ctx's x
 * scratch holds M x K), but for STREAM at M <= K_CUDA_LINEAR_Q_TILE_MIN_STREAM_M
 * where STREAM splits K over at most K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT CTAs; else DEQUANT
 * for STREAM at M > 8 where ctx would split K over more than
 * K_CUDA_LINEAR_Q_WIDE_MAX_SPLIT CTAs and the scratch (wtmp_elems) and ctx's sizes
 * allow it. */
enum k_cuda_linear_q_kind k_cuda_linear_q_choose(const struct k_cuda_linear *ctx,
						 const struct k_quant *q, const float *x,
						 const void *w, int M, int N, int K,
						 size_t wtmp_elems);

/* y (M, N) fp32 = x (M, K) fp32 @ w^T (y += with accumulate) on ctx's stream, w (N, K)
 * quantized as q says with q->scale in device memory (K_F32 or K_F16); kind < 0:
 * k_cuda_linear_q_choose's, else that one (-EINVAL where it cannot run). wtmp: device scratch of wtmp_elems 16-bit values for DEQUANT (NULL, 0: none),
 * owned by the caller, overwritten; DEQUANT and TILE also overwrite the context's x
 * scratch and need M <= its max_M, K <= its max_K (TILE takes 64 rows a launch, reading
 * the weights again beyond). Capturable into a CUDA graph; no kind reads the bf16 copy
 * of x (k_cuda_linear_x_ready): -EINVAL where only that copy was written.
 * 0, -EINVAL or -EIO (logged). */
int k_cuda_linear_q_run(struct k_cuda_linear *ctx, int kind, float *y, const float *x,
			const void *w, const struct k_quant *q, int M, int N, int K,
			int accumulate, uint16_t *wtmp, size_t wtmp_elems);

/* The GEMV kind (K_CUDA_LINEAR_Q_GEMV, M <= 8) with x = silu(gate) * up from gate_up
 * (M, 2K) fp32, row r holding gate then up: the product is formed in the kernel's x
 * staging with k_cuda_silu_mul_rows's operations, so y is bit for bit what that kernel
 * and k_cuda_linear_q_run's GEMV give in two launches, one launch and one pass over x
 * fewer (a dense SwiGLU MLP's down projection). -EINVAL where the GEMV does not take
 * the shape (k_cuda_linear_q_gemv_supports) or M > 8; else as k_cuda_linear_q_run. */
int k_cuda_linear_q_gemv_swiglu(struct k_cuda_linear *ctx, float *y, const float *gate_up,
				const void *w, const struct k_quant *q, int M, int N, int K,
				int accumulate);

/* struct k_cuda_xnorm: k_cuda_linear.h */
/* A decode kind that stages fp32 x (K_CUDA_LINEAR_Q_GEMV, or _STREAM, M <= 8) over an
 * RMSNorm's output, formed from its input x (M, K) in the kernel's x staging: y is bit
 * for bit what k_cuda_rmsnorm then k_cuda_linear_q_run of that kind give in two launches
 * (and norm->out what the first wrote), one launch and one round trip fewer (a layer's
 * input norm before q/k/v or gate/up). Every CTA reads x's whole rows for rs. -EINVAL
 * where the kind does not take the shape, another kind or M > 8; else as
 * k_cuda_linear_q_run. */
int k_cuda_linear_q_norm_run(struct k_cuda_linear *ctx, int kind, float *y, const float *x,
			     const struct k_cuda_xnorm *norm, const void *w,
			     const struct k_quant *q, int M, int N, int K, int accumulate);

/* dst (N, K) in out (K_BF16 or K_F16) = w dequantized (value * scale in fp32, rounded
 * to nearest even once), q->scale in device memory (K_F32 or K_F16). Queued on stream
 * without programmatic dependent launch (dst may be what the kernel before is
 * reading). 0, -EINVAL, -EIO. */
int k_cuda_quant_dequant(cudaStream_t stream, uint16_t *dst, enum k_dtype out, const void *w,
			 const struct k_quant *q, int N, int K);

/* "stream", "mma", "tile", "dequant", "warp", "gemv". */
const char *k_cuda_linear_q_kind_name(enum k_cuda_linear_q_kind kind);

/* A one-line description of how `kind` would launch this shape, for benchmarks. */
void k_cuda_linear_q_describe(const struct k_cuda_linear *ctx, enum k_cuda_linear_q_kind kind,
			      const struct k_quant *q, int M, int N, int K, char *buf,
			      size_t len);

#ifdef __cplusplus
}
#endif

#endif
