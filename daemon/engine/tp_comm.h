/* Where tensor-parallel ranks running as threads meet (docs/PARALLEL.md): a barrier that
 * sleeps (so more ranks than cores wait instead of spinning) and that a failing rank can
 * break, and the all-reduce of float buffers through shared memory. Used by
 * forward_tp.c and measured alone by kdbench allreduce. */
#ifndef KD_DAEMON_TP_COMM_H
#define KD_DAEMON_TP_COMM_H

#include <pthread.h>
#include <stddef.h>

#include "kernels/dtype.h"

#define TP_COMM_MAX_RANKS 64

struct tp_barrier {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int n, waiting;
	unsigned gen;
	int broken;		/* some rank failed: waits return at once */
};

void tp_barrier_init(struct tp_barrier *b, int n);
void tp_barrier_fini(struct tp_barrier *b);
/* 0 once all n arrived; -ECANCELED when the barrier is (or gets) broken. */
int tp_barrier_wait(struct tp_barrier *b);
void tp_barrier_break(struct tp_barrier *b);
/* Mends a broken barrier; only while no rank waits on it. */
void tp_barrier_reset(struct tp_barrier *b);

struct tp_comm {
	int n;
	struct tp_barrier bar;
	float *bufs[TP_COMM_MAX_RANKS];	/* each rank's partial, published */
	float *sum;			/* (cap) the reduced result */
	float *normed;			/* (cap) its RMSNorm (tp_comm_reduce_norm) */
	size_t cap;
};

/* The RMSNorm that follows a reduction, done inside it (tp_comm_reduce_norm). */
struct tp_norm {
	const void *gamma;	/* (width) the norm's weight, as stored */
	enum k_dtype dtype;	/* its dtype */
	int width;		/* values per row (hidden) */
	float eps;
	float *out;		/* (rows, width) this rank's rmsnorm(residual) * gamma */
};

/* n ranks (1..TP_COMM_MAX_RANKS), reductions of up to cap floats. 0 or -errno. */
int tp_comm_init(struct tp_comm *c, int n, size_t cap);
void tp_comm_fini(struct tp_comm *c);	/* accepts a zeroed one */

/* Rank r's part of an all-reduce every rank calls with its own buf (n floats): the sum
 * over ranks in rank order (the same bits on every rank) is added to residual (n
 * floats; the residual add fused into the read) or, residual NULL, written to buf.
 * 0; -ECANCELED when another rank failed (the barrier broken); -EINVAL past cap
 * (then it breaks the barrier itself, so no rank waits for it). */
int tp_comm_reduce(struct tp_comm *c, int r, float *buf, size_t n, float *residual);

/* tp_comm_reduce with residual and the next RMSNorm fused (norm NULL: the plain
 * form): rank r sums every rank's partial for its share of the rows (n / width rows,
 * split by rows, not elements: the norm needs whole rows), adds its residual's rows
 * and normalises them once, for every rank; then every rank copies the new residual
 * and norm->out. The same bits as the reduction followed by k_cpu_rmsnorm (which it
 * runs) on every rank. 0 or -errno as tp_comm_reduce. */
int tp_comm_reduce_norm(struct tp_comm *c, int r, float *buf, size_t n, float *residual,
			const struct tp_norm *norm);

#endif
