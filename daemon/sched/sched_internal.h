/* What the scheduler's files share (sched.c: requests in, queues, the end of a
 * request; sched_step.c: admission and steps; sched_events.c: events out;
 * sched_preempt.c: KV claims; sched_spec.c: speculation): the request and scheduler
 * structs and the helpers that cross between them. Engine thread only; not part of
 * the scheduler's API. */
#ifndef KD_DAEMON_SCHED_INTERNAL_H
#define KD_DAEMON_SCHED_INTERNAL_H

#include <stdint.h>

#include "daemon/sched/sched.h"

struct sched_req {
	struct client_conn *c;		/* owner; outlives the request */
	uint64_t id;			/* the client's id */
	int running;			/* 0: waiting for admission */
	struct engine_seq seq;
	int32_t *prompt;		/* (n_prompt), owned */
	int n_prompt;
	/* what the sequence prefills: the prompt, or after a preemption the resume
	 * tokens (prompt, the output but its last token, then that last token) */
	const int32_t *feed;		/* (n_feed) prompt or resume */
	int n_feed;
	int32_t *resume;		/* (n_feed) owned; NULL until a preemption */
	int n_prefilled;		/* feed tokens in the KV cache */
	int n_cached;			/* of those, the ones its last start found there */
	int32_t last;			/* the token the next decode feeds */
	int n_gen;			/* tokens generated */
	int max_tokens;
	int max_tokens_asked;		/* the client's max_tokens where the model's positions
					 * cut max_tokens (max_position_embeddings - n_prompt);
					 * 0: not cut */
	int step_fed;			/* tokens it feeds in the step being built (decodes) */
	int n_preempted;		/* times preempted */
	uint64_t admit_no;		/* admission order: the newest is preempted first */
	struct k_sample_params sp;
	int32_t *out;			/* (cap_out) generated ids, kept only for penalties */
	int spec_k, spec_n;		/* n-gram drafts per step, n-gram length; k 0: off */
	int32_t fed[SPEC_MAX_K + 1];	/* a speculative step's tokens: last, then drafts */
	int cap_out;
	int32_t stop[IPC_STOP_MAX];
	int n_stop;
	int priority;
	char session[IPC_SESSION_MAX];	/* "" or the session name */
	struct kv_session *kvs;		/* the engine's session while the turn runs */
	int keep;			/* 1: the turn ended well: save it into kvs */
	uint64_t seqno;			/* arrival order */
	uint64_t t_submit, t_pickup, t_last;	/* ns */
	uint64_t paused_since;		/* ns; 0 = not paused */
	int prefix_waits;		/* steps it waited for another request's prefill of
					 * their shared prefix (see sched_step.c prefix_pending) */
};

struct sched_ses {
	char name[IPC_SESSION_MAX];
	struct client_conn *c;
	int inflight;
	uint64_t total;
};

struct sched {
	struct engine *e;
	struct sched_opts o;
	struct sched_req **run;		/* (max_batch) the running batch */
	int n_run;
	struct sched_req **wait;	/* (n_wait) by priority, then arrival */
	int n_wait, cap_wait;
	struct sched_ses *ses;
	int n_ses, cap_ses;
	struct metrics m;
	int draining;
	uint64_t seqno;
	uint64_t admit_no;		/* admissions so far */
	/* step scratch, (max_batch) each */
	struct engine_req *ereq;
	struct sched_req **of;
	struct k_sample_params *sp;
	struct k_sample_hist *hist;
	struct k_sample_logprobs *lp;
	uint64_t *steps;
	int32_t *ids;
	/* sp, hist, lp, steps, ids go by logits row: (rows_cap) each, since a
	 * speculative request has one row per fed token; row0 (max_batch) is each
	 * request's first row */
	int *row0;
	int n_rows, rows_cap;
	int32_t *spec_hist;		/* (spec_cap) a request's tokens, for the drafter */
	int spec_cap;
	/* the pace of prompt chunks (sched_step.c): moving averages of what steps cost */
	double decode_ns;		/* a decode-only step, ns; 0: none seen yet */
	double prompt_tok_ns;		/* a prompt token's share of a step, ns; 0: none yet */
	int step_decodes, step_prompt;	/* the step being built: decode rows, prompt tokens */
};

/* sched_events.c: a final or token event (*ev, copied) into c's event ring. A
 * client that cannot take it is marked dead; the engine thread drops it. */
void sched_emit(struct client_conn *c, const struct ipc_event *ev);
/* The same for r's client, with ev's request id and times set from r. */
void sched_emit_req(const struct sched_req *r, struct ipc_event ev);

/* Ends r: its final event (unless already carried by a token event), its KV back. */
void sched_finish(struct sched *s, struct sched_req *r, uint16_t reason, uint16_t detail, int err,
		  uint32_t a0, int emit_final);

/* Appends r's next n_tok tokens (tok) to the step as one engine request, with one
 * logits row; *n counts the step's requests. */
void sched_add(struct sched *s, int *n, struct sched_req *r, const int32_t *tok, int n_tok);

/* Delivers tok, with its logprobs when the request asked (lp may be NULL: none);
 * may end r (and free it). */
void sched_deliver(struct sched *s, struct sched_req *r, int32_t tok,
		   const struct k_sample_logprobs *lp, uint64_t now);

/* Puts r back at the front of the waiting requests of its priority. */
void sched_enqueue_front(struct sched *s, struct sched_req *r);
void sched_remove_ptr(struct sched_req **v, int *n, struct sched_req *r);

/* sched_preempt.c: KV blocks for the step being built. Each running request claims
 * the blocks it may still take this step: a prefilling one, its whole feed; a
 * decoding one, those of its step_fed tokens. */
int sched_claim(const struct sched *s, const struct sched_req *r);
/* Blocks available (free + cached) less every running request's claim; < 0: short. */
int sched_spare(const struct sched *s);
/* Whether the first waiting request may be admitted now. */
int sched_can_admit(const struct sched *s);
/* Takes r, just started, out of the batch again, to the front of the waiting
 * requests of its priority, its KV released (no preemption counted). */
void sched_unadmit(struct sched *s, struct sched_req *r);
/* Preempts running requests (lowest priority, newest first) until the claims fit,
 * after trying to move idle sessions to the host tier; then, while the first waiting
 * request does not fit, preempts those of lower priority than it. */
void sched_make_room(struct sched *s);

/* sched_spec.c: a decode of r, with drafts to verify when it speculates (within
 * *budget tokens and its client's event slots); and the verification's delivery. */
void sched_add_decode(struct sched *s, int *n, struct sched_req *r, int *budget);
void sched_deliver_spec(struct sched *s, struct sched_req *r, const struct engine_req *q,
			const int32_t *ids, const struct k_sample_logprobs *lp, uint64_t now);

#endif
