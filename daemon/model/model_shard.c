/* Tensor-parallel shards (docs/PARALLEL.md's table): query heads, KV heads (replicated
 * when fewer than ranks), MLA query heads, intermediate columns of dense MLPs, shared and
 * routed experts (or, expert parallel, a share of the routed experts whole and the
 * shared one on rank 0), and vocabulary rows, each rank's part copied into one
 * allocation of its own. Replicated: norms, the router, MLA's latent projections.
 * From a mapped model (model_load_opts.mapped) each slice is read straight from the
 * files and the pages read are given back tensor by tensor, so building the shards
 * never holds the whole model. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "daemon/model/model_shard.h"

#define SHARD_ALIGN 64

int model_shard_check(const struct model_config *c, int n, int ep, char *err, size_t err_len)
{
	const char *t = c->model_type;

	if (n < 1 || n > MODEL_SHARD_MAX_RANKS) {
		snprintf(err, err_len, "tp %d: between 1 and %d", n, MODEL_SHARD_MAX_RANKS);
		return -EINVAL;
	}
	if (c->n_heads % n) {
		snprintf(err, err_len, "tp %d does not divide %d query heads of %s", n, c->n_heads, t);
		return -EINVAL;
	}
	if (!c->mla && c->n_kv_heads % n && n % c->n_kv_heads) {
		snprintf(err, err_len,
			 "tp %d does not divide %d KV heads of %s, nor do they divide it (replication)",
			 n, c->n_kv_heads, t);
		return -EINVAL;
	}
	if (model_config_has_dense_layer(c) && c->intermediate_size % n) {
		snprintf(err, err_len, "tp %d does not divide the dense MLP's %d intermediate columns of %s",
			 n, c->intermediate_size, t);
		return -EINVAL;
	}
	if (ep && c->n_experts < n) {
		snprintf(err, err_len, "tp %d with expert parallel: %s has %d routed experts, fewer than ranks",
			 n, t, c->n_experts);
		return -EINVAL;
	}
	if (!ep && c->n_experts > 0 && c->moe_intermediate_size % n) {
		snprintf(err, err_len, "tp %d does not divide the experts' %d intermediate columns of %s",
			 n, c->moe_intermediate_size, t);
		return -EINVAL;
	}
	if (c->vocab_size < n) {
		snprintf(err, err_len, "tp %d is more than the %d vocabulary rows of %s", n, c->vocab_size, t);
		return -EINVAL;
	}
	return 0;
}

void model_shard_vocab(int vocab, int r, int n, int *first, int *count)
{
	int base = vocab / n, extra = vocab % n;

	*first = r * base + (r < extra ? r : extra);
	*count = base + (r < extra ? 1 : 0);
}

void model_shard_experts(int n_experts, int r, int n, int *first, int *count)
{
	model_shard_vocab(n_experts, r, n, first, count);	/* the same even split */
}

/* Two passes over the same calls: the first (buf NULL) sums the bytes, the second copies. */
struct arena {
	char *buf;
	size_t used;
	const struct model *src;	/* what the copies read: its pages given back after */
};

/* A source region copied: its file pages go back (a mapped source). */
static void done_with(struct arena *a, const void *p, size_t bytes)
{
	model_release_pages(a->src, p, bytes);
}

