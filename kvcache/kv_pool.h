/* The KV block pool: which fixed-size token blocks are free and how many holders
 * reference each one. Bookkeeping only; the backend owns the tensors that the block
 * ids index (one row of block_tokens tokens per block in every layer's cache). */
#ifndef KD_KVCACHE_KV_POOL_H
#define KD_KVCACHE_KV_POOL_H

#include <stdint.h>

struct kv_pool {
	int n_blocks;
	int block_tokens;	/* tokens per block */
	int n_free;
	int32_t *free_ids;	/* (n_blocks) stack of free block ids; top at n_free - 1 */
	uint32_t *refs;		/* (n_blocks) holders of each block; 0 = free */
};

/* Returns 0, or -EINVAL (sizes <= 0), -ENOMEM. */
int kv_pool_init(struct kv_pool *pool, int n_blocks, int block_tokens);
void kv_pool_fini(struct kv_pool *pool);	/* accepts a zeroed pool */

/* Takes a free block with one reference: its id, or -ENOSPC when none is free. */
int kv_pool_alloc(struct kv_pool *pool);

/* Adds a holder to an allocated block; -EINVAL for a bad or free id. */
int kv_pool_ref(struct kv_pool *pool, int32_t id);

/* Drops a holder; the block returns to the free list at zero. -EINVAL for a bad or
 * free id (a double free is caught, never corrupts the list). */
int kv_pool_unref(struct kv_pool *pool, int32_t id);

/* Blocks needed for n tokens. */
static inline int kv_pool_blocks_for(const struct kv_pool *pool, int64_t n_tokens)
{
	return (int)((n_tokens + pool->block_tokens - 1) / pool->block_tokens);
}

#endif
