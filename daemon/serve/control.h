/* The control protocol: one JSON object per line on the daemon's socket. Parsing
 * of untrusted lines (fuzzed: tests/fuzz/fuzz_control.c) and the replies' text. */
#ifndef KD_DAEMON_CONTROL_H
#define KD_DAEMON_CONTROL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/serve/engine_thread.h"

enum control_kind {
	CTL_HELLO = 1,		/* a libkdclient connection: {"hello":"kdclient","protocol":N,"spin":B} */
	CTL_STATUS,		/* {"cmd":"status"} */
	CTL_CLIENTS,
	CTL_SESSIONS,
	CTL_METRICS,
	CTL_DRAIN,		/* {"cmd":"drain"} or {"cmd":"drain","on":false} (= resume) */
	CTL_RESUME,		/* {"cmd":"resume"}: admit again after drain */
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

/* Who is an operator (docs/SECURITY.md): root, the daemon's own uid, and these.
 * Every other peer the allow-list admits is a client: it runs the read-only
 * commands and session-close, and sees only its own clients and sessions. */
struct control_operators {
	const uid_t *uid;	/* (n_uid) --operator-uid */
	int n_uid;
	const gid_t *gid;	/* (n_gid) --operator-gid: the peer's primary or supplementary group */
	int n_gid;
};

/* The peer of one connection, from SO_PEERCRED at accept (never from what it says). */
struct control_peer {
	pid_t pid;
	uid_t uid;
	gid_t gid;
	int op;			/* an operator (control_peer_is_operator) */
};

/* Whether the peer on connected socket fd (uid, gid from SO_PEERCRED) is one of o's
 * operators; its supplementary groups come from SO_PEERGROUPS. */
int control_peer_is_operator(const struct control_operators *o, int fd, uid_t uid, gid_t gid);

/* The command's name as kdctl spells it ("shutdown"), or "hello". */
const char *control_cmd_name(enum control_kind kind);

/* 0 when p may run cmd; else -EPERM with the one-line reason in err, e.g. "uid 1001 is
 * not an operator of this daemon (operators: uid 0, 1000)". */
int control_permit(const struct control_cmd *cmd, const struct control_peer *p,
		   const struct control_operators *o, char *err, size_t err_len);

/* Facts the main thread adds to a report. */
struct control_info {
	const char *model;
	const char *model_path;	/* the directory or GGUF file it was loaded from */
	const char *weights;	/* how its linear weights are stored: bf16, fp8-block, int4-g32, ... */
	const char *backend;
	const char *notify;
	double uptime_s;
	int max_clients;
};

/* Reply lines (malloc'd, '\n'-terminated; NULL on ENOMEM). */
char *control_reply_error(const char *msg, int err);
char *control_reply_ok(void);
/* The reply to kind for peer p: a client's clients and sessions tables hold only
 * rows of its own uid; aggregates (status, metrics) are whole. */
char *control_reply(enum control_kind kind, const struct et_report *r, const struct control_info *info,
		    const struct control_peer *p);

#endif
