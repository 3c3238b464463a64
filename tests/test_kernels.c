/* CPU reference ops against straightforward double-precision references: pool,
 * linear (every dtype, batch invariance), norms, SwiGLU, embed, paged GQA, experts. */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

static unsigned long long seed = 0x9e3779b97f4a7c15ull;

/* The same random weights stored as dtype (values rounded to it) and as float. */
static void *rand_weights(size_t n, enum k_dtype dt, float **as_f32)
{
	float *f = test_rand_floats(n, 1.0f, &seed);
	uint16_t *h;

	*as_f32 = f;
	if (dt == K_F32) {
		float *c = malloc(sizeof(float) * (n ? n : 1));

		memcpy(c, f, sizeof(float) * n);
		return c;
	}
	h = malloc(sizeof(uint16_t) * (n ? n : 1));
	for (size_t i = 0; i < n; i++) {
		if (dt == K_BF16) {
			h[i] = k_f32_to_bf16(f[i]);
		} else {
			/* f16 by search: exact rounding does not matter, only that f
			 * then holds exactly the stored value. */
			float v = f[i];
			int e;
			float m = frexpf(fabsf(v), &e);
			uint16_t bits;

			if (v == 0 || e < -13) {
				bits = 0;
			} else {
				int man = (int)lrintf((m * 2 - 1) * 1024);

				if (man == 1024) {
					man = 0;
					e++;
				}
				bits = (uint16_t)(((e - 1 + 15) << 10) | man);
			}
			if (v < 0)
				bits |= 0x8000;
			h[i] = bits;
		}
		f[i] = k_load(h, dt, i);
	}
	return h;
}

/* ---- pool ---------------------------------------------------------------- */

struct pool_check {
	int *hits;
	atomic_int calls;
};

static void pool_fn(void *arg, int t)
{
	struct pool_check *c = arg;

	c->hits[t]++;
	atomic_fetch_add(&c->calls, 1);
}

static void test_pool(void)
{
	struct k_pool *pool;
	struct pool_check c;
	int n = 1000, bad = 0;

	CHECK(k_pool_create(&pool, 0) == -EINVAL, "0 threads");
	CHECK(k_pool_create(&pool, 4) == 0, "create");
	CHECK(k_pool_threads(pool) == 4 && k_pool_threads(NULL) == 1, "threads");
	c.hits = calloc((size_t)n, sizeof(int));
	/* Many short runs shake out generation races; each task runs exactly once. */
	for (int rep = 0; rep < 2000; rep++) {
		int tasks = 1 + rep % 37;

		atomic_init(&c.calls, 0);
		memset(c.hits, 0, sizeof(int) * (size_t)n);
		k_pool_run(pool, pool_fn, &c, rep == 0 ? n : tasks);
		for (int t = 0; t < (rep == 0 ? n : tasks); t++)
			bad += c.hits[t] != 1;
		bad += atomic_load(&c.calls) != (rep == 0 ? n : tasks);
	}
	CHECK(bad == 0, "%d task miscounts", bad);
	atomic_init(&c.calls, 0);
	k_pool_run(NULL, pool_fn, &c, 5);
	k_pool_run(pool, pool_fn, &c, 0);
	CHECK(atomic_load(&c.calls) == 5, "NULL pool");
	free(c.hits);
	k_pool_destroy(pool);
	k_pool_destroy(NULL);
	CHECK(k_pool_create(&pool, 1) == 0, "single");
	atomic_init(&c.calls, 0);
	c.hits = calloc(8, sizeof(int));
	k_pool_run(pool, pool_fn, &c, 8);
	CHECK(atomic_load(&c.calls) == 8, "single-thread pool");
	free(c.hits);
	k_pool_destroy(pool);
}

/* ---- linear -------------------------------------------------------------- */

/* Every half and bf16 bit pattern through K = 1: y = 1 * w exactly. */
static void test_linear_conversions(struct k_pool *pool)
{
	enum { N = 65536 };
	uint16_t *w = malloc(sizeof(uint16_t) * N);
	float *y = malloc(sizeof(float) * N);
	float one = 1.0f;
	int bad = 0;

	for (int i = 0; i < N; i++)
		w[i] = (uint16_t)i;
	for (int dt = K_F16; dt <= K_BF16; dt++) {
		bad = 0;
		k_cpu_linear(pool, y, &one, w, dt, 1, N, 1);
		for (int i = 0; i < N; i++) {
			float want = k_load(w, dt, (size_t)i);

			if (isnan(want) ? !isnan(y[i]) : y[i] != want)
				bad++;
		}
		CHECK(bad == 0, "%s: %d conversions wrong", k_dtype_name(dt), bad);
	}
	free(w);
	free(y);
}

