/* The split merge of decode attention (attn_ws.cu) against a double-precision
 * reference: the split counts the attention calls use, one live split of many, all
 * live, odd counts and dims, strided and unaligned outputs, heads where no split saw a
 * token (their partials NaN: a read one poisons its output), outputs poisoned first.
 * Both merge kernels, bit for bit alike. Skips (77) without CUDA or a GPU.
 * KD_TEST_SEED=n: repeat a run. Timings: tests/bench/bench_cuda_attn. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "tests/cudatest.h"

static unsigned long long seed;

/* ---- the split merge ------------------------------------------------------ */

/* Tolerance of the merge against its double-precision reference, absolute per element:
 * partials in [-1, 1] and weights summing to 1 keep every output in [-1, 1], and the
 * fp32 weights and fmaf sums of <= 128 terms are off by ~1e-7; 1e-5 fails on any wrong,
 * missing or extra split, weight or element. The batched kernel (attn_merge_batched 1)
 * must also match the default block kernel bit for bit, fp32 and bf16. */
#define MERGE_TOL 1e-5

/* Which splits of each (row, head) saw tokens: the first `live` (as a step's splits
 * past the context), `live` at random places, and with dead_rh every third (row, head)
 * none at all (ctx 0). */
enum merge_live { MERGE_PREFIX, MERGE_SCATTER };

struct merge_shape {
	int n_splits, n_rows, n_heads, dim;
	int live;
	enum merge_live how;
	int dead_rh;
	int pad_h, pad_r;	/* out_hs = dim + pad_h, out_rs = n_heads * out_hs + pad_r */
};

/* Inputs of one merge: partials in [-1, 1] where live and NaN where not (a read one
 * would poison its output), lse in [-8, 8] or -inf; and the reference output. */
struct merge_run {
	struct merge_shape sh;
	long out_rs, out_hs;
	size_t n_out;			/* floats of out (n_rows * out_rs) */
	float *o, *lse, *ref;		/* host */
	float *d_o, *d_lse, *d_out;	/* device */
	uint16_t *d_bf16;
	struct k_cuda_attn_ws *ws;
};

static void merge_pick_live(const struct merge_shape *sh, size_t rh, char *on)
{
	int want = sh->dead_rh && rh % 3 == 1 ? 0 : sh->live, have = 0;

	memset(on, 0, (size_t)sh->n_splits);
	if (sh->how == MERGE_PREFIX) {
		memset(on, 1, (size_t)want);
		return;
	}
	while (have < want) {
		int sp = test_rand_int(0, sh->n_splits - 1, &seed);

		have += !on[sp];
		on[sp] = 1;
	}
}

/* The reference: out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), in double. */
static void merge_reference(struct merge_run *m)
{
	const struct merge_shape *sh = &m->sh;
	size_t per_split = (size_t)sh->n_rows * sh->n_heads;

	for (size_t rh = 0; rh < per_split; rh++) {
		double mx = -INFINITY, sum = 0;

		for (int sp = 0; sp < sh->n_splits; sp++)
			if (m->lse[sp * per_split + rh] > mx)
				mx = m->lse[sp * per_split + rh];
		for (int sp = 0; sp < sh->n_splits; sp++)
			if (isfinite(m->lse[sp * per_split + rh]))
				sum += exp2(m->lse[sp * per_split + rh] - mx);
		for (int d = 0; d < sh->dim; d++) {
			double acc = 0;

			for (int sp = 0; sp < sh->n_splits; sp++) {
				size_t at = sp * per_split + rh;

				if (isfinite(m->lse[at]))
					acc += exp2(m->lse[at] - mx) * m->o[at * sh->dim + d];
			}
			m->ref[rh * sh->dim + d] = sum > 0 ? (float)(acc / sum) : 0.0f;
		}
	}
}

