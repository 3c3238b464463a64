/* libkdclient: the connection's life. The socket handshake (hello, the segment and
 * eventfds back with SCM_RIGHTS), mapping and checking the segment, noticing that
 * the daemon went away, and the pollable fd for event loops. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/kdclient_internal.h"
#include "ipc/ipc_ring.h"

#define CONNECT_TIMEOUT_S 10
#define MAX_FDS 3

static __thread char tls_err[256];

const char *kd_connect_error(const struct kd_client *c)
{
	if (c)
		return c->err[0] ? c->err : "connected";
	return tls_err;
}

int kd_default_socket(char *buf, size_t len)
{
	return ipc_default_socket(buf, len);
}

static int fail(int ret, const char *fmt, const char *arg)
{
	snprintf(tls_err, sizeof(tls_err), fmt, arg, strerror(-ret));
	return ret;
}

/* The daemon's replies are flat JSON objects that it writes itself; these pick out
 * one key. They return -ENOENT when the key is absent. */
static const char *json_key(const char *line, const char *key)
{
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(line, pat);
	if (!p)
		return NULL;
	p += strlen(pat);
	while (*p == ' ')
		p++;
	return p;
}

static int json_long(const char *line, const char *key, long long *out)
{
	const char *p = json_key(line, key);
	char *end;

	if (!p)
		return -ENOENT;
	*out = strtoll(p, &end, 10);
	return end == p ? -EINVAL : 0;
}

static void json_str(const char *line, const char *key, char *out, size_t len)
{
	const char *p = json_key(line, key);
	size_t n = 0;

	if (len)
		out[0] = '\0';
	if (!p || *p != '"' || !len)
		return;
	for (p++; *p && *p != '"' && n + 1 < len; p++) {
		if (*p == '\\' && p[1])
			p++;
		out[n++] = *p;
	}
	out[n] = '\0';
}

/* Reads one reply line and any fds passed with it. Returns the fd count or -errno. */
static int recv_reply(int sock, char *line, size_t len, int *fds)
{
	size_t used = 0;
	int n_fds = 0;

	while (used + 1 < len) {
		union {
			char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
			struct cmsghdr align;
		} u;
		struct iovec iov = { line + used, len - used - 1 };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1,
				      .msg_control = u.buf, .msg_controllen = sizeof(u.buf) };
		ssize_t r = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
			if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
				continue;
			for (size_t i = 0; (i + 1) * sizeof(int) <= cm->cmsg_len - CMSG_LEN(0); i++) {
				int fd;

				memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
				if (n_fds < MAX_FDS)
					fds[n_fds++] = fd;
				else
					close(fd);
			}
		}
		if (r == 0)
			break;
		used += (size_t)r;
		line[used] = '\0';
		if (memchr(line, '\n', used))
			return n_fds;
	}
	line[used] = '\0';
	for (int i = 0; i < n_fds; i++)
		close(fds[i]);
	return used ? -EPROTO : -ECONNRESET;
}

static int open_socket(const char *path, int *out)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = CONNECT_TIMEOUT_S };
	int s;

	if (strlen(path) >= sizeof(sa.sun_path))
		return fail(-ENAMETOOLONG, "socket path %s: %s", path);
	strcpy(sa.sun_path, path);
	s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return fail(-errno, "socket: %s%s", "");
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int ret = -errno;

		close(s);
		return fail(ret, "cannot connect to kdecd at %s: %s", path);
	}
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	*out = s;
	return 0;
}

/* Checks the daemon's reply and the segment it describes; maps it. */
static int map_segment(struct kd_client *c, const char *line, const int *fds, int n_fds)
{
	const struct ipc_seg_hdr *h;
	char notify[16];
	long long proto = 0, bytes = 0, id = 0;
	struct stat st;

	json_long(line, "protocol", &proto);
	json_long(line, "seg_bytes", &bytes);
	json_long(line, "client_id", &id);
	json_str(line, "notify", notify, sizeof(notify));
	if (proto != IPC_PROTOCOL_VERSION) {
		snprintf(tls_err, sizeof(tls_err), "kdecd speaks protocol %lld, this library %u",
			 proto, IPC_PROTOCOL_VERSION);
		return -EPROTO;
	}
	c->notify = !strcmp(notify, "eventfd") ? IPC_NOTIFY_EVENTFD : IPC_NOTIFY_FUTEX;
	if (n_fds < 2 || (c->notify == IPC_NOTIFY_EVENTFD && n_fds < 3) || bytes != IPC_SEG_BYTES ||
	    fstat(fds[0], &st) || st.st_size != bytes) {
		snprintf(tls_err, sizeof(tls_err), "kdecd's reply does not match protocol %u (%d fds, %lld bytes)",
			 IPC_PROTOCOL_VERSION, n_fds, bytes);
		return -EPROTO;
	}
	c->seg = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (c->seg == MAP_FAILED) {
		c->seg = NULL;
		return fail(-errno, "mapping the segment%s: %s", "");
	}
	c->seg_bytes = (size_t)bytes;
	h = c->seg;
	if (h->magic != IPC_MAGIC || h->version != IPC_PROTOCOL_VERSION || h->notify != c->notify ||
	    h->sub_off != IPC_SUB_OFF || h->ev_off != IPC_EV_OFF || h->pay_off != IPC_PAY_OFF ||
	    h->sub_slots != IPC_SUB_SLOTS || h->ev_slots != IPC_EV_SLOTS || h->pay_tokens != IPC_PAY_TOKENS) {
		snprintf(tls_err, sizeof(tls_err), "the segment's header does not match protocol %u",
			 IPC_PROTOCOL_VERSION);
		return -EPROTO;
	}
	c->client_id = (uint32_t)id;
	c->max_prompt = h->max_prompt;
	c->notify_efd = fds[1];
	c->bell_efd = c->notify == IPC_NOTIFY_EVENTFD ? fds[2] : -1;
	c->sub_tail = atomic_load(&((struct ipc_seg_hdr *)c->seg)->sub_tail);
	c->ev_head = atomic_load(&((struct ipc_seg_hdr *)c->seg)->ev_head);
	return 0;
}

