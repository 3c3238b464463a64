/* GGUF tensors -> struct model: model_for_each_tensor's walk by Hugging Face name, each
 * name translated to llama.cpp's, shape-checked, then either left in the file's image
 * (our own copy, already in the engine's dtype) or dequantized into one owned buffer, undoing the
 * converter's layout changes (llama q/k row permutation, split MLA kv_b, stacked experts). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/model/gguf_dequant.h"
#include "daemon/model/model_gguf.h"

#define BUF_ALIGN 64	/* bytes: each dequantized tensor starts on a cache line */

/* How a GGUF tensor becomes the HF one. */
enum src_kind {
	SRC_PLAIN,	/* same rows, same order */
	SRC_EXPERT,	/* slab `expert` of a (n_experts, rows, cols) stack */
	SRC_UNPERMUTE,	/* llama attn_q/attn_k: rows permuted per head for llama.cpp's rope */
	SRC_KV_B,	/* MLA kv_b_proj rebuilt from attn_k_b and attn_v_b */
};

struct src {
	enum src_kind kind;
	char name[96];		/* GGUF tensor name */
	int expert;		/* SRC_EXPERT */
	int heads;		/* SRC_UNPERMUTE: heads in this projection */
};

struct gbind {
	struct model *m;
	const struct gguf_file *f;
	const char *fname;	/* the file, for messages */
	char *err;
	size_t err_len;
	int pass;		/* 0: check and count, 1: size the copy, 2: fill; 3 (a mapped
				 * model): point each slot at its source in the mapping */
	int copy_all;		/* passes 1-2: copy even what could stay in the file's image,
				 * so the image can go (it is mostly quantized weights) */
	size_t mappable;	/* pass 1: bytes that could stay in the image */
	enum k_dtype dt;	/* dtype of dequantized weights */
	int64_t elems;		/* pass 0: elements of all weights */
	size_t used;		/* passes 1-2: bytes of m->gguf_buf handed out */
};

static const char *base_name(const char *path)
{
	const char *s = strrchr(path, '/');

	return s ? s + 1 : path;
}

/* ---- names ---------------------------------------------------------------- */

static const struct {
	const char *hf;		/* after model.layers.N. */
	const char *gguf;	/* after blk.N. */
} layer_names[] = {
	{ "input_layernorm.weight", "attn_norm.weight" },
	{ "post_attention_layernorm.weight", "ffn_norm.weight" },
	{ "self_attn.q_proj.weight", "attn_q.weight" },
	{ "self_attn.k_proj.weight", "attn_k.weight" },
	{ "self_attn.v_proj.weight", "attn_v.weight" },
	{ "self_attn.o_proj.weight", "attn_output.weight" },
	{ "self_attn.q_norm.weight", "attn_q_norm.weight" },
	{ "self_attn.k_norm.weight", "attn_k_norm.weight" },
	{ "self_attn.q_a_proj.weight", "attn_q_a.weight" },
	{ "self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight" },
	{ "self_attn.q_b_proj.weight", "attn_q_b.weight" },
	{ "self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight" },
	{ "self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight" },
	{ "self_attn.kv_b_proj.weight", "attn_kv_b.weight" },
	{ "mlp.gate_proj.weight", "ffn_gate.weight" },
	{ "mlp.up_proj.weight", "ffn_up.weight" },
	{ "mlp.down_proj.weight", "ffn_down.weight" },
	{ "mlp.gate.weight", "ffn_gate_inp.weight" },
	{ "mlp.gate.e_score_correction_bias", "exp_probs_b.bias" },
	{ "mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight" },
	{ "mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight" },
	{ "mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight" },
};

