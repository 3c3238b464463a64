/* Tool calls out of generated text, one parser per documented format: Llama 3.1 JSON
 * ({"name", "parameters"}, optionally after <|python_tag|>, ';' between calls), Qwen2.5
 * and Qwen3 (<tool_call>{"name", "arguments"}</tool_call>), Kimi-K2 and DeepSeek-V3 / V3.1
 * (marked sections of calls). A call that does not parse stays in the prose. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"

struct parse {
	const char *s;
	size_t n;
	json_t *calls;		/* [{"id", "name", "arguments"}] */
	char *content;		/* (k) kept text, grown as spans are kept */
	size_t k, cap;
	int oom;
};

struct span {
	const char *p;
	size_t n;
};

static struct span trim(struct span s)
{
	while (s.n && tok_is_py_space((unsigned char)*s.p)) {
		s.p++;
		s.n--;
	}
	while (s.n && tok_is_py_space((unsigned char)s.p[s.n - 1]))
		s.n--;
	return s;
}

static const char *find(struct span s, const char *needle)
{
	return memmem(s.p, s.n, needle, strlen(needle));
}

static struct span from(struct span s, const char *p)
{
	return (struct span){ p, (size_t)(s.p + s.n - p) };
}

static void keep(struct parse *ps, struct span s)
{
	if (ps->k + s.n + 1 > ps->cap) {
		size_t cap = (ps->k + s.n + 1) * 2;
		char *p = realloc(ps->content, cap);

		if (!p) {
			ps->oom = 1;
			return;
		}
		ps->content = p;
		ps->cap = cap;
	}
	memcpy(ps->content + ps->k, s.p, s.n);
	ps->k += s.n;
}

/* A JSON object and nothing else (white space aside); NULL otherwise. */
static json_t *parse_object(struct span s)
{
	json_t *v;

	s = trim(s);
	v = json_loadb(s.p, s.n, JSON_REJECT_DUPLICATES, NULL);
	if (v && !json_is_object(v)) {
		json_decref(v);
		v = NULL;
	}
	return v;
}

/* Appends a call; id NULL gives call_<index>. Takes args. 0, or -EINVAL when the name
 * is empty or not UTF-8 (the call is then not a call). */
static int add_call(struct parse *ps, struct span id, struct span name, json_t *args)
{
	char gen[32], *text = json_dumps(args, JSON_COMPACT);
	json_t *call;

	json_decref(args);
	if (!id.p) {
		snprintf(gen, sizeof(gen), "call_%zu", json_array_size(ps->calls));
		id = (struct span){ gen, strlen(gen) };
	}
	call = text && name.n ? json_pack("{s:s%,s:s%,s:s}", "id", id.p, id.n, "name", name.p,
					  name.n, "arguments", text) : NULL;
	free(text);
	if (!call)
		return -EINVAL;
	return json_array_append_new(ps->calls, call) ? -ENOMEM : 0;
}

/* {"name": string, key: object} as one call. */
static int add_json_call(struct parse *ps, json_t *obj, const char *key, const char *alt)
{
	json_t *name = json_object_get(obj, "name"), *args = json_object_get(obj, key);
	int rc = -EINVAL;

	if (!args && alt)
		args = json_object_get(obj, alt);
	if (json_is_string(name) && json_is_object(args))
		rc = add_call(ps, (struct span){ 0 },
			      (struct span){ json_string_value(name), json_string_length(name) },
			      json_incref(args));
	json_decref(obj);
	return rc;
}

/* Llama 3.1: the whole reply is the calls, or it is prose. */
static void parse_llama(struct parse *ps)
{
	struct span s = trim((struct span){ ps->s, ps->n });
	size_t before = json_array_size(ps->calls);

	if (s.n >= 14 && !memcmp(s.p, "<|python_tag|>", 14))
		s = trim((struct span){ s.p + 14, s.n - 14 });
	while (s.n && *s.p == '{') {
		json_error_t err;
		json_t *v = json_loadb(s.p, s.n, JSON_DISABLE_EOF_CHECK | JSON_REJECT_DUPLICATES, &err);

		if (!v || !json_is_object(v) || err.position <= 0 || (size_t)err.position > s.n ||
		    add_json_call(ps, v ? json_incref(v) : NULL, "parameters", "arguments")) {
			json_decref(v);
			break;
		}
		json_decref(v);
		s = trim((struct span){ s.p + err.position, s.n - (size_t)err.position });
		if (s.n && *s.p == ';')
			s = trim((struct span){ s.p + 1, s.n - 1 });
	}
	if (s.n || json_array_size(ps->calls) == before) {
		json_array_clear(ps->calls);	/* not all calls: all prose */
		keep(ps, (struct span){ ps->s, ps->n });
	}
}

