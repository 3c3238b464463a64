/* The CUDA backend's fused ops. The weight walk places q/k/v and gate/up of a layer one
 * after another in the arena, so each group is one (rows, K) matrix: one GEMM reads it
 * where three or two did, and one kernel does what came after them (norm, rope, cache
 * append; SiLU-and-multiply). Where a group is not adjacent (odd sizes leave padding)
 * the projections run one by one into the same scratch layout. mla_post is the MLA
 * layer's counterpart of qkv_prep's kernel: latent norm, both ropes and the cache
 * append after the q and kv_a projections. qkv_prep_attn and mla_prep_attn go one
 * further: the projections, then an attention launch that does that kernel's work
 * too. Every op finishes its own work: nothing is left for a later op to take over. */
#include <errno.h>
#include <stdint.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/ops/k_cuda_ops.h"

/* The switches below are the installed k_cuda_tuning's (filled from the KDEC_*
 * environment at backend creation), read at each call as the kernels read theirs. */

int cuda_fused_reserve(struct backend_cuda *b, int max_M)
{
	const struct model_config *c = &b->m->cfg;
	size_t qkv = (size_t)(c->n_heads + 2 * c->n_kv_heads) * (size_t)c->head_dim;
	size_t inter = (size_t)c->intermediate_size, shared;
	size_t width;

	shared = (size_t)c->moe_intermediate_size * (size_t)(c->n_shared_experts > 0 ? c->n_shared_experts : 0);
	if (shared > inter)
		inter = shared;
	width = c->mla ? 2 * inter : (qkv > 2 * inter ? qkv : 2 * inter);
	if (c->mla) {	/* mla_prep's [q | kv_a] rows, or [q_a | kv_a] and q_a normalised */
		size_t qkva = (size_t)c->n_heads * (size_t)(c->qk_nope_head_dim + c->qk_rope_head_dim) +
			      (size_t)(c->kv_lora_rank + c->qk_rope_head_dim);
		size_t lora = 2 * (size_t)c->q_lora_rank + (size_t)(c->kv_lora_rank + c->qk_rope_head_dim);

		if (qkva > width)
			width = qkva;
		if (c->q_lora_rank > 0 && lora > width)
			width = lora;
	}
	b->fused_floats = (size_t)max_M * width;
	if (cudaMalloc((void **)&b->fused, b->fused_floats * sizeof(float)) != cudaSuccess) {
		b->fused = NULL;
		return -ENOMEM;
	}
	b->alloc_bytes += b->fused_floats * sizeof(float);
	return 0;
}

/* 1 when the bf16 matrices w[0..n) lie one after another in the arena, each of K
 * columns (quantized ones, kept so, never count: their scales lie between). */
static int adjacent(const uint16_t *const *d, const struct model_tensor *const *w, int n)
{
	for (int i = 0; i < n; i++)
		if (w[i]->q.fmt != K_Q_NONE)
			return 0;
	for (int i = 1; i < n; i++)
		if (!d[i] || d[i] != d[i - 1] + (size_t)w[i - 1]->rows * (size_t)w[i - 1]->cols ||
		    w[i]->cols != w[0]->cols)
			return 0;
	return d[0] != NULL;
}

/* 1 when w[0..n) stayed quantized as the n parts of one stack, in this order. */
static int quant_stacked(const struct backend_cuda *b, const struct model_tensor *const *w, int n)
{
	const struct cuda_qweight *q0 = cuda_qweight_of(b, w[0]);

	if (!q0 || !q0->group || q0->group_n != n)
		return 0;
	for (int i = 0; i < n; i++) {
		const struct cuda_qweight *qi = cuda_qweight_of(b, w[i]);

		if (!qi || qi->group != q0->group || qi->group_i != i)
			return 0;
	}
	return 1;
}

/* y (M, sum of rows) = x @ [w_0; ...; w_n-1]^T: one GEMM when adjacent. Otherwise each
 * w_i by itself into its own (M, rows_i) block of y; *rs then gets each block's row
 * stride and *off each block's start. */