static void *take(struct arena *a, size_t bytes)
{
	void *p = a->buf ? a->buf + a->used : NULL;

	a->used += (bytes + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN;
	return p;
}

/* Rows [r0, r0 + n) of t, all its columns. */
static void *copy_rows_raw(struct arena *a, const struct model_tensor *t, int64_t r0, int64_t n)
{
	size_t row = (size_t)t->cols * k_dtype_size(t->dtype);
	void *p = take(a, (size_t)n * row);

	if (p) {
		memcpy(p, (const char *)t->data + (size_t)r0 * row, (size_t)n * row);
		done_with(a, (const char *)t->data + (size_t)r0 * row, (size_t)n * row);
	}
	return p;
}

static void rows(struct arena *a, struct model_tensor *dst, const struct model_tensor *t, int64_t r0,
		 int64_t n)
{
	*dst = (struct model_tensor){ .dtype = t->dtype, .rows = n, .cols = t->cols };
	dst->data = t->data ? copy_rows_raw(a, t, r0, n) : NULL;
}

static void whole(struct arena *a, struct model_tensor *dst, const struct model_tensor *t)
{
	rows(a, dst, t, 0, t->rows);
}

/* Columns [c0, c0 + n) of every row of t, stored (rows, n). */
static const void *copy_cols_raw(struct arena *a, const void *data, enum k_dtype dt, int64_t n_rows,
				 int64_t cols, int64_t c0, int64_t n)
{
	size_t es = k_dtype_size(dt);
	char *p = take(a, (size_t)n_rows * (size_t)n * es);

	if (p) {
		for (int64_t i = 0; i < n_rows; i++)
			memcpy(p + (size_t)i * (size_t)n * es,
			       (const char *)data + ((size_t)i * (size_t)cols + (size_t)c0) * es,
			       (size_t)n * es);
		done_with(a, data, (size_t)n_rows * (size_t)cols * es);
	}
	return p;
}

static void cols(struct arena *a, struct model_tensor *dst, const struct model_tensor *t, int64_t c0,
		 int64_t n)
{
	*dst = (struct model_tensor){ .dtype = t->dtype, .rows = t->rows, .cols = n };
	dst->data = t->data ? copy_cols_raw(a, t->data, t->dtype, t->rows, t->cols, c0, n) : NULL;
}

static void shard_gqa(struct arena *a, struct model_layer *d, const struct model_layer *L,
		      const struct model_config *c, int r, int n)
{
	int64_t D = c->head_dim, hl = c->n_heads / n;
	int64_t kvl = c->n_kv_heads >= n ? c->n_kv_heads / n : 1;
	int64_t kv0 = (int64_t)r * c->n_kv_heads / n;	/* KV < n: the head rank r's queries read */

	rows(a, &d->wq, &L->wq, r * hl * D, hl * D);
	rows(a, &d->wk, &L->wk, kv0 * D, kvl * D);
	rows(a, &d->wv, &L->wv, kv0 * D, kvl * D);
	cols(a, &d->wo, &L->wo, r * hl * D, hl * D);
	if (L->q_norm.data)
		whole(a, &d->q_norm, &L->q_norm);
	if (L->k_norm.data)
		whole(a, &d->k_norm, &L->k_norm);
}

static void shard_mla(struct arena *a, struct model_layer *d, const struct model_layer *L,
		      const struct model_config *c, int r, int n)
{
	int64_t hl = c->n_heads / n, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
	int64_t kvb = c->qk_nope_head_dim + c->v_head_dim, vd = c->v_head_dim;

	if (L->wq_a.data) {
		whole(a, &d->wq_a, &L->wq_a);
		whole(a, &d->q_a_norm, &L->q_a_norm);
	}
	rows(a, &d->wq_b, &L->wq_b, r * hl * qk, hl * qk);
	whole(a, &d->wkv_a, &L->wkv_a);
	whole(a, &d->kv_a_norm, &L->kv_a_norm);
	rows(a, &d->wkv_b, &L->wkv_b, r * hl * kvb, hl * kvb);
	cols(a, &d->wo, &L->wo, r * hl * vd, hl * vd);
}

/* A SwiGLU MLP (dense, or the shared expert): gate and up by rows, down by columns. */
static void shard_mlp(struct arena *a, struct model_layer *d, const struct model_layer *L, int r, int n)
{
	int64_t il = L->w_gate.rows / n;

	rows(a, &d->w_gate, &L->w_gate, r * il, il);
	rows(a, &d->w_up, &L->w_up, r * il, il);
	cols(a, &d->w_down, &L->w_down, r * il, il);
}


/* Every rank routes over all E experts: the router's bias whole (none: 0). */
static int copy_router_bias(struct model_layer *d, const struct model_layer *L, int E)
{
	if (!L->router_bias)
		return 0;
	d->router_bias = malloc(sizeof(float) * (size_t)E);
	if (!d->router_bias)
		return -ENOMEM;
	memcpy(d->router_bias, L->router_bias, sizeof(float) * (size_t)E);
	return 0;
}

/* Every expert sliced as the dense MLP: a 1/n slice of each (tensor-parallel experts). */
static int shard_experts(struct arena *a, struct model_layer *d, const struct model_layer *L,
			 const struct model_config *c, int r, int n)
{
	int64_t H = c->hidden_size, I = c->moe_intermediate_size, il = I / n;
	size_t es = k_dtype_size(L->expert_dtype);
	int E = c->n_experts;

	whole(a, &d->router, &L->router);
	d->expert_dtype = L->expert_dtype;
	if (!a->buf) {
		for (int e = 0; e < E; e++) {
			take(a, (size_t)(2 * il * H) * es);
			take(a, (size_t)(H * il) * es);
		}
		return 0;
	}
	d->experts = calloc((size_t)E, sizeof(*d->experts));
	if (!d->experts || copy_router_bias(d, L, E))
		return -ENOMEM;
	for (int e = 0; e < E; e++) {
		char *gu = take(a, (size_t)(2 * il * H) * es);

		memcpy(gu, (const char *)L->experts[e].gate + (size_t)(r * il * H) * es, (size_t)(il * H) * es);
		memcpy(gu + (size_t)(il * H) * es, (const char *)L->experts[e].up + (size_t)(r * il * H) * es,
		       (size_t)(il * H) * es);
		done_with(a, (const char *)L->experts[e].gate + (size_t)(r * il * H) * es, (size_t)(il * H) * es);
		done_with(a, (const char *)L->experts[e].up + (size_t)(r * il * H) * es, (size_t)(il * H) * es);
		d->experts[e].gate = gu;
		d->experts[e].up = gu + (size_t)(il * H) * es;
		d->experts[e].down = copy_cols_raw(a, L->experts[e].down, L->expert_dtype, H, I, r * il, il);
	}
	return 0;
}

/* Expert parallel: this rank's experts whole, renumbered from 0. */
static int shard_experts_whole(struct arena *a, struct model_layer *d, const struct model_layer *L,
			       const struct model_config *c, int r, int n)
{
	size_t bytes = (size_t)c->moe_intermediate_size * (size_t)c->hidden_size *
		       k_dtype_size(L->expert_dtype);
	int e0, ne, E = c->n_experts;

	whole(a, &d->router, &L->router);
	d->expert_dtype = L->expert_dtype;
	model_shard_experts(E, r, n, &e0, &ne);
	if (a->buf) {
		d->experts = calloc((size_t)ne, sizeof(*d->experts));
		if (!d->experts || copy_router_bias(d, L, E))
			return -ENOMEM;
	}
	for (int e = 0; e < ne; e++) {
		const struct k_expert *x = &L->experts[e0 + e];
		void *g = take(a, bytes), *u = take(a, bytes), *dn = take(a, bytes);

		if (!a->buf)
			continue;
		memcpy(g, x->gate, bytes);
		memcpy(u, x->up, bytes);
		memcpy(dn, x->down, bytes);
		done_with(a, x->gate, bytes);
		done_with(a, x->up, bytes);
		done_with(a, x->down, bytes);
		d->experts[e] = (struct k_expert){ .gate = g, .up = u, .down = dn };
	}
	return 0;
}

/* One pass over every tensor of the shard (buf NULL: sizes only). */
static int shard_all(struct arena *a, struct model *s, const struct model *m, int r, int n, int ep)
{
	const struct model_config *c = &m->cfg;
	int v0, vn, ret;

	model_shard_vocab(c->vocab_size, r, n, &v0, &vn);
	rows(a, &s->embed, &m->embed, v0, vn);
	whole(a, &s->final_norm, &m->final_norm);
	if (m->lm_head.data == m->embed.data)
		s->lm_head = s->embed;	/* tied: the same rows */
	else
		rows(a, &s->lm_head, &m->lm_head, v0, vn);
	for (int l = 0; l < c->n_layers; l++) {
		const struct model_layer *L = &m->layers[l];
		struct model_layer *d = &s->layers[l];

		whole(a, &d->attn_norm, &L->attn_norm);
		whole(a, &d->ffn_norm, &L->ffn_norm);
		if (c->mla)
			shard_mla(a, d, L, c, r, n);
		else
			shard_gqa(a, d, L, c, r, n);
		if (L->w_gate.data && L->is_moe && ep) {	/* the shared expert: rank 0's */
			if (r == 0) {
				whole(a, &d->w_gate, &L->w_gate);
				whole(a, &d->w_up, &L->w_up);
				whole(a, &d->w_down, &L->w_down);
			}
		} else if (L->w_gate.data) {
			shard_mlp(a, d, L, r, n);
		}
		d->is_moe = L->is_moe;
		if (L->is_moe && (ret = ep ? shard_experts_whole(a, d, L, c, r, n)
					   : shard_experts(a, d, L, c, r, n)))
			return ret;
	}
	return 0;
}

/* The rank's config: its heads, widths and vocabulary rows. */
static void shard_config(struct model_config *sc, const struct model_config *c, int r, int n, int ep)
{
	int v0;

	*sc = *c;
	sc->n_heads = c->n_heads / n;
	sc->n_kv_heads = c->mla ? sc->n_heads : c->n_kv_heads >= n ? c->n_kv_heads / n : 1;
	sc->intermediate_size = c->intermediate_size / n;
	sc->moe_intermediate_size = ep ? c->moe_intermediate_size : c->moe_intermediate_size / n;
	model_shard_vocab(c->vocab_size, r, n, &v0, &sc->vocab_size);
}

int model_shard_create(struct model **out, const struct model *m, int r, int n, int ep, char *err,
		       size_t err_len)
{
	struct arena a = { 0 };
	struct model *s;
	int ret;

	*out = NULL;
	if (n > 1 && m->n_quantized) {	/* the shards copy payloads, not the scales beside them */
		snprintf(err, err_len, "%d weights are quantized; tensor parallel runs bf16/fp32 "
			 "weights only for now", m->n_quantized);
		return -EOPNOTSUPP;
	}
	if ((ret = model_shard_check(&m->cfg, n, ep, err, err_len)))
		return ret;
	if (r < 0 || r >= n)
		return -EINVAL;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	shard_config(&s->cfg, &m->cfg, r, n, ep);
	s->synthetic = m->synthetic;
	s->path = strdup(m->path ? m->path : "");
	s->layers = calloc((size_t)m->cfg.n_layers, sizeof(*s->layers));
	if (!s->path || !s->layers) {
		ret = -ENOMEM;
		goto fail;
	}
	shard_all(&a, s, m, r, n, ep);	/* sizes */
	s->weight_bytes = a.used;
	/* pages of its own (not malloc's), which model_shard_drop_host can give back */
	s->shard_bytes = a.used ? a.used : 1;
	s->shard_buf = mmap(NULL, s->shard_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			    -1, 0);
	if (s->shard_buf == MAP_FAILED)
		s->shard_buf = NULL;
	if (!s->shard_buf) {
		snprintf(err, err_len, "tp %d: out of memory for rank %d's %.1f MiB of weights", n, r,
			 (double)a.used / (1 << 20));
		ret = -ENOMEM;
		goto fail;
	}
	a = (struct arena){ .buf = s->shard_buf, .src = m };
	if ((ret = shard_all(&a, s, m, r, n, ep)))
		goto fail;
	*out = s;
	return 0;
fail:
	if (ret == -ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "tp %d: out of memory building rank %d's shard", n, r);
	model_destroy(s);
	return ret;
}

void model_shard_drop_host(struct model *s)
{
	if (s && s->shard_buf)
		madvise(s->shard_buf, s->shard_bytes, MADV_DONTNEED);
}
