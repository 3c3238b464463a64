/* Linear layers on the GPU: y = x @ w^T (or y += x @ w^T) with bf16 weights and fp32
 * activations, one variant per range of M, chosen by named predicates in linear.cu. */
#ifndef KD_KERNELS_CUDA_K_CUDA_LINEAR_H
#define KD_KERNELS_CUDA_K_CUDA_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The variants, in the order k_cuda_linear_pick tries them (but STREAM and RING before
 * GEMV: they take the larger matrices, GEMV the small ones). */
enum k_cuda_linear_kind {
	/* M <= KDEC_LINEAR_RING (0 by default: measured slower than cuBLAS and the
	 * streaming kernel on an H100) on matrices above linear_small_mb: the
	 * quantized decode GEMV's kernel on bf16 weights (linear_qgemv.cu): each warp's 16
	 * rows through its own cp.async ring 5 stages deep from before the PDL wait, x
	 * rounded to bf16 in shared memory, mma.sync bf16, K split over plain CTAs whose
	 * partials the last one adds in split order (the split timed at the first call);
	 * it can form its x from an RMSNorm's input or a SwiGLU's gate/up
	 * (k_cuda_linear_norm_run, k_cuda_linear_swiglu_run) */
	K_CUDA_LINEAR_RING = 0,
	/* M <= 2: fp32 x on CUDA cores, 16-byte weight loads, one warp per 2 weight rows */
	K_CUDA_LINEAR_GEMV,
	/* 2 < M <= 64: mma.sync bf16 tensor cores, x rounded to bf16 in shared memory,
	 * K split across the CTAs of a thread-block cluster and reduced through
	 * distributed shared memory (fixed order, no atomics) */
	K_CUDA_LINEAR_SPLITK,
	/* M <= 64 (walked in blocks of 64 beyond): weight tiles streamed through a cp.async
	 * pipeline in shared memory into mma.sync, x in bf16, K split over CTAs to fill
	 * whole waves, partial tiles added in split order by the last CTA of each tile */
	K_CUDA_LINEAR_STREAM,
	/* larger M (prefill): x rounded to bf16 into the context's scratch, then
	 * cublasGemmEx with fp32 accumulation and fp32 output */
	K_CUDA_LINEAR_CUBLAS,
	/* any shape, any alignment: scalar loads, one warp per output; slow */
	K_CUDA_LINEAR_GENERIC,
	K_CUDA_LINEAR_N_KINDS,
};

/* Rows of x one launch of the ring GEMV (K_CUDA_LINEAR_RING) takes. */
#define K_CUDA_LINEAR_RING_M 8

/* One context per stream: the cuBLAS handle with its preallocated workspace and the
 * bf16 scratch for x, so that the calls below never allocate, never synchronise and
 * can be captured into a CUDA graph. Not thread safe: one caller per context. */
struct k_cuda_linear;

/* Creates a context for `stream` on the current device, for calls with M <= max_M
 * and K <= max_K. Returns 0, -EINVAL, -ENOMEM or -EIO; *out is owned by the caller
 * (k_cuda_linear_destroy). Not capturable: it allocates, and runs one empty probe
 * kernel to completion on `stream` (cluster launch, programmatic dependent launch). */
int k_cuda_linear_create(struct k_cuda_linear **out, cudaStream_t stream, int max_M, int max_K);
void k_cuda_linear_destroy(struct k_cuda_linear *ctx);	/* accepts NULL */

/* shared = 1: other contexts' kernels may run on this device at the same time (virtual
 * tensor-parallel ranks on one GPU, their steps in one graph), so no launch may count
 * on all its CTAs being resident at once: the wgmma tile kernel then leaves a split's
 * sum to the last CTA of each tile instead of spreading it over the tile's CTAs, which
 * wait for each other. Default 0. */
void k_cuda_linear_set_shared(struct k_cuda_linear *ctx, int shared);

