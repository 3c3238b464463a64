/* Small-op benchmark on the GPU: mla_post (DeepSeek-V2-Lite's latent norm, both ropes
 * and the cache append, from mla_prep's [q | kv_a] rows) behind a programmatically
 * launched RMSNorm that stands in for the projection before it, with its cos/sin table
 * read before the launch wait (the default) and after it, at 1, 8 and 64 rows, beside
 * the floor of its own bytes. The checks of the same ops: test_cuda_ops.
 * Usage: bench_cuda_ops. Exits 77 without CUDA or a GPU. */
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/cudatest.h"
#include "tests/bench/cudabench.h"

#define MLAP_RUNS 25
#define NORM_ROWS 132		/* one wave of the norm's blocks */
#define NORM_DIM 65536		/* ~35 MB read and written: a projection's worth */

static unsigned long long seed = 0x5eed0c0da0ull;
static cudaStream_t stream;

/* Median microseconds of the PDL-launched RMSNorm over NORM_ROWS rows of NORM_DIM floats,
 * then mla_post when a is set: their difference is what mla_post adds to a step where it
 * overlaps its predecessor. MLAP_RUNS runs after one. */
static double mla_post_after_norm_us(const struct k_cuda_mla_post_args *a)
{
	static float *x, *w;
	float ms[MLAP_RUNS];
	cudaEvent_t e0 = NULL, e1 = NULL;
	double us = 0;

	if (!x) {
		x = dalloc(sizeof(float) * (size_t)NORM_ROWS * NORM_DIM);
		w = dalloc(sizeof(float) * NORM_DIM);
		CU(cudaMemset(x, 0, sizeof(float) * (size_t)NORM_ROWS * NORM_DIM));
		CU(cudaMemset(w, 0, sizeof(float) * NORM_DIM));
	}
	if (!x || !w || !CU(cudaEventCreate(&e0)) || !CU(cudaEventCreate(&e1)))
		goto out;
	for (int i = -1; i < MLAP_RUNS; i++) {
		CU(cudaEventRecord(e0, stream));
		k_cuda_rmsnorm(stream, x, NORM_DIM, x, NORM_DIM, w, NORM_ROWS, NORM_DIM, 1e-6f);
		if (a)
			k_cuda_mla_post(stream, a);
		CU(cudaEventRecord(e1, stream));
		CU(cudaEventSynchronize(e1));
		if (i >= 0)
			CU(cudaEventElapsedTime(&ms[i], e0, e1));
	}
	us = test_median(ms, MLAP_RUNS) * 1e3;
out:
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
	return us;
}

/* mla_post's inputs on the device for rows of DeepSeek-V2-Lite (16 heads, nope 128,
 * rope 64, latent 512; YaRN): [q | kv_a] rows, norm weights, the rope's frequencies,
 * positions and a slot each in a cache of rows + 7. */
struct mla_post_bench {
	struct k_cuda_mla_post_args a;
	float *d_src, *d_q, *d_w, *d_inv;
	int32_t *d_pos, *d_slots;
	uint16_t *d_cache;
	double bytes;		/* what one call must read and write */
};

static int mla_post_setup(struct mla_post_bench *b, int rows, const struct k_rope *rope)
{
	const int H = 16, nope = 128, pe = 64, lora = 512, qk = nope + pe, width = lora + pe;
	const long src_rs = (long)H * qk + width;
	const size_t nsrc = (size_t)rows * src_rs;
	float *src = test_rand_floats(nsrc, 2.0f, &seed), *w = test_rand_floats(lora, 1.0f, &seed);
	int32_t *pos = malloc(sizeof(int32_t) * rows), *slots = malloc(sizeof(int32_t) * rows);

	for (int r = 0; r < rows; r++) {
		pos[r] = test_rand_int(0, 32767, &seed);
		slots[r] = r;
	}
	b->d_src = dup_to_device(src, sizeof(float) * nsrc);
	b->d_q = dalloc(sizeof(float) * (size_t)rows * H * qk);
	b->d_w = dup_to_device(w, sizeof(float) * lora);
	b->d_inv = dup_to_device(rope->inv_freq, sizeof(float) * (size_t)rope->dim / 2);
	b->d_pos = dup_to_device(pos, sizeof(int32_t) * rows);
	b->d_slots = dup_to_device(slots, sizeof(int32_t) * rows);
	b->d_cache = dalloc(sizeof(uint16_t) * (size_t)(rows + 7) * width);
	b->a = (struct k_cuda_mla_post_args){
		.q_pe = b->d_q + nope, .q_rs = (long)H * qk, .q_hs = qk, .n_heads = H,
		.q_src_pe = b->d_src + nope, .q_src_rs = src_rs, .nope_dim = nope,
		.kv = b->d_src + (size_t)H * qk, .kv_rs = src_rs, .rows = rows, .kv_lora = lora,
		.pe_dim = pe, .norm = b->d_w, .eps = 1e-6f, .inv_freq = b->d_inv,
		.rot_dim = rope->dim, .interleaved = rope->interleaved,
		.attn_factor = rope->attn_factor, .pos = b->d_pos, .cache = b->d_cache,
		.slots = b->d_slots,
	};
	b->bytes = 4.0 * nsrc + 4.0 * rows * H * qk + 2.0 * rows * width;
	free(src), free(w), free(pos), free(slots);
	return b->d_src && b->d_q && b->d_w && b->d_inv && b->d_pos && b->d_slots &&
	       b->d_cache ? 0 : -1;
}

static void mla_post_teardown(struct mla_post_bench *b)
{
	cudaFree(b->d_src), cudaFree(b->d_q), cudaFree(b->d_w), cudaFree(b->d_inv);
	cudaFree(b->d_pos), cudaFree(b->d_slots), cudaFree(b->d_cache);
}

/* mla_post behind the norm, its cos/sin table before the PDL wait (the default) and
 * after it (mla_post_early 0). The source is only read, so the runs repeat one
 * computation. */
static void mla_post_time(int rows, const struct k_rope *rope)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning late = was;
	struct mla_post_bench b = { 0 };
	double base, early, after;

	if (mla_post_setup(&b, rows, rope)) {
		CHECK(0, "mla_post setup");
		mla_post_teardown(&b);
		return;
	}
	base = mla_post_after_norm_us(NULL);
	early = mla_post_after_norm_us(&b.a);
	late.mla_post_early = 0;
	k_cuda_tuning_set(&late);
	after = mla_post_after_norm_us(&b.a);
	k_cuda_tuning_set(&was);
	printf("%-14s yarn rows %2d H 16 nope 128 pe 64 lora 512 fused: after a %.1f us norm: "
	       "+%.1f us (table early), +%.1f us (after the wait); floor %.2f us\n",
	       "mla_post time", rows, base, early - base, after - base, bench_floor_us(b.bytes));
	mla_post_teardown(&b);
}

int main(void)
{
	const struct k_rope_params yarn = { .type = K_ROPE_YARN, .theta = 10000, .dim = 64,
		.factor = 40, .original_max_pos = 4096, .beta_fast = 32, .beta_slow = 1,
		.mscale = 1, .mscale_all_dim = 0.707, .truncate = 1 };
	struct k_rope rope;

	if (bench_begin("bench_cuda_ops"))
		return 77;
	CU(cudaStreamCreate(&stream));
	if (k_rope_init(&rope, &yarn)) {
		fprintf(stderr, "bench_cuda_ops: rope init\n");
		return 1;
	}
	for (int rows = 1; rows <= 64; rows *= 8)
		mla_post_time(rows, &rope);
	k_rope_fini(&rope);
	cudaStreamDestroy(stream);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_ops: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
