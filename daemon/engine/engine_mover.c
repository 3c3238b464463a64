/* The mover's worker threads: device blocks (every rank's part: kv_spans.h) to zstd
 * frames and back through the backends' side copies, off the engine thread. Locking is in engine_mover.h: one
 * mutex over the queued and done lists and each job's claim counters; a block's
 * contents are its worker's between its claim and the job's take. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/engine/engine_mover.h"

/* One worker's own: codec contexts and buffers. */
struct mover_worker {
	struct engine_mover *m;
	pthread_t th;
	struct kv_codec codec;
	uint8_t *raw;			/* (block_bytes) one block, host_alloc memory where the backend has it */
	uint8_t *frame;			/* (kv_codec_bound) one compressed block */
};

struct engine_mover {
	pthread_mutex_t mu;
	pthread_cond_t cv_work;		/* a job queued, or stop */
	pthread_cond_t cv_done;		/* a job done */
	/* (mu) submitted jobs with blocks nobody has claimed yet; the workers claim a
	 * job's blocks one at a time, so a pool shares a big session's codec work */
	struct mover_job *queued, **queued_tail;
	struct mover_job *done, **done_tail;	/* (mu) finished, not taken */
	atomic_int n_done;		/* jobs on done: a lock-free look for the engine loop */
	int stop;			/* (mu) */
	void (*wake)(void *);		/* (mu) */
	void *wake_arg;

	/* set at creation, read-only after */
	const struct kv_spans *ks;	/* where a block's bytes are (the engine's) */
	struct backend *be;		/* rank 0's: the workers' page-locked buffers */
	int n_workers, n_started;
	struct mover_worker *w;		/* (n_workers) */
};

static void test_delay(uint32_t us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000 };

	if (us)
		nanosleep(&ts, NULL);
}

static int offload_block(struct mover_worker *w, struct mover_block *b)
{
	size_t zb;
	int ret = kv_spans_copy(w->m->ks, b->dev, w->raw, 0, 1);

	if (!ret)
		ret = kv_codec_compress(&w->codec, w->frame, kv_codec_bound(&w->codec), &zb, w->raw);
	if (!ret && !(b->out = kv_host_block_new(w->frame, zb)))
		ret = -ENOMEM;
	return ret;
}

static int restore_block(struct mover_worker *w, struct mover_block *b)
{
	int ret = kv_codec_decompress(&w->codec, w->raw, b->hb->z, b->hb->zbytes);

	if (ret)
		return ret;
	return kv_spans_copy(w->m->ks, b->dev, w->raw, 1, 1);
}

static int run_block(struct mover_worker *w, struct mover_job *j, struct mover_block *b)
{
	int ret;

	ret = j->restore ? restore_block(w, b) : offload_block(w, b);
	test_delay(j->delay_us);
	return ret;
}

/* (mu) Takes j off the queue: nobody claims its blocks any more. */
static void unqueue(struct engine_mover *m, struct mover_job *j)
{
	struct mover_job **link;

	for (link = &m->queued; *link; link = &(*link)->next) {
		if (*link != j)
			continue;
		*link = j->next;
		if (!*link)
			m->queued_tail = link;
		return;
	}
}

/* (mu) The next block of the first queued job that has one to move (*out its job),
 * -2 for a job with nothing left to move and none in a worker's hands (*out: done),
 * or -1: nothing to do. */
static int claim(struct engine_mover *m, struct mover_job **out)
{
	while (m->queued) {
		struct mover_job *j = m->queued;

		if (j->ret || atomic_load_explicit(&j->cancel, memory_order_relaxed)) {
			j->claimed = j->n;	/* the rest is skipped: the job fails */
			if (!j->ret)
				j->ret = -ECANCELED;
		}
		while (j->claimed < j->n && j->b[j->claimed].dev < 0)
			j->claimed++;
		if (j->claimed < j->n) {
			*out = j;
			j->running++;
			return j->claimed++;
		}
		unqueue(m, j);
		j->queued = 0;
		if (!j->running) {	/* nothing of it in a worker's hands: done */
			*out = j;
			return -2;
		}
	}
	return -1;
}

/* (mu) j is done: to the done list, the engine thread woken. */
static void finish(struct engine_mover *m, struct mover_job *j)
{
	j->next = NULL;
	*m->done_tail = j;
	m->done_tail = &j->next;
	atomic_fetch_add(&m->n_done, 1);
	pthread_cond_broadcast(&m->cv_done);
	if (m->wake)	/* under the lock: set_wake cannot race it */
		m->wake(m->wake_arg);
}

static void *worker(void *arg)
{
	struct mover_worker *w = arg;
	struct engine_mover *m = w->m;
	struct sched_param sp = { 0 };

	/* background work: never preempt the engine thread on a wake-up (where both
	 * share a core, a woken worker ran its whole job before the engine thread's
	 * next step); a refusal only costs that */
	pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
	pthread_mutex_lock(&m->mu);
	for (;;) {
		struct mover_job *j = NULL;
		int k = -1, ret;

		while (!m->stop && (k = claim(m, &j)) == -1)
			pthread_cond_wait(&m->cv_work, &m->mu);
		if (m->stop)
			break;
		if (k == -2) {	/* a job with nothing (left) to move */
			finish(m, j);
			continue;
		}
		pthread_mutex_unlock(&m->mu);
		ret = run_block(w, j, &j->b[k]);
		pthread_mutex_lock(&m->mu);
		if (ret && !j->ret)
			j->ret = ret;
		j->running--;
		if (!j->queued && !j->running)
			finish(m, j);
		else if (j->claimed >= j->n && !j->running) {
			unqueue(m, j);
			j->queued = 0;
			finish(m, j);
		}
	}
	pthread_mutex_unlock(&m->mu);
	return NULL;
}

