/* CPU mixture of experts: the router (softmax/sigmoid scoring, greedy or
 * group-limited top-k, HF semantics) and the routed experts' SwiGLU MLPs. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"

/* The router keeps a row's scores on the stack; every known model has far fewer
 * experts (DeepSeek-V3 256, Kimi-K2 384, Qwen3-Next 512). */
#define MOE_MAX_EXPERTS	4096
#define MOE_MAX_GROUPS	256

/* Softmax like torch's: max-subtracted expf, summed, then divided. */
static void route_softmax(float *s /* (n) */, const float *logits, int n)
{
	float max = logits[0], sum = 0.0f;

	for (int e = 1; e < n; e++)
		max = logits[e] > max ? logits[e] : max;
	for (int e = 0; e < n; e++) {
		s[e] = expf(logits[e] - max);
		sum += s[e];
	}
	for (int e = 0; e < n; e++)
		s[e] /= sum;
}

/* Index of the largest v[i] not yet taken; ties go to the lower index. */
static int route_argmax(const float *v, const unsigned char *taken, int n)
{
	int best = -1;

	for (int i = 0; i < n; i++) {
		if (taken[i])
			continue;
		if (best < 0 || v[i] > v[best])
			best = i;
	}
	return best;
}

/* Group score: the max (GROUP_MAX) or the sum of the two largest (GROUP_TOP2). */
static float route_group_score(const float *c /* (per) */, int per, enum k_moe_select sel)
{
	float a = -INFINITY, b = -INFINITY;

	for (int i = 0; i < per; i++) {
		if (c[i] > a) {
			b = a;
			a = c[i];
		} else if (c[i] > b) {
			b = c[i];
		}
	}
	return sel == K_MOE_GROUP_MAX || per < 2 ? a : a + b;
}

/* Drops the experts of all but the topk_group best groups: HF masks them with 0.0
 * (DeepSeek-V2 group_limited_greedy) or -inf (DeepSeek-V3 noaux_tc). */
static void route_mask_groups(const struct k_moe_route_params *p, float *choice,
			      unsigned char *masked /* (n_experts) */)
{
	int per = p->n_experts / p->n_group;
	float gs[MOE_MAX_GROUPS];
	unsigned char keep[MOE_MAX_GROUPS] = { 0 };
	float fill = p->select == K_MOE_GROUP_MAX ? 0.0f : -INFINITY;

	for (int g = 0; g < p->n_group; g++)
		gs[g] = route_group_score(choice + g * per, per, p->select);
	for (int i = 0; i < p->topk_group && i < p->n_group; i++)
		keep[route_argmax(gs, keep, p->n_group)] = 1;
	for (int e = 0; e < p->n_experts; e++) {
		masked[e] = !keep[e / per];
		if (masked[e])
			choice[e] = fill;
	}
}

/* score = softmax or sigmoid of the logits; choice = score + bias with the dropped
 * groups masked (masked[e] set for those). */
static void route_choice(const struct k_moe_route_params *p, const float *logits /* (E) */,
			 float *score, float *choice, unsigned char *masked)
{
	int E = p->n_experts;

	if (p->scoring == K_MOE_SOFTMAX)
		route_softmax(score, logits, E);
	else
		for (int e = 0; e < E; e++)
			score[e] = 1.0f / (1.0f + expf(-logits[e]));
	for (int e = 0; e < E; e++)
		choice[e] = p->bias ? score[e] + p->bias[e] : score[e];
	if (p->select != K_MOE_GREEDY && p->n_group > 0)
		route_mask_groups(p, choice, masked);
}

/* w (top_k) in slot order: renormalised where asked, then scaled. */
static void route_finish_weights(const struct k_moe_route_params *p, float *w)
{
	float sum = 0.0f;

	for (int j = 0; j < p->top_k; j++)
		sum += w[j];
	if (p->norm_topk_prob)
		for (int j = 0; j < p->top_k; j++)
			w[j] /= sum + 1e-20f;
	for (int j = 0; j < p->top_k; j++)
		w[j] *= p->routed_scaling;
}

