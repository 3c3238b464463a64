/* Speculation for sampled requests: verification by the request's own seeded draws
 * (spec_accept over k_cpu_sample_hist) is rejection sampling for a point-mass n-gram
 * draft. Over 1e5 draws from synthetic distributions p (after temperature, top-k,
 * top-p, min-p, penalties, computed here independently in double): the emitted
 * token follows p, a draft x is accepted with probability p(x) (exactly never at
 * p(x) = 0, always at p(x) = 1), and a rejected position's token follows p without x,
 * renormalised (chi-square at alpha = 1e-4); at temperature 0 acceptance is exactly
 * the greedy rule; a chain of drafts emits the plain draws position by position. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/spec_ngram.h"
#include "kernels/cpu/k_cpu_sample.h"
#include "tests/testutil.h"

#define V 8
#define N_DRAWS 100000

/* chi-square critical values at alpha = 1e-4, by degrees of freedom 1..7 */
static const double chi2_crit[V] = { 0, 15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88 };

/* p as kernels/k_sample.h defines it, in double: penalties over h, temperature,
 * top-k, top-p, min-p. (greedy: a point mass on the argmax) */
static void expected_p(const float *logits, const struct k_sample_params *sp,
		       const struct k_sample_hist *h, double *p)
{
	double l[V], z[V], sum = 0, kept = 0;
	int order[V], n = V;

	for (int i = 0; i < V; i++) {
		int in_hist = 0, c = 0;

		l[i] = logits[i];
		for (int k = 0; h && k < h->n_prompt; k++)
			in_hist |= h->prompt[k] == i;
		for (int k = 0; h && k < h->n_out; k++)
			c += h->out[k] == i;
		if ((in_hist || c) && sp->repetition_penalty > 0 && sp->repetition_penalty != 1)
			l[i] = l[i] > 0 ? l[i] / sp->repetition_penalty : l[i] * sp->repetition_penalty;
		if (c)
			l[i] -= sp->presence_penalty + sp->frequency_penalty * c;
	}
	/* order by logit descending, ties by the lower id */
	for (int i = 0; i < V; i++)
		order[i] = i;
	for (int i = 1; i < V; i++)
		for (int j = i; j > 0 && l[order[j]] > l[order[j - 1]]; j--) {
			int t = order[j];

			order[j] = order[j - 1];
			order[j - 1] = t;
		}
	memset(p, 0, V * sizeof(*p));
	if (sp->temperature <= 0) {
		p[order[0]] = 1;
		return;
	}
	if (sp->top_k > 0 && sp->top_k < n)
		n = sp->top_k;
	for (int i = 0; i < n; i++)
		sum += z[i] = exp((l[order[i]] - l[order[0]]) / sp->temperature);
	for (int i = 0; i < n; i++)
		z[i] /= sum;
	if (sp->top_p > 0 && sp->top_p < 1) {
		double run = 0;

		for (int i = 0; i < n; i++) {
			run += z[i];
			if (run >= sp->top_p) {
				n = i + 1;
				break;
			}
		}
	}
	if (sp->min_p > 0)
		for (int i = 1; i < n; i++)
			if (z[i] < sp->min_p * z[0]) {
				n = i;
				break;
			}
	for (int i = 0; i < n; i++)
		kept += z[i];
	for (int i = 0; i < n; i++)
		p[order[i]] = z[i] / kept;
}

/* Chi-square of counts against total * q over the tokens with q > 0; tokens with
 * q == 0 must have no count. Returns 1 if it passes. */
static int chi2_ok(const long *count, const double *q, long total, const char *what)
{
	double chi = 0;
	int df = -1;

	for (int i = 0; i < V; i++) {
		if (q[i] <= 0) {
			if (count[i]) {
				fprintf(stderr, "%s: token %d has probability 0 but came %ld times\n", what, i, count[i]);
				return 0;
			}
			continue;
		}
		chi += (count[i] - total * q[i]) * (count[i] - total * q[i]) / (total * q[i]);
		df++;
	}
	if (df <= 0)
		return 1;	/* one token: the zero checks above are all there is */
	fprintf(stderr, "  %s: chi2 %.2f (df %d, critical %.2f)\n", what, chi, df, chi2_crit[df]);
	return chi <= chi2_crit[df];
}

struct scase {
	const char *name;
	float logits[V];
	struct k_sample_params sp;
	int32_t draft;
	int penalties;	/* use the history below */
};

static const int32_t hist_prompt[] = { 1, 2 }, hist_out[] = { 2, 3, 3 };

static void run_case(const struct scase *c, float *work)
{
	struct k_sample_hist h = { hist_prompt, 2, hist_out, 3 };
	const struct k_sample_hist *hp = c->penalties ? &h : NULL;
	long emitted[V] = { 0 }, rejected[V] = { 0 }, acc = 0;
	double p[V], rest[V];
	int32_t x = c->draft;

	expected_p(c->logits, &c->sp, hp, p);
	for (long s = 0; s < N_DRAWS; s++) {
		int32_t t = k_cpu_sample_hist(c->logits, V, &c->sp, hp, (uint64_t)s, work, NULL);
		int a = spec_accept(&t, &x, 1);

		/* what is emitted at the position: the draft if accepted, else the draw */
		emitted[a ? x : t]++;
		acc += a;
		if (!a)
			rejected[t]++;
	}
	fprintf(stderr, "%s: p(x=%d) = %.4f, accepted %.4f\n", c->name, x, p[x], (double)acc / N_DRAWS);
	CHECK(chi2_ok(emitted, p, N_DRAWS, "emitted ~ p"), "%s: the emitted tokens do not follow p", c->name);
	if (p[x] == 0) {
		CHECK(acc == 0, "%s: x with p(x) = 0 accepted %ld times", c->name, acc);
	} else if (p[x] == 1) {
		CHECK(acc == N_DRAWS, "%s: x with p(x) = 1 rejected %ld times", c->name, N_DRAWS - acc);
	} else {
		double sd = sqrt(p[x] * (1 - p[x]) / N_DRAWS);

		CHECK(fabs((double)acc / N_DRAWS - p[x]) <= 5 * sd, "%s: acceptance %.4f, want p(x) %.4f (5 sd %.4f)",
		      c->name, (double)acc / N_DRAWS, p[x], 5 * sd);
	}
	if (p[x] < 1) {
		for (int i = 0; i < V; i++)
			rest[i] = i == x ? 0 : p[i] / (1 - p[x]);
		CHECK(chi2_ok(rejected, rest, N_DRAWS - acc, "rejected ~ p without x"),
		      "%s: the tokens at rejections do not follow p without x", c->name);
	}
}

