/* KV between tiers: device blocks to compressed host blocks and back, a session's
 * offload and restore, and the two make-room policies (device: offload idle
 * sessions; host: drop the oldest offloaded ones). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine_internal.h"

/* ---- one block ------------------------------------------------------------ */

static int block_copy(struct engine *e, int32_t block, void *host, int to_device)
{
	const struct forward *f = e->fwd;
	size_t plane = (size_t)e->pool.block_tokens * (size_t)f->kv[0].width * e->kv_elem_bytes;
	size_t off = (size_t)block * plane;
	uint8_t *h = host;
	int ret;

	if (block < 0 || block >= e->pool.n_blocks)
		return -EINVAL;
	for (int l = 0; l < e->model->cfg.n_layers; l++) {
		for (int v = 0; v < (e->model->cfg.mla ? 1 : 2); v++) {
			uint8_t *dev = (uint8_t *)(v ? (void *)f->kv[l].v : (void *)f->kv[l].k) + off;

			ret = to_device ? e->be->ops->upload(e->be, dev, h, plane)
					: e->be->ops->download(e->be, h, dev, plane);
			if (ret)
				return ret;
			h += plane;
		}
	}
	return e->be->ops->sync(e->be);
}

int engine_block_read(struct engine *e, int32_t block, void *dst)
{
	return block_copy(e, block, dst, 0);
}

int engine_block_write(struct engine *e, int32_t block, const void *src)
{
	return block_copy(e, block, (void *)src, 1);
}

int engine_block_compress(struct engine *e, int32_t block, size_t *zbytes)
{
	int ret = engine_block_read(e, block, e->kv_raw);

	if (ret)
		return ret;
	return kv_codec_compress(&e->codec, e->kv_frame, kv_codec_bound(&e->codec), zbytes, e->kv_raw);
}

int engine_block_restore(struct engine *e, const struct kv_host_block *hb, int32_t *block)
{
	int id = kv_pool_alloc(&e->pool), ret;

	if (id < 0)
		return id;
	ret = kv_codec_decompress(&e->codec, e->kv_raw, hb->z, hb->zbytes);
	if (!ret)
		ret = engine_block_write(e, id, e->kv_raw);
	if (ret) {
		kv_pool_unref(&e->pool, id);
		return ret;
	}
	e->stats.restored_blocks++;
	*block = id;
	return 0;
}

/* ---- a session -------------------------------------------------------------- */

/* Keys of the session's full blocks: malloc'd (at least one entry), or NULL. */
static struct kv_key *session_keys(const struct engine *e, const struct kv_session *s)
{
	int nfull = s->n_tokens / e->pool.block_tokens;
	struct kv_key *keys = malloc((size_t)(nfull + 1) * sizeof(*keys));

	if (keys)
		engine_chain_keys(e, s->salt, s->tokens, s->n_tokens, keys);
	return keys;
}

/* Host copy of block i (full blocks shared by key, the partial one private). */
static int block_to_host(struct engine *e, struct kv_session *s, int i, const struct kv_key *keys)
{
	const struct kv_key *key = i < s->n_tokens / e->pool.block_tokens ? &keys[i] : NULL;
	struct kv_host_block *hb = key ? kv_host_find(&e->host, *key, s->salt) : NULL;
	size_t zb;
	int ret;

	if (hb) {
		kv_host_ref(hb);
		s->host[i] = hb;
		return 0;
	}
	if ((ret = engine_block_compress(e, s->dev[i], &zb)))
		return ret;
	ret = kv_host_add(&e->host, key, s->salt, e->kv_frame, zb, &hb);
	if (ret == -ENOSPC && !engine_host_make_room(e, kv_host_cost(zb), s))
		ret = kv_host_add(&e->host, key, s->salt, e->kv_frame, zb, &hb);
	if (ret)
		return ret;
	s->host[i] = hb;
	e->stats.offloaded_blocks++;
	e->stats.offloaded_bytes += e->block_bytes;
	e->stats.offloaded_zbytes += zb;
	return 0;
}

int engine_session_to_host(struct engine *e, struct kv_session *s)
{
	struct kv_key *keys;
	uint8_t *added;
	int ret = 0;

	if (!e->host_enabled)
		return -ENOTSUP;
	keys = session_keys(e, s);
	added = calloc((size_t)s->n_blocks + 1, 1);
	if (!keys || !added) {
		ret = -ENOMEM;
		goto out;
	}
	for (int i = 0; i < s->n_blocks && !ret; i++) {
		if (s->dev[i] < 0 || s->host[i])
			continue;
		ret = block_to_host(e, s, i, keys);
		added[i] = !ret;
	}
	for (int i = s->n_blocks - 1; i >= 0; i--) {	/* leaves first into the LRU */
		if (ret && added[i]) {	/* roll back: the session stays on the device */
			kv_host_unref(&e->host, s->host[i]);
			s->host[i] = NULL;
		} else if (!ret && s->dev[i] >= 0) {
			/* full blocks stay valid in the LRU: a restore before they are
			 * evicted costs no decompression */
			kv_pool_unref(&e->pool, s->dev[i]);
			s->dev[i] = -1;
		}
	}
out:
	free(keys);
	free(added);
	return ret;
}