static void check_linear(struct k_pool *pool, enum k_dtype dt, int M, int N, int K)
{
	float *wf, *x = test_rand_floats((size_t)M * K, 1.0f, &seed);
	void *w = rand_weights((size_t)N * K, dt, &wf);
	float *y = malloc(sizeof(float) * (size_t)M * N);
	/* Rigorous fp32 bound for 16 lanes of K/16 terms plus a 4-level tree. */
	double gamma = (K / 16 + 6) * 6e-8;
	int bad = 0;

	k_cpu_linear(pool, y, x, w, dt, M, N, K);
	for (int m = 0; m < M; m++) {
		for (int n = 0; n < N; n++) {
			double ref = 0, mag = 0;

			for (int k = 0; k < K; k++) {
				double t = (double)x[(size_t)m * K + k] * wf[(size_t)n * K + k];

				ref += t;
				mag += fabs(t);
			}
			if (!(test_abs_err(y[(size_t)m * N + n], ref) <= gamma * mag + 1e-30))
				bad++;
		}
	}
	CHECK(bad == 0, "linear %s M=%d N=%d K=%d: %d outputs off", k_dtype_name(dt), M, N, K,
	      bad);
	free(x);
	free(wf);
	free(w);
	free(y);
}

/* A row's result must not depend on M, on the other rows or on the thread count. */
static void test_linear_invariance(struct k_pool *pool)
{
	enum { M = 37, N = 77, K = 600 };
	float *wf, *x = test_rand_floats((size_t)M * K, 1.0f, &seed);
	void *w = rand_weights((size_t)N * K, K_BF16, &wf);
	float *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * N);
	float *yt = malloc(sizeof(float) * M * N);
	int bad = 0;

	k_cpu_linear(pool, y, x, w, K_BF16, M, N, K);
	k_cpu_linear(NULL, yt, x, w, K_BF16, M, N, K);
	CHECK(test_same_floats(y, yt, (size_t)M * N), "linear: threads change bits");
	for (int m = 0; m < M; m++) {
		k_cpu_linear(pool, y1, x + (size_t)m * K, w, K_BF16, 1, N, K);
		bad += !test_same_floats(y1, y + (size_t)m * N, N);
	}
	CHECK(bad == 0, "linear: %d rows differ between M=1 and M=%d", bad, M);
	free(x);
	free(wf);
	free(w);
	free(y);
	free(y1);
	free(yt);
}

static void test_linear(struct k_pool *pool)
{
	static const int shapes[][2] = { { 77, 131 }, { 16, 256 }, { 33, 600 }, { 5, 7 } };
	static const int ms[] = { 1, 3, 64 };

	test_linear_conversions(pool);
	for (int dt = K_F32; dt <= K_BF16; dt++)
		for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
			for (size_t m = 0; m < sizeof(ms) / sizeof(ms[0]); m++)
				check_linear(pool, dt, ms[m], shapes[s][0], shapes[s][1]);
	test_linear_invariance(pool);
}

/* ---- elementwise --------------------------------------------------------- */

