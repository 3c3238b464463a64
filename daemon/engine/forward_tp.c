/* Ranks as threads (docs/PARALLEL.md): each step rank 0 (the engine thread) wakes ranks
 * 1..n-1, every rank runs forward_layers on its own shard and forward, the partial sums
 * meet in forward_tp_reduce, and each rank writes its vocabulary columns of the logits.
 * Barriers sleep, so n ranks on fewer cores wait instead of spinning; a rank that fails
 * breaks the step's barrier and every rank returns instead of waiting forever.
 * A backend without host memory (cuda: virtual ranks on one GPU) stages each rank's
 * inputs itself, reduces through the backend's tp_* ops between two barriers (their
 * order is what keeps ranks sharing a GPU from deadlocking: backend_cuda_tp.c) and
 * runs op by op, or, for decode steps, replays graphs of the ranks' steps
 * (forward_tp_graph.c). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "daemon/base/log.h"
#include "daemon/engine/forward_tp.h"
#include "daemon/engine/forward_tp_internal.h"
#include "daemon/engine/route_trace.h"
#include "daemon/model/model_shard.h"
#include "kernels/cpu/k_cpu.h"
#include "kernels/quant.h"

#define OP(f, name, ...) ((f)->be->ops->name((f)->be, __VA_ARGS__))

int forward_tp_reduce(struct forward *f, float *buf, size_t n, float *residual)
{
	return forward_tp_reduce_norm(f, buf, n, residual, NULL, NULL);
}

int forward_tp_reduce_norm(struct forward *f, float *buf, size_t n, float *residual,
			   const struct model_tensor *gamma, float *out)
{
	struct fwd_tp *g = f->tp;
	int hidden = f->m->cfg.hidden_size, ret;
	float eps = f->m->cfg.rms_norm_eps;

	if (!g->bcomm) {
		struct tp_norm norm = { .width = hidden, .eps = eps, .out = out };

		if (!gamma)
			return tp_comm_reduce(&g->comm, f->tp_rank, buf, n, residual);
		norm.gamma = gamma->data;
		norm.dtype = gamma->dtype;
		return tp_comm_reduce_norm(&g->comm, f->tp_rank, buf, n, residual, &norm);
	}
	if (n % (size_t)hidden)
		return -EINVAL;
	if ((g->mode == TP_STEP_CAPTURE || g->mode == TP_STEP_LAYER) &&
	    g->graph_kind == BACKEND_TP_GRAPH_ONE) {
		/* one graph of every rank: each rank records its part; once all have, rank
		 * 0 queues them as one launch, then every rank's next work waits for it */
		if ((ret = g->ops->tp_arrive(f->be, g->bcomm, f->tp_rank)) ||
		    (ret = g->ops->tp_reduce(f->be, g->bcomm, f->tp_rank, buf,
					     (int)(n / (size_t)hidden), residual, gamma, out, eps)) ||
		    (ret = tp_barrier_wait(&g->comm.bar)) ||
		    (ret = g->ops->tp_reduce_join(f->be, g->bcomm, f->tp_rank, 0)) ||
		    (ret = tp_barrier_wait(&g->comm.bar)))
			return ret;
		return g->ops->tp_reduce_join(f->be, g->bcomm, f->tp_rank, 1);
	}
	/* every rank's work marked before any reduction is queued; every reduction
	 * queued before any rank queues what follows it (backend_cuda_tp.c says why) */
	if ((ret = g->ops->tp_arrive(f->be, g->bcomm, f->tp_rank)) ||
	    (ret = tp_barrier_wait(&g->comm.bar)) ||
	    (ret = g->ops->tp_reduce(f->be, g->bcomm, f->tp_rank, buf, (int)(n / (size_t)hidden),
				     residual, gamma, out, eps)))
		return ret;
	return tp_barrier_wait(&g->comm.bar);
}

