/* The CUDA backend: weights and activations in GPU memory, every op a kernel of
 * kernels/cuda on one stream, asynchronous until sync or a download; decode steps
 * captured as CUDA graphs. Ops that return nothing record their first failure,
 * which the next sync reports. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/sample/k_cuda_sample.h"

int cuda_check(struct backend_cuda *b, cudaError_t e, const char *call, const char *file, int line)
{
	if (e == cudaSuccess)
		return 0;
	log_error("cuda: %s failed on GPU %d at %s:%d: %s", call, b->dev, file, line,
		  cudaGetErrorString(e));
	if (!b->err)
		b->err = -EIO;
	return -EIO;
}

/* ---- per-op timing (KDEC_CUDA_OP_TIMES=1) ---------------------------------- */

static void prof_create(struct backend_cuda *b)
{
	const char *v = getenv("KDEC_CUDA_OP_TIMES");
	struct cuda_prof *p;

	if (!v || strcmp(v, "1") || !(p = calloc(1, sizeof(*p))))
		return;
	for (int i = 0; i <= CUDA_PROF_MAX_PENDING; i++)
		if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
			for (int j = 0; j < i; j++)
				cudaEventDestroy(p->ev[j]);
			free(p);
			return;
		}
	p->on = 1;
	b->prof = p;
	log_info("cuda: timing every op (KDEC_CUDA_OP_TIMES=1); graphs record no times");
}

/* The ops that read their x through the linear context: they may use a bf16 copy of
 * x that the op before them left in its scratch (k_cuda_linear_x_ready). */
static int reads_x_bf16(const char *op)
{
	return !strcmp(op, "linear") || !strcmp(op, "linear_add") || !strcmp(op, "qkv_prep") ||
	       !strcmp(op, "gate_up_silu") || !strcmp(op, "mla_prep");
}

void cuda_note_untimed(struct backend_cuda *b, int ret, const char *what)
{
	if (ret && !b->err) {
		log_error("cuda: %s failed: %s", what, strerror(-ret));
		b->err = ret;
	}
}

void cuda_pending_flush(struct backend_cuda *b)
{
	cuda_mla_post_flush(b);
	cuda_qkv_post_flush(b);
}

/* What earlier ops left pending, launched unless `op` takes it: attn_mla takes mla_post,
 * attn_gqa qkv_post. */
static void pending_flush_for(struct backend_cuda *b, const char *op)
{
	if (strcmp(op, "attn_mla"))
		cuda_mla_post_flush(b);
	if (strcmp(op, "attn_gqa"))
		cuda_qkv_post_flush(b);
}

/* Marks the start of an op: the previous op's end is this op's start. Any other op
 * drops the bf16 copy of x that a producer left for a linear next: it could be about
 * to change x. */
void cuda_prof_mark(struct backend_cuda *b, const char *op)
{
	struct cuda_prof *p = b->prof;

	pending_flush_for(b, op);
	if (!reads_x_bf16(op))
		k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	if (!p || b->capturing || p->n_pending >= CUDA_PROF_MAX_PENDING)
		return;
	if (p->n_pending == 0)
		cudaEventRecord(p->ev[0], b->stream);
	p->pending_name[p->n_pending] = op;
}

static void prof_done(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;

	if (!p || b->capturing || p->n_pending >= CUDA_PROF_MAX_PENDING)
		return;
	cudaEventRecord(p->ev[++p->n_pending], b->stream);
}

/* After a stream sync: every pending op's time into its row of the table. */
static void prof_collect(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;

	if (!p)
		return;
	if (p->max_M > 64)
		p->n_pending = 0;	/* a prefill chunk: decode steps only */
	p->max_M = 0;
	for (int i = 0; i < p->n_pending; i++) {
		float ms = 0;
		int k;

		cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]);
		for (k = 0; k < p->n_ops && strcmp(p->name[k], p->pending_name[i]); k++)
			;
		if (k == p->n_ops) {
			if (k == CUDA_PROF_MAX_OPS)
				continue;
			p->name[p->n_ops++] = p->pending_name[i];
		}
		p->ms[k] += ms;
		p->calls[k]++;
	}
	p->syncs += p->n_pending > 0;
	p->n_pending = 0;
}

