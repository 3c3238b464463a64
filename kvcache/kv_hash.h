/* Keyed hashing for the KV cache: SipHash-2-4 (64- and 128-bit output), and the chained
 * 128-bit key that names a full block of tokens by everything that precedes it. */
#ifndef KD_KVCACHE_KV_HASH_H
#define KD_KVCACHE_KV_HASH_H

#include <stddef.h>
#include <stdint.h>

/* A block's identity in the prefix cache. 128 bits so that accidental collisions are
 * out of reach (about n^2 / 2^129 for n blocks ever hashed); keyed with a secret so
 * that a client cannot construct one on purpose. */
struct kv_key {
	uint64_t lo;
	uint64_t hi;
};

static inline int kv_key_eq(struct kv_key a, struct kv_key b)
{
	return a.lo == b.lo && a.hi == b.hi;
}

/* Incremental SipHash-2-4 state; byte order of the input is the caller's business. */
struct kv_siphash {
	uint64_t v0, v1, v2, v3;
	uint64_t tail;		/* up to 7 pending bytes, little-endian */
	unsigned n_tail;
	uint64_t len;		/* bytes consumed */
};

/* key: 16 bytes as two little-endian words. out128: 1 for the 128-bit variant. */
void kv_siphash_init(struct kv_siphash *h, const uint64_t key[2], int out128);
void kv_siphash_update(struct kv_siphash *h, const void *p, size_t n);
uint64_t kv_siphash_final64(struct kv_siphash *h);
struct kv_key kv_siphash_final128(struct kv_siphash *h);

/* One-shot forms. */
uint64_t kv_siphash64(const uint64_t key[2], const void *p, size_t n);
struct kv_key kv_siphash128(const uint64_t key[2], const void *p, size_t n);

/* The key of a full block: SipHash-128 over (salt, parent key, tokens[0..n)), parent
 * being the previous block's key or all zeroes for the first block. Chaining makes a
 * block's key depend on every token before its end, so equal keys mean equal prefixes. */
struct kv_key kv_block_key(const uint64_t key[2], uint64_t salt, struct kv_key parent,
			   const int32_t *tokens, int n);

/* Fills key with bytes from getrandom(); falls back to the clock and pid when the
 * kernel refuses (returns -errno then, the key still usable but guessable). */
int kv_hash_random_key(uint64_t key[2]);

#endif
