/* Incremental decoding: token bytes go into a small buffer and only complete UTF-8
 * characters leave it, so a character split across tokens (an emoji's four bytes in
 * two byte-level tokens) is printed whole. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client/tokenizer.h"
#include "client/tokenizer_unicode.h"

#define STREAM_HELD_MAX 3	/* bytes of an incomplete character kept between pushes */
static const char replacement[] = "\xef\xbf\xbd";	/* U+FFFD */

struct kd_tokenizer_stream {
	const struct kd_tokenizer *t;
	unsigned flags;		/* KD_DECODE_* */
	unsigned char held[STREAM_HELD_MAX];
	size_t n_held;
	char *out;		/* (out_cap) bytes handed back by the last push */
	size_t out_cap;
};

int kd_tokenizer_stream_create(struct kd_tokenizer_stream **out, const struct kd_tokenizer *t,
			       unsigned flags)
{
	struct kd_tokenizer_stream *s;

	*out = NULL;
	if (!t || (flags & ~KD_DECODE_SKIP_SPECIAL))
		return -EINVAL;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->t = t;
	s->flags = flags;
	/* a token's bytes, the held bytes, and each byte possibly widened to U+FFFD */
	s->out_cap = 3 * (TOK_MAX_TOKEN_BYTES + STREAM_HELD_MAX);
	s->out = malloc(s->out_cap);
	if (!s->out) {
		free(s);
		return -ENOMEM;
	}
	*out = s;
	return 0;
}

void kd_tokenizer_stream_destroy(struct kd_tokenizer_stream *s)
{
	if (!s)
		return;
	free(s->out);
	free(s);
}

/* The length a valid sequence starting with lead byte c has, or 0 for a byte that
 * cannot start one. */
static size_t utf8_need(unsigned char c)
{
	if (c < 0x80)
		return 1;
	if (c >= 0xc2 && c <= 0xdf)
		return 2;
	if (c >= 0xe0 && c <= 0xef)
		return 3;
	if (c >= 0xf0 && c <= 0xf4)
		return 4;
	return 0;
}

/* 1 if b[0..n) (n < the lead byte's need) can still grow into a valid character. */
static int utf8_prefix_ok(const unsigned char *b, size_t n)
{
	for (size_t i = 1; i < n; i++) {
		if ((b[i] & 0xc0) != 0x80)
			return 0;
	}
	/* second-byte limits that rule out overlongs, surrogates and > U+10FFFF */
	if (n >= 2 && ((b[0] == 0xe0 && b[1] < 0xa0) || (b[0] == 0xed && b[1] > 0x9f) ||
		       (b[0] == 0xf0 && b[1] < 0x90) || (b[0] == 0xf4 && b[1] > 0x8f)))
		return 0;
	return 1;
}

/* Moves the complete characters of b[0..n) to s->out (from *k), invalid bytes as
 * U+FFFD, and keeps a valid incomplete tail in s->held. */
static void drain(struct kd_tokenizer_stream *s, const unsigned char *b, size_t n, size_t *k)
{
	size_t i = 0;

	while (i < n) {
		size_t need = utf8_need(b[i]), avail = n - i;
		uint32_t cp;

		if (need && avail < need && utf8_prefix_ok(b + i, avail)) {
			memcpy(s->held, b + i, avail);
			s->n_held = avail;
			return;
		}
		if (need && avail >= need && tok_utf8_decode(b + i, need, &cp) == (int)need &&
		    cp < TOK_CP_INVALID) {
			memcpy(s->out + *k, b + i, need);
			*k += need;
			i += need;
			continue;
		}
		memcpy(s->out + *k, replacement, 3);
		*k += 3;
		i++;
	}
	s->n_held = 0;
}

int kd_tokenizer_stream_push(struct kd_tokenizer_stream *s, int32_t id, const char **text,
			     size_t *len)
{
	unsigned char buf[STREAM_HELD_MAX + TOK_MAX_TOKEN_BYTES];
	const struct tok_token *tk;
	size_t n = s->n_held, k = 0;

	*text = s->out;
	*len = 0;
	if (id < 0 || (uint32_t)id >= s->t->n_vocab)
		return -EINVAL;
	tk = &s->t->tokens[id];
	if (tk->special && (s->flags & KD_DECODE_SKIP_SPECIAL))
		return 0;
	memcpy(buf, s->held, n);
	memcpy(buf + n, s->t->strings + tk->bytes_off, tk->bytes_len);
	drain(s, buf, n + tk->bytes_len, &k);
	*len = k;
	return 0;
}

int kd_tokenizer_stream_finish(struct kd_tokenizer_stream *s, const char **text, size_t *len)
{
	*text = s->out;
	*len = 0;
	if (s->n_held) {
		memcpy(s->out, replacement, 3);
		*len = 3;
		s->n_held = 0;
	}
	return 0;
}
