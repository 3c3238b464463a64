/* The OpenAI API front end: /v1/chat/completions and /v1/completions bodies into a
 * call (messages through the model's chat template), and its answers: the response
 * object, the chat.completion.chunk / text_completion server-sent events ending in
 * "data: [DONE]", logprobs in both shapes, and the {"error": {...}} body. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_call.h"

#define MAX_MESSAGES 4096

/* A JSON string of the token's bytes: as they are when valid UTF-8, else each byte
 * outside ASCII written "\xNN" (the "bytes" array beside it has them exactly). */
static json_t *token_string(const char *s, size_t n)
{
	json_t *v = json_stringn(s, n);
	char esc[4 * 64 + 1];
	size_t k = 0;

	if (v)
		return v;
	for (size_t i = 0; i < n && k + 5 < sizeof(esc); i++)
		k += (size_t)(((unsigned char)s[i] < 0x80 && s[i])
			? snprintf(esc + k, sizeof(esc) - k, "%c", s[i])
			: snprintf(esc + k, sizeof(esc) - k, "\\x%02x", (unsigned char)s[i]));
	return json_stringn(esc, k);
}

static json_t *token_bytes(const char *s, size_t n)
{
	json_t *a = json_array();

	for (size_t i = 0; i < n; i++)
		json_array_append_new(a, json_integer((unsigned char)s[i]));
	return a;
}

/* Chat's logprobs.content entries for tokens [from, to). */
static json_t *chat_logprobs(const struct call *c, size_t from, size_t to)
{
	json_t *content = json_array();
	char buf[64];

	for (size_t i = from; i < to; i++) {
		const struct call_lp *l = &c->lps[i];
		size_t n = call_token_text(c, l->token, buf, sizeof(buf));
		json_t *top = json_array();

		if (l->top >= 0 && c->top_logprobs) {
			size_t m = call_token_text(c, l->top, buf, sizeof(buf));

			json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token",
				token_string(buf, m), "logprob", (double)l->top_lp, "bytes",
				token_bytes(buf, m)));
			n = call_token_text(c, l->token, buf, sizeof(buf));
		}
		json_array_append_new(content, json_pack("{s:o, s:f, s:o, s:o}", "token",
			token_string(buf, n), "logprob", (double)l->lp, "bytes", token_bytes(buf, n),
			"top_logprobs", top));
	}
	return json_pack("{s:o}", "content", content);
}

/* Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset. */
static json_t *completion_logprobs(const struct call *c, size_t from, size_t to, size_t base)
{
	json_t *toks = json_array(), *lps = json_array(), *tops = json_array(),
	       *offs = json_array();
	char buf[64];

	for (size_t i = from; i < to; i++) {
		const struct call_lp *l = &c->lps[i];
		size_t n = call_token_text(c, l->token, buf, sizeof(buf));

		json_array_append_new(toks, token_string(buf, n));
		json_array_append_new(lps, json_real(l->lp));
		json_array_append_new(offs, json_integer((json_int_t)(base + l->text_at)));
		if (l->top >= 0 && c->top_logprobs) {
			json_t *o = json_object(), *k;

			n = call_token_text(c, l->top, buf, sizeof(buf));
			k = token_string(buf, n);
			json_object_set_new(o, json_string_value(k) ?: "", json_real(l->top_lp));
			json_decref(k);
			json_array_append_new(tops, o);
		} else {
			json_array_append_new(tops, json_null());
		}
	}
	return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps,
			 "top_logprobs", tops, "text_offset", offs);
}

