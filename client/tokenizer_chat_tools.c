/* The chat templates that know tools, rendered in C as transformers renders each real
 * template: Llama 3.1-3.3 (tool schemas in the first user turn, one JSON call per
 * assistant turn), Qwen2.5 and Qwen3 (<tools> in the system block; Qwen3 keeps <think>
 * after the last query),
 * Kimi-K2 (tools declared as JSON, calls numbered functions.NAME:N), DeepSeek-V3.1
 * (calls and results, no tool definitions). Input JSON is parsed and checked here. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "client/tokenizer.h"

static const char *str_or_empty(const char *s)
{
	return s ? s : "";
}

/* ---- Llama 3.1-3.3 ------------------------------------------------------------ */

static const char llama_gen[] = "<|start_header_id|>assistant<|end_header_id|>\n\n";

/* Today as the 3.2 template's strftime_now("%d %b %Y") (local time), English month
 * names whatever the locale. */
static void put_today(struct tok_out *o)
{
	static const char mon[12][4] = { "Jan", "Feb", "Mar", "Apr", "May", "Jun",
					 "Jul", "Aug", "Sep", "Oct", "Nov", "Dec" };
	time_t now = time(NULL);
	struct tm tm;
	char buf[64];

	if (!localtime_r(&now, &tm))
		memset(&tm, 0, sizeof(tm));
	snprintf(buf, sizeof(buf), "%02d %.3s %04d", tm.tm_mday % 100,
		 mon[(unsigned)tm.tm_mon % 12], (tm.tm_year + 1900) % 10000);
	tok_puts(o, buf);
}

static void put_llama_tools(struct tok_out *o, const json_t *tools, const char *first_user)
{
	size_t i;
	json_t *tool;

	tok_puts(o, "<|start_header_id|>user<|end_header_id|>\n\n"
		    "Given the following functions, please respond with a JSON for a function call "
		    "with its proper arguments that best answers the given prompt.\n\n"
		    "Respond in the format {\"name\": function name, \"parameters\": dictionary of "
		    "argument name and its value}.Do not use variables.\n\n");
	json_array_foreach(tools, i, tool) {
		tok_put_pyjson(o, tool, 4);
		tok_puts(o, "\n\n");
	}
	tok_put_trimmed(o, first_user);
	tok_puts(o, "<|eot_id|>");
}

static int render_llama31(const struct kd_tokenizer *t, const struct tok_chat_in *in,
			  struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;
	size_t i = 0;

	tok_put_token(o, t, t->bos);
	tok_puts(o, "<|start_header_id|>system<|end_header_id|>\n\n");
	if (in->tools)
		tok_puts(o, "Environment: ipython\n");
	tok_puts(o, "Cutting Knowledge Date: December 2023\nToday Date: ");
	if (t->chat_today)
		put_today(o);
	else
		tok_puts(o, "26 Jul 2024");
	tok_puts(o, "\n\n");
	if (in->n && !strcmp(m[0].role, "system"))
		tok_put_trimmed(o, str_or_empty(m[i++].content));
	tok_puts(o, "<|eot_id|>");
	if (in->tools) {
		/* the template raises here: tools go into a first user message */
		if (i == in->n) {
			tok_set_error("Llama 3.1 chat with tools: no user message to put them in");
			return -EINVAL;
		}
		put_llama_tools(o, in->tools, str_or_empty(m[i++].content));
	}
	for (; i < in->n; i++) {
		int tool = !strcmp(m[i].role, "tool") || !strcmp(m[i].role, "ipython");

		if (!tool && !m[i].tool_calls_json) {
			tok_puts(o, "<|start_header_id|>");
			tok_puts(o, m[i].role);
			tok_puts(o, "<|end_header_id|>\n\n");
			tok_put_trimmed(o, str_or_empty(m[i].content));
			tok_puts(o, "<|eot_id|>");
		} else if (!tool) {
			const json_t *call = json_array_get(in->calls[i], 0);

			if (json_array_size(in->calls[i]) != 1) {
				tok_set_error("message %zu: Llama 3.1 takes one tool call per assistant "
					      "turn, not %zu", i, json_array_size(in->calls[i]));
				return -EINVAL;
			}
			tok_puts(o, llama_gen);
			tok_puts(o, "{\"name\": \"");
			tok_puts(o, json_string_value(json_object_get(call, "name")));
			tok_puts(o, "\", \"parameters\": ");
			tok_put_pyjson(o, json_object_get(call, "arguments"), -1);
			tok_puts(o, "}<|eot_id|>");
		} else {
			const char *c = str_or_empty(m[i].content);

			tok_puts(o, "<|start_header_id|>ipython<|end_header_id|>\n\n");
			tok_put_json_string(o, c, strlen(c));	/* a string is iterable: tojson */
			tok_puts(o, "<|eot_id|>");
		}
	}
	if (in->gen)
		tok_puts(o, llama_gen);
	return 0;
}

