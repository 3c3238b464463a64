// The host side of the tensor-core decode attention (attn_mma.cu's kernels): the
// predicates that pick a compiled shape, the split count, the launch and its merge.
#include <cstdint>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mma.cuh"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/launch_check.cuh"

// Per device (the attribute is), so at every workspace's creation.
int attn_mma_prepare(int smem_optin)
{
	for (int i = 0; i < attn_mma_n_shapes; i++) {
		mma_shape &sh = attn_mma_shapes[i];

		if ((int)sh.smem > smem_optin)
			continue;
		K_CUDA_TRY(cudaFuncSetAttribute(sh.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
						(int)sh.smem));
		if (!sh.vsep && attn_mla_carveout(sh.kernel))
			return -EIO;
		K_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sh.per_sm, sh.kernel,
									 sh.threads, sh.smem));
	}
	return 0;
}

// The switches below are k_cuda_tuning()'s, read at each call (the tests run every
// path). attn_mma 0 (KDEC_ATTN_MMA=0) turns the tensor-core decode kernel off;
// attn_mma_tk 64 (KDEC_ATTN_MMA_TK=64) picks the 64-token GQA tiles (32 by default:
// 8.48 against 9.40 ms a Llama-3.1-8B step at batch 64 on H200, 3 stages in flight).
static int mma_enabled(void)
{
	return k_cuda_tuning()->attn_mma != 0;
}

// mla_mma_ksplit 0 (KDEC_MLA_MMA_KSPLIT=0): MLA's kernel with 4 warps, each over all
// 576 key dims of its tokens, instead of 8 that split them in two (attn_mma_kernel's W).
static bool mla_ksplit(void)
{
	return k_cuda_tuning()->mla_mma_ksplit != 0;
}

// q rows in float4: dk, the strides and the base 16-byte aligned.
static bool mma_q_ok(const attn_tile_args *a)
{
	return a->dk % 4 == 0 && a->q_rs % 4 == 0 && a->q_hs % 4 == 0 && (uintptr_t)a->q % 16 == 0;
}

// attn_mma_qreg 0 (KDEC_ATTN_MMA_QREG=0): GQA's shapes that stage q in shared memory
// for every tile (the bits are the same).
static bool mma_qreg_enabled(void)
{
	return k_cuda_tuning()->attn_mma_qreg != 0;
}

// GQA: the shape of the wanted q placement first, the other where it is unusable.
// post: only the shapes with qkv_post folded in (q in registers), else only the others.
static const mma_shape *mma_find(int dk, int dv, bool vsep, bool post = false)
{
	const int want_tk = k_cuda_tuning()->attn_mma_tk == 64 ? 64 : 32;
	const bool want_qreg = mma_qreg_enabled();

	if (!mma_enabled() || dk % 8 || dv % 2)
		return nullptr;
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < attn_mma_n_shapes; i++) {
			const mma_shape &sh = attn_mma_shapes[i];

			if (sh.per_sm < 1 || sh.vsep != vsep || dk > sh.dk || dv > sh.dv ||
			    sh.post != post)
				continue;
			if (vsep && sh.dk == 128 && dk > 64 && sh.tk != want_tk)
				continue;
			if (vsep && dk <= 64 && sh.dk != 64)
				continue;
			if (vsep && pass == 0 && sh.qreg != want_qreg && !post)
				continue;
			if (!vsep && (sh.threads != MMA_THREADS) != mla_ksplit())
				continue;
			return &sh;
		}
	return nullptr;
}

int attn_mma_usable(const attn_tile_args *a)
{
	return a->vec && mma_q_ok(a) && mma_find(a->dk, a->dv, a->v != nullptr) != nullptr;
}

// Splits along the sequence. Below MMA_WAVE_FILL of one wave of resident blocks, as many
// as fill it (splits of at least MMA_MIN_SPLIT_TOKENS). Above, a block's time is the same
// in every wave, so the step takes ceil(waves) of them: the fewest splits whose last wave
// is at least MMA_WAVE_FILL full (a batch of 64 Llama rows is 512 blocks, 1.3 waves of
// 3 per SM: 3 splits make it 3.9 of 4), and never more than MMA_MAX_WAVE_SPLITS. With
// q in registers (4 per SM, 528 slots) the 512 are 0.97 of a wave: one split, no merge.
// Measured on H200 (test_cuda_attn's timings, now bench_cuda_attn; cold L2, Llama batch
// 64 ctx 1024): one split 82.6 us against 88.8 with two and the merge launch
// (docs/results/cuda-attn-h3.txt).
#define MMA_WAVE_FILL 0.9
#define MMA_MAX_WAVE_SPLITS 4
#define MMA_MIN_WAVE_SPLIT_TOKENS 256
static int mma_pick_splits(const k_cuda_attn_ws *ws, long base, long slots, int max_ctx,
			   size_t part, size_t lse)
{
	int n = 1, best = 1;
	double best_fill = 0.0;

	if (base < MMA_WAVE_FILL * slots)
		return attn_pick_splits(ws, base, slots, max_ctx, MMA_MIN_SPLIT_TOKENS, part, lse);
	for (n = 1; n <= MMA_MAX_WAVE_SPLITS; n++) {
		const double waves = (double)base * n / slots;
		const double fill = waves / __builtin_ceil(waves);

		if (n > 1 && ((long)max_ctx < (long)n * MMA_MIN_WAVE_SPLIT_TOKENS ||
			      (size_t)n * part > ws->part_floats || (size_t)n * lse > ws->lse_floats))
			break;
		if (fill > best_fill + 1e-9) {
			best = n;
			best_fill = fill;
		}
		if (fill >= MMA_WAVE_FILL)
			break;
	}
	return best;
}

