/* Tool use in kdhttpd's requests: the OpenAI "tools" / "tool_choice" fields, role
 * "tool" messages and assistant "tool_calls"; the Anthropic "tools" / "tool_choice"
 * fields and tool_use / tool_result blocks, converted to the OpenAI form that
 * libkdclient's kd_tokenizer_chat_tools renders with the model's own template. A
 * template without tool support (kd_tokenizer_supports_tools 0) refuses all of it.
 * What the model answers is split back into calls in http_tools_answer.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_call.h"

#define TOOLS_MAX 128		/* tool definitions per request */
#define TOOL_NAME_MAX 64	/* bytes of a function name (OpenAI's limit) */

static int no_tool_support(struct call_err *e, const char *param, const char *what)
{
	return call_errf(e, 400, param, "%s: the model's chat template has no tool support in "
			 "kdec (tools render for Llama 3.1-3.3, Qwen2.5, Qwen3 and Kimi-K2 "
			 "templates); send the request without tools", what);
}

static int check_name(json_t *v, const char *field, size_t i, struct call_err *e)
{
	if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) > TOOL_NAME_MAX)
		return call_errf(e, 400, "tools", "tools[%zu].%s: want a string of 1..%d bytes", i,
				 field, TOOL_NAME_MAX);
	return 0;
}

/* OpenAI's tools: [{"type": "function", "function": {name, description?, parameters?}}] */
static int check_openai_tools(json_t *tools, struct call_err *e)
{
	json_t *t;
	size_t i;

	if (!json_is_array(tools))
		return call_errf(e, 400, "tools", "tools: want an array of {\"type\": \"function\", "
				 "\"function\": {...}}");
	if (json_array_size(tools) > TOOLS_MAX)
		return call_errf(e, 400, "tools", "tools: %zu, at most %d", json_array_size(tools),
				 TOOLS_MAX);
	json_array_foreach(tools, i, t) {
		const char *type = json_string_value(json_object_get(t, "type"));
		json_t *f = json_object_get(t, "function"), *d, *p;

		if (!json_is_object(t) || !type || strcmp(type, "function") || !json_is_object(f))
			return call_errf(e, 400, "tools", "tools[%zu]: want {\"type\": \"function\", "
					 "\"function\": {...}} (type '%s')", i, type ? type : "(none)");
		if (check_name(json_object_get(f, "name"), "function.name", i, e))
			return -1;
		d = json_object_get(f, "description");
		p = json_object_get(f, "parameters");
		if ((d && !json_is_null(d) && !json_is_string(d)) ||
		    (p && !json_is_null(p) && !json_is_object(p)))
			return call_errf(e, 400, "tools", "tools[%zu].function: want description a "
					 "string and parameters an object", i);
	}
	return 0;
}

static int keep_tools(struct call *c, json_t *tools, struct call_err *e)
{
	if (!json_array_size(tools))
		return 0;
	if (!kd_tokenizer_supports_tools(c->tok))
		return no_tool_support(e, "tools", "tools");
	if (!(c->tools_json = json_dumps(tools, JSON_COMPACT)))
		return call_errf(e, 500, NULL, "out of memory");
	return 0;
}

int tools_check_openai(struct call *c, json_t *body, struct call_err *e)
{
	json_t *tools = json_object_get(body, "tools"), *choice = json_object_get(body, "tool_choice");
	json_t *par = json_object_get(body, "parallel_tool_calls");
	const char *cs = json_string_value(choice);

	if (json_object_get(body, "functions") || json_object_get(body, "function_call"))
		return call_errf(e, 400, json_object_get(body, "functions") ? "functions" :
				 "function_call", "functions / function_call: the deprecated form "
				 "is not served; send tools and tool_choice");
	if (par && !json_is_null(par) && !json_is_boolean(par))
		return call_errf(e, 400, "parallel_tool_calls", "parallel_tool_calls: want a boolean");
	if (tools && !json_is_null(tools) && check_openai_tools(tools, e))
		return -1;
	if (choice && !json_is_null(choice)) {
		if (cs && !strcmp(cs, "none"))
			return 0;	/* no call wanted: the tools stay out of the prompt */
		if (!cs || strcmp(cs, "auto"))
			return call_errf(e, 400, "tool_choice", "tool_choice %s: kdecd has no "
					 "constrained decoding, so a call cannot be forced; use "
					 "\"auto\" or \"none\"", cs ? cs : json_is_object(choice) ?
					 "(a named function)" : "(not a string)");
	}
	return tools && !json_is_null(tools) ? keep_tools(c, tools, e) : 0;
}