int forward_tp_embed(struct forward *f, const struct fwd_batch *b)
{
	struct fwd_tp *g = f->tp;
	int hidden = f->m->cfg.hidden_size, v0 = g->v0[f->tp_rank], vn = f->m->cfg.vocab_size;

	if (f->be->ops->embed_shard) {	/* b->tokens in backend memory */
		OP(f, embed_shard, f->x, b->tokens, b->n_rows, &f->m->embed, v0);
		return forward_tp_reduce(f, f->x, (size_t)b->n_rows * hidden, NULL);
	}
	for (int i = 0; i < b->n_rows; i++) {
		float *row = f->x + (size_t)i * hidden;
		int32_t id = b->tokens[i] - v0;

		if (id >= 0 && id < vn)
			OP(f, embed, row, &id, 1, &f->m->embed);
		else	/* another rank's row: it contributes it to the sum */
			memset(row, 0, sizeof(float) * (size_t)hidden);
	}
	return forward_tp_reduce(f, f->x, (size_t)b->n_rows * hidden, NULL);
}

int forward_tp_experts(struct forward *f, int32_t *ids, size_t n)
{
	struct fwd_tp *g = f->tp;
	int32_t *h = ids;
	int e0, ne, ret;

	if (!g->ep)
		return f->m->cfg.n_experts;
	e0 = g->e0[f->tp_rank];
	ne = g->ne[f->tp_rank];
	if (f->be->ops->experts_shard) {	/* in backend memory, on its queue (cuda) */
		OP(f, experts_shard, ids, (int)n, e0, ne);
		return ne;
	}
	/* other backend memory: through the host, a synchronous copy each way */
	if (!f->be->ops->host_memory &&
	    (ret = f->be->ops->download(f->be, h = g->ep_ids[f->tp_rank], ids, n * sizeof(int32_t))))
		return ret;
	/* another rank's expert: an id the kernel skips (it contributes nothing here) */
	for (size_t i = 0; i < n; i++)
		h[i] = h[i] >= e0 && h[i] < e0 + ne ? h[i] - e0 : -1;
	if (h != ids && (ret = f->be->ops->upload(f->be, ids, h, n * sizeof(int32_t))))
		return ret;
	return ne;
}

const int32_t *forward_tp_cp_slots(const struct forward *f)
{
	if (!f->tp || !f->tp->cp)
		return NULL;
	return f->tp->bcp ? f->tp->cp_dslots[f->tp_rank] : f->tp->cp_slots[f->tp_rank];
}

/* w_kv_b as floats where it is quantized (as backend_cpu's attn_mla does, for this call
 * only); *tmp the copy to free, or NULL: w's own data. */
static const void *kv_b_data(const struct model_tensor *w, enum k_dtype *dtype, float **tmp)
{
	*tmp = NULL;
	*dtype = w->dtype;
	if (w->q.fmt == K_Q_NONE)
		return w->data;
	*tmp = malloc(sizeof(float) * (size_t)w->rows * (size_t)w->cols);
	if (!*tmp)
		return NULL;
	for (int64_t r = 0; r < w->rows; r++)
		k_quant_row_to_f32(*tmp + r * w->cols, w->data, &w->q, w->cols, r, 0, w->cols);
	*dtype = K_F32;
	return *tmp;
}

/* The three stages below on a backend without host memory, through its exchange: each
 * rank's stage queued before any rank queues the next (the barriers). */
static int mla_attn_backend(struct forward *f, const struct model_layer *L, int l,
			    const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale)
{
	struct fwd_tp *g = f->tp;
	int ret = 0;

	for (int stage = 0; stage < 3; stage++) {
		if (stage && (ret = tp_barrier_wait(&g->comm.bar)))
			break;
		if ((ret = g->ops->mla_cp_attn(f->be, g->bcp, f->tp_rank, stage, f->attn, f->q,
					       &L->wkv_b, &f->kv[l], rows, d, scale))) {
			tp_barrier_break(&g->comm.bar);
			break;
		}
	}
	return ret;
}

