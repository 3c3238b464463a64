/* Decode graphs with tensor parallel (docs/PARALLEL.md, "CUDA graphs with tp > 1"): per
 * batch bucket, the step of every rank captured once and replayed after. Ranks sharing
 * one device (BACKEND_TP_GRAPH_ONE): one graph holds every rank's step, rank 0's queue
 * forked into each rank's and joined back, each reduction one launch of all ranks;
 * rank 0 stages every rank's inputs and replays it alone, the threads idle. Ranks on
 * devices of their own (BACKEND_TP_GRAPH_PER_RANK; a multi-GPU machine, never run
 * here): each rank captures and replays its own graph in its own thread. Either way a
 * graph ends with the rank's final norm, lm_head and the greedy pair of its vocabulary
 * slice (tp_argmax), so only 8 bytes a row and rank cross back after the replay; a step
 * with top-k rows launches the top-k op (tp_topk) over the rank's logits after the
 * replay, outside the graph, and its pairs come back in the same copy. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/forward_tp_internal.h"

#define OP(f, name, ...) ((f)->be->ops->name((f)->be, __VA_ARGS__))

void forward_tp_graph_init(struct fwd_tp *g)
{
	const struct backend_ops *o = g->ops;

	g->graph_kind = BACKEND_TP_GRAPH_NONE;
	if (!g->bcomm || !o->tp_graph_kind || !o->tp_capture_begin || !o->tp_capture_end ||
	    !o->tp_reduce_join || !g->best_dev[0] || !o->graph_launch)
		return;	/* every step op by op */
	g->graph_kind = o->tp_graph_kind(g->bcomm);
}

void forward_tp_graph_fini(struct fwd_tp *g)
{
	for (int r = 0; r < g->n; r++) {
		struct backend *be = g->be[r];

		for (int i = 0; i < FWD_N_BUCKETS && be && g->ops->graph_destroy; i++) {
			g->ops->graph_destroy(be, g->rank_graph[i][r]);
			g->rank_graph[i][r] = NULL;
		}
	}
}

/* Rank r's inputs as the bucket's g_size rows into its block, the copy queued on via's
 * queue: the graph reads them there at every replay. */
static int rank_stage(struct fwd_tp *g, int r, const struct fwd_batch *b, struct backend *via)
{
	struct forward *f = g->f[r];
	long bytes = forward_stage_rows(f, b, g->g_size, &g->db[r]);

	if (bytes < 0)
		return (int)bytes;
	/* the attention sized for the whole cache: any context fits a replay (as
	 * forward_step.c's graph_capture); every row an out row */
	g->db[r].attn.max_ctx = f->n_blocks * f->block_tokens;
	g->db[r].n_out = g->g_size;
	g->db[r].out_rows = NULL;
	return via->ops->upload(via, f->st.block, f->st.h_block, (size_t)bytes);
}

/* What a rank's graph holds: its layers, then the final norm of every row, lm_head of
 * its vocabulary slice and the slice's greedy pair per row. */
static int rank_ops(struct forward *f)
{
	struct fwd_tp *g = f->tp;
	const struct model_config *c = &f->m->cfg;
	int hidden = c->hidden_size, S = g->g_size, ret;

	if ((ret = forward_layers(f, &g->db[f->tp_rank])))
		return ret;
	OP(f, rmsnorm, f->h, hidden, f->x, hidden, &f->m->final_norm, S, hidden, c->rms_norm_eps);
	OP(f, linear, f->logits, f->h, &f->m->lm_head, S);
	OP(f, tp_argmax, g->best_dev[f->tp_rank], f->logits, S, c->vocab_size, g->v0[f->tp_rank]);
	return 0;
}

/* After a replay: rank r's pairs of the step's rows (the graph's greedy pairs, and
 * where a row draws by top-k the top-k op's, launched here after the replay), or its
 * vocabulary columns of their logits into the caller's rows, copied on via's queue
 * (ordered after the replay). */
static int rank_collect(struct fwd_tp *g, int r, struct backend *via)
{
	const struct fwd_batch *b = g->b;
	struct forward *f = g->f[r];
	int vn = f->m->cfg.vocab_size, ret;

	if (g->greedy)
		return forward_tp_pairs_device(g, r, via, f->logits, b->n_rows, 0, g->g_size);
	for (int i = 0; i < b->n_rows; i++)
		if ((ret = via->ops->download(via, g->logits + (size_t)i * g->vocab + g->v0[r],
					      f->logits + (size_t)i * vn, sizeof(float) * (size_t)vn)))
			return ret;
	return 0;
}

