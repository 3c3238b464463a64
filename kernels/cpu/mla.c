/* CPU multi-head latent attention (DeepSeek-V2/V3) over a latent paged cache:
 * the absorbed form used for inference and the expanded textbook form for tests. */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cpu/k_cpu_dot.h"

/* Scores held at once by the absorbed form's online softmax. */
#define MLA_CHUNK	256

/* Widens one stored row of n elements; one loop per type. */
static void mla_widen(float *dst, const void *src, enum k_dtype dtype, size_t row, int n)
{
	size_t off = row * (size_t)n;

	if (dtype == K_F32) {
		memcpy(dst, (const float *)src + off, sizeof(float) * (size_t)n);
	} else if (dtype == K_BF16) {
		for (int i = 0; i < n; i++)
			dst[i] = k_bf16_to_f32(((const uint16_t *)src)[off + i]);
	} else {
		for (int i = 0; i < n; i++)
			dst[i] = k_f16_to_f32(((const uint16_t *)src)[off + i]);
	}
}

/* Float offset of token t's latent row. */
static size_t mla_slot_off(const struct k_kv_layer *kv, const int32_t *blocks, int t)
{
	size_t slot = (size_t)blocks[t / kv->block_tokens] * kv->block_tokens +
		      (size_t)(t % kv->block_tokens);

	return slot * (size_t)kv->width;
}

struct mla_job {
	float *out;			/* (n_rows, n_heads, v_dim) */
	const float *q;			/* (n_rows, n_heads, nope_dim + rope_dim) */
	const void *w;			/* (n_heads * (nope_dim + v_dim), kv_lora) as stored */
	enum k_dtype dtype;
	const struct k_kv_layer *kv;
	const struct k_attn_rows *rows;
	const struct k_mla_dims *d;
	float scale;
	atomic_int err;			/* first failure of any task */
};

/* Per-task scratch, one allocation. */
struct mla_scratch {
	double *dacc;	/* (kv_lora) double accumulator for the absorptions */
	float *q_abs;	/* (kv_lora) W_UK^T q_nope */
	float *o_lat;	/* (kv_lora) running sum_t exp(s_t - max) c_t */
	float *wrow;	/* (kv_lora) one widened weight row */
	float *sc;	/* (MLA_CHUNK) scores */
};

static void *mla_scratch_alloc(struct mla_scratch *s, int kv_lora)
{
	size_t n = (size_t)kv_lora;
	char *p = malloc(n * sizeof(double) + (3 * n + MLA_CHUNK) * sizeof(float));

	if (!p)
		return NULL;
	s->dacc = (double *)p;
	s->q_abs = (float *)(p + n * sizeof(double));
	s->o_lat = s->q_abs + n;
	s->wrow = s->o_lat + n;
	s->sc = s->wrow + n;
	return p;
}

/* q_abs = W_UK_h^T q_nope: sum over the nope rows in double, rounded once. */
static void mla_absorb_q(const struct mla_job *job, struct mla_scratch *s, int h,
			 const float *q_nope /* (nope_dim) */)
{
	const struct k_mla_dims *d = job->d;
	size_t row0 = (size_t)h * (d->nope_dim + d->v_dim);

	for (int c = 0; c < d->kv_lora; c++)
		s->dacc[c] = 0.0;
	for (int i = 0; i < d->nope_dim; i++) {
		double qi = q_nope[i];

		mla_widen(s->wrow, job->w, job->dtype, row0 + i, d->kv_lora);
		for (int c = 0; c < d->kv_lora; c++)
			s->dacc[c] += qi * s->wrow[c];
	}
	for (int c = 0; c < d->kv_lora; c++)
		s->q_abs[c] = (float)s->dacc[c];
}

