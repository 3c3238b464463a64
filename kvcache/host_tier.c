/* Byte shuffle, the zstd codec of one block, and the reference-counted store of
 * compressed blocks with its budget. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "kvcache/host_tier.h"

/* ---- shuffle ------------------------------------------------------------ */

void kv_shuffle(void *dst, const void *src, size_t n, size_t elem_bytes)
{
	const uint8_t *s = src;
	uint8_t *d = dst;

	if (elem_bytes == 2) {	/* the hot case (bf16): two planes in one pass */
		for (size_t i = 0; i < n; i++) {
			d[i] = s[2 * i];
			d[n + i] = s[2 * i + 1];
		}
		return;
	}
	for (size_t p = 0; p < elem_bytes; p++)
		for (size_t i = 0; i < n; i++)
			d[p * n + i] = s[i * elem_bytes + p];
}

void kv_unshuffle(void *dst, const void *src, size_t n, size_t elem_bytes)
{
	const uint8_t *s = src;
	uint8_t *d = dst;

	if (elem_bytes == 2) {
		for (size_t i = 0; i < n; i++) {
			d[2 * i] = s[i];
			d[2 * i + 1] = s[n + i];
		}
		return;
	}
	for (size_t p = 0; p < elem_bytes; p++)
		for (size_t i = 0; i < n; i++)
			d[i * elem_bytes + p] = s[p * n + i];
}

/* ---- codec -------------------------------------------------------------- */

int kv_codec_init(struct kv_codec *c, size_t raw_bytes, size_t elem_bytes, int level, int shuffle)
{
	memset(c, 0, sizeof(*c));
	if (!raw_bytes || !elem_bytes || raw_bytes % elem_bytes)
		return -EINVAL;
	c->raw_bytes = raw_bytes;
	c->elem_bytes = elem_bytes;
	c->shuffle = shuffle && elem_bytes > 1;
	c->level = level;
	c->cctx = ZSTD_createCCtx();
	c->dctx = ZSTD_createDCtx();
	c->tmp = malloc(raw_bytes);
	if (!c->cctx || !c->dctx || !c->tmp)
		goto err_fini;
	if (ZSTD_isError(ZSTD_CCtx_setParameter(c->cctx, ZSTD_c_compressionLevel, level)) ||
	    ZSTD_isError(ZSTD_CCtx_setParameter(c->cctx, ZSTD_c_checksumFlag, 1)) ||
	    ZSTD_isError(ZSTD_CCtx_setParameter(c->cctx, ZSTD_c_contentSizeFlag, 1)))
		goto err_fini;
	return 0;

err_fini:
	kv_codec_fini(c);
	return -ENOMEM;
}

void kv_codec_fini(struct kv_codec *c)
{
	ZSTD_freeCCtx(c->cctx);
	ZSTD_freeDCtx(c->dctx);
	free(c->tmp);
	memset(c, 0, sizeof(*c));
}

size_t kv_codec_bound(const struct kv_codec *c)
{
	return ZSTD_compressBound(c->raw_bytes);
}

/* Each plane goes into zstd blocks of its own (a flush ends a block): zstd keeps
 * one Huffman table per block for all literals, so planes that shared a block would
 * share one table and the exponent plane's low entropy would be lost in the mix. */
static int compress_planes(struct kv_codec *c, void *dst, size_t cap, size_t *zbytes)
{
	size_t plane = c->raw_bytes / c->elem_bytes, rem;
	ZSTD_outBuffer out = { dst, cap, 0 };

	if (ZSTD_isError(ZSTD_CCtx_reset(c->cctx, ZSTD_reset_session_only)) ||
	    ZSTD_isError(ZSTD_CCtx_setPledgedSrcSize(c->cctx, c->raw_bytes)))
		return -EIO;
	for (size_t p = 0; p < c->elem_bytes; p++) {
		ZSTD_inBuffer in = { c->tmp + p * plane, plane, 0 };
		ZSTD_EndDirective mode = p + 1 == c->elem_bytes ? ZSTD_e_end : ZSTD_e_flush;

		do {
			rem = ZSTD_compressStream2(c->cctx, &out, &in, mode);
			if (ZSTD_isError(rem) || (rem && out.pos == out.size))
				return -EIO;
		} while (rem || in.pos < in.size);
	}
	*zbytes = out.pos;
	return 0;
}

int kv_codec_compress(struct kv_codec *c, void *dst, size_t cap, size_t *zbytes, const void *raw)
{
	size_t n;

	if (c->shuffle) {
		kv_shuffle(c->tmp, raw, c->raw_bytes / c->elem_bytes, c->elem_bytes);
		return compress_planes(c, dst, cap, zbytes);
	}
	n = ZSTD_compress2(c->cctx, dst, cap, raw, c->raw_bytes);
	if (ZSTD_isError(n))
		return -EIO;
	*zbytes = n;
	return 0;
}

