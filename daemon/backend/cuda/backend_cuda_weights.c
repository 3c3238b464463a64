/* The model's weights on the GPU: one arena sized up front (so out-of-memory is
 * known before anything is copied, with the numbers), matrices converted to bf16,
 * vectors to fp32, copied through a pinned staging buffer with a progress line. The
 * sources are the model's own copy of its files (model.h: never a mapping), read here
 * once at create; no op reads a host weight after, so nothing done to the files under
 * a running daemon reaches the GPU's copy. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"

#define STAGE_BYTES (64u << 20)	/* pinned staging buffer */
#define ARENA_ALIGN 256

/* ---- host -> device pointer map ------------------------------------------ */

static size_t ptr_hash(const void *p, size_t cap)
{
	uint64_t x = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;

	return (size_t)(x >> 17) & (cap - 1);
}

int cuda_ptr_map_put(struct cuda_ptr_map *m, const void *key, void *val)
{
	if (2 * (m->n + 1) > m->cap) {
		struct cuda_ptr_map g = { .cap = m->cap ? 2 * m->cap : 1024 };

		g.keys = calloc(g.cap, sizeof(*g.keys));
		g.vals = calloc(g.cap, sizeof(*g.vals));
		if (!g.keys || !g.vals) {
			free(g.keys);
			free(g.vals);
			return -ENOMEM;
		}
		for (size_t i = 0; i < m->cap; i++)
			if (m->keys[i])
				cuda_ptr_map_put(&g, m->keys[i], m->vals[i]);
		cuda_ptr_map_fini(m);
		*m = g;
	}
	for (size_t i = ptr_hash(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
		if (!m->keys[i]) {
			m->keys[i] = key;
			m->vals[i] = val;
			m->n++;
			return 0;
		}
		if (m->keys[i] == key) {
			m->vals[i] = val;
			return 0;
		}
	}
}

void *cuda_ptr_map_get(const struct cuda_ptr_map *m, const void *key)
{
	if (!m->cap || !key)
		return NULL;
	for (size_t i = ptr_hash(key, m->cap); m->keys[i]; i = (i + 1) & (m->cap - 1))
		if (m->keys[i] == key)
			return m->vals[i];
	return NULL;
}

void cuda_ptr_map_fini(struct cuda_ptr_map *m)
{
	free(m->keys);
	free(m->vals);
	memset(m, 0, sizeof(*m));
}

/* ---- the walk over every weight ------------------------------------------ */

/* One weight to place: a host source, its type and shape; vectors become fp32. */
struct weight_item {
	const void *src;
	enum k_dtype dtype;
	size_t n;		/* elements */
	int vector;		/* fp32 on the device, else bf16 */
	const struct k_quant *q;	/* quantized (else NULL): dequantized to bf16 */
	int64_t cols;		/* row length, for q */
};

/* Elements [i, i + n) of a quantized (.., cols) weight as bf16: dequantized exactly in
 * fp32 (kernels/quant.h), then rounded once. The interim fallback until the GPU has
 * kernels that read the quantized bytes (cuda_create logs it). */
static void stage_quant(uint16_t *dst, const struct weight_item *w, size_t i, size_t n)
{
	float f[256];

	for (size_t j = 0; j < n;) {
		int64_t r = (int64_t)((i + j) / (size_t)w->cols), k = (int64_t)((i + j) % (size_t)w->cols);
		int64_t len = w->cols - k;

		if (len > 256)
			len = 256;
		if ((size_t)len > n - j)
			len = (int64_t)(n - j);
		k_quant_row_to_f32(f, w->src, w->q, w->cols, r, k, len);
		for (int64_t t = 0; t < len; t++)
			dst[j + (size_t)t] = k_f32_to_bf16(f[t]);
		j += (size_t)len;
	}
}

struct upload {
	struct backend_cuda *b;
	int pass;		/* 0: size the arena; 1: copy */
	size_t off;		/* bytes placed so far */
	size_t total;		/* bytes of the arena (pass 1) */
	void *stage;		/* pinned (STAGE_BYTES) */
	double t0, last_report;
	int ret;
};

static size_t item_bytes(const struct weight_item *w)
{
	return w->n * (w->vector ? sizeof(float) : sizeof(uint16_t));
}

static void report(struct upload *u, int done)
{
	double now = clock_now();

	if (!done && now - u->last_report < 1.0)
		return;
	u->last_report = now;
	log_info("cuda: weights %5.1f%% (%.2f of %.2f GiB, %.1f GB/s)%s",
		 100.0 * (double)u->off / (double)(u->total ? u->total : 1),
		 (double)u->off / (1u << 30), (double)u->total / (1u << 30),
		 (double)u->off / 1e9 / (now - u->t0 > 1e-9 ? now - u->t0 : 1e-9), done ? ", done" : "");
}

/* Converts and copies one item into dst through the staging buffer. */
static int copy_item(struct upload *u, char *dst, const struct weight_item *w)
{
	size_t out_size = w->vector ? sizeof(float) : sizeof(uint16_t);
	size_t per = STAGE_BYTES / out_size;
	int ret;

	for (size_t i = 0; i < w->n; i += per) {
		size_t n = w->n - i < per ? w->n - i : per;

		if (w->q) {
			stage_quant(u->stage, w, i, n);
		} else if (w->vector) {
			float *s = u->stage;

			for (size_t j = 0; j < n; j++)
				s[j] = k_load(w->src, w->dtype, i + j);
		} else if (w->dtype == K_BF16) {
			memcpy(u->stage, (const uint16_t *)w->src + i, n * sizeof(uint16_t));
		} else {
			uint16_t *s = u->stage;

			for (size_t j = 0; j < n; j++)
				s[j] = k_f32_to_bf16(k_load(w->src, w->dtype, i + j));
		}
		/* synchronous: the staging buffer is refilled next */
		if ((ret = CUDA_CHECK(u->b, cudaMemcpy(dst + i * out_size, u->stage, n * out_size,
						       cudaMemcpyHostToDevice))))
			return ret;
	}
	return 0;
}

/* Places one item (pass 0 counts, pass 1 copies) and maps key to its copy. Several
 * keys may name one host source (tied embeddings): it is placed once. */
static void place(struct upload *u, const void *key, const struct weight_item *w)
{
	char *dst;

	if (u->ret || !key || !w->src || cuda_ptr_map_get(&u->b->map, key))
		return;
	dst = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += (item_bytes(w) + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
	if (u->pass == 0) {
		u->ret = cuda_ptr_map_put(&u->b->map, key, (void *)1);	/* seen */
		return;
	}
	if ((u->ret = copy_item(u, dst, w)))
		return;
	if ((u->ret = cuda_ptr_map_put(&u->b->map, key, dst)))
		return;
	report(u, 0);
}

static void place_tensor(struct upload *u, const struct model_tensor *t)
{
	struct weight_item w = {
		.src = t->data, .dtype = t->dtype, .n = (size_t)t->rows * (size_t)t->cols,
		.vector = t->cols == 1, .q = t->q.fmt != K_Q_NONE ? &t->q : NULL, .cols = t->cols,
	};

	if (!w.vector && t->cols > u->b->max_K)
		u->b->max_K = (int)t->cols;
	place(u, t->data, &w);
}

/* A MoE layer's experts: all gate/up/down matrices, then a device table (n_experts,
 * 3) of their device pointers, mapped under L->experts. */
static void place_experts(struct upload *u, const struct model_layer *L)
{
	const struct model_config *c = &u->b->m->cfg;
	size_t inter = (size_t)c->moe_intermediate_size, hidden = (size_t)c->hidden_size;
	size_t table_bytes = (size_t)c->n_experts * 3 * sizeof(void *);
	void **table = NULL;
	char *dst;

	if (u->pass == 1 && !(table = malloc(table_bytes))) {
		u->ret = -ENOMEM;
		return;
	}
	for (int e = 0; e < c->n_experts; e++) {
		const struct k_expert *x = &L->experts[e];
		const void *src[3] = { x->gate, x->up, x->down };
		const struct k_quant *q[3] = { &x->gate_q, &x->up_q, &x->down_q };

		for (int j = 0; j < 3; j++) {
			struct weight_item w = { .src = src[j], .dtype = L->expert_dtype,
						 .n = inter * hidden,
						 .q = q[j]->fmt != K_Q_NONE ? q[j] : NULL,
						 .cols = (int64_t)(j < 2 ? hidden : inter) };

			place(u, src[j], &w);
			if (table)
				table[3 * e + j] = cuda_ptr_map_get(&u->b->map, src[j]);
		}
	}
	if ((size_t)u->b->max_K < inter)
		u->b->max_K = (int)inter;
	if ((size_t)u->b->max_K < hidden)
		u->b->max_K = (int)hidden;
	dst = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += (table_bytes + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
	if (table && !u->ret) {
		u->ret = CUDA_CHECK(u->b, cudaMemcpy(dst, table, table_bytes, cudaMemcpyHostToDevice));
		if (!u->ret)
			u->ret = cuda_ptr_map_put(&u->b->map, L->experts, dst);
	}
	free(table);
}

static void place_layer(struct upload *u, const struct model_layer *L)
{
	const struct model_config *c = &u->b->m->cfg;
	const int lora = L->wq_a.data != NULL;
	/* MLA: the projection of h before kv_a's (wq_a with q-LoRA, else wq_b) right
	 * before wkv_a, so mla_prep reads the two as one matrix */
	const struct model_tensor *t[] = {
		&L->attn_norm, &L->ffn_norm, &L->wq, &L->wk, &L->wv, &L->q_norm, &L->k_norm,
		lora ? &L->wq_a : &L->wq_b, &L->wkv_a, &L->q_a_norm, lora ? &L->wq_b : &L->wq_a,
		&L->kv_a_norm, &L->wkv_b, &L->wo, &L->w_gate, &L->w_up, &L->w_down, &L->router,
	};

	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		place_tensor(u, t[i]);
	if (L->router_bias) {
		struct weight_item w = { .src = L->router_bias, .dtype = K_F32,
					 .n = (size_t)c->n_experts, .vector = 1 };

		place(u, L->router_bias, &w);
	}
	if (L->is_moe && L->experts)
		place_experts(u, L);
}

static void place_model(struct upload *u)
{
	const struct model *m = u->b->m;

	place_tensor(u, &m->embed);
	place_tensor(u, &m->final_norm);
	place_tensor(u, &m->lm_head);
	for (int l = 0; l < m->cfg.n_layers; l++)
		place_layer(u, &m->layers[l]);
}

int cuda_weights_upload(struct backend_cuda *b, char *err, size_t err_len)
{
	struct upload u = { .b = b };
	size_t free_b = 0, total_b = 0;
	int ret;

	place_model(&u);	/* pass 0: the arena's size */
	cuda_ptr_map_fini(&b->map);
	if (u.ret)
		return u.ret;
	b->arena_bytes = u.off;
	cudaMemGetInfo(&free_b, &total_b);
	if (cudaMalloc(&b->arena, b->arena_bytes) != cudaSuccess) {
		cudaGetLastError();
		b->arena = NULL;
		snprintf(err, err_len,
			 "cuda: out of GPU memory for the weights: they need %.2f GiB, GPU %d has %.2f GiB free of %.2f GiB%s",
			 (double)b->arena_bytes / (1u << 30), b->dev, (double)free_b / (1u << 30),
			 (double)total_b / (1u << 30), b->m->n_quantized > 0 ? " (quantized weights "
			 "count as bf16: the interim fallback dequantizes them at load)" : "");
		return -ENOMEM;
	}
	if (cudaHostAlloc(&u.stage, STAGE_BYTES, cudaHostAllocDefault) != cudaSuccess) {
		cudaGetLastError();
		snprintf(err, err_len, "cuda: cannot pin %u MiB of host memory for the upload",
			 STAGE_BYTES >> 20);
		return -ENOMEM;
	}
	u.pass = 1;
	u.total = u.off;
	u.off = 0;
	u.t0 = u.last_report = clock_now();
	place_model(&u);
	ret = u.ret;
	cudaFreeHost(u.stage);
	if (ret) {
		snprintf(err, err_len, "cuda: copying the weights to GPU %d failed: %s", b->dev, strerror(-ret));
		return ret;
	}
	report(&u, 1);
	return 0;
}
