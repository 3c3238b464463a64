/* The forward pass of every supported architecture, layer by layer, as backend ops.
 * Reads like the models' Hugging Face definitions: pre-norm attention, then a dense or
 * mixture-of-experts MLP, residual adds, final norm, lm_head. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/forward.h"
#include "daemon/engine/forward_tp.h"
#include "daemon/engine/route_trace.h"

#define OP(f, name, ...) ((f)->be->ops->name((f)->be, __VA_ARGS__))

/* ---- sizes -------------------------------------------------------------- */

static int kv_width(const struct model_config *c)
{
	return c->mla ? c->kv_lora_rank + c->qk_rope_head_dim : c->n_kv_heads * c->head_dim;
}

/* Bytes per token of all layers' cache on the CPU backend (fp32); a backend with
 * a narrower kv_dtype scales it by its element size. */
size_t forward_kv_bytes_per_token(const struct model *m)
{
	const struct model_config *c = &m->cfg;
	size_t per_layer = (size_t)kv_width(c) * (c->mla ? 1 : 2) * sizeof(float);

	return per_layer * (size_t)c->n_layers;
}

static int max_inter(const struct model_config *c)
{
	int a = c->intermediate_size, b = c->moe_intermediate_size * c->n_shared_experts;

	return a > b ? a : b;
}

/* ---- lifecycle ---------------------------------------------------------- */

static int bytes_alloc(struct forward *f, void **p, size_t bytes, const char *what,
		       char *err, size_t err_len)
{
	*p = f->be->ops->alloc(f->be, bytes);
	if (!*p) {
		snprintf(err, err_len, "%s backend: out of memory allocating %s (%.1f MiB)",
			 f->be->ops->name, what, (double)bytes / (1 << 20));
		return -ENOMEM;
	}
	return 0;
}

static int scratch_alloc(struct forward *f, void **p, size_t floats, const char *what,
			 char *err, size_t err_len)
{
	return bytes_alloc(f, p, floats * sizeof(float), what, err, err_len);
}

/* The cache holds n_blocks blocks plus one (dummy_block) that padding rows of graph
 * replays write into, so they never touch a sequence's blocks. */
static int forward_alloc_cache(struct forward *f, char *err, size_t err_len)
{
	const struct model_config *c = &f->m->cfg;
	size_t tokens = ((size_t)f->n_blocks + 1) * (size_t)f->block_tokens;
	size_t elem = k_dtype_size(f->be->ops->kv_dtype);
	int width = kv_width(c);
	int ret;

	f->kv = calloc((size_t)c->n_layers, sizeof(*f->kv));	/* host: the descriptors */
	if (!f->kv)
		return -ENOMEM;
	for (int l = 0; l < c->n_layers; l++) {
		struct k_kv_layer *kv = &f->kv[l];

		kv->n_blocks = f->n_blocks + 1;
		kv->block_tokens = f->block_tokens;
		kv->width = width;
		if ((ret = bytes_alloc(f, (void **)&kv->k, tokens * (size_t)width * elem, "the KV cache",
				       err, err_len)))
			return ret;
		if (!c->mla && (ret = bytes_alloc(f, (void **)&kv->v, tokens * (size_t)width * elem,
						  "the KV cache", err, err_len)))
			return ret;
	}
	f->dummy_block = f->n_blocks;
	f->kv_bytes = forward_kv_bytes_per_token(f->m) / sizeof(float) * elem * tokens;
	return 0;
}

static int forward_alloc_scratch(struct forward *f, char *err, size_t err_len)
{
	const struct model_config *c = &f->m->cfg;
	size_t R = (size_t)f->max_rows;
	int qk = c->mla ? c->qk_nope_head_dim + c->qk_rope_head_dim : c->head_dim;
	int vd = c->mla ? c->v_head_dim : c->head_dim;
	struct {
		void **p;
		size_t floats;
	} bufs[] = {
		{ (void **)&f->x, R * c->hidden_size },
		{ (void **)&f->h, R * c->hidden_size },
		{ (void **)&f->q, R * c->n_heads * qk },
		{ (void **)&f->k, c->mla ? 0 : R * c->n_kv_heads * c->head_dim },
		{ (void **)&f->v, c->mla ? 0 : R * c->n_kv_heads * c->head_dim },
		{ (void **)&f->q_a, R * c->q_lora_rank },
		{ (void **)&f->kv_a, c->mla ? R * (size_t)kv_width(c) : 0 },
		{ (void **)&f->attn, R * c->n_heads * vd },
		{ (void **)&f->gate, R * max_inter(c) },
		{ (void **)&f->up, R * max_inter(c) },
		{ (void **)&f->mlp, R * c->hidden_size },
		{ (void **)&f->router, R * c->n_experts },
		{ (void **)&f->route_ids, R * c->top_k },
		{ (void **)&f->route_w, R * c->top_k },
		{ (void **)&f->logits, (size_t)FWD_LOGIT_ROWS * c->vocab_size },
	};
	int ret;

	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
		if (!bufs[i].floats)
			continue;
		if ((ret = scratch_alloc(f, bufs[i].p, bufs[i].floats, "activations", err, err_len)))
			return ret;
	}
	return 0;
}

