/* MLA: the absorbed form equals the expanded textbook form on random inputs, for
 * odd dims, several rows, long contexts and shuffled block tables of two sizes. */
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

/* Both forms are fp32 with different summation orders (and the absorbed one
 * folds W_UK into q): they agree to ~1e-6; 1e-5 relative L2 is the contract. */
#define MLA_TOL 1e-5

enum { ROWS = 4 };
static const int32_t ctxs[ROWS] = { 1, 37, 150, 300 };
static unsigned long long seed = 12345;

/* Stores floats as dtype and rounds the floats to what was stored. F16 draws its
 * own values (|w| in [1/8, 1)) so that no conversion from float is needed. */
static void *store_as(float *f, size_t n, enum k_dtype dt)
{
	uint16_t *h;

	if (dt == K_F32) {
		float *c = malloc(sizeof(float) * n);

		memcpy(c, f, sizeof(float) * n);
		return c;
	}
	h = malloc(sizeof(uint16_t) * n);
	for (size_t i = 0; i < n; i++) {
		if (dt == K_BF16) {
			h[i] = k_f32_to_bf16(f[i]);
		} else {
			unsigned int r = (unsigned int)((test_randf(&seed) + 1) * 32767);

			h[i] = (uint16_t)((f[i] < 0 ? 0x8000 : 0) | ((12 + (r & 3)) << 10) |
					  ((r >> 2) & 0x3ff));
		}
		f[i] = k_load(h, dt, i);
	}
	return h;
}

/* A latent cache where each row's tokens live in shuffled blocks of bt tokens. */
static int build_cache(struct k_kv_layer *kv, int32_t **tables, int width, int bt)
{
	int total = 2, used = 0;
	int32_t *perm;

	for (int r = 0; r < ROWS; r++)
		total += (ctxs[r] + bt - 1) / bt;
	perm = test_shuffled_ids(total, &seed);
	*kv = (struct k_kv_layer){ .n_blocks = total, .block_tokens = bt, .width = width };
	kv->k = test_rand_floats((size_t)total * bt * width, 1.0f, &seed);
	for (int r = 0; r < ROWS; r++) {
		int nb = (ctxs[r] + bt - 1) / bt;
		float *src = test_rand_floats((size_t)ctxs[r] * width, 1.0f, &seed);
		int32_t *slots = malloc(sizeof(int32_t) * ctxs[r]);

		tables[r] = malloc(sizeof(int32_t) * nb);
		for (int b = 0; b < nb; b++)
			tables[r][b] = perm[used++];
		for (int t = 0; t < ctxs[r]; t++)
			slots[t] = tables[r][t / bt] * bt + t % bt;
		k_cpu_kv_write(kv->k, width, src, ctxs[r], slots);
		free(src);
		free(slots);
	}
	free(perm);
	return 0;
}

static void check_mla(struct k_pool *pool, const struct k_mla_dims *d, enum k_dtype dt, int bt)
{
	int qk = d->nope_dim + d->rope_dim, width = d->kv_lora + d->rope_dim;
	size_t nw = (size_t)d->n_heads * (d->nope_dim + d->v_dim) * d->kv_lora;
	size_t no = (size_t)ROWS * d->n_heads * d->v_dim;
	float *wf = test_rand_floats(nw, 1.0f, &seed);
	float *q = test_rand_floats((size_t)ROWS * d->n_heads * qk, 1.0f, &seed);
	void *w = store_as(wf, nw, dt);
	float *a = malloc(sizeof(float) * no), *a1 = malloc(sizeof(float) * no);
	float *e = malloc(sizeof(float) * no);
	float scale = 1.0f / sqrtf((float)qk);
	int32_t *tables[ROWS];
	struct k_kv_layer kv;
	double err, norm = 0;
	int ret;

	build_cache(&kv, tables, width, bt);
	struct k_attn_rows rows = { .n_rows = ROWS, .ctx = ctxs,
		.blocks = (const int32_t *const *)tables };

	ret = k_cpu_attn_mla(pool, a, q, w, dt, &kv, &rows, d, scale);
	CHECK(ret == 0, "absorbed %d", ret);
	ret = k_cpu_attn_mla(NULL, a1, q, w, dt, &kv, &rows, d, scale);
	CHECK(ret == 0, "absorbed %d", ret);
	ret = k_cpu_attn_mla_expanded(e, q, w, dt, &kv, &rows, d, scale);
	CHECK(ret == 0, "expanded %d", ret);
	CHECK(test_same_floats(a, a1, no), "absorbed: threads change bits");
	err = test_rel_l2(a, e, no);
	for (size_t i = 0; i < no; i++)
		norm += (double)e[i] * e[i];
	CHECK(norm > 1e-3 * no, "degenerate outputs (norm %g)", norm);
	CHECK(err < MLA_TOL, "heads %d nope %d rope %d v %d lora %d %s bt %d: rel L2 %g",
	      d->n_heads, d->nope_dim, d->rope_dim, d->v_dim, d->kv_lora, k_dtype_name(dt),
	      bt, err);
	for (int r = 0; r < ROWS; r++)
		free(tables[r]);
	free(kv.k);
	free(wf);
	free(w);
	free(q);
	free(a);
	free(a1);
	free(e);
}

