/* The fixtures of the attention's fused inputs, for their tests and the benchmark:
 * qkv_post over the rows of a fused q/k/v projection, qkv_post folded into the GQA
 * decode attention (k_cuda_attn_gqa_qkv), and mla_post folded into MLA's absorb
 * (k_cuda_attn_mla_post) beside the two launches it replaces. Include after
 * tests/attntest.h. */
#ifndef KD_TESTS_ATTNFOLD_H
#define KD_TESTS_ATTNFOLD_H

#include <errno.h>

#include "kernels/cuda/ops/k_cuda_ops.h"
#include "tests/attntest.h"

/* qkv_post's arguments for rows of the fused projection src (rows, (H + 2 KV) * D:
 * q, k, v side by side); norm (2 D: q's weights, then k's) or NULL, eps 1e-6, rope over
 * rope_dim dims (interleaved il) at pos with the inverse frequencies fr. */
static inline struct k_cuda_qkv_args packed_qkv_args(const float *src, int rows, int H, int KV,
						     int D, const float *norm, const float *fr,
						     int rope_dim, int il, const int32_t *pos,
						     const int32_t *slots, float *q,
						     uint16_t *k_cache, uint16_t *v_cache)
{
	const long rs = (long)(H + 2 * KV) * D;

	return (struct k_cuda_qkv_args){
		.q = q, .q_src = src, .k_src = src + (size_t)H * D,
		.v_src = src + (size_t)(H + KV) * D, .q_rs = rs, .k_rs = rs, .v_rs = rs,
		.rows = rows, .n_heads = H, .kv_heads = KV, .head_dim = D, .q_norm = norm,
		.k_norm = norm ? norm + D : NULL, .eps = 1e-6f, .inv_freq = fr,
		.rope_dim = rope_dim, .interleaved = il, .attn_factor = 1.0f, .pos = pos,
		.k_cache = k_cache, .v_cache = v_cache, .slots = slots,
	};
}

/* ---- qkv_post on its own --------------------------------------------------- */

/* k_cuda_qkv_post over random rows into rows + 5 cache slots; one row (the middle one
 * where rows > 1) writes none (slot -1). */
struct qkv_run {
	struct k_cuda_qkv_args a;
	size_t nq, ncache;	/* floats of q, values of each cache */
	float *d_src, *d_w, *d_fr, *d_q;
	int32_t *d_pos, *d_slots;
	uint16_t *d_k, *d_v;
};

/* Random inputs on the device; 0, or -1 after a failed check (qkv_teardown either way). */
static inline int qkv_setup(struct qkv_run *q, int rows, int H, int KV, int D, int rope_dim,
			    int qk_norm, int il)
{
	/* slots r * stride + 3 (mod n_slots) are distinct only for a stride prime to
	 * n_slots: two rows on one slot would leave it to whichever kernel writes last */
	const int nk = KV * D, n_slots = rows + 5, stride = n_slots % 7 ? 7 : n_slots % 11 ? 11 : 13;
	const size_t nsrc = (size_t)rows * (H + 2 * KV) * D;
	float *src = test_rand_floats(nsrc, 2.0f, &attn_seed);
	float *w = test_rand_floats(2 * (size_t)D, 1.0f, &attn_seed);
	float *fr = test_rand_floats((size_t)rope_dim / 2 + 1, 1.0f, &attn_seed);
	int32_t *pos = malloc(sizeof(int32_t) * rows), *slots = malloc(sizeof(int32_t) * rows);

	for (int i = 0; i <= rope_dim / 2; i++)
		fr[i] = fabsf(fr[i]);
	for (int r = 0; r < rows; r++) {
		pos[r] = test_rand_int(0, 32767, &attn_seed);
		slots[r] = r == rows / 2 && rows > 1 ? -1 : (r * stride + 3) % n_slots;
	}
	memset(q, 0, sizeof(*q));
	q->d_src = dup_to_device(src, sizeof(float) * nsrc);
	q->d_w = dup_to_device(w, sizeof(float) * 2 * D);
	q->d_fr = dup_to_device(fr, sizeof(float) * (rope_dim / 2 + 1));
	q->d_pos = dup_to_device(pos, sizeof(int32_t) * rows);
	q->d_slots = dup_to_device(slots, sizeof(int32_t) * rows);
	q->nq = (size_t)rows * H * D;
	q->ncache = (size_t)n_slots * nk;
	q->d_q = dalloc(sizeof(float) * q->nq);
	q->d_k = dalloc(sizeof(uint16_t) * q->ncache);
	q->d_v = dalloc(sizeof(uint16_t) * q->ncache);
	q->a = packed_qkv_args(q->d_src, rows, H, KV, D, qk_norm ? q->d_w : NULL, q->d_fr,
			       rope_dim, il, q->d_pos, q->d_slots, q->d_q, q->d_k, q->d_v);
	free(src), free(w), free(fr), free(pos), free(slots);
	return q->d_src && q->d_w && q->d_fr && q->d_pos && q->d_slots && q->d_q && q->d_k &&
	       q->d_v ? 0 : -1;
}

