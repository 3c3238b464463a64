/* MLA decode context parallel's GPU parts (k_cuda_mla_cp.h) against the CPU ranks'
 * (k_cpu_mla_absorb, k_cpu_attn_mla_part, k_cpu_mla_merge_expand) and against the whole
 * attention (k_cpu_attn_mla) on random inputs: shuffled block tables, a bf16 latent cache
 * cut into n parts exactly as the ranks hold it (slot s at part s % n, its row s / n),
 * decode rows whose contexts n does not divide (a context of 1: the other parts hold
 * none of it) and prefill runs, DeepSeek-V2-Lite, V3 and Kimi-K2 head shapes and an odd
 * one (the tiled kernel, no 16-byte copies), n = 2, 4, 8; the CUDA-core kernels (fp32,
 * tolerance 2e-4 relative L2) and then the tensor-core ones (bf16 q and p: 1e-2), the
 * tolerances of test_cuda_attn_mla (tests/attntest.h says why). Each stage is checked:
 * the absorbed rows (relative L2 against k_cpu_mla_absorb), each part's partials (its
 * splits merged here in double: the normalised latent by relative L2, the log-sum-exp
 * within 20 x tolerance x max(1, |lse|), parts holding none of a row's tokens -inf in
 * every split), the merged and expanded output against both CPU forms, and the rank's
 * rows (k_cuda_mla_cp_rows) exactly. Outputs poisoned with NaN first.
 * Skips (77) without CUDA or a GPU. KD_TEST_QUICK=1: the small cases at n = 2 and 8
 * (compute-sanitizer).
 * KD_TEST_SEED=n: repeat a run. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/attn/k_cuda_mla_cp.h"
#include "tests/cudatest.h"
#include "tests/attntest.h"

#define CP_MAX_PARTS 8

static int quick;	/* KD_TEST_QUICK */

/* One case: the whole inputs (mla_run: rows, cache, q, w) and the parts' caches. */
struct cp_run {
	struct mla_run m;	/* q (R, H, qk), w (H (nope + v), L) bf16, the whole cache */
	int n;			/* parts */
	int local_rows;		/* rows of a part's cache: ceil(T / n) + 1 */
	float *lf[CP_MAX_PARTS];	/* (local_rows, wd) part p's cache as fp32 (CPU) */
	uint16_t *ld[CP_MAX_PARTS];	/* the same, bf16 on the device */
};

static void cp_free(struct cp_run *c)
{
	for (int p = 0; p < c->n; p++) {
		free(c->lf[p]);
		cudaFree(c->ld[p]);
	}
	mla_teardown(&c->m);
}

/* The whole inputs, then each part's cache cut from the whole one. */
static int cp_setup(struct cp_run *c, struct k_mla_dims d, int n, int bt, struct rows *r)
{
	int wd = d.kv_lora + d.rope_dim;
	size_t T;

	memset(c, 0, sizeof(*c));
	c->n = n;
	if (mla_setup(&c->m, d, bt, r, 0, 0))
		return -1;
	T = (size_t)r->n_blocks * bt;
	c->local_rows = (int)((T + n - 1) / n + 1);
	for (int p = 0; p < n; p++) {
		uint16_t *h = calloc((size_t)c->local_rows * wd, sizeof(uint16_t));

		c->lf[p] = calloc((size_t)c->local_rows * wd, sizeof(float));
		if (!h || !c->lf[p]) {
			free(h);
			return -1;
		}
		for (size_t s = (size_t)p; s < T; s += (size_t)n) {
			memcpy(h + s / n * wd, c->m.c.h + s * wd, sizeof(uint16_t) * wd);
			memcpy(c->lf[p] + s / n * wd, c->m.c.f + s * wd, sizeof(float) * wd);
		}
		c->ld[p] = dup_to_device(h, sizeof(uint16_t) * (size_t)c->local_rows * wd);
		free(h);
		if (!c->ld[p])
			return -1;
	}
	return 0;
}

/* The rank's rows: local slots and held tokens against their definitions, exactly, on
 * random slots (some negative) and the case's contexts. */
