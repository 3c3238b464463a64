/* The CUDA backend's internals shared by its files: the backend object, its ops by
 * enum with their properties, the one error path, and what each file provides. */
#ifndef KD_DAEMON_BACKEND_CUDA_H
#define KD_DAEMON_BACKEND_CUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "daemon/backend/backend.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/quant.h"

struct k_cuda_linear;
struct k_cuda_attn_ws;
struct k_cuda_moe_ws;
struct k_cuda_moe_quant;
struct k_cuda_sample_ws;
struct cuda_prof;

/* host pointer -> device pointer, open addressing, never shrinks */
struct cuda_ptr_map {
	const void **keys;	/* (cap) */
	void **vals;		/* (cap) */
	size_t cap;		/* power of two */
	size_t n;
};

/* ---- ops ------------------------------------------------------------------ */

/* Every op the backend queues, one per backend_ops entry that launches work. A fused
 * op (QKV_PREP_ATTN, MLA_PREP_ATTN) is one op here: timed as one, failing as one. */
enum cuda_op {
	CUDA_OP_EMBED,
	CUDA_OP_RMSNORM,
	CUDA_OP_ADD,
	CUDA_OP_SILU_MUL,
	CUDA_OP_LINEAR,
	CUDA_OP_LINEAR_ADD,
	CUDA_OP_LINEAR_FP32X,
	CUDA_OP_ROPE,
	CUDA_OP_KV_WRITE,
	CUDA_OP_QKV_PREP,
	CUDA_OP_ATTN_GQA,
	CUDA_OP_QKV_PREP_ATTN,
	CUDA_OP_MLA_PREP,
	CUDA_OP_MLA_POST,
	CUDA_OP_ATTN_MLA,
	CUDA_OP_MLA_PREP_ATTN,
	CUDA_OP_GATE_UP_SILU,
	CUDA_OP_MOE_ROUTE,
	CUDA_OP_MOE_EXPERTS,
	CUDA_OP_MOE_EXPERTS_ADD,
	CUDA_OP_MOE_LAYER,
	CUDA_OP_SAMPLE,
	CUDA_OP_COUNT
};

struct cuda_op_info {
	const char *name;	/* the backend_ops entry: in error lines and the op times */
	int reads_x_bf16;	/* 1: its first kernel is a GEMM reading x through the linear
				 * context, which may take the bf16 copy of x that the op
				 * before left there (k_cuda_linear_x_ready); every other
				 * op drops that mark, as it may be about to change x */
};

extern const struct cuda_op_info cuda_op_info[CUDA_OP_COUNT];	/* by enum cuda_op */

/* ---- the backend object --------------------------------------------------- */

/* A linear weight kept quantized on the GPU (backend_cuda_weights.c). */
struct cuda_qweight {
	const void *w;		/* (rows, row bytes) payload in the arena, as in the file */
	struct k_quant q;	/* scale: the arena's (scale rows, scale_cols) fp32 or f16 */
	int64_t rows;
	int mma_ok;		/* the tensor-core GEMV is exact for it (int4: f16 scales) */
	/* a part of a stack (q/k/v, gate/up, MLA's q and kv_a placed as one matrix): the
	 * stack's entry, its number of parts and this one's index; NULL, 1, 0 alone */
	const struct cuda_qweight *group;
	int group_n, group_i;
};

struct backend_cuda {
	struct backend base;
	const struct model *m;
	int dev;
	enum backend_allreduce allreduce;	/* backend_opts': the tp ranks' reduction */
	cudaStream_t stream;
	int err;			/* first failure of an op since the last sync, -errno */

	void *arena;			/* every weight, one allocation */
	size_t arena_bytes;
	struct cuda_ptr_map map;	/* model_tensor.data / router_bias / experts -> device;
					 * &model_tensor.q -> its qw entry (kept quantized) */
	struct cuda_qweight *qw;	/* (n_qw) the weights kept quantized */
	int n_qw;
	struct k_cuda_moe_quant *moe_q;	/* (n_layers) the routed experts' format where they
					 * stay quantized (fmt K_Q_NONE: bf16); cuda_moe_q_of */
	uint16_t *wtmp;			/* (wtmp_elems) f16: one quantized weight dequantized,
					 * for the linears of more than 32 rows */
	size_t wtmp_elems;		/* the largest kept quantized weight's rows * cols */
	float *inv_freq;		/* (rope dim / 2) device copy of the forward's rope */
	int rope_dim;
	int max_K;			/* widest matrix input (cols) */