int forward_tp_mla_attn(struct forward *f, const struct model_layer *L, int l,
			const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale)
{
	struct fwd_tp *g = f->tp;
	int r = f->tp_rank, H = g->cp_heads, width = d->kv_lora + d->rope_dim;
	int h0 = r * d->n_heads, ret;
	enum k_dtype dtype;
	float *tmp;
	const void *w;

	if (g->bcp)
		return mla_attn_backend(f, L, l, rows, d, scale);
	w = kv_b_data(&L->wkv_b, &dtype, &tmp);

	if (!w)
		ret = -ENOMEM;
	else	/* 1. this rank's heads absorbed, into the rows every rank reads */
		ret = k_cpu_mla_absorb(g->cp_q + (size_t)h0 * width, (size_t)H * width, f->q, w, dtype,
				       rows->n_rows, d);
	if (ret)
		tp_barrier_break(&g->comm.bar);
	/* 2. every head over this rank's tokens, once every rank's heads are in */
	if (!ret && !(ret = tp_barrier_wait(&g->comm.bar)) &&
	    (ret = k_cpu_attn_mla_part(NULL, g->cp_o[r], g->cp_ml[r], g->cp_q, &f->kv[l], rows, H,
				       d->kv_lora, d->rope_dim, scale, r, g->n)))
		tp_barrier_break(&g->comm.bar);
	/* 3. this rank's heads merged over every rank's partials, then expanded. Nothing
	 * here is written again before every rank has read it: the next writes are the
	 * next layer's, after this layer's two reductions (barriers) */
	if (!ret && !(ret = tp_barrier_wait(&g->comm.bar)) &&
	    (ret = k_cpu_mla_merge_expand(f->attn, (const float *const *)g->cp_o,
					  (const float *const *)g->cp_ml, g->n, rows->n_rows, H, h0,
					  w, dtype, d)))
		tp_barrier_break(&g->comm.bar);
	free(tmp);
	return ret;
}

/* Decode context parallel: rank r's latent cache cut to its slots (docs/PARALLEL.md),
 * ceil(T / n) rows of the T the block tables address plus the row that takes the
 * other ranks' latents, and the buffers the ranks exchange. */
static int cp_create(struct fwd_tp *g, const struct model *m, int max_rows, char *err,
		     size_t err_len)
{
	const struct model_config *c = &m->cfg;
	struct forward *f0 = g->f[0];
	size_t T = ((size_t)f0->n_blocks + 1) * (size_t)f0->block_tokens;
	size_t rows = (T + (size_t)g->n - 1) / (size_t)g->n + 1, R = (size_t)max_rows;
	size_t H = (size_t)c->n_heads, L = (size_t)c->kv_lora_rank;

	g->cp_heads = c->n_heads;
	g->cp_trash = (int)(rows - 1);
	if (!g->ops->host_memory) {	/* the backend's exchange, on its devices */
		struct k_mla_dims d = {
			.n_heads = c->n_heads, .nope_dim = c->qk_nope_head_dim,
			.rope_dim = c->qk_rope_head_dim, .v_dim = c->v_head_dim, .kv_lora = c->kv_lora_rank,
		};
		int ret = g->ops->mla_cp_create(g->be, g->n, max_rows,
						f0->n_blocks * f0->block_tokens, f0->block_tokens,
						&d, g->cp_trash, &g->bcp, err, err_len);

		if (ret)
			return ret;
	} else if (!(g->cp_q = malloc(sizeof(float) * R * H * (L + (size_t)c->qk_rope_head_dim)))) {
		goto nomem;
	}
	for (int r = 0; r < g->n; r++) {
		struct forward *f = g->f[r];
		size_t elem = k_dtype_size(f->be->ops->kv_dtype);

		if (g->ops->host_memory) {
			g->cp_slots[r] = malloc(sizeof(int32_t) * R);
			g->cp_o[r] = malloc(sizeof(float) * R * H * L);
			g->cp_ml[r] = malloc(sizeof(float) * R * H * 2);
			if (!g->cp_slots[r] || !g->cp_o[r] || !g->cp_ml[r])
				goto nomem;
		}
		for (int l = 0; l < c->n_layers; l++) {
			struct k_kv_layer *kv = &f->kv[l];

			f->be->ops->free(f->be, kv->k);	/* forward_create's whole cache */
			kv->k = f->be->ops->alloc(f->be, rows * (size_t)kv->width * elem);
			if (!kv->k)
				goto nomem;
		}
		f->kv_bytes = rows * (size_t)f->kv[0].width * elem * (size_t)c->n_layers;
	}
	return 0;
nomem:
	snprintf(err, err_len, "tp %d --mla-cp: out of memory for the split latent cache", g->n);
	return -ENOMEM;
}

