/* kdhttpd's HTTP side on libmicrohttpd (thread per connection: a generation blocks
 * its own thread only): listening socket, API key, body bound, routing, the
 * generation endpoints (whole responses and server-sent events), /v1/models,
 * /health and /metrics with kdhttpd's own counters. */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "http/http_call.h"
#include "http/http_server.h"

enum route { R_CHAT, R_COMPLETION, R_MESSAGES, R_MODELS, R_HEALTH, R_METRICS, R_OTHER, N_ROUTES };
static const char *const route_names[N_ROUTES] = {
	"chat_completions", "completions", "messages", "models", "health", "metrics", "other",
};

struct srv {
	struct MHD_Daemon *d;
	struct hb *hb;
	struct srv_opts o;
	char unix_path[108];
	atomic_ullong requests[N_ROUTES][600];	/* by route and status */
	atomic_int running;			/* generation calls in progress */
	atomic_ullong disconnects, prompt_tokens, completion_tokens;
	atomic_ullong next_id;
};

/* One HTTP request's state between the access handler's calls. */
struct req_ctx {
	enum route route;
	int keepalive_ms;		/* a stream's comment after this long without an event */
	long long last_ms;		/* when the stream last gave libmicrohttpd bytes */
	char *body;			/* (len) bytes received, NUL-terminated */
	size_t len, cap;
	int too_big;
	struct call call;
	int counted_running;
};

static void count(struct srv *s, enum route r, unsigned status)
{
	if (status < 600)
		atomic_fetch_add(&s->requests[r][status], 1);
}

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned status, const char *type,
				 const char *body)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
								  MHD_RESPMEM_MUST_COPY);
	enum MHD_Result ret;

	if (!r)
		return MHD_NO;
	MHD_add_response_header(r, "Content-Type", type);
	ret = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return ret;
}

/* The error in the shape of the route's API. */
static enum MHD_Result send_error(struct srv *s, struct MHD_Connection *conn, enum route r,
				  const struct call_err *e)
{
	char *body = r == R_MESSAGES ? anthropic_error_body(e) : openai_error_body(e);
	enum MHD_Result ret;
	unsigned status = (unsigned)e->status;

	count(s, r, status);
	ret = send_text(conn, status, "application/json", body ? body : "{}");
	free(body);
	return ret;
}

static enum MHD_Result send_errf(struct srv *s, struct MHD_Connection *conn, enum route r,
				 int status, const char *msg)
{
	struct call_err e;

	call_errf(&e, status, NULL, "%s", msg);
	return send_error(s, conn, r, &e);
}

static enum route route_of(const char *url)
{
	if (!strcmp(url, "/v1/chat/completions"))
		return R_CHAT;
	if (!strcmp(url, "/v1/completions"))
		return R_COMPLETION;
	if (!strcmp(url, "/v1/messages"))
		return R_MESSAGES;
	if (!strcmp(url, "/v1/models") || !strncmp(url, "/v1/models/", 11))
		return R_MODELS;
	if (!strcmp(url, "/health"))
		return R_HEALTH;
	if (!strcmp(url, "/metrics"))
		return R_METRICS;
	return R_OTHER;
}

/* Compares every byte whatever the first difference, so that timing tells nothing. */
static int same_key(const char *a, const char *b)
{
	size_t la = strlen(a), lb = strlen(b);
	unsigned char d = la != lb;

	for (size_t i = 0; i < la; i++)
		d |= (unsigned char)(a[i] ^ b[i % (lb ? lb : 1)]);
	return !d;
}

static int authorized(struct srv *s, struct MHD_Connection *conn)
{
	const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
	const char *xkey = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "x-api-key");
	const char *given = xkey;
	int ok = 0;

	if (!s->o.api_keys)
		return 1;
	if (auth && !strncasecmp(auth, "Bearer ", 7))
		given = auth + 7;
	for (char **k = s->o.api_keys; given && *k; k++)
		ok |= same_key(given, *k);
	return ok;
}