/* HF name -> where the weight is in the GGUF file. 0, or -ENOENT (no counterpart). */
static int src_of(const struct model *m, const char *hf, struct src *s)
{
	char rest[128], proj[16];
	int l, e;

	memset(s, 0, sizeof(*s));
	if (!strcmp(hf, "model.embed_tokens.weight"))
		return snprintf(s->name, sizeof(s->name), "token_embd.weight"), 0;
	if (!strcmp(hf, "model.norm.weight"))
		return snprintf(s->name, sizeof(s->name), "output_norm.weight"), 0;
	if (!strcmp(hf, "lm_head.weight"))
		return snprintf(s->name, sizeof(s->name), "output.weight"), 0;
	if (sscanf(hf, "model.layers.%d.%127s", &l, rest) != 2)
		return -ENOENT;
	if (sscanf(rest, "mlp.experts.%d.%15[a-z]_proj.weight", &e, proj) == 2) {
		s->kind = SRC_EXPERT;
		s->expert = e;
		snprintf(s->name, sizeof(s->name), "blk.%d.ffn_%s_exps.weight", l, proj);
		return 0;
	}
	for (size_t i = 0; i < sizeof(layer_names) / sizeof(layer_names[0]); i++) {
		if (strcmp(rest, layer_names[i].hf))
			continue;
		snprintf(s->name, sizeof(s->name), "blk.%d.%s", l, layer_names[i].gguf);
		if (m->cfg.arch == ARCH_LLAMA && (!strcmp(layer_names[i].gguf, "attn_q.weight") ||
						  !strcmp(layer_names[i].gguf, "attn_k.weight"))) {
			s->kind = SRC_UNPERMUTE;
			s->heads = layer_names[i].gguf[5] == 'q' ? m->cfg.n_heads : m->cfg.n_kv_heads;
		}
		if (m->cfg.mla && !strcmp(layer_names[i].gguf, "attn_kv_b.weight") &&
		    !gguf_find_tensor(m->gguf, s->name)) {
			s->kind = SRC_KV_B;	/* newer converters split it */
			snprintf(s->name, sizeof(s->name), "blk.%d.attn_k_b.weight", l);
		}
		return 0;
	}
	return -ENOENT;
}

/* ---- checks --------------------------------------------------------------- */

static void shape_text(const struct gguf_tensor *t, char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = '\0';
	for (int i = 0; i < t->n_dims && n + 24 < len; i++)
		n += (size_t)snprintf(buf + n, len - n, "%s%" PRId64, i ? ", " : "", t->ne[i]);
}

static int bind_fail_shape(struct gbind *b, const struct gguf_tensor *t, const char *hf,
			   const char *want)
{
	const char *tn = gguf_ttype_name(t->type);
	char got[96];

	shape_text(t, got, sizeof(got));
	snprintf(b->err, b->err_len, "%s: tensor '%s' (for %s): type %s, shape [%s] (ggml order), "
		 "expected [%s]", b->fname, t->name, hf, tn ? tn : "?", got, want);
	return -EINVAL;
}

/* The tensor exists, has a loadable type and ne = (ne0, ne1, ne2) (0: must be absent). */
static int check_tensor(struct gbind *b, const char *hf, const char *name,
			int64_t ne0, int64_t ne1, int64_t ne2, const struct gguf_tensor **out)
{
	const struct gguf_tensor *t = gguf_find_tensor(b->f, name);
	int dims = ne2 ? 3 : ne1 ? 2 : 1;
	char want[96], msg[256];

	*out = t;
	if (!t) {
		snprintf(b->err, b->err_len, "%s: tensor '%s' is missing (kdec's %s, needed by %s)",
			 b->fname, name, hf, b->m->cfg.model_type);
		return -EINVAL;
	}
	if (!gguf_dequant_supported(t->type) || !t->data) {
		snprintf(b->err, b->err_len, "%s: %s", b->fname,
			 gguf_dequant_refusal(msg, sizeof(msg), name, t->type));
		return -ENOTSUP;
	}
	if (t->n_dims == dims && t->ne[0] == ne0 && (dims < 2 || t->ne[1] == ne1) &&
	    (dims < 3 || t->ne[2] == ne2))
		return 0;
	if (dims == 1)
		snprintf(want, sizeof(want), "%" PRId64, ne0);
	else if (dims == 2)
		snprintf(want, sizeof(want), "%" PRId64 ", %" PRId64, ne0, ne1);
	else
		snprintf(want, sizeof(want), "%" PRId64 ", %" PRId64 ", %" PRId64, ne0, ne1, ne2);
	return bind_fail_shape(b, t, hf, want);
}

/* Bytes of n elements of t's type (n whole blocks). */
static size_t type_bytes(const struct gguf_tensor *t, int64_t n)
{
	uint32_t be = 1, bb = 4;

	gguf_ttype_block(t->type, &be, &bb);
	return (size_t)(n / be) * bb;
}

/* ---- filling -------------------------------------------------------------- */

static void *buf_take(struct gbind *b, size_t bytes)
{
	size_t at = (b->used + BUF_ALIGN - 1) / BUF_ALIGN * BUF_ALIGN;

	b->used = at + bytes;
	return b->pass == 2 ? (uint8_t *)b->m->gguf_buf + at : NULL;
}

