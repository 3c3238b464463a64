/* Tensor-parallel shards (docs/PARALLEL.md's table): query heads, KV heads (replicated
 * when fewer than ranks), MLA query heads, intermediate columns of dense MLPs, shared and
 * routed experts (or, expert parallel, a share of the routed experts whole and a slice
 * of the shared one), and vocabulary rows, each rank's part copied into one
 * allocation of its own. Replicated: norms, the router, MLA's latent projections.
 * From a mapped model (model_load_opts.mapped) each slice is read straight from the
 * files and the pages read are given back tensor by tensor, so building the shards
 * never holds the whole model; from a mapped GGUF each slice is dequantized alone
 * (model_gguf_shard.c). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "daemon/base/sigbus_guard.h"
#include "daemon/model/model_gguf.h"
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

/* Two passes over the same calls: the first (buf NULL) sums the bytes and checks that a
 * mapped GGUF holds every slice, the second copies. */
struct arena {
	char *buf;
	size_t used;
	const struct model *src;	/* what the copies read: its pages given back after */
	char *err;			/* the first slice that cannot be made, or NULL */
	size_t err_len;
	int bad;
	int ret;			/* the copying pass: its first error (a GGUF slice's) */
	struct model_gguf_scratch sc;	/* a mapped GGUF's dequantization rows */
};

/* bytes of the source at src into dst: a copy, or a lazy synthetic model's values made
 * for just that range (model_synthetic_read). */
static void src_read(struct arena *a, void *dst, const void *src, size_t bytes)
{
	if (!a->src->synth_jobs) {
		memcpy(dst, src, bytes);
		return;
	}
	if (model_synthetic_read(a->src, dst, src, bytes) && !a->ret)
		a->ret = -EINVAL;	/* a slice off its tensor: a bug, never a user's input */
}

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

/* Bytes of one stored row of t's payload, and of columns [c0, c0 + n) of it (int4:
 * eight to a 32-bit word; the caller checks c0 is a word's first). */
static size_t col_bytes(const struct model_tensor *t, int64_t n)
{
	if (t->q.fmt == K_Q_INT4)
		return (size_t)((n + 7) / 8) * 4;
	if (t->q.fmt == K_Q_FP8)
		return (size_t)n;
	return (size_t)n * k_dtype_size(t->dtype);
}

static int64_t gcd64(int64_t a, int64_t b)
{
	while (b) {
		int64_t t = a % b;

		a = b;
		b = t;
	}
	return a;
}

/* The block size of [x0, x0 + n) of a dimension cut in blocks of b, in the slice: b
 * where the slice keeps the scale blocks (it starts on a block, or lies within one,
 * whose one scale then serves it); else gcd(b, x0 mod b), the largest size whose
 * blocks, counted from x0, each lie within one of the source's (a rank of Qwen3-30B-A3B
 * fp8 at tp 8 holds 96 of an expert's 768 rows: its 128-row blocks restated as 32-row
 * ones, the same scales repeated; the values dequantize to the same floats). */
static int64_t slice_block(int64_t x0, int64_t n, int64_t b)
{
	if (b <= 1 || x0 % b == 0 || x0 / b == (x0 + n - 1) / b)
		return b;
	return gcd64(b, x0 % b);
}

/* The scales rows [r0, r0 + nr) and columns [c0, c0 + nc) of t use, in blocks of
 * (slice_block of each dimension): element (i, j) of the slice is element (r0 + i,
 * c0 + j) of t, whose scale is [(r0 + i) / br][(c0 + j) / bc]; block (u, v) of the
 * slice lies within the source's block [(r0 + u bn) / br][(c0 + v bk) / bc]: where the
 * columns keep theirs (bk = bc), a run of that scale row. */
