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
#include "daemon/serve/listen_socket.h"
#include "daemon/serve/control.h"
#include "ipc/ipc_proto.h"

#define SERVER_DEFAULT_MAX_CLIENTS 128
#define SERVER_DEFAULT_SHUTDOWN_S 30.0
#define SERVER_DEFAULT_MAX_PENDING 64	/* connections not (yet) clients */
#define SERVER_DEFAULT_HANDSHAKE_S 10.0	/* seconds one may make no progress */

struct server_opts {
	const char *socket_path;	/* NULL: ipc_default_socket */
	int max_clients;		/* <= 0: SERVER_DEFAULT_MAX_CLIENTS */
	int max_pending;		/* <= 0: SERVER_DEFAULT_MAX_PENDING; connections without
					 * a hello (kdctl's too); a new one past it displaces
					 * the oldest of the uid holding the most */
	double handshake_timeout_s;	/* <= 0: SERVER_DEFAULT_HANDSHAKE_S; a connection that
					 * is not a client is closed after this long without
					 * a line in or a reply byte out */
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
	struct listen_socket *ls;	/* NULL: server_create claims the socket; else one
					 * server_listen opened, which the server takes over */
};

struct server;

/* Claims and binds o's socket (daemon/serve/listen_socket.h; mode 0660, or 0666 with
 * an allow-list) into ls, for kdecd to do before it loads the model: a second kdecd on
 * the path refuses at once, and no thread exists yet (the mode is set by a umask).
 * 0 or -errno with err; listen_socket_close undoes it. */
int server_listen(struct listen_socket *ls, const struct server_opts *o, char *err, size_t err_len);

/* Takes o->ls (or claims the socket with server_listen), starts the engine thread on
 * e and registers with loop. 0 or -errno with err; o->ls is the server's either way. */
int server_create(struct server **out, struct ev_loop *loop, struct engine *e,
		  const struct server_opts *o, char *err, size_t err_len);

/* Stop admitting; finish running requests within the shutdown timeout (then cancel
 * them); ev_break(loop) once the engine thread has stopped. */
void server_shutdown(struct server *s);

/* Stop after the engine's current step, cancelling everything; ev_break soon. */
void server_stop_now(struct server *s);

/* Closes every connection, joins the engine thread, removes the socket file it bound
 * (not one that replaced it) and releases the socket's lock. Accepts NULL. */
void server_destroy(struct server *s);

const char *server_socket_path(const struct server *s);

#endif