/* n elements of type `type` at src into dst in b->dt. */
static int dequant_to(struct gbind *b, uint32_t type, const void *src, int64_t n, void *dst)
{
	if (b->dt == K_F32)
		return gguf_dequant(type, src, n, dst);
	return gguf_dequant_bf16(type, src, n, dst);
}

/* f32 rows -> dst in b->dt. */
static void store_f32(const struct gbind *b, const float *v, int64_t n, void *dst)
{
	if (b->dt == K_F32) {
		memcpy(dst, v, (size_t)n * sizeof(float));
		return;
	}
	for (int64_t i = 0; i < n; i++)
		((uint16_t *)dst)[i] = k_f32_to_bf16(v[i]);
}

/* llama.cpp's converter reorders each head's rows from HF's halves (i, i + d/2) into
 * adjacent pairs (2i, 2i+1) for its interleaved rope: GGUF row 2i+j of a head is HF
 * row j*d/2 + i. Put them back so the engine's HF-layout rope is right. */
static void unpermute_rows(const float *g, float *hf, int heads, int64_t rows, int64_t cols)
{
	int64_t d = rows / heads, half = d / 2;

	for (int h = 0; h < heads; h++)
		for (int64_t i = 0; i < half; i++)
			for (int j = 0; j < 2; j++)
				memcpy(hf + (h * d + j * half + i) * cols, g + (h * d + 2 * i + j) * cols,
				       (size_t)cols * sizeof(float));
}

/* kv_b_proj (n_heads * (nope + v), kv_lora) from attn_k_b (n_heads, kv_lora, nope),
 * stored transposed for the absorbed product, and attn_v_b (n_heads, v, kv_lora). */
static void assemble_kv_b(const float *kb, const float *vb, float *out, const struct model_config *c)
{
	int64_t nope = c->qk_nope_head_dim, v = c->v_head_dim, r = c->kv_lora_rank;

	for (int h = 0; h < c->n_heads; h++) {
		float *o = out + h * (nope + v) * r;

		for (int64_t j = 0; j < nope; j++)
			for (int64_t k = 0; k < r; k++)
				o[j * r + k] = kb[(h * r + k) * nope + j];
		memcpy(o + nope * r, vb + h * v * r, (size_t)(v * r) * sizeof(float));
	}
}

/* A copy through fp32 (for the layout fixes): dequantizes t (n elements) to a
 * temporary. NULL on -ENOMEM. */
static float *dequant_tmp(const struct gguf_tensor *t, int64_t n)
{
	float *v = malloc((size_t)n * sizeof(float));

	if (v && gguf_dequant(t->type, t->data, n, v)) {
		free(v);
		v = NULL;
	}
	return v;
}

/* attn_v_b beside attn_k_b (same block, same head count). */
static int check_v_b(struct gbind *b, const char *hf, const struct gguf_tensor *kb,
		     const struct gguf_tensor **vb)
{
	const struct model_config *c = &b->m->cfg;
	char name[96];

	snprintf(name, sizeof(name), "%.*s_v_b.weight",
		 (int)(strlen(kb->name) - strlen("_k_b.weight")), kb->name);
	return check_tensor(b, hf, name, c->kv_lora_rank, c->v_head_dim, c->n_heads, vb);
}

static int fill_kv_b(struct gbind *b, const struct gguf_tensor *kb, const struct gguf_tensor *vb,
		     void *dst)
{
	const struct model_config *c = &b->m->cfg;
	int64_t nk = (int64_t)c->n_heads * c->kv_lora_rank * c->qk_nope_head_dim;
	int64_t nv = (int64_t)c->n_heads * c->v_head_dim * c->kv_lora_rank;
	float *k = dequant_tmp(kb, nk), *v = dequant_tmp(vb, nv);
	float *all = malloc((size_t)(nk + nv) * sizeof(float));
	int ret = k && v && all ? 0 : -ENOMEM;

	if (!ret) {
		assemble_kv_b(k, v, all, c);
		store_f32(b, all, nk + nv, dst);
	}
	free(k);
	free(v);
	free(all);
	return ret;
}

