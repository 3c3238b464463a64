/* The CUDA backend's ops: the table of their properties, the bracket every op runs in
 * (cuda_op_begin / cuda_op_end), and the ops that are one kernel launcher each. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/sample/k_cuda_sample.h"

/* ---- the ops' properties -------------------------------------------------- */

const struct cuda_op_info cuda_op_info[CUDA_OP_COUNT] = {
	[CUDA_OP_EMBED] = { "embed", 0 },
	[CUDA_OP_RMSNORM] = { "rmsnorm", 0 },
	[CUDA_OP_ADD] = { "add", 0 },
	[CUDA_OP_SILU_MUL] = { "silu_mul", 0 },
	[CUDA_OP_LINEAR] = { "linear", 1 },
	[CUDA_OP_LINEAR_ADD] = { "linear_add", 1 },
	[CUDA_OP_LINEAR_FP32X] = { "linear_fp32x", 0 },
	[CUDA_OP_ROPE] = { "rope", 0 },
	[CUDA_OP_KV_WRITE] = { "kv_write", 0 },
	[CUDA_OP_QKV_PREP] = { "qkv_prep", 1 },
	[CUDA_OP_ATTN_GQA] = { "attn_gqa", 0 },
	[CUDA_OP_QKV_PREP_ATTN] = { "qkv_prep_attn", 1 },
	[CUDA_OP_MLA_PREP] = { "mla_prep", 1 },
	[CUDA_OP_MLA_POST] = { "mla_post", 0 },
	[CUDA_OP_ATTN_MLA] = { "attn_mla", 0 },
	[CUDA_OP_MLA_PREP_ATTN] = { "mla_prep_attn", 1 },
	[CUDA_OP_GATE_UP_SILU] = { "gate_up_silu", 1 },
	[CUDA_OP_MOE_ROUTE] = { "moe_route", 0 },
	[CUDA_OP_MOE_EXPERTS] = { "moe_experts", 0 },
	[CUDA_OP_MOE_EXPERTS_ADD] = { "moe_experts_add", 0 },
	[CUDA_OP_MOE_LAYER] = { "moe_layer", 0 },
	[CUDA_OP_SAMPLE] = { "sample", 0 },
};

/* ---- an op's bracket ------------------------------------------------------ */

void cuda_op_begin(struct backend_cuda *b, enum cuda_op op)
{
	int ret;

	/* a pending SwiGLU is the down projection's (a linear) to take, nobody else's */
	if (b->swiglu.out && op != CUDA_OP_LINEAR && op != CUDA_OP_LINEAR_ADD &&
	    (ret = cuda_swiglu_settle(b)))
		cuda_fail(b, ret, "gate_up_silu");
	/* a pending norm is for an op whose first kernels are linears over x (the ones that
	 * may read its bf16 copy); whatever else they launch over x settles it first */
	if (b->norm.out && !cuda_op_info[op].reads_x_bf16 && (ret = cuda_norm_settle(b)))
		cuda_fail(b, ret, "rmsnorm");
	if (!cuda_op_info[op].reads_x_bf16)
		k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	cuda_prof_begin(b, op);
}

void cuda_op_end(struct backend_cuda *b, enum cuda_op op, int ret)
{
	cuda_prof_end(b);
	if (ret)
		cuda_fail(b, ret, cuda_op_info[op].name);
}

void cuda_op_fail(struct backend_cuda *b, enum cuda_op op, int ret, const char *why)
{
	char what[160];

	snprintf(what, sizeof(what), "%s (%s)", cuda_op_info[op].name, why);
	cuda_prof_end(b);
	cuda_fail(b, ret, what);
}

const void *cuda_dev_of(struct backend_cuda *b, const void *host, const char *what)
{
	const void *d = cuda_ptr_map_get(&b->map, host);

	if (!d)
		cuda_fail(b, -EFAULT, what);
	return d;
}

/* ---- the ops -------------------------------------------------------------- */

void cuda_embed(struct backend *be, float *out, const int32_t *ids, int n,
		const struct model_tensor *table)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_EMBED);
	cuda_op_end(b, CUDA_OP_EMBED, k_cuda_embed(b->stream, out, ids, n, W(b, table), (int)table->cols));
}

