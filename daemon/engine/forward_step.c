/* One forward call end to end: the step's inputs moved to backend memory, the layers
 * run op by op or replayed from a graph captured per batch bucket, then the final
 * norm, lm_head, and either logits to the host or tokens sampled on the backend. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/forward.h"
#include "daemon/engine/forward_tp.h"

#define OP(f, name, ...) ((f)->be->ops->name((f)->be, __VA_ARGS__))

/* ---- staging ------------------------------------------------------------ */

static size_t align_up(size_t n, size_t a)
{
	return (n + a - 1) / a * a;
}

/* Byte offsets of the stage block's arrays for a step of S rows. */
struct stage_offsets {
	size_t tokens, pos, slots, ctx, row_tables, params, steps, tables;
};

static struct stage_offsets stage_offsets_of(size_t S)
{
	struct stage_offsets o;

	o.tokens = 0;
	o.pos = o.tokens + S * sizeof(int32_t);
	o.slots = o.pos + S * sizeof(int32_t);
	o.ctx = o.slots + S * sizeof(int32_t);
	o.row_tables = align_up(o.ctx + S * sizeof(int32_t), 16);
	o.params = align_up(o.row_tables + S * sizeof(int32_t *), 16);
	o.steps = align_up(o.params + S * sizeof(struct k_sample_params), 16);
	o.tables = align_up(o.steps + S * sizeof(uint64_t), 16);
	return o;
}

/* Points the stage's arrays into the block as laid out for S rows. */
static void stage_layout(struct fwd_stage *st, int S)
{
	struct stage_offsets o = stage_offsets_of((size_t)S);

	st->layout_rows = S;
	st->tokens = (int32_t *)(st->block + o.tokens);
	st->pos = (int32_t *)(st->block + o.pos);
	st->slots = (int32_t *)(st->block + o.slots);
	st->ctx = (int32_t *)(st->block + o.ctx);
	st->row_tables = (const int32_t **)(st->block + o.row_tables);
	st->params = (struct k_sample_params *)(st->block + o.params);
	st->steps = (uint64_t *)(st->block + o.steps);
	st->tables = (int32_t *)(st->block + o.tables);
}

/* The host mirror of a place in the block. */
static void *stage_host(const struct fwd_stage *st, const void *dev)
{
	return st->h_block + ((const char *)dev - st->block);
}

static void *host_alloc(struct forward *f, size_t bytes)
{
	return f->be->ops->host_alloc ? f->be->ops->host_alloc(f->be, bytes) : calloc(1, bytes);
}

static void host_free(struct forward *f, void *p)
{
	if (f->be->ops->host_free)
		f->be->ops->host_free(f->be, p);
	else
		free(p);
}

/* A block for max_rows rows and table_cap table entries; replaces the old block. The
 * old graphs read the old block, so they go too and are captured again. */
static int stage_block_alloc(struct forward *f, int table_cap)
{
	struct fwd_stage *st = &f->st;
	size_t bytes = stage_offsets_of((size_t)f->max_rows).tables + (size_t)table_cap * sizeof(int32_t);
	char *d = f->be->ops->alloc(f->be, bytes), *h = host_alloc(f, bytes);

	if (!h || !d) {
		if (h)
			host_free(f, h);
		if (d)
			f->be->ops->free(f->be, d);
		return -ENOMEM;
	}
	if (st->block)
		f->be->ops->free(f->be, st->block);
	if (st->h_block)
		host_free(f, st->h_block);
	for (int i = 0; i < FWD_N_BUCKETS; i++)
		for (int j = 0; j < 2; j++) {
			if (f->graphs[i][j])
				f->be->ops->graph_destroy(f->be, f->graphs[i][j]);
			f->graphs[i][j] = NULL;
		}
	st->block = d;
	st->h_block = h;
	st->block_bytes = bytes;
	st->table_cap = table_cap;
	stage_layout(st, f->max_rows);
	return 0;
}

int forward_stage_create(struct forward *f, char *err, size_t err_len)
{
	struct fwd_stage *st = &f->st;

	st->ids = f->be->ops->alloc(f->be, FWD_LOGIT_ROWS * sizeof(*st->ids));
	st->h_ids = host_alloc(f, FWD_LOGIT_ROWS * sizeof(*st->h_ids));
	if (!st->ids || !st->h_ids || stage_block_alloc(f, f->n_blocks + 2 * f->max_rows + 1)) {
		snprintf(err, err_len, "%s backend: out of memory for the step's inputs", f->be->ops->name);
		return -ENOMEM;
	}
	return 0;
}

