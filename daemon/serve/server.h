/* The main thread's side of kdecd: the Unix socket (kdctl commands and libkdclient
 * handshakes), peer credentials against the allow-list, each client's connection
 * for its whole life, and the hand-off of clients to the engine thread. */
#ifndef KD_DAEMON_SERVER_H
#define KD_DAEMON_SERVER_H

#include <ev.h>
#include <stddef.h>
#include <sys/types.h>

#include "daemon/engine/engine.h"
#include "daemon/sched/sched.h"
#include "daemon/serve/control.h"
#include "ipc/ipc_proto.h"

#define SERVER_DEFAULT_MAX_CLIENTS 128
#define SERVER_DEFAULT_SHUTDOWN_S 30.0

struct server_opts {
	const char *socket_path;	/* NULL: ipc_default_socket */
	int max_clients;		/* <= 0: SERVER_DEFAULT_MAX_CLIENTS */
	const uid_t *allow_uid;		/* (n_allow_uid) besides our own uid and root */
	int n_allow_uid;
	const gid_t *allow_gid;		/* (n_allow_gid) a peer in one of them is allowed */
	int n_allow_gid;
	struct control_operators operators;	/* who runs drain, shutdown, ... (besides root and us) */
	enum ipc_notify notify;
	double shutdown_timeout_s;	/* < 0: SERVER_DEFAULT_SHUTDOWN_S */
	struct sched_opts sched;
	const char *backend;		/* for status */
	const char *state_dir;		/* NULL, or where snapshots go (--state-dir) */
};

struct server;

/* Binds the socket (mode 0660), starts the engine thread on e and registers with
 * loop. 0 or -errno with err. */
int server_create(struct server **out, struct ev_loop *loop, struct engine *e,
		  const struct server_opts *o, char *err, size_t err_len);

/* Stop admitting; finish running requests within the shutdown timeout (then cancel
 * them); ev_break(loop) once the engine thread has stopped. */
void server_shutdown(struct server *s);

/* Stop after the engine's current step, cancelling everything; ev_break soon. */
void server_stop_now(struct server *s);

/* Closes every connection, joins the engine thread, removes the socket file.
 * Accepts NULL. */
void server_destroy(struct server *s);

const char *server_socket_path(const struct server *s);

#endif
