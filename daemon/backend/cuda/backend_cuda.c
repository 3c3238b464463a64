/* The CUDA backend: its lifecycle (create, reserve, destroy), memory and copies, CUDA
 * graphs (capture, replay), its one error path, and the table of its entry points.
 * Weights and activations live in GPU memory; every op (backend_cuda_ops.c,
 * backend_cuda_fused.c) is kernels of kernels/cuda on one stream, asynchronous until
 * sync or a download; an op's failure is kept and reported by the next sync. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "kernels/cuda/sample/k_cuda_sample.h"

/* ---- errors ---------------------------------------------------------------- */

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

void cuda_fail(struct backend_cuda *b, int ret, const char *what)
{
	if (ret && !b->err) {
		log_error("cuda: %s failed: %s", what, strerror(-ret));
		b->err = ret;
	}
}

int cuda_dev_enter(const struct backend_cuda *b)
{
	int prev = b->dev;

	if (cudaGetDevice(&prev) != cudaSuccess) {
		cudaGetLastError();
		prev = b->dev;
	}
	if (prev != b->dev && cudaSetDevice(b->dev) != cudaSuccess)
		cudaGetLastError();	/* the call that follows fails and says so */
	return prev;
}

void cuda_dev_leave(const struct backend_cuda *b, int prev)
{
	if (prev != b->dev && cudaSetDevice(prev) != cudaSuccess)
		cudaGetLastError();
}

/* ---- lifecycle ------------------------------------------------------------- */

static void cuda_destroy(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	int prev;

	if (!b)
		return;
	prev = cuda_dev_enter(b);	/* its streams, events, handles and memory are on b->dev */
	cuda_prof_destroy(b);
	for (int i = 0; i < 2; i++)
		if (b->timer[i])
			cudaEventDestroy(b->timer[i]);
	k_cuda_sample_ws_destroy(b->sample_ws);
	cudaFree(b->fused);
	k_cuda_moe_ws_destroy(b->moe_ws);
	k_cuda_attn_ws_destroy(b->attn_ws);
	k_cuda_linear_destroy(b->lin);
	cuda_branch_destroy(b);
	cudaFree(b->wtmp);
	free(b->qw);
	free(b->moe_q);
	if (b->inv_freq)
		cudaFree(b->inv_freq);
	if (b->arena)
		cudaFree(b->arena);
	cuda_ptr_map_fini(&b->map);
	if (b->side)
		cudaStreamDestroy(b->side);
	pthread_mutex_destroy(&b->side_mu);
	if (b->stream)
		cudaStreamDestroy(b->stream);
	cuda_dev_leave(b, prev);
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

/* The KDEC_* tuning knobs, read from the environment once here and installed for the
 * kernels and the ops (k_cuda_tuning.h); a malformed value refuses the backend rather
 * than run an A/B measurement on the defaults unnoticed. */
static int tuning_install(char *err, size_t err_len)
{
	struct k_cuda_tuning t;
	char why[160];
	int ret = k_cuda_tuning_from_env(&t, why, sizeof(why));

	if (ret) {
		snprintf(err, err_len, "cuda backend: %s", why);
		return ret;
	}
	k_cuda_tuning_set(&t);
	return 0;
}

/* backend auto's question: a visible GPU, named in why. */
static int cuda_available(char *why, size_t why_len)
{
	char name[128] = "?";
	double gib = 0;
	int count = 0, major = 0, minor = 0;

	if (k_cuda_device_count(&count) || count == 0) {
		snprintf(why, why_len, "no usable GPU (driver or device missing)");
		return 0;
	}
	k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor);
	snprintf(why, why_len, "GPU 0 of %d: %s, %.1f GiB, sm_%d%d", count, name, gib, major, minor);
	return 1;
}

static int cuda_device_count(void)
{
	int count = 0;

	return k_cuda_device_count(&count) ? 0 : count;
}

