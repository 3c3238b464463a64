/* The routing trace: each MoE layer's expert choice for every token, recorded on one
 * engine and forced on another. It makes a GPU/reference difference decidable: the
 * reference (CPU) engine run with the GPU's choices shows whether a row that left
 * tolerance did so because the router picked other experts (a flip) or because a
 * kernel is wrong. Decisions are keyed by (sequence, layer, position); a sequence is
 * known by its first KV block, numbered in the order the trace first sees it. While a
 * trace is attached the engine runs op by op (no graph replays): each MoE layer's
 * router logits and ids are copied to the host after the router. */
#ifndef KD_DAEMON_ROUTE_TRACE_H
#define KD_DAEMON_ROUTE_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "daemon/backend/backend.h"

struct route_trace {
	int n_layers, n_experts, top_k, max_seqs, max_pos;
	int pos_base;		/* the first position recorded (0 unless a caller sets it):
				 * keys hold positions pos_base .. pos_base + max_pos - 1 */
	int32_t *seq_block;	/* (max_seqs) first KV block of each sequence seen */
	int n_seqs;
	/* by key: ids (top_k) the experts the step used (forced ones where forced), own
	 * (top_k) this engine's own choice, logits (n_experts) its router logits */
	int32_t *ids;
	int32_t *own;
	float *logits;
	uint8_t *have;		/* 1 where recorded */
	/* choices to force instead, by key (route_trace_force_from / _read) */
	int32_t *force;
	uint8_t *have_force;
	long n_forced;		/* decisions replaced by forced ones */
	long n_differ;		/* ... of which the own choice was another set of experts */
};

/* A trace for up to max_seqs sequences of up to max_pos tokens of a model with
 * n_layers layers, n_experts experts, top_k per token. 0 or -ENOMEM / -EINVAL. */
int route_trace_create(struct route_trace **out, int n_layers, int n_experts, int top_k,
		       int max_seqs, int max_pos);
void route_trace_destroy(struct route_trace *t);	/* accepts NULL */
/* Forgets what was recorded (choices, sequences, counts); keeps the forced choices. */
void route_trace_clear(struct route_trace *t);

/* The key's index, or -1 out of range. */
long route_trace_index(const struct route_trace *t, int seq, int layer, int pos);

/* How many distinct experts layer's recorded decisions used (0: none recorded). */
int route_trace_experts(const struct route_trace *t, int layer);

/* Forces the choices src's steps used on the next runs: every decision src has. */
int route_trace_force_from(struct route_trace *t, const struct route_trace *src);

/* The hook of the forward pass, after a MoE layer's router: rows R of the step whose
 * host-side positions are pos and first blocks first_block; logits (R, E), ids and w
 * (R, top_k) in backend memory. Records the own choice; where a forced one exists and
 * differs, replaces ids and w by it (weights from this engine's own router logits,
 * k_cpu_moe_route_forced); records what is used. 0 or -errno with one line in err. */
int route_trace_layer(struct route_trace *t, struct backend *be,
		      const struct k_moe_route_params *p, int layer, int R, const int32_t *pos,
		      const int32_t *first_block, const float *logits, int32_t *ids, float *w,
		      char *err, size_t err_len);

/* The file: a header line "kdec-routing 1 layers L experts E top_k K", then one line per
 * recorded decision "seq layer pos id... margin": the experts used, and the margin
 * (k_cpu_moe_route_margin) of this engine's router logits there. p gives the routing for the margins (its bias is per layer:
 * bias_of(layer) or NULL). 0 or -errno. */
int route_trace_write(const struct route_trace *t, FILE *f,
		      const struct k_moe_route_params *p,
		      const float *(*bias_of)(void *arg, int layer), void *arg);
/* Reads such a file into t's forced choices (t's sizes must match the header; every
 * line is checked). 0 or -EINVAL with the line number and the problem in err. */
int route_trace_read_force(struct route_trace *t, FILE *f, char *err, size_t err_len);

#endif
