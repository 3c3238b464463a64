/* k_cuda_topk_slice (kernels/cuda/comm/topk_slice.cu) against kernels/cpu/sample.c's
 * selection: for every row, the best min(64, non-NaN) (value, v0 + id) pairs by
 * k_cpu_sample_top_k(row, vn, 64), ids ascending, values the row's own bits (-0 stays
 * -0), the count, and NaN / -1 in the slots past it: bit for bit, no tolerance (a
 * selection has no arithmetic).
 * Rows: spread logits (distinct), a pool of few values (ties everywhere: -1, +-0, 2,
 * 1e30, NaN, +-inf), one value repeated, fewer than 64 non-NaN values, all NaN, all
 * -inf, and values rounded to a few bits (long runs of ties across chunks); vn from 1
 * to K_CUDA_TOPK_SLICE_MAX_VN, one chunk (<= 4096) and many, rows 1..64, v0 offsets.
 * Both histogram forms (k_cuda_tuning()->topk_match 1 and 0: the same bits). Then the
 * two launches captured in a CUDA graph, replayed on fresh inputs; the refusals (one
 * line each, nothing launched). KD_TEST_QUICK=1: a few small shapes (for
 * compute-sanitizer). Skips (77) without CUDA or a GPU. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include "kernels/cpu/k_cpu_sample.h"
#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "tests/cudatest.h"

#define K K_CUDA_TOPK_SLICE_K
#define N_KINDS 8

static unsigned long long seed;
static cudaStream_t stream;

/* Row r of vn values of kind (r + salt) % N_KINDS. */
static void make_row(float *l, int vn, int kind)
{
	static const float pool[] = { -1.0f, 0.0f, -0.0f, 2.0f, 2.0f, 1e30f, NAN, INFINITY,
				      -INFINITY };

	for (int i = 0; i < vn; i++) {
		float a = test_randf(&seed);

		switch (kind) {
		case 0: l[i] = a * 8; break;	/* distinct */
		case 1: l[i] = pool[test_rand_int(0, 8, &seed)]; break;
		case 2: l[i] = 1.5f; break;	/* one value: the lowest ids win */
		case 3: l[i] = a < 0.9f ? NAN : a * 4; break;	/* few non-NaN */
		case 4: l[i] = NAN; break;
		case 5: l[i] = -INFINITY; break;
		case 6: l[i] = roundf(a * 3) / 2; break;	/* 7 values, runs of ties */
		default: l[i] = a < 0.5f ? -0.0f : a < 0.8f ? 0.0f : -a; break;	/* +-0 ties */
		}
	}
	if (kind == 0 && vn > 8)	/* a clear best near the end, a few sprinkled */
		for (int k = 0; k < 4; k++)
			l[vn - 1 - test_rand_int(0, 7, &seed)] = 20 + (float)k;
	if (kind == 3 && vn > 2)
		l[test_rand_int(0, vn - 1, &seed)] = -INFINITY;
}

/* The expected result row: count, values, ids (v0 added), ascending. */
static int reference(const float *l, int vn, int v0, float *v, int32_t *id)
{
	int m = k_cpu_sample_top_k(l, vn, K, id);

	for (int a = 1; a < m; a++)
		for (int b = a; b > 0 && id[b - 1] > id[b]; b--) {
			int32_t t = id[b];

			id[b] = id[b - 1];
			id[b - 1] = t;
		}
	for (int j = 0; j < m; j++) {
		v[j] = l[id[j]];
		id[j] += v0;
	}
	return m;
}

/* got (the kernel's (2K + 1, rows) words) against the reference of each row of h. */
static int compare(const uint32_t *got, const float *h, int rows, int vn, int v0, const char *what)
{
	int bad = 0;

	for (int r = 0; r < rows; r++) {
		float wv[K], gv;
		int32_t wi[K], gi, gm;
		int m = reference(h + (size_t)r * vn, vn, v0, wv, wi), row_bad = 0;

		memcpy(&gm, &got[(size_t)2 * rows * K + r], sizeof(gm));
		row_bad |= gm != m;
		for (int j = 0; j < K; j++) {
			uint32_t nan = 0x7fc00000u;

			memcpy(&gv, &got[(size_t)r * K + j], sizeof(gv));
			memcpy(&gi, &got[(size_t)rows * K + (size_t)r * K + j], sizeof(gi));
			if (j < m)
				row_bad |= memcmp(&gv, &wv[j], sizeof(gv)) || gi != wi[j];
			else
				row_bad |= memcmp(&gv, &nan, sizeof(gv)) || gi != -1;
		}
		if (row_bad && bad++ < 3)
			fprintf(stderr, "  %s: row %d of %d (vn %d, v0 %d): count %d want %d\n", what,
				r, rows, vn, v0, gm, m);
	}
	return bad;
}

