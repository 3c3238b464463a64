/* CPU linear layer y = x @ w^T with weights widened from their stored type, or
 * dequantized per use from fp8/int4 (kernels/quant.h) block by block.
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
/* Multiply-adds below which a task is not worth handing to another thread: waking
 * and joining workers costs microseconds, so small layers (a tiny model's, or any
 * layer at M = 1 with small K) run their column blocks in fewer, larger tasks. */
#define LIN_MIN_TASK_MACS	(1 << 13)
/* Independent partial sums per dot product: enough for the compiler to keep
 * several vector accumulators busy, and more accurate than one running sum. */
#define LIN_LANES	16

struct lin_job {
	float *y;		/* (M, N) */
	const float *x;		/* (M, K) */
	const void *w;		/* (N, K) as stored */
	enum k_dtype dtype;
	const struct k_quant *q;	/* NULL: w is stored in dtype */
	int M, N, K;
	int blocks_per_task;	/* column blocks of LIN_NB per task */
};

/* The widened weight block; integer stores let the bf16/f16 widening vectorise. */
union lin_wbuf {
	float f[LIN_NB * LIN_KB];
	uint32_t u[LIN_NB * LIN_KB];
};

/* IEEE half to float bits without branches, so it vectorises. The magnitude
 * bits moved to float position and scaled by 2^(127-15) are exact for normal and
 * subnormal halves alike; Inf and NaN then get the all-ones exponent. */
static inline uint32_t lin_f16_bits(uint32_t h)
{
	uint32_t o = (h & 0x7fffu) << 13;
	uint32_t inf = 0u - (uint32_t)((h & 0x7c00u) == 0x7c00u);
	float f;

	memcpy(&f, &o, sizeof(f));
	f *= 0x1p112f;
	memcpy(&o, &f, sizeof(o));
	return o | (inf & 0x7f800000u) | ((h & 0x8000u) << 16);
}

/* Fixed-size chunks of LIN_LANES so that -O2's cheap vectoriser takes them. */
static void lin_widen_bf16(uint32_t *restrict dst, const uint16_t *restrict src, int kb)
{
	int kv = kb - kb % LIN_LANES, k;

	for (k = 0; k < kv; k += LIN_LANES)
		for (int j = 0; j < LIN_LANES; j++)
			dst[k + j] = (uint32_t)src[k + j] << 16;
	for (; k < kb; k++)
		dst[k] = (uint32_t)src[k] << 16;
}

static void lin_widen_f16(uint32_t *restrict dst, const uint16_t *restrict src, int kb)
{
	int kv = kb - kb % LIN_LANES, k;

	for (k = 0; k < kv; k += LIN_LANES)
		for (int j = 0; j < LIN_LANES; j++)
			dst[k + j] = lin_f16_bits(src[k + j]);
	for (; k < kb; k++)
		dst[k] = lin_f16_bits(src[k]);
}

/* Widens rows [0, nb) x columns [k0, k0 + kb) of a (.., K) 16-bit weight slice
 * into wbuf (LIN_NB, LIN_KB). */
static void lin_widen(union lin_wbuf *wbuf, const uint16_t *w, enum k_dtype dtype, int K,
		      int nb, int k0, int kb)
{
	for (int n = 0; n < nb; n++) {
		uint32_t *dst = wbuf->u + n * LIN_KB;
		const uint16_t *src = w + (size_t)n * K + k0;

		if (dtype == K_BF16)
			lin_widen_bf16(dst, src, kb);
		else
			lin_widen_f16(dst, src, kb);
	}
}

/* acc[k % LIN_LANES] += x[k] * w[k] in increasing k, for two weight rows at once
 * (one x load feeds both); each row's sums are exactly those of a lone dot. */
