/* kdhttpd's answers with tool calls, through its real front ends (http_openai.c,
 * http_anthropic.c, http_tools_answer.c) and libkdclient's Qwen3 parser: a finished
 * call whose text holds prose and two <tool_call> blocks gives OpenAI's message
 * (content, tool_calls with ids unique per response, finish_reason "tool_calls") and
 * Anthropic's blocks (text, tool_use with the parsed input, stop_reason "tool_use"),
 * streamed and not; a text without calls keeps its plain shape. The tokenizer is
 * tests/data/tokenizer/bytes512_qwen3 (bytes512's vocabulary, a Qwen3 template). No
 * daemon: the finished call is what http_gen.c leaves after a run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_call.h"

static int fails;

#define CHECK(cond, ...) do { \
	if (!(cond)) { fails++; printf("FAIL %s:%d: ", __FILE__, __LINE__); \
		printf(__VA_ARGS__); printf("\n"); } } while (0)

static const char *TEXT = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
	"{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
	"\"arguments\": {\"tz\": \"CET\", \"n\": 2}}\n</tool_call>";

static void setup(struct call *c, const struct kd_tokenizer *tok, enum call_api api,
		  const char *text, int stream)
{
	memset(c, 0, sizeof(*c));
	c->api = api;
	c->tok = tok;
	c->model = "m";
	snprintf(c->id, sizeof(c->id), api == API_MESSAGES ? "msg_abc" : "chatcmpl-abc");
	c->stream = stream;
	c->tools_json = strdup("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}]");
	c->text = strdup(text);
	c->len = c->cap = strlen(text);
	c->fin = FIN_TOKEN;
	c->n_gen = 7;
}

static json_t *load(char *s)
{
	json_t *v = s ? json_loads(s, 0, NULL) : NULL;

	free(s);
	return v;
}

static const char *str(json_t *o, const char *path)
{
	char buf[128], *save, *k;

	snprintf(buf, sizeof(buf), "%s", path);
	for (k = strtok_r(buf, ".", &save); k && o; k = strtok_r(NULL, ".", &save))
		o = json_is_array(o) ? json_array_get(o, (size_t)atoi(k)) : json_object_get(o, k);
	return json_is_string(o) ? json_string_value(o) : json_is_null(o) ? "(null)" : "(absent)";
}

static void openai_whole(const struct kd_tokenizer *tok)
{
	struct call c;
	json_t *o, *calls;

	setup(&c, tok, API_CHAT, TEXT, 0);
	o = load(openai_response(&c));
	calls = json_object_get(json_object_get(json_array_get(json_object_get(o, "choices"), 0),
						"message"), "tool_calls");
	CHECK(!strcmp(str(o, "choices.0.message.content"), "Let me look."), "content '%s'",
	      str(o, "choices.0.message.content"));
	CHECK(!strcmp(str(o, "choices.0.finish_reason"), "tool_calls"), "finish_reason %s",
	      str(o, "choices.0.finish_reason"));
	CHECK(json_array_size(calls) == 2, "%zu tool_calls", json_array_size(calls));
	CHECK(!strcmp(str(calls, "0.id"), "call_abc_0") && !strcmp(str(calls, "1.id"), "call_abc_1"),
	      "ids %s %s", str(calls, "0.id"), str(calls, "1.id"));
	CHECK(!strcmp(str(calls, "0.type"), "function"), "type %s", str(calls, "0.type"));
	CHECK(!strcmp(str(calls, "0.function.name"), "get_weather") &&
	      !strcmp(str(calls, "1.function.name"), "get_time"), "names");
	CHECK(!strcmp(str(calls, "0.function.arguments"), "{\"city\":\"Paris\"}") &&
	      !strcmp(str(calls, "1.function.arguments"), "{\"tz\":\"CET\",\"n\":2}"),
	      "arguments %s %s", str(calls, "0.function.arguments"), str(calls, "1.function.arguments"));
	CHECK(!json_object_get(json_array_get(calls, 0), "index"), "index in a whole response");
	json_decref(o);
	call_free(&c);

	/* only calls: content null; no calls: the text and "stop" */
	setup(&c, tok, API_CHAT, strstr(TEXT, "<tool_call>"), 0);
	o = load(openai_response(&c));
	CHECK(!strcmp(str(o, "choices.0.message.content"), "(null)"), "content %s",
	      str(o, "choices.0.message.content"));
	json_decref(o);
	call_free(&c);
	setup(&c, tok, API_CHAT, "just prose", 0);
	o = load(openai_response(&c));
	CHECK(!strcmp(str(o, "choices.0.message.content"), "just prose") &&
	      !strcmp(str(o, "choices.0.finish_reason"), "stop") &&
	      !json_object_get(json_object_get(json_array_get(json_object_get(o, "choices"), 0),
					       "message"), "tool_calls"), "no calls: %s",
	      str(o, "choices.0.finish_reason"));
	json_decref(o);
	call_free(&c);
}

