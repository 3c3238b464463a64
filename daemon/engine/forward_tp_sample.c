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

/* Top-k draws by slices: rank r's best k (value, id) pairs of each of its n rows (rows,
 * vn) of out rows o.., ids ascending (the candidates' order forward_tp_topk_draw wants:
 * the slices follow one another in the vocabulary). */
void forward_tp_rank_topk(struct fwd_tp *g, int r, const float *rows, int n, int vn, int o)
{
	for (int i = 0; i < n; i++) {
		const struct k_sample_params *p = &g->sp[o + i];
		size_t k = (size_t)r * (size_t)g->max_rows + (size_t)(o + i);
		int32_t *ids = g->top_i + k * FWD_TP_TOPK_MAX;
		float *v = g->top_v + k * FWD_TP_TOPK_MAX;
		const float *l = rows + (size_t)i * vn;
		int m;

		if (p->temperature <= 0) {	/* a greedy row of the step */
			forward_tp_rank_best(g, r, l, 1, vn, o + i);
			continue;
		}
		m = k_cpu_sample_top_k(l, vn, p->top_k, ids);
		for (int a = 1; a < m; a++)	/* ids ascending (m <= 64: insertion) */
			for (int b = a; b > 0 && ids[b - 1] > ids[b]; b--) {
				int32_t t = ids[b];

				ids[b] = ids[b - 1];
				ids[b - 1] = t;
			}
		for (int j = 0; j < m; j++) {
			v[j] = l[ids[j]];
			ids[j] += g->v0[r];
		}
		g->top_n[k] = m;
	}
}

/* The top-k pairs' buffers, at the first step that draws by them (rank 0, before the
 * round). */
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
