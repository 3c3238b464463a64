/* Tensor parallel on the CPU backend (docs/PARALLEL.md): N ranks as threads, each a
 * struct forward of its own over its shard of the model (model_shard.h), its own KV
 * cache, scratch and backend; they meet at the reductions forward.c asks for. Rank 0
 * is the caller's thread and its forward the one the engine holds. */
#ifndef KD_DAEMON_FORWARD_TP_H
#define KD_DAEMON_FORWARD_TP_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/engine/forward.h"

struct fwd_tp;

/* Builds the n ranks (n >= 2; n 1 only with a backend communicator, --allreduce nccl:
 * rank 0 then runs the whole model on the caller's *be0_io, no shard) of model m, the routed experts sliced (ep 0) or whole, a
 * share per rank (ep 1, expert parallel), an MLA latent cache replicated (cp 0) or
 * split by tokens (cp 1, decode context parallel, forward_tp_cp_check): the shards, their backends of ops (rank 0's
 * *be0_io, created by the caller with bo where ops has host memory; where it has not,
 * *be0_io is NULL and rank 0's backend is made here of rank 0's shard, so no device
 * ever holds the whole model, and handed back in *be0_io on success, the caller's to
 * destroy after forward_destroy; the other ranks' with bo too, owned here), forwards
 * and threads. *out is rank 0's forward: forward_run fans each step out,
 * forward_destroy stops everything. 0 or -errno with one line in err. */
int forward_tp_create(struct forward **out, const struct model *m, struct backend **be0_io,
		      const struct backend_ops *ops, int n, int ep, int cp,
		      const struct backend_opts *bo, int n_blocks, int block_tokens, int max_rows,
		      char *err, size_t err_len);

/* Whether MLA decode context parallel (cp 1 of forward_tp_create, --mla-cp) can run
 * model c at n ranks on ops: 0, or -EINVAL / -ENOTSUP with one line in err. */
int forward_tp_cp_check(const struct model_config *c, const struct backend_ops *ops, int n,
			char *err, size_t err_len);

/* Any rank inside a step, with decode context parallel: the cache rows (this rank's
 * local rows, or the row that takes other ranks' latents) of the step's rows, for the
 * latent's write; NULL without it (the step's slots are every rank's). */
const int32_t *forward_tp_cp_slots(const struct forward *f);

/* Any rank, with decode context parallel: layer l's MLA attention of this rank's heads
 * into f->attn (rows, heads, v_dim), from its q (f->q, rope applied) and the latents
 * every rank holds of the rows' contexts: this rank's heads absorbed and shared, every
 * head attended over this rank's tokens, its heads' partials merged by log-sum-exp and
 * expanded. 0, or -errno (-ECANCELED: another rank failed). */
int forward_tp_mla_attn(struct forward *f, const struct model_layer *L, int l,
			const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale);

/* Rank 0: runs the step on every rank; logits (n_out, full vocab) as forward_run.
 * With sampling set (forward_sample_set; every row greedy, or a top-k draw where
 * forward_tp_topk_ok, else -EINVAL) no logits are written: each rank takes the argmax,
 * or the top-k pairs, of its vocabulary slice of each out row and rank 0 merges the
 * (value, id) pairs into f->sample.ids (vocabulary-split sampling: the full logits are
 * never gathered). */
int forward_tp_run(struct forward *f, const struct fwd_batch *b, float *logits);

/* The greedy pick of kernels/cpu/sample.c over l (n): the highest value, the lower
 * index on ties, NaNs passed over (all NaN: the last); its value in *value. */
int32_t forward_tp_argmax(const float *l, int n, float *value);

/* The ids[r * stride] whose v[r * stride] wins among n slices' argmaxes given in
 * vocabulary order, by the same rule: the argmax of the whole row. */
int forward_tp_argmax_merge(const float *v, const int32_t *ids, int n, size_t stride);

/* Top-k draws by vocabulary slices (forward_tp_topk_ok): a row with temperature > 0
 * and 1 <= top_k <= FWD_TP_TOPK_MAX is drawn from every rank's top_k (value, id) pairs
 * of its slice alone: the row's top_k candidates are among them, and the procedure of
 * kernels/k_sample.h after its step 2 reads nothing else, so the draw is the one over
 * the gathered row (forward_tp_topk_draw). */