	struct k_cuda_linear *lin;
	struct k_cuda_attn_ws *attn_ws;
	struct k_cuda_moe_ws *moe_ws;
	struct k_cuda_sample_ws *sample_ws;
	size_t alloc_bytes;		/* cudaMalloc'd through alloc() */
	float *fused;			/* (fused_floats) fused projections' outputs:
					 * (rows, q + 2 kv widths) or (rows, 2 * inter) */
	size_t fused_floats;
	/* A SwiGLU left to the down projection (cuda_gate_up_silu on quantized weights, or
	 * bf16 ones whose down runs on the ring GEMV, at up to KDEC_SWIGLU_IN_DOWN rows, 1):
	 * out (rows, inter) = silu(gate) * up of gu (rows, 2 inter) is not yet written. The
	 * next quantized or ring linear whose x is out takes it in its GEMV; anything else
	 * writes out first (cuda_swiglu_settle). */
	struct {
		float *out;		/* NULL: none pending */
		const float *gu;
		int rows, inter;
	} swiglu;
	/* An RMSNorm left to the linear after it (cuda_rmsnorm at up to KDEC_NORM_IN_GEMV
	 * rows): out (rows, dim) = rmsnorm(x) * w is not yet written. The next quantized
	 * or ring-GEMV linear whose x is out takes it in its GEMV, which writes out as well;
	 * anything else writes it first (cuda_norm_settle). */
	struct {
		float *out;		/* NULL: none pending */
		const float *x;		/* (rows, dim) the norm's input */
		const float *w;		/* (dim) device */
		int rows, dim;
		float eps;
	} norm;
	struct cuda_branch *branch;	/* the branch op's queue (backend_cuda_branch.c); NULL
					 * where no MoE layer has a shared expert to run there */
	int capturing;			/* between capture_begin and capture_end */
	struct cuda_prof *prof;		/* NULL unless KDEC_CUDA_OP_TIMES=1 */
	/* side copies (the host tier's mover thread): their own non-blocking stream, made
	 * on first use; side_mu serialises callers. Never touched by the ops or err. */
	pthread_mutex_t side_mu;
	cudaStream_t side;
	cudaEvent_t timer[2];		/* timer_mark's two marks, made on first use */
};

static inline struct backend_cuda *cuda_of(struct backend *be)
{
	return (struct backend_cuda *)be;
}

/* ---- errors (backend_cuda.c): the backend's one error path ------------------ */

/* A CUDA runtime call's result: a failure is logged (call, file, line, GPU) and kept
 * for the next sync; returns -EIO, or 0 on success. */
int cuda_check(struct backend_cuda *b, cudaError_t e, const char *call, const char *file, int line);
#define CUDA_CHECK(b, call) cuda_check((b), (call), #call, __FILE__, __LINE__)
/* Any other failure ret (-errno) of what: the first since the last sync is logged and
 * kept for it (one failing launch fails the rest of a step: one line, not hundreds). */
void cuda_fail(struct backend_cuda *b, int ret, const char *what);
/* b's GPU made the calling thread's current one (the CUDA current device is per host
 * thread, and the engine thread allocates and frees for every rank, each on its own GPU
 * with --gpus); returns the device to give back to cuda_dev_leave. */
int cuda_dev_enter(const struct backend_cuda *b);
void cuda_dev_leave(const struct backend_cuda *b, int prev);
/* Ends the capture on b's stream and instantiates it into *graph (NULL on failure),
 * *n_nodes its nodes; ret (a failure before the end) or an op's error while recording
 * (b->err, then cleared) fails it. 0 or -errno. */
int cuda_capture_finish(struct backend_cuda *b, void **graph, int *n_nodes, int ret);

/* ---- an op's bracket (backend_cuda_ops.c) --------------------------------- */

/* Every op calls cuda_op_begin before it queues anything and cuda_op_end (or
 * cuda_op_fail) once after: begin drops the bf16 copy of x unless op reads it and
 * starts op's time (KDEC_CUDA_OP_TIMES); end stops it and keeps a failure ret != 0. */
