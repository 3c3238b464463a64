/* The CPU backend: the reference. Host memory, the ops of kernels/cpu, a thread pool;
 * everything runs synchronously on the calling (engine) thread plus its workers. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/backend/backend.h"
#include "kernels/cpu/k_cpu.h"

struct backend_cpu {
	struct backend base;
	struct k_pool *pool;
	int kv_bf16;		/* backend_opts.kv_bf16 */
	int w_bf16;		/* backend_opts.w_bf16 */
	int x_bf16;		/* backend_opts.x_bf16: rows from which x is rounded; 0: never */
	int (*x_bf16_at)(void *arg, const struct model_tensor *w, int M);	/* backend_opts' */
	void *x_bf16_arg;
	float *xr;		/* (xr_cap) x rounded to bf16, for x_bf16 */
	size_t xr_cap;
};

static struct k_pool *pool_of(struct backend *be)
{
	return ((struct backend_cpu *)be)->pool;
}

static int cpu_create(struct backend **out, const struct model *m, const struct backend_opts *opts,
		      char *err, size_t err_len)
{
	struct backend_cpu *b;
	long threads = opts && opts->threads > 0 ? opts->threads : sysconf(_SC_NPROCESSORS_ONLN);
	int ret;

	(void)m;
	if (threads < 1)
		threads = 1;
	if (threads > 1024) {
		snprintf(err, err_len, "--threads %ld: at most 1024", threads);
		return -EINVAL;
	}
	b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->base.ops = &backend_cpu_ops;
	b->kv_bf16 = opts && opts->kv_bf16;
	b->w_bf16 = opts && opts->w_bf16;
	b->x_bf16 = opts && opts->x_bf16 > 0 ? opts->x_bf16 : 0;
	b->x_bf16_at = opts ? opts->x_bf16_at : NULL;
	b->x_bf16_arg = opts ? opts->x_bf16_arg : NULL;
	ret = k_pool_create(&b->pool, (int)threads);
	if (ret) {
		snprintf(err, err_len, "cpu backend: cannot start %ld threads: %s", threads, strerror(-ret));
		free(b);
		return ret;
	}
	*out = &b->base;
	return 0;
}

static void cpu_destroy(struct backend *be)
{
	if (!be)
		return;
	k_pool_destroy(pool_of(be));
	free(((struct backend_cpu *)be)->xr);
	free(be);
}

static void *cpu_alloc(struct backend *be, size_t bytes)
{
	(void)be;
	return calloc(1, bytes ? bytes : 1);
}

static void cpu_free(struct backend *be, void *p)
{
	(void)be;
	free(p);
}

static int cpu_copy(struct backend *be, void *dst, const void *src, size_t bytes)
{
	(void)be;
	memcpy(dst, src, bytes);
	return 0;
}

/* The cache is host memory: a side copy is memcpy, on the caller's thread. */
static int cpu_side_download(struct backend *be, void *dst, void *const *src, int n, size_t bytes)
{
	(void)be;
	for (int i = 0; i < n; i++)
		memcpy((uint8_t *)dst + (size_t)i * bytes, src[i], bytes);
	return 0;
}

static int cpu_side_upload(struct backend *be, void *const *dst, const void *src, int n, size_t bytes)
{
	(void)be;
	for (int i = 0; i < n; i++)
		memcpy(dst[i], (const uint8_t *)src + (size_t)i * bytes, bytes);
	return 0;
}

static int cpu_sync(struct backend *be)
{
	(void)be;
	return 0;
}

static void cpu_embed(struct backend *be, float *out, const int32_t *ids, int n,
		      const struct model_tensor *table)
{
	(void)be;
	k_cpu_embed(out, ids, n, table->data, table->dtype, (int)table->cols);
}

static void cpu_rmsnorm(struct backend *be, float *out, int out_stride, const float *x, int x_stride,
			const struct model_tensor *w, int rows, int dim, float eps)
{
	(void)be;
	k_cpu_rmsnorm(out, out_stride, x, x_stride, w->data, w->dtype, rows, dim, eps);
}