int forward_tp_graph_rank(struct forward *f)
{
	struct fwd_tp *g = f->tp;
	int r = f->tp_rank, per = g->graph_kind == BACKEND_TP_GRAPH_PER_RANK, ret = 0, ret2;
	int staged = 0;
	void **graph = &g->rank_graph[g->g_bucket][r];

	/* a graph per rank: each rank stages its own inputs on its own device (rank 0
	 * did before the round; with one graph it staged every rank's). Not while
	 * capturing: the copy would be recorded. A rank's block moves (stage_block_alloc)
	 * exactly when rank 0's does (the same batch, the same table capacity), which
	 * rank 0 checked before the round, so what a replay reads is where its graph does.
	 * A failed upload still runs the step below on the inputs already there (a step
	 * that then fails): the other ranks' kernels are already waiting in their fused
	 * all-reduces for this rank's partials, and would otherwise spin until they trap */
	if (per && r && g->mode != TP_STEP_CAPTURE && g->mode != TP_STEP_LAYER)
		staged = rank_stage(g, r, g->b, f->be);
	if (g->mode == TP_STEP_REPLAY && f->st.block != g->cap_block[g->g_bucket][r])
		ret = -ESTALE;	/* not reached: see above */
	switch (g->mode) {
	case TP_STEP_WARM:	/* op by op at the bucket's shape: cuBLASLt tunes outside a capture */
		if (!ret)
			ret = rank_ops(f);
		ret2 = f->be->ops->sync(f->be);
		ret = ret ? ret : ret2;
		break;
	case TP_STEP_CAPTURE:	/* rank 0 began its capture before the round */
		if (!ret && r && (ret = g->ops->tp_capture_begin(f->be, g->bcomm, r)))
			break;
		if (!ret)
			ret = rank_ops(f);
		if (r) {	/* even after a failure: the capture must end */
			ret2 = g->ops->tp_capture_end(f->be, g->bcomm, r, graph, &g->rank_nodes[g->g_bucket][r]);
			ret = ret ? ret : ret2;
		}
		break;
	case TP_STEP_LAYER:	/* as a capture, one layer over the bucket's staged inputs */
		if (!ret && r && (ret = g->ops->tp_capture_begin(f->be, g->bcomm, r)))
			break;
		for (int i = 0; !ret && i < g->layer_reps; i++)
			ret = forward_layer(f, g->layer, &g->db[r]);
		if (r) {
			void *none = NULL;	/* one graph: rank 0's end holds it */

			ret2 = g->ops->tp_capture_end(f->be, g->bcomm, r, &none, &g->layer_nodes[r]);
			ret = ret ? ret : ret2;
		}
		break;
	case TP_STEP_REPLAY:	/* a graph per rank */
		if (!ret)
			ret = f->be->ops->graph_launch(f->be, *graph);
		if (!ret && !staged)
			ret = rank_collect(g, r, f->be);
		ret2 = f->be->ops->sync(f->be);
		ret = ret ? ret : ret2;
		break;
	default:
		ret = -EINVAL;
	}
	ret = ret ? ret : staged;
	if (ret)	/* the others must not wait for this rank at a reduction */
		tp_barrier_break(&g->comm.bar);
	return ret;
}

/* The bucket's graphs, every rank's, destroyed. */
static void graphs_drop(struct fwd_tp *g, int bucket)
{
	struct forward *f0 = g->f[0];

	f0->be->ops->graph_destroy(f0->be, f0->graphs[bucket][1]);
	f0->graphs[bucket][1] = NULL;
	f0->graph_nodes[bucket][1] = 0;
	for (int r = 0; r < g->n; r++) {
		g->ops->graph_destroy(g->be[r], g->rank_graph[bucket][r]);
		g->rank_graph[bucket][r] = NULL;
		g->cap_block[bucket][r] = NULL;
	}
}

/* Whether the bucket has its graphs and every rank's inputs are where they read them. */
static int graphs_ready(const struct fwd_tp *g, int bucket)
{
	for (int r = 0; r < g->n; r++) {
		int have = g->graph_kind == BACKEND_TP_GRAPH_ONE ? r > 0 || g->f[0]->graphs[bucket][1]
								 : g->rank_graph[bucket][r] != NULL;

		if (!have || g->cap_block[bucket][r] != g->f[r]->st.block)
			return 0;
	}
	return 1;
}

/* The bucket's graphs: one step op by op at its shape, then the capture round. */
static int graphs_capture(struct fwd_tp *g, int bucket, int *nodes)
{
	struct forward *f0 = g->f[0];
	void **graph = g->graph_kind == BACKEND_TP_GRAPH_ONE ? &f0->graphs[bucket][1]
							     : &g->rank_graph[bucket][0];
	int ret, ret2, n0 = 0;

	graphs_drop(g, bucket);
	if ((ret = forward_tp_round(g, TP_STEP_WARM, g->b, g->logits)))
		return ret;
	if ((ret = g->ops->tp_capture_begin(g->be[0], g->bcomm, 0)))
		return ret;
	ret = forward_tp_round(g, TP_STEP_CAPTURE, g->b, g->logits);
	/* after every other rank's end (the round's finish barrier): rank 0's, which
	 * with one graph joins theirs and ends the capture */
	ret2 = g->ops->tp_capture_end(g->be[0], g->bcomm, 0, graph, &n0);
	ret = ret ? ret : ret2;
	*nodes = n0;
	for (int r = 1; r < g->n; r++)
		*nodes += g->rank_nodes[bucket][r];
	if (ret) {
		for (int r = 0; r < g->n; r++)	/* a failed capture's error, logged, not kept */
			g->ops->sync(g->be[r]);
		graphs_drop(g, bucket);
		return ret;
	}
	if (g->graph_kind == BACKEND_TP_GRAPH_ONE)
		f0->graph_nodes[bucket][1] = n0;
	for (int r = 0; r < g->n; r++)
		g->cap_block[bucket][r] = g->f[r]->st.block;
	return 0;
}