/* KDEC_NORM_IN_GEMV: a norm of whole rows, out apart from x, whose GEMV could take it
 * (dim a whole number of int4 groups, 16-byte rows) is left pending. */
static int norm_defers(const float *out, int out_stride, const float *x, int x_stride, int rows,
		       int dim)
{
	const size_t n = (size_t)rows * (size_t)dim;

	return rows >= 1 && rows <= k_cuda_tuning()->norm_in_gemv && out_stride == dim &&
	       x_stride == dim && dim % 32 == 0 && !((uintptr_t)out & 15) &&
	       !((uintptr_t)x & 15) && (out + n <= x || x + n <= out);
}

int cuda_norm_settle(struct backend_cuda *b)
{
	float *out = b->norm.out;
	const int rows = b->norm.rows, dim = b->norm.dim;
	uint16_t *xb;
	int ret;

	if (!out)
		return 0;
	b->norm.out = NULL;
	xb = k_cuda_linear_x_scratch(b->lin, rows, dim);
	if (!xb)
		return k_cuda_rmsnorm(b->stream, out, dim, b->norm.x, dim, b->norm.w, rows, dim,
				      b->norm.eps);
	ret = k_cuda_rmsnorm_bf16(b->stream, out, dim, b->norm.x, dim, b->norm.w, rows, dim,
				  b->norm.eps, xb);
	if (!ret)
		k_cuda_linear_x_ready(b->lin, out, rows, dim);
	return ret;
}

void cuda_pending_settle(struct backend_cuda *b)
{
	int ret;

	if ((ret = cuda_norm_settle(b)))
		cuda_fail(b, ret, "rmsnorm");
	if ((ret = cuda_swiglu_settle(b)))
		cuda_fail(b, ret, "gate_up_silu");
}

void cuda_rmsnorm(struct backend *be, float *out, int out_stride, const float *x, int x_stride,
		  const struct model_tensor *w, int rows, int dim, float eps)
{
	struct backend_cuda *b = cuda_of(be);
	uint16_t *xb = out_stride == dim ? k_cuda_linear_x_scratch(b->lin, rows, dim) : NULL;

	cuda_op_begin(b, CUDA_OP_RMSNORM);
	if (norm_defers(out, out_stride, x, x_stride, rows, dim) && !((uintptr_t)V(b, w) & 15)) {
		b->norm.out = out;
		b->norm.x = x;
		b->norm.w = V(b, w);
		b->norm.rows = rows;
		b->norm.dim = dim;
		b->norm.eps = eps;
		cuda_op_end(b, CUDA_OP_RMSNORM, 0);
		return;
	}
	if (!xb) {
		cuda_op_end(b, CUDA_OP_RMSNORM, k_cuda_rmsnorm(b->stream, out, out_stride, x, x_stride,
							       V(b, w), rows, dim, eps));
		return;
	}
	/* the output in bf16 as well, for the linear that usually comes next */
	cuda_op_end(b, CUDA_OP_RMSNORM, k_cuda_rmsnorm_bf16(b->stream, out, out_stride, x, x_stride,
							    V(b, w), rows, dim, eps, xb));
	k_cuda_linear_x_ready(b->lin, out, rows, dim);
}

void cuda_add(struct backend *be, float *y, const float *x, size_t n)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_ADD);
	cuda_op_end(b, CUDA_OP_ADD, k_cuda_add(b->stream, y, x, n));
}

void cuda_silu_mul(struct backend *be, float *out, const float *gate, const float *up, size_t n)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_SILU_MUL);
	cuda_op_end(b, CUDA_OP_SILU_MUL, k_cuda_silu_mul(b->stream, out, gate, up, n));
}

const struct cuda_qweight *cuda_qweight_of(const struct backend_cuda *b, const struct model_tensor *w)
{
	return w->q.fmt != K_Q_NONE ? cuda_ptr_map_get(&b->map, &w->q) : NULL;
}

/* 1 where x (M, K) is the output of the norm left pending: *n is its fold's argument. */
static int norm_pending_is(const struct backend_cuda *b, const float *x, int M, int K,
			   struct k_cuda_xnorm *n)
{
	if (!b->norm.out || x != b->norm.out || M != b->norm.rows || K != b->norm.dim)
		return 0;
	*n = (struct k_cuda_xnorm){ b->norm.w, b->norm.eps, b->norm.out };
	return 1;
}

