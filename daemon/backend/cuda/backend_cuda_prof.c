/* The CUDA backend's op times (KDEC_CUDA_OP_TIMES=1: decode steps, 2: prefill chunks):
 * an event between every two ops of an eager step, resolved at each sync into GPU time
 * by op, a table at destroy. */
#include <stdio.h>
#include <stdlib.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/log.h"
#include "kernels/cuda/k_cuda_tuning.h"

#define CUDA_PROF_MAX_PENDING 8192	/* ops timed between two syncs; later ones go untimed */

/* ev[0] is recorded at the first op after a sync; op i then ends at ev[i + 1], which is
 * where op i + 1 starts. */
struct cuda_prof {
	int n_pending;				/* ops queued since the last sync */
	enum cuda_op pending_op[CUDA_PROF_MAX_PENDING];
	cudaEvent_t ev[CUDA_PROF_MAX_PENDING + 1];
	double ms[CUDA_OP_COUNT];		/* by op, summed over the decode steps */
	long calls[CUDA_OP_COUNT];
	enum cuda_op order[CUDA_OP_COUNT];	/* the table's rows: ops as first timed */
	int n_ops;
	long syncs;
	int max_M;		/* widest linear since the last sync: > 64 is prefill */
	int prefill;		/* KDEC_CUDA_OP_TIMES=2: time prefill chunks, not decode steps */
};

void cuda_prof_create(struct backend_cuda *b)
{
	struct cuda_prof *p;

	if (!k_cuda_tuning()->op_times || !(p = calloc(1, sizeof(*p))))
		return;
	for (int i = 0; i <= CUDA_PROF_MAX_PENDING; i++)
		if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
			for (int j = 0; j < i; j++)
				cudaEventDestroy(p->ev[j]);
			free(p);
			return;
		}
	p->prefill = k_cuda_tuning()->op_times == 2;
	b->prof = p;
	log_info("cuda: timing every op of the %s (KDEC_CUDA_OP_TIMES=%d); graphs record no times",
		 p->prefill ? "prefill chunks" : "decode steps", k_cuda_tuning()->op_times);
}

/* The previous op's end is this op's start. */
void cuda_prof_begin(struct backend_cuda *b, enum cuda_op op)
{
	struct cuda_prof *p = b->prof;

	if (!p || b->capturing || p->n_pending >= CUDA_PROF_MAX_PENDING)
		return;
	if (p->n_pending == 0)
		cudaEventRecord(p->ev[0], b->stream);
	p->pending_op[p->n_pending] = op;
}

void cuda_prof_end(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;

	if (!p || b->capturing || p->n_pending >= CUDA_PROF_MAX_PENDING)
		return;
	cudaEventRecord(p->ev[++p->n_pending], b->stream);
}

void cuda_prof_rows(struct backend_cuda *b, int M)
{
	if (b->prof && M > b->prof->max_M)
		b->prof->max_M = M;
}

/* Every pending op's time into its row of the table. */
void cuda_prof_collect(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;

	if (!p)
		return;
	if ((p->max_M > 64) != p->prefill)
		p->n_pending = 0;	/* a step of the other kind */
	p->max_M = 0;
	for (int i = 0; i < p->n_pending; i++) {
		enum cuda_op op = p->pending_op[i];
		float ms = 0;

		cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]);
		if (!p->calls[op])
			p->order[p->n_ops++] = op;
		p->ms[op] += ms;
		p->calls[op]++;
	}
	p->syncs += p->n_pending > 0;
	p->n_pending = 0;
}

/* The table goes to stderr as it is, whatever the log level: it is what the variable
 * asked for (contrib/device/run.sh greps it out of a --log-level warn run). */
void cuda_prof_destroy(struct backend_cuda *b)
{
	struct cuda_prof *p = b->prof;
	double total = 0;

	if (!p)
		return;
	for (int k = 0; k < p->n_ops; k++)
		total += p->ms[p->order[k]];
	fprintf(stderr, "cuda op times of %s over %ld syncs (%.3f ms of GPU time in all):\n",
		p->prefill ? "prefill chunks" : "decode steps", p->syncs, total);
	fprintf(stderr, "  %-15s %10s %9s %10s %7s\n", "op", "total_ms", "calls", "avg_us", "share");
	for (int k = 0; k < p->n_ops; k++) {
		enum cuda_op op = p->order[k];

		fprintf(stderr, "  %-15s %10.3f %9ld %10.2f %6.1f%%\n", cuda_op_info[op].name,
			p->ms[op], p->calls[op], 1e3 * p->ms[op] / (double)p->calls[op],
			100 * p->ms[op] / (total > 0 ? total : 1));
	}
	for (int i = 0; i <= CUDA_PROF_MAX_PENDING; i++)
		cudaEventDestroy(p->ev[i]);
	free(p);
	b->prof = NULL;
}
