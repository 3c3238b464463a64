// What the KV-cache and attention files of kernels/cuda share: the workspace, the error
// macros, bf16 and division helpers, the split rule and the internal launchers.
#ifndef KD_KERNELS_CUDA_ATTN_COMMON_CUH
#define KD_KERNELS_CUDA_ATTN_COMMON_CUH

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"

#define ATTN_INVAL(...)                                                            \
	do {                                                                       \
		k_cuda_log(__VA_ARGS__);                                           \
		return -EINVAL;                                                    \
	} while (0)

// k_cuda_tuning()->mla_carveout (KDEC_MLA_CARVEOUT=1): the kernels of MLA's attention
// chain (absorb, attention, expand) ask for the largest shared-memory carveout, all the
// same one. An SM changes
// its L1 / shared split only when idle, so a kernel launched early (programmatic launch)
// cannot join one of another split until it drains. Measured on H200 (DeepSeek-V2-Lite,
// batch 1, two runs on two machines): 3.155 -> 3.086 ms with it, then 3.145 -> 3.173:
// within the noise, so off (the driver's choice). At ws creation.
template <typename K>
static inline int attn_mla_carveout(K *kernel)
{
	if (!k_cuda_tuning()->mla_carveout)
		return 0;
	K_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
				      (int)cudaSharedmemCarveoutMaxShared));
	return 0;
}

// Splits along the sequence: at most this many (the merge holds their weights; one
// block per SM for MLA at batch 1 needs about the SM count).
#define ATTN_MAX_SPLITS 128
// Partials the workspace holds: this many splits at max_rows (more for fewer rows).
#define ATTN_WS_SPLITS_AT_MAX_ROWS 4
// Split boundaries are multiples of this many tokens.
#define ATTN_SPLIT_ALIGN 32

struct k_cuda_attn_ws {
	int max_rows, max_heads, max_dim, max_ctx;
	int n_sm;		// multiprocessors of the device it was made on
	int smem_optin;		// bytes of shared memory a block may opt in to
	float *q_lat;		// (max_rows, max_heads, max_dim) MLA [W_UK^T q_nope ; q_pe]
	float *o_lat;		// (max_rows, max_heads, max_dim) MLA softmax-weighted latent
	float *part_o;		// (part_floats) split partials (n_splits, n_rows, n_heads, dim),
				// each normalised by its own sum
	float *part_lse;	// (lse_floats) (n_splits, n_rows, n_heads): log2 of the sum of
				// exp2 scores of each partial; -inf where the split saw no token
	size_t part_floats, lse_floats;
};

// q / d for 0 <= q < 2^31 by a multiply and a shift (block_tokens is a run-time value).
struct attn_div {
	uint32_t d, m, s;
};

static inline attn_div attn_div_make(uint32_t d)
{
	attn_div f;
	uint32_t s = 0;

	while (s < 31 && (1u << s) < d)
		s++;
	f.d = d;
	f.s = s;
	f.m = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << s) - d)) / d + 1);
	return f;
}

__device__ __forceinline__ uint32_t attn_div_q(attn_div f, uint32_t n)
{
	return (__umulhi(n, f.m) + n) >> f.s;
}