static int group_linear(struct backend_cuda *b, float *y, const float *x,
			const struct model_tensor *const *w, int n, int M, long *off, long *rs)
{
	const uint16_t *d[3];
	long total = 0;
	int ret = 0;

	for (int i = 0; i < n; i++) {
		d[i] = W(b, w[i]);
		total += (long)w[i]->rows;
	}
	if (adjacent(d, w, n) || quant_stacked(b, w, n)) {
		const struct cuda_qweight *qw = cuda_qweight_of(b, w[0]);

		for (long i = 0, o = 0; i < n; o += (long)w[i]->rows, i++) {
			off[i] = o;
			rs[i] = total;
		}
		if (qw)
			return cuda_qlinear_run(b, y, x, qw->group, M, (int)w[0]->cols, 0);
		return cuda_bf16_linear_run(b, y, x, d[0], M, (int)total, (int)w[0]->cols, 0);
	}
	for (long i = 0, o = 0; i < n && !ret; o += (long)M * (long)w[i]->rows, i++) {
		off[i] = o;
		rs[i] = (long)w[i]->rows;
		ret = cuda_linear_run(b, y + o, x, w[i], M, 0);
	}
	return ret;
}

/* In a decode step qkv_prep_attn does qkv_post's work in the attention launch
 * (k_cuda_attn_gqa_qkv) where the rows take one split: one launch boundary fewer a
 * layer, the new K/V row appended by the block that reads it; elsewhere that launcher
 * launches qkv_post first. KDEC_QKV_IN_ATTN=0: qkv_prep_attn declines, so qkv_prep
 * launches qkv_post and attn_gqa follows. */
static int qkv_in_attn(void)
{
	return k_cuda_tuning()->qkv_in_attn != 0;
}

/* qkv_prep's projections: q/k/v of h (rows, hidden) into b->fused, one GEMM where the
 * three are adjacent, and *a = qkv_post's arguments over them (q out, K/V into the
 * cache). 0, or the failure, then already recorded as op's end. */
static int qkv_project(struct backend_cuda *b, enum cuda_op op, struct k_cuda_qkv_args *a,
		       float *q, const float *h, const struct model_layer *L,
		       const struct backend_qkv *p)
{
	const struct model_tensor *w[3] = { &L->wq, &L->wk, &L->wv };
	long off[3], rs[3];
	int ret;

	if ((size_t)p->rows * (size_t)(L->wq.rows + 2 * L->wk.rows) > b->fused_floats ||
	    p->rope->dim != b->rope_dim) {
		cuda_op_fail(b, op, -EINVAL, "rows past the scratch, or another model's rope");
		return -EINVAL;
	}
	if ((ret = group_linear(b, b->fused, h, w, 3, p->rows, off, rs))) {
		cuda_op_end(b, op, ret);
		return ret;
	}
	*a = (struct k_cuda_qkv_args){
		.q = q, .q_src = b->fused + off[0], .k_src = b->fused + off[1],
		.v_src = b->fused + off[2], .q_rs = rs[0], .k_rs = rs[1], .v_rs = rs[2],
		.rows = p->rows, .n_heads = p->n_heads, .kv_heads = p->kv_heads,
		.head_dim = p->head_dim, .q_norm = p->qk_norm ? V(b, &L->q_norm) : NULL,
		.k_norm = p->qk_norm ? V(b, &L->k_norm) : NULL, .eps = p->eps,
		.inv_freq = b->inv_freq, .rope_dim = p->rope->dim,
		.interleaved = p->rope->interleaved, .attn_factor = p->rope->attn_factor,
		.pos = p->pos, .k_cache = (uint16_t *)p->kv->k, .v_cache = (uint16_t *)p->kv->v,
		.slots = p->slots,
	};
	return 0;
}

void cuda_qkv_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_qkv *p)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_qkv_args a;

	cuda_op_begin(b, CUDA_OP_QKV_PREP);
	if (!qkv_project(b, CUDA_OP_QKV_PREP, &a, q, h, L, p))
		cuda_op_end(b, CUDA_OP_QKV_PREP, k_cuda_qkv_post(b->stream, &a));
}

/* qkv_prep then attn_gqa over its q and the layer's cache, qkv_post's work in the
 * attention launch; declines where KDEC_QKV_IN_ATTN=0 or the attention's rows are not
 * the projections'. */
