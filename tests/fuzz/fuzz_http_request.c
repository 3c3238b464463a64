/* libFuzzer target: kdhttpd's front ends on an arbitrary request body and arbitrary
 * model output, as a network client and a model could send them. The first byte picks
 * the API (chat completions, completions, Anthropic messages) and the tokenizer
 * (bytes512, or its vocabulary under Qwen3's tool-calling template); the next two give
 * the body's length, then the body; the rest is the model's output, token ids (two
 * bytes each) detokenized as kdhttpd does. openai_parse / anthropic_parse must answer
 * 0 with every prompt id inside the vocabulary, or -1 with an HTTP status 400..599 and
 * a message; the error body and, after a parse, the response (tool calls split from
 * the prose where tools are in play) must be JSON. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"
#include "http/http_call.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* FUZZ_TOKENIZERS: the tree's tests/data/tokenizer (set by the build) */
static struct kd_tokenizer *toks[2];

static struct kd_tokenizer *tokenizer(int i)
{
	static const char *const dirs[] = { "bytes512", "bytes512_qwen3" };
	char path[1024];

	if (!toks[i]) {
		snprintf(path, sizeof(path), "%s/%s", FUZZ_TOKENIZERS, dirs[i]);
		if (kd_tokenizer_open(&toks[i], path)) {
			fprintf(stderr, "fuzz_http_request: tokenizer %s: %s\n", path,
				kd_tokenizer_error());
			abort();
		}
	}
	return toks[i];
}

static void must_be_json(const char *s, const char *what)
{
	json_error_t je;
	json_t *v;

	if (!s) {
		fprintf(stderr, "fuzz_http_request: no %s\n", what);
		abort();
	}
	if (!(v = json_loads(s, JSON_ALLOW_NUL, &je))) {	/* a model may emit NUL: \u0000 */
		fprintf(stderr, "fuzz_http_request: %s is not JSON (%s): %.200s\n", what, je.text, s);
		abort();
	}
	json_decref(v);
}

static void append(struct call *c, const char *piece, size_t len)
{
	if (!len)
		return;
	if (c->len + len > c->cap) {
		c->cap = 2 * (c->len + len);
		if (!(c->text = realloc(c->text, c->cap)))
			abort();
	}
	memcpy(c->text + c->len, piece, len);
	c->len += len;
}

/* The model's output into c->text, through the detokenizer kdhttpd streams with. */
static void generate(struct call *c, const uint8_t *p, size_t n)
{
	struct kd_tokenizer_stream *ds;
	const char *piece;
	size_t len;
	int vocab = kd_tokenizer_n_vocab(c->tok);

	if (kd_tokenizer_stream_create(&ds, c->tok, KD_DECODE_SKIP_SPECIAL))
		abort();
	for (size_t i = 0; i + 1 < n; i += 2) {
		int32_t id = (int32_t)(((unsigned)p[i] << 8 | p[i + 1]) % (unsigned)vocab);

		if (kd_tokenizer_stream_push(ds, id, &piece, &len))
			abort();
		append(c, piece, len);
		c->n_gen++;
	}
	if (kd_tokenizer_stream_finish(ds, &piece, &len))
		abort();
	append(c, piece, len);
	kd_tokenizer_stream_destroy(ds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const enum call_api apis[] = { API_CHAT, API_COMPLETION, API_MESSAGES, API_CHAT };
	struct call c = { 0 };
	struct call_err e = { 0 };
	json_t *body;
	size_t blen;
	int ret;

	if (size < 3)
		return 0;
	c.api = apis[data[0] & 3];
	c.tok = tokenizer(data[0] >> 2 & 1);
	c.model = "fuzz";
	c.client_fd = -1;
	snprintf(c.id, sizeof(c.id), "fuzz");
	blen = (size_t)data[1] << 8 | data[2];
	if (blen > size - 3)
		blen = size - 3;
	/* as prepare() in http_server.c: a JSON object, duplicates refused */
	body = json_loadb((const char *)data + 3, blen, JSON_REJECT_DUPLICATES, NULL);
	if (!json_is_object(body)) {
		json_decref(body);
		return 0;
	}
	ret = c.api == API_MESSAGES ? anthropic_parse(&c, body, &e) : openai_parse(&c, body, &e);
	json_decref(body);
	if (ret) {
		char *eb = c.api == API_MESSAGES ? anthropic_error_body(&e) : openai_error_body(&e);

		if (ret != -1 || e.status < 400 || e.status > 599 || !e.msg[0]) {
			fprintf(stderr, "fuzz_http_request: parse %d, status %d, message '%s'\n", ret,
				e.status, e.msg);
			abort();
		}
		must_be_json(eb, "error body");
		free(eb);
		call_free(&c);
		return 0;
	}
	for (uint32_t i = 0; i < c.req.n_prompt; i++)
		if (c.req.prompt[i] < 0 || c.req.prompt[i] >= kd_tokenizer_n_vocab(c.tok)) {
			fprintf(stderr, "fuzz_http_request: prompt[%u] %d outside the vocabulary\n", i,
				c.req.prompt[i]);
			abort();
		}
	generate(&c, data + 3 + blen, size - 3 - blen);
	c.fin = data[0] & 8 ? FIN_LENGTH : FIN_TOKEN;
	{
		char *r = c.api == API_MESSAGES ? anthropic_response(&c) : openai_response(&c);

		must_be_json(r, "response");
		free(r);
	}
	call_free(&c);
	return 0;
}
