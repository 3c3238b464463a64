/* A call's run on kdecd: submit (retrying while the connection's tokens in flight are
 * at the daemon's cap), take its events, detokenize, match stop strings across token
 * boundaries, notice a client that hung up and cancel; and the helpers both front
 * ends use to read fields and write errors. */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http/http_call.h"

#define STEP_SLICE_MS 100	/* waits are cut in slices to look at the client's socket */

int call_errf(struct call_err *e, int status, const char *param, const char *fmt, ...)
{
	va_list ap;

	e->status = status ? status : 400;
	e->type = NULL;
	snprintf(e->param, sizeof(e->param), "%s", param ? param : "");
	va_start(ap, fmt);
	vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
	va_end(ap);
	return -1;
}

int call_get_num(json_t *body, const char *key, double min, double max, double *out,
		 struct call_err *e)
{
	json_t *v = json_object_get(body, key);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v))
		return call_errf(e, 400, key, "%s: want a number in [%g, %g]", key, min, max);
	if (json_number_value(v) < min || json_number_value(v) > max)
		return call_errf(e, 400, key, "%s %g: want a number in [%g, %g]", key,
				 json_number_value(v), min, max);
	*out = json_number_value(v);
	return 0;
}

int call_get_int(json_t *body, const char *key, long long min, long long max, long long *out,
		 struct call_err *e)
{
	json_t *v = json_object_get(body, key);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v))
		return call_errf(e, 400, key, "%s: want an integer in [%lld, %lld]", key, min, max);
	if (json_integer_value(v) < min || json_integer_value(v) > max)
		return call_errf(e, 400, key, "%s %lld: want an integer in [%lld, %lld]", key,
				 (long long)json_integer_value(v), min, max);
	*out = json_integer_value(v);
	return 0;
}

int call_text_parts(json_t *v, const char *where, const char *param, int null_ok, char **out,
		    struct call_err *e)
{
	size_t j, len = 0;
	json_t *b;
	char *s = NULL;

	if (json_is_string(v)) {
		*out = strndup(json_string_value(v), json_string_length(v));
		return *out ? 0 : call_errf(e, 500, NULL, "out of memory");
	}
	if (null_ok && (!v || json_is_null(v))) {
		*out = strdup("");
		return *out ? 0 : call_errf(e, 500, NULL, "out of memory");
	}
	if (!json_is_array(v))
		return call_errf(e, 400, param, "%s: want a string or an array of text parts", where);
	json_array_foreach(v, j, b) {
		const char *type = json_string_value(json_object_get(b, "type"));
		json_t *t = json_object_get(b, "text");
		char *s2;

		if (!type || strcmp(type, "text") || !json_is_string(t)) {
			free(s);
			return call_errf(e, 400, param, "%s[%zu]: type '%s': kdec serves text only "
					 "(parts of type \"text\" with a string \"text\")", where, j,
					 type ? type : "(none)");
		}
		if (!(s2 = realloc(s, len + json_string_length(t) + 1))) {
			free(s);
			return call_errf(e, 500, NULL, "out of memory");
		}
		s = s2;
		memcpy(s + len, json_string_value(t), json_string_length(t));
		len += json_string_length(t);
		s[len] = 0;
	}
	*out = s ? s : strdup("");
	return *out ? 0 : call_errf(e, 500, NULL, "out of memory");
}

int call_get_bool(json_t *body, const char *key, int *out, struct call_err *e)
{
	json_t *v = json_object_get(body, key);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return call_errf(e, 400, key, "%s: want true or false", key);
	*out = json_is_true(v);
	return 0;
}

int call_parse_sampling(struct call *c, json_t *body, struct call_err *e)
{
	struct kd_sampling *s = &c->req.sampling;
	double t = 1, top_p = 1, min_p = 0, pres = 0, freq = 0;
	long long top_k = 0, seed = 0;

	/* both APIs default to temperature 1 */
	if (call_get_num(body, "temperature", 0, 2, &t, e) ||
	    call_get_num(body, "top_p", 0, 1, &top_p, e) ||
	    call_get_num(body, "min_p", 0, 1, &min_p, e) ||
	    call_get_int(body, "top_k", -1, 1 << 30, &top_k, e) ||
	    call_get_int(body, "seed", INT64_MIN, INT64_MAX, &seed, e) ||
	    call_get_num(body, "presence_penalty", -2, 2, &pres, e) ||
	    call_get_num(body, "frequency_penalty", -2, 2, &freq, e))
		return -1;
	s->temperature = (float)t;
	s->top_p = (float)top_p;
	s->min_p = (float)min_p;
	s->top_k = (int)top_k;
	s->seed = (uint64_t)seed;
	s->presence_penalty = (float)pres;
	s->frequency_penalty = (float)freq;
	return 0;
}