static void prof_report(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;
	double total = 0;

	if (!p)
		return;
	for (int k = 0; k < p->n_ops; k++)
		total += p->ms[k];
	fprintf(stderr, "cuda op times of decode steps over %ld syncs (%.3f ms of GPU time in all):\n", p->syncs, total);
	fprintf(stderr, "  %-12s %10s %9s %10s %7s\n", "op", "total_ms", "calls", "avg_us", "share");
	for (int k = 0; k < p->n_ops; k++)
		fprintf(stderr, "  %-12s %10.3f %9ld %10.2f %6.1f%%\n", p->name[k], p->ms[k], p->calls[k],
			1e3 * p->ms[k] / (double)p->calls[k], 100 * p->ms[k] / (total > 0 ? total : 1));
	for (int i = 0; i <= CUDA_PROF_MAX_PENDING; i++)
		cudaEventDestroy(p->ev[i]);
	free(p);
	b->prof = NULL;
}

/* An op's launcher result: the first failure sticks until sync. */
void cuda_note(struct backend_cuda *b, int ret, const char *op)
{
	prof_done(b);
	if (ret && !b->err) {
		log_error("cuda: %s failed: %s", op, strerror(-ret));
		b->err = ret;
	}
}

/* The device copy of a weight; a missing one is a bug in the upload walk. */
const void *cuda_dev_of(struct backend_cuda *b, const void *host, const char *what)
{
	const void *d = cuda_ptr_map_get(&b->map, host);

	if (!d)
		cuda_note(b, -EFAULT, what);
	return d;
}


/* ---- lifecycle ------------------------------------------------------------- */

static void cuda_destroy(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);

	if (!b)
		return;
	prof_report(b);
	k_cuda_sample_ws_destroy(b->sample_ws);
	cudaFree(b->fused);
	k_cuda_moe_ws_destroy(b->moe_ws);
	k_cuda_attn_ws_destroy(b->attn_ws);
	k_cuda_linear_destroy(b->lin);
	if (b->inv_freq)
		cudaFree(b->inv_freq);
	if (b->arena)
		cudaFree(b->arena);
	cuda_ptr_map_fini(&b->map);
	if (b->stream)
		cudaStreamDestroy(b->stream);
	free(b);
}

/* The forward's rope frequencies on the device: forward.c builds its k_rope from the
 * same parameters, so the two tables are equal. */
static int upload_rope(struct backend_cuda *b, char *err, size_t err_len)
{
	struct k_rope rope;
	int ret = k_rope_init(&rope, &b->m->cfg.rope);

	if (ret) {
		snprintf(err, err_len, "cuda: rope parameters rejected");
		return ret;
	}
	b->rope_dim = rope.dim;
	ret = CUDA_CHECK(b, cudaMalloc((void **)&b->inv_freq, (size_t)rope.dim / 2 * sizeof(float)));
	if (!ret)
		ret = CUDA_CHECK(b, cudaMemcpy(b->inv_freq, rope.inv_freq, (size_t)rope.dim / 2 * sizeof(float),
					       cudaMemcpyHostToDevice));
	k_rope_fini(&rope);
	if (ret)
		snprintf(err, err_len, "cuda: cannot place the rope table on GPU %d", b->dev);
	return ret;
}

