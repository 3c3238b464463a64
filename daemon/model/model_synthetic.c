/* Synthetic weights: any supported config with deterministic random weights and no
 * weight files, so that full-size configs can be benchmarked. Values are uniform in
 * +-1/sqrt(cols) (norm weights near 1) so that activations stay O(1) through depth. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/model/model.h"

#define FILL_CHUNK (1u << 20)	/* elements per independently seeded chunk */
#define FILL_THREADS_MAX 16

struct synth_plan {
	struct model *m;
	int assign;		/* 0: count bytes; 1: point slots into the buffer */
	size_t bytes;
	unsigned n_tensors;
	struct synth_job *jobs;	/* (n_tensors) when assign */
};

struct synth_job {
	void *data;
	size_t n;		/* elements */
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

static int plan_tensor(void *ctx, const char *name, struct model_tensor *slot,
		       int64_t rows, int64_t cols)
{
	struct synth_plan *p = ctx;
	enum k_dtype dt = p->m->cfg.dtype;
	size_t n = (size_t)rows * (size_t)cols;
	size_t bytes = (n * k_dtype_size(dt) + 63) & ~(size_t)63;

	if (!slot)
		return -EINVAL;
	if (p->assign) {
		struct synth_job *j = &p->jobs[p->n_tensors];

		slot->data = (char *)p->m->synthetic_buf + p->bytes;
		slot->dtype = dt;
		slot->rows = rows;
		slot->cols = cols;
		j->data = (void *)slot->data;
		j->n = n;
		j->center = cols == 1 ? 1.0f : 0.0f;
		j->scale = cols == 1 ? 0.1f : 1.0f / sqrtf((float)cols);
		j->key = splitmix64(p->n_tensors);
	}
	p->bytes += bytes;
	p->n_tensors++;
	(void)name;
	return 0;
}

struct fill_ctx {
	struct synth_plan *plan;
	uint64_t seed;
	unsigned thread, n_threads;
};

static void fill_chunk(const struct synth_job *j, enum k_dtype dt, uint64_t seed, size_t c)
{
	size_t begin = c * FILL_CHUNK, end = begin + FILL_CHUNK < j->n ? begin + FILL_CHUNK : j->n;
	uint64_t s = splitmix64(seed ^ j->key ^ splitmix64(c));

	for (size_t i = begin; i < end; i++) {
		float v;

		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		v = j->center + j->scale * ((float)(s >> 40) * (2.0f / 16777216.0f) - 1.0f);
		if (dt == K_F32)
			((float *)j->data)[i] = v;
		else if (dt == K_BF16)
			((uint16_t *)j->data)[i] = k_f32_to_bf16(v);
		else
			((uint16_t *)j->data)[i] = k_f32_to_f16(v);
	}
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
				fill_chunk(j, p->m->cfg.dtype, f->seed, c);
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

int model_synthesize(struct model *m, uint64_t seed, char *err, size_t err_len)
{
	struct synth_plan p = { .m = m };
	double t0;
	int ret;

	if ((ret = model_for_each_tensor(m, plan_tensor, &p)))
		return ret;
	m->synthetic_buf = aligned_alloc(64, p.bytes);
	p.jobs = calloc(p.n_tensors, sizeof(*p.jobs));
	if (!m->synthetic_buf || !p.jobs) {
		snprintf(err, err_len, "%s: synthetic weights need %.2f GiB of host memory: out of memory",
			 m->path, (double)p.bytes / (1u << 30));
		free(p.jobs);
		return -ENOMEM;
	}
	m->weight_bytes = p.bytes;
	p.assign = 1;
	p.bytes = 0;
	p.n_tensors = 0;
	if ((ret = model_for_each_tensor(m, plan_tensor, &p)))
		goto out;
	t0 = clock_now();
	log_info("synthesizing %.2f GiB of %s weights (seed %llu)...", (double)p.bytes / (1u << 30),
		 k_dtype_name(m->cfg.dtype), (unsigned long long)seed);
	fill_all(&p, seed);
	log_info("synthetic weights ready in %.1f s", clock_now() - t0);
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
