/* KV between tiers: device blocks to compressed host blocks and back; a session's
 * offload and restore as jobs of the mover thread (engine_mover.h), started and
 * committed here on the engine thread, or waited for; and the two make-room policies
 * (device: offload idle sessions; host: drop the oldest offloaded ones). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/engine/engine_internal.h"

/* ---- one block ------------------------------------------------------------ */

static int block_copy(struct engine *e, int32_t block, void *host, int to_device)
{
	if (block < 0 || block >= e->pool.n_blocks)
		return -EINVAL;
	return kv_spans_copy(&e->spans, block, host, to_device, 0);
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

/* ---- moves on the mover ---------------------------------------------------------
 * A session's offload or restore is a job: the engine thread takes the references
 * the job needs (the device blocks it reads or fills, the host frames it decodes),
 * the mover does the copies and the codec, and the engine thread commits the result
 * (engine_host_poll) or, when the session changed meanwhile, drops it. */

/* Keys of the session's full blocks: malloc'd (at least one entry), or NULL. */
static struct kv_key *session_keys(const struct engine *e, const struct kv_session *s)
{
	int nfull = s->n_tokens / e->pool.block_tokens;
	struct kv_key *keys = malloc((size_t)(nfull + 1) * sizeof(*keys));

	if (keys)
		engine_chain_keys(e, s->salt, s->tokens, s->n_tokens, keys);
	return keys;
}

static int is_full(const struct engine *e, const struct kv_session *s, int i)
{
	return i < s->n_tokens / e->pool.block_tokens;
}

/* A job for s (marked moving), on e's list; NULL when out of memory. */
static struct host_job *job_new(struct engine *e, struct kv_session *s, int restore, int flags)
{
	struct host_job *j = calloc(1, sizeof(*j));

	if (!j)
		return NULL;
	j->keys = session_keys(e, s);
	j->mj.b = calloc((size_t)s->n_blocks + 1, sizeof(*j->mj.b));
	if (!j->keys || !j->mj.b) {
		free(j->keys);
		free(j->mj.b);
		free(j);
		return NULL;
	}
	j->mj.restore = restore;
	j->sess = s;
	j->flags = flags;
	j->t0 = engine_now(e);
	j->next = e->host_jobs;
	e->host_jobs = j;
	e->stats.moves_in_flight++;
	s->job = j;
	return j;
}

static struct mover_block *job_add(struct engine *e, struct host_job *j, int idx, int32_t dev,
				   struct kv_host_block *hb)
{
	struct mover_block *b = &j->mj.b[j->mj.n++];

	b->idx = idx;
	b->dev = dev;
	b->hb = hb;
	if (dev >= 0) {
		j->bytes += (int64_t)e->block_bytes;
		e->stats.move_bytes_in_flight += e->block_bytes;
	}
	return b;
}

/* Drops what j still holds (last block first, so that blocks reach the LRU leaves
 * first) and frees it. */
static void job_release(struct engine *e, struct host_job *j)
{
	struct host_job **link = &e->host_jobs;

	while (*link && *link != j)
		link = &(*link)->next;
	if (*link)
		*link = j->next;
	e->stats.moves_in_flight--;
	e->stats.move_bytes_in_flight -= (uint64_t)j->bytes;
	if (j->sess && j->sess->job == j)
		j->sess->job = NULL;
	for (int k = j->mj.n - 1; k >= 0; k--) {
		struct mover_block *b = &j->mj.b[k];

		if (b->dev >= 0)
			kv_pool_unref(&e->pool, b->dev);
		if (b->hb)
			kv_host_unref(&e->host, b->hb);
		kv_host_block_free(b->out);
	}
	free(j->keys);
	free(j->mj.b);
	free(j);
}

/* The frames into the host tier (shared by key), then the device references
 * dropped; on failure the session stays whole on the device. */
static int offload_commit(struct engine *e, struct host_job *j)
{
	struct kv_session *s = j->sess;
	int ret = j->mj.ret, k;

	for (k = 0; k < j->mj.n && !ret; k++) {
		struct mover_block *b = &j->mj.b[k];
		const struct kv_key *key = is_full(e, s, b->idx) ? &j->keys[b->idx] : NULL;
		struct kv_host_block *mine = b->out, *hb;
		int fresh;

		if (b->hb) {	/* found by key at the start: its reference moves over */
			s->host[b->idx] = b->hb;
			b->hb = NULL;
			continue;
		}
		fresh = !key || !kv_host_find(&e->host, *key, s->salt);
		ret = kv_host_insert(&e->host, key, s->salt, mine, &hb);
		if (ret == -ENOSPC && !engine_host_make_room(e, kv_host_cost(mine->zbytes), s))
			ret = kv_host_insert(&e->host, key, s->salt, mine, &hb);
		if (ret)
			break;
		b->out = NULL;	/* the store's now (or freed: a copy was there) */
		s->host[b->idx] = hb;
		if (fresh) {
			e->stats.offloaded_blocks++;
			e->stats.offloaded_bytes += e->block_bytes;
			e->stats.offloaded_zbytes += hb->zbytes;
		}
	}
	if (ret) {
		while (k-- > 0) {
			int i = j->mj.b[k].idx;

			kv_host_unref(&e->host, s->host[i]);
			s->host[i] = NULL;
		}
		return ret;
	}
	for (k = j->mj.n - 1; k >= 0; k--) {	/* the session's references are the last */
		if (j->mj.b[k].dev >= 0)
			kv_pool_unref(&e->pool, j->mj.b[k].dev);
		j->mj.b[k].dev = -1;
	}
	for (int i = s->n_blocks - 1; i >= 0; i--) {	/* leaves first into the LRU */
		if (s->dev[i] >= 0) {
			/* full blocks stay valid in the LRU: a restore before they are
			 * evicted costs no decompression */
			kv_pool_unref(&e->pool, s->dev[i]);
			s->dev[i] = -1;
		}
	}
	return 0;
}

/* The filled blocks into the session (full ones into the prefix cache); the host
 * copies go once every block is on the device. */
static int restore_commit(struct engine *e, struct host_job *j)
{
	struct kv_session *s = j->sess;

	if (j->mj.ret)
		return j->mj.ret;
	for (int k = 0; k < j->mj.n; k++) {
		struct mover_block *b = &j->mj.b[k];

		s->dev[b->idx] = b->dev;
		if (is_full(e, s, b->idx))
			engine_register_block(e, j->keys[b->idx], s->salt, b->dev);
		b->dev = -1;	/* the job's reference is the session's now */
	}
	e->stats.restored_blocks += (uint64_t)j->mj.n;
	if (kv_session_blocks_on_device(s) == s->n_blocks) {
		for (int i = 0; i < s->n_blocks; i++) {
			if (s->host[i]) {
				kv_host_unref(&e->host, s->host[i]);
				s->host[i] = NULL;
			}
		}
	}
	if (j->moved) {
		e->stats.restores++;
		e->stats.restore_ns += engine_now(e) - j->t0;
	}
	return j->partial ? -ENOSPC : 0;
}

/* Commits j, or drops it when cancelled; frees it. Its result: 0 or -errno. */
static int job_commit(struct engine *e, struct host_job *j)
{
	struct kv_session *s = j->sess;
	int ret;

	if (!s) {
		job_release(e, j);
		return -ECANCELED;
	}
	ret = j->mj.restore ? restore_commit(e, j) : offload_commit(e, j);
	if (ret && j->mj.restore) {
		s->restore_failed = 1;
	} else if (ret && (j->flags & HOST_MOVE_QUOTA)) {
		kv_session_drop_kv(s, &e->pool, &e->host);
		e->stats.sessions_dropped++;
	} else if (ret && (j->flags & HOST_MOVE_IDLE)) {
		uint64_t now = engine_now(e);

		s->offload_failed_ns = now ? now : 1;
	}
	job_release(e, j);
	return ret;
}

/* Commits the done jobs of list; *ret receives want's result where it is one. */
static int commit_list(struct engine *e, struct mover_job *list, const struct host_job *want,
		       int *found, int *ret)
{
	int n = 0;

	while (list) {
		struct host_job *j = (struct host_job *)list;
		int r;

		list = list->next;
		r = job_commit(e, j);
		if (j == want) {	/* compared, not used: j is freed */
			*found = 1;
			*ret = r;
		}
		n++;
	}
	return n;
}

int engine_host_poll(struct engine *e)
{
	int found = 0, ret = 0;

	if (!e->mover)
		return 0;
	return commit_list(e, engine_mover_take(e->mover), NULL, &found, &ret);
}

int engine_host_pending(const struct engine *e)
{
	return e->mover && engine_mover_has_done(e->mover);
}

/* Blocks until want (submitted) is done and commits it, with every job done before
 * it: want's result. */
static int job_wait(struct engine *e, const struct host_job *want)
{
	int found = 0, ret = 0;

	while (!found) {
		struct mover_job *list = engine_mover_take(e->mover);

		if (!list)
			engine_mover_wait(e->mover);
		else
			commit_list(e, list, want, &found, &ret);
	}
	return ret;
}

/* The mover's threads: host_workers, else one per 8 online CPUs, 1 to 4 (the codec
 * runs at 0.2-0.8 GB/s a core; the engine's own threads need the rest). */
static int mover_workers(const struct engine *e)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN) / 8;

	if (e->host_workers > 0)
		return e->host_workers;
	return n < 1 ? 1 : n > 4 ? 4 : (int)n;
}

