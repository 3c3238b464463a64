/* The tensor-parallel ranks' shared state (forward_tp.c: the ranks, their eager step;
 * forward_tp_graph.c: their decode graphs). Private to those two files. */
#ifndef KD_DAEMON_FORWARD_TP_INTERNAL_H
#define KD_DAEMON_FORWARD_TP_INTERNAL_H

#include <pthread.h>

#include "daemon/engine/forward_tp.h"
#include "daemon/engine/tp_comm.h"
#include "daemon/model/model_shard.h"

/* What a round of the ranks' threads runs (g->mode, set by rank 0 before the round). */
enum tp_step {
	TP_STEP_EAGER = 0,	/* the batch op by op, the reductions between barriers */
	TP_STEP_WARM,		/* a graph bucket's step op by op, before its capture */
	TP_STEP_CAPTURE,	/* the same step recorded, nothing run */
	TP_STEP_REPLAY,		/* BACKEND_TP_GRAPH_PER_RANK: each rank replays its graph */
	TP_STEP_LAYER,		/* BACKEND_TP_GRAPH_ONE: one layer of every rank, g->layer_reps
				 * times over, recorded (kdbench's layer_us) */
};

struct fwd_tp {
	int n;
	struct model *shard[MODEL_SHARD_MAX_RANKS];
	struct backend *be[MODEL_SHARD_MAX_RANKS];	/* [0] the caller's */
	struct forward *f[MODEL_SHARD_MAX_RANKS];
	pthread_t thread[MODEL_SHARD_MAX_RANKS];
	int started;			/* threads running (ranks 1..started) */
	int own0;			/* be[0] made here (not yet handed to the caller) */
	int vocab, v0[MODEL_SHARD_MAX_RANKS];
	double peak_mib[MODEL_SHARD_MAX_RANKS];	/* the process's peak host memory (ru_maxrss)
					 * once rank r's shard was built (and, without
					 * host memory, copied to its device) */
	int ep;				/* expert parallel: rank r holds experts [e0, e0 + ne) */
	int e0[MODEL_SHARD_MAX_RANKS], ne[MODEL_SHARD_MAX_RANKS];
	int32_t *ep_ids[MODEL_SHARD_MAX_RANKS];	/* (max_rows, top_k) host copy of the router's
					 * choices, backends without host memory nor
					 * experts_shard */

	/* MLA decode context parallel (cp 1): rank r's latent cache holds the slots s
	 * with s % n == r, at its row s / n (one more row takes the others' latents);
	 * the buffers below are shared by the ranks (threads of one process) */
	int cp;
	int kv_same[MODEL_SHARD_MAX_RANKS];	/* the first rank whose KV cache holds the
					 * bytes rank r's does (r: none before it): KV heads
					 * replicated, an MLA latent without cp */
	int cp_heads;			/* the model's query heads (every rank's) */
	int cp_trash;			/* the cache row a slot of another rank is written to */
	int32_t *cp_slots[MODEL_SHARD_MAX_RANKS];	/* (max_rows) this step's rows' local rows */
	float *cp_q;			/* (max_rows, cp_heads, kv_lora + rope) absorbed q, each
					 * rank writing its heads' */
	float *cp_o[MODEL_SHARD_MAX_RANKS];	/* (max_rows, cp_heads, kv_lora) rank r's partials */
	float *cp_ml[MODEL_SHARD_MAX_RANKS];	/* (max_rows, cp_heads, 2) their (max, sum) */
	void *bcp;			/* without host memory: the backend's exchange
					 * (ops->mla_cp_create) instead of the four above */
	const int32_t *cp_dslots[MODEL_SHARD_MAX_RANKS];	/* its cp_slots (backend memory) */

	struct tp_barrier step;		/* start and finish of a step (never broken) */
	struct tp_comm comm;		/* inside a step: the reductions */
	const struct backend_ops *ops;	/* the ranks' backend */
	void *bcomm;			/* its communicator (ops->tp_comm_create), or NULL:
					 * host memory, tp_comm_reduce */

	/* the step in flight, set by rank 0 before the start barrier */
	const struct fwd_batch *b;
	float *logits;
	int greedy;			/* 1: the out rows drawn by slices (each rank's argmax
					 * of its slice, or its top-k: FWD_TP_TOPK_MAX), no logits */
	int topk;			/* 1: some out row of the step draws by top-k pairs */
	const struct k_sample_params *sp;	/* (b->n_out) those rows' parameters */
	int quit;
	int ret[MODEL_SHARD_MAX_RANKS];

