/* Steps of many sequences over one paged KV cache: block reservation, row staging,
 * forward calls of bounded size; the prefix cache that lets a sequence start on
 * blocks another one computed. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/engine/forward_tp.h"
#include "daemon/engine/engine_internal.h"
#include "daemon/model/model_shard.h"

static uint64_t clock_monotonic_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int64_t seconds_opt(int v, int def)
{
	if (v < 0)
		return -1;
	return (int64_t)(v ? v : def) * 1000000000ll;
}

/* Prefix index, host tier, codec, sessions: everything past the forward pass. */
static int engine_kv_init(struct engine *e, const struct engine_opts *opts, char *err, size_t err_len)
{
	const struct model_config *c = &e->model->cfg;
	uint64_t key[2];
	int64_t host = opts->host_kv_bytes ? opts->host_kv_bytes : ENGINE_DEFAULT_HOST_KV_BYTES;
	int ret;

	e->clock_ns = clock_monotonic_ns;
	e->kv_elem_bytes = k_dtype_size(e->be->ops->kv_dtype);
	if ((ret = kv_spans_build(&e->spans, e->fwd, c->n_layers, e->pool.block_tokens, e->kv_elem_bytes)))
		return ret;
	e->block_bytes = e->spans.block_bytes;	/* tp 1: bt x width x elem x (K, V) x layers */
	e->host_enabled = host > 0;
	e->session_quota_blocks = opts->session_quota_blocks > 0 ? opts->session_quota_blocks
								 : (e->pool.n_blocks + 3) / 4;
	e->max_sessions = opts->max_sessions > 0 ? opts->max_sessions : ENGINE_DEFAULT_MAX_SESSIONS;
	e->session_ttl_ns = seconds_opt(opts->session_ttl_s, ENGINE_DEFAULT_SESSION_TTL_S);
	e->offload_after_ns = seconds_opt(opts->offload_after_s, ENGINE_DEFAULT_OFFLOAD_AFTER_S);
	kv_sessions_init(&e->sessions);
	/* a guessable key only weakens the salt's protection against crafted
	 * collisions; the cache still works, so a refusing kernel is not fatal */
	kv_hash_random_key(key);
	if ((ret = kv_prefix_init(&e->prefix, e->pool.n_blocks, key)) ||
	    (ret = kv_host_init(&e->host, host > 0 ? (size_t)host : 0)) ||
	    (ret = kv_codec_init(&e->codec, e->block_bytes, e->kv_elem_bytes,
				 opts->zstd_level ? opts->zstd_level : KV_CODEC_DEFAULT_LEVEL, 1))) {
		snprintf(err, err_len, "engine: cannot set up the KV cache index: %s", strerror(-ret));
		return ret;
	}
	e->pool.on_evict = kv_prefix_evict_cb;
	e->pool.evict_ctx = &e->prefix;
	e->kv_raw = malloc(e->block_bytes);
	e->kv_frame = malloc(kv_codec_bound(&e->codec));
	if (!e->kv_raw || !e->kv_frame)
		return -ENOMEM;
	return 0;
}

/* --allreduce: a GPU backend's reduction (cpu ranks reduce through shared memory); fused
 * needs two ranks or more, nccl ranks on distinct GPUs (n_devs of them: tp 1's one rank,
 * a one-rank communicator, or one rank per GPU). Refused here, before any weight is
 * loaded; the backend refuses what only it can see (peer access, NCCL missing) when it
 * makes the communicator. */
static int engine_allreduce_check(const struct backend_ops *ops, const struct engine_opts *opts,
				  int n_devs, char *err, size_t err_len)
{
	const char *name = backend_allreduce_name(opts->allreduce);

	if (opts->allreduce == BACKEND_AR_AUTO)
		return 0;
	if (ops->host_memory || !ops->tp_comm_create) {
		snprintf(err, err_len, "--allreduce %s on the %s backend: its ranks reduce through "
			 "shared memory; --allreduce picks a GPU reduction (--backend cuda)", name,
			 ops->name);
		return -EINVAL;
	}
	if (opts->allreduce == BACKEND_AR_FUSED && opts->tp <= 1) {
		snprintf(err, err_len, "--allreduce fused with --tp 1: one rank has nothing to reduce "
			 "(--allreduce nccl runs a one-rank communicator)");
		return -EINVAL;
	}
	if (opts->allreduce == BACKEND_AR_NCCL && opts->tp > 1 && n_devs == 1) {
		snprintf(err, err_len, "--allreduce nccl with --tp %d on one GPU: NCCL cannot put two "
			 "ranks on one GPU (a communicator holds each device once), and these %s ranks "
			 "share one; name a GPU per rank (--gpus), use --allreduce fused or auto, or "
			 "--tp 1 --allreduce nccl (a one-rank communicator)", opts->tp, ops->name);
		return -ENOTSUP;
	}
	return 0;
}

