/* RoPE: inverse frequencies of every rope type against double-precision formulas
 * and hard-coded HF values, and the rotation itself (layouts, norms, identity). */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

#define PI 3.14159265358979323846

/* Relative tolerance against the double formulas: float32 inv_freq carries a few
 * ulps (powf, then a reciprocal, then the scaling ops), ~1e-7 each. */
#define INV_RTOL 1e-6

static double ref_default(double theta, int dim, int i)
{
	return 1.0 / pow(theta, (double)(2 * i) / dim);
}

static double ref_llama3(const struct k_rope_params *p, int i)
{
	double inv = ref_default(p->theta, p->dim, i);
	double wl = 2 * PI / inv;
	double low_wl = p->original_max_pos / p->low_freq_factor;
	double high_wl = p->original_max_pos / p->high_freq_factor;
	double s;

	if (wl > low_wl)
		return inv / p->factor;
	if (wl < high_wl)
		return inv;
	s = (p->original_max_pos / wl - p->low_freq_factor) /
	    (p->high_freq_factor - p->low_freq_factor);
	return (1 - s) * inv / p->factor + s * inv;
}

static double ref_corr(double rot, const struct k_rope_params *p)
{
	return p->dim * log(p->original_max_pos / (rot * 2 * PI)) / (2 * log(p->theta));
}

static double ref_yarn(const struct k_rope_params *p, int i)
{
	double lo = floor(ref_corr(p->beta_fast, p)), hi = ceil(ref_corr(p->beta_slow, p));
	double pf = pow(p->theta, (double)(2 * i) / p->dim), ramp, ef;

	lo = fmax(lo, 0);
	hi = fmin(hi, p->dim - 1);
	if (lo == hi)
		hi += 0.001;
	ramp = fmin(fmax((i - lo) / (hi - lo), 0), 1);
	ef = 1 - ramp;
	return 1 / (p->factor * pf) * (1 - ef) + 1 / pf * ef;
}

static void check_inv(const struct k_rope_params *p, double (*ref)(const struct k_rope_params *, int),
		      const char *what)
{
	struct k_rope rope;
	int ret = k_rope_init(&rope, p);

	CHECK(ret == 0, "%s: init %d", what, ret);
	if (ret)
		return;
	for (int i = 0; i < p->dim / 2; i++) {
		double want = ref(p, i);

		CHECK(fabs(rope.inv_freq[i] - want) <= INV_RTOL * want,
		      "%s inv[%d] = %.9g, want %.9g", what, i, rope.inv_freq[i], want);
	}
	k_rope_fini(&rope);
}

static double ref_default_p(const struct k_rope_params *p, int i)
{
	return ref_default(p->theta, p->dim, i);
}

static double ref_linear_p(const struct k_rope_params *p, int i)
{
	return ref_default(p->theta, p->dim, i) / p->factor;
}

static void test_inv_formulas(void)
{
	struct k_rope_params p = { .type = K_ROPE_DEFAULT, .theta = 10000, .dim = 128 };

	check_inv(&p, ref_default_p, "default 1e4/128");
	p.theta = 1000000;
	p.dim = 64;
	check_inv(&p, ref_default_p, "default 1e6/64");
	p.type = K_ROPE_LINEAR;
	p.factor = 4;
	check_inv(&p, ref_linear_p, "linear");

	/* Llama 3.1 8B. */
	p = (struct k_rope_params){ .type = K_ROPE_LLAMA3, .theta = 500000, .dim = 128,
		.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
		.original_max_pos = 8192 };
	check_inv(&p, ref_llama3, "llama3 8B");

	/* DeepSeek-V3 (rope part 64, interleaved). */
	p = (struct k_rope_params){ .type = K_ROPE_YARN, .theta = 10000, .dim = 64,
		.interleaved = 1, .factor = 40, .original_max_pos = 4096, .beta_fast = 32,
		.beta_slow = 1, .mscale = 1, .mscale_all_dim = 1, .truncate = 1 };
	check_inv(&p, ref_yarn, "yarn dsv3");
	p.dim = 128;
	p.theta = 1000000;
	p.factor = 4;
	p.original_max_pos = 32768;
	check_inv(&p, ref_yarn, "yarn qwen");
}

/* Expected values computed by a short Python script that follows the HF code step
 * by step in float32 (each op rounded with struct.pack('f')). */