void forward_stage_destroy(struct forward *f)
{
	struct fwd_stage *st = &f->st;

	if (st->block)
		f->be->ops->free(f->be, st->block);
	if (st->ids)
		f->be->ops->free(f->be, st->ids);
	if (st->h_block)
		host_free(f, st->h_block);
	if (st->h_ids)
		host_free(f, st->h_ids);
	memset(st, 0, sizeof(*st));
}

/* Where sequence runs end: rows of one sequence are consecutive and share a table. */
static int run_end(const struct fwd_batch *b, int r)
{
	while (r + 1 < b->n_rows && b->attn.blocks[r + 1] == b->attn.blocks[r])
		r++;
	return r;
}

/* Table entries the batch's step needs: each sequence's table once, long enough for
 * its last row, then a one-entry table for padding rows. */
static int stage_tables_need(const struct forward *f, const struct fwd_batch *b)
{
	int need = 1;

	for (int r = 0, end; r < b->n_rows; r = end + 1) {
		end = run_end(b, r);
		need += (b->attn.ctx[end] + f->block_tokens - 1) / f->block_tokens;
	}
	return need;
}

/* Fills the host mirror's tables and row_tables (backend pointers into tables) for
 * n_rows rows; returns the table entries used. */
static int stage_tables(struct forward *f, const struct fwd_batch *b, int n_rows)
{
	struct fwd_stage *st = &f->st;
	int32_t *h_tables = stage_host(st, st->tables);
	const int32_t **h_row_tables = stage_host(st, st->row_tables);
	int bt = f->block_tokens, used = 0;

	for (int r = 0, end; r < b->n_rows; r = end + 1) {
		int len;

		end = run_end(b, r);
		len = (b->attn.ctx[end] + bt - 1) / bt;
		memcpy(h_tables + used, b->attn.blocks[r], (size_t)len * sizeof(int32_t));
		for (int i = r; i <= end; i++)
			h_row_tables[i] = st->tables + used;
		used += len;
	}
	h_tables[used] = f->dummy_block;
	for (int i = b->n_rows; i < n_rows; i++)
		h_row_tables[i] = st->tables + used;
	return used + 1;
}

/* Copies the host mirror's [dev, dev + bytes) to the block. */
static int stage_upload(struct forward *f, const void *dev, size_t bytes)
{
	return f->be->ops->upload(f->be, (void *)dev, stage_host(&f->st, dev), bytes);
}

/* Writes b's inputs into the host mirror as n_rows rows (n_rows > b->n_rows pads
 * with rows that read and write only the dummy block), laid out for n_rows, and fills
 * *db to match. Returns the bytes of the block to upload (through the tables used),
 * or -errno. The sampling parameters go in between (sample_fill) before the upload. */
static long stage_batch(struct forward *f, const struct fwd_batch *b, int n_rows, struct fwd_batch *db)
{
	struct fwd_stage *st = &f->st;
	size_t n = (size_t)b->n_rows;
	int32_t *tok, *pos, *slots, *ctx;
	int need, used, max_ctx = 1, n_seqs = 0;

	need = stage_tables_need(f, b);
	if (need > st->table_cap && stage_block_alloc(f, 2 * need))
		return -ENOMEM;
	stage_layout(st, n_rows);
	used = stage_tables(f, b, n_rows);
	for (int r = 0; r < b->n_rows; r = run_end(b, r) + 1)
		n_seqs++;
	n_seqs += n_rows - b->n_rows;	/* each padding row on its own */
	for (int r = 0; r < b->n_rows; r++)
		if (b->attn.ctx[r] > max_ctx)
			max_ctx = b->attn.ctx[r];

	/* real rows, then padding: token 0 at position 0 in the dummy block */
	tok = stage_host(st, st->tokens);
	pos = stage_host(st, st->pos);
	slots = stage_host(st, st->slots);
	ctx = stage_host(st, st->ctx);
	memcpy(tok, b->tokens, n * sizeof(int32_t));
	memcpy(pos, b->pos, n * sizeof(int32_t));
	memcpy(slots, b->slots, n * sizeof(int32_t));
	memcpy(ctx, b->attn.ctx, n * sizeof(int32_t));
	for (size_t i = n; i < (size_t)n_rows; i++) {
		tok[i] = 0;
		pos[i] = 0;
		slots[i] = f->dummy_block * f->block_tokens;
		ctx[i] = 1;
	}

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
	return (long)((const char *)(st->tables + used) - st->block);
}

