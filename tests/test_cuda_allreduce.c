/* The fused one-shot all-reduce + residual add + RMSNorm (kernels/cuda/comm) with N
 * virtual ranks on one GPU, against a plain C reference: the partials (bf16 or fp32)
 * summed in rank order in fp32, added to the residual, then k_cpu_rmsnorm's
 * arithmetic. Tolerances: the residual bit for bit (the same fp32 adds in the same
 * order), every rank's output bit for bit equal to rank 0's, and rank 0's output
 * within 1e-6 relative L2 per row of the reference (only the fp64 sum of squares'
 * order differs); out_bf16 is out rounded (nearest even) bit for bit.
 *
 * Cases, for N = 2, 3, 4, 8: one reduction per (rows, width) with fresh random
 * inputs, every launch form (a launch per rank on its own stream, one launch for all
 * ranks); thousands of back-to-back reductions of changing sizes and inputs with no
 * host sync (a stale buffer or a reset racing a peer's write changes the residual,
 * which sums them all); a captured graph of four reductions replayed; refused
 * arguments launching nothing; with an fp32 payload also the plain reductions (no
 * norm: residual += sum; out = sum, in place too) bit for bit. -0.0 (the sentinel's
 * bits) is planted in the inputs. Then the greedy pairs of vocabulary slices
 * (k_cuda_argmax_slice) against a host scan by kernels/cpu/sample.c's rule on rows of
 * few distinct values (ties), NaNs, all-NaN rows, infinities and signed zeros, bit
 * for bit (value and id).
 * KD_TEST_QUICK=1: a few reductions of two ranks in one launch (KD_TEST_PART=streams:
 * a launch per rank), for the sanitizers. Skips (77) without CUDA or a GPU. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/dtype.h"
#include "tests/cudatest.h"

#define MAX_ROWS	64
#define MAX_WIDTH	16384
#define MAX_ELEMS	((size_t)MAX_ROWS * MAX_WIDTH)
#define N_SETS		4	/* partial sets in turn: coprime with the 3 buffers */
#define EPS		1e-5f
#define OUT_TOL		1e-6	/* rel L2 per row of out against the reference */

enum form { PER_STREAM, ONE_LAUNCH };

struct world {
	int n, dtype, esize;
	struct k_cuda_ar *ar;
	cudaStream_t st[K_CUDA_AR_MAX_RANKS];
	void *part[K_CUDA_AR_MAX_RANKS][N_SETS];	/* (MAX_ELEMS) payload, device */
	float *hpart[K_CUDA_AR_MAX_RANKS][N_SETS];	/* the same values as floats, host */
	float *res[K_CUDA_AR_MAX_RANKS], *out[K_CUDA_AR_MAX_RANKS];	/* (MAX_ELEMS) device */
	uint16_t *ob[K_CUDA_AR_MAX_RANKS];
	float *gamma;			/* (MAX_WIDTH) device */
	float *hgamma, *href;		/* gamma; the reference residual (MAX_ELEMS) */
	float *got, *gout, *want;	/* host scratch (MAX_ELEMS) */
	uint16_t *gob;
};

static unsigned long long seed;

/* Random payload values rounded as the dtype holds them, -0.0 planted every 13th. */
static void fill_set(struct world *w, int r, int k)
{
	float *h = w->hpart[r][k];
	uint16_t *b = malloc(MAX_ELEMS * sizeof(uint16_t));

	for (size_t i = 0; i < MAX_ELEMS; i++) {
		float v = i % 13 == 5 ? -0.0f : test_randf(&seed) * 2.0f;

		if (w->dtype == K_CUDA_AR_BF16) {
			b[i] = k_f32_to_bf16(v);
			v = k_bf16_to_f32(b[i]);
		}
		h[i] = v;
	}
	CU(cudaMemcpy(w->part[r][k], w->dtype == K_CUDA_AR_BF16 ? (void *)b : (void *)h,
		      MAX_ELEMS * w->esize, cudaMemcpyHostToDevice));
	CU(cudaDeviceSynchronize());	/* the ranks' streams do not wait for this copy */
	free(b);
}