/* What --gpus and --tp N need before anything is built: GPUs for a backend that runs on
 * them, rank r's GPU in devs (engine_rank_devices: one rank per GPU, or every rank on
 * one GPU), shapes that N divides, a backend whose ranks can run as threads (cpu; cuda:
 * one rank per GPU, or N = 2 or 4 virtual ranks on one GPU), no host tier (it would
 * move rank 0's cache only). */
static int engine_tp_check(const struct model *m, const struct backend_ops *ops,
			   const struct engine_opts *opts, int *devs, char *err, size_t err_len)
{
	int ret, n_devs = 1;

	devs[0] = 0;
	if (opts->n_gpus != 0 && !ops->device_count) {
		snprintf(err, err_len, "--gpus on the %s backend: it runs on no GPU (--backend cuda)",
			 ops->name);
		return -EINVAL;
	}
	if (ops->device_count &&
	    (ret = engine_rank_devices(opts, ops->device_count(), devs, &n_devs, err, err_len)))
		return ret;
	if (opts->ep && opts->tp <= 1) {
		snprintf(err, err_len, "--ep: expert parallel needs --tp N of 2 or more");
		return -EINVAL;
	}
	if (opts->ep && m->cfg.n_experts <= 0) {
		snprintf(err, err_len, "--ep: %s has no routed experts", m->cfg.model_type);
		return -EINVAL;
	}
	if (opts->mla_cp && (ret = forward_tp_cp_check(&m->cfg, ops, opts->tp, err, err_len)))
		return ret;
	if ((ret = engine_allreduce_check(ops, opts, n_devs, err, err_len)))
		return ret;
	if (opts->tp <= 1)
		return 0;
	if (!ops->host_memory && !ops->tp_comm_create) {
		snprintf(err, err_len, "--tp %d on the %s backend: it has no tensor-parallel reduction; "
			 "use --tp 1, or --backend cpu", opts->tp, ops->name);
		return -ENOTSUP;
	}
	if (!ops->host_memory && n_devs == 1 && opts->tp != 2 && opts->tp != 4) {
		snprintf(err, err_len, "--tp %d on %s with one GPU: virtual ranks on one GPU take --tp "
			 "2 or 4; name %d GPUs (--gpus) for one rank each; --backend cpu takes any N "
			 "that divides the shapes", opts->tp, ops->name, opts->tp);
		return -ENOTSUP;
	}
	return model_shard_check(&m->cfg, opts->tp, opts->ep, err, err_len);
}

/* Threads of each rank's pool: the engine's threads shared among the ranks. */
static int engine_rank_threads(const struct engine_opts *opts)
{
	long t = opts->threads > 0 ? opts->threads : sysconf(_SC_NPROCESSORS_ONLN);
	int n = opts->tp > 1 ? opts->tp : 1;

	return t / n > 1 ? (int)(t / n) : 1;
}

/* --decode-path: parsed, refused with one line where the backend has no latency path
 * at all (the CPU backend), logged where the latency path has nothing for the model. */
static int engine_decode_path_set(struct engine *e, const char *name, char *err, size_t err_len)
{
	enum fwd_path p = FWD_PATH_AUTO;
	char why[160];

	if (name && fwd_path_parse(name, &p)) {
		snprintf(err, err_len, "--decode-path '%s': want auto, standard or latency", name);
		return -EINVAL;
	}
	e->fwd->path = p;
	if (p == FWD_PATH_STANDARD || forward_latency_supported(e->fwd, 1, why, sizeof(why)))
		return 0;
	if (p == FWD_PATH_LATENCY && !e->be->ops->moe_layer) {
		snprintf(err, err_len, "--decode-path latency: %s (use standard or auto)", why);
		return -ENOTSUP;
	}
	if (p == FWD_PATH_LATENCY)	/* asked for: say why it changes nothing */
		log_info("engine: decode path latency: %s; the standard kernels run", why);
	else
		log_debug("engine: decode path auto: %s; the standard kernels run", why);
	return 0;
}