int forward_create(struct forward **out, const struct model *m, struct backend *be,
		   int n_blocks, int block_tokens, int max_rows, char *err, size_t err_len)
{
	struct forward *f;
	int ret;

	*out = NULL;
	if (n_blocks <= 0 || block_tokens <= 0 || max_rows <= 0) {
		snprintf(err, err_len, "forward: bad sizes: %d blocks of %d tokens, %d rows",
			 n_blocks, block_tokens, max_rows);
		return -EINVAL;
	}
	f = calloc(1, sizeof(*f));
	if (!f)
		return -ENOMEM;
	f->m = m;
	f->be = be;
	f->max_rows = max_rows;
	f->block_tokens = block_tokens;
	f->n_blocks = n_blocks;
	ret = k_rope_init(&f->rope, &m->cfg.rope);
	if (ret) {
		snprintf(err, err_len, "%s: rope parameters rejected (dim %d, factor %g)",
			 m->path, m->cfg.rope.dim, m->cfg.rope.factor);
		goto err_destroy;
	}
	if ((ret = forward_alloc_cache(f, err, err_len)) || (ret = forward_alloc_scratch(f, err, err_len)))
		goto err_destroy;
	if (!be->ops->host_memory && (ret = forward_stage_create(f, err, err_len)))
		goto err_destroy;
	if (be->ops->reserve &&
	    (ret = be->ops->reserve(be, max_rows, n_blocks * block_tokens, err, err_len)))
		goto err_destroy;
	f->use_graphs = be->ops->capture_begin != NULL;
	memset(f->bucket_lat, -1, sizeof(f->bucket_lat));
	*out = f;
	return 0;

err_destroy:
	forward_destroy(f);
	return ret;
}

void forward_destroy(struct forward *f)
{
	void *bufs[16];
	struct fwd_tp *tp;
	int n = 0;

	if (!f)
		return;
	tp = f->tp_rank == 0 ? f->tp : NULL;	/* rank 0 owns the other ranks */
	forward_tp_stop(tp);
	for (int i = 0; i < FWD_N_BUCKETS; i++)
		for (int j = 0; j < 2; j++)
			if (f->graphs[i][j])
				f->be->ops->graph_destroy(f->be, f->graphs[i][j]);
	forward_stage_destroy(f);
	if (f->kv) {
		for (int l = 0; l < f->m->cfg.n_layers; l++) {
			f->be->ops->free(f->be, f->kv[l].k);
			f->be->ops->free(f->be, f->kv[l].v);
		}
		free(f->kv);
	}
	bufs[n++] = f->x, bufs[n++] = f->h, bufs[n++] = f->q, bufs[n++] = f->k;
	bufs[n++] = f->v, bufs[n++] = f->q_a, bufs[n++] = f->kv_a, bufs[n++] = f->attn;
	bufs[n++] = f->gate, bufs[n++] = f->up, bufs[n++] = f->mlp, bufs[n++] = f->router;
	bufs[n++] = f->route_ids, bufs[n++] = f->route_w, bufs[n++] = f->logits;
	for (int i = 0; i < n; i++)
		if (bufs[i])
			f->be->ops->free(f->be, bufs[i]);
	k_rope_fini(&f->rope);
	free(f->trace_first);
	free(f);
	forward_tp_free(tp);	/* the shards, rank 0's (f->m) among them */
}

/* ---- the decode path ---------------------------------------------------- */

static const char *const path_names[] = { "auto", "standard", "latency" };

const char *fwd_path_name(enum fwd_path p)
{
	return (unsigned)p < 3 ? path_names[p] : NULL;
}