static enum MHD_Result models(struct srv *s, struct MHD_Connection *conn, const char *url)
{
	const char *name = hb_model_name(s->hb);
	json_t *m = json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:s}", "id", name, "object", "model",
			      "type", "model", "created", 0, "owned_by", "kdec", "display_name",
			      name, "created_at", "1970-01-01T00:00:00Z");
	json_t *o;
	char *body;
	enum MHD_Result ret;

	if (!strncmp(url, "/v1/models/", 11)) {
		if (strcmp(url + 11, name)) {
			json_decref(m);
			return send_errf(s, conn, R_MODELS, 404, "no such model: kdecd serves one");
		}
		o = m;
	} else {
		o = json_pack("{s:s, s:[o], s:b, s:s, s:s}", "object", "list", "data", m, "has_more",
			      0, "first_id", name, "last_id", name);
	}
	body = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	count(s, R_MODELS, 200);
	ret = send_text(conn, 200, "application/json", body ? body : "{}");
	free(body);
	return ret;
}

/* Ready when kdecd is: connected, the tokenizer loaded, its status answered and not
 * draining. */
static enum MHD_Result health(struct srv *s, struct MHD_Connection *conn)
{
	char *reply = NULL;
	json_t *o = NULL;
	int ready = hb_ready(s->hb) && !hb_control(s->hb, "status", &reply) &&
		    (o = json_loads(reply, JSON_DISABLE_EOF_CHECK, NULL)) &&
		    json_is_true(json_object_get(o, "ok")) &&
		    !json_is_true(json_object_get(o, "draining"));

	json_decref(o);
	free(reply);
	count(s, R_HEALTH, ready ? 200 : 503);
	return send_text(conn, ready ? 200 : 503, "application/json",
			 ready ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}");
}

