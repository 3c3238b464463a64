/* The vocabulary and merge tables: tokens by id with their decoded bytes, a hash of
 * token text -> id, a hash of (left id, right id) -> (rank, merged id), and GPT-2's
 * byte <-> code point map that byte-level vocabularies are written in. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client/tokenizer.h"
#include "client/tokenizer_unicode.h"

/* GPT-2's map: printable Latin-1 bytes stand for themselves, the other 68 bytes take
 * code points 256, 257, ... in byte order (0..32 -> 256..288, 127..160 -> 289..322,
 * 173 -> 323), so every byte has a visible character. */
static int byte_is_printable(unsigned b)
{
	return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
}

uint32_t tok_byte_to_cp(unsigned char b)
{
	if (byte_is_printable(b))
		return b;
	if (b <= 32)
		return 256 + b;
	if (b <= 160)
		return 289 + (b - 127u);
	return 323;	/* 173, the soft hyphen */
}

int tok_cp_to_byte(uint32_t cp)
{
	if (cp < 256)
		return byte_is_printable(cp) ? (int)cp : -1;
	if (cp <= 288)
		return (int)(cp - 256);
	if (cp <= 322)
		return (int)(cp - 289 + 127);
	return cp == 323 ? 173 : -1;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull;	/* FNV-1a */

	for (size_t i = 0; i < n; i++)
		h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
	return h ^ h >> 29;
}

static uint64_t hash_pair(uint64_t key)
{
	key *= 0x9e3779b97f4a7c15ull;
	return key ^ key >> 31;
}

static int strings_append(struct kd_tokenizer *t, const char *s, size_t n, uint32_t *off)
{
	if (t->strings_len + n > UINT32_MAX)
		return -E2BIG;
	if (t->strings_len + n > t->strings_cap) {
		size_t cap = t->strings_cap ? t->strings_cap * 2 : 1 << 20;
		char *p;

		while (cap < t->strings_len + n)
			cap *= 2;
		p = realloc(t->strings, cap);
		if (!p)
			return -ENOMEM;
		t->strings = p;
		t->strings_cap = cap;
	}
	memcpy(t->strings + t->strings_len, s, n);
	*off = (uint32_t)t->strings_len;
	t->strings_len += n;
	return 0;
}

int tok_vocab_init(struct kd_tokenizer *t, uint32_t n_vocab)
{
	if (!n_vocab || n_vocab > TOK_MAX_VOCAB) {
		tok_set_error("%s: %u tokens (want 1..%u)", t->path, n_vocab, TOK_MAX_VOCAB);
		return -EINVAL;
	}
	t->tokens = calloc(n_vocab, sizeof(*t->tokens));
	if (!t->tokens)
		return -ENOMEM;
	t->n_vocab = n_vocab;
	return 0;
}

/* Every token decodes through the byte map, special ones too, as HF's ByteLevel
 * decoder does (DeepSeek's added token "ü" is the byte 0xFC); a character outside the
 * map ("<|im_end|>" is all inside it, "<｜begin▁of▁sentence｜>" is not) decodes as
 * itself. */
static int token_decode_bytes(struct kd_tokenizer *t, struct tok_token *tk)
{
	char buf[TOK_MAX_TOKEN_BYTES];
	const unsigned char *s = (const unsigned char *)t->strings + tk->text_off;
	size_t n = 0;

	for (size_t i = 0; i < tk->text_len;) {
		uint32_t cp;
		int k = tok_utf8_decode(s + i, tk->text_len - i, &cp);
		int b = tok_cp_to_byte(cp);

		if (b >= 0)
			buf[n++] = (char)b;
		else
			for (int j = 0; j < k; j++)
				buf[n++] = (char)s[i + j];
		i += (size_t)k;
	}
	tk->bytes_len = (uint32_t)n;
	return strings_append(t, buf, n, &tk->bytes_off);
}

int tok_add_token(struct kd_tokenizer *t, uint32_t id, const char *text, size_t len, int special)
{
	struct tok_token *tk;
	int ret;

	if (id >= t->n_vocab) {
		tok_set_error("%s: token id %u past the vocabulary (%u)", t->path, id, t->n_vocab);
		return -EINVAL;
	}
	if (!len || len > TOK_MAX_TOKEN_BYTES) {
		tok_set_error("%s: token %u is %zu bytes (want 1..%d)", t->path, id, len,
			      TOK_MAX_TOKEN_BYTES);
		return -EINVAL;
	}
	tk = &t->tokens[id];
	ret = strings_append(t, text, len, &tk->text_off);
	if (ret)
		return ret;
	tk->text_len = (uint32_t)len;
	tk->special = special ? 1 : 0;
	return token_decode_bytes(t, tk);
}

int32_t tok_find(const struct kd_tokenizer *t, const char *text, size_t len)
{
	uint32_t i = (uint32_t)hash_bytes(text, len) & t->vocab_mask;

	if (!t->vocab_slots)
		return -1;
	for (;; i = (i + 1) & t->vocab_mask) {
		uint32_t v = t->vocab_slots[i];
		const struct tok_token *tk;

		if (!v)
			return -1;
		tk = &t->tokens[v - 1];
		if (tk->text_len == len && !memcmp(t->strings + tk->text_off, text, len))
			return (int32_t)(v - 1);
	}
}

