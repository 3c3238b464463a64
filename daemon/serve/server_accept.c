/* Accepting connections without letting anyone hold the door: SO_PEERCRED against the
 * allow-list; at most --max-pending connections that are not clients yet (a new one
 * displaces the oldest of the uid holding the most); each closed after
 * --handshake-timeout seconds without progress; and when the open-file limit is
 * reached, a displaced pending connection or a reserve descriptor makes room, so the
 * loop never spins on a listening socket it cannot accept from. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/serve/control.h"
#include "daemon/serve/server_internal.h"
#include "ipc/ipc_futex.h"

#define ACCEPT_PAUSE_S 0.25	/* no descriptor at all: try accept again this much later */
#define FDS_PER_CLIENT 4	/* its socket, memfd and two eventfds */
#define FDS_BASE 64		/* the daemon's own: log, io_uring, thread pool, listening socket */

int server_ratelog_ok(struct server_ratelog *r, unsigned *quiet)
{
	uint64_t now = ipc_now_ns();

	if (r->last_ns && now - r->last_ns < 1000000000ull) {
		r->quiet++;
		return 0;
	}
	*quiet = r->quiet;
	r->quiet = 0;
	r->last_ns = now;
	return 1;
}

void server_fd_limits(struct server *s)
{
	struct rlimit rl;
	long need = (long)s->o.max_clients * FDS_PER_CLIENT + s->o.max_pending + FDS_BASE;

	if (getrlimit(RLIMIT_NOFILE, &rl))
		return;
	/* Each client holds 4 descriptors: the soft default of 1024 is low for a daemon. */
	if (rl.rlim_cur < rl.rlim_max) {
		rlim_t was = rl.rlim_cur;

		rl.rlim_cur = rl.rlim_max;
		if (!setrlimit(RLIMIT_NOFILE, &rl))
			log_debug("open files: soft limit raised from %llu to %llu",
				  (unsigned long long)was, (unsigned long long)rl.rlim_max);
		else
			getrlimit(RLIMIT_NOFILE, &rl);
	}
	s->nofile = rl.rlim_cur == RLIM_INFINITY ? (1L << 30) : (long)rl.rlim_cur;
	if (s->nofile < need)
		log_warn("open files: RLIMIT_NOFILE is %ld, but --max-clients %d and --max-pending %d "
			 "may need %ld; at the limit new connections displace pending ones or are refused",
			 s->nofile, s->o.max_clients, s->o.max_pending, need);
}

static int allowed(const struct server *s, const struct conn *c)
{
	gid_t groups[64];
	socklen_t len = sizeof(groups);
	int n;

	if (c->uid == 0 || c->uid == geteuid())
		return 1;
	for (int i = 0; i < s->o.n_allow_uid; i++)
		if (s->o.allow_uid[i] == c->uid)
			return 1;
	if (!s->o.n_allow_gid)
		return 0;
	/* The peer's supplementary groups too, where the kernel tells them. */
	n = getsockopt(c->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) ? 0 : (int)(len / sizeof(gid_t));
	for (int i = 0; i < s->o.n_allow_gid; i++) {
		if (s->o.allow_gid[i] == c->gid)
			return 1;
		for (int k = 0; k < n; k++)
			if (groups[k] == s->o.allow_gid[i])
				return 1;
	}
	return 0;
}

static int pending_of(const struct server *s, uid_t uid)
{
	int n = 0;

	for (const struct conn *c = s->conns; c; c = c->next)
		n += !c->is_client && c->uid == uid;
	return n;
}

/* The oldest pending connection of the uid that holds the most (ties: the oldest of
 * theirs), or NULL. A flooding uid displaces its own connections, not others'. */
static struct conn *pending_victim(const struct server *s, const struct conn *spare, int *held)
{
	struct conn *victim = NULL;
	int best = 0;

	for (struct conn *c = s->conns; c; c = c->next) {
		int n = c->is_client || c == spare ? 0 : pending_of(s, c->uid);

		if (n && (n > best || (n == best && c->t_open_ns < victim->t_open_ns))) {
			best = n;
			victim = c;
		}
	}
	*held = best;
	return victim;
}

int server_make_room(struct server *s, const struct conn *spare, const char *why)
{
	struct conn *v;
	unsigned quiet;
	uint64_t id;
	int held;

	if (!(v = pending_victim(s, spare, &held)))
		return 0;
	if (server_ratelog_ok(&s->rl_evict, &quiet))
		log_warn("%s: closing the oldest connection without a hello of uid %d, which holds %d of "
			 "the %d (pid %d, open %.1f s; %u more not logged)", why, (int)v->uid, held,
			 s->n_pending, (int)v->pid, (double)(ipc_now_ns() - v->t_open_ns) * 1e-9, quiet);
	/* it may not read: the reply is best effort, the close is not */
	id = v->id;
	v->out_off = v->out_len;
	v->close_after_write = 0;
	server_conn_send(v, control_reply_error("too many connections without a hello: closed to make room",
						EUSERS));
	for (struct conn *c = s->conns; c; c = c->next) {
		if (c->id == id) {
			server_conn_close(c);
			break;
		}
	}
	return 1;
}