static int put(char **b, size_t *len, size_t *cap, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static int put(char **b, size_t *len, size_t *cap, const char *fmt, ...)
{
	va_list ap;
	int n;

	for (;;) {
		va_start(ap, fmt);
		n = vsnprintf(*b ? *b + *len : NULL, *b ? *cap - *len : 0, fmt, ap);
		va_end(ap);
		if (n < 0)
			return -1;
		if (*b && *len + (size_t)n < *cap) {
			*len += (size_t)n;
			return 0;
		}
		char *nb = realloc(*b, *cap * 2 + (size_t)n + 1);

		if (!nb)
			return -1;
		*b = nb;
		*cap = *cap * 2 + (size_t)n + 1;
	}
}

/* kdhttpd's counters, then kdecd's kd_* metrics as its control socket gives them. */
static enum MHD_Result metrics(struct srv *s, struct MHD_Connection *conn)
{
	char *b = NULL, *reply = NULL;
	size_t len = 0, cap = 0;
	json_t *o;
	enum MHD_Result ret;

	put(&b, &len, &cap, "# HELP kdhttpd_requests_total HTTP requests answered, by endpoint and status.\n"
	    "# TYPE kdhttpd_requests_total counter\n");
	for (int r = 0; r < N_ROUTES; r++)
		for (int st = 0; st < 600; st++)
			if (atomic_load(&s->requests[r][st]))
				put(&b, &len, &cap, "kdhttpd_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n",
				    route_names[r], st, atomic_load(&s->requests[r][st]));
	put(&b, &len, &cap, "# HELP kdhttpd_requests_running Generation requests in progress.\n"
	    "# TYPE kdhttpd_requests_running gauge\nkdhttpd_requests_running %d\n"
	    "# HELP kdhttpd_client_disconnects_total Generations cancelled because the client hung up.\n"
	    "# TYPE kdhttpd_client_disconnects_total counter\nkdhttpd_client_disconnects_total %llu\n"
	    "# HELP kdhttpd_prompt_tokens_total Prompt tokens submitted.\n"
	    "# TYPE kdhttpd_prompt_tokens_total counter\nkdhttpd_prompt_tokens_total %llu\n"
	    "# HELP kdhttpd_completion_tokens_total Tokens generated for HTTP clients.\n"
	    "# TYPE kdhttpd_completion_tokens_total counter\nkdhttpd_completion_tokens_total %llu\n"
	    "# HELP kdhttpd_kdecd_connected Whether kdecd is connected.\n"
	    "# TYPE kdhttpd_kdecd_connected gauge\nkdhttpd_kdecd_connected %d\n",
	    atomic_load(&s->running), atomic_load(&s->disconnects),
	    atomic_load(&s->prompt_tokens), atomic_load(&s->completion_tokens), hb_ready(s->hb));
	if (!hb_control(s->hb, "metrics", &reply) &&
	    (o = json_loads(reply, JSON_DISABLE_EOF_CHECK, NULL))) {
		put(&b, &len, &cap, "%s", json_string_value(json_object_get(o, "text")) ?: "");
		json_decref(o);
	}
	free(reply);
	count(s, R_METRICS, 200);
	ret = send_text(conn, 200, "text/plain; version=0.0.4", b ? b : "");
	free(b);
	return ret;
}

static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Streams the call's events: MHD calls this whenever the socket can take more. Where
 * no event comes for keepalive_ms (a long prefill, a busy daemon), an SSE comment line
 * goes out instead: libmicrohttpd closes a connection that sends nothing for --timeout,
 * mid-stream too, and clients skip comments. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
	static const char keepalive[] = ": keep-alive\n\n";
	struct req_ctx *x = cls;
	struct call *c = &x->call;

	(void)pos;
	for (;;) {
		int r;

		if (c->out_pos < c->out_len) {
			size_t n = c->out_len - c->out_pos < max ? c->out_len - c->out_pos : max;

			memcpy(buf, c->out + c->out_pos, n);
			c->out_pos += n;
			if (c->out_pos == c->out_len)
				c->out_pos = c->out_len = 0;
			x->last_ms = mono_ms();
			return (ssize_t)n;
		}
		if (mono_ms() - x->last_ms >= x->keepalive_ms && max >= sizeof(keepalive) - 1) {
			memcpy(buf, keepalive, sizeof(keepalive) - 1);
			x->last_ms = mono_ms();
			return (ssize_t)(sizeof(keepalive) - 1);
		}
		r = c->api == API_MESSAGES ? anthropic_stream(c, 250) : openai_stream(c, 250);
		if (r < 0)
			return MHD_CONTENT_READER_END_WITH_ERROR;
		if (r == 0 && c->out_pos == c->out_len)
			return MHD_CONTENT_READER_END_OF_STREAM;
	}
}

static void new_id(struct srv *s, struct call *c)
{
	static const char *const prefix[] = { "chatcmpl-", "cmpl-", "msg_" };
	unsigned long long n = atomic_fetch_add(&s->next_id, 1);

	snprintf(c->id, sizeof(c->id), "%skd%llx%llx", prefix[c->api], (unsigned long long)time(NULL), n);
	c->created = (long long)time(NULL);
}

/* Parses the body into x->call. 0 or -1 with e. */
static int prepare(struct srv *s, struct MHD_Connection *conn, struct req_ctx *x,
		   struct call_err *e)
{
	struct call *c = &x->call;
	const char *ses = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Kdec-Session");
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	json_error_t je;
	json_t *body;
	int ret;