static int parse_messages(struct call *c, json_t *body, struct call_err *e)
{
	json_t *msgs = json_object_get(body, "messages"), *m;
	struct kd_chat_message *cm;
	char **texts, where[48];
	size_t i, n;
	int ret = 0;

	if (!json_is_array(msgs) || !json_array_size(msgs))
		return call_errf(e, 400, "messages", "messages: want a non-empty array");
	if ((n = json_array_size(msgs)) > MAX_MESSAGES)
		return call_errf(e, 400, "messages", "messages: %zu, at most %d", n, MAX_MESSAGES);
	cm = calloc(n, sizeof(*cm));
	texts = calloc(2 * n, sizeof(*texts));	/* content, then tool_calls JSON */
	if (!cm || !texts) {
		free(cm);
		free(texts);
		return call_errf(e, 500, NULL, "out of memory");
	}
	json_array_foreach(msgs, i, m) {
		const char *role = json_string_value(json_object_get(m, "role"));

		if (!role || (strcmp(role, "system") && strcmp(role, "developer") &&
			      strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "tool"))) {
			ret = call_errf(e, 400, "messages", "messages[%zu].role '%s': want system, "
					"developer, user, assistant or tool", i, role ? role : "(none)");
			break;
		}
		snprintf(where, sizeof(where), "messages[%zu].content", i);
		if ((ret = call_text_parts(json_object_get(m, "content"), where, "messages", 1,
					   &texts[i], e)))
			break;
		cm[i].role = strcmp(role, "developer") ? role : "system";
		cm[i].content = texts[i];
		if ((ret = tools_openai_message(c, m, i, &cm[i], &texts[n + i], e)))
			break;
	}
	if (!ret)
		ret = tools_render(c, cm, n, e);
	for (i = 0; i < 2 * n; i++)
		free(texts[i]);
	free(texts);
	free(cm);
	return ret;
}

static int parse_prompt(struct call *c, json_t *body, struct call_err *e)
{
	json_t *p = json_object_get(body, "prompt");

	if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
		p = json_array_get(p, 0);
	if (json_is_string(p))
		return call_set_prompt(c, json_string_value(p), json_string_length(p), 0, e);
	if (json_is_array(p) && json_array_size(p) && json_is_integer(json_array_get(p, 0))) {
		size_t i, n = json_array_size(p);
		json_t *v;

		if (n > CALL_MAX_PROMPT)
			return call_errf(e, 400, "prompt", "prompt: %zu tokens, over kdhttpd's %d", n,
					 CALL_MAX_PROMPT);
		if (!(c->prompt = malloc(sizeof(*c->prompt) * n)))
			return call_errf(e, 500, NULL, "out of memory");
		json_array_foreach(p, i, v) {
			if (!json_is_integer(v) || json_integer_value(v) < 0 ||
			    json_integer_value(v) >= kd_tokenizer_n_vocab(c->tok))
				return call_errf(e, 400, "prompt", "prompt[%zu]: want a token id in "
						 "0..%d", i, kd_tokenizer_n_vocab(c->tok) - 1);
			c->prompt[i] = (int32_t)json_integer_value(v);
		}
		c->req.prompt = c->prompt;
		c->req.n_prompt = (uint32_t)n;
		return 0;
	}
	return call_errf(e, 400, "prompt", "prompt: want a string, an array of one string, or "
			 "an array of token ids (one prompt per request: n = 1)");
}

static int parse_stop(struct call *c, json_t *body, struct call_err *e)
{
	json_t *s = json_object_get(body, "stop"), *v;
	size_t i;

	if (!s || json_is_null(s))
		return 0;
	if (json_is_string(s))
		return call_add_stop(c, json_string_value(s), json_string_length(s), "stop", e);
	if (!json_is_array(s))
		return call_errf(e, 400, "stop", "stop: want a string or an array of strings");
	json_array_foreach(s, i, v) {
		if (!json_is_string(v))
			return call_errf(e, 400, "stop", "stop[%zu]: want a string", i);
		if (call_add_stop(c, json_string_value(v), json_string_length(v), "stop", e))
			return -1;
	}
	return 0;
}

/* Fields kdec cannot honour are refused, not ignored: the client would get something
 * else than it asked for. */
