/* Sessions on the engine: a turn starts on the session's blocks, ends by handing the
 * sequence's blocks to the session; quotas, idle timers and the listing. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine_internal.h"

static void session_free(struct engine *e, struct kv_session *sess)
{
	engine_session_cancel_move(e, sess);
	kv_session_destroy(&e->sessions, sess, &e->pool, &e->host);
}

int engine_session_open(struct engine *e, const char *name, uint64_t owner, uint64_t salt,
			struct kv_session **out)
{
	struct kv_session *s;
	int ret;

	*out = NULL;
	if (!kv_session_name_ok(name))
		return -EINVAL;
	s = kv_session_find(&e->sessions, name, owner);
	if (s && !s->closing) {
		s->salt = salt;
		*out = s;
		return 0;
	}
	if (s)		/* closed during its turn: the name is free again */
		return -EBUSY;
	if (kv_sessions_count_owner(&e->sessions, owner) >= e->max_sessions)
		return -EDQUOT;
	if ((ret = kv_session_create(&e->sessions, name, owner, salt, &s)))
		return ret;
	/* a session of this name the snapshot load left on disk is replaced: the new
	 * one is what the next snapshot keeps */
	engine_snapshot_forget(e, name, owner);
	s->last_used_ns = engine_now(e);
	*out = s;
	return 0;
}

struct kv_session *engine_session_find(const struct engine *e, const char *name, uint64_t owner)
{
	struct kv_session *s = kv_session_find(&e->sessions, name, owner);

	return s && !s->closing ? s : NULL;
}

/* Tokens two histories share from the start. */
static int common_prefix(const int32_t *a, int na, const int32_t *b, int nb)
{
	int n = na < nb ? na : nb, i = 0;

	while (i < n && a[i] == b[i])
		i++;
	return i;
}

/* The session's full blocks 0..max_full in s, as long as they are on the device. */
static void adopt_full_blocks(struct engine *e, struct engine_seq *s, const struct kv_session *sess,
			      const int32_t *prompt, int max_full)
{
	int bt = e->pool.block_tokens;

	while (s->n_keyed < max_full && sess->dev[s->n_keyed] >= 0) {
		int b = s->n_keyed;
		int32_t id = sess->dev[b];
		struct kv_key k = kv_prefix_key(&e->prefix, s->salt, s->chain, prompt + (size_t)b * bt, bt);

		kv_pool_ref(&e->pool, id);
		/* the index may have lost this key (the copy it named was evicted) */
		engine_register_block(e, k, s->salt, id);
		s->blocks[s->n_blocks++] = id;
		memcpy(s->tokens + (size_t)b * bt, prompt + (size_t)b * bt, (size_t)bt * sizeof(int32_t));
		s->n_keyed++;
		s->n_tokens = s->n_keyed * bt;
		s->chain = k;
	}
}

/* When the prompt continues the whole history, the session's partial last block
 * moves to the sequence, which writes on into it: only new tokens are computed.
 * It moves rather than being shared because it is about to be written; the
 * session is left with its full blocks until the turn is saved. */
static void adopt_partial_block(struct engine *e, struct engine_seq *s, struct kv_session *sess,
				int n, int common)
{
	int bt = e->pool.block_tokens, nfull = sess->n_tokens / bt, rest = sess->n_tokens % bt;
	int32_t id;

	if (!rest || common != sess->n_tokens || n <= sess->n_tokens || s->n_blocks != nfull ||
	    s->n_tokens != nfull * bt)
		return;
	id = sess->dev[nfull];
	if (id < 0 || e->pool.refs[id] != 1)	/* someone else holds it: it would be written under them */
		return;
	s->blocks[s->n_blocks++] = id;
	memcpy(s->tokens + s->n_tokens, sess->tokens + s->n_tokens, (size_t)rest * sizeof(int32_t));
	s->n_tokens += rest;
	sess->dev[nfull] = -1;
	if (sess->host[nfull]) {
		kv_host_unref(&e->host, sess->host[nfull]);
		sess->host[nfull] = NULL;
	}
	sess->n_blocks = nfull;
	sess->n_tokens = nfull * bt;
}

int engine_seq_start_session(struct engine *e, struct engine_seq *s, struct kv_session *sess,
			     const int32_t *prompt, int n, int *cached_tokens)
{
	int bt = e->pool.block_tokens, common, max_full, ret;

	if (cached_tokens)
		*cached_tokens = 0;
	if (sess->busy || sess->closing)
		return -EBUSY;
	if ((ret = engine_seq_begin(e, s, prompt, n, sess->salt)))
		return ret;
	sess->busy = 1;
	/* an offload in flight is cancelled, a restore in flight waited for; a failed
	 * restore leaves the session whole: what came back is used, the rest is
	 * recomputed */
	engine_session_settle(e, sess);
	if (kv_session_blocks_on_host(sess))
		engine_session_to_device(e, sess);
	common = common_prefix(sess->tokens, sess->n_tokens, prompt, n);
	max_full = (common < n - 1 ? common : n - 1) / bt;
	adopt_full_blocks(e, s, sess, prompt, max_full);
	engine_seq_map_cached(e, s, prompt, (n - 1) / bt);
	adopt_partial_block(e, s, sess, n, common);
	e->stats.prefix_hit_tokens += (uint64_t)s->n_tokens;
	if (cached_tokens)
		*cached_tokens = s->n_tokens;
	return 0;
}

