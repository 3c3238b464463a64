/* kdecd's readiness: --daemon (the starting command returns once kdecd serves, or with
 * the failed start's exit status), --pid-file, and systemd's READY=1 (NOTIFY_SOCKET). */
#ifndef KD_DAEMON_KDECD_READY_H
#define KD_DAEMON_KDECD_READY_H

/* What the serving process tells once it serves. Zeroed: nothing to tell. */
struct kdecd_ready {
	int fd;			/* --daemon: the pipe to the waiting parent, else -1 */
	const char *pid_file;	/* NULL: none */
	int pid_written;	/* the file is ours to remove at exit */
};

/* --daemon: forks. The parent never returns: it waits on a pipe and exits 0 when the
 * child reports ready, else with the child's exit status (1 if it died by a signal).
 * The child returns 0 with r->fd set, in a new session, stdin and stdout on /dev/null
 * (stderr stays: the log). Call before any thread exists. -errno if the fork or pipe
 * fails (nothing forked). */
int kdecd_daemonize(struct kdecd_ready *r);

/* Once serving: writes the pid file, sends READY=1 where NOTIFY_SOCKET names a
 * socket, then releases the --daemon parent. Failures are logged, never fatal, except
 * a pid file that cannot be written (-errno: the caller stops, the parent then exits
 * with its status). */
int kdecd_ready_tell(struct kdecd_ready *r);

/* At exit: removes the pid file if this process wrote it. */
void kdecd_ready_fini(struct kdecd_ready *r);

#endif