void cuda_op_begin(struct backend_cuda *b, enum cuda_op op);
void cuda_op_end(struct backend_cuda *b, enum cuda_op op, int ret);
/* cuda_op_end with why the op refused its arguments in the error line. */
void cuda_op_fail(struct backend_cuda *b, enum cuda_op op, int ret, const char *why);

/* The device copy of a weight; a missing one is a bug in the upload walk. */
const void *cuda_dev_of(struct backend_cuda *b, const void *host, const char *what);
/* The quantized format of L's routed experts on the GPU, or NULL where they are bf16. */
const struct k_cuda_moe_quant *cuda_moe_q_of(const struct backend_cuda *b,
					     const struct model_layer *L);
#define W(b, t) ((const uint16_t *)cuda_dev_of((b), (t)->data, __func__))
#define V(b, t) ((const float *)cuda_dev_of((b), (t)->data, __func__))

static inline struct k_cuda_attn_rows cuda_attn_rows(const struct k_attn_rows *r)
{
	return (struct k_cuda_attn_rows){ .n_rows = r->n_rows, .ctx = r->ctx, .blocks = r->blocks,
					  .max_ctx = r->max_ctx, .n_seqs = r->n_seqs };
}

/* ---- op times (backend_cuda_prof.c), KDEC_CUDA_OP_TIMES=1 -------------------- */

/* Ops run one by one (no graphs): events around each op, resolved at each sync into a
 * table by op, printed at destroy. Every call below does nothing while b->prof is NULL,
 * and the timing ones nothing while capturing. */
void cuda_prof_create(struct backend_cuda *b);	/* b->prof, where the variable says 1 */
void cuda_prof_destroy(struct backend_cuda *b);	/* prints the table */
void cuda_prof_begin(struct backend_cuda *b, enum cuda_op op);
void cuda_prof_end(struct backend_cuda *b);
void cuda_prof_rows(struct backend_cuda *b, int M);	/* a linear's rows: > 64 is prefill */
void cuda_prof_collect(struct backend_cuda *b);		/* after a stream sync */

/* ---- the ops (backend_cuda_ops.c): one kernel launcher each ----------------- */

void cuda_embed(struct backend *be, float *out, const int32_t *ids, int n,
		const struct model_tensor *table);
void cuda_rmsnorm(struct backend *be, float *out, int out_stride, const float *x, int x_stride,
		  const struct model_tensor *w, int rows, int dim, float eps);
void cuda_add(struct backend *be, float *y, const float *x, size_t n);
void cuda_silu_mul(struct backend *be, float *out, const float *gate, const float *up, size_t n);
/* y (M, w->rows) = x @ w^T (y += with accumulate) on the backend's stream: the quantized
 * kernels where w stayed quantized (k_cuda_linear_q_run: M <= 64 on the tensor-core
 * GEMV, one launch; more through an f16 copy into b->wtmp), else k_cuda_linear
 * on its bf16 copy.
 * 0 or -errno (not yet recorded: the caller's op ends with it). */
int cuda_linear_run(struct backend_cuda *b, float *y, const float *x, const struct model_tensor *w,
		    int M, int accumulate);
/* The same for a weight kept quantized (or a stack of them), w->rows rows of K columns. */
int cuda_qlinear_run(struct backend_cuda *b, float *y, const float *x, const struct cuda_qweight *w,
		     int M, int K, int accumulate);
/* The same for a bf16 weight w (N, K) in device memory (k_cuda_linear; a norm or SwiGLU
 * left pending is formed by the ring GEMV where it takes the call, else written first). */
int cuda_bf16_linear_run(struct backend_cuda *b, float *y, const float *x, const uint16_t *w,
			 int M, int N, int K, int accumulate);
/* w's entry where it stayed quantized on the GPU, else NULL. */
const struct cuda_qweight *cuda_qweight_of(const struct backend_cuda *b, const struct model_tensor *w);
/* Writes a pending SwiGLU's output (and its bf16 copy for the linear next) as
 * cuda_gate_up_silu would have; 0 where none is pending, else the launch's result. */
int cuda_swiglu_settle(struct backend_cuda *b);
/* The same for a pending RMSNorm (cuda_rmsnorm's launch, out and its bf16 copy). */
int cuda_norm_settle(struct backend_cuda *b);
/* Both, before a step's results are read or its graph ends; failures recorded. */
void cuda_pending_settle(struct backend_cuda *b);

/* ---- the branch op (backend_cuda_branch.c) -------------------------------- */