/* Qwen3: each <tool_call>...</tool_call> block on its own. */
static void parse_qwen(struct parse *ps)
{
	static const char open[] = "<tool_call>", close[] = "</tool_call>";
	struct span s = { ps->s, ps->n };
	const char *b, *e;

	while ((b = find(s, open)) && (e = find(from(s, b + sizeof(open) - 1), close))) {
		struct span inner = { b + sizeof(open) - 1, (size_t)(e - b) - (sizeof(open) - 1) };
		json_t *obj = parse_object(inner);

		if (obj && !add_json_call(ps, obj, "arguments", "parameters")) {
			keep(ps, (struct span){ s.p, (size_t)(b - s.p) });
		} else {
			keep(ps, (struct span){ s.p, (size_t)(e - s.p) + sizeof(close) - 1 });
		}
		s = from(s, e + sizeof(close) - 1);
	}
	keep(ps, s);
}

/* A section of calls between markers: begin (call_begin head sep body call_end)*
 * end, the end optional at the end of the text (generation stopped there). */
struct section_fmt {
	const char *begin, *end, *call_begin, *sep, *call_end;
	int (*call)(struct parse *ps, struct span head, struct span body);
};

static int parse_section(struct parse *ps, const struct section_fmt *f, struct span sec)
{
	size_t before = json_array_size(ps->calls);
	const char *cb;

	while ((cb = find(sec, f->call_begin))) {
		struct span rest = from(sec, cb + strlen(f->call_begin));
		const char *sep = find(rest, f->sep);
		const char *ce = sep ? find(from(rest, sep + strlen(f->sep)), f->call_end) : NULL;

		if (trim((struct span){ sec.p, (size_t)(cb - sec.p) }).n || !sep || !ce ||
		    f->call(ps, (struct span){ rest.p, (size_t)(sep - rest.p) },
			    (struct span){ sep + strlen(f->sep), (size_t)(ce - sep) - strlen(f->sep) }))
			goto bad;
		sec = from(sec, ce + strlen(f->call_end));
	}
	if (!trim(sec).n && json_array_size(ps->calls) > before)
		return 0;
bad:
	while (json_array_size(ps->calls) > before)
		json_array_remove(ps->calls, json_array_size(ps->calls) - 1);
	return -EINVAL;
}

static void parse_sections(struct parse *ps, const struct section_fmt *f)
{
	struct span s = { ps->s, ps->n };
	const char *b;

	while ((b = find(s, f->begin))) {
		struct span rest = from(s, b + strlen(f->begin));
		const char *e = find(rest, f->end);
		struct span sec = e ? (struct span){ rest.p, (size_t)(e - rest.p) } : rest;
		const char *next = e ? e + strlen(f->end) : s.p + s.n;

		if (!parse_section(ps, f, sec))
			keep(ps, (struct span){ s.p, (size_t)(b - s.p) });
		else
			keep(ps, (struct span){ s.p, (size_t)(next - s.p) });
		s = from(s, next);
	}
	keep(ps, s);
}

/* Kimi-K2: head "functions.NAME:N" (the id), body the arguments object. */
static int kimi_call(struct parse *ps, struct span head, struct span body)
{
	struct span id = trim(head), name = id;
	json_t *args = parse_object(body);

	if (!args)
		return -EINVAL;
	if (name.n > 10 && !memcmp(name.p, "functions.", 10))
		name = (struct span){ name.p + 10, name.n - 10 };
	for (size_t i = name.n; i-- > 0;)
		if (name.p[i] == ':') {
			name.n = i;
			break;
		}
	return add_call(ps, id, name, args);
}

