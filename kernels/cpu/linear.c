/* CPU linear layer y = x @ w^T with weights widened from their stored type.
 * Every output is one fixed-order dot product, so results are batch invariant. */
#include <string.h>

#include "kernels/cpu/k_cpu.h"

/* Output columns per task: the weight slice (LIN_NB rows) stays in cache while
 * every input row passes over it. */
#define LIN_NB		16
/* Input rows that share one widened weight block. */
#define LIN_MT		8
/* K elements widened at a time; a multiple of LIN_LANES so that lane j always
 * accumulates the k with k % LIN_LANES == j, whatever the blocking. */
#define LIN_KB		256
/* Independent partial sums per dot product: enough for the compiler to keep
 * several vector accumulators busy, and more accurate than one running sum. */
#define LIN_LANES	16

struct lin_job {
	float *y;		/* (M, N) */
	const float *x;		/* (M, K) */
	const void *w;		/* (N, K) as stored */
	enum k_dtype dtype;
	int M, N, K;
};

/* IEEE half to float without branches on the exponent, so the block loop can be
 * vectorised; exact for every input, subnormals included. */
static inline float f16_to_f32_fast(uint16_t h)
{
	uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
	uint32_t exp = o & 0x0f800000u;
	uint32_t sub_bits;
	float f, sub;

	o += (uint32_t)(127 - 15) << 23;
	o += exp == 0x0f800000u ? (uint32_t)(128 - 16) << 23 : 0;	/* Inf, NaN */
	sub_bits = o + (1u << 23);
	memcpy(&sub, &sub_bits, sizeof(sub));
	sub -= 6.103515625e-05f;		/* 2^-14: renormalises a subnormal exactly */
	memcpy(&f, &o, sizeof(f));
	f = exp == 0 ? sub : f;
	memcpy(&o, &f, sizeof(o));
	o |= (uint32_t)(h & 0x8000u) << 16;
	memcpy(&f, &o, sizeof(f));
	return f;
}

/* Widens rows [0, nb) x columns [k0, k0 + kb) of a (.., K) weight slice into
 * wbuf (LIN_NB, LIN_KB). One loop per type keeps the switch out of the inner loop. */
static void lin_widen(float *wbuf, const void *w, enum k_dtype dtype, int K,
		      int nb, int k0, int kb)
{
	for (int n = 0; n < nb; n++) {
		float *dst = wbuf + n * LIN_KB;
		size_t off = (size_t)n * K + k0;

		if (dtype == K_F32) {
			memcpy(dst, (const float *)w + off, (size_t)kb * sizeof(float));
		} else if (dtype == K_BF16) {
			const uint16_t *src = (const uint16_t *)w + off;

			for (int k = 0; k < kb; k++) {
				uint32_t u = (uint32_t)src[k] << 16;

				memcpy(&dst[k], &u, sizeof(u));
			}
		} else {
			const uint16_t *src = (const uint16_t *)w + off;

			for (int k = 0; k < kb; k++)
				dst[k] = f16_to_f32_fast(src[k]);
		}
	}
}

/* acc[k % LIN_LANES] += x[k] * w[k] in increasing k. */
static void lin_dot_acc(float *restrict acc /* (LIN_LANES) */, const float *restrict x,
			const float *restrict w, int kb)
{
	int kv = kb - kb % LIN_LANES;
	int k;

	for (k = 0; k < kv; k += LIN_LANES)
		for (int j = 0; j < LIN_LANES; j++)
			acc[j] += x[k + j] * w[k + j];
	for (; k < kb; k++)
		acc[k - kv] += x[k] * w[k];
}

/* Pairwise combination of the lanes, always in the same tree. */
static float lin_reduce(const float *acc /* (LIN_LANES) */)
{
	float t[LIN_LANES];

	memcpy(t, acc, sizeof(t));
	for (int w = LIN_LANES / 2; w > 0; w /= 2)
		for (int j = 0; j < w; j++)
			t[j] = t[j] + t[j + w];
	return t[0];
}

/* Rows [m0, m0 + mt) against output columns [n0, n0 + nb). */
static void lin_tile(const struct lin_job *job, int m0, int mt, int n0, int nb)
{
	float acc[LIN_MT][LIN_NB][LIN_LANES];
	float wbuf[LIN_NB * LIN_KB];
	const char *w = (const char *)job->w + (size_t)n0 * job->K * k_dtype_size(job->dtype);
	int K = job->K;

	memset(acc, 0, sizeof(acc));
	for (int k0 = 0; k0 < K; k0 += LIN_KB) {
		int kb = K - k0 < LIN_KB ? K - k0 : LIN_KB;

		lin_widen(wbuf, w, job->dtype, K, nb, k0, kb);
		for (int m = 0; m < mt; m++) {
			const float *xr = job->x + (size_t)(m0 + m) * K + k0;

			for (int n = 0; n < nb; n++)
				lin_dot_acc(acc[m][n], xr, wbuf + n * LIN_KB, kb);
		}
	}
	for (int m = 0; m < mt; m++)
		for (int n = 0; n < nb; n++)
			job->y[(size_t)(m0 + m) * job->N + n0 + n] = lin_reduce(acc[m][n]);
}

static void lin_task(void *arg, int task)
{
	const struct lin_job *job = arg;
	int n0 = task * LIN_NB;
	int nb = job->N - n0 < LIN_NB ? job->N - n0 : LIN_NB;

	for (int m0 = 0; m0 < job->M; m0 += LIN_MT) {
		int mt = job->M - m0 < LIN_MT ? job->M - m0 : LIN_MT;

		lin_tile(job, m0, mt, n0, nb);
	}
}

void k_cpu_linear(struct k_pool *pool, float *y /* (M, N) */, const float *x /* (M, K) */,
		  const void *w /* (N, K) */, enum k_dtype dtype, int M, int N, int K)
{
	struct lin_job job = {
		.y = y, .x = x, .w = w, .dtype = dtype, .M = M, .N = N, .K = K,
	};

	if (M <= 0 || N <= 0)
		return;
	k_pool_run(pool, lin_task, &job, (N + LIN_NB - 1) / LIN_NB);
}
