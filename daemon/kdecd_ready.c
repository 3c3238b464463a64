/* kdecd's readiness (kdecd_ready.h): the --daemon handshake over a pipe, the pid file,
 * and sd_notify's READY=1 written by hand (one datagram; no libsystemd). */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/kdecd_ready.h"

#define READY_BYTE 'R'

/* The parent's side: one byte means ready; EOF means the child exited first. */
static void parent_wait(int fd, pid_t child)
{
	char c;
	ssize_t n;
	int st;

	do
		n = read(fd, &c, 1);
	while (n < 0 && errno == EINTR);
	if (n == 1 && c == READY_BYTE)
		_exit(0);
	while (waitpid(child, &st, 0) < 0)
		if (errno != EINTR)
			_exit(1);
	_exit(WIFEXITED(st) && WEXITSTATUS(st) ? WEXITSTATUS(st) : 1);
}

int kdecd_daemonize(struct kdecd_ready *r)
{
	int p[2], null;
	pid_t pid;

	if (pipe2(p, O_CLOEXEC))
		return -errno;
	pid = fork();
	if (pid < 0) {
		int e = errno;

		close(p[0]);
		close(p[1]);
		return -e;
	}
	if (pid > 0) {
		close(p[1]);
		parent_wait(p[0], pid);
	}
	close(p[0]);
	r->fd = p[1];
	setsid();
	/* stdin and stdout to /dev/null, so that a caller reading our output (say a shell's
	 * $(...)) sees its end when the parent exits; stderr keeps the log */
	null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null >= 0) {
		dup2(null, STDIN_FILENO);
		dup2(null, STDOUT_FILENO);
		close(null);
	}
	return 0;
}

static int pid_file_write(struct kdecd_ready *r)
{
	char tmp[4096];
	FILE *f;

	if (snprintf(tmp, sizeof(tmp), "%s.tmp", r->pid_file) >= (int)sizeof(tmp))
		return -ENAMETOOLONG;
	f = fopen(tmp, "we");
	if (!f)
		return -errno;
	fprintf(f, "%ld\n", (long)getpid());
	if (fclose(f) || rename(tmp, r->pid_file)) {	/* readers never see a partial file */
		int e = errno;

		unlink(tmp);
		return -e;
	}
	r->pid_written = 1;
	return 0;
}

/* sd_notify(0, "READY=1"): a datagram to $NOTIFY_SOCKET, a path or "@abstract". */
static void notify_ready(void)
{
	const char *path = getenv("NOTIFY_SOCKET"), msg[] = "READY=1";
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t len;
	int fd;

	if (!path || !*path)
		return;
	len = strlen(path);
	if ((path[0] != '/' && path[0] != '@') || len >= sizeof(sa.sun_path)) {
		log_warn("NOTIFY_SOCKET=%s: not a socket path; READY=1 not sent", path);
		return;
	}
	memcpy(sa.sun_path, path, len);
	if (path[0] == '@')
		sa.sun_path[0] = '\0';
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || sendto(fd, msg, sizeof(msg) - 1, 0, (struct sockaddr *)&sa,
			     (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) < 0)
		log_warn("NOTIFY_SOCKET=%s: READY=1 not sent: %s", path, strerror(errno));
	if (fd >= 0)
		close(fd);
}

int kdecd_ready_tell(struct kdecd_ready *r)
{
	char c = READY_BYTE;
	int ret;

	if (r->pid_file && (ret = pid_file_write(r))) {
		log_error("--pid-file %s: %s", r->pid_file, strerror(-ret));
		return ret;
	}
	notify_ready();
	if (r->fd >= 0) {
		if (write(r->fd, &c, 1) != 1)
			log_warn("--daemon: the starting command did not hear ready: %s", strerror(errno));
		close(r->fd);
		r->fd = -1;
	}
	return 0;
}

void kdecd_ready_fini(struct kdecd_ready *r)
{
	if (r->pid_written)
		unlink(r->pid_file);
	r->pid_written = 0;
}