	c->api = x->route == R_CHAT ? API_CHAT : x->route == R_COMPLETION ? API_COMPLETION : API_MESSAGES;
	c->hb = s->hb;
	c->tok = hb_tokenizer(s->hb);
	c->model = hb_model_name(s->hb);
	c->client_fd = ci ? ci->connect_fd : -1;
	c->timeout_ms = (int)s->o.queue_timeout_s * 1000;
	new_id(s, c);
	if (!hb_ready(s->hb) || !c->tok)
		return call_errf(e, 503, NULL, "kdecd is not connected (see GET /health)");
	if (!(body = json_loadb(x->body ? x->body : "", x->len, JSON_REJECT_DUPLICATES, &je)))
		return call_errf(e, 400, NULL, "the body is not JSON: line %d column %d: %s",
				 je.line, je.column, je.text);
	if (!json_is_object(body)) {
		json_decref(body);
		return call_errf(e, 400, NULL, "the body is not a JSON object");
	}
	ret = json_object_get(body, "model") && !json_is_string(json_object_get(body, "model"))
		? call_errf(e, 400, "model", "model: want a string") : 0;
	if (!ret && ses)
		ret = call_set_session(c, ses, "X-Kdec-Session", e);
	if (!ret)
		ret = c->api == API_MESSAGES ? anthropic_parse(c, body, e) : openai_parse(c, body, e);
	json_decref(body);
	return ret;
}

static enum MHD_Result generate(struct srv *s, struct MHD_Connection *conn, struct req_ctx *x)
{
	struct call *c = &x->call;
	struct MHD_Response *r;
	struct call_err e;
	enum MHD_Result ret;
	char *body;

	if (prepare(s, conn, x, &e))
		return send_error(s, conn, x->route, &e);
	atomic_fetch_add(&s->running, 1);
	x->counted_running = 1;
	atomic_fetch_add(&s->prompt_tokens, c->req.n_prompt);
	if (call_start(c, &e)) {
		if (c->client_gone) {
			atomic_fetch_add(&s->disconnects, 1);
			return MHD_NO;
		}
		return send_error(s, conn, x->route, &e);
	}
	if (c->stream) {
		/* a third of --timeout (at most 15 s): two chances before the connection is
		 * counted idle */
		x->keepalive_ms = s->o.timeout_s >= 45 ? 15000 : (int)s->o.timeout_s * 1000 / 3;
		x->last_ms = mono_ms();
		r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, x, NULL);
		if (!r)
			return MHD_NO;
		MHD_add_response_header(r, "Content-Type", "text/event-stream");
		MHD_add_response_header(r, "Cache-Control", "no-cache");
		count(s, x->route, 200);
		ret = MHD_queue_response(conn, 200, r);
		MHD_destroy_response(r);
		return ret;
	}
	if (call_run(c)) {
		atomic_fetch_add(&s->disconnects, 1);
		return MHD_NO;
	}
	if (c->fin == FIN_ERROR) {
		call_fin_error(c, &e);
		return send_error(s, conn, x->route, &e);
	}
	body = c->api == API_MESSAGES ? anthropic_response(c) : openai_response(c);
	if (!body)
		return send_errf(s, conn, x->route, 500, "out of memory");
	count(s, x->route, 200);
	ret = send_text(conn, 200, "application/json", body);
	free(body);
	return ret;
}

/* Takes a piece of the body; past max_body the rest is read and dropped. */
static void take_body(struct srv *s, struct req_ctx *x, const char *data, size_t n)
{
	if (x->too_big || x->len + n > s->o.max_body) {
		x->too_big = 1;
		return;
	}
	if (x->len + n + 1 > x->cap) {
		size_t cap = x->cap ? x->cap : 4096;
		char *b;

		while (cap < x->len + n + 1)
			cap *= 2;
		if (!(b = realloc(x->body, cap))) {
			x->too_big = 1;
			return;
		}
		x->body = b;
		x->cap = cap;
	}
	memcpy(x->body + x->len, data, n);
	x->len += n;
	x->body[x->len] = 0;
}

