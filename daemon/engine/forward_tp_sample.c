/* Sampling by vocabulary slices at tp > 1 (docs/PARALLEL.md, "Vocabulary-split
 * sampling"): each rank's argmax, or top-k (value, id) pairs, of its slice of each out
 * row, and their merge into the token a draw over the gathered row would give. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/forward_tp.h"
#include "daemon/engine/forward_tp_internal.h"
#include "kernels/cpu/k_cpu_sample.h"

_Static_assert(FWD_TP_TOPK_MAX == BACKEND_TP_TOPK, "a rank's device pairs are the draw's");

int32_t forward_tp_argmax(const float *l, int n, float *value)
{
	int32_t best = 0;

	for (int32_t i = 1; i < n; i++)	/* kernels/cpu/sample.c's rule */
		if (l[i] > l[best] || isnan(l[best]))
			best = i;
	*value = l[best];
	return best;
}

int forward_tp_argmax_merge(const float *v, const int32_t *ids, int n, size_t stride)
{
	int best = 0;

	/* the slices in vocabulary order, by the scan's own rule: what a scan of the
	 * whole row would pick (a slice that is all NaN passes on, as NaN elements do) */
	for (int r = 1; r < n; r++)
		if (v[(size_t)r * stride] > v[(size_t)best * stride] || isnan(v[(size_t)best * stride]))
			best = r;
	return ids[(size_t)best * stride];
}

int32_t forward_tp_topk_draw(const float *v, const int32_t *ids, int m,
			     const struct k_sample_params *p, uint64_t step, float *work)
{
	/* every logit NaN: no candidate, and the whole row's draw is token 0 */
	return m > 0 ? ids[k_cpu_sample(v, m, p, step, work)] : 0;
}

/* Vocabulary-split greedy: rank r's (value, id) of the best logit of each of its n
 * rows (rows, vn) of out rows o.. (host memory: the rank's own, or its slice copied
 * down). */
void forward_tp_rank_best(struct fwd_tp *g, int r, const float *rows, int n, int vn, int o)
{
	for (int i = 0; i < n; i++) {
		size_t k = (size_t)r * (size_t)g->max_rows + (size_t)(o + i);

		g->best_i[k] = g->v0[r] + forward_tp_argmax(rows + (size_t)i * vn, vn, &g->best_v[k]);
	}
}

/* Rank r's top_k pairs of out row o from m candidates v in the order of their ids
 * (ids: those ids; NULL: v is the rank's slice, ids v0 + index): the best top_k by
 * the procedure's order, ids ascending, what forward_tp_topk_merge joins. The order of
 * the candidates is the ids', so k_cpu_sample_top_k's ties to the lower index are the
 * ties to the lower id, whether v is the slice or the device's best 64 of it. */
static void topk_keep(struct fwd_tp *g, int r, int o, const float *v, const int32_t *ids, int m,
		      int top_k)
{
	size_t k = (size_t)r * (size_t)g->max_rows + (size_t)o;
	int32_t *out_i = g->top_i + k * FWD_TP_TOPK_MAX;
	float *out_v = g->top_v + k * FWD_TP_TOPK_MAX;
	int n = k_cpu_sample_top_k(v, m, top_k, out_i);	/* indices into v */

	for (int a = 1; a < n; a++)	/* ascending (n <= 64: insertion) */
		for (int b = a; b > 0 && out_i[b - 1] > out_i[b]; b--) {
			int32_t t = out_i[b];

			out_i[b] = out_i[b - 1];
			out_i[b - 1] = t;
		}
	for (int j = 0; j < n; j++) {
		out_v[j] = v[out_i[j]];
		out_i[j] = ids ? ids[out_i[j]] : g->v0[r] + out_i[j];
	}
	g->top_n[k] = n;
}

/* Top-k draws by slices on host ranks: rank r's pairs of each of its n rows (rows, vn)
 * of out rows o.. (a greedy row: its argmax pair). */
void forward_tp_rank_topk(struct fwd_tp *g, int r, const float *rows, int n, int vn, int o)
{
	for (int i = 0; i < n; i++) {
		const struct k_sample_params *p = &g->sp[o + i];

		if (p->temperature <= 0)	/* a greedy row of the step */
			forward_tp_rank_best(g, r, rows + (size_t)i * vn, 1, vn, o + i);
		else
			topk_keep(g, r, o + i, rows + (size_t)i * vn, NULL, vn, p->top_k);
	}
}

int forward_tp_pairs_on_device(const struct backend_ops *ops)
{
	return !ops->host_memory && ops->tp_argmax;
}

int forward_tp_topk_ok(const struct backend_ops *ops)
{
	return ops->host_memory || (forward_tp_pairs_on_device(ops) && ops->tp_topk_bytes && ops->tp_topk);
}

/* Bytes of rank r's device pairs: the argmax words, then the top-k op's buffer. */
static size_t pairs_dev_bytes(const struct fwd_tp *g, int r, size_t *top_off)
{
	const struct backend_ops *o = g->ops;

	*top_off = 2 * sizeof(uint32_t) * FWD_LOGIT_ROWS;	/* 512: the op's alignment */
	return *top_off + (forward_tp_topk_ok(o) ? o->tp_topk_bytes(FWD_LOGIT_ROWS,
								      g->f[r]->m->cfg.vocab_size) : 0);
}

