/* Sessions to disk and back: the fingerprint that says which model and cache layout a
 * snapshot's KV belongs to, and the engine side of kvcache/snapshot.c, with what a load
 * leaves behind: the sessions that stayed on disk, or a file that must not be replaced. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/engine/engine_internal.h"
#include "daemon/engine/forward_tp.h"
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
	fp_u64(h, (uint64_t)t->q.fmt);
	bytes = t->q.fmt != K_Q_NONE ? (size_t)t->rows * k_quant_row_bytes(t->q.fmt, t->cols)
				      : (size_t)t->rows * (size_t)t->cols * k_dtype_size(t->dtype);
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
		c->first_k_dense, c->moe_layer_freq, c->decoder_sparse_step, (int)c->quant.format,
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
	for (int r = 0; e->spans.n > 1 && r < e->spans.n; r++) {	/* a block's run across the
									 * ranks (tp 1's as before) */
		const struct kv_span *sp = &e->spans.s[r];

		fp_u64(&h, (uint64_t)e->spans.n);
		fp_u64(&h, (uint64_t)sp->split);
		fp_u64(&h, (uint64_t)sp->same_as);
		fp_u64(&h, (uint64_t)sp->row);
		fp_u64(&h, (uint64_t)sp->n_planes);
	}
	fp = kv_siphash_final128(&h);

	memset(meta, 0, sizeof(*meta));
	meta->fingerprint[0] = fp.lo;
	meta->fingerprint[1] = fp.hi;
	if (e->spans.n <= 1)
		snprintf(meta->desc, sizeof(meta->desc), "%.10s %dL w%d #%08x", m->cfg.model_type,
			 m->cfg.n_layers, e->fwd->kv[0].width, (unsigned)(fp.lo >> 32));
	else if (snprintf(meta->desc, sizeof(meta->desc), "%.10s %dL w%d tp%d #%08x", m->cfg.model_type,
			  m->cfg.n_layers, e->fwd->kv[0].width, e->spans.n,
			  (unsigned)(fp.lo >> 32)) >= (int)sizeof(meta->desc))
		meta->desc[sizeof(meta->desc) - 1] = 0;	/* words cut: the fingerprint decides */
	meta->block_tokens = (uint32_t)e->pool.block_tokens;
	meta->elem_bytes = (uint32_t)e->kv_elem_bytes;
	meta->block_bytes = e->block_bytes;
	meta->flags = KV_SNAP_SHUFFLED;
}

/* ---- what a load leaves ------------------------------------------------- */

/* A session of the loaded snapshot that did not fit: its record, and where its frames
 * are in the file it came from. */
struct snap_carry {
	char name[KV_SESSION_NAME_MAX + 1];
	uint64_t owner;
	uint64_t salt;
	int32_t *tokens;	/* (n_tokens) */
	int n_tokens;
	int n_blocks;
	uint64_t *off;		/* (n_blocks) frame offsets in the source file */
	uint64_t *zbytes;	/* (n_blocks) frame lengths */
	int gone;		/* closed, or replaced by a new session of its name */
};

struct engine_snap {
	int last_ret;		/* the last save: sessions written or -errno; 0: none */
	/* sessions carried: the source stays open, so a save that renames a new file
	 * over it still reads the old inode */
	int fd;			/* -1: nothing carried */
	uint64_t len;		/* the source's bytes */
	uint8_t header[KV_SNAP_HEADER_BYTES];	/* its header: the source is unchanged */
	struct snap_carry *c;	/* (n) */
	int n;
	uint8_t *buf;		/* (buf_len) one frame read back */
	size_t buf_len;
	/* a snapshot that was not loaded and could not be set aside stays where it is */
	int hold;
	int hold_id;		/* 1: dev and ino identify it */
	dev_t dev;
	ino_t ino;
	char why[320];
};

static struct engine_snap *snap_get(struct engine *e)
{
	if (!e->snap && (e->snap = calloc(1, sizeof(*e->snap))))
		e->snap->fd = -1;
	return e->snap;
}