/* Device copy of block i: still cached on the device, else decompressed. */
static int block_to_device(struct engine *e, struct kv_session *s, int i, const struct kv_key *keys)
{
	int full = i < s->n_tokens / e->pool.block_tokens;
	int32_t id = full ? kv_prefix_find(&e->prefix, keys[i], s->salt) : -1;
	int ret;

	if (id >= 0) {
		kv_pool_ref(&e->pool, id);
		s->dev[i] = id;
		return 0;
	}
	ret = engine_block_restore(e, s->host[i], &id);
	if (ret == -ENOSPC && !engine_make_room(e, 1, s))
		ret = engine_block_restore(e, s->host[i], &id);
	if (ret)
		return ret;
	if (full)
		engine_register_block(e, keys[i], s->salt, id);
	s->dev[i] = id;
	return 0;
}

int engine_session_to_device(struct engine *e, struct kv_session *s)
{
	uint64_t t0 = engine_now(e);
	struct kv_key *keys = session_keys(e, s);
	int ret = 0, moved = 0;

	if (!keys)
		return -ENOMEM;
	for (int i = 0; i < s->n_blocks && !ret; i++) {
		if (s->dev[i] < 0) {
			ret = block_to_device(e, s, i, keys);
			moved++;
		}
	}
	/* on error the blocks brought back keep their host copies too: whole either way */
	for (int i = 0; i < s->n_blocks && !ret; i++) {
		if (s->host[i]) {
			kv_host_unref(&e->host, s->host[i]);
			s->host[i] = NULL;
		}
	}
	if (moved) {
		e->stats.restores++;
		e->stats.restore_ns += engine_now(e) - t0;
	}
	free(keys);
	return ret;
}

int engine_session_offload(struct engine *e, struct kv_session *sess)
{
	if (sess->busy)
		return -EBUSY;
	return engine_session_to_host(e, sess);
}

int engine_session_restore(struct engine *e, struct kv_session *sess)
{
	if (sess->busy)
		return -EBUSY;
	return engine_session_to_device(e, sess);
}

/* ---- making room ------------------------------------------------------------- */

/* The least recently used idle session other than keep that want() accepts. */
static struct kv_session *oldest_idle(struct engine *e, const struct kv_session *keep,
				      int (*want)(const struct kv_session *s))
{
	struct kv_session *best = NULL;

	for (struct kv_session *s = e->sessions.head; s; s = s->next)
		if (s != keep && !s->busy && want(s) && (!best || s->last_used_ns < best->last_used_ns))
			best = s;
	return best;
}

static int on_device(const struct kv_session *s)
{
	return s->n_blocks > 0 && kv_session_blocks_on_device(s) > 0;
}

static int host_only(const struct kv_session *s)
{
	return s->n_blocks > 0 && kv_session_blocks_on_device(s) == 0;
}

int engine_make_room(struct engine *e, int need, const struct kv_session *keep)
{
	struct kv_session **tried = NULL;
	int n_tried = 0, ret = 0;

	if (!e->host_enabled)
		return kv_pool_available(&e->pool) >= need ? 0 : -ENOSPC;
	while (kv_pool_available(&e->pool) < need) {
		struct kv_session *best = NULL;

		/* oldest first, skipping the ones whose offload failed this time */
		for (struct kv_session *s = e->sessions.head; s; s = s->next) {
			int skip = s == keep || s->busy || !on_device(s);

			for (int t = 0; t < n_tried && !skip; t++)
				skip = tried[t] == s;
			if (!skip && (!best || s->last_used_ns < best->last_used_ns))
				best = s;
		}
		if (!best) {
			ret = -ENOSPC;
			break;
		}
		if (engine_session_to_host(e, best)) {
			struct kv_session **t = realloc(tried, (size_t)(n_tried + 1) * sizeof(*t));

			if (!t) {
				ret = -ENOMEM;
				break;
			}
			tried = t;
			tried[n_tried++] = best;
		}
	}
	free(tried);
	return ret;
}

int engine_host_make_room(struct engine *e, size_t bytes, const struct kv_session *keep)
{
	while (e->host.used + bytes > e->host.budget) {
		struct kv_session *s = oldest_idle(e, keep, host_only);

		if (!s)
			return -ENOSPC;
		/* its blocks may be shared with other sessions: then nothing is freed
		 * yet, and the loop goes on to the next oldest */
		kv_session_drop_kv(s, &e->pool, &e->host);
		e->stats.sessions_dropped++;
	}
	return 0;
}