static void check_rows(const struct cp_run *c, int32_t *d_slots, int32_t *d_ctxp, int p)
{
	const struct rows *r = c->m.r;
	int R = r->n_rows, bad = 0;
	int32_t *slots = malloc(sizeof(int32_t) * R), *ls = malloc(sizeof(int32_t) * R);
	int32_t *cp = malloc(sizeof(int32_t) * R), *d_in = NULL;

	for (int i = 0; i < R; i++)
		slots[i] = i % 5 == 4 ? -1 : test_rand_int(0, 1 << 20, &attn_seed);
	d_in = dup_to_device(slots, sizeof(int32_t) * R);
	CHECK(k_cuda_mla_cp_rows(0, d_slots, d_ctxp, d_in, r->d_ctx, R, p, c->n, 12345) == 0,
	      "k_cuda_mla_cp_rows");
	if (to_host(ls, d_slots, sizeof(int32_t) * R) && to_host(cp, d_ctxp, sizeof(int32_t) * R))
		for (int i = 0; i < R; i++) {
			int want_s = slots[i] < 0 ? -1 : slots[i] % c->n == p ? slots[i] / c->n : 12345;
			int held = 0;

			for (int t = 0; t < r->ctx[i]; t++)
				held += t % c->n == p;
			bad += ls[i] != want_s || cp[i] != held;
		}
	CHECK(!bad, "part %d of %d: %d rows' local slots or held tokens wrong", p, c->n, bad);
	cudaFree(d_in);
	free(slots);
	free(ls);
	free(cp);
}

/* Part p's S splits (GPU) merged in double against its CPU partial (o unnormalised,
 * (max, sum)): the normalised latent by relative L2 over the (row, head)s holding
 * tokens, the lse within the stated bound, and -inf in every split where none. */
static void check_part(const struct cp_run *c, const float *po, const float *pl, int S,
		       const float *o_cpu, const float *ml_cpu, int p, const char *label)
{
	const struct k_mla_dims *d = &c->m.d;
	size_t R = (size_t)c->m.r->n_rows, H = (size_t)d->n_heads, L = (size_t)d->kv_lora;
	float *got = calloc(R * H * L, sizeof(float)), *ref = calloc(R * H * L, sizeof(float));
	double *acc = calloc(L, sizeof(double)), worst = 0;
	int lse_bad = 0, none_bad = 0;
	char what[320];

	for (size_t rh = 0; rh < R * H; rh++) {
		double mx = -INFINITY, den = 0, sum = ml_cpu[rh * 2 + 1];

		for (int s = 0; s < S; s++)
			mx = fmax(mx, pl[(size_t)s * R * H + rh]);
		if (!(sum > 0)) {	/* the part holds none of the row's tokens */
			none_bad += mx != -INFINITY;
			continue;
		}
		memset(acc, 0, sizeof(double) * L);
		for (int s = 0; s < S; s++) {
			double w = exp2((double)pl[(size_t)s * R * H + rh] - mx);

			if (pl[(size_t)s * R * H + rh] == -INFINITY)
				continue;
			den += w;
			for (size_t i = 0; i < L; i++)
				acc[i] += w * po[((size_t)s * R * H + rh) * L + i];
		}
		for (size_t i = 0; i < L; i++) {
			got[rh * L + i] = (float)(acc[i] / den);
			ref[rh * L + i] = (float)(o_cpu[rh * L + i] / sum);
		}
		{	/* natural log-sum-exp of the part's scores, both sides */
			double lse_got = (mx + log2(den)) * M_LN2;
			double lse_ref = ml_cpu[rh * 2] + log(sum);
			double err = fabs(lse_got - lse_ref) / fmax(1.0, fabs(lse_ref));

			worst = err > worst ? err : worst;
			lse_bad += !(err <= 20 * attn_tol);
		}
	}
	snprintf(what, sizeof(what), "%s part %d/%d: %d splits, normalised latent", label, p,
		 c->n, S);
	attn_compare(what, got, ref, R * H * L);
	fprintf(stderr, "%s%-72s worst lse err %.2e (bound %.1e) %s\n", attn_path, "  its lse",
		worst, 20 * attn_tol, lse_bad || none_bad ? "FAIL" : "PASS");
	CHECK(!lse_bad && !none_bad, "%s: %d lse beyond the bound, %d (row, head)s with no "
	      "token not -inf", what, lse_bad, none_bad);
	free(got);
	free(ref);
	free(acc);
}

/* Device buffers of one case (every part's). */
struct cp_dev {
	struct k_cuda_attn_ws *ws[CP_MAX_PARTS];
	float *qa, *po, *pl, *out[CP_MAX_PARTS];
	int32_t *slots, *ctxp[CP_MAX_PARTS];
};

