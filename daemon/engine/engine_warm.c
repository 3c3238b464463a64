/* The engine's warm-up before it serves: every decode graph bucket captured (and with
 * it every cuBLASLt tuning at the bucket sizes), and one prompt chunk of the largest
 * step run once, so that no request pays a capture, a tuning run or a kernel's first
 * load. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine_internal.h"

/* One step of n throw-away sequences of `tokens` tokens each, released after. */
static int warm_step(struct engine *e, int n, int tokens, char *err, size_t err_len)
{
	struct engine_seq *seqs = calloc((size_t)n, sizeof(*seqs));
	struct engine_req *reqs = calloc((size_t)n, sizeof(*reqs));
	struct k_sample_params *sp = calloc((size_t)n, sizeof(*sp));
	uint64_t *steps = calloc((size_t)n, sizeof(*steps));
	int32_t *prompt = calloc((size_t)tokens * (size_t)n, sizeof(int32_t));
	int32_t *ids = calloc((size_t)n, sizeof(*ids));
	int ret = -ENOMEM;

	if (seqs && reqs && sp && steps && prompt && ids) {
		for (int i = 0; i < n; i++) {
			/* distinct tokens: no sequence maps another's prefix */
			for (int t = 0; t < tokens; t++)
				prompt[(size_t)i * tokens + t] =
					(int32_t)(((size_t)i * tokens + t) % (size_t)e->model->cfg.vocab_size);
			engine_seq_init(&seqs[i]);
			reqs[i] = (struct engine_req){ .seq = &seqs[i], .tokens = prompt + (size_t)i * tokens,
						       .n_tokens = tokens };
		}
		ret = engine_step_sample(e, reqs, n, sp, steps, ids, NULL, err, err_len);
		for (int i = 0; i < n; i++)
			engine_seq_release(e, &seqs[i]);
	}
	free(seqs);
	free(reqs);
	free(sp);
	free(steps);
	free(prompt);
	free(ids);
	return ret;
}

int engine_warm(struct engine *e, char *err, size_t err_len)
{
	struct engine_stats was = e->stats;
	int most = e->fwd->max_rows < FWD_GRAPH_MAX_ROWS ? e->fwd->max_rows : FWD_GRAPH_MAX_ROWS;
	int chunk = e->fwd->max_rows, buckets = 0, ret = 0;
	double t0 = clock_now();

	if (!e->fwd->use_graphs)
		return 0;	/* a backend without graphs (the CPU) has nothing to prepare */
	/* a decode step of `size` one-token sequences is a decode bucket's shape */
	for (int size = 1; size <= most && !ret; size *= 2, buckets++)
		if (kv_pool_available(&e->pool) < size)
			break;
		else
			ret = warm_step(e, size, 1, err, err_len);
	if (!ret && kv_pool_blocks_for(&e->pool, chunk) <= kv_pool_available(&e->pool))
		ret = warm_step(e, 1, chunk, err, err_len);
	/* the warm-up's tokens are not the clients': the counters start at zero */
	e->stats = was;
	if (ret)
		return ret;
	log_info("warm: %d decode graphs and a %d-token prompt chunk in %.0f ms", buckets, chunk,
		 (clock_now() - t0) * 1e3);
	return 0;
}
