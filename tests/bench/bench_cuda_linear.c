/* Linear-layer benchmark on the GPU: for Llama-3.1-8B and DeepSeek-V2-Lite shapes and
 * M = 1..64, the variant k_cuda_linear picks beside cuBLAS, against the HBM floor.
 *
 * Timing: each sample replays a CUDA graph of L launches (as a decode step would) that
 * rotate over enough copies of the weights (>= ROTATE_BYTES) that none is still in the
 * 60 MB L2 when it is read again; the sample's event time / L is one launch; the
 * median of SAMPLES samples after warm-up is reported. Bytes = weights + x + y, each
 * once; floor = bytes / 4.25 TB/s (bench_floor_us: the measured H200 read bandwidth).
 * The cuBLAS column includes its x -> bf16 rounding launch: same inputs, same output.
 * The stream column forces the streaming kernel (its x rounding launch included), the
 * ring columns the ring kind (M <= 8: one launch) on each of its kernels
 * (KDEC_LINEAR_RING_STREAM): "ring qg" the decode GEMV, "ring qs" the cluster streaming
 * form of linear_qmma.cu (0 where it has no plan).
 * "us" has programmatic dependent launch on (each launch streams its weights while the
 * previous one drains, as kdec's own kernels allow), "us nopdl" has it off: a decode
 * step sees the first where the op before a linear layer triggers early too.
 * Usage: bench_cuda_linear [--quick]. Exits 77 without CUDA or GPU. */
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
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "tests/cudatest.h"
#include "tests/bench/cudabench.h"

#define ROTATE_BYTES	((size_t)256 << 20)	/* > 4x the L2 */
#define MAX_M		64

struct shape {
	const char *name;
	int N, K;
	int llama_layer;	/* one of the 4 linear layers of a Llama-3.1-8B block */
};

static const struct shape shapes[] = {
	{ "llama8b qkv", 6144, 4096, 1 },
	{ "llama8b o_proj", 4096, 4096, 1 },
	{ "llama8b gate_up", 28672, 4096, 1 },
	{ "llama8b down", 4096, 14336, 1 },
	{ "llama8b lm_head", 128256, 4096, 0 },
	{ "dsv2lite q/kv", 3072, 2048, 0 },
	{ "dsv2lite o_proj", 2048, 2048, 0 },
	{ "dsv2lite shared", 2816, 2048, 0 },
	{ "dsv2lite exp.down", 2048, 1408, 0 },
	{ "dsv2lite lm_head", 102400, 2048, 0 },
};
#define N_SHAPES (int)(sizeof(shapes) / sizeof(shapes[0]))

static const int all_ms[] = { 1, 2, 4, 8, 16, 32, 64 };
static const int quick_ms[] = { 1, 64 };
#define N_MS (int)(sizeof(all_ms) / sizeof(all_ms[0]))

static cudaStream_t stream;
static struct k_cuda_linear *lin;
#define SAMPLES_MAX 60
static int samples = SAMPLES_MAX;	/* --quick: 11 */

/* kind < 0: the variant k_cuda_linear picks; otherwise that one. */
static int run_kind(int kind, float *y, const float *x, const uint16_t *w, int M, int N, int K)
{
	return kind >= 0 ? k_cuda_linear_run_kind(lin, kind, y, x, w, M, N, K, 0)
			 : k_cuda_linear(lin, y, x, w, M, N, K, 0);
}

/* One call of linear_time_us's graph: weight copy i % copies. */
struct lin_call {
	int kind, M, N, K, copies;
	float *y;
	const float *x;
	const uint16_t *w;
};

static int lin_call_run(void *arg, int i, cudaStream_t s)
{
	const struct lin_call *c = arg;

	(void)s;	/* the context's own stream */
	return run_kind(c->kind, c->y, c->x, c->w + (size_t)(i % c->copies) * c->N * c->K, c->M,
			c->N, c->K);
}

/* Median µs of one launch; w holds `copies` weight matrices of N * K each. 0 after a
 * failed check. */
