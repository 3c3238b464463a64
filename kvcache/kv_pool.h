/* The KV block pool: which fixed-size token blocks are free, cached or in use, and how
 * many holders reference each one. Bookkeeping only; the backend owns the tensors that
 * the block ids index (one row of block_tokens tokens per block in every layer's cache).
 *
 * A block is in exactly one state:
 *   free    refs == 0, on free_ids, holds nothing worth keeping;
 *   in use  refs > 0 (sequences, sessions);
 *   cached  refs == 0 but marked cached (its contents are registered in a prefix index),
 *           on the LRU list so that a later hit can take it back.
 * Allocation takes a free block first, else evicts the least recently used cached one
 * (the on_evict hook lets the index forget it). */
#ifndef KD_KVCACHE_KV_POOL_H
#define KD_KVCACHE_KV_POOL_H

#include <stdint.h>

/* Called when a cached block is taken for other contents. */
typedef void (*kv_pool_evict_fn)(void *ctx, int32_t id);

struct kv_pool {
	int n_blocks;
	int block_tokens;	/* tokens per block */
	int n_free;
	int32_t *free_ids;	/* (n_blocks) stack of free block ids; top at n_free - 1 */
	uint32_t *refs;		/* (n_blocks) holders of each block; 0 = free or cached */
	uint8_t *cached;	/* (n_blocks) 1: registered contents; goes to the LRU at 0 refs */
	int32_t *lru_prev;	/* (n_blocks) LRU links of cached unreferenced blocks, -1 ends */
	int32_t *lru_next;	/* (n_blocks) */
	int32_t lru_head;	/* least recently released; evicted first; -1 when empty */
	int32_t lru_tail;	/* most recently released */
	int n_lru;		/* blocks on the LRU */
	uint64_t n_evicted;	/* cached blocks taken for other contents, ever */
	kv_pool_evict_fn on_evict;	/* may be NULL */
	void *evict_ctx;
};

/* Returns 0, or -EINVAL (sizes <= 0), -ENOMEM. */
int kv_pool_init(struct kv_pool *pool, int n_blocks, int block_tokens);
void kv_pool_fini(struct kv_pool *pool);	/* accepts a zeroed pool */

/* Takes a free block, else evicts the LRU cached block; returns its id with one
 * reference, or -ENOSPC when every block is in use. */
int kv_pool_alloc(struct kv_pool *pool);

/* Adds a holder to an in-use or cached block (a cached one leaves the LRU: a hit);
 * -EINVAL for a bad or free id. */
int kv_pool_ref(struct kv_pool *pool, int32_t id);

/* Drops a holder; at zero the block goes to the LRU tail when cached, else to the free
 * list. -EINVAL for a bad or unreferenced id (a double free is caught, never corrupts
 * the lists). */
int kv_pool_unref(struct kv_pool *pool, int32_t id);

/* Marks an in-use block as cached (its contents registered). -EINVAL unless in use. */
int kv_pool_set_cached(struct kv_pool *pool, int32_t id);

/* Evicts the LRU head to the free list (calling on_evict): its id, or -ENOENT. */
int kv_pool_evict_lru(struct kv_pool *pool);

/* Blocks an allocation can get without freeing anything held. */
static inline int kv_pool_available(const struct kv_pool *pool)
{
	return pool->n_free + pool->n_lru;
}

/* Blocks needed for n tokens. */
static inline int kv_pool_blocks_for(const struct kv_pool *pool, int64_t n_tokens)
{
	return (int)((n_tokens + pool->block_tokens - 1) / pool->block_tokens);
}

#endif