static void cpu_add(struct backend *be, float *y, const float *x, size_t n)
{
	(void)be;
	k_cpu_add(y, x, n);
}

static void cpu_silu_mul(struct backend *be, float *out, const float *gate, const float *up, size_t n)
{
	(void)be;
	k_cpu_silu_mul(out, gate, up, n);
}

/* The router's linear: fp32 input always, as on the GPU. */
static void cpu_linear_fp32x(struct backend *be, float *y, const float *x,
			     const struct model_tensor *w, int M)
{
	k_cpu_linear_q(pool_of(be), y, x, w->data, w->dtype, &w->q, M, (int)w->rows, (int)w->cols);
}

/* How the GPU rounds this linear's x: x_bf16_at's answer where it has one (1: bf16, 2:
 * f16, 0: not), else x_bf16's rule by rows (bf16). */
static int cpu_rounds_x(const struct backend_cpu *b, const struct model_tensor *w, int M)
{
	int at = -1;

	if (b->x_bf16_at)
		at = b->x_bf16_at(b->x_bf16_arg, w, M);
	return at >= 0 ? at : b->x_bf16 && M >= b->x_bf16;
}

/* With x_bf16, x rounded first where the GPU's kernels round it (bf16, or f16 for its
 * quantized kernels); a scratch that cannot grow leaves x as it is (the fidelity check
 * then shows the difference). */
static void cpu_linear(struct backend *be, float *y, const float *x, const struct model_tensor *w, int M)
{
	struct backend_cpu *b = (struct backend_cpu *)be;
	const int mode = cpu_rounds_x(b, w, M);
	size_t n = (size_t)M * (size_t)w->cols;

	if (mode) {
		if (n > b->xr_cap) {
			float *p = realloc(b->xr, n * sizeof(float));

			if (p) {
				b->xr = p;
				b->xr_cap = n;
			}
		}
		if (n <= b->xr_cap) {
			for (size_t i = 0; i < n; i++)
				b->xr[i] = k_round_to(x[i], mode == 2 ? K_F16 : K_BF16);
			x = b->xr;
		}
	}
	cpu_linear_fp32x(be, y, x, w, M);
}

static void cpu_rope(struct backend *be, const struct k_rope *rope, float *x, int n_rows, int n_heads,
		     int row_stride, int head_stride, const int32_t *pos)
{
	(void)be;
	k_cpu_rope(rope, x, n_rows, n_heads, row_stride, head_stride, pos);
}

static void cpu_kv_write(struct backend *be, float *cache, int width, const float *src, int n_rows,
			 const int32_t *slots)
{
	k_cpu_kv_write(cache, width, src, n_rows, slots);
	if (((struct backend_cpu *)be)->kv_bf16)
		for (int r = 0; r < n_rows; r++)
			for (int i = 0; i < width; i++) {
				float *c = cache + (size_t)slots[r] * width + i;

				*c = k_round_to(*c, K_BF16);
			}
}

static void cpu_attn_gqa(struct backend *be, float *out, const float *q, const struct k_kv_layer *kv,
			 const struct k_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
			 float scale)
{
	k_cpu_attn_gqa(pool_of(be), out, q, kv, rows, n_heads, kv_heads, head_dim, scale);
}

static int cpu_attn_mla(struct backend *be, float *out, const float *q, const struct model_tensor *w_kv_b,
			const struct k_kv_layer *kv, const struct k_attn_rows *rows,
			const struct k_mla_dims *d, float scale)
{
	float *wf;
	size_t n;
	int ret;

	if (w_kv_b->q.fmt == K_Q_NONE)
		return k_cpu_attn_mla(pool_of(be), out, q, w_kv_b->data, w_kv_b->dtype, kv, rows, d, scale);
	/* quantized kv_b_proj: dequantized for this call only (the reference keeps the
	 * quantized bytes resident); with w_bf16 rounded as the GPU keeps it (bf16) */
	n = (size_t)w_kv_b->rows * (size_t)w_kv_b->cols;
	wf = malloc(sizeof(float) * n);
	if (!wf)
		return -ENOMEM;
	for (int64_t r = 0; r < w_kv_b->rows; r++)
		k_quant_row_to_f32(wf + r * w_kv_b->cols, w_kv_b->data, &w_kv_b->q, w_kv_b->cols, r, 0,
				   w_kv_b->cols);
	for (size_t i = 0; ((struct backend_cpu *)be)->w_bf16 && i < n; i++)
		wf[i] = k_round_to(wf[i], K_BF16);
	ret = k_cpu_attn_mla(pool_of(be), out, q, wf, K_F32, kv, rows, d, scale);
	free(wf);
	return ret;
}

