/* What the main thread's files share: a connection, the server, and the calls between
 * server.c (connection I/O, hellos, control lines, replies) and server_accept.c
 * (accepting, the allow-list, the pending cap and idle timer, running out of fds). */
#ifndef KD_DAEMON_SERVER_INTERNAL_H
#define KD_DAEMON_SERVER_INTERNAL_H

#include <ev.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/serve/listen_socket.h"
#include "daemon/serve/server.h"

/* A control connection's unsent replies past which its next lines wait (bytes): a
 * peer that pipelines commands and never reads costs this much, not more. */
#define SERVER_OUT_MAX (64 * 1024)

struct conn {
	ev_io rio, wio;
	ev_timer idle;			/* before the hello: closes a connection with no progress */
	struct server *srv;
	int fd;
	uint64_t id;			/* cookie for the engine thread's replies */
	uint64_t t_open_ns;
	pid_t pid;
	uid_t uid;
	gid_t gid;
	int op;				/* an operator (control_peer_is_operator) */
	int is_client;
	uint32_t client_id;
	int close_after_write;
	int n_query;			/* engine-thread queries awaiting their reply (0 or 1) */
	char in[IPC_LINE_MAX];		/* a partial line */
	size_t in_len;
	char *out;			/* unsent bytes [out_off, out_len) */
	size_t out_len, out_off;
	struct conn *next;
};

/* One kind of trouble logged at most once a second, with how many were not. */
struct server_ratelog {
	uint64_t last_ns;
	unsigned quiet;
};

struct server {
	struct ev_loop *loop;
	struct server_opts o;
	struct engine *e;
	struct engine_thread *et;
	struct listen_socket ls;
	ev_io accept_io;
	ev_timer accept_pause;		/* restarts accept_io after a pause (fds ran out) */
	ev_async replies;
	struct conn *conns;
	uint64_t next_conn;
	uint32_t next_client;
	int n_clients;
	int n_pending;			/* connections not (yet) clients: no hello, or kdctl */
	int reserve_fd;			/* /dev/null, given up to refuse a connection at EMFILE */
	long nofile;			/* RLIMIT_NOFILE (soft) */
	int shutting_down;
	uint64_t t_start_ns;
	char weights[40];		/* model_weights_name, for kdctl status */
	struct server_ratelog rl_fds, rl_evict, rl_idle;
};

/* server.c */
void server_conn_close(struct conn *c);
/* Queues line (malloc'd, taken) and sends what the socket takes now; may close c
 * when it was to close after this write. */
void server_conn_send(struct conn *c, char *line);
void server_conn_refuse(struct conn *c, const char *why, int err);
void server_on_read(struct ev_loop *loop, ev_io *w, int revents);
void server_on_write(struct ev_loop *loop, ev_io *w, int revents);

/* server_accept.c */
void server_on_accept(struct ev_loop *loop, ev_io *w, int revents);
void server_on_accept_pause(struct ev_loop *loop, ev_timer *w, int revents);
/* Starts (again) a pending connection's idle timer: it made progress. */
void server_conn_touch(struct conn *c);
/* Closes the oldest pending connection (not spare) of the uid holding the most, with
 * a line saying why; 1, or 0 when there is none. */
int server_make_room(struct server *s, const struct conn *spare, const char *why);
/* 1 when this kind of line may be logged now (and says how many were not). */
int server_ratelog_ok(struct server_ratelog *r, unsigned *quiet);
/* The open-file limit, raised to the hard limit; warns when --max-clients cannot fit. */
void server_fd_limits(struct server *s);

#endif
