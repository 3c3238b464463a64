/* MoE experts benchmark on the GPU: DeepSeek-V2-Lite's and Qwen3-30B-A3B's routed
 * experts at M 1, 2, 4, 8, 32 and 64 on each path (small, grouped, auto), with the
 * small path's variant (the general kernels at M 1) and fused with
 * the shared expert and the residual add (k_cuda_moe_experts_add), each beside the HBM
 * floor of the used experts' weights. The checks of the same kernels: test_cuda_moe.
 * Then the whole MoE layer from the normed x to the residual ("moe_lat" lines), Qwen3,
 * V2-Lite, DeepSeek-V3 and Kimi-K2 at M 1 and 8: the standard path's four launches
 * (router GEMV, moe_route, the small path's gate/up and down) against the latency
 * path's two (k_cuda_moe_lat), each a CUDA graph replayed behind an L2 flush, beside
 * the floor of the router, the chosen experts and the shared expert (test_cuda_moe_lat
 * checks those kernels). Then ("moe_q" lines) the routed experts bf16, fp8 128 x 128
 * and int4 g32 (k_cuda_moe_experts_q) at the four models' shapes, M 1, 2, 4, 8, 64 and 256,
 * beside the floor of their bytes as stored (test_cuda_moe_q checks those kernels); on the
 * auto path with the tile kernels off ("small" up to 64 pairs, else "grouped":
 * expert_mma_kernel), then the grouped path on moe_qtile.cu's tile kernels at every M
 * ("qtile", KDEC_MOE_QTILE_ROWS set to the call's rows; from 64 rows also in their wide
 * passes, "qtile-wide", KDEC_MOE_QTILE_WIDE 1, the other line then with it 0), and
 * quantized experts at M <= 8 on moe_qgemv.cu's GEMVs over the chosen experts' union
 * ("qgemv", gate/up a CTA an item, KDEC_MOE_QGEMV_PERSIST 0; "small" is then the small
 * path's own kernels, KDEC_MOE_QGEMV_ROWS 0; "qgemv-p" with the persistent
 * gate/up where it differs, KDEC_MOE_QGEMV_PERSIST 1, the default).
 * "route" lines: the routing alone at decode, 32 layers of the router GEMV, of the GEMV
 * then moe_route, and of moe_route alone, each one graph, per layer.
 * Usage: bench_cuda_moe [lat | route | q [SHAPE [M [FORMAT]]]] (only those lines; q: only the
 * shapes whose name contains SHAPE, M rows (0: all; another, 1..4096, that M alone: a
 * prefill chunk's), FORMAT bf16, fp8-block or int4-g32; for ncu; SHAPE "kimi-k2-" adds
 * Kimi-K2's 8 chosen experts alone in memory and as 8 of 16 and of 64, against the 8 of
 * 384 spread over 17 GB of "kimi-k2"). BENCH_MOE_FILL=const fills the "moe_q" experts
 * with a byte pattern instead of random values of their format; BENCH_MOE_HOT=1 routes
 * every row's first slot to one expert.
 * Exits 77 without CUDA or a GPU. */
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
		time_experts(s, M, K_CUDA_MOE_PATH_GROUPED, -1);
		time_experts(s, M, K_CUDA_MOE_PATH_SMALL, shared);	/* fused */
		if (M == 1) {	/* the above took moe_small_m1.cu's kernels */
			moe_set_m1(0);
			printf("(general kernels at M 1)\n");
			time_experts(s, M, K_CUDA_MOE_PATH_SMALL, shared);
			moe_set_m1(-1);
		}
	}
	time_experts(s, 32, K_CUDA_MOE_PATH_AUTO, -1);
	time_experts(s, 64, K_CUDA_MOE_PATH_AUTO, -1);
}

/* ---- the whole MoE layer: standard kernels against k_cuda_moe_lat ---------------- */