static void test_distributions(void)
{
	static const struct scase cases[] = {
		{ "t=1, x likely", { 2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, 0.2f },
		  { .temperature = 1.0f, .seed = 1 }, 0, 0 },
		{ "t=0.7, x unlikely", { 2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, 0.2f },
		  { .temperature = 0.7f, .seed = 2 }, 5, 0 },
		{ "top-k 3, x cut (p(x) = 0)", { 2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, 0.2f },
		  { .temperature = 1.0f, .top_k = 3, .seed = 3 }, 2, 0 },
		{ "top-k 1, x the only one (p(x) = 1)", { 2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, 0.2f },
		  { .temperature = 1.3f, .top_k = 1, .seed = 4 }, 0, 0 },
		{ "top-p 0.8 + min-p 0.1", { 1.0f, 0.9f, 0.8f, 0.1f, -2.0f, 0.3f, 0.5f, -1.0f },
		  { .temperature = 0.9f, .top_p = 0.8f, .min_p = 0.1f, .seed = 5 }, 2, 0 },
		{ "penalties", { 1.0f, 0.9f, 0.8f, 0.7f, -0.2f, 0.3f, 0.5f, 0.0f },
		  { .temperature = 1.0f, .repetition_penalty = 1.5f, .presence_penalty = 0.3f,
		    .frequency_penalty = 0.1f, .seed = 6 }, 3, 1 },
	};
	float *work = malloc(K_CPU_SAMPLE_WORK(V) * sizeof(float));

	for (size_t i = 0; work && i < sizeof(cases) / sizeof(cases[0]); i++)
		run_case(&cases[i], work);
	free(work);
}

/* Temperature 0: the draw is the argmax, so a draft stands exactly when it is the
 * argmax (ties: the lower id), whatever the seed, as spec_verify_greedy decides. */
static void test_greedy(void)
{
	/* row 0 decides; spec_verify_greedy reads a row past an accepted draft */
	static const float rows[2][V] = { { 0.5f, 2.0f, 2.0f, -1.0f, 1.0f, 0.0f, 1.9f, -3.0f } };
	const float *l = rows[0];
	float *work = malloc(K_CPU_SAMPLE_WORK(V) * sizeof(float));
	struct k_sample_params sp = { .temperature = 0, .seed = 99 };

	for (int32_t x = 0; work && x < V; x++) {
		for (uint64_t s = 0; s < 100; s++) {
			int32_t t = k_cpu_sample(l, V, &sp, s, work), g[2];
			int a = spec_accept(&t, &x, 1);

			CHECK(a == (x == 1), "temperature 0, draft %d, step %llu: accepted %d", x,
			      (unsigned long long)s, a);
			CHECK(spec_verify_greedy(rows[0], V, &x, 1, g) - 1 == a && g[0] == t,
			      "temperature 0, draft %d: spec_verify_greedy disagrees", x);
		}
	}
	free(work);
}

/* A chain of k drafts at output indices n..n+k: the tokens emitted (accepted drafts,
 * then the draw at the first rejection) are the plain draws of those indices, so
 * output does not depend on what was drafted. */
static void test_chain(void)
{
	static const float rows[3][V] = {
		{ 1.0f, 0.2f, 0.1f, 0.0f, -1.0f, 0.3f, 0.5f, 0.4f },
		{ 0.0f, 1.5f, 0.1f, 0.0f, -1.0f, 0.3f, 0.5f, 0.4f },
		{ 0.3f, 0.2f, 1.1f, 0.0f, -1.0f, 0.3f, 0.5f, 0.4f },
	};
	struct k_sample_params sp = { .temperature = 1.0f, .top_k = 5, .seed = 7 };
	float *work = malloc(K_CPU_SAMPLE_WORK(V) * sizeof(float));
	long all = 0, mismatched = 0;

	for (uint64_t n = 0; work && n < 20000; n += 3) {
		int32_t drafts[2] = { (int32_t)(n % V), (int32_t)((n / V) % V) }, draws[3];
		int m;

		for (int j = 0; j < 3; j++)
			draws[j] = k_cpu_sample(rows[j], V, &sp, n + (uint64_t)j, work);
		m = spec_accept(draws, drafts, 2);
		all += m;
		for (int j = 0; j <= m; j++)
			mismatched += (j < m ? drafts[j] : draws[j]) != k_cpu_sample(rows[j], V, &sp, n + (uint64_t)j, work);
	}
	CHECK(mismatched == 0 && all > 0, "chain: %ld emitted tokens differ from the plain draws (%ld accepted)",
	      mismatched, all);
	free(work);
}

int main(void)
{
	test_distributions();
	test_greedy();
	test_chain();
	return test_result("test_spec_sample");
}