// The two bf16 halves of a 32-bit word as floats (low half is the lower address).
__device__ __forceinline__ float bf16_lo(uint32_t w)
{
	return __uint_as_float(w << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t w)
{
	return __uint_as_float(w & 0xffff0000u);
}

// exp2(a - b) with exp2(-inf - -inf) taken as 1: the weight of a running maximum a
// against a new maximum b >= a, where both may still be -inf (nothing seen yet).
__device__ __forceinline__ float attn_rescale(float a, float b)
{
	return a == b ? 1.0f : exp2f(a - b);
}

static inline int attn_cdiv(int a, int b)
{
	return (a + b - 1) / b;
}

// Splits along the sequence for a launch of base_ctas blocks per split: enough blocks
// to reach target_ctas, each split at least min_tokens of max_ctx, no more partials
// than the workspace holds. Host values only (graph safety).
int attn_pick_splits(const k_cuda_attn_ws *ws, long base_ctas, long target_ctas, int max_ctx,
		     int min_tokens, size_t part_per_split, size_t lse_per_split);

// Checks the rows against the workspace; logs and returns -EINVAL when they do not fit.
int attn_check_rows(const char *who, const k_cuda_attn_ws *ws, const k_cuda_attn_rows *rows,
		    int block_tokens, int n_heads, int dim);

// out(r, h, :dim) = sum_s w_s part_o(s, r, h, :) over the splits, w from part_lse.
// out row r head h at out + r * out_rs + h * out_hs (floats).
// out_bf16 (NULL or at the same offsets as out): out rounded to bf16 as well.
int attn_merge(cudaStream_t s, const k_cuda_attn_ws *ws, int n_splits, int n_rows,
	       int n_heads, int dim, float *out, long out_rs, long out_hs, uint16_t *out_bf16);

// fp32 -> bf16 bits, round to nearest even (NaN kept a NaN).
__device__ __forceinline__ uint16_t attn_bf16(float f)
{
	return k_cuda_bf16_rn(f);
}

// Tokens per split: ctx spread over the splits, in whole ATTN_SPLIT_ALIGN runs.
__device__ __forceinline__ int attn_split_len(int ctx, int n_splits)
{
	int per = (ctx + n_splits - 1) / n_splits;

	return (per + ATTN_SPLIT_ALIGN - 1) / ATTN_SPLIT_ALIGN * ATTN_SPLIT_ALIGN;
}

// ---- the tiled kernel (attn_tile.cu): a tile of query vectors shares each K/V tile ----

// What a tiled launch reads and writes. Query vector (row r, q head h) of kv head kvh
// = h / group is q + r * q_rs + h * q_hs; token slot's key is
// k + slot * k_stride + kvh * k_hoff (dk values), its value v + ... (dv values), or the
// first dv values of the key where v is null (MLA: the latent is both).
struct attn_tile_args {
	float *out;			// split 1: (r, h) at out + r * out_rs + h * out_hs
	long out_rs, out_hs;
	float *part_o, *part_lse;	// more splits: (n_splits, n_rows, n_heads, dv) etc.
	const float *q;
	long q_rs, q_hs;
	const uint16_t *k, *v;
	long k_stride, v_stride, k_hoff, v_hoff;
	const int32_t *ctx;
	const int32_t *const *blocks;
	attn_div bt;
	int n_rows, n_heads, group, kv_heads, dk, dv, n_splits;
	float qscale;			// scale * log2(e): scores in base 2
	int vec;			// 16-byte copies (dims, strides, offsets, bases aligned)
	int early;			// attn_mma. GQA (set by its launcher): the first tiles
					// of old tokens go out before the PDL wait. MLA (set
					// by its caller): the launch before appended this
					// step's rows, which are copied after the wait
	int relay;			// attn_mma only, set by its launcher: triggers the next
					// launch at its start (k_cuda_pdl_relay)
	int min_split;			// MLA tensor-core kernel only: tokens per split at least
					// this (a multiple of ATTN_SPLIT_ALIGN; 0: no floor),
	int split_live;			// or, where > 0, only as much of it as keeps the splits
					// that hold tokens at most this many (the ctx's own floor)
};

// Grid (tiles, kv heads, a->n_splits) of tq query vectors per tile: 64 (GQA prefill) or
// 16 (MLA: the heads of a row); merges the splits into a->out when there are several
// (a->out null: leaves them in a->part_o / part_lse for the caller).
int attn_tile_launch(cudaStream_t s, const k_cuda_attn_ws *ws, int tq, const attn_tile_args *a);

// Dynamic shared memory of a tiled launch; 0 where the dims cannot fit the device.
size_t attn_tile_smem(const k_cuda_attn_ws *ws, int tq, int dk, int dv, int v_separate);

// Opt-in to large dynamic shared memory for the tiled and MLA kernels (at ws creation).
int attn_tile_prepare(int smem_optin);
int attn_mla_prepare(int smem_optin);

// ---- the tensor-core decode kernel (attn_mma.cu; these in attn_mma_launch.cu): one
// block per (row, kv head, 16 q heads of it, split); q and p enter the tensor cores in
// bf16 (~3e-3 relative) ----

// Whether it can run a's attention: a compiled shape covers dk and dv (GQA: a->v set;
// MLA: null, V is the key's first dv values), q and K/V 16-byte aligned (a->vec), and
// k_cuda_tuning()->attn_mma is not 0.
int attn_mma_usable(const attn_tile_args *a);

// Launches it over a's rows (a->n_splits chosen here, or forced_splits when > 0 and it
// fits the workspace), then merges the splits; out_bf16 as in k_cuda_attn_gqa_bf16.
// GQA only. The first copies of tokens below ctx - n_rows go out before the PDL wait
// (attn_mma_early 0: after it).
int attn_mma_launch(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a, int max_ctx,
		    uint16_t *out_bf16, int forced_splits);

// attn_mma_launch without the merge: where a->n_splits comes back > 1, the normalised
// partials and their log2-sum-exp2 are in ws->part_o and ws->part_lse for the caller
// to merge, and a->out is not written.
int attn_mma_run(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a, int max_ctx,
		 uint16_t *out_bf16, int forced_splits);

// Opt-in shared memory and occupancy of the compiled shapes (at ws creation).
int attn_mma_prepare(int smem_optin);

// attn_mma_launch with qkv_post's work in the launch (post: its arguments, for these
// rows, head_dim a->dk; a->q its q_src, a->q_rs its q_rs): q normed and rotated as it
// is staged, and each row's K/V appended by the block whose split holds the row's last
// token, which must be its only new one (a decode step). q (post->q) is not written;
// the cache rows are qkv_post's bits, out those of qkv_post + attn_mma_launch.
// attn_mma_post_usable: whether a compiled shape runs a's rows that way (GQA, group
// <= 16, the attn_mma_usable conditions).
int attn_mma_post_usable(const attn_tile_args *a);
// The splits attn_mma_launch_post would run a's rows with (0 where it cannot).
int attn_mma_post_splits(const k_cuda_attn_ws *ws, const attn_tile_args *a, int max_ctx,
			 int forced_splits);
int attn_mma_launch_post(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a,
			 int max_ctx, uint16_t *out_bf16, int forced_splits,
			 const struct k_cuda_qkv_args *post);

// ---- the tensor-core prefill kernel (attn_prefill.cu): a block per (128 query vectors
// of consecutive rows, 64 at head_dim <= 64; kv head; split), flash-attention-2 style;
// q and p enter the tensor cores in bf16 (~3e-3 relative) ----

// Whether it can run a's GQA rows: head_dim (dk == dv) a multiple of 8 up to 128, q in
// float4 (strides and base 16-byte aligned), K/V aligned (a->vec), and
// k_cuda_tuning()->attn_mma and ->attn_prefill_mma not 0.
int attn_prefill_usable(const attn_tile_args *a);

// Launches it over a's rows (a->n_splits chosen here from host values), then merges the
// splits; out_bf16 (NULL or as in k_cuda_attn_gqa_bf16) written too.
int attn_prefill_launch(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a,
			int max_ctx, uint16_t *out_bf16);

// Opt-in shared memory and occupancy of its compiled shapes (at ws creation).
int attn_prefill_prepare(int smem_optin);

#ifdef __CUDACC__
// One warp lists the splits of (row, head) rh that count and their weights:
// live[0 .. n) the split numbers in increasing order, w[i] = exp2(lse - max) / sum for
// live[i]; returns n in every lane. Splits with lse = -inf saw no token: weight 0, so
// never listed (their partial is never read); no split listed where none saw a token
// (ctx 0). Lane l owns splits l + 32 k: ATTN_MAX_SPLITS / 32 loads in flight.
static __device__ __forceinline__ int merge_list(const float *part_lse, int n_splits,
					  size_t rh, size_t per_split, int *live, float *w)
{
	constexpr int PER = ATTN_MAX_SPLITS / 32;
	const int lane = threadIdx.x % 32;
	float x[PER], mx = -INFINITY, sum = 0.0f;
	int base = 0;

#pragma unroll
	for (int k = 0; k < PER; k++) {
		const int sp = lane + 32 * k;

		x[k] = sp >= n_splits ? -INFINITY : part_lse[sp * per_split + rh];
		mx = fmaxf(mx, x[k]);
	}
	for (int off = 16; off > 0; off >>= 1)
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
#pragma unroll
	for (int k = 0; k < PER; k++) {
		x[k] = x[k] == -INFINITY ? 0.0f : exp2f(x[k] - mx);
		sum += x[k];
	}
	for (int off = 16; off > 0; off >>= 1)
		sum += __shfl_xor_sync(0xffffffffu, sum, off);
	// sum >= 1 unless no split saw a token (ctx 0): then no split is listed.
#pragma unroll
	for (int k = 0; k < PER; k++) {
		const bool on = sum > 0.0f && x[k] != 0.0f;
		const unsigned m = __ballot_sync(0xffffffffu, on);

		if (on) {
			const int at = base + __popc(m & ((1u << lane) - 1u));

			live[at] = lane + 32 * k;
			w[at] = x[k] / sum;
		}
		base += __popc(m);
	}
	return base;
}
#endif

#endif
