/* The engine thread's loop: commands from the main thread, the clients' submission
 * rings, one scheduler step, its events published and the sleeping clients woken
 * with one io_uring submit; when idle, a sleep in io_uring on every client's
 * doorbell plus the main thread's eventfd. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/serve/doorbell.h"
#include "daemon/serve/engine_thread.h"
#include "ipc/ipc_futex.h"
#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"

/* Values of ipc_seg_hdr.daemon_sleeping: 2 also asks the client to ring after it
 * reads events, because a request of it may be paused on a full event ring. */
#define SLEEPING 1u
#define SLEEPING_WANT_SPACE 2u

enum { DEAD_NONE, DEAD_PENDING, DEAD_KICKED };

struct engine_thread {
	pthread_t th;
	int started;
	struct engine *e;
	struct et_opts o;
	struct sched *s;
	struct doorbell db;
	struct client_conn **slot;	/* (n_slots); slot 0 is the main thread's eventfd */
	uint32_t *gen;			/* (n_slots) generation per slot, for doorbell tags */
	int n_slots;
	int n_spin;			/* connected clients that asked for spinning */
	int wake_efd;			/* main -> engine */
	int main_armed;
	pthread_mutex_t mu;		/* guards in and out */
	struct et_msg *in, **in_tail;
	struct et_msg *out, **out_tail;
	_Atomic int has_in;
	void (*wake_main)(void *);
	void *wake_arg;
	int stopping, hard;
	uint64_t deadline;		/* ns, with stopping */
	uint32_t shutdown_ms;		/* the timeout that set deadline */
	uint64_t steps;
	int max_inflight;		/* requests per client */
	uint64_t t_tick;		/* ns of the last engine_tick */
};

static void reply(struct engine_thread *t, struct et_msg *m)
{
	m->next = NULL;
	pthread_mutex_lock(&t->mu);
	*t->out_tail = m;
	t->out_tail = &m->next;
	pthread_mutex_unlock(&t->mu);
	t->wake_main(t->wake_arg);
}

/* The mover finished a host-tier move (its thread): end the engine thread's sleep
 * through the main thread's eventfd; the loop then commits it (engine_host_poll). */
static void wake_from_mover(void *arg)
{
	struct engine_thread *t = arg;
	uint64_t one = 1;

	if (write(t->wake_efd, &one, sizeof(one)) < 0)
		return;	/* saturated: the engine thread is awake anyway */
}

void engine_thread_post(struct engine_thread *t, struct et_msg *m)
{
	uint64_t one = 1;

	m->next = NULL;
	pthread_mutex_lock(&t->mu);
	*t->in_tail = m;
	t->in_tail = &m->next;
	atomic_store(&t->has_in, 1);
	pthread_mutex_unlock(&t->mu);
	if (write(t->wake_efd, &one, sizeof(one)) < 0)
		return;	/* saturated: the engine thread is awake anyway */
}

struct et_msg *engine_thread_replies(struct engine_thread *t)
{
	struct et_msg *m;

	pthread_mutex_lock(&t->mu);
	m = t->out;
	t->out = NULL;
	t->out_tail = &t->out;
	pthread_mutex_unlock(&t->mu);
	return m;
}

void et_report_free(struct et_report *r)
{
	if (!r)
		return;
	free(r->s.sessions);
	free(r->s.kv_sessions);
	free(r->clients);
	free(r);
}

static uint64_t tag_of(const struct engine_thread *t, const struct client_conn *c)
{
	return doorbell_tag((uint32_t)c->slot, t->gen[c->slot]);
}

static void wake_client(struct engine_thread *t, struct client_conn *c, unsigned bits)
{
	struct ipc_seg_hdr *h = c->seg;

	if (bits & IPC_SLEEP_FUTEX)
		doorbell_wake_futex(&t->db, &h->client_bell);
	if (bits & IPC_SLEEP_FD)
		doorbell_wake_fd(&t->db, c->notify_efd);
}