int call_parse_max_tokens(struct call *c, json_t *body, const char *const *names, int required,
			  struct call_err *e)
{
	long long v = -1;

	for (; *names; names++)
		if (call_get_int(body, *names, 1, 1 << 24, &v, e))
			return -1;
	if (v < 0 && required)
		return call_errf(e, 400, "max_tokens", "max_tokens: required (an integer >= 1)");
	c->req.max_tokens = (uint32_t)v;	/* -1 (absent): call_start picks */
	return 0;
}

int call_add_stop(struct call *c, const char *s, size_t len, const char *param,
		  struct call_err *e)
{
	if (c->n_stops == CALL_MAX_STOPS)
		return call_errf(e, 400, param, "%s: at most %d stop strings", param, CALL_MAX_STOPS);
	if (!len || len > CALL_STOP_MAX)
		return call_errf(e, 400, param, "%s: a stop string of %zu bytes (want 1..%d)", param,
				 len, CALL_STOP_MAX);
	if (!(c->stops[c->n_stops] = strndup(s, len)))
		return call_errf(e, 500, NULL, "out of memory");
	c->n_stops++;
	if (len > c->max_stop)
		c->max_stop = len;
	return 0;
}

int call_set_session(struct call *c, const char *name, const char *where, struct call_err *e)
{
	char why[200];

	if (kd_session_name_check(name, why, sizeof(why)))
		return call_errf(e, 400, where, "%s: %s", where, why);
	snprintf(c->session, sizeof(c->session), "%s", name);
	c->req.session = c->session;
	return 0;
}

int call_set_prompt(struct call *c, const char *text, size_t len, int chat, struct call_err *e)
{
	unsigned flags = chat ? KD_TOKENIZE_SPECIAL : KD_TOKENIZE_ADD_SPECIAL;
	long n = kd_tokenizer_encode(c->tok, text, len, flags, NULL, 0);

	if (n < 0)
		return call_errf(e, 400, "prompt", "the prompt does not tokenize: %s",
				 kd_strerror((int)n));
	if (n == 0)
		return call_errf(e, 400, "prompt", "the prompt is empty (0 tokens)");
	if (n > CALL_MAX_PROMPT)
		return call_errf(e, 400, "prompt", "the prompt is %ld tokens, over kdhttpd's %d", n,
				 CALL_MAX_PROMPT);
	if (!(c->prompt = malloc(sizeof(*c->prompt) * (size_t)n)))
		return call_errf(e, 500, NULL, "out of memory");
	c->req.prompt = c->prompt;
	c->req.n_prompt = (uint32_t)kd_tokenizer_encode(c->tok, text, len, flags, c->prompt,
							(size_t)n);
	return 0;
}

static void add_stop_id(struct call *c, int32_t id)
{
	for (uint32_t i = 0; i < c->req.n_stop; i++)
		if (c->stop_ids[i] == id)
			return;
	if (id >= 0 && c->req.n_stop < KD_MAX_STOP)
		c->stop_ids[c->req.n_stop++] = id;
	c->req.stop = c->stop_ids;
}

void call_stop_at_eot(struct call *c)
{
	add_stop_id(c, kd_tokenizer_eot(c->tok));
	add_stop_id(c, kd_tokenizer_eos(c->tok));
}

size_t call_token_text(const struct call *c, int32_t id, char *buf, size_t len)
{
	long n = kd_tokenizer_decode(c->tok, &id, 1, 0, buf, len);

	return n < 0 ? 0 : (size_t)n < len ? (size_t)n : len;
}

static int grow(char **p, size_t *cap, size_t need)
{
	size_t cap2 = *cap ? *cap : 256;
	char *q;

	if (need <= *cap)
		return 0;
	while (cap2 < need)
		cap2 *= 2;
	if (!(q = realloc(*p, cap2)))
		return -ENOMEM;
	*p = q;
	*cap = cap2;
	return 0;
}

int call_out(struct call *c, const char *s, size_t len)
{
	if (grow(&c->out, &c->out_cap, c->out_len + len))
		return -ENOMEM;
	memcpy(c->out + c->out_len, s, len);
	c->out_len += len;
	return 0;
}