void engine_decode_path_describe(const struct engine *e, char *buf, size_t len)
{
	const struct forward *f = e->fwd;
	size_t n = (size_t)snprintf(buf, len, "%s", fwd_path_name(f->path));
	char why[160];
	int any = 0;

	if (f->path == FWD_PATH_STANDARD || n >= len)
		return;
	if (!forward_latency_supported(f, 1, why, sizeof(why))) {
		snprintf(buf + n, len - n, " (latency kernels unused: %s)", why);
		return;
	}
	for (int i = 0; i < FWD_N_BUCKETS && n < len; i++) {
		if (f->bucket_lat[i] < 0)
			continue;
		n += (size_t)snprintf(buf + n, len - n, "%s%d: %s", any ? ", " : " (", 1 << i,
				      f->bucket_lat[i] ? "latency" : "standard");
		any = 1;
	}
	if (any && n < len)
		snprintf(buf + n, len - n, ")");
}

void engine_parallel_describe(const struct engine *e, char *buf, size_t len)
{
	forward_tp_describe(e->fwd, buf, len);
}

unsigned engine_decode_path_latency_mask(const struct engine *e)
{
	unsigned m = 0;

	for (int i = 0; i < FWD_N_BUCKETS; i++)
		m |= (e->fwd->bucket_lat[i] > 0 ? 1u : 0u) << i;
	return m;
}

int engine_create(struct engine **out, struct model *m, const struct engine_opts *opts,
		  char *err, size_t err_len)
{
	static const struct engine_opts defaults;
	const struct backend_ops *ops;
	struct backend_opts bo;
	struct engine *e;
	char why[512];
	int block_tokens, kv_tokens, max_rows, ret, devs[ENGINE_MAX_GPUS];

	if (!opts)
		opts = &defaults;
	*out = NULL;
	block_tokens = opts->block_tokens > 0 ? opts->block_tokens : ENGINE_DEFAULT_BLOCK_TOKENS;
	kv_tokens = opts->kv_tokens > 0 ? opts->kv_tokens : ENGINE_DEFAULT_KV_TOKENS;
	ops = backend_pick(opts->backend ? opts->backend : "cpu", why, sizeof(why), err, err_len);
	if (!ops)
		return -ENOENT;
	max_rows = opts->max_rows;
	if (max_rows <= 0) {
		max_rows = ENGINE_DEFAULT_MAX_ROWS;
		if (ops->prompt_rows > max_rows)
			max_rows = ops->prompt_rows;
		if (opts->min_rows > max_rows)
			max_rows = opts->min_rows;
	}
	if (block_tokens > 4096 || max_rows > 65536) {
		snprintf(err, err_len, "block size %d (max 4096) or rows per step %d (max 65536) too large",
			 block_tokens, max_rows);
		return -EINVAL;
	}
	if ((ret = engine_tp_check(m, ops, opts, devs, err, err_len)))
		return ret;
	if (why[0])
		log_info("%s", why);	/* "auto": which backend, and why that one */
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->model = m;
	bo = (struct backend_opts){ .threads = opts->tp > 1 ? engine_rank_threads(opts) : opts->threads,
				    .kv_bf16 = opts->kv_bf16,
				    .w_bf16 = opts->w_bf16,
				    .x_bf16 = opts->x_bf16,
				    .x_bf16_at = opts->x_bf16_at,
				    .x_bf16_arg = opts->x_bf16_arg,
				    .device = devs[0],
				    .rank_devices = opts->tp > 1 ? devs : NULL,
				    .allreduce = opts->allreduce };
	/* tp on a backend without host memory: rank 0's backend holds rank 0's shard
	 * alone, made by forward_tp_create */
	if ((opts->tp <= 1 || ops->host_memory) && (ret = ops->create(&e->be, m, &bo, err, err_len)))
		goto err_destroy;
	ret = kv_pool_init(&e->pool, (kv_tokens + block_tokens - 1) / block_tokens, block_tokens);
	if (ret)
		goto err_destroy;
	/* --allreduce nccl at tp 1: one rank through the tp reductions, on e->be */
	if (opts->tp > 1 || opts->allreduce == BACKEND_AR_NCCL)
		ret = forward_tp_create(&e->fwd, m, &e->be, ops, opts->tp > 1 ? opts->tp : 1, opts->ep,
					opts->mla_cp, &bo, e->pool.n_blocks, block_tokens, max_rows,
					err, err_len);
	else
		ret = forward_create(&e->fwd, m, e->be, e->pool.n_blocks, block_tokens, max_rows,
				     err, err_len);
	if (ret)
		goto err_destroy;
	if ((ret = engine_decode_path_set(e, opts->decode_path, err, err_len)))
		goto err_destroy;
	if (opts->no_graphs)
		e->fwd->use_graphs = 0;
	e->tokens = calloc((size_t)max_rows, sizeof(int32_t));
	e->pos = calloc((size_t)max_rows, sizeof(int32_t));
	e->slots = calloc((size_t)max_rows, sizeof(int32_t));
	e->ctx = calloc((size_t)max_rows, sizeof(int32_t));
	e->out_rows = calloc((size_t)max_rows, sizeof(int32_t));
	e->row_blocks = calloc((size_t)max_rows, sizeof(*e->row_blocks));
	if (!e->tokens || !e->pos || !e->slots || !e->ctx || !e->out_rows || !e->row_blocks) {
		ret = -ENOMEM;
		goto err_destroy;
	}
	if ((ret = engine_kv_init(e, opts, err, err_len)))
		goto err_destroy;
	*out = e;
	return 0;

err_destroy:
	if (ret == -ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "engine: out of memory");
	engine_destroy(e);
	return ret;
}

