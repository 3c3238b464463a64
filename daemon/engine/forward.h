/* The standard forward pass: one definition per architecture family (GQA dense,
 * GQA + MoE, MLA + MoE), composed from backend ops, over a paged KV cache. */
#ifndef KD_DAEMON_FORWARD_H
#define KD_DAEMON_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/model/model.h"

/* One step: rows are tokens of one or more sequences, a sequence's rows in order.
 * Every row's K/V is written to its slot before any row attends, so rows of one
 * prefill see each other (causally, through ctx). */
struct fwd_batch {
	int n_rows;
	const int32_t *tokens;		/* (n_rows) ids, already checked < vocab */
	const int32_t *pos;		/* (n_rows) position of the row's token in its sequence */
	const int32_t *slots;		/* (n_rows) cache slot: block * block_tokens + pos % block_tokens */
	struct k_attn_rows attn;	/* per row: ctx = pos + 1 and its block table */
	int n_out;
	const int32_t *out_rows;	/* (n_out) rows whose logits are wanted */
};

#define FWD_LOGIT_ROWS 64		/* rows of logits one lm_head call computes */
#define FWD_GRAPH_MAX_ROWS 64		/* decode steps up to this many rows replay a graph */
#define FWD_N_BUCKETS 7			/* graph batch buckets 1, 2, 4, ..., 64 */

/* Step inputs in backend memory, for backends that cannot read host memory. One
 * block holds a step's row inputs and then its block tables, laid out for the step's
 * row count S (stage_layout): tokens, pos, slots, ctx (S int32 each), row_tables (S),
 * params and steps (S each), tables (table_cap). A step's inputs are written into the
 * host mirror and go over in one copy; a graph, captured at its bucket's S, finds
 * them where it read them at capture. */
struct fwd_stage {
	char *block;			/* (block_bytes) backend memory */
	char *h_block;			/* (block_bytes) host mirror, pinned where the backend can */
	size_t block_bytes;
	int table_cap;			/* tables entries the block holds at max_rows */
	int layout_rows;		/* S of the pointers below */
	int32_t *tokens, *pos, *slots, *ctx;	/* (S) into block */
	const int32_t **row_tables;	/* (S) backend pointers into tables */
	struct k_sample_params *params;	/* (S) */
	uint64_t *steps;		/* (S) */
	int32_t *tables;		/* (table_cap) the step's block tables, back to back */
	int32_t *ids;			/* (FWD_LOGIT_ROWS) backend: sampled ids */
	int32_t *h_ids;			/* (FWD_LOGIT_ROWS) host, pinned where the backend can */
};

/* Sampling requested for the out rows of the steps that follow (forward_sample_set):
 * arrays over all out rows of one engine step, in order; host memory. */
struct fwd_sample {
	const struct k_sample_params *params;	/* (n) or NULL: no sampling */
	const uint64_t *steps;			/* (n) */
	int32_t *ids;				/* (n) out */
	int n;
	int done;				/* out rows sampled so far */
	int want_logits;			/* 1: logits are downloaded as well */
	const uint8_t *host_rows;		/* (n) or NULL: 1 = download this row's
						 * logits (without want_logits) */
};

struct route_trace;
struct fwd_tp;

/* Which kernels a decode step runs (--decode-path, issue 23). The latency path swaps
 * in fused layers where the backend has them (today: the MoE layer at up to
 * FWD_LAT_MAX_ROWS rows, backend op moe_layer); every other op is the standard one. */
enum fwd_path {
	FWD_PATH_AUTO = 0,	/* per batch bucket: latency where supported and measured
				 * more than 1% faster at the graph's capture, else
				 * standard */
	FWD_PATH_STANDARD,
	FWD_PATH_LATENCY,	/* wherever supported, graphs or not */
};
#define FWD_LAT_MAX_ROWS 8

/* "auto", "standard", "latency" (NULL for anything else) and back. */
const char *fwd_path_name(enum fwd_path p);
int fwd_path_parse(const char *s, enum fwd_path *out);