/* gate/up of the SwiGLU left pending where x (M, K) is its output, else NULL. */
static const float *swiglu_pending_is(const struct backend_cuda *b, const float *x, int M, int K)
{
	return b->swiglu.out && x == b->swiglu.out && M == b->swiglu.rows &&
			       K == b->swiglu.inter
		       ? b->swiglu.gu
		       : NULL;
}

/* The kind cuda_qlinear_run takes for w at M rows of x (K wide) */
static int cuda_qlinear_kind(const struct backend_cuda *b, const float *x,
			     const struct cuda_qweight *w, int M, int K)
{
	int kind = k_cuda_linear_q_choose(b->lin, &w->q, x, w->w, M, (int)w->rows, K,
					  b->wtmp ? b->wtmp_elems : 0);

	if ((kind == K_CUDA_LINEAR_Q_STREAM || kind == K_CUDA_LINEAR_Q_MMA ||
	     kind == K_CUDA_LINEAR_Q_TILE || kind == K_CUDA_LINEAR_Q_GEMV) &&
	    !w->mma_ok)	/* int4 with fp32 scales */
		kind = M <= K_CUDA_LINEAR_Q_MMA_MAX_M || !b->wtmp ? K_CUDA_LINEAR_Q_WARP
							       : K_CUDA_LINEAR_Q_DEQUANT;
	if (k_cuda_tuning()->linear_fp32x)	/* KDEC_LINEAR_FP32X: x never rounded */
		kind = K_CUDA_LINEAR_Q_WARP;
	return kind;
}

int cuda_qlinear_run(struct backend_cuda *b, float *y, const float *x, const struct cuda_qweight *w,
		     int M, int K, int accumulate)
{
	const int N = (int)w->rows, kind = cuda_qlinear_kind(b, x, w, M, K);
	const float *gu;
	struct k_cuda_xnorm n;
	int ret;

	/* the first linear over a norm left pending */
	if ((kind == K_CUDA_LINEAR_Q_GEMV || kind == K_CUDA_LINEAR_Q_STREAM) &&
	    norm_pending_is(b, x, M, K, &n)) {
		ret = k_cuda_linear_q_norm_run(b->lin, kind, y, b->norm.x, &n, w->w, &w->q, M, N, K,
					       accumulate);
		if (ret != -EINVAL) {	/* else declined: the norm's own launch first */
			b->norm.out = NULL;
			return ret;
		}
	}
	if ((ret = cuda_norm_settle(b)))
		return ret;
	/* the down projection of a SwiGLU left pending */
	if (kind == K_CUDA_LINEAR_Q_GEMV && (gu = swiglu_pending_is(b, x, M, K))) {
		b->swiglu.out = NULL;
		return k_cuda_linear_q_gemv_swiglu(b->lin, y, gu, w->w, &w->q, M, N, K, accumulate);
	}
	if ((ret = cuda_swiglu_settle(b)))
		return ret;
	return k_cuda_linear_q_run(b->lin, kind, y, x, w->w, &w->q, M, N, K, accumulate, b->wtmp,
				   b->wtmp_elems);
}

int cuda_bf16_linear_run(struct backend_cuda *b, float *y, const float *x, const uint16_t *w,
			 int M, int N, int K, int accumulate)
{
	/* the pick is asked only where a norm or SwiGLU waits for a linear to take it */
	const int ring = (b->norm.out || b->swiglu.out) &&
			 k_cuda_linear_choose_tuned(b->lin, x, w, M, N, K) == K_CUDA_LINEAR_RING;
	const float *gu;
	struct k_cuda_xnorm n;
	int ret;

	/* as cuda_qlinear_run, on the ring GEMV */
	if (ring && norm_pending_is(b, x, M, K, &n)) {
		ret = k_cuda_linear_norm_run(b->lin, y, b->norm.x, &n, w, M, N, K, accumulate);
		if (ret != -EINVAL) {
			b->norm.out = NULL;
			return ret;
		}
	}
	if ((ret = cuda_norm_settle(b)))
		return ret;
	if (ring && (gu = swiglu_pending_is(b, x, M, K))) {
		b->swiglu.out = NULL;
		return k_cuda_linear_swiglu_run(b->lin, y, gu, w, M, N, K, accumulate);
	}
	if ((ret = cuda_swiglu_settle(b)))
		return ret;
	return k_cuda_linear(b->lin, y, x, w, M, N, K, accumulate);
}

