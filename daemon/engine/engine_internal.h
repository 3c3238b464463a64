/* What engine.c, engine_host.c, engine_session.c and engine_snapshot.c share; not an
 * interface for anyone else. */
#ifndef KD_DAEMON_ENGINE_INTERNAL_H
#define KD_DAEMON_ENGINE_INTERNAL_H

#include "daemon/engine/engine.h"
#include "daemon/engine/engine_mover.h"

static inline uint64_t engine_now(const struct engine *e)
{
	return e->clock_ns();
}

/* engine.c */
/* Grows s's token and block arrays to hold n_tokens and n_blocks. 0 or -ENOMEM. */
int engine_seq_reserve(struct engine_seq *s, int n_tokens, int n_blocks);
/* Checks prompt (n tokens, ids < vocab) and readies the empty s to take it with
 * prefix caching under salt. 0, -EINVAL, -ENOMEM. */
int engine_seq_begin(struct engine *e, struct engine_seq *s, const int32_t *prompt, int n,
		     uint64_t salt);
/* Extends s, made only of keyed full blocks, with cached blocks of prompt (device,
 * else host) up to max_blocks blocks in all. Arrays must be reserved. */
void engine_seq_map_cached(struct engine *e, struct engine_seq *s, const int32_t *prompt,
			   int max_blocks);
/* Puts an in-use block under (key, salt) in the prefix cache unless the key has one. */
void engine_register_block(struct engine *e, struct kv_key key, uint64_t salt, int32_t block);
/* The key of each full block of tokens[0..n) in turn, into keys (n / block_tokens). */
void engine_chain_keys(const struct engine *e, uint64_t salt, const int32_t *tokens, int n,
		       struct kv_key *keys);

/* engine_host.c */
/* Host memory -> one device block (the inverse of engine_block_read). */
int engine_block_write(struct engine *e, int32_t block, const void *src);
/* Device block -> e->kv_frame: *zbytes its length. 0 or -errno. */
int engine_block_compress(struct engine *e, int32_t block, size_t *zbytes);
/* A new device block holding host block hb's contents: *block with one reference.
 * 0, -ENOSPC (no device block), -EBADMSG, -EIO. Counts stats.restored_blocks; the
 * callers time whole restores. */
int engine_block_restore(struct engine *e, const struct kv_host_block *hb, int32_t *block);
/* Frees host memory for bytes more by dropping the KV of host-only idle sessions
 * (oldest first), never keep's. 0 or -ENOSPC. */
int engine_host_make_room(struct engine *e, size_t bytes, const struct kv_session *keep);

/* A move between the tiers in flight (engine_host.c): the mover's job plus what the
 * engine thread needs to commit it. Engine thread only, but mj between submit and
 * take (engine_mover.h). The references its blocks hold (mj.b[].dev, .hb) are the
 * job's own: tests count them as holders (tests/kvtest.h). */
enum host_move_flags {
	HOST_MOVE_IDLE = 1,	/* engine_tick's: a failure is retried one offload_after later */
	HOST_MOVE_QUOTA = 2,	/* the quota's: a failure drops the session's KV */
};

struct host_job {
	struct mover_job mj;		/* first */
	struct host_job *next;		/* e->host_jobs */
	struct kv_session *sess;	/* NULL once cancelled: the result is discarded */
	int flags;			/* enum host_move_flags */
	int submitted;			/* 0: committed without the mover (nothing to move) */
	int moved;			/* restore: blocks not on the device at the start */
	int partial;			/* restore: some got no device block */
	struct kv_key *keys;		/* (session's full blocks + 1) chained keys */
	int64_t bytes;			/* raw KV bytes it moves */
	uint64_t t0;			/* engine clock at the start */
};

/* Starts moving sess's device blocks to the host tier on the mover: 0 (started,
 * or done at once), -EBUSY (a turn, or a restore in flight), -ENOTSUP, -ENOMEM. */
int engine_session_offload_start(struct engine *e, struct kv_session *sess, int flags);
/* Before a turn on sess: an offload in flight is cancelled, a restore waited for and
 * committed. */
void engine_session_settle(struct engine *e, struct kv_session *sess);
/* Before sess's KV is dropped or sess freed: any move of it is cancelled. */
void engine_session_cancel_move(struct engine *e, struct kv_session *sess);
/* Cancels every move, waits for the mover and stops it (engine_destroy). */
void engine_host_fini(struct engine *e);

/* engine_session_offload and _restore without the busy check (a turn's own restore). */
int engine_session_to_host(struct engine *e, struct kv_session *sess);
int engine_session_to_device(struct engine *e, struct kv_session *sess);

/* engine_snapshot.c */
/* Frees what the load left (carried sessions, held file); engine_destroy's. */
void engine_snapshot_fini(struct engine *e);
/* The session (name, owner) left on disk by the load is dropped (closed, or a new
 * session of that name replaced it). 1 when there was one. */
int engine_snapshot_forget(struct engine *e, const char *name, uint64_t owner);

/* engine_gpus.c: rank r's GPU into devs[r] (r < max(tp, 1)) from o->gpus / n_gpus and
 * o->tp, given how many GPUs are visible; *n_devs the number of distinct GPUs (1:
 * every rank on devs[0]). 0, or -EINVAL / -ENODEV with one line in err. */
int engine_rank_devices(const struct engine_opts *o, int visible, int *devs, int *n_devs,
			char *err, size_t err_len);

#endif
