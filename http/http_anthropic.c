/* The Anthropic Messages API front end: a /v1/messages body (system, messages of text
 * blocks, tool blocks through http_tools.c, stop_sequences, max_tokens) into a call, and
 * its answers: the message object with text and tool_use blocks, the message_start ...
 * message_stop events, the {"type": "error"} body. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_call.h"

#define MAX_MESSAGES 4096

/* system (optional) then messages of user / assistant turns. */
static int parse_messages(struct call *c, json_t *body, struct call_err *e)
{
	json_t *msgs = json_object_get(body, "messages"), *sys = json_object_get(body, "system"), *m;
	struct kd_chat_message *cm;
	char **texts, where[48];
	size_t i, n, k = 0, ko = 0, cap = 1;
	int ret = 0;

	if (!json_is_array(msgs) || !json_array_size(msgs))
		return call_errf(e, 400, "messages", "messages: want a non-empty array");
	if ((n = json_array_size(msgs)) > MAX_MESSAGES)
		return call_errf(e, 400, "messages", "messages: %zu, at most %d", n, MAX_MESSAGES);
	/* a message with tool blocks becomes up to 1 + blocks turns, of 2 + blocks texts */
	json_array_foreach(msgs, i, m)
		cap += 2 + json_array_size(json_object_get(m, "content"));
	cm = calloc(cap, sizeof(*cm));
	texts = calloc(cap, sizeof(*texts));
	if (!cm || !texts) {
		free(cm);
		free(texts);
		return call_errf(e, 500, NULL, "out of memory");
	}
	if (sys && !json_is_null(sys)) {
		ret = call_text_parts(sys, "system", "system", 0, &texts[ko], e);
		cm[k].role = "system";
		cm[k].content = texts[ko++];
		k++;
	}
	json_array_foreach(msgs, i, m) {
		const char *role = json_string_value(json_object_get(m, "role"));

		if (ret)
			break;
		if (!role || (strcmp(role, "user") && strcmp(role, "assistant"))) {
			ret = call_errf(e, 400, "messages", "messages[%zu].role '%s': want user or "
					"assistant (system goes in the top-level \"system\")", i,
					role ? role : "(none)");
			break;
		}
		if (tools_anthropic_has_blocks(json_object_get(m, "content"))) {
			if ((ret = tools_anthropic_message(c, json_object_get(m, "content"), role, i,
							   cm, &k, texts, &ko, e)))
				break;
			continue;
		}
		snprintf(where, sizeof(where), "messages[%zu].content", i);
		if ((ret = call_text_parts(json_object_get(m, "content"), where, where, 0, &texts[ko],
					   e)))
			break;
		cm[k].role = role;
		cm[k].content = texts[ko++];
		k++;
	}
	if (!ret)
		ret = tools_render(c, cm, k, e);
	for (i = 0; i < cap; i++)
		free(texts[i]);
	free(texts);
	free(cm);
	return ret;
}

static int parse_stops(struct call *c, json_t *body, struct call_err *e)
{
	json_t *s = json_object_get(body, "stop_sequences"), *v;
	size_t i;

	if (!s || json_is_null(s))
		return 0;
	if (!json_is_array(s))
		return call_errf(e, 400, "stop_sequences", "stop_sequences: want an array of strings");
	json_array_foreach(s, i, v) {
		if (!json_is_string(v))
			return call_errf(e, 400, "stop_sequences", "stop_sequences[%zu]: want a string",
					 i);
		if (call_add_stop(c, json_string_value(v), json_string_length(v), "stop_sequences",
				  e))
			return -1;
	}
	return 0;
}