int cuda_linear_run(struct backend_cuda *b, float *y, const float *x, const struct model_tensor *w,
		    int M, int accumulate)
{
	const struct cuda_qweight *qw = cuda_qweight_of(b, w);

	if (!qw)
		return cuda_bf16_linear_run(b, y, x, W(b, w), M, (int)w->rows, (int)w->cols,
					    accumulate);
	return cuda_qlinear_run(b, y, x, qw, M, (int)w->cols, accumulate);
}

int cuda_linear_rounds_x(struct backend *be, const struct model_tensor *w, int M)
{
	static const _Alignas(16) float x_aligned[4];	/* the engine's x: only its address */
	struct backend_cuda *b = cuda_of(be);
	const struct cuda_qweight *q = cuda_qweight_of(b, w);
	const uint16_t *d = w->q.fmt == K_Q_NONE ? cuda_ptr_map_get(&b->map, w->data) : NULL;

	if (q)	/* every quantized kind but the CUDA-core one takes x in f16 */
		return cuda_qlinear_kind(b, x_aligned, q, M, (int)w->cols) == K_CUDA_LINEAR_Q_WARP ?
		       0 : 2;
	if (!d)
		return -1;
	if (k_cuda_linear_rounds_x(b->lin, d, (int)w->cols, M) > 0)
		return 1;
	return k_cuda_linear_rounds_x(cuda_branch_linear(b), d, (int)w->cols, M);
}

void cuda_linear(struct backend *be, float *y, const float *x, const struct model_tensor *w, int M)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_LINEAR);
	cuda_prof_rows(b, M);
	cuda_op_end(b, CUDA_OP_LINEAR, cuda_linear_run(b, y, x, w, M, 0));
}

/* The router: x in fp32 on the CUDA cores at every M (the GEMV walks M in pairs; the
 * generic kernel where x or w is misaligned), never rounded to bf16 as the tensor-core
 * paths do. The router matrices are small (n_experts rows), so the repeated weight
 * reads stay in L2. */
void cuda_linear_fp32x(struct backend *be, float *y, const float *x, const struct model_tensor *w,
		       int M)
{
	struct backend_cuda *b = cuda_of(be);
	const uint16_t *dw = W(b, w);
	int N = (int)w->rows, K = (int)w->cols;
	enum k_cuda_linear_kind kind = k_cuda_linear_supports(K_CUDA_LINEAR_GEMV, x, dw, M, N, K) ?
				       K_CUDA_LINEAR_GEMV : K_CUDA_LINEAR_GENERIC;

	if (!k_cuda_tuning()->router_fp32)	/* KDEC_ROUTER_FP32=0: as any linear */
		kind = k_cuda_linear_choose(x, dw, M, N, K);
	cuda_op_begin(b, CUDA_OP_LINEAR_FP32X);
	cuda_prof_rows(b, M);
	cuda_op_end(b, CUDA_OP_LINEAR_FP32X, k_cuda_linear_run_kind(b->lin, kind, y, x, dw, M, N, K, 0));
}

void cuda_linear_add(struct backend *be, float *y, const float *x, const struct model_tensor *w,
		     int M)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_LINEAR_ADD);
	cuda_prof_rows(b, M);
	cuda_op_end(b, CUDA_OP_LINEAR_ADD, cuda_linear_run(b, y, x, w, M, 1));
}

void cuda_rope(struct backend *be, const struct k_rope *rope, float *x, int n_rows, int n_heads,
	       int row_stride, int head_stride, const int32_t *pos)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_ROPE);
	if (rope->dim != b->rope_dim) {
		cuda_op_fail(b, CUDA_OP_ROPE, -EINVAL, "table of another model");
		return;
	}
	cuda_op_end(b, CUDA_OP_ROPE, k_cuda_rope(b->stream, b->inv_freq, rope->dim, rope->interleaved,
						 rope->attn_factor, x, n_rows, n_heads, row_stride,
						 head_stride, pos));
}

