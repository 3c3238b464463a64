/* RoPE at absolute positions through the CPU engine. Attention sees only position
 * differences, so logits cannot show a position offset common to a whole sequence (the
 * references match either way); the KV cache can: it keeps each key rotated by its own
 * position, and a cache moved between engines, builds or backends (host tier,
 * snapshots, the prefix cache) must mean the same thing everywhere. Here layer 0's key
 * of a token at position p, read back from the cache (engine_block_read), must equal the
 * key computed outside the engine from the checkpoint's weights (embedding, the layer's
 * RMSNorm, W_k, qwen3's k_norm) rotated by p with the engine's frequency table, whose
 * values test_rope checks against the formulas: for p = 0 (no rotation), 1, 16 (a
 * block's first slot), 37 and 38, by one prefill and by a step at p after the cache
 * holds 0..p-1. */
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/engine_internal.h"
#include "daemon/model/model.h"
#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

#define ROPE_POS_TOL 1e-6	/* the same fp32 kernels in the same order: measured 0 */

/* Layer 0's key of token tok at position pos, (n_kv_heads * head_dim) floats. */
static void ref_key(const struct engine *e, int32_t tok, int32_t pos, float *k)
{
	const struct model *m = e->model;
	const struct model_layer *l = &m->layers[0];
	const struct model_config *c = &m->cfg;
	int hd = c->head_dim, width = c->n_kv_heads * c->head_dim;
	float *x = malloc(sizeof(float) * (size_t)c->hidden_size);

	k_cpu_embed(x, &tok, 1, m->embed.data, m->embed.dtype, c->hidden_size);
	k_cpu_rmsnorm(x, c->hidden_size, x, c->hidden_size, l->attn_norm.data, l->attn_norm.dtype, 1,
		      c->hidden_size, c->rms_norm_eps);
	k_cpu_linear(NULL, k, x, l->wk.data, l->wk.dtype, 1, width, c->hidden_size);
	if (l->k_norm.data)
		k_cpu_rmsnorm(k, hd, k, hd, l->k_norm.data, l->k_norm.dtype, c->n_kv_heads, hd,
			      c->rms_norm_eps);
	k_cpu_rope(&e->fwd->rope, k, 1, c->n_kv_heads, width, hd, &pos);
	free(x);
}

/* Layer 0's key at position pos of s, from the cache (kv dtype f32 on the CPU). */
static int cached_key(struct engine *e, const struct engine_seq *s, int pos, float *k)
{
	int bt = e->pool.block_tokens, width = e->model->cfg.n_kv_heads * e->model->cfg.head_dim;
	float *blk = malloc(e->block_bytes);
	int ret = engine_block_read(e, s->blocks[pos / bt], blk);

	if (!ret)	/* layer 0's K plane comes first: (block_tokens, width) */
		memcpy(k, blk + (size_t)(pos % bt) * width, sizeof(float) * (size_t)width);
	free(blk);
	return ret;
}

/* Token tok at position p after p filler tokens: in one prefill (split = 0) or in a
 * step of its own after the fillers are cached (split = 1). */
static void check_pos(struct engine *e, const char *name, int32_t tok, int p, int split)
{
	int vocab = e->model->cfg.vocab_size, width = e->model->cfg.n_kv_heads * e->model->cfg.head_dim;
	int32_t *toks = malloc(sizeof(int32_t) * (size_t)(p + 1));
	float *logits = malloc(sizeof(float) * (size_t)vocab * 2);
	float *got = malloc(sizeof(float) * (size_t)width), *want = malloc(sizeof(float) * (size_t)width);
	struct engine_seq s;
	char err[256] = "";
	int ret = 0;

	for (int i = 0; i < p; i++)
		toks[i] = (int32_t)((i * 7919u + 11u) % (unsigned)vocab);
	toks[p] = tok;
	engine_seq_init(&s);
	if (split && p > 0)
		ret = engine_step(e, &(struct engine_req){ .seq = &s, .tokens = toks, .n_tokens = p }, 1,
				  logits, err, sizeof(err));
	if (!ret)
		ret = engine_step(e, &(struct engine_req){ .seq = &s, .tokens = toks + (split ? p : 0),
							  .n_tokens = split ? 1 : p + 1 },
				  1, logits, err, sizeof(err));
	CHECK(ret == 0, "%s p %d split %d: step: %s", name, p, split, err);
	if (!ret) {
		double rel;

		CHECK(s.n_tokens == p + 1, "%s p %d: %d tokens cached", name, p, s.n_tokens);
		ret = cached_key(e, &s, p, got);
		CHECK(ret == 0, "%s p %d: block read %d", name, p, ret);
		ref_key(e, tok, p, want);
		rel = test_rel_l2(got, want, (size_t)width);
		CHECK(ret == 0 && rel <= ROPE_POS_TOL,
		      "%s: layer 0 key of the token at position %d (%s) is rotated otherwise: rel L2 %.3g "
		      "against RoPE at %d", name, p, split ? "a step after the cache" : "one prefill", rel, p);
		if (split && p == 38)
			fprintf(stderr, "  %-18s keys at 0, 1, 16, 37, 38 as RoPE at those positions "
				"(last rel L2 %.2g)\n", name, rel);
	}
	engine_seq_release(e, &s);
	free(toks);
	free(logits);
	free(got);
	free(want);
}

/* The check's own control: the key at p is not the key at p + 1 (so a cache written
 * one position off could not pass). */
static void check_distinct(struct engine *e, const char *name)
{
	int width = e->model->cfg.n_kv_heads * e->model->cfg.head_dim;
	float *a = malloc(sizeof(float) * (size_t)width), *b = malloc(sizeof(float) * (size_t)width);

	ref_key(e, 5, 37, a);
	ref_key(e, 5, 38, b);
	CHECK(test_rel_l2(a, b, (size_t)width) > 1e-3, "%s: keys at 37 and 38 alike (rel L2 %.3g)", name,
	      test_rel_l2(a, b, (size_t)width));
	free(a);
	free(b);
}

static void check_model(const char *top, const char *name)
{
	struct engine_opts eo = { .backend = "cpu", .threads = 2, .kv_tokens = 1024, .block_tokens = 16,
				  .max_rows = 64 };
	static const int ps[] = { 0, 1, 16, 37, 38 };
	char path[1024], err[512] = "";
	struct model *m = NULL;
	struct engine *e = NULL;

	snprintf(path, sizeof(path), "%s/tests/data/%s", top, name);
	CHECK(model_load(&m, path, NULL, err, sizeof(err)) == 0, "%s: %s", path, err);
	if (m)
		CHECK(engine_create(&e, m, &eo, err, sizeof(err)) == 0, "%s: engine: %s", name, err);
	if (e && !m->cfg.mla) {
		check_distinct(e, name);
		for (int split = 0; split < 2; split++)
			for (size_t i = 0; i < sizeof(ps) / sizeof(ps[0]); i++)
				check_pos(e, name, 5 + (int32_t)i, ps[i], split);
	}
	engine_destroy(e);
	model_destroy(m);
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";

	check_model(top, "golden/llama3");	/* llama3 rope scaling, GQA */
	check_model(top, "golden/qwen3");	/* k_norm before the rotation */
	check_model(top, "reference/llama");	/* odd dims, fp16 checkpoint */
	return test_result("test_rope_position");
}
