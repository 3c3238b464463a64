/* The engine: a model on a backend with a paged KV cache, running steps of one or
 * more sequences. Owned and driven by one thread (the engine thread in kdecd, main
 * in kdbench); nothing here is thread-safe. */
#ifndef KD_DAEMON_ENGINE_H
#define KD_DAEMON_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend.h"
#include "daemon/forward.h"
#include "daemon/model.h"
#include "kernels/k_sample.h"
#include "kvcache/kv_pool.h"

#define ENGINE_DEFAULT_BLOCK_TOKENS 16
#define ENGINE_DEFAULT_MAX_ROWS 256
#define ENGINE_DEFAULT_KV_TOKENS 32768

struct engine_opts {
	const char *backend;	/* "cpu" (default) */
	int threads;		/* <= 0: one per online CPU */
	int block_tokens;	/* <= 0: ENGINE_DEFAULT_BLOCK_TOKENS */
	int kv_tokens;		/* cache capacity in tokens; <= 0: ENGINE_DEFAULT_KV_TOKENS */
	int max_rows;		/* tokens per forward call; <= 0: ENGINE_DEFAULT_MAX_ROWS */
};

/* Counters since engine_create; read by metrics. */
struct engine_stats {
	uint64_t prompt_tokens;		/* tokens run through the model by engine_step */
	uint64_t prefix_hit_tokens;	/* prompt tokens served from the prefix cache instead */
	uint64_t steps;			/* engine_step calls that ran */
};

struct engine {
	struct model *model;		/* not owned */
	struct engine_stats stats;
	struct backend *be;
	struct forward *fwd;
	struct kv_pool pool;
	/* per-step staging, (max_rows) each, host memory */
	int32_t *tokens, *pos, *slots, *ctx, *out_rows;
	const int32_t **row_blocks;
	struct engine_sampler *sampler;	/* engine_sample.c's buffers, made on first use */
};

/* A sequence's cache: its block table and how many tokens are in it. */
struct engine_seq {
	int32_t *blocks;	/* (cap) block ids, the first n_blocks in use */
	int n_blocks;
	int cap;
	int n_tokens;		/* tokens whose K/V are in the cache */
};

/* One sequence's part of a step: n_tokens new tokens appended at seq->n_tokens. */
struct engine_req {
	struct engine_seq *seq;
	const int32_t *tokens;	/* (n_tokens) */
	int n_tokens;
	int all_logits;		/* 1: logits of every new token; 0: of the last one only */
};

int engine_create(struct engine **out, struct model *m, const struct engine_opts *opts,
		  char *err, size_t err_len);
void engine_destroy(struct engine *e);	/* accepts NULL */

void engine_seq_init(struct engine_seq *s);
/* Returns the sequence's blocks to the pool and empties it. */
void engine_seq_release(struct engine *e, struct engine_seq *s);

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

/* Frees what engine_step_sample made; called by engine_destroy. Accepts NULL. */
void engine_sampler_destroy(struct engine_sampler *s);

/* Rows of logits a step will write. */
int engine_step_out_rows(const struct engine_req *reqs, int n);

#endif