/* One launch of rows x vn on the test's stream, checked. */
static int case_shape(int rows, int vn, int v0, int salt)
{
	const size_t e = (size_t)rows * vn, words = (size_t)(2 * K + 1) * rows;
	size_t ws_bytes = k_cuda_topk_slice_ws_bytes(rows, vn);
	float *h = malloc(e * sizeof(float)), *d;
	uint32_t *got = malloc(words * sizeof(uint32_t)), *dtop = dalloc(words * sizeof(uint32_t));
	void *ws = ws_bytes ? dalloc(ws_bytes) : NULL;
	char what[64];
	int bad = 0;

	for (int r = 0; r < rows; r++)
		make_row(h + (size_t)r * vn, vn, (r + salt) % N_KINDS);
	d = dup_to_device(h, e * sizeof(float));
	if (ws)
		poison(ws, ws_bytes);
	poison(dtop, words * sizeof(uint32_t));
	CU(cudaDeviceSynchronize());	/* the legacy stream's memsets before the launch */
	snprintf(what, sizeof(what), "%d x %d", rows, vn);
	CHECK(k_cuda_topk_slice(stream, dtop, ws, ws_bytes, d, rows, vn, v0) == 0, "topk_slice %s", what);
	if (CU(cudaStreamSynchronize(stream)) && to_host(got, dtop, words * sizeof(uint32_t)))
		bad = compare(got, h, rows, vn, v0, what);
	CHECK(bad == 0, "topk_slice %s from %d: %d rows differ from k_cpu_sample_top_k", what, v0, bad);
	cudaFree(d);
	cudaFree(dtop);
	cudaFree(ws);
	free(got);
	free(h);
	return rows;
}

/* The launches (two: vn > 4096) captured once and replayed on fresh rows written into
 * the same input buffer: every replay's result as the reference. */
static void case_graph(int rows, int vn)
{
	const size_t e = (size_t)rows * vn, words = (size_t)(2 * K + 1) * rows;
	size_t ws_bytes = k_cuda_topk_slice_ws_bytes(rows, vn);
	float *h = malloc(e * sizeof(float)), *d = dalloc(e * sizeof(float));
	uint32_t *got = malloc(words * sizeof(uint32_t)), *dtop = dalloc(words * sizeof(uint32_t));
	void *ws = dalloc(ws_bytes);
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	int bad = 0, ret = -1;

	CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
	ret = k_cuda_topk_slice(stream, dtop, ws, ws_bytes, d, rows, vn, 7);
	CU(cudaStreamEndCapture(stream, &graph));
	CHECK(ret == 0 && graph, "topk_slice: capture of %d x %d", rows, vn);
	if (graph && CU(cudaGraphInstantiate(&exec, graph, 0))) {
		for (int rep = 0; rep < 4; rep++) {
			for (int r = 0; r < rows; r++)
				make_row(h + (size_t)r * vn, vn, (r + rep) % N_KINDS);
			CU(cudaMemcpyAsync(d, h, e * sizeof(float), cudaMemcpyHostToDevice, stream));
			poison(dtop, words * sizeof(uint32_t));
			CU(cudaDeviceSynchronize());
			CU(cudaGraphLaunch(exec, stream));
			if (CU(cudaStreamSynchronize(stream)) && to_host(got, dtop, words * sizeof(uint32_t)))
				bad += compare(got, h, rows, vn, 7, "graph replay");
		}
		cudaGraphExecDestroy(exec);
	}
	if (graph)
		cudaGraphDestroy(graph);
	CHECK(bad == 0, "topk_slice: graph of %d x %d: %d rows differ over 4 replays", rows, vn, bad);
	fprintf(stderr, "test_cuda_topk_slice: a graph of %d x %d replayed on 4 fresh inputs\n", rows, vn);
	cudaFree(d);
	cudaFree(dtop);
	cudaFree(ws);
	free(got);
	free(h);
}