/* The final norm and this rank's vocabulary columns of the out rows' logits, written
 * straight into the caller's (n_out, vocab) rows; or, greedy, only the best of them. */
static int rank_logits(struct forward *f, const struct fwd_batch *b, float *logits)
{
	struct fwd_tp *g = f->tp;
	const struct model_config *c = &f->m->cfg;
	int hidden = c->hidden_size, vn = c->vocab_size, v0 = g->v0[f->tp_rank];

	for (int o = 0; o < b->n_out; o += FWD_LOGIT_ROWS) {
		int n = b->n_out - o < FWD_LOGIT_ROWS ? b->n_out - o : FWD_LOGIT_ROWS;

		for (int i = 0; i < n; i++)
			OP(f, rmsnorm, f->h + (size_t)i * hidden, hidden,
			   f->x + (size_t)b->out_rows[o + i] * hidden, hidden, &f->m->final_norm, 1,
			   hidden, c->rms_norm_eps);
		OP(f, linear, f->logits, f->h, &f->m->lm_head, n);
		if (g->greedy && g->best_dev[f->tp_rank]) {	/* pairs picked on the device */
			int ret = forward_tp_pairs_device(g, f->tp_rank, f->be, f->logits, n, o, 0);

			if (ret)
				return ret;
			continue;
		}
		if (g->greedy) {
			const float *rows = f->logits;
			int ret;

			if (!f->be->ops->host_memory) {	/* its slice alone crosses to the host */
				rows = g->slice[f->tp_rank];
				if ((ret = f->be->ops->download(f->be, g->slice[f->tp_rank], f->logits,
								sizeof(float) * (size_t)n * (size_t)vn)))
					return ret;
			}
			if (g->topk)	/* some row of the step draws by top-k */
				forward_tp_rank_topk(g, f->tp_rank, rows, n, vn, o);
			else
				forward_tp_rank_best(g, f->tp_rank, rows, n, vn, o);
			continue;
		}
		for (int i = 0; i < n; i++) {
			float *dst = logits + (size_t)(o + i) * g->vocab + v0;
			int ret;

			if (f->be->ops->host_memory)
				memcpy(dst, f->logits + (size_t)i * vn, sizeof(float) * (size_t)vn);
			else if ((ret = f->be->ops->download(f->be, dst, f->logits + (size_t)i * vn,
							      sizeof(float) * (size_t)vn)))
				return ret;
		}
	}
	return 0;
}

static int rank_step(struct forward *f)
{
	struct fwd_tp *g = f->tp;
	const struct fwd_batch *b = g->b;
	struct fwd_batch db;
	int ret = 0;

	if (g->mode != TP_STEP_EAGER)	/* a graph bucket's step: forward_tp_graph.c */
		return forward_tp_graph_rank(f);
	if (!f->be->ops->host_memory) {	/* this rank's inputs in its backend's memory */
		ret = forward_stage_step(f, g->b, &db);
		b = &db;
	}
	for (int i = 0; g->cp && !g->bcp && i < b->n_rows; i++)	/* where this rank's latents go */
		g->cp_slots[f->tp_rank][i] = b->slots[i] % g->n == f->tp_rank ? b->slots[i] / g->n
									  : g->cp_trash;
	if (!ret && g->bcp &&	/* the same on the device, and the tokens it holds */
	    !(g->cp_dslots[f->tp_rank] = g->ops->mla_cp_step(f->be, g->bcp, f->tp_rank, b->slots,
							      &b->attn)))
		ret = -EIO;
	if (!ret)
		ret = forward_layers(f, b);
	if (!ret)
		ret = rank_logits(f, b, g->logits);
	if (!f->be->ops->host_memory) {	/* done before the finish barrier */
		int r = f->be->ops->sync(f->be);

		ret = ret ? ret : r;
	}
	if (ret)	/* the others must not wait for this rank at a reduction */
		tp_barrier_break(&g->comm.bar);
	return ret;
}