/* A fresh residual, the same on every rank and in the reference. */
static void fill_residual(struct world *w)
{
	for (size_t i = 0; i < MAX_ELEMS; i++)
		w->href[i] = test_randf(&seed) * 4.0f;
	for (int r = 0; r < w->n; r++)
		CU(cudaMemcpy(w->res[r], w->href, MAX_ELEMS * sizeof(float), cudaMemcpyHostToDevice));
	CU(cudaDeviceSynchronize());
}

static int world_init(struct world *w, int n, int dtype)
{
	int devs[K_CUDA_AR_MAX_RANKS] = { 0 };
	int ret;

	memset(w, 0, sizeof(*w));
	w->n = n;
	w->dtype = dtype;
	w->esize = dtype == K_CUDA_AR_BF16 ? 2 : 4;
	ret = k_cuda_ar_create(&w->ar, n, devs, dtype, MAX_ROWS, MAX_WIDTH);
	CHECK(ret == 0, "k_cuda_ar_create(%d ranks on device 0): %d", n, ret);
	if (ret)
		return -1;
	CHECK(k_cuda_ar_ranks_per_device(w->ar) == n, "%d virtual ranks counted %d per device", n,
	      k_cuda_ar_ranks_per_device(w->ar));
	w->hgamma = test_rand_floats(MAX_WIDTH, 1.0f, &seed);
	w->gamma = dup_to_device(w->hgamma, MAX_WIDTH * sizeof(float));
	w->href = malloc(MAX_ELEMS * sizeof(float));
	w->got = malloc(MAX_ELEMS * sizeof(float));
	w->gout = malloc(MAX_ELEMS * sizeof(float));
	w->want = malloc(MAX_ELEMS * sizeof(float));
	w->gob = malloc(MAX_ELEMS * sizeof(uint16_t));
	for (int r = 0; r < n; r++) {
		CU(cudaStreamCreateWithFlags(&w->st[r], cudaStreamNonBlocking));
		w->res[r] = dalloc(MAX_ELEMS * sizeof(float));
		w->out[r] = dalloc(MAX_ELEMS * sizeof(float));
		w->ob[r] = dalloc(MAX_ELEMS * sizeof(uint16_t));
		for (int k = 0; k < N_SETS; k++) {
			w->part[r][k] = dalloc(MAX_ELEMS * w->esize);
			w->hpart[r][k] = malloc(MAX_ELEMS * sizeof(float));
			if (!w->part[r][k] || !w->hpart[r][k])
				return -1;
			fill_set(w, r, k);
		}
		if (!w->res[r] || !w->out[r] || !w->ob[r])
			return -1;
	}
	if (!w->gamma || !w->href || !w->got || !w->gout || !w->want || !w->gob)
		return -1;
	fill_residual(w);
	return 0;
}

static void world_fini(struct world *w)
{
	cudaDeviceSynchronize();
	k_cuda_ar_destroy(w->ar);
	for (int r = 0; r < w->n; r++) {
		if (w->st[r])
			cudaStreamDestroy(w->st[r]);
		cudaFree(w->res[r]);
		cudaFree(w->out[r]);
		cudaFree(w->ob[r]);
		for (int k = 0; k < N_SETS; k++) {
			cudaFree(w->part[r][k]);
			free(w->hpart[r][k]);
		}
	}
	cudaFree(w->gamma);
	free(w->hgamma);
	free(w->href);
	free(w->got);
	free(w->gout);
	free(w->want);
	free(w->gob);
}