int fwd_path_parse(const char *s, enum fwd_path *out)
{
	for (int i = 0; i < 3; i++)
		if (s && !strcmp(s, path_names[i])) {
			*out = (enum fwd_path)i;
			return 0;
		}
	return -EINVAL;
}

int forward_latency_supported(const struct forward *f, int n_rows, char *why, size_t why_len)
{
	const struct model_config *c = &f->m->cfg;
	int moe = 0;

	for (int l = 0; l < c->n_layers; l++)
		moe |= f->m->layers[l].is_moe;
	if (!f->be->ops->moe_layer) {
		if (why)
			snprintf(why, why_len, "the %s backend has no latency path", f->be->ops->name);
		return 0;
	}
	if (!moe) {
		if (why)
			snprintf(why, why_len, "no fused layers for %s's dense layers yet", c->model_type);
		return 0;
	}
	if (f->tp) {	/* the fused MoE layer adds into the residual: a reduction's job */
		if (why)
			snprintf(why, why_len, "tensor parallel: the residual add is the reduction's");
		return 0;
	}
	if (n_rows > FWD_LAT_MAX_ROWS) {
		if (why)
			snprintf(why, why_len, "%d rows (the fused MoE layer takes 1..%d)", n_rows,
				 FWD_LAT_MAX_ROWS);
		return 0;
	}
	return 1;
}

/* ---- layers ------------------------------------------------------------- */

/* residual (R, w->rows) += x @ w^T, fused where the backend can; otherwise through
 * scratch (R, w->rows), exactly as an add after the linear. */
static void linear_residual(struct forward *f, float *residual, float *scratch, const float *x,
			    const struct model_tensor *w, int R)
{
	if (f->be->ops->linear_add) {
		OP(f, linear_add, residual, x, w, R);
		return;
	}
	OP(f, linear, scratch, x, w, R);
	OP(f, add, residual, scratch, (size_t)R * (size_t)w->rows);
}

/* Tensor parallel: the ranks' partial sums part (R, hidden) reduced into the residual
 * f->x, and the RMSNorm that comes next (norm; NULL: none) of it into f->h inside the
 * same reduction (the fused all-reduce + residual + RMSNorm): forward_layer then
 * skips that norm. */
static int tp_reduce_norm(struct forward *f, float *part, int R, const struct model_tensor *norm)
{
	return forward_tp_reduce_norm(f, part, (size_t)R * (size_t)f->m->cfg.hidden_size, f->x, norm,
				      f->h);
}

/* The next layer's input norm after layer l's MLP (none after the last: the final norm
 * runs on the out rows alone). */
static const struct model_tensor *next_norm(const struct forward *f, int l)
{
	return l + 1 < f->m->cfg.n_layers ? &f->m->layers[l + 1].attn_norm : NULL;
}

/* The attention's output projection added to the residual: with tensor parallel the
 * ranks' partial sums (their heads' columns of wo) are reduced into it, with the
 * MLP's input norm. */
static int attn_out(struct forward *f, const struct model_layer *L, int R)
{
	if (!f->tp) {
		linear_residual(f, f->x, f->h, f->attn, &L->wo, R);
		return 0;
	}
	OP(f, linear, f->mlp, f->attn, &L->wo, R);
	return tp_reduce_norm(f, f->mlp, R, &L->ffn_norm);
}

/* q, and K/V into the cache, op by op (backends without qkv_prep). */
static void gqa_inputs(struct forward *f, const struct model_layer *L, int l,
		       const struct fwd_batch *b)
{
	const struct model_config *c = &f->m->cfg;
	int R = b->n_rows, H = c->n_heads, KV = c->n_kv_heads, D = c->head_dim;
	struct k_kv_layer *kv = &f->kv[l];

	OP(f, linear, f->q, f->h, &L->wq, R);
	OP(f, linear, f->k, f->h, &L->wk, R);
	OP(f, linear, f->v, f->h, &L->wv, R);
	if (c->qk_norm) {	/* Qwen3: RMSNorm of every head before rope */
		OP(f, rmsnorm, f->q, D, f->q, D, &L->q_norm, R * H, D, c->rms_norm_eps);
		OP(f, rmsnorm, f->k, D, f->k, D, &L->k_norm, R * KV, D, c->rms_norm_eps);
	}
	OP(f, rope, &f->rope, f->q, R, H, H * D, D, b->pos);
	OP(f, rope, &f->rope, f->k, R, KV, KV * D, D, b->pos);
	OP(f, kv_write, kv->k, kv->width, f->k, R, b->slots);
	OP(f, kv_write, kv->v, kv->width, f->v, R, b->slots);
}

