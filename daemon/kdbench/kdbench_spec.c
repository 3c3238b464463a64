/* `kdbench generate --spec ngram:...`: greedy decoding where each step feeds the last
 * token and up to k n-gram drafts, keeps the longest prefix the model agrees with
 * plus its own next token, and rolls the KV of the rest back. Same ids as plain
 * greedy; the acceptance figures go to stderr. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/clock.h"
#include "daemon/kdbench/kdbench.h"

struct spec_run {
	long steps;		/* verification steps */
	long drafted;		/* draft tokens fed */
	long accepted;		/* of those, kept */
};

/* One step: drafts after hist, verify, keep; *emitted tokens appended to hist. */
static int spec_step(struct engine *e, struct engine_seq *seq, const struct spec_opts *so,
		     int32_t *hist, int n_hist, long room, float *logits, int *emitted,
		     struct spec_run *st, char *err, size_t err_len)
{
	int32_t fed[SPEC_MAX_K + 1];
	int k = so->k < room - 1 ? so->k : (int)(room - 1);
	int nd = spec_ngram_propose(hist, n_hist, so->n, k, fed + 1);
	struct engine_req r = { .seq = seq, .tokens = fed, .n_tokens = nd + 1, .all_logits = 1,
				.n_draft = nd };
	int m, ret;

	fed[0] = hist[n_hist - 1];
	if ((ret = engine_step(e, &r, 1, logits, err, err_len)))
		return ret;
	m = spec_verify_greedy(logits, e->model->cfg.vocab_size, fed + 1, nd, hist + n_hist);
	if ((ret = engine_seq_truncate(e, seq, seq->n_tokens - (nd - (m - 1))))) {
		snprintf(err, err_len, "KV rollback failed: %s", strerror(-ret));
		return ret;
	}
	st->steps++;
	st->drafted += nd;
	st->accepted += m - 1;
	*emitted = m;
	return 0;
}

int kdbench_generate_spec(struct engine *e, const int32_t *ids, int n, long max_tokens,
			  const struct spec_opts *so)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	float *logits = malloc((size_t)(SPEC_MAX_K + 1) * vocab * sizeof(float));
	int32_t *hist = malloc(((size_t)n + (size_t)max_tokens + SPEC_MAX_K + 1) * sizeof(int32_t));
	struct engine_req r = { .tokens = ids, .n_tokens = n };
	struct spec_run st = { 0 };
	struct engine_seq seq;
	double t0, t_first, t_end;
	char err[256] = "";
	long out = 0;
	int n_hist = n, ret = -ENOMEM;

	engine_seq_init(&seq);
	if (!logits || !hist)
		goto out;
	memcpy(hist, ids, (size_t)n * sizeof(int32_t));
	t0 = clock_now();
	r.seq = &seq;
	if ((ret = engine_step(e, &r, 1, logits, err, sizeof(err))))
		goto out;
	spec_verify_greedy(logits, (int)vocab, NULL, 0, hist + n_hist++);
	t_first = t_end = clock_now();
	out = 1;
	while (out < max_tokens) {
		int m;

		if ((ret = spec_step(e, &seq, so, hist, n_hist, max_tokens - out, logits, &m, &st,
				     err, sizeof(err))))
			break;
		n_hist += m;
		out += m;
		t_end = clock_now();
	}
	for (long i = 0; i < out; i++)
		printf("%s%d", i ? " " : "", hist[n + i]);
	printf("\n");
	fflush(stdout);
	if (ret)
		goto out;
	fprintf(stderr, "prompt %d tokens: time to first token %.2f ms (%.1f tokens/s prefill)\n",
		n, (t_first - t0) * 1e3, n / (t_first - t0));
	if (max_tokens > 1)
		fprintf(stderr, "decode %ld tokens: %.2f ms/token, %.1f tokens/s\n", max_tokens - 1,
			(t_end - t_first) * 1e3 / (double)(max_tokens - 1),
			(double)(max_tokens - 1) / (t_end - t_first));
	fprintf(stderr, "spec ngram k=%d n=%d: %ld steps, %ld drafted, %ld accepted, "
		"mean acceptance length %.2f tokens/step\n", so->k, so->n, st.steps, st.drafted,
		st.accepted, st.steps ? (double)(st.steps + st.accepted) / (double)st.steps : 0.0);
out:
	if (ret)
		fprintf(stderr, "kdbench generate: %s\n", err[0] ? err : strerror(-ret));
	engine_seq_release(e, &seq);
	free(logits);
	free(hist);
	return ret;
}