long forward_stage_rows(struct forward *f, const struct fwd_batch *b, int n_rows, struct fwd_batch *db)
{
	return stage_batch(f, b, n_rows, db);
}

int forward_stage_step(struct forward *f, const struct fwd_batch *b, struct fwd_batch *db)
{
	long bytes = stage_batch(f, b, b->n_rows, db);

	if (bytes < 0)
		return (int)bytes;
	return stage_upload(f, f->st.block, (size_t)bytes);
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

/* Writes the sampling parameters of the next n out rows into the host mirror. */
static int sample_fill(struct forward *f, int n)
{
	const struct fwd_sample *s = &f->sample;
	struct fwd_stage *st = &f->st;

	if (s->done + n > s->n || n > st->layout_rows)
		return -EINVAL;
	memcpy(stage_host(st, st->params), s->params + s->done, (size_t)n * sizeof(*s->params));
	memcpy(stage_host(st, st->steps), s->steps + s->done, (size_t)n * sizeof(*s->steps));
	return 0;
}

/* Fills and uploads them, for a step run op by op. */
static int sample_stage(struct forward *f, int n)
{
	int ret;

	if ((ret = sample_fill(f, n)) ||
	    (ret = stage_upload(f, f->st.params, (size_t)n * sizeof(*f->st.params))))
		return ret;
	return stage_upload(f, f->st.steps, (size_t)n * sizeof(*f->st.steps));
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
		if ((ret = be->ops->download(be, f->st.h_ids, f->st.ids, (size_t)n * sizeof(int32_t))))
			return ret;
		memcpy(f->sample.ids + f->sample.done, f->st.h_ids, (size_t)n * sizeof(int32_t));
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

static int bucket_of(int rows, int *size)
{
	int i = 0;

	for (*size = 1; *size < rows; *size *= 2)
		i++;
	return i;
}

/* A decode step: every row its own sequence and an out row, few enough rows, and a
 * bucket no larger than the scratch (max_rows). */
static int graph_eligible(const struct forward *f, const struct fwd_batch *b)
{
	int size;

	bucket_of(b->n_rows, &size);
	if (!f->use_graphs || b->n_rows > FWD_GRAPH_MAX_ROWS || size > f->max_rows ||
	    !out_rows_are_all(b))
		return 0;
	for (int r = 1; r < b->n_rows; r++)
		if (b->attn.blocks[r] == b->attn.blocks[r - 1])
			return 0;
	return 1;
}

int forward_graph_bucket(const struct forward *f, const struct fwd_batch *b, int *size)
{
	int bucket = bucket_of(b->n_rows, size);

	return graph_eligible(f, b) ? bucket : -1;
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

/* The median of n replays of graph (launch + sync each), ms; 0 on a failure. */
double forward_graph_replay_ms(struct forward *f, void *graph, int n)
{
	double t[16];

	n = n < 16 ? n : 16;
	for (int i = 0; i < n; i++) {
		double t0 = clock_now();

		if (f->be->ops->graph_launch(f->be, graph) || f->be->ops->sync(f->be))
			return 0;
		t[i] = clock_now() - t0;
	}
	for (int i = 1; i < n; i++)	/* insertion sort: n is small */
		for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
			double v = t[j];

			t[j] = t[j - 1];
			t[j - 1] = v;
		}
	return t[n / 2] * 1e3;
}

static double fwd_median3(const double t[3])
{
	double lo = t[0] < t[1] ? t[0] : t[1], hi = t[0] < t[1] ? t[1] : t[0];

	return t[2] < lo ? lo : t[2] > hi ? hi : t[2];
}

/* auto keeps the standard graph unless the latency one is faster by more than 1%:
 * where the two are within noise of each other a bare comparison picked either, so two
 * processes of one build could run different kernels (session 24: DeepSeek-V2-Lite at
 * one row, Qwen3-30B-A3B at eight) */
static int fwd_path_latency_wins(double ms_std, double ms_lat)
{
	return ms_std > 0 && ms_lat > 0 && ms_lat < 0.99 * ms_std;
}

/* Two graphs timed against each other: after a warm-up of each, FWD_PAIR_ROUNDS
 * rounds that replay a then b FWD_PAIR_REPLAYS times each; each graph's figure is the
 * median of its rounds' medians (ms, both 0 on a failure). Interleaved so that a drift
 * of the clocks or of other load over the timing lands on both graphs, not on the one
 * timed second. */
enum { FWD_PAIR_ROUNDS = 3, FWD_PAIR_REPLAYS = 5 };
_Static_assert(FWD_PAIR_ROUNDS == 3, "fwd_median3 takes the rounds");

static void forward_graph_pair_ms(struct forward *f, void *a, void *b, double *ms_a, double *ms_b)
{
	double ta[FWD_PAIR_ROUNDS], tb[FWD_PAIR_ROUNDS];

	*ms_a = *ms_b = 0;
	if (forward_graph_replay_ms(f, a, 3) <= 0 || forward_graph_replay_ms(f, b, 3) <= 0)
		return;
	for (int r = 0; r < FWD_PAIR_ROUNDS; r++) {
		ta[r] = forward_graph_replay_ms(f, a, FWD_PAIR_REPLAYS);
		tb[r] = forward_graph_replay_ms(f, b, FWD_PAIR_REPLAYS);
		if (ta[r] <= 0 || tb[r] <= 0)
			return;
	}
	*ms_a = fwd_median3(ta);
	*ms_b = fwd_median3(tb);
}

/* The bucket's graph on the decode path: standard where the latency path has nothing
 * for it or was not asked for; latency where forced; under auto, the first capture of
 * the bucket records both and times each (replays of the staged step: they write the
 * same K/V again, forward_graph_pair_ms), keeps the latency one where it is more than 1%
 * faster and remembers the choice for the bucket. */
static int graph_capture_path(struct forward *f, const struct fwd_batch *db, int size, int bucket,
			      int s)
{
	void *other = NULL;
	int ret, n_other = 0, lat = f->bucket_lat[bucket];

	if (lat < 0) {
		lat = f->path != FWD_PATH_STANDARD && forward_latency_supported(f, size, NULL, 0);
		if (lat && f->path == FWD_PATH_AUTO) {
			double ms_std, ms_lat;

			if ((ret = graph_capture(f, db, size, &other, &n_other)))
				return ret;
			f->lat = 1;
			ret = graph_capture(f, db, size, &f->graphs[bucket][s], &f->graph_nodes[bucket][s]);
			f->lat = 0;
			if (ret) {
				f->be->ops->graph_destroy(f->be, other);
				return ret;
			}
			forward_graph_pair_ms(f, other, f->graphs[bucket][s], &ms_std, &ms_lat);
			f->bucket_ms[bucket][0] = ms_std;
			f->bucket_ms[bucket][1] = ms_lat;
			lat = fwd_path_latency_wins(ms_std, ms_lat);
			log_info("forward: decode path for %d rows: latency %.3f ms, standard %.3f ms a step: %s",
				 size, ms_lat, ms_std, lat ? "latency" : "standard");
			if (!lat) {	/* keep the standard graph */
				void *g = f->graphs[bucket][s];

				f->graphs[bucket][s] = other;
				f->graph_nodes[bucket][s] = n_other;
				other = g;
			}
			f->be->ops->graph_destroy(f->be, other);
			f->bucket_lat[bucket] = (signed char)lat;
			return 0;
		}
		f->bucket_lat[bucket] = (signed char)lat;
	}
	f->lat = lat;
	ret = graph_capture(f, db, size, &f->graphs[bucket][s], &f->graph_nodes[bucket][s]);
	f->lat = 0;
	return ret;
}

/* The kdbench split of a replayed step (forward.h): marks and host clock reads. */
struct step_clock {
	int on;
	double t0, t1, t2;
};

static void step_clock_start(struct forward *f, struct step_clock *c)
{
	c->on = f->time_steps && f->be->ops->timer_mark && f->be->ops->timer_ms;
	f->step_gpu_ms = f->step_stage_ms = f->step_launch_ms = f->step_wait_ms = -1;
	if (c->on)
		c->t0 = clock_now();
}

static void step_clock_end(struct forward *f, const struct step_clock *c)
{
	double t3;

	if (!c->on)
		return;
	t3 = clock_now();
	f->step_gpu_ms = f->be->ops->timer_ms(f->be);
	f->step_stage_ms = (c->t1 - c->t0) * 1e3;
	f->step_launch_ms = (c->t2 - c->t1) * 1e3;
	f->step_wait_ms = (t3 - c->t2) * 1e3;
}

static int run_graph(struct forward *f, const struct fwd_batch *b, float *logits)
{
	int size, bucket = bucket_of(b->n_rows, &size), s = sampling(f), ret;
	struct fwd_batch db;
	void **graph = &f->graphs[bucket][s];
	struct step_clock clk = { 0 };
	long bytes;

	step_clock_start(f, &clk);
	bytes = stage_batch(f, b, size, &db);
	if (bytes < 0)
		return (int)bytes;
	if (s) {
		if ((ret = sample_fill(f, b->n_rows)))
			return ret;
		/* padding rows draw greedily from their dummy logits */
		memset((struct k_sample_params *)stage_host(&f->st, f->st.params) + b->n_rows, 0,
		       (size_t)(size - b->n_rows) * sizeof(*f->st.params));
		memset((uint64_t *)stage_host(&f->st, f->st.steps) + b->n_rows, 0,
		       (size_t)(size - b->n_rows) * sizeof(*f->st.steps));
	}
	if (clk.on) {
		clk.t1 = clock_now();
		clk.on = !f->be->ops->timer_mark(f->be, 0);
	}
	/* the step's inputs, sampling parameters and tables in one copy */
	if ((ret = stage_upload(f, f->st.block, (size_t)bytes)))
		return ret;
	if (!*graph) {
		clk.on = 0;	/* a capture is no step to time */
		double t0 = clock_now();

		if ((ret = graph_capture_path(f, &db, size, bucket, s))) {
			log_warn("forward: capturing the %d-row decode graph failed (%s); running op by op",
				 size, strerror(-ret));
			f->use_graphs = 0;
			return -EAGAIN;
		}
		log_info("forward: captured the %d-row decode graph%s in %.1f ms: %d nodes, %s path",
			 size, s ? " with sampling" : "", (clock_now() - t0) * 1e3,
			 f->graph_nodes[bucket][s], f->bucket_lat[bucket] ? "latency" : "standard");
	}
	if ((ret = f->be->ops->graph_launch(f->be, *graph)))
		return ret;
	if (clk.on) {
		clk.on = !f->be->ops->timer_mark(f->be, 1);
		clk.t2 = clock_now();
	}
	f->graph_replays++;
	if ((ret = logits_collect(f, b->n_rows, logits)) || (ret = f->be->ops->sync(f->be)))
		return ret;
	step_clock_end(f, &clk);
	return 0;
}

int forward_replay_tokens(struct forward *f, int rows, const int32_t *tokens, double *ms)
{
	int size, bucket = bucket_of(rows, &size), ret;
	struct fwd_stage *st = &f->st;
	double t0;

	if (rows < 1 || bucket >= FWD_N_BUCKETS || !f->use_graphs || !f->graphs[bucket][1] ||
	    st->layout_rows != size || f->tp)	/* tp: rank 0's tokens alone would change */
		return -EINVAL;
	t0 = clock_now();
	memcpy(stage_host(st, st->tokens), tokens, (size_t)rows * sizeof(int32_t));
	if ((ret = stage_upload(f, st->tokens, (size_t)rows * sizeof(int32_t))) ||
	    (ret = f->be->ops->graph_launch(f->be, f->graphs[bucket][1])) ||
	    (ret = f->be->ops->sync(f->be)))
		return ret;
	*ms = (clock_now() - t0) * 1e3;
	return 0;
}

/* The host-side keys of the routing trace for this step: positions, first blocks. */
static int trace_rows(struct forward *f, const struct fwd_batch *b)
{
	if (!f->trace_first && !(f->trace_first = malloc(sizeof(int32_t) * (size_t)f->max_rows)))
		return -ENOMEM;
	for (int r = 0; r < b->n_rows; r++)
		f->trace_first[r] = b->attn.blocks[r][0];
	f->trace_pos = b->pos;
	return 0;
}

int forward_run(struct forward *f, const struct fwd_batch *b, float *logits)
{
	struct fwd_batch db;
	long bytes;
	int ret;

	if (b->n_rows <= 0 || b->n_rows > f->max_rows || b->n_out < 0 || b->n_out > b->n_rows)
		return -EINVAL;
	if (f->trace && (ret = trace_rows(f, b)))
		return ret;
	if (forward_tp_ranks(f) > 1)	/* one rank (--allreduce nccl at tp 1): below, graphs too */
		return forward_tp_run(f, b, logits);
	if (f->be->ops->host_memory)
		return run_eager(f, b, logits);
	if (!f->trace && graph_eligible(f, b)) {
		ret = run_graph(f, b, logits);
		if (ret != -EAGAIN)
			return ret;
	}
	bytes = stage_batch(f, b, b->n_rows, &db);
	if (bytes < 0)
		return (int)bytes;
	if ((ret = stage_upload(f, f->st.block, (size_t)bytes)))
		return ret;
	/* op by op: the latency path only where forced (auto chooses by graph replays) */
	f->lat = f->path == FWD_PATH_LATENCY && forward_latency_supported(f, b->n_rows, NULL, 0);
	ret = run_eager(f, &db, logits);
	f->lat = 0;
	return ret;
}

void forward_set_path(struct forward *f, enum fwd_path p)
{
	for (int i = 0; i < FWD_N_BUCKETS; i++)
		for (int j = 0; j < 2; j++) {
			if (f->graphs[i][j])
				f->be->ops->graph_destroy(f->be, f->graphs[i][j]);
			f->graphs[i][j] = NULL;
			f->graph_nodes[i][j] = 0;
		}
	memset(f->bucket_lat, -1, sizeof(f->bucket_lat));
	memset(f->bucket_ms, 0, sizeof(f->bucket_ms));
	f->path = p;
}

/* ---- one layer alone (kdbench's layer_us) --------------------------------------- */

int forward_layer_time(struct forward *f, int rows, int layer, int reps, int replays,
		       double *us_per_layer, int *nodes)
{
	int size, bucket = bucket_of(rows, &size), ret, ret2, n = 0;
	struct fwd_stage *st = &f->st;
	struct fwd_batch db;
	void *graph = NULL;
	double ms;

	if (forward_tp_ranks(f) > 1)	/* every rank's layer, one graph (forward_tp_graph.c) */
		return forward_tp_layer_time(f, rows, layer, reps, replays, us_per_layer, nodes);
	if (!f->use_graphs || f->tp || bucket >= FWD_N_BUCKETS || f->bucket_lat[bucket] < 0 ||
	    st->layout_rows != size || layer < 0 || layer >= f->m->cfg.n_layers || reps < 1 ||
	    replays < 1)
		return -EINVAL;
	/* the inputs the bucket's last step staged, as graph_capture reads them */
	db = (struct fwd_batch){
		.n_rows = size, .tokens = st->tokens, .pos = st->pos, .slots = st->slots,
		.attn = { .n_rows = size, .max_ctx = f->n_blocks * f->block_tokens, .n_seqs = size,
			  .ctx = st->ctx, .blocks = st->row_tables },
		.n_out = size,
	};
	f->lat = f->bucket_lat[bucket];
	if ((ret = f->be->ops->capture_begin(f->be))) {
		f->lat = 0;
		return ret;
	}
	ret = 0;
	for (int i = 0; i < reps && !ret; i++)
		ret = forward_layer(f, layer, &db);
	ret2 = f->be->ops->capture_end(f->be, &graph, &n);
	f->lat = 0;
	if (ret || ret2) {
		f->be->ops->graph_destroy(f->be, graph);
		return ret ? ret : ret2;
	}
	forward_graph_replay_ms(f, graph, 2);
	ms = forward_graph_replay_ms(f, graph, replays);
	f->be->ops->graph_destroy(f->be, graph);
	if (ms <= 0)
		return -EIO;
	*us_per_layer = ms * 1e3 / reps;
	*nodes = n / reps;
	return 0;
}