/* Online softmax over the latents; leaves o_lat = sum_t p_t c_t (normalised). */
static void mla_attend(const struct mla_job *job, struct mla_scratch *s, int r,
		       const float *q_pe /* (rope_dim) */)
{
	const struct k_mla_dims *d = job->d;
	const int32_t *blocks = job->rows->blocks[r];
	int ctx = job->rows->ctx[r], L = d->kv_lora;
	float max = -INFINITY, sum = 0.0f;

	memset(s->o_lat, 0, sizeof(float) * (size_t)L);
	for (int t0 = 0; t0 < ctx; t0 += MLA_CHUNK) {
		int n = ctx - t0 < MLA_CHUNK ? ctx - t0 : MLA_CHUNK;
		float cmax = -INFINITY;

		for (int j = 0; j < n; j++) {
			const float *c = job->kv->k + mla_slot_off(job->kv, blocks, t0 + j);
			float dot = k_dot_f32(s->q_abs, c, L) + k_dot_f32(q_pe, c + L, d->rope_dim);

			s->sc[j] = dot * job->scale;
			cmax = s->sc[j] > cmax ? s->sc[j] : cmax;
		}
		if (cmax > max) {
			float alpha = sum > 0 ? expf(max - cmax) : 0.0f;

			for (int c = 0; c < L; c++)
				s->o_lat[c] *= alpha;
			sum *= alpha;
			max = cmax;
		}
		for (int j = 0; j < n; j++) {
			const float *c = job->kv->k + mla_slot_off(job->kv, blocks, t0 + j);
			float p = expf(s->sc[j] - max);

			sum += p;
			for (int i = 0; i < L; i++)
				s->o_lat[i] += p * c[i];
		}
	}
	if (sum > 0)
		for (int c = 0; c < L; c++)
			s->o_lat[c] /= sum;
}

/* out_h = W_UV_h o_lat, each output a double sum rounded once. */
static void mla_expand_out(const struct mla_job *job, struct mla_scratch *s, int h,
			   float *out /* (v_dim) */)
{
	const struct k_mla_dims *d = job->d;
	size_t row0 = (size_t)h * (d->nope_dim + d->v_dim) + d->nope_dim;

	for (int j = 0; j < d->v_dim; j++) {
		double acc = 0.0;

		mla_widen(s->wrow, job->w, job->dtype, row0 + j, d->kv_lora);
		for (int c = 0; c < d->kv_lora; c++)
			acc += (double)s->wrow[c] * s->o_lat[c];
		out[j] = (float)acc;
	}
}

static void mla_task(void *arg, int task)
{
	struct mla_job *job = arg;
	const struct k_mla_dims *d = job->d;
	int r = task / d->n_heads, h = task % d->n_heads;
	const float *q = job->q + ((size_t)r * d->n_heads + h) * (d->nope_dim + d->rope_dim);
	float *out = job->out + ((size_t)r * d->n_heads + h) * d->v_dim;
	struct mla_scratch s;
	void *mem = mla_scratch_alloc(&s, d->kv_lora);

	if (!mem) {
		atomic_store(&job->err, -ENOMEM);
		return;
	}
	mla_absorb_q(job, &s, h, q);
	mla_attend(job, &s, r, q + d->nope_dim);
	mla_expand_out(job, &s, h, out);
	free(mem);
}

int k_cpu_attn_mla(struct k_pool *pool, float *out /* (n_rows, n_heads, v_dim) */,
		   const float *q /* (n_rows, n_heads, nope_dim + rope_dim) */,
		   const void *w_kv_b /* (n_heads * (nope_dim + v_dim), kv_lora) */,
		   enum k_dtype dtype, const struct k_kv_layer *kv,
		   const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale)
{
	struct mla_job job = {
		.out = out, .q = q, .w = w_kv_b, .dtype = dtype, .kv = kv, .rows = rows,
		.d = d, .scale = scale,
	};

	atomic_init(&job.err, 0);
	k_pool_run(pool, mla_task, &job, rows->n_rows * d->n_heads);
	return atomic_load(&job.err);
}

/* ---- expanded reference -------------------------------------------------- */