/* The reduction with partial set k on every rank, in the given form; no sync. */
static int launch(struct world *w, enum form f, int k, int rows, int width)
{
	struct k_cuda_ar_io io[K_CUDA_AR_MAX_RANKS];
	int ret = 0;

	for (int r = 0; r < w->n; r++)
		io[r] = (struct k_cuda_ar_io){ w->part[r][k], w->res[r], w->gamma, w->out[r], w->ob[r] };
	if (f == ONE_LAUNCH)
		return k_cuda_ar_fused_all(w->ar, w->st[0], io, rows, width, EPS);
	for (int r = 0; r < w->n && !ret; r++)	/* issued rank by rank: see k_cuda_comm.h */
		ret = k_cuda_ar_fused(w->ar, r, w->st[r], &io[r], rows, width, EPS);
	return ret;
}

/* The reduction with the given io, a launch per rank; no sync. */
static int launch_io(struct world *w, const struct k_cuda_ar_io *io, int rows, int width)
{
	int ret = 0;

	for (int r = 0; r < w->n && !ret; r++)
		ret = k_cuda_ar_fused(w->ar, r, w->st[r], &io[r], rows, width, EPS);
	return ret;
}

/* The reference of that reduction: href += the set's partials (rank order), then
 * want = rmsnorm(href) * gamma (k_cpu_rmsnorm's arithmetic). */
static void reference(struct world *w, int k, int rows, int width)
{
	for (size_t i = 0; i < (size_t)rows * width; i++) {
		float sum = 0.0f;

		for (int r = 0; r < w->n; r++)
			sum += w->hpart[r][k][i];
		w->href[i] += sum;
	}
	for (int row = 0; row < rows; row++) {
		const float *x = w->href + (size_t)row * width;
		double ss = 0.0;
		float rs;

		for (int i = 0; i < width; i++)
			ss += (double)x[i] * x[i];
		rs = 1.0f / sqrtf((float)(ss / width) + EPS);
		for (int i = 0; i < width; i++)
			w->want[(size_t)row * width + i] = w->hgamma[i] * (x[i] * rs);
	}
}

/* Every rank's residual and out after the last reduction (rows, width) against the
 * reference in href / want; what for the failure lines. */
static void compare(struct world *w, int rows, int width, const char *what)
{
	const size_t e = (size_t)rows * width;
	double worst = 0.0;
	int bad_res = 0, bad_rank = 0, bad_bf16 = 0;

	CU(cudaDeviceSynchronize());
	for (int r = 0; r < w->n; r++) {
		CU(cudaMemcpy(w->got, w->res[r], e * sizeof(float), cudaMemcpyDeviceToHost));
		bad_res += !test_same_floats(w->got, w->href, e);
		if (r == 0) {
			CU(cudaMemcpy(w->gout, w->out[0], e * sizeof(float), cudaMemcpyDeviceToHost));
			for (int row = 0; row < rows; row++)
				worst = test_err_max(worst, test_rel_l2(w->gout + (size_t)row * width,
									w->want + (size_t)row * width,
									width));
		} else {
			CU(cudaMemcpy(w->got, w->out[r], e * sizeof(float), cudaMemcpyDeviceToHost));
			bad_rank += !test_same_floats(w->got, w->gout, e);
		}
		CU(cudaMemcpy(w->gob, w->ob[r], e * sizeof(uint16_t), cudaMemcpyDeviceToHost));
		for (size_t i = 0; i < e; i++)
			if (w->gob[i] != k_f32_to_bf16(w->gout[i])) {
				bad_bf16++;
				break;
			}
	}
	CHECK(bad_res == 0, "%s: %d of %d ranks' residual differ from the reference's bits", what,
	      bad_res, w->n);
	CHECK(bad_rank == 0, "%s: %d ranks' out differ from rank 0's bits", what, bad_rank);
	CHECK(bad_bf16 == 0, "%s: %d ranks' out_bf16 is not out rounded", what, bad_bf16);
	CHECK(worst <= OUT_TOL, "%s: out rel L2 %.3g per row (tol %g)", what, worst, OUT_TOL);
}