struct forward {
	const struct model *m;
	struct backend *be;
	int max_rows;			/* rows one forward_run accepts */
	int block_tokens;
	int n_blocks;
	struct k_rope rope;
	struct k_kv_layer *kv;		/* (n_layers) caches in backend memory */
	size_t kv_bytes;		/* all layers' cache (tensor parallel, rank 0: all ranks') */

	/* scratch, backend memory, (max_rows, width) floats */
	float *x;			/* (rows, hidden) residual stream */
	float *h;			/* (rows, hidden) normed input / sublayer output */
	float *q;			/* (rows, n_heads * qk_dim) */
	float *k;			/* (rows, kv_heads * head_dim) GQA */
	float *v;			/* (rows, kv_heads * head_dim) GQA */
	float *q_a;			/* (rows, q_lora) MLA */
	float *kv_a;			/* (rows, kv_lora + rope) MLA latent + rope part */
	float *attn;			/* (rows, n_heads * v_dim) */
	float *gate;			/* (rows, max_inter) */
	float *up;			/* (rows, max_inter) */
	float *mlp;			/* (rows, hidden) */
	float *router;			/* (rows, n_experts) */
	int32_t *route_ids;		/* (rows, top_k) */
	float *route_w;			/* (rows, top_k) */
	float *logits;			/* (FWD_LOGIT_ROWS, vocab) */

	struct fwd_stage st;		/* used when !be->ops->host_memory */
	struct fwd_sample sample;
	int dummy_block;		/* block id (== n_blocks) that padding rows write to */
	void *graphs[FWD_N_BUCKETS][2];	/* decode graphs per bucket, [0] logits, [1] sampled */
	int graph_nodes[FWD_N_BUCKETS][2];	/* kernels (and copies) each graph replays */
	int use_graphs;			/* backend can capture and the caller did not disable it */
	enum fwd_path path;		/* what the caller asked for */
	int lat;			/* 1 while the ops being issued take the latency path */
	signed char bucket_lat[FWD_N_BUCKETS];	/* the bucket's graphs: 1 latency, 0
						 * standard, -1 not captured yet */
	double bucket_ms[FWD_N_BUCKETS][2];	/* auto's replay medians: standard, latency
						 * (0: not timed) */
	uint64_t graph_replays;		/* steps that replayed a graph */
	/* kdbench decode's split of a replayed step (time_steps set, the backend has a
	 * timer): ms on the backend's queue from before the input copy to the graph's
	 * end, and host wall ms of staging, of the copy and launch calls, and of the wait
	 * for the ids (each -1 when the last step was not timed) */
	int time_steps;
	double step_gpu_ms, step_stage_ms, step_launch_ms, step_wait_ms;

	/* the routing trace (route_trace.h), or NULL; while set, steps run op by op */
	struct route_trace *trace;
	const int32_t *trace_pos;	/* (rows) host positions of the step in flight */
	int32_t *trace_first;		/* (max_rows) host: each row's first KV block */
	char trace_err[256];		/* the trace's failure, for the caller */

	/* tensor parallel (forward_tp.h): NULL with one rank; else this forward is rank
	 * tp_rank's, over its shard, and forward.c reduces the partial sums */
	struct fwd_tp *tp;
	int tp_rank;
};

/* Allocates the caches (n_blocks of block_tokens tokens, every layer) and the scratch.
 * Returns 0 or -errno with one line in err (numbers for out-of-memory). */
int forward_create(struct forward **out, const struct model *m, struct backend *be,
		   int n_blocks, int block_tokens, int max_rows, char *err, size_t err_len);
void forward_destroy(struct forward *f);	/* accepts NULL and half-built */

/* Bytes of KV cache one token takes over all layers (fp32 on the CPU backend). */
size_t forward_kv_bytes_per_token(const struct model *m);

/* Runs the batch and writes logits (n_out, vocab) to host memory. 0 or -errno.
 * Decode-shaped batches (one out row per row, each row its own sequence, at most
 * FWD_GRAPH_MAX_ROWS) replay a graph captured per batch bucket where the backend
 * can capture; everything else runs op by op. */
