/* CPU paged KV cache writes and causal GQA attention over the block tables.
 * Softmax is fp32 with max subtraction, done online in chunks so any ctx fits. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cpu/k_cpu_dot.h"

/* Scores held at once; a whole chunk shares one max, so for ctx up to this the
 * softmax is exactly the two-pass textbook form. */
#define ATT_CHUNK	256

void k_cpu_kv_write(float *cache /* (n_blocks * block_tokens, width) */, int width,
		    const float *src /* (n_rows, width) */, int n_rows,
		    const int32_t *slots /* (n_rows) */)
{
	for (int r = 0; r < n_rows; r++)
		memcpy(cache + (size_t)slots[r] * width, src + (size_t)r * width,
		       sizeof(float) * (size_t)width);
}

struct att_job {
	float *out;			/* (n_rows, n_heads, head_dim) */
	const float *q;			/* (n_rows, n_heads, head_dim) */
	const struct k_kv_layer *kv;
	const struct k_attn_rows *rows;
	int n_heads, group, head_dim;	/* group: q heads per kv head */
	float scale;
};

/* Float offset of token t's row in one layer's cache. */
static size_t att_slot_off(const struct k_kv_layer *kv, const int32_t *blocks, int t)
{
	size_t slot = (size_t)blocks[t / kv->block_tokens] * kv->block_tokens +
		      (size_t)(t % kv->block_tokens);

	return slot * (size_t)kv->width;
}

/* Online-softmax state of one (row, head): acc holds sum_t exp(s_t - max) v_t. */
struct att_state {
	float max;
	float sum;
	float *acc;	/* (head_dim) */
};

/* Folds the scores sc (n) of tokens [t0, t0 + n) into st. */
static void att_fold_chunk(const struct att_job *job, struct att_state *st, float *sc,
			   int n, const int32_t *blocks, int t0, size_t v_off)
{
	float cmax = sc[0];
	int hd = job->head_dim;

	for (int j = 1; j < n; j++)
		cmax = sc[j] > cmax ? sc[j] : cmax;
	if (cmax > st->max) {
		/* On the first chunk sum and acc are 0, so alpha's value is moot. */
		float alpha = st->sum > 0 ? expf(st->max - cmax) : 0.0f;

		for (int i = 0; i < hd; i++)
			st->acc[i] *= alpha;
		st->sum *= alpha;
		st->max = cmax;
	}
	for (int j = 0; j < n; j++) {
		const float *v = job->kv->v + att_slot_off(job->kv, blocks, t0 + j) + v_off;
		float p = expf(sc[j] - st->max);

		st->sum += p;
		for (int i = 0; i < hd; i++)
			st->acc[i] += p * v[i];
	}
}

static void att_task(void *arg, int task)
{
	const struct att_job *job = arg;
	int r = task / job->n_heads, h = task % job->n_heads;
	int ctx = job->rows->ctx[r], hd = job->head_dim;
	const int32_t *blocks = job->rows->blocks[r];
	size_t head_off = ((size_t)r * job->n_heads + h) * hd;
	size_t kv_off = (size_t)(h / job->group) * hd;	/* kv head within a token row */
	const float *q = job->q + head_off;
	struct att_state st = { .max = -INFINITY, .sum = 0.0f, .acc = job->out + head_off };
	float sc[ATT_CHUNK];

	memset(st.acc, 0, sizeof(float) * (size_t)hd);
	for (int t0 = 0; t0 < ctx; t0 += ATT_CHUNK) {
		int n = ctx - t0 < ATT_CHUNK ? ctx - t0 : ATT_CHUNK;

		for (int j = 0; j < n; j++) {
			const float *k = job->kv->k + att_slot_off(job->kv, blocks, t0 + j) + kv_off;

			sc[j] = k_dot_f32(q, k, hd) * job->scale;
		}
		att_fold_chunk(job, &st, sc, n, blocks, t0, kv_off);
	}
	if (st.sum > 0)
		for (int i = 0; i < hd; i++)
			st.acc[i] /= st.sum;
}

void k_cpu_attn_gqa(struct k_pool *pool, float *out /* (n_rows, n_heads, head_dim) */,
		    const float *q /* (n_rows, n_heads, head_dim) */,
		    const struct k_kv_layer *kv, const struct k_attn_rows *rows,
		    int n_heads, int kv_heads, int head_dim, float scale)
{
	struct att_job job = {
		.out = out, .q = q, .kv = kv, .rows = rows, .n_heads = n_heads,
		.group = n_heads / kv_heads, .head_dim = head_dim, .scale = scale,
	};

	k_pool_run(pool, att_task, &job, rows->n_rows * n_heads);
}