static inline void qkv_teardown(struct qkv_run *q)
{
	cudaFree(q->d_src), cudaFree(q->d_w), cudaFree(q->d_fr), cudaFree(q->d_pos);
	cudaFree(q->d_slots), cudaFree(q->d_q), cudaFree(q->d_k), cudaFree(q->d_v);
}

static inline int qkv_call(void *p, cudaStream_t s)
{
	return k_cuda_qkv_post(s, &((struct qkv_run *)p)->a);
}

static inline void qkv_poison(struct qkv_run *q)
{
	poison(q->a.q, sizeof(float) * q->nq);
	poison(q->a.k_cache, sizeof(uint16_t) * q->ncache);
	poison(q->a.v_cache, sizeof(uint16_t) * q->ncache);
}

/* q, then the k and v caches, on the host as bytes (malloc'd, caller frees). */
static inline unsigned char *qkv_result(struct qkv_run *q)
{
	size_t bq = sizeof(float) * q->nq, bc = sizeof(uint16_t) * q->ncache;
	unsigned char *h = malloc(bq + 2 * bc);

	CU(cudaMemcpy(h, q->a.q, bq, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bq, q->a.k_cache, bc, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bq + bc, q->a.v_cache, bc, cudaMemcpyDeviceToHost));
	return h;
}

/* ---- qkv_post folded into the decode attention ------------------------------- */

/* Decode rows (each its own sequence, the new token at ctx - 1) with their raw q/k/v
 * rows of a fused projection, through k_cuda_attn_gqa_qkv. Rope at Llama's base, norm
 * weights around 1; one row writes no K/V (slot -1) where rows > 2. */
struct qkv_fold {
	struct rows *r;
	struct k_cuda_attn_ws *ws;
	struct k_cuda_qkv_args a;
	struct cache k, v;
	float *d_out;		/* (rows, H, D) fp32 */
	uint16_t *d_outb;	/* (rows, H, D) bf16 */
	float scale;
	size_t n_out;
	int32_t *slots;		/* host (rows): each row's cache slot */
	float *d_src, *d_w, *d_fr, *d_q;
	int32_t *d_pos, *d_slots;
};

/* Takes r (qkv_fold_teardown frees it). 0, or -1 after a failed check. */
static inline int qkv_fold_setup(struct qkv_fold *f, struct gqa_shape sh, int rope_dim,
				 int qk_norm, int il, int bt, struct rows *r)
{
	const int H = sh.h, KV = sh.kv, D = sh.hd, R = r->n_rows, width = KV * D;
	const size_t nsrc = (size_t)R * (H + 2 * KV) * D;
	float *src, *w, *fr;
	int32_t *pos;

	memset(f, 0, sizeof(*f));
	f->r = r;
	f->scale = 1.0f / sqrtf((float)D);
	f->n_out = (size_t)R * H * D;
	if (rows_tables(r, bt, r->max_ctx) || cache_new(&f->k, r, width) ||
	    cache_new(&f->v, r, width) || k_cuda_attn_ws_create(&f->ws, R, H, D, r->max_ctx)) {
		CHECK(0, "qkv fold setup");
		return -1;
	}
	src = test_rand_floats(nsrc, 2.0f, &attn_seed);
	w = test_rand_floats(2 * (size_t)D, 1.0f, &attn_seed);
	fr = malloc(sizeof(float) * (rope_dim / 2 + 1));
	pos = malloc(sizeof(int32_t) * R);
	f->slots = malloc(sizeof(int32_t) * R);
	for (int i = 0; i <= rope_dim / 2; i++)	/* Llama's base; long positions below */
		fr[i] = powf(500000.0f, -2.0f * (float)i / (float)(rope_dim ? rope_dim : 1));
	for (int i = 0; i < 2 * D; i++)
		w[i] += 1.0f;
	for (int i = 0; i < R; i++) {
		const int t = r->ctx[i] - 1;

		pos[i] = t;
		f->slots[i] = r->tab[r->seq[i]][t / bt] * bt + t % bt;
	}
	if (R > 2)
		f->slots[R / 2] = -1;
	f->d_src = dup_to_device(src, sizeof(float) * nsrc);
	f->d_w = dup_to_device(w, sizeof(float) * 2 * D);
	f->d_fr = dup_to_device(fr, sizeof(float) * (rope_dim / 2 + 1));
	f->d_pos = dup_to_device(pos, sizeof(int32_t) * R);
	f->d_slots = dup_to_device(f->slots, sizeof(int32_t) * R);
	f->d_q = dalloc(sizeof(float) * f->n_out);
	f->d_out = dalloc(sizeof(float) * f->n_out);
	f->d_outb = dalloc(sizeof(uint16_t) * f->n_out);
	f->a = packed_qkv_args(f->d_src, R, H, KV, D, qk_norm ? f->d_w : NULL, f->d_fr, rope_dim,
			       il, f->d_pos, f->d_slots, f->d_q, f->k.d, f->v.d);
	free(src), free(w), free(fr), free(pos);
	return f->d_src && f->d_w && f->d_fr && f->d_pos && f->d_slots && f->d_q && f->d_out &&
	       f->d_outb ? 0 : -1;
}

