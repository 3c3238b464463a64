/* Chat templates. Models ship a Jinja template; kdec does not run Jinja but recognises
 * the families it supports from the template's text and renders them in C: here
 * ChatML (SmolLM2, Qwen2) with the default system message the template may carry,
 * Llama 3 (bos, header ids, trimmed content, <|eot_id|>) and DeepSeek LLM / V2; the
 * families whose templates know tools (Llama 3.1-3.3, Qwen3, Kimi-K2, DeepSeek-V3.1)
 * render in tokenizer_chat_tools.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/tokenizer.h"

static const char *find_mem(const char *s, size_t n, const char *needle)
{
	return memmem(s, n, needle, strlen(needle));
}

/* ChatML templates that open with a fixed system message when the conversation has
 * none write it as a literal: '<|im_start|>system\nTEXT<|im_end|>' with TEXT free of
 * quotes and Jinja (the branch that copies messages[0] has a quote right away). The
 * newline may be a real one or Jinja's \n escape. */
static int chatml_default_system(struct kd_tokenizer *t, const char *s, size_t n)
{
	static const char open[] = "<|im_start|>system";
	const char *p = s, *end = s + n;

	while ((p = find_mem(p, (size_t)(end - p), open))) {
		const char *q = p + sizeof(open) - 1, *close;

		p = q;
		if (q < end && *q == '\n')
			q++;
		else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n')
			q += 2;
		else
			continue;
		close = find_mem(q, (size_t)(end - q), "<|im_end|>");
		if (!close || close == q || memchr(q, '\'', (size_t)(close - q)) ||
		    memchr(q, '"', (size_t)(close - q)) || find_mem(q, (size_t)(close - q), "{"))
			continue;
		t->chat_system = strndup(q, (size_t)(close - q));
		return t->chat_system ? 0 : -ENOMEM;
	}
	return 0;
}

/* Kimi-K2 writes its default system message as a literal after this marker. */
static int kimi_default_system(struct kd_tokenizer *t, const char *s, size_t n)
{
	static const char open[] = "<|im_system|>system<|im_middle|>";
	const char *p = s, *end = s + n;

	while ((p = find_mem(p, (size_t)(end - p), open))) {
		const char *q = p + sizeof(open) - 1;
		const char *close = find_mem(q, (size_t)(end - q), "<|im_end|>");

		p = q;
		if (!close || close == q || memchr(q, '\'', (size_t)(close - q)) ||
		    memchr(q, '"', (size_t)(close - q)) || find_mem(q, (size_t)(close - q), "{"))
			continue;
		t->chat_system = strndup(q, (size_t)(close - q));
		return t->chat_system ? 0 : -ENOMEM;
	}
	tok_set_error("%s: a Kimi-K2 template without its default system message", t->path);
	t->chat = TOK_CHAT_NONE;
	return 0;
}

/* The families that render tools, each by strings only its template has: Kimi-K2
 * (Instruct as updated with its queue of call ids; not the first release, not
 * Thinking), Qwen3 (reasoning_content) and Qwen2.5 (<tools>, a default system), and
 * DeepSeek-V3.1 (V3 and R1 lack the tool separator after the name and is_last_user). */
static int detect_tools_family(struct kd_tokenizer *t, const char *tmpl, size_t len)
{
	if (find_mem(tmpl, len, "<|im_middle|>") && find_mem(tmpl, len, "tool_response_queue") &&
	    find_mem(tmpl, len, "<|tool_calls_section_begin|>") && !find_mem(tmpl, len, "<think>")) {
		t->chat = TOK_CHAT_KIMI_K2;
		return kimi_default_system(t, tmpl, len);
	}
	/* Qwen3-Coder and Qwen3.5 write calls as XML (<function=...>): not these */
	if (find_mem(tmpl, len, "<|im_start|>") && find_mem(tmpl, len, "<tools>") &&
	    find_mem(tmpl, len, "<tool_call>") && !find_mem(tmpl, len, "<function=")) {
		int rc;

		if (find_mem(tmpl, len, "reasoning_content")) {
			t->chat = TOK_CHAT_QWEN3;
			return 0;
		}
		/* Qwen2.5 names its default system message in both branches; without one
		 * the template is another ChatML with tools, left to plain ChatML */
		rc = chatml_default_system(t, tmpl, len);
		if (!rc && t->chat_system)
			t->chat = TOK_CHAT_QWEN25;
		return rc;
	}
	if (find_mem(tmpl, len, "<｜User｜>") &&
	    find_mem(tmpl, len, "is_last_user") && find_mem(tmpl, len, "<think></think>") &&
	    find_mem(tmpl, len, "tool['function']['name'] + '<｜tool▁sep｜>'"))
		t->chat = TOK_CHAT_DEEPSEEK3;
	return 0;
}

