/* One forward call end to end: the step's inputs moved to backend memory, the layers
 * run op by op or replayed from a graph captured per batch bucket, then the final
 * norm, lm_head, and either logits to the host or tokens sampled on the backend. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/forward.h"
#include "daemon/cli.h"
#include "daemon/log.h"

#define OP(f, name, ...) ((f)->be->ops->name((f)->be, __VA_ARGS__))

/* ---- staging ------------------------------------------------------------ */

static void *stage_alloc(struct forward *f, size_t bytes, int *failed)
{
	void *p = f->be->ops->alloc(f->be, bytes);

	if (!p)
		*failed = 1;
	return p;
}

static int stage_tables_alloc(struct forward *f, int cap)
{
	struct fwd_stage *st = &f->st;
	int32_t *h = malloc((size_t)cap * sizeof(*h));
	int32_t *d = f->be->ops->alloc(f->be, (size_t)cap * sizeof(*d));

	if (!h || !d) {
		free(h);
		if (d)
			f->be->ops->free(f->be, d);
		return -ENOMEM;
	}
	free(st->h_tables);
	if (st->tables)
		f->be->ops->free(f->be, st->tables);
	st->h_tables = h;
	st->tables = d;
	st->table_cap = cap;
	return 0;
}

int forward_stage_create(struct forward *f, char *err, size_t err_len)
{
	struct fwd_stage *st = &f->st;
	size_t R = (size_t)f->max_rows;
	int failed = 0;

	st->tokens = stage_alloc(f, R * sizeof(int32_t), &failed);
	st->pos = stage_alloc(f, R * sizeof(int32_t), &failed);
	st->slots = stage_alloc(f, R * sizeof(int32_t), &failed);
	st->ctx = stage_alloc(f, R * sizeof(int32_t), &failed);
	st->row_tables = stage_alloc(f, R * sizeof(*st->row_tables), &failed);
	st->params = stage_alloc(f, FWD_LOGIT_ROWS * sizeof(*st->params), &failed);
	st->steps = stage_alloc(f, FWD_LOGIT_ROWS * sizeof(*st->steps), &failed);
	st->ids = stage_alloc(f, FWD_LOGIT_ROWS * sizeof(*st->ids), &failed);
	st->h_row_tables = calloc(R, sizeof(*st->h_row_tables));
	st->h_rows = calloc(R > FWD_GRAPH_MAX_ROWS ? R : FWD_GRAPH_MAX_ROWS, sizeof(*st->h_rows));
	if (failed || !st->h_row_tables || !st->h_rows ||
	    stage_tables_alloc(f, f->n_blocks + 2 * (int)R + 1)) {
		snprintf(err, err_len, "%s backend: out of memory for the step's inputs", f->be->ops->name);
		return -ENOMEM;
	}
	return 0;
}

void forward_stage_destroy(struct forward *f)
{
	struct fwd_stage *st = &f->st;
	void *dev[] = { st->tokens, st->pos, st->slots, st->ctx, (void *)st->row_tables,
			st->tables, st->params, st->steps, st->ids };

	for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
		if (dev[i])
			f->be->ops->free(f->be, dev[i]);
	free(st->h_row_tables);
	free(st->h_tables);
	free(st->h_rows);
	memset(st, 0, sizeof(*st));
}

/* Where sequence runs end: rows of one sequence are consecutive and share a table. */
static int run_end(const struct fwd_batch *b, int r)
{
	while (r + 1 < b->n_rows && b->attn.blocks[r + 1] == b->attn.blocks[r])
		r++;
	return r;
}

/* Block tables of the batch's sequences, each once, long enough for the sequence's
 * last row, then a one-entry table for padding rows. Fills h_tables and
 * h_row_tables (backend pointers); returns the entries used or -ENOMEM. */
