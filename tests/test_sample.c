/* The CPU sampler against distributions computed by hand: greedy ties, temperature,
 * top-k, top-p, min-p, repetition / presence / frequency penalties, logprobs, and
 * reproducibility of (seed, step). */
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

enum { V5 = 5 };

/* Like check_dist over a vocabulary of 5 with a history. */
static void check_dist5(const char *what, const float *logits, const struct k_sample_params *p,
			const struct k_sample_hist *h, const double *want)
{
	float *work = malloc(K_CPU_SAMPLE_WORK(V5) * sizeof(float));
	double freq[V5] = { 0 };

	for (int s = 0; s < DRAWS; s++)
		freq[k_cpu_sample_hist(logits, V5, p, h, (uint64_t)s, work, NULL)] += 1.0 / DRAWS;
	free(work);
	for (int i = 0; i < V5; i++)
		CHECK(fabs(freq[i] - want[i]) <= 0.005 && (want[i] > 0 || freq[i] == 0),
		      "%s: token %d drawn %.4f, expected %.4f", what, i, freq[i], want[i]);
}

/* logits 1, -1, 2, 0.5, 0.3; prompt 0 1; output 2 2 3. Repetition 2 touches 0..3:
 * 0.5, -2, 1, 0.25, 0.3; presence 0.5 and frequency 0.25 then take 0.5 + 2 * 0.25
 * from token 2 and 0.5 + 0.25 from token 3: 0.5, -2, 0, -0.5, 0.3. */
static void test_penalties(void)
{
	const float logits[V5] = { 1, -1, 2, 0.5f, 0.3f }, pen[V5] = { 0.5f, -2, 0, -0.5f, 0.3f };
	const int32_t prompt[] = { 0, 1 }, out[] = { 2, 2, 3 };
	struct k_sample_hist h = { .prompt = prompt, .n_prompt = 2, .out = out, .n_out = 3 };
	struct k_sample_params p = { .repetition_penalty = 2, .presence_penalty = 0.5f,
				     .frequency_penalty = 0.25f, .logprobs = 1, .top_logprobs = 3 };
	float work[4 * V5], copy[V5];
	struct k_sample_logprobs lp;
	double s = 0, want[V5];

	memcpy(copy, logits, sizeof(copy));
	CHECK(k_cpu_sample(logits, V5, &p, 0, work) == 2, "no history: no penalty");
	CHECK(k_cpu_sample_hist(logits, V5, &p, &h, 0, work, &lp) == 0, "greedy with penalties");
	CHECK(!memcmp(copy, logits, sizeof(copy)), "logits unchanged");
	for (int i = 0; i < V5; i++)
		s += exp(pen[i]);
	CHECK(lp.token == 0 && fabs(lp.logprob - (0.5 - log(s))) < 1e-6,
	      "greedy logprob %.7f, expected %.7f", lp.logprob, 0.5 - log(s));
	CHECK(lp.n == 3 && lp.ids[0] == 0 && lp.ids[1] == 4 && lp.ids[2] == 2,
	      "top logprobs %d: %d %d %d", lp.n, lp.ids[0], lp.ids[1], lp.ids[2]);
	for (int i = 0; i < lp.n && i < 3; i++)
		CHECK(fabs(lp.logprobs[i] - (pen[lp.ids[i]] - log(s))) < 1e-6, "alternative %d", i);
	p.temperature = 1;
	for (int i = 0; i < V5; i++)
		want[i] = exp(pen[i]) / s;
	check_dist5("penalties T=1", logits, &p, &h, want);
	p.repetition_penalty = 0;	/* presence and frequency alone: 2 -> 1, 0.5 -> -0.25 */
	s = exp(1) + exp(-1) + exp(1) + exp(-0.25) + exp(0.3);
	check_dist5("presence+frequency", logits, &p, &h,
		    (double[]){ exp(1) / s, exp(-1) / s, exp(1) / s, exp(-0.25) / s, exp(0.3) / s });
	p = (struct k_sample_params){ .temperature = 1, .repetition_penalty = 0.5f };
	h.n_out = 0;			/* prompt 0 1 only: 2, -0.5, 2, 0.5, 0.3 */
	s = 2 * exp(2) + exp(-0.5) + exp(0.5) + exp(0.3);
	check_dist5("repetition < 1", logits, &p, &h,
		    (double[]){ exp(2) / s, exp(-0.5) / s, exp(2) / s, exp(0.5) / s, exp(0.3) / s });
	/* reproducible: same (seed, step), same token, with penalties */
	p.seed = 99;
	for (int st = 0; st < 50; st++)
		CHECK(k_cpu_sample_hist(logits, V5, &p, &h, (uint64_t)st, work, NULL) ==
		      k_cpu_sample_hist(logits, V5, &p, &h, (uint64_t)st, work, NULL), "repeatable");
}

/* logits log 1..4 (p 0.1 .. 0.4) */
static void test_min_p_logprobs(const float *logits)
{
	struct k_sample_params p = { .temperature = 1, .seed = 5, .min_p = 0.5f };
	struct k_sample_logprobs lp;
	float work[4 * V];
	double s = 1 + sqrt(2) + sqrt(3) + 2;

	check_dist("min_p=0.5", logits, &p, (double[]){ 0, 2.0 / 9, 3.0 / 9, 4.0 / 9 });
	p.min_p = 0.8f;		/* floor 0.32 keeps 0.4 only */
	check_dist("min_p=0.8", logits, &p, (double[]){ 0, 0, 0, 1 });
	p.min_p = 0.6f;		/* top-3 2/9 3/9 4/9; floor 0.6 * 4/9 = 0.267 cuts 2/9 */
	p.top_k = 3;
	check_dist("top_k=3,min_p=0.6", logits, &p, (double[]){ 0, 0, 3.0 / 7, 4.0 / 7 });
	/* logprobs: after temperature, before truncation: 0.5 log(i + 1) - log s at T=2 */
	p = (struct k_sample_params){ .temperature = 2, .top_k = 1, .logprobs = 1, .top_logprobs = 20 };
	CHECK(k_cpu_sample_hist(logits, V, &p, NULL, 3, work, &lp) == 3, "top_k=1 draws 3");
	CHECK(lp.token == 3 && fabs(lp.logprob - log(2 / s)) < 1e-6, "logprob %.7f, expected %.7f",
	      lp.logprob, log(2 / s));
	CHECK(lp.n == V, "top_logprobs 20 over 4 tokens gives %d", lp.n);
	for (int i = 0; i < lp.n; i++)
		CHECK(lp.ids[i] == V - 1 - i && fabs(lp.logprobs[i] - (0.5 * log(V - i) - log(s))) < 1e-6,
		      "alternative %d: id %d logprob %.7f", i, lp.ids[i], lp.logprobs[i]);
	lp.n = -1;
	p.logprobs = 0;
	k_cpu_sample_hist(logits, V, &p, NULL, 3, work, &lp);
	CHECK(lp.n == -1, "logprobs off leaves lp alone");
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

	test_penalties();
	test_min_p_logprobs(logits);

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
