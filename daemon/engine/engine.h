/* The engine: a model on a backend with a paged KV cache, running steps of one or
 * more sequences; with the prefix cache, sessions, the host tier and snapshots on
 * top of that cache (docs/KVCACHE.md). Owned and driven by one thread (the engine
 * thread in kdecd, main in kdbench); nothing here is thread-safe. */
#ifndef KD_DAEMON_ENGINE_H
#define KD_DAEMON_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/engine/forward.h"
#include "daemon/engine/kv_spans.h"
#include "daemon/model/model.h"
#include "kernels/k_sample.h"
#include "kvcache/host_tier.h"
#include "kvcache/kv_pool.h"
#include "kvcache/prefix_index.h"
#include "kvcache/session.h"

#define ENGINE_DEFAULT_BLOCK_TOKENS 16
#define ENGINE_DEFAULT_MAX_ROWS 256
#define ENGINE_DEFAULT_KV_TOKENS 32768
#define ENGINE_DEFAULT_HOST_KV_BYTES (1LL << 30)
#define ENGINE_DEFAULT_MAX_SESSIONS 64		/* per owner */
#define ENGINE_DEFAULT_SESSION_TTL_S 3600
#define ENGINE_DEFAULT_OFFLOAD_AFTER_S 30

#define ENGINE_MAX_GPUS 64

struct engine_opts {
	const char *backend;	/* "cpu" (default), "cuda", or "auto" (backend_pick) */
	int threads;		/* <= 0: one per online CPU; with tp > 1, shared among the ranks */
	int gpus[ENGINE_MAX_GPUS];	/* --gpus (cuda): the GPUs to run on */
	int n_gpus;		/* 0: not given (GPU 0); -1: all visible; else gpus[0..n) */
	int tp;			/* tensor-parallel ranks (docs/PARALLEL.md); <= 1: one. cpu:
				 * any N the shapes split; cuda: one rank per GPU of gpus,
				 * or 2 / 4 virtual ranks on one */
	int ep;			/* with tp > 1: routed experts whole, a share per rank (expert
				 * parallel), not sliced across all ranks */
	int mla_cp;		/* with tp > 1 on an MLA model: the latent cache split by
				 * tokens across the ranks, 1/N each (decode context
				 * parallel, --mla-cp), not replicated */
	enum backend_allreduce allreduce;	/* --allreduce (cuda): how the ranks reduce;
				 * nccl at tp 1 runs a one-rank NCCL communicator
				 * through the tp reduction code (docs/PARALLEL.md) */
	int block_tokens;	/* <= 0: ENGINE_DEFAULT_BLOCK_TOKENS */
	int kv_tokens;		/* cache capacity in tokens; <= 0: ENGINE_DEFAULT_KV_TOKENS */
	int max_rows;		/* tokens per forward call; <= 0: the backend's prompt_rows,
				 * at least ENGINE_DEFAULT_MAX_ROWS and min_rows */
	int min_rows;		/* with max_rows <= 0: at least this many (--prefill-chunk) */
	int64_t host_kv_bytes;	/* host tier budget (bytes); 0: ENGINE_DEFAULT_HOST_KV_BYTES; < 0: none */
	int session_quota_blocks;	/* device blocks one owner's sessions may pin; <= 0: 1/4 of the cache */
	int max_sessions;	/* sessions per owner; <= 0: ENGINE_DEFAULT_MAX_SESSIONS */
	int session_ttl_s;	/* idle seconds until engine_tick closes a session; 0: default; < 0: never */
	int offload_after_s;	/* idle seconds until engine_tick moves it to host; 0: default; < 0: never */
	int zstd_level;		/* host tier compression; 0: KV_CODEC_DEFAULT_LEVEL */
	int kv_bf16;		/* backend_opts.kv_bf16: a CPU cache rounded as the GPU's */
	int w_bf16;		/* backend_opts.w_bf16: a quantized MLA kv_b rounded to bf16
				 * as the GPU keeps it */
	int x_bf16;		/* backend_opts.x_bf16: the fewest rows whose CPU GEMM inputs are
				 * rounded as the GPU's; 0: never */
	/* backend_opts.x_bf16_at, x_bf16_arg: which weights' inputs a GPU engine's run-time
	 * choices rounded (engine_linear_rounds_x of that engine); NULL: x_bf16 alone */
	int (*x_bf16_at)(void *arg, const struct model_tensor *w, int M);
	void *x_bf16_arg;
	const char *decode_path;	/* --decode-path: "auto" (NULL), "standard", "latency" */
	int no_graphs;		/* --no-graphs: every step op by op (with tp > 1 the ranks'
				 * eager path, docs/PARALLEL.md) */
};

