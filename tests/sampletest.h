/* The fixtures of the sampling test and benchmark: logits rows of five kinds (flat,
 * realistic, quantised with ties, -inf and NaN, all equal) and the per-row sampling
 * parameters of one configuration. */
#ifndef KD_TESTS_SAMPLETEST_H
#define KD_TESTS_SAMPLETEST_H

#include <math.h>
#include <stdint.h>

#include "kernels/k_sample.h"
#include "tests/testutil.h"

/* One sampling configuration, every row alike. */
struct sample_cfg {
	float temperature;
	int top_k;
	float top_p;
};

/* Row r's kind: 0 flat, 1 and 2 realistic (a few tokens far above a long tail), 3
 * quantised (exact ties) with -inf and one NaN, 4 all equal (row 7). */
static inline int sample_row_kind(int r)
{
	return r == 7 ? 4 : r % 4;
}

static inline int sample_realistic(int r)
{
	return sample_row_kind(r) == 1 || sample_row_kind(r) == 2;
}

/* vocab logits of row r's kind into l. */
static inline void sample_make_logits(float *l, int vocab, int r, unsigned long long *seed)
{
	int kind = sample_row_kind(r);

	for (int i = 0; i < vocab; i++) {
		float a = test_randf(seed), b = test_randf(seed), c = test_randf(seed);

		switch (kind) {
		case 0: l[i] = a * 2; break;
		case 1: l[i] = a * 3; break;
		case 2: l[i] = (a + b + c) * 1.2f; break;
		case 3: l[i] = roundf(a * 6) / 2; break;
		default: l[i] = 1.5f; break;
		}
	}
	if (kind == 1 || kind == 2)
		for (int k = 0; k < (kind == 1 ? 8 : 12); k++)
			l[test_rand_int(0, vocab - 1, seed)] += 16 + test_randf(seed) * 8 +
								  (kind == 1 ? 2 : 0);
	if (kind == 3) {
		for (int k = 0; k < vocab / 10; k++)
			l[test_rand_int(0, vocab - 1, seed)] = -INFINITY;
		l[test_rand_int(0, vocab - 1, seed)] = NAN;
	}
}

/* M rows of configuration c at step (each row's own seed, from ci) into p and steps. */
static inline void sample_params_for(struct k_sample_params *p, uint64_t *steps, int M,
				     const struct sample_cfg *c, int step, int ci)
{
	for (int r = 0; r < M; r++) {
		p[r] = (struct k_sample_params){ .temperature = c->temperature, .top_k = c->top_k,
			.top_p = c->top_p, .seed = 0x1234567ull * (uint64_t)(r + 1) + (uint64_t)ci };
		steps[r] = (uint64_t)step * 7 + (uint64_t)r % 3;
	}
}

#endif