struct lat_bench {
	const struct moe_shape *s;
	struct k_moe_route_params p;	/* bias: device */
	int M, shared, latency;
	struct k_cuda_moe_ws *ws;
	struct k_cuda_linear *lin;
	const uint16_t *router;
	const uint16_t *const *table;
	struct k_cuda_moe_shared sh;
	float *x, *y, *logits, *wts;
	int32_t *ids;
};

/* One MoE layer on the benchmark's stream, the path lb->latency says. */
static int lat_layer(struct lat_bench *lb)
{
	const struct moe_shape *s = lb->s;
	const struct k_cuda_moe_shared *sh = lb->shared ? &lb->sh : NULL;
	int ret;

	if (lb->latency)
		return k_cuda_moe_lat(stream, lb->ws, lb->y, lb->x, lb->M, lb->router, &lb->p,
				      lb->logits, lb->ids, lb->wts, lb->table, NULL, s->n_experts,
				      s->hidden, s->inter, sh);
	if ((ret = k_cuda_linear_run_kind(lb->lin, K_CUDA_LINEAR_GEMV, lb->logits, lb->x,
					  lb->router, lb->M, s->n_experts, s->hidden, 0)) ||
	    (ret = k_cuda_moe_route(stream, &lb->p, lb->logits, lb->M, lb->ids, lb->wts)))
		return ret;
	return k_cuda_moe_experts_add(stream, lb->ws, lb->y, lb->x, lb->M, lb->ids, lb->wts,
				      s->top_k, lb->table, s->n_experts, s->hidden, s->inter, sh);
}

static int lat_call(void *arg)
{
	return lat_layer(arg);
}

/* Median of 25 replays of a graph of what call(arg) queues on the benchmark's stream
 * (where the linear contexts are), each behind an L2 flush; *nodes gets the graph's
 * launches. 0 after a failure. */
static double stream_graph_us(int (*call)(void *), void *arg, void *flush, int *nodes)
{
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	cudaEvent_t e0, e1;
	float ms[25];
	size_t n = 0;
	int ret;

	*nodes = 0;
	if (!CU(cudaEventCreate(&e0)) || !CU(cudaEventCreate(&e1)) || call(arg) ||
	    !CU(cudaStreamSynchronize(stream)))
		return 0;
	if (!CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal)))
		return 0;
	ret = call(arg);
	if (!CU(cudaStreamEndCapture(stream, &graph)) || ret ||
	    !CU(cudaGraphInstantiate(&exec, graph, 0)))
		return 0;
	CU(cudaGraphGetNodes(graph, NULL, &n));
	*nodes = (int)n;
	for (int i = 0; i < 3; i++)
		CU(cudaGraphLaunch(exec, stream));
	for (int i = 0; i < 25; i++) {
		CU(cudaMemsetAsync(flush, i & 0xff, BENCH_FLUSH_BYTES, stream));
		CU(cudaEventRecord(e0, stream));
		CU(cudaGraphLaunch(exec, stream));
		CU(cudaEventRecord(e1, stream));
		CU(cudaEventSynchronize(e1));
		CU(cudaEventElapsedTime(&ms[i], e0, e1));
	}
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return test_median(ms, 25) * 1e3;
}

/* On the device: a random bf16 router (n_experts, hidden) into *router, random x (M,
 * hidden) into *x and, for sigmoid scoring, a random bias into p->bias. */
static void route_inputs(const struct moe_shape *s, struct k_moe_route_params *p, int M,
			 const uint16_t **router, float **x)
{
	size_t nr = (size_t)s->n_experts * s->hidden, nx = (size_t)M * s->hidden;
	uint16_t *hr = malloc(sizeof(uint16_t) * nr);
	float *hx = malloc(sizeof(float) * nx);

	for (size_t i = 0; i < nr; i++)
		hr[i] = k_f32_to_bf16(test_randf(&seed) * 0.05f);
	for (size_t i = 0; i < nx; i++)
		hx[i] = test_randf(&seed);
	if (p->scoring == K_MOE_SIGMOID) {
		float *bias = malloc(sizeof(float) * s->n_experts);

		for (int e = 0; e < s->n_experts; e++)
			bias[e] = test_randf(&seed) * 0.05f;
		p->bias = dup_to_device(bias, sizeof(float) * s->n_experts);
		free(bias);
	}
	*router = dup_to_device(hr, sizeof(uint16_t) * nr);
	*x = dup_to_device(hx, sizeof(float) * nx);
	free(hr);
	free(hx);
}