int cuda_qkv_prep_attn(struct backend *be, float *out, float *q, const float *h,
		       const struct model_layer *L, const struct backend_qkv *p,
		       const struct k_attn_rows *rows, float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_attn_rows r = cuda_attn_rows(rows);
	const int width = p->n_heads * p->head_dim;
	/* the output in bf16 as well, for o_proj next */
	uint16_t *xb = k_cuda_linear_x_scratch(b->lin, rows->n_rows, width);
	struct k_cuda_qkv_args a;
	int ret;

	if (!qkv_in_attn() || rows->n_rows != p->rows)
		return 1;
	cuda_op_begin(b, CUDA_OP_QKV_PREP_ATTN);
	if (qkv_project(b, CUDA_OP_QKV_PREP_ATTN, &a, q, h, L, p))
		return 0;
	/* the attention reads the projections' rows, not x: the bf16 copy of h goes, as
	 * at the start of any op that does not read it */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	ret = k_cuda_attn_gqa_qkv(b->stream, b->attn_ws, out, xb, &a, p->kv->block_tokens, &r,
				  scale);
	cuda_op_end(b, CUDA_OP_QKV_PREP_ATTN, ret < 0 ? ret : 0);
	if (ret == 1)
		k_cuda_linear_x_ready(b->lin, out, rows->n_rows, width);
	return 0;
}

/* KDEC_CUDA_MLA_POST=0: mla_post runs the four kernels of the op-by-op path instead of
 * k_cuda_mla_post (for A/B timing and for bisecting a difference). */
static int mla_post_fused(void)
{
	return k_cuda_tuning()->mla_post_fused != 0;
}

static int mla_post_op_by_op(struct backend_cuda *b, float *q, float *kv_a,
			     const struct model_layer *L, const struct backend_mla *p)
{
	const int R = p->rows, H = p->n_heads, qk = p->nope_dim + p->rope_dim;
	const int width = p->kv_lora + p->rope_dim;
	const struct k_rope *r = p->rope;
	int ret;

	if ((ret = k_cuda_rmsnorm(b->stream, kv_a, width, kv_a, width, V(b, &L->kv_a_norm), R,
				  p->kv_lora, p->eps)) ||
	    (ret = k_cuda_rope(b->stream, b->inv_freq, r->dim, r->interleaved, r->attn_factor,
			       q + p->nope_dim, R, H, H * qk, qk, p->pos)) ||
	    (ret = k_cuda_rope(b->stream, b->inv_freq, r->dim, r->interleaved, r->attn_factor,
			       kv_a + p->kv_lora, R, 1, width, 0, p->pos)))
		return ret;
	return k_cuda_kv_write(b->stream, (uint16_t *)p->kv->k, width, kv_a, width, R, p->slots);
}

/* mla_prep_attn does mla_post's work in the absorb launch (k_cuda_attn_mla_post), one
 * launch boundary fewer a layer: V2-Lite batch 1 2.654 -> 2.554 ms, batch 8 7.727 ->
 * 7.603 (H200, 64e33ca). KDEC_MLA_POST_IN_ABSORB=0: mla_prep_attn declines, so mla_prep
 * launches mla_post's kernel and attn_mla follows. */
static int mla_post_in_absorb(void)
{
	return k_cuda_tuning()->mla_post_in_absorb != 0;
}

/* mla_post's arguments; q_src (NULL: q in place) and kv_a rows q_src_rs and kv_rs apart. */
static void mla_post_args(struct backend_cuda *b, struct k_cuda_mla_post_args *out, float *q,
			  const float *q_src, long q_src_rs, const float *kv_a, long kv_rs,
			  const struct model_layer *L, const struct backend_mla *p)
{
	const int qk = p->nope_dim + p->rope_dim;

	*out = (struct k_cuda_mla_post_args){
		.q_pe = q + p->nope_dim, .q_rs = (long)p->n_heads * qk, .q_hs = qk,
		.q_src_pe = q_src ? q_src + p->nope_dim : NULL, .q_src_rs = q_src_rs,
		.nope_dim = p->nope_dim,
		.n_heads = p->n_heads, .kv = kv_a, .kv_rs = kv_rs,
		.rows = p->rows, .kv_lora = p->kv_lora, .pe_dim = p->rope_dim,
		.norm = V(b, &L->kv_a_norm), .eps = p->eps, .inv_freq = b->inv_freq,
		.rot_dim = p->rope->dim, .interleaved = p->rope->interleaved,
		.attn_factor = p->rope->attn_factor, .pos = p->pos, .cache = (uint16_t *)p->kv->k,
		.slots = p->slots,
	};
}

