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
 * waiting in stream order would block the kernel its own reduction waits for. */
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
	for (int r = 0; r < c->n; r++)
		if (c->arrived[r])
			cudaEventDestroy(c->arrived[r]);
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
	for (int r = 0; r < n && !ret; r++) {
		struct backend_cuda *b = cuda_of(ranks[r]);

		if (!(ret = CUDA_CHECK(b, cudaSetDevice(b->dev))))
			ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->arrived[r], cudaEventDisableTiming));
	}
	if (!ret)	/* the caller's thread: rank 0's GPU current again */
		ret = CUDA_CHECK(cuda_of(ranks[0]), cudaSetDevice(cuda_of(ranks[0])->dev));
	if (ret) {
		snprintf(err, err_len, "cuda: tp %d: cannot make the reduction's buffers for %d rows "
			 "of %d values (%s)", n, max_rows, width, strerror(-ret));
		cuda_tp_comm_destroy(c);
		return ret;
	}
	if (!nccl)
		log_info("cuda: tp %d: the reduction (k_cuda_ar_fused, fp32 payload) for up to %d rows "
			 "of %d, on GPU %d%s", n, max_rows, width, devs[0],
			 k_cuda_ar_ranks_per_device(c->ar) > 1 ? " (virtual ranks: one GPU)" : "");
	*comm = c;
	return 0;
}

int cuda_tp_arrive(struct backend *be, void *comm, int rank)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;

	return CUDA_CHECK(b, cudaEventRecord(c->arrived[rank], b->stream));
}

int cuda_tp_reduce(struct backend *be, void *comm, int rank, float *buf, int rows, float *residual,
		   const struct model_tensor *gamma, float *out, float eps)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_tp_comm *c = comm;
	struct k_cuda_ar_io io = { .partial = buf, .residual = residual, .out = residual ? NULL : buf };
	int ret = 0;

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
	for (int r = 0; r < c->n && !ret; r++)
		if (r != rank)
			ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->arrived[r], 0));
	if (!ret)
		ret = k_cuda_ar_fused(c->ar, rank, b->stream, &io, rows, c->width, eps);
	if (!ret && io.out_bf16)
		k_cuda_linear_x_ready(b->lin, out, rows, c->width);
	cuda_fail(b, ret, "tp_reduce (k_cuda_ar_fused)");
	return ret;
}

const char *cuda_tp_comm_name(void *comm)
{
	struct cuda_tp_comm *c = comm;

	return c->nccl ? cuda_nccl_name(c->nccl) : "fused (k_cuda_ar_fused)";
}
