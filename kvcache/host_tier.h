/* The host tier: KV blocks in host memory, byte-shuffled and zstd-compressed, within a
 * byte budget. The codec turns one block (all layers' K and V, backend element type)
 * into one zstd frame with a content checksum and back; the store holds frames with
 * reference counts, full blocks findable by their prefix key like device blocks. */
#ifndef KD_KVCACHE_HOST_TIER_H
#define KD_KVCACHE_HOST_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/kv_hash.h"

#define KV_CODEC_DEFAULT_LEVEL 1	/* zstd level: see docs/KVCACHE.md */

/* Splits n elements of elem_bytes each into elem_bytes planes: byte p of element i goes
 * to dst[p * n + i]. KV values of one plane (the sign/exponent byte of bf16, say) are
 * alike, the mantissa planes are noise; apart, zstd finds the former's redundancy. */
void kv_shuffle(void *dst, const void *src, size_t n, size_t elem_bytes);
void kv_unshuffle(void *dst, const void *src, size_t n, size_t elem_bytes);

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;

struct kv_codec {
	size_t raw_bytes;		/* one block's bytes, all layers */
	size_t elem_bytes;		/* bytes per element (planes of the shuffle) */
	int shuffle;			/* 0: compress the bytes as they are (measurements) */
	int level;			/* zstd level */
	struct ZSTD_CCtx_s *cctx;
	struct ZSTD_DCtx_s *dctx;
	uint8_t *tmp;			/* (raw_bytes) shuffled staging */
};

/* raw_bytes must be a multiple of elem_bytes. 0, -EINVAL or -ENOMEM. */
int kv_codec_init(struct kv_codec *c, size_t raw_bytes, size_t elem_bytes, int level, int shuffle);
void kv_codec_fini(struct kv_codec *c);		/* accepts a zeroed codec */

/* Largest frame a block can compress to. */
size_t kv_codec_bound(const struct kv_codec *c);

/* Compresses raw (raw_bytes) into dst (cap bytes, >= kv_codec_bound): *zbytes gets the
 * frame's length. 0 or -EIO. */
int kv_codec_compress(struct kv_codec *c, void *dst, size_t cap, size_t *zbytes, const void *raw);

/* Decodes frame z (zbytes) into raw (raw_bytes). -EBADMSG unless z is exactly one frame
 * with a content checksum that checks and decodes to raw_bytes bytes. */
int kv_codec_decompress(struct kv_codec *c, void *raw, const void *z, size_t zbytes);

/* One compressed block in host memory. */
struct kv_host_block {
	struct kv_host_block *next;	/* bucket chain (keyed blocks only) */
	struct kv_key key;
	uint64_t salt;
	int keyed;			/* 1: a full block, found by (key, salt); 0: private */
	uint32_t refs;
	size_t zbytes;
	uint8_t z[];			/* (zbytes) zstd frame */
};

struct kv_host {
	size_t budget;			/* bytes the tier may hold (frames + entry headers) */
	size_t used;			/* bytes held */
	size_t n_blocks;
	uint32_t mask;			/* buckets - 1 */
	struct kv_host_block **buckets;	/* (mask + 1) */
};

/* Host cost of a frame of zbytes: what counts against the budget. */
static inline size_t kv_host_cost(size_t zbytes)
{
	return sizeof(struct kv_host_block) + zbytes;
}

/* 0, -ENOMEM. budget 0 means the tier holds nothing. */
int kv_host_init(struct kv_host *h, size_t budget);
void kv_host_fini(struct kv_host *h);	/* frees every block; accepts a zeroed tier */

/* The keyed block (key, salt), or NULL. */
struct kv_host_block *kv_host_find(const struct kv_host *h, struct kv_key key, uint64_t salt);

/* A block holding a copy of frame z, with one more reference: an existing keyed block
 * with the same (key, salt) when there is one (nothing copied), else a new one. key
 * NULL: a private block. -ENOSPC when it does not fit the budget, -ENOMEM. */
int kv_host_add(struct kv_host *h, const struct kv_key *key, uint64_t salt, const void *z,
		size_t zbytes, struct kv_host_block **out);

/* A block made outside the store (by the engine's mover thread, say): a copy of frame z,
 * in no store, no reference; NULL when out of memory. Any thread. Freed by
 * kv_host_block_free until kv_host_insert takes it. */
struct kv_host_block *kv_host_block_new(const void *z, size_t zbytes);
void kv_host_block_free(struct kv_host_block *b);	/* accepts NULL */

/* kv_host_add without the copy: b (kv_host_block_new) into the store with one
 * reference, or, keyed, the existing block (key, salt) with one more reference and b
 * freed. *out is the block referenced. On error (-ENOSPC: over the budget) b stays
 * the caller's. */
int kv_host_insert(struct kv_host *h, const struct kv_key *key, uint64_t salt, struct kv_host_block *b,
		   struct kv_host_block **out);

void kv_host_ref(struct kv_host_block *b);
/* Drops a reference; the block is freed at zero. */
void kv_host_unref(struct kv_host *h, struct kv_host_block *b);

#endif
