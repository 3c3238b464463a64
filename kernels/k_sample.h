/* Sampling parameters and the one random number each sampled token uses, shared by
 * the CPU sampler and the GPU one so that both draw the same token for the same
 * (seed, step). Plain C; the functions also compile as CUDA device code. */
#ifndef KD_KERNELS_K_SAMPLE_H
#define KD_KERNELS_K_SAMPLE_H

#include <stdint.h>

#ifdef __CUDACC__
#define K_SAMPLE_FN __host__ __device__ static inline
#else
#define K_SAMPLE_FN static inline
#endif

/* How one request picks its next token. The procedure, identical on every backend:
 *   1. temperature <= 0: greedy, the highest logit (ties: the lower token id).
 *   2. candidates: the top_k highest logits (top_k <= 0: all), ordered by logit
 *      descending, ties by the lower id; z = logit / temperature (a division).
 *   3. p = softmax(z) over the candidates (fp32, max subtracted).
 *   4. top_p in (0, 1): keep the shortest prefix of the ordered candidates whose
 *      probabilities sum to >= top_p (at least one token).
 *   5. u = k_sample_uniform(seed, step); the token is the first kept candidate at
 *      which the running sum of p reaches u * (sum of kept p). */
struct k_sample_params {
	float temperature;	/* <= 0: greedy */
	int top_k;		/* <= 0: off */
	float top_p;		/* <= 0 or >= 1: off */
	uint64_t seed;
};

/* splitmix64's finaliser over seed and step: a counter-based generator, so a token's
 * draw depends only on its request's seed and its index in the output (step 0 is the
 * first generated token), never on batch order. Returns u in [0, 1) with 24 bits. */
K_SAMPLE_FN float k_sample_uniform(uint64_t seed, uint64_t step)
{
	uint64_t x = seed + (step + 1) * 0x9E3779B97F4A7C15ull;

	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	x ^= x >> 31;
	return (float)(x >> 40) * (1.0f / 16777216.0f);
}

#endif
