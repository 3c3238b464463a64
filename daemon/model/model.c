/* Model loading: config.json, then every tensor the architecture needs, bound by its
 * Hugging Face name and checked for shape and dtype. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/model/model.h"
#include "daemon/model/model_gguf.h"
#include "daemon/model/model_quant.h"
#include "format/file_read.h"

static const char *const layer_prefix = "model.layers";

/* ---- what each architecture needs --------------------------------------- */

struct walk {
	struct model *m;
	model_tensor_fn fn;
	void *ctx;
	char name[256];
};

static int need(struct walk *w, struct model_tensor *slot, int64_t rows, int64_t cols,
		const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int need(struct walk *w, struct model_tensor *slot, int64_t rows, int64_t cols,
		const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(w->name, sizeof(w->name), fmt, ap);
	va_end(ap);
	return w->fn(w->ctx, w->name, slot, rows, cols);
}

static int walk_gqa_attention(struct walk *w, struct model_layer *L, int l)
{
	const struct model_config *c = &w->m->cfg;
	int64_t q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
	int ret;

	if ((ret = need(w, &L->wq, q, c->hidden_size, "%s.%d.self_attn.q_proj.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->wk, kv, c->hidden_size, "%s.%d.self_attn.k_proj.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->wv, kv, c->hidden_size, "%s.%d.self_attn.v_proj.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->wo, c->hidden_size, q, "%s.%d.self_attn.o_proj.weight", layer_prefix, l)))
		return ret;
	if (!c->qk_norm)
		return 0;
	if ((ret = need(w, &L->q_norm, c->head_dim, 1, "%s.%d.self_attn.q_norm.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->k_norm, c->head_dim, 1, "%s.%d.self_attn.k_norm.weight", layer_prefix, l)))
		return ret;
	return 0;
}

static int walk_mla_attention(struct walk *w, struct model_layer *L, int l)
{
	const struct model_config *c = &w->m->cfg;
	int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
	int64_t q_out = (int64_t)c->n_heads * qk;
	int ret;

	if (c->q_lora_rank > 0) {
		if ((ret = need(w, &L->wq_a, c->q_lora_rank, c->hidden_size,
				"%s.%d.self_attn.q_a_proj.weight", layer_prefix, l)) ||
		    (ret = need(w, &L->q_a_norm, c->q_lora_rank, 1,
				"%s.%d.self_attn.q_a_layernorm.weight", layer_prefix, l)) ||
		    (ret = need(w, &L->wq_b, q_out, c->q_lora_rank,
				"%s.%d.self_attn.q_b_proj.weight", layer_prefix, l)))
			return ret;
	} else if ((ret = need(w, &L->wq_b, q_out, c->hidden_size,
			       "%s.%d.self_attn.q_proj.weight", layer_prefix, l))) {
		return ret;
	}
	if ((ret = need(w, &L->wkv_a, c->kv_lora_rank + c->qk_rope_head_dim, c->hidden_size,
			"%s.%d.self_attn.kv_a_proj_with_mqa.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->kv_a_norm, c->kv_lora_rank, 1,
			"%s.%d.self_attn.kv_a_layernorm.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->wkv_b, (int64_t)c->n_heads * (c->qk_nope_head_dim + c->v_head_dim),
			c->kv_lora_rank, "%s.%d.self_attn.kv_b_proj.weight", layer_prefix, l)) ||
	    (ret = need(w, &L->wo, c->hidden_size, (int64_t)c->n_heads * c->v_head_dim,
			"%s.%d.self_attn.o_proj.weight", layer_prefix, l)))
		return ret;
	return 0;
}

static int walk_mlp(struct walk *w, struct model_layer *L, int l, const char *part, int64_t inter)
{
	int64_t hidden = w->m->cfg.hidden_size;
	int ret;

	if ((ret = need(w, &L->w_gate, inter, hidden, "%s.%d.mlp.%sgate_proj.weight", layer_prefix, l, part)) ||
	    (ret = need(w, &L->w_up, inter, hidden, "%s.%d.mlp.%sup_proj.weight", layer_prefix, l, part)) ||
	    (ret = need(w, &L->w_down, hidden, inter, "%s.%d.mlp.%sdown_proj.weight", layer_prefix, l, part)))
		return ret;
	return 0;
}

/* Each expert is bound through the layer's expert_gate/up/down slots (so a walk sees
 * real slots), loaded first with what expert e holds so that a walk that binds
 * nothing (counting, engine_weight_bytes) changes nothing; all experts must match. */
static int walk_expert(struct walk *w, struct model_layer *L, int l, int e, struct model_tensor *slot,
		       int64_t rows, int64_t cols, const char *part, const void **data,
		       struct k_quant *q)
{
	enum k_qfmt prev = slot->q.fmt;
	int ret;

	slot->data = *data;
	slot->q = *q;
	if ((ret = need(w, slot, rows, cols, "%s.%d.mlp.experts.%d.%s.weight", layer_prefix, l, e, part)))
		return ret;
	*data = slot->data;
	*q = slot->q;
	if (e == 0 && slot == &L->expert_gate)
		L->expert_dtype = slot->dtype;
	if (slot->dtype != L->expert_dtype || (e > 0 && slot->q.fmt != prev))
		return w->fn(w->ctx, w->name, NULL, -1, -1);	/* reports the mix */
	return 0;
}

static int walk_moe(struct walk *w, struct model_layer *L, int l)
{
	const struct model_config *c = &w->m->cfg;
	int64_t hidden = c->hidden_size, inter = c->moe_intermediate_size;
	int ret;

	if ((ret = need(w, &L->router, c->n_experts, hidden, "%s.%d.mlp.gate.weight", layer_prefix, l)))
		return ret;
	for (int e = 0; e < c->n_experts; e++) {
		struct k_expert *x = &L->experts[e];

		if ((ret = walk_expert(w, L, l, e, &L->expert_gate, inter, hidden, "gate_proj", &x->gate,
				       &x->gate_q)) ||
		    (ret = walk_expert(w, L, l, e, &L->expert_up, inter, hidden, "up_proj", &x->up,
				       &x->up_q)) ||
		    (ret = walk_expert(w, L, l, e, &L->expert_down, hidden, inter, "down_proj", &x->down,
				       &x->down_q)))
			return ret;
	}
	if (c->n_shared_experts > 0)
		return walk_mlp(w, L, l, "shared_experts.", inter * c->n_shared_experts);
	return 0;
}

int model_for_each_tensor(struct model *m, model_tensor_fn fn, void *ctx)
{
	const struct model_config *c = &m->cfg;
	struct walk w = { .m = m, .fn = fn, .ctx = ctx };
	int ret;

	if ((ret = need(&w, &m->embed, c->vocab_size, c->hidden_size, "model.embed_tokens.weight")))
		return ret;
	for (int l = 0; l < c->n_layers; l++) {
		struct model_layer *L = &m->layers[l];

		if ((ret = need(&w, &L->attn_norm, c->hidden_size, 1, "%s.%d.input_layernorm.weight", layer_prefix, l)) ||
		    (ret = need(&w, &L->ffn_norm, c->hidden_size, 1, "%s.%d.post_attention_layernorm.weight", layer_prefix, l)))
			return ret;
		ret = c->mla ? walk_mla_attention(&w, L, l) : walk_gqa_attention(&w, L, l);
		if (ret)
			return ret;
		ret = L->is_moe ? walk_moe(&w, L, l) : walk_mlp(&w, L, l, "", c->intermediate_size);
		if (ret)
			return ret;
	}
	if ((ret = need(&w, &m->final_norm, c->hidden_size, 1, "model.norm.weight")))
		return ret;
	if (c->tie_word_embeddings) {
		m->lm_head = m->embed;
		return 0;
	}
	return need(&w, &m->lm_head, c->vocab_size, c->hidden_size, "lm_head.weight");
}

/* ---- binding to safetensors --------------------------------------------- */

struct bind {
	struct model *m;
	char *err;
	size_t err_len;
};

static const char *base_name(const char *path)
{
	const char *s = strrchr(path, '/');

	return s ? s + 1 : path;
}

static int bind_tensor(void *ctx, const char *name, struct model_tensor *slot,
		       int64_t rows, int64_t cols)
{
	struct bind *b = ctx;
	const struct st_file *file;
	const struct st_tensor *t;
	int shape_ok, ret;

	if (!slot) {
		snprintf(b->err, b->err_len, "%s: tensor '%s': experts of one layer mix dtypes "
			 "or quantization",
			 b->m->path, name);
		return -EINVAL;
	}
	if ((ret = model_quant_bind(b->m, name, slot, rows, cols, b->err, b->err_len)) <= 0)
		return ret;
	slot->q = (struct k_quant){ 0 };
	t = st_set_find(&b->m->files, name, &file);
	if (!t) {
		snprintf(b->err, b->err_len, "%s: tensor '%s' is missing (needed by %s)",
			 b->m->path, name, model_arch_name(b->m->cfg.arch));
		return -EINVAL;
	}
	if (!t->dtype_ok) {
		int fp8 = !strncmp(t->dtype_name, "F8", 2);

		snprintf(b->err, b->err_len, "%s: tensor '%s': dtype %s is not supported%s",
			 base_name(file->path), name, t->dtype_name,
			 fp8 ? " without a quantization_config in config.json that says how it is "
			 "scaled" : " (bf16, fp16, fp32 are)");
		return -ENOTSUP;
	}
	if (cols == 1)
		shape_ok = t->ndim == 1 && t->shape[0] == rows;
	else
		shape_ok = t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols;
	if (!shape_ok) {
		char got[96] = "";
		size_t n = 0;

		for (int i = 0; i < t->ndim && n < sizeof(got) - 24; i++)
			n += (size_t)snprintf(got + n, sizeof(got) - n, "%s%" PRId64, i ? ", " : "", t->shape[i]);
		if (cols == 1)
			snprintf(b->err, b->err_len, "%s: tensor '%s': shape [%s], expected [%" PRId64 "]",
				 base_name(file->path), name, got, rows);
		else
			snprintf(b->err, b->err_len,
				 "%s: tensor '%s': shape [%s], expected [%" PRId64 ", %" PRId64 "]",
				 base_name(file->path), name, got, rows, cols);
		return -EINVAL;
	}
	slot->data = t->data;
	slot->dtype = t->dtype;
	slot->rows = rows;
	slot->cols = cols;
	b->m->weight_bytes += t->nbytes;
	return 0;
}

/* e_score_correction_bias is a buffer, often fp32 while the rest is bf16: keep an
 * fp32 copy so routing never depends on the stored dtype. */
static int bind_router_bias(struct model *m, char *err, size_t err_len)
{
	struct bind b = { .m = m, .err = err, .err_len = err_len };
	char name[128];

	for (int l = 0; l < m->cfg.n_layers; l++) {
		struct model_layer *L = &m->layers[l];
		struct model_tensor t;
		int ret;

		if (!L->is_moe || m->cfg.route.scoring != K_MOE_SIGMOID)
			continue;
		snprintf(name, sizeof(name), "%s.%d.mlp.gate.e_score_correction_bias", layer_prefix, l);
		if ((ret = bind_tensor(&b, name, &t, m->cfg.n_experts, 1)))
			return ret;
		L->router_bias = malloc((size_t)m->cfg.n_experts * sizeof(float));
		if (!L->router_bias)
			return -ENOMEM;
		k_row_to_f32(L->router_bias, t.data, t.dtype, (size_t)m->cfg.n_experts);
	}
	return 0;
}

/* ---- lifecycle ---------------------------------------------------------- */

static int model_alloc_layers(struct model *m)
{
	const struct model_config *c = &m->cfg;

	m->layers = calloc((size_t)c->n_layers, sizeof(*m->layers));
	if (!m->layers)
		return -ENOMEM;
	for (int l = 0; l < c->n_layers; l++) {
		struct model_layer *L = &m->layers[l];

		L->is_moe = model_config_layer_is_moe(c, l);
		if (!L->is_moe)
			continue;
		L->experts = calloc((size_t)c->n_experts, sizeof(*L->experts));
		if (!L->experts)
			return -ENOMEM;
	}
	return 0;
}

static int count_tensor(void *ctx, const char *name, struct model_tensor *slot,
			int64_t rows, int64_t cols)
{
	(void)name;
	(void)slot;
	*(int64_t *)ctx += rows * cols;
	return 0;
}

int model_count_params(const struct model_config *cfg, int64_t *params)
{
	struct model *m = calloc(1, sizeof(*m));
	int ret;

	*params = 0;
	if (!m)
		return -ENOMEM;
	m->cfg = *cfg;
	ret = model_alloc_layers(m);
	if (!ret)
		ret = model_for_each_tensor(m, count_tensor, params);
	model_destroy(m);
	return ret;
}

/* A tensor's bytes as the GPU streams them: quantized ones as stored (payload +
 * scales), the rest in bf16. Routed experts apart: their slots hold each expert in turn. */
static int stream_tensor(void *ctx, const char *name, struct model_tensor *slot, int64_t rows,
			 int64_t cols)
{
	struct model *m = ctx;
	double b = slot && slot->q.fmt != K_Q_NONE ? (double)model_tensor_bytes(slot, 2)
						     : 2.0 * (double)rows * (double)cols;
	char last[48];
	const int in_last = snprintf(last, sizeof(last), "%s.%d.", layer_prefix,
				     m->cfg.n_layers - 1) > 0 &&
			    !strncmp(name, last, strlen(last));

	if (strstr(name, ".mlp.experts.")) {
		m->stream_expert_bytes += b;
		m->stream_last_expert_bytes += in_last ? b : 0;
	} else {
		m->stream_dense_bytes += b;
		m->stream_last_dense_bytes += in_last ? b : 0;
	}
	return 0;
}

void model_count_stream_bytes(struct model *m)
{
	m->stream_dense_bytes = m->stream_expert_bytes = 0;
	m->stream_last_dense_bytes = m->stream_last_expert_bytes = 0;
	model_for_each_tensor(m, stream_tensor, m);
	m->stream_counted = 1;
}

/* ---- reading the files ---------------------------------------------------- */

#define PROGRESS_MIN_BYTES ((size_t)1 << 30)	/* smaller files load without a line */
#define PROGRESS_EVERY_S 2.0

/* file_load's progress: a line every few seconds while a large file is read (weights
 * are read whole at start, so this is where a large model's start-up time goes). */
void model_load_progress(void *ctx, const char *path, size_t done, size_t total)
{
	struct model_load_progress *p = ctx;
	double now = clock_now();

	if (total < PROGRESS_MIN_BYTES)
		return;
	if (done <= FILE_LOAD_CHUNK)	/* a file's first chunk */
		p->t0 = p->last = now;
	if (done < total && now - p->last < PROGRESS_EVERY_S)
		return;
	p->last = now;
	log_info("model: reading %s: %5.1f%% (%.2f of %.2f GiB, %.2f GB/s)%s", path,
		 100.0 * (double)done / (double)total, (double)done / (1u << 30),
		 (double)total / (1u << 30), (double)done / 1e9 / (now - p->t0 > 1e-9 ? now - p->t0 : 1e-9),
		 done == total ? ", done" : "");
}

/* What path is, for a model: 0 (a directory, or with synthetic a config file), 1 (a
 * GGUF file), or -errno with one line in err: a file that is neither, or too short to
 * tell (a GGUF cut to a few bytes is no directory either). */
static int model_path_kind(const char *path, int synthetic, char *err, size_t err_len)
{
	size_t n = strlen(path);
	struct stat st;

	if (stat(path, &st))
		return 0;	/* the config's open names the path and the reason */
	if (S_ISDIR(st.st_mode))
		return 0;
	if (!S_ISREG(st.st_mode))
		return file_fail(err, err_len, -EINVAL, "%s: not a model directory or a GGUF file "
				 "(%s)", path, file_kind(st.st_mode));
	if (gguf_is_gguf(path))
		return 1;
	if (synthetic && !(n >= 5 && !strcmp(path + n - 5, ".gguf")))
		return 0;	/* a config.json */
	if (st.st_size < GGUF_HEADER_BYTES)
		return file_fail(err, err_len, -EINVAL, "%s: %lld bytes, too short for a GGUF "
				 "header (needs at least %d)", path, (long long)st.st_size,
				 GGUF_HEADER_BYTES);
	return file_fail(err, err_len, -EINVAL, "%s: not a GGUF file (no \"GGUF\" magic at its "
			 "start) and not a model directory", path);
}

/* A synthetic model may be given its config.json path or its directory. */
static int load_config(struct model *m, const char *path, char *err, size_t err_len)
{
	struct stat st;

	if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
		return model_config_load(&m->cfg, path, err, err_len);
	return model_config_load_file(&m->cfg, path, err, err_len);
}

int model_load(struct model **out, const char *path, const struct model_load_opts *opts,
	       char *err, size_t err_len)
{
	static const struct model_load_opts defaults;
	struct model *m;
	int ret;

	if (!opts)
		opts = &defaults;
	*out = NULL;
	if (err_len)
		err[0] = '\0';
	m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->path = strdup(path);
	if (!m->path) {
		ret = -ENOMEM;
		goto err_destroy;
	}
	if (opts->weight_format.format != MODEL_Q_NONE && !opts->synthetic) {
		snprintf(err, err_len, "--weight-format needs --synthetic-weights (a checkpoint's "
			 "weights are in the format its files hold)");
		ret = -EINVAL;
		goto err_destroy;
	}
	ret = model_path_kind(path, opts->synthetic, err, err_len);
	if (ret < 0)
		goto err_destroy;
	if (ret == 1)
		ret = model_gguf_open(m, path, opts->mapped && !opts->synthetic, err, err_len);
	else
		ret = opts->synthetic ? load_config(m, path, err, err_len)
				      : model_config_load(&m->cfg, path, err, err_len);
	if (ret)
		goto err_destroy;
	if (opts->n_layers > 0 && opts->n_layers < m->cfg.n_layers)
		m->cfg.n_layers = opts->n_layers;
	if ((ret = model_alloc_layers(m)))
		goto err_destroy;
	if (opts->synthetic) {
		m->synthetic = 1;
		ret = model_synthesize(m, opts->seed, &opts->weight_format, opts->mapped, err, err_len);
	} else if (m->gguf) {
		ret = model_gguf_bind(m, opts->gguf_f32_limit, err, err_len);
	} else {
		struct bind b = { .m = m, .err = err, .err_len = err_len };
		struct model_load_progress lp = { 0 };
		struct st_progress pr = { .fn = model_load_progress, .ctx = &lp };

		m->mapped = opts->mapped;
		if ((ret = opts->mapped ? st_set_map(&m->files, path, err, err_len)
					: st_set_load(&m->files, path, &pr, err, err_len)))
			goto err_destroy;
		ret = model_for_each_tensor(m, bind_tensor, &b);
		if (!ret)
			ret = bind_router_bias(m, err, err_len);
	}
	if (ret)
		goto err_destroy;
	model_count_stream_bytes(m);
	*out = m;
	return 0;

err_destroy:
	if (ret == -ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "%s: out of memory while loading", path);
	model_destroy(m);
	return ret;
}

void model_destroy(struct model *m)
{
	if (!m)
		return;
	if (m->layers) {
		for (int l = 0; l < m->cfg.n_layers; l++) {
			free(m->layers[l].experts);
			free(m->layers[l].router_bias);
		}
		free(m->layers);
	}
	st_set_close(&m->files);
	model_gguf_release(m);
	free(m->synthetic_buf);
	free(m->synth_jobs);
	if (m->synth_reserve)
		munmap(m->synth_reserve, m->synth_reserve_bytes);
	if (m->shard_buf)
		munmap(m->shard_buf, m->shard_bytes);
	free(m->path);
	free(m);
}

void model_release_pages(const struct model *m, const void *p, size_t bytes)
{
	uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p, b = a + bytes;

	if (!m->mapped || !bytes)
		return;
	for (int i = 0; i <= m->files.n_files; i++) {	/* the files, then a mapped GGUF */
		const void *map = i < m->files.n_files ? m->files.files[i].map : m->gguf ? m->gguf->map : NULL;
		size_t size = i < m->files.n_files ? m->files.files[i].size : m->gguf ? m->gguf->size : 0;
		uintptr_t lo = (uintptr_t)map, hi = lo + size;

		if (!map || a < lo || b > hi)
			continue;
		/* whole pages around the range: a page shared with a neighbour is
		 * read again from the file when the neighbour is copied */
		a &= ~(page - 1);
		b = (b + page - 1) & ~(page - 1);
		madvise((void *)a, b - a, MADV_DONTNEED);
		return;
	}
}

const char *model_weights_name(const struct model *m, char *buf, size_t n)
{
	if (m->cfg.quant.format != MODEL_Q_NONE)
		model_quant_name(&m->cfg.quant, buf, n);
	else	/* bf16, f16, f32 */
		for (size_t i = 0; i < n; i++)
			if (!(buf[i] = (char)tolower((unsigned char)k_dtype_name(m->cfg.dtype)[i])))
				break;
	buf[n - 1] = '\0';
	if (m->gguf_buf)	/* a GGUF's blocks are dequantized at load */
		strncat(buf, ", from GGUF", n - strlen(buf) - 1);
	return buf;
}