/* Every row its own sequence (n_seqs counts the runs of rows sharing a table; the
 * tables themselves may be in backend memory), so each row's token is its sequence's
 * only new one, at ctx - 1. */
static int rows_one_per_seq(const struct fwd_batch *b)
{
	return b->attn.n_seqs == b->n_rows;
}

/* Llama / Qwen3 attention: h (rows, hidden) in, h (rows, hidden) out. */
static int gqa_attention(struct forward *f, const struct model_layer *L, int l,
			 const struct fwd_batch *b)
{
	const struct model_config *c = &f->m->cfg;
	int R = b->n_rows, H = c->n_heads, KV = c->n_kv_heads, D = c->head_dim;
	struct k_kv_layer *kv = &f->kv[l];
	struct backend_qkv p = {
		.rows = R, .n_heads = H, .kv_heads = KV, .head_dim = D, .qk_norm = c->qk_norm,
		.eps = c->rms_norm_eps, .rope = &f->rope, .pos = b->pos, .slots = b->slots, .kv = kv,
	};

	/* a decode step: q/k/v and the attention as one op where the backend fuses them
	 * (it declines with 1, and the ops below run) */
	if (!rows_one_per_seq(b) || !f->be->ops->qkv_prep_attn ||
	    OP(f, qkv_prep_attn, f->attn, f->q, f->h, L, &p, &b->attn, c->attn_scale) == 1) {
		if (f->be->ops->qkv_prep)
			OP(f, qkv_prep, f->q, f->h, L, &p);
		else
			gqa_inputs(f, L, l, b);
		OP(f, attn_gqa, f->attn, f->q, kv, &b->attn, H, KV, D, c->attn_scale);
	}
	return attn_out(f, L, R);
}

/* MLA's q and the latent into the cache, op by op (backends without mla_prep): q_a
 * and its norm first where there is q-LoRA. */
static void mla_inputs(struct forward *f, const struct model_layer *L, int l,
		       const struct fwd_batch *b, const struct backend_mla *p)
{
	const struct model_config *c = &f->m->cfg;
	int R = b->n_rows, H = c->n_heads;
	int qk = c->qk_nope_head_dim + c->qk_rope_head_dim, width = kv_width(c);

	if (c->q_lora_rank > 0) {
		OP(f, linear, f->q_a, f->h, &L->wq_a, R);
		OP(f, rmsnorm, f->q_a, c->q_lora_rank, f->q_a, c->q_lora_rank, &L->q_a_norm, R,
		   c->q_lora_rank, c->rms_norm_eps);
		OP(f, linear, f->q, f->q_a, &L->wq_b, R);
	} else {
		OP(f, linear, f->q, f->h, &L->wq_b, R);
	}
	OP(f, linear, f->kv_a, f->h, &L->wkv_a, R);
	if (f->be->ops->mla_post) {
		OP(f, mla_post, f->q, f->kv_a, L, p);
	} else {	/* the latent normalised, q_pe and the key rotated, then appended */
		OP(f, rmsnorm, f->kv_a, width, f->kv_a, width, &L->kv_a_norm, R, c->kv_lora_rank,
		   c->rms_norm_eps);
		OP(f, rope, &f->rope, f->q + c->qk_nope_head_dim, R, H, H * qk, qk, b->pos);
		OP(f, rope, &f->rope, f->kv_a + c->kv_lora_rank, R, 1, width, 0, b->pos);
		OP(f, kv_write, f->kv[l].k, width, f->kv_a, R, p->slots);
	}
}

/* DeepSeek multi-head latent attention, absorbed: the cache holds the normalised
 * kv_lora latent and the rotated rope key of each token, never per-head K/V. */