static void *rank_main(void *arg)
{
	struct forward *f = arg;
	struct fwd_tp *g = f->tp;

	if (f->be->ops->thread_attach)	/* cuda: the rank's GPU current on this thread */
		f->be->ops->thread_attach(f->be);
	for (;;) {
		tp_barrier_wait(&g->step);
		if (g->quit)
			break;
		g->ret[f->tp_rank] = rank_step(f);
		tp_barrier_wait(&g->step);
	}
	return NULL;
}

/* Whether the trace holds choices to force. Recording alone is rank 0's (the trace is
 * f[0]'s): the router is replicated and its input the same bits on every rank, so rank
 * 0's choices are every rank's. */
static int trace_forces(const struct route_trace *t)
{
	size_t keys = (size_t)t->max_seqs * (size_t)t->n_layers * (size_t)t->max_pos;

	return memchr(t->have_force, 1, keys) != NULL;
}

int forward_tp_round(struct fwd_tp *g, enum tp_step mode, const struct fwd_batch *b, float *logits)
{
	int ret = 0;

	tp_barrier_reset(&g->comm.bar);
	g->mode = mode;
	g->b = b;
	g->logits = logits;
	tp_barrier_wait(&g->step);
	g->ret[0] = rank_step(g->f[0]);
	tp_barrier_wait(&g->step);
	g->mode = TP_STEP_EAGER;
	/* the failing rank's error, not the -ECANCELED of those it stopped */
	for (int r = 0; r < g->n; r++)
		if (g->ret[r] && (!ret || ret == -ECANCELED))
			ret = g->ret[r];
	return ret;
}

int forward_tp_run(struct forward *f, const struct fwd_batch *b, float *logits)
{
	struct fwd_tp *g = f->tp;
	int ret = 0;

	if (b->n_rows <= 0 || b->n_rows > f->max_rows || b->n_out < 0 || b->n_out > b->n_rows)
		return -EINVAL;
	if (f->trace && trace_forces(f->trace)) {	/* it would force rank 0's routing alone */
		snprintf(f->trace_err, sizeof(f->trace_err), "forced routing with tp %d: not built "
			 "(it would change rank 0's choices alone)", g->n);
		return -ENOTSUP;
	}
	/* sampling asked for (engine_sample.c does so for greedy rows, and for top-k rows
	 * where forward_tp_topk_ok): each rank's argmax, or top-k pairs, of its
	 * vocabulary slice; only (value, id) pairs compared */
	g->greedy = f->sample.params != NULL;
	g->topk = 0;
	if (g->greedy && f->sample.done + b->n_out > f->sample.n)
		return -EINVAL;
	g->sp = g->greedy ? f->sample.params + f->sample.done : NULL;
	for (int o = 0; g->greedy && o < b->n_out; o++) {
		const struct k_sample_params *p = &g->sp[o];

		if (p->temperature <= 0)
			continue;
		if (!forward_tp_topk_ok(g->ops) || p->top_k < 1 || p->top_k > FWD_TP_TOPK_MAX)
			return -EINVAL;	/* drawn by slices: greedy, or top-k */
		if (!g->top_v && (ret = forward_tp_topk_alloc(g)))
			return ret;
		g->topk = 1;
	}
	/* a decode step replays its bucket's graph where the ranks can capture */
	ret = forward_tp_graph_step(f, b, logits);
	if (ret == -EAGAIN)
		ret = forward_tp_round(g, TP_STEP_EAGER, b, logits);
	if (!ret && g->greedy) {
		for (int o = 0; o < b->n_out; o++)
			f->sample.ids[f->sample.done + o] =
				g->sp[o].temperature > 0 ? forward_tp_topk_merge(g, o, f->sample.steps[f->sample.done + o])
							 : forward_tp_argmax_merge(g->best_v + o, g->best_i + o, g->n,
										   (size_t)g->max_rows);
		f->sample.done += b->n_out;
	}
	g->greedy = 0;
	g->topk = 0;
	return ret;
}

void forward_tp_stop(struct fwd_tp *g)
{
	if (!g)
		return;
	if (g->started) {
		g->quit = 1;
		/* every started thread waits at the start barrier; the others count as
		 * arrived (barrier of started + 1) */
		tp_barrier_wait(&g->step);
		for (int r = 1; r <= g->started; r++)
			pthread_join(g->thread[r], NULL);
		g->started = 0;
	}
	forward_tp_graph_fini(g);	/* the graphs and pairs' buffers: the backends still live */
	forward_tp_pairs_fini(g);
	for (int r = 1; r < g->n; r++) {
		forward_destroy(g->f[r]);
		g->f[r] = NULL;
		if (g->be[r])
			g->be[r]->ops->destroy(g->be[r]);
		g->be[r] = NULL;
	}
}

