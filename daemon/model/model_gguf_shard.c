/* Tensor-parallel slices of a mapped GGUF (docs/PARALLEL.md, "Loading"): each rank's
 * rows and columns of a weight read from the file's mapping and dequantized alone,
 * with the same calls, in the same dtype, and through the same layout fixes as
 * model_gguf_bind's whole copy, so a slice holds exactly the bits that copy would hold
 * there. A ggml block runs along a row (ne[0]): a row split keeps blocks whole; a
 * column run that starts or ends inside a block dequantizes the blocks it touches and
 * keeps its columns (dequantization is elementwise: the same values). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/model/gguf_dequant.h"
#include "daemon/model/model_gguf.h"

enum slice_kind {
	SL_ROWS,	/* the slot's rows are the tensor's (or an expert slab's), in order */
	SL_UNPERMUTE,	/* llama attn_q/attn_k: each head's rows in llama.cpp's rope order */
	SL_KV_B,	/* MLA kv_b_proj, assembled from attn_k_b and attn_v_b a head at a time */
};

struct gsrc {
	const struct gguf_tensor *t;	/* holds the slot's data */
	const struct gguf_tensor *vb;	/* SL_KV_B: attn_v_b */
	const uint8_t *base;		/* the slot's first element (an expert's slab) */
	enum slice_kind kind;
	int heads;			/* SL_UNPERMUTE */
	uint32_t be, bb;		/* elements and bytes of a block of t's type */
};

static int ends_with(const char *s, const char *tail)
{
	size_t n = strlen(s), k = strlen(tail);

	return n >= k && !strcmp(s + n - k, tail);
}

/* Bytes of n elements (whole blocks) of src's type. */
static size_t el_bytes(const struct gsrc *g, int64_t n)
{
	return (size_t)(n / g->be) * g->bb;
}

/* Which tensor of the mapping holds t, and how its rows are laid out (the names
 * model_gguf.c's src_of gives). */
static int find_src(const struct model *m, const struct model_tensor *t, struct gsrc *g)
{
	const struct gguf_file *f = m->gguf;
	const uint8_t *p = t->data;

	memset(g, 0, sizeof(*g));
	for (uint64_t i = 0; f && i < f->n_tensors; i++) {
		const uint8_t *d = f->tensors[i].data;

		if (d && p >= d && p < d + f->tensors[i].nbytes) {
			g->t = &f->tensors[i];
			break;
		}
	}
	if (!g->t || gguf_ttype_block(g->t->type, &g->be, &g->bb))
		return -ENOENT;
	g->base = p;
	if (m->cfg.arch == ARCH_LLAMA && ends_with(g->t->name, ".attn_q.weight")) {
		g->kind = SL_UNPERMUTE;
		g->heads = m->cfg.n_heads;
	} else if (m->cfg.arch == ARCH_LLAMA && ends_with(g->t->name, ".attn_k.weight")) {
		g->kind = SL_UNPERMUTE;
		g->heads = m->cfg.n_kv_heads;
	} else if (m->cfg.mla && ends_with(g->t->name, ".attn_k_b.weight")) {
		char name[GGUF_MAX_NAME + 8];

		snprintf(name, sizeof(name), "%.*s_v_b.weight",
			 (int)(strlen(g->t->name) - strlen("_k_b.weight")), g->t->name);
		g->kind = SL_KV_B;
		g->vb = gguf_find_tensor(f, name);
		if (!g->vb || !g->vb->data)
			return -ENOENT;
	}
	return 0;
}

/* fp32 values -> dst in dtype (model_gguf.c's store_f32). */
static void store(enum k_dtype dt, const float *v, int64_t n, void *dst)
{
	if (dt == K_F32) {
		memcpy(dst, v, (size_t)n * sizeof(float));
		return;
	}
	for (int64_t i = 0; i < n; i++)
		((uint16_t *)dst)[i] = k_f32_to_bf16(v[i]);
}

