/* A rank's shard of a loaded model for tensor parallel (docs/PARALLEL.md): the heads,
 * intermediate columns and vocabulary rows rank r of n owns, copied into the shard's own
 * memory, with a config that says the rank's sizes. Every forward op runs on a shard as
 * on a whole model; the ranks' partial sums are reduced by the caller. */
#ifndef KD_DAEMON_MODEL_SHARD_H
#define KD_DAEMON_MODEL_SHARD_H

#include <stddef.h>

#include "daemon/model/model.h"

#define MODEL_SHARD_MAX_RANKS 64

/* Whether n ranks can split cfg's shapes, the routed experts sliced (ep 0: tensor-
 * parallel experts) or whole, a share of them per rank (ep 1: expert parallel): 0, or
 * -EINVAL with one line in err naming the numbers ("tp 3 does not divide 8 query
 * heads of llama"). Quantized weights must also split at their scale blocks:
 * model_shard_create refuses a split that cuts one, in one line. */
int model_shard_check(const struct model_config *cfg, int n, int ep, char *err, size_t err_len);

/* The vocabulary rows [*first, *first + *count) rank r of n holds (uneven splits
 * allowed: the first ranks get one row more). */
void model_shard_vocab(int vocab, int r, int n, int *first, int *count);

/* The routed experts [*first, *first + *count) rank r of n holds whole with ep. */
void model_shard_experts(int n_experts, int r, int n, int *first, int *count);

/* Rank r's shard of m (which it does not reference after). With ep, its share of the
 * routed experts whole (their ids renumbered from 0) and the shared expert on rank 0
 * only. 0 or -errno with err; *out is released with model_destroy. */
int model_shard_create(struct model **out, const struct model *m, int r, int n, int ep, char *err,
		       size_t err_len);

/* Gives back the host pages of shard s's weights once a backend without host memory
 * has copied them at create (cuda: it reads no host weight after, and keeps their
 * addresses only as keys of its pointer map, which stay valid: the pages read as zeros
 * after). So a rank's host copy lives only while its device copy is made, and the
 * load holds one rank's shard at a time. */
void model_shard_drop_host(struct model *s);

#endif