int forward_tp_graph_step(struct forward *f, const struct fwd_batch *b, float *logits)
{
	struct fwd_tp *g = f->tp;
	int one = g->graph_kind == BACKEND_TP_GRAPH_ONE, size, bucket, ret, nodes = 0;

	if (g->graph_kind == BACKEND_TP_GRAPH_NONE || f->trace)
		return -EAGAIN;
	if (!f->use_graphs) {
		if (!g->said_eager++)
			log_info("tp %d: graphs off: every step op by op", g->n);
		return -EAGAIN;
	}
	if (g->bcp) {	/* the exchange's stages meet at host barriers and its rows are
			 * staged per step (mla_cp_step): nothing a replay would redo */
		if (!g->said_eager++)
			log_info("tp %d --mla-cp: every step op by op (the latent exchange is not "
				 "captured into graphs yet)", g->n);
		return -EAGAIN;
	}
	if ((bucket = forward_graph_bucket(f, b, &size)) < 0)
		return -EAGAIN;
	g->g_size = size;
	g->g_bucket = bucket;
	g->b = b;
	g->logits = logits;
	/* one graph: rank 0 stages every rank's inputs, copied on its own queue, which
	 * the replay follows; a graph per rank: rank 0 its own here, the others theirs
	 * in the round (their devices' memory) */
	for (int r = 0; r < (one ? g->n : 1); r++)
		if ((ret = rank_stage(g, r, b, g->be[0])))
			return ret;
	if (!graphs_ready(g, bucket)) {
		double t0 = clock_now();

		/* the ranks' streams read the staged inputs while the graph is made */
		if (one && (ret = g->ops->sync(g->be[0])))
			return ret;
		if ((ret = graphs_capture(g, bucket, &nodes))) {
			log_warn("tp %d: capturing the %d-row decode graph failed (%s); every step op by "
				 "op from now on", g->n, size, strerror(-ret));
			f->use_graphs = 0;
			return -EAGAIN;
		}
		log_info("tp %d: captured the %d-row decode graph%s in %.1f ms: %d nodes", g->n, size,
			 one ? " of every rank's step (one graph)" : "s, one per rank",
			 (clock_now() - t0) * 1e3, nodes);
	}
	if (!one)
		return forward_tp_round(g, TP_STEP_REPLAY, b, logits);
	if ((ret = g->ops->graph_launch(g->be[0], f->graphs[bucket][1])))
		return ret;
	f->graph_replays++;
	for (int r = 0; r < g->n; r++)	/* on rank 0's queue: after the replay */
		if ((ret = rank_collect(g, r, g->be[0])))
			return ret;
	return g->ops->sync(g->be[0]);
}

int forward_tp_layer_time(struct forward *f, int rows, int layer, int reps, int replays,
			  double *us_per_layer, int *nodes)
{
	struct fwd_tp *g = f->tp;
	struct backend *be0 = g->be[0];	/* g->f[0]'s: one graph, replayed there */
	void *graph = NULL;
	int ret, ret2, n0 = 0, size, bucket = 0;

	for (size = 1; size < rows; size *= 2)	/* forward_step.c's buckets */
		bucket++;
	/* one graph of every rank (a graph per rank would need every rank's replay timed
	 * together: not built); the bucket of rows is the last graph step's, staged */
	if (g->graph_kind != BACKEND_TP_GRAPH_ONE || !f->use_graphs || reps < 1 || replays < 1 ||
	    layer < 0 || layer >= f->m->cfg.n_layers || bucket != g->g_bucket || size != g->g_size ||
	    !graphs_ready(g, bucket))
		return -EINVAL;
	g->layer = layer;
	g->layer_reps = reps;
	if ((ret = g->ops->tp_capture_begin(be0, g->bcomm, 0)))
		return ret;
	ret = forward_tp_round(g, TP_STEP_LAYER, g->b, g->logits);
	ret2 = g->ops->tp_capture_end(be0, g->bcomm, 0, &graph, &n0);
	ret = ret ? ret : ret2;
	for (int r = 1; r < g->n; r++)
		n0 += g->layer_nodes[r];
	if (!ret) {
		double ms = forward_graph_replay_ms(g->f[0], graph, 2);

		ms = ms > 0 ? forward_graph_replay_ms(g->f[0], graph, replays) : 0;
		ret = ms > 0 ? 0 : -EIO;
		*us_per_layer = ms * 1e3 / reps;
		*nodes = n0 / reps;
	}
	be0->ops->graph_destroy(be0, graph);
	return ret;
}