/* Counters since engine_create; read by metrics. */
struct engine_stats {
	uint64_t prompt_tokens;		/* tokens run through the model by engine_step */
	uint64_t prefix_hit_tokens;	/* prompt tokens served from the prefix cache instead */
	uint64_t steps;			/* engine_step calls that ran */
	uint64_t offloaded_blocks;	/* blocks compressed into the host tier */
	uint64_t offloaded_bytes;	/* their raw size, bytes */
	uint64_t offloaded_zbytes;	/* their compressed size, bytes */
	uint64_t restores;		/* restore operations (a session, or a prefix hit on host) */
	uint64_t restored_blocks;	/* blocks decompressed back into the device cache */
	uint64_t restore_ns;		/* time those took, ns */
	uint64_t sessions_expired;	/* closed by the idle TTL */
	uint64_t sessions_dropped;	/* lost their KV for want of host memory */
	uint64_t moves_in_flight;	/* gauge: host-tier moves on the mover, not yet committed */
	uint64_t move_bytes_in_flight;	/* gauge: raw KV bytes they move */
};

/* Where the cache's blocks are (engine_cache_status). */
struct engine_cache_status {
	int block_tokens;
	int blocks_total;		/* device blocks */
	int blocks_used;		/* referenced by a sequence or a session */
	int blocks_cached;		/* unreferenced, valid, reusable on a hit (the LRU) */
	int blocks_free;
	int64_t host_blocks;		/* compressed blocks in host memory */
	int64_t host_bytes;		/* bytes they take */
	int64_t host_budget;
	int sessions;
};

/* One session as engine_sessions_list reports it. */
struct engine_session_info {
	char name[KV_SESSION_NAME_MAX + 1];
	uint64_t owner;
	int n_tokens;			/* history whose KV it keeps */
	int blocks_device;
	int blocks_host;
	double idle_s;			/* since its last turn ended */
	int busy;			/* a turn is running */
};

struct engine {
	struct model *model;		/* not owned */
	struct engine_stats stats;
	struct backend *be;
	struct forward *fwd;
	struct kv_pool pool;
	double last_step_bytes;		/* the last engine_step's weights (at its rows) and KV
					 * (its rows' contexts), bytes: engine_bytes.c */
	/* per-step staging, (max_rows) each, host memory */
	int32_t *tokens, *pos, *slots, *ctx, *out_rows;
	const int32_t **row_blocks;
	struct engine_sampler *sampler;	/* engine_sample.c's buffers, made on first use */

	/* KV cache management (engine_session.c, engine_snapshot.c) */
	struct kv_prefix prefix;	/* full device blocks by chained key */
	struct kv_host host;		/* compressed blocks in host memory */
	struct kv_codec codec;		/* one block <-> one zstd frame */
	struct kv_sessions sessions;
	size_t kv_elem_bytes;		/* bytes per cached K/V element (backend's kv dtype) */
	struct kv_spans spans;		/* where a block's bytes are: every rank's cache */
	size_t block_bytes;		/* one block over all layers, K and V, (every rank's
					 * stored span: kv_spans.h) bytes */
	uint8_t *kv_raw;		/* (block_bytes) host staging of one block */
	uint8_t *kv_frame;		/* (kv_codec_bound) one compressed block */
	int host_enabled;
	int session_quota_blocks;
	int max_sessions;
	int64_t session_ttl_ns;		/* < 0: never */
	int64_t offload_after_ns;	/* < 0: never */
	struct engine_snap *snap;	/* engine_snapshot.c: sessions left on disk, a held file */
	uint64_t (*clock_ns)(void);	/* monotonic clock; tests substitute their own */