static double linear_time_us(int kind, float *y, const float *x, const uint16_t *w, int copies,
			     int M, int N, int K)
{
	struct lin_call c = { kind, M, N, K, copies, y, x, w };
	char what[96];

	snprintf(what, sizeof(what), "linear kind %d (M %d N %d K %d)", kind, M, N, K);
	return bench_rotated_us(lin_call_run, &c, stream, copies, 3, samples, what);
}

/* The ring kind on one of its kernels (KDEC_LINEAR_RING_STREAM: 0 the decode GEMV, 2 the
 * cluster streaming form); 0 past its rows, or where the streaming form has no plan. */
static double ring_time_us(int mode, float *y, const float *x, const uint16_t *w, int copies,
			   int M, int N, int K)
{
	struct k_cuda_tuning was = *k_cuda_tuning(), t = was;
	char desc[160];
	double us = 0;

	if (M > K_CUDA_LINEAR_RING_M)
		return 0;
	t.linear_ring_stream = mode;
	k_cuda_tuning_set(&t);
	k_cuda_linear_describe(lin, K_CUDA_LINEAR_RING, M, N, K, desc, sizeof(desc));
	if (!mode || !strncmp(desc, "qstream", 7))
		us = linear_time_us(K_CUDA_LINEAR_RING, y, x, w, copies, M, N, K);
	k_cuda_tuning_set(&was);
	return us;
}

/* linear_time_us with programmatic dependent launch off, then back on. */
static double time_us_nopdl(float *y, const float *x, const uint16_t *w, int copies, int M, int N,
			    int K)
{
	double us;

	k_cuda_linear_set_pdl(lin, 0);
	us = linear_time_us(-1, y, x, w, copies, M, N, K);
	k_cuda_linear_set_pdl(lin, 1);
	return us;
}

/* Random bf16 in [-1, 1) on the host, copied to every device copy. */
static uint16_t *weights_create(int N, int K, int copies)
{
	size_t wn = (size_t)N * K;
	uint16_t *h = malloc(wn * sizeof(uint16_t)), *d;
	unsigned long long s = 0x9e3779b97f4a7c15ull ^ wn;

	if (!h) {
		CHECK(0, "out of host memory");
		return NULL;
	}
	for (size_t i = 0; i < wn; i++)
		h[i] = k_f32_to_bf16(test_randf(&s));
	d = dalloc(wn * sizeof(uint16_t) * (size_t)copies);
	for (int c = 0; d && c < copies; c++)
		CU(cudaMemcpyAsync(d + (size_t)c * wn, h, wn * sizeof(uint16_t),
				   cudaMemcpyHostToDevice, stream));
	CU(cudaStreamSynchronize(stream));
	free(h);
	return d;
}