int call_out_sse(struct call *c, const char *event, json_t *v)
{
	char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
	int ret = -ENOMEM;

	json_decref(v);
	if (!s)
		return ret;
	if (event)
		ret = call_out(c, "event: ", 7) || call_out(c, event, strlen(event)) ||
		      call_out(c, "\n", 1) ? -ENOMEM : 0;
	else
		ret = 0;
	if (!ret)
		ret = call_out(c, "data: ", 6) || call_out(c, s, strlen(s)) ||
		      call_out(c, "\n\n", 2) ? -ENOMEM : 0;
	free(s);
	return ret;
}

/* Whether the client hung up: the socket reports a hang-up or an error (data the
 * client may have pipelined is not one). */
static int client_gone(struct call *c)
{
	struct pollfd p = { .fd = c->client_fd, .events = POLLRDHUP };

	if (c->client_gone)
		return 1;
	if (c->client_fd >= 0 && poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)))
		c->client_gone = 1;
	return c->client_gone;
}

/* The first position where a stop string starts within text[from..len), or -1. */
static long find_stop(struct call *c, size_t from)
{
	long best = -1;

	for (int i = 0; i < c->n_stops; i++) {
		size_t n = strlen(c->stops[i]);
		const char *p = c->len >= n ? memmem(c->text + from, c->len - from, c->stops[i], n)
					    : NULL;

		if (p && (best < 0 || p - c->text < best)) {
			best = p - c->text;
			c->stop_index = i;
		}
	}
	return best;
}

static int append_text(struct call *c, const char *s, size_t n)
{
	size_t old = c->len, from;
	long at;

	if (grow(&c->text, &c->cap, c->len + n + 1))
		return -ENOMEM;
	memcpy(c->text + c->len, s, n);
	c->len += n;
	c->text[c->len] = 0;
	if (!c->n_stops || !n)
		return 0;
	/* a stop string found now ends in the new bytes: it starts at most
	 * max_stop - 1 bytes before them */
	from = old > c->max_stop - 1 ? old - (c->max_stop - 1) : 0;
	at = find_stop(c, from);
	if (at >= 0) {
		c->len = (size_t)at;
		c->text[c->len] = 0;
		c->fin = FIN_STOP;
	}
	return 0;
}

size_t call_ready(const struct call *c)
{
	size_t hold = 0;

	if (c->fin != FIN_NONE)
		return c->len;
	/* hold back the longest tail that is the start of a stop string */
	for (int i = 0; i < c->n_stops; i++) {
		size_t n = strlen(c->stops[i]);

		for (size_t k = n - 1; k > hold; k--)
			if (k <= c->len && !memcmp(c->text + c->len - k, c->stops[i], k)) {
				hold = k;
				break;
			}
	}
	return c->len - hold;
}

static int add_lp(struct call *c, const struct kd_event *ev)
{
	if (c->n_lp == c->cap_lp) {
		size_t cap = c->cap_lp ? c->cap_lp * 2 : 64;
		struct call_lp *p = realloc(c->lps, sizeof(*p) * cap);

		if (!p)
			return -ENOMEM;
		c->lps = p;
		c->cap_lp = cap;
	}
	c->lps[c->n_lp++] = (struct call_lp){ .token = ev->token, .lp = ev->logprob,
					      .top = ev->top_token, .top_lp = ev->top_logprob,
					      .text_at = c->len };
	return 0;
}

static void finish(struct call *c, const struct kd_event *ev)
{
	const char *tail;
	size_t n;

	c->final = *ev;
	if (c->fin != FIN_NONE)
		return;
	if (!kd_tokenizer_stream_finish(c->detok, &tail, &n))
		append_text(c, tail, n);
	if (c->fin != FIN_NONE)
		return;
	switch (ev->stop) {
	case KD_STOP_TOKEN: c->fin = FIN_TOKEN; break;
	case KD_STOP_LENGTH: c->fin = FIN_LENGTH; break;
	default: c->fin = FIN_ERROR; break;
	}
}

/* One event into the text. */
static void take_event(struct call *c, const struct kd_event *ev)
{
	const char *piece;
	size_t n;

	if (c->fin != FIN_NONE)
		return;
	if (ev->token >= 0) {
		if (!c->n_gen++)
			c->cached = ev->cached_tokens;
		if ((ev->flags & KD_EVENT_LOGPROB) && add_lp(c, ev))
			c->fin = FIN_ERROR;
		if (kd_tokenizer_stream_push(c->detok, ev->token, &piece, &n) ||
		    append_text(c, piece, n))
			c->fin = FIN_ERROR;
	}
	if (ev->flags & KD_EVENT_FINAL)
		finish(c, ev);
	else if (c->fin == FIN_STOP)
		c->final = *ev;
}