void cuda_kv_write(struct backend *be, float *cache, int width, const float *src, int n_rows,
		   const int32_t *slots)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_KV_WRITE);
	cuda_op_end(b, CUDA_OP_KV_WRITE, k_cuda_kv_write(b->stream, (uint16_t *)cache, width, src,
							 width, n_rows, slots));
}

/* The attention over q as it is; cuda_qkv_prep_attn is the decode step's fused form. */
void cuda_attn_gqa(struct backend *be, float *out, const float *q, const struct k_kv_layer *kv,
		   const struct k_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
		   float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_attn_rows r = cuda_attn_rows(rows);
	const int width = n_heads * head_dim;
	/* the output in bf16 as well, for o_proj next */
	uint16_t *xb = k_cuda_linear_x_scratch(b->lin, rows->n_rows, width);
	int ret;

	cuda_op_begin(b, CUDA_OP_ATTN_GQA);
	ret = k_cuda_attn_gqa_bf16(b->stream, b->attn_ws, out, xb, q, (const uint16_t *)kv->k,
				   (const uint16_t *)kv->v, kv->block_tokens, &r, n_heads, kv_heads,
				   head_dim, scale);
	cuda_op_end(b, CUDA_OP_ATTN_GQA, ret < 0 ? ret : 0);
	if (ret == 1)
		k_cuda_linear_x_ready(b->lin, out, rows->n_rows, width);
}

/* The attention over q as it is; cuda_mla_prep_attn is the fused form. */
int cuda_attn_mla(struct backend *be, float *out, const float *q, const struct model_tensor *w_kv_b,
		  const struct k_kv_layer *kv, const struct k_attn_rows *rows,
		  const struct k_mla_dims *d, float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_attn_rows r;
	int ret;

	cuda_op_begin(b, CUDA_OP_ATTN_MLA);
	r = cuda_attn_rows(rows);
	ret = k_cuda_attn_mla(b->stream, b->attn_ws, out, q, W(b, w_kv_b), (const uint16_t *)kv->k,
			      kv->block_tokens, &r, d, scale);
	cuda_op_end(b, CUDA_OP_ATTN_MLA, ret);
	return ret;
}

void cuda_moe_route(struct backend *be, const struct k_moe_route_params *p, const float *logits,
		    int M, int32_t *ids, float *weights)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_moe_route_params dp = *p;

	cuda_op_begin(b, CUDA_OP_MOE_ROUTE);
	dp.bias = p->bias ? cuda_dev_of(b, p->bias, "moe_route bias") : NULL;
	cuda_op_end(b, CUDA_OP_MOE_ROUTE, k_cuda_moe_route(b->stream, &dp, logits, M, ids, weights));
}

int cuda_moe_experts(struct backend *be, float *out, const float *x, int M, const int32_t *ids,
		     const float *weights, int top_k, const struct model_layer *L, int hidden,
		     int inter, int n_experts)
{
	struct backend_cuda *b = cuda_of(be);
	const uint16_t *const *table;
	int ret;

	cuda_op_begin(b, CUDA_OP_MOE_EXPERTS);
	table = cuda_dev_of(b, L->experts, "moe_experts");
	ret = k_cuda_moe_experts_q(b->stream, b->moe_ws, out, x, M, ids, weights, top_k, table,
				   cuda_moe_q_of(b, L), n_experts, hidden, inter);
	cuda_op_end(b, CUDA_OP_MOE_EXPERTS, ret);
	return ret;
}

/* Declines (1) past k_cuda_tuning()->moe_fused_rows rows (KDEC_MOE_FUSED_ROWS, default
 * 1) before anything is queued, and where the shared expert's matrices are not as the
 * kernels take them. Batch 1 only, as measured on H200, DeepSeek-V2-Lite: batch 1 3.17
 * ms a step fused (staged kernels) against 3.37 unfused; the fused call alone, timed
 * with registers only, 50.9 us at batch 1 and 352 at batch 8, where the grouped path
 * and the separate shared expert take ~236 (tests/test_cuda_moe). With quantized
 * routed experts (cuda_moe_q_of) and a shared expert, k_cuda_moe_experts_add_q declines
 * too: the shared expert is then quantized linears (backend_cuda_weights.c). */
