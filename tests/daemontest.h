/* Helpers of the tests that run a real kdecd: its paths, starting it and waiting until
 * it accepts clients, stopping it, kdctl's answers, the offline reference (kdbench
 * generate) for a prompt, and cleaning up after it. Include after testutil.h. */
#ifndef KD_TESTS_DAEMONTEST_H
#define KD_TESTS_DAEMONTEST_H

#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "tests/testutil.h"

#define DAEMONTEST_MAX_ARGS 26	/* kdecd's argv, its own options included */

/* One test's daemon: where the binaries and the model are, its scratch directory
 * (logs, socket) and its process. */
struct daemontest {
	char builddir[512];	/* top_builddir: kdecd, kdbench, kdctl */
	char model[512];	/* the tiny Llama 3 checkpoint under top_srcdir */
	char dir[256];		/* a fresh /tmp/kdec_<tag>.XXXXXX */
	char sock[300];		/* dir/kdecd.sock */
	pid_t pid;		/* the running kdecd, or 0 */
};

/* Fills d's paths and makes its directory. Ignores SIGPIPE: a daemon that goes away
 * mid-write must not end the test. 0, or -1 when the directory cannot be made. */
static inline int daemontest_init(struct daemontest *d, const char *tag)
{
	const char *b = getenv("top_builddir"), *s = getenv("top_srcdir");
	char tmpl[200];

	memset(d, 0, sizeof(*d));
	snprintf(d->builddir, sizeof(d->builddir), "%s", b ? b : ".");
	snprintf(d->model, sizeof(d->model), "%s/tests/data/golden/llama3", s ? s : ".");
	snprintf(tmpl, sizeof(tmpl), "/tmp/kdec_%s.XXXXXX", tag);
	if (!mkdtemp(tmpl)) {
		perror("mkdtemp");
		return -1;
	}
	snprintf(d->dir, sizeof(d->dir), "%s", tmpl);
	snprintf(d->sock, sizeof(d->sock), "%s/kdecd.sock", d->dir);
	signal(SIGPIPE, SIG_IGN);
	return 0;
}

/* Forks `kdecd --backend cpu --model <model> --socket <sock> --threads 2` followed by
 * the options given (strings, NULL last; a later --backend wins), its stderr appended
 * to dir/log_name, and waits up to 10 s for the socket to accept a client. The CPU
 * backend by name: the tests compare with CPU runs, and kdecd's default (auto) would
 * take a GPU where one is present. d->pid receives the daemon's pid (0 once it
 * died). Returns 0 once it answers, else -1. */
static inline int daemontest_start(struct daemontest *d, const char *log_name, ...)
{
	char kdecd[600], log[600];
	char *argv[DAEMONTEST_MAX_ARGS] = { kdecd, "--backend", "cpu", "--model", d->model,
					     "--socket", d->sock, "--threads", "2" };
	int argc = 9;
	struct kd_client *c;
	va_list ap;
	pid_t pid;

	snprintf(kdecd, sizeof(kdecd), "%s/kdecd", d->builddir);
	snprintf(log, sizeof(log), "%s/%s", d->dir, log_name);
	va_start(ap, log_name);
	while (argc < DAEMONTEST_MAX_ARGS - 1 && (argv[argc] = (char *)va_arg(ap, const char *)))
		argc++;
	va_end(ap);
	argv[argc] = NULL;
	pid = fork();
	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);

		dup2(fd, 2);
		execv(argv[0], argv);
		_exit(127);
	}
	d->pid = pid > 0 ? pid : 0;
	if (pid < 0)
		return -1;
	for (int i = 0; i < 200; i++) {
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			d->pid = 0;
			return -1;
		}
		if (!kd_connect(&c, &(struct kd_connect_opts){ .socket_path = d->sock })) {
			kd_close(c);
			return 0;
		}
		usleep(50000);
	}
	return -1;
}

/* SIGTERM to the daemon and its exit status: 0 for an orderly exit 0, 128 + signal
 * when a signal ended it, -1 when none runs. d->pid is 0 after. */
