/* The sampling procedure of kernels/k_sample.h, step by step, on the CPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/k_cpu_sample.h"

/* The order every backend uses: higher logit first, then the lower id. */
static int ranks_before(const float *z, int32_t a, int32_t b)
{
	return z[a] > z[b] || (z[a] == z[b] && a < b);
}

static int32_t argmax(const float *logits, int vocab)
{
	int32_t best = 0;

	for (int32_t i = 1; i < vocab; i++)
		if (logits[i] > logits[best] || isnan(logits[best]))
			best = i;
	return best;
}

/* Sift-down of a min-heap (worst candidate at the root) ordered by ranks_before. */
static void heap_sift(int32_t *h, int n, int i, const float *logits)
{
	for (;;) {
		int l = 2 * i + 1, r = l + 1, w = i;

		if (l < n && ranks_before(logits, h[w], h[l]))
			w = l;
		if (r < n && ranks_before(logits, h[w], h[r]))
			w = r;
		if (w == i)
			return;
		int32_t t = h[i];
		h[i] = h[w];
		h[w] = t;
		i = w;
	}
}

/* The k best ids (by logit, ties to the lower id) into ids, unordered. */
static int select_top_k(const float *logits, int vocab, int k, int32_t *ids)
{
	int n = 0;

	for (int32_t i = 0; i < vocab; i++) {
		if (isnan(logits[i]))
			continue;
		if (n < k) {
			ids[n++] = i;
			if (n == k)
				for (int j = k / 2 - 1; j >= 0; j--)
					heap_sift(ids, k, j, logits);
		} else if (ranks_before(logits, i, ids[0])) {
			ids[0] = i;
			heap_sift(ids, k, 0, logits);
		}
	}
	return n;
}

static const float *sort_logits;	/* qsort has no context argument */

static int cmp_rank(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;

	return ranks_before(sort_logits, x, y) ? -1 : ranks_before(sort_logits, y, x);
}

int32_t k_cpu_sample(const float *logits, int vocab, const struct k_sample_params *p,
		     uint64_t step, float *work)
{
	int32_t *ids = (int32_t *)(void *)work;
	float *prob = work + vocab;
	float t, max, sum = 0, kept = 0, target, run = 0;
	int n, n_keep;

	if (p->temperature <= 0 || vocab == 1)
		return argmax(logits, vocab);
	n = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
	n = select_top_k(logits, vocab, n, ids);
	if (n == 0)
		return 0;	/* every logit NaN */
	sort_logits = logits;
	qsort(ids, (size_t)n, sizeof(*ids), cmp_rank);

	t = p->temperature;
	max = logits[ids[0]] / t;
	for (int i = 0; i < n; i++) {
		prob[i] = expf(logits[ids[i]] / t - max);
		sum += prob[i];
	}
	n_keep = n;
	if (p->top_p > 0 && p->top_p < 1) {
		float need = p->top_p * sum, cum = 0;

		for (int i = 0; i < n; i++) {
			cum += prob[i];
			if (cum >= need) {
				n_keep = i + 1;
				break;
			}
		}
	}
	for (int i = 0; i < n_keep; i++)
		kept += prob[i];
	target = k_sample_uniform(p->seed, step) * kept;
	for (int i = 0; i < n_keep; i++) {
		run += prob[i];
		if (run >= target)
			return ids[i];
	}
	return ids[n_keep - 1];
}
