/* The tensor-parallel reduction on the GPU (issue 25): a one-shot all-reduce over the
 * ranks' partial sums, fused with the residual add and the next RMSNorm, synchronised
 * by the data itself (Lamport-style: no barrier kernel, no flag, no host sync).
 *
 * Each rank r holds a receive buffer on its own device with one slot per sending
 * rank. A reduction: every rank writes its partial (rows, width) into slot r of every
 * rank's receive buffer (its own included: peer stores over NVLink between GPUs of
 * one process, plain stores where the ranks share a GPU); then each rank waits on its
 * own buffer until no element holds the sentinel (the bit pattern of -0.0, which a
 * sender never writes: it sends +0.0 instead, the same value in a sum), sums the N
 * slots in rank order in fp32, adds the sum to its residual and normalises. Every rank
 * reads the same bits in the same order, so every rank ends with the same residual and
 * output bits, as the CPU ranks do (daemon/engine/tp_comm.c).
 *
 * Three receive buffers are used in turn (launch k: buffer k % 3). A launch also resets
 * to the sentinel its own buffer of the launch before (k - 1) % 3, which no peer can
 * write again before launch k + 2, and a peer reaches launch k + 2 only after reading
 * this rank's data of launch k + 1, sent after this launch ended. The turn counter and
 * the previous sizes live in device memory, so a captured graph replays correctly.
 *
 * Ranks: all on one GPU (N "virtual" ranks: separate buffers standing in for peers,
 * the single-GPU check of the multi-GPU code) or one per GPU with peer access
 * (k_cuda_ar_create enables it), or a mix. Every rank's kernel spins, so all CTAs of
 * the ranks sharing a GPU must be resident at once: the grid of a rank is at most
 * (CTAs of this kernel that fit on the GPU) / (ranks on that GPU), from the occupancy
 * query at launch; and the launches of one reduction must all be issued before any
 * rank's next reduction (k_cuda_ar_fused_all issues them as one launch).
 *
 * Every function returns 0 or a negative errno (-EINVAL: bad arguments, nothing
 * launched, one line logged; -EOPNOTSUPP: two devices without peer access; -ENOMEM;
 * -EIO: a CUDA call failed, logged). Launches never allocate or synchronise. */
#ifndef KD_KERNELS_CUDA_COMM_K_CUDA_COMM_H
#define KD_KERNELS_CUDA_COMM_K_CUDA_COMM_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define K_CUDA_AR_MAX_RANKS 16

/* What crosses between ranks: the partial sums as bf16 (half the bytes; the seed's
 * form) or fp32 (the engine's activations, exact). Fixed per communicator: the
 * sentinel in the buffers is the payload's -0.0. */
enum k_cuda_ar_dtype {
	K_CUDA_AR_BF16 = 0,
	K_CUDA_AR_F32 = 1,
};

struct k_cuda_ar;	/* opaque: the ranks' buffers and turn counters */

/* n_ranks (2..K_CUDA_AR_MAX_RANKS) ranks, rank r on device devs[r], for reductions of
 * up to max_rows rows of up to max_width values (max_width a multiple of 8). Allocates
 * 3 * n_ranks * max_rows * max_width payload values and a few words on each rank's
 * device, fills them with the sentinel and waits for that (setup, not a step).
 * *out receives the communicator; the caller frees it with k_cuda_ar_destroy. The
 * current device is unchanged on return. */
int k_cuda_ar_create(struct k_cuda_ar **out, int n_ranks, const int *devs,
		     enum k_cuda_ar_dtype dtype, int max_rows, int max_width);

/* Frees every rank's buffers (NULL and a half-built one accepted). No reduction may be
 * in flight. */
void k_cuda_ar_destroy(struct k_cuda_ar *ar);

/* One rank's side of a reduction. All device pointers on the rank's device, 16-byte
 * aligned; residual, out and out_bf16 do not overlap each other or partial, except out
 * may be partial itself with an fp32 payload (the sum in place).
 *   x = residual + sum of every rank's partial (written back), or the sum alone where
 *   residual is NULL; out = rmsnorm(x) * gamma, or x itself where gamma is NULL.
 * The fused form: residual and gamma (k_cuda_add_rmsnorm after the reduction); the
 * engine's plain reductions: gamma NULL (tp_comm_reduce's two forms). */
struct k_cuda_ar_io {
	const void *partial;	/* (rows, width) bf16 or fp32 as the communicator's dtype */
	float *residual;	/* (rows, width) fp32 in/out, or NULL (then out is needed) */
	const float *gamma;	/* (width) fp32 RMSNorm weight, or NULL: no norm */
	float *out;		/* (rows, width) fp32, or NULL */
	uint16_t *out_bf16;	/* (rows, width) out rounded to bf16 (nearest even), or NULL */
};

