/* Helpers of the tests that run a real kdecd: start it and wait until it accepts
 * clients, stop it, clean up after it, and the offline reference (kdbench generate)
 * for a prompt. */
#ifndef KD_TESTS_DAEMONTEST_H
#define KD_TESTS_DAEMONTEST_H

#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kdclient.h"

/* Forks kdecd with argv (argv[0] is its path, NULL-terminated), its stderr appended
 * to log, and waits up to 10 s for sock to accept a client. *pid receives the
 * daemon's pid (0 when it died). Returns 0 once it answers, else -1. */
static inline int daemontest_start(char *const argv[], const char *log, const char *sock,
				   pid_t *pid_out)
{
	struct kd_client *c;
	pid_t pid = fork();

	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);

		dup2(fd, 2);
		execv(argv[0], argv);
		_exit(127);
	}
	*pid_out = pid > 0 ? pid : 0;
	if (pid < 0)
		return -1;
	for (int i = 0; i < 200; i++) {
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			*pid_out = 0;
			return -1;
		}
		if (!kd_connect(&c, &(struct kd_connect_opts){ .socket_path = sock })) {
			kd_close(c);
			return 0;
		}
		usleep(50000);
	}
	return -1;
}

/* SIGTERM to the daemon and its exit status: 0 for an orderly exit 0, 128 + signal
 * when a signal ended it, -1 when there is none (pid <= 0). */
static inline int daemontest_stop(pid_t pid)
{
	int st = 0;

	if (pid <= 0)
		return -1;
	kill(pid, SIGTERM);
	if (waitpid(pid, &st, 0) != pid)
		return -1;
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* A daemon test's paths: builddir from top_builddir, model the tiny Llama 3 checkpoint
 * under top_srcdir, dir a fresh /tmp/kdec_<tag>.XXXXXX and sock its socket in it
 * (buffers of 512, 512, 256 and 300 bytes). Ignores SIGPIPE: a daemon that goes away
 * mid-write must not end the test. 0, or -1 when the directory cannot be made. */
static inline int daemontest_paths(const char *tag, char *builddir, char *model, char *dir,
				   char *sock)
{
	const char *b = getenv("top_builddir"), *s = getenv("top_srcdir");
	char tmpl[200];

	snprintf(builddir, 512, "%s", b ? b : ".");
	snprintf(model, 512, "%s/tests/data/golden/llama3", s ? s : ".");
	snprintf(tmpl, sizeof(tmpl), "/tmp/kdec_%s.XXXXXX", tag);
	if (!mkdtemp(tmpl))
		return -1;
	snprintf(dir, 256, "%s", tmpl);
	snprintf(sock, 300, "%s/kdecd.sock", dir);
	signal(SIGPIPE, SIG_IGN);
	return 0;
}

/* Removes the test's scratch directory (socket, daemon log) unless keep; then says
 * where the logs are instead. */
static inline void daemontest_cleanup(const char *dir, int keep)
{
	char cmd[300];

	if (keep) {
		fprintf(stderr, "daemon log kept in %s\n", dir);
		return;
	}
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd))
		fprintf(stderr, "cannot remove %s\n", dir);
}

/* kdbench generate's greedy ids for prompt p (n ids), at most max_tokens into out;
 * returns how many, or -1. */
static inline int daemontest_reference(const char *builddir, const char *model, const int32_t *p,
				       int n, int max_tokens, int32_t *out)
{
	char cmd[2048], ids[512] = "";
	int len = 0, k = 0;
	FILE *f;

	for (int j = 0; j < n; j++)
		len += snprintf(ids + len, sizeof(ids) - (size_t)len, "%s%d", j ? "," : "", p[j]);
	snprintf(cmd, sizeof(cmd), "'%s/kdbench' generate --model '%s' --prompt %s --max-tokens %d --threads 1 2>/dev/null",
		 builddir, model, ids, max_tokens);
	if (!(f = popen(cmd, "r")))
		return -1;
	while (k < max_tokens && fscanf(f, "%d", &out[k]) == 1)
		k++;
	pclose(f);
	return k;
}

#endif
