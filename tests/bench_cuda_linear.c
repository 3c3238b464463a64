/* Linear-layer benchmark on the GPU: for Llama-3.1-8B and DeepSeek-V2-Lite shapes and
 * M = 1..64, the variant k_cuda_linear picks beside cuBLAS, against the HBM floor.
 *
 * Timing: each sample replays a CUDA graph of L launches (as a decode step would) that
 * rotate over enough copies of the weights (>= ROTATE_BYTES) that none is still in the
 * 60 MB L2 when it is read again; the sample's event time / L is one launch; the
 * median of SAMPLES samples after warm-up is reported. Bytes = weights + x + y, each
 * once; floor = bytes / 4.25 TB/s (the measured H200 read bandwidth, DEVICE.md).
 * The cuBLAS column includes its x -> bf16 rounding launch: same inputs, same output.
 * The stream column forces the streaming kernel (its x rounding launch included).
 * "us" has programmatic dependent launch on (each launch streams its weights while the
 * previous one drains, as kdec's own kernels allow), "us nopdl" has it off: a decode
 * step sees the first where the op before a linear layer triggers early too.
 * Usage: bench_cuda_linear [--quick]. Exits 77 without CUDA or GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/linear/k_cuda_linear.h"

#define HBM_BYTES_PER_S	4.25e12
#define ROTATE_BYTES	((size_t)256 << 20)	/* > 4x the L2 */
#define MIN_LAUNCHES	20			/* per graph replay */
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
static int samples = 60;

#define CUDA_OK(call)                                                                   \
	do {                                                                            \
		cudaError_t e_ = (call);                                                \
		if (e_ != cudaSuccess) {                                                \
			fprintf(stderr, "FATAL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
				cudaGetErrorString(e_));                                \
			exit(1);                                                        \
		}                                                                       \
	} while (0)

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;

	return x < y ? -1 : x > y;
}

/* kind < 0: the variant k_cuda_linear picks; otherwise that one. */
static int run(int kind, float *y, const float *x, const uint16_t *w, int M, int N, int K)
{
	return kind >= 0 ? k_cuda_linear_run_kind(lin, kind, y, x, w, M, N, K, 0)
			 : k_cuda_linear(lin, y, x, w, M, N, K, 0);
}

/* Median µs of one launch; w holds `copies` weight matrices of N * K each. */
static double time_us(int kind, float *y, const float *x, const uint16_t *w, int copies,
		      int M, int N, int K)
{
	int launches = copies < MIN_LAUNCHES ? (MIN_LAUNCHES + copies - 1) / copies * copies : copies;
	size_t wn = (size_t)N * K;
	cudaGraph_t graph;
	cudaGraphExec_t exec;
	cudaEvent_t t0, t1;
	float *ms = malloc(sizeof(float) * (size_t)samples), med;

	for (int i = 0; i < 3; i++)	/* kernels load, cuBLAS picks, outside capture */
		if (run(kind, y, x, w + (size_t)(i % copies) * wn, M, N, K)) {
			fprintf(stderr, "FATAL: linear failed (M %d N %d K %d)\n", M, N, K);
			exit(1);
		}
	CUDA_OK(cudaStreamSynchronize(stream));
	CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
	for (int i = 0; i < launches; i++)
		if (run(kind, y, x, w + (size_t)(i % copies) * wn, M, N, K)) {
			fprintf(stderr, "FATAL: linear failed in capture (M %d N %d K %d)\n", M, N, K);
			exit(1);
		}
	CUDA_OK(cudaStreamEndCapture(stream, &graph));
	CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
	CUDA_OK(cudaEventCreate(&t0));
	CUDA_OK(cudaEventCreate(&t1));
	CUDA_OK(cudaGraphLaunch(exec, stream));	/* warm-up */
	for (int s = 0; s < samples; s++) {
		CUDA_OK(cudaEventRecord(t0, stream));
		CUDA_OK(cudaGraphLaunch(exec, stream));
		CUDA_OK(cudaEventRecord(t1, stream));
		CUDA_OK(cudaEventSynchronize(t1));
		CUDA_OK(cudaEventElapsedTime(&ms[s], t0, t1));
	}
	qsort(ms, (size_t)samples, sizeof(float), cmp_float);
	med = ms[samples / 2];
	free(ms);
	cudaEventDestroy(t0);
	cudaEventDestroy(t1);
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	return (double)med * 1000.0 / launches;
}