static void worker_fini(struct engine_mover *m, struct mover_worker *w)
{
	kv_codec_fini(&w->codec);
	if (w->raw && m->be->ops->host_free)
		m->be->ops->host_free(m->be, w->raw);
	else
		free(w->raw);
	free(w->frame);
}

void engine_mover_destroy(struct engine_mover *m)
{
	if (!m)
		return;
	pthread_mutex_lock(&m->mu);
	m->stop = 1;
	pthread_cond_broadcast(&m->cv_work);
	pthread_mutex_unlock(&m->mu);
	for (int i = 0; i < m->n_started; i++)
		pthread_join(m->w[i].th, NULL);
	for (int i = 0; m->w && i < m->n_workers; i++)
		worker_fini(m, &m->w[i]);
	pthread_cond_destroy(&m->cv_work);
	pthread_cond_destroy(&m->cv_done);
	pthread_mutex_destroy(&m->mu);
	free(m->w);
	free(m);
}

static int worker_init(struct engine_mover *m, struct mover_worker *w, const struct kv_codec *c)
{
	struct backend *be = m->be;
	int ret;

	w->m = m;
	if ((ret = kv_codec_init(&w->codec, c->raw_bytes, c->elem_bytes, c->level, c->shuffle)))
		return ret;
	w->raw = be->ops->host_alloc ? be->ops->host_alloc(be, c->raw_bytes) : malloc(c->raw_bytes);
	w->frame = malloc(kv_codec_bound(&w->codec));
	return w->raw && w->frame ? 0 : -ENOMEM;
}

int engine_mover_create(struct engine_mover **out, const struct kv_spans *ks, const struct kv_codec *c,
			int n_workers)
{
	struct engine_mover *m = calloc(1, sizeof(*m));
	int ret = -ENOMEM;

	*out = NULL;
	if (!m)
		return -ENOMEM;
	pthread_mutex_init(&m->mu, NULL);
	pthread_cond_init(&m->cv_work, NULL);
	pthread_cond_init(&m->cv_done, NULL);
	m->queued_tail = &m->queued;
	m->done_tail = &m->done;
	m->ks = ks;
	m->be = ks->s[0].be;
	m->n_workers = n_workers > 0 ? n_workers : 1;
	m->w = calloc((size_t)m->n_workers, sizeof(*m->w));
	if (!m->w)
		goto err;
	for (int i = 0; i < m->n_workers; i++)
		if ((ret = worker_init(m, &m->w[i], c)))
			goto err;
	for (; m->n_started < m->n_workers; m->n_started++)
		if ((ret = -pthread_create(&m->w[m->n_started].th, NULL, worker, &m->w[m->n_started])))
			goto err;
	*out = m;
	return 0;

err:
	engine_mover_destroy(m);
	return ret;
}

void engine_mover_set_wake(struct engine_mover *m, void (*wake)(void *), void *arg)
{
	pthread_mutex_lock(&m->mu);
	m->wake = wake;
	m->wake_arg = arg;
	pthread_mutex_unlock(&m->mu);
}

void engine_mover_submit(struct engine_mover *m, struct mover_job *j)
{
	j->next = NULL;
	j->ret = 0;
	j->claimed = 0;
	j->running = 0;
	j->queued = 1;
	pthread_mutex_lock(&m->mu);
	*m->queued_tail = j;
	m->queued_tail = &j->next;
	pthread_cond_broadcast(&m->cv_work);
	pthread_mutex_unlock(&m->mu);
}

struct mover_job *engine_mover_take(struct engine_mover *m)
{
	struct mover_job *j;

	if (!atomic_load(&m->n_done))
		return NULL;
	pthread_mutex_lock(&m->mu);
	j = m->done;
	m->done = NULL;
	m->done_tail = &m->done;
	atomic_store(&m->n_done, 0);
	pthread_mutex_unlock(&m->mu);
	return j;
}

int engine_mover_has_done(struct engine_mover *m)
{
	return atomic_load(&m->n_done) > 0;
}

void engine_mover_wait(struct engine_mover *m)
{
	pthread_mutex_lock(&m->mu);
	while (!m->done)
		pthread_cond_wait(&m->cv_done, &m->mu);
	pthread_mutex_unlock(&m->mu);
}

int engine_mover_cancel(struct engine_mover *m, struct mover_job *j)
{
	int untouched;

	pthread_mutex_lock(&m->mu);
	untouched = j->queued && !j->claimed;
	if (untouched) {
		unqueue(m, j);
		j->queued = 0;
	} else {
		atomic_store(&j->cancel, 1);
	}
	pthread_mutex_unlock(&m->mu);
	return untouched;
}
