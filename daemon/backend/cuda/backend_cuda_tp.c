/* The CUDA backend's tensor-parallel ops (docs/PARALLEL.md): the ranks' embedding and
 * their reduction through k_cuda_ar_fused (fp32 payload, exact: the sum in rank order
 * as tp_comm.c computes it on the CPU), with the residual add and, where the engine
 * asks, the next RMSNorm in the same kernel (its gamma form). Virtual ranks (several on one GPU, each a
 * backend with its own stream) are what one GPU can run; one rank per GPU waits for a
 * multi-GPU machine.
 *
 * Why a reduction cannot deadlock with ranks sharing a GPU: every rank's kernel spins
 * until every rank's partial has arrived, so all ranks' reduction kernels must be
 * resident together. (1) tp_arrive records an event on each rank's stream; the
 * caller's barrier then guarantees every rank's event is recorded before any rank
 * calls tp_reduce, which makes its stream wait for all of them: no reduction kernel
 * starts before every rank's work before it is done, so no spinning CTA can keep
 * another rank's GEMM from the SMs. Once they start, the reduction kernels are the
 * only work of the ranks the GPU may run (each stream's next work waits for its own
 * reduction), and k_cuda_ar_fused sizes each grid to 1/N of what fits. (2) The
 * caller's second barrier, after every rank has queued its tp_reduce, keeps any rank
 * from queueing work that depends on its reduction ahead of another rank's reduction:
 * streams may share a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS), in which a kernel
 * waiting in stream order would block the kernel its own reduction waits for.
 *
 * Graphs (tp_capture_begin..end, forward_tp_graph.c): ranks sharing the device
 * (BACKEND_TP_GRAPH_ONE) are captured into one graph, rank 0's stream forking into
 * every rank's; a reduction there is one node, k_cuda_ar_fused_all of every rank's
 * part (tp_reduce records the part, tp_reduce_join launches and joins), so its CTAs
 * wait only for CTAs of the same launch, which is sized to be resident whole; the
 * graph's edges stand where the events and barriers stand op by op. Ranks on devices
 * of their own (BACKEND_TP_GRAPH_PER_RANK) capture a graph each, k_cuda_ar_fused
 * inside with no event: no work but its own rank's is on a GPU, so every rank's k-th
 * reduction starts once its own work before it is done (docs/PARALLEL.md, the
 * induction), and the sentinels in the data are the only wait. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/log.h"
#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/linear/k_cuda_linear.h"

struct cuda_tp_comm {
	int n, width;
	struct k_cuda_ar *ar;		/* the fused kernel's buffers, or NULL: */
	struct cuda_nccl *nccl;		/* NCCL (--allreduce, backend_cuda_nccl.c) */
	cudaEvent_t arrived[K_CUDA_AR_MAX_RANKS];	/* rank r's work before the reduction */
	enum backend_tp_graph kind;	/* how a step is captured (the ranks' devices) */
	/* a capture in flight: its kind (set by rank 0's tp_capture_begin, read by the
	 * others after the caller's barrier), or BACKEND_TP_GRAPH_NONE */
	enum backend_tp_graph capturing;
	/* BACKEND_TP_GRAPH_ONE: rank 0's capture forked into every rank's stream, the
	 * one-launch reduction done, rank r's work joined back at the end */
	cudaEvent_t fork, done, join[K_CUDA_AR_MAX_RANKS];
	struct k_cuda_ar_io io[K_CUDA_AR_MAX_RANKS];	/* each rank's part of the reduction
							 * being recorded (tp_reduce) */
	int rows[K_CUDA_AR_MAX_RANKS];
	float eps;
};

void cuda_thread_attach(struct backend *be)
{
	struct backend_cuda *b = cuda_of(be);

	CUDA_CHECK(b, cudaSetDevice(b->dev));
}

void cuda_embed_shard(struct backend *be, float *out, const int32_t *ids, int n,
		      const struct model_tensor *table, int v0)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_EMBED);
	cuda_op_end(b, CUDA_OP_EMBED, k_cuda_embed_shard(b->stream, out, ids, n, W(b, table),
							 (int)table->rows, (int)table->cols, v0));
}

