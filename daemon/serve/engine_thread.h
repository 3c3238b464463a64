/* The engine thread: the only caller of engine_*. It owns the connected clients'
 * ring state and the scheduler, and talks to the main thread through two message
 * queues: commands in (woken by an eventfd it sleeps on), replies out (the main
 * thread is woken by a callback, an ev_async in kdecd). */
#ifndef KD_DAEMON_ENGINE_THREAD_H
#define KD_DAEMON_ENGINE_THREAD_H

#include <stdint.h>
#include <sys/types.h>

#include "daemon/engine/engine.h"
#include "daemon/sched/client_conn.h"
#include "daemon/sched/sched.h"

/* How long the engine thread polls rings after its last work when a client asked
 * for spinning (KD_CONNECT_SPIN), before it sleeps. */
#define ET_SPIN_NS 2000000

struct et_opts {
	enum ipc_notify notify;
	int max_clients;
	struct sched_opts sched;
	const char *state_dir;	/* NULL: no snapshots; else saved at orderly stop and on ET_Q_SNAPSHOT */
};

struct et_client_info {
	uint32_t id;
	pid_t pid;
	uid_t uid;
	int spin;
	int inflight;
	uint64_t submitted, generated;
	double connected_s;
};

/* A snapshot for kdctl: everything the control commands print. */
struct et_report {
	struct sched_report s;
	struct et_client_info *clients;	/* (n_clients) */
	int n_clients;
	uint64_t steps;
	char decode_path[160];		/* engine_decode_path_describe */
	unsigned decode_lat_mask;	/* engine_decode_path_latency_mask */
	char parallel[128];		/* engine_parallel_describe: tp and the all-reduce */
	/* the outcome of ET_Q_SNAPSHOT or ET_Q_SESSION_CLOSE */
	int op_ret;		/* 0 or -errno */
	int op_count;		/* sessions written */
	char op_err[200];
};

void et_report_free(struct et_report *r);	/* accepts NULL */

/* What an ET_QUERY asks for (its arg): each is answered with ET_REPORT. */
enum et_query {
	ET_Q_REPORT,
	ET_Q_SNAPSHOT,		/* engine_snapshot_save to state_dir first */
	ET_Q_SESSION_CLOSE,	/* engine_session_close(why, uid) first */
};

enum et_msg_type {
	/* main -> engine */
	ET_ADD,			/* client: take ownership */
	ET_REMOVE,		/* client_id: gone (EOF or kicked): release and destroy */
	ET_QUERY,		/* cookie, arg (enum et_query): answer with ET_REPORT */
	ET_DRAIN,		/* arg: 1 stop admitting, 0 admit again */
	ET_SHUTDOWN,		/* deadline_ns: drain, finish or cancel by then, stop; arg: the
				 * timeout in ms, for the cancelled requests' message */
	ET_HARD_STOP,		/* stop after the current step */
	/* engine -> main */
	ET_KICK,		/* client_id broke the protocol (why): close its socket */
	ET_REPORT,		/* cookie, report */
	ET_STOPPED,		/* the thread is about to exit */
};

struct et_msg {
	enum et_msg_type type;
	uint32_t client_id;
	struct client_conn *client;
	uint64_t cookie;
	int arg;
	uint64_t deadline_ns;
	uid_t uid;			/* ET_Q_SESSION_CLOSE: the session's owner */
	struct et_report *report;	/* owned by the receiver */
	char why[200];
	struct et_msg *next;
};

struct engine_thread;

/* Starts the thread on e (which it then drives exclusively). wake_main(arg) is
 * called from the engine thread when replies are queued. 0 or -errno + err. */
int engine_thread_start(struct engine_thread **out, struct engine *e, const struct et_opts *o,
			void (*wake_main)(void *), void *arg, char *err, size_t err_len);

/* Queues m (malloc'd; the engine thread frees it). Any thread. */
void engine_thread_post(struct engine_thread *t, struct et_msg *m);

/* Takes the replies queued so far (a list the caller frees). Any thread. */
struct et_msg *engine_thread_replies(struct engine_thread *t);

/* Joins the thread (after ET_STOPPED or ET_HARD_STOP) and frees everything, clients
 * included. Accepts NULL. */
void engine_thread_destroy(struct engine_thread *t);

#endif