static const float llama3_want[8] = {
	1.0f, 0.079403013f, 0.00470075384f, 0.000911583134f,
	0.000176776681f, 3.42810235e-05f, 6.64786967e-06f, 1.28917316e-06f,
};

static const float yarn_want[8] = {
	1.0f, 0.237170815f, 0.049999997f, 0.00790569466f,
	0.00249999994f, 0.000790569466f, 0.000250000012f, 7.90569466e-05f,
};

static void check_table(const struct k_rope_params *p, const float *want, const char *what)
{
	struct k_rope rope;
	int ret = k_rope_init(&rope, p);

	CHECK(ret == 0, "%s: init %d", what, ret);
	if (ret)
		return;
	for (int i = 0; i < p->dim / 2; i++)
		CHECK(fabsf(rope.inv_freq[i] - want[i]) <= 1e-6f * want[i],
		      "%s inv[%d] = %.9g, want %.9g", what, i, rope.inv_freq[i], want[i]);
	CHECK(rope.attn_factor == 1.0f, "%s attn_factor %.9g", what, rope.attn_factor);
	k_rope_fini(&rope);
}

static void test_inv_hardcoded(void)
{
	/* Covers all three llama3 bands: kept, blended (i = 1), divided. */
	struct k_rope_params l3 = { .type = K_ROPE_LLAMA3, .theta = 500000, .dim = 16,
		.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
		.original_max_pos = 64 };
	/* Correction range [0, 3]: i = 1, 2 sit on the ramp. */
	struct k_rope_params y = { .type = K_ROPE_YARN, .theta = 10000, .dim = 16,
		.factor = 4, .beta_fast = 32, .beta_slow = 1, .mscale = 1,
		.mscale_all_dim = 1, .original_max_pos = 64, .truncate = 1 };

	check_table(&l3, llama3_want, "llama3 table");
	check_table(&y, yarn_want, "yarn table");
	y.beta_fast = y.beta_slow = 0;		/* 0 means the defaults 32 and 1 */
	check_table(&y, yarn_want, "yarn default betas");
}

static void test_yarn_attn_factor(void)
{
	struct k_rope_params p = { .type = K_ROPE_YARN, .theta = 10000, .dim = 64,
		.factor = 40, .original_max_pos = 4096, .truncate = 1 };
	struct k_rope rope;

	/* No mscale pair: get_mscale(factor) = 0.1 ln 40 + 1. */
	CHECK(k_rope_init(&rope, &p) == 0, "init");
	CHECK_NEAR(rope.attn_factor, 0.1 * log(40.0) + 1, 1e-6, "mscale(factor)");
	k_rope_fini(&rope);
	/* Unequal pair: ratio of the two mscales. */
	p.mscale = 1;
	p.mscale_all_dim = 0.5;
	CHECK(k_rope_init(&rope, &p) == 0, "init");
	CHECK_NEAR(rope.attn_factor, (0.1 * log(40.0) + 1) / (0.05 * log(40.0) + 1), 1e-6,
		   "mscale ratio");
	k_rope_fini(&rope);
	/* An explicit attention_factor wins. */
	p.attention_factor = 0.75;
	CHECK(k_rope_init(&rope, &p) == 0, "init");
	CHECK(rope.attn_factor == 0.75f, "explicit attention_factor %.9g", rope.attn_factor);
	k_rope_fini(&rope);
}

static void test_invalid(void)
{
	struct k_rope_params p = { .type = K_ROPE_DEFAULT, .theta = 10000, .dim = 7 };
	struct k_rope rope, zero;

	CHECK(k_rope_init(&rope, &p) == -EINVAL, "odd dim");
	p.dim = 0;
	CHECK(k_rope_init(&rope, &p) == -EINVAL, "zero dim");
	p.dim = 8;
	p.type = K_ROPE_LINEAR;
	CHECK(k_rope_init(&rope, &p) == -EINVAL, "linear factor 0");
	p.type = K_ROPE_YARN;
	p.factor = 2;
	CHECK(k_rope_init(&rope, &p) == -EINVAL, "yarn without original_max_pos");
	memset(&zero, 0, sizeof(zero));
	k_rope_fini(&zero);
	k_rope_fini(NULL);
}