/* The reduction for rank `rank`, launched on stream s (of the rank's device, which must
 * be current). Every rank calls it once per reduction with the same rows, width and
 * eps, in the same order of reductions; rows 1..max_rows, width a multiple of 8 (bf16)
 * or 4 (fp32), 8..max_width, rows * width <= max_rows * max_width. */
int k_cuda_ar_fused(struct k_cuda_ar *ar, int rank, cudaStream_t s, const struct k_cuda_ar_io *io,
		    int rows, int width, float eps);

/* Every rank's side in one launch on stream s: only where all ranks share the current
 * device (virtual ranks). io[r] is rank r's. The single-GPU form the sanitizers can
 * run (no cross-launch wait) and the cheaper one to launch. */
int k_cuda_ar_fused_all(struct k_cuda_ar *ar, cudaStream_t s, const struct k_cuda_ar_io *io,
			int rows, int width, float eps);

/* How many CTAs (*ctas) of *threads threads one rank's launch of this shape uses on the
 * current device (for the benchmark's report). */
int k_cuda_ar_shape(const struct k_cuda_ar *ar, int rows, int width, int *ctas, int *threads);

/* Ranks sharing a device with another (the virtual case): the largest count of ranks
 * on one device. */
int k_cuda_ar_ranks_per_device(const struct k_cuda_ar *ar);

/* A tensor-parallel rank's embedding (shard_embed.cu): out (n, dim) = the rows of ids
 * from table (vn, dim) bf16, which holds the vocabulary rows [v0, v0 + vn) (ids[i] - v0
 * indexes it); a row whose id falls outside is zeros, another rank's to fill in the
 * reduction. 0 or -EINVAL / -EIO. */
int k_cuda_embed_shard(cudaStream_t s, float *out, const int32_t *ids, int n,
		       const uint16_t *table, int vn, int dim, int v0);

/* An expert-parallel rank's choices (shard_experts.cu): ids (n) in place, an id in
 * [e0, e0 + ne) (the experts the rank holds) becomes id - e0, any other -1 (skipped by
 * the experts kernels). 0 or -EINVAL / -EIO. */
int k_cuda_experts_shard(cudaStream_t s, int32_t *ids, int n, int e0, int ne);

/* Greedy by vocabulary slices (argmax_slice.cu): for each row i of logits (rows, vn)
 * fp32, a rank's slice holding the vocabulary [v0, v0 + vn), best (2, rows) 32-bit
 * words get its greatest value (fp32, best[i]) and v0 + its index (int32,
 * best[rows + i]) by kernels/cpu/sample.c's greedy rule: the lower index on ties,
 * NaNs passed over, the last index where the row is all NaN. 0 or -EINVAL / -EIO. */
int k_cuda_argmax_slice(cudaStream_t s, void *best, const float *logits, int rows, int vn,
			int v0);

/* Top-k draws by vocabulary slices (topk_slice.cu): for each row i of logits (rows, vn)
 * fp32, a rank's slice holding the vocabulary [v0, v0 + vn), its best m_i = min(K,
 * non-NaN values of the row) by kernels/cpu/sample.c's order (the higher logit, ties to
 * the lower id; NaN never one, -inf may be), ids ascending, into top (2 * K + 1, rows)
 * 32-bit words: values fp32 at [i * K + j] (the logits' own bits), ids v0 + index int32
 * at [rows * K + i * K + j], m_i int32 at [2 * rows * K + i]; slots j >= m_i hold NaN
 * and -1. K = K_CUDA_TOPK_SLICE_K; vn <= K_CUDA_TOPK_SLICE_MAX_VN; rows 1..65535.
 * ws: k_cuda_topk_slice_ws_bytes(rows, vn) bytes of device scratch (0, and ws NULL, where
 * the row is one chunk: vn <= 4096), not shared with a launch in flight. One launch,
 * two where vn > 4096; no allocation or synchronisation (graph capturable). 0, or
 * -EINVAL (bad arguments: one line, nothing launched) / -EIO. */
#define K_CUDA_TOPK_SLICE_K 64
#define K_CUDA_TOPK_SLICE_MAX_VN 262144
size_t k_cuda_topk_slice_ws_bytes(int rows, int vn);
int k_cuda_topk_slice(cudaStream_t s, void *top, void *ws, size_t ws_bytes, const float *logits,
		      int rows, int vn, int v0);

#ifdef __cplusplus
}
#endif

#endif