/* mla_post's kernel, arguments as mla_post_args. */
static int mla_post_kernel(struct backend_cuda *b, float *q, const float *q_src, long q_src_rs,
			   const float *kv_a, long kv_rs, const struct model_layer *L,
			   const struct backend_mla *p)
{
	struct k_cuda_mla_post_args a;

	mla_post_args(b, &a, q, q_src, q_src_rs, kv_a, kv_rs, L, p);
	return k_cuda_mla_post(b->stream, &a);
}

static int mla_rope_ok(struct backend_cuda *b, const struct backend_mla *p)
{
	return p->rope->dim == b->rope_dim && p->rope->dim <= p->rope_dim;
}

void cuda_mla_post(struct backend *be, float *q, float *kv_a, const struct model_layer *L,
		   const struct backend_mla *p)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_MLA_POST);
	if (!mla_rope_ok(b, p)) {
		cuda_op_fail(b, CUDA_OP_MLA_POST, -EINVAL,
			     "another model's rope, or wider than the rope key");
		return;
	}
	if (!mla_post_fused()) {
		cuda_op_end(b, CUDA_OP_MLA_POST, mla_post_op_by_op(b, q, kv_a, L, p));
		return;
	}
	cuda_op_end(b, CUDA_OP_MLA_POST,
		    mla_post_kernel(b, q, NULL, 0, kv_a, p->kv_lora + p->rope_dim, L, p));
}

/* KDEC_CUDA_MLA_PREP=0: mla_prep runs q_b and kv_a as two linears (q straight into q)
 * and mla_post's kernel in place, as the op-by-op forward did. */
static int mla_prep_fused(void)
{
	return k_cuda_tuning()->mla_prep_fused != 0;
}

/* q-LoRA: q = rmsnorm(q_a) @ wq_b^T from the q_a part of the fused rows, through a
 * contiguous scratch after them (its bf16 copy made on the way, for that linear). */
static int mla_prep_lora(struct backend_cuda *b, float *q, const float *q_a, long q_a_rs,
			 const struct model_layer *L, const struct backend_mla *p, float *scratch)
{
	const int R = p->rows, n = (int)L->wq_a.rows;
	uint16_t *xb = k_cuda_linear_x_scratch(b->lin, R, n);
	int ret;

	if (!xb)
		ret = k_cuda_rmsnorm(b->stream, scratch, n, q_a, (int)q_a_rs, V(b, &L->q_a_norm), R, n,
				     p->eps);
	else if (!(ret = k_cuda_rmsnorm_bf16(b->stream, scratch, n, q_a, (int)q_a_rs,
					     V(b, &L->q_a_norm), R, n, p->eps, xb)))
		k_cuda_linear_x_ready(b->lin, scratch, R, n);
	if (ret)
		return ret;
	return cuda_linear_run(b, q, scratch, &L->wq_b, R, 0);
}

/* mla_prep's shapes and scratch: 0, or -EINVAL, then already recorded as op's end. */
static int mla_prep_check(struct backend_cuda *b, enum cuda_op op, const struct model_layer *L,
			  const struct backend_mla *p)
{
	const int lora = L->wq_a.data != NULL;
	const struct model_tensor *w[2] = { lora ? &L->wq_a : &L->wq_b, &L->wkv_a };
	const long qk = p->nope_dim + p->rope_dim, width = p->kv_lora + p->rope_dim;
	const size_t R = (size_t)p->rows, pair = R * (size_t)(w[0]->rows + w[1]->rows);

	if (!mla_rope_ok(b, p) || L->wq_b.rows != (int64_t)p->n_heads * qk ||
	    L->wkv_a.rows != width || w[0]->cols != w[1]->cols ||
	    (lora && L->wq_b.cols != L->wq_a.rows) ||
	    pair + (lora ? R * (size_t)L->wq_a.rows : 0) > b->fused_floats) {
		cuda_op_fail(b, op, -EINVAL, "another model's rope or shapes, or rows past the "
			     "scratch");
		return -EINVAL;
	}
	return 0;
}