void engine_thread_attach(struct engine *e)
{
	if (e->be && e->be->ops->thread_attach)
		e->be->ops->thread_attach(e->be);
}

void engine_destroy(struct engine *e)
{
	if (!e)
		return;
	engine_sampler_destroy(e->sampler);
	engine_host_fini(e);	/* the mover's references first */
	engine_snapshot_fini(e);
	kv_sessions_fini(&e->sessions, &e->pool, &e->host);
	kv_host_fini(&e->host);
	kv_codec_fini(&e->codec);
	kv_prefix_fini(&e->prefix);
	free(e->kv_raw);
	free(e->kv_frame);
	kv_spans_free(&e->spans);
	forward_destroy(e->fwd);
	if (e->be)
		e->be->ops->destroy(e->be);
	kv_pool_fini(&e->pool);
	free(e->tokens);
	free(e->pos);
	free(e->slots);
	free(e->ctx);
	free(e->out_rows);
	free(e->row_blocks);
	free(e);
}

void engine_seq_init(struct engine_seq *s)
{
	memset(s, 0, sizeof(*s));
}

void engine_seq_release(struct engine *e, struct engine_seq *s)
{
	/* last block first: the LRU then evicts a cached prefix from its end, and the
	 * first blocks, which more prompts share, stay longest */
	for (int i = s->n_blocks - 1; i >= 0; i--)
		kv_pool_unref(&e->pool, s->blocks[i]);
	free(s->blocks);
	free(s->tokens);
	engine_seq_init(s);
}

int engine_seq_reserve(struct engine_seq *s, int n_tokens, int n_blocks)
{
	if (n_tokens > s->tok_cap) {
		int cap = n_tokens > 2 * s->tok_cap ? n_tokens : 2 * s->tok_cap;
		int32_t *t = realloc(s->tokens, (size_t)cap * sizeof(*t));

		if (!t)
			return -ENOMEM;
		s->tokens = t;
		s->tok_cap = cap;
	}
	if (n_blocks > s->cap) {
		int cap = n_blocks > 2 * s->cap ? n_blocks : 2 * s->cap;
		int32_t *b = realloc(s->blocks, (size_t)cap * sizeof(*b));

		if (!b)
			return -ENOMEM;
		s->blocks = b;
		s->cap = cap;
	}
	return 0;
}

int engine_step_out_rows(const struct engine_req *reqs, int n)
{
	int rows = 0;

	for (int i = 0; i < n; i++)
		rows += reqs[i].all_logits ? reqs[i].n_tokens : 1;
	return rows;
}