/* c broke the protocol: drop its requests now, tell the main thread to close it. */
static void kick(struct engine_thread *t, struct client_conn *c)
{
	struct et_msg *m;

	if (c->dead == DEAD_KICKED)
		return;
	c->dead = DEAD_KICKED;
	sched_drop_client(t->s, c);
	client_conn_mark_closed(c);
	wake_client(t, c, IPC_SLEEP_FUTEX | IPC_SLEEP_FD);
	m = calloc(1, sizeof(*m));
	if (!m)
		return;	/* the client stays ignored until its socket closes */
	m->type = ET_KICK;
	m->client_id = c->id;
	snprintf(m->why, sizeof(m->why), "%s", c->why[0] ? c->why : "protocol violation");
	reply(t, m);
}

static void add_client(struct engine_thread *t, struct client_conn *c)
{
	for (int i = 1; i < t->n_slots; i++) {
		if (t->slot[i])
			continue;
		t->slot[i] = c;
		c->slot = i;
		c->gen = ++t->gen[i];
		t->n_spin += c->spin;
		return;
	}
	/* The main thread caps clients below n_slots; this is a bug guard. */
	snprintf(c->why, sizeof(c->why), "no client slot left");
	c->slot = 0;
	c->dead = DEAD_PENDING;
	kick(t, c);
	client_conn_destroy(c);
}

static void remove_client(struct engine_thread *t, uint32_t id)
{
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];

		if (!c || c->id != id)
			continue;
		if (c->wait_armed)
			doorbell_cancel(&t->db, tag_of(t, c));
		t->gen[i]++;	/* completions of the old waits are stale now */
		if (c->dead != DEAD_KICKED)
			sched_drop_client(t->s, c);
		t->n_spin -= c->spin;
		t->slot[i] = NULL;
		log_debug("client %u released", id);
		client_conn_destroy(c);
		return;
	}
}

static struct et_report *build_report(struct engine_thread *t)
{
	struct et_report *r = calloc(1, sizeof(*r));
	uint64_t now = ipc_now_ns();
	int n = 0;

	if (!r)
		return NULL;
	r->clients = calloc((size_t)t->n_slots, sizeof(*r->clients));
	if (!r->clients || sched_report(t->s, &r->s)) {
		et_report_free(r);
		return NULL;
	}
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];

		if (!c || c->dead)
			continue;
		r->clients[n++] = (struct et_client_info){
			.id = c->id, .pid = c->pid, .uid = c->uid, .spin = c->spin,
			.inflight = c->n_inflight, .submitted = c->n_submitted,
			.generated = c->n_generated,
			.connected_s = (double)(now - c->t_connect_ns) * 1e-9,
		};
	}
	r->n_clients = n;
	r->steps = t->steps;
	engine_decode_path_describe(t->e, r->decode_path, sizeof(r->decode_path));
	r->decode_lat_mask = engine_decode_path_latency_mask(t->e);
	engine_parallel_describe(t->e, r->parallel, sizeof(r->parallel));
	return r;
}

/* Writes the sessions to state_dir: the count, or -errno with one line in err. */
static int snapshot(struct engine_thread *t, char *err, size_t err_len)
{
	int n;

	if (!t->o.state_dir) {
		snprintf(err, err_len, "no --state-dir");
		return -ENOTSUP;
	}
	n = engine_snapshot_save(t->e, t->o.state_dir, err, err_len);
	if (n < 0) {
		log_error("snapshot to %s: %s", t->o.state_dir, err[0] ? err : strerror(-n));
		return n;
	}
	log_info("snapshot: %d sessions written to %s", n, t->o.state_dir);
	return n;
}

/* kdctl session-close: 0 or -errno with the reason in err (the name is checked first,
 * so it is safe to print). */
static int session_close(struct engine_thread *t, const struct et_msg *m, char *err, size_t err_len)
{
	int ret = engine_session_close(t->e, m->why, m->uid);

	if (ret == -EINVAL)
		snprintf(err, err_len, "not a session name (a session name is " KV_SESSION_NAME_RULE ")");
	else if (ret == -ENOENT)
		snprintf(err, err_len, "no session '%.63s' for uid %u", m->why, (unsigned)m->uid);
	return ret;
}