static int refuse_unsupported(struct call *c, json_t *body, struct call_err *e)
{
	json_t *v;
	long long n = 1;
	int echo = 0;

	if (call_get_int(body, "n", 1, 128, &n, e) || call_get_bool(body, "echo", &echo, e))
		return -1;
	if (n != 1)
		return call_errf(e, 400, "n", "n %lld: kdhttpd generates one choice per request "
				 "(n = 1); send %lld requests", n, n);
	if (echo)
		return call_errf(e, 400, "echo", "echo: not supported (false only)");
	if ((v = json_object_get(body, "best_of")) && !json_is_null(v) &&
	    !(json_is_integer(v) && json_integer_value(v) == 1))
		return call_errf(e, 400, "best_of", "best_of: not supported (1 only)");
	if ((v = json_object_get(body, "logit_bias")) && !json_is_null(v) &&
	    !(json_is_object(v) && !json_object_size(v)))
		return call_errf(e, 400, "logit_bias", "logit_bias: not supported by kdecd's sampler");
	if ((v = json_object_get(body, "suffix")) && !json_is_null(v) &&
	    !(json_is_string(v) && !json_string_length(v)))
		return call_errf(e, 400, "suffix", "suffix: not supported");
	v = json_object_get(json_object_get(body, "response_format"), "type");
	if (json_object_get(body, "response_format") && !json_is_null(json_object_get(body, "response_format")) &&
	    (!json_is_string(v) || strcmp(json_string_value(v), "text")))
		return call_errf(e, 400, "response_format", "response_format: only {\"type\": "
				 "\"text\"} (kdecd has no constrained decoding)");
	return 0;
}

static int parse_logprobs(struct call *c, json_t *body, struct call_err *e)
{
	json_t *v = json_object_get(body, "logprobs");
	long long top = 0;

	if (c->api == API_CHAT) {
		if (call_get_bool(body, "logprobs", &c->logprobs, e) ||
		    call_get_int(body, "top_logprobs", 0, 20, &top, e))
			return -1;
	} else if (v && !json_is_null(v)) {	/* completions: an integer, the top count */
		if (call_get_int(body, "logprobs", 0, 5, &top, e))
			return -1;
		c->logprobs = 1;
	}
	if (top > 1)
		return call_errf(e, 400, "top_logprobs", "top_logprobs %lld: kdecd returns the "
				 "most probable token's logprob only (0 or 1)", top);
	c->top_logprobs = (int)top;
	c->req.sampling.logprobs = c->logprobs;
	c->req.sampling.top_logprobs = c->logprobs && top;
	return 0;
}

int openai_parse(struct call *c, json_t *body, struct call_err *e)
{
	static const char *const chat_max[] = { "max_tokens", "max_completion_tokens", NULL };
	static const char *const compl_max[] = { "max_tokens", NULL };
	json_t *so = json_object_get(body, "stream_options"), *user = json_object_get(body, "user");
	int ignore_eos = 0;

	if (refuse_unsupported(c, body, e) || tools_check_openai(c, body, e) ||
	    call_get_bool(body, "stream", &c->stream, e) || call_parse_sampling(c, body, e) ||
	    call_parse_max_tokens(c, body, c->api == API_CHAT ? chat_max : compl_max, 0, e) ||
	    parse_logprobs(c, body, e) || parse_stop(c, body, e))
		return -1;
	if (so && !json_is_null(so) &&
	    (!json_is_object(so) || call_get_bool(so, "include_usage", &c->include_usage, e)))
		return call_errf(e, 400, "stream_options", "stream_options: want {\"include_usage\": "
				 "true|false}");
	if (user && !json_is_null(user) && !json_is_string(user))
		return call_errf(e, 400, "user", "user: want a string");
	if (!c->session[0] && json_is_string(user) &&
	    call_set_session(c, json_string_value(user), "user", e))
		return -1;
	if (c->api == API_COMPLETION && c->req.max_tokens == (uint32_t)-1)
		c->req.max_tokens = 16;	/* the completions API's own default */
	if (c->api == API_CHAT) {
		if (parse_messages(c, body, e))
			return -1;
		call_stop_at_eot(c);
		return 0;
	}
	if (parse_prompt(c, body, e) || call_get_bool(body, "ignore_eos", &ignore_eos, e))
		return -1;
	/* a completion still ends at the end of text, unless ignore_eos (vLLM's field) */
	if (kd_tokenizer_eos(c->tok) >= 0 && !ignore_eos) {
		c->stop_ids[0] = kd_tokenizer_eos(c->tok);
		c->req.stop = c->stop_ids;
		c->req.n_stop = 1;
	}
	return 0;
}

