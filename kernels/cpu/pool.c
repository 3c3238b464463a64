/* The CPU thread pool: persistent workers that run one parallel-for at a time.
 * Tasks are handed out by an atomic counter; the caller takes tasks too. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels/cpu/k_cpu.h"

/* How long the caller polls for stragglers before sleeping: a decode step runs
 * many tiny parallel-fors, and a sleep/wake round trip costs more than the wait. */
#define K_POOL_SPIN	4096
/* How many pause instructions a worker waits for the next job before it sleeps
 * (tens of microseconds): the ops of a step come back to back, and waking sleeping
 * threads for each would cost more than the op itself on a small model. */
#define K_POOL_IDLE_SPIN	8192

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

struct k_pool {
	int n_threads;			/* including the caller */
	int n_workers;			/* threads actually started */
	pthread_t *threads;		/* (n_workers) */

	pthread_mutex_t lock;
	pthread_cond_t wake;		/* workers wait here for a new generation */
	pthread_cond_t idle;		/* the caller waits here for busy == 0 */
	atomic_ulong gen;		/* bumped once per k_pool_run, under lock; read lock-free by spinning workers */
	int busy;			/* workers inside the current job, under lock */
	int seats;			/* workers that may still join the current job, under lock */
	int stop;

	/* The current job; written under lock before gen is bumped. */
	k_pool_fn fn;
	void *arg;
	int n_tasks;
	atomic_int next;		/* next task to hand out */
	atomic_int done;		/* tasks finished */
};

/* Takes tasks until none are left; returns how many this thread ran. */
static void pool_drain(struct k_pool *pool, k_pool_fn fn, void *arg, int n_tasks)
{
	int ran = 0;

	for (;;) {
		int t = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);

		if (t >= n_tasks)
			break;
		fn(arg, t);
		ran++;
	}
	if (ran)
		atomic_fetch_add_explicit(&pool->done, ran, memory_order_release);
}

static void *pool_worker(void *p)
{
	struct k_pool *pool = p;
	unsigned long seen = 0;

	pthread_mutex_lock(&pool->lock);
	for (;;) {
		if (pool->gen == seen && !pool->stop) {
			pthread_mutex_unlock(&pool->lock);
			for (int i = 0; i < K_POOL_IDLE_SPIN &&
			     atomic_load_explicit(&pool->gen, memory_order_relaxed) == seen; i++)
				cpu_relax();
			pthread_mutex_lock(&pool->lock);
		}
		while (pool->gen == seen && !pool->stop)
			pthread_cond_wait(&pool->wake, &pool->lock);
		if (pool->stop)
			break;
		seen = pool->gen;
		/* A job of n tasks needs at most n - 1 helpers; the others would only
		 * contend for the counters (many cores, small layers). */
		if (pool->seats == 0)
			continue;
		pool->seats--;
		pool->busy++;
		k_pool_fn fn = pool->fn;
		void *arg = pool->arg;
		int n_tasks = pool->n_tasks;
		pthread_mutex_unlock(&pool->lock);

		pool_drain(pool, fn, arg, n_tasks);

		pthread_mutex_lock(&pool->lock);
		/* The caller may not post the next job (and reset the counters)
		 * while a worker still holds this job's fn. */
		if (--pool->busy == 0)
			pthread_cond_signal(&pool->idle);
	}
	pthread_mutex_unlock(&pool->lock);
	return NULL;
}

int k_pool_threads(const struct k_pool *pool)
{
	return pool ? pool->n_threads : 1;
}

void k_pool_destroy(struct k_pool *pool)
{
	if (!pool)
		return;
	pthread_mutex_lock(&pool->lock);
	pool->stop = 1;
	pthread_cond_broadcast(&pool->wake);
	pthread_mutex_unlock(&pool->lock);
	for (int i = 0; i < pool->n_workers; i++)
		pthread_join(pool->threads[i], NULL);
	pthread_cond_destroy(&pool->idle);
	pthread_cond_destroy(&pool->wake);
	pthread_mutex_destroy(&pool->lock);
	free(pool->threads);
	free(pool);
}

int k_pool_create(struct k_pool **out, int n_threads)
{
	struct k_pool *pool;
	int ret;

	*out = NULL;
	if (n_threads < 1)
		return -EINVAL;
	pool = calloc(1, sizeof(*pool));
	if (!pool)
		return -ENOMEM;
	pool->n_threads = n_threads;
	atomic_init(&pool->gen, 0);
	atomic_init(&pool->next, 0);
	atomic_init(&pool->done, 0);
	pthread_mutex_init(&pool->lock, NULL);
	pthread_cond_init(&pool->wake, NULL);
	pthread_cond_init(&pool->idle, NULL);
	if (n_threads > 1) {
		pool->threads = calloc((size_t)n_threads - 1, sizeof(*pool->threads));
		if (!pool->threads) {
			ret = -ENOMEM;
			goto err_destroy;
		}
	}
	for (int i = 0; i < n_threads - 1; i++) {
		ret = pthread_create(&pool->threads[i], NULL, pool_worker, pool);
		if (ret) {
			ret = -ret;
			goto err_destroy;
		}
		pool->n_workers++;
	}
	*out = pool;
	return 0;

err_destroy:
	k_pool_destroy(pool);
	return ret;
}

/* Waits until no worker still holds the job. The caller has handed out every task,
 * and a worker only takes tasks while counted in busy, so busy == 0 means every
 * task has finished; the mutex makes their writes visible. The spin on done only
 * shortens the common case. */
static void pool_wait(struct k_pool *pool, int n_tasks)
{
	for (int i = 0; i < K_POOL_SPIN; i++)
		if (atomic_load_explicit(&pool->done, memory_order_acquire) == n_tasks)
			break;
	pthread_mutex_lock(&pool->lock);
	while (pool->busy > 0)
		pthread_cond_wait(&pool->idle, &pool->lock);
	pthread_mutex_unlock(&pool->lock);
}

void k_pool_run(struct k_pool *pool, k_pool_fn fn, void *arg, int n_tasks)
{
	if (n_tasks <= 0)
		return;
	if (!pool || pool->n_workers == 0 || n_tasks == 1) {
		for (int t = 0; t < n_tasks; t++)
			fn(arg, t);
		return;
	}

	pthread_mutex_lock(&pool->lock);
	/* A worker that woke late for the previous job may still be draining it. */
	while (pool->busy > 0)
		pthread_cond_wait(&pool->idle, &pool->lock);
	pool->fn = fn;
	pool->arg = arg;
	pool->n_tasks = n_tasks;
	pool->seats = n_tasks - 1 < pool->n_workers ? n_tasks - 1 : pool->n_workers;
	atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
	atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
	pool->gen++;
	pthread_cond_broadcast(&pool->wake);
	pthread_mutex_unlock(&pool->lock);

	pool_drain(pool, fn, arg, n_tasks);
	pool_wait(pool, n_tasks);
}