/* One head's expanded K row [W_UK c ; kpe] (nope + rope) and V row W_UV c (v_dim),
 * each a plain fp32 sum as HF's kv_b_proj linear would give. */
static void mla_expand_token(const float *wh /* (nope + v, kv_lora) */, const float *lat,
			     const struct k_mla_dims *d, float *k, float *v)
{
	for (int i = 0; i < d->nope_dim + d->v_dim; i++) {
		float acc = 0.0f;

		for (int c = 0; c < d->kv_lora; c++)
			acc += wh[(size_t)i * d->kv_lora + c] * lat[c];
		if (i < d->nope_dim)
			k[i] = acc;
		else
			v[i - d->nope_dim] = acc;
	}
	memcpy(k + d->nope_dim, lat + d->kv_lora, sizeof(float) * (size_t)d->rope_dim);
}

/* Two-pass softmax attention of one (row, head) with everything expanded. */
static void mla_expanded_head(float *out /* (v_dim) */, const float *q /* (qk) */,
			      const float *wh, const struct k_kv_layer *kv,
			      const int32_t *blocks, int ctx, const struct k_mla_dims *d,
			      float scale, float *sc /* (ctx) */, float *k, float *v)
{
	int qk = d->nope_dim + d->rope_dim;
	float max = -INFINITY, sum = 0.0f;

	for (int t = 0; t < ctx; t++) {
		float dot = 0.0f;

		mla_expand_token(wh, kv->k + mla_slot_off(kv, blocks, t), d, k, v);
		for (int i = 0; i < qk; i++)
			dot += q[i] * k[i];
		sc[t] = dot * scale;
		max = sc[t] > max ? sc[t] : max;
	}
	for (int t = 0; t < ctx; t++) {
		sc[t] = expf(sc[t] - max);
		sum += sc[t];
	}
	memset(out, 0, sizeof(float) * (size_t)d->v_dim);
	for (int t = 0; t < ctx; t++) {
		float p = sc[t] / sum;

		mla_expand_token(wh, kv->k + mla_slot_off(kv, blocks, t), d, k, v);
		for (int j = 0; j < d->v_dim; j++)
			out[j] += p * v[j];
	}
}

int k_cpu_attn_mla_expanded(float *out /* (n_rows, n_heads, v_dim) */,
			    const float *q /* (n_rows, n_heads, nope_dim + rope_dim) */,
			    const void *w_kv_b /* (n_heads * (nope_dim + v_dim), kv_lora) */,
			    enum k_dtype dtype, const struct k_kv_layer *kv,
			    const struct k_attn_rows *rows, const struct k_mla_dims *d,
			    float scale)
{
	size_t per_head = (size_t)(d->nope_dim + d->v_dim) * d->kv_lora;
	int qk = d->nope_dim + d->rope_dim, max_ctx = 1;
	float *wh, *sc, *k, *v;

	for (int r = 0; r < rows->n_rows; r++)
		max_ctx = rows->ctx[r] > max_ctx ? rows->ctx[r] : max_ctx;
	wh = malloc(sizeof(float) * (per_head + (size_t)max_ctx + qk + d->v_dim));
	if (!wh)
		return -ENOMEM;
	sc = wh + per_head;
	k = sc + max_ctx;
	v = k + qk;

	for (int h = 0; h < d->n_heads; h++) {
		for (size_t i = 0; i < (size_t)(d->nope_dim + d->v_dim); i++)
			mla_widen(wh + i * d->kv_lora, w_kv_b, dtype,
				  (size_t)h * (d->nope_dim + d->v_dim) + i, d->kv_lora);
		for (int r = 0; r < rows->n_rows; r++) {
			size_t rh = (size_t)r * d->n_heads + h;

			mla_expanded_head(out + rh * d->v_dim, q + rh * qk, wh, kv,
					  rows->blocks[r], rows->ctx[r], d, scale, sc, k, v);
		}
	}
	free(wh);
	return 0;
}