	/* host tier moves off the engine thread (engine_host.c, engine_mover.h) */
	struct engine_mover *mover;	/* made on the first move */
	struct host_job *host_jobs;	/* started, not yet committed (stats.moves_in_flight) */
	void (*host_wake)(void *);	/* called from the mover when a move is done */
	void *host_wake_arg;
	int host_workers;		/* mover threads, set before the first move; 0: by the CPUs */
	uint32_t host_delay_us;		/* tests only: the mover sleeps this long per block */
};

/* A sequence's cache: its block table and how many tokens are in it. A sequence
 * started by engine_seq_start registers each block in the prefix cache as it fills;
 * one set up by engine_seq_init alone keeps its blocks private. Blocks in the
 * prefix cache may be shared: a sequence writes only past n_tokens, which is never
 * inside a shared (full) block. */
struct engine_seq {
	int32_t *blocks;	/* (cap) block ids, the first n_blocks in use */
	int n_blocks;
	int cap;
	int n_tokens;		/* tokens whose K/V are in the cache */
	int32_t *tokens;	/* (tok_cap) the ids at positions 0..n_tokens */
	int tok_cap;
	int cache;		/* 1: full blocks go into the prefix cache */
	uint64_t salt;		/* tenant salt of its keys */
	int n_keyed;		/* leading full blocks whose keys are known */
	struct kv_key chain;	/* key of block n_keyed - 1 */
};

/* One sequence's part of a step: n_tokens new tokens appended at seq->n_tokens. */
struct engine_req {
	struct engine_seq *seq;
	const int32_t *tokens;	/* (n_tokens) */
	int n_tokens;
	int all_logits;		/* 1: logits of every new token; 0: of the last one only */
	int n_draft;		/* trailing tokens that are unverified drafts (speculative
				 * decoding): blocks they fill stay out of the prefix cache
				 * until engine_seq_truncate confirms them; the caller must
				 * call it before the sequence's next step */
};

int engine_create(struct engine **out, struct model *m, const struct engine_opts *opts,
		  char *err, size_t err_len);

/* The decode path as asked and as chosen per graph bucket, one line for logs, kdctl
 * status and the metric: "auto (1: latency, 8: standard)", "standard", "latency (its
 * kernels unused: no fused layers for llama's dense layers yet)". */
void engine_decode_path_describe(const struct engine *e, char *buf, size_t len);

/* The ranks and their reduction for the log and kdctl status: "tp 1", "tp 2, all-reduce
 * fused (k_cuda_ar_fused)", "tp 1, all-reduce nccl 2.28.3", ... */
void engine_parallel_describe(const struct engine *e, char *buf, size_t len);
/* The buckets (1, 2, 4, ... rows) whose decode graphs take the latency path: bit i for
 * bucket 2^i. */
unsigned engine_decode_path_latency_mask(const struct engine *e);
void engine_destroy(struct engine *e);	/* accepts NULL */

/* The calling thread made ready to step e: its backend's GPU (rank 0's with tp > 1)
 * current on it (cuda; nothing on the cpu). Call once on a thread other than the one
 * that created e before it calls engine_step or the session functions. */
void engine_thread_attach(struct engine *e);

void engine_seq_init(struct engine_seq *s);
/* Drops the sequence's blocks and empties it: registered full blocks stay in the
 * prefix cache (LRU), the others return to the free list. */
void engine_seq_release(struct engine *e, struct engine_seq *s);

/* Rolls s back to its first n_tokens tokens (rejected speculative drafts): blocks
 * past the new end go back to the pool, then the full blocks that remain are
 * registered in the prefix cache. Only blocks s alone holds and that are not in
 * the prefix cache are ever dropped: n_tokens may not cut into a registered block.
 * 0, or -EINVAL (n_tokens outside [registered prefix, s->n_tokens]), -EBUSY (a
 * block to drop is shared or cached; s is unchanged). */
int engine_seq_truncate(struct engine *e, struct engine_seq *s, int n_tokens);

/* The bytes a decode step of `rows` rows reads of the weights (bf16, or as stored
 * when quantized; routed experts counted as uniform routing would choose them), and of
 * the KV cache for `tokens` tokens of context in the backend's cache dtype
 * (engine_bytes.c). */
double engine_weight_bytes(const struct model *m, int rows);
/* The same count for the model's last decoder layer alone (kdbench's layer_us floor;
 * its KV share is engine_kv_bytes / n_layers). */
