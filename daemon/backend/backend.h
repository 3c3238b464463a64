/* A backend provides memory, the ops a forward pass is composed of, and a way to run a
 * step. The standard path (forward.c) calls only these entry points, so one definition
 * of each architecture serves every backend. Activations are float (rows, width),
 * row-major, in backend memory. Ops may run asynchronously; sync() waits for them. */
#ifndef KD_DAEMON_BACKEND_H
#define KD_DAEMON_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model.h"
#include "kernels/k_sample.h"
#include "kernels/ops.h"

struct backend;

/* The fewest rows at which the cuda backend's linear layers take their input rounded to
 * bf16 (K_CUDA_LINEAR_SPLITK and up; fewer rows run the fp32-x GEMV). */
#define BACKEND_X_BF16_MIN_M	3

/* How tensor-parallel ranks on GPUs reduce (--allreduce, docs/PARALLEL.md): auto picks
 * the fused one-shot kernel where every pair of ranks shares a device or has peer
 * access, NCCL otherwise; fused and nccl force one. The cpu ranks reduce through shared
 * memory whatever this says (only auto is accepted there). */
enum backend_allreduce {
	BACKEND_AR_AUTO = 0,
	BACKEND_AR_FUSED,
	BACKEND_AR_NCCL,
};

/* The steps of the branch op, in this order (MARK may stand alone). */
enum backend_branch {
	BACKEND_BRANCH_MARK,	/* the point the branch starts after */
	BACKEND_BRANCH_BEGIN,	/* the ops queued next go to the branch */
	BACKEND_BRANCH_END,	/* ... and from here to the main queue again */
	BACKEND_BRANCH_JOIN,	/* the main queue's next ops wait for the branch */
};

/* "auto", "fused", "nccl" -> *out: 0, or -EINVAL for anything else. */
int backend_allreduce_parse(const char *s, enum backend_allreduce *out);
const char *backend_allreduce_name(enum backend_allreduce a);

struct backend_opts {
	int threads;		/* CPU worker threads; <= 0: one per online CPU */
	int device;		/* first GPU (cuda) */
	int kv_bf16;		/* cpu: round each cached K/V value to bf16 as it is written,
				 * as the cuda backend stores it, so a fidelity check can tell
				 * the cache's rounding from the kernels' error (cuda: ignored) */
	int w_bf16;		/* cpu: a quantized checkpoint's MLA kv_b, which the cuda backend
				 * dequantizes to bf16 at load (no quantized kernel reads it),
				 * rounded to bf16 as it keeps it; for kv_bf16's reason (cuda:
				 * ignored) */
	int x_bf16;		/* cpu: the fewest rows at which a linear layer's input is
				 * rounded to bf16, as the cuda backend's kernels round it:
				 * BACKEND_X_BF16_MIN_M for its defaults, 1 where every bf16
				 * linear rounds (the ring kind, KDEC_LINEAR_RING); never the
				 * router's linear_fp32x; 0: never. For the same reason as
				 * kv_bf16 (cuda: ignored) */
	/* cpu, consulted before x_bf16's rule for each linear: 1 rounds x to bf16, 2 to f16
	 * (a GPU's quantized kernels), 0 keeps it, -1 leaves it to x_bf16 (the reference of
	 * a GPU engine whose run-time choices round x for some weights only:
	 * backend_ops.linear_rounds_x); NULL: none */
	int (*x_bf16_at)(void *arg, const struct model_tensor *w, int M);
	void *x_bf16_arg;
	const int *rank_devices; /* tp > 1 (cuda): rank r's backend on GPU rank_devices[r]
				  * (engine_rank_devices); NULL: every rank on device */
	enum backend_allreduce allreduce;	/* the ranks' reduction (tp_comm_create) */
};

/* A GQA layer's attention inputs for qkv_prep (and qkv_prep_attn): rows of h in, q out,
 * K/V into the cache. */
