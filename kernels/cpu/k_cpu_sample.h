/* The CPU sampler: the reference for the sampling procedure of kernels/k_sample.h,
 * and the sampler of the CPU backend. */
#ifndef KD_KERNELS_CPU_K_CPU_SAMPLE_H
#define KD_KERNELS_CPU_K_CPU_SAMPLE_H

#include <stdint.h>

#include "kernels/k_sample.h"

/* Floats of scratch k_cpu_sample needs for a vocabulary of vocab tokens. */
#define K_CPU_SAMPLE_WORK(vocab) (2 * (size_t)(vocab))

/* The token drawn from logits (vocab) by params p at output index step.
 * work: K_CPU_SAMPLE_WORK(vocab) floats of caller scratch (malloc'd or otherwise
 * untyped memory: ids and probabilities share it). NaN logits never win. */
int32_t k_cpu_sample(const float *logits, int vocab, const struct k_sample_params *p,
		     uint64_t step, float *work);

#endif