static int cuda_create(struct backend **out, const struct model *m, const struct backend_opts *opts,
		       char *err, size_t err_len)
{
	struct backend_cuda *b;
	char name[128];
	double gib, t0 = clock_now();
	int count = 0, major, minor, ret;

	*out = NULL;
	if ((ret = tuning_install(err, err_len)))
		return ret;
	k_cuda_device_count(&count);
	if (count == 0) {
		snprintf(err, err_len, "cuda backend: no usable GPU (driver or device missing)");
		return -ENODEV;
	}
	b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->base.ops = &backend_cuda_ops;
	pthread_mutex_init(&b->side_mu, NULL);
	b->m = m;
	b->dev = opts && opts->device > 0 ? opts->device : 0;
	b->allreduce = opts ? opts->allreduce : BACKEND_AR_AUTO;
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
	/* then all in place before anything runs: a cudaMemcpy from pageable memory (the
	 * expert tables, the RoPE frequencies) may return before its DMA lands, and b->stream,
	 * non-blocking, would not wait for the legacy stream's copies */
	if ((ret = cuda_weights_upload(b, err, err_len)) || (ret = upload_rope(b, err, err_len)))
		goto err_destroy;
	if ((ret = CUDA_CHECK(b, cudaDeviceSynchronize()))) {
		snprintf(err, err_len, "cuda: copying the weights to GPU %d failed", b->dev);
		goto err_destroy;
	}
	log_info("cuda: %.2f GiB of weights on GPU %d in %.1f s", (double)b->arena_bytes / (1u << 30),
		 b->dev, clock_now() - t0);
	cuda_prof_create(b);
	*out = &b->base;
	return 0;

err_destroy:
	cuda_destroy(&b->base);
	return ret;
}

/* The f16 copy of one quantized weight for the linears of more than 64 rows (prefill,
 * large batches): the largest kept quantized weight's size, written before each such
 * linear (k_cuda_linear_q_run's DEQUANT). */
static int cuda_wtmp_reserve(struct backend_cuda *b)
{
	if (!b->n_qw || !b->wtmp_elems || b->wtmp)
		return 0;
	if (cudaMalloc((void **)&b->wtmp, b->wtmp_elems * sizeof(uint16_t)) != cudaSuccess) {
		cudaGetLastError();
		b->wtmp = NULL;
		return -ENOMEM;
	}
	b->alloc_bytes += b->wtmp_elems * sizeof(uint16_t);
	log_info("cuda: %.1f MiB of f16 scratch for the quantized linears of more than %d rows",
		 (double)b->wtmp_elems * 2 / (1 << 20), K_CUDA_LINEAR_Q_STREAM_MAX_M);
	return 0;
}

/* cuda_reserve with b's GPU current. */
static int cuda_reserve_on(struct backend_cuda *b, int max_rows, int max_ctx, int max_dim,
			   int max_M, char *err, size_t err_len)
{
	const struct model_config *c = &b->m->cfg;
	size_t free_b = 0, total_b = 0;
	int ret;

	if ((ret = k_cuda_linear_create(&b->lin, b->stream, max_M, b->max_K)) ||
	    (ret = k_cuda_attn_ws_create(&b->attn_ws, max_M, c->n_heads, max_dim, max_ctx)) ||
	    (c->n_experts > 0 &&
	     (ret = k_cuda_moe_ws_create(&b->moe_ws, max_M, c->top_k,
					 b->m->held_experts ? b->m->held_experts : c->n_experts,
					 c->hidden_size,
					 c->moe_intermediate_size,
					 c->n_shared_experts > 0 ?
					 c->moe_intermediate_size * c->n_shared_experts : 0))) ||
	    (ret = k_cuda_sample_ws_create(&b->sample_ws, 64, c->vocab_size)) ||
	    (ret = cuda_fused_reserve(b, max_M)) || (ret = cuda_wtmp_reserve(b)) ||
	    (ret = cuda_branch_create(b, max_M))) {
		cudaMemGetInfo(&free_b, &total_b);
		snprintf(err, err_len,
			 "cuda: cannot make the workspaces for %d rows x %d tokens of context (%.2f GiB free on GPU %d)",
			 max_rows, max_ctx, (double)free_b / (1u << 30), b->dev);
		return ret;
	}
	/* the workspaces' counters are zeroed by cudaMemset on the legacy stream, which
	 * b->stream (non-blocking) does not wait for: done before the first kernel */
	if ((ret = CUDA_CHECK(b, cudaDeviceSynchronize()))) {
		snprintf(err, err_len, "cuda: zeroing the workspaces on GPU %d failed", b->dev);
		return ret;
	}
	cudaMemGetInfo(&free_b, &total_b);
	log_info("cuda: GPU %d memory: weights %.2f GiB, KV cache and activations %.2f GiB, %.2f GiB free of %.2f GiB",
		 b->dev, (double)b->arena_bytes / (1u << 30), (double)b->alloc_bytes / (1u << 30),
		 (double)free_b / (1u << 30), (double)total_b / (1u << 30));
	return 0;
}

