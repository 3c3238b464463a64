/* MoE experts benchmark on the GPU: DeepSeek-V2-Lite's and Qwen3-30B-A3B's routed
 * experts at M 1, 2, 4, 8, 32 and 64 on each path (small, grouped, auto), with the
 * small path's variants (prefetch ahead; the general kernels at M 1) and fused with
 * the shared expert and the residual add (k_cuda_moe_experts_add), each beside the HBM
 * floor of the used experts' weights. The checks of the same kernels: test_cuda_moe.
 * Usage: bench_cuda_moe. Exits 77 without CUDA or a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "tests/cudatest.h"
#include "tests/moetest.h"
#include "tests/bench/cudabench.h"

static unsigned long long seed = 0x3c0ffee5ull;
static cudaStream_t stream;

/* Informational, no pass/fail: one call's time (median of 20 after warm-up) with
 * every expert in its own memory, against the bytes of the used experts' weights at
 * the HBM floor (bench_floor_us). si >= 0: k_cuda_moe_experts_add with a
 * shared expert that wide (0: none), its weights counted too. */
static void time_experts(const struct moe_shape *s, int M, enum k_cuda_moe_path path, int si)
{
	size_t per = (size_t)s->hidden * s->inter, nk = (size_t)M * s->top_k;
	uint16_t *one = malloc(sizeof(uint16_t) * per), *all;
	const uint16_t **table = malloc(sizeof(*table) * (size_t)s->n_experts * 3);
	float *x = malloc(sizeof(float) * (size_t)M * s->hidden), *wts = malloc(sizeof(float) * nk);
	int32_t *ids = malloc(sizeof(int32_t) * nk);
	unsigned char *used = calloc((size_t)s->n_experts, 1);
	struct k_cuda_moe_ws *ws;
	cudaEvent_t ev[21];
	float ms[20], med;
	void *dtable, *dx, *dw, *dids, *dout;
	double bytes = 0;
	int n_rec = 0;	/* events recorded */
	size_t sn = (size_t)s->hidden * (size_t)(si > 0 ? si : 1);
	uint16_t *dsh = dalloc(sizeof(uint16_t) * 3 * sn);
	struct k_cuda_moe_shared sh = { dsh, dsh + sn, dsh + 2 * sn, si };

	CU(cudaMemset(dsh, 0, sizeof(uint16_t) * 3 * sn));
	if (k_cuda_moe_ws_create(&ws, M, s->top_k, s->n_experts, s->hidden, s->inter,
				 si > 0 ? si : 0)) {
		cudaFree(dsh);
		return;
	}
	for (size_t i = 0; i < per; i++)
		one[i] = k_f32_to_bf16(test_randf(&seed) * 0.05f);
	all = dalloc(sizeof(uint16_t) * per * 3 * (size_t)s->n_experts);
	for (int e = 0; e < 3 * s->n_experts; e++) {
		CU(cudaMemcpy(all + per * e, one, sizeof(uint16_t) * per, cudaMemcpyHostToDevice));
		table[e] = all + per * e;
	}
	for (size_t i = 0; i < (size_t)M * s->hidden; i++)
		x[i] = test_randf(&seed);
	moe_make_ids(ids, wts, M, s, -1, &seed);
	for (size_t i = 0; i < nk; i++)
		used[ids[i]] = 1;
	for (int e = 0; e < s->n_experts; e++)
		bytes += used[e] ? 3.0 * 2 * (double)per : 0;
	bytes += si > 0 ? 3.0 * 2 * (double)sn : 0;
	dtable = dup_to_device(table, sizeof(*table) * (size_t)s->n_experts * 3);
	dx = dup_to_device(x, sizeof(float) * (size_t)M * s->hidden);
	dw = dup_to_device(wts, sizeof(float) * nk);
	dids = dup_to_device(ids, sizeof(int32_t) * nk);
	dout = dalloc(sizeof(float) * (size_t)M * s->hidden);
	for (int i = 0; i < 21; i++)
		CU(cudaEventCreate(&ev[i]));
	CU(cudaMemset(dout, 0, sizeof(float) * (size_t)M * s->hidden));
	moe_set_path(path);
	for (int i = 0; i < 23; i++) {
		if (si < 0)
			k_cuda_moe_experts(stream, ws, dout, dx, M, dids, dw, s->top_k, dtable,
					   s->n_experts, s->hidden, s->inter);
		else if (k_cuda_moe_experts_add(stream, ws, dout, dx, M, dids, dw, s->top_k, dtable,
						s->n_experts, s->hidden, s->inter,
						si > 0 ? &sh : NULL))
			break;	/* declined or failed: no time to show */
		if (i >= 2)
			CU(cudaEventRecord(ev[i - 2], stream));
		n_rec = i - 1;
	}
	if (n_rec < 21) {
		printf("experts_add time %-7s %-28s M %2d: declined\n", moe_path_name(path), s->name, M);
		goto out;
	}
	CU(cudaEventSynchronize(ev[20]));
	for (int i = 0; i < 20; i++)
		CU(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
	med = test_median(ms, 20);
	printf("%s time %-7s %-28s M %2d shared %4d: %3.0f MB of weights, %7.1f us = %.2f TB/s "
	       "(floor %.1f us at 4.25 TB/s: %.0f%%)\n", si < 0 ? "moe_experts" : "experts_add",
	       moe_path_name(path), s->name, M, si > 0 ? si : 0, bytes / 1e6,
	       med * 1e3,
	       bytes / (med * 1e-3) / 1e12, bench_floor_us(bytes),
	       100 * bench_floor_us(bytes) / (med * 1e3));
out:
	CU(cudaStreamSynchronize(stream));
	for (int i = 0; i < 21; i++)
		cudaEventDestroy(ev[i]);
	cudaFree(all);
	cudaFree(dtable);
	cudaFree(dx);
	cudaFree(dw);
	cudaFree(dids);
	cudaFree(dout);
	cudaFree(dsh);
	k_cuda_moe_ws_destroy(ws);
	free(one);
	free(table);
	free(x);
	free(wts);
	free(ids);
	free(used);
}

/* Each path at M 1..8, the small path's variants, then auto at 32 and 64 rows. */
static void bench_shape(const struct moe_shape *s, int shared)
{
	for (int m = 0; m < 4; m++) {
		int M = (int[]){ 1, 2, 4, 8 }[m];

		time_experts(s, M, K_CUDA_MOE_PATH_SMALL, -1);
		moe_set_prefetch_ahead(1);
		printf("(prefetch ahead)\n");
		time_experts(s, M, K_CUDA_MOE_PATH_SMALL, -1);
		moe_set_prefetch_ahead(-1);
		time_experts(s, M, K_CUDA_MOE_PATH_GROUPED, -1);
		time_experts(s, M, K_CUDA_MOE_PATH_SMALL, shared);	/* fused */
		if (M == 1) {	/* the above took moe_small_m1.cu's kernels */
			moe_set_m1(0);
			printf("(general kernels at M 1)\n");
			time_experts(s, M, K_CUDA_MOE_PATH_SMALL, shared);
			moe_set_m1(-1);
		}
		moe_set_prefetch_ahead(1);
		printf("(prefetch ahead)\n");
		time_experts(s, M, K_CUDA_MOE_PATH_SMALL, shared);
		moe_set_prefetch_ahead(-1);
	}
	time_experts(s, 32, K_CUDA_MOE_PATH_AUTO, -1);
	time_experts(s, 64, K_CUDA_MOE_PATH_AUTO, -1);
}

int main(void)
{
	static const struct moe_shape v2lite = { "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 },
		qwen3 = { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 };

	if (bench_begin("bench_cuda_moe"))
		return 77;
	CU(cudaStreamCreate(&stream));
	bench_shape(&v2lite, 2816);	/* its shared expert: 2 x 1408 */
	bench_shape(&qwen3, 0);		/* none */
	k_cuda_tuning_set(NULL);
	cudaStreamDestroy(stream);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_moe: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