static void test_rmsnorm(void)
{
	enum { ROWS = 3, DIM = 50, XS = 64, OS = 70 };
	float *x = test_rand_floats(ROWS * XS, 2.0f, &seed), *out = calloc(ROWS * OS, sizeof(float));
	float eps = 1e-6f;

	for (int dt = K_F32; dt <= K_BF16; dt++) {
		float *wf;
		void *w = rand_weights(DIM, dt, &wf);
		float *inpl = malloc(sizeof(float) * ROWS * XS);

		k_cpu_rmsnorm(out, OS, x, XS, w, dt, ROWS, DIM, eps);
		for (int r = 0; r < ROWS; r++) {
			double ss = 0;

			for (int i = 0; i < DIM; i++)
				ss += (double)x[r * XS + i] * x[r * XS + i];
			for (int i = 0; i < DIM; i++) {
				double want = wf[i] * (x[r * XS + i] / sqrt(ss / DIM + eps));

				/* three fp32 roundings after the double mean */
				CHECK(fabs(out[r * OS + i] - want) <= 4e-7 * fabs(want) + 1e-30,
				      "rmsnorm %s [%d,%d] %.9g vs %.9g", k_dtype_name(dt), r, i,
				      out[r * OS + i], want);
			}
			for (int i = DIM; i < OS; i++)
				CHECK(out[r * OS + i] == 0, "rmsnorm wrote past dim");
		}
		memcpy(inpl, x, sizeof(float) * ROWS * XS);
		k_cpu_rmsnorm(inpl, XS, inpl, XS, w, dt, ROWS, DIM, eps);
		for (int r = 0; r < ROWS; r++)
			CHECK(memcmp(inpl + r * XS, out + r * OS, sizeof(float) * DIM) == 0,
			      "in-place rmsnorm differs");
		free(inpl);
		free(w);
		free(wf);
	}
	free(x);
	free(out);
}

static void test_silu_add_embed(void)
{
	enum { N = 1000, V = 11, D = 13 };
	float *g = test_rand_floats(N, 12.0f, &seed), *u = test_rand_floats(N, 3.0f, &seed);
	float *o = malloc(sizeof(float) * N);
	float *y = test_rand_floats(N, 1.0f, &seed), *y0 = malloc(sizeof(float) * N);
	const int32_t ids[4] = { 3, 0, 10, 3 };
	float emb[4 * D];
	int bad = 0;

	k_cpu_silu_mul(o, g, u, N);
	for (int i = 0; i < N; i++) {
		double want = g[i] / (1 + exp(-(double)g[i])) * u[i];

		bad += !(test_abs_err(o[i], want) <= 4e-7 * fabs(want) + 1e-30);
	}
	CHECK(bad == 0, "silu_mul: %d off", bad);
	k_cpu_silu_mul(g, g, u, N);	/* out aliases gate */
	CHECK(memcmp(g, o, sizeof(float) * N) == 0, "silu_mul aliasing");

	memcpy(y0, y, sizeof(float) * N);
	k_cpu_add(y, u, N);
	bad = 0;
	for (int i = 0; i < N; i++)
		bad += y[i] != y0[i] + u[i];
	CHECK(bad == 0, "add");

	for (int dt = K_F32; dt <= K_BF16; dt++) {
		float *tf;
		void *t = rand_weights(V * D, dt, &tf);

		k_cpu_embed(emb, ids, 4, t, dt, D);
		for (int i = 0; i < 4; i++)
			CHECK(memcmp(emb + i * D, tf + ids[i] * D, sizeof(float) * D) == 0,
			      "embed %s row %d", k_dtype_name(dt), i);
		free(t);
		free(tf);
	}
	free(g);
	free(u);
	free(o);
	free(y);
	free(y0);
}

/* ---- paged GQA attention ------------------------------------------------- */

enum { AH = 8, AKV = 2, AHD = 20, AROWS = 6 };
static const int att_ctx[AROWS] = { 1, 5, 16, 129, 300, 600 };

/* Each row is its own sequence with a shuffled block table drawn from one pool. */
struct att_case {
	struct k_kv_layer kv;
	int32_t *tables[AROWS];
	float *keys[AROWS];	/* (ctx, AKV * AHD) dense copies for the reference */
	float *vals[AROWS];
};

static void att_case_build(struct att_case *c, int bt)
{
	int width = AKV * AHD, total = 0, used = 0;
	int32_t *perm;

	for (int r = 0; r < AROWS; r++)
		total += (att_ctx[r] + bt - 1) / bt;
	total += 3;	/* spare blocks nobody uses */
	perm = test_shuffled_ids(total, &seed);
	c->kv = (struct k_kv_layer){ .n_blocks = total, .block_tokens = bt, .width = width };
	c->kv.k = test_rand_floats((size_t)total * bt * width, 1.0f, &seed);	/* garbage elsewhere */
	c->kv.v = test_rand_floats((size_t)total * bt * width, 1.0f, &seed);
	for (int r = 0; r < AROWS; r++) {
		int nb = (att_ctx[r] + bt - 1) / bt, n = att_ctx[r];
		int32_t *slots = malloc(sizeof(int32_t) * n);

		c->tables[r] = malloc(sizeof(int32_t) * nb);
		for (int b = 0; b < nb; b++)
			c->tables[r][b] = perm[used++];
		for (int t = 0; t < n; t++)
			slots[t] = c->tables[r][t / bt] * bt + t % bt;
		c->keys[r] = test_rand_floats((size_t)n * width, 1.0f, &seed);
		c->vals[r] = test_rand_floats((size_t)n * width, 1.0f, &seed);
		k_cpu_kv_write(c->kv.k, width, c->keys[r], n, slots);
		k_cpu_kv_write(c->kv.v, width, c->vals[r], n, slots);
		free(slots);
	}
	free(perm);
}