/* mla_prep with KDEC_CUDA_MLA_PREP=0 or KDEC_CUDA_MLA_POST=0: the op-by-op order, each
 * projection its own linear (q straight into q), then mla_post's work in place. */
static int mla_prep_op_by_op(struct backend_cuda *b, float *q, const float *h,
			     const struct model_layer *L, const struct backend_mla *p)
{
	const int lora = L->wq_a.data != NULL;
	const struct model_tensor *w[2] = { lora ? &L->wq_a : &L->wq_b, &L->wkv_a };
	const long width = p->kv_lora + p->rope_dim;
	const size_t R = (size_t)p->rows, pair = R * (size_t)(w[0]->rows + w[1]->rows);
	float *q_a = b->fused, *kv_a = b->fused + R * (size_t)w[0]->rows;
	int ret = 0;

	if (lora && !(ret = cuda_linear_run(b, q_a, h, w[0], p->rows, 0)))
		ret = mla_prep_lora(b, q, q_a, (long)w[0]->rows, L, p, b->fused + pair);
	else if (!lora)
		ret = cuda_linear_run(b, q, h, w[0], p->rows, 0);
	if (!ret)
		ret = cuda_linear_run(b, kv_a, h, w[1], p->rows, 0);
	if (!ret)
		ret = mla_post_fused() ? mla_post_kernel(b, q, NULL, 0, kv_a, width, L, p)
				       : mla_post_op_by_op(b, q, kv_a, L, p);
	return ret;
}

/* [q | kv_a] (rows, H * qk + kv_lora + rope) = h @ [wq_b; wkv_a]^T in b->fused, one
 * linear where the arena holds the two adjacent (it places them so): at batch 1 one
 * weight stream of 15 MB where two launches read 12.6 and 2.4. *a = mla_post's
 * arguments over them: its kernel copies q out of the fused rows into q, rotating its
 * rope part, and appends the latent from the same rows. With q-LoRA the pair is
 * [wq_a; wkv_a]: q_a's norm and wq_b follow here, and mla_post rotates q in place.
 * 0, or the failure, then already recorded as op's end. */
static int mla_project(struct backend_cuda *b, enum cuda_op op, struct k_cuda_mla_post_args *a,
		       float *q, const float *h, const struct model_layer *L,
		       const struct backend_mla *p)
{
	const int lora = L->wq_a.data != NULL;
	const struct model_tensor *w[2] = { lora ? &L->wq_a : &L->wq_b, &L->wkv_a };
	const size_t R = (size_t)p->rows, pair = R * (size_t)(w[0]->rows + w[1]->rows);
	long off[2], rs[2];
	int ret;

	if ((ret = group_linear(b, b->fused, h, w, 2, p->rows, off, rs)) ||
	    (lora && (ret = mla_prep_lora(b, q, b->fused + off[0], rs[0], L, p, b->fused + pair)))) {
		cuda_op_end(b, op, ret);
		return ret;
	}
	mla_post_args(b, a, q, lora ? NULL : b->fused + off[0], rs[0], b->fused + off[1], rs[1],
		      L, p);
	return 0;
}

void cuda_mla_prep(struct backend *be, float *q, const float *h, const struct model_layer *L,
		   const struct backend_mla *p)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_mla_post_args a;

	cuda_op_begin(b, CUDA_OP_MLA_PREP);
	if (mla_prep_check(b, CUDA_OP_MLA_PREP, L, p))
		return;
	if (!mla_prep_fused() || !mla_post_fused()) {
		cuda_op_end(b, CUDA_OP_MLA_PREP, mla_prep_op_by_op(b, q, h, L, p));
		return;
	}
	if (!mla_project(b, CUDA_OP_MLA_PREP, &a, q, h, L, p))
		cuda_op_end(b, CUDA_OP_MLA_PREP, k_cuda_mla_post(b->stream, &a));
}

/* mla_prep (fused) then attn_mla over its q and the layer's cache, mla_post's work in
 * the absorb launch; declines where a KDEC_ switch turns a part of that off or the
 * attention's rows are not the projections'. */