	/* decode graphs (forward_tp_graph.c): how the ranks capture a step (the backend
	 * communicator's kind; NONE: every step op by op) and the step in flight */
	enum backend_tp_graph graph_kind;
	enum tp_step mode;
	int g_size, g_bucket;		/* the graph step's bucket: rows (padded) and index */
	struct fwd_batch db[MODEL_SHARD_MAX_RANKS];	/* rank r's inputs staged at g_size */
	/* ranks without host memory with tp_argmax (forward_tp_pairs_init): the pairs of
	 * a step on rank r's device, (2, FWD_LOGIT_ROWS) 32-bit words of tp_argmax pairs
	 * (a graph's, or the eager path's), then with tp_topk its buffer
	 * (tp_topk_bytes(FWD_LOGIT_ROWS, rank's vocab)); one copy down brings both */
	void *best_dev[MODEL_SHARD_MAX_RANKS];
	uint32_t *best_host[MODEL_SHARD_MAX_RANKS];	/* (2, FWD_LOGIT_ROWS) words then
					 * BACKEND_TP_TOPK_WORDS(FWD_LOGIT_ROWS): their host
					 * copy (page-locked where the backend can) */
	/* BACKEND_TP_GRAPH_PER_RANK: rank r's graph of each bucket (ONE: rank 0's
	 * forward's graphs[bucket][1] holds the whole step) */
	void *rank_graph[FWD_N_BUCKETS][MODEL_SHARD_MAX_RANKS];
	int rank_nodes[FWD_N_BUCKETS][MODEL_SHARD_MAX_RANKS];
	char *cap_block[FWD_N_BUCKETS][MODEL_SHARD_MAX_RANKS];	/* the staged blocks a
					 * bucket's graph reads (a new block: captured again) */
	int said_eager;			/* the line "graphs off" logged */
	int layer, layer_reps;		/* TP_STEP_LAYER: which layer, how many times */
	int layer_nodes[MODEL_SHARD_MAX_RANKS];	/* its kernels, rank r's */

	/* vocabulary-split greedy sampling: rank r's best (value, id) per out row */
	int max_rows;
	float *best_v;			/* (n, max_rows) */
	int32_t *best_i;		/* (n, max_rows) ids in the whole vocabulary */
	float *slice[MODEL_SHARD_MAX_RANKS];	/* (FWD_LOGIT_ROWS, rank's vocab) host copy of
					 * a rank's logits, backends without host memory */
	/* top-k draws by slices: rank r's top_k pairs of out row o at
	 * [(r * max_rows + o) * FWD_TP_TOPK_MAX], ids ascending; made at the first such
	 * step */
	float *top_v;			/* (n, max_rows, FWD_TP_TOPK_MAX) */
	int32_t *top_i;			/* (n, max_rows, FWD_TP_TOPK_MAX) */
	int *top_n;			/* (n, max_rows) pairs held */
	float *top_work;		/* K_CPU_SAMPLE_WORK(n * FWD_TP_TOPK_MAX) floats */
};

/* One round of every rank's thread in mode: rank 0 (the caller) runs its part, the
 * others theirs; the failing rank's error, or 0. */
int forward_tp_round(struct fwd_tp *g, enum tp_step mode, const struct fwd_batch *b, float *logits);

/* A rank's part of a graph round (forward_tp_graph.c). 0 or -errno. */
int forward_tp_graph_rank(struct forward *f);

/* Rank 0: the step b as a replay of its bucket's graph (captured first where it is not
 * yet, or where a rank's staged inputs moved); greedy pairs in g->best_v/best_i or
 * logits as forward_tp_run. -EAGAIN: not a graph step (run it op by op); a capture
 * that failed also says so in one line and turns graphs off. */
int forward_tp_graph_step(struct forward *f, const struct fwd_batch *b, float *logits);

/* Whether the ranks can capture (graph_kind); frees the per-rank graphs (before the
 * ranks' backends go). */
void forward_tp_graph_init(struct fwd_tp *g);
void forward_tp_graph_fini(struct fwd_tp *g);

/* forward_tp_sample.c: rank r's greedy pair (forward_tp_rank_best) or, for the rows
 * drawn by top-k, its top-k pairs (forward_tp_rank_topk) of its n logit rows (rows, vn)
 * of out rows o..; the pairs' buffers at the first top-k step (0 or -ENOMEM); out row
 * o's top-k draw from every rank's pairs. */
void forward_tp_rank_best(struct fwd_tp *g, int r, const float *rows, int n, int vn, int o);
void forward_tp_rank_topk(struct fwd_tp *g, int r, const float *rows, int n, int vn, int o);
int forward_tp_topk_alloc(struct fwd_tp *g);
int32_t forward_tp_topk_merge(struct fwd_tp *g, int o, uint64_t step);

/* forward_tp_sample.c, ranks without host memory: whether the pairs come from the
 * device (tp_argmax, and tp_topk for top-k rows), and their buffers (best_dev,
 * best_host; made at create, freed before the backends go). */
int forward_tp_pairs_on_device(const struct backend_ops *ops);
int forward_tp_pairs_init(struct fwd_tp *g);
void forward_tp_pairs_fini(struct fwd_tp *g);

/* Rank r's pairs of its n logit rows (rows, vocab slice) on its device for out rows
 * o..: tp_argmax's, launched here on via's queue (graph_rows 0) or already in best_dev
 * from a replay (graph_rows: the graph's rows, the pairs' stride); with g->topk also
 * tp_topk's, launched here; copied down in one copy and stored for the merge. 0 or
 * -errno. */
int forward_tp_pairs_device(struct fwd_tp *g, int r, struct backend *via, const float *logits,
			    int n, int o, int graph_rows);

#endif