static int cuda_create(struct backend **out, const struct model *m, const struct backend_opts *opts,
		       char *err, size_t err_len)
{
	struct backend_cuda *b;
	char name[128];
	double gib, t0 = clock_now();
	int count = 0, major, minor, ret;

	*out = NULL;
	k_cuda_device_count(&count);
	if (count == 0) {
		snprintf(err, err_len, "cuda backend: no usable GPU (driver or device missing)");
		return -ENODEV;
	}
	b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->base.ops = &backend_cuda_ops;
	b->m = m;
	b->dev = opts && opts->device > 0 ? opts->device : 0;
	if (b->dev >= count) {
		snprintf(err, err_len, "cuda backend: GPU %d requested, %d visible", b->dev, count);
		free(b);
		return -ENODEV;
	}
	if ((ret = CUDA_CHECK(b, cudaSetDevice(b->dev))) ||
	    (ret = CUDA_CHECK(b, cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking)))) {
		snprintf(err, err_len, "cuda backend: cannot start on GPU %d", b->dev);
		goto err_destroy;
	}
	k_cuda_device_describe(b->dev, name, sizeof(name), &gib, &major, &minor);
	log_info("cuda: GPU %d: %s, %.1f GiB, sm_%d%d", b->dev, name, gib, major, minor);
	if ((ret = cuda_weights_upload(b, err, err_len)) || (ret = upload_rope(b, err, err_len)))
		goto err_destroy;
	log_info("cuda: %.2f GiB of weights on GPU %d in %.1f s", (double)b->arena_bytes / (1u << 30),
		 b->dev, clock_now() - t0);
	prof_create(b);
	*out = &b->base;
	return 0;

err_destroy:
	cuda_destroy(&b->base);
	return ret;
}

static int cuda_reserve(struct backend *be, int max_rows, int max_ctx, char *err, size_t err_len)
{
	struct backend_cuda *b = cuda_of(be);
	const struct model_config *c = &b->m->cfg;
	int max_dim = c->mla ? c->kv_lora_rank + c->qk_rope_head_dim : c->head_dim;
	int max_M = max_rows > 64 ? max_rows : 64;
	size_t free_b = 0, total_b = 0;
	int ret;

	if (c->mla && c->v_head_dim > max_dim)
		max_dim = c->v_head_dim;
	if ((ret = k_cuda_linear_create(&b->lin, b->stream, max_M, b->max_K)) ||
	    (ret = k_cuda_attn_ws_create(&b->attn_ws, max_M, c->n_heads, max_dim, max_ctx)) ||
	    (c->n_experts > 0 &&
	     (ret = k_cuda_moe_ws_create(&b->moe_ws, max_M, c->top_k, c->n_experts, c->hidden_size,
					 c->moe_intermediate_size,
					 c->n_shared_experts > 0 ?
					 c->moe_intermediate_size * c->n_shared_experts : 0))) ||
	    (ret = k_cuda_sample_ws_create(&b->sample_ws, 64, c->vocab_size)) ||
	    (ret = cuda_fused_reserve(b, max_M))) {
		cudaMemGetInfo(&free_b, &total_b);
		snprintf(err, err_len,
			 "cuda: cannot make the workspaces for %d rows x %d tokens of context (%.2f GiB free on GPU %d)",
			 max_rows, max_ctx, (double)free_b / (1u << 30), b->dev);
		return ret;
	}
	cudaMemGetInfo(&free_b, &total_b);
	log_info("cuda: GPU %d memory: weights %.2f GiB, KV cache and activations %.2f GiB, %.2f GiB free of %.2f GiB",
		 b->dev, (double)b->arena_bytes / (1u << 30), (double)b->alloc_bytes / (1u << 30),
		 (double)free_b / (1u << 30), (double)total_b / (1u << 30));
	return 0;
}

/* ---- memory ---------------------------------------------------------------- */

static void *cuda_alloc(struct backend *be, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);
	void *p = NULL;

	if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
		size_t free_b = 0, total_b = 0;

		cudaGetLastError();
		cudaMemGetInfo(&free_b, &total_b);
		log_error("cuda: out of GPU memory: %.2f GiB requested, %.2f GiB free of %.2f GiB on GPU %d",
			  (double)bytes / (1u << 30), (double)free_b / (1u << 30),
			  (double)total_b / (1u << 30), b->dev);
		return NULL;
	}
	if (CUDA_CHECK(b, cudaMemsetAsync(p, 0, bytes ? bytes : 1, b->stream))) {
		cudaFree(p);
		return NULL;
	}
	b->alloc_bytes += bytes;
	return p;
}

