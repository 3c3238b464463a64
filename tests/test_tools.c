/* Tool calling in libkdclient: kd_tokenizer_chat_tools byte for byte against
 * transformers' renders of each family's real template (tests/data/tokenizer/
 * <family>_tools.json, contrib/make_tools_fixture.py), the parsers against model
 * outputs in each documented format (tool_outputs.json), errors, and a small fuzz of
 * the parsers (truncations and mutations of those outputs: no crash, valid JSON). */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"
#include "tests/testutil.h"

struct fam {
	const char *name;	/* fixture prefix and tool_outputs.json key */
	const char *bos;	/* the BOS text the fixture rendered with */
	enum tok_chat chat;	/* what the template must be recognised as */
	int tools;		/* kd_tokenizer_supports_tools */
};

static const struct fam fams[] = {
	{ "llama3_1", "<|begin_of_text|>", TOK_CHAT_LLAMA31, 1 },
	{ "qwen2_5", NULL, TOK_CHAT_QWEN25, 1 },
	{ "qwen3", NULL, TOK_CHAT_QWEN3, 1 },
	{ "kimi_k2", NULL, TOK_CHAT_KIMI_K2, 1 },
	{ "deepseek_v3", "<｜begin▁of▁sentence｜>", TOK_CHAT_DEEPSEEK3, 0 },
};

/* A tokenizer with only a BOS token and the template: what rendering reads. */
static struct kd_tokenizer *tok_with_template(const char *bos, const char *tmpl, size_t len)
{
	struct kd_tokenizer *t = calloc(1, sizeof(*t));

	if (!t)
		return NULL;
	t->bos = t->eos = t->eot = -1;
	t->path = strdup("fixture");
	if (tok_vocab_init(t, 1) || (bos && tok_add_token(t, 0, bos, strlen(bos), 1)) ||
	    tok_build(t) || tok_chat_detect(t, tmpl, len)) {
		kd_tokenizer_close(t);
		return NULL;
	}
	if (bos)
		t->bos = 0;
	return t;
}

static json_t *load(const char *srcdir, const char *name)
{
	char path[PATH_MAX];
	json_error_t err;
	json_t *doc;

	snprintf(path, sizeof(path), "%s/tests/data/tokenizer/%s.json", srcdir, name);
	doc = json_load_file(path, 0, &err);
	CHECK(doc, "%s: %s (line %d)", path, err.text, err.line);
	return doc;
}

/* The fixture's messages as kd_chat_message (strings owned by the fixture or by dumps[]). */
static size_t to_messages(const json_t *msgs, struct kd_chat_message *m, char **dumps, size_t max)
{
	size_t j;
	json_t *mj;

	memset(m, 0, max * sizeof(*m));
	json_array_foreach(msgs, j, mj) {
		const json_t *calls = json_object_get(mj, "tool_calls");

		if (j == max)
			break;
		m[j].role = json_string_value(json_object_get(mj, "role"));
		m[j].content = json_string_value(json_object_get(mj, "content"));
		m[j].tool_call_id = json_string_value(json_object_get(mj, "tool_call_id"));
		m[j].name = json_string_value(json_object_get(mj, "name"));
		dumps[j] = calls ? json_dumps(calls, JSON_COMPACT) : NULL;
		m[j].tool_calls_json = dumps[j];
	}
	return j < max ? j : max;
}