static void route_row(const struct k_moe_route_params *p, const float *logits /* (E) */,
		      int32_t *ids /* (top_k) */, float *w /* (top_k) */)
{
	float score[MOE_MAX_EXPERTS], choice[MOE_MAX_EXPERTS];
	unsigned char masked[MOE_MAX_EXPERTS] = { 0 }, taken[MOE_MAX_EXPERTS] = { 0 };

	route_choice(p, logits, score, choice, masked);
	for (int j = 0; j < p->top_k; j++) {
		int e = route_argmax(choice, taken, p->n_experts);

		taken[e] = 1;
		ids[j] = e;
		/* V2 takes its weights from the masked scores, V3 from the raw ones. */
		w[j] = masked[e] && p->select == K_MOE_GROUP_MAX ? 0.0f : score[e];
	}
	route_finish_weights(p, w);
}

void k_cpu_moe_route(const struct k_moe_route_params *p, const float *logits /* (M, E) */,
		     int M, int32_t *ids /* (M, top_k) */, float *weights /* (M, top_k) */)
{
	for (int m = 0; m < M; m++)
		route_row(p, logits + (size_t)m * p->n_experts, ids + (size_t)m * p->top_k,
			  weights + (size_t)m * p->top_k);
}

/* ---- forced routing and margins (the fidelity tools) ---------------------- */

int k_cpu_moe_route_forced(const struct k_moe_route_params *p, const float *logits,
			   const int32_t *ids, float *w)
{
	float score[MOE_MAX_EXPERTS], choice[MOE_MAX_EXPERTS];
	unsigned char masked[MOE_MAX_EXPERTS] = { 0 };

	for (int j = 0; j < p->top_k; j++)
		if (ids[j] < 0 || ids[j] >= p->n_experts)
			return -EINVAL;
	route_choice(p, logits, score, choice, masked);
	/* the experts were chosen elsewhere, so their groups were kept there: the raw
	 * score, as the reference weighs an expert of a kept group */
	for (int j = 0; j < p->top_k; j++)
		w[j] = score[ids[j]];
	route_finish_weights(p, w);
	return 0;
}

/* The largest of the choice values v (n) not taken; -inf where all are. */
static float route_best_left(const float *v, const unsigned char *taken, int n)
{
	int e = route_argmax(v, taken, n);

	return e < 0 ? -INFINITY : v[e];
}

float k_cpu_moe_route_margin(const struct k_moe_route_params *p, const float *logits,
			     float *choice)
{
	float score[MOE_MAX_EXPERTS], mine[MOE_MAX_EXPERTS];
	unsigned char masked[MOE_MAX_EXPERTS] = { 0 }, taken[MOE_MAX_EXPERTS] = { 0 };
	float *c = choice ? choice : mine, last = 0.0f, margin;
	int E = p->n_experts;

	route_choice(p, logits, score, c, masked);
	if (p->top_k >= E)
		return INFINITY;
	for (int j = 0; j < p->top_k; j++) {
		int e = route_argmax(c, taken, E);

		taken[e] = 1;
		last = c[e];
	}
	margin = last - route_best_left(c, taken, E);
	if (p->select != K_MOE_GREEDY && p->n_group > 0 && p->topk_group < p->n_group) {
		/* the group choice is a decision too: the last kept group against the best
		 * dropped one, by the scores the groups were ranked with (unmasked) */
		int per = E / p->n_group;
		float gs[MOE_MAX_GROUPS], raw[MOE_MAX_EXPERTS];
		unsigned char keep[MOE_MAX_GROUPS] = { 0 };

		for (int e = 0; e < E; e++)
			raw[e] = p->bias ? score[e] + p->bias[e] : score[e];
		for (int g = 0; g < p->n_group; g++)
			gs[g] = route_group_score(raw + g * per, per, p->select);
		for (int i = 0; i < p->topk_group; i++) {
			int g = route_argmax(gs, keep, p->n_group);

			keep[g] = 1;
			last = gs[g];
		}
		if (last - route_best_left(gs, keep, p->n_group) < margin)
			margin = last - route_best_left(gs, keep, p->n_group);
	}
	return margin;
}

/* ---- experts ------------------------------------------------------------- */

/* Which (row, slot) pairs chose each expert, rows ascending (a counting sort). */
struct moe_plan {
	int *start;	/* (n_experts + 1) first entry of each expert */
	int *entry;	/* (M * top_k) m * top_k + j */
	int max_rows;	/* most rows any expert got */
};