static void cuda_free(struct backend *be, void *p)
{
	(void)be;
	if (p)
		cudaFree(p);
}

/* Page-locked, so that a step's input copy is one DMA the stream runs in order,
 * without the staging and stream sync of a copy from pageable memory. */
static void *cuda_host_alloc(struct backend *be, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);
	void *p = NULL;

	if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
		cudaGetLastError();
		log_error("cuda: out of page-locked host memory: %.1f MiB requested for GPU %d",
			  (double)bytes / (1u << 20), b->dev);
		return NULL;
	}
	memset(p, 0, bytes ? bytes : 1);
	return p;
}

static void cuda_host_free(struct backend *be, void *p)
{
	(void)be;
	if (p)
		cudaFreeHost(p);
}

static int cuda_upload(struct backend *be, void *dst, const void *src, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_pending_flush(b);

	return CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, b->stream));
}

static int cuda_download(struct backend *be, void *dst, const void *src, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_pending_flush(b);
	ret = CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, b->stream));

	if (!ret)
		ret = CUDA_CHECK(b, cudaStreamSynchronize(b->stream));
	prof_collect(b);
	return ret ? ret : b->err;
}

static int cuda_sync(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_pending_flush(b);
	ret = CUDA_CHECK(b, cudaStreamSynchronize(b->stream));

	prof_collect(b);
	if (!ret)
		ret = b->err;
	b->err = 0;
	return ret;
}

/* ---- ops ------------------------------------------------------------------- */

static void cuda_embed(struct backend *be, float *out, const int32_t *ids, int n,
		       const struct model_tensor *table)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "embed");

	cuda_note(b, k_cuda_embed(b->stream, out, ids, n, W(b, table), (int)table->cols), "embed");
}

static void cuda_rmsnorm(struct backend *be, float *out, int out_stride, const float *x, int x_stride,
			 const struct model_tensor *w, int rows, int dim, float eps)
{
	struct backend_cuda *b = cuda_of(be);
	uint16_t *xb = out_stride == dim ? k_cuda_linear_x_scratch(b->lin, rows, dim) : NULL;

	cuda_prof_mark(b, "rmsnorm");
	if (!xb) {
		cuda_note(b, k_cuda_rmsnorm(b->stream, out, out_stride, x, x_stride, V(b, w), rows, dim,
					    eps), "rmsnorm");
		return;
	}
	/* the output in bf16 as well, for the linear that usually comes next */
	cuda_note(b, k_cuda_rmsnorm_bf16(b->stream, out, out_stride, x, x_stride, V(b, w), rows, dim,
					 eps, xb), "rmsnorm");
	k_cuda_linear_x_ready(b->lin, out, rows, dim);
}

static void cuda_add(struct backend *be, float *y, const float *x, size_t n)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "add");

	cuda_note(b, k_cuda_add(b->stream, y, x, n), "add");
}

static void cuda_silu_mul(struct backend *be, float *out, const float *gate, const float *up, size_t n)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "silu_mul");

	cuda_note(b, k_cuda_silu_mul(b->stream, out, gate, up, n), "silu_mul");
}

static void cuda_linear(struct backend *be, float *y, const float *x, const struct model_tensor *w, int M)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "linear");
	if (b->prof && M > b->prof->max_M)
		b->prof->max_M = M;

	cuda_note(b, k_cuda_linear(b->lin, y, x, W(b, w), M, (int)w->rows, (int)w->cols, 0), "linear");
}