/* The first call, with the headers: route, method, key, declared length. 1: go on. */
static int check_headers(struct srv *s, struct MHD_Connection *conn, struct req_ctx *x,
			 const char *method, enum MHD_Result *ret)
{
	int post = x->route == R_CHAT || x->route == R_COMPLETION || x->route == R_MESSAGES;
	const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
	char msg[160];

	if (x->route == R_OTHER) {
		*ret = send_errf(s, conn, x->route, 404, "no such endpoint (POST /v1/chat/completions, "
				 "/v1/completions, /v1/messages; GET /v1/models, /health, /metrics)");
		return 0;
	}
	if (strcmp(method, post ? "POST" : "GET")) {
		snprintf(msg, sizeof(msg), "method %.16s: this endpoint takes %s", method,
			 post ? "POST" : "GET");
		*ret = send_errf(s, conn, x->route, 405, msg);
		return 0;
	}
	if (x->route != R_HEALTH && !authorized(s, conn)) {
		*ret = send_errf(s, conn, x->route, 401, "missing or wrong API key (Authorization: "
				 "Bearer KEY, or x-api-key: KEY)");
		return 0;
	}
	if (cl && strtoull(cl, NULL, 10) > s->o.max_body) {
		snprintf(msg, sizeof(msg), "the body is %.20s bytes, over kdhttpd's --max-body %zu",
			 cl, s->o.max_body);
		*ret = send_errf(s, conn, x->route, 413, msg);
		return 0;
	}
	return 1;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
			      const char *method, const char *version, const char *data,
			      size_t *data_size, void **con_cls)
{
	struct srv *s = cls;
	struct req_ctx *x = *con_cls;
	enum MHD_Result ret;
	char msg[128];

	if (!x) {
		if (!(x = calloc(1, sizeof(*x))))
			return MHD_NO;
		x->call.client_fd = -1;
		x->route = route_of(url);
		*con_cls = x;
		return check_headers(s, conn, x, method, &ret) ? MHD_YES : ret;
	}
	if (*data_size) {
		take_body(s, x, data, *data_size);
		*data_size = 0;
		return MHD_YES;
	}
	if (x->too_big) {
		snprintf(msg, sizeof(msg), "the body is over kdhttpd's --max-body %zu bytes",
			 s->o.max_body);
		return send_errf(s, conn, x->route, 413, msg);
	}
	switch (x->route) {
	case R_MODELS: return models(s, conn, url);
	case R_HEALTH: return health(s, conn);
	case R_METRICS: return metrics(s, conn);
	default: return generate(s, conn, x);
	}
}

static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
		      enum MHD_RequestTerminationCode why)
{
	struct srv *s = cls;
	struct req_ctx *x = *con_cls;

	if (!x)
		return;
	/* a streamed call whose client hung up: seen on its socket, or as a failed write */
	if (x->call.stream && x->call.phase != 2 &&
	    (x->call.client_gone || why != MHD_REQUEST_TERMINATED_COMPLETED_OK))
		atomic_fetch_add(&s->disconnects, 1);
	atomic_fetch_add(&s->completion_tokens, x->call.n_gen);
	if (x->counted_running)
		atomic_fetch_sub(&s->running, 1);
	call_free(&x->call);	/* cancels a generation still running */
	free(x->body);
	free(x);
	*con_cls = NULL;
}

