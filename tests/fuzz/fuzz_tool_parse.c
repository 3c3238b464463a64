/* libFuzzer target: kd_tokenizer_parse_tool_calls on arbitrary model output in each
 * family's format (the first byte picks the family) must not crash, must return 0,
 * and must give JSON with a content string and a tool_calls array whose arguments are
 * JSON objects. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const enum tok_chat families[] = { TOK_CHAT_LLAMA31, TOK_CHAT_QWEN3, TOK_CHAT_KIMI_K2,
					  TOK_CHAT_DEEPSEEK3, TOK_CHAT_CHATML };

static int output_sane(const char *out)
{
	json_t *doc = json_loads(out, JSON_ALLOW_NUL, NULL), *calls, *c;
	size_t i;
	int ok;

	calls = json_object_get(doc, "tool_calls");
	ok = json_is_string(json_object_get(doc, "content")) && json_is_array(calls);
	json_array_foreach(calls, i, c) {
		json_t *args = json_loads(json_string_value(json_object_get(c, "arguments")), 0, NULL);

		ok = ok && json_is_string(json_object_get(c, "id")) &&
		     json_string_length(json_object_get(c, "name")) && json_is_object(args);
		json_decref(args);
	}
	json_decref(doc);
	return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kd_tokenizer t;
	char *out = NULL, *text;

	if (!size)
		return 0;
	memset(&t, 0, sizeof(t));
	t.chat = families[data[0] % (sizeof(families) / sizeof(families[0]))];
	/* exactly size - 1 bytes, no terminator: the parser must stay inside them */
	text = malloc(size - 1 ? size - 1 : 1);
	if (!text)
		return 0;
	memcpy(text, data + 1, size - 1);
	if (kd_tokenizer_parse_tool_calls(&t, text, size - 1, &out) || !out || !output_sane(out))
		__builtin_trap();
	free(out);
	free(text);
	return 0;
}
