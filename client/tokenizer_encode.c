/* Encoding: special tokens found in the text (when asked), the pre-tokenizer's pieces,
 * and byte-level BPE on each piece: start from one token per byte and apply the
 * lowest-ranked adjacent merge (leftmost on ties) until none applies, with a heap of
 * candidate pairs so a long piece costs O(n log n). Also decoding. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client/tokenizer.h"
#include "client/tokenizer_unicode.h"

#define TOK_MAX_TEXT (1u << 30)	/* bytes one encode call accepts */

struct bpe_sym {
	int32_t id;
	int32_t prev, next;	/* neighbours in the piece; -1 at the ends */
	int dead;
};

struct bpe_cand {
	uint32_t rank;
	int32_t left;		/* symbol index of the pair's left side */
	int32_t lid, rid, merged;
};

/* Scratch sized for the text between two special tokens, so a piece never allocates. */
struct encode_ctx {
	const struct kd_tokenizer *t;
	const char *text;	/* the stretch being encoded (NFC-normalised if the model does) */
	struct bpe_sym *sym;	/* (its length) */
	struct bpe_cand *heap;	/* (3 * its length) */
	char *mapped;		/* (4 * its length) a piece in the vocabulary's spelling */
	int32_t *ids;		/* caller's buffer (max_ids) */
	size_t max_ids, n_ids;
};

static void out_id(struct encode_ctx *c, int32_t id)
{
	if (c->n_ids < c->max_ids)
		c->ids[c->n_ids] = id;
	c->n_ids++;
}

static int cand_less(const struct bpe_cand *a, const struct bpe_cand *b)
{
	return a->rank != b->rank ? a->rank < b->rank : a->left < b->left;
}