static int stage_tables(struct forward *f, const struct fwd_batch *b, int n_rows)
{
	struct fwd_stage *st = &f->st;
	int bt = f->block_tokens, used = 0, need = 1;

	for (int r = 0, end; r < b->n_rows; r = end + 1) {
		end = run_end(b, r);
		need += (b->attn.ctx[end] + bt - 1) / bt;
	}
	if (need > st->table_cap && stage_tables_alloc(f, 2 * need))
		return -ENOMEM;
	for (int r = 0, end; r < b->n_rows; r = end + 1) {
		int len;

		end = run_end(b, r);
		len = (b->attn.ctx[end] + bt - 1) / bt;
		memcpy(st->h_tables + used, b->attn.blocks[r], (size_t)len * sizeof(int32_t));
		for (int i = r; i <= end; i++)
			st->h_row_tables[i] = st->tables + used;
		used += len;
	}
	st->h_tables[used] = f->dummy_block;
	for (int i = b->n_rows; i < n_rows; i++)
		st->h_row_tables[i] = st->tables + used;
	return used + 1;
}

/* Copies b's inputs into backend memory as n_rows rows (n_rows > b->n_rows pads
 * with rows that read and write only the dummy block) and fills *db to match. */
static int stage_batch(struct forward *f, const struct fwd_batch *b, int n_rows,
		       struct fwd_batch *db)
{
	struct fwd_stage *st = &f->st;
	struct backend *be = f->be;
	size_t n = (size_t)b->n_rows, pad = (size_t)(n_rows - b->n_rows);
	int used, ret, max_ctx = 1, n_seqs = 0;

	used = stage_tables(f, b, n_rows);
	if (used < 0)
		return used;
	for (int r = 0; r < b->n_rows; r = run_end(b, r) + 1)
		n_seqs++;
	n_seqs += n_rows - b->n_rows;	/* each padding row on its own */
	for (int r = 0; r < b->n_rows; r++)
		if (b->attn.ctx[r] > max_ctx)
			max_ctx = b->attn.ctx[r];

	/* real rows, then padding: token 0 at position 0 in the dummy block */
	if ((ret = be->ops->upload(be, st->tokens, b->tokens, n * sizeof(int32_t))) ||
	    (ret = be->ops->upload(be, st->pos, b->pos, n * sizeof(int32_t))) ||
	    (ret = be->ops->upload(be, st->slots, b->slots, n * sizeof(int32_t))) ||
	    (ret = be->ops->upload(be, st->ctx, b->attn.ctx, n * sizeof(int32_t))))
		return ret;
	if (pad) {
		for (size_t i = 0; i < pad; i++)
			st->h_rows[i] = 0;
		if ((ret = be->ops->upload(be, st->tokens + n, st->h_rows, pad * sizeof(int32_t))) ||
		    (ret = be->ops->upload(be, st->pos + n, st->h_rows, pad * sizeof(int32_t))))
			return ret;
		for (size_t i = 0; i < pad; i++)
			st->h_rows[i] = f->dummy_block * f->block_tokens;
		if ((ret = be->ops->upload(be, st->slots + n, st->h_rows, pad * sizeof(int32_t))))
			return ret;
		for (size_t i = 0; i < pad; i++)
			st->h_rows[i] = 1;
		if ((ret = be->ops->upload(be, st->ctx + n, st->h_rows, pad * sizeof(int32_t))))
			return ret;
	}
	if ((ret = be->ops->upload(be, st->tables, st->h_tables, (size_t)used * sizeof(int32_t))) ||
	    (ret = be->ops->upload(be, (void *)st->row_tables, st->h_row_tables,
				   (size_t)n_rows * sizeof(*st->row_tables))))
		return ret;

	*db = (struct fwd_batch){
		.n_rows = n_rows,
		.tokens = st->tokens,
		.pos = st->pos,
		.slots = st->slots,
		.attn = { .n_rows = n_rows, .max_ctx = max_ctx, .n_seqs = n_seqs, .ctx = st->ctx,
			  .blocks = st->row_tables },
		.n_out = b->n_out,
		.out_rows = b->out_rows,	/* host: forward_logits reads them */
	};
	return 0;
}

