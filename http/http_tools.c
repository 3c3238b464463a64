/* Tool use in kdhttpd, all in this file: the OpenAI "tools" / "tool_choice" fields and
 * tool messages, the Anthropic "tools" / "tool_choice" fields. For now every request
 * that asks for tools is refused with the API's 400 error naming the reason;
 * tool_choice "none" (and an empty tools array) asks for nothing and passes.
 *
 * WHERE THE TOOLS GO (issue 26; libkdclient's branch `tools` adds the three calls):
 *  1. tools_check_*: instead of refusing, when kd_tokenizer_supports_tools(c->tok),
 *     keep the "tools" array's JSON text in the call (and tool_choice), and accept
 *     role "tool" messages (tool_call_id) and assistant "tool_calls" (OpenAI), or
 *     tool_use / tool_result blocks (Anthropic, http_anthropic.c blocks_text), filling
 *     kd_chat_message's tool_calls_json, tool_call_id and name. A tokenizer without
 *     tool support keeps the refusal below.
 *  2. the render (http_openai.c render_chat, http_anthropic.c render): call
 *     kd_tokenizer_chat_tools(c->tok, msgs, n, tools_json, 1, buf, len) in place of
 *     kd_tokenizer_chat when the call has tools.
 *  3. the answer (openai_response / anthropic_response, and the streams' end): run
 *     kd_tokenizer_parse_tool_calls(c->tok, c->text, c->len, &json) on the whole text
 *     and write its "content" and "tool_calls" in the API's shape, finish_reason
 *     "tool_calls" / stop_reason "tool_use". A streamed call with tools holds its
 *     text until the end (the calls are only known then). */
#include <string.h>

#include "http/http_call.h"

/* tools absent, null or []; tool_choice absent, null or "none" (or {"type": "none"}) */
static int asks_for_tools(json_t *body, const char **what)
{
	json_t *tools = json_object_get(body, "tools"), *choice = json_object_get(body, "tool_choice");
	const char *cs = json_string_value(choice);
	const char *ct = json_string_value(json_object_get(choice, "type"));

	if (tools && !json_is_null(tools) && !(json_is_array(tools) && !json_array_size(tools))) {
		*what = "tools";
		return 1;
	}
	if (choice && !json_is_null(choice) && !(cs && !strcmp(cs, "none")) &&
	    !(ct && !strcmp(ct, "none"))) {
		*what = "tool_choice";
		return 1;
	}
	if (json_object_get(body, "functions") || json_object_get(body, "function_call")) {
		*what = json_object_get(body, "functions") ? "functions" : "function_call";
		return 1;
	}
	return 0;
}

int tools_check_openai(struct call *c, json_t *body, struct call_err *e)
{
	json_t *msgs = json_object_get(body, "messages"), *m;
	const char *what;
	size_t i;

	if (asks_for_tools(body, &what))
		return call_errf(e, 400, what, "%s: tool use is not available in this kdhttpd "
				 "(the model's tool-call format is not wired in yet); send the "
				 "request without tools", what);
	json_array_foreach(msgs, i, m) {
		const char *role = json_string_value(json_object_get(m, "role"));

		if ((role && !strcmp(role, "tool")) || json_object_get(m, "tool_calls"))
			return call_errf(e, 400, "messages", "messages[%zu]: %s: tool use is not "
					 "available in this kdhttpd", i, role && !strcmp(role, "tool") ?
					 "role \"tool\"" : "tool_calls");
	}
	return 0;
}

int tools_check_anthropic(struct call *c, json_t *body, struct call_err *e)
{
	const char *what;

	if (asks_for_tools(body, &what))
		return call_errf(e, 400, what, "%s: tool use is not available in this kdhttpd "
				 "(the model's tool-call format is not wired in yet); send the "
				 "request without tools", what);
	return 0;	/* tool_use / tool_result blocks: http_anthropic.c refuses them */
}