static int check_reqs(const struct engine *e, const struct engine_req *reqs, int n,
		      char *err, size_t err_len)
{
	int vocab = e->model->cfg.vocab_size;

	for (int i = 0; i < n; i++) {
		const struct engine_req *r = &reqs[i];

		if (r->n_tokens <= 0 || r->n_tokens > (1 << 24)) {
			snprintf(err, err_len, "request %d: %d tokens (1..%d allowed)", i, r->n_tokens, 1 << 24);
			return -EINVAL;
		}
		if (r->n_draft < 0 || r->n_draft >= r->n_tokens) {
			snprintf(err, err_len, "request %d: %d drafts in %d tokens", i, r->n_draft, r->n_tokens);
			return -EINVAL;
		}
		if ((int64_t)r->seq->n_tokens + r->n_tokens > (int64_t)e->pool.n_blocks * e->pool.block_tokens) {
			snprintf(err, err_len, "request %d: %d + %d tokens exceed the KV cache (%d tokens)",
				 i, r->seq->n_tokens, r->n_tokens, e->pool.n_blocks * e->pool.block_tokens);
			return -ENOSPC;
		}
		for (int t = 0; t < r->n_tokens; t++) {
			if (r->tokens[t] < 0 || r->tokens[t] >= vocab) {
				snprintf(err, err_len, "request %d: token %d at index %d is outside the vocabulary (0..%d)",
					 i, r->tokens[t], t, vocab - 1);
				return -EINVAL;
			}
		}
		for (int j = 0; j < i; j++) {
			if (reqs[j].seq == r->seq) {
				snprintf(err, err_len, "requests %d and %d name the same sequence", j, i);
				return -EINVAL;
			}
		}
	}
	return 0;
}

/* Gives every request's sequence the blocks its new tokens need, all or nothing.
 * grown[i] receives how many blocks request i added (for the rollback). */
static int reserve_blocks(struct engine *e, struct engine_req *reqs, int n, int *grown,
			  char *err, size_t err_len)
{
	int need = 0;

	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;

		grown[i] = kv_pool_blocks_for(&e->pool, (int64_t)s->n_tokens + reqs[i].n_tokens) - s->n_blocks;
		need += grown[i];
	}
	/* cached blocks count as available (the pool evicts them); idle sessions
	 * move to the host tier before a step is refused */
	if (need > kv_pool_available(&e->pool) && engine_make_room(e, need, NULL)) {
		snprintf(err, err_len, "KV cache full: the step needs %d more blocks of %d tokens, %d are free",
			 need, e->pool.block_tokens, kv_pool_available(&e->pool));
		return -ENOSPC;
	}
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;
		int want = s->n_blocks + grown[i];

		if (engine_seq_reserve(s, s->n_tokens + reqs[i].n_tokens, want))
			goto err_rollback;
		while (s->n_blocks < want)
			s->blocks[s->n_blocks++] = kv_pool_alloc(&e->pool);
	}
	return 0;

err_rollback:
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;
		int keep = kv_pool_blocks_for(&e->pool, s->n_tokens);

		while (s->n_blocks > keep)
			kv_pool_unref(&e->pool, s->blocks[--s->n_blocks]);
	}
	snprintf(err, err_len, "engine: out of memory growing a sequence");
	return -ENOMEM;
}

static void release_grown(struct engine *e, struct engine_req *reqs, int n, const int *grown)
{
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;

		for (int k = 0; k < grown[i]; k++)
			kv_pool_unref(&e->pool, s->blocks[--s->n_blocks]);
	}
}

/* Puts the blocks s filled with its first upto tokens in the prefix cache, so that
 * other sequences can start on them while s still runs. */
static void seq_register_full(struct engine *e, struct engine_seq *s, int upto)
{
	int bt = e->pool.block_tokens;

	while (s->cache && s->n_keyed < upto / bt) {
		int b = s->n_keyed;
		struct kv_key k = kv_prefix_key(&e->prefix, s->salt, s->chain, s->tokens + (size_t)b * bt, bt);

		engine_register_block(e, k, s->salt, s->blocks[b]);
		s->chain = k;
		s->n_keyed++;
	}
}

int engine_linear_rounds_x(void *arg, const struct model_tensor *w, int M)
{
	struct engine *e = arg;

	return e && e->be->ops->linear_rounds_x ? e->be->ops->linear_rounds_x(e->be, w, M) : -1;
}

void engine_set_route_trace(struct engine *e, struct route_trace *t)
{
	e->fwd->trace = t;
	e->fwd->trace_err[0] = 0;
}