static inline void qkv_fold_teardown(struct qkv_fold *f)
{
	k_cuda_attn_ws_destroy(f->ws);
	cache_free(&f->k);
	cache_free(&f->v);
	cudaFree(f->d_src), cudaFree(f->d_w), cudaFree(f->d_fr), cudaFree(f->d_pos);
	cudaFree(f->d_slots), cudaFree(f->d_q), cudaFree(f->d_out), cudaFree(f->d_outb);
	free(f->slots);
	rows_free(f->r);
}

static inline int qkv_fold_call(void *p, cudaStream_t s)
{
	struct qkv_fold *f = p;
	struct k_cuda_attn_rows gr = rows_gpu(f->r, 0);
	int ret = k_cuda_attn_gqa_qkv(s, f->ws, f->d_out, f->d_outb, &f->a, f->r->bt, &gr,
				      f->scale);

	return ret < 0 ? ret : ret == 1 ? 0 : -EPROTO;	/* decode rows: bf16 written */
}

/* Caches back to their random contents, the rows this step writes poisoned. */
static inline void qkv_fold_reset(struct qkv_fold *f)
{
	const size_t w = (size_t)f->a.kv_heads * f->a.head_dim;

	CU(cudaMemcpy(f->k.d, f->k.h, sizeof(uint16_t) * f->k.n, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(f->v.d, f->v.h, sizeof(uint16_t) * f->v.n, cudaMemcpyHostToDevice));
	for (int i = 0; i < f->r->n_rows; i++)
		if (f->slots[i] >= 0) {
			poison(f->k.d + f->slots[i] * w, sizeof(uint16_t) * w);
			poison(f->v.d + f->slots[i] * w, sizeof(uint16_t) * w);
		}
	poison(f->d_out, sizeof(float) * f->n_out);
	poison(f->d_outb, sizeof(uint16_t) * f->n_out);
}

/* out, out_bf16, k cache, v cache on the host as bytes (malloc'd, caller frees). */
static inline unsigned char *qkv_fold_result(struct qkv_fold *f)
{
	size_t bo = sizeof(float) * f->n_out, bb = sizeof(uint16_t) * f->n_out;
	size_t bc = sizeof(uint16_t) * f->k.n;
	unsigned char *h = malloc(bo + bb + 2 * bc);

	CU(cudaMemcpy(h, f->d_out, bo, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo, f->d_outb, bb, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo + bb, f->k.d, bc, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(h + bo + bb + bc, f->v.d, bc, cudaMemcpyDeviceToHost));
	return h;
}

/* ---- mla_post folded into MLA's absorb ------------------------------------- */

/* k_cuda_attn_mla_post (new) beside k_cuda_mla_post then k_cuda_attn_mla (old) on the
 * same inputs, two copies of one cache. fused: q comes from [q | kv_a] rows (mla_prep's
 * GEMM), the new path's q buffer poisoned (the fold must read the rows, never q). Each
 * row appends its token at ctx - 1, which the attention then reads. */
struct mla_fold {
	struct mla_run m;	/* dims, rows, the old path's cache and q, w, out */
	uint16_t *d_cache2;	/* the new path's cache */
	float *d_q2, *d_out2;	/* its q (poisoned, fused) and out */
	float *d_src;		/* (rows, src_rs): [q | kv_a] (fused) or kv_a alone */
	float *d_inv;
	int32_t *d_pos, *d_slots;
	struct k_cuda_mla_post_args a_old, a_new;
};

static inline int mla_fold_old(void *p, cudaStream_t s)
{
	struct mla_fold *f = p;
	int ret = k_cuda_mla_post(s, &f->a_old);

	return ret ? ret : mla_call(&f->m, s);
}

static inline int mla_fold_new(void *p, cudaStream_t s)
{
	struct mla_fold *f = p;
	struct k_cuda_attn_rows gr = rows_gpu(f->m.r, f->m.hint);

	return k_cuda_attn_mla_post(s, f->m.ws, f->d_out2, &f->a_new, f->m.d_w, f->d_cache2,
				    f->m.r->bt, &gr, &f->m.d, f->m.scale);
}

/* The new path's buffers and both argument sets, after mla_setup of f->m. */
static inline int mla_fold_args(struct mla_fold *f, int rot_dim, int interleaved, int fused)
{
	const struct k_mla_dims *d = &f->m.d;
	const struct rows *r = f->m.r;
	const int R = r->n_rows, H = d->n_heads, qk = d->nope_dim + d->rope_dim;
	const int width = d->kv_lora + d->rope_dim;
	/* rows padded (interleaved cases): the absorb's q loads then one at a time */
	const long src_rs = (fused ? (long)H * qk : 0) + width + (interleaved ? 3 : 0);
	size_t nsrc = (size_t)R * src_rs, nq = (size_t)R * H * qk;
	float *src = test_rand_floats(nsrc, 1.0f, &attn_seed), inv[512];
	int32_t pos[64], slots[64];

	for (int i = 0; i < rot_dim / 2; i++)
		inv[i] = powf(10000.0f, -2.0f * (float)i / (float)rot_dim);
	for (int i = 0; i < R; i++) {	/* the row's token: ctx - 1, in its table */
		pos[i] = r->ctx[i] - 1;
		slots[i] = r->row_tab[i][pos[i] / r->bt] * r->bt + pos[i] % r->bt;
	}
	f->d_src = dup_to_device(src, sizeof(float) * nsrc);
	f->d_inv = dup_to_device(inv, sizeof(float) * (size_t)(rot_dim / 2 + 1));
	f->d_pos = dup_to_device(pos, sizeof(int32_t) * (size_t)R);
	f->d_slots = dup_to_device(slots, sizeof(int32_t) * (size_t)R);
	f->d_cache2 = dup_to_device(f->m.c.h, sizeof(uint16_t) * f->m.c.n);
	f->d_q2 = dup_to_device(f->m.q, sizeof(float) * nq);	/* lora: q in place, both */
	f->d_out2 = dalloc(sizeof(float) * (size_t)R * H * d->v_dim);
	free(src);
	if (!f->d_src || !f->d_inv || !f->d_pos || !f->d_slots || !f->d_cache2 || !f->d_q2 ||
	    !f->d_out2)
		return -1;
	if (fused)	/* the fold must not read q: NaN there shows in out */
		poison(f->d_q2, sizeof(float) * nq);
	f->a_old = (struct k_cuda_mla_post_args){
		.q_pe = f->m.d_q + d->nope_dim, .q_rs = (long)H * qk, .q_hs = qk,
		.q_src_pe = fused ? f->d_src + d->nope_dim : NULL, .q_src_rs = src_rs,
		.nope_dim = d->nope_dim, .n_heads = H,
		.kv = f->d_src + (fused ? (long)H * qk : 0), .kv_rs = src_rs, .rows = R,
		.kv_lora = d->kv_lora, .pe_dim = d->rope_dim,
		.norm = f->d_src,	/* any (kv_lora) fp32 values serve as the norm weight */
		.eps = 1e-6f, .inv_freq = f->d_inv, .rot_dim = rot_dim,
		.interleaved = interleaved, .attn_factor = rot_dim % 4 ? 1.0f : 1.125f,
		.pos = f->d_pos, .cache = f->m.c.d, .slots = f->d_slots,
	};
	f->a_new = f->a_old;
	f->a_new.q_pe = f->d_q2 + d->nope_dim;
	f->a_new.cache = f->d_cache2;
	return 0;
}

/* MLA dims d over rows r (16-token blocks; taken, freed by mla_fold_teardown), rope
 * over rot_dim of d's rope dims. 0, or -1 (a failed check; teardown either way). */
static inline int mla_fold_setup(struct mla_fold *f, struct k_mla_dims d, struct rows *r,
				 int rot_dim, int interleaved, int fused)
{
	memset(f, 0, sizeof(*f));
	if (mla_setup(&f->m, d, 16, r, 0, 0) || mla_fold_args(f, rot_dim, interleaved, fused)) {
		CHECK(0, "mla fold setup");
		return -1;
	}
	return 0;
}

static inline void mla_fold_teardown(struct mla_fold *f)
{
	cudaFree(f->d_cache2);
	cudaFree(f->d_q2);
	cudaFree(f->d_out2);
	cudaFree(f->d_src);
	cudaFree(f->d_inv);
	cudaFree(f->d_pos);
	cudaFree(f->d_slots);
	mla_teardown(&f->m);
}

#endif
