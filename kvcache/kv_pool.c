/* Free list and reference counts of KV blocks. */
#include <errno.h>
#include <stdlib.h>

#include "kvcache/kv_pool.h"

int kv_pool_init(struct kv_pool *pool, int n_blocks, int block_tokens)
{
	pool->free_ids = NULL;
	pool->refs = NULL;
	pool->n_free = 0;
	pool->n_blocks = 0;
	pool->block_tokens = block_tokens;
	if (n_blocks <= 0 || block_tokens <= 0)
		return -EINVAL;
	pool->free_ids = malloc((size_t)n_blocks * sizeof(*pool->free_ids));
	pool->refs = calloc((size_t)n_blocks, sizeof(*pool->refs));
	if (!pool->free_ids || !pool->refs) {
		kv_pool_fini(pool);
		return -ENOMEM;
	}
	pool->n_blocks = n_blocks;
	/* Low ids on top so that a fresh pool hands out 0, 1, 2, ... */
	for (int i = 0; i < n_blocks; i++)
		pool->free_ids[i] = n_blocks - 1 - i;
	pool->n_free = n_blocks;
	return 0;
}

void kv_pool_fini(struct kv_pool *pool)
{
	free(pool->free_ids);
	free(pool->refs);
	pool->free_ids = NULL;
	pool->refs = NULL;
	pool->n_free = 0;
	pool->n_blocks = 0;
}

int kv_pool_alloc(struct kv_pool *pool)
{
	int32_t id;

	if (pool->n_free == 0)
		return -ENOSPC;
	id = pool->free_ids[--pool->n_free];
	pool->refs[id] = 1;
	return id;
}

int kv_pool_ref(struct kv_pool *pool, int32_t id)
{
	if (id < 0 || id >= pool->n_blocks || pool->refs[id] == 0)
		return -EINVAL;
	pool->refs[id]++;
	return 0;
}

int kv_pool_unref(struct kv_pool *pool, int32_t id)
{
	if (id < 0 || id >= pool->n_blocks || pool->refs[id] == 0)
		return -EINVAL;
	if (--pool->refs[id] == 0)
		pool->free_ids[pool->n_free++] = id;
	return 0;
}