int anthropic_parse(struct call *c, json_t *body, struct call_err *e)
{
	static const char *const max_names[] = { "max_tokens", NULL };
	json_t *md = json_object_get(body, "metadata"), *user = json_object_get(md, "user_id");

	if (tools_check_anthropic(c, body, e) || call_get_bool(body, "stream", &c->stream, e) ||
	    call_parse_sampling(c, body, e) || call_parse_max_tokens(c, body, max_names, 1, e) ||
	    parse_stops(c, body, e))
		return -1;
	if (md && !json_is_null(md) && !json_is_object(md))
		return call_errf(e, 400, "metadata", "metadata: want an object");
	if (user && !json_is_null(user) && !json_is_string(user))
		return call_errf(e, 400, "metadata.user_id", "metadata.user_id: want a string");
	if (!c->session[0] && json_is_string(user) &&
	    call_set_session(c, json_string_value(user), "metadata.user_id", e))
		return -1;
	if (parse_messages(c, body, e))
		return -1;
	call_stop_at_eot(c);
	return 0;
}

static const char *stop_reason(const struct call *c, size_t n_calls)
{
	return n_calls ? "tool_use" : c->fin == FIN_LENGTH ? "max_tokens" : c->fin == FIN_STOP ? "stop_sequence" : "end_turn";
}

static json_t *stop_sequence(const struct call *c)
{
	return c->fin == FIN_STOP ? json_string(c->stops[c->stop_index]) : json_null();
}

/* The content blocks: the text (left out when empty and there are calls), then one
 * tool_use block per call. */
static json_t *content_blocks(struct call *c, const struct tools_answer *a)
{
	json_t *blocks = json_array();

	if (a->content_len || !a->n_calls)
		json_array_append_new(blocks, json_pack("{s:s, s:s%}", "type", "text", "text",
							a->content, a->content_len));
	for (size_t i = 0; i < a->n_calls; i++)
		json_array_append_new(blocks, tools_anthropic_block(c, a, i, NULL));
	return blocks;
}

/* The answer split by the tools' parser, or all text (no tools, or the parse failed). */
static void answer(struct call *c, struct tools_answer *a)
{
	if (!c->tools_json || c->fin == FIN_ERROR || tools_answer(c, a))
		*a = (struct tools_answer){ .content = c->text ? c->text : "", .content_len = c->len };
}

char *anthropic_response(struct call *c)
{
	struct tools_answer a;
	json_t *o;
	char *s;

	answer(c, &a);
	o = json_pack("{s:s, s:s, s:s, s:s, s:o, s:s, s:o, s:{s:i, s:i}}", "id", c->id, "type",
		      "message", "role", "assistant", "model", c->model, "content",
		      content_blocks(c, &a), "stop_reason", stop_reason(c, a.n_calls),
		      "stop_sequence", a.n_calls ? json_null() : stop_sequence(c), "usage",
		      "input_tokens", (int)c->req.n_prompt, "output_tokens", (int)c->n_gen);
	s = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	tools_answer_free(&a);
	return s;
}

static void stream_start(struct call *c)
{
	call_out_sse(c, "message_start", json_pack(
		"{s:s, s:{s:s, s:s, s:s, s:s, s:[], s:n, s:n, s:{s:i, s:i}}}", "type",
		"message_start", "message", "id", c->id, "type", "message", "role", "assistant",
		"model", c->model, "content", "stop_reason", "stop_sequence", "usage",
		"input_tokens", (int)c->req.n_prompt, "output_tokens", 0));
	if (!c->tools_json)	/* with tools the blocks are known at the end */
		call_out_sse(c, "content_block_start", json_pack("{s:s, s:i, s:{s:s, s:s}}",
			"type", "content_block_start", "index", 0, "content_block", "type", "text",
			"text", ""));
	call_out_sse(c, "ping", json_pack("{s:s}", "type", "ping"));
}

/* A stream with tools held its text: the text block (when there is text) and each
 * tool_use block, its input as one input_json_delta, each started, filled, stopped. */