static void carry_free(struct engine_snap *sn)
{
	for (int i = 0; i < sn->n; i++)
		free(sn->c[i].off);	/* with zbytes and tokens */
	free(sn->c);
	sn->c = NULL;
	sn->n = 0;
	if (sn->fd >= 0)
		close(sn->fd);
	sn->fd = -1;
}

void engine_snapshot_fini(struct engine *e)
{
	if (!e->snap)
		return;
	carry_free(e->snap);
	free(e->snap->buf);
	free(e->snap);
	e->snap = NULL;
}

int engine_snapshot_status(const struct engine *e)
{
	return e->snap ? e->snap->last_ret : 0;
}

int engine_snapshot_forget(struct engine *e, const char *name, uint64_t owner)
{
	struct engine_snap *sn = e->snap;

	for (int i = 0; sn && i < sn->n; i++) {
		if (!sn->c[i].gone && sn->c[i].owner == owner && !strcmp(sn->c[i].name, name)) {
			sn->c[i].gone = 1;
			return 1;
		}
	}
	return 0;
}

/* Session r of f stays on disk: its record is copied, its frames are found by offset. */
static int carry_add(struct engine_snap *sn, const struct kv_snap_file *f, const struct kv_snap_session *r)
{
	struct snap_carry *v = realloc(sn->c, (size_t)(sn->n + 1) * sizeof(*v)), *k;
	size_t nt = (size_t)r->n_tokens, nb = (size_t)r->n_blocks;

	if (!v)
		return -ENOMEM;
	sn->c = v;
	k = &v[sn->n];
	memset(k, 0, sizeof(*k));
	/* one allocation: offsets, lengths, tokens */
	k->off = malloc(nb * 16 + nt * sizeof(int32_t) + 1);
	if (!k->off)
		return -ENOMEM;
	k->zbytes = k->off + nb;
	k->tokens = (int32_t *)(k->zbytes + nb);
	snprintf(k->name, sizeof(k->name), "%s", r->name);
	k->owner = r->owner;
	k->salt = r->salt;
	k->n_tokens = r->n_tokens;
	k->n_blocks = r->n_blocks;
	if (nt)
		memcpy(k->tokens, r->tokens, nt * sizeof(int32_t));
	for (size_t b = 0; b < nb; b++) {
		k->off[b] = (uint64_t)(r->z[b] - (const uint8_t *)f->map);
		k->zbytes[b] = r->zbytes[b];
	}
	sn->n++;
	return 0;
}

/* Opens the file the carried sessions came from: the same bytes f mapped, or -ESTALE. */
static int carry_open(struct engine_snap *sn, const char *path, const struct kv_snap_file *f)
{
	struct stat st;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != f->len ||
	    pread(fd, sn->header, sizeof(sn->header), 0) != (ssize_t)sizeof(sn->header) ||
	    memcmp(sn->header, f->map, sizeof(sn->header))) {
		close(fd);
		return -ESTALE;
	}
	sn->fd = fd;
	sn->len = f->len;
	return 0;
}

/* Still the file the carried sessions came from (nobody wrote into it since)? */
static int carry_source_ok(struct engine_snap *sn)
{
	uint8_t h[KV_SNAP_HEADER_BYTES];
	struct stat st;

	return !fstat(sn->fd, &st) && (uint64_t)st.st_size == sn->len &&
	       pread(sn->fd, h, sizeof(h), 0) == (ssize_t)sizeof(h) && !memcmp(h, sn->header, sizeof(h));
}

static int carry_frame(struct engine_snap *sn, const struct snap_carry *k, int b, const void **z,
		       size_t *zbytes)
{
	size_t n = (size_t)k->zbytes[b], got = 0;

	if (n > sn->buf_len) {
		uint8_t *p = realloc(sn->buf, n);

		if (!p)
			return -ENOMEM;
		sn->buf = p;
		sn->buf_len = n;
	}
	while (got < n) {
		ssize_t r = pread(sn->fd, sn->buf + got, n - got, (off_t)(k->off[b] + got));

		if (r <= 0)
			return r < 0 ? -errno : -EIO;
		got += (size_t)r;
	}
	*z = sn->buf;
	*zbytes = n;
	return 0;
}

