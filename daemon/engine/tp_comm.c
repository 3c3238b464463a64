/* The ranks' barrier and shared-memory all-reduce (tp_comm.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/tp_comm.h"
#include "kernels/cpu/k_cpu.h"

void tp_barrier_init(struct tp_barrier *b, int n)
{
	memset(b, 0, sizeof(*b));
	pthread_mutex_init(&b->lock, NULL);
	pthread_cond_init(&b->cond, NULL);
	b->n = n;
}

void tp_barrier_fini(struct tp_barrier *b)
{
	pthread_mutex_destroy(&b->lock);
	pthread_cond_destroy(&b->cond);
}

int tp_barrier_wait(struct tp_barrier *b)
{
	int ret = 0;

	pthread_mutex_lock(&b->lock);
	if (b->broken) {
		ret = -ECANCELED;
	} else if (++b->waiting == b->n) {
		b->waiting = 0;
		b->gen++;
		pthread_cond_broadcast(&b->cond);
	} else {
		unsigned gen = b->gen;

		while (gen == b->gen && !b->broken)
			pthread_cond_wait(&b->cond, &b->lock);
		if (gen == b->gen)
			ret = -ECANCELED;
	}
	pthread_mutex_unlock(&b->lock);
	return ret;
}

void tp_barrier_break(struct tp_barrier *b)
{
	pthread_mutex_lock(&b->lock);
	b->broken = 1;
	b->waiting = 0;
	pthread_cond_broadcast(&b->cond);
	pthread_mutex_unlock(&b->lock);
}

void tp_barrier_reset(struct tp_barrier *b)
{
	pthread_mutex_lock(&b->lock);
	b->broken = 0;
	b->waiting = 0;
	pthread_mutex_unlock(&b->lock);
}

int tp_comm_init(struct tp_comm *c, int n, size_t cap)
{
	memset(c, 0, sizeof(*c));
	if (n < 1 || n > TP_COMM_MAX_RANKS)
		return -EINVAL;
	c->sum = malloc((cap ? cap : 1) * sizeof(float));
	c->normed = malloc((cap ? cap : 1) * sizeof(float));
	if (!c->sum || !c->normed) {
		free(c->sum);
		free(c->normed);
		c->sum = c->normed = NULL;
		return -ENOMEM;
	}
	c->n = n;
	c->cap = cap;
	tp_barrier_init(&c->bar, n);
	return 0;
}

void tp_comm_fini(struct tp_comm *c)
{
	if (!c->sum)
		return;
	tp_barrier_fini(&c->bar);
	free(c->sum);
	free(c->normed);
	c->sum = c->normed = NULL;
}

int tp_comm_reduce(struct tp_comm *c, int r, float *buf, size_t n, float *residual)
{
	size_t i0 = n * (size_t)r / (size_t)c->n, i1 = n * (size_t)(r + 1) / (size_t)c->n;
	int N = c->n, ret;

	if (n > c->cap) {
		tp_barrier_break(&c->bar);
		return -EINVAL;
	}
	c->bufs[r] = buf;
	if ((ret = tp_barrier_wait(&c->bar)))
		return ret;
	/* this rank's share of the elements, summed in rank order: the same bits
	 * whichever rank sums them */
	for (size_t i = i0; i < i1; i++) {
		float s = c->bufs[0][i];

		for (int k = 1; k < N; k++)
			s += c->bufs[k][i];
		c->sum[i] = s;
	}
	/* after this barrier the bufs are read no more: each rank may write its own
	 * again, and the next reduction's first barrier waits for every read of sum */
	if ((ret = tp_barrier_wait(&c->bar)))
		return ret;
	if (!residual) {
		memcpy(buf, c->sum, n * sizeof(float));
		return 0;
	}
	for (size_t i = 0; i < n; i++)	/* y += x, as the add op does */
		residual[i] += c->sum[i];
	return 0;
}

int tp_comm_reduce_norm(struct tp_comm *c, int r, float *buf, size_t n, float *residual,
			const struct tp_norm *norm)
{
	size_t w, rows, r0, r1;
	int N = c->n, ret;

	if (!norm)
		return tp_comm_reduce(c, r, buf, n, residual);
	w = (size_t)(norm->width > 0 ? norm->width : 1);
	rows = n / w;
	if (n > c->cap || !residual || n % w) {
		tp_barrier_break(&c->bar);
		return -EINVAL;
	}
	r0 = rows * (size_t)r / (size_t)N;
	r1 = rows * (size_t)(r + 1) / (size_t)N;
	c->bufs[r] = buf;
	if ((ret = tp_barrier_wait(&c->bar)))
		return ret;
	/* this rank's rows: the sum in rank order added to the residual (every rank's
	 * residual holds the same bits), then normalised, once for all ranks */
	for (size_t i = r0 * w; i < r1 * w; i++) {
		float s = c->bufs[0][i];

		for (int k = 1; k < N; k++)
			s += c->bufs[k][i];
		c->sum[i] = residual[i] + s;
	}
	if (r1 > r0)
		k_cpu_rmsnorm(c->normed + r0 * w, (int)w, c->sum + r0 * w, (int)w, norm->gamma,
			      norm->dtype, (int)(r1 - r0), (int)w, norm->eps);
	/* as tp_comm_reduce: after this barrier the bufs are read no more (out may be
	 * one of them) */
	if ((ret = tp_barrier_wait(&c->bar)))
		return ret;
	memcpy(residual, c->sum, n * sizeof(float));
	memcpy(norm->out, c->normed, n * sizeof(float));
	return 0;
}