/* ---- logits and sampling -------------------------------------------------- */

void forward_sample_set(struct forward *f, const struct k_sample_params *params,
			const uint64_t *steps, int32_t *ids, int n, int want_logits)
{
	f->sample = (struct fwd_sample){ .params = params, .steps = steps, .ids = ids, .n = n,
					 .want_logits = want_logits };
}

void forward_sample_host_rows(struct forward *f, const uint8_t *rows)
{
	f->sample.host_rows = rows;
}

void forward_sample_clear(struct forward *f)
{
	memset(&f->sample, 0, sizeof(f->sample));
}

static int sampling(const struct forward *f)
{
	return f->sample.params && f->be->ops->sample;
}

/* Uploads the sampling parameters of the next n out rows. */
static int sample_stage(struct forward *f, int n)
{
	struct backend *be = f->be;
	const struct fwd_sample *s = &f->sample;
	int ret;

	if (s->done + n > s->n)
		return -EINVAL;
	if ((ret = be->ops->upload(be, f->st.params, s->params + s->done, (size_t)n * sizeof(*s->params))))
		return ret;
	return be->ops->upload(be, f->st.steps, s->steps + s->done, (size_t)n * sizeof(*s->steps));
}

/* Final norm and lm_head of out rows [o, o + n) into f->logits, then the draw. */
static void logits_ops(struct forward *f, const struct fwd_batch *b, int o, int n, int all_rows)
{
	const struct model_config *c = &f->m->cfg;
	int hidden = c->hidden_size;

	if (all_rows) {
		OP(f, rmsnorm, f->h, hidden, f->x + (size_t)o * hidden, hidden, &f->m->final_norm, n,
		   hidden, c->rms_norm_eps);
	} else {
		for (int i = 0; i < n; i++)
			OP(f, rmsnorm, f->h + (size_t)i * hidden, hidden,
			   f->x + (size_t)b->out_rows[o + i] * hidden, hidden, &f->m->final_norm, 1,
			   hidden, c->rms_norm_eps);
	}
	OP(f, linear, f->logits, f->h, &f->m->lm_head, n);
	if (sampling(f))
		OP(f, sample, f->st.ids, f->logits, n, c->vocab_size, f->st.params, f->st.steps);
}

/* What logits_ops left: logits to the host (when wanted), ids to the caller. */
static int logits_collect(struct forward *f, int n, float *logits)
{
	struct backend *be = f->be;
	size_t row_bytes = (size_t)f->m->cfg.vocab_size * sizeof(float);
	int ret;

	if (!sampling(f) || f->sample.want_logits) {
		if ((ret = be->ops->download(be, logits, f->logits, (size_t)n * row_bytes)))
			return ret;
	} else if (f->sample.host_rows) {
		for (int i = 0; i < n; i++) {
			size_t off = (size_t)i * f->m->cfg.vocab_size;

			if (f->sample.host_rows[f->sample.done + i] &&
			    (ret = be->ops->download(be, logits + off, f->logits + off, row_bytes)))
				return ret;
		}
	}
	if (sampling(f)) {
		if ((ret = be->ops->download(be, f->sample.ids + f->sample.done, f->st.ids,
					     (size_t)n * sizeof(int32_t))))
			return ret;
		f->sample.done += n;
	}
	return 0;
}

static int out_rows_are_all(const struct fwd_batch *b)
{
	if (b->n_out != b->n_rows)
		return 0;
	for (int i = 0; i < b->n_out; i++)
		if (b->out_rows[i] != i)
			return 0;
	return 1;
}

static int run_eager(struct forward *f, const struct fwd_batch *b, float *logits)
{
	size_t vocab = (size_t)f->m->cfg.vocab_size;
	int all = out_rows_are_all(b), ret;

	if ((ret = forward_layers(f, b)))
		return ret;
	for (int o = 0; o < b->n_out; o += FWD_LOGIT_ROWS) {
		int n = b->n_out - o < FWD_LOGIT_ROWS ? b->n_out - o : FWD_LOGIT_ROWS;

		if (sampling(f) && (ret = sample_stage(f, n)))
			return ret;
		logits_ops(f, b, o, n, all);
		if ((ret = logits_collect(f, n, logits + (size_t)o * vocab)))
			return ret;
	}
	return f->be->ops->sync(f->be);
}

