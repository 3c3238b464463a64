/* Speculative decoding without a draft model: n-gram (prompt-lookup) drafts from a
 * sequence's own history, the `--spec ngram:k=N[,n=M]` option, and greedy
 * verification of the drafts against the model's logits. Pure functions; the
 * callers (kdbench generate, the scheduler) own the steps and the KV rollback. */
#ifndef KD_DAEMON_SPEC_NGRAM_H
#define KD_DAEMON_SPEC_NGRAM_H

#include <stddef.h>
#include <stdint.h>

#define SPEC_MAX_K 32		/* drafts per step */
#define SPEC_MAX_N 16		/* longest n-gram matched */
#define SPEC_DEFAULT_N 3
#define SPEC_DEFAULT_K 4		/* a request's IPC_SUB_SPEC when the daemon has no --spec */

struct spec_opts {
	int k;			/* drafts per step; 0: speculation off */
	int n;			/* longest n-gram matched (n..1 tried) */
};

/* Parses "ngram:k=N[,n=M]" (k in 1..SPEC_MAX_K, n in 1..SPEC_MAX_N, default
 * SPEC_DEFAULT_N) or "off" into o. 0, or -EINVAL with one line in err. */
int spec_parse(const char *s, struct spec_opts *o, char *err, size_t err_len);

/* Proposes k drafts (into out, k <= SPEC_MAX_K) to follow hist[0..n_hist): the
 * tokens that followed the most recent earlier occurrence of the longest suffix
 * of hist (max_n tokens down to 1) found again in hist, repeated periodically
 * past the end of hist. Returns k, or 0 (no match). One backward pass,
 * O(n_hist * max_n). */
int spec_ngram_propose(const int32_t *hist, int n_hist, int max_n, int k, int32_t *out);

/* Greedy verification. logits: (n_draft + 1, vocab), row i the model's prediction
 * after the fed token i (the last emitted token, then drafts[0..n_draft)). Writes
 * the tokens to emit into out (n_draft + 1 room): the longest prefix of drafts
 * that the argmax (ties: the lower id, as kernels/k_sample.h) agrees with, then
 * the model's own token at the first disagreement (or after the last draft).
 * Returns how many tokens out holds: accepted drafts + 1. */
int spec_verify_greedy(const float *logits, int vocab, const int32_t *drafts, int n_draft,
		       int32_t *out);

/* Verification by the request's own draws, for any sampling: draws[i] is the token
 * its sampler (kernels/k_sample.h, the seeded u of output index n_gen + i) drew from
 * the model's distribution p after fed token i, as plain decoding would. Draft i is
 * accepted while draws[i] equals it. An n-gram draft is a point mass on x, and this
 * is rejection sampling for it with one uniform per position: x is accepted with
 * probability p(x), and a rejected position's draw is distributed as p with x
 * removed and renormalised; so the tokens emitted, draws[0..accepted], are those
 * plain decoding draws with the same seed. At temperature 0 draws are argmaxes:
 * exactly greedy acceptance. Returns the drafts accepted, 0..n_draft. */
int spec_accept(const int32_t *draws, const int32_t *drafts, int n_draft);

#endif