struct backend_qkv {
	int rows, n_heads, kv_heads, head_dim;
	int qk_norm;			/* Qwen3: RMSNorm of each q and k head (L->q_norm, k_norm) */
	float eps;
	const struct k_rope *rope;
	const int32_t *pos;		/* (rows) */
	const int32_t *slots;		/* (rows) cache slot of each row's K/V */
	struct k_kv_layer *kv;
};

/* An MLA layer's attention inputs for mla_post (and mla_prep, mla_prep_attn), after or
 * with its q and kv_a projections. */
struct backend_mla {
	int rows, n_heads, nope_dim, rope_dim, kv_lora;	/* rope_dim: q_pe and key width */
	float eps;			/* of the latent's RMSNorm (L->kv_a_norm) */
	const struct k_rope *rope;
	const int32_t *pos;		/* (rows) */
	const int32_t *slots;		/* (rows) cache slot of each row's latent; < 0: none */
	struct k_kv_layer *kv;
};

/* How the tensor-parallel ranks capture a decode step into graphs (forward_tp_graph.c):
 * every rank on one device (virtual ranks): one graph holds every rank's step, each
 * reduction one launch of all ranks (no cross-launch wait can deadlock); every rank on
 * a device of its own: a graph per rank, the reductions' only waits the data's
 * sentinels; a mix (some ranks sharing a device, not all): none, op by op. */
enum backend_tp_graph {
	BACKEND_TP_GRAPH_NONE = 0,
	BACKEND_TP_GRAPH_ONE,
	BACKEND_TP_GRAPH_PER_RANK,
};

/* The pairs a row of tp_topk gives (FWD_TP_TOPK_MAX), and the words of its result. */
#define BACKEND_TP_TOPK 64
#define BACKEND_TP_TOPK_WORDS(rows) ((2 * BACKEND_TP_TOPK + 1) * (size_t)(rows))

/* The kind for n ranks (n >= 2) on devices devs (n), by the rule above. */
static inline enum backend_tp_graph backend_tp_graph_kind(const int *devs, int n)
{
	int same = 0, pairs = 0;

	for (int a = 0; a < n; a++)
		for (int b = a + 1; b < n; b++) {
			pairs++;
			same += devs[a] == devs[b];
		}
	if (n < 2)
		return BACKEND_TP_GRAPH_NONE;
	return same == pairs ? BACKEND_TP_GRAPH_ONE : same == 0 ? BACKEND_TP_GRAPH_PER_RANK
							    : BACKEND_TP_GRAPH_NONE;
}

struct backend_ops {
	const char *name;
	enum k_dtype kv_dtype;	/* element type of the KV cache: K_F32 (cpu), K_BF16 (cuda);
				 * struct k_kv_layer's k and v point to storage of this type */
	int host_memory;	/* 1: backend memory is host memory, so ops read a step's host
				 * inputs (ids, positions, block tables) in place */
	int prompt_rows;	/* rows per forward call that engine_create defaults to (0:
				 * ENGINE_DEFAULT_MAX_ROWS) where one call of many rows costs
				 * less per token than several of fewer: a lone prompt runs in
				 * steps of that many tokens (sched_step.c) */

	/* Optional (NULL: always usable): 1 when the backend can run here, with what it
	 * would run on in why ("GPU 0: NVIDIA H200, 139.8 GiB"); 0 when it cannot, with
	 * the reason in why. Must not leave state behind that a later fork would lose
	 * beyond what create itself would. */
	int (*available)(char *why, size_t why_len);

	/* Optional (NULL: the backend runs on no GPU): how many GPUs it can see, 0 when
	 * none (--gpus all is resolved by it). */
	int (*device_count)(void);

	/* Prepares the backend for model m (which outlives it). Returns 0 or -errno with
	 * one line in err. *out is released with destroy. */
	int (*create)(struct backend **out, const struct model *m, const struct backend_opts *opts,
		      char *err, size_t err_len);
	void (*destroy)(struct backend *be);	/* accepts NULL */