/* Every expert in its own (zeroed) memory, a random router, random x: the standard
 * and the latency path at M rows, each beside the floor of the bytes the layer reads
 * (router, the experts its ids chose, the shared expert). */
static void bench_lat(const struct moe_shape *s, struct k_moe_route_params p, int shared, int M)
{
	size_t per = (size_t)s->hidden * s->inter, nk = (size_t)M * s->top_k;
	size_t nr = (size_t)s->n_experts * s->hidden, ns = (size_t)s->hidden * shared;
	struct lat_bench lb = { .s = s, .p = p, .M = M, .shared = shared };
	uint16_t *all = dalloc(sizeof(uint16_t) * (per * 3 * (size_t)s->n_experts + 3 * ns));
	const uint16_t **table = malloc(sizeof(*table) * 3 * (size_t)s->n_experts);
	int32_t *ids = malloc(sizeof(int32_t) * nk);
	unsigned char *used = calloc((size_t)s->n_experts, 1);
	void *flush = bench_flush_buffer();
	double us[2], bytes;
	int nodes[2], n_used = 0;

	if (!all || !flush)
		goto out;
	CU(cudaMemset(all, 0, sizeof(uint16_t) * (per * 3 * (size_t)s->n_experts + 3 * ns)));
	for (int e = 0; e < 3 * s->n_experts; e++)
		table[e] = all + per * e;
	lb.sh = (struct k_cuda_moe_shared){ all + per * 3 * s->n_experts,
					    all + per * 3 * s->n_experts + ns,
					    all + per * 3 * s->n_experts + 2 * ns, shared };
	route_inputs(s, &lb.p, M, &lb.router, &lb.x);
	lb.table = dup_to_device(table, sizeof(*table) * 3 * (size_t)s->n_experts);
	lb.y = dalloc(sizeof(float) * (size_t)M * s->hidden);
	lb.logits = dalloc(sizeof(float) * (size_t)M * s->n_experts);
	lb.wts = dalloc(sizeof(float) * nk);
	lb.ids = dalloc(sizeof(int32_t) * nk);
	if (k_cuda_moe_ws_create(&lb.ws, M, s->top_k, s->n_experts, s->hidden, s->inter, shared) ||
	    k_cuda_linear_create(&lb.lin, stream, M, s->hidden))
		goto out;
	for (int l = 0; l < 2; l++) {
		lb.latency = l;
		us[l] = stream_graph_us(lat_call, &lb, flush, &nodes[l]);
	}
	CU(cudaStreamSynchronize(stream));
	to_host(ids, lb.ids, sizeof(int32_t) * nk);
	for (size_t i = 0; i < nk; i++)
		if (ids[i] >= 0 && ids[i] < s->n_experts && !used[ids[i]]++)
			n_used++;
	bytes = 2.0 * ((double)nr + 3.0 * (double)per * n_used + 3.0 * (double)ns);
	for (int l = 0; l < 2; l++)
		printf("moe_lat %-8s %-28s M %d shared %4d: %d launches, %3.0f MB (router + %d experts"
		       "%s), %7.1f us = %.2f TB/s (floor %.1f us at 4.25 TB/s: %.0f%%)\n",
		       l ? "latency" : "standard", s->name, M, shared, nodes[l], bytes / 1e6, n_used,
		       shared ? " + shared" : "", us[l], us[l] > 0 ? bytes / (us[l] * 1e-6) / 1e12 : 0,
		       bench_floor_us(bytes), us[l] > 0 ? 100 * bench_floor_us(bytes) / us[l] : 0);
out:
	k_cuda_linear_destroy(lb.lin);
	k_cuda_moe_ws_destroy(lb.ws);
	cudaFree(all);
	cudaFree((void *)lb.router);
	cudaFree((void *)lb.table);
	cudaFree((void *)lb.p.bias);
	cudaFree(lb.x);
	cudaFree(lb.y);
	cudaFree(lb.logits);
	cudaFree(lb.wts);
	cudaFree(lb.ids);
	free(table);
	free(ids);
	free(used);
}