void cuda_experts_shard(struct backend *be, int32_t *ids, int n, int e0, int ne)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_MOE_ROUTE);	/* timed as the routing it finishes */
	cuda_op_end(b, CUDA_OP_MOE_ROUTE, k_cuda_experts_shard(b->stream, ids, n, e0, ne));
}

void cuda_tp_comm_destroy(void *comm)
{
	struct cuda_tp_comm *c = comm;

	if (!c)
		return;
	k_cuda_ar_destroy(c->ar);
	cuda_nccl_destroy(c->nccl);
	for (int r = 0; r < c->n; r++) {
		if (c->arrived[r])
			cudaEventDestroy(c->arrived[r]);
		if (c->join[r])
			cudaEventDestroy(c->join[r]);
	}
	if (c->fork)
		cudaEventDestroy(c->fork);
	if (c->done)
		cudaEventDestroy(c->done);
	free(c);
}

int cuda_tp_comm_create(struct backend *const *ranks, int n, int max_rows, int width,
			void **comm, char *err, size_t err_len)
{
	struct cuda_tp_comm *c;
	struct cuda_nccl *nccl = NULL;
	int devs[K_CUDA_AR_MAX_RANKS], ret;

	*comm = NULL;
	/* --allreduce: NCCL where chosen, else the fused kernel (backend_cuda_nccl.c) */
	if (n >= 1 && n <= K_CUDA_AR_MAX_RANKS && (ret = cuda_nccl_pick(ranks, n, &nccl, err, err_len)))
		return ret;
	if (!nccl && (n < 2 || n > K_CUDA_AR_MAX_RANKS || width % 8 || width < 8)) {
		snprintf(err, err_len, "cuda: tp %d of hidden size %d: the GPU reduction takes 2..%d "
			 "ranks and a hidden size that is a multiple of 8", n, width,
			 K_CUDA_AR_MAX_RANKS);
		return -EINVAL;
	}
	c = calloc(1, sizeof(*c));
	if (!c) {
		cuda_nccl_destroy(nccl);
		return -ENOMEM;
	}
	c->n = n;
	c->width = width;
	c->nccl = nccl;
	for (int r = 0; r < n; r++)
		devs[r] = cuda_of(ranks[r])->dev;
	ret = nccl ? 0 : k_cuda_ar_create(&c->ar, n, devs, K_CUDA_AR_F32, max_rows, width);
	if (ret && !nccl) {	/* auto's fused kernel could not be set up: NCCL where it can run */
		char e2[256] = "";

		if (!(ret = cuda_nccl_fallback(ranks, n, ret, &nccl, e2, sizeof(e2))))
			c->nccl = nccl;
		else if (e2[0]) {
			snprintf(err, err_len, "%s", e2);
			cuda_tp_comm_destroy(c);
			return ret;
		}
	}
	for (int r = 0; r < n && !ret; r++) {
		struct backend_cuda *b = cuda_of(ranks[r]);

		if (!(ret = CUDA_CHECK(b, cudaSetDevice(b->dev))))
			ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->arrived[r], cudaEventDisableTiming));
		if (!ret)
			ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->join[r], cudaEventDisableTiming));
		if (!ret && r == 0)
			ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming));
		if (!ret && r == 0)
			ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
	}
	c->kind = backend_tp_graph_kind(devs, n);
	for (int r = 0; r < n; r++)	/* ranks sharing a GPU run at once: no co-residency */
		for (int o = 0; o < n; o++)
			if (o != r && devs[o] == devs[r])
				k_cuda_linear_set_shared(cuda_of(ranks[r])->lin, 1);
	if (!ret)	/* the caller's thread: rank 0's GPU current again */
		ret = CUDA_CHECK(cuda_of(ranks[0]), cudaSetDevice(cuda_of(ranks[0])->dev));
	if (ret) {
		snprintf(err, err_len, "cuda: tp %d: cannot make the reduction's buffers for %d rows "
			 "of %d values (%s)", n, max_rows, width, strerror(-ret));
		cuda_tp_comm_destroy(c);
		return ret;
	}
	{
		const char *graphs = c->kind == BACKEND_TP_GRAPH_ONE ? "one graph of every rank's step" :
				     c->kind == BACKEND_TP_GRAPH_PER_RANK ? "a graph per rank" :
				     "none (some ranks share a GPU, not all)";

		char on[96];
		size_t k = 0;

		on[0] = '\0';	/* the GPUs the ranks are on, in rank order */
		for (int r = 0; r < n && k < sizeof(on) - 8; r++)
			if (!r || devs[r] != devs[0])
				k += (size_t)snprintf(on + k, sizeof(on) - k, "%s%d", k ? "," : "", devs[r]);
		if (!nccl)
			log_info("cuda: tp %d: the reduction (k_cuda_ar_fused, fp32 payload) for up to %d "
				 "rows of %d, on GPU%s %s%s; decode graphs: %s", n, max_rows, width,
				 strchr(on, ',') ? "s" : "", on,
				 k_cuda_ar_ranks_per_device(c->ar) > 1 ? " (virtual ranks: one GPU)" : "",
				 graphs);
		else if (n > 1)
			log_info("cuda: tp %d: decode graphs: %s", n, graphs);
	}
	*comm = c;
	return 0;
}