static int cuda_reserve(struct backend *be, int max_rows, int max_ctx, char *err, size_t err_len)
{
	struct backend_cuda *b = cuda_of(be);
	const struct model_config *c = &b->m->cfg;
	int max_dim = c->mla ? c->kv_lora_rank + c->qk_rope_head_dim : c->head_dim;
	int max_M = max_rows > 64 ? max_rows : 64;
	int ret, prev;

	if (c->mla && c->v_head_dim > max_dim)
		max_dim = c->v_head_dim;
	prev = cuda_dev_enter(b);
	ret = cuda_reserve_on(b, max_rows, max_ctx, max_dim, max_M, err, err_len);
	cuda_dev_leave(b, prev);
	return ret;
}

/* ---- memory ---------------------------------------------------------------- */

/* On b's GPU whatever the calling thread's current device (kv caches, sampling pairs:
 * the engine thread allocates for every rank). */
static void *cuda_alloc(struct backend *be, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);
	const int prev = cuda_dev_enter(b);
	void *p = NULL;

	if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
		size_t free_b = 0, total_b = 0;

		cudaGetLastError();
		cudaMemGetInfo(&free_b, &total_b);
		log_error("cuda: out of GPU memory: %.2f GiB requested, %.2f GiB free of %.2f GiB on GPU %d",
			  (double)bytes / (1u << 30), (double)free_b / (1u << 30),
			  (double)total_b / (1u << 30), b->dev);
		p = NULL;
	} else if (CUDA_CHECK(b, cudaMemsetAsync(p, 0, bytes ? bytes : 1, b->stream))) {
		cudaFree(p);
		p = NULL;
	} else {
		b->alloc_bytes += bytes;
	}
	cuda_dev_leave(b, prev);
	return p;
}

static void cuda_free(struct backend *be, void *p)
{
	struct backend_cuda *b = cuda_of(be);
	int prev;

	if (!p)
		return;
	prev = cuda_dev_enter(b);
	cudaFree(p);
	cuda_dev_leave(b, prev);
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

	return CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, b->stream));
}

static int cuda_download(struct backend *be, void *dst, const void *src, size_t bytes)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_pending_settle(b);	/* none is left pending past a step */
	cuda_branch_settle(b);
	ret = CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, b->stream));
	if (!ret)
		ret = CUDA_CHECK(b, cudaStreamSynchronize(b->stream));
	cuda_prof_collect(b);
	return ret ? ret : b->err;
}

static int cuda_sync(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	cuda_pending_settle(b);	/* none is left pending past a step */
	cuda_branch_settle(b);
	ret = CUDA_CHECK(b, cudaStreamSynchronize(b->stream));
	cuda_prof_collect(b);
	if (!ret)
		ret = b->err;
	b->err = 0;
	return ret;
}

