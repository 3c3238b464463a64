/* The CPU sampler against distributions computed by hand: greedy ties, temperature,
 * top-k, top-p, and reproducibility of (seed, step). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/k_cpu_sample.h"
#include "tests/testutil.h"

enum { V = 4, DRAWS = 200000 };

/* Frequencies of each token over DRAWS steps of one seed. */
static void frequencies(const float *logits, const struct k_sample_params *p, double *freq)
{
	float *work = malloc(K_CPU_SAMPLE_WORK(V) * sizeof(float));

	memset(freq, 0, V * sizeof(*freq));
	for (int s = 0; s < DRAWS; s++)
		freq[k_cpu_sample(logits, V, p, (uint64_t)s, work)] += 1.0 / DRAWS;
	free(work);
}

static void check_dist(const char *what, const float *logits, const struct k_sample_params *p,
		       const double *want)
{
	double freq[V];

	frequencies(logits, p, freq);
	for (int i = 0; i < V; i++)
		CHECK(fabs(freq[i] - want[i]) <= 0.005 && (want[i] > 0 || freq[i] == 0),
		      "%s: token %d drawn %.4f, expected %.4f", what, i, freq[i], want[i]);
}

int main(void)
{
	/* p = 0.1, 0.2, 0.3, 0.4 at temperature 1 */
	float logits[V] = { logf(1), logf(2), logf(3), logf(4) };
	float work[2 * 8];
	struct k_sample_params p = { .temperature = 1, .seed = 42 };

	/* greedy: highest logit, ties to the lower id, NaN never wins */
	{
		float t[8] = { 1, 3, NAN, 3, -1, 2, 3, 0 };
		struct k_sample_params g = { .temperature = 0 };

		CHECK(k_cpu_sample(t, 8, &g, 0, work) == 1, "greedy tie goes to the lower id");
		t[0] = NAN;
		CHECK(k_cpu_sample(t, 8, &g, 0, work) == 1, "NaN first logit does not win");
	}
	check_dist("T=1", logits, &p, (double[]){ 0.1, 0.2, 0.3, 0.4 });
	p.temperature = 2;	/* p ~ sqrt(1..4) */
	{
		double s = 1 + sqrt(2) + sqrt(3) + 2;

		check_dist("T=2", logits, &p, (double[]){ 1 / s, sqrt(2) / s, sqrt(3) / s, 2 / s });
	}
	p.temperature = 1;
	p.top_k = 2;
	check_dist("top_k=2", logits, &p, (double[]){ 0, 0, 3.0 / 7, 4.0 / 7 });
	p.top_k = 0;
	p.top_p = 0.5f;		/* sorted 0.4, 0.3: 0.4 < 0.5 <= 0.7 keeps two */
	check_dist("top_p=0.5", logits, &p, (double[]){ 0, 0, 3.0 / 7, 4.0 / 7 });
	p.top_p = 0.35f;	/* 0.4 >= 0.35 keeps one */
	check_dist("top_p=0.35", logits, &p, (double[]){ 0, 0, 0, 1 });
	p.top_p = 0.75f;
	p.top_k = 3;		/* top-3 renormalised: 2/9 3/9 4/9; 4/9+3/9 = 0.78 >= 0.75 */
	check_dist("top_k=3,top_p=0.75", logits, &p, (double[]){ 0, 0, 3.0 / 7, 4.0 / 7 });

	/* a draw depends on (seed, step) only */
	{
		struct k_sample_params a = { .temperature = 1, .seed = 7 };
		int same = 1, differ = 0;

		for (int s = 0; s < 100; s++) {
			int32_t x = k_cpu_sample(logits, V, &a, (uint64_t)s, work);
			int32_t y = k_cpu_sample(logits, V, &a, (uint64_t)s, work);

			same &= x == y;
			a.seed = 8;
			differ += k_cpu_sample(logits, V, &a, (uint64_t)s, work) != x;
			a.seed = 7;
		}
		CHECK(same, "the same seed and step draw the same token");
		CHECK(differ > 20, "another seed draws differently (%d of 100 differ)", differ);
	}
	/* u is in [0, 1) */
	for (uint64_t s = 0; s < 100000; s++) {
		float u = k_sample_uniform(123, s);

		if (!(u >= 0 && u < 1)) {
			CHECK(0, "u(123, %llu) = %g out of [0, 1)", (unsigned long long)s, u);
			break;
		}
	}
	return test_result("test_sample");
}