int cuda_tp_arrive(struct backend *be, void *comm, int rank)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;

	if (c->capturing == BACKEND_TP_GRAPH_PER_RANK)
		return 0;	/* a graph per rank: no event crosses between them */
	return CUDA_CHECK(b, cudaEventRecord(c->arrived[rank], b->stream));
}

int cuda_tp_reduce(struct backend *be, void *comm, int rank, float *buf, int rows, float *residual,
		   const struct model_tensor *gamma, float *out, float eps)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;
	struct k_cuda_ar_io io = { .partial = buf, .residual = residual, .out = residual ? NULL : buf };
	int ret = 0;

	cuda_pending_settle(b);	/* a norm or SwiGLU left pending is written before */
	if (c->nccl)	/* NCCL waits for the other ranks itself */
		return cuda_nccl_reduce(be, c->nccl, rank, buf, rows, c->width, residual,
					gamma ? V(b, gamma) : NULL, out, eps);
	if (gamma) {	/* the next RMSNorm in the reduction: out fp32, and bf16 for the
			 * linear that reads it next, as cuda_rmsnorm leaves it */
		if (!residual || !out)
			return -EINVAL;
		io.gamma = V(b, gamma);
		io.out = out;
		io.out_bf16 = k_cuda_linear_x_scratch(b->lin, rows, c->width);
	}
	/* it writes the residual (or buf): a bf16 copy of x marked ready is stale after */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	if (c->capturing == BACKEND_TP_GRAPH_ONE) {	/* recorded: tp_reduce_join launches it */
		c->io[rank] = io;
		c->rows[rank] = rows;
		c->eps = eps;
		if (io.out_bf16)
			k_cuda_linear_x_ready(b->lin, out, rows, c->width);
		return 0;
	}
	for (int r = 0; r < c->n && !ret && c->capturing != BACKEND_TP_GRAPH_PER_RANK; r++)
		if (r != rank)
			ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->arrived[r], 0));
	if (!ret)
		ret = k_cuda_ar_fused(c->ar, rank, b->stream, &io, rows, c->width, eps);
	if (!ret && io.out_bf16)
		k_cuda_linear_x_ready(b->lin, out, rows, c->width);
	cuda_fail(b, ret, "tp_reduce (k_cuda_ar_fused)");
	return ret;
}

enum backend_tp_graph cuda_tp_graph_kind(void *comm)
{
	return ((struct cuda_tp_comm *)comm)->kind;
}

int cuda_tp_capture_begin(struct backend *be, void *comm, int rank)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;
	int ret;

	/* as cuda_capture_begin: no bf16 mark from before the capture is taken inside */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
	if (c->kind == BACKEND_TP_GRAPH_NONE)
		return -EOPNOTSUPP;
	if (c->kind == BACKEND_TP_GRAPH_PER_RANK || rank == 0) {
		/* relaxed: the other ranks' threads queue into the forked streams */
		ret = CUDA_CHECK(b, cudaStreamBeginCapture(b->stream, c->kind == BACKEND_TP_GRAPH_ONE ?
							   cudaStreamCaptureModeRelaxed :
							   cudaStreamCaptureModeThreadLocal));
		if (!ret && c->kind == BACKEND_TP_GRAPH_ONE)
			ret = CUDA_CHECK(b, cudaEventRecord(c->fork, b->stream));
		if (rank == 0)
			c->capturing = ret ? BACKEND_TP_GRAPH_NONE : c->kind;
	} else {	/* after the caller's barrier: rank 0 forked */
		ret = c->capturing == BACKEND_TP_GRAPH_ONE ? 0 : -EIO;
		if (!ret)
			ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->fork, 0));
	}
	b->capturing = !ret;
	return ret;
}