/* ---- side copies (another thread) ---------------------------------------------
 * The host tier's mover copies KV blocks while the engine thread runs steps: on a
 * stream of their own, created non-blocking so it never waits for the legacy stream,
 * from and to the caller's page-locked buffer (host_alloc: DMA, no staging), then a
 * sync of that stream alone. The engine's graph captures use
 * cudaStreamCaptureModeThreadLocal, so these calls from another thread neither break
 * a capture nor are refused by one. Failures are logged here and returned, never kept
 * in b->err, which belongs to the engine thread's ops. */

static int side_check(const struct backend_cuda *b, cudaError_t e, const char *call)
{
	if (e == cudaSuccess)
		return 0;
	log_error("cuda: %s failed on GPU %d (side copy): %s", call, b->dev, cudaGetErrorString(e));
	return -EIO;
}

static int side_copy(struct backend_cuda *b, void *const *dev, uint8_t *host, int n, size_t bytes,
		     int to_device)
{
	int ret;

	pthread_mutex_lock(&b->side_mu);
	/* the current device is per thread: this one may never have set it */
	ret = side_check(b, cudaSetDevice(b->dev), "cudaSetDevice");
	if (!ret && !b->side)
		ret = side_check(b, cudaStreamCreateWithFlags(&b->side, cudaStreamNonBlocking),
				 "cudaStreamCreateWithFlags");
	for (int i = 0; i < n && !ret; i++)
		ret = side_check(b, to_device ?
				 cudaMemcpyAsync(dev[i], host + (size_t)i * bytes, bytes, cudaMemcpyHostToDevice, b->side) :
				 cudaMemcpyAsync(host + (size_t)i * bytes, dev[i], bytes, cudaMemcpyDeviceToHost, b->side),
				 "cudaMemcpyAsync");
	if (b->side) {	/* even after a failure: nothing of ours may still be in flight */
		int r = side_check(b, cudaStreamSynchronize(b->side), "cudaStreamSynchronize");

		ret = ret ? ret : r;
	}
	pthread_mutex_unlock(&b->side_mu);
	return ret;
}

static int cuda_side_download(struct backend *be, void *dst, void *const *src, int n, size_t bytes)
{
	return side_copy(cuda_of(be), src, dst, n, bytes, 0);
}

static int cuda_side_upload(struct backend *be, void *const *dst, const void *src, int n, size_t bytes)
{
	return side_copy(cuda_of(be), dst, (uint8_t *)src, n, bytes, 1);
}

/* ---- graphs ---------------------------------------------------------------- */

static int cuda_capture_begin(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	int ret;

	/* A bf16 "x ready" mark left by a producer queued before the capture names a
	 * scratch the graph never writes: its first linear call would take it and each
	 * replay read whatever the scratch held then. */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	ret = CUDA_CHECK(b, cudaStreamBeginCapture(b->stream, cudaStreamCaptureModeThreadLocal));

	b->capturing = !ret;
	return ret;
}

int cuda_capture_finish(struct backend_cuda *b, void **graph, int *n_nodes, int ret)
{
	cudaGraph_t g = NULL;
	cudaGraphExec_t exec = NULL;
	size_t nodes = 0;
	int r = CUDA_CHECK(b, cudaStreamEndCapture(b->stream, &g));

	*graph = NULL;
	ret = ret ? ret : r;
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

static int cuda_capture_end(struct backend *be, void **graph, int *n_nodes)
{
	struct backend_cuda *b = cuda_of(be);

	b->capturing = 0;
	cuda_pending_settle(b);	/* inside the graph, not after it */
	cuda_branch_settle(b);	/* a branch left open joins the graph's end */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);	/* nor one left inside it, after it */
	return cuda_capture_finish(b, graph, n_nodes, 0);
}

static int cuda_graph_launch(struct backend *be, void *graph)
{
	struct backend_cuda *b = cuda_of(be);

	return CUDA_CHECK(b, cudaGraphLaunch((cudaGraphExec_t)graph, b->stream));
}