#define FWD_TP_TOPK_MAX 64

/* Whether ranks on ops draw top-k rows by slices: with host memory (each rank's
 * selection on the host), or with the device ops tp_argmax and tp_topk (each rank's
 * best 64 of its slice on its device, the row's top_k chosen among them on the host). */
int forward_tp_topk_ok(const struct backend_ops *ops);

/* The draw of k_cpu_sample(row, vocab, p, step) from m candidates (v, ids) that hold
 * the row's top p->top_k (ids ascending; work: K_CPU_SAMPLE_WORK(m) floats). */
int32_t forward_tp_topk_draw(const float *v, const int32_t *ids, int m,
			     const struct k_sample_params *p, uint64_t step, float *work);

/* Any rank, inside a step: the sum of every rank's buf (n floats), the same bits on
 * every rank, added to residual (n floats; the residual add fused) or, residual NULL,
 * into buf. 0, or -ECANCELED when another rank failed the step. */
int forward_tp_reduce(struct forward *f, float *buf, size_t n, float *residual);

/* forward_tp_reduce into residual with the RMSNorm that follows it fused: out (n
 * floats, rows of hidden; may be buf) = rmsnorm(residual) * gamma, computed inside
 * the reduction (tp_comm_reduce_norm; on a backend, tp_reduce's gamma form). gamma
 * NULL: forward_tp_reduce. */
int forward_tp_reduce_norm(struct forward *f, float *buf, size_t n, float *residual,
			   const struct model_tensor *gamma, float *out);

/* Any rank, before its routed experts run: the expert count its shard holds, and with
 * expert parallel ids (n, the router's choices, in backend memory) renumbered into them
 * (-1: another rank's expert, which the experts op skips); -errno where a copy of ids
 * to or from the backend failed. */
int forward_tp_experts(struct forward *f, int32_t *ids, size_t n);

/* Any rank: the embedding of b's tokens into f->x, by vocabulary shard and reduction. */
int forward_tp_embed(struct forward *f, const struct fwd_batch *b);

/* The ranks of f's step: 1 without tp, and with a one-rank communicator (whose steps
 * run as tp 1's, graphs and all: forward_run). */
int forward_tp_ranks(const struct forward *f);

/* forward_layer_time at tp > 1: layer `layer` of every rank, reps times over, captured
 * into one graph (ranks that share a GPU: BACKEND_TP_GRAPH_ONE) over the inputs the
 * last decode graph step staged (its bucket must be rows'), replayed `replays` times on
 * rank 0's queue; the kernels of every rank counted in *nodes. -EINVAL where the ranks
 * capture no such graph (a graph per rank: not built). */
int forward_tp_layer_time(struct forward *f, int rows, int layer, int reps, int replays,
			  double *us_per_layer, int *nodes);

/* Rank r's (r < forward_tp_ranks(f)) forward, whose kv holds its KV cache, and backend
 * (tp 1: f and f->be); the first rank whose cache holds the same bytes (r where no rank
 * before it does: KV heads replicated when fewer than ranks, an MLA latent replicated
 * unless split by tokens); and *split: 1, or n where the rank holds every n-th slot
 * (s % n == r, at its row s / n: MLA decode context parallel). For the host tier's
 * copies (kv_spans.h). */
void forward_tp_rank_kv(const struct forward *f, int r, const struct forward **rf,
			struct backend **be, int *same_as, int *split);

/* "tp 1", or "tp N, all-reduce fused (k_cuda_ar_fused)" / "..., all-reduce nccl
 * 2.28.3" / "..., all-reduce shared memory (tp_comm.c)": for the log and kdctl status. */
void forward_tp_describe(const struct forward *f, char *buf, size_t len);

/* Rank 0, from forward_destroy: stops the threads and destroys ranks 1..n-1; then
 * forward_tp_free releases the shards (after rank 0's forward is gone). */
void forward_tp_stop(struct fwd_tp *g);
void forward_tp_free(struct fwd_tp *g);

#endif
