/* Synthetic weights: any supported config with deterministic random weights and no
 * weight files, so that full-size configs can be benchmarked. Values are uniform in
 * +-1/sqrt(cols) (norm weights near 1) so that activations stay O(1) through depth;
 * --weight-format stores the linear weights quantized instead (plan_quant). Element i of
 * a tensor depends only on the seed, the tensor and i (a generator seeded per group of
 * SYNTH_GROUP elements), so that a tensor-parallel shard's slices are generated alone
 * (lazy: model_synthetic_read), equal to those of the model made whole. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/model/model.h"

#define FILL_CHUNK (1u << 20)	/* elements a fill thread takes at once */
#define SYNTH_GROUP 64		/* elements per independently seeded generator */
#define FILL_THREADS_MAX 16

struct synth_plan {
	struct model *m;
	const struct model_quant *q;	/* MODEL_Q_NONE: all in the config's dtype */
	int assign;		/* 0: count bytes; 1: point slots into the buffer */
	char *base;		/* the buffer (or a lazy model's reservation) */
	size_t bytes;
	unsigned n_tensors;
	struct synth_job *jobs;	/* (n_tensors) when assign */
};

struct synth_job {
	void *data;
	size_t n;		/* elements (raw: bytes) */
	enum k_dtype dtype;
	int raw;		/* random bytes & mask: a quantized payload */
	int int4;		/* raw int4 nibbles: never 0 (the value -8), made 8 (0) */
	uint8_t mask;
	float scale;		/* uniform half-width */
	float center;		/* 1 for norm weights, else 0 */
	uint64_t key;
};