/* DeepSeek-V3: head "function", body "NAME\n```json\n{...}\n```"; V3.1: head NAME,
 * body the arguments object. */
static int deepseek_call(struct parse *ps, struct span head, struct span body)
{
	struct span name = trim(head);
	const char *nl, *fence, *close;
	json_t *args;

	if (name.n == 8 && !memcmp(name.p, "function", 8) && (nl = memchr(body.p, '\n', body.n)) &&
	    (fence = find(from(body, nl), "```json")) && (close = find(from(body, fence + 7), "```"))) {
		name = trim((struct span){ body.p, (size_t)(nl - body.p) });
		body = (struct span){ fence + 7, (size_t)(close - fence - 7) };
	}
	args = parse_object(body);
	return args ? add_call(ps, (struct span){ 0 }, name, args) : -EINVAL;
}

static const struct section_fmt kimi_fmt = {
	"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
	"<|tool_call_argument_begin|>", "<|tool_call_end|>", kimi_call,
};

static const struct section_fmt deepseek_fmt = {
	"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
	"<｜tool▁call▁end｜>", deepseek_call,
};

/* Bytes that are not UTF-8 become U+FFFD, so the prose is a JSON string. */
static char *to_utf8(const char *s, size_t n, size_t *out_n)
{
	char *o = malloc(n * 3 + 1), *p = o;

	if (!o)
		return NULL;
	for (size_t i = 0; i < n;) {
		unsigned char c = (unsigned char)s[i];
		size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 :
			     (c & 0xf8) == 0xf0 ? 4 : 0;
		int ok = len && i + len <= n;
		uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;

		for (size_t j = 1; ok && j < len; j++) {
			ok = ((unsigned char)s[i + j] & 0xc0) == 0x80;
			cp = cp << 6 | ((unsigned char)s[i + j] & 0x3f);
		}
		ok = ok && !(len == 2 && cp < 0x80) && !(len == 3 && cp < 0x800) &&
		     !(len == 4 && (cp < 0x10000 || cp > 0x10ffff)) && !(cp >= 0xd800 && cp < 0xe000);
		if (ok) {
			memcpy(p, s + i, len);
			p += len;
			i += len;
		} else {
			memcpy(p, "\xef\xbf\xbd", 3);
			p += 3;
			i++;
		}
	}
	*out_n = (size_t)(p - o);
	return o;
}

static int finish(struct parse *ps, char **json_out)
{
	struct span c = { ps->content ? ps->content : "", ps->k };
	size_t n;
	char *utf8;
	json_t *doc;

	if (json_array_size(ps->calls))
		c = trim(c);
	utf8 = to_utf8(c.p, c.n, &n);
	doc = utf8 ? json_pack("{s:s%,s:O}", "content", utf8, n, "tool_calls", ps->calls) : NULL;
	free(utf8);
	*json_out = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
	json_decref(doc);
	return *json_out ? 0 : -ENOMEM;
}

int kd_tokenizer_parse_tool_calls(const struct kd_tokenizer *t, const char *text, size_t len,
				  char **json_out)
{
	struct parse ps = { text, len, NULL, NULL, 0, 0, 0 };
	int rc;

	if (!json_out)
		return -EINVAL;
	*json_out = NULL;
	if (!t || (!text && len)) {
		tok_set_error("kd_tokenizer_parse_tool_calls: NULL tokenizer or text");
		return -EINVAL;
	}
	ps.s = text ? text : "";
	ps.calls = json_array();
	if (!ps.calls)
		return -ENOMEM;
	switch (t->chat) {
	case TOK_CHAT_LLAMA31: parse_llama(&ps); break;
	case TOK_CHAT_QWEN25:
	case TOK_CHAT_QWEN3: parse_qwen(&ps); break;
	case TOK_CHAT_KIMI_K2: parse_sections(&ps, &kimi_fmt); break;
	case TOK_CHAT_DEEPSEEK3: parse_sections(&ps, &deepseek_fmt); break;
	default: keep(&ps, (struct span){ ps.s, ps.n });
	}
	rc = ps.oom ? -ENOMEM : finish(&ps, json_out);
	json_decref(ps.calls);
	free(ps.content);
	return rc;
}

void kd_tool_calls_free(char *json)
{
	free(json);
}