static void cuda_linear_add(struct backend *be, float *y, const float *x, const struct model_tensor *w,
			    int M)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "linear_add");
	if (b->prof && M > b->prof->max_M)
		b->prof->max_M = M;

	cuda_note(b, k_cuda_linear(b->lin, y, x, W(b, w), M, (int)w->rows, (int)w->cols, 1), "linear_add");
}

static void cuda_rope(struct backend *be, const struct k_rope *rope, float *x, int n_rows, int n_heads,
		      int row_stride, int head_stride, const int32_t *pos)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "rope");

	if (rope->dim != b->rope_dim) {
		cuda_note(b, -EINVAL, "rope (table of another model)");
		return;
	}
	cuda_note(b, k_cuda_rope(b->stream, b->inv_freq, rope->dim, rope->interleaved, rope->attn_factor, x,
			    n_rows, n_heads, row_stride, head_stride, pos), "rope");
}

static void cuda_kv_write(struct backend *be, float *cache, int width, const float *src, int n_rows,
			  const int32_t *slots)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "kv_write");

	cuda_note(b, k_cuda_kv_write(b->stream, (uint16_t *)cache, width, src, width, n_rows, slots),
	     "kv_write");
}

static struct k_cuda_attn_rows attn_rows(const struct k_attn_rows *r)
{
	return (struct k_cuda_attn_rows){ .n_rows = r->n_rows, .ctx = r->ctx, .blocks = r->blocks,
					  .max_ctx = r->max_ctx, .n_seqs = r->n_seqs };
}

static void cuda_attn_gqa(struct backend *be, float *out, const float *q, const struct k_kv_layer *kv,
			  const struct k_attn_rows *rows, int n_heads, int kv_heads, int head_dim,
			  float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct k_cuda_attn_rows r = attn_rows(rows);
	const int width = n_heads * head_dim;
	/* the output in bf16 as well, for o_proj next */
	uint16_t *xb = k_cuda_linear_x_scratch(b->lin, rows->n_rows, width);
	int ret;

	cuda_prof_mark(b, "attn_gqa");
	/* qkv_prep's qkv_post work, where it left it for this q and cache: in the attention
	 * launch (k_cuda_attn_gqa_qkv); anything else runs it first */
	if (b->qkv_post_pending &&
	    (b->qkv_post.q != q || b->qkv_post.k_cache != (uint16_t *)kv->k ||
	     b->qkv_post.v_cache != (uint16_t *)kv->v || b->qkv_post.rows != rows->n_rows ||
	     b->qkv_post.n_heads != n_heads || b->qkv_post.kv_heads != kv_heads ||
	     b->qkv_post.head_dim != head_dim))
		cuda_qkv_post_flush(b);
	if (b->qkv_post_pending) {
		b->qkv_post_pending = 0;
		ret = k_cuda_attn_gqa_qkv(b->stream, b->attn_ws, out, xb, &b->qkv_post,
					  kv->block_tokens, &r, scale);
	} else {
		ret = k_cuda_attn_gqa_bf16(b->stream, b->attn_ws, out, xb, q,
					   (const uint16_t *)kv->k, (const uint16_t *)kv->v,
					   kv->block_tokens, &r, n_heads, kv_heads, head_dim,
					   scale);
	}
	cuda_note(b, ret < 0 ? ret : 0, "attn_gqa");
	if (ret == 1)
		k_cuda_linear_x_ready(b->lin, out, rows->n_rows, width);
}