int kv_codec_decompress(struct kv_codec *c, void *raw, const void *z, size_t zbytes)
{
	const uint8_t *zb = z;
	void *dst = c->shuffle ? c->tmp : raw;
	size_t n;

	/* exactly one frame of the right size with its checksum flag (bit 2 of the frame
	 * header descriptor, byte 4) set: a damaged header could otherwise switch the
	 * checksum off or end the frame early */
	if (zbytes < 5 || ZSTD_getFrameContentSize(z, zbytes) != (unsigned long long)c->raw_bytes ||
	    !(zb[4] & 0x04) || ZSTD_findFrameCompressedSize(z, zbytes) != zbytes)
		return -EBADMSG;
	n = ZSTD_decompressDCtx(c->dctx, dst, c->raw_bytes, z, zbytes);
	if (ZSTD_isError(n) || n != c->raw_bytes)
		return -EBADMSG;
	if (c->shuffle)
		kv_unshuffle(raw, c->tmp, c->raw_bytes / c->elem_bytes, c->elem_bytes);
	return 0;
}

/* ---- store -------------------------------------------------------------- */

#define HOST_MIN_BUCKETS 64

int kv_host_init(struct kv_host *h, size_t budget)
{
	memset(h, 0, sizeof(*h));
	h->buckets = calloc(HOST_MIN_BUCKETS, sizeof(*h->buckets));
	if (!h->buckets)
		return -ENOMEM;
	h->mask = HOST_MIN_BUCKETS - 1;
	h->budget = budget;
	return 0;
}

void kv_host_fini(struct kv_host *h)
{
	/* private blocks are not on the chains: their holders must have dropped them */
	for (uint32_t i = 0; h->buckets && i <= h->mask; i++) {
		struct kv_host_block *b = h->buckets[i], *next;

		for (; b; b = next) {
			next = b->next;
			free(b);
		}
	}
	free(h->buckets);
	memset(h, 0, sizeof(*h));
}

static struct kv_host_block **bucket_of(const struct kv_host *h, struct kv_key key)
{
	return &h->buckets[(uint32_t)key.lo & h->mask];
}

struct kv_host_block *kv_host_find(const struct kv_host *h, struct kv_key key, uint64_t salt)
{
	for (struct kv_host_block *b = *bucket_of(h, key); b; b = b->next)
		if (kv_key_eq(b->key, key) && b->salt == salt)
			return b;
	return NULL;
}

/* Doubles the table when keyed blocks outnumber buckets; a failed grow only costs
 * longer chains. */
static void maybe_grow(struct kv_host *h)
{
	uint32_t n = (h->mask + 1) * 2;
	struct kv_host_block **nb;

	if (h->n_blocks <= h->mask + 1 || n == 0)
		return;
	nb = calloc(n, sizeof(*nb));
	if (!nb)
		return;
	for (uint32_t i = 0; i <= h->mask; i++) {
		struct kv_host_block *b = h->buckets[i], *next;

		for (; b; b = next) {
			next = b->next;
			b->next = nb[(uint32_t)b->key.lo & (n - 1)];
			nb[(uint32_t)b->key.lo & (n - 1)] = b;
		}
	}
	free(h->buckets);
	h->buckets = nb;
	h->mask = n - 1;
}

struct kv_host_block *kv_host_block_new(const void *z, size_t zbytes)
{
	struct kv_host_block *b = malloc(sizeof(*b) + zbytes);

	if (!b)
		return NULL;
	memset(b, 0, sizeof(*b));
	memcpy(b->z, z, zbytes);
	b->zbytes = zbytes;
	return b;
}

void kv_host_block_free(struct kv_host_block *b)
{
	free(b);
}

int kv_host_insert(struct kv_host *h, const struct kv_key *key, uint64_t salt, struct kv_host_block *b,
		   struct kv_host_block **out)
{
	struct kv_host_block *have;

	if (key && (have = kv_host_find(h, *key, salt))) {
		have->refs++;
		free(b);
		*out = have;
		return 0;
	}
	if (h->used + kv_host_cost(b->zbytes) > h->budget)
		return -ENOSPC;
	b->refs = 1;
	b->salt = salt;
	b->keyed = 0;
	b->next = NULL;
	if (key) {
		struct kv_host_block **head = bucket_of(h, *key);

		b->key = *key;
		b->keyed = 1;
		b->next = *head;
		*head = b;
	}
	h->used += kv_host_cost(b->zbytes);
	h->n_blocks++;
	if (key)
		maybe_grow(h);
	*out = b;
	return 0;
}

int kv_host_add(struct kv_host *h, const struct kv_key *key, uint64_t salt, const void *z,
		size_t zbytes, struct kv_host_block **out)
{
	struct kv_host_block *b;
	int ret;

	if (key && (b = kv_host_find(h, *key, salt))) {
		b->refs++;
		*out = b;
		return 0;
	}
	if (h->used + kv_host_cost(zbytes) > h->budget)
		return -ENOSPC;
	if (!(b = kv_host_block_new(z, zbytes)))
		return -ENOMEM;
	if ((ret = kv_host_insert(h, key, salt, b, out)))
		kv_host_block_free(b);
	return ret;
}

void kv_host_ref(struct kv_host_block *b)
{
	b->refs++;
}

void kv_host_unref(struct kv_host *h, struct kv_host_block *b)
{
	if (--b->refs > 0)
		return;
	if (b->keyed) {
		struct kv_host_block **link = bucket_of(h, b->key);

		while (*link && *link != b)
			link = &(*link)->next;
		if (*link)
			*link = b->next;
	}
	h->used -= kv_host_cost(b->zbytes);
	h->n_blocks--;
	free(b);
}
