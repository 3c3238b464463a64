/* Quantized-weight linear benchmark on the GPU: k_cuda_linear_q_run ("us": the
 * decode GEMV (linear_qgemv.cu) at M <= 8, the tile kernel at 8 < M <= 64, "(choose: stream)" in the
 * plan where k_cuda_linear_q_choose takes the streaming GEMV instead; "alt us" below) on the dense projections of Llama-3.1-8B, Qwen3-30B-A3B and
 * DeepSeek-V3 / Kimi-K2 (q/k/v and gate/up stacked, as the CUDA backend places them),
 * in fp8 with 128 x 128 block scales, fp8 per channel and int4 in groups of 32 (f16
 * scales, as the backend keeps them), against the HBM floor of the bytes it must move.
 *
 * Timing as bench_cuda_linear: each sample replays a CUDA graph of launches that rotate
 * over enough copies of the weight (>= ROTATE_BYTES) that none is still in the 60 MB L2
 * when read again; sample / launches is one call; median of SAMPLES samples. Bytes =
 * payload + scales (as on the device) + x (M, K) fp32 + y (M, N) fp32, each once; floor
 * = bytes / 4.25 TB/s (bench_floor_us). "alt us": the streaming GEMV (STREAM, clusters) at M <= 8,
 * above it the faster of the two kinds M > 8 took before the tile kernel (the streaming
 * GEMV's wide form, the DEQUANT kind: f16 copy + cuBLAS). "bf16 us": k_cuda_linear on
 * a bf16 weight of the same shape (its own kind), with its floor% (bf16 bytes). "warp"
 * is the CUDA-core GEMV (k_cuda_linear_q) at M = 1, for comparison. M = 1, 2, 4, 8, 16,
 * 32, 64. Usage: bench_cuda_linear_q [--quick] [--only SUBSTRING] [--m LIST] [--fmt LIST] [--once] (--quick:
 * M = 1, 8, 16 and 64 only; --only: the shapes whose name holds SUBSTRING; --m: those M,
 * comma-separated, up to 7; --fmt: those formats, comma-separated; --once: each of GEMV
 * and STREAM once at each shape, format and M, eagerly and untimed, for ncu). The KDEC_*
 * tuning variables apply (KDEC_LINEAR_QGEMV=0, KDEC_LINEAR_QGEMV_WARPS for A/B runs).
 * Exits 77 without CUDA or GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/dtype.h"
#include "tests/cudatest.h"
#include "tests/bench/cudabench.h"

#define ROTATE_BYTES	((size_t)256 << 20)	/* > 4x the L2 */
#define SAMPLES		15
#define MAX_M		64
#define MAX_K		18432

struct shape {
	const char *name;
	int N, K;
	int llama_layer;	/* one of the 4 linears of a Llama-3.1-8B block */
};

static const struct shape shapes[] = {
	{ "llama8b qkv", 6144, 4096, 1 },
	{ "llama8b o_proj", 4096, 4096, 1 },
	{ "llama8b gate_up", 28672, 4096, 1 },
	{ "llama8b down", 4096, 14336, 1 },
	{ "qwen3-30b qkv", 5120, 2048, 0 },
	{ "qwen3-30b o_proj", 2048, 4096, 0 },
	{ "dsv3 q_a+kv_a", 2112, 7168, 0 },
	{ "dsv3 q_b", 24576, 1536, 0 },
	{ "kimi-k2 q_b", 12288, 1536, 0 },
	{ "dsv3 o_proj", 7168, 16384, 0 },
	{ "kimi-k2 o_proj", 7168, 8192, 0 },
	{ "dsv3 dense gate_up", 36864, 7168, 0 },
	{ "dsv3 dense down", 7168, 18432, 0 },
};
#define N_SHAPES (int)(sizeof(shapes) / sizeof(shapes[0]))

struct fmt {
	const char *name;
	enum k_qfmt fmt;
	int block_rows, block_cols;	/* 0: the whole dim */
	enum k_dtype scale_dtype;	/* on the device */
};

static const struct fmt fmts[] = {
	{ "fp8-block", K_Q_FP8, 128, 128, K_F32 },
	{ "fp8-channel", K_Q_FP8, 1, 0, K_F32 },
	{ "int4-g32", K_Q_INT4, 1, 32, K_F16 },
};
#define N_FMTS (int)(sizeof(fmts) / sizeof(fmts[0]))

