/* Tool calling in libkdclient: which families support it, the checked JSON input of
 * kd_tokenizer_chat_tools (tool definitions, assistant tool calls), and the parsers
 * that turn a generated text back into prose plus structured calls, one per format. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"

#define TOOLS_MAX_JSON (16u << 20)	/* bytes of tools or tool_calls JSON accepted */

int kd_tokenizer_supports_tools(const struct kd_tokenizer *t)
{
	if (!t)
		return 0;
	return (t->chat == TOK_CHAT_LLAMA31 && t->chat_tools) || t->chat == TOK_CHAT_QWEN25 ||
	       t->chat == TOK_CHAT_QWEN3 || t->chat == TOK_CHAT_KIMI_K2;
}

/* The families rendered in tokenizer_chat_tools.c, which read tool calls and results. */
static int tools_family(const struct kd_tokenizer *t)
{
	return kd_tokenizer_supports_tools(t) || t->chat == TOK_CHAT_LLAMA31 ||
	       t->chat == TOK_CHAT_DEEPSEEK3;
}

static const char *family_name(const struct kd_tokenizer *t)
{
	switch (t->chat) {
	case TOK_CHAT_CHATML: return "ChatML";
	case TOK_CHAT_LLAMA3: return "Llama 3.0";
	case TOK_CHAT_LLAMA31: return t->chat_tools ? "Llama 3.1" : "Llama 3.1 fine-tune";
	case TOK_CHAT_DEEPSEEK2: return "DeepSeek LLM / V2";
	case TOK_CHAT_QWEN25: return "Qwen2.5";
	case TOK_CHAT_QWEN3: return "Qwen3";
	case TOK_CHAT_KIMI_K2: return "Kimi-K2";
	case TOK_CHAT_DEEPSEEK3: return "DeepSeek-V3.1";
	default: return "unknown";
	}
}

static json_t *load_json(const char *what, const char *text)
{
	json_error_t err;
	size_t n = strnlen(text, TOOLS_MAX_JSON + 1);
	json_t *v;

	if (n > TOOLS_MAX_JSON) {
		tok_set_error("%s: over %u bytes of JSON", what, TOOLS_MAX_JSON);
		return NULL;
	}
	v = json_loadb(text, n, JSON_REJECT_DUPLICATES, &err);
	if (!v)
		tok_set_error("%s: malformed JSON at byte %d: %s", what, err.position, err.text);
	return v;
}

/* tools: an array of {"type": "function", "function": {"name": string, ...}}. */
static int check_tools(json_t *tools)
{
	size_t i;
	json_t *tool;

	if (!json_is_array(tools)) {
		tok_set_error("tools: not a JSON array");
		return -EINVAL;
	}
	json_array_foreach(tools, i, tool) {
		json_t *fn = json_object_get(tool, "function");

		if (!json_is_object(tool) || !json_is_object(fn) ||
		    !json_is_string(json_object_get(fn, "name"))) {
			tok_set_error("tools[%zu]: not {\"type\": \"function\", \"function\": "
				      "{\"name\": ...}}", i);
			return -EINVAL;
		}
	}
	return 0;
}

/* One OpenAI tool call as {"name", "arguments": object}: arguments given as a string
 * (the API's form) are parsed, as the templates expect a mapping. */
static json_t *norm_call(size_t m, size_t i, const json_t *call)
{
	json_t *fn = json_object_get(call, "function"), *name, *args, *parsed = NULL;
	char what[64];

	snprintf(what, sizeof(what), "message %zu: tool_calls[%zu]", m, i);
	name = json_object_get(fn, "name");
	args = json_object_get(fn, "arguments");
	if (!json_is_string(name)) {
		tok_set_error("%s: no function name", what);
		return NULL;
	}
	if (json_is_string(args)) {
		parsed = load_json(what, json_string_value(args));
		if (!parsed)
			return NULL;
		args = parsed;
	}
	if (!json_is_object(args)) {
		tok_set_error("%s: arguments not a JSON object", what);
		json_decref(parsed);
		return NULL;
	}
	call = json_pack("{sOsO}", "name", name, "arguments", args);
	json_decref(parsed);
	return (json_t *)call;
}

static int load_calls(size_t m, const char *text, json_t **out)
{
	char what[48];
	json_t *calls, *norm, *call;
	size_t i;

	snprintf(what, sizeof(what), "message %zu: tool_calls", m);
	calls = load_json(what, text);
	if (!calls)
		return -EINVAL;
	norm = json_array();
	if (!json_is_array(calls) || !norm) {
		tok_set_error("%s: not a JSON array", what);
		goto err;
	}
	json_array_foreach(calls, i, call) {
		if (json_array_append_new(norm, norm_call(m, i, call)))
			goto err;
	}
	json_decref(calls);
	*out = norm;
	return 0;
err:
	json_decref(calls);
	json_decref(norm);
	return -EINVAL;
}

static void free_calls(json_t **calls, size_t n)
{
	for (size_t i = 0; calls && i < n; i++)
		json_decref(calls[i]);
	free(calls);
}

static int check_messages(const struct kd_chat_message *msgs, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (!msgs[i].role) {
			tok_set_error("message %zu: no role", i);
			return -EINVAL;
		}
		/* content may be null only beside calls, where the templates allow it */
		if (!msgs[i].content && !msgs[i].tool_calls_json) {
			tok_set_error("message %zu (%s): no content", i, msgs[i].role);
			return -EINVAL;
		}
	}
	return 0;
}

static int render(const struct kd_tokenizer *t, struct tok_chat_in *in, struct tok_out *o)
{
	int rc;

	for (size_t i = 0; i < in->n; i++)
		if (in->m[i].tool_calls_json && (rc = load_calls(i, in->m[i].tool_calls_json,
								 &in->calls[i])))
			return rc;
	for (size_t i = 0; i < in->n && !tools_family(t); i++)
		if (!in->m[i].content) {
			tok_set_error("message %zu (%s): no content", i, in->m[i].role);
			return -EINVAL;
		}
	if (in->tools && !kd_tokenizer_supports_tools(t)) {
		tok_set_error("%s: the %s chat template renders no tool definitions", t->path,
			      family_name(t));
		return -ENOTSUP;
	}
	return tok_render_tools(t, in, o);
}

long kd_tokenizer_chat_tools(const struct kd_tokenizer *t, const struct kd_chat_message *msgs,
			     size_t n, const char *tools_json, int add_generation_prompt,
			     char *buf, size_t len)
{
	struct tok_out o = { buf, len, 0 };
	struct tok_chat_in in = { .m = msgs, .n = n, .gen = add_generation_prompt };
	json_t *tools = NULL;
	int rc;

	if (!t || (!msgs && n) || (!buf && len) || n > (SIZE_MAX >> 4)) {
		tok_set_error("kd_tokenizer_chat: NULL tokenizer, messages or buffer");
		return -EINVAL;
	}
	if ((rc = check_messages(msgs, n)))
		return rc;
	if (tools_json) {
		tools = load_json("tools", tools_json);
		if (!tools)
			return -EINVAL;
		if ((rc = check_tools(tools))) {
			json_decref(tools);
			return rc;
		}
		if (json_array_size(tools))
			in.tools = tools;	/* "[]" renders as no tools */
	}
	in.calls = calloc(n ? n : 1, sizeof(*in.calls));
	if (!in.calls) {
		json_decref(tools);
		return -ENOMEM;
	}
	rc = render(t, &in, &o);
	free_calls(in.calls, n);
	json_decref(tools);
	if (rc)
		return rc;
	if (o.k < len)
		buf[o.k] = '\0';
	return (long)o.k;
}