int call_step(struct call *c, int wait_ms)
{
	struct kd_event ev[64];
	int n = 0;

	do {
		int slice = wait_ms < STEP_SLICE_MS ? wait_ms : STEP_SLICE_MS;

		if (client_gone(c)) {
			hb_req_release(&c->q);	/* cancels it on the daemon */
			c->submitted = 0;
			return -1;
		}
		n = hb_req_take(&c->q, ev, 64, slice);
		wait_ms -= slice;
	} while (!n && wait_ms > 0);
	for (int i = 0; i < n; i++)
		take_event(c, &ev[i]);
	if (c->fin != FIN_NONE && c->submitted) {
		hb_req_release(&c->q);	/* a stop string: the daemon stops here */
		c->submitted = 0;
	}
	return n > 0;
}

int call_run(struct call *c)
{
	while (c->fin == FIN_NONE)
		if (call_step(c, 1000) < 0)
			return -1;
	return 0;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* The default max_tokens: what the daemon's cache leaves after the prompt, at most
 * 4096 (a request of the whole cache would hold the connection's tokens alone). */
static uint32_t default_max_tokens(struct call *c)
{
	uint32_t ctx = hb_context_tokens(c->hb), left;

	left = ctx > c->req.n_prompt ? ctx - c->req.n_prompt : 1;
	return ctx ? (left < 4096 ? left : 4096) : 4096;
}

int call_start(struct call *c, struct call_err *e)
{
	long long deadline = now_ms() + c->timeout_ms;
	int ret;

	if (c->req.max_tokens == (uint32_t)-1 || !c->req.max_tokens)
		c->req.max_tokens = default_max_tokens(c);
	if (kd_tokenizer_stream_create(&c->detok, c->tok, KD_DECODE_SKIP_SPECIAL))
		return call_errf(e, 500, NULL, "out of memory");
	for (;;) {
		ret = hb_submit(c->hb, &c->req, &c->q, 1000);
		if (ret == -ENOTCONN)
			return call_errf(e, 503, NULL, "kdecd is not connected");
		if (ret == -E2BIG)
			return call_errf(e, 400, "messages", "the prompt (%u tokens) is longer than "
					 "kdecd's shared-memory segment takes", c->req.n_prompt);
		if (ret)
			return call_errf(e, ret == -EAGAIN ? 503 : 400, NULL, "kdecd refused the "
					 "request: %s", kd_strerror(ret));
		c->submitted = 1;
		while (c->fin == FIN_NONE && !c->n_gen)
			if (call_step(c, 1000) < 0)
				return call_errf(e, 499, NULL, "the client closed the connection");
		/* the connection's tokens in flight are at the daemon's cap: wait for one
		 * of its requests to end and submit again */
		if (c->fin == FIN_ERROR && c->final.error == -EAGAIN && !c->n_gen &&
		    now_ms() < deadline) {
			c->fin = FIN_NONE;
			hb_wait_any_final(c->hb, 200);
			if (client_gone(c))
				return call_errf(e, 499, NULL, "the client closed the connection");
			continue;
		}
		break;
	}
	if (c->fin == FIN_ERROR && !c->n_gen) {
		call_fin_error(c, e);
		return -1;
	}
	return 0;
}

void call_fin_error(const struct call *c, struct call_err *e)
{
	char msg[256];
	int err = c->final.error, status;

	kd_event_message(&c->final, msg, sizeof(msg));
	if (err == -E2BIG || err == -EINVAL || err == -ERANGE || err == -EEXIST)
		status = 400;
	else if (err == -ENOSPC || err == -EAGAIN || err == -EBUSY || err == -EDQUOT)
		status = 429;
	else if (err == -ECONNRESET || err == -ESHUTDOWN || c->final.stop == KD_STOP_CANCELLED)
		status = 503;
	else
		status = 500;
	call_errf(e, status, NULL, "kdecd: %s", msg);
}

void call_free(struct call *c)
{
	if (c->submitted)
		hb_req_release(&c->q);
	kd_tokenizer_stream_destroy(c->detok);
	for (int i = 0; i < c->n_stops; i++)
		free(c->stops[i]);
	free(c->prompt);
	free(c->tools_json);
	free(c->text);
	free(c->lps);
	free(c->out);
	memset(c, 0, sizeof(*c));
}