/* One reduction per shape with fresh inputs, checked after each. */
static void case_sweep(struct world *w, enum form f, const int *widths, int nw, const int *rows,
		       int nr)
{
	char what[128];

	for (int a = 0; a < nw; a++)
		for (int b = 0; b < nr; b++) {
			const int k = (a * nr + b) % N_SETS;

			for (int r = 0; r < w->n; r++)
				fill_set(w, r, k);
			fill_residual(w);
			snprintf(what, sizeof(what), "tp %d %s %s %d x %d", w->n,
				 w->dtype == K_CUDA_AR_BF16 ? "bf16" : "fp32",
				 f == ONE_LAUNCH ? "one launch" : "per stream", rows[b], widths[a]);
			CHECK(launch(w, f, k, rows[b], widths[a]) == 0, "%s: launch", what);
			reference(w, k, rows[b], widths[a]);
			compare(w, rows[b], widths[a], what);
		}
}

/* The shapes of the back-to-back runs, in turn (5: coprime with the 3 buffers and
 * the 4 sets, so every buffer sees every size and set). */
static const int stress_rows[5] = { 1, 64, 3, 17, 8 };
static const int stress_width[5] = { 7168, 2048, 4096, 5120, 8192 };

/* iters reductions back to back in form f, no host sync; the residual sums them all.
 * (The forms do not mix without events between them: a rank's reductions must follow
 * each other on one stream.) */
static void case_stress(struct world *w, int iters, enum form f)
{
	char what[128];
	int i, last = 0, failed = 0;

	fill_residual(w);
	for (i = 0; i < iters && !failed; i++) {
		last = i % 5;
		failed = launch(w, f, i % N_SETS, stress_rows[last], stress_width[last]) != 0;
		reference(w, i % N_SETS, stress_rows[last], stress_width[last]);
	}
	CHECK(!failed, "tp %d: launch %d of the back-to-back run refused", w->n, i - 1);
	snprintf(what, sizeof(what), "tp %d %s %s: %d reductions back to back", w->n,
		 w->dtype == K_CUDA_AR_BF16 ? "bf16" : "fp32",
		 f == ONE_LAUNCH ? "one launch" : "per stream", iters);
	/* out of the last one; the residual of every one of them */
	compare(w, stress_rows[last], stress_width[last], what);
	if (stress_rows[last] * stress_width[last] < stress_rows[1] * stress_width[1]) {
		/* the residual past the last shape: the 64 x 2048 ones' running sum */
		const size_t e = (size_t)stress_rows[1] * stress_width[1];

		CU(cudaMemcpy(w->got, w->res[w->n - 1], e * sizeof(float), cudaMemcpyDeviceToHost));
		CHECK(test_same_floats(w->got, w->href, e), "%s: the residual of every shape", what);
	}
}

/* A graph of four reductions (sets 0..3, shapes in turn) over every rank's stream,
 * replayed `replays` times, then eager reductions after it. */