/* ---- quantized experts ("q" lines): k_cuda_moe_experts_q --------------------------- */

struct qbench {
	const struct moe_shape *s;
	struct k_cuda_moe_ws *ws;
	void *dtable, *dx, *dw, *dids, *dout;
	struct k_cuda_moe_quant q;	/* fmt K_Q_NONE: bf16 experts */
	int M;
};

static int qbench_call(void *arg, cudaStream_t st)
{
	struct qbench *b = arg;

	return k_cuda_moe_experts_q(st, b->ws, b->dout, b->dx, b->M, b->dids, b->dw, b->s->top_k,
				    b->dtable, b->q.fmt != K_Q_NONE ? &b->q : NULL,
				    b->s->n_experts, b->s->hidden, b->s->inter);
}

#define FILL_PATTERN_BYTES ((size_t)8 << 20)	/* random bytes made once, copied over */

/* Whether time_q fills the experts with random values of their format (the default, as
 * kdbench's synthetic weights) or, with BENCH_MOE_FILL=const, with the byte 0x3c as the
 * lines before session 33 did: the tensor cores draw less power on constant operands,
 * which may hold a higher clock, so compute-bound tiles may time faster on it. */
static int fill_const(void)
{
	const char *v = getenv("BENCH_MOE_FILL");

	return v && !strcmp(v, "const");
}

/* time_q's routing: uniform (-1), or with BENCH_MOE_HOT=1 every row's slot 0 on expert 0
 * (0), one expert of M rows, as the prefill chunks of kdbench's synthetic weights route
 * most rows to a few experts (docs/PERFORMANCE.md, "Session 33"). */
static int hot_expert(void)
{
	const char *v = getenv("BENCH_MOE_HOT");

	return v && !strcmp(v, "1") ? 0 : -1;
}

/* bytes of device memory at dst (a multiple of 256) filled with values of fmt: the
 * payload (scale 0) or its scales (scale 1; fp8's fp32, int4's bf16), random finite
 * values from one FILL_PATTERN_BYTES pattern repeated (1), or the byte 0x3c (0: under
 * fill_const, or where the pattern's memory could not be had). */
static int fill_q(void *dst, size_t bytes, enum k_qfmt fmt, int scale)
{
	unsigned char *pat = fill_const() ? NULL : malloc(FILL_PATTERN_BYTES);

	if (!pat) {	/* asked for, or no memory for the pattern */
		CU(cudaMemset(dst, 0x3c, bytes));
		return 0;
	}
	for (size_t i = 0; i < FILL_PATTERN_BYTES; i += 4) {
		float f = test_randf(&seed);
		uint32_t w = (uint32_t)(seed >> 32);	/* the generator's state: 32 random bits */
		uint16_t lo, hi;

		if (scale && fmt == K_Q_FP8) {	/* fp32 block scales, ~amax / 448 */
			float sc = (1.5f + f) * 1e-4f;

			memcpy(pat + i, &sc, 4);
			continue;
		}
		if (scale || fmt == K_Q_NONE) {	/* bf16: int4 scales, or bf16 weights */
			lo = k_f32_to_bf16(scale ? (1.5f + f) * 1e-3f : f * 0.05f);
			hi = k_f32_to_bf16(scale ? (1.5f - f) * 1e-3f : test_randf(&seed) * 0.05f);
			memcpy(pat + i, &lo, 2);
			memcpy(pat + i + 2, &hi, 2);
			continue;
		}
		if (fmt == K_Q_FP8)	/* e4m3: no NaN (s.1111.111) */
			for (int b = 0; b < 4; b++)
				if (((w >> (8 * b)) & 0x7f) == 0x7f)
					w &= ~(1u << (8 * b));
		memcpy(pat + i, &w, 4);	/* int4: every nibble is a value */
	}
	/* the pattern once, then what is filled copied after itself on the device */
	CU(cudaMemcpy(dst, pat, bytes < FILL_PATTERN_BYTES ? bytes : FILL_PATTERN_BYTES,
		      cudaMemcpyHostToDevice));
	for (size_t o = FILL_PATTERN_BYTES; o < bytes; o *= 2)
		CU(cudaMemcpy((char *)dst + o, dst, bytes - o < o ? bytes - o : o,
			      cudaMemcpyDeviceToDevice));
	free(pat);
	return 1;
}