/* Runs what an ET_QUERY asks for, then builds the report that answers it. */
static struct et_report *answer(struct engine_thread *t, const struct et_msg *m)
{
	char err[200] = "";
	struct et_report *r;
	int ret = 0;

	if (m->arg == ET_Q_SNAPSHOT)
		ret = snapshot(t, err, sizeof(err));
	else if (m->arg == ET_Q_SESSION_CLOSE)
		ret = session_close(t, m, err, sizeof(err));
	r = build_report(t);
	if (!r)
		return NULL;
	r->op_ret = ret < 0 ? ret : 0;
	r->op_count = ret > 0 ? ret : 0;
	snprintf(r->op_err, sizeof(r->op_err), "%s", err[0] ? err : ret < 0 ? strerror(-ret) : "");
	return r;
}

static void handle_msgs(struct engine_thread *t)
{
	struct et_msg *m, *next;

	pthread_mutex_lock(&t->mu);
	m = t->in;
	t->in = NULL;
	t->in_tail = &t->in;
	atomic_store(&t->has_in, 0);
	pthread_mutex_unlock(&t->mu);
	for (; m; m = next) {
		next = m->next;
		switch (m->type) {
		case ET_ADD: add_client(t, m->client); break;
		case ET_REMOVE: remove_client(t, m->client_id); break;
		case ET_DRAIN:
			/* once stopping, nothing admits again (the main thread refuses too) */
			if (!t->stopping)
				sched_set_draining(t->s, m->arg);
			break;
		case ET_SHUTDOWN:
			t->stopping = 1;
			t->deadline = m->deadline_ns;
			t->shutdown_ms = m->arg > 0 ? (uint32_t)m->arg : 0;
			sched_set_draining(t->s, 1);
			break;
		case ET_HARD_STOP: t->hard = 1; break;
		case ET_QUERY:
			m->report = answer(t, m);
			m->type = ET_REPORT;
			reply(t, m);
			continue;	/* m goes back to the main thread */
		default: break;
		}
		free(m);
	}
}

/* Takes what the clients submitted. A client at its in-flight cap, or with finals
 * still waiting for ring space, is not read: its ring fills and kd_submit says
 * -EAGAIN, which is the back-pressure. */
static void drain_rings(struct engine_thread *t, uint64_t now)
{
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];

		if (!c || c->dead)
			continue;
		/* At most a ring's worth per client per iteration: a client refilling its
		 * ring as fast as we drain it must not keep the others waiting. */
		for (int k = 0; k < (int)IPC_SUB_SLOTS && !c->n_pending && c->n_inflight < t->max_inflight; k++) {
			struct ipc_sub rec;
			int32_t *tokens;
			int ret = client_conn_take(c, &rec, &tokens);

			if (!ret)
				break;
			if (ret < 0) {
				if (ret != -EPROTO)
					snprintf(c->why, sizeof(c->why), "reading its ring: %s", strerror(-ret));
				log_warn("client %u (pid %d): %s: disconnecting", c->id, (int)c->pid, c->why);
				kick(t, c);
				break;
			}
			sched_submit(t->s, c, &rec, tokens, now);
		}
	}
}

/* Publishes every client's new events and queues the wakes of those asleep; one
 * submit sends them all. */
static void publish_all(struct engine_thread *t)
{
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];

		if (!c || c->dead == DEAD_KICKED)
			continue;
		if (!c->dead && c->n_pending && client_conn_flush(c) < 0)
			c->dead = DEAD_PENDING;
		if (c->dead == DEAD_PENDING) {
			log_warn("client %u (pid %d): %s: disconnecting", c->id, (int)c->pid, c->why);
			kick(t, c);
			continue;
		}
		if (c->touched)
			wake_client(t, c, client_conn_publish(c));
	}
}

static void on_completion(void *arg, uint64_t tag, int res)
{
	struct engine_thread *t = arg;
	uint32_t slot = (uint32_t)tag, gen = (uint32_t)(tag >> 32);

	(void)res;
	if (slot == 0) {
		t->main_armed = 0;
		return;
	}
	if ((int)slot < t->n_slots && t->slot[slot] && t->gen[slot] == gen)
		t->slot[slot]->wait_armed = 0;
}

