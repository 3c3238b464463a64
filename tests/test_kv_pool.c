/* KV block pool: allocation order, exhaustion, reference counts, double frees caught,
 * and the free-list invariant under a long random workload. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kv_pool.h"
#include "tests/testutil.h"

static void check_invariants(const struct kv_pool *p, const uint32_t *model_refs)
{
	int free_count = 0;
	char *on_list = calloc((size_t)p->n_blocks, 1);

	for (int i = 0; i < p->n_free; i++) {
		int32_t id = p->free_ids[i];

		CHECK(id >= 0 && id < p->n_blocks, "free id %d in range", id);
		if (id < 0 || id >= p->n_blocks)
			continue;
		CHECK(!on_list[id], "block %d listed free twice", id);
		on_list[id] = 1;
	}
	for (int b = 0; b < p->n_blocks; b++) {
		CHECK(p->refs[b] == model_refs[b], "block %d refs %u, expected %u", b, p->refs[b], model_refs[b]);
		CHECK((p->refs[b] == 0) == (on_list[b] == 1), "block %d: free iff unreferenced", b);
		free_count += p->refs[b] == 0;
	}
	CHECK(free_count == p->n_free, "free count %d vs n_free %d", free_count, p->n_free);
	free(on_list);
}

int main(void)
{
	struct kv_pool p;
	uint32_t *model_refs;
	unsigned long long s = 42;

	CHECK(kv_pool_init(&p, 0, 16) == -EINVAL, "zero blocks rejected");
	CHECK(kv_pool_init(&p, 4, 0) == -EINVAL, "zero block size rejected");
	CHECK(kv_pool_init(&p, 4, 16) == 0, "init");
	CHECK(kv_pool_blocks_for(&p, 0) == 0 && kv_pool_blocks_for(&p, 1) == 1 &&
	      kv_pool_blocks_for(&p, 16) == 1 && kv_pool_blocks_for(&p, 17) == 2, "blocks_for");
	for (int i = 0; i < 4; i++)
		CHECK(kv_pool_alloc(&p) == i, "fresh pool hands out %d", i);
	CHECK(kv_pool_alloc(&p) == -ENOSPC, "exhausted");
	CHECK(kv_pool_ref(&p, 2) == 0, "ref");
	CHECK(kv_pool_unref(&p, 2) == 0 && p.n_free == 0, "still held after one unref");
	CHECK(kv_pool_unref(&p, 2) == 0 && p.n_free == 1, "freed at zero");
	CHECK(kv_pool_unref(&p, 2) == -EINVAL, "double free caught");
	CHECK(kv_pool_ref(&p, 2) == -EINVAL, "ref of a free block caught");
	CHECK(kv_pool_unref(&p, -1) == -EINVAL && kv_pool_unref(&p, 4) == -EINVAL, "bad ids caught");
	CHECK(kv_pool_alloc(&p) == 2, "freed block reused");
	kv_pool_fini(&p);

	/* random workload against a model of the reference counts */
	CHECK(kv_pool_init(&p, 97, 7) == 0, "init 97");
	model_refs = calloc(97, sizeof(*model_refs));
	for (int step = 0; step < 20000; step++) {
		unsigned r = (unsigned)((test_randf(&s) + 1.0f) * 1000.0f) % 3;
		int32_t id = (int32_t)((test_randf(&s) + 1.0f) * 48.5f) % 97;

		if (r == 0) {
			int got = kv_pool_alloc(&p), model_free = 0;

			for (int b = 0; b < 97; b++)
				model_free += model_refs[b] == 0;
			/* the block handed out was free in the model, not one still held (a
			 * model that just set its count to 1 would hide that) */
			CHECK(got < 97 && (got < 0 || model_refs[got] == 0), "alloc returned %d, held %u times",
			      got, got >= 0 && got < 97 ? model_refs[got] : 0);
			if (got >= 0 && got < 97)
				model_refs[got] = 1;
			else
				CHECK(got == -ENOSPC && model_free == 0, "alloc fails (%d) with %d blocks free",
				      got, model_free);
		} else if (r == 1) {
			int ret = kv_pool_ref(&p, id);

			CHECK((ret == 0) == (model_refs[id] > 0), "ref %d", id);
			if (!ret)
				model_refs[id]++;
		} else {
			int ret = kv_pool_unref(&p, id);

			CHECK((ret == 0) == (model_refs[id] > 0), "unref %d", id);
			if (!ret)
				model_refs[id]--;
		}
		if (step % 1000 == 0)
			check_invariants(&p, model_refs);
	}
	check_invariants(&p, model_refs);
	free(model_refs);
	kv_pool_fini(&p);
	kv_pool_fini(&p);	/* idempotent */
	return test_result("test_kv_pool");
}