int main(int argc, char **argv)
{
	const int *ms = all_ms;
	int n_ms = N_MS;
	double llama_us[N_MS] = { 0 }, llama_cb[N_MS] = { 0 }, llama_floor[N_MS] = { 0 };
	double llama_st[N_MS] = { 0 };
	float *x, *y, *hx;

	if (argc > 1 && !strcmp(argv[1], "--quick")) {
		ms = quick_ms;
		n_ms = 2;
		samples = 11;
	}
	if (bench_begin("bench_cuda_linear"))
		return 77;
	printf("median of %d graph replays, weights rotated over >= %zu MB\n", samples,
	       ROTATE_BYTES >> 20);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	if (k_cuda_linear_create(&lin, stream, MAX_M, 16384)) {
		fprintf(stderr, "bench_cuda_linear: k_cuda_linear_create failed\n");
		return 1;
	}
	hx = malloc(sizeof(float) * MAX_M * 16384);
	for (size_t i = 0; i < (size_t)MAX_M * 16384; i++)
		hx[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
	x = dalloc(sizeof(float) * MAX_M * 16384);
	y = dalloc(sizeof(float) * MAX_M * 131072);
	if (!x || !y)
		return 1;
	CU(cudaMemcpyAsync(x, hx, sizeof(float) * MAX_M * 16384, cudaMemcpyHostToDevice, stream));
	CU(cudaStreamSynchronize(stream));
	free(hx);
	printf("%-17s %6s %5s %2s | %-6s %8s %6s %6s %8s | %8s %6s %6s | %8s %6s | %8s %6s | %8s "
	       "%6s | %8s %5s | %s\n", "shape", "N", "K", "M", "pick", "us", "TB/s", "floor%",
	       "us nopdl", "cublas", "TB/s", "floor%", "stream", "floor%", "ring qg", "floor%",
	       "ring qs", "floor%", "floor us", "x cb", "plan");
	for (int si = 0; si < N_SHAPES; si++) {
		const struct shape *s = &shapes[si];
		size_t wbytes = (size_t)s->N * s->K * 2;
		int copies = (int)((ROTATE_BYTES + wbytes - 1) / wbytes);
		uint16_t *w;

		copies = copies < 2 ? 2 : copies;
		if (!(w = weights_create(s->N, s->K, copies)))
			continue;
		for (int mi = 0; mi < n_ms; mi++) {
			int M = ms[mi];
			enum k_cuda_linear_kind kind = k_cuda_linear_pick(M, s->N, s->K);
			double bytes = (double)wbytes + 4.0 * M * s->K + 4.0 * M * s->N;
			double floor_us = bench_floor_us(bytes);
			double us = linear_time_us(-1, y, x, w, copies, M, s->N, s->K);
			double us_nopdl = time_us_nopdl(y, x, w, copies, M, s->N, s->K);
			double cb = linear_time_us(K_CUDA_LINEAR_CUBLAS, y, x, w, copies, M, s->N,
						   s->K);
			double st = linear_time_us(K_CUDA_LINEAR_STREAM, y, x, w, copies, M, s->N,
						   s->K);
			double rg = ring_time_us(0, y, x, w, copies, M, s->N, s->K);
			double rs = ring_time_us(2, y, x, w, copies, M, s->N, s->K);
			char plan[160];

			k_cuda_linear_describe(lin, kind, M, s->N, s->K, plan, sizeof(plan));
			printf("%-17s %6d %5d %2d | %-6s %8.2f %6.2f %5.1f%% %8.2f | %8.2f %6.2f %5.1f%% | "
			       "%8.2f %5.1f%% | %8.2f %5.1f%% | %8.2f %5.1f%% | %8.2f %5.2f | %s\n",
			       s->name, s->N, s->K, M, k_cuda_linear_kind_name(kind), us,
			       bytes / us / 1e6, 100.0 * floor_us / us, us_nopdl, cb, bytes / cb / 1e6,
			       100.0 * floor_us / cb, st, 100.0 * floor_us / st, rg,
			       rg > 0 ? 100.0 * floor_us / rg : 0.0, rs,
			       rs > 0 ? 100.0 * floor_us / rs : 0.0, floor_us, cb / us, plan);
			for (int a = 0; a < N_MS; a++) {
				if (all_ms[a] != M || !s->llama_layer)
					continue;
				llama_us[a] += us;
				llama_cb[a] += cb;
				llama_st[a] += st;
				llama_floor[a] += floor_us;
			}
		}
		CU(cudaFree(w));
	}
	printf("\nLlama-3.1-8B, the 4 linear layers of one block (qkv, o, gate_up, down), x 32 "
	       "blocks (lm_head not included):\n");
	for (int a = 0; a < N_MS; a++) {
		if (llama_us[a] == 0)
			continue;
		printf("  M=%-2d kdec %8.1f us  cublas %8.1f us  stream %8.1f us  floor %8.1f us  "
		       "(%.1f%% of floor; cublas %.1f%%, stream %.1f%%)\n", all_ms[a],
		       32 * llama_us[a], 32 * llama_cb[a], 32 * llama_st[a], 32 * llama_floor[a],
		       100.0 * llama_floor[a] / llama_us[a], 100.0 * llama_floor[a] / llama_cb[a],
		       100.0 * llama_floor[a] / llama_st[a]);
	}
	cudaFree(x);
	cudaFree(y);
	k_cuda_linear_destroy(lin);
	cudaStreamDestroy(stream);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_linear: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