static void cuda_graph_destroy(struct backend *be, void *graph)
{
	(void)be;
	if (graph)
		cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

/* ---- the queue's own clock ------------------------------------------------------ */

static int cuda_timer_mark(struct backend *be, int which)
{
	struct backend_cuda *b = cuda_of(be);
	int ret = 0;

	if (which < 0 || which > 1 || b->capturing)
		return -EINVAL;
	if (!b->timer[which])
		ret = CUDA_CHECK(b, cudaEventCreate(&b->timer[which]));
	return ret ? ret : CUDA_CHECK(b, cudaEventRecord(b->timer[which], b->stream));
}

static double cuda_timer_ms(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);
	float ms = -1;

	if (!b->timer[0] || !b->timer[1] ||
	    cudaEventElapsedTime(&ms, b->timer[0], b->timer[1]) != cudaSuccess) {
		cudaGetLastError();
		return -1;
	}
	return ms;
}

const struct backend_ops backend_cuda_ops = {
	.name = "cuda",
	.kv_dtype = K_BF16,
	.host_memory = 0,
	/* H200, Llama-3.1-8B, 1,024 prompt tokens: 24.7 ms as one call, 36.4 ms as four of
	 * 256 (GEMMs at M = 1,024 run at ~720 TFLOPS, at 256 at ~600; PERFORMANCE.md) */
	.prompt_rows = 2048,
	.available = cuda_available,
	.device_count = cuda_device_count,
	.create = cuda_create,
	.destroy = cuda_destroy,
	.alloc = cuda_alloc,
	.free = cuda_free,
	.host_alloc = cuda_host_alloc,
	.host_free = cuda_host_free,
	.upload = cuda_upload,
	.download = cuda_download,
	.sync = cuda_sync,
	.side_download = cuda_side_download,
	.side_upload = cuda_side_upload,
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
	/* optional and fused (backend_cuda_fused.c, but moe_experts_add) */
	.qkv_prep = cuda_qkv_prep,
	.mla_post = cuda_mla_post,
	.mla_prep = cuda_mla_prep,
	.gate_up_silu = cuda_gate_up_silu,
	.reserve = cuda_reserve,
	.linear_add = cuda_linear_add,
	.linear_fp32x = cuda_linear_fp32x,
	.linear_rounds_x = cuda_linear_rounds_x,
	.moe_experts_add = cuda_moe_experts_add,
	.moe_layer = cuda_moe_layer,
	.branch = cuda_branch,
	.qkv_prep_attn = cuda_qkv_prep_attn,
	.mla_prep_attn = cuda_mla_prep_attn,
	.sample = cuda_sample,
	/* tensor-parallel ranks (backend_cuda_tp.c) */
	.thread_attach = cuda_thread_attach,
	.embed_shard = cuda_embed_shard,
	.experts_shard = cuda_experts_shard,
	.tp_comm_create = cuda_tp_comm_create,
	.tp_comm_destroy = cuda_tp_comm_destroy,
	.tp_comm_name = cuda_tp_comm_name,
	.tp_arrive = cuda_tp_arrive,
	.tp_reduce = cuda_tp_reduce,
	.tp_graph_kind = cuda_tp_graph_kind,
	.tp_capture_begin = cuda_tp_capture_begin,
	.tp_capture_end = cuda_tp_capture_end,
	.tp_reduce_join = cuda_tp_reduce_join,
	.tp_argmax = cuda_tp_argmax,
	/* MLA decode context parallel (backend_cuda_mla_cp.c) */
	.mla_cp_create = cuda_mla_cp_create,
	.mla_cp_destroy = cuda_mla_cp_destroy,
	.mla_cp_step = cuda_mla_cp_step,
	.mla_cp_attn = cuda_mla_cp_attn,
	.tp_topk_bytes = cuda_tp_topk_bytes,
	.tp_topk = cuda_tp_topk,
	.capture_begin = cuda_capture_begin,
	.capture_end = cuda_capture_end,
	.graph_launch = cuda_graph_launch,
	.graph_destroy = cuda_graph_destroy,
	.timer_mark = cuda_timer_mark,
	.timer_ms = cuda_timer_ms,
};