static void slice_scales(struct arena *a, struct k_quant *q, const struct model_tensor *t, int64_t r0,
			 int64_t nr, int64_t c0, int64_t nc)
{
	int64_t br = t->q.block_rows, bc = t->q.block_cols;
	int64_t bn = slice_block(r0, nr, br), bk = slice_block(c0, nc, bc);
	int64_t s0 = r0 / br, s_end = (r0 + nr - 1) / br + 1;
	int64_t k0 = c0 / bc, k_src = (c0 + nc - 1) / bc - k0 + 1;	/* source scales a row */
	int64_t sn = (nr + bn - 1) / bn, kn = (nc + bk - 1) / bk;
	size_t es = k_dtype_size(t->q.scale_dtype);
	char *p = take(a, (size_t)(sn * kn) * es), *row = NULL;

	*q = t->q;
	q->scale = p;
	q->block_rows = (int)bn;
	q->block_cols = (int)bk;
	q->scale_cols = kn;
	if (!p || !t->q.scale)
		return;
	if (bk != bc && !(row = malloc((size_t)k_src * es))) {
		a->ret = a->ret ? a->ret : -ENOMEM;
		return;
	}
	for (int64_t u = 0; u < sn; u++) {
		int64_t s = (r0 + u * bn) / br;
		const char *src = (const char *)t->q.scale + (size_t)(s * t->q.scale_cols + k0) * es;

		if (!row) {	/* the columns keep their blocks: one run */
			src_read(a, p + (size_t)(u * kn) * es, src, (size_t)kn * es);
			continue;
		}
		src_read(a, row, src, (size_t)k_src * es);
		for (int64_t v = 0; v < kn; v++)
			memcpy(p + (size_t)(u * kn + v) * es, row + (size_t)((c0 + v * bk) / bc - k0) * es, es);
	}
	free(row);
	done_with(a, (const char *)t->q.scale + (size_t)(s0 * t->q.scale_cols) * es,
		  (size_t)((s_end - s0) * t->q.scale_cols) * es);
}

/* Columns [c0, c0 + n) of one int4 row (words of eight nibbles, low first) into dst,
 * from its first nibble on; the last word's unused nibbles hold 8 (the value 0). */
static void int4_cols(char *dst, const char *src, int64_t c0, int64_t n)
{
	for (int64_t w = 0; w < (n + 7) / 8; w++) {
		uint32_t out = 0;

		for (int k = 0; k < 8; k++) {
			int64_t j = w * 8 + k, c = c0 + j;
			uint32_t word, nib = 8;

			if (j < n) {
				memcpy(&word, src + (size_t)(c / 8) * 4, 4);
				nib = word >> (4 * (c % 8)) & 0xfu;
			}
			out |= nib << (4 * k);
		}
		memcpy(dst + (size_t)w * 4, &out, 4);
	}
}

/* A mapped GGUF's slice, dequantized from the file into the shard (the first pass
 * checks that the mapping holds it). */
static void gguf_slice(struct arena *a, struct model_tensor *dst, const struct model_tensor *t,
		       int64_t r0, int64_t nr, int64_t c0, int64_t nc)
{
	char *p = take(a, (size_t)nr * col_bytes(t, nc));
	int ret;

	if (!a->buf) {
		if (model_gguf_slice(a->src, t, r0, nr, c0, nc, NULL, NULL, a->bad ? NULL : a->err,
				     a->err_len))
			a->bad++;
		return;
	}
	ret = model_gguf_slice(a->src, t, r0, nr, c0, nc, p, &a->sc, NULL, 0);
	if (ret && !a->ret)
		a->ret = ret;
	dst->data = p;
}

/* Rows [r0, r0 + nr) and columns [c0, c0 + nc) of t into the shard, stored (nr, nc):
 * the payload as stored (quantized: its bytes, and the scales it uses). */
