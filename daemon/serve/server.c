/* The control socket on the main thread's libev loop. Every connection starts the
 * same way: SO_PEERCRED against the allow-list, then JSON lines. A hello turns it
 * into a client connection that stays open for the client's life (EOF = the client
 * is gone); anything else is a kdctl command. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/sched/client_conn.h"
#include "daemon/serve/control.h"
#include "daemon/serve/engine_thread.h"
#include "daemon/serve/server_internal.h"
#include "ipc/ipc_futex.h"

static void conn_pump(struct conn *c);

static struct conn *conn_by_id(struct server *s, uint64_t id)
{
	for (struct conn *c = s->conns; c; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

/* Sends what the socket takes. 0, or -1 when c was closed (an error, or its last
 * write done). */
static int conn_flush(struct conn *c)
{
	while (c->out_off < c->out_len) {
		ssize_t r = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
				 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			if (!ev_is_active(&c->wio))
				ev_io_start(c->srv->loop, &c->wio);
			return 0;
		}
		if (r < 0) {
			server_conn_close(c);
			return -1;
		}
		c->out_off += (size_t)r;
		server_conn_touch(c);
	}
	ev_io_stop(c->srv->loop, &c->wio);
	free(c->out);
	c->out = NULL;
	c->out_len = c->out_off = 0;
	if (c->close_after_write) {
		server_conn_close(c);
		return -1;
	}
	return 0;
}

void server_on_write(struct ev_loop *loop, ev_io *w, int revents)
{
	struct conn *c = w->data;

	(void)loop;
	(void)revents;
	if (!conn_flush(c))
		conn_pump(c);	/* lines that waited for the backlog to drain */
}

void server_conn_send(struct conn *c, char *line)
{
	size_t n, pending = c->out_len - c->out_off;
	char *p;

	if (!line)
		return;
	n = strlen(line);
	if (c->out_off && pending < c->out_off) {	/* reclaim what was sent */
		memmove(c->out, c->out + c->out_off, pending);
		c->out_len = pending;
		c->out_off = 0;
	}
	p = realloc(c->out, c->out_len + n);
	if (!p) {
		free(line);
		return;
	}
	memcpy(p + c->out_len, line, n);
	free(line);
	c->out = p;
	c->out_len += n;
	conn_flush(c);
}

static void post(struct server *s, enum et_msg_type type, uint32_t client_id, uint64_t cookie, int arg)
{
	struct et_msg *m = calloc(1, sizeof(*m));

	if (!m) {
		log_error("out of memory posting to the engine thread");
		return;
	}
	m->type = type;
	m->client_id = client_id;
	m->cookie = cookie;
	m->arg = arg;
	engine_thread_post(s->et, m);
}

void server_conn_close(struct conn *c)
{
	struct server *s = c->srv;
	struct conn **pp;

	if (c->is_client) {
		/* The engine thread cancels its requests and frees the segment. */
		post(s, ET_REMOVE, c->client_id, 0, 0);
		s->n_clients--;
		log_info("client %u (pid %d) disconnected", c->client_id, (int)c->pid);
	} else {
		s->n_pending--;
	}
	ev_io_stop(s->loop, &c->rio);
	ev_timer_stop(s->loop, &c->idle);
	ev_io_stop(s->loop, &c->wio);
	close(c->fd);
	for (pp = &s->conns; *pp; pp = &(*pp)->next) {
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	}
	free(c->out);
	free(c);
}