double engine_last_layer_bytes(const struct model *m, int rows);
/* The share of a MoE layer's routed experts that `rows` rows choose under uniform
 * routing, E * (1 - (1 - k/E)^rows) / E (0 without experts): what the two above count. */
double engine_uniform_expert_share(const struct model_config *c, int rows);
/* engine_weight_bytes and engine_last_layer_bytes with the routed experts' share
 * given: the share a traced step used (kdbench decode), not the uniform one. */
double engine_weight_bytes_at(const struct model *m, int rows, double expert_share);
double engine_last_layer_bytes_at(const struct model *m, int rows, double expert_share);
double engine_kv_bytes(const struct engine *e, double tokens);

/* Attaches a routing trace (route_trace.h; NULL detaches): the steps that follow
 * record each MoE layer's choices into it and take its forced ones, and run op by op
 * (no graph replays) while it is attached. The trace outlives the attachment. */
struct route_trace;
void engine_set_route_trace(struct engine *e, struct route_trace *t);

/* How e's backend rounds the input of weight w at M rows (backend_ops.linear_rounds_x:
 * 1 bf16 by a run-time choice, 2 f16 or 0 fp32 for a quantized weight), else -1: a CPU
 * reference engine's x_bf16_at (engine_opts) with arg e. */
int engine_linear_rounds_x(void *e, const struct model_tensor *w, int M);

/* Prepares everything a request would otherwise pay for on first use (engine_warm.c):
 * every decode graph bucket captured, with the backend's tunings at those sizes, and
 * one prompt chunk of max_rows tokens run; the KV it used is released and the stats
 * are as before. Nothing to do on a backend without graphs. 0 or -errno (err set). */
int engine_warm(struct engine *e, char *err, size_t err_len);

/* Runs reqs[0..n) as one step (split into forward calls of at most max_rows rows).
 * logits receives, request by request, n_tokens rows (all_logits) or one row, each
 * vocab floats. On error no sequence changes: -EINVAL (token id >= vocab, empty
 * request) or -ENOSPC (cache full) with one line in err. */
int engine_step(struct engine *e, struct engine_req *reqs, int n, float *logits,
		char *err, size_t err_len);

/* engine_step, then each request's next token drawn from its last row's logits by
 * the procedure of kernels/k_sample.h: params (n), steps (n) the index of the token
 * in the request's output (the draw's counter), ids (n) out. Every request must
 * have all_logits == 0. logits: NULL, or (n, vocab) floats that receive the rows
 * sampled from. Errors as engine_step. */
int engine_step_sample(struct engine *e, struct engine_req *reqs, int n,
		       const struct k_sample_params *params, const uint64_t *steps, int32_t *ids,
		       float *logits, char *err, size_t err_len);

/* engine_step_sample with the host-only steps of kernels/k_sample.h: hist (n) or
 * NULL (no penalties) each request's tokens so far; lp (n) or NULL receives each
 * request's logprobs (zeroed, with .token, where params[i].logprobs is 0). A request
 * that uses penalties, min-p or logprobs is drawn on the host from its own logits
 * row (only that row is downloaded); the others stay on the backend's sampler.
 * Requests may have all_logits (speculative verification): then params, steps,
 * hist, ids, lp and logits go by row (engine_step_out_rows(reqs, n_reqs) of them),
 * one per new token of such a request, one per other request. */
int engine_step_sample_ext(struct engine *e, struct engine_req *reqs, int n_reqs,
			   const struct k_sample_params *params, const uint64_t *steps,
			   const struct k_sample_hist *hist, int32_t *ids,
			   struct k_sample_logprobs *lp, float *logits, char *err, size_t err_len);

/* Frees what engine_step_sample made; called by engine_destroy. Accepts NULL. */
void engine_sampler_destroy(struct engine_sampler *s);

/* Rows of logits a step will write. */
int engine_step_out_rows(const struct engine_req *reqs, int n);

/* ---- prefix cache ------------------------------------------------------ */