int tok_chat_detect(struct kd_tokenizer *t, const char *tmpl, size_t len)
{
	t->chat = TOK_CHAT_NONE;
	int rc = detect_tools_family(t, tmpl, len);

	if (rc || t->chat != TOK_CHAT_NONE)
		return rc;
	if (find_mem(tmpl, len, "<|im_start|>")) {
		t->chat = TOK_CHAT_CHATML;
		return chatml_default_system(t, tmpl, len);
	}
	/* DeepSeek LLM and V2 (V3 and R1 use <｜User｜> tags instead) */
	if (find_mem(tmpl, len, "'User: '") && find_mem(tmpl, len, "'Assistant: '") &&
	    find_mem(tmpl, len, "eos_token")) {
		t->chat = TOK_CHAT_DEEPSEEK2;
		return 0;
	}
	/* Llama 3.0's template; 3.1 and later add a dated system block and tool calls,
	 * 3.2 dates it today (strftime_now) where 3.1 and 3.3 write a fixed date */
	if (find_mem(tmpl, len, "<|start_header_id|>")) {
		t->chat = find_mem(tmpl, len, "Cutting Knowledge") ? TOK_CHAT_LLAMA31 : TOK_CHAT_LLAMA3;
		t->chat_today = t->chat == TOK_CHAT_LLAMA31 && find_mem(tmpl, len, "strftime_now");
		t->chat_tools = t->chat == TOK_CHAT_LLAMA31 &&
				find_mem(tmpl, len, "tools_in_user_message");
	}
	return 0;
}

static void render_chatml(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			  size_t n, int gen, struct tok_out *o)
{
	if (t->chat_system && (!n || strcmp(m[0].role, "system"))) {
		tok_puts(o, "<|im_start|>system\n");
		tok_puts(o, t->chat_system);
		tok_puts(o, "<|im_end|>\n");
	}
	for (size_t i = 0; i < n; i++) {
		tok_puts(o, "<|im_start|>");
		tok_puts(o, m[i].role);
		tok_puts(o, "\n");
		tok_puts(o, m[i].content);
		tok_puts(o, "<|im_end|>\n");
	}
	if (gen)
		tok_puts(o, "<|im_start|>assistant\n");
}

/* A Llama 3 turn: header, the trimmed content, <|eot_id|>. */
static void put_llama3_turn(struct tok_out *o, const char *role, const char *content)
{
	tok_puts(o, "<|start_header_id|>");
	tok_puts(o, role);
	tok_puts(o, "<|end_header_id|>\n\n");
	tok_put_trimmed(o, content);
	tok_puts(o, "<|eot_id|>");
}

static const char llama3_gen[] = "<|start_header_id|>assistant<|end_header_id|>\n\n";

static void render_llama3(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			  size_t n, int gen, struct tok_out *o)
{
	if (n)
		tok_put_token(o, t, t->bos);
	for (size_t i = 0; i < n; i++)
		put_llama3_turn(o, m[i].role, m[i].content);
	if (gen)
		tok_puts(o, llama3_gen);
}

/* Content as is (no trim); roles other than these three are not written. */
static void render_deepseek2(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			     size_t n, int gen, struct tok_out *o)
{
	tok_put_token(o, t, t->bos);
	for (size_t i = 0; i < n; i++) {
		if (!strcmp(m[i].role, "user")) {
			tok_puts(o, "User: ");
			tok_puts(o, m[i].content);
			tok_puts(o, "\n\n");
		} else if (!strcmp(m[i].role, "assistant")) {
			tok_puts(o, "Assistant: ");
			tok_puts(o, m[i].content);
			tok_put_token(o, t, t->eos);
		} else if (!strcmp(m[i].role, "system")) {
			tok_puts(o, m[i].content);
			tok_puts(o, "\n\n");
		}
	}
	if (gen)
		tok_puts(o, "Assistant:");
}

/* The families without tools; -ENOTSUP (message set) for the rest. */
int tok_render_plain(const struct kd_tokenizer *t, const struct kd_chat_message *m, size_t n,
		     int gen, struct tok_out *o)
{
	switch (t->chat) {
	case TOK_CHAT_CHATML:
		render_chatml(t, m, n, gen, o);
		return 0;
	case TOK_CHAT_LLAMA3:
		render_llama3(t, m, n, gen, o);
		return 0;
	case TOK_CHAT_DEEPSEEK2:
		render_deepseek2(t, m, n, gen, o);
		return 0;
	default:
		tok_set_error("%s: no chat template kdec knows (ChatML, Llama 3, Llama 3.1-3.3, "
			      "Qwen2.5, Qwen3, Kimi-K2, DeepSeek LLM / V2 / V3.1)", t->path);
		return -ENOTSUP;
	}
}

long kd_tokenizer_chat(const struct kd_tokenizer *t, const struct kd_chat_message *msgs,
		       size_t n, int add_generation_prompt, char *buf, size_t len)
{
	return kd_tokenizer_chat_tools(t, msgs, n, NULL, add_generation_prompt, buf, len);
}