	/* Backend memory, zeroed; NULL when exhausted. */
	void *(*alloc)(struct backend *be, size_t bytes);
	void (*free)(struct backend *be, void *p);
	/* Optional: host memory the backend copies from and to fastest (page-locked),
	 * zeroed; NULL when exhausted. Without them forward stages in malloc'd memory. */
	void *(*host_alloc)(struct backend *be, size_t bytes);
	void (*host_free)(struct backend *be, void *p);
	/* Host <-> backend copies; return 0 or -EIO. An upload from host_alloc memory may
	 * read its source until the next sync or download. */
	int (*upload)(struct backend *be, void *dst, const void *src, size_t bytes);
	int (*download)(struct backend *be, void *dst, const void *src, size_t bytes);
	int (*sync)(struct backend *be);
	/* Optional, safe on another thread beside everything above (the host tier's mover
	 * calls them; one caller at a time): copies that wait only for themselves.
	 * side_download gathers n regions src[0..n) of bytes each (backend memory) into
	 * dst (n * bytes of host memory, from host_alloc where the backend has it);
	 * side_upload scatters src (the same) into dst[0..n). They return once the bytes
	 * are there: 0 or -EIO. The caller keeps the ops from writing a region it reads
	 * and from reading one it writes until then, and has seen (a sync) the ops that
	 * wrote a region before it reads it. */
	int (*side_download)(struct backend *be, void *dst, void *const *src, int n, size_t bytes);
	int (*side_upload)(struct backend *be, void *const *dst, const void *src, int n, size_t bytes);

	/* ---- ops; shapes as in kernels/cpu/k_cpu.h, types in kernels/ops.h ---- */
	void (*embed)(struct backend *be, float *out, const int32_t *ids, int n,
		      const struct model_tensor *table);
	void (*rmsnorm)(struct backend *be, float *out, int out_stride, const float *x, int x_stride,
			const struct model_tensor *w, int rows, int dim, float eps);
	void (*add)(struct backend *be, float *y, const float *x, size_t n);
	void (*silu_mul)(struct backend *be, float *out, const float *gate, const float *up, size_t n);
	/* y (M, w->rows) = x (M, w->cols) @ w^T */
	void (*linear)(struct backend *be, float *y, const float *x, const struct model_tensor *w, int M);
	void (*rope)(struct backend *be, const struct k_rope *rope, float *x, int n_rows, int n_heads,
		     int row_stride, int head_stride, const int32_t *pos);
	void (*kv_write)(struct backend *be, float *cache, int width, const float *src, int n_rows,
			 const int32_t *slots);
	void (*attn_gqa)(struct backend *be, float *out, const float *q, const struct k_kv_layer *kv,
			 const struct k_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
			 float scale);
	int (*attn_mla)(struct backend *be, float *out, const float *q, const struct model_tensor *w_kv_b,
			const struct k_kv_layer *kv, const struct k_attn_rows *rows,
			const struct k_mla_dims *d, float scale);
	void (*moe_route)(struct backend *be, const struct k_moe_route_params *p, const float *logits,
			  int M, int32_t *ids, float *weights);
	int (*moe_experts)(struct backend *be, float *out, const float *x, int M, const int32_t *ids,
			   const float *weights, int top_k, const struct model_layer *L, int hidden,
			   int inter, int n_experts);