/* The "data:" payloads of c->out, in order (an array of JSON values; [DONE] a string). */
static json_t *events(const struct call *c, json_t *names)
{
	json_t *arr = json_array();
	char *buf = strndup(c->out, c->out_len), *save, *ev;

	for (ev = strtok_r(buf, "\n", &save); ev; ev = strtok_r(NULL, "\n", &save)) {
		if (!strncmp(ev, "event: ", 7) && names)
			json_array_append_new(names, json_string(ev + 7));
		if (strncmp(ev, "data: ", 6))
			continue;
		json_array_append_new(arr, !strcmp(ev + 6, "[DONE]") ? json_string("[DONE]") :
				      json_loads(ev + 6, 0, NULL));
	}
	free(buf);
	return arr;
}

static void openai_streamed(const struct kd_tokenizer *tok)
{
	struct call c;
	json_t *ev;
	int n = 0;

	setup(&c, tok, API_CHAT, TEXT, 1);
	while (openai_stream(&c, 0) == 1 && n++ < 10)
		;
	ev = events(&c, NULL);
	/* role, content, call 0, call 1, finish, [DONE] */
	CHECK(json_array_size(ev) == 6, "%zu events: %.*s", json_array_size(ev), (int)c.out_len,
	      c.out);
	CHECK(!strcmp(str(ev, "0.choices.0.delta.role"), "assistant"), "first chunk");
	CHECK(!strcmp(str(ev, "1.choices.0.delta.content"), "Let me look."), "content delta %s",
	      str(ev, "1.choices.0.delta.content"));
	CHECK(!strcmp(str(ev, "2.choices.0.delta.tool_calls.0.id"), "call_abc_0") &&
	      !strcmp(str(ev, "2.choices.0.delta.tool_calls.0.function.name"), "get_weather") &&
	      json_integer_value(json_object_get(json_array_get(json_object_get(json_object_get(
		json_array_get(json_object_get(json_array_get(ev, 3), "choices"), 0), "delta"),
		"tool_calls"), 0), "index")) == 1, "tool_calls deltas: %.*s", (int)c.out_len, c.out);
	CHECK(!strcmp(str(ev, "3.choices.0.delta.tool_calls.0.function.arguments"),
		      "{\"tz\":\"CET\",\"n\":2}"), "arguments delta");
	CHECK(!strcmp(str(ev, "4.choices.0.finish_reason"), "tool_calls"), "finish %s",
	      str(ev, "4.choices.0.finish_reason"));
	CHECK(!strcmp(str(ev, "5"), "[DONE]"), "last %s", str(ev, "5"));
	json_decref(ev);
	call_free(&c);
}