static void cpu_moe_route(struct backend *be, const struct k_moe_route_params *p, const float *logits,
			  int M, int32_t *ids, float *weights)
{
	(void)be;
	k_cpu_moe_route(p, logits, M, ids, weights);
}

static int cpu_moe_experts(struct backend *be, float *out, const float *x, int M, const int32_t *ids,
			   const float *weights, int top_k, const struct model_layer *L, int hidden,
			   int inter, int n_experts)
{
	return k_cpu_moe_experts(pool_of(be), out, x, M, ids, weights, top_k, L->experts, n_experts,
				 L->expert_dtype, hidden, inter);
}

/* The reference for the fused op: the ops forward.c runs otherwise, in its order, with
 * scratch of its own: mlp = routed, mlp += down(silu(gate h) * up h), y += mlp. */
static int cpu_moe_experts_add(struct backend *be, float *y, const float *x, int M,
			       const int32_t *ids, const float *weights, int top_k,
			       const struct model_layer *L, int hidden, int inter, int n_experts,
			       int shared_inter)
{
	size_t nx = (size_t)M * (size_t)hidden, ns = (size_t)M * (size_t)shared_inter;
	float *mlp, *down, *gate, *up;
	int ret;

	if (shared_inter > 0 && (L->w_gate.rows != shared_inter || L->w_up.rows != shared_inter ||
				 L->w_down.cols != shared_inter || L->w_down.rows != hidden))
		return 1;	/* not the sizes this op was asked for: the ops will do */
	mlp = malloc(sizeof(float) * (nx + (shared_inter > 0 ? nx + 2 * ns : 0)));
	if (!mlp)
		return -ENOMEM;
	down = mlp + nx;
	gate = down + nx;
	up = gate + ns;
	ret = cpu_moe_experts(be, mlp, x, M, ids, weights, top_k, L, hidden, inter, n_experts);
	if (!ret && shared_inter > 0) {
		cpu_linear(be, gate, x, &L->w_gate, M);
		cpu_linear(be, up, x, &L->w_up, M);
		k_cpu_silu_mul(gate, gate, up, ns);
		cpu_linear(be, down, gate, &L->w_down, M);
		k_cpu_add(mlp, down, nx);
	}
	if (!ret)
		k_cpu_add(y, mlp, nx);
	free(mlp);
	return ret;
}

const struct backend_ops backend_cpu_ops = {
	.name = "cpu",
	.kv_dtype = K_F32,
	.host_memory = 1,
	.create = cpu_create,
	.destroy = cpu_destroy,
	.alloc = cpu_alloc,
	.free = cpu_free,
	.upload = cpu_copy,
	.download = cpu_copy,
	.sync = cpu_sync,
	.side_download = cpu_side_download,
	.side_upload = cpu_side_upload,
	.embed = cpu_embed,
	.rmsnorm = cpu_rmsnorm,
	.add = cpu_add,
	.silu_mul = cpu_silu_mul,
	.linear = cpu_linear,
	.linear_fp32x = cpu_linear_fp32x,
	.rope = cpu_rope,
	.kv_write = cpu_kv_write,
	.attn_gqa = cpu_attn_gqa,
	.attn_mla = cpu_attn_mla,
	.moe_route = cpu_moe_route,
	.moe_experts = cpu_moe_experts,
	.moe_experts_add = cpu_moe_experts_add,
};