static void att_case_free(struct att_case *c)
{
	for (int r = 0; r < AROWS; r++) {
		free(c->tables[r]);
		free(c->keys[r]);
		free(c->vals[r]);
	}
	free(c->kv.k);
	free(c->kv.v);
}

/* Dense double attention of one (row, head). */
static void att_ref(double *out, const float *q, const struct att_case *c, int r, int h,
		    double scale)
{
	int n = att_ctx[r], kvh = h / (AH / AKV);
	double *s = malloc(sizeof(double) * n), max = -INFINITY, sum = 0;

	for (int t = 0; t < n; t++) {
		double d = 0;

		for (int i = 0; i < AHD; i++)
			d += (double)q[i] * c->keys[r][(size_t)t * AKV * AHD + kvh * AHD + i];
		s[t] = d * scale;
		max = fmax(max, s[t]);
	}
	for (int t = 0; t < n; t++)
		sum += s[t] = exp(s[t] - max);
	for (int i = 0; i < AHD; i++) {
		double o = 0;

		for (int t = 0; t < n; t++)
			o += s[t] * c->vals[r][(size_t)t * AKV * AHD + kvh * AHD + i];
		out[i] = o / sum;
	}
	free(s);
}

static void test_attn_gqa(struct k_pool *pool, int bt)
{
	struct att_case c;
	const int32_t *const *tables;
	float *q = test_rand_floats(AROWS * AH * AHD, 3.0f, &seed);	/* peaky enough softmaxes */
	float *out = malloc(sizeof(float) * AROWS * AH * AHD);
	float *out1 = malloc(sizeof(float) * AROWS * AH * AHD);
	float scale = 1.0f / sqrtf(AHD);
	double ref[AHD], err = 0;

	att_case_build(&c, bt);
	tables = (const int32_t *const *)c.tables;
	struct k_attn_rows rows = { .n_rows = AROWS, .ctx = att_ctx, .blocks = tables };

	k_cpu_attn_gqa(pool, out, q, &c.kv, &rows, AH, AKV, AHD, scale);
	k_cpu_attn_gqa(NULL, out1, q, &c.kv, &rows, AH, AKV, AHD, scale);
	CHECK(test_same_floats(out, out1, AROWS * AH * AHD),
	      "attn bt=%d: 1 and 4 threads differ", bt);
	for (int r = 0; r < AROWS; r++) {
		for (int h = 0; h < AH; h++) {
			att_ref(ref, q + (r * AH + h) * AHD, &c, r, h, scale);
			for (int i = 0; i < AHD; i++)
				err = test_err_max(err, test_abs_err(out[(r * AH + h) * AHD + i], ref[i]));
		}
	}
	/* Outputs are convex mixes of values in [-1, 1]; fp32 scores and weights
	 * keep them within a few 1e-7. */
	CHECK(err < 2e-6, "attn bt=%d: max abs error %g", bt, err);
	att_case_free(&c);
	free(q);
	free(out);
	free(out1);
}

/* ---- experts ------------------------------------------------------------- */

enum { XE = 6, XH = 24, XI = 40, XM = 5, XK = 2 };

/* Double reference of one expert on one row. */
static void expert_ref(double *y /* (XH) */, const float *x, const float *g, const float *u,
		       const float *d)
{
	double a[XI];

	for (int i = 0; i < XI; i++) {
		double gs = 0, us = 0;

		for (int k = 0; k < XH; k++) {
			gs += (double)g[i * XH + k] * x[k];
			us += (double)u[i * XH + k] * x[k];
		}
		a[i] = gs / (1 + exp(-gs)) * us;
	}
	for (int j = 0; j < XH; j++) {
		y[j] = 0;
		for (int i = 0; i < XI; i++)
			y[j] += d[j * XI + i] * a[i];
	}
}

