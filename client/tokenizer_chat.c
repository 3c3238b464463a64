/* Chat templates. Models ship a Jinja template; kdec does not run Jinja but recognises
 * the families it supports from the template's text and renders them in C:
 * ChatML (SmolLM2, Qwen2) with the default system message the template may carry,
 * Llama 3 (bos, header ids, trimmed content, <|eot_id|>), and Llama 3.1-3.3 (Llama 3
 * after a system block dated as the template dates it; tool results as a JSON string;
 * tool definitions and tool calls are not rendered). */
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

int tok_chat_detect(struct kd_tokenizer *t, const char *tmpl, size_t len)
{
	t->chat = TOK_CHAT_NONE;
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
	}
	return 0;
}

struct out_buf {
	char *buf;
	size_t len, k;
};

static void put(struct out_buf *o, const char *s, size_t n)
{
	if (o->k < o->len)
		memcpy(o->buf + o->k, s, o->len - o->k < n ? o->len - o->k : n);
	o->k += n;
}

static void puts_(struct out_buf *o, const char *s)
{
	put(o, s, strlen(s));
}

/* Jinja's trim (Python's str.strip): leading and trailing white space. */
static int is_py_space(unsigned char c)
{
	return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static void put_trimmed(struct out_buf *o, const char *s)
{
	size_t n = strlen(s);

	while (n && is_py_space((unsigned char)*s)) {
		s++;
		n--;
	}
	while (n && is_py_space((unsigned char)s[n - 1]))
		n--;
	put(o, s, n);
}

static void put_token(struct out_buf *o, const struct kd_tokenizer *t, int32_t id)
{
	if (id >= 0)
		put(o, t->strings + t->tokens[id].text_off, t->tokens[id].text_len);
}

static void render_chatml(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			  size_t n, int gen, struct out_buf *o)
{
	if (t->chat_system && (!n || strcmp(m[0].role, "system"))) {
		puts_(o, "<|im_start|>system\n");
		puts_(o, t->chat_system);
		puts_(o, "<|im_end|>\n");
	}
	for (size_t i = 0; i < n; i++) {
		puts_(o, "<|im_start|>");
		puts_(o, m[i].role);
		puts_(o, "\n");
		puts_(o, m[i].content);
		puts_(o, "<|im_end|>\n");
	}
	if (gen)
		puts_(o, "<|im_start|>assistant\n");
}

/* A Llama 3 turn: header, the trimmed content, <|eot_id|>. */
static void put_llama3_turn(struct out_buf *o, const char *role, const char *content)
{
	puts_(o, "<|start_header_id|>");
	puts_(o, role);
	puts_(o, "<|end_header_id|>\n\n");
	put_trimmed(o, content);
	puts_(o, "<|eot_id|>");
}

static const char llama3_gen[] = "<|start_header_id|>assistant<|end_header_id|>\n\n";

static void render_llama3(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			  size_t n, int gen, struct out_buf *o)
{
	if (n)
		put_token(o, t, t->bos);
	for (size_t i = 0; i < n; i++)
		put_llama3_turn(o, m[i].role, m[i].content);
	if (gen)
		puts_(o, llama3_gen);
}

/* s as a JSON string, as Python's json.dumps(s, ensure_ascii=False) writes it (the
 * templates' tojson): quotes, backslashes and control characters escaped, the rest
 * as is. */
static void put_json_string(struct out_buf *o, const char *s)
{
	static const char hex[] = "0123456789abcdef";

	puts_(o, "\"");
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		char esc[7] = { '\\', 0 };

		switch (c) {
		case '"': esc[1] = '"'; break;
		case '\\': esc[1] = '\\'; break;
		case '\n': esc[1] = 'n'; break;
		case '\r': esc[1] = 'r'; break;
		case '\t': esc[1] = 't'; break;
		case '\b': esc[1] = 'b'; break;
		case '\f': esc[1] = 'f'; break;
		default:
			if (c >= 0x20) {
				put(o, s, 1);
				continue;
			}
			memcpy(esc + 1, "u00", 3);
			esc[4] = hex[c >> 4];
			esc[5] = hex[c & 15];
		}
		puts_(o, esc);
	}
	puts_(o, "\"");
}

/* Today as the 3.2 template's strftime_now("%d %b %Y") (local time), English month
 * names whatever the locale. */
static void put_today(struct out_buf *o)
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
	puts_(o, buf);
}

static void render_llama31(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			   size_t n, int gen, struct out_buf *o)
{
	size_t i = 0;

	put_token(o, t, t->bos);
	puts_(o, "<|start_header_id|>system<|end_header_id|>\n\n"
		 "Cutting Knowledge Date: December 2023\nToday Date: ");
	if (t->chat_today)
		put_today(o);
	else
		puts_(o, "26 Jul 2024");
	puts_(o, "\n\n");
	if (n && !strcmp(m[0].role, "system"))
		put_trimmed(o, m[i++].content);
	puts_(o, "<|eot_id|>");
	for (; i < n; i++) {
		if (strcmp(m[i].role, "tool") && strcmp(m[i].role, "ipython")) {
			put_llama3_turn(o, m[i].role, m[i].content);
			continue;
		}
		puts_(o, "<|start_header_id|>ipython<|end_header_id|>\n\n");
		put_json_string(o, m[i].content);
		puts_(o, "<|eot_id|>");
	}
	if (gen)
		puts_(o, llama3_gen);
}

/* Content as is (no trim); roles other than these three are not written. */
static void render_deepseek2(const struct kd_tokenizer *t, const struct kd_chat_message *m,
			     size_t n, int gen, struct out_buf *o)
{
	put_token(o, t, t->bos);
	for (size_t i = 0; i < n; i++) {
		if (!strcmp(m[i].role, "user")) {
			puts_(o, "User: ");
			puts_(o, m[i].content);
			puts_(o, "\n\n");
		} else if (!strcmp(m[i].role, "assistant")) {
			puts_(o, "Assistant: ");
			puts_(o, m[i].content);
			put_token(o, t, t->eos);
		} else if (!strcmp(m[i].role, "system")) {
			puts_(o, m[i].content);
			puts_(o, "\n\n");
		}
	}
	if (gen)
		puts_(o, "Assistant:");
}

long kd_tokenizer_chat(const struct kd_tokenizer *t, const struct kd_chat_message *msgs,
		       size_t n, int add_generation_prompt, char *buf, size_t len)
{
	struct out_buf o = { buf, len, 0 };

	if (!t || (!msgs && n) || (!buf && len))
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (!msgs[i].role || !msgs[i].content)
			return -EINVAL;
	switch (t->chat) {
	case TOK_CHAT_CHATML:
		render_chatml(t, msgs, n, add_generation_prompt, &o);
		break;
	case TOK_CHAT_LLAMA3:
		render_llama3(t, msgs, n, add_generation_prompt, &o);
		break;
	case TOK_CHAT_LLAMA31:
		render_llama31(t, msgs, n, add_generation_prompt, &o);
		break;
	case TOK_CHAT_DEEPSEEK2:
		render_deepseek2(t, msgs, n, add_generation_prompt, &o);
		break;
	default:
		tok_set_error("%s: no chat template kdec knows (ChatML, Llama 3, Llama 3.1-3.3, "
			      "DeepSeek LLM / V2)", t->path);
		return -ENOTSUP;
	}
	if (o.k < len)
		buf[o.k] = '\0';
	return (long)o.k;
}
