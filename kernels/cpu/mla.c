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

/* ---- decode context parallel (docs/PARALLEL.md "MLA decode context parallel") -- */

int k_cpu_mla_absorb(float *qa, size_t qa_row_stride, const float *q, const void *w_kv_b,
		      enum k_dtype dtype, int n_rows, const struct k_mla_dims *d)
{
	struct mla_job job = { .w = w_kv_b, .dtype = dtype, .d = d };
	int qk = d->nope_dim + d->rope_dim, width = d->kv_lora + d->rope_dim;
	struct mla_scratch s;
	void *mem = mla_scratch_alloc(&s, d->kv_lora);

	if (!mem)
		return -ENOMEM;
	for (int r = 0; r < n_rows; r++)
		for (int h = 0; h < d->n_heads; h++) {
			const float *qh = q + ((size_t)r * d->n_heads + h) * qk;
			float *dst = qa + (size_t)r * qa_row_stride + (size_t)h * width;

			mla_absorb_q(&job, &s, h, qh);	/* the rounding k_cpu_attn_mla does */
			memcpy(dst, s.q_abs, sizeof(float) * (size_t)d->kv_lora);
			memcpy(dst + d->kv_lora, qh + d->nope_dim, sizeof(float) * (size_t)d->rope_dim);
		}
	free(mem);
	return 0;
}

/* One (row, head)'s online softmax over the part's tokens (the chunks of mla_attend,
 * over the tokens this part holds): o (kv_lora) = sum_t exp(s_t - max) c_t, not
 * normalised, and ml = (max, sum); (-inf, 0) and o = 0 where the part holds none. */
static void mla_attend_part(float *o, float *ml, const float *qa, const struct k_kv_layer *kv,
			    const int32_t *blocks, int ctx, int kv_lora, int rope_dim, float scale,
			    int part, int n_parts, float *sc, size_t *off)
{
	float max = -INFINITY, sum = 0.0f;
	int t = 0;

	memset(o, 0, sizeof(float) * (size_t)kv_lora);
	while (t < ctx) {
		float cmax = -INFINITY;
		int n = 0;

		for (; t < ctx && n < MLA_CHUNK; t++) {	/* the chunk's tokens of this part */
			size_t slot = (size_t)blocks[t / kv->block_tokens] * kv->block_tokens +
				      (size_t)(t % kv->block_tokens);
			const float *c;

			if ((int)(slot % (size_t)n_parts) != part)
				continue;
			off[n] = slot / (size_t)n_parts * (size_t)kv->width;	/* its local row */
			c = kv->k + off[n];
			sc[n] = (k_dot_f32(qa, c, kv_lora) + k_dot_f32(qa + kv_lora, c + kv_lora, rope_dim)) *
				scale;
			cmax = sc[n] > cmax ? sc[n] : cmax;
			n++;
		}
		if (!n)
			continue;
		if (cmax > max) {
			float alpha = sum > 0 ? expf(max - cmax) : 0.0f;

			for (int c = 0; c < kv_lora; c++)
				o[c] *= alpha;
			sum *= alpha;
			max = cmax;
		}
		for (int j = 0; j < n; j++) {
			const float *c = kv->k + off[j];
			float p = expf(sc[j] - max);

			sum += p;
			for (int i = 0; i < kv_lora; i++)
				o[i] += p * c[i];
		}
	}
	ml[0] = max;
	ml[1] = sum;
}

struct mla_part_job {
	float *o, *ml;
	const float *qa;
	const struct k_kv_layer *kv;
	const struct k_attn_rows *rows;
	int n_heads, kv_lora, rope_dim, part, n_parts;
	float scale;
	atomic_int err;
};

static void mla_part_task(void *arg, int task)
{
	struct mla_part_job *j = arg;
	int r = task / j->n_heads, h = task % j->n_heads;
	size_t rh = (size_t)r * j->n_heads + h;
	float *sc = malloc(MLA_CHUNK * (sizeof(float) + sizeof(size_t)));

	if (!sc) {
		atomic_store(&j->err, -ENOMEM);
		return;
	}
	mla_attend_part(j->o + rh * j->kv_lora, j->ml + rh * 2,
			j->qa + rh * (size_t)(j->kv_lora + j->rope_dim), j->kv, j->rows->blocks[r],
			j->rows->ctx[r], j->kv_lora, j->rope_dim, j->scale, j->part, j->n_parts, sc,
			(size_t *)(sc + MLA_CHUNK));
	free(sc);
}

int k_cpu_attn_mla_part(struct k_pool *pool, float *o, float *ml, const float *qa,
			const struct k_kv_layer *kv, const struct k_attn_rows *rows, int n_heads,
			int kv_lora, int rope_dim, float scale, int part, int n_parts)
{
	struct mla_part_job job = {
		.o = o, .ml = ml, .qa = qa, .kv = kv, .rows = rows, .n_heads = n_heads,
		.kv_lora = kv_lora, .rope_dim = rope_dim, .part = part, .n_parts = n_parts,
		.scale = scale,
	};

	if (n_parts < 1 || part < 0 || part >= n_parts)
		return -EINVAL;
	atomic_init(&job.err, 0);
	k_pool_run(pool, mla_part_task, &job, rows->n_rows * n_heads);
	return atomic_load(&job.err);
}

int k_cpu_mla_merge_expand(float *out, const float *const *o, const float *const *ml, int n_parts,
			   int n_rows, int n_heads_all, int h0, const void *w_kv_b, enum k_dtype dtype,
			   const struct k_mla_dims *d)
{
	struct mla_job job = { .w = w_kv_b, .dtype = dtype, .d = d };
	struct mla_scratch s;
	void *mem = mla_scratch_alloc(&s, d->kv_lora);
	int L = d->kv_lora;

	if (!mem)
		return -ENOMEM;
	for (int r = 0; r < n_rows; r++)
		for (int h = 0; h < d->n_heads; h++) {
			size_t rh = (size_t)r * n_heads_all + (size_t)(h0 + h);
			float max = -INFINITY;
			double den = 0.0;

			for (int p = 0; p < n_parts; p++)	/* parts holding none: (-inf, 0) */
				if (ml[p][rh * 2 + 1] > 0 && ml[p][rh * 2] > max)
					max = ml[p][rh * 2];
			for (int c = 0; c < L; c++)
				s.dacc[c] = 0.0;
			/* the exact log-sum-exp combine: every part rescaled to the common max,
			 * numerators and denominators summed in part order, divided once */
			for (int p = 0; p < n_parts; p++) {
				double w;

				if (!(ml[p][rh * 2 + 1] > 0))
					continue;
				w = exp((double)ml[p][rh * 2] - (double)max);
				den += w * ml[p][rh * 2 + 1];
				for (int c = 0; c < L; c++)
					s.dacc[c] += w * o[p][rh * L + c];
			}
			for (int c = 0; c < L; c++)
				s.o_lat[c] = den > 0 ? (float)(s.dacc[c] / den) : 0.0f;
			mla_expand_out(&job, &s, h, out + ((size_t)r * d->n_heads + h) * d->v_dim);
		}
	free(mem);
	return 0;
}
