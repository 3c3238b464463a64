/* Free list, LRU of cached blocks and reference counts of KV blocks. */
#include <errno.h>
#include <stdlib.h>

#include "kvcache/kv_pool.h"

int kv_pool_init(struct kv_pool *pool, int n_blocks, int block_tokens)
{
	*pool = (struct kv_pool){ .block_tokens = block_tokens, .lru_head = -1, .lru_tail = -1 };
	if (n_blocks <= 0 || block_tokens <= 0)
		return -EINVAL;
	pool->free_ids = malloc((size_t)n_blocks * sizeof(*pool->free_ids));
	pool->refs = calloc((size_t)n_blocks, sizeof(*pool->refs));
	pool->cached = calloc((size_t)n_blocks, sizeof(*pool->cached));
	pool->lru_prev = malloc((size_t)n_blocks * sizeof(*pool->lru_prev));
	pool->lru_next = malloc((size_t)n_blocks * sizeof(*pool->lru_next));
	if (!pool->free_ids || !pool->refs || !pool->cached || !pool->lru_prev || !pool->lru_next) {
		kv_pool_fini(pool);
		return -ENOMEM;
	}
	pool->n_blocks = n_blocks;
	/* Low ids on top so that a fresh pool hands out 0, 1, 2, ... */
	for (int i = 0; i < n_blocks; i++) {
		pool->free_ids[i] = n_blocks - 1 - i;
		pool->lru_prev[i] = pool->lru_next[i] = -1;
	}
	pool->n_free = n_blocks;
	return 0;
}

void kv_pool_fini(struct kv_pool *pool)
{
	free(pool->free_ids);
	free(pool->refs);
	free(pool->cached);
	free(pool->lru_prev);
	free(pool->lru_next);
	*pool = (struct kv_pool){ .block_tokens = pool->block_tokens, .lru_head = -1, .lru_tail = -1 };
}

static void lru_remove(struct kv_pool *pool, int32_t id)
{
	int32_t p = pool->lru_prev[id], n = pool->lru_next[id];

	if (p >= 0)
		pool->lru_next[p] = n;
	else
		pool->lru_head = n;
	if (n >= 0)
		pool->lru_prev[n] = p;
	else
		pool->lru_tail = p;
	pool->lru_prev[id] = pool->lru_next[id] = -1;
	pool->n_lru--;
}

static void lru_push_tail(struct kv_pool *pool, int32_t id)
{
	pool->lru_prev[id] = pool->lru_tail;
	pool->lru_next[id] = -1;
	if (pool->lru_tail >= 0)
		pool->lru_next[pool->lru_tail] = id;
	else
		pool->lru_head = id;
	pool->lru_tail = id;
	pool->n_lru++;
}

/* Takes the LRU head out of the cache; the caller decides where it goes. */
static int32_t evict_head(struct kv_pool *pool)
{
	int32_t id = pool->lru_head;

	lru_remove(pool, id);
	pool->cached[id] = 0;
	pool->n_evicted++;
	if (pool->on_evict)
		pool->on_evict(pool->evict_ctx, id);
	return id;
}

int kv_pool_alloc(struct kv_pool *pool)
{
	int32_t id;

	if (pool->n_free > 0)
		id = pool->free_ids[--pool->n_free];
	else if (pool->lru_head >= 0)
		id = evict_head(pool);
	else
		return -ENOSPC;
	pool->refs[id] = 1;
	return id;
}

int kv_pool_ref(struct kv_pool *pool, int32_t id)
{
	if (id < 0 || id >= pool->n_blocks)
		return -EINVAL;
	if (pool->refs[id] == 0) {
		if (!pool->cached[id])
			return -EINVAL;
		lru_remove(pool, id);
	}
	pool->refs[id]++;
	return 0;
}

int kv_pool_unref(struct kv_pool *pool, int32_t id)
{
	if (id < 0 || id >= pool->n_blocks || pool->refs[id] == 0)
		return -EINVAL;
	if (--pool->refs[id] > 0)
		return 0;
	if (pool->cached[id])
		lru_push_tail(pool, id);
	else
		pool->free_ids[pool->n_free++] = id;
	return 0;
}

int kv_pool_set_cached(struct kv_pool *pool, int32_t id)
{
	if (id < 0 || id >= pool->n_blocks || pool->refs[id] == 0)
		return -EINVAL;
	pool->cached[id] = 1;
	return 0;
}

int kv_pool_evict_lru(struct kv_pool *pool)
{
	int32_t id;

	if (pool->lru_head < 0)
		return -ENOENT;
	id = evict_head(pool);
	pool->free_ids[pool->n_free++] = id;
	return id;
}