static void slice(struct arena *a, struct model_tensor *dst, const struct model_tensor *t, int64_t r0,
		  int64_t nr, int64_t c0, int64_t nc)
{
	size_t row = col_bytes(t, t->cols), off = col_bytes(t, c0), len = col_bytes(t, nc);
	int quant = t->q.fmt != K_Q_NONE;
	char *p;

	*dst = (struct model_tensor){ .dtype = t->dtype, .rows = nr, .cols = nc };
	if (!t->data)
		return;
	if (a->src->mapped && a->src->gguf) {
		gguf_slice(a, dst, t, r0, nr, c0, nc);
		return;
	}
	p = take(a, (size_t)nr * len);
	if (p && t->q.fmt == K_Q_INT4 && c0 % 8) {	/* not on a word: the nibbles moved */
		char *tmp = a->src->synth_jobs ? malloc(row) : NULL;

		if (a->src->synth_jobs && !tmp) {
			a->ret = a->ret ? a->ret : -ENOMEM;
			return;
		}
		for (int64_t i = 0; i < nr; i++) {
			const char *src = (const char *)t->data + (size_t)(r0 + i) * row;

			if (tmp)	/* lazy: the whole source row made first */
				src_read(a, tmp, src, row);
			int4_cols(p + (size_t)i * len, tmp ? tmp : src, c0, nc);
		}
		free(tmp);
	} else if (p && nc == t->cols) {	/* whole rows: one run */
		src_read(a, p, (const char *)t->data + (size_t)r0 * row, (size_t)nr * len);
	} else if (p) {
		for (int64_t i = 0; i < nr; i++)
			src_read(a, p + (size_t)i * len, (const char *)t->data + (size_t)(r0 + i) * row + off,
				 len);
	}
	if (p)
		done_with(a, (const char *)t->data + (size_t)r0 * row, (size_t)nr * row);
	dst->data = p;
	if (quant)
		slice_scales(a, &dst->q, t, r0, nr, c0, nc);
}

/* Rows [r0, r0 + n) of t, all its columns. */
static void rows(struct arena *a, struct model_tensor *dst, const struct model_tensor *t, int64_t r0,
		 int64_t n)
{
	slice(a, dst, t, r0, n, 0, t->cols);
}

static void whole(struct arena *a, struct model_tensor *dst, const struct model_tensor *t)
{
	rows(a, dst, t, 0, t->rows);
}

/* Columns [c0, c0 + n) of every row of t, stored (rows, n). */
static void cols(struct arena *a, struct model_tensor *dst, const struct model_tensor *t, int64_t c0,
		 int64_t n)
{
	slice(a, dst, t, 0, t->rows, c0, n);
}

/* Expert e of layer L as a tensor: which (0 gate, 1 up, 2 down). */
static struct model_tensor expert_view(const struct model_layer *L, const struct model_config *c, int e,
				       int which)
{
	const struct k_expert *x = &L->experts[e];
	int64_t H = c->hidden_size, I = c->moe_intermediate_size;
	struct model_tensor t = { .dtype = L->expert_dtype, .rows = which == 2 ? H : I,
				  .cols = which == 2 ? I : H };

	t.data = which == 0 ? x->gate : which == 1 ? x->up : x->down;
	t.q = which == 0 ? x->gate_q : which == 1 ? x->up_q : x->down_q;
	return t;
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
	int64_t il = c->moe_intermediate_size / n;
	int E = c->n_experts;

	whole(a, &d->router, &L->router);
	d->expert_dtype = L->expert_dtype;
	if (a->buf) {
		d->experts = calloc((size_t)E, sizeof(*d->experts));
		if (!d->experts || copy_router_bias(d, L, E))
			return -ENOMEM;
	}
	for (int e = 0; e < E; e++) {
		struct model_tensor g = expert_view(L, c, e, 0), u = expert_view(L, c, e, 1);
		struct model_tensor dn = expert_view(L, c, e, 2), sg, su, sd;

		rows(a, &sg, &g, r * il, il);
		rows(a, &su, &u, r * il, il);
		cols(a, &sd, &dn, r * il, il);
		if (a->buf)
			d->experts[e] = (struct k_expert){ .gate = sg.data, .up = su.data, .down = sd.data,
							   .gate_q = sg.q, .up_q = su.q, .down_q = sd.q };
	}
	return 0;
}