static float *scratch(struct model_gguf_scratch *sc, size_t n)
{
	if (sc->n < n) {
		float *p = realloc(sc->buf, n * sizeof(float));

		if (!p)
			return NULL;
		sc->buf = p;
		sc->n = n;
	}
	return sc->buf;
}

/* n elements at src (whole blocks) into dst as model_gguf_bind's plain copy does:
 * bytes as they are where the slot kept the file's dtype, else dequantized. */
static int plain(const struct gsrc *g, enum k_dtype dt, const uint8_t *src, int64_t n, void *dst)
{
	if ((dt == K_F32 && g->t->type == GGUF_TT_F32) || (dt == K_BF16 && g->t->type == GGUF_TT_BF16)) {
		memcpy(dst, src, (size_t)n * k_dtype_size(dt));
		return 0;
	}
	if (dt == K_F32)
		return gguf_dequant(g->t->type, src, n, dst);
	return gguf_dequant_bf16(g->t->type, src, n, dst);
}

/* Columns [c0, c0 + nc) of the row at src dequantized to fp32 and stored in dt: the
 * blocks the run touches dequantized whole (scratch), its columns kept. */
static int deq_cols(const struct gsrc *g, enum k_dtype dt, const uint8_t *src, int64_t c0, int64_t nc,
		    void *dst, struct model_gguf_scratch *sc)
{
	int64_t b0 = c0 / g->be * g->be, b1 = (c0 + nc + g->be - 1) / g->be * g->be;
	float *v = scratch(sc, (size_t)(b1 - b0));
	int ret;

	if (!v)
		return -ENOMEM;
	if ((ret = gguf_dequant(g->t->type, src + el_bytes(g, b0), b1 - b0, v)))
		return ret;
	store(dt, v + (c0 - b0), nc, dst);
	return 0;
}

/* The same columns as `plain` stores them: plainly on block bounds, else through
 * deq_cols (Qwen3-30B-A3B Q4_K at tp 8: 96 of an expert's 768 columns a rank, inside
 * 256-element blocks). */
static int cols_run(const struct gsrc *g, enum k_dtype dt, const uint8_t *src, int64_t c0, int64_t nc,
		    void *dst, struct model_gguf_scratch *sc)
{
	if (c0 % g->be == 0 && nc % g->be == 0)
		return plain(g, dt, src + el_bytes(g, c0), nc, dst);
	return deq_cols(g, dt, src, c0, nc, dst, sc);
}

static int fill_rows(const struct gsrc *g, const struct model_tensor *t, int64_t r0, int64_t nr,
		     int64_t c0, int64_t nc, char *dst, struct model_gguf_scratch *sc)
{
	size_t row = el_bytes(g, t->cols), es = k_dtype_size(t->dtype);
	int ret = 0;

	if (nc == t->cols)	/* whole rows: one run */
		return plain(g, t->dtype, g->base + el_bytes(g, r0 * t->cols), nr * nc, dst);
	for (int64_t i = 0; i < nr && !ret; i++)
		ret = cols_run(g, t->dtype, g->base + (size_t)(r0 + i) * row, c0, nc,
			       dst + (size_t)(i * nc) * es, sc);
	return ret;
}

/* HF row R of a head of d rows is GGUF row 2i + j of it, R = j * d/2 + i
 * (model_gguf.c's unpermute_rows, the other way round). */
static int fill_unpermuted(const struct gsrc *g, const struct model_tensor *t, int64_t r0, int64_t nr,
			   int64_t c0, int64_t nc, char *dst, struct model_gguf_scratch *sc)
{
	int64_t d = t->rows / g->heads, half = d / 2;
	size_t row = el_bytes(g, t->cols), es = k_dtype_size(t->dtype);
	int ret = 0;

	for (int64_t i = 0; i < nr && !ret; i++) {
		int64_t R = r0 + i, h = R / d, w = R % d, G = h * d + 2 * (w % half) + w / half;

		ret = deq_cols(g, t->dtype, g->base + (size_t)G * row, c0, nc,
			       dst + (size_t)(i * nc) * es, sc);
	}
	return ret;
}