/* Whether anything could be done right now (rechecked after announcing a sleep). */
static int work_waiting(struct engine_thread *t)
{
	if (atomic_load(&t->has_in) || engine_host_pending(t->e))
		return 1;
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];
		struct ipc_seg_hdr *h;

		if (!c || c->dead)
			continue;
		if (c->n_pending) {
			/* queued finals can move once the client has read some events */
			if (ipc_ev_free(c->seg, c->ev_tail) != 0)
				return 1;
			continue;
		}
		if (c->n_inflight >= t->max_inflight)
			continue;
		h = c->seg;
		if (ipc_load_acquire(&h->sub_tail) != c->sub_head)
			return 1;
	}
	return sched_runnable(t->s);
}

static void set_sleeping(struct engine_thread *t, int on)
{
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];

		if (!c || c->dead)
			continue;
		atomic_store(&((struct ipc_seg_hdr *)c->seg)->daemon_sleeping,
			     !on ? 0u : c->n_inflight || c->n_pending ? SLEEPING_WANT_SPACE : SLEEPING);
	}
}

static void arm_waits(struct engine_thread *t)
{
	for (int i = 1; i < t->n_slots; i++) {
		struct client_conn *c = t->slot[i];
		struct ipc_seg_hdr *h;

		if (!c || c->dead || c->wait_armed)
			continue;
		h = c->seg;
		if (t->o.notify == IPC_NOTIFY_FUTEX)
			c->wait_armed = !doorbell_arm_futex(&t->db, &h->daemon_bell,
							    atomic_load(&h->daemon_bell), tag_of(t, c));
		else
			c->wait_armed = !doorbell_arm_fd(&t->db, c->bell_efd, tag_of(t, c));
	}
	if (!t->main_armed)
		t->main_armed = !doorbell_arm_fd(&t->db, t->wake_efd, doorbell_tag(0, 0));
}

/* Polls for new work for up to ET_SPIN_NS (clients that asked for it). */
static int spin(struct engine_thread *t)
{
	uint64_t until = ipc_now_ns() + ET_SPIN_NS;

	while (ipc_now_ns() < until) {
		if (work_waiting(t))
			return 1;
		for (int k = 0; k < 64; k++)
			ipc_cpu_relax();
	}
	return 0;
}

static void sleep_idle(struct engine_thread *t, uint64_t now)
{
	int64_t timeout = sched_next_timeout(t->s, now);
	int ret;

	/* Wake for engine_tick (session TTL, offload) while sessions exist. */
	if (engine_sessions_list(t->e, NULL, 0) && timeout > 1000000000)
		timeout = 1000000000;

	if (t->stopping) {
		int64_t left = t->deadline > now ? (int64_t)(t->deadline - now) : 0;

		timeout = left < timeout ? left : timeout;
	}
	arm_waits(t);
	/* Announce, then look again: a client that submitted before seeing the flag is
	 * caught by the recheck, one that saw it rings the doorbell. */
	set_sleeping(t, 1);
	atomic_thread_fence(memory_order_seq_cst);
	if (work_waiting(t))
		timeout = 0;
	ret = doorbell_run(&t->db, timeout == INT64_MAX ? -1 : timeout, on_completion, t);
	if (ret < 0)
		log_error("io_uring wait failed: %s", strerror(-ret));
	set_sleeping(t, 0);
}