static cudaStream_t stream;
static struct k_cuda_linear *lin;
static uint16_t *wtmp;		/* DEQUANT's f16 copy */
static size_t wtmp_elems;

/* A quantized weight in `copies` device copies: payloads wb apart, scales sb apart. */
struct qweight {
	struct k_quant q;
	uint8_t *w;
	uint8_t *s;
	size_t wb, sb;
	int copies;
};

/* A bf16 weight in `copies` device copies wb bytes apart (kind < 0 in call: k_cuda_linear). */
struct bweight {
	uint16_t *w;
	size_t wb;
	int copies;
};

static const struct bweight *bf16_w;	/* set while timing the bf16 linear */

/* Whether name is one of the comma-separated list's entries. */
static int bench_listed(const char *list, const char *name)
{
	const size_t n = strlen(name);

	for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
		if (!strncmp(p, name, n) && (p[n] == ',' || p[n] == 0))
			return 1;
	return 0;
}

static int call(const struct qweight *qw, int kind, int i, float *y, const float *x, int M,
		int N, int K)
{
	struct k_quant q;

	if (kind < 0)
		return k_cuda_linear(lin, y, x, bf16_w->w + (size_t)(i % bf16_w->copies) * (bf16_w->wb / 2),
				     M, N, K, 0);
	q = qw->q;
	q.scale = qw->s + (size_t)(i % qw->copies) * qw->sb;
	if (kind == K_CUDA_LINEAR_Q_WARP)	/* fp32 scales only: its own stream */
		return q.scale_dtype == K_F32 ? k_cuda_linear_q(stream, y, x, qw->w + (size_t)(i % qw->copies) * qw->wb,
								&q, M, N, K, 0) : -1;
	return k_cuda_linear_q_run(lin, kind, y, x, qw->w + (size_t)(i % qw->copies) * qw->wb, &q,
				   M, N, K, 0, wtmp, wtmp_elems);
}

/* One call of time_us's graph. */
struct q_call {
	const struct qweight *qw;
	int kind, M, N, K;
	float *y;
	const float *x;
};

static int q_call_run(void *arg, int i, cudaStream_t s)
{
	const struct q_call *c = arg;

	(void)s;	/* the context's own stream */
	return call(c->qw, c->kind, i, c->y, c->x, c->M, c->N, c->K);
}

/* Median µs of one call. 0 after a failed check (or where kind cannot run). */
static double time_us(const struct qweight *qw, int kind, float *y, const float *x, int M, int N,
		      int K)
{
	struct q_call c = { qw, kind, M, N, K, y, x };
	char what[96];

	snprintf(what, sizeof(what), "linear_q kind %d (M %d N %d K %d)", kind, M, N, K);
	return bench_rotated_us(q_call_run, &c, stream, kind < 0 ? bf16_w->copies : qw->copies, 2,
				SAMPLES, what);
}