/* One call of the routed experts at M rows in format fmt (K_Q_NONE: bf16; K_Q_FP8:
 * 128 x 128 blocks, fp32 scales; K_Q_INT4: groups of 32, bf16 scales), every expert in
 * its own memory, a graph replayed behind an L2 flush (bench_graph_us), beside the floor
 * of the used experts' bytes as stored (payload + scales). The payloads and scales are
 * random finite values of the format (fill_q; BENCH_MOE_FILL=const: a byte pattern). */
static void time_q(const struct moe_shape *s, enum k_qfmt fmt, int M, const char *path)
{
	const char *fname = fmt == K_Q_FP8 ? "fp8-block" : fmt == K_Q_INT4 ? "int4-g32" : "bf16";
	size_t per = (size_t)s->hidden * s->inter, nk = (size_t)M * s->top_k;
	size_t pay = fmt == K_Q_FP8 ? per : fmt == K_Q_INT4 ? per / 2 : per * 2;
	/* scales of one matrix: fp8 (N / 128) (K / 128) fp32; int4 N (K / 32) bf16 (either
	 * orientation: the same count at these shapes) */
	size_t sb = fmt == K_Q_FP8 ? (size_t)((s->inter + 127) / 128) * ((s->hidden + 127) / 128) * 4
		  : fmt == K_Q_INT4 ? per / 32 * 2 : 0;
	size_t pay_al = (pay + 255) & ~(size_t)255, sb_al = (sb + 255) & ~(size_t)255;
	void **table = malloc(sizeof(void *) * (size_t)s->n_experts * 3);
	void **stable = malloc(sizeof(void *) * (size_t)s->n_experts * 3);
	float *x = malloc(sizeof(float) * (size_t)M * s->hidden), *wts = malloc(sizeof(float) * nk);
	int32_t *ids = malloc(sizeof(int32_t) * nk);
	unsigned char *used = calloc((size_t)s->n_experts, 1);
	struct qbench b = { .s = s, .M = M };
	char *all = NULL, *sall = NULL;
	double bytes = 0, us, flops;
	int n_used = 0, rnd;

	if (k_cuda_moe_ws_create(&b.ws, M, s->top_k, s->n_experts, s->hidden, s->inter, 0))
		goto out;
	all = dalloc(pay_al * 3 * (size_t)s->n_experts);
	rnd = fill_q(all, pay_al * 3 * (size_t)s->n_experts, fmt, 0);
	if (sb) {
		sall = dalloc(sb_al * 3 * (size_t)s->n_experts);
		rnd &= fill_q(sall, sb_al * 3 * (size_t)s->n_experts, fmt, 1);
	}
	for (int e = 0; e < 3 * s->n_experts; e++) {
		table[e] = all + pay_al * e;
		stable[e] = sall ? sall + sb_al * e : NULL;
	}
	for (size_t i = 0; i < (size_t)M * s->hidden; i++)
		x[i] = test_randf(&seed);
	moe_make_ids(ids, wts, M, s, hot_expert(), &seed);
	for (size_t i = 0; i < nk; i++)
		used[ids[i]] = 1;
	for (int e = 0; e < s->n_experts; e++)
		n_used += used[e];
	bytes = 3.0 * (double)(pay + sb) * n_used;
	b.dtable = dup_to_device(table, sizeof(void *) * (size_t)s->n_experts * 3);
	b.dx = dup_to_device(x, sizeof(float) * (size_t)M * s->hidden);
	b.dw = dup_to_device(wts, sizeof(float) * nk);
	b.dids = dup_to_device(ids, sizeof(int32_t) * nk);
	b.dout = dalloc(sizeof(float) * (size_t)M * s->hidden);
	if (fmt != K_Q_NONE) {
		int bc = fmt == K_Q_FP8 ? 128 : 32, br = fmt == K_Q_FP8 ? 128 : 1;

		b.q = (struct k_cuda_moe_quant){ .fmt = fmt, .scale_dtype = fmt == K_Q_FP8 ? K_F32 : K_BF16,
						 .block_rows = { br, br, br }, .block_cols = { bc, bc, bc } };
		b.q.scales = dup_to_device(stable, sizeof(void *) * (size_t)s->n_experts * 3);
	}
	us = bench_graph_us(qbench_call, &b, bench_flush_buffer());
	/* the products the call must take: 3 matrices of hidden x inter a pair */
	flops = 2.0 * 3 * (double)per * (double)nk;
	printf("moe_q time %-9s %-10s %-29s M %2d%s: %d experts, %5.1f MB (payload + scales, "
	       "%s), %7.1f us = %.2f TB/s (floor %.1f us at 4.25 TB/s: %.0f%%), %.0f TFLOP/s\n",
	       fname, path, s->name, M, hot_expert() < 0 ? "" : " hot", n_used, bytes / 1e6,
	       rnd ? "random" : "0x3c", us,
	       us > 0 ? bytes / (us * 1e-6) / 1e12 : 0, bench_floor_us(bytes),
	       us > 0 ? 100 * bench_floor_us(bytes) / us : 0, us > 0 ? flops / us * 1e-6 : 0);
out:
	k_cuda_moe_ws_destroy(b.ws);
	cudaFree(all);
	cudaFree(sall);
	cudaFree(b.dtable);
	cudaFree((void *)b.q.scales);
	cudaFree(b.dx);
	cudaFree(b.dw);
	cudaFree(b.dids);
	cudaFree(b.dout);
	free(table);
	free(stable);
	free(x);
	free(wts);
	free(ids);
	free(used);
}

