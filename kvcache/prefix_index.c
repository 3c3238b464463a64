/* Chained hash table from block keys to block ids. The chains run through per-block
 * arrays, so the table never allocates after init and removal is a short list walk. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/prefix_index.h"

int kv_prefix_init(struct kv_prefix *x, int n_blocks, const uint64_t hash_key[2])
{
	uint32_t buckets = 1;

	memset(x, 0, sizeof(*x));
	if (n_blocks <= 0 || n_blocks > (1 << 30))
		return -EINVAL;
	while (buckets < (uint32_t)n_blocks)
		buckets <<= 1;
	x->buckets = malloc(buckets * sizeof(*x->buckets));
	x->next = malloc((size_t)n_blocks * sizeof(*x->next));
	x->keys = calloc((size_t)n_blocks, sizeof(*x->keys));
	x->salts = calloc((size_t)n_blocks, sizeof(*x->salts));
	x->registered = calloc((size_t)n_blocks, sizeof(*x->registered));
	if (!x->buckets || !x->next || !x->keys || !x->salts || !x->registered) {
		kv_prefix_fini(x);
		return -ENOMEM;
	}
	memset(x->buckets, 0xff, buckets * sizeof(*x->buckets));
	memset(x->next, 0xff, (size_t)n_blocks * sizeof(*x->next));
	x->mask = buckets - 1;
	x->n_blocks = n_blocks;
	x->hash_key[0] = hash_key[0];
	x->hash_key[1] = hash_key[1];
	return 0;
}

void kv_prefix_fini(struct kv_prefix *x)
{
	free(x->buckets);
	free(x->next);
	free(x->keys);
	free(x->salts);
	free(x->registered);
	memset(x, 0, sizeof(*x));
}

/* The key is already a keyed hash: its low bits are as good as any. */
static uint32_t bucket_of(const struct kv_prefix *x, struct kv_key key)
{
	return (uint32_t)key.lo & x->mask;
}

int kv_prefix_find(const struct kv_prefix *x, struct kv_key key, uint64_t salt)
{
	for (int32_t b = x->buckets[bucket_of(x, key)]; b >= 0; b = x->next[b])
		if (kv_key_eq(x->keys[b], key) && x->salts[b] == salt)
			return b;
	return -ENOENT;
}

int kv_prefix_insert(struct kv_prefix *x, struct kv_key key, uint64_t salt, int32_t block)
{
	uint32_t h;

	if (block < 0 || block >= x->n_blocks)
		return -EINVAL;
	if (x->registered[block] || kv_prefix_find(x, key, salt) >= 0)
		return -EEXIST;
	h = bucket_of(x, key);
	x->keys[block] = key;
	x->salts[block] = salt;
	x->registered[block] = 1;
	x->next[block] = x->buckets[h];
	x->buckets[h] = block;
	x->n_entries++;
	return 0;
}

void kv_prefix_remove(struct kv_prefix *x, int32_t block)
{
	int32_t *link;

	if (block < 0 || block >= x->n_blocks || !x->registered[block])
		return;
	for (link = &x->buckets[bucket_of(x, x->keys[block])]; *link >= 0; link = &x->next[*link]) {
		if (*link == block) {
			*link = x->next[block];
			break;
		}
	}
	x->next[block] = -1;
	x->registered[block] = 0;
	x->n_entries--;
}

void kv_prefix_evict_cb(void *ctx, int32_t block)
{
	kv_prefix_remove(ctx, block);
}