int cuda_mla_prep_attn(struct backend *be, float *out, float *q, const float *h,
		       const struct model_layer *L, const struct backend_mla *p,
		       const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_mla_post_args a;
	struct k_cuda_attn_rows r;
	int ret;

	if (!mla_prep_fused() || !mla_post_fused() || !mla_post_in_absorb() ||
	    rows->n_rows != p->rows)
		return 1;
	cuda_op_begin(b, CUDA_OP_MLA_PREP_ATTN);
	if (mla_prep_check(b, CUDA_OP_MLA_PREP_ATTN, L, p) ||
	    mla_project(b, CUDA_OP_MLA_PREP_ATTN, &a, q, h, L, p))
		return 0;
	/* the absorb reads the projections' rows, not x: the bf16 copy of x goes, as at the
	 * start of any op that does not read it */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	r = cuda_attn_rows(rows);
	ret = k_cuda_attn_mla_post(b->stream, b->attn_ws, out, &a, W(b, &L->wkv_b),
				   (const uint16_t *)p->kv->k, p->kv->block_tokens, &r, d, scale);
	cuda_op_end(b, CUDA_OP_MLA_PREP_ATTN, ret);
	return ret < 0 ? ret : 0;
}

/* 1 where the down projection (M, inter) -> (M, hidden) that follows gate_up_silu
 * reads its x in bf16 only (cuBLAS: Llama-3.1-8B's 117 MB one at every batch), so SwiGLU
 * need not write the fp32 form (KDEC_SILU_BF16_ONLY=0 writes it anyway). */
static int down_reads_bf16(int M, int hidden, int inter)
{
	return k_cuda_tuning()->silu_bf16_only && inter % 8 == 0 &&
	       k_cuda_linear_kind_reads_bf16(k_cuda_linear_pick(M, hidden, inter));
}

/* Where the down projection reads bf16 only and gate/up is one cuBLAS GEMM, that GEMM
 * writes gate and up in bf16 (rounded once from fp32 sums, as a bf16 model's own
 * projections are) and SwiGLU reads them so: at Llama-3.1-8B batch 64 7.3 MB fewer
 * bytes written and read a layer, 7.07 against 7.13 ms a step. Dense models only: in a
 * MoE model the extra rounding reaches the routers, where a near-tie flips an expert
 * (the golden DeepSeek-V3's greedy output changed at token 12 with it; the dense golden
 * models' did not). 0 when it did it, -EOPNOTSUPP where the fp32 form is taken.
 * KDEC_GATE_UP_BF16=0 keeps fp32. */
static int gate_up_silu_bf16(struct backend_cuda *b, float *out, const float *x,
			     const struct model_tensor *const *w, int M, int inter)
{
	uint16_t *xb = k_cuda_linear_x_scratch(b->lin, M, inter);
	const uint16_t *d[2];
	int ret;

	if (!k_cuda_tuning()->gate_up_bf16 || b->m->cfg.n_experts > 0 || !xb ||
	    !down_reads_bf16(M, (int)w[0]->cols, inter))
		return -EOPNOTSUPP;
	d[0] = W(b, w[0]);
	d[1] = W(b, w[1]);
	if (!adjacent(d, w, 2))
		return -EOPNOTSUPP;
	if ((ret = cuda_norm_settle(b)))
		return ret;
	ret = k_cuda_linear_bf16_out(b->lin, (uint16_t *)b->fused, x, d[0], M, 2 * inter,
				     (int)w[0]->cols);
	if (ret)
		return ret;
	ret = k_cuda_silu_mul_rows_bf16in(b->stream, (const uint16_t *)b->fused, M, inter, xb);
	if (!ret)
		k_cuda_linear_x_ready_only(b->lin, out, M, inter);
	return ret;
}

/* KDEC_SWIGLU_IN_DOWN (rows, default 1): quantized gate/up at up to that many rows leave
 * SwiGLU to the down projection's GEMV, one launch and one round trip of the layer's
 * chain fewer (session 15, one H100: the SwiGLU launch between gate/up and down took 3.1
 * µs a layer at fp8, 4.9 at int4; with it in the GEMV Llama-3.1-8B's step went 3.79 ->
 * 3.70 ms at fp8, 3.14 -> 3.02 at int4, batch 1; at batch 8 5.18 against 4.76, every
 * CTA of the split forming its slice of 8 rows' products again). */
