/* The control socket on the main thread's libev loop. Every connection starts the
 * same way: SO_PEERCRED against the allow-list, then JSON lines. A hello turns it
 * into a client connection that stays open for the client's life (EOF = the client
 * is gone); anything else is a kdctl command. */
#include <errno.h>
#include <grp.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/sched/client_conn.h"
#include "daemon/serve/control.h"
#include "daemon/serve/engine_thread.h"
#include "daemon/serve/server.h"
#include "ipc/ipc_futex.h"

struct conn {
	ev_io rio, wio;
	struct server *srv;
	int fd;
	uint64_t id;			/* cookie for the engine thread's replies */
	pid_t pid;
	uid_t uid;
	gid_t gid;
	int op;				/* an operator (control_peer_is_operator) */
	int is_client;
	uint32_t client_id;
	int close_after_write;
	char in[IPC_LINE_MAX];		/* a partial line */
	size_t in_len;
	char *out;			/* unsent bytes [out_off, out_len) */
	size_t out_len, out_off;
	struct conn *next;
};

struct server {
	struct ev_loop *loop;
	struct server_opts o;
	struct engine *e;
	struct engine_thread *et;
	char path[108];
	int lfd;
	ev_io accept_io;
	ev_async replies;
	struct conn *conns;
	uint64_t next_conn;
	uint32_t next_client;
	int n_clients;
	int shutting_down;
	int bound;			/* the socket file is ours to remove */
	uint64_t t_start_ns;
	uid_t *uids;
	gid_t *gids;
};

static void conn_close(struct conn *c);