	/* ---- optional: NULL where a backend lacks them (forward.c falls back to the
	 * ops each stands for) ---- */
	/* q (rows, n_heads * head_dim) = rope(norm(h @ wq^T)); rope(norm(h @ wk^T)) and
	 * h @ wv^T into the cache: what linear x3, rmsnorm x2, rope x2 and kv_write x2 do,
	 * with the three projections as one matrix where the backend holds them adjacent. */
	void (*qkv_prep)(struct backend *be, float *q, const float *h, const struct model_layer *L,
			 const struct backend_qkv *p);
	/* q (rows, n_heads, nope_dim + rope_dim): each head's rope part rotated in place;
	 * kv_a (rows, kv_lora + rope_dim): [rmsnorm(latent) ; rope(key)] into the cache at
	 * the slots. What rmsnorm, rope x2 and kv_write do; kv_a is scratch after. */
	void (*mla_post)(struct backend *be, float *q, float *kv_a, const struct model_layer *L,
			 const struct backend_mla *p);
	/* q = h @ L->wq_b^T (q-LoRA: rmsnorm(h @ L->wq_a^T) @ L->wq_b^T) and kv_a =
	 * h @ L->wkv_a^T, the first projection and kv_a's as one matrix where the backend
	 * holds the two adjacent, then what mla_post does; h (rows, hidden) in, q (rows,
	 * n_heads, nope_dim + rope_dim) out, kv_a in the backend's own scratch. */
	void (*mla_prep)(struct backend *be, float *q, const float *h, const struct model_layer *L,
			 const struct backend_mla *p);
	/* out (M, w_gate->rows) = silu(x @ w_gate^T) * (x @ w_up^T), one matrix where the
	 * backend holds the two adjacent. */
	void (*gate_up_silu)(struct backend *be, float *out, const float *x,
			     const struct model_tensor *w_gate, const struct model_tensor *w_up, int M);
	/* Sizes the ops' workspaces for steps of up to max_rows rows attending to up to
	 * max_ctx tokens; called once by forward_create. 0 or -errno with err. */
	int (*reserve)(struct backend *be, int max_rows, int max_ctx, char *err, size_t err_len);
	/* y (M, w->rows) += x (M, w->cols) @ w^T: the residual add fused into the linear */
	void (*linear_add)(struct backend *be, float *y, const float *x, const struct model_tensor *w,
			   int M);
	/* linear with x kept in fp32 at every M (a backend's linear may round x to bf16 for
	 * its tensor cores): the MoE router, where the reference decides routing from fp32
	 * logits and a rounding flips experts at near-ties. NULL where linear already is. */
	void (*linear_fp32x)(struct backend *be, float *y, const float *x,
			     const struct model_tensor *w, int M);
	/* 1 where this backend's linears so far rounded the input of w (a bf16 weight) at M
	 * rows to bf16 by a choice made at run time (a timed kernel kind) that its static
	 * rule (BACKEND_X_BF16_MIN_M) would not make; for a weight it keeps quantized, 2
	 * where its kernel at M rows takes x in f16, 0 where in fp32; -1 otherwise. For the
	 * CPU reference (backend_opts.x_bf16_at). NULL where no such choice exists. */
	int (*linear_rounds_x)(struct backend *be, const struct model_tensor *w, int M);
	/* y (M, hidden) += the routed experts' sum (moe_experts's arguments) + the shared
	 * expert of L (w_gate, w_up, w_down; shared_inter wide, 0: none) of x: what
	 * moe_experts, the shared SwiGLU MLP and add do, in the ops' order of the sums,
	 * where the backend can fuse this call. 1: it cannot, nothing done (forward.c then
	 * runs those ops); 0 or -errno. */
	int (*moe_experts_add)(struct backend *be, float *y, const float *x, int M,
			       const int32_t *ids, const float *weights, int top_k,
			       const struct model_layer *L, int hidden, int inter, int n_experts,
			       int shared_inter);
	/* The latency path's MoE layer (--decode-path latency): y (M, hidden) += the MoE of
	 * x, router L->router (x in fp32, logits into logits (M, n_experts)), the choice by
	 * route (bias a host-side model pointer, as moe_route takes it; ids, weights (M,
	 * top_k) written), the routed experts and the shared expert of L as
	 * moe_experts_add sums them: what linear_fp32x, moe_route and moe_experts_add do,
	 * in fewer launches. 1: it declines, nothing queued (forward.c then runs those
	 * ops); 0 or -errno. */
	int (*moe_layer)(struct backend *be, float *y, const float *x, int M,
			 const struct model_layer *L, const struct k_moe_route_params *route,
			 float *logits, int32_t *ids, float *weights, int hidden, int inter,
			 int n_experts, int shared_inter);
	/* A branch of the step beside the main queue (NULL where the backend has none),
	 * for work that depends on an earlier point only: MARK notes that point (what the
	 * ops queued so far write); the ops queued between BEGIN and END run after it,
	 * concurrently with the ops the main queue gets after END, until JOIN makes the
	 * main queue's next ops wait for them. The branch's ops must not touch what the
	 * main queue's ops meanwhile write, nor write what they read. MARK returns 1 where
	 * the backend declines a branch for rows rows (nothing noted: queue the work in
	 * line), else 0 or -errno; the other steps' failures are kept for the next sync. */
	int (*branch)(struct backend *be, enum backend_branch step, int rows);
	/* A decode step's attention, fused: what qkv_prep(q, h, L, p) then attn_gqa(out, q,
	 * p->kv, rows, p's heads, scale) do, for rows that are each the only new token of
	 * their sequence, at its last position (ctx - 1): the backend may then do qkv_prep's
	 * norm, rope and cache append inside the attention launch. 1: it declines, nothing
	 * queued (forward.c then runs the two ops); 0: done, failures kept for the next
	 * sync as the two ops' are. */
	int (*qkv_prep_attn)(struct backend *be, float *out, float *q, const float *h,
			     const struct model_layer *L, const struct backend_qkv *p,
			     const struct k_attn_rows *rows, float scale);
	/* An MLA layer's attention, fused: what mla_prep(q, h, L, p) then attn_mla(out, q,
	 * &L->wkv_b, p->kv, rows, d, scale) do, mla_post's work inside the attention's
	 * first launch where the backend can. 1: it declines, nothing queued (forward.c
	 * then runs the two ops); else attn_mla's result: 0 or -errno. */
	int (*mla_prep_attn)(struct backend *be, float *out, float *q, const float *h,
			     const struct model_layer *L, const struct backend_mla *p,
			     const struct k_attn_rows *rows, const struct k_mla_dims *d,
			     float scale);
	/* ids (M) drawn from logits (M, vocab) by params (M) at output indices steps (M),
	 * the procedure of kernels/k_sample.h; all in backend memory. 0 or -errno. */
	int (*sample)(struct backend *be, int32_t *ids, const float *logits, int M, int vocab,
		      const struct k_sample_params *params, const uint64_t *steps);
	/* ---- optional: tensor-parallel ranks of a backend without host memory
	 * (forward_tp.c; docs/PARALLEL.md). Every rank is a backend of its own, its ops
	 * queued by its own thread. ---- */
	/* Makes the calling thread able to queue be's ops (cuda: be's GPU current). */
	void (*thread_attach)(struct backend *be);
	/* out (n, table->cols) = the rows of ids from table, a rank's shard holding the
	 * vocabulary rows [v0, v0 + table->rows); a row whose id is outside it is zeros. */
	void (*embed_shard)(struct backend *be, float *out, const int32_t *ids, int n,
			    const struct model_tensor *table, int v0);
	/* Expert parallel: ids (n, the router's choices) in place, an expert of the rank's
	 * share [e0, e0 + ne) renumbered to id - e0, any other to -1 (skipped). */
	void (*experts_shard)(struct backend *be, int32_t *ids, int n, int e0, int ne);
	/* The reductions' communicator of n ranks, rank r's ops queued on ranks[r], for up
	 * to max_rows rows of width floats: 0 or -errno with one line in err. */
	int (*tp_comm_create)(struct backend *const *ranks, int n, int max_rows, int width,
			      void **comm, char *err, size_t err_len);
	void (*tp_comm_destroy)(void *comm);	/* accepts NULL; no reduction in flight */
	/* Optional: what the communicator reduces through, for the log and kdctl status
	 * ("fused (k_cuda_ar_fused)", "nccl 2.28.3"); the string lives as long as comm. */
	const char *(*tp_comm_name)(void *comm);
	/* One reduction, every rank in turn with the same rows: tp_arrive (rank r's work
	 * so far, marked), then once every rank has arrived (the caller's barrier),
	 * tp_reduce: rank r's part, queued to start once every rank's marked work is done;
	 * buf (rows, width) is its partial; the sum over ranks in rank order (the same
	 * bits on every rank) is added to residual (rows, width) or, residual NULL,
	 * written to buf; with gamma (a (width) norm weight; residual then needed) out
	 * (rows, width) = rmsnorm(residual) * gamma in the same reduction (the next
	 * layer's norm fused; out may be buf). No rank may queue more work before every
	 * rank has queued its tp_reduce (the caller's second barrier). 0 or -errno. */
	int (*tp_arrive)(struct backend *be, void *comm, int rank);
	int (*tp_reduce)(struct backend *be, void *comm, int rank, float *buf, int rows,
			 float *residual, const struct model_tensor *gamma, float *out, float eps);
	/* Graphs of a tensor-parallel step (forward_tp_graph.c; docs/PARALLEL.md "CUDA
	 * graphs with tp > 1"). tp_graph_kind: how comm's ranks capture a decode step,
	 * backend_tp_graph_kind of their devices. */
	enum backend_tp_graph (*tp_graph_kind)(void *comm);
	/* A capture of one step across the ranks. tp_capture_begin: rank 0 first, then,
	 * after the caller's barrier, the others; tp_capture_end: ranks 1..n-1 first, then
	 * rank 0 after a barrier, also where a rank's ops failed (the capture must end).
	 * BACKEND_TP_GRAPH_ONE: rank 0's queue starts the capture and forks into every
	 * rank's; each rank issues its own ops; rank 0's end joins them and *graph (rank
	 * 0 only; NULL elsewhere) is the whole step of every rank, replayed by rank 0's
	 * graph_launch. BACKEND_TP_GRAPH_PER_RANK: each rank captures its own queue into
	 * its own *graph, replayed by its own graph_launch. *n_nodes as capture_end. */
	int (*tp_capture_begin)(struct backend *be, void *comm, int rank);
	int (*tp_capture_end)(struct backend *be, void *comm, int rank, void **graph, int *n_nodes);
	/* Inside a BACKEND_TP_GRAPH_ONE capture tp_reduce records rank r's part and
	 * launches nothing; then, after the caller's barrier, tp_reduce_join(phase 0):
	 * rank 0 queues every rank's part as one launch once every rank's marked work is
	 * done; after a second barrier tp_reduce_join(phase 1): rank r's queue waits for
	 * it. Outside such a capture: nothing. 0 or -errno. */
	int (*tp_reduce_join)(struct backend *be, void *comm, int rank, int phase);
	/* Greedy by vocabulary slices on the device: best (2, rows) 32-bit words, row i's
	 * (value, v0 + index) of the greatest of logits (rows, vn) by forward_tp_argmax's
	 * rule (the lower index on ties, NaNs passed over, all NaN: the last); values
	 * as floats in best[0..rows), ids as int32 in best[rows..2 rows). */
	void (*tp_argmax)(struct backend *be, void *best, const float *logits, int rows, int vn,
			  int v0);
	/* ---- optional: MLA decode context parallel (--mla-cp) on a backend without host
	 * memory (forward_tp.c; docs/PARALLEL.md): rank r's latent cache holds slot s where
	 * s % n == r, at its row s / n. ---- */
	/* The exchange of n ranks (rank r's ops queued on ranks[r]) for steps of up to
	 * max_rows rows attending to up to max_ctx tokens, block tables of block_tokens
	 * tokens, d the model's MLA dims (d->n_heads every rank's heads), trash the cache row
	 * that takes the other ranks' latents: 0 or -errno with one line in err. */
	int (*mla_cp_create)(struct backend *const *ranks, int n, int max_rows, int max_ctx,
			     int block_tokens, const struct k_mla_dims *d, int trash, void **cp,
			     char *err, size_t err_len);
	void (*mla_cp_destroy)(void *cp);	/* accepts NULL; nothing in flight */
	/* Once a step, before its layers, slots and rows the staged step's (backend memory):
	 * the rank's cache rows of the step's latents (returned, backend memory owned by
	 * cp, for the latent writes) and the tokens of each row it holds. NULL on failure. */
	const int32_t *(*mla_cp_step)(struct backend *be, void *cp, int rank, const int32_t *slots,
				      const struct k_attn_rows *rows);
	/* One MLA layer's attention in stages, every rank's stage queued (the caller's
	 * barrier) before any rank queues the next: 0, the rank's heads absorbed (q, its
	 * heads (rows, d->n_heads, nope + rope)) into the rows every rank reads; 1, every
	 * head over the rank's tokens (kv its cache); 2, the rank's heads merged over every
	 * rank's partials and expanded by w_kv_b into out (rows, d->n_heads, v_dim).
	 * 0 or -errno. */
	int (*mla_cp_attn)(struct backend *be, void *cp, int rank, int stage, float *out,
			   const float *q, const struct model_tensor *w_kv_b,
			   const struct k_kv_layer *kv, const struct k_attn_rows *rows,
			   const struct k_mla_dims *d, float scale);
	/* Optional: top-k draws by vocabulary slices on the device (absent where the
	 * backend has host memory: the CPU ranks select on the host, forward_tp_sample.c).
	 * For each row i of logits (rows, vn), its best m_i = min(BACKEND_TP_TOPK, non-NaN
	 * values) (value, v0 + index) by kernels/cpu/sample.c's order (the higher logit,
	 * then the lower index; NaN never one), indices ascending, into top: a buffer of
	 * tp_topk_bytes(rows, vn) bytes of backend memory (more rows' size is as good)
	 * whose first BACKEND_TP_TOPK_WORDS(rows) 32-bit words hold the values (fp32 at
	 * [i * TOPK + j]), the ids (int32 at [rows * TOPK + i * TOPK + j]) and m_i (int32
	 * at [2 * rows * TOPK + i]); the rest is the op's scratch. */
	size_t (*tp_topk_bytes)(int rows, int vn);
	void (*tp_topk)(struct backend *be, void *top, const float *logits, int rows, int vn,
			int v0);
	/* Graphs: ops issued between capture_begin and capture_end are recorded into
	 * *graph instead of running; graph_launch replays them on the current contents of
	 * the same buffers; *n_nodes receives the kernels and copies recorded. 0 or -errno. */
	int (*capture_begin)(struct backend *be);
	int (*capture_end)(struct backend *be, void **graph, int *n_nodes);
	int (*graph_launch)(struct backend *be, void *graph);
	void (*graph_destroy)(struct backend *be, void *graph);	/* accepts NULL */
	/* Optional: the backend's own clock for what lies between two marks of its
	 * queue (kdbench decode's gpu_ms). timer_mark(be, 0) and then (be, 1) in the queue
	 * order of the ops between them; timer_ms after a sync: ms between the two, or -1. */
	int (*timer_mark)(struct backend *be, int which);
	double (*timer_ms)(struct backend *be);
};

/* Every backend embeds this first, so the generic code can reach its ops. */
struct backend {
	const struct backend_ops *ops;
};

extern const struct backend_ops backend_cpu_ops;
extern const struct backend_ops backend_cuda_ops;	/* in builds with CUDA */

/* The backend called name ("cpu", "cuda"), or NULL with a message in err that lists
 * the backends this build has. */
const struct backend_ops *backend_find(const char *name, char *err, size_t err_len);

/* As backend_find, and "auto" (BACKEND_AUTO): the first backend of the build that says
 * it is available, preferring a GPU (cuda when built with CUDA and a device is
 * visible), else cpu; why (when not NULL) gets one line saying which and why, for the
 * log ("auto: cuda (GPU 0: ...)", "auto: cpu (cuda: no usable GPU)"), and stays empty
 * for a named backend. */
#define BACKEND_AUTO "auto"
const struct backend_ops *backend_pick(const char *name, char *why, size_t why_len,
				       char *err, size_t err_len);

/* The names of the backends compiled into this build, "cuda, cpu" style (the order
 * auto tries them), into buf. */
void backend_names(char *buf, size_t len);

#endif