static int fill_unpermuted(struct gbind *b, const struct gguf_tensor *t, const struct src *s,
			   int64_t rows, int64_t cols, void *dst)
{
	float *g = dequant_tmp(t, rows * cols), *hfv = malloc((size_t)(rows * cols) * sizeof(float));
	int ret = g && hfv ? 0 : -ENOMEM;

	if (!ret) {
		unpermute_rows(g, hfv, s->heads, rows, cols);
		store_f32(b, hfv, rows * cols, dst);
	}
	free(g);
	free(hfv);
	return ret;
}

static int bind_one(void *ctx, const char *hf, struct model_tensor *slot, int64_t rows, int64_t cols)
{
	struct gbind *b = ctx;
	const struct gguf_tensor *t, *vb = NULL;
	const uint8_t *src;
	struct src s;
	int64_t n = rows * cols;
	int ret, mapped;

	if (!slot) {
		snprintf(b->err, b->err_len, "%s: tensor for '%s': experts of one layer mix dtypes",
			 b->fname, hf);
		return -EINVAL;
	}
	if (src_of(b->m, hf, &s)) {
		snprintf(b->err, b->err_len, "%s: kdec's tensor '%s' has no GGUF counterpart",
			 b->fname, hf);
		return -ENOTSUP;
	}
	if (s.kind == SRC_KV_B) {
		const struct model_config *c = &b->m->cfg;

		ret = check_tensor(b, hf, s.name, c->qk_nope_head_dim, c->kv_lora_rank, c->n_heads, &t);
		if (!ret)
			ret = check_v_b(b, hf, t, &vb);
	} else if (s.kind == SRC_EXPERT) {
		ret = check_tensor(b, hf, s.name, cols, rows, b->m->cfg.n_experts, &t);
	} else {
		ret = check_tensor(b, hf, s.name, cols == 1 ? rows : cols, cols == 1 ? 0 : rows, 0, &t);
	}
	if (ret)
		return ret;
	if (b->pass == 0) {
		b->elems += n;
		return 0;
	}
	src = (const uint8_t *)t->data;
	if (s.kind == SRC_EXPERT)
		src += type_bytes(t, n) * (size_t)s.expert;
	/* In the file already as the engine wants it (and aligned for it: general.alignment
	 * may be below 4): use the mapping. fp32 vectors (the norms) stay fp32 even when
	 * the matrices go to bf16. */
	mapped = (s.kind == SRC_PLAIN || s.kind == SRC_EXPERT) &&
		 ((t->type == GGUF_TT_F32 && (uintptr_t)src % 4 == 0 &&
		   (b->dt == K_F32 || (cols == 1 && s.kind == SRC_PLAIN))) ||
		  (t->type == GGUF_TT_BF16 && (uintptr_t)src % 2 == 0 && b->dt == K_BF16));
	slot->rows = rows;
	slot->cols = cols;
	if (b->pass == 3) {	/* the dtype pass 2 would give; data: the source */
		slot->dtype = mapped ? (t->type == GGUF_TT_F32 ? K_F32 : K_BF16) : b->dt;
		slot->data = s.kind == SRC_UNPERMUTE || s.kind == SRC_KV_B ? t->data : src;
		b->m->weight_bytes += (size_t)n * k_dtype_size(slot->dtype);
		return 0;
	}
	if (mapped) {
		size_t bytes;

		slot->dtype = t->type == GGUF_TT_F32 ? K_F32 : K_BF16;
		bytes = (size_t)n * k_dtype_size(slot->dtype);
		b->mappable += bytes;
		slot->data = b->copy_all ? buf_take(b, bytes) : src;
		if (b->pass == 2 && b->copy_all)
			memcpy((void *)slot->data, src, bytes);
		if (b->pass == 2)
			b->m->weight_bytes += bytes;
		return 0;
	}
	slot->dtype = b->dt;
	slot->data = buf_take(b, (size_t)n * k_dtype_size(b->dt));
	if (b->pass < 2)
		return 0;
	if (s.kind == SRC_KV_B)
		ret = fill_kv_b(b, t, vb, (void *)slot->data);
	else if (s.kind == SRC_UNPERMUTE)
		ret = fill_unpermuted(b, t, &s, rows, cols, (void *)slot->data);
	else
		ret = dequant_to(b, t->type, src, n, (void *)slot->data);
	if (!ret && b->pass == 2)
		b->m->weight_bytes += (size_t)n * k_dtype_size(slot->dtype);
	if (ret == -ENOMEM)
		snprintf(b->err, b->err_len, "%s: tensor '%s': out of memory", b->fname, t->name);
	else if (ret)
		snprintf(b->err, b->err_len, "%s: tensor '%s': cannot dequantize type %s (%d)",
			 b->fname, t->name, gguf_ttype_name(t->type) ? gguf_ttype_name(t->type) : "?", ret);
	return ret;
}