int cuda_tp_capture_end(struct backend *be, void *comm, int rank, void **graph, int *n_nodes)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;
	int ret = 0;

	*graph = NULL;
	*n_nodes = 0;
	b->capturing = 0;
	cuda_pending_settle(b);	/* inside the graph, not after it */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);	/* nor one left inside it, after it */
	if (c->kind == BACKEND_TP_GRAPH_ONE && rank != 0)	/* joined back into rank 0's */
		return CUDA_CHECK(b, cudaEventRecord(c->join[rank], b->stream));
	if (c->kind == BACKEND_TP_GRAPH_ONE) {
		if (c->capturing != BACKEND_TP_GRAPH_ONE)
			return -EIO;	/* its begin failed: nothing to end */
		for (int r = 1; r < c->n; r++) {	/* every branch, even after a failure */
			int w = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->join[r], 0));

			ret = ret ? ret : w;
		}
	}
	if (rank == 0)
		c->capturing = BACKEND_TP_GRAPH_NONE;
	return cuda_capture_finish(b, graph, n_nodes, ret);
}

int cuda_tp_reduce_join(struct backend *be, void *comm, int rank, int phase)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;
	int ret = 0;

	if (c->capturing != BACKEND_TP_GRAPH_ONE)
		return 0;
	if (phase == 1 && rank != 0)	/* after rank 0 queued it: this rank's work follows it */
		ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->done, 0));
	if (phase == 0 && rank == 0) {	/* every rank's marked work, then one launch */
		for (int r = 1; r < c->n && !ret; r++) {
			if (c->rows[r] != c->rows[0])
				ret = -EINVAL;
			if (!ret)
				ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->arrived[r], 0));
		}
		if (!ret)
			ret = k_cuda_ar_fused_all(c->ar, b->stream, c->io, c->rows[0], c->width, c->eps);
		if (!ret)
			ret = CUDA_CHECK(b, cudaEventRecord(c->done, b->stream));
	}
	cuda_fail(b, ret, "tp_reduce_join (k_cuda_ar_fused_all)");
	return ret;
}

void cuda_tp_argmax(struct backend *be, void *best, const float *logits, int rows, int vn, int v0)
{
	struct backend_cuda *b = cuda_of(be);

	cuda_op_begin(b, CUDA_OP_SAMPLE);	/* timed as the draw it is */
	cuda_op_end(b, CUDA_OP_SAMPLE, k_cuda_argmax_slice(b->stream, best, logits, rows, vn, v0));
}

/* The result's words, then the kernel's scratch from a 256-byte boundary: the layout
 * depends on rows alone, so a buffer made for more rows serves fewer. */
static size_t topk_result_bytes(int rows)
{
	return (BACKEND_TP_TOPK_WORDS(rows) * sizeof(uint32_t) + 255) & ~(size_t)255;
}

size_t cuda_tp_topk_bytes(int rows, int vn)
{
	return topk_result_bytes(rows) + k_cuda_topk_slice_ws_bytes(rows, vn);
}

void cuda_tp_topk(struct backend *be, void *top, const float *logits, int rows, int vn, int v0)
{
	struct backend_cuda *b = cuda_of(be);
	size_t ws = k_cuda_topk_slice_ws_bytes(rows, vn);

	_Static_assert(BACKEND_TP_TOPK == K_CUDA_TOPK_SLICE_K, "the kernel's K is the op's");
	cuda_op_begin(b, CUDA_OP_SAMPLE);
	cuda_op_end(b, CUDA_OP_SAMPLE,
		    k_cuda_topk_slice(b->stream, top, ws ? (char *)top + topk_result_bytes(rows) : NULL,
				      ws, logits, rows, vn, v0));
}

const char *cuda_tp_comm_name(void *comm)
{
	struct cuda_tp_comm *c = comm;

	return c->nccl ? cuda_nccl_name(c->nccl) : "fused (k_cuda_ar_fused)";
}