/* A 4-dim head at position 3 against the rotation written out in double. */
static void test_apply_known(void)
{
	struct k_rope_params p = { .type = K_ROPE_DEFAULT, .theta = 100, .dim = 4 };
	struct k_rope rope;
	float x[6] = { 1, 2, 3, 4, 5, 6 };	/* dims 4, 5 lie past the rotary part */
	float y[6] = { 1, 2, 3, 4, 5, 6 };
	int32_t pos = 3;
	double a0 = 3.0, a1 = 3.0 / 10.0;	/* pos * 100^(-0/4), pos * 100^(-2/4) */
	double want_half[4] = {
		1 * cos(a0) - 3 * sin(a0), 2 * cos(a1) - 4 * sin(a1),
		3 * cos(a0) + 1 * sin(a0), 4 * cos(a1) + 2 * sin(a1),
	};
	double want_inter[4] = {
		1 * cos(a0) - 2 * sin(a0), 2 * cos(a0) + 1 * sin(a0),
		3 * cos(a1) - 4 * sin(a1), 4 * cos(a1) + 3 * sin(a1),
	};

	CHECK(k_rope_init(&rope, &p) == 0, "init");
	k_cpu_rope(&rope, x, 1, 1, 6, 6, &pos);
	for (int i = 0; i < 4; i++)
		CHECK_NEAR(x[i], want_half[i], 1e-6, "rotate_half");
	CHECK(x[4] == 5 && x[5] == 6, "past rotary dims touched");
	k_rope_fini(&rope);

	p.interleaved = 1;
	CHECK(k_rope_init(&rope, &p) == 0, "init");
	k_cpu_rope(&rope, y, 1, 1, 6, 6, &pos);
	for (int i = 0; i < 4; i++)
		CHECK_NEAR(y[i], want_inter[i], 1e-6, "interleaved");
	CHECK(y[4] == 5 && y[5] == 6, "past rotary dims touched");
	k_rope_fini(&rope);
}

/* Several rows and strided heads: each pair keeps its norm, position 0 is exact. */
static void test_apply_norms(int interleaved)
{
	enum { ROWS = 5, HEADS = 3, HD = 40, DIM = 32, HS = 48, RS = HEADS * HS + 5 };
	struct k_rope_params p = { .type = K_ROPE_YARN, .theta = 10000, .dim = DIM,
		.interleaved = interleaved, .factor = 1, .original_max_pos = 4096,
		.truncate = 1 };
	static float x[ROWS * RS], x0[ROWS * RS];
	int32_t pos[ROWS] = { 0, 1, 17, 4095, 131071 };
	unsigned long long seed = 42;
	struct k_rope rope;

	CHECK(k_rope_init(&rope, &p) == 0, "init");
	CHECK(rope.attn_factor == 1.0f, "factor 1 gives no mscale");
	for (int i = 0; i < ROWS * RS; i++)
		x[i] = x0[i] = test_randf(&seed);
	k_cpu_rope(&rope, x, ROWS, HEADS, RS, HS, pos);
	for (int r = 0; r < ROWS; r++) {
		for (int h = 0; h < HEADS; h++) {
			const float *a = x + r * RS + h * HS, *b = x0 + r * RS + h * HS;

			for (int i = 0; i < DIM / 2; i++) {
				int i1 = interleaved ? 2 * i : i;
				int i2 = interleaved ? 2 * i + 1 : i + DIM / 2;
				double n0 = hypot(b[i1], b[i2]), n1 = hypot(a[i1], a[i2]);

				/* the rotation itself, by the float angle HF forms */
				double ang = (float)pos[r] * rope.inv_freq[i];
				double w1 = b[i1] * cos(ang) - b[i2] * sin(ang);
				double w2 = b[i2] * cos(ang) + b[i1] * sin(ang);

				CHECK(fabs(n1 - n0) <= 1e-6 * (n0 + 1e-6), "pair norm %g vs %g", n1, n0);
				CHECK(fabs(a[i1] - w1) <= 1e-6 && fabs(a[i2] - w2) <= 1e-6,
				      "row %d pair %d rotated wrong", r, i);
			}
			for (int i = DIM; i < HS; i++)
				CHECK(a[i] == b[i], "untouched tail changed at %d", i);
			if (pos[r] == 0)
				CHECK(memcmp(a, b, sizeof(float) * HD) == 0, "position 0 not identity");
		}
	}
	k_rope_fini(&rope);
}

int main(void)
{
	test_inv_formulas();
	test_inv_hardcoded();
	test_yarn_attn_factor();
	test_invalid();
	test_apply_known();
	test_apply_norms(0);
	test_apply_norms(1);
	return test_result("test_rope");
}
