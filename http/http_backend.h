/* kdhttpd's side of kdecd: one libkdclient connection shared by every HTTP request,
 * a receiver thread that routes the daemon's events to the request that owns them,
 * the model's tokenizer, and the control socket's status and metrics. */
#ifndef KDHTTPD_HTTP_BACKEND_H
#define KDHTTPD_HTTP_BACKEND_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "client/kdclient.h"

struct hb;		/* the backend: connection, receiver thread, tokenizer */

/* One request in flight on the daemon: its events queue here until the HTTP side
 * takes them. Owned by the HTTP call that submitted it (hb_req_release frees). */
struct hb_req {
	uint64_t id;
	struct hb *hb;
	pthread_cond_t cv;		/* signalled when an event is queued */
	struct kd_event *ev;		/* (cap) queued events, [head, n) not yet taken */
	size_t n, head, cap;
	int final;			/* the final event is queued */
	struct hb_req *next;
};

struct hb_opts {
	const char *socket_path;	/* NULL: libkdclient's default */
	const char *tokenizer_path;	/* NULL: the model kdecd serves (its status) */
	const char *model_name;		/* NULL: the served model file's base name */
};

/* Starts the receiver thread, which connects (and reconnects) to kdecd. 0 or -errno. */
int hb_create(struct hb **out, const struct hb_opts *o);
void hb_destroy(struct hb *hb);		/* accepts NULL; cancels what is in flight */

/* Whether kdecd is connected and the tokenizer loaded; with it, what a request
 * needs. The tokenizer stays valid until hb_destroy once returned. */
int hb_ready(struct hb *hb);
const struct kd_tokenizer *hb_tokenizer(struct hb *hb);
const char *hb_model_name(struct hb *hb);	/* "" until known */
uint32_t hb_context_tokens(struct hb *hb);	/* the daemon's KV cache tokens, 0: unknown */
const char *hb_socket(const struct hb *hb);	/* the control socket's path */

/* Submits r and queues its events on q (caller storage, zeroed by hb_submit). A
 * submission ring that stays full is retried for up to wait_ms. 0, -ENOTCONN (no
 * daemon), -EAGAIN, or kd_submit's -errno. hb_req_release must follow a success. */
int hb_submit(struct hb *hb, const struct kd_request *r, struct hb_req *q, int wait_ms);

/* Takes up to max events, waiting up to timeout_ms for one. The number taken, 0. */
int hb_req_take(struct hb_req *q, struct kd_event *ev, int max, int timeout_ms);

/* Cancels q on the daemon unless it ended, unlinks it and frees its queue. */
void hb_req_release(struct hb_req *q);

/* Waits up to timeout_ms for any request of this backend to end (a refusal for too
 * many tokens in flight is retried after one does). */
void hb_wait_any_final(struct hb *hb, int timeout_ms);

/* One control command's reply (malloc'd JSON text) over kdecd's socket. 0 or -errno. */
int hb_control(struct hb *hb, const char *cmd, char **reply);

#endif