/* kv_b_proj's head h: rows j < nope are column j of attn_k_b's (kv_lora, nope) slab,
 * the v rows are attn_v_b's (v, kv_lora) slab (model_gguf.c's assemble_kv_b). */
static int fill_kv_b(const struct gsrc *g, const struct model *m, const struct model_tensor *t,
		     int64_t r0, int64_t nr, int64_t c0, int64_t nc, char *dst,
		     struct model_gguf_scratch *sc)
{
	const struct model_config *c = &m->cfg;
	int64_t nope = c->qk_nope_head_dim, v = c->v_head_dim, r = c->kv_lora_rank, kvb = nope + v;
	uint32_t vbe = 1, vbb = 4;
	size_t es = k_dtype_size(t->dtype);
	float *kb = scratch(sc, (size_t)(r * kvb + nc)), *vb, *row;
	int64_t have = -1;
	int ret = kb ? 0 : -ENOMEM;

	if (ret || gguf_ttype_block(g->vb->type, &vbe, &vbb))
		return ret ? ret : -ENOENT;
	vb = kb + r * nope;
	row = vb + v * r;
	for (int64_t i = 0; i < nr && !ret; i++) {
		int64_t R = r0 + i, h = R / kvb, w = R % kvb;

		if (h != have) {	/* the head's two slabs */
			ret = gguf_dequant(g->t->type, g->base + el_bytes(g, h * r * nope), r * nope, kb);
			if (!ret)
				ret = gguf_dequant(g->vb->type, (const uint8_t *)g->vb->data +
						   (size_t)(h * v * r / vbe) * vbb, v * r, vb);
			have = h;
		}
		for (int64_t k = 0; k < nc && !ret; k++)
			row[k] = w < nope ? kb[(c0 + k) * nope + w] : vb[(w - nope) * r + c0 + k];
		if (!ret)
			store(t->dtype, row, nc, dst + (size_t)(i * nc) * es);
	}
	return ret;
}

/* The pages of the file the slice read. */
static void release(const struct gsrc *g, const struct model *m, const struct model_tensor *t,
		    int64_t r0, int64_t nr)
{
	if (g->kind == SL_ROWS) {
		model_release_pages(m, g->base + el_bytes(g, r0 * t->cols), el_bytes(g, nr * t->cols));
	} else if (g->kind == SL_UNPERMUTE) {	/* the heads the rows fall in */
		int64_t d = t->rows / g->heads, h0 = r0 / d, h1 = (r0 + nr - 1) / d + 1;

		model_release_pages(m, g->base + el_bytes(g, h0 * d * t->cols),
				    el_bytes(g, (h1 - h0) * d * t->cols));
	} else {
		model_release_pages(m, g->t->data, g->t->nbytes);
		model_release_pages(m, g->vb->data, g->vb->nbytes);
	}
}

int model_gguf_slice(const struct model *m, const struct model_tensor *t, int64_t r0, int64_t nr,
		     int64_t c0, int64_t nc, void *dst, struct model_gguf_scratch *sc, char *err,
		     size_t err_len)
{
	struct gsrc g;
	int ret;

	if (find_src(m, t, &g)) {
		if (err)
			snprintf(err, err_len, "a %lldx%lld weight is not in the mapping of %s",
				 (long long)t->rows, (long long)t->cols, m->path ? m->path : "the GGUF");
		return -ENOENT;
	}
	/* Blocks run along a row: whole rows start on one (a row holds whole blocks:
	 * ggml's rule, checked when the file was bound); a column run inside one is
	 * dequantized from the blocks it touches (cols_run). kv_b is dequantized a head at
	 * a time. */
	if (!dst)
		return 0;
	if (g.kind == SL_UNPERMUTE)
		ret = fill_unpermuted(&g, t, r0, nr, c0, nc, dst, sc);
	else if (g.kind == SL_KV_B)
		ret = fill_kv_b(&g, m, t, r0, nr, c0, nc, dst, sc);
	else
		ret = fill_rows(&g, t, r0, nr, c0, nc, dst, sc);
	if (!ret)
		release(&g, m, t, r0, nr);
	return ret;
}