/* Anthropic's tools [{name, description?, input_schema}] as OpenAI's function tools. */
static int convert_anthropic_tools(json_t *tools, json_t **out, struct call_err *e)
{
	json_t *t, *conv;
	size_t i;

	if (!json_is_array(tools))
		return call_errf(e, 400, "tools", "tools: want an array of {name, description, "
				 "input_schema}");
	if (json_array_size(tools) > TOOLS_MAX)
		return call_errf(e, 400, "tools", "tools: %zu, at most %d", json_array_size(tools),
				 TOOLS_MAX);
	conv = json_array();
	json_array_foreach(tools, i, t) {
		const char *type = json_string_value(json_object_get(t, "type"));
		json_t *d = json_object_get(t, "description"), *s = json_object_get(t, "input_schema");
		json_t *f;

		if (!json_is_object(t) || (json_object_get(t, "type") && (!type || strcmp(type, "custom"))) ||
		    (d && !json_is_string(d)) || !json_is_object(s)) {
			json_decref(conv);
			return call_errf(e, 400, "tools", "tools[%zu]: want {name, description (a "
					 "string), input_schema (an object)}; type '%s' (server tools "
					 "are not served)", i, type ? type : "(none)");
		}
		if (check_name(json_object_get(t, "name"), "name", i, e)) {
			json_decref(conv);
			return -1;
		}
		f = json_pack("{s:O}", "name", json_object_get(t, "name"));
		if (d)
			json_object_set(f, "description", d);
		json_object_set(f, "parameters", s);
		json_array_append_new(conv, json_pack("{s:s, s:o}", "type", "function", "function", f));
	}
	*out = conv;
	return 0;
}

int tools_check_anthropic(struct call *c, json_t *body, struct call_err *e)
{
	json_t *tools = json_object_get(body, "tools"), *choice = json_object_get(body, "tool_choice");
	json_t *conv = NULL;
	const char *ct = json_string_value(json_object_get(choice, "type"));
	int ret;

	if (choice && !json_is_null(choice)) {
		if (!json_is_object(choice) || !ct)
			return call_errf(e, 400, "tool_choice", "tool_choice: want {\"type\": \"auto\" "
					 "| \"none\" | \"any\" | \"tool\"}");
		if (strcmp(ct, "auto") && strcmp(ct, "none"))
			return call_errf(e, 400, "tool_choice", "tool_choice %s: kdecd has no "
					 "constrained decoding, so a tool call cannot be forced; use "
					 "auto or none", ct);
	}
	if (!tools || json_is_null(tools))
		return 0;
	if (convert_anthropic_tools(tools, &conv, e))
		return -1;
	ret = ct && !strcmp(ct, "none") ? 0 : keep_tools(c, conv, e);
	json_decref(conv);
	return ret;
}

int tools_openai_message(struct call *c, json_t *msg, size_t i, struct kd_chat_message *m,
			 char **own, struct call_err *e)
{
	json_t *calls = json_object_get(msg, "tool_calls"), *id = json_object_get(msg, "tool_call_id");
	json_t *name = json_object_get(msg, "name"), *tc;
	size_t j;

	if (!strcmp(m->role, "tool")) {
		if (!kd_tokenizer_supports_tools(c->tok))
			return no_tool_support(e, "messages", "a message of role \"tool\"");
		if (!json_is_string(id) || (name && !json_is_null(name) && !json_is_string(name)))
			return call_errf(e, 400, "messages", "messages[%zu]: role \"tool\" wants a "
					 "string tool_call_id (and name a string)", i);
		m->tool_call_id = json_string_value(id);
		m->name = json_string_value(name);
		return 0;
	}
	if (!calls || json_is_null(calls))
		return 0;
	if (strcmp(m->role, "assistant"))
		return call_errf(e, 400, "messages", "messages[%zu]: tool_calls in a %s message "
				 "(assistant only)", i, m->role);
	if (!kd_tokenizer_supports_tools(c->tok))
		return no_tool_support(e, "messages", "an assistant message's tool_calls");
	if (!json_is_array(calls) || json_array_size(calls) > TOOLS_MAX)
		return call_errf(e, 400, "messages", "messages[%zu].tool_calls: want an array of "
				 "at most %d calls", i, TOOLS_MAX);
	json_array_foreach(calls, j, tc) {
		json_t *f = json_object_get(tc, "function"), *a = json_object_get(f, "arguments");
		json_t *cid = json_object_get(tc, "id");

		if (!json_is_object(f) || !json_is_string(json_object_get(f, "name")) ||
		    !(json_is_string(a) || json_is_object(a)) ||
		    (cid && !json_is_null(cid) && !json_is_string(cid)))
			return call_errf(e, 400, "messages", "messages[%zu].tool_calls[%zu]: want {id, "
					 "type: \"function\", function: {name (a string), arguments "
					 "(a JSON string or object)}}", i, j);
	}
	if (!(*own = json_dumps(calls, JSON_COMPACT)))
		return call_errf(e, 500, NULL, "out of memory");
	m->tool_calls_json = *own;
	return 0;
}

int tools_anthropic_has_blocks(json_t *content)
{
	json_t *b;
	size_t j;

	json_array_foreach(content, j, b) {
		const char *type = json_string_value(json_object_get(b, "type"));

		if (type && (!strcmp(type, "tool_use") || !strcmp(type, "tool_result")))
			return 1;
	}
	return 0;
}

/* Appends a string's bytes to a malloc'd text. */
static int append(char **s, size_t *len, json_t *v)
{
	char *s2 = realloc(*s, *len + json_string_length(v) + 1);

	if (!s2)
		return -1;
	memcpy(s2 + *len, json_string_value(v), json_string_length(v));
	*len += json_string_length(v);
	s2[*len] = 0;
	*s = s2;
	return 0;
}