static int merge_setup(struct merge_run *m, struct merge_shape sh)
{
	size_t per_split = (size_t)sh.n_rows * sh.n_heads, n_o = sh.n_splits * per_split * sh.dim;
	char on[128];

	memset(m, 0, sizeof(*m));
	m->sh = sh;
	m->out_hs = sh.dim + sh.pad_h;
	m->out_rs = sh.n_heads * m->out_hs + sh.pad_r;
	m->n_out = (size_t)sh.n_rows * m->out_rs;
	m->o = malloc(sizeof(float) * n_o);
	m->lse = malloc(sizeof(float) * sh.n_splits * per_split);
	m->ref = malloc(sizeof(float) * per_split * sh.dim);
	for (size_t rh = 0; rh < per_split; rh++) {
		merge_pick_live(&sh, rh, on);
		for (int sp = 0; sp < sh.n_splits; sp++) {
			size_t at = sp * per_split + rh;

			m->lse[at] = on[sp] ? 8.0f * test_randf(&seed) : -INFINITY;
			for (int d = 0; d < sh.dim; d++)
				m->o[at * sh.dim + d] = on[sp] ? test_randf(&seed) : NAN;
		}
	}
	merge_reference(m);
	m->d_o = dup_to_device(m->o, sizeof(float) * n_o);
	m->d_lse = dup_to_device(m->lse, sizeof(float) * sh.n_splits * per_split);
	m->d_out = dalloc(sizeof(float) * m->n_out);
	m->d_bf16 = dalloc(sizeof(uint16_t) * m->n_out);
	if (!m->d_o || !m->d_lse || !m->d_out || !m->d_bf16)
		return -1;
	return k_cuda_attn_ws_create(&m->ws, 1, 1, 1, 0) ? -1 : 0;
}

static void merge_teardown(struct merge_run *m)
{
	k_cuda_attn_ws_destroy(m->ws);
	free(m->o);
	free(m->lse);
	free(m->ref);
	cudaFree(m->d_o);
	cudaFree(m->d_lse);
	cudaFree(m->d_out);
	cudaFree(m->d_bf16);
}

static int merge_call(struct merge_run *m)
{
	return k_cuda_attn_merge(0, m->ws, m->d_o, m->d_lse, m->sh.n_splits, m->sh.n_rows,
				 m->sh.n_heads, m->sh.dim, m->d_out, m->out_rs, m->out_hs,
				 m->d_bf16);
}

/* With the batched kernel (batched 1) or the block one: poisons out (NaN) and out_bf16
 * (0xffff), merges, downloads both; 0 or -1. */
static int merge_once(struct merge_run *m, int batched, float *out, uint16_t *bf)
{
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	int ret;

	poison(m->d_out, sizeof(float) * m->n_out);
	poison(m->d_bf16, sizeof(uint16_t) * m->n_out);
	t.attn_merge_batched = batched;
	k_cuda_tuning_set(&t);
	ret = merge_call(m);
	k_cuda_tuning_set(&was);
	CHECK(ret == 0, "k_cuda_attn_merge: %d", ret);
	if (ret || !CU(cudaDeviceSynchronize()) ||
	    !CU(cudaMemcpy(out, m->d_out, sizeof(float) * m->n_out, cudaMemcpyDeviceToHost)) ||
	    !CU(cudaMemcpy(bf, m->d_bf16, sizeof(uint16_t) * m->n_out, cudaMemcpyDeviceToHost)))
		return -1;
	return 0;
}

/* Every output within MERGE_TOL of the reference and its bf16 its rounding; every
 * value between the rows' and heads' outputs (the strides' padding) still poison.
 * Returns the number of bad values; *max_abs the largest error. */
static size_t merge_verify(const struct merge_run *m, const float *out, const uint16_t *bf,
			   double *max_abs)
{
	const struct merge_shape *sh = &m->sh;
	size_t bad = 0;

	*max_abs = 0;
	for (size_t i = 0; i < m->n_out; i++) {
		long r = (long)(i / m->out_rs), in_r = (long)(i % m->out_rs);
		long h = in_r / m->out_hs, d = in_r % m->out_hs;
		uint32_t bits;
		double err;

		memcpy(&bits, &out[i], sizeof(bits));
		if (h >= sh->n_heads || d >= sh->dim) {
			bad += bits != 0xffffffffu || bf[i] != 0xffff;
			continue;
		}
		err = fabs((double)out[i] - m->ref[((size_t)r * sh->n_heads + h) * sh->dim + d]);
		if (!(err <= MERGE_TOL) || bf[i] != k_f32_to_bf16(out[i]))
			bad++;
		else if (err > *max_abs)
			*max_abs = err;
	}
	return bad;
}

/* The batched merge against the reference, then the default block kernel's against it
 * bit for bit. */
