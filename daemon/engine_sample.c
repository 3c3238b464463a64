/* A step that ends in token ids: drawn on the backend where it can sample (only ids
 * come back), else on the host by the CPU sampler; both follow kernels/k_sample.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon/engine.h"
#include "kernels/cpu/k_cpu_sample.h"

struct engine_sampler {
	int cap;		/* requests the buffers hold */
	float *logits;		/* (cap, vocab) */
	float *work;		/* K_CPU_SAMPLE_WORK(vocab) */
};

void engine_sampler_destroy(struct engine_sampler *s)
{
	if (!s)
		return;
	free(s->logits);
	free(s->work);
	free(s);
}

static int sampler_reserve(struct engine *e, int n)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	struct engine_sampler *s = e->sampler;
	float *logits;

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
	s->cap = n;
	return 0;
}

int engine_step_sample(struct engine *e, struct engine_req *reqs, int n,
		       const struct k_sample_params *params, const uint64_t *steps, int32_t *ids,
		       float *logits, char *err, size_t err_len)
{
	int vocab = e->model->cfg.vocab_size, ret;

	for (int i = 0; i < n; i++) {
		if (reqs[i].all_logits) {
			snprintf(err, err_len, "engine: request %d of a sampled step asks for all logits", i);
			return -EINVAL;
		}
	}
	if (!logits) {
		if ((ret = sampler_reserve(e, n))) {
			snprintf(err, err_len, "engine: out of memory for %d rows of logits", n);
			return ret;
		}
		logits = e->sampler->logits;
	} else if ((ret = sampler_reserve(e, 0))) {
		snprintf(err, err_len, "engine: out of memory for the sampler");
		return ret;
	}
	if (e->be->ops->sample) {
		forward_sample_set(e->fwd, params, steps, ids, n, logits != e->sampler->logits);
		ret = engine_step(e, reqs, n, logits, err, err_len);
		if (!ret && e->fwd->sample.done != n) {
			snprintf(err, err_len, "engine: %d of %d tokens sampled", e->fwd->sample.done, n);
			ret = -EIO;
		}
		forward_sample_clear(e->fwd);
		return ret;
	}
	if ((ret = engine_step(e, reqs, n, logits, err, err_len)))
		return ret;
	for (int i = 0; i < n; i++)
		ids[i] = k_cpu_sample(logits + (size_t)i * vocab, vocab, &params[i], steps[i],
				      e->sampler->work);
	return 0;
}