static void stream_tool_blocks(struct call *c, struct tools_answer *a)
{
	int index = 0;

	if (a->content_len || !a->n_calls) {
		call_out_sse(c, "content_block_start", json_pack("{s:s, s:i, s:{s:s, s:s}}",
			"type", "content_block_start", "index", index, "content_block", "type",
			"text", "text", ""));
		if (a->content_len)
			call_out_sse(c, "content_block_delta", json_pack("{s:s, s:i, s:{s:s, s:s%}}",
				"type", "content_block_delta", "index", index, "delta", "type",
				"text_delta", "text", a->content, a->content_len));
		call_out_sse(c, "content_block_stop", json_pack("{s:s, s:i}", "type",
			"content_block_stop", "index", index++));
	}
	for (size_t i = 0; i < a->n_calls; i++, index++) {
		const char *input = "{}";
		json_t *b = tools_anthropic_block(c, a, i, &input);

		json_object_set_new(b, "input", json_object());	/* filled by the delta */
		call_out_sse(c, "content_block_start", json_pack("{s:s, s:i, s:o}", "type",
			"content_block_start", "index", index, "content_block", b));
		call_out_sse(c, "content_block_delta", json_pack("{s:s, s:i, s:{s:s, s:s}}", "type",
			"content_block_delta", "index", index, "delta", "type", "input_json_delta",
			"partial_json", input));
		call_out_sse(c, "content_block_stop", json_pack("{s:s, s:i}", "type",
			"content_block_stop", "index", index));
	}
}

static void stream_end(struct call *c)
{
	if (c->fin == FIN_ERROR) {
		struct call_err e;
		char *body;

		call_fin_error(c, &e);
		body = anthropic_error_body(&e);
		call_out(c, "event: error\ndata: ", 19);
		call_out(c, body ? body : "{}", body ? strlen(body) : 2);
		call_out(c, "\n\n", 2);
		free(body);
		return;
	}
	struct tools_answer a = { 0 };

	if (c->tools_json) {
		answer(c, &a);
		stream_tool_blocks(c, &a);
	} else {
		call_out_sse(c, "content_block_stop", json_pack("{s:s, s:i}", "type",
			"content_block_stop", "index", 0));
	}
	call_out_sse(c, "message_delta", json_pack("{s:s, s:{s:s, s:o}, s:{s:i}}", "type",
		"message_delta", "delta", "stop_reason", stop_reason(c, a.n_calls), "stop_sequence",
		a.n_calls ? json_null() : stop_sequence(c), "usage", "output_tokens", (int)c->n_gen));
	call_out_sse(c, "message_stop", json_pack("{s:s}", "type", "message_stop"));
	tools_answer_free(&a);
}

int anthropic_stream(struct call *c, int wait_ms)
{
	size_t ready;

	if (c->phase == 2)
		return 0;
	if (c->phase == 0) {
		c->phase = 1;
		stream_start(c);
		return 1;
	}
	if (c->fin == FIN_NONE && call_step(c, wait_ms) < 0)
		return -1;
	ready = c->tools_json ? 0 : call_ready(c);	/* with tools: held to the end */
	if (ready > c->sent) {
		call_out_sse(c, "content_block_delta", json_pack("{s:s, s:i, s:{s:s, s:s%}}", "type",
			"content_block_delta", "index", 0, "delta", "type", "text_delta", "text",
			c->text + c->sent, ready - c->sent));
		c->sent = ready;
	}
	if (c->fin != FIN_NONE && (c->sent == c->len || c->tools_json)) {
		stream_end(c);
		c->phase = 2;
	}
	return 1;
}

char *anthropic_error_body(const struct call_err *e)
{
	const char *type = e->type ? e->type : e->status == 401 ? "authentication_error" :
			   e->status == 403 ? "permission_error" :
			   e->status == 404 ? "not_found_error" :
			   e->status == 413 ? "request_too_large" :
			   e->status == 429 ? "rate_limit_error" :
			   e->status == 503 ? "overloaded_error" :
			   e->status >= 500 ? "api_error" : "invalid_request_error";
	json_t *o = json_pack("{s:s, s:{s:s, s:s}}", "type", "error", "error", "type", type,
			      "message", e->msg);
	char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;

	json_decref(o);
	return s;
}