static struct conn *conn_by_id(struct server *s, uint64_t id)
{
	for (struct conn *c = s->conns; c; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

static void on_write(struct ev_loop *loop, ev_io *w, int revents)
{
	struct conn *c = w->data;

	(void)loop;
	(void)revents;
	while (c->out_off < c->out_len) {
		ssize_t r = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
				 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (r < 0) {
			conn_close(c);
			return;
		}
		c->out_off += (size_t)r;
	}
	ev_io_stop(c->srv->loop, &c->wio);
	free(c->out);
	c->out = NULL;
	c->out_len = c->out_off = 0;
	if (c->close_after_write)
		conn_close(c);
}

/* Queues line (takes it) and sends what the socket takes now. */
static void conn_send(struct conn *c, char *line)
{
	size_t n;
	char *p;

	if (!line)
		return;
	n = strlen(line);
	p = realloc(c->out, c->out_len + n);
	if (!p) {
		free(line);
		return;
	}
	memcpy(p + c->out_len, line, n);
	free(line);
	c->out = p;
	c->out_len += n;
	if (!ev_is_active(&c->wio))
		ev_io_start(c->srv->loop, &c->wio);
	on_write(c->srv->loop, &c->wio, EV_WRITE);
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

static void conn_close(struct conn *c)
{
	struct server *s = c->srv;
	struct conn **pp;

	if (c->is_client) {
		/* The engine thread cancels its requests and frees the segment. */
		post(s, ET_REMOVE, c->client_id, 0, 0);
		s->n_clients--;
		log_info("client %u (pid %d) disconnected", c->client_id, (int)c->pid);
	}
	ev_io_stop(s->loop, &c->rio);
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

static void refuse(struct conn *c, const char *why, int err)
{
	conn_send(c, control_reply_error(why, err));
	c->close_after_write = 1;
	if (!c->out)
		conn_close(c);
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

	if (c->is_client) {
		refuse(c, "second hello on one connection", EPROTO);
		return;
	}
	if (cmd->protocol != IPC_PROTOCOL_VERSION) {
		snprintf(line, sizeof(line), "protocol version %lld is not supported: kdecd speaks %u",
			 cmd->protocol, IPC_PROTOCOL_VERSION);
		log_warn("client pid %d: %s", (int)c->pid, line);
		refuse(c, line, EPROTO);
		return;
	}
	if (s->shutting_down) {
		refuse(c, "kdecd is shutting down", ESHUTDOWN);
		return;
	}
	if (s->n_clients >= s->o.max_clients) {
		snprintf(line, sizeof(line), "too many clients (--max-clients %d)", s->o.max_clients);
		log_warn("client pid %d refused: %s", (int)c->pid, line);
		refuse(c, line, EUSERS);
		return;
	}
	ret = client_conn_create(&cl, ++s->next_client, s->o.notify, &lim, err, sizeof(err));
	m = calloc(1, sizeof(*m));
	if (ret || !m) {
		free(m);
		client_conn_destroy(ret ? NULL : cl);
		log_error("client pid %d: %s", (int)c->pid, err[0] ? err : "out of memory");
		refuse(c, "the daemon could not build a segment", ENOMEM);
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
		conn_close(c);
		return;
	}
	c->is_client = 1;
	c->client_id = cl->id;
	s->n_clients++;
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
		conn_send(c, control_reply_error("out of memory", ENOMEM));
		return;
	}
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
		conn_send(c, control_reply_error(err, EINVAL));
		return;
	}
	if (control_permit(&cmd, &peer, &s->o.operators, err, sizeof(err))) {
		log_warn("kdctl %s refused (pid %d): %s", control_cmd_name(cmd.kind), (int)c->pid, err);
		conn_send(c, control_reply_error(err, EPERM));
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
			conn_send(c, control_reply_error("kdecd is shutting down: resume cannot undo it",
							 ESHUTDOWN));
			return;
		}
		post(s, ET_DRAIN, 0, 0, cmd.kind == CTL_DRAIN);
		log_info("kdctl %s by uid %d (pid %d)", control_cmd_name(cmd.kind), (int)c->uid, (int)c->pid);
		conn_send(c, control_reply_ok());
		return;
	case CTL_SHUTDOWN:
		log_info("kdctl shutdown by uid %d (pid %d)", (int)c->uid, (int)c->pid);
		conn_send(c, control_reply_ok());
		server_shutdown(s);
		return;
	case CTL_LOG_LEVEL:
		log_threshold = (enum log_level)cmd.level;
		log_info("kdctl log-level by uid %d (pid %d)", (int)c->uid, (int)c->pid);
		conn_send(c, control_reply_ok());
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

static void on_read(struct ev_loop *loop, ev_io *w, int revents)
{
	struct conn *c = w->data;
	ssize_t r;
	char *nl;

	(void)loop;
	(void)revents;
	r = recv(c->fd, c->in + c->in_len, sizeof(c->in) - c->in_len, MSG_DONTWAIT);
	if (r < 0 && (errno == EAGAIN || errno == EINTR || errno == EWOULDBLOCK))
		return;
	if (r <= 0) {
		conn_close(c);
		return;
	}
	c->in_len += (size_t)r;
	while ((nl = memchr(c->in, '\n', c->in_len))) {
		size_t n = (size_t)(nl - c->in);
		struct server *srv = c->srv;
		uint64_t id = c->id;

		do_line(c, c->in, n);
		if (!conn_by_id(srv, id))
			return;	/* closed while handling the line */
		memmove(c->in, nl + 1, c->in_len - n - 1);
		c->in_len -= n + 1;
	}
	if (c->in_len == sizeof(c->in)) {
		if (c->is_client)
			c->in_len = 0;	/* not a protocol we read: drop it */
		else
			refuse(c, "line longer than 4096 bytes", E2BIG);
	}
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

static void on_accept(struct ev_loop *loop, ev_io *w, int revents)
{
	struct server *s = w->data;
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct conn *c;
	int fd;

	(void)revents;
	fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (fd < 0)
		return;
	c = calloc(1, sizeof(*c));
	if (!c || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
		free(c);
		close(fd);
		return;
	}
	c->srv = s;
	c->fd = fd;
	c->id = ++s->next_conn;
	c->pid = cred.pid;
	c->uid = cred.uid;
	c->gid = cred.gid;
	c->op = control_peer_is_operator(&s->o.operators, fd, c->uid, c->gid);
	ev_io_init(&c->rio, on_read, fd, EV_READ);
	ev_io_init(&c->wio, on_write, fd, EV_WRITE);
	c->rio.data = c->wio.data = c;
	c->next = s->conns;
	s->conns = c;
	if (!allowed(s, c)) {
		char why[128];

		snprintf(why, sizeof(why), "uid %d is not on kdecd's allow-list", (int)c->uid);
		log_warn("refused pid %d: %s", (int)c->pid, why);
		refuse(c, why, EACCES);
		return;
	}
	ev_io_start(loop, &c->rio);
}

static void handle_reply(struct server *s, struct et_msg *m)
{
	struct control_info info = {
		.model = s->e->model->cfg.model_type,
		.model_path = s->e->model->path,
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
		peer = peer_of(c);
		if (!m->report)
			conn_send(c, control_reply_error("out of memory", ENOMEM));
		else
			conn_send(c, control_reply((enum control_kind)(m->cookie & 0xff), m->report, &info,
						   &peer));
		break;
	case ET_KICK:
		for (c = s->conns; c; c = c->next) {
			if (c->is_client && c->client_id == m->client_id) {
				char why[256];

				log_warn("client %u (pid %d) disconnected: %s", c->client_id, (int)c->pid, m->why);
				snprintf(why, sizeof(why), "protocol violation: %s", m->why);
				refuse(c, why, EPROTO);
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

/* Makes the socket's directory when it is one of the defaults. */
static int make_dir(const char *path, char *err, size_t err_len)
{
	char copy[108], dir[108];
	struct stat st;

	snprintf(copy, sizeof(copy), "%s", path);
	snprintf(dir, sizeof(dir), "%s", dirname(copy));
	if (!stat(dir, &st))
		return 0;
	/* /run/kdecd is for a group of users (0750 + --allow-gid); /tmp/kdecd-$UID is ours. */
	if (mkdir(dir, strncmp(dir, "/tmp/", 5) ? 0750 : 0700) && errno != EEXIST) {
		snprintf(err, err_len, "cannot create %s: %s", dir, strerror(errno));
		return -errno;
	}
	return 0;
}

static int bind_socket(struct server *s, char *err, size_t err_len)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int ret;

	if (strlen(s->path) >= sizeof(sa.sun_path)) {
		snprintf(err, err_len, "socket path %s is too long", s->path);
		return -ENAMETOOLONG;
	}
	strcpy(sa.sun_path, s->path);
	if (!s->o.socket_path && (ret = make_dir(s->path, err, err_len)))
		return ret;
	s->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s->lfd < 0)
		goto err_errno;
	/* A socket file left by a dead daemon is replaced; a live daemon's is not. */
	if (!connect(s->lfd, (struct sockaddr *)&sa, sizeof(sa))) {
		snprintf(err, err_len, "%s: another kdecd is already serving it", s->path);
		return -EADDRINUSE;
	}
	close(s->lfd);
	s->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s->lfd < 0)
		goto err_errno;
	unlink(s->path);
	if (bind(s->lfd, (struct sockaddr *)&sa, sizeof(sa)) || chmod(s->path, 0660) ||
	    listen(s->lfd, 128))
		goto err_errno;
	s->bound = 1;
	return 0;

err_errno:
	ret = -errno;
	snprintf(err, err_len, "socket %s: %s", s->path, strerror(errno));
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
	s->lfd = -1;
	s->t_start_ns = ipc_now_ns();
	if (s->o.max_clients <= 0)
		s->o.max_clients = SERVER_DEFAULT_MAX_CLIENTS;
	if (s->o.shutdown_timeout_s < 0)
		s->o.shutdown_timeout_s = SERVER_DEFAULT_SHUTDOWN_S;
	if (o->socket_path)
		snprintf(s->path, sizeof(s->path), "%s", o->socket_path);
	else if ((ret = ipc_default_socket(s->path, sizeof(s->path))))
		goto err;
	if ((ret = bind_socket(s, err, err_len)))
		goto err;
	eo = (struct et_opts){ .notify = o->notify, .max_clients = s->o.max_clients, .sched = o->sched,
				 .state_dir = o->state_dir };
	if ((ret = engine_thread_start(&s->et, e, &eo, wake_main, s, err, err_len)))
		goto err;
	ev_async_init(&s->replies, on_replies);
	s->replies.data = s;
	ev_async_start(loop, &s->replies);
	ev_io_init(&s->accept_io, on_accept, s->lfd, EV_READ);
	s->accept_io.data = s;
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
	return s->path;
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
	if (s->loop && s->lfd >= 0)
		ev_io_stop(s->loop, &s->accept_io);
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
		conn_close(c);
	}
	if (s->lfd >= 0)
		close(s->lfd);
	if (s->bound)
		unlink(s->path);
	free(s);
}