static int cuda_attn_mla(struct backend *be, float *out, const float *q, const struct model_tensor *w_kv_b,
			 const struct k_kv_layer *kv, const struct k_attn_rows *rows,
			 const struct k_mla_dims *d, float scale)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "attn_mla");
	struct k_cuda_attn_rows r = attn_rows(rows);
	int ret;

	/* mla_prep's mla_post work, where it left it for this layer's q and cache: in the
	 * absorb launch (k_cuda_attn_mla_post); anything else runs it first */
	if (b->mla_post_pending && (b->mla_post.cache != (uint16_t *)kv->k ||
				    b->mla_post.q_pe != q + d->nope_dim))
		cuda_mla_post_flush(b);
	if (b->mla_post_pending) {
		b->mla_post_pending = 0;
		ret = k_cuda_attn_mla_post(b->stream, b->attn_ws, out, &b->mla_post,
					   W(b, w_kv_b), (const uint16_t *)kv->k,
					   kv->block_tokens, &r, d, scale);
	} else {
		ret = k_cuda_attn_mla(b->stream, b->attn_ws, out, q, W(b, w_kv_b),
				      (const uint16_t *)kv->k, kv->block_tokens, &r, d, scale);
	}

	cuda_note(b, ret, "attn_mla");
	return ret;
}

static void cuda_moe_route(struct backend *be, const struct k_moe_route_params *p, const float *logits,
			   int M, int32_t *ids, float *weights)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "moe_route");
	struct k_moe_route_params dp = *p;

	dp.bias = p->bias ? cuda_dev_of(b, p->bias, "moe_route bias") : NULL;
	cuda_note(b, k_cuda_moe_route(b->stream, &dp, logits, M, ids, weights), "moe_route");
}

static int cuda_moe_experts(struct backend *be, float *out, const float *x, int M, const int32_t *ids,
			    const float *weights, int top_k, const struct model_layer *L, int hidden,
			    int inter, int n_experts)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "moe_experts");
	const uint16_t *const *table = cuda_dev_of(b, L->experts, "moe_experts");
	int ret = k_cuda_moe_experts(b->stream, b->moe_ws, out, x, M, ids, weights, top_k, table,
				     n_experts, hidden, inter);

	cuda_note(b, ret, "moe_experts");
	return ret;
}

/* Rows up to which the MoE layer runs as one fused call (routed + shared experts +
 * residual add, on the small path). Measured on H200, DeepSeek-V2-Lite: batch 1 3.17 ms
 * a step fused (staged kernels) against 3.37 unfused; the fused call alone, timed with
 * registers only, 50.9 us at batch 1 and 352 at batch 8, where the grouped path and the
 * separate shared expert take ~236 (tests/test_cuda_moe). So batch 1 only. */
#define CUDA_MOE_FUSED_MAX_ROWS 1

/* CUDA_MOE_FUSED_MAX_ROWS, or KDEC_MOE_FUSED_ROWS where set (A/B runs: the fused call's
 * timings at 2..8 rows are in tests/test_cuda_moe), read once. */
static int moe_fused_max_rows(void)
{
	static int rows = -1;

	if (rows < 0) {
		const char *e = getenv("KDEC_MOE_FUSED_ROWS");

		rows = e && *e ? atoi(e) : CUDA_MOE_FUSED_MAX_ROWS;
		if (rows < 0)
			rows = 0;
	}
	return rows;
}

static int cuda_moe_experts_add(struct backend *be, float *y, const float *x, int M,
				const int32_t *ids, const float *weights, int top_k,
				const struct model_layer *L, int hidden, int inter, int n_experts,
				int shared_inter)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "moe_experts_add");
	const uint16_t *const *table = cuda_dev_of(b, L->experts, "moe_experts_add");
	struct k_cuda_moe_shared sh = { 0 };
	int ret = 1;	/* the shared matrices not as the kernels take them: the ops will do */

	if (M > moe_fused_max_rows())
		return 1;
	if (shared_inter > 0 && L->w_gate.rows == shared_inter && L->w_up.rows == shared_inter &&
	    L->w_down.cols == shared_inter && L->w_gate.cols == hidden && L->w_up.cols == hidden &&
	    L->w_down.rows == hidden)
		sh = (struct k_cuda_moe_shared){ W(b, &L->w_gate), W(b, &L->w_up), W(b, &L->w_down),
						 shared_inter };
	if (shared_inter == 0 || sh.inter)
		ret = k_cuda_moe_experts_add(b->stream, b->moe_ws, y, x, M, ids, weights, top_k,
					     table, n_experts, hidden, inter,
					     shared_inter > 0 ? &sh : NULL);
	cuda_note(b, ret < 0 ? ret : 0, "moe_experts_add");
	return ret;
}