static void *engine_main(void *arg)
{
	struct engine_thread *t = arg;
	struct et_msg *m;
	sigset_t all;

	/* Signals are the main loop's business. */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	engine_thread_attach(t->e);	/* --gpus N: GPU N current here, not GPU 0 */
	for (;;) {
		uint64_t now, pass0 = ipc_now_ns();	/* a pass's length is a stall's */
		int n;

		if (atomic_load(&t->has_in))
			handle_msgs(t);
		if (t->hard)
			break;
		now = ipc_now_ns();
		drain_rings(t, now);
		if (t->stopping && (!sched_busy(t->s) || now >= t->deadline)) {
			if (sched_busy(t->s))
				log_warn("shutdown timeout: cancelling %d requests", sched_busy(t->s));
			sched_cancel_all(t->s, t->shutdown_ms);
			publish_all(t);
			doorbell_run(&t->db, 0, on_completion, t);
			if (t->o.state_dir) {
				char err[200] = "";

				snapshot(t, err, sizeof(err));
			}
			break;
		}
		engine_host_poll(t->e);	/* host-tier moves the mover finished */
		if (now - t->t_tick >= 1000000000ull) {
			engine_tick(t->e);
			t->t_tick = now;
		}
		n = sched_step(t->s, now);
		if (n)
			t->steps++;
		publish_all(t);
		doorbell_run(&t->db, 0, on_completion, t);
		sched_note_loop(t->s, ipc_now_ns() - pass0);
		if (n)
			continue;
		if (t->n_spin && spin(t))
			continue;
		sleep_idle(t, now);
	}
	m = calloc(1, sizeof(*m));
	if (m) {
		m->type = ET_STOPPED;
		reply(t, m);
	}
	return NULL;
}

int engine_thread_start(struct engine_thread **out, struct engine *e, const struct et_opts *o,
			void (*wake_main)(void *), void *arg, char *err, size_t err_len)
{
	struct engine_thread *t = calloc(1, sizeof(*t));
	int ret;

	*out = NULL;
	if (!t)
		return -ENOMEM;
	t->e = e;
	t->o = *o;
	t->max_inflight = o->sched.max_inflight > 0 ? o->sched.max_inflight : SCHED_DEFAULT_MAX_INFLIGHT;
	t->wake_main = wake_main;
	t->wake_arg = arg;
	t->in_tail = &t->in;
	t->out_tail = &t->out;
	t->wake_efd = -1;
	pthread_mutex_init(&t->mu, NULL);
	t->n_slots = o->max_clients + 1;
	t->slot = calloc((size_t)t->n_slots, sizeof(*t->slot));
	t->gen = calloc((size_t)t->n_slots, sizeof(*t->gen));
	if (!t->slot || !t->gen) {
		ret = -ENOMEM;
		goto err;
	}
	if ((ret = sched_create(&t->s, e, &o->sched)))
		goto err;
	if ((ret = doorbell_init(&t->db, o->notify, t->n_slots, err, err_len)))
		goto err;
	t->wake_efd = eventfd(0, EFD_CLOEXEC);	/* blocking: see client_conn_create */
	if (t->wake_efd < 0) {
		ret = -errno;
		goto err;
	}
	engine_host_set_wake(e, wake_from_mover, t);
	if ((ret = -pthread_create(&t->th, NULL, engine_main, t)))
		goto err;
	t->started = 1;
	*out = t;
	return 0;

err:
	if (!err[0])
		snprintf(err, err_len, "engine thread: %s", strerror(-ret));
	engine_thread_destroy(t);
	return ret;
}

void engine_thread_destroy(struct engine_thread *t)
{
	struct et_msg *m, *next;

	if (!t)
		return;
	if (t->started) {
		m = calloc(1, sizeof(*m));
		if (m) {
			m->type = ET_HARD_STOP;
			engine_thread_post(t, m);
		}
		pthread_join(t->th, NULL);
	}
	for (m = t->in; m; m = next) {
		next = m->next;
		if (m->type == ET_ADD)
			client_conn_destroy(m->client);
		free(m);
	}
	for (m = engine_thread_replies(t); m; m = next) {
		next = m->next;
		et_report_free(m->report);
		free(m);
	}
	/* Requests first (they hold KV blocks), then the clients they point at. */
	sched_destroy(t->s);
	for (int i = 1; t->slot && i < t->n_slots; i++)
		client_conn_destroy(t->slot[i]);
	doorbell_fini(&t->db);
	if (t->e)	/* the engine outlives t: no more wakes into it */
		engine_host_set_wake(t->e, NULL, NULL);
	if (t->wake_efd >= 0)
		close(t->wake_efd);
	pthread_mutex_destroy(&t->mu);
	free(t->slot);
	free(t->gen);
	free(t);
}