/* The snapshot at dir could not be loaded nor set aside: saves leave it in place. */
static void hold_file(struct engine_snap *sn, const char *dir, const char *why)
{
	char path[4096];
	struct stat st;

	snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
	sn->hold = 1;
	sn->hold_id = !lstat(path, &st);
	if (sn->hold_id) {
		sn->dev = st.st_dev;
		sn->ino = st.st_ino;
	}
	snprintf(sn->why, sizeof(sn->why), "%s", why);
}

/* -EEXIST while the held file is still at dir; the hold ends once it is gone. */
static int hold_check(struct engine_snap *sn, const char *dir, char *err, size_t err_len)
{
	char path[4096];
	struct stat st;

	if (!sn || !sn->hold)
		return 0;
	snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
	if (lstat(path, &st) ? errno == ENOENT
			     : sn->hold_id && (st.st_dev != sn->dev || st.st_ino != sn->ino)) {
		sn->hold = 0;
		return 0;
	}
	snprintf(err, err_len, "snapshot: not writing over %s, which was not loaded (%s); move it "
		 "away to save sessions again", path, sn->why);
	return -EEXIST;
}

/* ---- save ----------------------------------------------------------------- */

struct save_ctx {
	struct engine *e;
	struct kv_session **sessions;	/* (n_live) in the order written */
	int n_live;
	const struct snap_carry **carried;	/* then these */
};