static const char *finish_reason(const struct call *c, size_t n_calls)
{
	return n_calls ? "tool_calls" : c->fin == FIN_LENGTH ? "length" : "stop";
}

static json_t *usage(const struct call *c)
{
	return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", (int)c->req.n_prompt,
			 "completion_tokens", (int)c->n_gen, "total_tokens",
			 (int)(c->req.n_prompt + c->n_gen), "prompt_tokens_details",
			 "cached_tokens", (int)c->cached);
}

char *openai_response(struct call *c)
{
	json_t *text = json_stringn(c->text ? c->text : "", c->len), *choice, *o;
	struct tools_answer a = { 0 };
	char *s;

	if (c->tools_json && tools_answer(c, &a) == 0) {	/* prose and calls apart */
		json_decref(text);
		text = a.content_len || !a.n_calls ? json_stringn(a.content, a.content_len)
						   : json_null();
	}
	if (c->api == API_CHAT)
		choice = json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", 0, "message", "role",
				   "assistant", "content", text, "logprobs", c->logprobs ?
				   chat_logprobs(c, 0, c->n_lp) : json_null(), "finish_reason",
				   finish_reason(c, a.n_calls));
	else
		choice = json_pack("{s:o, s:i, s:o, s:s}", "text", text, "index", 0, "logprobs",
				   c->logprobs ? completion_logprobs(c, 0, c->n_lp, 0) : json_null(),
				   "finish_reason", finish_reason(c, 0));
	if (choice && a.n_calls)
		json_object_set_new(json_object_get(choice, "message"), "tool_calls",
				    tools_openai_calls(c, &a, 0, a.n_calls, 0));
	tools_answer_free(&a);
	o = json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", c->id, "object",
		      c->api == API_CHAT ? "chat.completion" : "text_completion", "created",
		      (json_int_t)c->created, "model", c->model, "choices", choice, "usage", usage(c));
	s = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	return s;
}

/* One chunk: delta text (NULL: none), the logprobs of tokens [lp_from, lp_to), the
 * finish reason (NULL: not yet). */
static int chunk(struct call *c, json_t *delta_text, json_t *calls, int role, size_t lp_from,
		 size_t lp_to, const char *fin)
{
	json_t *choice, *lp = json_null(), *o;

	if (c->logprobs && lp_to > lp_from)
		lp = c->api == API_CHAT ? chat_logprobs(c, lp_from, lp_to)
					: completion_logprobs(c, lp_from, lp_to, 0);
	if (c->api == API_CHAT) {
		json_t *delta = json_object();

		if (role)
			json_object_set_new(delta, "role", json_string("assistant"));
		if (delta_text)
			json_object_set_new(delta, "content", delta_text);
		if (calls)
			json_object_set_new(delta, "tool_calls", calls);
		choice = json_pack("{s:i, s:o, s:o, s:o}", "index", 0, "delta", delta, "logprobs",
				   lp, "finish_reason", fin ? json_string(fin) : json_null());
	} else {
		choice = json_pack("{s:o, s:i, s:o, s:o}", "text", delta_text ? delta_text :
				   json_string(""), "index", 0, "logprobs", lp, "finish_reason",
				   fin ? json_string(fin) : json_null());
	}
	o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", c->id, "object",
		      c->api == API_CHAT ? "chat.completion.chunk" : "text_completion", "created",
		      (json_int_t)c->created, "model", c->model, "choices", choice);
	if (o && c->include_usage)
		json_object_set_new(o, "usage", json_null());
	return call_out_sse(c, NULL, o);
}

