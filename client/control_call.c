/* The control socket round trip shared by kdctl, kdrun and kdbench agent. */
#include "client/control_call.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int control_call(const char *path, const char *req, char **reply)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t len = 0, cap = 4096, n = strlen(req);
	char *buf;
	int s, ret = 0, send_err = 0;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	memcpy(sa.sun_path, path, strlen(path) + 1);
	if (!(buf = malloc(cap)))
		return -ENOMEM;
	s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)))
		ret = -errno;
	/* A daemon that refuses this uid writes its reason and closes at once, maybe
	 * before the request is sent: the send then fails (EPIPE), the reason is still
	 * there to read, and it, not the send's errno, is the answer. */
	if (!ret && send(s, req, n, MSG_NOSIGNAL) != (ssize_t)n)
		send_err = -errno;
	while (!ret) {
		ssize_t r;

		if (len + 1 == cap) {
			char *nb = cap < CONTROL_REPLY_MAX ? realloc(buf, cap * 2) : NULL;

			if (!nb) {
				ret = cap < CONTROL_REPLY_MAX ? -ENOMEM : -E2BIG;
				break;
			}
			buf = nb;
			cap *= 2;
		}
		r = recv(s, buf + len, cap - len - 1, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		len += (size_t)r;
		buf[len] = '\0';
		if (memchr(buf, '\n', len))
			break;
	}
	if (s >= 0)
		close(s);
	buf[len] = '\0';
	if (!ret && !len)
		ret = send_err ? send_err : -ECONNRESET;
	if (ret)
		free(buf);
	else
		*reply = buf;
	return ret;
}