/* Bad arguments: -EINVAL and nothing launched (one line each on stderr). */
static void case_refusals(void)
{
	float *d = dalloc(sizeof(float) * 8192);
	uint32_t *dtop = dalloc(sizeof(uint32_t) * (2 * K + 1));
	size_t ws = k_cuda_topk_slice_ws_bytes(1, 8192);

	CHECK(ws > 0 && k_cuda_topk_slice_ws_bytes(1, 4096) == 0 &&
	      k_cuda_topk_slice_ws_bytes(0, 8192) == 0, "topk_slice: workspace sizes");
	CHECK(k_cuda_topk_slice(stream, NULL, NULL, 0, d, 1, 8, 0) == -EINVAL, "NULL top refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, 0, NULL, 1, 8, 0) == -EINVAL, "NULL logits refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, 0, d, 0, 8, 0) == -EINVAL, "0 rows refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, 0, d, 1, 0, 0) == -EINVAL, "0 values refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, 0, d, 1, 8, -1) == -EINVAL, "v0 < 0 refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, 0, d, 1, K_CUDA_TOPK_SLICE_MAX_VN + 1, 0) == -EINVAL,
	      "vn past the largest refused");
	CHECK(k_cuda_topk_slice(stream, dtop, NULL, ws, d, 1, 8192, 0) == -EINVAL, "NULL workspace refused");
	CHECK(k_cuda_topk_slice(stream, dtop, d, ws - 1, d, 1, 8192, 0) == -EINVAL,
	      "short workspace refused");
	CU(cudaStreamSynchronize(stream));
	cudaFree(d);
	cudaFree(dtop);
}

/* The histograms' form: one atomic per warp's digit (1, the default) or per item. */
static void set_match(int match)
{
	struct k_cuda_tuning t;

	k_cuda_tuning_defaults(&t);
	t.topk_match = match;
	k_cuda_tuning_set(&t);
}

static void run_full(void)
{
	static const int vns[] = { 1, 2, 7, 63, 64, 65, 100, 4095, 4096, 4097, 8191, 12289,
				   32000, 64128, 76032, 151936, 160000, K_CUDA_TOPK_SLICE_MAX_VN };
	static const int rowss[] = { 1, 3, 8, 64 };
	int rows = 0, shapes = 0;

	for (size_t a = 0; a < sizeof(vns) / sizeof(vns[0]); a++)
		for (size_t b = 0; b < sizeof(rowss) / sizeof(rowss[0]); b++) {
			int n = rowss[b], v0 = (int)(a * 4 + b) % 3 == 0 ? 0 : (int)(a * 977 + b * 31);

			if ((size_t)n * vns[a] > (size_t)16 << 20)	/* 64 rows of the largest: 8 */
				n = 8;
			rows += case_shape(n, vns[a], v0, (int)(a + b));
			shapes++;
		}
	rows += case_shape(5, 9000, 2147483647 - 9000, 3);	/* the last ids int32 holds */
	fprintf(stderr, "test_cuda_topk_slice: %d rows of %d shapes (every kind of row) as "
		"k_cpu_sample_top_k, bit for bit\n", rows, shapes + 1);
	set_match(0);	/* an atomic an item: the same selection */
	rows = 0;
	for (size_t a = 0; a < sizeof(vns) / sizeof(vns[0]); a += 2)
		rows += case_shape(8, vns[a], 11, (int)a);
	set_match(1);
	fprintf(stderr, "test_cuda_topk_slice: %d rows with topk_match 0 (an atomic an item) as "
		"k_cpu_sample_top_k, bit for bit\n", rows);
	case_graph(8, 40000);
	case_graph(3, 1000);
}

int main(void)
{
	if (!test_gpu_present("test_cuda_topk_slice"))
		return 77;
	seed = test_seed();
	fprintf(stderr, "test_cuda_topk_slice: seed %llu\n", seed);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	if (getenv("KD_TEST_QUICK") && atoi(getenv("KD_TEST_QUICK"))) {
		case_shape(3, 100, 5, 0);
		case_shape(9, 9000, 0, 1);	/* two launches, every kind of row */
		set_match(0);
		case_shape(9, 9000, 0, 2);
		set_match(1);
		case_graph(2, 5000);
	} else {
		run_full();
	}
	case_refusals();
	cudaStreamDestroy(stream);
	return test_result("test_cuda_topk_slice");
}

#else
int main(void)
{
	fprintf(stderr, "test_cuda_topk_slice: skipped: built without CUDA\n");
	return 77;
}
#endif
