/* One connected client as the daemon sees it: its sealed memfd segment, eventfds,
 * and the engine thread's private view of its rings. Created on the main thread at
 * the handshake, then owned by the engine thread (which destroys it). Nothing read
 * from the segment is trusted. */
#ifndef KD_DAEMON_CLIENT_CONN_H
#define KD_DAEMON_CLIENT_CONN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ipc/ipc_proto.h"

struct client_limits {
	uint32_t max_prompt;		/* prompt tokens per request */
	uint32_t max_new;		/* max_tokens per request */
	uint32_t max_inflight;		/* requests per client */
	uint32_t vocab_size;
	const char *model;		/* model_type for the header */
};

struct client_conn {
	uint32_t id;			/* daemon-wide client id, never reused */
	pid_t pid;			/* SO_PEERCRED */
	uid_t uid;
	gid_t gid;
	int spin;			/* asked the engine to poll instead of sleeping at once */
	uint64_t t_connect_ns;		/* CLOCK_MONOTONIC */
	enum ipc_notify notify;
	void *seg;			/* IPC_SEG_BYTES, MAP_SHARED */
	int memfd;
	int notify_efd;			/* we write it to wake the client (eventfd mode, kd_fd) */
	int bell_efd;			/* eventfd mode: the client writes it; else -1 */

	/* engine thread only */
	int slot;			/* index in the engine thread's table */
	uint32_t gen;			/* the slot's generation: doorbell tags */
	int wait_armed;			/* a doorbell wait for this client is in flight */
	uint32_t sub_head;		/* records taken (our copy; the segment's is advisory) */
	uint32_t ev_tail;		/* events written (ours; never read back) */
	int dead;			/* violated the protocol: rings no longer touched */
	int touched;			/* events written this step, not yet published */
	int step_space;			/* scheduler: event slots left in this step (-1: unknown) */
	struct ipc_event *pending;	/* (n_pending) finals waiting for ring space */
	int n_pending, cap_pending;
	int n_inflight;			/* requests the scheduler holds for this client */
	int64_t inflight_tokens;	/* their prompt + max_tokens, summed */
	uint64_t n_submitted, n_generated;
	char why[200];			/* the protocol violation, for the log and the client */
};

/* Builds the segment (memfd sealed against shrink and grow) and eventfds. The fds
 * stay owned by c; the caller sends copies with SCM_RIGHTS. 0 or -errno + err. */
int client_conn_create(struct client_conn **out, uint32_t id, enum ipc_notify notify,
		       const struct client_limits *lim, char *err, size_t err_len);
void client_conn_destroy(struct client_conn *c);	/* accepts NULL */

/* Takes the next submission: 1 with rec filled (and *tokens malloc'd with
 * rec->n_tokens ids for a request: the caller owns them), 0 when the ring is empty,
 * -EPROTO (c->why says why; the caller disconnects), -ENOMEM. */
int client_conn_take(struct client_conn *c, struct ipc_sub *rec, int32_t **tokens);

/* Event slots free for token events: ring space not promised to queued finals, or
 * -EPROTO when the client's ev_head is impossible (c->why set). */
int client_conn_ev_free(struct client_conn *c);

/* Writes an event (the caller checked client_conn_ev_free for non-final events);
 * a final that does not fit waits in c->pending. -ENOMEM, -EPROTO or 0. */
int client_conn_push(struct client_conn *c, const struct ipc_event *ev);

/* Moves waiting finals into the ring as space allows. */
int client_conn_flush(struct client_conn *c);

/* Makes written events visible. Returns IPC_SLEEP_* bits of how the client wants
 * to be woken (0: it is awake). */
unsigned client_conn_publish(struct client_conn *c);

/* Marks the segment closed (the client's library then reads the reason). */
void client_conn_mark_closed(struct client_conn *c);

#endif