/* A hand-sized case: one head, one token, so softmax is 1 and the output is
 * exactly W_UV c, independent of q. */
static void test_single_token(void)
{
	struct k_mla_dims d = { .n_heads = 1, .nope_dim = 2, .rope_dim = 2, .v_dim = 2,
		.kv_lora = 3 };
	float w[4 * 3] = {
		1, 0, 0,  0, 1, 0,	/* W_UK */
		1, 2, 3,  -1, 0, 1,	/* W_UV */
	};
	float cache[5] = { 0.5f, -1, 2, 7, 7 };	/* latent (3), kpe (2) */
	float q[4] = { 3, 1, 4, 1 }, out[2];
	int32_t table[1] = { 0 }, ctx[1] = { 1 };
	const int32_t *tabs[1] = { table };
	struct k_kv_layer kv = { .k = cache, .n_blocks = 1, .block_tokens = 1, .width = 5 };
	struct k_attn_rows rows = { .n_rows = 1, .ctx = ctx, .blocks = tabs };

	CHECK(k_cpu_attn_mla(NULL, out, q, w, K_F32, &kv, &rows, &d, 0.5f) == 0, "mla");
	CHECK_NEAR(out[0], 0.5 - 2 + 6, 1e-6, "W_UV c [0]");
	CHECK_NEAR(out[1], -0.5 + 2, 1e-6, "W_UV c [1]");
	CHECK(k_cpu_attn_mla_expanded(out, q, w, K_F32, &kv, &rows, &d, 0.5f) == 0, "exp");
	CHECK_NEAR(out[0], 4.5, 1e-6, "expanded [0]");
	CHECK_NEAR(out[1], 1.5, 1e-6, "expanded [1]");
}

int main(void)
{
	static const struct k_mla_dims dims[] = {
		{ .n_heads = 3, .nope_dim = 16, .rope_dim = 8, .v_dim = 12, .kv_lora = 48 },
		{ .n_heads = 2, .nope_dim = 7, .rope_dim = 5, .v_dim = 9, .kv_lora = 33 },
		{ .n_heads = 4, .nope_dim = 32, .rope_dim = 16, .v_dim = 24, .kv_lora = 128 },
		{ .n_heads = 1, .nope_dim = 1, .rope_dim = 2, .v_dim = 3, .kv_lora = 5 },
	};
	struct k_pool *pool;

	if (k_pool_create(&pool, 4)) {
		fprintf(stderr, "pool create failed\n");
		return 1;
	}
	test_single_token();
	for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++) {
		check_mla(pool, &dims[i], K_F32, 16);
		check_mla(pool, &dims[i], K_BF16, 7);
	}
	check_mla(pool, &dims[1], K_F16, 7);
	check_mla(pool, &dims[2], K_F16, 16);
	k_pool_destroy(pool);
	return test_result("test_mla");
}