static void cp_dev_free(struct cp_dev *g, int n)
{
	for (int p = 0; p < n; p++) {
		k_cuda_attn_ws_destroy(g->ws[p]);
		cudaFree(g->out[p]);
		cudaFree(g->ctxp[p]);
	}
	cudaFree(g->qa);
	cudaFree(g->po);
	cudaFree(g->pl);
	cudaFree(g->slots);
}

/* The CPU ranks' three stages: qa (R, H, wd), the partials, out (R, H, v). */
static int cpu_stages(const struct cp_run *c, float *qa, float **o, float **ml, float *out)
{
	const struct k_mla_dims *d = &c->m.d;
	struct k_mla_dims dp = *d;
	int R = c->m.r->n_rows, H = d->n_heads, Hq = H / c->n, wd = d->kv_lora + d->rope_dim;
	int qk = d->nope_dim + d->rope_dim, ret = 0;
	size_t wh = (size_t)(d->nope_dim + d->v_dim) * d->kv_lora;
	struct k_attn_rows cr = rows_cpu(c->m.r);
	float *qp = malloc(sizeof(float) * R * Hq * qk), *op = malloc(sizeof(float) * R * Hq * d->v_dim);

	dp.n_heads = Hq;
	for (int p = 0; p < c->n && !ret; p++) {	/* 1. each rank's heads absorbed */
		for (int i = 0; i < R; i++)
			memcpy(qp + (size_t)i * Hq * qk, c->m.q + ((size_t)i * H + p * Hq) * qk,
			       sizeof(float) * Hq * qk);
		ret = k_cpu_mla_absorb(qa + (size_t)p * Hq * wd, (size_t)H * wd, qp,
				       c->m.w + (size_t)p * Hq * wh, K_BF16, R, &dp);
	}
	for (int p = 0; p < c->n && !ret; p++) {	/* 2. every head over each rank's tokens */
		struct k_kv_layer kv = { .k = c->lf[p], .n_blocks = c->m.r->n_blocks,
					 .block_tokens = c->m.r->bt, .width = wd };

		ret = k_cpu_attn_mla_part(attn_pool, o[p], ml[p], qa, &kv, &cr, H, d->kv_lora,
					  d->rope_dim, c->m.scale, p, c->n);
	}
	for (int p = 0; p < c->n && !ret; p++) {	/* 3. each rank's heads merged, expanded */
		ret = k_cpu_mla_merge_expand(op, (const float *const *)o, (const float *const *)ml,
					     c->n, R, H, p * Hq, c->m.w + (size_t)p * Hq * wh, K_BF16,
					     &dp);
		for (int i = 0; i < R && !ret; i++)
			memcpy(out + ((size_t)i * H + p * Hq) * d->v_dim, op + (size_t)i * Hq * d->v_dim,
			       sizeof(float) * Hq * d->v_dim);
	}
	free(qp);
	free(op);
	return ret;
}