int kd_connect(struct kd_client **out, const struct kd_connect_opts *opts)
{
	static const struct kd_connect_opts defaults;
	char path[256], line[IPC_LINE_MAX], hello[128];
	int fds[MAX_FDS], n_fds, ret;
	struct kd_client *c;

	*out = NULL;
	tls_err[0] = '\0';
	if (!opts)
		opts = &defaults;
	if (opts->socket_path)
		snprintf(path, sizeof(path), "%s", opts->socket_path);
	else if (ipc_default_socket(path, sizeof(path)))
		return fail(-ENAMETOOLONG, "default socket path%s: %s", "");
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->sock = c->notify_efd = c->bell_efd = c->epfd = -1;
	c->spin_us = opts->spin_us;
	c->next_id = 1;
	if ((ret = open_socket(path, &c->sock)))
		goto err;
	snprintf(hello, sizeof(hello), "{\"hello\":\"kdclient\",\"protocol\":%u,\"spin\":%s}\n",
		 IPC_PROTOCOL_VERSION, opts->flags & KD_CONNECT_SPIN ? "true" : "false");
	/* A daemon that refuses us at accept may close before reading the hello: the
	 * send then fails, but its reason is still waiting to be read. */
	ret = send(c->sock, hello, strlen(hello), MSG_NOSIGNAL) == (ssize_t)strlen(hello) ? 0 : -errno;
	n_fds = recv_reply(c->sock, line, sizeof(line), fds);
	if (n_fds < 0) {
		ret = fail(ret ? ret : n_fds, "no answer from kdecd at %s: %s", path);
		goto err;
	}
	if (!strstr(line, "\"ok\":true")) {
		char why[200];
		long long code = 0;

		json_str(line, "error", why, sizeof(why));
		json_long(line, "errno", &code);
		snprintf(tls_err, sizeof(tls_err), "kdecd refused the connection: %.200s", why[0] ? why : line);
		ret = code > 0 ? (int)-code : -ECONNREFUSED;
		for (int i = 0; i < n_fds; i++)
			close(fds[i]);
		goto err;
	}
	ret = map_segment(c, line, fds, n_fds);
	close(fds[0]);	/* the mapping keeps the segment */
	if (ret) {
		for (int i = 1; i < n_fds; i++)
			close(fds[i]);
		c->notify_efd = c->bell_efd = -1;
		goto err;
	}
	for (int i = c->notify == IPC_NOTIFY_EVENTFD ? 3 : 2; i < n_fds; i++)
		close(fds[i]);
	*out = c;
	return 0;

err:
	kd_close(c);
	return ret;
}

void kd_close(struct kd_client *c)
{
	if (!c)
		return;
	if (c->seg)
		munmap(c->seg, c->seg_bytes);
	if (c->sock >= 0)
		close(c->sock);
	if (c->notify_efd >= 0)
		close(c->notify_efd);
	if (c->bell_efd >= 0)
		close(c->bell_efd);
	if (c->epfd >= 0)
		close(c->epfd);
	free(c);
}

/* Reads the daemon's parting line (if any) without blocking. */
static void read_reason(struct kd_client *c)
{
	char line[512];
	ssize_t r = recv(c->sock, line, sizeof(line) - 1, MSG_DONTWAIT);

	if (r > 0) {
		char why[256];

		line[r] = '\0';
		json_str(line, "error", why, sizeof(why));
		snprintf(c->err, sizeof(c->err), "kdecd dropped the connection: %.200s", why[0] ? why : line);
	} else if (!c->err[0]) {
		snprintf(c->err, sizeof(c->err), "kdecd closed the connection");
	}
}

int kdclient_check_closed(struct kd_client *c)
{
	struct ipc_seg_hdr *h = c->seg;
	struct pollfd p = { .fd = c->sock, .events = POLLIN };
	int ret = atomic_load(&c->closed);

	if (ret)
		return ret;
	/* The daemon marks the segment closed before its main thread writes the reason
	 * and closes the socket: give that a moment to arrive. */
	if (atomic_load_explicit(&h->state, memory_order_acquire) == IPC_STATE_CLOSED)
		poll(&p, 1, 1000);
	else if (poll(&p, 1, 0) != 1)
		return 0;
	if (p.revents & (POLLIN | POLLHUP | POLLERR) ||
	    atomic_load_explicit(&h->state, memory_order_acquire) == IPC_STATE_CLOSED) {
		/* Only a line or EOF can arrive after the handshake: either ends us. */
		read_reason(c);
		atomic_store(&c->closed, -ECONNRESET);
		return -ECONNRESET;
	}
	return 0;
}

int kd_fd(struct kd_client *c)
{
	struct epoll_event ev = { .events = EPOLLIN };
	struct ipc_seg_hdr *h = c->seg;

	if (c->epfd >= 0)
		return c->epfd;
	c->epfd = epoll_create1(EPOLL_CLOEXEC);
	if (c->epfd < 0)
		return -errno;
	if (epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->notify_efd, &ev) ||
	    epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->sock, &ev)) {
		int ret = -errno;

		close(c->epfd);
		c->epfd = -1;
		return ret;
	}
	/* From now on every publication writes the eventfd. */
	atomic_fetch_or(&h->client_sleep, IPC_SLEEP_FD);
	return c->epfd;
}