/* ---- decode graphs -------------------------------------------------------- */

/* A decode step: every row its own sequence and an out row, few enough rows. */
static int graph_eligible(const struct forward *f, const struct fwd_batch *b)
{
	if (!f->use_graphs || b->n_rows > FWD_GRAPH_MAX_ROWS || !out_rows_are_all(b))
		return 0;
	for (int r = 1; r < b->n_rows; r++)
		if (b->attn.blocks[r] == b->attn.blocks[r - 1])
			return 0;
	return 1;
}

static int bucket_of(int rows, int *size)
{
	int i = 0;

	for (*size = 1; *size < rows; *size *= 2)
		i++;
	return i;
}

/* Records one decode step of `size` rows reading the staged inputs. The attention
 * launches are sized for the whole cache, so any context fits a replay. */
static int graph_capture(struct forward *f, const struct fwd_batch *db, int size, void **graph,
			 int *n_nodes)
{
	struct backend *be = f->be;
	struct fwd_batch cb = *db;
	int ret, ret2;

	cb.attn.max_ctx = f->n_blocks * f->block_tokens;
	cb.n_out = size;
	/* one eager pass first, so that every linear shape of the step is seen outside a
	 * capture once (the CUDA backend times its cuBLASLt candidates then); the replay
	 * writes the same K/V again */
	if ((ret = forward_layers(f, &cb)))
		return ret;
	OP(f, linear, f->logits, f->h, &f->m->lm_head, size);
	if ((ret = be->ops->sync(be)))
		return ret;
	if ((ret = be->ops->capture_begin(be)))
		return ret;
	ret = forward_layers(f, &cb);
	if (!ret)
		logits_ops(f, &cb, 0, size, 1);
	ret2 = be->ops->capture_end(be, graph, n_nodes);
	return ret ? ret : ret2;
}

static int run_graph(struct forward *f, const struct fwd_batch *b, float *logits)
{
	int size, bucket = bucket_of(b->n_rows, &size), s = sampling(f), ret;
	struct fwd_batch db;
	void **graph = &f->graphs[bucket][s];

	if ((ret = stage_batch(f, b, size, &db)))
		return ret;
	if (s && (ret = sample_stage(f, b->n_rows)))
		return ret;
	if (!*graph) {
		double t0 = cli_now();

		if ((ret = graph_capture(f, &db, size, graph, &f->graph_nodes[bucket][s]))) {
			log_warn("forward: capturing the %d-row decode graph failed (%s); running op by op",
				 size, strerror(-ret));
			f->use_graphs = 0;
			return -EAGAIN;
		}
		log_info("forward: captured the %d-row decode graph%s in %.1f ms: %d nodes", size,
			 s ? " with sampling" : "", (cli_now() - t0) * 1e3, f->graph_nodes[bucket][s]);
	}
	if ((ret = f->be->ops->graph_launch(f->be, *graph)))
		return ret;
	f->graph_replays++;
	if ((ret = logits_collect(f, b->n_rows, logits)))
		return ret;
	return f->be->ops->sync(f->be);
}

int forward_run(struct forward *f, const struct fwd_batch *b, float *logits)
{
	struct fwd_batch db;
	int ret;

	if (b->n_rows <= 0 || b->n_rows > f->max_rows || b->n_out < 0 || b->n_out > b->n_rows)
		return -EINVAL;
	if (f->be->ops->host_memory)
		return run_eager(f, b, logits);
	if (graph_eligible(f, b)) {
		ret = run_graph(f, b, logits);
		if (ret != -EAGAIN)
			return ret;
	}
	if ((ret = stage_batch(f, b, b->n_rows, &db)))
		return ret;
	return run_eager(f, &db, logits);
}