/* accept() said EMFILE or ENFILE. */
static void out_of_fds(struct server *s, int err)
{
	static const char reply[] = "{\"ok\":false,\"error\":\"kdecd is out of file descriptors\",\"errno\":24}\n";
	char why[160];
	unsigned quiet;
	int fd;

	snprintf(why, sizeof(why), "accept: %s (RLIMIT_NOFILE %ld; %d clients, %d connections without a hello)",
		 strerror(err), s->nofile, s->n_clients, s->n_pending);
	if (server_make_room(s, NULL, why))
		return;	/* its descriptor is free: the next accept takes the new one */
	if (server_ratelog_ok(&s->rl_fds, &quiet))
		log_warn("%s: refusing new connections until descriptors free up (%u more not logged)",
			 why, quiet);
	if (s->reserve_fd >= 0) {
		/* Take the connection with the reserve, say why, close it: no busy loop. */
		close(s->reserve_fd);
		fd = accept4(s->ls.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd >= 0) {
			if (send(fd, reply, sizeof(reply) - 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
				(void)0;	/* best effort */
			close(fd);
		}
		s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (fd >= 0 && s->reserve_fd >= 0)
			return;
	}
	/* Nothing to give up: stop watching the socket for a moment. */
	ev_io_stop(s->loop, &s->accept_io);
	ev_timer_set(&s->accept_pause, ACCEPT_PAUSE_S, 0.);
	ev_timer_start(s->loop, &s->accept_pause);
}

void server_on_accept_pause(struct ev_loop *loop, ev_timer *w, int revents)
{
	struct server *s = w->data;

	(void)revents;
	if (s->reserve_fd < 0)
		s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	ev_io_start(loop, &s->accept_io);
}

static void on_idle(struct ev_loop *loop, ev_timer *w, int revents)
{
	struct conn *c = w->data;
	struct server *s = c->srv;
	size_t backlog = c->out_len - c->out_off;
	unsigned quiet;

	(void)loop;
	(void)revents;
	if (c->n_query) {	/* the engine thread owes it a reply: not the peer's fault */
		server_conn_touch(c);
		return;
	}
	if (server_ratelog_ok(&s->rl_idle, &quiet)) {
		if (backlog)
			log_warn("closed the connection of pid %d uid %d: %zu bytes of replies unread for %.0f s "
				 "(--handshake-timeout; %u more not logged)", (int)c->pid, (int)c->uid,
				 backlog, s->o.handshake_timeout_s, quiet);
		else
			log_warn("closed the connection of pid %d uid %d: no hello or command for %.0f s "
				 "(--handshake-timeout; %u more not logged)", (int)c->pid, (int)c->uid,
				 s->o.handshake_timeout_s, quiet);
	}
	if (backlog) {
		server_conn_close(c);
		return;
	}
	server_conn_refuse(c, "no hello or command within --handshake-timeout", ETIMEDOUT);
}

void server_conn_touch(struct conn *c)
{
	if (!c->is_client)
		ev_timer_again(c->srv->loop, &c->idle);
}

static struct conn *conn_new(struct server *s, int fd, const struct ucred *cred)
{
	struct conn *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	c->srv = s;
	c->fd = fd;
	c->id = ++s->next_conn;
	c->t_open_ns = ipc_now_ns();
	c->pid = cred->pid;
	c->uid = cred->uid;
	c->gid = cred->gid;
	c->op = control_peer_is_operator(&s->o.operators, fd, c->uid, c->gid);
	ev_io_init(&c->rio, server_on_read, fd, EV_READ);
	ev_io_init(&c->wio, server_on_write, fd, EV_WRITE);
	ev_init(&c->idle, on_idle);
	c->idle.repeat = s->o.handshake_timeout_s;
	c->rio.data = c->wio.data = c->idle.data = c;
	return c;
}

void server_on_accept(struct ev_loop *loop, ev_io *w, int revents)
{
	struct server *s = w->data;
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct conn *c;
	int fd;

	(void)revents;
	fd = accept4(s->ls.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (fd < 0) {
		if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
			out_of_fds(s, errno);
		return;	/* EAGAIN, EINTR, ECONNABORTED: nothing to do */
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) || !(c = conn_new(s, fd, &cred))) {
		close(fd);
		return;
	}
	if (s->n_pending >= s->o.max_pending) {
		char why[96];

		snprintf(why, sizeof(why), "--max-pending %d reached (pid %d uid %d connecting)",
			 s->o.max_pending, (int)c->pid, (int)c->uid);
		server_make_room(s, NULL, why);
	}
	c->next = s->conns;
	s->conns = c;
	s->n_pending++;
	server_conn_touch(c);
	if (!allowed(s, c)) {
		char why[128];

		snprintf(why, sizeof(why), "uid %d is not on kdecd's allow-list", (int)c->uid);
		log_warn("refused pid %d: %s", (int)c->pid, why);
		server_conn_refuse(c, why, EACCES);
		return;
	}
	ev_io_start(loop, &c->rio);
}
