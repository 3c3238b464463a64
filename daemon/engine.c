/* Steps of many sequences over one paged KV cache: block reservation, row staging,
 * forward calls of bounded size. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine.h"

int engine_create(struct engine **out, struct model *m, const struct engine_opts *opts,
		  char *err, size_t err_len)
{
	static const struct engine_opts defaults;
	const struct backend_ops *ops;
	struct backend_opts bo;
	struct engine *e;
	int block_tokens, kv_tokens, max_rows, ret;

	if (!opts)
		opts = &defaults;
	*out = NULL;
	block_tokens = opts->block_tokens > 0 ? opts->block_tokens : ENGINE_DEFAULT_BLOCK_TOKENS;
	kv_tokens = opts->kv_tokens > 0 ? opts->kv_tokens : ENGINE_DEFAULT_KV_TOKENS;
	max_rows = opts->max_rows > 0 ? opts->max_rows : ENGINE_DEFAULT_MAX_ROWS;
	if (block_tokens > 4096 || max_rows > 65536) {
		snprintf(err, err_len, "block size %d (max 4096) or rows per step %d (max 65536) too large",
			 block_tokens, max_rows);
		return -EINVAL;
	}
	ops = backend_find(opts->backend ? opts->backend : "cpu", err, err_len);
	if (!ops)
		return -ENOENT;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->model = m;
	bo = (struct backend_opts){ .threads = opts->threads };
	if ((ret = ops->create(&e->be, m, &bo, err, err_len)))
		goto err_destroy;
	ret = kv_pool_init(&e->pool, (kv_tokens + block_tokens - 1) / block_tokens, block_tokens);
	if (ret)
		goto err_destroy;
	ret = forward_create(&e->fwd, m, e->be, e->pool.n_blocks, block_tokens, max_rows, err, err_len);
	if (ret)
		goto err_destroy;
	e->tokens = calloc((size_t)max_rows, sizeof(int32_t));
	e->pos = calloc((size_t)max_rows, sizeof(int32_t));
	e->slots = calloc((size_t)max_rows, sizeof(int32_t));
	e->ctx = calloc((size_t)max_rows, sizeof(int32_t));
	e->out_rows = calloc((size_t)max_rows, sizeof(int32_t));
	e->row_blocks = calloc((size_t)max_rows, sizeof(*e->row_blocks));
	if (!e->tokens || !e->pos || !e->slots || !e->ctx || !e->out_rows || !e->row_blocks) {
		ret = -ENOMEM;
		goto err_destroy;
	}
	*out = e;
	return 0;

err_destroy:
	if (ret == -ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "engine: out of memory");
	engine_destroy(e);
	return ret;
}

void engine_destroy(struct engine *e)
{
	if (!e)
		return;
	engine_sampler_destroy(e->sampler);
	forward_destroy(e->fwd);
	if (e->be)
		e->be->ops->destroy(e->be);
	kv_pool_fini(&e->pool);
	free(e->tokens);
	free(e->pos);
	free(e->slots);
	free(e->ctx);
	free(e->out_rows);
	free(e->row_blocks);
	free(e);
}

void engine_seq_init(struct engine_seq *s)
{
	memset(s, 0, sizeof(*s));
}

void engine_seq_release(struct engine *e, struct engine_seq *s)
{
	for (int i = 0; i < s->n_blocks; i++)
		kv_pool_unref(&e->pool, s->blocks[i]);
	free(s->blocks);
	engine_seq_init(s);
}

int engine_step_out_rows(const struct engine_req *reqs, int n)
{
	int rows = 0;

	for (int i = 0; i < n; i++)
		rows += reqs[i].all_logits ? reqs[i].n_tokens : 1;
	return rows;
}

static int check_reqs(const struct engine *e, const struct engine_req *reqs, int n,
		      char *err, size_t err_len)
{
	int vocab = e->model->cfg.vocab_size;

	for (int i = 0; i < n; i++) {
		const struct engine_req *r = &reqs[i];

		if (r->n_tokens <= 0 || r->n_tokens > (1 << 24)) {
			snprintf(err, err_len, "request %d: %d tokens (1..%d allowed)", i, r->n_tokens, 1 << 24);
			return -EINVAL;
		}
		if ((int64_t)r->seq->n_tokens + r->n_tokens > (int64_t)e->pool.n_blocks * e->pool.block_tokens) {
			snprintf(err, err_len, "request %d: %d + %d tokens exceed the KV cache (%d tokens)",
				 i, r->seq->n_tokens, r->n_tokens, e->pool.n_blocks * e->pool.block_tokens);
			return -ENOSPC;
		}
		for (int t = 0; t < r->n_tokens; t++) {
			if (r->tokens[t] < 0 || r->tokens[t] >= vocab) {
				snprintf(err, err_len, "request %d: token %d at index %d is outside the vocabulary (0..%d)",
					 i, r->tokens[t], t, vocab - 1);
				return -EINVAL;
			}
		}
		for (int j = 0; j < i; j++) {
			if (reqs[j].seq == r->seq) {
				snprintf(err, err_len, "requests %d and %d name the same sequence", j, i);
				return -EINVAL;
			}
		}
	}
	return 0;
}

/* Gives every request's sequence the blocks its new tokens need, all or nothing.
 * grown[i] receives how many blocks request i added (for the rollback). */