static int mla_attention(struct forward *f, const struct model_layer *L, int l,
			 const struct fwd_batch *b)
{
	const struct model_config *c = &f->m->cfg;
	int R = b->n_rows, H = c->n_heads;
	/* tensor parallel with the latent cache split by tokens (decode context
	 * parallel): this rank's cache rows of the step's latents */
	const int32_t *cp_slots = f->tp ? forward_tp_cp_slots(f) : NULL;
	struct k_mla_dims d = {
		.n_heads = H, .nope_dim = c->qk_nope_head_dim, .rope_dim = c->qk_rope_head_dim,
		.v_dim = c->v_head_dim, .kv_lora = c->kv_lora_rank,
	};
	struct backend_mla p = {
		.rows = R, .n_heads = H, .nope_dim = c->qk_nope_head_dim,
		.rope_dim = c->qk_rope_head_dim, .kv_lora = c->kv_lora_rank,
		.eps = c->rms_norm_eps, .rope = &f->rope, .pos = b->pos,
		.slots = cp_slots ? cp_slots : b->slots, .kv = &f->kv[l],
	};
	int ret = 1;

	/* the projections and the attention as one op where the backend fuses them (it
	 * declines with 1, and the ops below run) */
	if (f->be->ops->mla_prep_attn && !cp_slots)
		ret = OP(f, mla_prep_attn, f->attn, f->q, f->h, L, &p, &b->attn, &d, c->attn_scale);
	if (ret == 1) {
		if (f->be->ops->mla_prep)	/* q(_a) and kv_a projections: one matrix */
			OP(f, mla_prep, f->q, f->h, L, &p);
		else
			mla_inputs(f, L, l, b, &p);
		if (cp_slots)	/* the ranks' partials over their tokens, merged */
			ret = forward_tp_mla_attn(f, L, l, &b->attn, &d, c->attn_scale);
		else
			ret = OP(f, attn_mla, f->attn, f->q, &L->wkv_b, &f->kv[l], &b->attn, &d,
				 c->attn_scale);
	}
	if (ret)
		return ret;
	return attn_out(f, L, R);
}

/* f->gate (rows, inter) = silu(h @ w_gate^T) * (h @ w_up^T). */
static void swiglu(struct forward *f, const struct model_layer *L, int R, int inter)
{
	size_t n = (size_t)R * (size_t)inter;

	if (f->be->ops->gate_up_silu) {
		OP(f, gate_up_silu, f->gate, f->h, &L->w_gate, &L->w_up, R);
	} else {
		OP(f, linear, f->gate, f->h, &L->w_gate, R);
		OP(f, linear, f->up, f->h, &L->w_up, R);
		OP(f, silu_mul, f->gate, f->gate, f->up, n);
	}
}

/* SwiGLU MLP of width inter: h in, added to acc (rows, hidden); scratch (rows,
 * hidden) may be h itself, which gate and up have consumed by then (unused where the
 * backend has linear_add). */
static void dense_mlp(struct forward *f, const struct model_layer *L, int R, int inter, float *acc,
		      float *scratch)
{
	swiglu(f, L, R, inter);
	linear_residual(f, acc, scratch, f->gate, &L->w_down, R);
}

/* Routed experts plus the shared expert (DeepSeek): h in, added to the residual f->x
 * (in one op where the backend fuses them, else by way of f->mlp). */
