/* The scheduler: continuous batching over the engine. Each iteration the engine
 * thread hands it the requests taken from the clients' rings; sched_step then runs
 * one engine step (sched_step.c) that decodes one token for every running request
 * and, within a token budget, prefills chunks of new ones, and writes the sampled
 * tokens into the clients' event rings; requests are preempted when the KV cache
 * runs short (sched_preempt.c) and may speculate (sched_spec.c). Engine thread only. */
#ifndef KD_DAEMON_SCHED_H
#define KD_DAEMON_SCHED_H

#include <stdint.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/spec_ngram.h"
#include "daemon/sched/client_conn.h"
#include "daemon/sched/metrics.h"
#include "ipc/ipc_proto.h"

#define SCHED_DEFAULT_MAX_BATCH 64
#define SCHED_DEFAULT_STEP_TOKENS 256
#define SCHED_DEFAULT_MAX_INFLIGHT 32
#define SCHED_DEFAULT_MAX_SESSIONS 64
#define SCHED_DEFAULT_STALL_MS 5000
#define SCHED_DEFAULT_PREFILL_PACE 2.5

struct sched_opts {
	int max_batch;		/* requests in the running batch; <= 0: default */
	int step_tokens;	/* tokens per step (decodes + prefill chunks); <= 0: default */
	int max_inflight;	/* requests per client; <= 0: default */
	int max_sessions;	/* session names per client; <= 0: default */
	int stall_ms;		/* a request paused on a full event ring is cancelled after this */
	int share_prefix;	/* 1: one prefix-cache salt for every uid (--share-prefix-cache) */
	int no_prefix_wait;	/* 1: admit a request at once even while another one is
				 * prefilling the same prompt prefix (--no-prefix-wait) */
	double prefill_pace;	/* a step that carries prompt chunks while requests decode
				 * aims at no more than this many decode-only steps' time
				 * (--prefill-pace); 0: the default; < 0: off (the token
				 * budget alone) */
	struct spec_opts spec;	/* --spec: requests' default (k == 0: off) */
};

/* One session name in use, for kdctl sessions. */
struct sched_session_info {
	char name[IPC_SESSION_MAX];
	uint32_t client_id;
	int inflight;		/* requests in flight now */
	uint64_t total;		/* requests submitted with it */
};

struct sched_report {
	int running, waiting;
	int kv_blocks_used, kv_blocks_total;
	struct engine_cache_status cache;
	int draining;
	uint64_t prefix_hit_tokens;
	struct engine_stats stats;
	struct engine_session_info *kv_sessions;	/* (n_kv_sessions) malloc'd, like sessions */
	int n_kv_sessions;
	struct metrics m;
	struct sched_session_info *sessions;	/* (n_sessions) malloc'd; the report's owner frees */
	int n_sessions;
};

struct sched;

int sched_create(struct sched **out, struct engine *e, const struct sched_opts *o);

/* The engine thread's pass through its loop took ns (kd_engine_loop_gap_max_seconds). */
void sched_note_loop(struct sched *s, uint64_t ns);
void sched_destroy(struct sched *s);	/* accepts NULL; releases every request's KV */

/* A record taken from c's ring (client_conn_take): requests join the waiting queue
 * or end at once with an error event; cancels find their request. Takes tokens. */
void sched_submit(struct sched *s, struct client_conn *c, const struct ipc_sub *rec,
		  int32_t *tokens, uint64_t t_pickup_ns);

/* Forgets c: its requests are released without events (c is gone or dead). */
void sched_drop_client(struct sched *s, struct client_conn *c);

/* Draining: new requests end with IPC_DETAIL_SHUTDOWN errors; running ones go on. */
void sched_set_draining(struct sched *s, int on);

/* Ends every request with a CANCELLED event: the shutdown timeout (timeout_ms, which
 * the event's message states) ran out. */
void sched_cancel_all(struct sched *s, uint32_t timeout_ms);

/* Requests running or waiting. */
int sched_busy(const struct sched *s);

/* Whether a step would do something now (some request can run). */
int sched_runnable(struct sched *s);

/* One engine step and its events (written, not yet published: see touched).
 * Returns the requests stepped (0: nothing could run) or -errno on an engine error
 * (the step's requests then end with error events). */
int sched_step(struct sched *s, uint64_t now_ns);

/* Nanoseconds until a paused request's stall timeout fires (INT64_MAX: none). */
int64_t sched_next_timeout(const struct sched *s, uint64_t now_ns);

/* Fills r (r->sessions malloc'd). 0 or -ENOMEM. */
int sched_report(struct sched *s, struct sched_report *r);

#endif