int forward_tp_pairs_init(struct fwd_tp *g)
{
	const struct backend_ops *o = g->ops;
	size_t host = sizeof(uint32_t) * (2 * FWD_LOGIT_ROWS + BACKEND_TP_TOPK_WORDS(FWD_LOGIT_ROWS));

	if (!forward_tp_pairs_on_device(o))
		return 0;
	for (int r = 0; r < g->n; r++) {
		size_t off, bytes = pairs_dev_bytes(g, r, &off);

		g->best_dev[r] = o->alloc(g->be[r], bytes);
		g->best_host[r] = o->host_alloc ? o->host_alloc(g->be[r], host) : malloc(host);
		if (!g->best_dev[r] || !g->best_host[r])
			return -ENOMEM;
	}
	return 0;
}

void forward_tp_pairs_fini(struct fwd_tp *g)
{
	for (int r = 0; r < g->n; r++) {
		struct backend *be = g->be[r];

		if (be && g->best_dev[r])
			g->ops->free(be, g->best_dev[r]);
		if (!g->ops->host_alloc)
			free(g->best_host[r]);
		else if (be && g->best_host[r])
			g->ops->host_free(be, g->best_host[r]);
		g->best_dev[r] = NULL;
		g->best_host[r] = NULL;
	}
}

/* Rank r's pairs in h (best_host) for its n rows of out rows o..: the argmax pairs at
 * stride S, then, with g->topk, the top-k op's result of n rows; stored for the merge. */
static void pairs_store(struct fwd_tp *g, int r, const uint32_t *h, int S, int n, int o)
{
	const uint32_t *top = h + 2 * FWD_LOGIT_ROWS;

	for (int i = 0; i < n; i++) {
		const struct k_sample_params *p = &g->sp[o + i];
		size_t k = (size_t)r * (size_t)g->max_rows + (size_t)(o + i);
		int32_t m;

		memcpy(&g->best_v[k], &h[i], sizeof(float));
		g->best_i[k] = (int32_t)h[S + i];
		if (!g->topk || p->temperature <= 0)
			continue;
		/* the device's best min(64, non-NaN) of the row, ids ascending: the
		 * row's top_k among them (never trusted past 64) */
		memcpy(&m, &top[(size_t)2 * n * BACKEND_TP_TOPK + i], sizeof(m));
		m = m < 0 ? 0 : m > BACKEND_TP_TOPK ? BACKEND_TP_TOPK : m;
		topk_keep(g, r, o + i, (const float *)(const void *)(top + (size_t)i * BACKEND_TP_TOPK),
			  (const int32_t *)(const void *)(top + (size_t)(n + i) * BACKEND_TP_TOPK), m,
			  p->top_k);
	}
}

int forward_tp_pairs_device(struct fwd_tp *g, int r, struct backend *via, const float *logits,
			    int n, int o, int graph_rows)
{
	const struct backend_ops *ops = via->ops;
	int vn = g->f[r]->m->cfg.vocab_size, v0 = g->v0[r], S = graph_rows ? graph_rows : n, ret;
	size_t off, bytes = 2 * sizeof(uint32_t) * (size_t)S;

	if (!graph_rows)
		ops->tp_argmax(via, g->best_dev[r], logits, n, vn, v0);
	if (g->topk) {	/* after the argmax words: one copy brings both */
		pairs_dev_bytes(g, r, &off);
		ops->tp_topk(via, (char *)g->best_dev[r] + off, logits, n, vn, v0);
		bytes = off + sizeof(uint32_t) * BACKEND_TP_TOPK_WORDS(n);
	}
	if ((ret = ops->download(via, g->best_host[r], g->best_dev[r], bytes)))
		return ret;
	pairs_store(g, r, g->best_host[r], S, n, o);
	return 0;
}

/* The top-k pairs' host buffers, at the first step that draws by them (rank 0,
 * before the round). */
int forward_tp_topk_alloc(struct fwd_tp *g)
{
	size_t pairs = (size_t)g->n * (size_t)g->max_rows * FWD_TP_TOPK_MAX;

	g->top_v = malloc(sizeof(float) * pairs);
	g->top_i = malloc(sizeof(int32_t) * pairs);
	g->top_n = calloc((size_t)g->n * (size_t)g->max_rows, sizeof(int));
	g->top_work = malloc(sizeof(float) * K_CPU_SAMPLE_WORK((size_t)g->n * FWD_TP_TOPK_MAX));
	if (g->top_v && g->top_i && g->top_n && g->top_work)
		return 0;
	free(g->top_v);
	free(g->top_i);
	free(g->top_n);
	free(g->top_work);
	g->top_v = NULL;
	g->top_i = NULL;
	g->top_n = NULL;
	g->top_work = NULL;
	return -ENOMEM;
}

/* Out row o's top-k draw from every rank's pairs, joined in vocabulary order (the
 * ranks' slices follow one another, each rank's ids ascending). */
int32_t forward_tp_topk_merge(struct fwd_tp *g, int o, uint64_t step)
{
	float v[MODEL_SHARD_MAX_RANKS * FWD_TP_TOPK_MAX];
	int32_t ids[MODEL_SHARD_MAX_RANKS * FWD_TP_TOPK_MAX];
	int m = 0;

	for (int r = 0; r < g->n; r++) {
		size_t k = (size_t)r * (size_t)g->max_rows + (size_t)o;

		memcpy(v + m, g->top_v + k * FWD_TP_TOPK_MAX, sizeof(float) * (size_t)g->top_n[k]);
		memcpy(ids + m, g->top_i + k * FWD_TP_TOPK_MAX, sizeof(int32_t) * (size_t)g->top_n[k]);
		m += g->top_n[k];
	}
	return forward_tp_topk_draw(v, ids, m, &g->sp[o], step, g->top_work);
}