/* Sends the hello reply with the segment and eventfds attached. */
static int send_fds(int fd, const char *line, const int *fds, int n_fds)
{
	union {
		char buf[CMSG_SPACE(3 * sizeof(int))];
		struct cmsghdr align;
	} u;
	struct iovec iov = { (void *)line, strlen(line) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			      .msg_controllen = CMSG_SPACE((size_t)n_fds * sizeof(int)) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	ssize_t r;

	memset(u.buf, 0, sizeof(u.buf));
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN((size_t)n_fds * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, (size_t)n_fds * sizeof(int));
	do
		r = sendmsg(fd, &msg, MSG_NOSIGNAL);
	while (r < 0 && errno == EINTR);
	return r == (ssize_t)iov.iov_len ? 0 : -EIO;
}

void server_conn_refuse(struct conn *c, const char *why, int err)
{
	struct server *s = c->srv;
	uint64_t id = c->id;

	c->close_after_write = 1;
	ev_io_stop(s->loop, &c->rio);	/* nothing more is read from it */
	server_conn_send(c, control_reply_error(why, err));
	if (conn_by_id(s, id) && !c->out)
		server_conn_close(c);
}

static void do_hello(struct conn *c, const struct control_cmd *cmd)
{
	struct server *s = c->srv;
	struct client_limits lim = {
		.max_prompt = IPC_PAY_TOKENS,
		.max_new = IPC_MAX_NEW,
		.max_inflight = s->o.sched.max_inflight > 0 ? (uint32_t)s->o.sched.max_inflight
							    : SCHED_DEFAULT_MAX_INFLIGHT,
		.vocab_size = (uint32_t)s->e->model->cfg.vocab_size,
		.model = s->e->model->cfg.model_type,
	};
	struct client_conn *cl;
	struct et_msg *m;
	char line[256], err[256] = "";
	int fds[3], ret;
	uint32_t id;

	if (c->is_client) {
		server_conn_refuse(c, "second hello on one connection", EPROTO);
		return;
	}
	if (cmd->protocol != IPC_PROTOCOL_VERSION) {
		snprintf(line, sizeof(line), "protocol version %lld is not supported: kdecd speaks %u",
			 cmd->protocol, IPC_PROTOCOL_VERSION);
		log_warn("client pid %d: %s", (int)c->pid, line);
		server_conn_refuse(c, line, EPROTO);
		return;
	}
	if (s->shutting_down) {
		server_conn_refuse(c, "kdecd is shutting down", ESHUTDOWN);
		return;
	}
	if (s->n_clients >= s->o.max_clients) {
		snprintf(line, sizeof(line), "too many clients (--max-clients %d)", s->o.max_clients);
		log_warn("client pid %d refused: %s", (int)c->pid, line);
		server_conn_refuse(c, line, EUSERS);
		return;
	}
	id = ++s->next_client;
	ret = client_conn_create(&cl, id, s->o.notify, &lim, err, sizeof(err));
	/* At the open-file limit a hello displaces connections that sent none (its
	 * segment takes up to 3 descriptors). */
	for (int i = 0; (ret == -EMFILE || ret == -ENFILE) && i < 3 &&
			server_make_room(s, c, "a client's hello at the open-file limit"); i++)
		ret = client_conn_create(&cl, id, s->o.notify, &lim, err, sizeof(err));
	m = calloc(1, sizeof(*m));
	if (ret || !m) {
		unsigned quiet;

		free(m);
		client_conn_destroy(ret ? NULL : cl);
		if ((ret != -EMFILE && ret != -ENFILE) || server_ratelog_ok(&s->rl_fds, &quiet))
			log_error("client pid %d: %s", (int)c->pid, err[0] ? err : "out of memory");
		server_conn_refuse(c, "the daemon could not build a segment", ENOMEM);
		return;
	}
	cl->pid = c->pid;
	cl->uid = c->uid;
	cl->gid = c->gid;
	cl->spin = cmd->spin;
	snprintf(line, sizeof(line),
		 "{\"ok\":true,\"protocol\":%u,\"notify\":\"%s\",\"seg_bytes\":%u,\"client_id\":%u}\n",
		 IPC_PROTOCOL_VERSION, s->o.notify == IPC_NOTIFY_EVENTFD ? "eventfd" : "futex",
		 IPC_SEG_BYTES, cl->id);
	fds[0] = cl->memfd;
	fds[1] = cl->notify_efd;
	fds[2] = cl->bell_efd;
	if (send_fds(c->fd, line, fds, s->o.notify == IPC_NOTIFY_EVENTFD ? 3 : 2)) {
		log_warn("client pid %d: the handshake reply could not be sent", (int)c->pid);
		client_conn_destroy(cl);
		free(m);
		server_conn_close(c);
		return;
	}
	c->is_client = 1;
	c->client_id = cl->id;
	s->n_clients++;
	s->n_pending--;
	ev_timer_stop(s->loop, &c->idle);	/* a client may stay silent for its whole life */
	log_info("client %u connected: pid %d uid %d%s", cl->id, (int)c->pid, (int)c->uid,
		 cl->spin ? ", spinning" : "");
	m->type = ET_ADD;
	m->client = cl;
	engine_thread_post(s->et, m);
}

/* The numbers live on the engine thread: ask it; the reply comes back through
 * on_replies with this connection's id and the command. A session is closed for
 * the asking connection's uid, its owner. */
static void post_query(struct server *s, struct conn *c, const struct control_cmd *cmd,
		       enum et_query q)
{
	struct et_msg *m = calloc(1, sizeof(*m));

	if (!m) {
		server_conn_send(c, control_reply_error("out of memory", ENOMEM));
		return;
	}
	c->n_query++;	/* its next lines wait for this reply: in order, one at a time */
	m->type = ET_QUERY;
	m->cookie = c->id << 8 | (uint64_t)cmd->kind;
	m->arg = q;
	m->uid = c->uid;
	snprintf(m->why, sizeof(m->why), "%s", cmd->name);
	engine_thread_post(s->et, m);
}

static struct control_peer peer_of(const struct conn *c)
{
	return (struct control_peer){ .pid = c->pid, .uid = c->uid, .gid = c->gid, .op = c->op };
}

static void do_line(struct conn *c, const char *line, size_t len)
{
	struct server *s = c->srv;
	struct control_peer peer = peer_of(c);
	struct control_cmd cmd;
	char err[256];

	if (c->is_client)
		return;	/* clients say nothing after the hello; ignore it */
	if (control_parse(line, len, &cmd, err, sizeof(err))) {
		server_conn_send(c, control_reply_error(err, EINVAL));
		return;
	}
	if (control_permit(&cmd, &peer, &s->o.operators, err, sizeof(err))) {
		log_warn("kdctl %s refused (pid %d): %s", control_cmd_name(cmd.kind), (int)c->pid, err);
		server_conn_send(c, control_reply_error(err, EPERM));
		return;
	}
	if (cmd.kind == CTL_DRAIN && !cmd.on)
		cmd.kind = CTL_RESUME;
	switch (cmd.kind) {
	case CTL_HELLO:
		do_hello(c, &cmd);
		return;
	case CTL_DRAIN:
	case CTL_RESUME:
		/* A shutdown drains for good: nothing may admit requests again. */
		if (cmd.kind == CTL_RESUME && s->shutting_down) {
			server_conn_send(c, control_reply_error("kdecd is shutting down: resume cannot undo it",
							 ESHUTDOWN));
			return;
		}
		post(s, ET_DRAIN, 0, 0, cmd.kind == CTL_DRAIN);
		log_info("kdctl %s by uid %d (pid %d)", control_cmd_name(cmd.kind), (int)c->uid, (int)c->pid);
		server_conn_send(c, control_reply_ok());
		return;
	case CTL_SHUTDOWN:
		log_info("kdctl shutdown by uid %d (pid %d)", (int)c->uid, (int)c->pid);
		server_conn_send(c, control_reply_ok());
		server_shutdown(s);
		return;
	case CTL_LOG_LEVEL:
		log_threshold = (enum log_level)cmd.level;
		log_info("kdctl log-level by uid %d (pid %d)", (int)c->uid, (int)c->pid);
		server_conn_send(c, control_reply_ok());
		return;
	case CTL_SNAPSHOT:
		log_info("kdctl snapshot by uid %d (pid %d)", (int)c->uid, (int)c->pid);
		post_query(s, c, &cmd, ET_Q_SNAPSHOT);
		return;
	case CTL_SESSION_CLOSE:
		log_info("kdctl session-close '%s' by uid %d (pid %d)", cmd.name, (int)c->uid, (int)c->pid);
		post_query(s, c, &cmd, ET_Q_SESSION_CLOSE);
		return;
	default:
		post_query(s, c, &cmd, ET_Q_REPORT);
	}
}

/* A control connection takes its next line only when the engine thread owes it no
 * reply and its unsent replies are under SERVER_OUT_MAX: a peer that pipelines and
 * never reads is held to that, its further input left in the kernel's buffers. */
static int conn_blocked(const struct conn *c)
{
	return c->close_after_write || c->n_query ||
	       (!c->is_client && c->out_len - c->out_off > SERVER_OUT_MAX);
}

/* Handles the complete lines buffered, then reads again only if it may go on. */
static void conn_pump(struct conn *c)
{
	struct server *s = c->srv;
	uint64_t id = c->id;
	char *nl;

	while (!conn_blocked(c) && (nl = memchr(c->in, '\n', c->in_len))) {
		size_t n = (size_t)(nl - c->in);

		do_line(c, c->in, n);
		if (!conn_by_id(s, id))
			return;	/* closed while handling the line */
		memmove(c->in, nl + 1, c->in_len - n - 1);
		c->in_len -= n + 1;
		server_conn_touch(c);
	}
	if (!conn_blocked(c) && c->in_len == sizeof(c->in)) {
		if (c->is_client) {
			c->in_len = 0;	/* not a protocol we read: drop it */
		} else {
			server_conn_refuse(c, "line longer than 4096 bytes", E2BIG);
			return;
		}
	}
	if (conn_blocked(c))
		ev_io_stop(s->loop, &c->rio);
	else if (!ev_is_active(&c->rio))
		ev_io_start(s->loop, &c->rio);
}

void server_on_read(struct ev_loop *loop, ev_io *w, int revents)
{
	struct conn *c = w->data;
	ssize_t r;

	(void)loop;
	(void)revents;
	if (conn_blocked(c)) {
		ev_io_stop(c->srv->loop, &c->rio);
		return;
	}
	r = recv(c->fd, c->in + c->in_len, sizeof(c->in) - c->in_len, MSG_DONTWAIT);
	if (r < 0 && (errno == EAGAIN || errno == EINTR || errno == EWOULDBLOCK))
		return;
	if (r <= 0) {
		server_conn_close(c);
		return;
	}
	c->in_len += (size_t)r;
	conn_pump(c);
}

static void handle_reply(struct server *s, struct et_msg *m)
{
	struct control_info info = {
		.model = s->e->model->cfg.model_type,
		.model_path = s->e->model->path,
		.weights = s->weights,
		.backend = s->o.backend ? s->o.backend : "cpu",
		.notify = s->o.notify == IPC_NOTIFY_EVENTFD ? "eventfd" : "futex",
		.uptime_s = (double)(ipc_now_ns() - s->t_start_ns) * 1e-9,
		.max_clients = s->o.max_clients,
	};
	struct control_peer peer;
	struct conn *c;

	switch (m->type) {
	case ET_REPORT:
		c = conn_by_id(s, m->cookie >> 8);
		if (!c)
			break;
		c->n_query--;
		peer = peer_of(c);
		if (!m->report)
			server_conn_send(c, control_reply_error("out of memory", ENOMEM));
		else
			server_conn_send(c, control_reply((enum control_kind)(m->cookie & 0xff), m->report, &info,
								  &peer));
		if ((c = conn_by_id(s, m->cookie >> 8)))
			conn_pump(c);	/* the lines that waited for this reply */
		break;
	case ET_KICK:
		for (c = s->conns; c; c = c->next) {
			if (c->is_client && c->client_id == m->client_id) {
				char why[256];

				log_warn("client %u (pid %d) disconnected: %s", c->client_id, (int)c->pid, m->why);
				snprintf(why, sizeof(why), "protocol violation: %s", m->why);
				server_conn_refuse(c, why, EPROTO);
				break;
			}
		}
		break;
	case ET_STOPPED:
		log_info("engine thread stopped");
		ev_break(s->loop, EVBREAK_ALL);
		break;
	default:
		break;
	}
}

static void on_replies(struct ev_loop *loop, ev_async *w, int revents)
{
	struct server *s = w->data;
	struct et_msg *m, *next;

	(void)loop;
	(void)revents;
	for (m = engine_thread_replies(s->et); m; m = next) {
		next = m->next;
		handle_reply(s, m);
		et_report_free(m->report);
		free(m);
	}
}

/* Called on the engine thread. */
static void wake_main(void *arg)
{
	struct server *s = arg;

	ev_async_send(s->loop, &s->replies);
}

/* The socket's mode and, for a default path, its directory's. Without an allow-list
 * only our uid (and root) may connect: 0660, the directory 0700 (/tmp) or 0750 (/run,
 * for our group). With --allow-uid or --allow-gid the peers checked by SO_PEERCRED
 * must be able to reach and open the socket: 0666, the directory 0711 (searchable,
 * not listable). The kernel's permission bits cannot name a list of uids; the
 * allow-list is the gate, checked on every connection before anything is read. */
int server_listen(struct listen_socket *ls, const struct server_opts *o, char *err, size_t err_len)
{
	int listed = o->n_allow_uid || o->n_allow_gid, ret;
	char def[108], dir[108];
	const char *path = o->socket_path;
	mode_t dir_mode;

	ls->fd = ls->lock_fd = -1;
	if (!path && (ret = ipc_default_socket(def, sizeof(def)))) {
		snprintf(err, err_len, "no default socket path: %s", strerror(-ret));
		return ret;
	}
	path = path ? path : def;
	dir_mode = listed ? 0711 : strncmp(path, "/tmp/", 5) ? 0750 : 0700;
	ret = listen_socket_open(ls, path, listed ? 0666 : 0660, SOMAXCONN, !o->socket_path, dir_mode,
				 err, err_len);
	/* A directory searchable by an allowed group does for --allow-gid alone (the
	 * systemd unit's 0750 RuntimeDirectory of group kdec); for uids we cannot tell. */
	if (!ret && listed && listen_socket_unreachable_dir(path, o->allow_gid, o->n_allow_gid,
							    !o->n_allow_uid, dir, sizeof(dir)))
		log_warn("%s is not searchable by others (no o+x): peers of --allow-uid / --allow-gid "
			 "may not reach %s", dir, path);
	return ret;
}

int server_create(struct server **out, struct ev_loop *loop, struct engine *e,
		  const struct server_opts *o, char *err, size_t err_len)
{
	struct server *s = calloc(1, sizeof(*s));
	struct et_opts eo;
	int ret;

	*out = NULL;
	if (!s)
		return -ENOMEM;
	s->loop = loop;
	s->e = e;
	s->o = *o;
	s->ls.fd = s->ls.lock_fd = s->reserve_fd = -1;
	s->t_start_ns = ipc_now_ns();
	model_weights_name(e->model, s->weights, sizeof(s->weights));
	if (s->o.max_clients <= 0)
		s->o.max_clients = SERVER_DEFAULT_MAX_CLIENTS;
	if (s->o.shutdown_timeout_s < 0)
		s->o.shutdown_timeout_s = SERVER_DEFAULT_SHUTDOWN_S;
	if (s->o.max_pending <= 0)
		s->o.max_pending = SERVER_DEFAULT_MAX_PENDING;
	if (s->o.handshake_timeout_s <= 0)
		s->o.handshake_timeout_s = SERVER_DEFAULT_HANDSHAKE_S;
	server_fd_limits(s);
	if (o->ls) {	/* claimed by the caller before the model load: ours now */
		s->ls = *o->ls;
		o->ls->fd = o->ls->lock_fd = -1;
		o->ls->bound = 0;
	} else if ((ret = server_listen(&s->ls, o, err, err_len))) {
		goto err;
	}
	/* given up at the open-file limit to refuse a connection with a reason */
	s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	eo = (struct et_opts){ .notify = o->notify, .max_clients = s->o.max_clients, .sched = o->sched,
				 .state_dir = o->state_dir };
	if ((ret = engine_thread_start(&s->et, e, &eo, wake_main, s, err, err_len)))
		goto err;
	ev_async_init(&s->replies, on_replies);
	s->replies.data = s;
	ev_async_start(loop, &s->replies);
	ev_io_init(&s->accept_io, server_on_accept, s->ls.fd, EV_READ);
	s->accept_io.data = s;
	ev_init(&s->accept_pause, server_on_accept_pause);
	s->accept_pause.data = s;
	ev_io_start(loop, &s->accept_io);
	*out = s;
	return 0;

err:
	if (!err[0])
		snprintf(err, err_len, "server: %s", strerror(-ret));
	server_destroy(s);
	return ret;
}

const char *server_socket_path(const struct server *s)
{
	return s->ls.path;
}

void server_shutdown(struct server *s)
{
	struct et_msg *m;

	if (s->shutting_down)
		return;
	s->shutting_down = 1;
	log_info("shutting down: no new requests; running ones get %.1f s", s->o.shutdown_timeout_s);
	m = calloc(1, sizeof(*m));
	if (!m) {
		server_stop_now(s);
		return;
	}
	m->type = ET_SHUTDOWN;
	m->arg = (int)(s->o.shutdown_timeout_s * 1000);
	m->deadline_ns = ipc_now_ns() + (uint64_t)(s->o.shutdown_timeout_s * 1e9);
	engine_thread_post(s->et, m);
}

void server_stop_now(struct server *s)
{
	s->shutting_down = 1;
	post(s, ET_HARD_STOP, 0, 0, 0);
}

void server_destroy(struct server *s)
{
	if (!s)
		return;
	if (s->loop && s->ls.fd >= 0) {
		ev_io_stop(s->loop, &s->accept_io);
		ev_timer_stop(s->loop, &s->accept_pause);
	}
	/* Join first: REMOVE messages posted by conn_close below then find no thread
	 * and are freed with it. */
	if (s->et) {
		ev_async_stop(s->loop, &s->replies);
		engine_thread_destroy(s->et);
		s->et = NULL;
	}
	while (s->conns) {
		struct conn *c = s->conns;

		c->is_client = 0;	/* its client_conn went with the engine thread */
		server_conn_close(c);
	}
	listen_socket_close(&s->ls);
	if (s->reserve_fd >= 0)
		close(s->reserve_fd);
	free(s);
}