/* b->branch's stream and linear context (max_M rows) where the model has MoE layers
 * with a shared expert and KDEC_MOE_SHARED_BRANCH > 0; else nothing. 0 or -errno. */
int cuda_branch_create(struct backend_cuda *b, int max_M);
void cuda_branch_destroy(struct backend_cuda *b);	/* accepts b->branch NULL */
int cuda_branch(struct backend *be, enum backend_branch step, int rows);
/* The branch's linear context, NULL without a branch. */
struct k_cuda_linear *cuda_branch_linear(const struct backend_cuda *b);
/* Before a sync, a download or a capture's end: a branch left open (a step that failed
 * halfway) ended and the main queue made to wait for all of the branch's work. */
void cuda_branch_settle(struct backend_cuda *b);
void cuda_linear(struct backend *be, float *y, const float *x, const struct model_tensor *w, int M);
/* backend_ops.linear_rounds_x: the main queue's and the branch's linear contexts asked
 * (k_cuda_linear_rounds_x) for w's bf16 matrix; 2 (f16) for a quantized one on the
 * tensor-core kinds, 0 on the CUDA-core one */
int cuda_linear_rounds_x(struct backend *be, const struct model_tensor *w, int M);
void cuda_linear_fp32x(struct backend *be, float *y, const float *x, const struct model_tensor *w,
		       int M);
void cuda_linear_add(struct backend *be, float *y, const float *x, const struct model_tensor *w,
		     int M);
void cuda_rope(struct backend *be, const struct k_rope *rope, float *x, int n_rows, int n_heads,
	       int row_stride, int head_stride, const int32_t *pos);
void cuda_kv_write(struct backend *be, float *cache, int width, const float *src, int n_rows,
		   const int32_t *slots);
void cuda_attn_gqa(struct backend *be, float *out, const float *q, const struct k_kv_layer *kv,
		   const struct k_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
		   float scale);
int cuda_attn_mla(struct backend *be, float *out, const float *q, const struct model_tensor *w_kv_b,
		  const struct k_kv_layer *kv, const struct k_attn_rows *rows,
		  const struct k_mla_dims *d, float scale);
void cuda_moe_route(struct backend *be, const struct k_moe_route_params *p, const float *logits,
		    int M, int32_t *ids, float *weights);
int cuda_moe_experts(struct backend *be, float *out, const float *x, int M, const int32_t *ids,
		     const float *weights, int top_k, const struct model_layer *L, int hidden,
		     int inter, int n_experts);
int cuda_moe_layer(struct backend *be, float *y, const float *x, int M, const struct model_layer *L,
		   const struct k_moe_route_params *route, float *logits, int32_t *ids,
		   float *weights, int hidden, int inter, int n_experts, int shared_inter);
int cuda_moe_experts_add(struct backend *be, float *y, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const struct model_layer *L, int hidden, int inter, int n_experts,
			 int shared_inter);
int cuda_sample(struct backend *be, int32_t *ids, const float *logits, int M, int vocab,
		const struct k_sample_params *params, const uint64_t *steps);

/* ---- fused ops (backend_cuda_fused.c): several kernels, one op ------------ */

int cuda_fused_reserve(struct backend_cuda *b, int max_M);	/* the scratch for max_M rows */
void cuda_qkv_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_qkv *p);
int cuda_qkv_prep_attn(struct backend *be, float *out, float *q, const float *h,
		       const struct model_layer *L, const struct backend_qkv *p,
		       const struct k_attn_rows *rows, float scale);
void cuda_mla_post(struct backend *be, float *q, float *kv_a, const struct model_layer *L,
		   const struct backend_mla *p);
void cuda_mla_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_mla *p);
int cuda_mla_prep_attn(struct backend *be, float *out, float *q, const float *h,
		       const struct model_layer *L, const struct backend_mla *p,
		       const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale);
void cuda_gate_up_silu(struct backend *be, float *out, const float *x,
		       const struct model_tensor *w_gate, const struct model_tensor *w_up, int M);

/* ---- tensor-parallel ranks (backend_cuda_tp.c) ------------------------------ */

void cuda_thread_attach(struct backend *be);
void cuda_embed_shard(struct backend *be, float *out, const int32_t *ids, int n,
		      const struct model_tensor *table, int v0);