static int stream_end(struct call *c, size_t n_calls)
{
	if (c->fin == FIN_ERROR) {
		struct call_err e;
		char *body;

		call_fin_error(c, &e);
		body = openai_error_body(&e);
		call_out(c, "data: ", 6);
		call_out(c, body ? body : "{}", body ? strlen(body) : 2);
		call_out(c, "\n\n", 2);
		free(body);
		return 0;
	}
	chunk(c, NULL, NULL, 0, 0, 0, finish_reason(c, n_calls));
	if (c->include_usage) {
		json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", c->id, "object",
				      c->api == API_CHAT ? "chat.completion.chunk" : "text_completion",
				      "created", (json_int_t)c->created, "model", c->model, "choices",
				      "usage", usage(c));

		call_out_sse(c, NULL, o);
	}
	return call_out(c, "data: [DONE]\n\n", 14);
}

/* A stream with tools held its text: the calls are known only at the end. Then the
 * prose as one content delta (with all the logprobs), each call as a tool_calls delta
 * with its index, and the finish reason. */
static void stream_tools_end(struct call *c)
{
	struct tools_answer a = { 0 };

	if (c->fin != FIN_ERROR && tools_answer(c, &a))
		a = (struct tools_answer){ .content = c->text ? c->text : "", .content_len = c->len };
	if (c->fin != FIN_ERROR && (a.content_len || (c->logprobs && c->n_lp)))
		chunk(c, json_stringn(a.content, a.content_len), NULL, 0, 0, c->n_lp, NULL);
	for (size_t i = 0; i < a.n_calls; i++)
		chunk(c, NULL, tools_openai_calls(c, &a, i, i + 1, 1), 0, 0, 0, NULL);
	c->sent = c->len;
	c->lp_sent = c->n_lp;
	stream_end(c, a.n_calls);
	tools_answer_free(&a);
}

int openai_stream(struct call *c, int wait_ms)
{
	size_t ready;

	if (c->phase == 2)
		return 0;
	if (c->phase == 0) {
		c->phase = 1;
		if (c->api == API_CHAT)
			chunk(c, json_string(""), NULL, 1, 0, 0, NULL);
		return 1;
	}
	if (c->fin == FIN_NONE && call_step(c, wait_ms) < 0)
		return -1;
	if (c->tools_json && c->api == API_CHAT) {
		if (c->fin != FIN_NONE) {
			stream_tools_end(c);
			c->phase = 2;
		}
		return 1;
	}
	ready = call_ready(c);
	if (ready > c->sent || (c->logprobs && c->n_lp > c->lp_sent)) {
		chunk(c, json_stringn(c->text + c->sent, ready - c->sent), NULL, 0, c->lp_sent,
		      c->n_lp, NULL);
		c->sent = ready;
		c->lp_sent = c->n_lp;
	}
	if (c->fin != FIN_NONE && c->sent == c->len) {
		stream_end(c, 0);
		c->phase = 2;
	}
	return 1;
}

char *openai_error_body(const struct call_err *e)
{
	const char *type = e->type ? e->type : e->status == 401 ? "invalid_request_error" :
			   e->status == 404 ? "invalid_request_error" :
			   e->status == 429 ? "rate_limit_exceeded" :
			   e->status >= 500 ? "server_error" : "invalid_request_error";
	json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", e->msg, "type", type,
			      "param", e->param[0] ? json_string(e->param) : json_null(), "code",
			      e->status == 401 ? json_string("invalid_api_key") : json_null());
	char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;

	json_decref(o);
	return s;
}