/* Expert parallel: this rank's experts whole, renumbered from 0. */
static int shard_experts_whole(struct arena *a, struct model_layer *d, const struct model_layer *L,
			       const struct model_config *c, int r, int n)
{
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
		struct model_tensor g = expert_view(L, c, e0 + e, 0), u = expert_view(L, c, e0 + e, 1);
		struct model_tensor dn = expert_view(L, c, e0 + e, 2), sg, su, sd;

		whole(a, &sg, &g);
		whole(a, &su, &u);
		whole(a, &sd, &dn);
		if (a->buf)
			d->experts[e] = (struct k_expert){ .gate = sg.data, .up = su.data, .down = sd.data,
							   .gate_q = sg.q, .up_q = su.q, .down_q = sd.q };
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
		/* the shared expert: sliced as the dense MLP, with expert parallel too (whole on
		 * rank 0 it made that rank read its bytes alone: DeepSeek-V3's 88 MB a layer in
		 * bf16, against ~88 MB of routed experts a rank at batch 1 and tp 8); whole on
		 * rank 0 where n does not divide its width */
		if (L->w_gate.data && L->is_moe && ep && L->w_gate.rows % n) {
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

/* The copying pass, with a mapped source's SIGBUS (a file shrunk under the mapping)
 * turned into -EIO: everything it allocates hangs off s, which the caller frees. */
struct copy_job {
	struct arena *a;
	struct model *s;
	const struct model *m;
	int r, n, ep;
};

static int copy_job_run(void *arg)
{
	struct copy_job *j = arg;

	return shard_all(j->a, j->s, j->m, j->r, j->n, j->ep);
}

static int copy_guarded(struct arena *a, struct model *s, const struct model *m, int r, int n,
			int ep)
{
	struct copy_job j = { a, s, m, r, n, ep };

	return m->mapped ? sigbus_guard_run(copy_job_run, &j) : copy_job_run(&j);
}

int model_shard_create(struct model **out, const struct model *m, int r, int n, int ep, char *err,
		       size_t err_len)
{
	struct arena a = { 0 };
	struct model *s;
	int ret;

	*out = NULL;
	if ((ret = model_shard_check(&m->cfg, n, ep, err, err_len)))
		return ret;
	if (r < 0 || r >= n)
		return -EINVAL;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	shard_config(&s->cfg, &m->cfg, r, n, ep);
	if (ep && m->cfg.n_experts > 0) {	/* the router still scores all E */
		int e0;

		model_shard_experts(m->cfg.n_experts, r, n, &e0, &s->held_experts);
	}
	s->synthetic = m->synthetic;
	s->path = strdup(m->path ? m->path : "");
	s->layers = calloc((size_t)m->cfg.n_layers, sizeof(*s->layers));
	if (!s->path || !s->layers) {
		ret = -ENOMEM;
		goto fail;
	}
	s->n_quantized = m->n_quantized;
	a = (struct arena){ .src = m, .err = err, .err_len = err_len };
	shard_all(&a, s, m, r, n, ep);	/* sizes, and whether a mapped GGUF holds each slice */
	if (a.bad) {
		ret = -EINVAL;
		goto fail;
	}
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
	ret = copy_guarded(&a, s, m, r, n, ep);
	free(a.sc.buf);
	if (!ret && a.ret) {
		ret = a.ret;
		snprintf(err, err_len, "tp %d: rank %d: a slice of %s could not be made (%d)", n, r,
			 m->path ? m->path : "the GGUF", ret);
	}
	if (ret == -EIO && m->mapped)
		snprintf(err, err_len, "tp %d: rank %d: a weight file of %s shrank while its shard was "
			 "read (SIGBUS on the mapping): start again once the files are whole", n, r,
			 m->path ? m->path : "the model");
	if (ret)
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
