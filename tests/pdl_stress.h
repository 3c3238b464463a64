/* test_cuda_pdl's device side (tests/pdl_stress.cu): a producer that lets the next
 * kernel launch at once and writes only after spinning for `cycles`, and a checker of
 * the consumer's output against that replay's values. Each returns 0 or -1 (launch
 * failed). */
#ifndef KD_TESTS_PDL_STRESS_H
#define KD_TESTS_PDL_STRESS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#define PDL_STRESS_MERGE	0	/* a: part_o, b: part_lse; n: heads * dim per row */
#define PDL_STRESS_LOGITS	1	/* a: logits (rows, n) */

#ifdef __cplusplus
extern "C" {
#endif

int pdl_stress_produce(cudaStream_t s, int mode, float *a, float *b, int n_splits, int rows,
		       int n, const unsigned *gen, long long cycles);
/* errors[0] += mismatches; then *gen += 1 (the next replay's values). */
int pdl_stress_check(cudaStream_t s, int mode, const float *out, const int32_t *ids,
		     int n_splits, int rows, int n, unsigned *gen, unsigned long long *errors);
/* The positive control: dst = src read before the grid-dependency wait, PDL launch. */
int pdl_stress_early_copy(cudaStream_t s, float *dst, const float *src, size_t n);

#ifdef __cplusplus
}
#endif

#endif