static void test_experts(struct k_pool *pool)
{
	/* Expert 3 is never chosen: its NULL weights would crash if touched. */
	const int32_t ids[XM * XK] = { 0, 5, 5, 0, 1, 2, 4, 0, 2, 1 };
	float w[XM * XK], *x = test_rand_floats(XM * XH, 1.0f, &seed), out[XM * XH], out1[XH];
	struct k_expert ex[XE] = { { 0 } };
	float *f[XE][3];
	double err = 0;
	int ret;

	for (int j = 0; j < XM * XK; j++)
		w[j] = 0.25f + 0.5f * (test_randf(&seed) + 1);
	for (int e = 0; e < XE; e++) {
		if (e == 3)
			continue;
		ex[e].gate = rand_weights(XI * XH, K_BF16, &f[e][0]);
		ex[e].up = rand_weights(XI * XH, K_BF16, &f[e][1]);
		ex[e].down = rand_weights(XH * XI, K_BF16, &f[e][2]);
	}
	ret = k_cpu_moe_experts(pool, out, x, XM, ids, w, XK, ex, XE, K_BF16, XH, XI);
	CHECK(ret == 0, "moe_experts %d", ret);
	for (int m = 0; m < XM; m++) {
		double want[XH] = { 0 }, y[XH];

		for (int j = 0; j < XK; j++) {
			int e = ids[m * XK + j];

			expert_ref(y, x + m * XH, f[e][0], f[e][1], f[e][2]);
			for (int c = 0; c < XH; c++)
				want[c] += w[m * XK + j] * y[c];
		}
		for (int c = 0; c < XH; c++)
			err = test_err_max(err, test_abs_err(out[m * XH + c], want[c]) / (1 + fabs(want[c])));
		/* Batch invariance: the row alone gives the same bits. */
		ret = k_cpu_moe_experts(pool, out1, x + m * XH, 1, ids + m * XK, w + m * XK, XK,
					ex, XE, K_BF16, XH, XI);
		CHECK(ret == 0 && test_same_floats(out1, out + m * XH, XH),
		      "moe row %d differs alone", m);
	}
	/* Sums of ~40 products of O(1) terms in fp32. */
	CHECK(err < 1e-5, "moe_experts error %g", err);
	{	/* Ids outside [0, XE) select nothing: the row keeps its valid slot only
		 * (under ASan, a counting sort indexed by them would write out of bounds). */
		const int32_t bad[2 * XK] = { -1, 4, XE, XE + 1000 };
		double want[XH], y[XH];

		ret = k_cpu_moe_experts(pool, out, x, 2, bad, w, XK, ex, XE, K_BF16, XH, XI);
		CHECK(ret == 0, "moe_experts bad ids %d", ret);
		expert_ref(y, x, f[4][0], f[4][1], f[4][2]);
		err = 0;
		for (int c = 0; c < XH; c++) {
			want[c] = w[1] * y[c];
			err = test_err_max(err, test_abs_err(out[c], want[c]) / (1 + fabs(want[c])));
			err = test_err_max(err, test_abs_err(out[XH + c], 0));	/* no valid id: zeros */
		}
		CHECK(err < 1e-5, "moe_experts with ids out of range: error %g", err);
	}
	for (int e = 0; e < XE; e++) {
		if (e == 3)
			continue;
		free((void *)ex[e].gate);
		free((void *)ex[e].up);
		free((void *)ex[e].down);
		for (int i = 0; i < 3; i++)
			free(f[e][i]);
	}
	free(x);
}

int main(void)
{
	struct k_pool *pool;

	test_pool();
	if (k_pool_create(&pool, 4)) {
		fprintf(stderr, "pool create failed\n");
		return 1;
	}
	test_linear(pool);
	test_rmsnorm();
	test_silu_add_embed();
	test_attn_gqa(pool, 1);
	test_attn_gqa(pool, 7);
	test_attn_gqa(pool, 16);
	test_experts(pool);
	k_pool_destroy(pool);
	return test_result("test_kernels");
}