/* Starts the empty sequence s on prompt (n tokens): maps the longest cached prefix
 * of whole blocks under salt (device blocks, else host blocks restored) and records
 * those tokens as done; *cached_tokens receives how many. The caller runs the rest,
 * prompt + cached .. n, through engine_step. At least one token is always left to
 * run so that the step has logits (a prompt cached to its end recomputes its last
 * block). Salt separates tenants: the daemon passes the client's uid, or one shared
 * value with --share-prefix-cache. 0, or -EINVAL (s not empty, n < 1, a token
 * outside the vocabulary), -ENOMEM. Counts stats.prefix_hit_tokens. */
int engine_seq_start(struct engine *e, struct engine_seq *s, const int32_t *prompt, int n,
		     uint64_t salt, int *cached_tokens);

/* Evicts every cached unreferenced block (the LRU) to the free list. */
void engine_cache_drop(struct engine *e);

void engine_cache_status(const struct engine *e, struct engine_cache_status *st);

/* One device block's K/V, layer by layer, K then V (tensor parallel: each stored rank's
 * in turn, kv_spans.h), into dst (block_bytes): what the host tier stores; kdbench
 * kvcache measures compression on it. 0 or -errno. */
int engine_block_read(struct engine *e, int32_t block, void *dst);

/* ---- sessions (engine_session.c) ------------------------------------------
 * A session is a client's named conversation: (name, owner) with owner the client's
 * uid or id. Between turns it keeps the KV of its latest sequence, on the device
 * within the owner's quota (session_quota_blocks), or in the host tier. A turn:
 *   engine_session_open -> engine_seq_start_session -> engine_step ... ->
 *   engine_session_save (or engine_session_cancel) -> engine_seq_release.
 * The kv_session pointer stays valid until engine_session_close, engine_tick's TTL,
 * engine_destroy; a session closed during its turn is freed when the turn ends. */

/* Finds session (name, owner) or creates an empty one (which replaces a session of
 * that name the snapshot load left on disk); a found session takes salt. -EINVAL
 * (name: KV_SESSION_NAME_RULE), -EDQUOT (owner has max_sessions), -ENOMEM. */
int engine_session_open(struct engine *e, const char *name, uint64_t owner, uint64_t salt,
			struct kv_session **out);
struct kv_session *engine_session_find(const struct engine *e, const char *name, uint64_t owner);

/* engine_seq_start for a turn of sess: the session's blocks where prompt repeats its
 * history (host blocks restored first), including its last partial block when the
 * prompt continues the whole history, so that only new tokens are computed; then
 * the prefix cache for the rest. Marks the session busy. -EBUSY (a turn is running),
 * else as engine_seq_start. */
int engine_seq_start_session(struct engine *e, struct engine_seq *s, struct kv_session *sess,
			     const int32_t *prompt, int n, int *cached_tokens);

/* Ends the turn keeping s's KV as the session's (s itself is left to release).
 * When the owner's sessions then pin more than the quota, its idle sessions (oldest
 * first, this one last) move to the host tier. 0 or -ENOMEM (the session keeps its
 * previous state). */
int engine_session_save(struct engine *e, struct kv_session *sess, const struct engine_seq *s);

/* Ends the turn without keeping anything new. */
void engine_session_cancel(struct engine *e, struct kv_session *sess);

/* Closes (name, owner), in memory or left on disk by the snapshot load: 0, -EINVAL
 * (not a session name), -ENOENT (no such session of owner). */
int engine_session_close(struct engine *e, const char *name, uint64_t owner);

/* Moves an idle session's device blocks to the host tier (compressed), or brings
 * them back. 0, -EBUSY (a turn is running), -ENOSPC (host budget, device blocks),
 * -ENOTSUP (no host tier), -EIO. On error the session is as before, still whole. */
int engine_session_offload(struct engine *e, struct kv_session *sess);
int engine_session_restore(struct engine *e, struct kv_session *sess);

/* Frees device blocks, if it can, by offloading idle sessions (least recently used
 * first; never keep, which may be NULL) until need blocks are available
 * (kv_pool_available). 0 or -ENOSPC. */
int engine_make_room(struct engine *e, int need, const struct kv_session *keep);