static int swiglu_in_down(int M)
{
	return M <= k_cuda_tuning()->swiglu_in_down && M <= K_CUDA_LINEAR_Q_MMA_MAX_M;
}

/* 1 where a bf16 down projection (M, inter) -> (M, hidden) runs on the ring GEMV, which
 * can form SwiGLU's product itself (k_cuda_linear_swiglu_run) as the quantized GEMV does. */
static int down_rings(int M, int hidden, int inter)
{
	return k_cuda_linear_pick(M, hidden, inter) == K_CUDA_LINEAR_RING;
}

/* The one writer of a quantized SwiGLU's output: out and its bf16 copy for the linear
 * next (the GEMV it goes to reads the fp32 form). */
int cuda_swiglu_settle(struct backend_cuda *b)
{
	float *out = b->swiglu.out;
	const int rows = b->swiglu.rows, inter = b->swiglu.inter;
	uint16_t *xb;
	int ret;

	if (!out)
		return 0;
	b->swiglu.out = NULL;
	xb = k_cuda_linear_x_scratch(b->lin, rows, inter);
	ret = k_cuda_silu_mul_rows_bf16(b->stream, out, b->swiglu.gu, rows, inter, xb);
	if (!ret && xb)
		k_cuda_linear_x_ready(b->lin, out, rows, inter);
	return ret;
}

void cuda_gate_up_silu(struct backend *be, float *out, const float *x,
		       const struct model_tensor *w_gate, const struct model_tensor *w_up, int M)
{
	struct backend_cuda *b = cuda_of(be);
	const struct model_tensor *w[2] = { w_gate, w_up };
	const int inter = (int)w_gate->rows;
	long off[2], rs[2];
	int ret;

	cuda_op_begin(b, CUDA_OP_GATE_UP_SILU);
	if ((size_t)M * 2 * (size_t)inter > b->fused_floats || w_up->rows != w_gate->rows) {
		cuda_op_fail(b, CUDA_OP_GATE_UP_SILU, -EINVAL,
			     "rows past the scratch, or gate and up differ");
		return;
	}
	if ((ret = gate_up_silu_bf16(b, out, x, w, M, inter)) != -EOPNOTSUPP) {
		cuda_op_end(b, CUDA_OP_GATE_UP_SILU, ret);
		return;
	}
	if ((ret = group_linear(b, b->fused, x, w, 2, M, off, rs))) {
		cuda_op_end(b, CUDA_OP_GATE_UP_SILU, ret);
		return;
	}
	if (rs[0] == 2L * inter &&
	    (w_gate->q.fmt != K_Q_NONE || down_rings(M, (int)w_gate->cols, inter))) {
		/* quantized gate/up, one GEMM (rows hold gate then up): the down projection
		 * is quantized too and its GEMV reads fp32 x, or bf16 on the ring GEMV; it
		 * forms the product itself at up to KDEC_SWIGLU_IN_DOWN rows, else SwiGLU is
		 * written now */
		b->swiglu.out = out;
		b->swiglu.gu = b->fused;
		b->swiglu.rows = M;
		b->swiglu.inter = inter;
		ret = swiglu_in_down(M) ? 0 : cuda_swiglu_settle(b);
	} else if (rs[0] == 2L * inter) {	/* one GEMM: rows hold gate then up */
		/* out in bf16 as well, for the down projection next; in bf16 only where
		 * that projection reads nothing else */
		uint16_t *xb = k_cuda_linear_x_scratch(b->lin, M, inter);
		const int only = xb && down_reads_bf16(M, (int)w_gate->cols, inter);

		ret = k_cuda_silu_mul_rows_bf16(b->stream, only ? NULL : out, b->fused, M, inter, xb);
		if (!ret && only)
			k_cuda_linear_x_ready_only(b->lin, out, M, inter);
		else if (!ret && xb)
			k_cuda_linear_x_ready(b->lin, out, M, inter);
	} else
		ret = k_cuda_silu_mul(b->stream, out, b->fused + off[0], b->fused + off[1],
				      (size_t)M * (size_t)inter);
	cuda_op_end(b, CUDA_OP_GATE_UP_SILU, ret);
}
