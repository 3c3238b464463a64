/* Sessions to disk and back: the fingerprint that says which model and cache layout a
 * snapshot's KV belongs to, and the engine side of kvcache/snapshot.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine_internal.h"
#include "kvcache/snapshot.h"

#define FP_SAMPLE_BYTES 4096	/* bytes hashed from each end of a sampled weight */

/* A fixed key: the fingerprint identifies, it does not authenticate. */
static const uint64_t fp_key[2] = { 0x6b6465632d6b762dULL, 0x66696e6765727072ULL };

static void fp_u64(struct kv_siphash *h, uint64_t v)
{
	uint8_t b[8];

	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)(v >> (8 * i));
	kv_siphash_update(h, b, 8);
}

static void fp_f64(struct kv_siphash *h, double d)
{
	uint64_t v;

	memcpy(&v, &d, sizeof(v));
	fp_u64(h, v);
}

/* Shape, type and the bytes at both ends of a weight: tells fine-tunes and seeds of
 * one config apart without reading the whole model. */
static void fp_tensor(struct kv_siphash *h, const struct model_tensor *t)
{
	size_t bytes, n;

	fp_u64(h, (uint64_t)t->dtype);
	fp_u64(h, (uint64_t)t->rows);
	fp_u64(h, (uint64_t)t->cols);
	if (!t->data)
		return;
	bytes = (size_t)t->rows * (size_t)t->cols * k_dtype_size(t->dtype);
	n = bytes < FP_SAMPLE_BYTES ? bytes : FP_SAMPLE_BYTES;
	kv_siphash_update(h, t->data, n);
	kv_siphash_update(h, (const uint8_t *)t->data + bytes - n, n);
}

static void fp_config(struct kv_siphash *h, const struct model_config *c)
{
	const struct k_rope_params *r = &c->rope;
	const struct k_moe_route_params *m = &c->route;
	const int64_t ints[] = {
		c->arch, c->dtype, c->vocab_size, c->hidden_size, c->n_layers, c->n_heads,
		c->n_kv_heads, c->head_dim, c->intermediate_size, c->tie_word_embeddings, c->qk_norm,
		c->mla, c->q_lora_rank, c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim,
		c->v_head_dim, c->n_experts, c->top_k, c->moe_intermediate_size, c->n_shared_experts,
		c->first_k_dense, c->moe_layer_freq, c->decoder_sparse_step, c->fp8_weights,
		r->type, r->dim, r->interleaved, r->truncate, r->freq_dtype,
		m->n_experts, m->top_k, m->scoring, m->select, m->n_group, m->topk_group, m->norm_topk_prob,
	};
	const double reals[] = {
		c->rms_norm_eps, c->attn_scale, r->theta, r->factor, r->low_freq_factor,
		r->high_freq_factor, r->original_max_pos, r->beta_fast, r->beta_slow, r->mscale,
		r->mscale_all_dim, r->attention_factor, m->routed_scaling,
	};

	kv_siphash_update(h, c->model_type, strnlen(c->model_type, sizeof(c->model_type)));
	for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++)
		fp_u64(h, (uint64_t)ints[i]);
	for (size_t i = 0; i < sizeof(reals) / sizeof(reals[0]); i++)
		fp_f64(h, reals[i]);
	kv_siphash_update(h, c->mlp_only, sizeof(c->mlp_only));
}

/* What this engine's snapshot blocks are valid for. */
static void engine_snap_meta(const struct engine *e, struct kv_snap_meta *meta)
{
	const struct model *m = e->model;
	struct kv_siphash h;
	struct kv_key fp;

	kv_siphash_init(&h, fp_key, 1);
	fp_config(&h, &m->cfg);
	fp_tensor(&h, &m->embed);
	fp_tensor(&h, &m->final_norm);
	fp_tensor(&h, &m->lm_head);
	for (int l = 0; l < m->cfg.n_layers; l++) {
		fp_tensor(&h, &m->layers[l].attn_norm);
		fp_tensor(&h, &m->layers[l].ffn_norm);
	}
	fp_u64(&h, (uint64_t)e->be->ops->kv_dtype);
	fp_u64(&h, (uint64_t)e->fwd->kv[0].width);
	fp = kv_siphash_final128(&h);

	memset(meta, 0, sizeof(*meta));
	meta->fingerprint[0] = fp.lo;
	meta->fingerprint[1] = fp.hi;
	snprintf(meta->desc, sizeof(meta->desc), "%.10s %dL w%d #%08x", m->cfg.model_type, m->cfg.n_layers,
		 e->fwd->kv[0].width, (unsigned)(fp.lo >> 32));
	meta->block_tokens = (uint32_t)e->pool.block_tokens;
	meta->elem_bytes = (uint32_t)e->kv_elem_bytes;
	meta->block_bytes = e->block_bytes;
	meta->flags = KV_SNAP_SHUFFLED;
}

/* ---- save ----------------------------------------------------------------- */

struct save_ctx {
	struct engine *e;
	struct kv_session **sessions;	/* (n) in the order written */
};

static int save_frame(void *ctx, int si, int b, const void **z, size_t *zbytes)
{
	struct save_ctx *c = ctx;
	struct kv_session *s = c->sessions[si];
	int ret;

	if (s->host[b]) {	/* already compressed */
		*z = s->host[b]->z;
		*zbytes = s->host[b]->zbytes;
		return 0;
	}
	if ((ret = engine_block_compress(c->e, s->dev[b], zbytes)))
		return ret;
	*z = c->e->kv_frame;
	return 0;
}

