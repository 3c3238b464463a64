/* MLA decode context parallel on the GPU (docs/PARALLEL.md, "MLA decode context
 * parallel"): the latent cache split by tokens over n_parts ranks, cache slot s held by
 * part s % n_parts at its local row s / n_parts, as the CPU ranks hold it
 * (kernels/cpu/k_cpu.h, k_cpu_attn_mla_part). With block_tokens a multiple of n_parts
 * (required here) part p holds a sequence's positions t = p mod n_parts, position t at
 * local row table[t / bt] * (bt / n_parts) + (t % bt) / n_parts: a paged cache of
 * bt / n_parts-token blocks under the same block tables, so a part's attention is
 * k_cuda_attn_mla's own latent attention over a shorter context, and its split partials
 * (normalised, base-2 log-sum-exp) are splits of the whole softmax, merged across the
 * parts by k_cuda_attn_merge's merge. The step: every rank absorbs its heads into the
 * rows every rank reads (k_cuda_mla_absorb), attends every head over its tokens
 * (k_cuda_attn_mla_part), and merges and expands its heads over every rank's partials
 * (k_cuda_mla_merge_expand). C entry points; 0 or a negative errno as k_cuda_attn.h;
 * launch configurations from host values only, no allocation, no synchronisation. */
#ifndef KD_KERNELS_CUDA_K_CUDA_MLA_CP_H
#define KD_KERNELS_CUDA_K_CUDA_MLA_CP_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/attn/k_cuda_attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Once a step, for part `part`: local_slots (n_rows) = the cache row of each row's
 * latent in this part's cache: slots[i] / n_parts where slots[i] % n_parts == part,
 * trash (a row no position maps to) for another part's, -1 for a negative slot; and
 * ctx_part (n_rows) = the tokens of row i this part holds, ceil((ctx[i] - part) /
 * n_parts), 0 where ctx[i] <= part. All device memory. k_cuda_attn_mla_part reads
 * ctx_part before its programmatic-launch wait: queue this at least one copy or
 * non-programmatic launch before it (the engine: at the step's start). */
int k_cuda_mla_cp_rows(cudaStream_t s, int32_t *local_slots, int32_t *ctx_part,
		       const int32_t *slots, const int32_t *ctx, int n_rows, int part, int n_parts,
		       int trash);

/* qa row r, head h at qa + r * qa_rs + h * (kv_lora + rope_dim) (floats) = [W_UK_h^T
 * q_nope ; q_pe] for the d->n_heads heads of w_kv_b (d->n_heads * (nope + v), kv_lora)
 * bf16; q (n_rows, d->n_heads, nope + rope) fp32: k_cuda_attn_mla's absorb (its
 * rounding), through ws->q_lat. */
int k_cuda_mla_absorb(cudaStream_t s, struct k_cuda_attn_ws *ws, float *qa, long qa_rs,
		      const float *q, const uint16_t *w_kv_b, int n_rows,
		      const struct k_mla_dims *d);

/* The split partials each part writes (k_cuda_attn_mla_part's n_splits): every part the
 * same count, from host values alone: n_rows, n_heads, the whole context bound max_ctx,
 * n_parts and ranks_per_gpu (parts sharing one GPU: each takes its share of the SMs),
 * at least 2, at most what ws (made for n_heads heads), ATTN's 128 merged splits over
 * n_parts and cap_floats (one part's partial buffer) hold. 0 where not even 2 fit. */
int k_cuda_attn_mla_part_splits(const struct k_cuda_attn_ws *ws, int n_rows, int n_heads,
				int kv_lora, int max_ctx, int n_parts, int ranks_per_gpu,
				size_t cap_floats);

/* Part `part` of n_parts: every one of n_heads heads of qa (n_rows, n_heads, kv_lora +
 * rope_dim) over the row's tokens this part holds (ctx_part, from k_cuda_mla_cp_rows;
 * rows->blocks the block tables of block_tokens tokens, rows->max_ctx the whole
 * context's bound), cache the part's own (local rows): n_splits split partials
 * part_o (n_splits, n_rows, n_heads, kv_lora) normalised and part_lse (n_splits,
 * n_rows, n_heads) their log2-sum-exp2 of scale * log2(e) scores, -inf where a split
 * holds none of the row's tokens. ws made for n_heads heads. */
int k_cuda_attn_mla_part(cudaStream_t s, struct k_cuda_attn_ws *ws, float *part_o,
			 float *part_lse, int n_splits, const float *qa, const uint16_t *cache,
			 int block_tokens, const struct k_cuda_attn_rows *rows,
			 const int32_t *ctx_part, int n_heads, int kv_lora, int rope_dim,
			 float scale, int part, int n_parts);

/* out (n_rows, d->n_heads, v_dim) for heads [h0, h0 + d->n_heads) of n_heads_all: the
 * log-sum-exp merge of n_splits partials (every part's, back to back: part_o
 * (n_splits, n_rows, n_heads_all, kv_lora), part_lse (n_splits, n_rows, n_heads_all)),
 * gathered into ws->part_o / part_lse and merged as k_cuda_attn_mla merges its splits,
 * then expanded by the heads' W_UV rows of w_kv_b (d->n_heads heads' rows, as stored).
 * n_splits 1..128; ws made for n_heads_all heads. */
int k_cuda_mla_merge_expand(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			    const float *part_o, const float *part_lse, int n_splits, int n_rows,
			    int n_heads_all, int h0, const uint16_t *w_kv_b,
			    const struct k_mla_dims *d);

#ifdef __cplusplus
}
#endif

#endif