static int cmp_special_len(const void *a, const void *b, void *arg)
{
	const struct kd_tokenizer *t = arg;
	uint32_t la = t->tokens[*(const int32_t *)a].text_len;
	uint32_t lb = t->tokens[*(const int32_t *)b].text_len;

	if (la != lb)
		return la > lb ? -1 : 1;
	return *(const int32_t *)a < *(const int32_t *)b ? -1 : 1;
}

/* Indexes the tokens: the text hash (a duplicated text keeps its lowest id, as a
 * vocabulary map would), the byte tokens, the special tokens longest first. */
int tok_build(struct kd_tokenizer *t)
{
	uint32_t cap = 1;
	char cpbuf[4];

	while (cap < t->n_vocab * 2u)
		cap <<= 1;
	t->vocab_slots = calloc(cap, sizeof(*t->vocab_slots));
	t->special = calloc(t->n_vocab, sizeof(*t->special));
	if (!t->vocab_slots || !t->special)
		return -ENOMEM;
	t->vocab_mask = cap - 1;
	for (uint32_t id = 0; id < t->n_vocab; id++) {
		const struct tok_token *tk = &t->tokens[id];

		if (!tk->text_len)
			continue;
		if (tok_find(t, t->strings + tk->text_off, tk->text_len) < 0) {
			uint32_t i = (uint32_t)hash_bytes(t->strings + tk->text_off, tk->text_len) &
				     t->vocab_mask;

			while (t->vocab_slots[i])
				i = (i + 1) & t->vocab_mask;
			t->vocab_slots[i] = id + 1;
		}
		if (tk->special && t->n_special < TOK_MAX_SPECIAL) {
			t->special[t->n_special++] = (int32_t)id;
			t->special_first[(unsigned char)t->strings[tk->text_off]] = 1;
		}
	}
	qsort_r(t->special, t->n_special, sizeof(*t->special), cmp_special_len, t);
	for (unsigned b = 0; b < 256; b++) {
		int n = tok_utf8_encode(tok_byte_to_cp((unsigned char)b), cpbuf);

		t->byte_id[b] = tok_find(t, cpbuf, (size_t)n);
	}
	return 0;
}

static struct tok_merge_slot *merge_slot(const struct kd_tokenizer *t, uint64_t key)
{
	uint32_t i = (uint32_t)hash_pair(key) & t->merge_mask;

	while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
		i = (i + 1) & t->merge_mask;
	return &t->merges[i];
}

static int merges_grow(struct kd_tokenizer *t)
{
	uint32_t old_n = t->merges ? t->merge_mask + 1 : 0, cap = old_n ? old_n * 2 : 1 << 16;
	struct tok_merge_slot *old = t->merges;

	t->merges = malloc(sizeof(*t->merges) * cap);
	if (!t->merges) {
		t->merges = old;
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < cap; i++)
		t->merges[i].key = UINT64_MAX;
	t->merge_mask = cap - 1;
	for (uint32_t i = 0; i < old_n; i++)
		if (old[i].key != UINT64_MAX)
			*merge_slot(t, old[i].key) = old[i];
	free(old);
	return 0;
}

/* One merge rule "left right", in rank order. A rule whose parts or result are not
 * tokens can never fire (HF refuses such files; we skip the rule). */
int tok_add_merge(struct kd_tokenizer *t, const char *left, size_t llen, const char *right,
		  size_t rlen)
{
	char buf[2 * TOK_MAX_TOKEN_BYTES];
	int32_t a = tok_find(t, left, llen), b = tok_find(t, right, rlen), m;
	struct tok_merge_slot *s;
	uint32_t rank = t->n_merges++;
	int ret;

	if (a < 0 || b < 0 || llen + rlen > sizeof(buf))
		return 0;
	memcpy(buf, left, llen);
	memcpy(buf + llen, right, rlen);
	m = tok_find(t, buf, llen + rlen);
	if (m < 0)
		return 0;
	if (!t->merges || (t->n_merges + 1) * 2 > t->merge_mask + 1) {
		ret = merges_grow(t);
		if (ret)
			return ret;
	}
	s = merge_slot(t, (uint64_t)(uint32_t)a << 32 | (uint32_t)b);
	if (s->key != UINT64_MAX)
		return 0;	/* a repeated rule keeps its first rank */
	s->key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	s->rank = rank;
	s->merged = m;
	return 0;
}

const struct tok_merge_slot *tok_merge_find(const struct kd_tokenizer *t, int32_t a, int32_t b)
{
	const struct tok_merge_slot *s;

	if (!t->merges)
		return NULL;
	s = merge_slot(t, (uint64_t)(uint32_t)a << 32 | (uint32_t)b);
	return s->key == UINT64_MAX ? NULL : s;
}