static void check_render(const struct fam *f, struct kd_tokenizer *t, size_t i, const json_t *c)
{
	static char buf[1 << 16];
	struct kd_chat_message m[16];
	char *dumps[16] = { 0 }, *tools = NULL;
	const char *want = json_string_value(json_object_get(c, "text"));
	const json_t *tj = json_object_get(c, "tools");
	int gen = json_is_true(json_object_get(c, "add_generation_prompt"));
	size_t n = to_messages(json_object_get(c, "messages"), m, dumps, 16);
	long k;

	if (json_is_array(tj))
		tools = json_dumps(tj, JSON_COMPACT);
	k = kd_tokenizer_chat_tools(t, m, n, tools, gen, buf, sizeof(buf));
	if (!f->tools && tools) {
		/* the template renders no tool definitions: refused, and without them the
		 * text is HF's (which ignores them) */
		CHECK(k == -ENOTSUP && strstr(kd_tokenizer_error(), "DeepSeek"),
		      "%s: chat %zu with tools: %ld (%s)", f->name, i, k, kd_tokenizer_error());
		k = kd_tokenizer_chat_tools(t, m, n, NULL, gen, buf, sizeof(buf));
	}
	CHECK(k >= 0 && !strcmp(buf, want), "%s: chat %zu:\n got  \"%s\" (%ld)\n want \"%s\"",
	      f->name, i, k >= 0 ? buf : kd_tokenizer_error(), k, want);
	CHECK(k < 0 || kd_tokenizer_chat_tools(t, m, n, f->tools ? tools : NULL, gen, NULL, 0) == k,
	      "%s: chat %zu: size query", f->name, i);
	if (k > 8) {	/* a short buffer: the length still, the text cut and terminated */
		char small[8];

		CHECK(kd_tokenizer_chat_tools(t, m, n, f->tools ? tools : NULL, gen, small, 8) == k,
		      "%s: chat %zu: short buffer", f->name, i);
	}
	for (size_t j = 0; j < n; j++)
		free(dumps[j]);
	free(tools);
}

