/* The mover: a small pool of worker threads that copy KV blocks between the device
 * cache and host memory and run the host tier's codec, so that the engine thread does
 * neither. The workers claim a job's blocks one at a time, so a big session's blocks
 * are compressed or decompressed in parallel (blocks are independent frames).
 *
 * Ownership and locking. The engine thread owns every job: it fills one, hands it over
 * with engine_mover_submit and gets it back, done, from engine_mover_take. In between
 * the workers read the job's inputs and write its outputs (a block's out frame by the
 * worker that claimed it; ret); the engine thread touches only job->cancel (atomic).
 * The mover's mutex guards its two lists (queued, done), the jobs' claim counters and
 * ret, and the wake callback, nothing else. A worker never
 * touches the pool, the prefix index, the sessions or the host tier's store: it reads
 * and writes device blocks the job holds references on (so nothing else uses them)
 * through the backend's side copies, which are safe beside the engine thread's ops,
 * and it reads frames the job holds host references on. */
#ifndef KD_DAEMON_ENGINE_MOVER_H
#define KD_DAEMON_ENGINE_MOVER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/engine/kv_spans.h"
#include "kvcache/host_tier.h"

/* One block of a job. */
struct mover_block {
	int idx;			/* the block's index in its session (the engine's) */
	int32_t dev;			/* device block read (offload) or written (restore), one pool
					 * reference held by the job; -1: nothing to move */
	struct kv_host_block *hb;	/* restore: the frame to decode; offload: a copy found by key
					 * at the start (nothing to compress); one host reference held */
	struct kv_host_block *out;	/* offload: the frame made (kv_host_block_new), or NULL */
};

struct mover_job {
	struct mover_job *next;		/* the mover's lists while it has the job */
	int restore;			/* 0: device -> frames; 1: frames -> device */
	int n;
	struct mover_block *b;		/* (n) */
	uint32_t delay_us;		/* tests: sleep per block moved (a slow codec) */
	atomic_int cancel;		/* the engine thread's: no block is started after it */
	int ret;			/* the workers': 0 or -errno (-ECANCELED: stopped) */
	int claimed, running, queued;	/* the mover's (its lock): blocks claimed, blocks in
					 * workers' hands, on its queue */
};

struct engine_mover;

/* A mover for the KV cache whose blocks ks places (every rank's cache; kept by the
 * caller until engine_mover_destroy), codec as c's parameters (each worker its own
 * contexts), with n_workers threads (< 1: one), started at once. 0, -ENOMEM, -errno of
 * pthread_create. Destroyed with engine_mover_destroy. */
int engine_mover_create(struct engine_mover **out, const struct kv_spans *ks, const struct kv_codec *c,
			int n_workers);
/* Stops and joins the thread. The caller has taken back every job it submitted
 * (cancelled, waited for, taken). Accepts NULL. */
void engine_mover_destroy(struct engine_mover *m);

/* wake(arg) is called from a worker each time a job is done (NULL: nobody sleeps on
 * the mover), under the mover's lock: it must not call the mover. */
void engine_mover_set_wake(struct engine_mover *m, void (*wake)(void *), void *arg);

/* Queues j (the worker owns it until engine_mover_take returns it). */
void engine_mover_submit(struct engine_mover *m, struct mover_job *j);
/* The jobs done since the last call, oldest first, or NULL. Never blocks. */
struct mover_job *engine_mover_take(struct engine_mover *m);
/* 1 when jobs are done and not yet taken (a cheap look, for a sleeping loop). */
int engine_mover_has_done(struct engine_mover *m);
/* Blocks until a job is done and not yet taken. */
void engine_mover_wait(struct engine_mover *m);
/* Cancels j: 1 when it had not started (it is the caller's again, untouched), 0 when
 * the worker has it or is done with it (it comes back through engine_mover_take). */
int engine_mover_cancel(struct engine_mover *m, struct mover_job *j);

#endif