static int reserve_blocks(struct engine *e, struct engine_req *reqs, int n, int *grown,
			  char *err, size_t err_len)
{
	int need = 0;

	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;

		grown[i] = kv_pool_blocks_for(&e->pool, (int64_t)s->n_tokens + reqs[i].n_tokens) - s->n_blocks;
		need += grown[i];
	}
	if (need > e->pool.n_free) {
		snprintf(err, err_len, "KV cache full: the step needs %d more blocks of %d tokens, %d are free",
			 need, e->pool.block_tokens, e->pool.n_free);
		return -ENOSPC;
	}
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;
		int want = s->n_blocks + grown[i];

		if (want > s->cap) {
			int cap = want > 2 * s->cap ? want : 2 * s->cap;
			int32_t *b = realloc(s->blocks, (size_t)cap * sizeof(*b));

			if (!b)
				goto err_rollback;
			s->blocks = b;
			s->cap = cap;
		}
		while (s->n_blocks < want)
			s->blocks[s->n_blocks++] = kv_pool_alloc(&e->pool);
	}
	return 0;

err_rollback:
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;
		int keep = kv_pool_blocks_for(&e->pool, s->n_tokens);

		while (s->n_blocks > keep)
			kv_pool_unref(&e->pool, s->blocks[--s->n_blocks]);
	}
	snprintf(err, err_len, "engine: out of memory growing a block table");
	return -ENOMEM;
}

static void release_grown(struct engine *e, struct engine_req *reqs, int n, const int *grown)
{
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;

		for (int k = 0; k < grown[i]; k++)
			kv_pool_unref(&e->pool, s->blocks[--s->n_blocks]);
	}
}

/* Runs the rows staged so far. */
static int flush_rows(struct engine *e, int n_rows, int n_out, float *logits)
{
	struct fwd_batch b = {
		.n_rows = n_rows,
		.tokens = e->tokens,
		.pos = e->pos,
		.slots = e->slots,
		.attn = { .n_rows = n_rows, .ctx = e->ctx, .blocks = e->row_blocks },
		.n_out = n_out,
		.out_rows = e->out_rows,
	};

	return forward_run(e->fwd, &b, logits);
}

int engine_step(struct engine *e, struct engine_req *reqs, int n, float *logits,
		char *err, size_t err_len)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	int grown_small[64], *grown = grown_small;
	int rows = 0, outs = 0, ret;
	int bt = e->pool.block_tokens;

	if (n <= 0)
		return 0;
	if ((ret = check_reqs(e, reqs, n, err, err_len)))
		return ret;
	if (n > 64 && !(grown = malloc((size_t)n * sizeof(*grown))))
		return -ENOMEM;
	if ((ret = reserve_blocks(e, reqs, n, grown, err, err_len)))
		goto out;
	for (int i = 0; i < n; i++) {
		const struct engine_req *r = &reqs[i];
		const struct engine_seq *s = r->seq;

		for (int t = 0; t < r->n_tokens; t++) {
			int p = s->n_tokens + t;

			e->tokens[rows] = r->tokens[t];
			e->pos[rows] = p;
			e->slots[rows] = s->blocks[p / bt] * bt + p % bt;
			e->ctx[rows] = p + 1;
			e->row_blocks[rows] = s->blocks;
			if (r->all_logits || t == r->n_tokens - 1)
				e->out_rows[outs++] = rows;
			if (++rows == e->fwd->max_rows) {
				if ((ret = flush_rows(e, rows, outs, logits)))
					goto err_forward;
				logits += (size_t)outs * vocab;
				rows = outs = 0;
			}
		}
	}
	if (rows && (ret = flush_rows(e, rows, outs, logits)))
		goto err_forward;
	for (int i = 0; i < n; i++)
		reqs[i].seq->n_tokens += reqs[i].n_tokens;
	ret = 0;
	goto out;

err_forward:
	release_grown(e, reqs, n, grown);
	snprintf(err, err_len, "forward pass failed: %s", strerror(-ret));
out:
	if (grown != grown_small)
		free(grown);
	return ret;
}