static void case_graph(struct world *w, int replays)
{
	static const int rows[4] = { 2, 64, 1, 33 }, width[4] = { 7168, 7168, 4096, 5120 };
	cudaEvent_t fork, join[K_CUDA_AR_MAX_RANKS];
	cudaGraphExec_t exec = NULL;
	cudaGraph_t g = NULL;
	char what[96];
	int ok = 1;

	fill_residual(w);
	CU(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
	for (int r = 0; r < w->n; r++)
		CU(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
	ok &= CU(cudaStreamBeginCapture(w->st[0], cudaStreamCaptureModeThreadLocal));
	ok &= CU(cudaEventRecord(fork, w->st[0]));
	for (int r = 1; r < w->n; r++)
		ok &= CU(cudaStreamWaitEvent(w->st[r], fork, 0));
	for (int k = 0; k < 4; k++)
		ok &= launch(w, PER_STREAM, k, rows[k], width[k]) == 0;
	for (int r = 1; r < w->n; r++) {
		ok &= CU(cudaEventRecord(join[r], w->st[r]));
		ok &= CU(cudaStreamWaitEvent(w->st[0], join[r], 0));
	}
	ok &= CU(cudaStreamEndCapture(w->st[0], &g));
	ok &= g && CU(cudaGraphInstantiate(&exec, g, 0));
	CHECK(ok, "tp %d: capture of four reductions", w->n);
	for (int i = 0; ok && i < replays; i++) {
		ok &= CU(cudaGraphLaunch(exec, w->st[0]));
		for (int k = 0; k < 4; k++)
			reference(w, k, rows[k], width[k]);
	}
	snprintf(what, sizeof(what), "tp %d: graph of 4 reductions replayed %d times", w->n, replays);
	if (ok)
		compare(w, rows[3], width[3], what);
	/* eager after the replays: the turn counters moved on in device memory */
	CU(cudaDeviceSynchronize());
	CHECK(launch(w, PER_STREAM, 1, 5, 7168) == 0, "tp %d: eager after the graph", w->n);
	reference(w, 1, 5, 7168);
	snprintf(what, sizeof(what), "tp %d: eager reduction after the graph", w->n);
	compare(w, 5, 7168, what);
	if (exec)
		cudaGraphExecDestroy(exec);
	if (g)
		cudaGraphDestroy(g);
	cudaEventDestroy(fork);
	for (int r = 0; r < w->n; r++)
		cudaEventDestroy(join[r]);
}

/* Refused arguments: -EINVAL, nothing launched, and the next reduction still right. */
static void case_refused(struct world *w)
{
	struct k_cuda_ar_io io = { w->part[0][0], w->res[0], w->gamma, w->out[0], w->ob[0] };
	struct k_cuda_ar_io odd = io;
	struct k_cuda_ar *bad = NULL;
	int devs[2] = { 0, 0 };

	odd.partial = (const char *)w->part[0][0] + 4;
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &io, 1, 7172, EPS) == -EINVAL, "width 7172 refused");
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &io, MAX_ROWS + 1, 4096, EPS) == -EINVAL,
	      "rows %d refused", MAX_ROWS + 1);
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &io, 0, 4096, EPS) == -EINVAL, "0 rows refused");
	CHECK(k_cuda_ar_fused(w->ar, w->n, w->st[0], &io, 1, 4096, EPS) == -EINVAL, "rank n refused");
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &io, 1, 2 * MAX_WIDTH, EPS) == -EINVAL,
	      "width past max refused");
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &odd, 1, 4096, EPS) == -EINVAL,
	      "misaligned partial refused");
	CHECK(k_cuda_ar_create(&bad, 1, devs, K_CUDA_AR_BF16, 8, 4096) == -EINVAL && !bad,
	      "one rank refused");
	CHECK(k_cuda_ar_create(&bad, 2, devs, K_CUDA_AR_BF16, 8, 4100) == -EINVAL && !bad,
	      "width 4100 refused");
	fill_residual(w);
	CHECK(launch(w, PER_STREAM, 2, 4, 7168) == 0, "tp %d: reduction after the refusals", w->n);
	reference(w, 2, 4, 7168);
	compare(w, 4, 7168, "after the refused calls");
}

/* The plain reductions (gamma NULL): residual += sum; out = sum (no residual); and out
 * in place of the fp32 partial. Every value bit for bit. */
