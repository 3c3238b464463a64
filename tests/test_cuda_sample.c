/* GPU sampling against k_cpu_sample. Greedy must equal the CPU's argmax exactly
 * (exact ties, -inf and NaN included). Sampled ids, for the same (seed, step):
 *  - must equal an exact reference on >= 98% of the draws, in each configuration (plus
 *    one draw: a config of 36 draws may hold one boundary case) and over all of them
 *    (a bug confined to one config must not hide among the others): k_cpu_sample's procedure
 *    with its fp32 sums replaced by the kernel's exact 2^-40 fixed-point sums (they can
 *    differ only where CUDA's and glibc's expf differ in a last bit at a boundary);
 *  - must equal k_cpu_sample on >= 98% of the draws from realistic rows, per config
 *    (plus one) and over all (a few tokens
 *    far above a long tail). On the stress rows (flat, quantised with exact ties,
 *    all equal) the CPU's sequential fp32 sums over ~10^5 terms drift by more than one
 *    token's mass, so its draws differ there by design; that rate is printed only;
 *  - must lie in the allowed set (top-k, then the top-p prefix, in fp64 with a 1e-5
 *    margin).
 * Also: repeated calls give the same ids, and a captured CUDA graph replays them.
 * Vocab 151936 (64 rows) and 1001 (9 rows, unaligned). Skips (77) without CUDA/GPU.
 * KD_TEST_QUICK=1 (compute-sanitizer, whose racecheck tracks every shared-memory access
 * of the radix rounds): vocab 32768 (3 rows) instead of 151936 (64). Timings:
 * tests/bench/bench_cuda_sample. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu_sample.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/sample/k_cuda_sample.h"
#include "tests/cudatest.h"
#include "tests/sampletest.h"

#define BIG_VOCAB 151936
#define ROWS 64
#define STEPS 4
#define MAX_MISMATCH 0.02

/* n mismatches of draws within the limit for one configuration: MAX_MISMATCH, plus one
 * draw so that a small config (36 draws) may hold a single boundary case (measured on
 * an H200: none in 2336 draws). */
static int config_ok(int n, int draws)
{
	return n <= MAX_MISMATCH * draws + 1;
}
#define P_MARGIN 1e-5

static unsigned long long seed = 0x5a3b1eull;
static cudaStream_t stream;
static struct k_cuda_sample_ws *ws;
static int n_draws, n_real, n_cpu_real, n_cpu_all, n_ref, n_outside;

/* ---- the allowed set, in fp64 --------------------------------------------- */

static const float *cmp_l;

static int cmp_rank(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	float lx = cmp_l[x], ly = cmp_l[y];

	if (lx != ly)
		return lx > ly ? -1 : 1;
	return x < y ? -1 : x > y;
}

/* order: the non-NaN ids by logit (ties: lower id); returns how many. */
static int rank_order(const float *l, int vocab, int32_t *order)
{
	int n = 0;

	for (int i = 0; i < vocab; i++)
		if (l[i] == l[i])
			order[n++] = i;
	cmp_l = l;
	qsort(order, (size_t)n, sizeof(*order), cmp_rank);
	return n;
}

/* Is tok a token p may draw? rank below top_k, and the mass ranked before it below
 * top_p of the candidates' mass (with a margin for fp32 sums). */
static int allowed(const float *l, const int32_t *order, int n, const struct k_sample_params *p,
		   int32_t tok)
{
	int k = p->top_k > 0 && p->top_k < n ? p->top_k : n, r = -1;
	double zmax, total = 0, before = 0;

	if (p->temperature <= 0)
		return 1;
	for (int i = 0; i < k; i++)
		if (order[i] == tok)
			r = i;
	if (r < 0)
		return 0;
	if (!(p->top_p > 0 && p->top_p < 1))
		return 1;
	zmax = (double)(l[order[0]] / p->temperature);
	for (int i = 0; i < k; i++) {
		double m = exp((double)(l[order[i]] / p->temperature) - zmax);

		total += m;
		if (i < r)
			before += m;
	}
	return before < p->top_p * total * (1 + P_MARGIN);
}

/* k_cpu_sample's procedure over the ranked ids with exact sums: each weight is
 * expf(l / T - max) in units of 2^-40, rounded to nearest even, as the kernel does. */