/* Random payload (no fp8 NaN) and scales, in enough copies to leave L2 between reads. */
static int qweight_create(struct qweight *qw, const struct fmt *f, int N, int K)
{
	unsigned long long s = 0x9e3779b97f4a7c15ull ^ ((size_t)N * K);
	size_t ns, es = k_dtype_size(f->scale_dtype);
	uint8_t *hw, *hs;

	memset(qw, 0, sizeof(*qw));
	qw->q = (struct k_quant){ .fmt = f->fmt, .scale_dtype = f->scale_dtype,
				  .block_rows = f->block_rows ? f->block_rows : N,
				  .block_cols = f->block_cols ? f->block_cols : K };
	qw->q.scale_cols = (K + qw->q.block_cols - 1) / qw->q.block_cols;
	ns = (size_t)((N + qw->q.block_rows - 1) / qw->q.block_rows) * (size_t)qw->q.scale_cols;
	qw->wb = (size_t)N * k_quant_row_bytes(f->fmt, K);
	qw->sb = (ns * es + 255) / 256 * 256;
	qw->copies = (int)((ROTATE_BYTES + qw->wb + qw->sb - 1) / (qw->wb + qw->sb));
	qw->copies = qw->copies < 2 ? 2 : qw->copies;
	hw = malloc(qw->wb);
	hs = calloc(1, qw->sb);
	if (!hw || !hs) {
		free(hw);
		free(hs);
		return -1;
	}
	for (size_t i = 0; i < qw->wb; i++) {
		uint8_t b = (uint8_t)((test_randf(&s) + 1.0f) * 127.99f);

		hw[i] = f->fmt == K_Q_FP8 && (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
	}
	for (size_t i = 0; i < ns; i++) {
		float v = (0.5f + 0.25f * (test_randf(&s) + 1.0f)) * 0.01f;

		if (es == 2)
			((uint16_t *)hs)[i] = k_f32_to_f16(v);
		else
			((float *)hs)[i] = v;
	}
	qw->w = dalloc(qw->wb * (size_t)qw->copies);
	qw->s = dalloc(qw->sb * (size_t)qw->copies);
	for (int c = 0; qw->w && qw->s && c < qw->copies; c++) {
		CU(cudaMemcpyAsync(qw->w + (size_t)c * qw->wb, hw, qw->wb, cudaMemcpyHostToDevice, stream));
		CU(cudaMemcpyAsync(qw->s + (size_t)c * qw->sb, hs, qw->sb, cudaMemcpyHostToDevice, stream));
	}
	CU(cudaStreamSynchronize(stream));
	free(hw);
	free(hs);
	return qw->w && qw->s ? 0 : -1;
}

/* Random bf16 weights in enough copies to leave L2 between reads. */
static int bweight_create(struct bweight *bw, int N, int K)
{
	unsigned long long s = 0x51ed2701ull ^ ((size_t)N * K);
	uint16_t *h;

	bw->wb = (size_t)N * K * 2;
	bw->copies = (int)((ROTATE_BYTES + bw->wb - 1) / bw->wb);
	bw->copies = bw->copies < 2 ? 2 : bw->copies;
	h = malloc(bw->wb);
	if (!h)
		return -1;
	for (size_t i = 0; i < (size_t)N * K; i++)
		h[i] = k_f32_to_bf16(test_randf(&s) * 0.05f);
	bw->w = dalloc(bw->wb * (size_t)bw->copies);
	for (int c = 0; bw->w && c < bw->copies; c++)
		CU(cudaMemcpyAsync((uint8_t *)bw->w + (size_t)c * bw->wb, h, bw->wb,
				   cudaMemcpyHostToDevice, stream));
	CU(cudaStreamSynchronize(stream));
	free(h);
	return bw->w ? 0 : -1;
}

int main(int argc, char **argv)
{
	static const int all_ms[] = { 1, 2, 4, 8, 16, 32, 64 }, quick_ms[] = { 1, 8, 16, 64 };
	static int user_ms[7];
	const int *ms = all_ms;
	int n_ms = 7;
	double llama_us[N_FMTS][MAX_M + 1] = { { 0 } }, llama_floor[N_FMTS][MAX_M + 1] = { { 0 } };
	double llama_bf16[MAX_M + 1] = { 0 }, llama_bf16_floor[MAX_M + 1] = { 0 };
	float *x, *y, *hx;

	const char *only = NULL, *fmt_only = NULL;
	int once = 0;

	for (int a = 1; a < argc; a++) {
		if (!strcmp(argv[a], "--quick")) {
			ms = quick_ms;
			n_ms = 4;
		} else if (!strcmp(argv[a], "--only") && a + 1 < argc) {
			only = argv[++a];
		} else if (!strcmp(argv[a], "--fmt") && a + 1 < argc) {
			fmt_only = argv[++a];
		} else if (!strcmp(argv[a], "--once")) {
			once = 1;
		} else if (!strcmp(argv[a], "--m") && a + 1 < argc) {
			char *e = argv[++a];

			ms = user_ms;
			for (n_ms = 0; n_ms < 7 && *e;) {
				long v = strtol(e, &e, 10);

				if (v >= 1 && v <= MAX_M)
					user_ms[n_ms++] = (int)v;
				if (*e != ',')
					break;
				e++;
			}
		}
	}
	if (bench_begin("bench_cuda_linear_q"))	/* KDEC_* variables apply (A/B of a knob) */
		return 77;
	printf("median of %d graph replays, weights rotated over >= %zu MB; floor at %.2f TB/s\n",
	       SAMPLES, ROTATE_BYTES >> 20, BENCH_HBM_BYTES_PER_S / 1e12);
	CU(cudaSetDevice(0));
	CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	if (k_cuda_linear_create(&lin, stream, 64, MAX_K)) {
		fprintf(stderr, "bench_cuda_linear_q: k_cuda_linear_create failed\n");
		return 1;
	}
	hx = malloc(sizeof(float) * MAX_M * MAX_K);
	for (size_t i = 0; i < (size_t)MAX_M * MAX_K; i++)
		hx[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
	x = dalloc(sizeof(float) * MAX_M * MAX_K);
	y = dalloc(sizeof(float) * MAX_M * 65536);
	wtmp_elems = (size_t)36864 * 7168;	/* the largest shape: DEQUANT's f16 copy */
	wtmp = dalloc(wtmp_elems * 2);
	if (!x || !y || !wtmp)
		return 1;
	CU(cudaMemcpy(x, hx, sizeof(float) * MAX_M * MAX_K, cudaMemcpyHostToDevice));
	free(hx);
	printf("%-18s %-11s %6s %5s %2s | %8s %6s %6s | %8s %7s | %8s %6s | %8s %6s | %8s | %s\n",
	       "shape", "format", "N", "K", "M", "us", "TB/s", "floor%", "floor us", "MB", "alt us",
	       "floor%", "bf16 us", "floor%", "warp us", "plan");
	for (int si = 0; si < N_SHAPES; si++) {
		const struct shape *s = &shapes[si];
		double bf16_us[MAX_M + 1] = { 0 }, bf16_floor[MAX_M + 1] = { 0 };
		struct bweight bw;

		if (only && !strstr(s->name, only))
			continue;

		if (once) {	/* each kind once, eagerly, for a profiler: no bf16, no timing */
			for (int fi = 0; fi < N_FMTS; fi++) {
				struct qweight qw;

				if ((fmt_only && !bench_listed(fmt_only, fmts[fi].name)) ||
				    qweight_create(&qw, &fmts[fi], s->N, s->K))
					continue;
				qw.q.scale = qw.s;
				for (int mi = 0; mi < n_ms; mi++) {
					CHECK(call(&qw, K_CUDA_LINEAR_Q_GEMV, 0, y, x, ms[mi], s->N, s->K) == 0 &&
					      call(&qw, K_CUDA_LINEAR_Q_STREAM, 0, y, x, ms[mi], s->N, s->K) == 0,
					      "%s %s M %d: once", s->name, fmts[fi].name, ms[mi]);
					CU(cudaStreamSynchronize(stream));
					printf("%s %s M %d: gemv and stream once\n", s->name, fmts[fi].name, ms[mi]);
				}
				cudaFree(qw.w);
				cudaFree(qw.s);
			}
			continue;
		}
		/* the bf16 linear at each M first, its weights freed before the quantized */
		if (bweight_create(&bw, s->N, s->K)) {
			CHECK(0, "%s: bf16 weights", s->name);
			continue;
		}
		bf16_w = &bw;
		for (int mi = 0; mi < n_ms; mi++) {
			const int M = ms[mi];

			bf16_floor[M] = bench_floor_us((double)bw.wb + 4.0 * M * s->K + 4.0 * M * s->N);
			bf16_us[M] = time_us(NULL, -1, y, x, M, s->N, s->K);
			if (s->llama_layer) {
				llama_bf16[M] += bf16_us[M];
				llama_bf16_floor[M] += bf16_floor[M];
			}
		}
		cudaFree(bw.w);

		for (int fi = 0; fi < N_FMTS; fi++) {
			struct qweight qw;

			if (fmt_only && !bench_listed(fmt_only, fmts[fi].name))
				continue;
			if (qweight_create(&qw, &fmts[fi], s->N, s->K)) {
				CHECK(0, "%s: weights", s->name);
				continue;
			}
			for (int mi = 0; mi < n_ms; mi++) {
				const int M = ms[mi];
				const enum k_cuda_linear_q_kind kind =
					M <= K_CUDA_LINEAR_Q_MMA_MAX_M ? K_CUDA_LINEAR_Q_GEMV : K_CUDA_LINEAR_Q_TILE;
				double bytes = (double)qw.wb + (double)((size_t)((s->N + qw.q.block_rows - 1) /
						qw.q.block_rows) * (size_t)qw.q.scale_cols *
						k_dtype_size(qw.q.scale_dtype)) + 4.0 * M * s->K + 4.0 * M * s->N;
				double floor_us = bench_floor_us(bytes), us, warp = 0, mma, st = 0;
				char plan[160];

				qw.q.scale = qw.s;
				const enum k_cuda_linear_q_kind chosen =
					k_cuda_linear_q_choose(lin, &qw.q, x, qw.w, M, s->N, s->K, wtmp_elems);

				/* STREAM: 9..16 rows where it splits K little; M <= 8 where the rule says, or
				 * under KDEC_LINEAR_QGEMV=0 */
				CHECK(chosen == kind || chosen == K_CUDA_LINEAR_Q_STREAM,
				      "%s %s M %d: chose %s", s->name, fmts[fi].name, M,
				      k_cuda_linear_q_kind_name(chosen));
				us = time_us(&qw, kind, y, x, M, s->N, s->K);
				mma = time_us(&qw, M <= 8 ? K_CUDA_LINEAR_Q_STREAM : K_CUDA_LINEAR_Q_DEQUANT, y,
					      x, M, s->N, s->K);
				if (M > 8) {
					st = time_us(&qw, K_CUDA_LINEAR_Q_STREAM, y, x, M, s->N, s->K);
					mma = st > 0 && (mma <= 0 || st < mma) ? st : mma;
				}
				if (M == 1 && qw.q.scale_dtype == K_F32)
					warp = time_us(&qw, K_CUDA_LINEAR_Q_WARP, y, x, M, s->N, s->K);
				k_cuda_linear_q_describe(lin, kind, &qw.q, M, s->N, s->K, plan, sizeof(plan));
				if (chosen != kind)	/* the choice takes "alt" (STREAM) here */
					snprintf(plan + strlen(plan), sizeof(plan) - strlen(plan),
						 " (choose: %s)", k_cuda_linear_q_kind_name(chosen));
				printf("%-18s %-11s %6d %5d %2d | %8.2f %6.2f %5.1f%% | %8.2f %7.1f | %8.2f %5.1f%% | %8.2f %5.1f%% | %8.2f | %s\n",
				       s->name, fmts[fi].name, s->N, s->K, M, us, us > 0 ? bytes / us / 1e6 : 0,
				       us > 0 ? 100.0 * floor_us / us : 0, floor_us, bytes / 1e6, mma,
				       mma > 0 ? 100.0 * floor_us / mma : 0, bf16_us[M],
				       bf16_us[M] > 0 ? 100.0 * bf16_floor[M] / bf16_us[M] : 0, warp, plan);
				if (s->llama_layer) {
					/* what decode runs */
					llama_us[fi][M] += chosen == kind ? us : M > 8 ? st : mma;
					llama_floor[fi][M] += floor_us;
				}
			}
			cudaFree(qw.w);
			cudaFree(qw.s);
		}
	}
	printf("\nLlama-3.1-8B, the 4 linears of one block (qkv, o, gate_up, down) x 32 blocks "
	       "(lm_head not included):\n");
	for (int fi = 0; fi < N_FMTS; fi++)
		for (int M = 1; M <= MAX_M; M++)
			if (llama_us[fi][M] > 0)
				printf("  %-11s M=%d %8.1f us, floor %8.1f us: %.1f%% of the floor; bf16 %8.1f us (%.1f%% of its floor): %.2fx\n",
				       fmts[fi].name, M, 32 * llama_us[fi][M], 32 * llama_floor[fi][M],
				       100.0 * llama_floor[fi][M] / llama_us[fi][M], 32 * llama_bf16[M],
				       llama_bf16[M] > 0 ? 100.0 * llama_bf16_floor[M] / llama_bf16[M] : 0,
				       llama_bf16[M] / llama_us[fi][M]);
	cudaFree(x);
	cudaFree(y);
	cudaFree(wtmp);
	k_cuda_linear_destroy(lin);
	cudaStreamDestroy(stream);
	return test_failures ? 1 : 0;
}
#else
int main(void)
{
	fprintf(stderr, "bench_cuda_linear_q: needs CUDA; this build has none (--without-cuda)\n");
	return 77;
}
#endif