static void lin_dot2_acc(float *restrict acc0, float *restrict acc1, const float *restrict x,
			 const float *restrict w0, const float *restrict w1, int kb)
{
	float a0[LIN_LANES], a1[LIN_LANES];
	int kv = kb - kb % LIN_LANES;
	int k;

	memcpy(a0, acc0, sizeof(a0));
	memcpy(a1, acc1, sizeof(a1));
	for (k = 0; k < kv; k += LIN_LANES) {
		for (int j = 0; j < LIN_LANES; j++) {
			a0[j] += x[k + j] * w0[k + j];
			a1[j] += x[k + j] * w1[k + j];
		}
	}
	for (; k < kb; k++) {
		a0[k - kv] += x[k] * w0[k];
		a1[k - kv] += x[k] * w1[k];
	}
	memcpy(acc0, a0, sizeof(a0));
	memcpy(acc1, a1, sizeof(a1));
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
	float acc[LIN_MT][LIN_NB + 1][LIN_LANES];	/* +1: scratch for an odd nb */
	union lin_wbuf wbuf;
	const char *w = job->q ? NULL : (const char *)job->w + (size_t)n0 * job->K * k_dtype_size(job->dtype);
	int K = job->K;

	memset(acc, 0, sizeof(acc));
	for (int k0 = 0; k0 < K; k0 += LIN_KB) {
		int kb = K - k0 < LIN_KB ? K - k0 : LIN_KB;
		const float *wr[LIN_NB + 1] = { 0 };

		/* fp32 weights are read in place; the others are widened once per block,
		 * quantized ones dequantized (value * scale in fp32) into the same block */
		if (job->q)
			for (int n = 0; n < nb; n++)
				k_quant_row_to_f32(wbuf.f + n * LIN_KB, job->w, job->q, K, n0 + n, k0, kb);
		else if (job->dtype != K_F32)
			lin_widen(&wbuf, (const uint16_t *)w, job->dtype, K, nb, k0, kb);
		for (int n = 0; n < nb; n++)
			wr[n] = job->dtype == K_F32 && !job->q ? (const float *)w + (size_t)n * K + k0
								: wbuf.f + n * LIN_KB;
		wr[nb] = wr[nb - 1];	/* an odd nb pairs its last row with itself */
		for (int m = 0; m < mt; m++) {
			const float *xr = job->x + (size_t)(m0 + m) * K + k0;

			for (int n = 0; n < nb; n += 2)
				lin_dot2_acc(acc[m][n], acc[m][n + 1], xr, wr[n], wr[n + 1], kb);
		}
	}
	for (int m = 0; m < mt; m++)
		for (int n = 0; n < nb; n++)
			job->y[(size_t)(m0 + m) * job->N + n0 + n] = lin_reduce(acc[m][n]);
}

/* Column blocks [task * blocks_per_task, ...) against every input row. The split only
 * decides who computes a column, never how, so results do not depend on it. */
static void lin_task(void *arg, int task)
{
	const struct lin_job *job = arg;
	int n_end = (task + 1) * job->blocks_per_task * LIN_NB;

	if (n_end > job->N)
		n_end = job->N;
	for (int n0 = task * job->blocks_per_task * LIN_NB; n0 < n_end; n0 += LIN_NB) {
		int nb = job->N - n0 < LIN_NB ? job->N - n0 : LIN_NB;

		for (int m0 = 0; m0 < job->M; m0 += LIN_MT) {
			int mt = job->M - m0 < LIN_MT ? job->M - m0 : LIN_MT;

			lin_tile(job, m0, mt, n0, nb);
		}
	}
}

void k_cpu_linear(struct k_pool *pool, float *y /* (M, N) */, const float *x /* (M, K) */,
		  const void *w /* (N, K) */, enum k_dtype dtype, int M, int N, int K)
{
	k_cpu_linear_q(pool, y, x, w, dtype, NULL, M, N, K);
}

void k_cpu_linear_q(struct k_pool *pool, float *y /* (M, N) */, const float *x /* (M, K) */,
		    const void *w /* (N, K) */, enum k_dtype dtype, const struct k_quant *q,
		    int M, int N, int K)
{
	struct lin_job job = {
		.y = y, .x = x, .w = w, .dtype = dtype, .q = q && q->fmt != K_Q_NONE ? q : NULL,
		.M = M, .N = N, .K = K,
	};
	int64_t block_macs = (int64_t)M * K * LIN_NB;
	int n_blocks = (N + LIN_NB - 1) / LIN_NB;

	if (M <= 0 || N <= 0)
		return;
	job.blocks_per_task = block_macs >= LIN_MIN_TASK_MACS ? 1
			      : (int)((LIN_MIN_TASK_MACS + block_macs - 1) / (block_macs > 0 ? block_macs : 1));
	if (job.blocks_per_task > n_blocks)
		job.blocks_per_task = n_blocks;
	k_pool_run(pool, lin_task, &job, (n_blocks + job.blocks_per_task - 1) / job.blocks_per_task);
}