static int moe_mlp(struct forward *f, const struct model_layer *L, int l, int R)
{
	const struct model_config *c = &f->m->cfg;
	struct k_moe_route_params route = c->route;
	int shared = c->n_shared_experts > 0 ? c->moe_intermediate_size * c->n_shared_experts : 0;
	int n_experts, side, ret;

	route.bias = L->router_bias;
	if (f->lat && R <= FWD_LAT_MAX_ROWS && f->be->ops->moe_layer && !f->trace &&
	    (ret = OP(f, moe_layer, f->x, f->h, R, L, &route, f->router, f->route_ids, f->route_w,
		      c->hidden_size, c->moe_intermediate_size, c->n_experts, shared)) <= 0)
		return ret;	/* the latency path: router to residual add in two launches */
	/* The shared expert needs h only: where the backend has a branch, it streams its
	 * weights there while the router, the routing and the routed experts run (at
	 * small batch a latency-bound chain), adding into the residual itself; its
	 * scratch (f->gate, the backend's) is nobody else's meanwhile. */
	side = shared > 0 && L->w_gate.data && !f->tp && f->be->ops->branch &&
	       f->be->ops->gate_up_silu && f->be->ops->linear_add &&
	       OP(f, branch, BACKEND_BRANCH_MARK, R) == 0;
	/* what decides routing at full precision, as the reference computes it: x in
	 * fp32 at every row count (a backend's linear may round x to bf16) */
	if (f->be->ops->linear_fp32x)
		OP(f, linear_fp32x, f->router, f->h, &L->router, R);
	else
		OP(f, linear, f->router, f->h, &L->router, R);
	OP(f, moe_route, &route, f->router, R, f->route_ids, f->route_w);
	if (f->trace && (ret = route_trace_layer(f->trace, f->be, &route, l, R, f->trace_pos,
						 f->trace_first, f->router, f->route_ids, f->route_w,
						 f->trace_err, sizeof(f->trace_err))))
		return ret;
	if (!f->tp && f->be->ops->moe_experts_add &&
	    (ret = OP(f, moe_experts_add, f->x, f->h, R, f->route_ids, f->route_w, c->top_k, L,
		      c->hidden_size, c->moe_intermediate_size, c->n_experts, shared)) <= 0)
		return ret;	/* fused: the experts, the shared expert and the residual add */
	/* tensor parallel: the experts this rank's shard holds (expert parallel: ids
	 * renumbered into its share) */
	n_experts = f->tp ? forward_tp_experts(f, f->route_ids, (size_t)R * c->top_k) : c->n_experts;
	if (n_experts < 0)
		return n_experts;
	if (side) {	/* x += the shared expert, then (below) x += the routed ones */
		OP(f, branch, BACKEND_BRANCH_BEGIN, R);
		dense_mlp(f, L, R, (int)L->w_gate.rows, f->x, NULL);
		OP(f, branch, BACKEND_BRANCH_END, R);
	}
	ret = OP(f, moe_experts, f->mlp, f->h, R, f->route_ids, f->route_w, c->top_k, L,
		 c->hidden_size, c->moe_intermediate_size, n_experts);
	if (side)
		OP(f, branch, BACKEND_BRANCH_JOIN, R);
	if (ret)
		return ret;
	if (shared > 0 && L->w_gate.data && !side)	/* this rank's rows of it (expert
							 * parallel: all of them on rank 0 where
							 * n does not divide them) */
		dense_mlp(f, L, R, (int)L->w_gate.rows, f->mlp, f->h);
	/* tensor parallel: routed and shared partial sums reduced together, once, into
	 * the residual, with the next layer's norm */
	if (f->tp)
		return tp_reduce_norm(f, f->mlp, R, next_norm(f, l));
	OP(f, add, f->x, f->mlp, (size_t)R * c->hidden_size);
	return 0;
}

int forward_layer(struct forward *f, int l, const struct fwd_batch *b)
{
	const struct model_config *c = &f->m->cfg;
	const struct model_layer *L = &f->m->layers[l];
	int R = b->n_rows, ret = 0;

	/* tensor parallel: the previous layer's last reduction normalised x into h */
	if (!f->tp || l == 0)
		OP(f, rmsnorm, f->h, c->hidden_size, f->x, c->hidden_size, &L->attn_norm, R,
		   c->hidden_size, c->rms_norm_eps);
	if (c->mla)
		ret = mla_attention(f, L, l, b);
	else
		ret = gqa_attention(f, L, l, b);
	if (ret)
		return ret;

	if (!f->tp)	/* tensor parallel: attn_out's reduction normalised it */
		OP(f, rmsnorm, f->h, c->hidden_size, f->x, c->hidden_size, &L->ffn_norm, R,
		   c->hidden_size, c->rms_norm_eps);
	if (L->is_moe)
		return moe_mlp(f, L, l, R);
	if (f->tp) {	/* this rank's partial sum (its columns) into f->mlp, reduced into f->x */
		swiglu(f, L, R, c->intermediate_size);
		OP(f, linear, f->mlp, f->gate, &L->w_down, R);
		return tp_reduce_norm(f, f->mlp, R, next_norm(f, l));
	}
	dense_mlp(f, L, R, c->intermediate_size, f->x, f->mlp);
	return 0;
}

/* The embedding and every layer: f->x holds the final residual stream after. */
int forward_layers(struct forward *f, const struct fwd_batch *b)
{
	int ret;

	if (f->tp && (ret = forward_tp_embed(f, b)))
		return ret;
	if (!f->tp)
		OP(f, embed, f->x, b->tokens, b->n_rows, &f->m->embed);
	for (int l = 0; l < f->m->cfg.n_layers; l++)
		if ((ret = forward_layer(f, l, b)))
			return ret;
	return 0;
}
