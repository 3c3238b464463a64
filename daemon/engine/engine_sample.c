/* A step that ends in token ids: drawn on the backend where it can sample (only ids
 * come back), else on the host by the CPU sampler; both follow kernels/k_sample.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/forward_tp.h"
#include "kernels/cpu/k_cpu_sample.h"

struct engine_sampler {
	int cap;		/* requests the buffers hold */
	float *logits;		/* (cap, vocab) */
	float *work;		/* K_CPU_SAMPLE_WORK(vocab) */
	uint8_t *host;		/* (cap) 1: the row is sampled on the host */
};

void engine_sampler_destroy(struct engine_sampler *s)
{
	if (!s)
		return;
	free(s->logits);
	free(s->work);
	free(s->host);
	free(s);
}

static int sampler_reserve(struct engine *e, int n)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	struct engine_sampler *s = e->sampler;
	float *logits;
	uint8_t *host;

	if (!s) {
		s = calloc(1, sizeof(*s));
		if (!s)
			return -ENOMEM;
		s->work = malloc(K_CPU_SAMPLE_WORK(vocab) * sizeof(float));
		if (!s->work) {
			free(s);
			return -ENOMEM;
		}
		e->sampler = s;
	}
	if (n <= s->cap)
		return 0;
	logits = realloc(s->logits, (size_t)n * vocab * sizeof(float));
	if (!logits)
		return -ENOMEM;
	s->logits = logits;
	host = realloc(s->host, (size_t)n);
	if (!host)
		return -ENOMEM;
	s->host = host;
	s->cap = n;
	return 0;
}

/* Whether row i needs the host sampler: what the GPU sampler lacks, when asked for. */
static int on_host(const struct k_sample_params *p, const struct k_sample_hist *hist,
		   const struct k_sample_logprobs *lp)
{
	return (hist && k_sample_has_penalty(p)) || (p->min_p > 0 && p->temperature > 0) ||
	       (lp && p->logprobs);
}

/* Whether every row of a tensor-parallel step is drawn by vocabulary slices: a plain
 * greedy pick (no penalty over a history, no logprobs), or, where the ranks can
 * (topk_ok: forward_tp_topk_ok), a top-k draw (1 <= top_k <= FWD_TP_TOPK_MAX: every
 * rank's top-k pairs hold the row's candidates, forward_tp.h). */
static int tp_by_slices(const struct k_sample_params *p, int n, const struct k_sample_hist *hist,
			const struct k_sample_logprobs *lp, int topk_ok)
{
	for (int i = 0; i < n; i++) {
		if (on_host(&p[i], hist ? &hist[i] : NULL, lp ? &lp[i] : NULL))
			return 0;
		if (p[i].temperature > 0 &&
		    !(topk_ok && p[i].top_k >= 1 && p[i].top_k <= FWD_TP_TOPK_MAX))
			return 0;
	}
	return n > 0;
}

/* The backend draws every row; rows flagged in s->host have their logits downloaded
 * and are drawn again on the host (n_host of them). */
static int step_on_backend(struct engine *e, struct engine_req *reqs, int n_reqs, int n,
			   const struct k_sample_params *params, const uint64_t *steps,
			   int32_t *ids, float *logits, int n_host, char *err, size_t err_len)
{
	int ret;

	forward_sample_set(e->fwd, params, steps, ids, n, logits != e->sampler->logits);
	if (n_host)
		forward_sample_host_rows(e->fwd, e->sampler->host);
	ret = engine_step(e, reqs, n_reqs, logits, err, err_len);
	if (!ret && e->fwd->sample.done != n) {
		snprintf(err, err_len, "engine: %d of %d tokens sampled", e->fwd->sample.done, n);
		ret = -EIO;
	}
	forward_sample_clear(e->fwd);
	return ret;
}

int engine_step_sample_ext(struct engine *e, struct engine_req *reqs, int n_reqs,
			   const struct k_sample_params *params, const uint64_t *steps,
			   const struct k_sample_hist *hist, int32_t *ids,
			   struct k_sample_logprobs *lp, float *logits, char *err, size_t err_len)
{
	/* an all_logits request (speculative verification) draws one token per row:
	 * n counts rows, not requests */
	int n = engine_step_out_rows(reqs, n_reqs);
	int vocab = e->model->cfg.vocab_size, ret, n_host = 0;
	/* tensor parallel: every rank holds a vocabulary slice. Greedy rows, and top-k
	 * rows (forward_tp_topk_ok), when the caller does not want the logits: each
	 * rank's argmax or top-k of its slice, only (value, id) pairs compared
	 * (forward_tp_run), the logits never gathered; any other draw (penalties, logprobs,
	 * min-p, no top-k) is the host's over the gathered logits. */
	int be_sample = forward_tp_ranks(e->fwd) > 1
				? !logits && tp_by_slices(params, n, hist, lp, forward_tp_topk_ok(e->be->ops))
				: e->be->ops->sample != NULL;
	struct engine_sampler *s;

	if ((ret = sampler_reserve(e, n))) {
		snprintf(err, err_len, "engine: out of memory for %d rows of logits", n);
		return ret;
	}
	s = e->sampler;
	if (!logits)
		logits = s->logits;
	for (int i = 0; i < n; i++) {
		s->host[i] = !be_sample ||
			     on_host(&params[i], hist ? &hist[i] : NULL, lp ? &lp[i] : NULL);
		n_host += s->host[i];
		if (lp)
			memset(&lp[i], 0, sizeof(lp[i]));
	}
	if (be_sample)
		ret = step_on_backend(e, reqs, n_reqs, n, params, steps, ids, logits, n_host, err, err_len);
	else
		ret = engine_step(e, reqs, n_reqs, logits, err, err_len);
	if (ret)
		return ret;
	for (int i = 0; i < n; i++) {
		if (s->host[i])
			ids[i] = k_cpu_sample_hist(logits + (size_t)i * vocab, vocab, &params[i],
						   hist ? &hist[i] : NULL, steps[i], s->work,
						   lp ? &lp[i] : NULL);
		if (lp)
			lp[i].token = ids[i];
	}
	return 0;
}

int engine_step_sample(struct engine *e, struct engine_req *reqs, int n,
		       const struct k_sample_params *params, const uint64_t *steps, int32_t *ids,
		       float *logits, char *err, size_t err_len)
{
	return engine_step_sample_ext(e, reqs, n, params, steps, NULL, ids, NULL, logits, err,
				      err_len);
}