/* An RMSNorm a GEMV forms from its input (k_cuda_linear_norm_run,
 * k_cuda_linear_q_norm_run): the GEMV's x is w * (x * rs), rs = 1 / sqrt(mean(x^2) +
 * eps) over the row's K values, as k_cuda_rmsnorm writes it (the same bits). w: (K) fp32
 * device, 16-byte aligned; out: NULL, or (M, K) fp32 device, 16-byte aligned, not x,
 * where the normalised rows are written as well (the norm's own output, for whoever
 * reads it next). */
struct k_cuda_xnorm {
	const float *w;
	float eps;
	float *out;
};

/* y (M, N) fp32 = x (M, K) fp32 @ w^T, w (N, K) bf16 row-major; with accumulate = 1,
 * y += x @ w^T instead (y is read only then). All three in device memory; y must not
 * overlap x or w. Queued on the context's stream; returns 0, -EINVAL (sizes, NULL,
 * M > max_M, K > max_K) or -EIO (a CUDA or cuBLAS call failed; logged). Every output
 * is a fixed-order sum: the same inputs give the same bits on the same GPU. */
int k_cuda_linear(struct k_cuda_linear *ctx, float *y, const float *x, const uint16_t *w,
		  int M, int N, int K, int accumulate);

/* k_cuda_linear (accumulate 0) with y (M, N) written in bf16 (fp32 accumulation, one
 * rounding), for an output only a bf16 reader takes (SwiGLU's gate and up at batch
 * sizes that go to cuBLAS: half the bytes written and read again). Only where
 * k_cuda_linear_choose picks cuBLAS; -EOPNOTSUPP elsewhere (the caller takes the fp32
 * form), else as k_cuda_linear. */
int k_cuda_linear_bf16_out(struct k_cuda_linear *ctx, uint16_t *y, const float *x,
			   const uint16_t *w, int M, int N, int K);

/* The RING kind over an RMSNorm's output, formed from its input x (M, K) in the
 * kernel's x staging: y is what k_cuda_rmsnorm then k_cuda_linear of RING give in two
 * launches (norm->out what the first wrote), one launch and one round trip fewer; every
 * CTA reads x's whole rows for rs. M <= 8. -EINVAL where RING is not
 * k_cuda_linear_choose_tuned's kind for the shape or norm->out overlaps x; else as
 * k_cuda_linear. */
int k_cuda_linear_norm_run(struct k_cuda_linear *ctx, float *y, const float *x,
			   const struct k_cuda_xnorm *norm, const uint16_t *w, int M, int N, int K,
			   int accumulate);

/* The RING kind with x = silu(gate) * up from gate_up (M, 2K) fp32, row r holding gate
 * then up, formed in the kernel's x staging with k_cuda_silu_mul_rows's operations (a
 * dense SwiGLU MLP's down projection: one launch and one pass over x fewer). M <= 8.
 * -EINVAL where RING is not k_cuda_linear_choose_tuned's kind for (M, N, K); else as
 * k_cuda_linear. */
int k_cuda_linear_swiglu_run(struct k_cuda_linear *ctx, float *y, const float *gate_up,
			     const uint16_t *w, int M, int N, int K, int accumulate);

/* The variant for this shape when x and w are 16-byte aligned
 * (otherwise it takes K_CUDA_LINEAR_GENERIC where the pick needs alignment). */
enum k_cuda_linear_kind k_cuda_linear_pick(int M, int N, int K);
/* The kind for these pointers: the pick, or the generic kernel where x
 * or w is not 16-byte aligned or K % 8 != 0. */
enum k_cuda_linear_kind k_cuda_linear_choose(const float *x, const uint16_t *w, int M, int N,
					     int K);

/* k_cuda_linear_choose, or the ring kind where KDEC_LINEAR_RING_TUNE timed it faster
 * for this shape at M's bucket (the next power of two, M <= K_CUDA_LINEAR_RING_M): the
 * first call at a bucket size outside a graph capture times both, synchronising the
 * stream, and the context keeps the ring where it was at least 3% faster; a capture,
 * or another M, takes what its bucket kept, else the plain choice. Never the ring
 * where only x's bf16 copy was written (k_cuda_linear_x_ready_only). k_cuda_linear
 * runs what this says. */