static inline int daemontest_stop(struct daemontest *d)
{
	pid_t pid = d->pid;
	int st = 0;

	d->pid = 0;
	if (pid <= 0)
		return -1;
	kill(pid, SIGTERM);
	if (waitpid(pid, &st, 0) != pid)
		return -1;
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* One control round trip on a raw connection to sock (no kdctl): line, which ends in
 * "\n", out; the reply's first line into reply (len bytes, NUL-terminated). Sends and
 * receives time out after timeout_s, so a hung daemon fails the check instead of
 * hanging the test. 0, or -1 when the connection or the write failed. */
static inline int daemontest_control(const char *sock, const char *line, char *reply, size_t len,
				     int timeout_s)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = timeout_s };
	size_t n = 0, k = strlen(sock);
	ssize_t r;
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	reply[0] = 0;
	if (s < 0)
		return -1;
	memcpy(sa.sun_path, sock, k < sizeof(sa.sun_path) ? k : sizeof(sa.sun_path) - 1);
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) || write(s, line, strlen(line)) < 0) {
		close(s);
		return -1;
	}
	while (n + 1 < len && (r = read(s, reply + n, len - 1 - n)) > 0) {
		n += (size_t)r;
		if (memchr(reply, '\n', n))
			break;
	}
	close(s);
	reply[n] = 0;
	return 0;
}

/* Output of `kdctl --socket <sock> <cmd>` into buf (len bytes, NUL-terminated).
 * 0, or -1 when kdctl failed. */
static inline int daemontest_kdctl(const struct daemontest *d, const char *cmd, char *buf,
				   size_t len)
{
	char line[1024];
	size_t n = 0, k;
	FILE *f;

	snprintf(line, sizeof(line), "'%s/kdctl' --socket '%s' %s", d->builddir, d->sock, cmd);
	if (!(f = popen(line, "r")))
		return -1;
	while (n + 1 < len && (k = fread(buf + n, 1, len - 1 - n, f)) > 0)
		n += k;
	buf[n] = 0;
	return pclose(f) == 0 ? 0 : -1;
}

/* The number after key (a metric's name after "\n", so not its # HELP line, or a JSON
 * key) in the output of kdctl cmd, or -1. */
static inline long long daemontest_number(const struct daemontest *d, const char *cmd,
					  const char *key)
{
	static char buf[1 << 16];
	const char *p;

	if (daemontest_kdctl(d, cmd, buf, sizeof(buf)))
		return -1;
	for (p = buf; (p = strstr(p, key)); p++) {
		p += strlen(key);
		if (*p == '"')
			p++;
		if (*p == ':' || *p == ' ') {
			while (*p == ':' || *p == ' ')
				p++;
			return (long long)strtod(p, NULL);
		}
	}
	return -1;
}

/* kdbench generate's greedy ids for prompt p (n ids), at most max_tokens into out;
 * returns how many, or -1. */
static inline int daemontest_reference(const struct daemontest *d, const int32_t *p, int n,
				       int max_tokens, int32_t *out)
{
	char cmd[2048], ids[512] = "";
	int len = 0, k = 0;
	FILE *f;

	for (int j = 0; j < n; j++)
		len += snprintf(ids + len, sizeof(ids) - (size_t)len, "%s%d", j ? "," : "", p[j]);
	snprintf(cmd, sizeof(cmd), "'%s/kdbench' generate --model '%s' --prompt %s --max-tokens %d --threads 1 2>/dev/null",
		 d->builddir, d->model, ids, max_tokens);
	if (!(f = popen(cmd, "r")))
		return -1;
	while (k < max_tokens && fscanf(f, "%d", &out[k]) == 1)
		k++;
	pclose(f);
	return k;
}

/* The end of a daemon test: a daemon still running must exit 0 on SIGTERM (a failed
 * check otherwise); the scratch directory goes, unless a check failed, when it stays
 * for its logs and the test says where. */
static inline void daemontest_finish(struct daemontest *d)
{
	char cmd[300];

	if (d->pid > 0)
		CHECK(daemontest_stop(d) == 0, "kdecd did not exit 0 on SIGTERM");
	if (test_failures) {
		fprintf(stderr, "daemon log kept in %s\n", d->dir);
		return;
	}
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
	if (system(cmd))
		fprintf(stderr, "cannot remove %s\n", d->dir);
}

#endif