static void check_parse(const struct fam *f, struct kd_tokenizer *t, size_t i, const json_t *c)
{
	const char *text = json_string_value(json_object_get(c, "text"));
	const json_t *want = json_object_get(c, "calls");
	char *out = NULL;
	json_t *got, *calls, *gc;
	size_t j;
	int rc = kd_tokenizer_parse_tool_calls(t, text, strlen(text), &out);

	got = out ? json_loads(out, 0, NULL) : NULL;
	calls = json_object_get(got, "tool_calls");
	CHECK(!rc && got && json_is_array(calls), "%s: output %zu: rc %d, %s", f->name, i, rc,
	      out ? out : "(none)");
	if (!got)
		goto out;
	CHECK(json_equal(json_object_get(got, "content"), json_object_get(c, "content")),
	      "%s: output %zu: content %s", f->name, i, out);
	CHECK(json_array_size(calls) == json_array_size(want), "%s: output %zu: %zu calls, want %zu: %s",
	      f->name, i, json_array_size(calls), json_array_size(want), out);
	json_array_foreach(calls, j, gc) {
		const json_t *w = json_array_get(want, j);
		json_t *args = json_loads(json_string_value(json_object_get(gc, "arguments")), 0, NULL);

		CHECK(w && json_equal(json_object_get(gc, "id"), json_object_get(w, "id")) &&
		      json_equal(json_object_get(gc, "name"), json_object_get(w, "name")) &&
		      json_equal(args, json_object_get(w, "arguments")),
		      "%s: output %zu: call %zu: %s", f->name, i, j, out);
		json_decref(args);
	}
out:
	json_decref(got);
	free(out);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* Truncations, byte flips, deletions and spliced markers of each output: the parser
 * returns 0 and valid JSON every time (ASan and UBSan builds check the rest). */
static void fuzz_parse(const struct fam *f, struct kd_tokenizer *t, const json_t *outs)
{
	static const char *bits[] = { "<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>",
				      "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
				      "<|tool_call_end|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
				      "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "```json\n", "{", "}",
				      "\"", ":", ";", "<|python_tag|>", "\xff", "\xe4\xb8" };
	size_t n_outs = json_array_size(outs), bad = 0;

	CHECK(n_outs, "%s: no outputs to fuzz", f->name);
	if (!n_outs)
		return;

	for (int it = 0; it < 3000; it++) {
		const char *src = json_string_value(json_object_get(json_array_get(outs,
						       next_rand() % n_outs), "text"));
		size_t len = strlen(src), cap = len + 64, k;
		char *s = malloc(cap), *out = NULL;
		json_t *doc;

		memcpy(s, src, len);
		k = len;
		for (int m = (int)(next_rand() % 4); m >= 0; m--) {
			size_t at = k ? next_rand() % (k + 1) : 0;
			const char *b = bits[next_rand() % (sizeof(bits) / sizeof(bits[0]))];
			size_t bl = strlen(b);

			switch (next_rand() % 4) {
			case 0: k = at; break;					/* truncate */
			case 1: if (at < k) s[at] = (char)next_rand(); break;	/* flip */
			case 2: if (at < k) memmove(s + at, s + at + 1, k - at - 1), k--; break;
			default:
				if (k + bl > cap)
					break;
				memmove(s + at + bl, s + at, k - at);	/* splice a marker */
				memcpy(s + at, b, bl);
				k += bl;
			}
		}
		/* exactly k bytes, no terminator: the parser must stay inside them */
		s = realloc(s, k ? k : 1);
		/* JSON_ALLOW_NUL: a NUL byte in the text is \u0000 in content */
		if (kd_tokenizer_parse_tool_calls(t, s, k, &out) ||
		    !(doc = json_loads(out, JSON_ALLOW_NUL, NULL)) ||
		    !json_is_string(json_object_get(doc, "content")) ||
		    !json_is_array(json_object_get(doc, "tool_calls"))) {
			if (bad++ < 3)
				fprintf(stderr, "%s: fuzz: \"%.*s\" -> %s\n", f->name, (int)k, s,
					out ? out : "(error)");
		} else
			json_decref(doc);
		free(out);
		free(s);
	}
	CHECK(!bad, "%s: fuzz: %zu of 3000 mutated outputs failed or gave bad JSON", f->name, bad);
}

static void check_family(const char *srcdir, const struct fam *f, const json_t *outputs)
{
	char name[64];
	json_t *doc, *c;
	const json_t *tmpl;
	struct kd_tokenizer *t;
	size_t i;

	snprintf(name, sizeof(name), "%s_tools", f->name);
	doc = load(srcdir, name);
	if (!doc)
		return;
	tmpl = json_object_get(doc, "chat_template");
	t = tok_with_template(f->bos, json_string_value(tmpl), json_string_length(tmpl));
	CHECK(t && t->chat == f->chat, "%s: template recognised as %d, want %d", f->name,
	      t ? (int)t->chat : -1, (int)f->chat);
	if (t && t->chat == f->chat) {
		CHECK(kd_tokenizer_supports_tools(t) == f->tools, "%s: supports_tools", f->name);
		json_array_foreach(json_object_get(doc, "chat"), i, c)
			check_render(f, t, i, c);
		json_array_foreach(json_object_get(outputs, f->name), i, c)
			check_parse(f, t, i, c);
		fuzz_parse(f, t, json_object_get(outputs, f->name));
		fprintf(stderr, "%s: %zu renders, %zu outputs checked\n", f->name,
			json_array_size(json_object_get(doc, "chat")),
			json_array_size(json_object_get(outputs, f->name)));
	}
	kd_tokenizer_close(t);
	json_decref(doc);
}

/* Bad input is -EINVAL with a message; a family without tools refuses them by name. */
static void check_errors(void)
{
	static const char chatml[] = "{% for m in messages %}<|im_start|>{{ m.role }}...";
	static const char qwen3[] = "<|im_start|> <tools> <tool_call> reasoning_content";
	struct kd_tokenizer *t = tok_with_template(NULL, chatml, sizeof(chatml) - 1);
	struct kd_tokenizer *q = tok_with_template(NULL, qwen3, sizeof(qwen3) - 1);
	struct kd_chat_message m[2] = { { .role = "user", .content = "hi" },
					{ .role = "assistant", .content = NULL } };
	char buf[256], *out = NULL;

	CHECK(t && q, "tokenizers");
	if (!t || !q)
		goto out;
	CHECK(!kd_tokenizer_supports_tools(t) && !kd_tokenizer_supports_tools(NULL), "ChatML tools");
	CHECK(kd_tokenizer_chat_tools(t, m, 1, "[{\"type\": \"function\", \"function\": {\"name\": "
				      "\"f\"}}]", 1, buf, sizeof(buf)) == -ENOTSUP &&
	      strstr(kd_tokenizer_error(), "ChatML"), "ChatML with tools: %s", kd_tokenizer_error());
	CHECK(kd_tokenizer_chat_tools(t, m, 1, "[]", 1, buf, sizeof(buf)) > 0, "ChatML, tools []");
	{	/* a Llama 3.1 fine-tune with its own tool format (functionary): no tools */
		static const char ft[] = "<|start_header_id|> Cutting Knowledge ... functions";
		struct kd_tokenizer *l = tok_with_template(NULL, ft, sizeof(ft) - 1);

		CHECK(l && l->chat == TOK_CHAT_LLAMA31 && !kd_tokenizer_supports_tools(l) &&
		      kd_tokenizer_chat_tools(l, m, 1, "[{\"function\": {\"name\": \"f\"}}]", 1, buf,
					      sizeof(buf)) == -ENOTSUP &&
		      kd_tokenizer_chat_tools(l, m, 1, NULL, 1, buf, sizeof(buf)) > 0,
		      "Llama 3.1 fine-tune: %s", kd_tokenizer_error());
		kd_tokenizer_close(l);
	}
	CHECK(kd_tokenizer_chat_tools(q, m, 1, "[{", 1, buf, sizeof(buf)) == -EINVAL &&
	      strstr(kd_tokenizer_error(), "tools"), "malformed tools: %s", kd_tokenizer_error());
	CHECK(kd_tokenizer_chat_tools(q, m, 1, "{}", 1, buf, sizeof(buf)) == -EINVAL, "tools {}");
	CHECK(kd_tokenizer_chat_tools(q, m, 1, "[{\"function\": {}}]", 1, buf, sizeof(buf)) == -EINVAL &&
	      strstr(kd_tokenizer_error(), "tools[0]"), "nameless tool: %s", kd_tokenizer_error());
	CHECK(kd_tokenizer_chat_tools(q, m, 2, NULL, 1, buf, sizeof(buf)) == -EINVAL &&
	      strstr(kd_tokenizer_error(), "message 1"), "null content: %s", kd_tokenizer_error());
	m[1].tool_calls_json = "[{\"function\": {\"name\": \"f\", \"arguments\": \"{not json\"}}]";
	CHECK(kd_tokenizer_chat_tools(q, m, 2, NULL, 1, buf, sizeof(buf)) == -EINVAL &&
	      strstr(kd_tokenizer_error(), "tool_calls[0]"), "bad arguments: %s", kd_tokenizer_error());
	m[1].tool_calls_json = "[{\"function\": {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}}]";
	CHECK(kd_tokenizer_chat_tools(q, m, 2, NULL, 0, buf, sizeof(buf)) > 0 &&
	      strstr(buf, "{\"name\": \"f\", \"arguments\": {\"a\": 1}}"), "string arguments: %s", buf);
	CHECK(kd_tokenizer_parse_tool_calls(t, "x", 1, NULL) == -EINVAL, "parse: NULL out");
	CHECK(!kd_tokenizer_parse_tool_calls(t, "<tool_call>", 11, &out) && out &&
	      strstr(out, "\"tool_calls\":[]"), "parse without tools: %s", out ? out : "");
	kd_tool_calls_free(out);
out:
	kd_tokenizer_close(t);
	kd_tokenizer_close(q);
}

int main(void)
{
	const char *srcdir = getenv("top_srcdir");
	json_t *outputs;

	if (!srcdir)
		srcdir = ".";
	outputs = load(srcdir, "tool_outputs");
	for (size_t i = 0; outputs && i < sizeof(fams) / sizeof(fams[0]); i++)
		check_family(srcdir, &fams[i], outputs);
	check_errors();
	json_decref(outputs);
	return test_result("test_tools");
}