void forward_tp_free(struct fwd_tp *g)
{
	if (!g)
		return;
	if (g->bcomm)	/* the threads are gone: no reduction in flight */
		g->ops->tp_comm_destroy(g->bcomm);
	if (g->bcp)
		g->ops->mla_cp_destroy(g->bcp);
	for (int r = 0; r < g->n; r++) {
		model_destroy(g->shard[r]);
		free(g->slice[r]);
		free(g->ep_ids[r]);
		free(g->cp_slots[r]);
		free(g->cp_o[r]);
		free(g->cp_ml[r]);
	}
	free(g->cp_q);
	free(g->best_v);
	free(g->best_i);
	free(g->top_v);
	free(g->top_i);
	free(g->top_n);
	free(g->top_work);
	tp_comm_fini(&g->comm);
	tp_barrier_fini(&g->step);
	free(g);
}

/* The process's peak resident memory so far (Linux: ru_maxrss in KiB). */
static double peak_host_mib(void)
{
	struct rusage ru;

	return getrusage(RUSAGE_SELF, &ru) ? 0 : (double)ru.ru_maxrss / 1024.0;
}

/* The shards, backends and forwards of every rank (threads not yet started). */
static int ranks_create(struct fwd_tp *g, const struct model *m, struct backend *be0,
			const struct backend_opts *bo, int n_blocks, int block_tokens, int max_rows,
			char *err, size_t err_len)
{
	int ret;

	if (g->n == 1) {	/* a one-rank communicator: the whole model, the caller's backend */
		g->be[0] = be0;
		g->peak_mib[0] = peak_host_mib();
		if ((ret = forward_create(&g->f[0], m, be0, n_blocks, block_tokens, max_rows, err,
					  err_len)))
			return ret;
		g->f[0]->tp = g;
		g->f[0]->tp_rank = 0;
		return 0;
	}
	for (int r = 0; r < g->n; r++) {
		int vn;

		if ((ret = model_shard_create(&g->shard[r], m, r, g->n, g->ep, err, err_len)))
			return ret;
		model_shard_vocab(m->cfg.vocab_size, r, g->n, &g->v0[r], &vn);
		if (!g->ops->host_memory && !forward_tp_pairs_on_device(g->ops) &&
		    !(g->slice[r] = malloc(sizeof(float) * FWD_LOGIT_ROWS * (size_t)vn)))
			return -ENOMEM;
		if (!g->ops->host_memory && g->ep && !g->ops->experts_shard &&
		    !(g->ep_ids[r] = malloc(sizeof(int32_t) * (size_t)max_rows * (size_t)m->cfg.top_k)))
			return -ENOMEM;
		model_shard_experts(m->cfg.n_experts, r, g->n, &g->e0[r], &g->ne[r]);
		if (r == 0 && be0) {
			g->be[0] = be0;
		} else {	/* without host memory rank 0 too: a backend of its shard */
			struct backend_opts br = *bo;

			if (bo->rank_devices)	/* cuda: the rank's GPU (engine_rank_devices) */
				br.device = bo->rank_devices[r];
			br.rank_devices = NULL;
			if ((ret = g->ops->create(&g->be[r], g->shard[r], &br, err, err_len)))
				return ret;
			g->own0 |= r == 0;
		}
		if (!g->ops->host_memory)	/* on its device now: one rank's host copy at a time */
			model_shard_drop_host(g->shard[r]);
		g->peak_mib[r] = peak_host_mib();
		if ((ret = forward_create(&g->f[r], g->shard[r], g->be[r], n_blocks, block_tokens,
					  max_rows, err, err_len)))
			return ret;
		g->f[r]->tp = g;
		g->f[r]->tp_rank = r;
	}
	return 0;
}

