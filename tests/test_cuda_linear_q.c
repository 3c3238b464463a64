/* The quantized-weight GEMV (k_cuda_linear_q: fp8 block / channel / tensor scales,
 * int4 groups) against the CPU reference k_cpu_linear_q on random payloads and scales:
 * the vectorised path (K a multiple of 32) and the element-by-element one (odd K,
 * partial blocks and groups, misaligned x), M = 1..9, y = and y +=. Both compute in
 * fp32 from the same exact dequantized values, so rel L2 per row <= 1e-5. Then, at
 * Llama-3.1-8B's projection shapes, M = 1, the time per call and its share of the HBM
 * floor of the quantized bytes (printed, not judged). Exits 77 without a GPU. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "tests/cudatest.h"

#define HBM_TBS 4.25

static unsigned long long seed = 0x9e3779b97f4a7c15ull;
static struct k_pool *pool;
static cudaStream_t stream;

struct qcase {
	const char *what;
	enum k_qfmt fmt;
	int block_rows, block_cols;	/* 0: the whole dim */
	enum k_dtype scale_dtype;	/* as a checkpoint stores it */
};

/* A random weight (N, K) as q says: payload bytes, host scales in scale_dtype, the same
 * scales in fp32 for the device. */
static void make_weight(const struct qcase *c, int N, int K, struct k_quant *q, uint8_t **w,
			size_t *wbytes, void **hs, float **fs, size_t *ns)
{
	*q = (struct k_quant){ .fmt = c->fmt, .scale_dtype = c->scale_dtype,
			       .block_rows = c->block_rows ? c->block_rows : N,
			       .block_cols = c->block_cols ? c->block_cols : K };
	q->scale_cols = (K + q->block_cols - 1) / q->block_cols;
	*ns = (size_t)((N + q->block_rows - 1) / q->block_rows) * (size_t)q->scale_cols;
	*wbytes = (size_t)N * k_quant_row_bytes(c->fmt, K);
	*w = malloc(*wbytes);
	*hs = malloc(*ns * 4);
	*fs = malloc(*ns * 4);
	for (size_t i = 0; i < *wbytes; i++) {
		uint8_t b = (uint8_t)((test_randf(&seed) + 1.0f) * 127.99f);

		/* e4m3: no NaN (0x7f/0xff) */
		(*w)[i] = c->fmt == K_Q_FP8 && (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
	}
	for (size_t i = 0; i < *ns; i++) {
		float s = (0.5f + 0.5f * (test_randf(&seed) + 1.0f)) / sqrtf((float)K) *
			  (c->fmt == K_Q_FP8 ? 0.05f : 0.3f);

		if (c->scale_dtype == K_BF16) {
			((uint16_t *)*hs)[i] = k_f32_to_bf16(s);
			s = k_bf16_to_f32(((uint16_t *)*hs)[i]);
		} else {
			((float *)*hs)[i] = s;
		}
		(*fs)[i] = s;
	}
}

static void run_case(const struct qcase *c, int N, int K, int M, int accumulate, int misalign)
{
	struct k_quant q, dq;
	uint8_t *w;
	void *hs;
	float *fs, *x, *y0, *ref, *out, *dx, *dy, *dfs;
	size_t wbytes, ns, nx = (size_t)M * K + 4, ny = (size_t)M * N;
	void *dw;
	double worst = 0;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	x = test_rand_floats(nx, 1.0f, &seed);
	y0 = test_rand_floats(ny, 1.0f, &seed);
	ref = malloc(ny * sizeof(float));
	out = malloc(ny * sizeof(float));
	q.scale = hs;
	k_cpu_linear_q(pool, ref, x + misalign, w, K_BF16, &q, M, N, K);
	if (accumulate)
		for (size_t i = 0; i < ny; i++)
			ref[i] += y0[i];
	dw = dup_to_device(w, wbytes);
	dfs = dup_to_device(fs, ns * 4);
	dx = dup_to_device(x, nx * sizeof(float));
	dy = dup_to_device(y0, ny * sizeof(float));
	dq = q;
	dq.scale = dfs;
	dq.scale_dtype = K_F32;
	if (dw && dfs && dx && dy) {
		int ret = k_cuda_linear_q(stream, dy, dx + misalign, dw, &dq, M, N, K, accumulate);

		CHECK(ret == 0, "%s N %d K %d M %d: rc %d", c->what, N, K, M, ret);
		CU(cudaStreamSynchronize(stream));
		CU(cudaMemcpy(out, dy, ny * sizeof(float), cudaMemcpyDeviceToHost));
		for (int m = 0; m < M; m++) {
			double d = 0, r = 0;

			for (int n = 0; n < N; n++) {
				double e = out[(size_t)m * N + n] - ref[(size_t)m * N + n];

				d += e * e;
				r += (double)ref[(size_t)m * N + n] * ref[(size_t)m * N + n];
			}
			d = sqrt(d / (r > 0 ? r : 1));
			worst = test_err_max(worst, d);
		}
		CHECK(worst <= 1e-5, "%s N %d K %d M %d acc %d misalign %d (%s path): rel L2 %.3g",
		      c->what, N, K, M, accumulate, misalign,
		      k_cuda_linear_q_vector(&q, K) && !misalign ? "vector" : "generic", worst);
	}
	printf("  %-12s N %5d K %5d M %d acc %d %-7s rel L2 %.2e\n", c->what, N, K, M, accumulate,
	       k_cuda_linear_q_vector(&q, K) && !misalign ? "vector" : "generic", worst);
	cudaFree(dw);
	cudaFree(dfs);
	cudaFree(dx);
	cudaFree(dy);
	free(w);
	free(hs);
	free(fs);
	free(x);
	free(y0);
	free(ref);
	free(out);
}

static const struct qcase cases[] = {
	{ "fp8-block", K_Q_FP8, 128, 128, K_F32 },
	{ "fp8-channel", K_Q_FP8, 1, 0, K_BF16 },
	{ "fp8-tensor", K_Q_FP8, 0, 0, K_F32 },
	{ "int4-g32", K_Q_INT4, 1, 32, K_BF16 },
	{ "int4-g128", K_Q_INT4, 1, 128, K_BF16 },
};

static void bench(const struct qcase *c, int N, int K)
{
	struct k_quant q;
	uint8_t *w;
	void *hs, *dw;
	float *fs, *dfs, *dx, *dy;
	size_t wbytes, ns;
	cudaEvent_t e0, e1;
	float ms = 0;
	const int reps = 200;

	make_weight(c, N, K, &q, &w, &wbytes, &hs, &fs, &ns);
	dw = dup_to_device(w, wbytes);
	dfs = dup_to_device(fs, ns * 4);
	dx = dalloc((size_t)K * sizeof(float));
	dy = dalloc((size_t)N * sizeof(float));
	q.scale = dfs;
	q.scale_dtype = K_F32;
	cudaEventCreate(&e0);
	cudaEventCreate(&e1);
	if (dw && dfs && dx && dy) {
		double bytes = (double)wbytes + (double)ns * 4 + 4.0 * K + 4.0 * N, us;

		k_cuda_linear_q(stream, dy, dx, dw, &q, 1, N, K, 0);
		cudaEventRecord(e0, stream);
		for (int i = 0; i < reps; i++)
			k_cuda_linear_q(stream, dy, dx, dw, &q, 1, N, K, 0);
		cudaEventRecord(e1, stream);
		CU(cudaEventSynchronize(e1));
		cudaEventElapsedTime(&ms, e0, e1);
		us = ms * 1e3 / reps;
		printf("bench: %-10s N %5d K %5d M 1: %7.2f us, %6.1f MB, %5.2f TB/s, %4.0f%% of the floor "
		       "(%.2f us at %.2f TB/s)\n", c->what, N, K, us, bytes / 1e6, bytes / us / 1e6,
		       100 * bytes / (HBM_TBS * 1e6) / us, bytes / (HBM_TBS * 1e6), HBM_TBS);
	}
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	cudaFree(dw);
	cudaFree(dfs);
	cudaFree(dx);
	cudaFree(dy);
	free(w);
	free(hs);
	free(fs);
}

static void test_bad_args(void)
{
	struct k_quant q = { .fmt = K_Q_FP8, .scale_dtype = K_BF16, .block_rows = 1, .block_cols = 32,
			     .scale_cols = 1 };
	float f;

	q.scale = &f;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 1, 1, 32, 0) == -EINVAL, "bf16 scales refused");
	q.scale_dtype = K_F32;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 0, 1, 32, 0) == -EINVAL, "M 0 refused");
	q.fmt = K_Q_NONE;
	CHECK(k_cuda_linear_q(stream, &f, &f, &f, &q, 1, 1, 32, 0) == -EINVAL, "no format refused");
}