// Not here: GQA's split merge in the attention kernel, the last split to finish merging
// (KDEC_ATTN_MMA_FOLD, removed in session 35): at Llama batch 64 with two splits 93.6
// us against 88.8 with the merge launch (H200, cold L2), no change at batch 1 and 8.

// attn_mma_early 0 (KDEC_ATTN_MMA_EARLY=0): GQA's K/V copies all wait for the kernel
// before (the bits are the same).
static int mma_early_enabled(void)
{
	return k_cuda_tuning()->attn_mma_early != 0;
}

// The splits mma_run takes for a on shape sh: one wave of resident blocks (see
// mma_pick_splits), or forced_splits where the workspace holds them.
static int mma_splits_of(const k_cuda_attn_ws *ws, const attn_tile_args *a, const mma_shape *sh,
			 int max_ctx, int forced_splits)
{
	const int n_hc = attn_cdiv(a->group, MMA_Q);
	const size_t part = (size_t)a->n_rows * a->n_heads * a->dv;
	const size_t lse = (size_t)a->n_rows * a->n_heads;

	if (forced_splits > 0 && (size_t)forced_splits * part <= ws->part_floats &&
	    (size_t)forced_splits * lse <= ws->lse_floats && forced_splits <= ATTN_MAX_SPLITS)
		return forced_splits;
	return mma_pick_splits(ws, (long)a->n_rows * a->kv_heads * n_hc,
			       (long)sh->per_sm * ws->n_sm, max_ctx, part, lse);
}

// gqa: GQA (attn_mma_launch) may issue its first copies before the PDL wait; a->early is
// set here but for MLA (attn_mma_run, no v), where its caller sets it: the cache append
// is in the launch just before, so this step's rows are copied after the wait (see the
// kernel).
// post: qkv_post's work in the launch (GQA, the POST shapes; see attn_mma_launch_post).
static int mma_run(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a, int max_ctx,
		   uint16_t *out_bf16, int forced_splits, bool gqa,
		   const k_cuda_qkv_args *post = nullptr)
{
	const mma_shape *sh = mma_find(a->dk, a->dv, a->v != nullptr, post != nullptr);
	const k_cuda_qkv_args none = {};
	const int n_hc = attn_cdiv(a->group, MMA_Q);
	dim3 grid;

	if (!sh || !a->vec || !mma_q_ok(a))
		ATTN_INVAL("attn_mma_launch: dk %d dv %d not compiled, or not 16-byte aligned",
			   a->dk, a->dv);
	a->n_splits = mma_splits_of(ws, a, sh, max_ctx, forced_splits);
	grid = dim3(a->kv_heads * n_hc, a->n_splits, a->n_rows);
	a->early = gqa ? mma_early_enabled() : !a->v && a->early;	// MLA: its caller's
	a->relay = k_cuda_pdl_relay_enabled(K_CUDA_RELAY_ATTN);
	K_CUDA_TRY(k_cuda_launch_pdl(s, grid, sh->threads, sh->smem, sh->kernel, *a, n_hc,
				     a->n_splits == 1 ? out_bf16 : nullptr, post ? *post : none));
	K_CUDA_TRY_LAUNCHED("attn_mma_kernel");
	return 0;
}

int attn_mma_run(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a, int max_ctx,
		 uint16_t *out_bf16, int forced_splits)
{
	return mma_run(s, ws, a, max_ctx, out_bf16, forced_splits, false);
}

int attn_mma_post_usable(const attn_tile_args *a)
{
	return a->vec && mma_q_ok(a) && a->group <= MMA_Q && a->v &&
	       mma_find(a->dk, a->dv, true, true) != nullptr;
}

int attn_mma_post_splits(const k_cuda_attn_ws *ws, const attn_tile_args *a, int max_ctx,
			 int forced_splits)
{
	const mma_shape *sh = attn_mma_post_usable(a) ? mma_find(a->dk, a->dv, true, true) : nullptr;

	return sh ? mma_splits_of(ws, a, sh, max_ctx, forced_splits) : 0;
}

int attn_mma_launch_post(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a,
			 int max_ctx, uint16_t *out_bf16, int forced_splits,
			 const k_cuda_qkv_args *post)
{
	if (!attn_mma_post_usable(a) || post->head_dim != a->dk || post->rows != a->n_rows)
		ATTN_INVAL("attn_mma_launch_post: dk %d group %d rows %d unsupported", a->dk,
			   a->group, a->n_rows);
	int ret = mma_run(s, ws, a, max_ctx, out_bf16, forced_splits, true, post);

	if (ret || a->n_splits == 1)
		return ret;
	return attn_merge(s, ws, a->n_splits, a->n_rows, a->n_heads, a->dv, a->out, a->out_rs,
			  a->out_hs, out_bf16);
}

int attn_mma_launch(cudaStream_t s, const k_cuda_attn_ws *ws, attn_tile_args *a, int max_ctx,
		    uint16_t *out_bf16, int forced_splits)
{
	int ret = mma_run(s, ws, a, max_ctx, out_bf16, forced_splits, true);

	if (ret || a->n_splits == 1)
		return ret;
	return attn_merge(s, ws, a->n_splits, a->n_rows, a->n_heads, a->dv, a->out, a->out_rs,
			  a->out_hs, out_bf16);
}