static void heap_push(struct bpe_cand *h, size_t *n, struct bpe_cand v)
{
	size_t i = (*n)++;

	while (i && cand_less(&v, &h[(i - 1) / 2])) {
		h[i] = h[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h[i] = v;
}

static struct bpe_cand heap_pop(struct bpe_cand *h, size_t *n)
{
	struct bpe_cand top = h[0], last = h[--*n];
	size_t i = 0;

	for (;;) {
		size_t c = 2 * i + 1;

		if (c >= *n)
			break;
		if (c + 1 < *n && cand_less(&h[c + 1], &h[c]))
			c++;
		if (!cand_less(&h[c], &last))
			break;
		h[i] = h[c];
		i = c;
	}
	if (*n)
		h[i] = last;
	return top;
}

static void try_pair(struct encode_ctx *c, size_t *nh, int32_t left)
{
	const struct bpe_sym *l = &c->sym[left];
	const struct tok_merge_slot *m;

	if (l->next < 0)
		return;
	m = tok_merge_find(c->t, l->id, c->sym[l->next].id);
	if (m)
		heap_push(c->heap, nh, (struct bpe_cand){ m->rank, left, l->id,
							 c->sym[l->next].id, m->merged });
}

/* The piece in the vocabulary's spelling (each byte as its mapped code point). */
static size_t map_piece(struct encode_ctx *c, const unsigned char *p, size_t n)
{
	size_t k = 0;

	for (size_t i = 0; i < n; i++)
		k += (size_t)tok_utf8_encode(tok_byte_to_cp(p[i]), c->mapped + k);
	return k;
}

static int bpe_piece(void *ctx, size_t off, size_t n)
{
	struct encode_ctx *c = ctx;
	const struct kd_tokenizer *t = c->t;
	const unsigned char *p = (const unsigned char *)c->text + off;
	size_t nh = 0;
	int32_t ns = 0;

	if (t->ignore_merges) {
		int32_t whole = tok_find(t, c->mapped, map_piece(c, p, n));

		if (whole >= 0) {
			out_id(c, whole);
			return 0;
		}
	}
	for (size_t i = 0; i < n; i++) {
		int32_t id = t->byte_id[p[i]];

		/* a byte the vocabulary lacks (SmolLM2 has no token for 0x04) is dropped, as
		 * HF's BPE does without an unk_token */
		if (id < 0)
			continue;
		c->sym[ns] = (struct bpe_sym){ id, ns - 1, -1, 0 };
		if (ns)
			c->sym[ns - 1].next = ns;
		ns++;
	}
	for (int32_t i = 0; i < ns; i++)
		try_pair(c, &nh, i);
	while (nh) {
		struct bpe_cand v = heap_pop(c->heap, &nh);
		struct bpe_sym *l = &c->sym[v.left], *r;

		/* stale: the left symbol changed or its neighbour did */
		if (l->dead || l->id != v.lid || l->next < 0 || c->sym[l->next].id != v.rid)
			continue;
		r = &c->sym[l->next];
		l->id = v.merged;
		r->dead = 1;
		l->next = r->next;
		if (r->next >= 0)
			c->sym[r->next].prev = v.left;
		if (l->prev >= 0)
			try_pair(c, &nh, l->prev);
		try_pair(c, &nh, v.left);
	}
	for (int32_t i = ns ? 0 : -1; i >= 0; i = c->sym[i].next)
		out_id(c, c->sym[i].id);
	return 0;
}

/* The longest special token starting at s[0..n), or -1. */
static int32_t special_at(const struct kd_tokenizer *t, const char *s, size_t n)
{
	if (!t->special_first[(unsigned char)s[0]])
		return -1;
	for (uint32_t i = 0; i < t->n_special; i++) {
		const struct tok_token *tk = &t->tokens[t->special[i]];

		if (tk->text_len <= n && !memcmp(s, t->strings + tk->text_off, tk->text_len))
			return t->special[i];
	}
	return -1;
}

/* Encodes a stretch of text without special tokens: normalise (Qwen2: NFC), split,
 * merge each piece. */
static int encode_text(struct encode_ctx *c, const char *s, size_t len)
{
	char *norm = NULL;
	size_t norm_len;
	int ret;

	if (!len)
		return 0;
	if (c->t->nfc) {
		ret = tok_nfc(s, len, &norm, &norm_len);
		if (ret)
			return ret;
		if (norm) {
			s = norm;
			len = norm_len;
		}
	}
	c->text = s;	/* the pre-tokenizer's offsets are from s */
	c->sym = malloc(sizeof(*c->sym) * (len + 1));
	c->heap = malloc(sizeof(*c->heap) * (3 * len + 1));
	c->mapped = malloc(4 * len + 1);
	ret = c->sym && c->heap && c->mapped ? tok_pretokenize(c->t->pre, s, len, bpe_piece, c) :
					       -ENOMEM;
	free(c->sym);
	free(c->heap);
	free(c->mapped);
	free(norm);
	return ret;
}

long kd_tokenizer_encode(const struct kd_tokenizer *t, const char *text, size_t len,
			 unsigned flags, int32_t *ids, size_t max_ids)
{
	struct encode_ctx c = { .t = t, .text = text, .ids = ids, .max_ids = ids ? max_ids : 0 };
	size_t start = 0;
	int ret = 0;

	if (!t || (!text && len) || (flags & ~(KD_TOKENIZE_ADD_SPECIAL | KD_TOKENIZE_SPECIAL)))
		return -EINVAL;
	if (len > TOK_MAX_TEXT)
		return -E2BIG;
	if ((flags & KD_TOKENIZE_ADD_SPECIAL) && t->add_bos && t->bos >= 0)
		out_id(&c, t->bos);
	for (size_t i = 0; (flags & KD_TOKENIZE_SPECIAL) && i < len; i++) {
		int32_t sp = special_at(t, text + i, len - i);

		if (sp < 0)
			continue;
		ret = encode_text(&c, text + start, i - start);
		if (ret)
			return ret;
		out_id(&c, sp);
		i += t->tokens[sp].text_len - 1;
		start = i + 1;
	}
	ret = encode_text(&c, text + start, len - start);
	return ret ? ret : (long)c.n_ids;
}

long kd_tokenizer_decode(const struct kd_tokenizer *t, const int32_t *ids, size_t n,
			 unsigned flags, char *buf, size_t len)
{
	size_t k = 0;

	if (!t || (!ids && n) || (!buf && len))
		return -EINVAL;
	for (size_t i = 0; i < n; i++) {
		const struct tok_token *tk;

		if (ids[i] < 0 || (uint32_t)ids[i] >= t->n_vocab)
			return -EINVAL;
		tk = &t->tokens[ids[i]];
		if (tk->special && (flags & KD_DECODE_SKIP_SPECIAL))
			continue;
		if (k < len)
			memcpy(buf + k, t->strings + tk->bytes_off,
			       len - k < tk->bytes_len ? len - k : tk->bytes_len);
		k += tk->bytes_len;
	}
	return (long)k;
}
