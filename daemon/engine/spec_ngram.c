/* n-gram drafts and their greedy verification (daemon/engine/spec_ngram.h). Agent traffic
 * re-quotes code and edits it, so the history often predicts the next tokens. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/spec_ngram.h"

/* "k=4" -> 4 within [min, max]; -EINVAL on anything else. */
static int parse_kv(const char *s, size_t len, const char *name, int min, int max, int *out)
{
	size_t nl = strlen(name);
	char buf[16], *end;
	long v;

	if (len <= nl + 1 || len - nl - 1 >= sizeof(buf) || strncmp(s, name, nl) || s[nl] != '=')
		return -EINVAL;
	memcpy(buf, s + nl + 1, len - nl - 1);
	buf[len - nl - 1] = 0;
	if (buf[0] < '0' || buf[0] > '9')
		return -EINVAL;
	errno = 0;
	v = strtol(buf, &end, 10);
	if (errno || *end || v < min || v > max)
		return -EINVAL;
	*out = (int)v;
	return 0;
}

int spec_parse(const char *s, struct spec_opts *o, char *err, size_t err_len)
{
	const char *p, *comma;
	int have_k = 0, have_n = 0;

	o->k = 0;
	o->n = SPEC_DEFAULT_N;
	if (!strcmp(s, "off"))
		return 0;
	if (strncmp(s, "ngram:", 6))
		goto bad;
	for (p = s + 6; *p; p = *comma ? comma + 1 : comma) {
		size_t len;

		comma = strchr(p, ',');
		if (!comma)
			comma = p + strlen(p);
		len = (size_t)(comma - p);
		if (!have_k && !parse_kv(p, len, "k", 1, SPEC_MAX_K, &o->k))
			have_k = 1;
		else if (!have_n && !parse_kv(p, len, "n", 1, SPEC_MAX_N, &o->n))
			have_n = 1;
		else
			goto bad;
		if (*comma && !comma[1])
			goto bad;	/* trailing comma */
	}
	if (have_k)
		return 0;
bad:
	snprintf(err, err_len, "--spec '%s': want ngram:k=N[,n=M] with N in 1..%d, M in 1..%d, or off",
		 s, SPEC_MAX_K, SPEC_MAX_N);
	o->k = 0;
	return -EINVAL;
}

int spec_ngram_propose(const int32_t *hist, int n_hist, int max_n, int k, int32_t *out)
{
	int best_len = 0, best_at = -1;

	if (max_n > SPEC_MAX_N)
		max_n = SPEC_MAX_N;
	if (k > SPEC_MAX_K)
		k = SPEC_MAX_K;
	if (k <= 0 || max_n <= 0 || n_hist < 2)
		return 0;
	/* at: where the continuation starts; the match ends at at - 1. Newest first,
	 * so a longer match must be strictly longer to displace a more recent one. */
	for (int at = n_hist - 1; at >= 1 && best_len < max_n; at--) {
		int len = 0;

		while (len < max_n && len < at && hist[at - 1 - len] == hist[n_hist - 1 - len])
			len++;
		if (len > best_len) {
			best_len = len;
			best_at = at;
		}
	}
	if (best_at < 0)
		return 0;
	/* a continuation that runs into the end of the history repeats with period
	 * n_hist - best_at (the match overlaps the suffix), as an LZ77 copy does: a
	 * loop the model is in yields k drafts, not one */
	for (int i = 0; i < k; i++)
		out[i] = best_at + i < n_hist ? hist[best_at + i] : out[i - (n_hist - best_at)];
	return k;
}

/* The greedy token exactly as kernels/cpu/sample.c picks it (the lower id on ties,
 * past a NaN), so that speculation never changes a greedy output. */
static int32_t argmax(const float *l, int vocab)
{
	int32_t best = 0;

	for (int32_t i = 1; i < vocab; i++)
		if (l[i] > l[best] || isnan(l[best]))
			best = i;
	return best;
}

int spec_verify_greedy(const float *logits, int vocab, const int32_t *drafts, int n_draft,
		       int32_t *out)
{
	int i;

	for (i = 0; i <= n_draft; i++) {
		out[i] = argmax(logits + (size_t)i * (size_t)vocab, vocab);
		if (i == n_draft || out[i] != drafts[i])
			break;
	}
	return i + 1;
}

int spec_accept(const int32_t *draws, const int32_t *drafts, int n_draft)
{
	int m = 0;

	while (m < n_draft && draws[m] == drafts[m])
		m++;
	return m;
}
