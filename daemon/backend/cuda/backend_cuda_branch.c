/* The backend's branch op: a second queue beside b->stream for work that depends on an
 * earlier point of the step only (the MoE layer's shared expert needs just the normed x),
 * so that it runs while the main queue's latency-bound chain (router, routing, the routed
 * experts) does. Captured, the branch is a parallel path of the step's graph: the
 * events become edges, no nodes.
 *
 * While on the branch, b->stream and b->lin are the branch's own (a stream and a linear
 * context with its own split workspaces and counters, marked shared: its kernels must
 * not wait for CTAs that the main queue's kernels keep from being resident). Ops
 * queued there use the backend's other scratch as they would in line (b->fused,
 * b->wtmp, the pending SwiGLU): none of the main queue's ops that may run meanwhile
 * (the router's fp32 linear, moe_route, moe_experts) touches those. */
#include <errno.h>
#include <stdlib.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/log.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/linear/k_cuda_linear.h"

enum branch_state { BRANCH_IDLE, BRANCH_MARKED, BRANCH_ON, BRANCH_OWED };

struct cuda_branch {
	cudaStream_t stream;		/* the branch's queue */
	struct k_cuda_linear *lin;	/* its linear context (shared) */
	cudaEvent_t mark;		/* MARK on the main queue: where the branch starts */
	cudaEvent_t done;		/* END on the branch: what JOIN waits for */
	cudaStream_t main_stream;	/* b->stream and b->lin while on the branch */
	struct k_cuda_linear *main_lin;
	int max_rows;			/* KDEC_MOE_SHARED_BRANCH: MARK declines beyond */
	enum branch_state state;
};

int cuda_branch_create(struct backend_cuda *b, int max_M)
{
	const struct model_config *c = &b->m->cfg;
	const int rows = k_cuda_tuning()->moe_shared_branch;
	struct cuda_branch *br;
	int ret;

	if (rows <= 0 || c->n_experts <= 0 || c->n_shared_experts <= 0)
		return 0;	/* nothing would take it */
	br = calloc(1, sizeof(*br));
	if (!br)
		return -ENOMEM;
	br->max_rows = rows;
	b->branch = br;
	if ((ret = CUDA_CHECK(b, cudaStreamCreateWithFlags(&br->stream, cudaStreamNonBlocking))) ||
	    (ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&br->mark, cudaEventDisableTiming))) ||
	    (ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&br->done, cudaEventDisableTiming))) ||
	    (ret = k_cuda_linear_create(&br->lin, br->stream, max_M, b->max_K)))
		return ret;	/* cuda_branch_destroy (from cuda_destroy) frees the rest */
	k_cuda_linear_set_shared(br->lin, 1);
	log_info("cuda: MoE shared experts on a branch of the step beside the routed ones, up to %d rows (KDEC_MOE_SHARED_BRANCH)",
		 rows);
	return 0;
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

/* Back to the main queue, which waits for the branch: END then JOIN. */
static int branch_join(struct backend_cuda *b, struct cuda_branch *br)
{
	int ret = 0;

	if (br->state == BRANCH_ON) {
		ret = CUDA_CHECK(b, cudaEventRecord(br->done, br->stream));
		b->stream = br->main_stream;
		b->lin = br->main_lin;
		br->state = BRANCH_OWED;
	}
	if (br->state == BRANCH_OWED) {
		int r = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, br->done, 0));

		ret = ret ? ret : r;
	}
	br->state = BRANCH_IDLE;
	return ret;
}

void cuda_branch_settle(struct backend_cuda *b)
{
	if (b->branch && b->branch->state != BRANCH_IDLE)
		branch_join(b, b->branch);
}

int cuda_branch(struct backend *be, enum backend_branch step, int rows)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_branch *br = b->branch;
	int ret = 0;

	if (step == BACKEND_BRANCH_MARK) {
		if (!br || rows > br->max_rows || br->state == BRANCH_ON || br->state == BRANCH_OWED)
			return 1;
		/* what the mark stands for must be written: a norm or SwiGLU left pending
		 * to the next linear is written now, on the main queue */
		cuda_pending_settle(b);
		ret = CUDA_CHECK(b, cudaEventRecord(br->mark, b->stream));
		br->state = ret ? BRANCH_IDLE : BRANCH_MARKED;
		return ret;
	}
	if (!br || (step == BACKEND_BRANCH_BEGIN && br->state != BRANCH_MARKED) ||
	    (step == BACKEND_BRANCH_END && br->state != BRANCH_ON) ||
	    (step == BACKEND_BRANCH_JOIN && br->state != BRANCH_OWED)) {
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
		br->state = BRANCH_ON;
		break;
	case BACKEND_BRANCH_END:
		cuda_pending_settle(b);	/* on the branch: the branch's SwiGLU */
		ret = CUDA_CHECK(b, cudaEventRecord(br->done, br->stream));
		b->stream = br->main_stream;
		b->lin = br->main_lin;
		br->state = BRANCH_OWED;
		break;
	case BACKEND_BRANCH_JOIN:
		ret = branch_join(b, br);
		break;
	default:
		break;
	}
	return ret;	/* a failed call is logged and kept for the next sync */
}