/* "unix:PATH", "[V6]:PORT" or "HOST:PORT" to a listening socket. */
static int listen_on(struct srv *s, const char *spec, char *shown, size_t shown_len)
{
	char host[256], port[16];
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *ai, *a;
	const char *colon;
	int fd = -1, one = 1, ret;

	if (!strncmp(spec, "unix:", 5)) {
		struct sockaddr_un un = { .sun_family = AF_UNIX };

		if (strlen(spec + 5) >= sizeof(un.sun_path) || !spec[5]) {
			fprintf(stderr, "kdhttpd: --listen %s: a path of 1..%zu bytes\n", spec,
				sizeof(un.sun_path) - 1);
			return -ENAMETOOLONG;
		}
		strcpy(un.sun_path, spec + 5);
		unlink(un.sun_path);	/* a stale socket of an earlier run */
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0 || bind(fd, (struct sockaddr *)&un, sizeof(un)) || listen(fd, 128)) {
			ret = -errno;
			fprintf(stderr, "kdhttpd: --listen %s: %s\n", spec, strerror(errno));
			if (fd >= 0)
				close(fd);
			return ret;
		}
		snprintf(s->unix_path, sizeof(s->unix_path), "%s", un.sun_path);
		snprintf(shown, shown_len, "%s", spec);
		return fd;
	}
	colon = strrchr(spec, ':');
	if (!colon || colon == spec || !colon[1] || (size_t)(colon - spec) >= sizeof(host) ||
	    strlen(colon + 1) >= sizeof(port)) {
		fprintf(stderr, "kdhttpd: --listen '%s': want HOST:PORT, [V6]:PORT or unix:PATH\n", spec);
		return -EINVAL;
	}
	memcpy(host, spec[0] == '[' ? spec + 1 : spec, (size_t)(colon - spec));
	host[colon - spec - (spec[0] == '[' ? 2 : 0)] = 0;
	snprintf(port, sizeof(port), "%s", colon + 1);
	if ((ret = getaddrinfo(host, port, &hints, &ai))) {
		fprintf(stderr, "kdhttpd: --listen %s: %s\n", spec, gai_strerror(ret));
		return -EINVAL;
	}
	ret = -EADDRNOTAVAIL;
	for (a = ai; a; a = a->ai_next) {
		fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
		if (fd < 0)
			continue;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (!bind(fd, a->ai_addr, a->ai_addrlen) && !listen(fd, 128))
			break;
		ret = -errno;
		close(fd);
		fd = -1;
	}
	freeaddrinfo(ai);
	if (fd < 0) {
		fprintf(stderr, "kdhttpd: --listen %s: %s\n", spec, strerror(-ret));
		return ret;
	} else {
		struct sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		char addr[INET6_ADDRSTRLEN] = "?";
		unsigned p = 0;

		getsockname(fd, (struct sockaddr *)&ss, &sl);
		if (ss.ss_family == AF_INET) {
			inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, addr, sizeof(addr));
			p = ntohs(((struct sockaddr_in *)&ss)->sin_port);
			snprintf(shown, shown_len, "http://%s:%u", addr, p);
		} else {
			inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, addr, sizeof(addr));
			p = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
			snprintf(shown, shown_len, "http://[%s]:%u", addr, p);
		}
	}
	return fd;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	char line[512];

	vsnprintf(line, sizeof(line), fmt, ap);
	fprintf(stderr, "kdhttpd: libmicrohttpd: %s%s", line,
		line[0] && line[strlen(line) - 1] == '\n' ? "" : "\n");
}

int srv_start(struct srv **out, const struct srv_opts *o, struct hb *hb)
{
	struct srv *s = calloc(1, sizeof(*s));
	char shown[300];
	int fd;

	if (!s)
		return -ENOMEM;
	s->hb = hb;
	s->o = *o;
	fd = listen_on(s, o->listen, shown, sizeof(shown));
	if (fd < 0) {
		free(s);
		return fd;
	}
	s->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
				MHD_USE_POLL | MHD_USE_ERROR_LOG, 0, NULL, NULL, handle, s,
				MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
				MHD_OPTION_LISTEN_SOCKET, fd,
				MHD_OPTION_CONNECTION_TIMEOUT, o->timeout_s,
				MHD_OPTION_CONNECTION_LIMIT, o->max_conns,
				MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
				MHD_OPTION_NOTIFY_COMPLETED, completed, s,
				MHD_OPTION_END);
	if (!s->d) {
		fprintf(stderr, "kdhttpd: libmicrohttpd did not start on %s\n", shown);
		close(fd);
		free(s);
		return -EIO;
	}
	fprintf(stderr, "kdhttpd: listening on %s\n", shown);
	*out = s;
	return 0;
}

void srv_stop(struct srv *s)
{
	if (!s)
		return;
	MHD_stop_daemon(s->d);
	if (s->unix_path[0])
		unlink(s->unix_path);
	free(s);
}
