/* Tool calls in kdhttpd's answers: the whole generated text split by libkdclient's
 * kd_tokenizer_parse_tool_calls into prose and calls in the model's family's format,
 * and the calls in each API's shape (OpenAI tool_calls, Anthropic tool_use blocks),
 * with ids unique per response. http_openai.c / http_anthropic.c place them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_call.h"

int tools_answer(const struct call *c, struct tools_answer *a)
{
	char *json = NULL;
	json_t *content;

	memset(a, 0, sizeof(*a));
	if (kd_tokenizer_parse_tool_calls(c->tok, c->text ? c->text : "", c->len, &json))
		return -1;
	a->parsed = json_loads(json, 0, NULL);
	kd_tool_calls_free(json);
	content = json_object_get(a->parsed, "content");
	if (!json_is_string(content) || !json_is_array(json_object_get(a->parsed, "tool_calls"))) {
		json_decref(a->parsed);
		a->parsed = NULL;
		return -1;
	}
	a->content = json_string_value(content);
	a->content_len = json_string_length(content);
	a->n_calls = json_array_size(json_object_get(a->parsed, "tool_calls"));
	return 0;
}

void tools_answer_free(struct tools_answer *a)
{
	json_decref(a->parsed);
	memset(a, 0, sizeof(*a));
}

static json_t *call_at(const struct tools_answer *a, size_t i)
{
	return json_array_get(json_object_get(a->parsed, "tool_calls"), i);
}

/* The parser numbers calls "call_N" where the format has no ids: unique only within
 * one answer, so they get the response's id; ids the model wrote (Kimi-K2's
 * "functions.NAME:N") are what its template renders back, so they stay. */
void tools_call_id(const struct call *c, const struct tools_answer *a, size_t i,
		   const char *prefix, char *buf, size_t len)
{
	const char *id = json_string_value(json_object_get(call_at(a, i), "id")) ?: "";
	const char *tail = strpbrk(c->id, "-_");

	if (!strncmp(id, "call_", 5) && id[5] && strspn(id + 5, "0123456789") == strlen(id + 5))
		snprintf(buf, len, "%s%s_%s", prefix, tail ? tail + 1 : c->id, id + 5);
	else
		snprintf(buf, len, "%s", id);
}

json_t *tools_openai_calls(const struct call *c, const struct tools_answer *a, size_t from,
			   size_t to, int with_index)
{
	json_t *arr = json_array();
	char id[128];

	for (size_t i = from; i < to && i < a->n_calls; i++) {
		json_t *k = call_at(a, i);
		json_t *o;

		tools_call_id(c, a, i, "call_", id, sizeof(id));
		o = json_pack("{s:s, s:s, s:{s:O, s:O}}", "id", id, "type", "function", "function",
			      "name", json_object_get(k, "name"), "arguments",
			      json_object_get(k, "arguments"));
		if (o && with_index)
			json_object_set_new(o, "index", json_integer((json_int_t)i));
		json_array_append_new(arr, o);
	}
	return arr;
}

json_t *tools_anthropic_block(const struct call *c, const struct tools_answer *a, size_t i,
			      const char **input_json)
{
	json_t *k = call_at(a, i);
	const char *args = json_string_value(json_object_get(k, "arguments")) ?: "{}";
	json_t *input = json_loads(args, 0, NULL);
	char id[128];

	if (!json_is_object(input)) {	/* the parser writes objects; never trust blindly */
		json_decref(input);
		input = json_object();
		args = "{}";
	}
	if (input_json)
		*input_json = args;
	tools_call_id(c, a, i, "toolu_", id, sizeof(id));
	return json_pack("{s:s, s:s, s:O, s:o}", "type", "tool_use", "id", id, "name",
			 json_object_get(k, "name"), "input", input);
}
