/* The CUDA backend's internals shared by its files: the backend object, the weight
 * arena and the map from a host weight to its device copy. */
#ifndef KD_DAEMON_BACKEND_CUDA_H
#define KD_DAEMON_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "daemon/backend/backend.h"
#include "kernels/cuda/ops/k_cuda_ops.h"

struct k_cuda_linear;
struct k_cuda_attn_ws;
struct k_cuda_moe_ws;
struct k_cuda_sample_ws;

/* host pointer -> device pointer, open addressing, never shrinks */
struct cuda_ptr_map {
	const void **keys;	/* (cap) */
	void **vals;		/* (cap) */
	size_t cap;		/* power of two */
	size_t n;
};

/* Per-op GPU time, KDEC_CUDA_OP_TIMES=1, ops run one by one (no graphs): events
 * around each launcher call, resolved at sync, a table at destroy. */
#define CUDA_PROF_MAX_PENDING 8192
#define CUDA_PROF_MAX_OPS 32

struct cuda_prof {
	int on;
	int n_pending;
	const char *pending_name[CUDA_PROF_MAX_PENDING];
	cudaEvent_t ev[CUDA_PROF_MAX_PENDING + 1];	/* ev[i], ev[i + 1] bracket op i */
	const char *name[CUDA_PROF_MAX_OPS];
	double ms[CUDA_PROF_MAX_OPS];
	long calls[CUDA_PROF_MAX_OPS];
	int n_ops;
	long syncs;
	int max_M;		/* widest linear since the last sync: > 64 is prefill, dropped */
};

struct backend_cuda {
	struct backend base;
	const struct model *m;
	int dev;
	cudaStream_t stream;
	int err;			/* first failure of an op since the last sync, -errno */

	void *arena;			/* every weight, one allocation */
	size_t arena_bytes;
	struct cuda_ptr_map map;	/* model_tensor.data / router_bias / experts -> device */
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
	struct k_cuda_mla_post_args mla_post;	/* mla_prep's mla_post work, left
						 * for attn_mla's absorb launch while
						 * mla_post_pending */
	int mla_post_pending;
	struct k_cuda_qkv_args qkv_post;	/* qkv_prep's qkv_post work (a decode
						 * step), left for attn_gqa's launch
						 * while qkv_post_pending */
	int qkv_post_pending;
	int capturing;
	struct cuda_prof *prof;		/* NULL unless KDEC_CUDA_OP_TIMES=1 */
};

static inline struct backend_cuda *cuda_of(struct backend *be)
{
	return (struct backend_cuda *)be;
}

/* Records a CUDA failure (call, file, line) once; returns -EIO, or 0 on success. */
int cuda_check(struct backend_cuda *b, cudaError_t e, const char *call, const char *file, int line);
#define CUDA_CHECK(b, call) cuda_check((b), (call), #call, __FILE__, __LINE__)

/* An op's launcher result: the first failure sticks until sync. */
void cuda_note(struct backend_cuda *b, int ret, const char *op);
/* The op about to be queued: launches the work earlier ops left pending that this op
 * does not take (cuda_pending_flush), and marks its start for KDEC_CUDA_OP_TIMES. */
void cuda_prof_mark(struct backend_cuda *b, const char *op);
/* Launches whatever is pending: mla_prep's mla_post work and qkv_prep's qkv_post
 * work. Before anything that reads or writes device memory outside the ops (uploads,
 * downloads, syncs, graph capture and launch). */
void cuda_pending_flush(struct backend_cuda *b);
/* The device copy of a weight; a missing one is a bug in the upload walk. */
const void *cuda_dev_of(struct backend_cuda *b, const void *host, const char *what);
#define W(b, t) ((const uint16_t *)cuda_dev_of((b), (t)->data, __func__))
#define V(b, t) ((const float *)cuda_dev_of((b), (t)->data, __func__))

/* Fused ops (backend_cuda_fused.c): the scratch for max_M rows, and the ops. */
int cuda_fused_reserve(struct backend_cuda *b, int max_M);
void cuda_qkv_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_qkv *p);
void cuda_mla_post(struct backend *be, float *q, float *kv_a, const struct model_layer *L,
		   const struct backend_mla *p);
void cuda_mla_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_mla *p);
/* Launches the mla_post work mla_prep left pending, if any (an op other than attn_mla
 * is about to be queued after it). Failures are recorded, not timed as an op. */
void cuda_mla_post_flush(struct backend_cuda *b);
/* Records a failure of work launched for an op that is not the one being timed. */
void cuda_note_untimed(struct backend_cuda *b, int ret, const char *what);
/* The same for the qkv_post work qkv_prep left pending (an op other than attn_gqa). */
void cuda_qkv_post_flush(struct backend_cuda *b);
void cuda_gate_up_silu(struct backend *be, float *out, const float *x,
		       const struct model_tensor *w_gate, const struct model_tensor *w_up, int M);

int cuda_ptr_map_put(struct cuda_ptr_map *m, const void *key, void *val);
void *cuda_ptr_map_get(const struct cuda_ptr_map *m, const void *key);
void cuda_ptr_map_fini(struct cuda_ptr_map *m);

/* Copies every weight of b->m into one device arena (matrices as bf16, vectors as
 * fp32) with a progress line; fills b->map. 0 or -errno with one line in err. */
int cuda_weights_upload(struct backend_cuda *b, char *err, size_t err_len);

#endif