static void bench_q_all(const char *only, int only_M, const char *only_f)
{
	static const struct moe_shape shapes[] = {
		{ "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 },
		{ "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 },
		{ "deepseek-v3 7168x2048 E256 k8", 7168, 2048, 256, 8 },
		{ "kimi-k2 7168x2048 E384 k8", 7168, 2048, 384, 8 },
		/* only when SHAPE holds "kimi-k2-": Kimi-K2's experts, the 8 chosen ones
		 * alone in one 352 MB buffer, then 8 of 16 (705 MB) and of 64 (2.8 GB), to
		 * set against the 8 of 384 spread over 17 GB above */
		{ "kimi-k2-compact 7168x2048 E8 k8", 7168, 2048, 8, 8 },
		{ "kimi-k2-spread16 7168x2048 E16 k8", 7168, 2048, 16, 8 },
		{ "kimi-k2-spread64 7168x2048 E64 k8", 7168, 2048, 64, 8 },
	};
	const enum k_qfmt fmts[] = { K_Q_NONE, K_Q_FP8, K_Q_INT4 };

	static const int Ms[] = { 1, 2, 4, 8, 64, 256 };
	const int n_M = sizeof(Ms) / sizeof(Ms[0]);
	int listed = !only_M;

	for (int m = 0; m < n_M; m++)
		listed |= Ms[m] == only_M;
	moe_set_path(K_CUDA_MOE_PATH_AUTO);
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		for (int m = 0; m < (listed ? n_M : 1); m++)
			for (int f = 0; f < 3; f++) {
				int M = listed ? Ms[m] : only_M;

				const char *fn = fmts[f] == K_Q_FP8 ? "fp8-block" : fmts[f] == K_Q_INT4 ? "int4-g32" : "bf16";

				if ((only && !strstr(shapes[i].name, only)) || (only_M && M != only_M) ||
				    (only_f && strcmp(fn, only_f)) ||
				    (strstr(shapes[i].name, "kimi-k2-") && !(only && strstr(only, "kimi-k2-"))))
					continue;
				moe_set_qtile(0);
				moe_set_qgemv(0);
				time_q(&shapes[i], fmts[f], M,
				       M * shapes[i].top_k <= 64 ? "small" : "grouped");
				moe_set_qgemv(-1);
				/* moe_qgemv.cu's union GEMVs where they take the call */
				if (fmts[f] != K_Q_NONE && M <= 8) {
					moe_set_qgemv_fmt(8);	/* int4 and wide fp8 at every M too */
					moe_set_qgemv_persist(0);	/* one item a CTA */
					time_q(&shapes[i], fmts[f], M, "qgemv");
					moe_set_qgemv_persist(1);	/* persistent gate/up */
					time_q(&shapes[i], fmts[f], M, "qgemv-p");
					moe_set_qgemv_persist(-1);
					moe_set_qgemv_fmt(-1);
				}
				/* the grouped path on moe_qtile.cu's tile kernels, at every M (where
				 * auto takes the small path too: plan and combine launches included) */
				moe_set_qtile(M);
				moe_set_path(K_CUDA_MOE_PATH_GROUPED);
				moe_set_qtile_wide(0);
				time_q(&shapes[i], fmts[f], M, "qtile");
				if (M >= 64) {	/* its wide passes */
					moe_set_qtile_wide(1);
					time_q(&shapes[i], fmts[f], M, "qtile-wide");
				}
				moe_set_qtile_wide(-1);
				moe_set_path(K_CUDA_MOE_PATH_AUTO);
				moe_set_qtile(-1);
			}
}

/* ---- the routing alone ("route" lines) ----------------------------------------- */

#define ROUTE_CHAIN 32	/* layers of one graph */

struct route_bench {
	const struct moe_shape *s;
	struct k_moe_route_params p;	/* bias: device */
	struct k_cuda_linear *lin;
	const uint16_t *router;
	float *x, *logits, *wts;
	int32_t *ids;
	int M, what;	/* 0: router GEMVs, 1: GEMV + moe_route, 2: moe_route alone */
};

static int route_chain(void *arg)
{
	struct route_bench *rb = arg;
	int ret = 0;

	for (int l = 0; l < ROUTE_CHAIN && !ret; l++) {
		if (rb->what < 2)
			ret = k_cuda_linear_run_kind(rb->lin, K_CUDA_LINEAR_GEMV, rb->logits, rb->x,
						     rb->router, rb->M, rb->s->n_experts,
						     rb->s->hidden, 0);
		if (!ret && rb->what > 0)
			ret = k_cuda_moe_route(stream, &rb->p, rb->logits, rb->M, rb->ids, rb->wts);
	}
	return ret;
}

/* Where a MoE layer's routing time goes at decode: ROUTE_CHAIN layers of the router
 * GEMV, of the GEMV then moe_route, and of moe_route alone, each chain one graph (its
 * launches programmatically dependent, as in a step), per layer. */
static void bench_route(const struct moe_shape *s, struct k_moe_route_params p, int M)
{
	struct route_bench rb = { .s = s, .p = p, .M = M };
	double us[3] = { 0, 0, 0 };
	int nodes;

	route_inputs(s, &rb.p, M, &rb.router, &rb.x);
	rb.logits = dalloc(sizeof(float) * (size_t)M * s->n_experts);
	rb.wts = dalloc(sizeof(float) * (size_t)M * s->top_k);
	rb.ids = dalloc(sizeof(int32_t) * (size_t)M * s->top_k);
	if (!k_cuda_linear_create(&rb.lin, stream, M, s->hidden)) {
		for (rb.what = 0; rb.what < 3; rb.what++)
			us[rb.what] = stream_graph_us(route_chain, &rb, bench_flush_buffer(),
						      &nodes) / ROUTE_CHAIN;
		printf("route %-28s M %d: router GEMV %5.2f us (its %.1f MB's floor %.2f), "
		       "GEMV + moe_route %5.2f us (the routing adds %5.2f), moe_route alone %5.2f us "
		       "a layer\n", s->name, M, us[0],
		       2.0 * s->n_experts * s->hidden / 1e6,
		       bench_floor_us(2.0 * s->n_experts * s->hidden), us[1], us[1] - us[0], us[2]);
	}
	k_cuda_linear_destroy(rb.lin);
	cudaFree((void *)rb.router);
	cudaFree((void *)rb.p.bias);
	cudaFree(rb.x);
	cudaFree(rb.logits);
	cudaFree(rb.wts);
	cudaFree(rb.ids);
}

static void bench_lat_all(int route_only)
{
	static const struct moe_shape qwen3 = { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 },
		v2lite = { "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 },
		v3 = { "deepseek-v3 7168x2048 E256 k8", 7168, 2048, 256, 8 },
		kimi = { "kimi-k2 7168x2048 E384 k8", 7168, 2048, 384, 8 };
	static const struct k_moe_route_params pq = { 128, 8, K_MOE_SOFTMAX, K_MOE_GREEDY, 0, 0, 1, 1.0f, NULL },
		pv2 = { 64, 6, K_MOE_SOFTMAX, K_MOE_GREEDY, 1, 1, 0, 1.0f, NULL },
		pv3 = { 256, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 8, 4, 1, 2.5f, NULL },
		pk = { 384, 8, K_MOE_SIGMOID, K_MOE_GROUP_TOP2, 1, 1, 1, 2.827f, NULL };

	if (route_only) {
		for (int M = 1; M <= 8; M += 7) {
			bench_route(&qwen3, pq, M);
			bench_route(&v2lite, pv2, M);
			bench_route(&v3, pv3, M);
			bench_route(&kimi, pk, M);
		}
		return;
	}
	for (int M = 1; M <= 8; M += 7) {
		bench_lat(&qwen3, pq, 0, M);
		bench_lat(&v2lite, pv2, 2816, M);
		bench_lat(&v3, pv3, 2048, M);
		bench_lat(&kimi, pk, 2048, M);
	}
}

int main(int argc, char **argv)
{
	static const struct moe_shape v2lite = { "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 },
		qwen3 = { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 };

	if (bench_begin("bench_cuda_moe"))
		return 77;
	CU(cudaStreamCreate(&stream));
	if (argc > 1 && (!strcmp(argv[1], "lat") || !strcmp(argv[1], "route"))) {
		bench_lat_all(!strcmp(argv[1], "route"));
		cudaStreamDestroy(stream);
		return test_failures ? 1 : 0;
	}
	if (argc > 1 && !strcmp(argv[1], "q")) {
		const int M = argc > 3 ? atoi(argv[3]) : 0;

		if (M < 0 || M > 4096) {
			fprintf(stderr, "bench_cuda_moe q: M %d outside 0..4096\n", M);
			cudaStreamDestroy(stream);
			return 2;
		}
		bench_q_all(argc > 2 ? argv[2] : NULL, M, argc > 4 ? argv[4] : NULL);
		k_cuda_tuning_set(NULL);
		cudaStreamDestroy(stream);
		return test_failures ? 1 : 0;
	}
	bench_shape(&v2lite, 2816);	/* its shared expert: 2 x 1408 */
	bench_shape(&qwen3, 0);		/* none */
	bench_lat_all(1);
	bench_lat_all(0);
	bench_q_all(NULL, 0, NULL);
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
