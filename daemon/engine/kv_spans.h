/* Where one KV block's bytes live: in each rank's cache (tensor parallel: every rank
 * holds its KV heads, or, MLA decode context parallel, its share of the block's
 * tokens), a plane per layer and K/V. The host tier's frames hold a block's bytes as
 * one run, each rank's planes in turn; a rank whose cache holds the same bytes as an
 * earlier rank's (KV heads replicated when fewer than ranks, an MLA latent replicated
 * on every rank) is stored once and restored from its twin. At tp 1 a block is one
 * span, laid out as before. */
#ifndef KD_DAEMON_ENGINE_KV_SPANS_H
#define KD_DAEMON_ENGINE_KV_SPANS_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/engine/forward.h"

/* One rank's part of every block. */
struct kv_span {
	struct backend *be;	/* the rank's backend */
	int rank, split;	/* split > 1: the rank holds slots s % split == rank at row s /
				 * split (forward_tp_rank_kv); 1: a block's bt rows */
	int same_as;		/* the span holding the same bytes (itself: stored) */
	int n_planes;		/* (layers x K/V) */
	size_t row;		/* bytes of one token's row in one plane */
	uint8_t **base;		/* (n_planes) each plane's cache, in be's memory */
};

struct kv_spans {
	int n;
	int bt;			/* tokens of a block */
	struct kv_span *s;	/* (n) rank order */
	size_t block_bytes;	/* one block's run: the stored spans' planes */
};

/* The spans of f's KV cache (every rank's, forward_tp_rank_kv): blocks of block_tokens
 * tokens of elem_bytes elements over n_layers layers. 0 or -ENOMEM. */
int kv_spans_build(struct kv_spans *ks, const struct forward *f, int n_layers, int block_tokens,
		   size_t elem_bytes);
void kv_spans_free(struct kv_spans *ks);

/* Block `block`'s bytes to raw (block_bytes; to_device 0) or from it (to_device 1, every
 * span: the twins from their stored bytes). side 0: the ranks' own queues, each synced
 * (the engine thread, between steps); side 1: the backends' side copies (the mover's
 * threads, beside the steps). 0 or -errno. */
int kv_spans_copy(const struct kv_spans *ks, int32_t block, void *raw, int to_device, int side);

#endif