/* Runs the rows staged so far. */
static int flush_rows(struct engine *e, int n_rows, int n_out, float *logits)
{
	struct fwd_batch b = {
		.n_rows = n_rows,
		.tokens = e->tokens,
		.pos = e->pos,
		.slots = e->slots,
		.attn = { .n_rows = n_rows, .ctx = e->ctx, .blocks = e->row_blocks },
		.n_out = n_out,
		.out_rows = e->out_rows,
	};

	return forward_run(e->fwd, &b, logits);
}

int engine_step(struct engine *e, struct engine_req *reqs, int n, float *logits,
		char *err, size_t err_len)
{
	size_t vocab = (size_t)e->model->cfg.vocab_size;
	int grown_small[64], *grown = grown_small;
	int rows = 0, outs = 0, all_rows = 0, ret;
	int bt = e->pool.block_tokens;
	double ctx_tokens = 0;

	if (n <= 0)
		return 0;
	if ((ret = check_reqs(e, reqs, n, err, err_len)))
		return ret;
	if (n > 64 && !(grown = malloc((size_t)n * sizeof(*grown))))
		return -ENOMEM;
	if ((ret = reserve_blocks(e, reqs, n, grown, err, err_len)))
		goto out;
	for (int i = 0; i < n; i++) {
		const struct engine_req *r = &reqs[i];
		const struct engine_seq *s = r->seq;

		for (int t = 0; t < r->n_tokens; t++) {
			int p = s->n_tokens + t;

			e->tokens[rows] = r->tokens[t];
			e->pos[rows] = p;
			e->slots[rows] = s->blocks[p / bt] * bt + p % bt;
			e->ctx[rows] = p + 1;
			ctx_tokens += p + 1;
			all_rows++;
			e->row_blocks[rows] = s->blocks;
			if (r->all_logits || t == r->n_tokens - 1)
				e->out_rows[outs++] = rows;
			if (++rows == e->fwd->max_rows) {
				if ((ret = flush_rows(e, rows, outs, logits)))
					goto err_forward;
				logits += (size_t)outs * vocab;
				rows = outs = 0;
			}
		}
	}
	if (rows && (ret = flush_rows(e, rows, outs, logits)))
		goto err_forward;
	for (int i = 0; i < n; i++) {
		struct engine_seq *s = reqs[i].seq;

		memcpy(s->tokens + s->n_tokens, reqs[i].tokens, (size_t)reqs[i].n_tokens * sizeof(int32_t));
		s->n_tokens += reqs[i].n_tokens;
		e->stats.prompt_tokens += (uint64_t)reqs[i].n_tokens;
		/* a draft may be rejected: a block holding one must stay private,
		 * or a prefix hit could map tokens the sequence never had */
		seq_register_full(e, s, s->n_tokens - reqs[i].n_draft);
	}
	e->stats.steps++;
	e->last_step_bytes = engine_weight_bytes(e->model, all_rows) + engine_kv_bytes(e, ctx_tokens);
	ret = 0;
	goto out;

err_forward:
	release_grown(e, reqs, n, grown);
	if (e->fwd->trace && e->fwd->trace_err[0])
		snprintf(err, err_len, "forward pass failed: %s", e->fwd->trace_err);
	else
		snprintf(err, err_len, "forward pass failed: %s", strerror(-ret));
out:
	if (grown != grown_small)
		free(grown);
	return ret;
}

int engine_seq_truncate(struct engine *e, struct engine_seq *s, int n_tokens)
{
	int keep = kv_pool_blocks_for(&e->pool, n_tokens);

	if (n_tokens < 0 || n_tokens > s->n_tokens || n_tokens < s->n_keyed * e->pool.block_tokens)
		return -EINVAL;
	/* check all first: a half-done rollback would leave n_tokens and blocks apart */
	for (int b = keep; b < s->n_blocks; b++)
		if (e->pool.refs[s->blocks[b]] != 1 || e->pool.cached[s->blocks[b]])
			return -EBUSY;
	while (s->n_blocks > keep)
		kv_pool_unref(&e->pool, s->blocks[--s->n_blocks]);
	/* the partial block at the new end keeps stale K/V past n_tokens; attention
	 * reads only positions < ctx and the next step overwrites them */
	s->n_tokens = n_tokens;
	seq_register_full(e, s, n_tokens);
	return 0;
}

