/* kdhttpd's connection to kdecd: one kd_client multiplexed over every HTTP request
 * (one segment, one uid, one security check at the daemon), its receiver thread that
 * routes events by request id, reconnection, the tokenizer of the served model. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/control_call.h"
#include "http/http_backend.h"

#define HB_RECONNECT_MS 300	/* between attempts while kdecd is down */
#define HB_WAIT_MS 200		/* the receiver's kd_wait, so that stop is seen */

struct hb {
	pthread_mutex_t mu;		/* guards everything below but tok's contents */
	pthread_cond_t any_final;	/* broadcast when a request ends */
	pthread_t thread;
	int thread_started;
	int stop;
	char socket_path[256];
	char tokenizer_path[1024];	/* "" : the served model's */
	char model_name[256];
	uint32_t context_tokens;	/* kv_blocks_total * kv_block_tokens */
	struct kd_client *c;		/* NULL while disconnected */
	struct kd_tokenizer *tok;	/* loaded on the first connection, kept */
	struct hb_req *reqs;		/* in flight, events routed to them */
	char last_error[256];
};

static void ms_to_abs(struct timespec *ts, int ms)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (long)(ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

static void cond_init_mono(pthread_cond_t *cv)
{
	pthread_condattr_t a;

	pthread_condattr_init(&a);
	pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	pthread_cond_init(cv, &a);
	pthread_condattr_destroy(&a);
}

int hb_control(struct hb *hb, const char *cmd, char **reply)
{
	char line[128];

	snprintf(line, sizeof(line), "{\"cmd\":\"%s\"}\n", cmd);
	return control_call(hb->socket_path, line, reply);
}

/* The served model's path, size of its KV cache and a name, from kdecd's status. */
static int read_status(struct hb *hb, char *model_path, size_t len)
{
	char *reply = NULL;
	json_t *o;
	int ret = hb_control(hb, "status", &reply);

	if (ret)
		return ret;
	o = json_loads(reply, JSON_DISABLE_EOF_CHECK, NULL);
	free(reply);
	if (!json_is_object(o)) {
		json_decref(o);
		return -EPROTO;
	}
	snprintf(model_path, len, "%s", json_string_value(json_object_get(o, "model_path")) ?: "");
	__atomic_store_n(&hb->context_tokens,
			 (uint32_t)(json_integer_value(json_object_get(o, "kv_blocks_total")) *
				    json_integer_value(json_object_get(o, "kv_block_tokens"))),
			 __ATOMIC_RELAXED);
	if (!hb->model_name[0]) {
		const char *base = strrchr(model_path, '/');
		char *dot;

		/* a directory path ends in '/' at most once: drop it, then the suffix */
		snprintf(hb->model_name, sizeof(hb->model_name), "%.200s", base && base[1] ? base + 1 :
			 model_path[0] ? model_path : "kdec");
		if ((dot = strstr(hb->model_name, ".gguf")) && !dot[5])
			*dot = 0;
	}
	json_decref(o);
	return 0;
}

/* Opens the tokenizer once: --tokenizer, else the file kdecd serves. */
static int load_tokenizer(struct hb *hb)
{
	char model_path[1024];
	const char *path = hb->tokenizer_path;
	int ret = read_status(hb, model_path, sizeof(model_path));

	if (ret) {
		snprintf(hb->last_error, sizeof(hb->last_error), "kdecd's status: %s", strerror(-ret));
		return ret;
	}
	if (hb->tok)
		return 0;
	if (!path[0])
		path = model_path;
	ret = kd_tokenizer_open(&hb->tok, path);
	if (ret) {
		snprintf(hb->last_error, sizeof(hb->last_error), "tokenizer %.120s: %.120s", path,
			 kd_tokenizer_error());
		fprintf(stderr, "kdhttpd: %s%s\n", hb->last_error,
			hb->tokenizer_path[0] ? "" : " (give --tokenizer PATH)");
	}
	return ret;
}

static void try_connect(struct hb *hb)
{
	struct kd_connect_opts o = { .socket_path = hb->socket_path };
	struct kd_client *c;
	int ret = kd_connect(&c, &o);

	if (ret) {
		snprintf(hb->last_error, sizeof(hb->last_error), "%s", kd_connect_error(NULL));
		return;
	}
	if (load_tokenizer(hb)) {
		kd_close(c);
		return;
	}
	pthread_mutex_lock(&hb->mu);
	hb->c = c;
	pthread_mutex_unlock(&hb->mu);
	fprintf(stderr, "kdhttpd: connected to kdecd at %s (model %s)\n", hb->socket_path,
		hb->model_name);
}

static void push_event(struct hb_req *q, const struct kd_event *ev)
{
	if (q->n == q->cap) {
		size_t cap = q->cap ? q->cap * 2 : 64;
		struct kd_event *e;

		if (q->head) {	/* reuse the taken prefix before growing */
			memmove(q->ev, q->ev + q->head, sizeof(*e) * (q->n - q->head));
			q->n -= q->head;
			q->head = 0;
		} else if ((e = realloc(q->ev, sizeof(*e) * cap))) {
			q->ev = e;
			q->cap = cap;
		}
		if (q->n == q->cap) {	/* out of memory: end the request as failed */
			q->ev[q->n - 1] = (struct kd_event){ .id = q->id, .token = -1,
				.flags = KD_EVENT_FINAL, .stop = KD_STOP_ERROR, .error = -ENOMEM };
			q->final = 1;
			return;
		}
	}
	q->ev[q->n++] = *ev;
	if (ev->flags & KD_EVENT_FINAL)
		q->final = 1;
}

/* Routes events to their requests; called with mu held. */
static void route(struct hb *hb, const struct kd_event *ev, int n)
{
	for (int i = 0; i < n; i++) {
		for (struct hb_req *q = hb->reqs; q; q = q->next) {
			if (q->id != ev[i].id || q->final)
				continue;
			push_event(q, &ev[i]);
			pthread_cond_signal(&q->cv);
			if (q->final)
				pthread_cond_broadcast(&hb->any_final);
			break;
		}
	}
}

/* The daemon went away: every request in flight ends with -ECONNRESET. */
static void disconnected(struct hb *hb)
{
	struct kd_client *c;

	pthread_mutex_lock(&hb->mu);
	snprintf(hb->last_error, sizeof(hb->last_error), "%s", kd_connect_error(hb->c));
	fprintf(stderr, "kdhttpd: kdecd connection lost: %s\n", hb->last_error);
	c = hb->c;
	hb->c = NULL;
	for (struct hb_req *q = hb->reqs; q; q = q->next) {
		struct kd_event ev = { .id = q->id, .token = -1, .flags = KD_EVENT_FINAL,
				       .stop = KD_STOP_ERROR, .error = -ECONNRESET };

		if (!q->final)
			push_event(q, &ev);
		pthread_cond_signal(&q->cv);
	}
	pthread_cond_broadcast(&hb->any_final);
	kd_close(c);	/* under mu: no submitter holds c now */
	pthread_mutex_unlock(&hb->mu);
}

static void *receiver(void *arg)
{
	struct hb *hb = arg;
	struct kd_event ev[128];

	while (!__atomic_load_n(&hb->stop, __ATOMIC_ACQUIRE)) {
		int n;

		if (!hb->c) {	/* only this thread sets c */
			try_connect(hb);
			if (!hb->c)
				usleep(HB_RECONNECT_MS * 1000);
			continue;
		}
		n = kd_wait(hb->c, ev, 128, HB_WAIT_MS);
		if (n < 0) {
			disconnected(hb);
			continue;
		}
		if (n) {
			pthread_mutex_lock(&hb->mu);
			route(hb, ev, n);
			pthread_mutex_unlock(&hb->mu);
		}
	}
	return NULL;
}

int hb_create(struct hb **out, const struct hb_opts *o)
{
	struct hb *hb = calloc(1, sizeof(*hb));
	int ret;

	if (!hb)
		return -ENOMEM;
	pthread_mutex_init(&hb->mu, NULL);
	cond_init_mono(&hb->any_final);
	if (o->socket_path)
		snprintf(hb->socket_path, sizeof(hb->socket_path), "%s", o->socket_path);
	else
		kd_default_socket(hb->socket_path, sizeof(hb->socket_path));
	snprintf(hb->tokenizer_path, sizeof(hb->tokenizer_path), "%s", o->tokenizer_path ?: "");
	snprintf(hb->model_name, sizeof(hb->model_name), "%s", o->model_name ?: "");
	snprintf(hb->last_error, sizeof(hb->last_error), "not connected yet");
	ret = -pthread_create(&hb->thread, NULL, receiver, hb);
	if (ret) {
		hb_destroy(hb);
		return ret;
	}
	hb->thread_started = 1;
	*out = hb;
	return 0;
}

void hb_destroy(struct hb *hb)
{
	if (!hb)
		return;
	__atomic_store_n(&hb->stop, 1, __ATOMIC_RELEASE);
	if (hb->thread_started)
		pthread_join(hb->thread, NULL);
	kd_close(hb->c);	/* the daemon cancels what is left */
	kd_tokenizer_close(hb->tok);
	pthread_cond_destroy(&hb->any_final);
	pthread_mutex_destroy(&hb->mu);
	free(hb);
}

int hb_ready(struct hb *hb)
{
	int r;

	pthread_mutex_lock(&hb->mu);
	r = hb->c && hb->tok;
	pthread_mutex_unlock(&hb->mu);
	return r;
}

const struct kd_tokenizer *hb_tokenizer(struct hb *hb)
{
	const struct kd_tokenizer *t;

	pthread_mutex_lock(&hb->mu);
	t = hb->tok;
	pthread_mutex_unlock(&hb->mu);
	return t;
}

const char *hb_model_name(struct hb *hb)
{
	return hb->model_name;	/* written once, before the first connection is published */
}

uint32_t hb_context_tokens(struct hb *hb)
{
	return __atomic_load_n(&hb->context_tokens, __ATOMIC_RELAXED);
}

const char *hb_socket(const struct hb *hb)
{
	return hb->socket_path;
}

int hb_submit(struct hb *hb, const struct kd_request *r, struct hb_req *q, int wait_ms)
{
	int ret, waited = 0;

	memset(q, 0, sizeof(*q));
	q->hb = hb;
	cond_init_mono(&q->cv);
	for (;;) {
		pthread_mutex_lock(&hb->mu);
		ret = hb->c ? kd_submit(hb->c, r, &q->id) : -ENOTCONN;
		if (!ret) {
			q->next = hb->reqs;
			hb->reqs = q;
		}
		pthread_mutex_unlock(&hb->mu);
		if (ret != -EAGAIN || waited >= wait_ms)
			break;
		usleep(2000);	/* the ring drains at the daemon's next step */
		waited += 2;
	}
	if (ret)
		pthread_cond_destroy(&q->cv);
	return ret;
}

int hb_req_take(struct hb_req *q, struct kd_event *ev, int max, int timeout_ms)
{
	struct hb *hb = q->hb;
	struct timespec until;
	int n = 0;

	ms_to_abs(&until, timeout_ms);
	pthread_mutex_lock(&hb->mu);
	while (q->head == q->n && timeout_ms > 0 &&
	       pthread_cond_timedwait(&q->cv, &hb->mu, &until) != ETIMEDOUT)
		;
	while (n < max && q->head < q->n)
		ev[n++] = q->ev[q->head++];
	pthread_mutex_unlock(&hb->mu);
	return n;
}

void hb_req_release(struct hb_req *q)
{
	struct hb *hb = q->hb;

	if (!hb)
		return;
	/* a full submission ring drains at the daemon's next step: retry a while */
	for (int tries = 0; tries < 500; tries++) {
		int ret;

		pthread_mutex_lock(&hb->mu);
		ret = !q->final && hb->c ? kd_cancel(hb->c, q->id) : 0;
		pthread_mutex_unlock(&hb->mu);
		if (ret != -EAGAIN)
			break;
		usleep(1000);
	}
	pthread_mutex_lock(&hb->mu);
	for (struct hb_req **p = &hb->reqs; *p; p = &(*p)->next) {
		if (*p == q) {
			*p = q->next;
			break;
		}
	}
	pthread_cond_broadcast(&hb->any_final);
	pthread_mutex_unlock(&hb->mu);
	pthread_cond_destroy(&q->cv);
	free(q->ev);
	memset(q, 0, sizeof(*q));
}

void hb_wait_any_final(struct hb *hb, int timeout_ms)
{
	struct timespec until;

	ms_to_abs(&until, timeout_ms);
	pthread_mutex_lock(&hb->mu);
	pthread_cond_timedwait(&hb->any_final, &hb->mu, &until);
	pthread_mutex_unlock(&hb->mu);
}