static uint64_t fixed_mass(float l, float t, float zmax)
{
	float e = expf(l / t - zmax);

	return e > 0 ? (uint64_t)llrintf(e * 1099511627776.0f) : 0;
}

static uint64_t frac_units(float frac, uint64_t total)
{
	double x = ceil((double)frac * (double)total);

	return x <= 0 ? 0 : x >= (double)total ? total : (uint64_t)x;
}

static int32_t ref_sample(const float *l, const int32_t *order, int n_ok,
			  const struct k_sample_params *p, uint64_t step)
{
	int n = p->top_k > 0 && p->top_k < n_ok ? p->top_k : n_ok, keep = n, i;
	float t = p->temperature, zmax;
	uint64_t total = 0, cum = 0, need;

	if (n == 0)
		return 0;
	zmax = l[order[0]] / t;
	for (i = 0; i < n; i++)
		total += fixed_mass(l[order[i]], t, zmax);
	if (p->top_p > 0 && p->top_p < 1) {
		need = frac_units(p->top_p, total);
		for (i = 0, cum = 0; i < n; i++) {
			cum += fixed_mass(l[order[i]], t, zmax);
			if (cum >= need)
				break;
		}
		keep = i < n ? i + 1 : n;
		total = cum;
	}
	need = frac_units(k_sample_uniform(p->seed, step), total);
	for (i = 0, cum = 0; i < keep; i++) {
		cum += fixed_mass(l[order[i]], t, zmax);
		if (cum >= need)
			return order[i];
	}
	return order[keep - 1];
}

/* ---- one configuration over all rows and steps ------------------------------ */