/* The GPU's three stages of every part, in order, each checked against the CPU's. */
static void gpu_stages(const struct cp_run *c, struct cp_dev *g, const float *qa_cpu,
		       float **o_cpu, float **ml_cpu, const float *out_cp, const float *out_whole,
		       const char *label)
{
	const struct k_mla_dims *d = &c->m.d;
	struct k_mla_dims dp = *d;
	int R = c->m.r->n_rows, H = d->n_heads, Hq = H / c->n, L = d->kv_lora;
	int wd = L + d->rope_dim, qk = d->nope_dim + d->rope_dim, S;
	size_t wh = (size_t)(d->nope_dim + d->v_dim) * L, no = (size_t)R * H * d->v_dim;
	struct k_cuda_attn_rows gr = rows_gpu(c->m.r, 0);
	float *h = NULL, *hl = NULL, *out = malloc(sizeof(float) * no);
	char what[320];
	int ret = 0;

	dp.n_heads = Hq;
	S = k_cuda_attn_mla_part_splits(g->ws[0], R, H, L, c->m.r->max_ctx, c->n, 1,
					SIZE_MAX);
	CHECK(S >= 2, "%s: %d splits", label, S);
	g->po = dalloc(sizeof(float) * c->n * S * R * H * L);
	g->pl = dalloc(sizeof(float) * c->n * S * R * H);
	poison(g->qa, sizeof(float) * R * H * wd);
	poison(g->po, sizeof(float) * c->n * S * R * H * L);
	poison(g->pl, sizeof(float) * c->n * S * R * H);
	for (int p = 0; p < c->n && !ret; p++)
		ret = k_cuda_mla_absorb(0, g->ws[p], g->qa + (size_t)p * Hq * wd, (long)H * wd,
					c->m.d_q + (size_t)p * R * Hq * qk,
					c->m.d_w + (size_t)p * Hq * wh, R, &dp);
	CHECK(ret == 0, "%s k_cuda_mla_absorb: %d", label, ret);
	if (ret || !(h = download(g->qa, (size_t)R * H * wd)))
		goto out;
	snprintf(what, sizeof(what), "%s absorbed q", label);
	attn_compare(what, h, qa_cpu, (size_t)R * H * wd);
	free(h);
	h = NULL;
	for (int p = 0; p < c->n && !ret; p++)
		ret = k_cuda_attn_mla_part(0, g->ws[p], g->po + (size_t)p * S * R * H * L,
					   g->pl + (size_t)p * S * R * H, S, g->qa, c->ld[p],
					   c->m.r->bt, &gr, g->ctxp[p], H, L, d->rope_dim, c->m.scale,
					   p, c->n);
	CHECK(ret == 0, "%s k_cuda_attn_mla_part: %d", label, ret);
	if (ret || !CU(cudaDeviceSynchronize()))
		goto out;
	h = download(g->po, (size_t)c->n * S * R * H * L);
	hl = download(g->pl, (size_t)c->n * S * R * H);
	for (int p = 0; p < c->n; p++)
		check_part(c, h + (size_t)p * S * R * H * L, hl + (size_t)p * S * R * H, S, o_cpu[p],
			   ml_cpu[p], p, label);
	for (int p = 0; p < c->n && !ret; p++) {
		poison(g->out[p], sizeof(float) * R * Hq * d->v_dim);
		ret = k_cuda_mla_merge_expand(0, g->ws[p], g->out[p], g->po, g->pl, c->n * S, R, H,
					      p * Hq, c->m.d_w + (size_t)p * Hq * wh, &dp);
	}
	CHECK(ret == 0, "%s k_cuda_mla_merge_expand: %d", label, ret);
	if (ret || !CU(cudaDeviceSynchronize()))
		goto out;
	for (int p = 0; p < c->n; p++) {
		float *o = download(g->out[p], (size_t)R * Hq * d->v_dim);

		for (int i = 0; i < R; i++)
			memcpy(out + ((size_t)i * H + p * Hq) * d->v_dim, o + (size_t)i * Hq * d->v_dim,
			       sizeof(float) * Hq * d->v_dim);
		free(o);
	}
	snprintf(what, sizeof(what), "%s out vs the CPU ranks", label);
	attn_compare(what, out, out_cp, no);
	snprintf(what, sizeof(what), "%s out vs k_cpu_attn_mla", label);
	attn_compare(what, out, out_whole, no);
out:
	free(h);
	free(hl);
	free(out);
}