static void case_plain(struct world *w)
{
	struct k_cuda_ar_io io[K_CUDA_AR_MAX_RANKS];
	const int rows = 5, width = 4096;
	const size_t e = (size_t)rows * width;
	float *sum = malloc(e * sizeof(float));
	int bad = 0;

	for (size_t i = 0; i < e; i++) {
		sum[i] = 0.0f;
		for (int r = 0; r < w->n; r++)
			sum[i] += w->hpart[r][0][i];
	}
	fill_residual(w);
	for (int r = 0; r < w->n; r++)
		io[r] = (struct k_cuda_ar_io){ w->part[r][0], w->res[r], NULL, NULL, NULL };
	for (int r = 0; r < w->n; r++)
		CHECK(k_cuda_ar_fused(w->ar, r, w->st[r], &io[r], rows, width, EPS) == 0, "plain r %d", r);
	reference(w, 0, rows, width);	/* href += sum */
	CU(cudaDeviceSynchronize());
	for (int r = 0; r < w->n; r++) {
		CU(cudaMemcpy(w->got, w->res[r], e * sizeof(float), cudaMemcpyDeviceToHost));
		bad += !test_same_floats(w->got, w->href, e);
	}
	CHECK(bad == 0, "tp %d: residual += sum without norm: %d ranks differ", w->n, bad);
	/* out = sum, then in place of the partial (fp32) */
	for (int pass = 0; pass < 2; pass++) {
		for (int r = 0; r < w->n; r++) {
			float *o = pass ? (float *)w->part[r][0] : w->out[r];

			io[r] = (struct k_cuda_ar_io){ w->part[r][0], NULL, NULL, o, w->ob[r] };
		}
		CHECK(launch_io(w, io, rows, width) == 0, "tp %d: sum into out (pass %d)", w->n, pass);
		CU(cudaDeviceSynchronize());
		bad = 0;
		for (int r = 0; r < w->n; r++) {
			const float *o = pass ? (float *)w->part[r][0] : w->out[r];

			CU(cudaMemcpy(w->got, o, e * sizeof(float), cudaMemcpyDeviceToHost));
			bad += !test_same_floats(w->got, sum, e);
		}
		CHECK(bad == 0, "tp %d: out = sum%s: %d ranks differ", w->n, pass ? " in place" : "",
		      bad);
	}
	io[0] = (struct k_cuda_ar_io){ w->part[0][0], NULL, w->gamma, w->out[0], NULL };
	CHECK(k_cuda_ar_fused(w->ar, 0, w->st[0], &io[0], rows, width, EPS) == -EINVAL,
	      "gamma without a residual refused");
	for (int r = 0; r < w->n; r++)
		fill_set(w, r, 0);	/* the in-place pass overwrote set 0 */
	free(sum);
}

static void run_full(void)
{
	static const int ns[4] = { 2, 3, 4, 8 };
	static const int widths[6] = { 2048, 4096, 5120, 7168, 8192, 16384 };
	static const int rows[5] = { 1, 2, 7, 33, 64 };
	static const int fw[3] = { 4096, 7168, 16384 }, fr[3] = { 1, 5, 64 };

	for (int i = 0; i < 4; i++) {
		struct world w;
		double t0 = test_now_s();

		if (world_init(&w, ns[i], K_CUDA_AR_BF16) == 0) {
			case_sweep(&w, PER_STREAM, widths, 6, rows, 5);
			case_sweep(&w, ONE_LAUNCH, widths + 2, 2, rows + 1, 3);
			case_stress(&w, 2000, PER_STREAM);
			case_stress(&w, 500, ONE_LAUNCH);
			case_graph(&w, 200);
			case_refused(&w);
		}
		world_fini(&w);
		fprintf(stderr, "test_cuda_allreduce: tp %d bf16 done in %.1f s\n", ns[i],
			test_now_s() - t0);
	}
	{
		struct world w;

		if (world_init(&w, 4, K_CUDA_AR_F32) == 0) {
			case_sweep(&w, PER_STREAM, fw, 3, fr, 3);
			case_sweep(&w, ONE_LAUNCH, fw, 3, fr, 3);
			case_plain(&w);
			case_stress(&w, 1000, PER_STREAM);
		}
		world_fini(&w);
	}
}

/* kernels/cpu/sample.c's greedy scan: the highest, the lower index on ties, NaNs
 * passed over (all NaN: the last). */
static int host_argmax(const float *l, int n)
{
	int best = 0;

	for (int i = 1; i < n; i++)
		if (l[i] > l[best] || l[best] != l[best])
			best = i;
	return best;
}

/* k_cuda_argmax_slice on rows of vn values from a pool of few (ties), as the slice
 * [v0, v0 + vn) of a vocabulary: each row's (value, v0 + index) equals the scan's. */