int engine_snapshot_save(struct engine *e, const char *dir, char *err, size_t err_len)
{
	struct kv_snap_meta meta;
	struct kv_snap_session *rec;
	struct save_ctx ctx = { .e = e };
	int n = 0, ret;

	engine_snap_meta(e, &meta);
	rec = calloc((size_t)e->sessions.n + 1, sizeof(*rec));
	ctx.sessions = calloc((size_t)e->sessions.n + 1, sizeof(*ctx.sessions));
	if (!rec || !ctx.sessions) {
		ret = -ENOMEM;
		snprintf(err, err_len, "snapshot: out of memory");
		goto out;
	}
	for (struct kv_session *s = e->sessions.head; s; s = s->next) {
		if (s->closing)
			continue;
		strcpy(rec[n].name, s->name);
		rec[n].owner = s->owner;
		rec[n].salt = s->salt;
		rec[n].tokens = s->tokens;
		rec[n].n_tokens = s->n_tokens;
		rec[n].n_blocks = s->n_blocks;
		ctx.sessions[n++] = s;
	}
	ret = kv_snap_write(dir, &meta, rec, n, save_frame, &ctx, err, err_len);
out:
	free(rec);
	free(ctx.sessions);
	return ret;
}

/* ---- load ----------------------------------------------------------------- */

/* One session from the file into the host tier; -ENOSPC when it does not fit. */
static int load_session(struct engine *e, const struct kv_snap_session *r)
{
	int nfull = r->n_tokens / e->pool.block_tokens, ret;
	struct kv_key *keys = malloc((size_t)(nfull + 1) * sizeof(*keys));
	struct kv_session *s = NULL;

	if (!keys)
		return -ENOMEM;
	engine_chain_keys(e, r->salt, r->tokens, r->n_tokens, keys);
	if ((ret = kv_session_create(&e->sessions, r->name, r->owner, r->salt, &s)) ||
	    (ret = kv_session_reserve(s, r->n_tokens, r->n_blocks)))
		goto err;
	if (r->n_tokens)
		memcpy(s->tokens, r->tokens, (size_t)r->n_tokens * sizeof(int32_t));
	s->n_tokens = r->n_tokens;
	for (int b = 0; b < r->n_blocks; b++) {
		ret = kv_host_add(&e->host, b < nfull ? &keys[b] : NULL, r->salt, r->z[b], r->zbytes[b],
				  &s->host[b]);
		if (ret)
			goto err;
		s->n_blocks = b + 1;
	}
	s->last_used_ns = engine_now(e);
	free(keys);
	return 0;

err:
	if (s)
		kv_session_destroy(&e->sessions, s, &e->pool, &e->host);
	free(keys);
	return ret;
}

/* Checks a read snapshot against this engine before anything is taken from it. */
static int check_loaded(const struct engine *e, const struct kv_snap_file *f, char *err, size_t err_len)
{
	int vocab = e->model->cfg.vocab_size;

	for (int i = 0; i < f->n_sessions; i++) {
		const struct kv_snap_session *s = &f->sessions[i];

		for (int t = 0; t < s->n_tokens; t++) {
			if (s->tokens[t] < 0 || s->tokens[t] >= vocab) {
				snprintf(err, err_len, "snapshot refused: session '%s' has token %d outside the vocabulary",
					 s->name, s->tokens[t]);
				return -EBADMSG;
			}
		}
	}
	return 0;
}

int engine_snapshot_load(struct engine *e, const char *dir, int *n_loaded, int *n_skipped,
			 char *err, size_t err_len)
{
	struct kv_snap_meta meta;
	struct kv_snap_file f;
	int loaded = 0, skipped = 0, ret;

	if (n_loaded)
		*n_loaded = 0;
	if (n_skipped)
		*n_skipped = 0;
	if (e->sessions.n) {
		snprintf(err, err_len, "snapshot: the engine already has %d sessions", e->sessions.n);
		return -EBUSY;
	}
	engine_snap_meta(e, &meta);
	if ((ret = kv_snap_read(&f, dir, &meta, err, err_len)))
		return ret;
	if ((ret = check_loaded(e, &f, err, err_len)))
		goto out;
	for (int i = 0; i < f.n_sessions; i++) {
		const struct kv_snap_session *r = &f.sessions[i];

		/* a session the device could never hold, over the owner's count, or
		 * beyond the host budget stays on disk only */
		if (!e->host_enabled || r->n_blocks > e->pool.n_blocks ||
		    kv_sessions_count_owner(&e->sessions, r->owner) >= e->max_sessions) {
			skipped++;
			continue;
		}
		ret = load_session(e, r);
		if (ret == -ENOMEM) {
			snprintf(err, err_len, "snapshot: out of memory loading session '%s'", r->name);
			kv_sessions_fini(&e->sessions, &e->pool, &e->host);
			goto out;
		}
		if (ret)
			skipped++;
		else
			loaded++;
	}
	ret = 0;
	if (n_loaded)
		*n_loaded = loaded;
	if (n_skipped)
		*n_skipped = skipped;
out:
	kv_snap_release(&f);
	return ret;
}