/* ---- Qwen2.5 and Qwen3 -------------------------------------------------------------------- */

static int starts_with(const char *s, const char *p)
{
	return !strncmp(s, p, strlen(p));
}

static int ends_with(const char *s, const char *p)
{
	size_t n = strlen(s), k = strlen(p);

	return n >= k && !memcmp(s + n - k, p, k);
}

/* The last user turn that is not a tool response wrapped by hand: <think> blocks
 * after it are kept, before it dropped. */
static size_t qwen3_last_query(const struct kd_chat_message *m, size_t n)
{
	for (size_t i = n; i-- > 0;) {
		const char *c = str_or_empty(m[i].content);

		if (!strcmp(m[i].role, "user") &&
		    !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>")))
			return i;
	}
	return n ? n - 1 : 0;
}

struct span {
	const char *p;
	size_t n;
};

static struct span lstrip_nl(struct span s)
{
	while (s.n && *s.p == '\n') {
		s.p++;
		s.n--;
	}
	return s;
}

static struct span rstrip_nl(struct span s)
{
	while (s.n && s.p[s.n - 1] == '\n')
		s.n--;
	return s;
}

static const char *find_last(const char *s, size_t n, const char *needle)
{
	size_t k = strlen(needle);
	const char *last = NULL, *p = s;

	while ((p = memmem(p, (size_t)(s + n - p), needle, k))) {
		last = p;
		p++;
	}
	return last;
}

/* content.split('</think>')[-1].lstrip('\n') and, as reasoning,
 * content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'). */
static void qwen3_split_think(const char *c, struct span *content, struct span *reasoning)
{
	size_t n = strlen(c);
	const char *first = strstr(c, "</think>"), *last, *open;
	struct span r;

	*content = (struct span){ c, n };
	*reasoning = (struct span){ "", 0 };
	if (!first)
		return;
	last = find_last(c, n, "</think>");
	*content = lstrip_nl((struct span){ last + 8, (size_t)(c + n - last - 8) });
	r = rstrip_nl((struct span){ c, (size_t)(first - c) });
	open = find_last(r.p, r.n, "<think>");
	if (open)
		r = (struct span){ open + 7, (size_t)(r.p + r.n - open - 7) };
	*reasoning = lstrip_nl(r);
}

static void put_qwen3_calls(struct tok_out *o, const json_t *calls, int content)
{
	size_t i;
	json_t *call;

	json_array_foreach(calls, i, call) {
		if (i || content)
			tok_puts(o, "\n");
		tok_puts(o, "<tool_call>\n{\"name\": \"");
		tok_puts(o, json_string_value(json_object_get(call, "name")));
		tok_puts(o, "\", \"arguments\": ");
		tok_put_pyjson(o, json_object_get(call, "arguments"), -1);
		tok_puts(o, "}\n</tool_call>");
	}
}

static void qwen3_assistant(const struct tok_chat_in *in, size_t i, size_t last_query,
			    struct tok_out *o)
{
	struct span content, reasoning;

	qwen3_split_think(str_or_empty(in->m[i].content), &content, &reasoning);
	tok_puts(o, "<|im_start|>assistant\n");
	if (i > last_query && (i + 1 == in->n || reasoning.n)) {
		tok_puts(o, "<think>\n");
		reasoning = rstrip_nl(lstrip_nl(reasoning));
		tok_put(o, reasoning.p, reasoning.n);
		tok_puts(o, "\n</think>\n\n");
		content = lstrip_nl(content);
	}
	tok_put(o, content.p, content.n);
	if (in->calls[i])
		put_qwen3_calls(o, in->calls[i], content.n > 0);
	tok_puts(o, "<|im_end|>\n");
}

/* Qwen2.5 and Qwen3 write the same tools block at the end of the system turn. */
static void qwen_tools_block(const struct tok_chat_in *in, struct tok_out *o)
{
	size_t i;
	json_t *tool;

	tok_puts(o, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
		    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
	json_array_foreach(in->tools, i, tool) {
		tok_puts(o, "\n");
		tok_put_pyjson(o, tool, -1);
	}
	tok_puts(o, "\n</tools>\n\nFor each function call, return a json object with function name "
		    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
		    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
		    "</tool_call><|im_end|>\n");
}

static void qwen3_system(const struct tok_chat_in *in, struct tok_out *o)
{
	int sys = in->n && !strcmp(in->m[0].role, "system");

	if (!in->tools) {
		if (sys) {
			tok_puts(o, "<|im_start|>system\n");
			tok_puts(o, str_or_empty(in->m[0].content));
			tok_puts(o, "<|im_end|>\n");
		}
		return;
	}
	tok_puts(o, "<|im_start|>system\n");
	if (sys) {
		tok_puts(o, str_or_empty(in->m[0].content));
		tok_puts(o, "\n\n");
	}
	qwen_tools_block(in, o);
}

/* A run of tool results is one user turn of <tool_response> blocks (both Qwens). */
static void qwen_tool_result(const struct tok_chat_in *in, size_t i, struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;

	if (!i || strcmp(m[i - 1].role, "tool"))
		tok_puts(o, "<|im_start|>user");
	tok_puts(o, "\n<tool_response>\n");
	tok_puts(o, str_or_empty(m[i].content));
	tok_puts(o, "\n</tool_response>");
	if (i + 1 == in->n || strcmp(m[i + 1].role, "tool"))
		tok_puts(o, "<|im_end|>\n");
}

static int render_qwen3(const struct tok_chat_in *in, struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;
	size_t last_query = qwen3_last_query(m, in->n);

	qwen3_system(in, o);
	for (size_t i = 0; i < in->n; i++) {
		if (!strcmp(m[i].role, "user") || (!strcmp(m[i].role, "system") && i)) {
			tok_puts(o, "<|im_start|>");
			tok_puts(o, m[i].role);
			tok_puts(o, "\n");
			tok_puts(o, str_or_empty(m[i].content));
			tok_puts(o, "<|im_end|>\n");
		} else if (!strcmp(m[i].role, "assistant")) {
			qwen3_assistant(in, i, last_query, o);
		} else if (!strcmp(m[i].role, "tool")) {
			qwen_tool_result(in, i, o);
		}
	}
	if (in->gen)
		tok_puts(o, "<|im_start|>assistant\n");
	return 0;
}

/* Qwen2.5: its default system message unless the first turn is one; the tools block
 * after it; an assistant turn with calls writes its content (if any) then each call
 * on its own line. */
static int render_qwen25(const struct kd_tokenizer *t, const struct tok_chat_in *in,
			 struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;
	int sys = in->n && !strcmp(m[0].role, "system");

	tok_puts(o, "<|im_start|>system\n");
	tok_puts(o, sys ? str_or_empty(m[0].content) : t->chat_system);
	if (in->tools) {
		tok_puts(o, "\n\n");
		qwen_tools_block(in, o);
	} else {
		tok_puts(o, "<|im_end|>\n");
	}
	for (size_t i = 0; i < in->n; i++) {
		int calls = json_array_size(in->calls[i]) > 0;
		const char *c = str_or_empty(m[i].content);

		if (!strcmp(m[i].role, "user") || (!strcmp(m[i].role, "system") && i) ||
		    (!strcmp(m[i].role, "assistant") && !calls)) {
			tok_puts(o, "<|im_start|>");
			tok_puts(o, m[i].role);
			tok_puts(o, "\n");
			tok_puts(o, c);
			tok_puts(o, "<|im_end|>\n");
		} else if (!strcmp(m[i].role, "assistant")) {
			tok_puts(o, "<|im_start|>assistant");
			if (*c) {
				tok_puts(o, "\n");
				tok_puts(o, c);
			}
			put_qwen3_calls(o, in->calls[i], 1);
			tok_puts(o, "<|im_end|>\n");
		} else if (!strcmp(m[i].role, "tool")) {
			qwen_tool_result(in, i, o);
		}
	}
	if (in->gen)
		tok_puts(o, "<|im_start|>assistant\n");
	return 0;
}

/* ---- Kimi-K2 ------------------------------------------------------------------ */

/* functions.NAME:N, N counting the conversation's calls from 0. */
static void put_kimi_id(struct tok_out *o, const char *name, size_t n)
{
	char num[24];

	snprintf(num, sizeof(num), ":%zu", n);
	tok_puts(o, "functions.");
	tok_puts(o, name);
	tok_puts(o, num);
}

/* The template keeps a queue of the ids it gave calls; each tool turn takes the
 * oldest, or, with the queue empty, names itself from its own name and the count. */
#define KIMI_QUEUE 64		/* unanswered calls remembered; more are not queued */

struct kimi_queue {
	struct {
		const json_t *call;	/* {"name", "arguments"} */
		size_t n;		/* its number in functions.NAME:N */
	} q[KIMI_QUEUE];
	size_t head, tail, counter;
};

static void kimi_calls(struct tok_out *o, const json_t *calls, struct kimi_queue *q)
{
	size_t i;
	json_t *call;

	tok_puts(o, "<|tool_calls_section_begin|>");
	json_array_foreach(calls, i, call) {
		tok_puts(o, "<|tool_call_begin|>");
		put_kimi_id(o, json_string_value(json_object_get(call, "name")), q->counter);
		if (q->tail - q->head < KIMI_QUEUE) {
			q->q[q->tail % KIMI_QUEUE].call = call;
			q->q[q->tail++ % KIMI_QUEUE].n = q->counter;
		}
		q->counter++;
		tok_puts(o, "<|tool_call_argument_begin|>");
		tok_put_pyjson(o, json_object_get(call, "arguments"), -1);
		tok_puts(o, "<|tool_call_end|>");
	}
	tok_puts(o, "<|tool_calls_section_end|>");
}

static void kimi_role(struct tok_out *o, const struct kd_chat_message *m)
{
	const char *name = m->name && *m->name ? m->name : m->role;

	if (!strcmp(m->role, "user"))
		tok_puts(o, "<|im_user|>");
	else if (!strcmp(m->role, "assistant"))
		tok_puts(o, "<|im_assistant|>");
	else
		tok_puts(o, "<|im_system|>");
	tok_puts(o, name);
	tok_puts(o, "<|im_middle|>");
}

static int render_kimi(const struct kd_tokenizer *t, const struct tok_chat_in *in,
		       struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;
	struct kimi_queue q = { .head = 0 };

	if (in->tools) {
		tok_puts(o, "<|im_system|>tool_declare<|im_middle|>");
		tok_put_pyjson(o, in->tools, -1);
		tok_puts(o, "<|im_end|>");
	}
	for (size_t i = 0; i < in->n; i++) {
		if (!i && strcmp(m[0].role, "system")) {
			tok_puts(o, "<|im_system|>system<|im_middle|>");
			tok_puts(o, t->chat_system);
			tok_puts(o, "<|im_end|>\n");
		}
		kimi_role(o, &m[i]);
		if (!strcmp(m[i].role, "assistant") && json_array_size(in->calls[i])) {
			tok_puts(o, str_or_empty(m[i].content));
			kimi_calls(o, in->calls[i], &q);
		} else if (!strcmp(m[i].role, "tool")) {
			tok_puts(o, "## Return of ");
			if (q.head < q.tail) {
				const json_t *call = q.q[q.head % KIMI_QUEUE].call;

				put_kimi_id(o, json_string_value(json_object_get(call, "name")),
					    q.q[q.head++ % KIMI_QUEUE].n);
			} else {
				put_kimi_id(o, m[i].name ? m[i].name : "unknown", q.counter);
			}
			tok_puts(o, "\n");
			tok_puts(o, str_or_empty(m[i].content));
		} else {
			tok_puts(o, str_or_empty(m[i].content));
		}
		tok_puts(o, "<|im_end|>");
	}
	if (in->gen)
		tok_puts(o, "<|im_assistant|>assistant<|im_middle|>");
	return 0;
}

/* ---- DeepSeek-V3.1 ------------------------------------------------------------ */

static void deepseek3_calls(struct tok_out *o, const struct kd_chat_message *m,
			    const json_t *calls)
{
	size_t i;
	json_t *call;

	json_array_foreach(calls, i, call) {
		if (!i) {
			tok_puts(o, str_or_empty(m->content));
			tok_puts(o, "<｜tool▁calls▁begin｜>");
		}
		tok_puts(o, "<｜tool▁call▁begin｜>");
		tok_puts(o, json_string_value(json_object_get(call, "name")));
		tok_puts(o, "<｜tool▁sep｜>");
		tok_put_pyjson(o, json_object_get(call, "arguments"), -1);
		tok_puts(o, "<｜tool▁call▁end｜>");
	}
	tok_puts(o, "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>");
}

/* Content after the first </think>, as the template's split('</think>', 1)[1]. */
static const char *after_think(const char *c)
{
	const char *p = strstr(c, "</think>");

	return p ? p + 8 : c;
}

static int render_deepseek3(const struct kd_tokenizer *t, const struct tok_chat_in *in,
			    struct tok_out *o)
{
	const struct kd_chat_message *m = in->m;
	int last_user = 0, is_tool = 0, first_sp = 1;

	tok_put_token(o, t, t->bos);
	for (size_t i = 0; i < in->n; i++) {	/* every system message, joined */
		if (strcmp(m[i].role, "system"))
			continue;
		if (!first_sp)
			tok_puts(o, "\n\n");
		first_sp = 0;
		tok_puts(o, str_or_empty(m[i].content));
	}
	for (size_t i = 0; i < in->n; i++) {
		if (!strcmp(m[i].role, "user")) {
			is_tool = 0;
			last_user = 1;
			tok_puts(o, "<｜User｜>");
			tok_puts(o, str_or_empty(m[i].content));
		} else if (!strcmp(m[i].role, "assistant")) {
			if (last_user)
				tok_puts(o, "<｜Assistant｜><think></think>");
			last_user = 0;
			if (json_array_size(in->calls[i])) {
				is_tool = 0;
				deepseek3_calls(o, &m[i], in->calls[i]);
				continue;
			}
			tok_puts(o, is_tool ? str_or_empty(m[i].content)
					    : after_think(str_or_empty(m[i].content)));
			is_tool = 0;
			tok_puts(o, "<｜end▁of▁sentence｜>");
		} else if (!strcmp(m[i].role, "tool")) {
			last_user = 0;
			is_tool = 1;
			tok_puts(o, "<｜tool▁output▁begin｜>");
			tok_puts(o, str_or_empty(m[i].content));
			tok_puts(o, "<｜tool▁output▁end｜>");
		}
	}
	if (in->gen && last_user && !is_tool)
		tok_puts(o, "<｜Assistant｜><think></think>");
	return 0;
}

int tok_render_tools(const struct kd_tokenizer *t, const struct tok_chat_in *in,
		     struct tok_out *o)
{
	switch (t->chat) {
	case TOK_CHAT_LLAMA31:
		return render_llama31(t, in, o);
	case TOK_CHAT_QWEN25:
		return render_qwen25(t, in, o);
	case TOK_CHAT_QWEN3:
		return render_qwen3(in, o);
	case TOK_CHAT_KIMI_K2:
		return render_kimi(t, in, o);
	case TOK_CHAT_DEEPSEEK3:
		return render_deepseek3(t, in, o);
	default:
		return tok_render_plain(t, in->m, in->n, in->gen, o);
	}
}
