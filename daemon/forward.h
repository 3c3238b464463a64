/* The standard forward pass: one definition per architecture family (GQA dense,
 * GQA + MoE, MLA + MoE), composed from backend ops, over a paged KV cache. */
#ifndef KD_DAEMON_FORWARD_H
#define KD_DAEMON_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend.h"
#include "daemon/model.h"

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

struct forward {
	const struct model *m;
	struct backend *be;
	int max_rows;			/* rows one forward_run accepts */
	int block_tokens;
	int n_blocks;
	struct k_rope rope;
	struct k_kv_layer *kv;		/* (n_layers) caches in backend memory */
	size_t kv_bytes;		/* all layers' cache */

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
	float *logits;			/* (LOGIT_ROWS, vocab) */
};

/* Allocates the caches (n_blocks of block_tokens tokens, every layer) and the scratch.
 * Returns 0 or -errno with one line in err (numbers for out-of-memory). */
int forward_create(struct forward **out, const struct model *m, struct backend *be,
		   int n_blocks, int block_tokens, int max_rows, char *err, size_t err_len);
void forward_destroy(struct forward *f);	/* accepts NULL and half-built */

/* Bytes of KV cache one token takes over all layers (fp32 on the CPU backend). */
size_t forward_kv_bytes_per_token(const struct model *m);

/* Runs the batch and writes logits (n_out, vocab) to host memory. 0 or -errno. */
int forward_run(struct forward *f, const struct fwd_batch *b, float *logits);

#endif