int forward_run(struct forward *f, const struct fwd_batch *b, float *logits);

/* Asks the following forward_run calls to draw a token for each out row on the
 * backend (which must have a sample op): n out rows in all, over one or more calls.
 * With want_logits 0 the logits are not copied back. forward_sample_clear ends it. */
void forward_sample_set(struct forward *f, const struct k_sample_params *params,
			const uint64_t *steps, int32_t *ids, int n, int want_logits);
void forward_sample_clear(struct forward *f);
/* After forward_sample_set: also download the logits of the out rows flagged in
 * rows (n, host memory, kept by the caller until forward_sample_clear). */
void forward_sample_host_rows(struct forward *f, const uint8_t *rows);

/* Switches the decode path: the decode graphs go (captured again on the next steps)
 * and so do the buckets' choices. For benchmarks of both paths in one process. */
void forward_set_path(struct forward *f, enum fwd_path p);

/* Whether the latency path has fused layers for this model at n_rows rows on this
 * backend (the predicate of --decode-path; architecture, rows, dtype: the backend's
 * moe_layer declines what it cannot take). Without, the latency path runs the
 * standard ops. why (may be NULL) gets the reason when not. */
int forward_latency_supported(const struct forward *f, int n_rows, char *why, size_t why_len);

/* One decoder layer alone, for kdbench's layer_us: the graph of layer `layer` issued
 * `reps` times over, captured at the bucket of `rows` on the inputs the last decode
 * graph of that bucket staged, replayed `replays` times; *us_per_layer gets the replay
 * time over reps (median of the replays), *nodes the kernels per layer. The layer
 * writes its K/V slot again and adds into the residual stream, as a step does. Needs
 * graphs and a decode step of that bucket run before. 0 or -errno. */
int forward_layer_time(struct forward *f, int rows, int layer, int reps, int replays,
		       double *us_per_layer, int *nodes);

/* One replay of the sampled decode graph of the bucket of `rows` on the inputs its
 * last step staged but for the tokens, replaced by tokens (rows): what a step's GPU
 * time is when its tokens (and with them the experts it routes to) change, without
 * the rest of a step. Host wall ms of the token copy, the replay and its sync in *ms.
 * Needs a sampled graph of that bucket and a step of it run before. 0 or -errno. */
int forward_replay_tokens(struct forward *f, int rows, const int32_t *tokens, double *ms);

/* ---- forward_step.c internals shared with forward.c ---- */
int forward_layers(struct forward *f, const struct fwd_batch *b);
int forward_layer(struct forward *f, int l, const struct fwd_batch *b);
int forward_stage_create(struct forward *f, char *err, size_t err_len);
void forward_stage_destroy(struct forward *f);
/* A tensor-parallel rank's step inputs (forward_tp.c): the host batch b staged into f's
 * backend memory (backends without host memory) as *db, op by op's layout. 0 or -errno. */
int forward_stage_step(struct forward *f, const struct fwd_batch *b, struct fwd_batch *db);
/* The same laid out for n_rows >= b->n_rows rows (padding rows read and write the
 * dummy block) into the host mirror only: the bytes of f->st.block to upload from
 * f->st.h_block, or -errno. A tensor-parallel graph step's (forward_tp_graph.c). */
long forward_stage_rows(struct forward *f, const struct fwd_batch *b, int n_rows, struct fwd_batch *db);
/* The median of n (<= 16) replays of graph on f's backend, each to its end, ms (0: a
 * replay failed). forward_layer_time's and, at tp > 1, forward_tp_layer_time's. */
double forward_graph_replay_ms(struct forward *f, void *graph, int n);
/* The graph bucket of a decode-shaped b (forward_run's rule) and its rows in *size,
 * or -1 where b runs op by op. */
int forward_graph_bucket(const struct forward *f, const struct fwd_batch *b, int *size);

#endif
