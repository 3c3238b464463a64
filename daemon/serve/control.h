/* The control protocol: one JSON object per line on the daemon's socket. Parsing
 * of untrusted lines (fuzzed: tests/fuzz/fuzz_control.c) and the replies' text. */
#ifndef KD_DAEMON_CONTROL_H
#define KD_DAEMON_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/serve/engine_thread.h"

enum control_kind {
	CTL_HELLO = 1,		/* a libkdclient connection: {"hello":"kdclient","protocol":N,"spin":B} */
	CTL_STATUS,		/* {"cmd":"status"} */
	CTL_CLIENTS,
	CTL_SESSIONS,
	CTL_METRICS,
	CTL_DRAIN,		/* {"cmd":"drain"} or {"cmd":"drain","on":false} */
	CTL_SHUTDOWN,
	CTL_LOG_LEVEL,		/* {"cmd":"log-level","level":"debug"} */
	CTL_SNAPSHOT,		/* {"cmd":"snapshot"}: sessions to --state-dir */
	CTL_SESSION_CLOSE,	/* {"cmd":"session-close","name":"NAME"}: the caller's session */
	CTL_N_KINDS,		/* one past the last */
};

struct control_cmd {
	enum control_kind kind;
	long long protocol;	/* CTL_HELLO */
	int spin;		/* CTL_HELLO */
	int on;			/* CTL_DRAIN */
	int level;		/* CTL_LOG_LEVEL: enum log_level */
	char name[KV_SESSION_NAME_MAX + 1];	/* CTL_SESSION_CLOSE */
};

/* Parses one line (len bytes, no NUL needed). 0, or -EINVAL with a one-line reason. */
int control_parse(const char *line, size_t len, struct control_cmd *cmd, char *err, size_t err_len);

/* Facts the main thread adds to a report. */
struct control_info {
	const char *model;
	const char *model_path;	/* the directory or GGUF file it was loaded from */
	const char *backend;
	const char *notify;
	double uptime_s;
	int max_clients;
};

/* Reply lines (malloc'd, '\n'-terminated; NULL on ENOMEM). */
char *control_reply_error(const char *msg, int err);
char *control_reply_ok(void);
char *control_reply(enum control_kind kind, const struct et_report *r, const struct control_info *info);

#endif
