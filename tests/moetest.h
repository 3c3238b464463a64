/* The fixtures of the MoE test and benchmark: expert shapes, a batch's routing (distinct
 * experts per row, one of them hot if asked) and the tuning's MoE fields, which pick the
 * path and its kernels. Include after tests/cudatest.h. */
#ifndef KD_TESTS_MOETEST_H
#define KD_TESTS_MOETEST_H

#include <stdint.h>

#include "kernels/cuda/k_cuda_tuning.h"
#include "tests/testutil.h"

struct moe_shape {
	const char *name;
	int hidden, inter, n_experts, top_k;
};

static inline const char *moe_path_name(int path)
{
	return path == K_CUDA_MOE_PATH_SMALL ? "small" : path == K_CUDA_MOE_PATH_GROUPED ?
	       "grouped" : "auto";
}

/* ids (M, top_k): distinct per row; hot >= 0 puts every row's slot 0 on expert hot.
 * wts: weights in [0.08, 0.88). */
static inline void moe_make_ids(int32_t *ids, float *wts, int M, const struct moe_shape *s,
				int hot, unsigned long long *seed)
{
	for (int m = 0; m < M; m++)
		for (int j = 0; j < s->top_k; j++) {
			int e, dup;

			do {
				e = j == 0 && hot >= 0 ? hot :
				    test_rand_int(0, s->n_experts - 1, seed);
				dup = 0;
				for (int q = 0; q < j; q++)
					dup |= ids[m * s->top_k + q] == e;
			} while (dup);
			ids[m * s->top_k + j] = e;
			wts[m * s->top_k + j] = (test_randf(seed) + 1.2f) * 0.4f;
		}
}

/* The path k_cuda_moe_experts takes (enum k_cuda_moe_path), installed. */
static inline void moe_set_path(int path)
{
	struct k_cuda_tuning t = *k_cuda_tuning();

	t.moe_path = path;
	k_cuda_tuning_set(&t);
}

/* moe_m1 (a single row on the small path takes moe_small_m1.cu's kernels), installed:
 * 0 or 1, or -1 for the built-in default. */
static inline void moe_set_m1(int on)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_m1 = on >= 0 ? on : def.moe_m1;
	k_cuda_tuning_set(&t);
}

/* moe_qtile_rows (up to that many rows a call, experts on the grouped path take
 * moe_qtile.cu's tile kernels; bf16 experts too where rows > 0; 0: expert_mma_kernel at
 * every M, their wide passes off too), installed: rows >= 0, or -1 for the defaults. */
static inline void moe_set_qtile(int rows)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qtile_rows = rows >= 0 ? rows : def.moe_qtile_rows;
	t.moe_qtile_bf16 = rows >= 0 ? rows > 0 : def.moe_qtile_bf16;
	t.moe_qtile_wide = rows == 0 ? 0 : def.moe_qtile_wide;
	k_cuda_tuning_set(&t);
}

/* moe_qtile_wide (the tile kernels' wide passes from that many rows a call; 0: never),
 * installed: rows >= 0, or -1 for the default. */
static inline void moe_set_qtile_wide(int rows)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qtile_wide = rows >= 0 ? rows : def.moe_qtile_wide;
	k_cuda_tuning_set(&t);
}

/* moe_qtile_split (the CTAs each used expert's passes are spread over in the tile
 * kernels; 0: by the call's rows, the default; 1: one), installed: n >= 0, or -1 for
 * the default. */
static inline void moe_set_qtile_split(int n)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qtile_split = n >= 0 ? n : def.moe_qtile_split;
	k_cuda_tuning_set(&t);
}

/* moe_qgemv_rows (up to that many rows a call, quantized experts of the small path's
 * sizes take moe_qgemv.cu's union GEMVs), installed: rows >= 0, or -1 for the default. */
static inline void moe_set_qgemv(int rows)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qgemv_rows = rows >= 0 ? rows : def.moe_qgemv_rows;
	k_cuda_tuning_set(&t);
}

/* moe_qgemv_int4_rows and moe_qgemv_fp8_rows (int4 / fp8 experts take the union GEMVs
 * up to that many rows, the tile kernels past them; fp8 at every width), installed:
 * rows >= 0, or -1 for their defaults. */
static inline void moe_set_qgemv_fmt(int rows)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qgemv_int4_rows = rows >= 0 ? rows : def.moe_qgemv_int4_rows;
	t.moe_qgemv_fp8_rows = rows >= 0 ? rows : def.moe_qgemv_fp8_rows;
	t.moe_qgemv_fp8_hidden = rows >= 0 ? 0 : def.moe_qgemv_fp8_hidden;
	k_cuda_tuning_set(&t);
}

/* moe_qgemv_persist (the union gate/up as persistent CTAs; > 1: at most that many),
 * installed: >= 0, or -1 for the default (1). */
static inline void moe_set_qgemv_persist(int v)
{
	struct k_cuda_tuning t = *k_cuda_tuning(), def;

	k_cuda_tuning_defaults(&def);
	t.moe_qgemv_persist = v >= 0 ? v : def.moe_qgemv_persist;
	k_cuda_tuning_set(&t);
}

#endif