/* time_us with programmatic dependent launch off, then back on. */
static double time_us_nopdl(float *y, const float *x, const uint16_t *w, int copies, int M, int N,
			    int K)
{
	double us;

	k_cuda_linear_set_pdl(lin, 0);
	us = time_us(-1, y, x, w, copies, M, N, K);
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
		fprintf(stderr, "FATAL: out of host memory\n");
		exit(1);
	}
	for (size_t i = 0; i < wn; i++) {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		h[i] = k_f32_to_bf16((float)((s >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f);
	}
	CUDA_OK(cudaMalloc((void **)&d, wn * sizeof(uint16_t) * (size_t)copies));
	for (int c = 0; c < copies; c++)
		CUDA_OK(cudaMemcpyAsync(d + (size_t)c * wn, h, wn * sizeof(uint16_t),
					cudaMemcpyHostToDevice, stream));
	CUDA_OK(cudaStreamSynchronize(stream));
	free(h);
	return d;
}

int main(int argc, char **argv)
{
	const int *ms = all_ms;
	int n_ms = N_MS, count = 0, major, minor;
	double llama_us[N_MS] = { 0 }, llama_cb[N_MS] = { 0 }, llama_floor[N_MS] = { 0 };
	double llama_st[N_MS] = { 0 };
	float *x, *y, *hx;
	char name[128];
	double gib;

	if (argc > 1 && !strcmp(argv[1], "--quick")) {
		ms = quick_ms;
		n_ms = 2;
		samples = 11;
	}
	k_cuda_device_count(&count);
	if (count == 0) {
		fprintf(stderr, "bench_cuda_linear: needs a CUDA device; none on this machine\n");
		return 77;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor) == 0)
		printf("device 0: %s, %.1f GiB, sm_%d%d; floor at %.2f TB/s; median of %d graph "
		       "replays, weights rotated over >= %zu MB\n", name, gib, major, minor,
		       HBM_BYTES_PER_S / 1e12, samples, ROTATE_BYTES >> 20);
	CUDA_OK(cudaSetDevice(0));
	CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	if (k_cuda_linear_create(&lin, stream, MAX_M, 16384)) {
		fprintf(stderr, "FATAL: k_cuda_linear_create\n");
		return 1;
	}
	hx = malloc(sizeof(float) * MAX_M * 16384);
	for (size_t i = 0; i < (size_t)MAX_M * 16384; i++)
		hx[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
	CUDA_OK(cudaMalloc((void **)&x, sizeof(float) * MAX_M * 16384));
	CUDA_OK(cudaMalloc((void **)&y, sizeof(float) * MAX_M * 131072));
	CUDA_OK(cudaMemcpyAsync(x, hx, sizeof(float) * MAX_M * 16384, cudaMemcpyHostToDevice, stream));
	CUDA_OK(cudaStreamSynchronize(stream));
	free(hx);
	printf("%-17s %6s %5s %2s | %-6s %8s %6s %6s %8s | %8s %6s %6s | %8s %6s | %8s %5s | %s\n",
	       "shape", "N", "K", "M", "pick", "us", "TB/s", "floor%", "us nopdl", "cublas", "TB/s",
	       "floor%", "stream", "floor%", "floor us", "x cb", "plan");
	for (int si = 0; si < N_SHAPES; si++) {
		const struct shape *s = &shapes[si];
		size_t wbytes = (size_t)s->N * s->K * 2;
		int copies = (int)((ROTATE_BYTES + wbytes - 1) / wbytes);
		uint16_t *w;

		copies = copies < 2 ? 2 : copies;
		w = weights_create(s->N, s->K, copies);
		for (int mi = 0; mi < n_ms; mi++) {
			int M = ms[mi];
			enum k_cuda_linear_kind kind = k_cuda_linear_pick(M, s->N, s->K);
			double bytes = (double)wbytes + 4.0 * M * s->K + 4.0 * M * s->N;
			double floor_us = bytes / HBM_BYTES_PER_S * 1e6;
			double us = time_us(-1, y, x, w, copies, M, s->N, s->K);
			double us_nopdl = time_us_nopdl(y, x, w, copies, M, s->N, s->K);
			double cb = time_us(K_CUDA_LINEAR_CUBLAS, y, x, w, copies, M, s->N, s->K);
			double st = time_us(K_CUDA_LINEAR_STREAM, y, x, w, copies, M, s->N, s->K);
			char plan[160];

			k_cuda_linear_describe(lin, kind, M, s->N, s->K, plan, sizeof(plan));
			printf("%-17s %6d %5d %2d | %-6s %8.2f %6.2f %5.1f%% %8.2f | %8.2f %6.2f %5.1f%% | "
			       "%8.2f %5.1f%% | %8.2f %5.2f | %s\n", s->name, s->N, s->K, M,
			       k_cuda_linear_kind_name(kind), us, bytes / us / 1e6, 100.0 * floor_us / us,
			       us_nopdl, cb, bytes / cb / 1e6, 100.0 * floor_us / cb, st,
			       100.0 * floor_us / st, floor_us, cb / us, plan);
			for (int a = 0; a < N_MS; a++) {
				if (all_ms[a] != M || !s->llama_layer)
					continue;
				llama_us[a] += us;
				llama_cb[a] += cb;
				llama_st[a] += st;
				llama_floor[a] += floor_us;
			}
		}
		CUDA_OK(cudaFree(w));
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
	return 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_linear: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
