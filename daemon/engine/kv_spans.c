/* A KV block's bytes across the ranks' caches (kv_spans.h). */
#include <errno.h>
#include <stdlib.h>

#include "daemon/engine/forward_tp.h"
#include "daemon/engine/kv_spans.h"
#include "daemon/model/model_shard.h"

#define SPAN_BATCH 512	/* planes a side copy takes in one call */

/* The rows [*lo, *hi) of block b in span sp's cache: bt of them, or (split) the
 * block's slots s with s % split == rank, at rows s / split. */
static void span_rows(const struct kv_span *sp, int bt, int32_t b, int64_t *lo, int64_t *hi)
{
	int64_t s0 = (int64_t)b * bt, n = sp->split;

	if (n <= 1) {
		*lo = s0;
		*hi = s0 + bt;
		return;
	}
	*lo = (s0 - sp->rank + n - 1) / n;
	*hi = (s0 + bt - sp->rank + n - 1) / n;
}

int kv_spans_build(struct kv_spans *ks, const struct forward *f, int n_layers, int block_tokens,
		   size_t elem_bytes)
{
	int n = forward_tp_ranks(f);

	ks->n = n;
	ks->bt = block_tokens;
	ks->block_bytes = 0;
	ks->s = calloc((size_t)n, sizeof(*ks->s));
	if (!ks->s)
		return -ENOMEM;
	for (int r = 0; r < n; r++) {
		struct kv_span *sp = &ks->s[r];
		const struct forward *rf;
		int per_layer;
		int64_t lo, hi;

		forward_tp_rank_kv(f, r, &rf, &sp->be, &sp->same_as, &sp->split);
		sp->rank = r;
		per_layer = rf->kv[0].v ? 2 : 1;
		sp->n_planes = n_layers * per_layer;
		sp->row = (size_t)rf->kv[0].width * elem_bytes;
		sp->base = calloc((size_t)sp->n_planes, sizeof(*sp->base));
		if (!sp->base) {
			kv_spans_free(ks);
			return -ENOMEM;
		}
		for (int l = 0; l < n_layers; l++)
			for (int v = 0; v < per_layer; v++)
				sp->base[l * per_layer + v] =
					(uint8_t *)(v ? (void *)rf->kv[l].v : (void *)rf->kv[l].k);
		span_rows(sp, block_tokens, 0, &lo, &hi);	/* the ranks' shares sum to bt */
		if (sp->same_as == r)
			ks->block_bytes += (size_t)sp->n_planes * (size_t)(hi - lo) * sp->row;
	}
	return 0;
}

void kv_spans_free(struct kv_spans *ks)
{
	for (int r = 0; ks->s && r < ks->n; r++)
		free(ks->s[r].base);
	free(ks->s);
	ks->s = NULL;
	ks->n = 0;
}

/* One span's planes of block b (rows [lo, hi) of each) to or from h. */
static int span_copy(const struct kv_span *sp, int64_t lo, int64_t hi, uint8_t *h, int to_device,
		     int side)
{
	struct backend *be = sp->be;
	size_t bytes = (size_t)(hi - lo) * sp->row;
	void *addr[SPAN_BATCH];
	int ret = 0;

	if (!bytes)
		return 0;
	for (int p0 = 0; p0 < sp->n_planes && !ret; p0 += SPAN_BATCH) {
		int np = sp->n_planes - p0 < SPAN_BATCH ? sp->n_planes - p0 : SPAN_BATCH;
		uint8_t *hp = h + (size_t)p0 * bytes;

		for (int p = 0; p < np; p++)
			addr[p] = sp->base[p0 + p] + (size_t)lo * sp->row;
		if (side) {
			ret = to_device ? be->ops->side_upload(be, addr, hp, np, bytes)
					: be->ops->side_download(be, hp, addr, np, bytes);
			continue;
		}
		for (int p = 0; p < np && !ret; p++)
			ret = to_device ? be->ops->upload(be, addr[p], hp + (size_t)p * bytes, bytes)
					: be->ops->download(be, hp + (size_t)p * bytes, addr[p], bytes);
	}
	if (!ret && !side)
		ret = be->ops->sync(be);
	return ret;
}

int kv_spans_copy(const struct kv_spans *ks, int32_t block, void *raw, int to_device, int side)
{
	size_t at[MODEL_SHARD_MAX_RANKS] = { 0 }, off = 0;	/* each span's place in the run */
	int ret = 0;

	if (ks->n > MODEL_SHARD_MAX_RANKS)
		return -EINVAL;
	for (int r = 0; r < ks->n; r++) {
		const struct kv_span *sp = &ks->s[r];
		int64_t lo, hi;

		if (side && (!sp->be->ops->side_download || !sp->be->ops->side_upload))
			return -ENOTSUP;
		span_rows(sp, ks->bt, block, &lo, &hi);
		at[r] = sp->same_as == r ? off : at[sp->same_as];
		if (sp->same_as == r)
			off += (size_t)sp->n_planes * (size_t)(hi - lo) * sp->row;
	}
	for (int r = 0; r < ks->n && !ret; r++) {
		const struct kv_span *sp = &ks->s[r];
		int64_t lo, hi;

		if (!to_device && sp->same_as != r)	/* a twin's bytes are read once */
			continue;
		span_rows(sp, ks->bt, block, &lo, &hi);
		ret = span_copy(sp, lo, hi, (uint8_t *)raw + at[r], to_device, side);
	}
	return ret;
}