enum k_cuda_linear_kind k_cuda_linear_choose_tuned(struct k_cuda_linear *ctx, const float *x,
						   const uint16_t *w, int M, int N, int K);

/* 1 where the calls so far at M's bucket ran the weight rows starting at w (K columns;
 * w may lie inside a matrix run as one, as a fused q/k/v's rows) on the ring kind that
 * KDEC_LINEAR_RING_TUNE chose where the plain choice reads fp32 x: x was rounded to
 * bf16 by the tuning's choice. -1 where no such call was made (the plain rule holds). */
int k_cuda_linear_rounds_x(const struct k_cuda_linear *ctx, const uint16_t *w, int K, int M);

/* 1 when `kind` can run this call: GEMV, SPLITK, STREAM and RING need K % 8 == 0 and x,
 * w 16-byte aligned; CUBLAS and GENERIC take anything. Any M is allowed (GEMV walks M
 * in pairs, SPLITK and STREAM in blocks of 64, RING of 8, re-reading the weights: for
 * tests). */
int k_cuda_linear_supports(enum k_cuda_linear_kind kind, const float *x, const uint16_t *w,
			   int M, int N, int K);

/* k_cuda_linear with the variant forced; -EINVAL where it is not supported. */
int k_cuda_linear_run_kind(struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind, float *y,
			   const float *x, const uint16_t *w, int M, int N, int K, int accumulate);

/* Producers that can write their output x (M, K) in bf16 as well spare the next call
 * its rounding pass: they write bf16(x), row-major (M, K), into the scratch that
 * k_cuda_linear_x_scratch returns (NULL where M, K exceed the context), then call
 * k_cuda_linear_x_ready(ctx, x, M, K) after queueing that kernel. The very next
 * k_cuda_linear call on the context uses the scratch as it is if its x, M and K are
 * those, and any call clears the mark (x = NULL clears it too). The rounding must be
 * round-to-nearest-even, as the context's own. */
uint16_t *k_cuda_linear_x_scratch(struct k_cuda_linear *ctx, int M, int K);
void k_cuda_linear_x_ready(struct k_cuda_linear *ctx, const float *x, int M, int K);
/* 1 where `kind` reads x as bf16 from the scratch (STREAM, CUBLAS), so a producer
 * for it may skip writing the fp32 x: it then marks the scratch with
 * k_cuda_linear_x_ready_only, and a next call whose kind reads fp32 x fails (-EINVAL)
 * instead of reading a stale x. */
int k_cuda_linear_kind_reads_bf16(enum k_cuda_linear_kind kind);
void k_cuda_linear_x_ready_only(struct k_cuda_linear *ctx, const float *x, int M, int K);

/* Programmatic dependent launch, on by default where the device takes it: each kernel
 * may start while the previous kernel in the stream drains and prefetches its weights
 * (constant) into L2 before it waits for that kernel's results; it reads x and y only
 * after the wait, so results never depend on it. The overlap happens where the previous
 * kernel triggers early; these kernels trigger right after their own wait, so a kernel
 * launched after them WITH programmatic serialisation must wait (griddepcontrol.wait)
 * before it reads y. Kernels launched without it are ordered as usual. 0 turns it off. */
void k_cuda_linear_set_pdl(struct k_cuda_linear *ctx, int on);

/* "ring", "gemv", "splitk", "stream", "cublas", "generic". */
const char *k_cuda_linear_kind_name(enum k_cuda_linear_kind kind);

/* A one-line description of how `kind` would launch this shape (grid, split,
 * cluster size) into buf, for benchmarks and failure logs. */
void k_cuda_linear_describe(const struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind,
			    int M, int N, int K, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