/* ---- host tier moves off the engine thread (engine_host.c) ------------------
 * The idle offload (engine_tick), the quota's and a restore started by
 * engine_session_restore_start run on the engine's mover thread (copies and codec);
 * the engine thread only starts them and commits them in engine_host_poll. While one
 * is in flight its session is whole (its blocks stay where they were, and the blocks
 * being read or written are referenced by the move); a turn, a close or a drop of the
 * session cancels an offload (its result is discarded); a turn waits for a restore.
 * engine_session_offload / _restore and engine_make_room are the same moves, waited
 * for. */

/* wake(arg) is called from the mover thread each time a move is done (the engine
 * thread's sleep ends; it then calls engine_host_poll). */
void engine_host_set_wake(struct engine *e, void (*wake)(void *), void *arg);
/* Commits the moves done: the number committed. Call it each loop iteration. */
int engine_host_poll(struct engine *e);
/* 1 when moves are done and wait for engine_host_poll (a cheap look, any time). */
int engine_host_pending(const struct engine *e);
/* Starts bringing sess's host blocks back to the device on the mover (the device
 * blocks it fills are taken now; full blocks still cached on the device are taken
 * back at once). 1: a restore is in flight, its turn should wait (call again after
 * engine_host_poll); 0: nothing to wait for (on the device, busy, or the restore
 * could not start or failed: the turn then takes what it can and recomputes the
 * rest). An offload in flight is cancelled. */
int engine_session_restore_start(struct engine *e, struct kv_session *sess);
/* 1 while a restore of sess is in flight. */
int engine_session_restoring(const struct kv_session *sess);

/* Fills out[0..max) and returns the number of sessions (may exceed max). */
int engine_sessions_list(const struct engine *e, struct engine_session_info *out, int max);

/* Timers: closes sessions idle past the TTL and offloads those idle past
 * offload_after. Call every second or so from the engine thread. */
void engine_tick(struct engine *e);

/* ---- persistence (engine_snapshot.c) -------------------------------------- */

/* Writes every session (token history, compressed KV) to dir/kv-sessions.snap
 * atomically, with the sessions the load left on disk (below) carried over unchanged
 * unless a session of the same name and owner replaced them. The number of sessions
 * written, or -errno with one line in err (the file on disk is then as before): among
 * them -EEXIST, a snapshot this engine could not load is still there (below). */
int engine_snapshot_save(struct engine *e, const char *dir, char *err, size_t err_len);

/* The last engine_snapshot_save's result: sessions written, or -errno; 0 when none
 * ran. kdecd's exit status after an orderly stop (which always saves). */
int engine_snapshot_status(const struct engine *e);

/* What engine_snapshot_load did, for the daemon's log. */
struct engine_snap_load {
	int loaded;			/* sessions now in the host tier */
	int kept;			/* sessions left on disk: written again by every save */
	uint64_t kept_zbytes;		/* their compressed KV */
	int kept_no_host;		/* of kept: no host tier (--host-kv-mem 0) */
	int kept_too_big;		/* of kept: more blocks than the whole device cache */
	int kept_quota;			/* of kept: over the owner's session limit */
	int kept_budget;		/* of kept: beyond the host tier's budget */
	uint64_t host_budget;		/* bytes of the host tier (--host-kv-mem) */
	int stale_temps;		/* temporary files of killed writers removed */
	char stale_temp[64];		/* the first of them */
	char set_aside[4200];		/* a refused snapshot's new path, or "" */
	int held;			/* 1: a snapshot not loaded stays in place, never written over */
};

/* Loads dir's snapshot into an engine that has no sessions: the sessions come back
 * with their KV in the host tier (restored to the device on their next turn); first
 * removes the temporary files of snapshot writers that were killed. Nothing is loaded
 * unless the whole file checks: -ENOENT (none), -EBADMSG (damaged or truncated, or a
 * token outside the vocabulary), -ESTALE (another model, config, KV dtype or block
 * size), -EBUSY (sessions exist), -ENOMEM; one line in err. A refused file (-EBADMSG,
 * -ESTALE) is renamed to kv-sessions.snap.refused-TIME (r->set_aside); a file that
 * could not be read or set aside is held: saves refuse to replace it (r->held) until
 * it is moved away. Sessions that do not fit (r->kept_*) stay on disk and are carried
 * into every later snapshot. r may be NULL. */
int engine_snapshot_load(struct engine *e, const char *dir, struct engine_snap_load *r,
			 char *err, size_t err_len);

#endif
