/* The mover's worker thread: device blocks to zstd frames and back through the
 * backend's side copies, off the engine thread. Locking is in engine_mover.h: one
 * mutex over the queued and done lists; the job's contents are the worker's between
 * submit and take. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/engine/engine_mover.h"

struct engine_mover {
	pthread_t th;
	int started;
	pthread_mutex_t mu;
	pthread_cond_t cv_work;		/* a job queued, or stop */
	pthread_cond_t cv_done;		/* a job done */
	struct mover_job *queued, **queued_tail;	/* (mu) submitted, not started */
	struct mover_job *done, **done_tail;		/* (mu) finished, not taken */
	atomic_int n_done;		/* jobs on done: a lock-free look for the engine loop */
	int stop;			/* (mu) */
	void (*wake)(void *);		/* (mu) */
	void *wake_arg;

	/* the worker's alone */
	struct backend *be;
	struct kv_codec codec;		/* its own zstd contexts */
	uint8_t *raw;			/* (block_bytes) one block, host_alloc memory where the backend has it */
	uint8_t *frame;			/* (kv_codec_bound) one compressed block */
	int n_planes;			/* (layers x K/V) planes of one block */
	size_t plane;			/* bytes of one block in one plane */
	uint8_t **base;			/* (n_planes) each plane's cache in backend memory */
	void **addr;			/* (n_planes) one block's place in each, per copy */
};

static void plane_addrs(struct engine_mover *m, int32_t block)
{
	for (int p = 0; p < m->n_planes; p++)
		m->addr[p] = m->base[p] + (size_t)block * m->plane;
}

static void test_delay(uint32_t us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000 };

	if (us)
		nanosleep(&ts, NULL);
}

static int offload_block(struct engine_mover *m, struct mover_block *b)
{
	size_t zb;
	int ret;

	plane_addrs(m, b->dev);
	ret = m->be->ops->side_download(m->be, m->raw, m->addr, m->n_planes, m->plane);
	if (!ret)
		ret = kv_codec_compress(&m->codec, m->frame, kv_codec_bound(&m->codec), &zb, m->raw);
	if (!ret && !(b->out = kv_host_block_new(m->frame, zb)))
		ret = -ENOMEM;
	return ret;
}

static int restore_block(struct engine_mover *m, struct mover_block *b)
{
	int ret = kv_codec_decompress(&m->codec, m->raw, b->hb->z, b->hb->zbytes);

	if (ret)
		return ret;
	plane_addrs(m, b->dev);
	return m->be->ops->side_upload(m->be, m->addr, m->raw, m->n_planes, m->plane);
}

static void run(struct engine_mover *m, struct mover_job *j)
{
	j->ret = 0;
	if (!m->be->ops->side_download || !m->be->ops->side_upload) {
		j->ret = -ENOTSUP;
		return;
	}
	for (int i = 0; i < j->n && !j->ret; i++) {
		struct mover_block *b = &j->b[i];

		if (atomic_load_explicit(&j->cancel, memory_order_relaxed)) {
			j->ret = -ECANCELED;
			break;
		}
		if (b->dev < 0)
			continue;
		j->ret = j->restore ? restore_block(m, b) : offload_block(m, b);
		test_delay(j->delay_us);
	}
}

static void *worker(void *arg)
{
	struct engine_mover *m = arg;
	struct sched_param sp = { 0 };

	/* background work: never preempt the engine thread on a wake-up (where both
	 * share a core, a woken worker ran its whole job before the engine thread's
	 * next step); a refusal only costs that */
	pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
	pthread_mutex_lock(&m->mu);
	for (;;) {
		struct mover_job *j;

		while (!m->stop && !m->queued)
			pthread_cond_wait(&m->cv_work, &m->mu);
		if (m->stop)
			break;
		j = m->queued;
		m->queued = j->next;
		if (!m->queued)
			m->queued_tail = &m->queued;
		pthread_mutex_unlock(&m->mu);

		run(m, j);

		pthread_mutex_lock(&m->mu);
		j->next = NULL;
		*m->done_tail = j;
		m->done_tail = &j->next;
		atomic_fetch_add(&m->n_done, 1);
		pthread_cond_broadcast(&m->cv_done);
		if (m->wake)	/* under the lock: set_wake cannot race it */
			m->wake(m->wake_arg);
	}
	pthread_mutex_unlock(&m->mu);
	return NULL;
}

void engine_mover_destroy(struct engine_mover *m)
{
	if (!m)
		return;
	if (m->started) {
		pthread_mutex_lock(&m->mu);
		m->stop = 1;
		pthread_cond_broadcast(&m->cv_work);
		pthread_mutex_unlock(&m->mu);
		pthread_join(m->th, NULL);
	}
	pthread_cond_destroy(&m->cv_work);
	pthread_cond_destroy(&m->cv_done);
	pthread_mutex_destroy(&m->mu);
	kv_codec_fini(&m->codec);
	if (m->raw && m->be->ops->host_free)
		m->be->ops->host_free(m->be, m->raw);
	else
		free(m->raw);
	free(m->frame);
	free(m->base);
	free(m->addr);
	free(m);
}

int engine_mover_create(struct engine_mover **out, struct backend *be, const struct forward *f,
			int n_layers, int block_tokens, size_t elem_bytes, const struct kv_codec *c)
{
	struct engine_mover *m = calloc(1, sizeof(*m));
	int per_layer = f->kv[0].v ? 2 : 1, ret;

	*out = NULL;
	if (!m)
		return -ENOMEM;
	pthread_mutex_init(&m->mu, NULL);
	pthread_cond_init(&m->cv_work, NULL);
	pthread_cond_init(&m->cv_done, NULL);
	m->queued_tail = &m->queued;
	m->done_tail = &m->done;
	m->be = be;
	m->n_planes = n_layers * per_layer;
	m->plane = (size_t)block_tokens * (size_t)f->kv[0].width * elem_bytes;
	m->base = calloc((size_t)m->n_planes, sizeof(*m->base));
	m->addr = calloc((size_t)m->n_planes, sizeof(*m->addr));
	ret = kv_codec_init(&m->codec, c->raw_bytes, c->elem_bytes, c->level, c->shuffle);
	if (ret || !m->base || !m->addr)
		goto err;
	m->raw = be->ops->host_alloc ? be->ops->host_alloc(be, c->raw_bytes) : malloc(c->raw_bytes);
	m->frame = malloc(kv_codec_bound(&m->codec));
	if (!m->raw || !m->frame)
		goto err;
	for (int l = 0; l < n_layers; l++)
		for (int v = 0; v < per_layer; v++)
			m->base[l * per_layer + v] = (uint8_t *)(v ? (void *)f->kv[l].v : (void *)f->kv[l].k);
	if ((ret = -pthread_create(&m->th, NULL, worker, m)))
		goto err;
	m->started = 1;
	*out = m;
	return 0;

err:
	engine_mover_destroy(m);
	return ret ? ret : -ENOMEM;
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
	pthread_mutex_lock(&m->mu);
	*m->queued_tail = j;
	m->queued_tail = &j->next;
	pthread_cond_signal(&m->cv_work);
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
	struct mover_job **link;
	int found = 0;

	pthread_mutex_lock(&m->mu);
	for (link = &m->queued; *link; link = &(*link)->next) {
		if (*link != j)
			continue;
		*link = j->next;
		if (!*link)
			m->queued_tail = link;
		found = 1;
		break;
	}
	if (!found)
		atomic_store(&j->cancel, 1);
	pthread_mutex_unlock(&m->mu);
	return found;
}