int main(void)
{
	static const int Ms[] = { 1, 2, 5, 9 };
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);

	if (!test_gpu_present("test_cuda_linear_q"))
		return 77;
	if (k_pool_create(&pool, cpus > 16 ? 16 : cpus > 0 ? (int)cpus : 1)) {
		fprintf(stderr, "FATAL: k_pool_create\n");
		return 1;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	test_bad_args();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		for (size_t j = 0; j < sizeof(Ms) / sizeof(Ms[0]); j++) {
			run_case(&cases[i], 300, 512, Ms[j], (int)(j & 1), 0);	/* vector */
			run_case(&cases[i], 77, 200, Ms[j], (int)(j & 1), 0);	/* generic: K % 32 */
			run_case(&cases[i], 130, 384, Ms[j], 0, 1);		/* generic: x misaligned */
		}
		run_case(&cases[i], 1000, 4096, 1, 0, 0);
	}
	if (!test_env_flag("KD_TEST_QUICK")) {
		static const int shapes[][2] = { { 4096, 4096 }, { 1024, 4096 }, { 14336, 4096 },
						 { 4096, 14336 } };

		for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
			for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
				bench(&cases[i], shapes[s][0], shapes[s][1]);
	}
	cudaStreamDestroy(stream);
	k_pool_destroy(pool);
	return test_result("test_cuda_linear_q");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_linear_q: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