static int moe_plan_build(struct moe_plan *pl, const int32_t *ids, int M, int top_k,
			  int n_experts)
{
	int n = M * top_k;

	pl->start = calloc((size_t)n_experts + 1, sizeof(int));
	pl->entry = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
	if (!pl->start || !pl->entry)
		return -ENOMEM;
	/* An id outside [0, n_experts) (never from the router; callers may pass anything)
	 * selects no expert: the pair contributes nothing, as on the GPU. */
	for (int i = 0; i < n; i++)
		if (ids[i] >= 0 && ids[i] < n_experts)
			pl->start[ids[i] + 1]++;
	pl->max_rows = 0;
	for (int e = 0; e < n_experts; e++) {
		if (pl->start[e + 1] > pl->max_rows)
			pl->max_rows = pl->start[e + 1];
		pl->start[e + 1] += pl->start[e];
	}
	/* start[e] is now where expert e begins; filling advances it to where e
	 * ends, and the shift below restores the beginnings. */
	for (int i = 0; i < n; i++)
		if (ids[i] >= 0 && ids[i] < n_experts)
			pl->entry[pl->start[ids[i]]++] = i;
	for (int e = n_experts - 1; e > 0; e--)
		pl->start[e] = pl->start[e - 1];
	pl->start[0] = 0;
	return 0;
}

/* Activation buffers for the largest expert batch. */
struct moe_bufs {
	float *x;	/* (max_rows, hidden) gathered inputs */
	float *gate;	/* (max_rows, inter) */
	float *up;	/* (max_rows, inter) */
	float *y;	/* (max_rows, hidden) expert outputs */
};

static float *moe_bufs_alloc(struct moe_bufs *b, int rows, int hidden, int inter)
{
	size_t nh = (size_t)rows * hidden, ni = (size_t)rows * inter;
	float *p = malloc(sizeof(float) * (2 * nh + 2 * ni + 1));

	if (!p)
		return NULL;
	b->x = p;
	b->gate = b->x + nh;
	b->up = b->gate + ni;
	b->y = b->up + ni;
	return p;
}

/* Runs expert e on its n gathered rows and adds w * y into out, like HF's
 * index_add_ of the weighted expert output. */
static void moe_run_expert(struct k_pool *pool, float *out, const float *x,
			   const int *entry, int n, const float *weights, int top_k,
			   const struct k_expert *ex, enum k_dtype dtype, int hidden,
			   int inter, struct moe_bufs *b)
{
	for (int i = 0; i < n; i++)
		memcpy(b->x + (size_t)i * hidden, x + (size_t)(entry[i] / top_k) * hidden,
		       sizeof(float) * (size_t)hidden);
	k_cpu_linear_q(pool, b->gate, b->x, ex->gate, dtype, &ex->gate_q, n, inter, hidden);
	k_cpu_linear_q(pool, b->up, b->x, ex->up, dtype, &ex->up_q, n, inter, hidden);
	k_cpu_silu_mul(b->gate, b->gate, b->up, (size_t)n * inter);
	k_cpu_linear_q(pool, b->y, b->gate, ex->down, dtype, &ex->down_q, n, hidden, inter);
	for (int i = 0; i < n; i++) {
		float *o = out + (size_t)(entry[i] / top_k) * hidden;
		const float *y = b->y + (size_t)i * hidden;
		float w = weights[entry[i]];

		for (int c = 0; c < hidden; c++) {
			float wy = y[c] * w;

			o[c] += wy;
		}
	}
}

int k_cpu_moe_experts(struct k_pool *pool, float *out /* (M, hidden) */,
		      const float *x /* (M, hidden) */, int M,
		      const int32_t *ids /* (M, top_k) */, const float *weights /* (M, top_k) */,
		      int top_k, const struct k_expert *experts /* (n_experts) */,
		      int n_experts, enum k_dtype dtype, int hidden, int inter)
{
	struct moe_plan pl = { 0 };
	struct moe_bufs b;
	float *mem = NULL;
	int ret;

	ret = moe_plan_build(&pl, ids, M, top_k, n_experts);
	if (ret)
		goto out_free;
	mem = moe_bufs_alloc(&b, pl.max_rows, hidden, inter);
	if (!mem) {
		ret = -ENOMEM;
		goto out_free;
	}
	memset(out, 0, sizeof(float) * (size_t)M * hidden);
	/* Increasing expert id: each row accumulates in the order HF's loop adds. */
	for (int e = 0; e < n_experts; e++) {
		int n = pl.start[e + 1] - pl.start[e];

		if (n)
			moe_run_expert(pool, out, x, pl.entry + pl.start[e], n, weights, top_k,
				       &experts[e], dtype, hidden, inter, &b);
	}
out_free:
	free(mem);
	free(pl.entry);
	free(pl.start);
	return ret;
}