/* Hands j to the mover (made on first use), or commits it at once when it has
 * nothing to move. 0 or -errno (then j is gone and nothing changed). */
static int job_run(struct engine *e, struct host_job *j)
{
	int ret, moves = 0;

	for (int k = 0; k < j->mj.n; k++)
		moves += j->mj.b[k].dev >= 0;
	if (!moves)
		return job_commit(e, j);
	if (!e->mover) {
		ret = engine_mover_create(&e->mover, &e->spans, &e->codec, mover_workers(e));
		if (ret) {
			j->sess = NULL;
			job_release(e, j);
			return ret;
		}
		if (e->host_wake)
			engine_mover_set_wake(e->mover, e->host_wake, e->host_wake_arg);
	}
	j->mj.delay_us = e->host_delay_us;
	j->submitted = 1;
	engine_mover_submit(e->mover, &j->mj);
	return 0;
}

int engine_session_offload_start(struct engine *e, struct kv_session *s, int flags)
{
	struct host_job *j;

	if (!e->host_enabled)
		return -ENOTSUP;
	if (s->busy || s->job)
		return -EBUSY;
	if (!(j = job_new(e, s, 0, flags)))
		return -ENOMEM;
	for (int i = 0; i < s->n_blocks; i++) {
		struct kv_host_block *hb;

		if (s->dev[i] < 0 || s->host[i])
			continue;
		hb = is_full(e, s, i) ? kv_host_find(&e->host, j->keys[i], s->salt) : NULL;
		if (hb) {	/* another session's copy: shared, nothing to compress */
			kv_host_ref(hb);
			job_add(e, j, i, -1, hb);
		} else {
			/* Full blocks are never written. The partial last one is written
			 * only by a turn that adopts it (refs 1: never while the job holds
			 * it), or past the session's tokens by a sequence saved and still
			 * going on (then the frame's bytes past them are garbage, as a
			 * synchronous copy's would be). */
			kv_pool_ref(&e->pool, s->dev[i]);
			job_add(e, j, i, s->dev[i], NULL);
		}
	}
	return job_run(e, j);
}