/* exp_probs_b.bias (sigmoid routers' e_score_correction_bias), as fp32 like model.c. */
static int bind_router_bias(struct gbind *b)
{
	struct model *m = b->m;
	char name[64];

	for (int l = 0; l < m->cfg.n_layers; l++) {
		struct model_layer *L = &m->layers[l];
		const struct gguf_tensor *t;
		int ret;

		if (!L->is_moe || m->cfg.route.scoring != K_MOE_SIGMOID)
			continue;
		snprintf(name, sizeof(name), "blk.%d.exp_probs_b.bias", l);
		if ((ret = check_tensor(b, "e_score_correction_bias", name, m->cfg.n_experts, 0, 0, &t)))
			return ret;
		L->router_bias = malloc((size_t)m->cfg.n_experts * sizeof(float));
		if (!L->router_bias)
			return -ENOMEM;
		if ((ret = gguf_dequant(t->type, t->data, m->cfg.n_experts, L->router_bias)))
			return ret;
	}
	return 0;
}

int model_gguf_bind(struct model *m, uint64_t f32_limit, char *err, size_t err_len)
{
	struct gbind b = { .m = m, .f = m->gguf, .fname = base_name(m->path), .err = err,
			   .err_len = err_len };
	int ret;

	if ((ret = model_for_each_tensor(m, bind_one, &b)))
		return ret;
	if (!f32_limit)
		f32_limit = MODEL_GGUF_F32_LIMIT;
	b.dt = (uint64_t)b.elems * sizeof(float) <= f32_limit ? K_F32 : K_BF16;
	if (m->mapped) {	/* the shards dequantize their slices (model_gguf_slice) */
		b.pass = 3;
		m->weight_bytes = 0;
		if ((ret = model_for_each_tensor(m, bind_one, &b)))
			return ret;
		return bind_router_bias(&b);
	}
	b.pass = 1;
	if ((ret = model_for_each_tensor(m, bind_one, &b)))
		return ret;
	/* The file's image is our own copy (gguf_load): kept only where most of it is
	 * used as it is, else everything is copied out and the image released, so a
	 * quantized file costs its size only while the model loads. */
	if (b.mappable * 2 < m->gguf->size) {
		b.copy_all = 1;
		b.used = 0;
		if ((ret = model_for_each_tensor(m, bind_one, &b)))
			return ret;
	}
	if (b.used) {
		m->gguf_buf = aligned_alloc(BUF_ALIGN, (b.used + BUF_ALIGN - 1) / BUF_ALIGN * BUF_ALIGN);
		if (!m->gguf_buf) {
			snprintf(err, err_len, "%s: %.2f GiB for the dequantized weights: out of memory",
				 b.fname, (double)b.used / (1 << 30));
			return -ENOMEM;
		}
		m->gguf_buf_bytes = b.used;
	}
	b.pass = 2;
	b.used = 0;
	m->weight_bytes = 0;
	if ((ret = model_for_each_tensor(m, bind_one, &b)) || (ret = bind_router_bias(&b)))
		return ret;
	if (b.copy_all) {
		gguf_close(m->gguf);
		free(m->gguf);
		m->gguf = NULL;
	}
	return 0;
}

int model_gguf_open(struct model *m, const char *path, int mapped, char *err, size_t err_len)
{
	int ret;
	struct model_load_progress lp = { 0 };

	m->gguf = calloc(1, sizeof(*m->gguf));
	if (!m->gguf)
		return -ENOMEM;
	m->mapped = mapped;
	ret = mapped ? gguf_open(m->gguf, path, err, err_len)
		     : gguf_load(m->gguf, path, model_load_progress, &lp, err, err_len);
	if (ret)
		return ret;
	return model_gguf_config(&m->cfg, m->gguf, base_name(path), err, err_len);
}

void model_gguf_release(struct model *m)
{
	if (m->gguf) {
		gguf_close(m->gguf);
		free(m->gguf);
		m->gguf = NULL;
	}
	free(m->gguf_buf);
	m->gguf_buf = NULL;
	m->gguf_buf_bytes = 0;
}
