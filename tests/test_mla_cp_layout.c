/* The layout MLA decode context parallel's GPU path rests on (k_cuda_mla_cp.h), checked
 * on the CPU reference: with block_tokens a multiple of N, rank r's share of the split
 * latent cache (slot s at rank s % N, its row s / N: the CPU ranks' view) is a paged
 * cache of block_tokens / N-token blocks under the same block tables, over a context of
 * ceil((ctx - r) / N) tokens. So k_cpu_attn_mla_part of part r of N over the rank's
 * cache equals, bit for bit (the same tokens in the same order and chunks),
 * k_cpu_attn_mla_part of the one part of 1 over the same cache seen with
 * block_tokens / N and that context, which is what the GPU's latent attention is
 * given. Also each position's row under both views, and the context formula, against
 * a count. N = 2, 4, 8; 16- and 64-token blocks; shuffled tables; contexts N does not
 * divide, 1 (ranks past 0 hold nothing: (-inf, 0)) and past one 256-token chunk. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

enum { ROWS = 5, L = 24, ROPE = 8, H = 3 };
static const int32_t ctxs[ROWS] = { 1, 2, 37, 301, 1203 };
static unsigned long long seed = 4242;

/* The GPU's context of rank r (k_cuda_mla_cp_rows). */
static int ctx_part(int ctx, int r, int n)
{
	return ctx > r ? (ctx - r + n - 1) / n : 0;
}

static void layout_case(int n, int bt)
{
	int width = L + ROPE, nb = 0, used = 0, bad_rows = 0, bad_ctx = 0;
	int32_t *tables[ROWS], *perm, ctx1[ROWS];
	size_t T, local;
	float *qa = test_rand_floats((size_t)ROWS * H * width, 1.0f, &seed);
	float *cache;

	for (int i = 0; i < ROWS; i++)
		nb += (ctxs[i] + bt - 1) / bt;
	nb += 2;	/* blocks no row owns */
	perm = test_shuffled_ids(nb, &seed);
	T = (size_t)nb * bt;
	local = (T + n - 1) / n + 1;
	cache = test_rand_floats(local * width, 1.0f, &seed);	/* a rank's cache */
	for (int i = 0; i < ROWS; i++) {
		int k = (ctxs[i] + bt - 1) / bt;

		tables[i] = perm + used;
		used += k;
	}
	for (int r = 0; r < n; r++) {
		struct k_kv_layer strided = { .k = cache, .n_blocks = nb, .block_tokens = bt,
					      .width = width };
		struct k_kv_layer paged = strided;
		struct k_attn_rows rs = { .n_rows = ROWS, .ctx = ctxs,
					  .blocks = (const int32_t *const *)tables };
		struct k_attn_rows rp = rs;
		size_t no = (size_t)ROWS * H * L, nm = (size_t)ROWS * H * 2;
		float *o1 = malloc(sizeof(float) * no), *o2 = malloc(sizeof(float) * no);
		float *m1 = malloc(sizeof(float) * nm), *m2 = malloc(sizeof(float) * nm);

		paged.block_tokens = bt / n;
		for (int i = 0; i < ROWS; i++) {
			int held = 0;

			for (int t = 0; t < ctxs[i]; t++) {
				size_t slot = (size_t)tables[i][t / bt] * bt + t % bt;
				int tp = t / n;	/* its index among the rank's positions */
				size_t row = (size_t)tables[i][tp / (bt / n)] * (bt / n) + tp % (bt / n);

				if ((int)(slot % n) != r)
					continue;
				held++;
				bad_rows += slot / n != row;
			}
			ctx1[i] = ctx_part(ctxs[i], r, n);
			bad_ctx += held != ctx1[i];
		}
		rp.ctx = ctx1;
		CHECK(k_cpu_attn_mla_part(NULL, o1, m1, qa, &strided, &rs, H, L, ROPE, 0.2f, r, n) == 0,
		      "part %d of %d", r, n);
		CHECK(k_cpu_attn_mla_part(NULL, o2, m2, qa, &paged, &rp, H, L, ROPE, 0.2f, 0, 1) == 0,
		      "paged part %d of %d", r, n);
		CHECK(memcmp(o1, o2, sizeof(float) * no) == 0 && memcmp(m1, m2, sizeof(float) * nm) == 0,
		      "n %d bt %d rank %d: the strided and the paged view's partials differ", n, bt, r);
		/* rank r past every row's first token holds none of ctx 1's: (-inf, 0) */
		if (r > 0)
			CHECK(isinf(m2[0]) && m2[0] < 0 && m2[1] == 0, "n %d rank %d: ctx 1 not (-inf, 0)", n, r);
		free(o1);
		free(o2);
		free(m1);
		free(m2);
	}
	CHECK(!bad_rows && !bad_ctx, "n %d bt %d: %d positions on another row, %d contexts wrong", n,
	      bt, bad_rows, bad_ctx);
	fprintf(stderr, "  n %d, %d-token blocks: %d ranks' partials equal bit for bit over the paged "
		"view, rows and contexts as counted\n", n, bt, n);
	free(perm);
	free(cache);
	free(qa);
}

int main(void)
{
	static const int ns[3] = { 2, 4, 8 }, bts[2] = { 16, 64 };

	for (int i = 0; i < 3; i++)
		for (int j = 0; j < 2; j++)
			layout_case(ns[i], bts[j]);
	return test_result("test_mla_cp_layout");
}