static int cuda_sample(struct backend *be, int32_t *ids, const float *logits, int M, int vocab,
		       const struct k_sample_params *params, const uint64_t *steps)
{
	struct backend_cuda *b = cuda_of(be);
	cuda_prof_mark(b, "sample");
	int ret = k_cuda_sample(b->stream, b->sample_ws, ids, logits, M, vocab, params, steps);

	cuda_note(b, ret, "sample");
	return ret;
}

/* ---- graphs ---------------------------------------------------------------- */

static int cuda_capture_begin(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_pending_flush(b);	/* eager work stays out of the graph */
	ret = CUDA_CHECK(b, cudaStreamBeginCapture(b->stream, cudaStreamCaptureModeThreadLocal));

	b->capturing = !ret;
	return ret;
}

static int cuda_capture_end(struct backend *be, void **graph, int *n_nodes)
{
	struct backend_cuda *b = cuda_of(be);
	cudaGraph_t g = NULL;
	cudaGraphExec_t exec = NULL;
	size_t nodes = 0;
	int ret;

	cuda_pending_flush(b);	/* the step's last work belongs in the graph */
	ret = CUDA_CHECK(b, cudaStreamEndCapture(b->stream, &g));

	b->capturing = 0;
	*graph = NULL;
	if (!ret)
		ret = CUDA_CHECK(b, cudaGraphGetNodes(g, NULL, &nodes));
	*n_nodes = (int)nodes;
	if (!ret && b->err)
		ret = b->err;	/* an op failed while recording */
	if (!ret)
		ret = CUDA_CHECK(b, cudaGraphInstantiate(&exec, g, 0));
	if (g)
		cudaGraphDestroy(g);
	if (ret) {
		b->err = 0;
		return ret;
	}
	*graph = exec;
	return 0;
}

static int cuda_graph_launch(struct backend *be, void *graph)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_pending_flush(b);
	return CUDA_CHECK(b, cudaGraphLaunch((cudaGraphExec_t)graph, b->stream));
}

static void cuda_graph_destroy(struct backend *be, void *graph)
{
	(void)be;
	if (graph)
		cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

const struct backend_ops backend_cuda_ops = {
	.name = "cuda",
	.kv_dtype = K_BF16,
	.host_memory = 0,
	.create = cuda_create,
	.destroy = cuda_destroy,
	.alloc = cuda_alloc,
	.free = cuda_free,
	.host_alloc = cuda_host_alloc,
	.host_free = cuda_host_free,
	.upload = cuda_upload,
	.download = cuda_download,
	.sync = cuda_sync,
	.embed = cuda_embed,
	.rmsnorm = cuda_rmsnorm,
	.add = cuda_add,
	.silu_mul = cuda_silu_mul,
	.linear = cuda_linear,
	.rope = cuda_rope,
	.kv_write = cuda_kv_write,
	.attn_gqa = cuda_attn_gqa,
	.attn_mla = cuda_attn_mla,
	.moe_route = cuda_moe_route,
	.moe_experts = cuda_moe_experts,
	.moe_experts_add = cuda_moe_experts_add,
	.reserve = cuda_reserve,
	.qkv_prep = cuda_qkv_prep,
	.mla_post = cuda_mla_post,
	.mla_prep = cuda_mla_prep,
	.gate_up_silu = cuda_gate_up_silu,
	.linear_add = cuda_linear_add,
	.sample = cuda_sample,
	.capture_begin = cuda_capture_begin,
	.capture_end = cuda_capture_end,
	.graph_launch = cuda_graph_launch,
	.graph_destroy = cuda_graph_destroy,
};