/* Starts s's restore: device blocks still cached are taken back at once, the others
 * are allocated now (making room if short) and filled by the mover. *out: the job
 * in flight, or NULL (nothing to decompress: done). 0, -ENOSPC (done, but not every
 * block got a device block), -ENOMEM. */
static int restore_begin(struct engine *e, struct kv_session *s, struct host_job **out)
{
	struct host_job *j;
	int need = 0, ret;

	*out = NULL;
	if (!e->host_enabled || !kv_session_blocks_on_host(s) || s->job)
		return 0;
	if (!(j = job_new(e, s, 1, 0)))
		return -ENOMEM;
	for (int i = 0; i < s->n_blocks; i++) {
		int32_t id;

		if (s->dev[i] >= 0)
			continue;
		j->moved++;
		id = is_full(e, s, i) ? kv_prefix_find(&e->prefix, j->keys[i], s->salt) : -1;
		if (id >= 0) {	/* still cached on the device: no decompression */
			kv_pool_ref(&e->pool, id);
			s->dev[i] = id;
		} else {
			need++;
		}
	}
	if (need > kv_pool_available(&e->pool))
		engine_make_room(e, need, s);	/* pressure: synchronous (engine_make_room) */
	for (int i = 0; i < s->n_blocks && need; i++) {
		int32_t id;

		if (s->dev[i] >= 0)
			continue;
		if ((id = kv_pool_alloc(&e->pool)) < 0) {
			j->partial = 1;	/* the rest stays on the host: recomputed or restored later */
			break;
		}
		kv_host_ref(s->host[i]);
		job_add(e, j, i, id, s->host[i]);
	}
	ret = job_run(e, j);
	if (s->job == j)
		*out = j;
	return ret;
}