static void case_argmax(void)
{
	static const float pool[] = { -1.0f, 0.0f, -0.0f, 2.0f, 2.0f, 1e30f, NAN, INFINITY, -INFINITY };
	static const int vns[] = { 1, 7, 31, 512, 513, 4099, 64128 };
	const int rows = 64, v0 = 1000;
	int bad = 0, cases = 0;

	for (size_t a = 0; a < sizeof(vns) / sizeof(vns[0]); a++) {
		const int vn = vns[a];
		const size_t e = (size_t)rows * vn;
		float *h = malloc(e * sizeof(float)), *d = NULL;
		uint32_t got[2 * 64], *dbest = NULL;

		for (int r = 0; r < rows; r++) {
			int kinds = r % 4 == 0 ? 9 : r % 4 == 1 ? 5 : r % 4 == 2 ? 7 : 1;

			for (int i = 0; i < vn; i++)
				h[(size_t)r * vn + i] = kinds == 1 ? NAN
							: pool[test_rand_int(0, kinds - 1, &seed)];
			if (r % 8 == 3)	/* the best near the end */
				h[(size_t)r * vn + vn - 1] = 3e30f;
		}
		CU(cudaMalloc((void **)&d, e * sizeof(float)));
		CU(cudaMalloc((void **)&dbest, sizeof(got)));
		CU(cudaMemcpy(d, h, e * sizeof(float), cudaMemcpyHostToDevice));
		CHECK(k_cuda_argmax_slice(0, dbest, d, rows, vn, v0) == 0, "argmax_slice of %d", vn);
		CU(cudaMemcpy(got, dbest, 2 * rows * sizeof(uint32_t), cudaMemcpyDeviceToHost));
		for (int r = 0; r < rows; r++, cases++) {
			int want = host_argmax(h + (size_t)r * vn, vn);
			float wv = h[(size_t)r * vn + want], gv;

			memcpy(&gv, &got[r], sizeof(gv));
			bad += (int32_t)got[rows + r] != v0 + want || memcmp(&gv, &wv, sizeof(gv));
		}
		cudaFree(d);
		cudaFree(dbest);
		free(h);
	}
	CHECK(k_cuda_argmax_slice(0, NULL, NULL, 1, 1, 0) == -EINVAL, "argmax_slice: NULL refused");
	CHECK(bad == 0, "argmax_slice: %d of %d rows differ from the host scan", bad, cases);
	fprintf(stderr, "test_cuda_allreduce: argmax_slice %d rows (ties, NaN, inf, +-0) as the scan\n",
		cases);
}

/* For the sanitizers: two ranks, a few shapes, one form. */
static void run_small(enum form f)
{
	static const int widths[2] = { 2048, 7168 }, rows[2] = { 1, 3 };
	struct world w;

	if (world_init(&w, 2, K_CUDA_AR_BF16) == 0) {
		case_sweep(&w, f, widths, 2, rows, 2);
		fill_residual(&w);
		for (int i = 0; i < 6; i++) {
			CHECK(launch(&w, f, i % N_SETS, 3, 2048) == 0, "small: launch %d", i);
			reference(&w, i % N_SETS, 3, 2048);
		}
		compare(&w, 3, 2048, "small: 6 back to back");
	}
	world_fini(&w);
}

int main(void)
{
	if (!test_gpu_present("test_cuda_allreduce"))
		return 77;
	seed = test_seed();
	fprintf(stderr, "test_cuda_allreduce: seed %llu\n", seed);
	CU(cudaSetDevice(0));
	if (getenv("KD_TEST_QUICK") && atoi(getenv("KD_TEST_QUICK")))
		run_small(getenv("KD_TEST_PART") && !strcmp(getenv("KD_TEST_PART"), "streams") ?
			  PER_STREAM : ONE_LAUNCH);
	else
		run_full();
	case_argmax();
	return test_result("test_cuda_allreduce");
}

#else
int main(void)
{
	fprintf(stderr, "test_cuda_allreduce: skipped: built without CUDA\n");
	return 77;
}
#endif
