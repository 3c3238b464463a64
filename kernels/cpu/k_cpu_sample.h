/* The CPU sampler: the reference for the sampling procedure of kernels/k_sample.h,
 * and the sampler of the CPU backend. */
#ifndef KD_KERNELS_CPU_K_CPU_SAMPLE_H
#define KD_KERNELS_CPU_K_CPU_SAMPLE_H

#include <stdint.h>

#include "kernels/k_sample.h"

/* Floats of scratch k_cpu_sample needs for a vocabulary of vocab tokens. */
#define K_CPU_SAMPLE_WORK(vocab) (4 * (size_t)(vocab))

/* The k best ids of logits (vocab) by the procedure's order (higher logit, then the
 * lower id; NaNs passed over) into ids, unordered; how many (fewer than k when fewer
 * are not NaN). */
int k_cpu_sample_top_k(const float *logits, int vocab, int k, int32_t *ids);

/* The token drawn from logits (vocab) by params p at output index step.
 * work: K_CPU_SAMPLE_WORK(vocab) floats of caller scratch (malloc'd or otherwise
 * untyped memory: ids and probabilities share it). NaN logits never win. */
int32_t k_cpu_sample(const float *logits, int vocab, const struct k_sample_params *p,
		     uint64_t step, float *work);

/* k_cpu_sample with the whole procedure: penalties over h (NULL: no history, so no
 * penalty applies), and with lp non-NULL and p->logprobs set, the log-probabilities
 * of the chosen token and of p->top_logprobs alternatives into *lp (untouched
 * otherwise). work as above; logits are not modified. */
int32_t k_cpu_sample_hist(const float *logits, int vocab, const struct k_sample_params *p,
			  const struct k_sample_hist *h, uint64_t step, float *work,
			  struct k_sample_logprobs *lp);

#endif