void cuda_experts_shard(struct backend *be, int32_t *ids, int n, int e0, int ne);
int cuda_tp_comm_create(struct backend *const *ranks, int n, int max_rows, int width,
			void **comm, char *err, size_t err_len);
void cuda_tp_comm_destroy(void *comm);
int cuda_tp_arrive(struct backend *be, void *comm, int rank);
enum backend_tp_graph cuda_tp_graph_kind(void *comm);
int cuda_tp_capture_begin(struct backend *be, void *comm, int rank);
int cuda_tp_capture_end(struct backend *be, void *comm, int rank, void **graph, int *n_nodes);
int cuda_tp_reduce_join(struct backend *be, void *comm, int rank, int phase);
void cuda_tp_argmax(struct backend *be, void *best, const float *logits, int rows, int vn, int v0);
size_t cuda_tp_topk_bytes(int rows, int vn);
void cuda_tp_topk(struct backend *be, void *top, const float *logits, int rows, int vn, int v0);
int cuda_tp_reduce(struct backend *be, void *comm, int rank, float *buf, int rows, float *residual,
		   const struct model_tensor *gamma, float *out, float eps);
const char *cuda_tp_comm_name(void *comm);

/* ---- the reduction's choice and NCCL (backend_cuda_nccl.c) ------------------- */

struct cuda_nccl;
/* The reduction of n ranks (1..K_CUDA_AR_MAX_RANKS) by ranks[0]'s allreduce, logged
 * in one line: *nccl made (the caller's, cuda_nccl_destroy) for NCCL, NULL for the
 * fused kernel. -EINVAL / -ENOTSUP (a choice these ranks cannot run: NCCL with two
 * ranks on one GPU, fused without peer access or with one rank), -ENOENT / -ENOSYS /
 * -EIO (NCCL missing or its ncclCommInitAll failing), each with one line in err. */
int cuda_nccl_pick(struct backend *const *ranks, int n, struct cuda_nccl **nccl, char *err,
		   size_t err_len);
/* Where the fused kernel was picked by --allreduce auto and its buffers could not be made
 * (fused_ret: k_cuda_ar_create's error, e.g. peer access that CanAccessPeer promised and
 * EnablePeerAccess refused): NCCL instead, as cuda_nccl_pick makes it; fused_ret where
 * auto did not choose (--allreduce fused) or ranks share a GPU. */
int cuda_nccl_fallback(struct backend *const *ranks, int n, int fused_ret, struct cuda_nccl **nccl,
		       char *err, size_t err_len);
void cuda_nccl_destroy(struct cuda_nccl *c);	/* accepts NULL; no reduction in flight */
const char *cuda_nccl_name(const struct cuda_nccl *c);	/* "nccl 2.28.3" */
/* Rank rank's reduction through NCCL on be's stream, the arguments of tp_reduce
 * (gamma: the norm's device weight); every rank calls it with the same rows. */
int cuda_nccl_reduce(struct backend *be, struct cuda_nccl *c, int rank, float *buf, int rows,
		     int width, float *residual, const float *gamma, float *out, float eps);

/* ---- MLA decode context parallel (backend_cuda_mla_cp.c) ------------------- */

int cuda_mla_cp_create(struct backend *const *ranks, int n, int max_rows, int max_ctx,
		       int block_tokens, const struct k_mla_dims *d, int trash, void **cp,
		       char *err, size_t err_len);
void cuda_mla_cp_destroy(void *cp);
const int32_t *cuda_mla_cp_step(struct backend *be, void *cp, int rank, const int32_t *slots,
				const struct k_attn_rows *rows);
int cuda_mla_cp_attn(struct backend *be, void *cp, int rank, int stage, float *out,
		     const float *q, const struct model_tensor *w_kv_b, const struct k_kv_layer *kv,
		     const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale);

/* ---- weights (backend_cuda_weights.c) ------------------------------------ */

int cuda_ptr_map_put(struct cuda_ptr_map *m, const void *key, void *val);
void *cuda_ptr_map_get(const struct cuda_ptr_map *m, const void *key);
void cuda_ptr_map_fini(struct cuda_ptr_map *m);

/* Copies every weight of b->m into one device arena (matrices as bf16, vectors as
 * fp32) with a progress line; fills b->map. 0 or -errno with one line in err. */
int cuda_weights_upload(struct backend_cuda *b, char *err, size_t err_len);

#endif