int engine_session_restore_start(struct engine *e, struct kv_session *s)
{
	struct host_job *j = s->job;

	if (j && j->mj.restore)
		return 1;
	if (j)	/* an offload in flight: cancelled, the session is whole on the device */
		engine_session_cancel_move(e, s);
	if (s->busy || s->closing || s->restore_failed)
		return 0;
	restore_begin(e, s, &j);
	return j != NULL;
}

int engine_session_restoring(const struct kv_session *s)
{
	return s->job && ((const struct host_job *)s->job)->mj.restore;
}

void engine_session_cancel_move(struct engine *e, struct kv_session *s)
{
	struct host_job *j = s->job;

	if (!j)
		return;
	s->job = NULL;
	j->sess = NULL;
	/* not started: released now; else it comes back through the mover, and its
	 * references keep the blocks it reads or writes until then */
	if (engine_mover_cancel(e->mover, &j->mj))
		job_release(e, j);
}

void engine_session_settle(struct engine *e, struct kv_session *s)
{
	struct host_job *j = s->job;

	s->restore_failed = 0;
	if (j && j->mj.restore)
		job_wait(e, j);
	else if (j)
		engine_session_cancel_move(e, s);
}

void engine_host_fini(struct engine *e)
{
	for (struct host_job *j = e->host_jobs, *next; j; j = next) {
		next = j->next;
		if (j->sess)
			engine_session_cancel_move(e, j->sess);
	}
	while (e->host_jobs) {
		engine_mover_wait(e->mover);
		engine_host_poll(e);
	}
	engine_mover_destroy(e->mover);
	e->mover = NULL;
}

void engine_host_set_wake(struct engine *e, void (*wake)(void *), void *arg)
{
	e->host_wake = wake;
	e->host_wake_arg = arg;
	if (e->mover)
		engine_mover_set_wake(e->mover, wake, arg);
}

/* ---- the same moves, waited for ------------------------------------------------- */

int engine_session_to_host(struct engine *e, struct kv_session *s)
{
	int ret;

	if (s->job)	/* a restore to finish, or the same offload already going */
		job_wait(e, s->job);
	if (!kv_session_blocks_on_device(s))
		return 0;
	ret = engine_session_offload_start(e, s, 0);
	if (!ret && s->job)
		ret = job_wait(e, s->job);
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

int engine_session_to_device(struct engine *e, struct kv_session *s)
{
	struct host_job *j;
	int ret;

	engine_session_settle(e, s);
	ret = restore_begin(e, s, &j);
	if (j)
		ret = job_wait(e, j);
	return ret;
}
/* ---- making room ------------------------------------------------------------- */

/* The least recently used idle session other than keep that want() accepts. */
static struct kv_session *oldest_idle(struct engine *e, const struct kv_session *keep,
				      int (*want)(const struct kv_session *s))
{
	struct kv_session *best = NULL;

	for (struct kv_session *s = e->sessions.head; s; s = s->next)
		if (s != keep && !s->busy && !s->job && want(s) &&
		    (!best || s->last_used_ns < best->last_used_ns))
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

/* Under pressure the restores in flight (but keep's) give their blocks back: the
 * step needs them now, the waiting turn starts its restore again when there is room.
 * Then whether any move on the mover will still release blocks. */
static int moves_to_wait_for(struct engine *e, const struct kv_session *keep)
{
	int any = 0;

	for (struct host_job *j = e->host_jobs, *next; j; j = next) {
		next = j->next;	/* a cancel may release j */
		if (j->sess && j->sess != keep && j->mj.restore && j->submitted)
			engine_session_cancel_move(e, j->sess);
	}
	for (const struct host_job *j = e->host_jobs; j; j = j->next)
		any |= j->submitted && (!j->sess || !j->mj.restore || j->sess != keep);
	return any;
}

/* Synchronous, unlike the idle and quota offloads: a step (or a restore) needs the
 * blocks now, and the alternative, preempting a request, recomputes its whole
 * context, which costs more than compressing idle KV. The idle offload after
 * offload_after and the quota have usually moved idle sessions already. */
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
			int skip = s == keep || s->busy || s->job || !on_device(s);

			for (int t = 0; t < n_tried && !skip; t++)
				skip = tried[t] == s;
			if (!skip && (!best || s->last_used_ns < best->last_used_ns))
				best = s;
		}
		if (!best && moves_to_wait_for(e, keep)) {
			/* offloads already going free their blocks when committed, cancelled
			 * moves when they come back */
			engine_mover_wait(e->mover);
			engine_host_poll(e);
			continue;
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