static void anthropic_whole(const struct kd_tokenizer *tok)
{
	struct call c;
	json_t *o, *in;

	setup(&c, tok, API_MESSAGES, TEXT, 0);
	o = load(anthropic_response(&c));
	in = json_object_get(json_array_get(json_object_get(o, "content"), 1), "input");
	CHECK(json_array_size(json_object_get(o, "content")) == 3, "%zu blocks",
	      json_array_size(json_object_get(o, "content")));
	CHECK(!strcmp(str(o, "content.0.type"), "text") &&
	      !strcmp(str(o, "content.0.text"), "Let me look."), "text block %s", str(o, "content.0.text"));
	CHECK(!strcmp(str(o, "content.1.type"), "tool_use") &&
	      !strcmp(str(o, "content.1.id"), "toolu_abc_0") &&
	      !strcmp(str(o, "content.2.id"), "toolu_abc_1") &&
	      !strcmp(str(o, "content.1.name"), "get_weather"), "tool_use %s %s",
	      str(o, "content.1.type"), str(o, "content.1.id"));
	CHECK(json_is_object(in) && !strcmp(str(in, "city"), "Paris"), "input not the object");
	CHECK(!strcmp(str(o, "stop_reason"), "tool_use"), "stop_reason %s", str(o, "stop_reason"));
	json_decref(o);
	call_free(&c);
}

static void anthropic_streamed(const struct kd_tokenizer *tok)
{
	static const char *const want[] = { "message_start", "ping", "content_block_start",
		"content_block_delta", "content_block_stop", "content_block_start",
		"content_block_delta", "content_block_stop", "content_block_start",
		"content_block_delta", "content_block_stop", "message_delta", "message_stop" };
	struct call c;
	json_t *names = json_array(), *ev;
	int n = 0;
	size_t i;

	setup(&c, tok, API_MESSAGES, TEXT, 1);
	while (anthropic_stream(&c, 0) == 1 && n++ < 10)
		;
	ev = events(&c, names);
	CHECK(json_array_size(names) == sizeof(want) / sizeof(*want), "%zu events: %.*s",
	      json_array_size(names), (int)c.out_len, c.out);
	for (i = 0; i < json_array_size(names) && i < sizeof(want) / sizeof(*want); i++)
		CHECK(!strcmp(json_string_value(json_array_get(names, i)), want[i]),
		      "event %zu %s, want %s", i,
		      json_string_value(json_array_get(names, i)), want[i]);
	if (json_array_size(ev) == sizeof(want) / sizeof(*want)) {
		CHECK(!strcmp(str(ev, "3.delta.text"), "Let me look."), "text delta");
		CHECK(!strcmp(str(ev, "5.content_block.type"), "tool_use") &&
		      !strcmp(str(ev, "5.content_block.id"), "toolu_abc_0") &&
		      !strcmp(str(ev, "5.content_block.name"), "get_weather") &&
		      json_integer_value(json_object_get(json_array_get(ev, 5), "index")) == 1,
		      "tool_use start");
		CHECK(!strcmp(str(ev, "6.delta.type"), "input_json_delta") &&
		      !strcmp(str(ev, "6.delta.partial_json"), "{\"city\":\"Paris\"}"),
		      "input_json_delta %s", str(ev, "6.delta.partial_json"));
		CHECK(!strcmp(str(ev, "11.delta.stop_reason"), "tool_use"), "stop_reason %s",
		      str(ev, "11.delta.stop_reason"));
	}
	json_decref(ev);
	json_decref(names);
	call_free(&c);
}

int main(void)
{
	const char *srcdir = getenv("top_srcdir");
	char path[4096];
	struct kd_tokenizer *tok = NULL;

	snprintf(path, sizeof(path), "%s/tests/data/tokenizer/bytes512_qwen3", srcdir ? srcdir : ".");
	if (kd_tokenizer_open(&tok, path) || !kd_tokenizer_supports_tools(tok)) {
		printf("FAIL: %s: %s (want a Qwen3 template with tools)\n", path, kd_tokenizer_error());
		return 1;
	}
	openai_whole(tok);
	openai_streamed(tok);
	anthropic_whole(tok);
	anthropic_streamed(tok);
	kd_tokenizer_close(tok);
	printf("%s: %d failures\n", fails ? "FAIL" : "ok", fails);
	return fails != 0;
}