int cuda_moe_experts_add(struct backend *be, float *y, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const struct model_layer *L, int hidden, int inter, int n_experts,
			 int shared_inter)
{
	struct backend_cuda *b = cuda_of(be);
	const uint16_t *const *table;
	struct k_cuda_moe_shared sh = { 0 };
	int ret = 1;	/* the shared matrices not as the kernels take them: the ops will do */

	if (M > k_cuda_tuning()->moe_fused_rows)
		return 1;
	cuda_op_begin(b, CUDA_OP_MOE_EXPERTS_ADD);
	table = cuda_dev_of(b, L->experts, "moe_experts_add");
	if (shared_inter > 0 && L->w_gate.rows == shared_inter && L->w_up.rows == shared_inter &&
	    L->w_down.cols == shared_inter && L->w_gate.cols == hidden && L->w_up.cols == hidden &&
	    L->w_down.rows == hidden)
		sh = (struct k_cuda_moe_shared){ W(b, &L->w_gate), W(b, &L->w_up), W(b, &L->w_down),
						 shared_inter };
	if (shared_inter == 0 || sh.inter)
		ret = k_cuda_moe_experts_add_q(b->stream, b->moe_ws, y, x, M, ids, weights, top_k,
					       table, cuda_moe_q_of(b, L), n_experts, hidden, inter,
					       shared_inter > 0 ? &sh : NULL);
	cuda_op_end(b, CUDA_OP_MOE_EXPERTS_ADD, ret < 0 ? ret : 0);
	return ret;
}

/* The latency path's MoE layer (k_cuda_moe_lat, two launches). Declines (1) before
 * anything is queued where the router would not be the fp32 GEMV the standard path runs
 * (KDEC_ROUTER_FP32=0: then the two paths would choose differently), where the shared
 * expert's matrices are not as the kernels take them, and where the kernels do not
 * take the shapes (more than K_CUDA_MOE_LAT_MAX_ROWS rows, say). */
int cuda_moe_layer(struct backend *be, float *y, const float *x, int M, const struct model_layer *L,
		   const struct k_moe_route_params *route, float *logits, int32_t *ids,
		   float *weights, int hidden, int inter, int n_experts, int shared_inter)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_moe_shared sh = { 0 };
	struct k_moe_route_params dp = *route;
	const uint16_t *router = W(b, &L->router);
	int ret;

	if (!k_cuda_tuning()->router_fp32 || M > K_CUDA_MOE_LAT_MAX_ROWS ||
	    !k_cuda_linear_supports(K_CUDA_LINEAR_GEMV, x, router, M, (int)L->router.rows,
				    (int)L->router.cols) || (int)L->router.rows != n_experts ||
	    (int)L->router.cols != hidden)
		return 1;
	if (shared_inter > 0) {
		if (L->w_gate.rows != shared_inter || L->w_up.rows != shared_inter ||
		    L->w_down.cols != shared_inter || L->w_gate.cols != hidden ||
		    L->w_up.cols != hidden || L->w_down.rows != hidden)
			return 1;
		sh = (struct k_cuda_moe_shared){ W(b, &L->w_gate), W(b, &L->w_up), W(b, &L->w_down),
						 shared_inter };
	}
	cuda_op_begin(b, CUDA_OP_MOE_LAYER);
	dp.bias = route->bias ? cuda_dev_of(b, route->bias, "moe_layer bias") : NULL;
	ret = k_cuda_moe_lat(b->stream, b->moe_ws, y, x, M, router, &dp, logits, ids, weights,
			     cuda_dev_of(b, L->experts, "moe_layer"), cuda_moe_q_of(b, L), n_experts,
			     hidden, inter, shared_inter > 0 ? &sh : NULL);
	cuda_op_end(b, CUDA_OP_MOE_LAYER, ret < 0 ? ret : 0);
	return ret;
}

int cuda_sample(struct backend *be, int32_t *ids, const float *logits, int M, int vocab,
		const struct k_sample_params *params, const uint64_t *steps)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_op_begin(b, CUDA_OP_SAMPLE);
	ret = k_cuda_sample(b->stream, b->sample_ws, ids, logits, M, vocab, params, steps);
	cuda_op_end(b, CUDA_OP_SAMPLE, ret);
	return ret;
}