/* Whether the device cache is contended: fewer than a quarter of its blocks free or
 * cached. A quota protects the other owners' share, and only binds when they could
 * miss it: offloading an owner's idle sessions while the cache is mostly free would
 * only cost compression and restores (16 agent sessions of one uid on an 8B model
 * moved 7.5 GB to the host tier in 50 s at 13% device use, issue 21). */
static int cache_contended(const struct engine *e)
{
	return kv_pool_available(&e->pool) < e->pool.n_blocks / 4;
}

/* Over quota while the cache is contended: the owner's idle sessions go to the host
 * tier, oldest first and sess last; where that fails they lose their KV, so the quota
 * holds either way. */
static void enforce_quota(struct engine *e, struct kv_session *sess)
{
	/* offloads run on the mover: what they will free counts as gone already */
	int pinned = kv_sessions_owner_device_blocks(&e->sessions, sess->owner);

	for (struct kv_session *s = e->sessions.head; s; s = s->next)
		if (s->owner == sess->owner && s->job && !engine_session_restoring(s))
			pinned -= kv_session_blocks_on_device(s);
	while (cache_contended(e) && pinned > e->session_quota_blocks) {
		struct kv_session *v = NULL;

		for (struct kv_session *s = e->sessions.head; s; s = s->next)
			if (s != sess && s->owner == sess->owner && !s->busy && !s->job &&
			    kv_session_blocks_on_device(s) && (!v || s->last_used_ns < v->last_used_ns))
				v = s;
		if (!v && !sess->job && kv_session_blocks_on_device(sess))
			v = sess;
		if (!v)
			return;		/* the rest is pinned by running turns */
		pinned -= kv_session_blocks_on_device(v);
		if (engine_session_offload_start(e, v, HOST_MOVE_QUOTA)) {
			kv_session_drop_kv(v, &e->pool, &e->host);
			e->stats.sessions_dropped++;
		}
	}
}

int engine_session_save(struct engine *e, struct kv_session *sess, const struct engine_seq *s)
{
	int nb = kv_pool_blocks_for(&e->pool, s->n_tokens), ret;

	ret = kv_session_reserve(sess, s->n_tokens, nb);
	if (!ret) {
		/* take the new references before dropping the old: shared blocks never
		 * touch zero in between */
		for (int i = 0; i < nb; i++)
			kv_pool_ref(&e->pool, s->blocks[i]);
		kv_session_drop_kv(sess, &e->pool, &e->host);
		for (int i = 0; i < nb; i++)
			sess->dev[i] = s->blocks[i];
		if (s->n_tokens)
			memcpy(sess->tokens, s->tokens, (size_t)s->n_tokens * sizeof(int32_t));
		sess->n_tokens = s->n_tokens;
		sess->n_blocks = nb;
	}
	sess->busy = 0;
	sess->last_used_ns = engine_now(e);
	if (sess->closing) {
		session_free(e, sess);
		return ret;
	}
	if (!ret)
		enforce_quota(e, sess);
	return ret;
}

void engine_session_cancel(struct engine *e, struct kv_session *sess)
{
	sess->busy = 0;
	sess->last_used_ns = engine_now(e);
	if (sess->closing)
		session_free(e, sess);
}

int engine_session_close(struct engine *e, const char *name, uint64_t owner)
{
	struct kv_session *s = kv_session_find(&e->sessions, name, owner);

	if (!kv_session_name_ok(name))
		return -EINVAL;
	if (!s || s->closing)	/* one the load left on disk is closed there */
		return engine_snapshot_forget(e, name, owner) ? 0 : -ENOENT;
	if (s->busy)
		s->closing = 1;
	else
		session_free(e, s);
	return 0;
}

int engine_sessions_list(const struct engine *e, struct engine_session_info *out, int max)
{
	uint64_t now = engine_now(e);
	int n = 0;

	for (const struct kv_session *s = e->sessions.head; s; s = s->next) {
		if (s->closing)
			continue;
		if (n < max) {
			struct engine_session_info *i = &out[n];

			memset(i, 0, sizeof(*i));
			strcpy(i->name, s->name);
			i->owner = s->owner;
			i->n_tokens = s->n_tokens;
			i->blocks_device = kv_session_blocks_on_device(s);
			i->blocks_host = kv_session_blocks_on_host(s);
			i->busy = s->busy;
			i->idle_s = s->busy || now < s->last_used_ns ? 0 : (double)(now - s->last_used_ns) * 1e-9;
		}
		n++;
	}
	return n;
}

void engine_tick(struct engine *e)
{
	uint64_t now = engine_now(e);
	struct kv_session *s, *next;

	for (s = e->sessions.head; s; s = next) {
		int64_t idle = now > s->last_used_ns ? (int64_t)(now - s->last_used_ns) : 0;

		next = s->next;
		if (s->busy)
			continue;
		if (e->session_ttl_ns >= 0 && idle >= e->session_ttl_ns) {
			session_free(e, s);
			e->stats.sessions_expired++;
		} else if (e->offload_after_ns >= 0 && idle >= e->offload_after_ns && e->host_enabled &&
			   !s->job && kv_session_blocks_on_device(s) &&
			   (!s->offload_failed_ns || now - s->offload_failed_ns >= (uint64_t)e->offload_after_ns)) {
			/* on the mover; a failure (host tier full) is retried one
			 * offload_after later, not every tick: each try compresses the
			 * whole session */
			s->offload_failed_ns = engine_session_offload_start(e, s, HOST_MOVE_IDLE) ? (now ? now : 1) : 0;
		}
	}
}