/* ---- prefix cache --------------------------------------------------------- */

void engine_register_block(struct engine *e, struct kv_key key, uint64_t salt, int32_t block)
{
	/* -EEXIST: another sequence computed the same block first; this copy stays
	 * private and is freed with its holders */
	if (!kv_prefix_insert(&e->prefix, key, salt, block))
		kv_pool_set_cached(&e->pool, block);
}

void engine_chain_keys(const struct engine *e, uint64_t salt, const int32_t *tokens, int n,
		       struct kv_key *keys)
{
	struct kv_key k = { 0, 0 };
	int bt = e->pool.block_tokens;

	for (int b = 0; b < n / bt; b++)
		keys[b] = k = kv_prefix_key(&e->prefix, salt, k, tokens + (size_t)b * bt, bt);
}

void engine_seq_map_cached(struct engine *e, struct engine_seq *s, const int32_t *prompt,
			   int max_blocks)
{
	int bt = e->pool.block_tokens, restored = 0;
	uint64_t t0 = 0;

	while (s->n_keyed < max_blocks) {
		const int32_t *t = prompt + (size_t)s->n_keyed * bt;
		struct kv_key k = kv_prefix_key(&e->prefix, s->salt, s->chain, t, bt);
		int32_t id = kv_prefix_find(&e->prefix, k, s->salt);

		if (id >= 0) {
			kv_pool_ref(&e->pool, id);
		} else {
			struct kv_host_block *hb = kv_host_find(&e->host, k, s->salt);

			if (!hb)
				break;
			if (!restored++)
				t0 = engine_now(e);
			if (engine_block_restore(e, hb, &id))
				break;
			engine_register_block(e, k, s->salt, id);
		}
		s->blocks[s->n_blocks++] = id;
		memcpy(s->tokens + (size_t)s->n_keyed * bt, t, (size_t)bt * sizeof(*t));
		s->n_keyed++;
		s->n_tokens = s->n_keyed * bt;
		s->chain = k;
	}
	if (restored) {
		e->stats.restores++;
		e->stats.restore_ns += engine_now(e) - t0;
	}
}

int engine_seq_begin(struct engine *e, struct engine_seq *s, const int32_t *prompt, int n,
		     uint64_t salt)
{
	int vocab = e->model->cfg.vocab_size;

	if (s->n_tokens || s->n_blocks || n < 1 || n > (1 << 24))
		return -EINVAL;
	for (int t = 0; t < n; t++)
		if (prompt[t] < 0 || prompt[t] >= vocab)
			return -EINVAL;
	if (engine_seq_reserve(s, n, kv_pool_blocks_for(&e->pool, n)))
		return -ENOMEM;
	s->cache = 1;
	s->salt = salt;
	s->n_keyed = 0;
	s->chain = (struct kv_key){ 0, 0 };
	return 0;
}

int engine_seq_start(struct engine *e, struct engine_seq *s, const int32_t *prompt, int n,
		     uint64_t salt, int *cached_tokens)
{
	int ret;

	if (cached_tokens)
		*cached_tokens = 0;
	if ((ret = engine_seq_begin(e, s, prompt, n, salt)))
		return ret;
	/* (n - 1) / bt whole blocks at most: one token is always left to compute, and
	 * it lands in a block of the sequence's own, never in a shared one */
	engine_seq_map_cached(e, s, prompt, (n - 1) / e->pool.block_tokens);
	e->stats.prefix_hit_tokens += (uint64_t)s->n_tokens;
	if (cached_tokens)
		*cached_tokens = s->n_tokens;
	return 0;
}

void engine_cache_drop(struct engine *e)
{
	while (kv_pool_evict_lru(&e->pool) >= 0)
		;
}

void engine_cache_status(const struct engine *e, struct engine_cache_status *st)
{
	memset(st, 0, sizeof(*st));
	st->block_tokens = e->pool.block_tokens;
	st->blocks_total = e->pool.n_blocks;
	st->blocks_free = e->pool.n_free;
	st->blocks_cached = e->pool.n_lru;
	st->blocks_used = e->pool.n_blocks - e->pool.n_free - e->pool.n_lru;
	st->host_blocks = (int64_t)e->host.n_blocks;
	st->host_bytes = (int64_t)e->host.used;
	st->host_budget = (int64_t)e->host.budget;
	st->sessions = e->sessions.n;
}
