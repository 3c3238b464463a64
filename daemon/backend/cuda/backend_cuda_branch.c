/* The backend's branch op: a second queue beside b->stream for work that depends on an
 * earlier point of the step only (the MoE layer's shared expert needs just the normed
 * x), so that it runs while the main queue's latency-bound chain (router, routing, the
 * routed experts) does. Captured, the branch is a parallel path of the step's graph:
 * the events become edges, no nodes.
 *
 * While on the branch, b->stream and b->lin are the branch's own (a stream and a linear
 * context with its own split workspaces and counters, marked shared: its kernels must
 * not wait for CTAs that the main queue's kernels keep from being resident). Ops
 * queued there use the backend's other scratch as they would in line (b->fused,
 * b->wtmp, the pending SwiGLU): none of the main queue's ops that may run meanwhile
 * (the router's fp32 linear, moe_route, moe_experts) touches those.
 *
 * Measured and removed (session 21, docs/PERFORMANCE.md): a dense layer's gate/up
 * heads asked of L2 on the branch while its attention ran (cp.async.bulk.prefetch.L2
 * a row) made every Llama-3.1-8B step slower, 16 MB or 32 MB a layer alike. */
#include <errno.h>
#include <stdlib.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/log.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"

struct cuda_branch {
	cudaStream_t stream;		/* the branch's queue */
	struct k_cuda_linear *lin;	/* its linear context (shared) */
	cudaEvent_t mark;		/* MARK on the main queue: where BEGIN starts */
	cudaEvent_t done;		/* END on the branch: what JOIN waits for */
	cudaStream_t main_stream;	/* b->stream and b->lin while on the branch */
	struct k_cuda_linear *main_lin;
	int shared_rows;		/* KDEC_MOE_SHARED_BRANCH: MARK declines beyond */
	int marked, on, owed;		/* MARK not yet begun; between BEGIN and END; work
					 * the main queue has not waited for */
};

int cuda_branch_create(struct backend_cuda *b, int max_M)
{
	const struct model_config *c = &b->m->cfg;
	const struct k_cuda_tuning *t = k_cuda_tuning();
	struct cuda_branch *br;
	int ret;

	if (t->moe_shared_branch <= 0 || c->n_experts <= 0 || c->n_shared_experts <= 0)
		return 0;	/* nothing would take it */
	br = calloc(1, sizeof(*br));
	if (!br)
		return -ENOMEM;
	br->shared_rows = t->moe_shared_branch;
	b->branch = br;
	if ((ret = CUDA_CHECK(b, cudaStreamCreateWithFlags(&br->stream, cudaStreamNonBlocking))) ||
	    (ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&br->mark, cudaEventDisableTiming))) ||
	    (ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&br->done, cudaEventDisableTiming))) ||
	    (ret = k_cuda_linear_create(&br->lin, br->stream, max_M, b->max_K)))
		return ret;	/* cuda_branch_destroy (from cuda_destroy) frees the rest */
	k_cuda_linear_set_shared(br->lin, 1);
	log_info("cuda: MoE shared experts on a branch of the step beside the routed ones, up to %d rows (KDEC_MOE_SHARED_BRANCH)",
		 br->shared_rows);
	return 0;
}

struct k_cuda_linear *cuda_branch_linear(const struct backend_cuda *b)
{
	return b->branch ? b->branch->lin : NULL;
}

void cuda_branch_destroy(struct backend_cuda *b)
{
	struct cuda_branch *br = b->branch;

	if (!br)
		return;
	k_cuda_linear_destroy(br->lin);
	if (br->mark)
		cudaEventDestroy(br->mark);
	if (br->done)
		cudaEventDestroy(br->done);
	if (br->stream)
		cudaStreamDestroy(br->stream);
	free(br);
	b->branch = NULL;
}

/* END: the branch's last work noted, the main queue's own back. */
static int branch_end(struct backend_cuda *b, struct cuda_branch *br)
{
	int ret = CUDA_CHECK(b, cudaEventRecord(br->done, br->stream));

	b->stream = br->main_stream;
	b->lin = br->main_lin;
	br->on = 0;
	br->owed = 1;
	return ret;
}

/* JOIN: the main queue waits for all of the branch's work so far. */
static int branch_join(struct backend_cuda *b, struct cuda_branch *br)
{
	if (!br->owed)
		return 0;
	br->owed = 0;
	return CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, br->done, 0));
}

void cuda_branch_settle(struct backend_cuda *b)
{
	struct cuda_branch *br = b->branch;

	if (!br)
		return;
	if (br->on)
		branch_end(b, br);
	branch_join(b, br);
	/* a MARK stays: it is on the main queue, before anything the sync waited for
	 * (the routing trace reads each MoE layer's routing between MARK and BEGIN) */
}

int cuda_branch(struct backend *be, enum backend_branch step, int rows)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_branch *br = b->branch;
	int ret = 0;

	if (step == BACKEND_BRANCH_MARK) {
		if (!br || rows > br->shared_rows || br->on)
			return 1;
		/* what the mark stands for must be written: a norm or SwiGLU left pending
		 * to the next linear is written now, on the main queue */
		cuda_pending_settle(b);
		ret = CUDA_CHECK(b, cudaEventRecord(br->mark, b->stream));
		br->marked = !ret;
		return ret;
	}
	if (!br || (step == BACKEND_BRANCH_BEGIN && (!br->marked || br->on)) ||
	    (step == BACKEND_BRANCH_END && !br->on) || (step == BACKEND_BRANCH_JOIN && br->on)) {
		cuda_fail(b, -EINVAL, "branch: steps out of order (MARK, BEGIN, END, JOIN)");
		return -EINVAL;
	}
	switch (step) {
	case BACKEND_BRANCH_BEGIN:
		cuda_pending_settle(b);
		ret = CUDA_CHECK(b, cudaStreamWaitEvent(br->stream, br->mark, 0));
		br->main_stream = b->stream;
		br->main_lin = b->lin;
		b->stream = br->stream;
		b->lin = br->lin;
		k_cuda_linear_x_ready(b->lin, NULL, 0, 0);	/* the mark of an earlier step */
		br->marked = 0;
		br->on = 1;
		break;
	case BACKEND_BRANCH_END:
		cuda_pending_settle(b);	/* on the branch: the branch's SwiGLU */
		ret = branch_end(b, br);
		break;
	case BACKEND_BRANCH_JOIN:
		ret = branch_join(b, br);
		break;
	default:
		break;
	}
	return ret;	/* a failed call is logged and kept for the next sync */
}