/* One case at n parts: the CPU ranks' stages and the whole attention, then the GPU's. */
static void cp_case(struct k_mla_dims d, int n, int bt, struct rows *r)
{
	struct cp_run c;
	struct cp_dev g;
	int R = r->n_rows, H = d.n_heads, Hq = H / n, wd = d.kv_lora + d.rope_dim, qk;
	int lo, hi;
	size_t no = (size_t)R * H * d.v_dim;
	float *qa = NULL, *o[CP_MAX_PARTS] = { 0 }, *ml[CP_MAX_PARTS] = { 0 };
	float *out_cp = NULL, *out_whole = NULL, *q_heads = NULL;
	char label[160];

	memset(&g, 0, sizeof(g));
	rows_ctx_range(r, &lo, &hi);
	snprintf(label, sizeof(label), "cp %d/%d h%d lora%d rope%d bt%d rows %d ctx %d..%d", n,
		 n, H, d.kv_lora, d.rope_dim, bt, R, lo, hi);
	if (cp_setup(&c, d, n, bt, r)) {
		CHECK(0, "%s: setup", label);
		cp_free(&c);
		return;
	}
	qk = d.nope_dim + d.rope_dim;
	qa = malloc(sizeof(float) * R * H * wd);
	out_cp = malloc(sizeof(float) * no);
	out_whole = malloc(sizeof(float) * no);
	for (int p = 0; p < n; p++) {
		o[p] = malloc(sizeof(float) * R * H * d.kv_lora);
		ml[p] = malloc(sizeof(float) * R * H * 2);
	}
	{
		struct k_kv_layer kv = { .k = c.m.c.f, .n_blocks = r->n_blocks, .block_tokens = bt,
					 .width = wd };
		struct k_attn_rows cr = rows_cpu(r);

		CHECK(k_cpu_attn_mla(attn_pool, out_whole, c.m.q, c.m.w, K_BF16, &kv, &cr, &c.m.d,
				     c.m.scale) == 0, "k_cpu_attn_mla");
	}
	CHECK(cpu_stages(&c, qa, o, ml, out_cp) == 0, "%s: CPU ranks", label);
	/* the GPU absorb of part p reads its heads contiguous (R, Hq, qk): lay q out
	 * part-major on the device, as each rank holds its own heads' q */
	q_heads = malloc(sizeof(float) * R * H * qk);
	for (int p = 0; p < n; p++)
		for (int i = 0; i < R; i++)
			memcpy(q_heads + (size_t)p * R * Hq * qk + (size_t)i * Hq * qk,
			       c.m.q + ((size_t)i * H + p * Hq) * qk, sizeof(float) * Hq * qk);
	CU(cudaMemcpy(c.m.d_q, q_heads, sizeof(float) * R * H * qk, cudaMemcpyHostToDevice));
	g.qa = dalloc(sizeof(float) * R * H * wd);
	g.slots = dalloc(sizeof(int32_t) * R);
	for (int p = 0; p < n; p++) {
		CHECK(k_cuda_attn_ws_create(&g.ws[p], R, H, wd > d.v_dim ? wd : d.v_dim, r->max_ctx) == 0,
		      "ws");
		g.out[p] = dalloc(sizeof(float) * R * Hq * d.v_dim);
		g.ctxp[p] = dalloc(sizeof(int32_t) * R);
		if (g.ws[p] && g.ctxp[p])
			check_rows(&c, g.slots, g.ctxp[p], p);
	}
	if (g.qa && g.ws[n - 1])
		gpu_stages(&c, &g, qa, o, ml, out_cp, out_whole, label);
	cp_dev_free(&g, n);
	for (int p = 0; p < n; p++) {
		free(o[p]);
		free(ml[p]);
	}
	free(q_heads);
	free(qa);
	free(out_cp);
	free(out_whole);
	cp_free(&c);
}

/* ---- cases ---------------------------------------------------------------- */

static void test_cp(void)
{
	static const struct k_mla_dims lite = { 16, 128, 64, 128, 512 },	/* V2-Lite */
		v3 = { 128, 128, 64, 128, 512 },	/* DeepSeek-V3 */
		kimi = { 64, 128, 64, 128, 512 },	/* Kimi-K2 */
		odd = { 8, 12, 6, 10, 37 };	/* the tiled kernel, no 16-byte copies */
	static const int parts[3] = { 2, 4, 8 };
	static const int runs[2] = { 3, 2 }, pos0[2] = { 500, 40 };

	for (int i = 0; i < 3; i++) {
		int n = parts[i];

		cp_case(lite, n, 64, rows_decode(5, 777, 1, 777));	/* ctx 1 among them */
		cp_case(odd, n, 16, rows_decode(3, 203, 1, 203));
		if (quick && n == 4)
			continue;
		cp_case(odd, n, 16, rows_prefill(2, runs, pos0, 600));
		if (quick)
			continue;
		cp_case(lite, n, 16, rows_decode(1, 1001, 0, 1001));
		cp_case(lite, n, 16, rows_prefill(2, runs, pos0, 600));
		cp_case(v3, n, 16, rows_decode(2, 301, 1, 301));
		cp_case(kimi, n, 64, rows_decode(1, 4097, 0, 4097));
		cp_case(lite, n, 16, rows_decode(16, 2051, 1, 2051));
	}
}

/* The CUDA-core kernels (fp32), then the tensor-core ones. */
int main(void)
{
	if (!test_gpu_present("test_cuda_mla_cp"))
		return 77;
	quick = test_env_flag("KD_TEST_QUICK");
	if (attn_begin("test_cuda_mla_cp", quick))
		return 1;
	attn_pass(0);
	test_cp();
	attn_pass(1);
	test_cp();
	return attn_end("test_cuda_mla_cp");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_mla_cp: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
