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

int k_cpu_sample_top_k(const float *logits, int vocab, int k, int32_t *ids)
{
	return k > 0 ? select_top_k(logits, vocab, k < vocab ? k : vocab, ids) : 0;
}

static const float *sort_logits;	/* qsort has no context argument */

static int cmp_rank(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;

	return ranks_before(sort_logits, x, y) ? -1 : ranks_before(sort_logits, y, x);
}

/* Step 0 of the procedure: l = logits with h's penalties. cnt (vocab): each token's
 * count in the output, -1 for one only in the prompt (with a repetition penalty). */
static void penalise(const float *logits, int vocab, const struct k_sample_params *p,
		     const struct k_sample_hist *h, float *l, int32_t *cnt)
{
	float r = p->repetition_penalty;

	memcpy(l, logits, (size_t)vocab * sizeof(*l));
	if (!h)
		return;
	memset(cnt, 0, (size_t)vocab * sizeof(*cnt));
	for (int i = 0; i < h->n_out; i++)
		if (h->out[i] >= 0 && h->out[i] < vocab)
			cnt[h->out[i]]++;
	if (r > 0 && r != 1) {
		for (int i = 0; i < h->n_prompt; i++)
			if (h->prompt[i] >= 0 && h->prompt[i] < vocab && !cnt[h->prompt[i]])
				cnt[h->prompt[i]] = -1;
		for (int32_t i = 0; i < vocab; i++)
			if (cnt[i])
				l[i] = l[i] > 0 ? l[i] / r : l[i] * r;
	}
	if (p->presence_penalty == 0 && p->frequency_penalty == 0)
		return;
	for (int32_t i = 0; i < vocab; i++)
		if (cnt[i] > 0)
			l[i] -= p->presence_penalty + p->frequency_penalty * (float)cnt[i];
}

/* log softmax(l / T) of tok and of the n most probable tokens into lp; ids: vocab
 * int32 of scratch. */
static void logprobs(const float *l, int vocab, const struct k_sample_params *p, int32_t tok,
		     int32_t *ids, struct k_sample_logprobs *lp)
{
	float t = p->temperature > 0 ? p->temperature : 1;
	double max = -INFINITY, sum = 0, lse;
	int n = p->top_logprobs;

	for (int32_t i = 0; i < vocab; i++)
		if (!isnan(l[i]) && (double)l[i] / t > max)
			max = (double)l[i] / t;
	for (int32_t i = 0; i < vocab; i++)
		if (!isnan(l[i]))
			sum += exp((double)l[i] / t - max);
	lse = max + log(sum);
	lp->token = tok;
	lp->logprob = (float)((double)l[tok] / t - lse);
	n = n < 0 ? 0 : n > K_SAMPLE_LOGPROBS_MAX ? K_SAMPLE_LOGPROBS_MAX : n;
	n = n < vocab ? n : vocab;
	lp->n = n ? select_top_k(l, vocab, n, ids) : 0;
	sort_logits = l;
	qsort(ids, (size_t)lp->n, sizeof(*ids), cmp_rank);
	for (int i = 0; i < lp->n; i++) {
		lp->ids[i] = ids[i];
		lp->logprobs[i] = (float)((double)l[ids[i]] / t - lse);
	}
}

/* Steps 2-6 over z (vocab): the drawn token. */
static int32_t draw(const float *z, int vocab, const struct k_sample_params *p, uint64_t step,
		    int32_t *ids, float *prob)
{
	float t, max, sum = 0, kept = 0, target, run = 0;
	int n, n_keep;

	n = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
	n = select_top_k(z, vocab, n, ids);
	if (n == 0)
		return 0;	/* every logit NaN */
	sort_logits = z;
	qsort(ids, (size_t)n, sizeof(*ids), cmp_rank);

	t = p->temperature;
	max = z[ids[0]] / t;
	for (int i = 0; i < n; i++) {
		prob[i] = expf(z[ids[i]] / t - max);
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
	if (p->min_p > 0) {
		float floor = p->min_p * prob[0];	/* ratios: the sum cancels */

		for (int i = 1; i < n_keep; i++) {
			if (prob[i] < floor) {
				n_keep = i;
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

int32_t k_cpu_sample_hist(const float *logits, int vocab, const struct k_sample_params *p,
			  const struct k_sample_hist *h, uint64_t step, float *work,
			  struct k_sample_logprobs *lp)
{
	int32_t *ids = (int32_t *)(void *)work;
	float *prob = work + vocab, *l = work + 2 * (size_t)vocab;
	const float *z = logits;
	int32_t tok;

	if (h && k_sample_has_penalty(p)) {
		penalise(logits, vocab, p, h, l, (int32_t *)(void *)(work + 3 * (size_t)vocab));
		z = l;
	}
	if (p->temperature <= 0 || vocab == 1)
		tok = argmax(z, vocab);
	else
		tok = draw(z, vocab, p, step, ids, prob);
	if (lp && p->logprobs)
		logprobs(z, vocab, p, tok, ids, lp);
	return tok;
}

int32_t k_cpu_sample(const float *logits, int vocab, const struct k_sample_params *p,
		     uint64_t step, float *work)
{
	return k_cpu_sample_hist(logits, vocab, p, NULL, step, work, NULL);
}
