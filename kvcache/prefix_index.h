/* The prefix index: which device block holds the full block named by a chained key
 * (kv_hash.h) under a tenant salt. One entry per block at most; the pool's LRU decides
 * when a cached block goes, and kv_prefix_evict_cb drops its entry then. */
#ifndef KD_KVCACHE_PREFIX_INDEX_H
#define KD_KVCACHE_PREFIX_INDEX_H

#include <stdint.h>

#include "kvcache/kv_hash.h"

struct kv_prefix {
	int n_blocks;
	uint64_t hash_key[2];		/* secret SipHash key of this process */
	uint32_t mask;			/* buckets - 1 (a power of two >= n_blocks) */
	int32_t *buckets;		/* (mask + 1) first block of each chain, -1 empty */
	int32_t *next;			/* (n_blocks) next block in the same bucket, -1 ends */
	struct kv_key *keys;		/* (n_blocks) key of each registered block */
	uint64_t *salts;		/* (n_blocks) its tenant salt, compared on lookup */
	uint8_t *registered;		/* (n_blocks) 1: the block has an entry */
	int n_entries;
};

/* hash_key: 16 secret bytes (kv_hash_random_key). 0, -EINVAL or -ENOMEM. */
int kv_prefix_init(struct kv_prefix *x, int n_blocks, const uint64_t hash_key[2]);
void kv_prefix_fini(struct kv_prefix *x);	/* accepts a zeroed index */

/* The key of the block of tokens[0..n) that follows parent (zero key: the first). */
static inline struct kv_key kv_prefix_key(const struct kv_prefix *x, uint64_t salt,
					  struct kv_key parent, const int32_t *tokens, int n)
{
	return kv_block_key(x->hash_key, salt, parent, tokens, n);
}

/* The block registered under (key, salt), or -ENOENT. */
int kv_prefix_find(const struct kv_prefix *x, struct kv_key key, uint64_t salt);

/* Registers block under (key, salt): 0, -EEXIST when that key already has a block (the
 * caller keeps its copy private) or the block is registered, -EINVAL for a bad id. */
int kv_prefix_insert(struct kv_prefix *x, struct kv_key key, uint64_t salt, int32_t block);

/* Forgets block's entry, if it has one. */
void kv_prefix_remove(struct kv_prefix *x, int32_t block);

/* kv_pool_evict_fn for a pool whose cached blocks this index names (ctx = x). */
void kv_prefix_evict_cb(void *ctx, int32_t block);

#endif