/* A tool_result's content: a string or text blocks, as one text in own[*ko]. */
static int result_text(json_t *v, const char *where, size_t j, char **out, struct call_err *e)
{
	size_t k, len = 0;
	json_t *b;

	*out = NULL;
	if (!v || json_is_null(v) || json_is_string(v)) {
		*out = strdup(v ? json_string_value(v) ?: "" : "");
		return *out ? 0 : call_errf(e, 500, NULL, "out of memory");
	}
	if (!json_is_array(v))
		return call_errf(e, 400, "messages", "%s[%zu].content: want a string or text blocks",
				 where, j);
	json_array_foreach(v, k, b) {
		const char *type = json_string_value(json_object_get(b, "type"));
		json_t *t = json_object_get(b, "text");

		if (!type || strcmp(type, "text") || !json_is_string(t))
			return call_errf(e, 400, "messages", "%s[%zu].content[%zu]: want text blocks "
					 "(kdec serves text only)", where, j, k);
		if (append(out, &len, t))
			return call_errf(e, 500, NULL, "out of memory");
	}
	if (!*out && !(*out = strdup("")))
		return call_errf(e, 500, NULL, "out of memory");
	return 0;
}

static int one_block(json_t *b, const char *role, const char *where, size_t j, json_t *calls,
		     struct kd_chat_message *m, size_t *k, char **own, size_t *ko, char **text,
		     size_t *len, struct call_err *e)
{
	const char *type = json_string_value(json_object_get(b, "type"));
	json_t *id, *name, *in;

	if (type && !strcmp(type, "text") && json_is_string(json_object_get(b, "text")))
		return append(text, len, json_object_get(b, "text")) ?
		       call_errf(e, 500, NULL, "out of memory") : 0;
	if (type && !strcmp(type, "tool_use") && !strcmp(role, "assistant")) {
		id = json_object_get(b, "id");
		name = json_object_get(b, "name");
		in = json_object_get(b, "input");
		if (!json_is_string(id) || !json_is_string(name) || !json_is_object(in))
			return call_errf(e, 400, "messages", "%s[%zu]: tool_use wants id and name "
					 "strings and input an object", where, j);
		json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", id, "type",
				      "function", "function", "name", name, "arguments", in));
		return 0;
	}
	if (type && !strcmp(type, "tool_result") && !strcmp(role, "user")) {
		id = json_object_get(b, "tool_use_id");
		if (!json_is_string(id))
			return call_errf(e, 400, "messages", "%s[%zu]: tool_result wants a string "
					 "tool_use_id", where, j);
		if (result_text(json_object_get(b, "content"), where, j, &own[*ko], e))
			return -1;
		m[*k] = (struct kd_chat_message){ .role = "tool", .content = own[(*ko)++],
						  .tool_call_id = json_string_value(id) };
		(*k)++;
		return 0;
	}
	return call_errf(e, 400, "messages", "%s[%zu]: type '%s' in a %s message: want text, "
			 "tool_use (assistant) or tool_result (user)", where, j,
			 type ? type : "(none)", role);
}

int tools_anthropic_message(struct call *c, json_t *content, const char *role, size_t i,
			    struct kd_chat_message *m, size_t *k, char **own, size_t *ko,
			    struct call_err *e)
{
	json_t *calls, *b;
	char where[48], *text = NULL;
	size_t j, len = 0;
	int ret = 0;

	if (!kd_tokenizer_supports_tools(c->tok))
		return no_tool_support(e, "messages", "tool_use / tool_result blocks");
	snprintf(where, sizeof(where), "messages[%zu].content", i);
	calls = json_array();
	json_array_foreach(content, j, b)
		if ((ret = one_block(b, role, where, j, calls, m, k, own, ko, &text, &len, e)))
			break;
	if (!ret && (text || json_array_size(calls))) {
		own[*ko] = text ? text : strdup("");
		text = NULL;
		m[*k] = (struct kd_chat_message){ .role = role, .content = own[(*ko)++] };
		if (json_array_size(calls)) {
			if (!(own[*ko] = json_dumps(calls, JSON_COMPACT)))
				ret = call_errf(e, 500, NULL, "out of memory");
			else
				m[*k].tool_calls_json = own[(*ko)++];
		}
		(*k)++;
	}
	free(text);
	json_decref(calls);
	return ret;
}

int tools_render(struct call *c, const struct kd_chat_message *m, size_t n, struct call_err *e)
{
	long len = kd_tokenizer_chat_tools(c->tok, m, n, c->tools_json, 1, NULL, 0);
	char *text;
	int ret;

	if (len < 0)
		return call_errf(e, 400, "messages", "the model's chat template: %s",
				 kd_tokenizer_error());
	if (!(text = malloc((size_t)len + 1)))
		return call_errf(e, 500, NULL, "out of memory");
	kd_tokenizer_chat_tools(c->tok, m, n, c->tools_json, 1, text, (size_t)len + 1);
	ret = call_set_prompt(c, text, (size_t)len, 1, e);
	free(text);
	return ret;
}