static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* Whether the published checkpoints quantize this weight: every linear but the
 * embedding, lm_head and the router (kept bf16 by DeepSeek-V3's fp8, by the
 * compressed-tensors recipes' ignore lists). */
static int synth_quantized(const char *name, int64_t cols)
{
	size_t n = strlen(name);

	return cols > 1 && strcmp(name, "model.embed_tokens.weight") && strcmp(name, "lm_head.weight") &&
	       !(n >= 16 && !strcmp(name + n - 16, ".mlp.gate.weight"));
}

/* The payload and scales of one quantized weight: two jobs. Random e4m3 bytes with
 * bit 6 clear (exponent <= 7: |v| < 2, never NaN, RMS about 0.5) scaled by
 * 2/sqrt(cols); random int4 values -7..7, 0 twice as often (RMS about 4.2), by
 * 0.22/sqrt(cols). The int4 values have mean 0, as a real layer's have: uniform
 * nibbles (-8..7, mean -0.5) gave every output of a matrix the same offset, -0.5 x the
 * scale x the sum of its input, which the layers after it amplified until every
 * token's hidden state was the same vector and the router chose the same experts for
 * all of them (Qwen3-30B-A3B: 8 distinct experts over 8 tokens from the second layer
 * on, against 18-30 in fp8), so int4 MoE steps above one row read a fraction of the
 * experts a real batch does. */
static void plan_quant(struct synth_plan *p, struct model_tensor *slot, int64_t rows, int64_t cols)
{
	const struct model_quant *mq = p->q;
	struct k_quant q = { .fmt = mq->format == MODEL_Q_INT4_GROUP ? K_Q_INT4 : K_Q_FP8,
			     .scale_dtype = mq->format == MODEL_Q_FP8_BLOCK ? K_F32 : K_BF16 };
	size_t payload, nscale;

	switch (mq->format) {
	case MODEL_Q_FP8_BLOCK: q.block_rows = mq->block_rows, q.block_cols = mq->block_cols; break;
	case MODEL_Q_FP8_CHANNEL: q.block_rows = 1, q.block_cols = (int)cols; break;
	case MODEL_Q_FP8_TENSOR: q.block_rows = (int)rows, q.block_cols = (int)cols; break;
	default: q.block_rows = 1, q.block_cols = mq->group_size; break;
	}
	q.scale_cols = (cols + q.block_cols - 1) / q.block_cols;
	payload = ((size_t)rows * k_quant_row_bytes(q.fmt, cols) + 63) & ~(size_t)63;
	nscale = (size_t)((rows + q.block_rows - 1) / q.block_rows) * (size_t)q.scale_cols;
	if (p->assign) {
		struct synth_job *j = &p->jobs[p->n_tensors];

		slot->data = p->base + p->bytes;
		slot->dtype = p->m->cfg.dtype;
		slot->rows = rows;
		slot->cols = cols;
		q.scale = p->base + p->bytes + payload;
		slot->q = q;
		*j = (struct synth_job){ .data = (void *)slot->data, .n = payload, .raw = 1,
					 .mask = q.fmt == K_Q_FP8 ? 0xbf : 0xff,
					 .int4 = q.fmt == K_Q_INT4,
					 .key = splitmix64(p->n_tensors) };
		j[1] = (struct synth_job){ .data = (void *)q.scale, .n = nscale, .dtype = q.scale_dtype,
					   .center = (q.fmt == K_Q_FP8 ? 2.0f : 0.22f) / sqrtf((float)cols),
					   .key = splitmix64(p->n_tensors + 1) };
		p->m->n_quantized++;
	}
	p->bytes += payload + ((nscale * k_dtype_size(q.scale_dtype) + 63) & ~(size_t)63);
	p->n_tensors += 2;
}

static int plan_tensor(void *ctx, const char *name, struct model_tensor *slot,
		       int64_t rows, int64_t cols)
{
	struct synth_plan *p = ctx;
	enum k_dtype dt = p->m->cfg.dtype;
	size_t n = (size_t)rows * (size_t)cols;
	size_t bytes = (n * k_dtype_size(dt) + 63) & ~(size_t)63;

	if (!slot)
		return -EINVAL;
	if (p->q->format != MODEL_Q_NONE && synth_quantized(name, cols)) {
		plan_quant(p, slot, rows, cols);
		return 0;
	}
	if (p->assign) {
		struct synth_job *j = &p->jobs[p->n_tensors];

		slot->data = p->base + p->bytes;
		slot->dtype = dt;
		slot->rows = rows;
		slot->cols = cols;
		slot->q = (struct k_quant){ 0 };
		j->data = (void *)slot->data;
		j->n = n;
		j->dtype = dt;
		j->center = cols == 1 ? 1.0f : 0.0f;
		j->scale = cols == 1 ? 0.1f : 1.0f / sqrtf((float)cols);
		j->key = splitmix64(p->n_tensors);
	}
	p->bytes += bytes;
	p->n_tensors++;
	return 0;
}

struct fill_ctx {
	struct synth_plan *plan;
	uint64_t seed;
	unsigned thread, n_threads;
};

/* Elements [i0, i0 + n) of job j into dst (element i0's place). */
static void synth_run(const struct synth_job *j, uint64_t seed, size_t i0, size_t n, void *dst)
{
	enum k_dtype dt = j->dtype;
	size_t g = i0 / SYNTH_GROUP;
	uint64_t s = splitmix64(seed ^ j->key ^ splitmix64(g++)) | 1;	/* xorshift: never 0 */

	for (size_t i = i0 - i0 % SYNTH_GROUP; i < i0; i++) {	/* the group's values before i0 */
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
	}
	for (size_t i = i0, k = 0; k < n; i++) {
		float v;

		if (i % SYNTH_GROUP == 0 && i > i0)
			s = splitmix64(seed ^ j->key ^ splitmix64(g++)) | 1;
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		if (j->raw) {
			uint8_t b = (uint8_t)(s >> 32) & j->mask;

			if (j->int4)
				b |= (b & 0x0f ? 0 : 0x08) | (b & 0xf0 ? 0 : 0x80);
			((uint8_t *)dst)[k++] = b;
			continue;
		}
		v = j->center + j->scale * ((float)(s >> 40) * (2.0f / 16777216.0f) - 1.0f);
		if (dt == K_F32)
			((float *)dst)[k++] = v;
		else if (dt == K_BF16)
			((uint16_t *)dst)[k++] = k_f32_to_bf16(v);
		else
			((uint16_t *)dst)[k++] = k_f32_to_f16(v);
	}
}

static size_t job_elem_bytes(const struct synth_job *j)
{
	return j->raw ? 1 : k_dtype_size(j->dtype);
}

static void fill_chunk(const struct synth_job *j, uint64_t seed, size_t c)
{
	size_t begin = c * FILL_CHUNK, end = begin + FILL_CHUNK < j->n ? begin + FILL_CHUNK : j->n;

	synth_run(j, seed, begin, end - begin, (char *)j->data + begin * job_elem_bytes(j));
}

static void *fill_thread(void *arg)
{
	struct fill_ctx *f = arg;
	struct synth_plan *p = f->plan;
	size_t k = 0;

	/* Chunks are dealt round-robin over all tensors: the values do not depend on the
	 * number of threads. */
	for (unsigned t = 0; t < p->n_tensors; t++) {
		const struct synth_job *j = &p->jobs[t];
		size_t n_chunks = (j->n + FILL_CHUNK - 1) / FILL_CHUNK;

		for (size_t c = 0; c < n_chunks; c++, k++)
			if (k % f->n_threads == f->thread)
				fill_chunk(j, f->seed, c);
	}
	return NULL;
}

static void fill_all(struct synth_plan *p, uint64_t seed)
{
	struct fill_ctx ctx[FILL_THREADS_MAX];
	pthread_t tid[FILL_THREADS_MAX];
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	unsigned n = cpus < 1 ? 1 : cpus > FILL_THREADS_MAX ? FILL_THREADS_MAX : (unsigned)cpus;
	unsigned started = 0;

	for (unsigned i = 0; i < n; i++) {
		ctx[i] = (struct fill_ctx){ .plan = p, .seed = seed, .thread = i, .n_threads = n };
		if (i > 0 && pthread_create(&tid[i], NULL, fill_thread, &ctx[i]) == 0)
			started |= 1u << i;
	}
	fill_thread(&ctx[0]);
	for (unsigned i = 1; i < n; i++) {
		if (started & (1u << i))
			pthread_join(tid[i], NULL);
		else
			fill_thread(&ctx[i]);	/* could not start: do its share here */
	}
}

/* The lazy model's address space: reserved, never backed (PROT_NONE: a stray read of
 * the whole model faults instead of reading zeros). */
static int reserve_lazy(struct model *m, size_t bytes, char *err, size_t err_len)
{
	void *p = mmap(NULL, bytes ? bytes : 1, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		       -1, 0);

	if (p == MAP_FAILED) {
		snprintf(err, err_len, "%s: cannot reserve %.2f GiB of address space for the synthetic "
			 "model's slices", m->path, (double)bytes / (1u << 30));
		return -ENOMEM;
	}
	m->synth_reserve = p;
	m->synth_reserve_bytes = bytes ? bytes : 1;
	m->synthetic_buf = NULL;
	return 0;
}

int model_synthetic_read(const struct model *m, void *dst, const void *src, size_t bytes)
{
	const char *p = src;
	unsigned lo = 0, hi = m->n_synth_jobs;

	if (!m->synth_jobs)
		return -EINVAL;
	while (hi - lo > 1) {	/* the last job starting at or below p (jobs ascend) */
		unsigned mid = lo + (hi - lo) / 2;

		if ((const char *)m->synth_jobs[mid].data <= p)
			lo = mid;
		else
			hi = mid;
	}
	const struct synth_job *j = &m->synth_jobs[lo];
	size_t es = job_elem_bytes(j), off = (size_t)(p - (const char *)j->data);

	if (p < (const char *)j->data || off % es || bytes % es || off / es + bytes / es > j->n)
		return -EINVAL;
	synth_run(j, m->synth_seed, off / es, bytes / es, dst);
	return 0;
}

int model_synthesize(struct model *m, uint64_t seed, const struct model_quant *q, int lazy,
		     char *err, size_t err_len)
{
	static const struct model_quant none;
	struct synth_plan p = { .m = m, .q = q ? q : &none };
	char qname[24];
	double t0;
	int ret;

	if ((ret = model_for_each_tensor(m, plan_tensor, &p)))
		return ret;
	p.jobs = calloc(p.n_tensors, sizeof(*p.jobs));
	if (lazy && p.jobs && (ret = reserve_lazy(m, p.bytes, err, err_len))) {
		free(p.jobs);
		return ret;
	}
	if (!lazy)
		m->synthetic_buf = aligned_alloc(64, p.bytes);
	if ((!lazy && !m->synthetic_buf) || !p.jobs) {
		snprintf(err, err_len, "%s: synthetic weights need %.2f GiB of host memory: out of memory",
			 m->path, (double)p.bytes / (1u << 30));
		free(p.jobs);
		return -ENOMEM;
	}
	m->weight_bytes = p.bytes;
	p.base = lazy ? m->synth_reserve : m->synthetic_buf;
	p.assign = 1;
	p.bytes = 0;
	p.n_tensors = 0;
	if ((ret = model_for_each_tensor(m, plan_tensor, &p)))
		goto out;
	t0 = clock_now();
	m->cfg.quant = *p.q;	/* what the weights are, whatever the config said */
	if (lazy) {	/* the shards generate their slices (model_shard.c) */
		log_info("synthetic weights: %.2f GiB of %s%s%s planned, generated slice by slice into "
			 "the shards (seed %llu)", (double)p.bytes / (1u << 30), k_dtype_name(m->cfg.dtype),
			 p.q->format != MODEL_Q_NONE ? ", linears " : "",
			 p.q->format != MODEL_Q_NONE ? model_quant_name(p.q, qname, sizeof(qname)) : "",
			 (unsigned long long)seed);
		m->synth_jobs = p.jobs;
		m->n_synth_jobs = p.n_tensors;
		m->synth_seed = seed;
		p.jobs = NULL;
		goto bias;
	}
	log_info("synthesizing %.2f GiB of %s weights%s%s (seed %llu)...", (double)p.bytes / (1u << 30),
		 k_dtype_name(m->cfg.dtype), p.q->format != MODEL_Q_NONE ? ", linears " : "",
		 p.q->format != MODEL_Q_NONE ? model_quant_name(p.q, qname, sizeof(qname)) : "",
		 (unsigned long long)seed);
	fill_all(&p, seed);
	log_info("synthetic weights ready in %.1f s", clock_now() - t0);
bias:
	for (int l = 0; l < m->cfg.n_layers; l++) {
		struct model_layer *L = &m->layers[l];
		uint64_t s = splitmix64(seed ^ 0xb1a5ull ^ (uint64_t)l);

		if (!L->is_moe || m->cfg.route.scoring != K_MOE_SIGMOID)
			continue;
		L->router_bias = malloc((size_t)m->cfg.n_experts * sizeof(float));
		if (!L->router_bias) {
			ret = -ENOMEM;
			goto out;
		}
		for (int e = 0; e < m->cfg.n_experts; e++) {
			s = splitmix64(s);
			L->router_bias[e] = 0.01f * ((float)(s >> 40) / 16777216.0f);
		}
	}
out:
	free(p.jobs);
	return ret;
}