static void run_gpu(int32_t *ids, const float *dl, int M, int vocab,
		    const struct k_sample_params *params, const uint64_t *steps)
{
	struct k_sample_params *dp = dalloc(sizeof(*dp) * M);
	uint64_t *ds = dalloc(sizeof(*ds) * M);
	int32_t *di = dalloc(sizeof(*di) * M);
	int ret;

	CU(cudaMemcpy(dp, params, sizeof(*dp) * M, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(ds, steps, sizeof(*ds) * M, cudaMemcpyHostToDevice));
	CU(cudaMemset(di, 0xff, sizeof(*di) * M));
	ret = k_cuda_sample(stream, ws, di, dl, M, vocab, dp, ds);
	CHECK(ret == 0, "k_cuda_sample returned %d", ret);
	CU(cudaStreamSynchronize(stream));
	CU(cudaMemcpy(ids, di, sizeof(*di) * M, cudaMemcpyDeviceToHost));
	cudaFree(dp);
	cudaFree(ds);
	cudaFree(di);
}

static void test_config(const float *l, const float *dl, int32_t *const *order, const int *n_ok,
			int M, int vocab, const struct sample_cfg *c, int ci, float *work)
{
	struct k_sample_params p[ROWS];
	uint64_t steps[ROWS];
	int32_t got[ROWS];
	int cpu_all = 0, cpu_real = 0, real = 0, ref = 0, out = 0, draws = 0;

	for (int s = 0; s < STEPS; s++) {
		sample_params_for(p, steps, M, c, s, ci);
		run_gpu(got, dl, M, vocab, p, steps);
		for (int r = 0; r < M; r++) {
			const float *row = l + (size_t)r * vocab;
			int32_t want = k_cpu_sample(row, vocab, &p[r], steps[r], work);
			int32_t exact = ref_sample(row, order[r], n_ok[r], &p[r], steps[r]);

			draws++;
			real += sample_realistic(r);
			cpu_all += got[r] != want;
			cpu_real += got[r] != want && sample_realistic(r);
			if (got[r] != exact && ref++ < 3)
				fprintf(stderr, "  T %g k %d p %g row %d (kind %d) step %d: gpu %d, exact %d, cpu %d\n",
					c->temperature, c->top_k, c->top_p, r, sample_row_kind(r), s, got[r],
					exact, want);
			if (got[r] < 0 || got[r] >= vocab ||
			    !allowed(row, order[r], n_ok[r], &p[r], got[r])) {
				out++;
				fprintf(stderr, "  T %g k %d p %g row %d: token %d outside the set\n",
					c->temperature, c->top_k, c->top_p, r, got[r]);
			}
		}
	}
	printf("sample  vocab %6d M %2d  T %.2f top_k %4d top_p %.2f: %4d draws; differ from exact %3d, "
	       "from cpu %3d of %3d realistic, %3d of all; %d outside  %s\n",
	       vocab, M, c->temperature, c->top_k, c->top_p, draws, ref, cpu_real, real, cpu_all, out,
	       !out && config_ok(ref, draws) && config_ok(cpu_real, real) ? "PASS" : "FAIL");
	CHECK(out == 0, "%d tokens outside the allowed set", out);
	CHECK(config_ok(ref, draws), "vocab %d T %g top_k %d top_p %g: %d of %d draws differ from exact",
	      vocab, c->temperature, c->top_k, c->top_p, ref, draws);
	CHECK(config_ok(cpu_real, real), "vocab %d T %g top_k %d top_p %g: %d of %d realistic draws differ "
	      "from cpu", vocab, c->temperature, c->top_k, c->top_p, cpu_real, real);
	n_draws += draws;
	n_real += real;
	n_cpu_real += cpu_real;
	n_cpu_all += cpu_all;
	n_ref += ref;
	n_outside += out;
}

static void test_greedy(float *l, int M, int vocab, float *work)
{
	struct k_sample_params p[ROWS];
	uint64_t steps[ROWS];
	int32_t got[ROWS];
	float *dl = dalloc(sizeof(float) * (size_t)M * vocab);
	int bad = 0;

	for (int r = 0; r < M; r++) {	/* exact ties of the max, before and after it */
		float *row = l + (size_t)r * vocab;
		int best = 0;

		for (int i = 1; i < vocab; i++)
			if (row[i] > row[best])
				best = i;
		if (r % 3 == 1)
			row[test_rand_int(0, vocab - 1, &seed)] = row[best];
		if (r % 3 == 2 && best > 0)
			row[test_rand_int(0, best - 1, &seed)] = row[best];
		p[r] = (struct k_sample_params){ .temperature = r % 2 ? 0.0f : -1.0f, .top_k = 5 };
		steps[r] = 0;
	}
	CU(cudaMemcpy(dl, l, sizeof(float) * (size_t)M * vocab, cudaMemcpyHostToDevice));
	/* twice: a row split over several blocks leaves its workspace slots clear */
	for (int pass = 0; pass < 2; pass++) {
		run_gpu(got, dl, M, vocab, p, steps);
		for (int r = 0; r < M; r++) {
			int32_t want = k_cpu_sample(l + (size_t)r * vocab, vocab, &p[r], 0, work);

			if (got[r] != want && bad++ < 3)
				fprintf(stderr, "  greedy row %d (pass %d): gpu %d, cpu %d\n", r, pass,
					got[r], want);
		}
	}
	printf("sample  vocab %6d M %2d  greedy (exact ties): %d differ  %s\n", vocab, M, bad,
	       bad ? "FAIL" : "PASS");
	CHECK(bad == 0, "greedy: %d rows differ", bad);
	cudaFree(dl);
}

/* The same call twice, and once through a captured graph: the same ids. */
static void test_repeat_and_graph(const float *dl, int M, int vocab)
{
	struct sample_cfg c = { 0.9f, 0, 0.95f };
	struct k_sample_params p[ROWS], *dp = dalloc(sizeof(p));
	uint64_t steps[ROWS], *ds = dalloc(sizeof(steps));
	int32_t a[ROWS], b[ROWS], g[ROWS], *di = dalloc(sizeof(g));
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	int ret, same = 1, ok;

	sample_params_for(p, steps, M, &c, 2, 99);
	run_gpu(a, dl, M, vocab, p, steps);
	run_gpu(b, dl, M, vocab, p, steps);
	for (int r = 0; r < M; r++)
		same &= a[r] == b[r];
	CU(cudaMemcpy(dp, p, sizeof(*dp) * M, cudaMemcpyHostToDevice));
	/* captured with other steps, replayed with step 2's */
	sample_params_for(p, steps, M, &c, 0, 99);
	CU(cudaMemcpy(ds, steps, sizeof(*ds) * M, cudaMemcpyHostToDevice));
	ok = CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
	ret = k_cuda_sample(stream, ws, di, dl, M, vocab, dp, ds);
	ok = CU(cudaStreamEndCapture(stream, &graph)) && ok;
	CHECK(ret == 0, "captured k_cuda_sample returned %d", ret);
	ok = ok && CU(cudaGraphInstantiate(&exec, graph, 0));
	sample_params_for(p, steps, M, &c, 2, 99);
	CU(cudaMemcpy(ds, steps, sizeof(*ds) * M, cudaMemcpyHostToDevice));
	CU(cudaMemset(di, 0xff, sizeof(g)));
	ok = ok && CU(cudaGraphLaunch(exec, stream)) && CU(cudaStreamSynchronize(stream)) &&
	     CU(cudaMemcpy(g, di, sizeof(*di) * M, cudaMemcpyDeviceToHost));
	for (int r = 0; r < M; r++)
		same &= ok && a[r] == g[r];
	printf("sample  vocab %6d M %2d  repeat and graph replay identical: %s\n", vocab, M,
	       same ? "PASS" : "FAIL");
	CHECK(same, "repeat / graph replay gave other ids");
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	cudaFree(dp);
	cudaFree(ds);
	cudaFree(di);
}

static void test_vocab(int vocab, int M)
{
	const struct sample_cfg cfgs[] = {
		{ 1.0f, 0, 0 }, { 0.7f, 50, 0 }, { 1.0f, 0, 0.9f }, { 0.8f, 40, 0.95f },
		{ 1.3f, 1, 0 }, { 1.0f, 2000, 0.9f }, { 0.6f, 0, 0.5f }, { 1.0f, 5000, 0 },
	};
	size_t n = (size_t)M * vocab;
	float *l = malloc(sizeof(float) * n), *dl = dalloc(sizeof(float) * n);
	float *work = malloc(sizeof(float) * K_CPU_SAMPLE_WORK(vocab));
	int32_t *order[ROWS];
	int n_ok[ROWS];

	for (int r = 0; r < M; r++) {
		sample_make_logits(l + (size_t)r * vocab, vocab, r, &seed);
		order[r] = malloc(sizeof(int32_t) * vocab);
		n_ok[r] = rank_order(l + (size_t)r * vocab, vocab, order[r]);
	}
	CU(cudaMemcpy(dl, l, sizeof(float) * n, cudaMemcpyHostToDevice));
	for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++)
		test_config(l, dl, order, n_ok, M, vocab, &cfgs[c], (int)c, work);
	test_repeat_and_graph(dl, M, vocab);
	/* last: they edit l. Fewer rows split each over more blocks (up to 16 at M = 1) */
	test_greedy(l, M, vocab, work);
	test_greedy(l, 1, vocab, work);
	test_greedy(l, 3, vocab, work);
	for (int r = 0; r < M; r++)
		free(order[r]);
	free(l);
	free(work);
	cudaFree(dl);
}