int forward_tp_cp_check(const struct model_config *c, const struct backend_ops *ops, int n,
			char *err, size_t err_len)
{
	if (!c->mla) {
		snprintf(err, err_len, "--mla-cp: %s has no latent (MLA) attention; context parallel "
			 "splits an MLA latent cache by tokens", c->model_type);
		return -EINVAL;
	}
	if (n < 2) {
		snprintf(err, err_len, "--mla-cp: context parallel needs --tp N of 2 or more");
		return -EINVAL;
	}
	if (!ops->host_memory && !ops->mla_cp_attn) {
		snprintf(err, err_len, "--tp %d --mla-cp on %s: the split latent cache is not built "
			 "there (use --tp %d without --mla-cp, or --backend cpu)", n, ops->name, n);
		return -ENOTSUP;
	}
	return 0;
}

int forward_tp_create(struct forward **out, const struct model *m, struct backend **be0_io,
		      const struct backend_ops *ops, int n, int ep, int cp,
		      const struct backend_opts *bo, int n_blocks, int block_tokens, int max_rows,
		      char *err, size_t err_len)
{
	struct backend *be0 = *be0_io;
	/* one rank: a backend's own communicator alone (--allreduce nccl at tp 1: a
	 * one-rank NCCL one) over the caller's backend of the whole model; no shard, no
	 * thread, and its steps run (and are captured) as tp 1's: forward_tp_ranks */
	const int one = n == 1 && be0 && !ops->host_memory && ops->tp_comm_create && !ep && !cp;
	struct fwd_tp *g;
	int ret;

	*out = NULL;
	if ((ret = model_shard_check(&m->cfg, n, ep, err, err_len)) ||
	    (cp && (ret = forward_tp_cp_check(&m->cfg, ops, n, err, err_len))))
		return ret;
	if ((n < 2 && !one) || (!ops->host_memory && !ops->tp_comm_create) ||
	    (!be0 && ops->host_memory) || (be0 && be0->ops != ops)) {
		snprintf(err, err_len, "tp %d on the %s backend: it has no tensor-parallel reduction",
			 n, ops->name);
		return -EINVAL;
	}
	g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	g->n = n;
	g->ep = ep;
	g->cp = cp;
	for (int r = 0, kv = m->cfg.n_kv_heads; r < n; r++) {	/* shard_gqa: rank r's KV
								 * head r * KV / n when KV < n */
		g->kv_same[r] = m->cfg.mla ? (cp ? r : 0) : r;
		while (!m->cfg.mla && kv < n && g->kv_same[r] > 0 &&
		       (g->kv_same[r] - 1) * kv / n == r * kv / n)
			g->kv_same[r]--;
	}
	g->vocab = m->cfg.vocab_size;
	g->ops = ops;
	g->max_rows = max_rows;
	g->best_v = malloc(sizeof(float) * (size_t)n * (size_t)max_rows);
	g->best_i = malloc(sizeof(int32_t) * (size_t)n * (size_t)max_rows);
	tp_barrier_init(&g->step, n);
	/* the host buffers only where the ranks reduce through host memory */
	ret = tp_comm_init(&g->comm, n, ops->host_memory ?
			   (size_t)max_rows * (size_t)m->cfg.hidden_size : 0);
	if (!ret && (!g->best_v || !g->best_i))
		ret = -ENOMEM;
	if (!ret)
		ret = ranks_create(g, m, be0, bo, n_blocks, block_tokens, max_rows, err, err_len);
	if (!ret && cp)
		ret = cp_create(g, m, max_rows, err, err_len);
	if (!ret && !ops->host_memory)
		ret = ops->tp_comm_create(g->be, n, max_rows, m->cfg.hidden_size, &g->bcomm,
					       err, err_len);
	if (!ret && (ret = forward_tp_pairs_init(g)))
		snprintf(err, err_len, "tp %d: out of memory for the sampling pairs", n);
	if (!ret)
		forward_tp_graph_init(g);
	if (ret && err_len && err[0]) {
		char why[512];	/* which rank: their sizes differ (KV heads, experts) */

		snprintf(why, sizeof(why), "%s", err);
		for (int r = 0; r < n; r++)
			if (!g->f[r]) {
				snprintf(err, err_len, "tp %d, rank %d: %s", n, r, why);
				break;
			}
	}
	for (int r = 1; !ret && r < n; r++) {
		if ((ret = -pthread_create(&g->thread[r], NULL, rank_main, g->f[r])))
			snprintf(err, err_len, "tp %d: cannot start rank %d's thread: %s", n, r,
				 strerror(-ret));
		else
			g->started = r;
	}
	if (ret) {
		/* stop only what started: a barrier of the started threads and this one */
		g->step.n = g->started + 1;
		if (!g->own0)
			g->be[0] = NULL;	/* the caller's */
		forward_tp_stop(g);
		if (g->f[0]) {
			g->f[0]->tp = NULL;
			forward_destroy(g->f[0]);
		}
		if (g->own0)
			g->be[0]->ops->destroy(g->be[0]);
		forward_tp_free(g);
		if (ret == -ENOMEM && err_len && !err[0])
			snprintf(err, err_len, "tp %d: out of memory", n);
		return ret;
	}
	for (int r = 0; r < n; r++)	/* what each rank holds: its shard, its cache */
		log_info("tp %d%s%s: rank %d holds %.1f MiB of weights and %.1f MiB of KV cache; peak "
			 "host memory %.1f MiB", n, ep ? " (experts parallel)" : "",
			 cp ? " (MLA context parallel: latent cache split by tokens)" : "", r,
			 (double)g->f[r]->m->weight_bytes / (1 << 20), (double)g->f[r]->kv_bytes / (1 << 20),
			 g->peak_mib[r]);
	if (n > 1)
		log_info("tp %d: the shards of %.1f MiB of weights %s; peak host memory: the process's "
			 "ru_maxrss once each rank was built", n, (double)m->weight_bytes / (1 << 20),
			 m->mapped ? "read straight from the mapped files (the model never resident whole)" :
			 m->synth_jobs ? "generated slice by slice (synthetic: the model never made whole)"
				       : "copied from the model in memory");
	if (n == 1)
		log_info("tp 1 on %s: one rank through the tensor-parallel reductions (%s), its steps "
			 "run and captured as tp 1's", ops->name,
			 ops->tp_comm_name ? ops->tp_comm_name(g->bcomm) : "its communicator");
	else if (!ops->host_memory)
		log_info("tp %d on %s: ranks as threads, one stream each; %s", n, ops->name,
			 g->graph_kind == BACKEND_TP_GRAPH_ONE ?
			 "decode steps replay one graph of every rank's step per batch bucket (each "
			 "reduction one launch of all ranks, k_cuda_ar_fused_all), other steps op by op" :
			 g->graph_kind == BACKEND_TP_GRAPH_PER_RANK ?
			 "decode steps replay a graph per rank per batch bucket (the reduction inside), "
			 "other steps op by op" : "every step op by op (these ranks' devices take no graphs)");
	for (int r = 1; r < n; r++)	/* the engine's figure: every rank's cache */
		g->f[0]->kv_bytes += g->f[r]->kv_bytes;
	*be0_io = g->be[0];	/* the caller's from now on */
	g->own0 = 0;
	*out = g->f[0];
	return 0;
}

int forward_tp_ranks(const struct forward *f)
{
	return f->tp ? f->tp->n : 1;
}

void forward_tp_rank_kv(const struct forward *f, int r, const struct forward **rf,
			struct backend **be, int *same_as, int *split)
{
	const struct fwd_tp *g = f->tp;

	*rf = g ? g->f[r] : f;
	*be = g ? g->be[r] : f->be;
	*same_as = g ? g->kv_same[r] : 0;
	*split = g && g->cp ? g->n : 1;
}

void forward_tp_describe(const struct forward *f, char *buf, size_t len)
{
	const struct fwd_tp *g = f->tp;

	if (!g) {
		snprintf(buf, len, "tp 1");
		return;
	}
	snprintf(buf, len, "tp %d%s%s, all-reduce %s", g->n, g->ep ? " (experts parallel)" : "",
		 g->cp ? " (MLA context parallel)" : "",
		 !g->bcomm ? "shared memory (tp_comm.c)"
		 : g->ops->tp_comm_name ? g->ops->tp_comm_name(g->bcomm) : g->ops->name);
}
