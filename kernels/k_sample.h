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
 *   0. penalties (only on the host: k_sample_host_only), over the request's history
 *      (struct k_sample_hist), to a copy l of the logits, in this order:
 *      repetition_penalty r (HF): each distinct token of prompt + output, l > 0:
 *      l / r, else l * r; then presence a and frequency f (OpenAI): each token that
 *      occurs c > 0 times in the output, l -= a + f * c. Greedy uses l too.
 *   1. temperature <= 0: greedy, the highest logit (ties: the lower token id).
 *   2. candidates: the top_k highest logits (top_k <= 0: all), ordered by logit
 *      descending, ties by the lower id; z = logit / temperature (a division).
 *   3. p = softmax(z) over the candidates (fp32, max subtracted).
 *   4. top_p in (0, 1): keep the shortest prefix of the ordered candidates whose
 *      probabilities sum to >= top_p (at least one token).
 *   5. min_p in (0, 1]: of those, keep the prefix with p >= min_p * p[0] (p[0] the
 *      highest; at least one token).
 *   6. u = k_sample_uniform(seed, step); the token is the first kept candidate at
 *      which the running sum of p reaches u * (sum of kept p).
 * Logprobs (logprobs != 0, host only) come from the distribution after step 0 and the
 * temperature and before any truncation: log softmax(l / T) over the whole
 * vocabulary (T = 1 when greedy), whatever top_k, top_p and min_p cut. */
struct k_sample_params {
	float temperature;	/* <= 0: greedy */
	int top_k;		/* <= 0: off */
	float top_p;		/* <= 0 or >= 1: off */
	uint64_t seed;
	float min_p;		/* <= 0: off; (0, 1] */
	float repetition_penalty;	/* 0 or 1: off; > 0 */
	float presence_penalty;		/* 0: off; logit units */
	float frequency_penalty;	/* 0: off; logit units per occurrence */
	int logprobs;		/* 0: off; 1: the chosen token's log-probability */
	int top_logprobs;	/* 0..K_SAMPLE_LOGPROBS_MAX alternatives, with logprobs */
};

#define K_SAMPLE_LOGPROBS_MAX 20

/* A request's tokens so far, for the penalties: the prompt and the output. */
struct k_sample_hist {
	const int32_t *prompt;	/* (n_prompt) token ids */
	int n_prompt;
	const int32_t *out;	/* (n_out) generated token ids */
	int n_out;
};

/* Log-probabilities of one sampled token (see the procedure above), natural log. */
struct k_sample_logprobs {
	int32_t token;				/* the chosen token */
	float logprob;				/* its log-probability */
	int n;					/* alternatives filled, <= top_logprobs */
	int32_t ids[K_SAMPLE_LOGPROBS_MAX];	/* (n) most probable first, ties lower id */
	float logprobs[K_SAMPLE_LOGPROBS_MAX];	/* (n) */
};

K_SAMPLE_FN int k_sample_has_penalty(const struct k_sample_params *p)
{
	return (p->repetition_penalty > 0 && p->repetition_penalty != 1) ||
	       p->presence_penalty != 0 || p->frequency_penalty != 0;
}

/* Whether p uses a step only the host sampler has (penalties, min-p, logprobs): the
 * GPU sampler (kernels/cuda/sample/k_cuda_sample.h) does the rest. */
K_SAMPLE_FN int k_sample_host_only(const struct k_sample_params *p)
{
	return k_sample_has_penalty(p) || (p->min_p > 0 && p->temperature > 0) || p->logprobs;
}

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