int main(void)
{
	int ret;

	if (!test_gpu_present("test_cuda_sample"))
		return 77;
	setvbuf(stdout, NULL, _IOLBF, 0);	/* a run cut off (a sanitizer's cap) shows its cases */
	CU(cudaStreamCreate(&stream));
	ret = k_cuda_sample_ws_create(&ws, ROWS, BIG_VOCAB);
	CHECK(ret == 0, "ws create %d", ret);
	if (ret)
		return test_result("test_cuda_sample");
	if (test_env_flag("KD_TEST_QUICK"))
		test_vocab(32768, 3);	/* still past S_CAND and split over 8 greedy blocks */
	else
		test_vocab(BIG_VOCAB, ROWS);
	test_vocab(1001, 9);
	printf("sample  all: %d draws: differ from exact %d (%.3f%%); from cpu %d of %d realistic "
	       "(%.3f%%), %d of all (%.3f%%, stress rows included); %d outside the set  %s\n",
	       n_draws, n_ref, 100.0 * n_ref / n_draws, n_cpu_real, n_real,
	       100.0 * n_cpu_real / n_real, n_cpu_all, 100.0 * n_cpu_all / n_draws, n_outside,
	       n_ref <= MAX_MISMATCH * n_draws && n_cpu_real <= MAX_MISMATCH * n_real && !n_outside ?
	       "PASS" : "FAIL");
	CHECK(n_ref <= MAX_MISMATCH * n_draws, "differ from exact: %.3f%%", 100.0 * n_ref / n_draws);
	CHECK(n_cpu_real <= MAX_MISMATCH * n_real, "differ from cpu on realistic rows: %.3f%%",
	      100.0 * n_cpu_real / n_real);
	k_cuda_sample_ws_destroy(ws);
	cudaStreamDestroy(stream);
	return test_result("test_cuda_sample");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_sample: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