static int save_frame(void *ctx, int si, int b, const void **z, size_t *zbytes)
{
	struct save_ctx *c = ctx;
	struct kv_session *s;
	int ret;

	if (si >= c->n_live)
		return carry_frame(c->e->snap, c->carried[si - c->n_live], b, z, zbytes);
	s = c->sessions[si];
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

/* The carried sessions to write after the live ones: not gone, not replaced. */
static int carried_to_write(struct engine *e, struct save_ctx *ctx, struct kv_snap_session *rec, int n)
{
	struct engine_snap *sn = e->snap;

	if (!sn || sn->fd < 0)
		return n;
	if (!carry_source_ok(sn)) {
		/* written into in place since the load: what is there is not theirs */
		for (int i = 0; i < sn->n; i++)
			e->stats.sessions_dropped += !sn->c[i].gone;
		carry_free(sn);
		return n;
	}
	for (int i = 0; i < sn->n; i++) {
		struct snap_carry *k = &sn->c[i];

		if (k->gone || kv_session_find(&e->sessions, k->name, k->owner))
			continue;
		snprintf(rec[n].name, sizeof(rec[n].name), "%s", k->name);
		rec[n].owner = k->owner;
		rec[n].salt = k->salt;
		rec[n].tokens = k->tokens;
		rec[n].n_tokens = k->n_tokens;
		rec[n].n_blocks = k->n_blocks;
		ctx->carried[n - ctx->n_live] = k;
		n++;
	}
	return n;
}

int engine_snapshot_save(struct engine *e, const char *dir, char *err, size_t err_len)
{
	struct engine_snap *sn = snap_get(e);
	struct kv_snap_meta meta;
	struct kv_snap_session *rec;
	struct save_ctx ctx = { .e = e };
	int n = 0, cap = e->sessions.n + (sn ? sn->n : 0), ret;

	engine_snap_meta(e, &meta);
	rec = calloc((size_t)cap + 1, sizeof(*rec));
	ctx.sessions = calloc((size_t)e->sessions.n + 1, sizeof(*ctx.sessions));
	ctx.carried = calloc((size_t)cap + 1, sizeof(*ctx.carried));
	if (!sn || !rec || !ctx.sessions || !ctx.carried) {
		ret = -ENOMEM;
		snprintf(err, err_len, "snapshot: out of memory");
		goto out;
	}
	if ((ret = hold_check(sn, dir, err, err_len)))
		goto out;
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
	ctx.n_live = n;
	n = carried_to_write(e, &ctx, rec, n);
	ret = kv_snap_write(dir, &meta, rec, n, save_frame, &ctx, err, err_len);
out:
	free(rec);
	free(ctx.sessions);
	free(ctx.carried);
	if (sn)
		sn->last_ret = ret ? ret : n;
	return ret ? ret : n;
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

/* Session r into the host tier, or left on disk with the reason counted. */
static int take_session(struct engine *e, const struct kv_snap_file *f, const struct kv_snap_session *r,
			struct engine_snap_load *rep)
{
	int *why, ret;
	uint64_t zb = 0;

	if (!e->host_enabled)
		why = &rep->kept_no_host;
	else if (r->n_blocks > e->pool.n_blocks)
		why = &rep->kept_too_big;
	else if (kv_sessions_count_owner(&e->sessions, r->owner) >= e->max_sessions)
		why = &rep->kept_quota;
	else if ((ret = load_session(e, r)))
		why = &rep->kept_budget;	/* -ENOSPC, or -ENOMEM: host memory either way */
	else {
		rep->loaded++;
		return 0;
	}
	if ((ret = carry_add(e->snap, f, r)))
		return ret;
	for (int b = 0; b < r->n_blocks; b++)
		zb += r->zbytes[b];
	(*why)++;
	rep->kept++;
	rep->kept_zbytes += zb;
	return 0;
}

/* A snapshot that was not loaded: set aside when refused, else held in place. */
static void not_loaded(struct engine *e, const char *dir, int ret, struct engine_snap_load *rep,
		       char *err, size_t err_len)
{
	char why[320];

	snprintf(why, sizeof(why), "%s", err[0] ? err : strerror(-ret));
	if ((ret == -EBADMSG || ret == -ESTALE) &&
	    !kv_snap_set_aside(dir, rep->set_aside, sizeof(rep->set_aside), err, err_len)) {
		snprintf(err, err_len, "%s", why);
		return;
	}
	rep->set_aside[0] = 0;
	rep->held = 1;
	hold_file(e->snap, dir, why);
	if (ret == -EBADMSG || ret == -ESTALE) {	/* err: why the set-aside failed */
		size_t n = strlen(why);

		snprintf(why + n, sizeof(why) - n, "; %s", err);
	}
	snprintf(err, err_len, "%s", why);
}

int engine_snapshot_load(struct engine *e, const char *dir, struct engine_snap_load *rep,
			 char *err, size_t err_len)
{
	struct engine_snap_load spare;
	struct kv_snap_meta meta;
	struct kv_snap_file f = { 0 };
	char path[4096];
	int ret;

	if (!rep)
		rep = &spare;
	memset(rep, 0, sizeof(*rep));
	rep->host_budget = e->host_enabled ? e->host.budget : 0;
	if (e->sessions.n || (e->snap && e->snap->n)) {
		snprintf(err, err_len, "snapshot: the engine already has %d sessions", e->sessions.n);
		return -EBUSY;
	}
	if (!snap_get(e)) {
		snprintf(err, err_len, "snapshot: out of memory");
		return -ENOMEM;
	}
	err[0] = 0;
	rep->stale_temps = kv_snap_clean_temps(dir, rep->stale_temp, sizeof(rep->stale_temp));
	engine_snap_meta(e, &meta);
	ret = kv_snap_read(&f, dir, &meta, err, err_len);
	if (!ret && (ret = check_loaded(e, &f, err, err_len)))
		kv_snap_release(&f);
	if (ret) {
		if (ret != -ENOENT)
			not_loaded(e, dir, ret, rep, err, err_len);
		return ret;
	}
	for (int i = 0; i < f.n_sessions && !ret; i++)
		ret = take_session(e, &f, &f.sessions[i], rep);
	snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
	if (!ret && e->snap->n)
		ret = carry_open(e->snap, path, &f);
	if (ret) {
		/* the sessions that did not fit cannot be carried: the file stays as it is */
		snprintf(err, err_len, "snapshot: %d sessions did not fit and cannot be carried over: %s",
			 f.n_sessions - rep->loaded, strerror(-ret));
		carry_free(e->snap);
		rep->held = 1;
		hold_file(e->snap, dir, err);
		ret = 0;
	}
	kv_snap_release(&f);
	return ret;
}