static void merge_case(struct merge_shape sh)
{
	struct merge_run m;
	float *got = NULL, *old = NULL;
	uint16_t *got_bf = NULL, *old_bf = NULL;
	size_t bad = 0, differ = 0;
	double max_abs = 0;
	char label[160];

	snprintf(label, sizeof(label), "merge splits %d (%d live%s%s) rows %d heads %d dim %d "
		 "pad %d/%d", sh.n_splits, sh.live, sh.how == MERGE_SCATTER ? ", scattered" : "",
		 sh.dead_rh ? ", some none" : "", sh.n_rows, sh.n_heads, sh.dim, sh.pad_h, sh.pad_r);
	if (merge_setup(&m, sh)) {
		CHECK(0, "%s: setup", label);
		goto out;
	}
	got = malloc(sizeof(float) * m.n_out);
	old = malloc(sizeof(float) * m.n_out);
	got_bf = malloc(sizeof(uint16_t) * m.n_out);
	old_bf = malloc(sizeof(uint16_t) * m.n_out);
	if (merge_once(&m, 1, got, got_bf))
		goto out;
	bad = merge_verify(&m, got, got_bf, &max_abs);
	if (merge_once(&m, 0, old, old_bf) == 0)
		for (size_t i = 0; i < m.n_out; i++)
			differ += memcmp(&got[i], &old[i], sizeof(float)) != 0 ||
				  got_bf[i] != old_bf[i];
	else
		differ = m.n_out;
	fprintf(stderr, "%-72s max_abs %.2e bad %zu differ %zu %s\n", label, max_abs, bad, differ,
		!bad && !differ ? "PASS" : "FAIL");
	CHECK(!bad && !differ, "%s: %zu values off the reference (tolerance %g abs), %zu differ "
	      "from the block kernel's", label, bad, MERGE_TOL, differ);
out:
	merge_teardown(&m);
	free(got);
	free(old);
	free(got_bf);
	free(old_bf);
}

/* The split counts the attention calls use and the merge's lane widths (on a 132-SM
 * H200: 1 float where splits > 8 or few heads, 2 for 9..16 splits, 4 for <= 8 splits
 * on many heads, 1 where alignment forbids more): batch 1 as a Llama-3.1-8B graph sizes
 * it (50 splits, 32 live at ctx 1024), one live of many, all live, 33 (two rounds of
 * 32 loads), batch 64 (3 splits), odd counts and dims, strided and unaligned outputs,
 * heads where no split saw a token. */
static void test_merge(void)
{
	static const struct merge_shape cases[] = {
		{ 50, 1, 32, 128, 32, MERGE_PREFIX, 0, 0, 0 },
		{ 128, 1, 32, 128, 1, MERGE_PREFIX, 0, 0, 0 },
		{ 128, 1, 32, 128, 1, MERGE_SCATTER, 0, 0, 0 },
		{ 128, 1, 32, 128, 128, MERGE_PREFIX, 0, 0, 0 },
		{ 128, 1, 32, 128, 33, MERGE_SCATTER, 1, 0, 0 },
		{ 64, 1, 8, 64, 61, MERGE_SCATTER, 0, 0, 0 },
		{ 3, 64, 32, 128, 3, MERGE_PREFIX, 0, 0, 0 },
		{ 3, 64, 32, 128, 2, MERGE_SCATTER, 1, 4, 8 },
		{ 4, 64, 32, 128, 3, MERGE_SCATTER, 0, 1, 0 },
		{ 13, 7, 32, 128, 11, MERGE_SCATTER, 1, 0, 0 },
		{ 7, 5, 12, 24, 5, MERGE_SCATTER, 0, 0, 0 },
		{ 9, 3, 5, 37, 4, MERGE_SCATTER, 1, 3, 1 },
		{ 1, 3, 10, 40, 1, MERGE_PREFIX, 0, 0, 0 },
		{ 2, 33, 10, 20, 2, MERGE_PREFIX, 1, 0, 0 },
		{ 128, 2, 16, 512, 33, MERGE_PREFIX, 0, 0, 0 },
		{ 5, 64, 16, 512, 5, MERGE_SCATTER, 1, 0, 4 },
		{ 6, 16, 4, 256, 4, MERGE_SCATTER, 0, 2, 2 },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		merge_case(cases[i]);
}

int main(void)
{
	char name[128];
	double gib;
	int major, minor;

	if (!test_gpu_present("test_cuda_merge"))
		return 77;
	seed = test_seed();
	CHECK(k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor) == 0, "describe");
	fprintf(stderr, "device 0: %s, %.1f GiB, sm_%d%d; seed %llu (KD_TEST_SEED repeats it); "
		"tolerance %g absolute per element\n", name, gib, major, minor, seed, MERGE_TOL);
	test_merge();
	return test_result("test_cuda_merge");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_merge: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
