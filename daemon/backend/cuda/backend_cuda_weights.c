/* The model's weights on the GPU: one arena sized up front (so out-of-memory is
 * known before anything is copied, with the numbers), matrices converted to bf16,
 * vectors to fp32, quantized linear weights kept quantized (payload as in the file,
 * scales as fp32, or f16 for int4 where all are exact f16), quantized routed experts
 * too (payload as in the file, scales in bf16 where the file's are, else fp32; with
 * them the shared expert, which then runs as linears), copied through a pinned
 * staging buffer with a progress line. The
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
#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/moe/k_cuda_moe.h"

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
	int raw;		/* copy the bytes as they are (n of them): a quantized payload */
};

/* Elements [i, i + n) of a quantized (.., cols) weight as bf16: dequantized exactly in
 * fp32 (kernels/quant.h), then rounded once. For the weights no quantized kernel reads
 * (MLA's wkv_b, a shared expert beside bf16 routed experts: cuda_weights_upload logs
 * how many). */
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
	int n_qw;		/* struct cuda_qweight entries so far (weights and stacks) */
	int n_kept;		/* weights kept quantized */
	size_t q_bytes;		/* their payload and scale bytes */
	int n_deq;		/* quantized weights dequantized to bf16 */
	int n_qexp;		/* routed experts' matrices kept quantized */
	size_t qexp_bytes;	/* their payload and scale bytes */
	size_t off;		/* bytes placed so far */
	size_t total;		/* bytes of the arena (pass 1) */
	void *stage;		/* pinned (STAGE_BYTES) */
	double t0, last_report;
	int ret;
};

static size_t item_bytes(const struct weight_item *w)
{
	return w->raw ? w->n : w->n * (w->vector ? sizeof(float) : sizeof(uint16_t));
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
	size_t out_size = w->raw ? 1 : w->vector ? sizeof(float) : sizeof(uint16_t);
	size_t per = STAGE_BYTES / out_size;
	int ret;

	for (size_t i = 0; i < w->n; i += per) {
		size_t n = w->n - i < per ? w->n - i : per;

		if (w->raw) {
			memcpy(u->stage, (const uint8_t *)w->src + i, n);
		} else if (w->q) {
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

/* The device type of a kept weight's scales: f16 for int4 where every scale is an exact
 * f16 normal (the tensor-core GEMV scales int4 values in f16), else fp32. */
static enum k_dtype qscale_dtype(const struct k_quant *q, size_t n)
{
	if (q->fmt != K_Q_INT4)
		return K_F32;
	for (size_t i = 0; i < n; i++)
		if (!k_quant_scale_f16_exact(k_quant_scale(q, i)))
			return K_F32;
	return K_F16;
}

static size_t align_up(size_t v)
{
	return (v + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
}

/* Scales [i, i + n) of q converted to dtype (K_F32, K_F16, K_BF16) into the staging buffer,
 * then copied to dst. */
static int copy_scales(struct upload *u, char *dst, const struct k_quant *q, size_t total,
		       enum k_dtype dtype)
{
	const size_t es = k_dtype_size(dtype), per = STAGE_BYTES / es;
	int ret;

	for (size_t i = 0; i < total; i += per) {
		size_t n = total - i < per ? total - i : per;

		for (size_t j = 0; j < n; j++) {
			float f = k_quant_scale(q, i + j);

			if (dtype == K_F16)
				((uint16_t *)u->stage)[j] = k_f32_to_f16(f);
			else if (dtype == K_BF16)	/* bf16 scales only: exact */
				((uint16_t *)u->stage)[j] = k_f32_to_bf16(f);
			else
				((float *)u->stage)[j] = f;
		}
		if ((ret = CUDA_CHECK(u->b, cudaMemcpy(dst + i * es, u->stage, n * es,
						       cudaMemcpyHostToDevice))))
			return ret;
	}
	return 0;
}

/* Whether quantized weights t[0..n) can stand as one matrix [t_0; ...; t_n-1]: the
 * same format, columns and scale blocks, every part but the last a whole number of
 * scale blocks of rows, so that their scales one after another are the stack's. */
static int quant_stackable(const struct model_tensor *const *t, int n)
{
	for (int i = 0; i < n; i++) {
		const struct k_quant *a = &t[0]->q, *q = &t[i]->q;

		if (!t[i]->data || q->fmt != a->fmt || t[i]->cols != t[0]->cols ||
		    q->block_rows != a->block_rows || q->block_cols != a->block_cols ||
		    q->scale_cols != a->scale_cols || (i < n - 1 && t[i]->rows % q->block_rows))
			return 0;
	}
	return 1;
}

static size_t scale_count(const struct model_tensor *t)
{
	return (size_t)((t->rows + t->q.block_rows - 1) / t->q.block_rows) * (size_t)t->q.scale_cols;
}

/* Quantized linear weights kept so: their payloads one after another, then their scales,
 * each region aligned; t->data maps to its payload, &t->q to its struct cuda_qweight,
 * and where n > 1 each entry's group to one more entry for the stack, which the fused
 * projections (q/k/v, gate/up) run as one GEMV. */
static void place_quant(struct upload *u, const struct model_tensor *const *t, int n)
{
	const struct k_quant *q = &t[0]->q;
	const size_t row_bytes = k_quant_row_bytes(q->fmt, t[0]->cols);
	enum k_dtype sdt = K_F32;
	size_t pay = 0, ns = 0;
	int64_t rows = 0;
	char *payload, *scales;
	struct cuda_qweight *grp = NULL;

	if (u->ret)
		return;
	for (int i = 0; i < n; i++) {
		rows += t[i]->rows;
		pay += (size_t)t[i]->rows * row_bytes;
		ns += scale_count(t[i]);
	}
	for (int i = 0; i < n; i++)
		if ((sdt = qscale_dtype(&t[i]->q, scale_count(t[i]))) != K_F16)
			break;
	payload = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += align_up(pay);
	scales = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += align_up(ns * k_dtype_size(sdt));
	if (t[0]->cols > u->b->max_K)
		u->b->max_K = (int)t[0]->cols;
	if ((size_t)rows * (size_t)t[0]->cols > u->b->wtmp_elems)
		u->b->wtmp_elems = (size_t)rows * (size_t)t[0]->cols;
	u->q_bytes += pay + ns * k_dtype_size(sdt);
	if (u->pass == 0) {
		u->n_qw += n + (n > 1);
		u->n_kept += n;
		for (int i = 0; i < n && !u->ret; i++)
			u->ret = cuda_ptr_map_put(&u->b->map, t[i]->data, (void *)1);	/* seen */
		return;
	}
	if (n > 1) {
		grp = &u->b->qw[u->n_qw++];
		*grp = (struct cuda_qweight){ .w = payload, .q = *q, .rows = rows };
		grp->q.scale = scales;
		grp->q.scale_dtype = sdt;
		/* int4 scaled in f16 is exact only with f16 scales; fp32 ones take the CUDA cores */
		grp->mma_ok = q->fmt != K_Q_INT4 || sdt == K_F16;
	}
	for (int i = 0; i < n && !u->ret; i++) {
		struct cuda_qweight *qw = &u->b->qw[u->n_qw++];
		struct weight_item w = { .src = t[i]->data, .n = (size_t)t[i]->rows * row_bytes, .raw = 1 };
		size_t nsi = scale_count(t[i]);

		*qw = (struct cuda_qweight){ .w = payload, .q = t[i]->q, .rows = t[i]->rows,
					     .mma_ok = q->fmt != K_Q_INT4 || sdt == K_F16,
					     .group = grp, .group_n = n, .group_i = i };
		qw->q.scale = scales;
		qw->q.scale_dtype = sdt;
		if (!(u->ret = copy_item(u, payload, &w)) &&
		    !(u->ret = copy_scales(u, scales, &t[i]->q, nsi, sdt)) &&
		    !(u->ret = cuda_ptr_map_put(&u->b->map, t[i]->data, payload)))
			u->ret = cuda_ptr_map_put(&u->b->map, &t[i]->q, qw);
		payload += w.n;
		scales += nsi * k_dtype_size(sdt);
	}
	report(u, 0);
}

/* The quantized linears of t[0..n) that stack, as one group; each other one alone. */
static void place_quant_stack(struct upload *u, const struct model_tensor *const *t, int n)
{
	for (int i = 0; i < n; i++)
		if (!t[i]->data || t[i]->q.fmt == K_Q_NONE || cuda_ptr_map_get(&u->b->map, t[i]->data))
			return;
	if (n > 1 && quant_stackable(t, n)) {
		place_quant(u, t, n);
		return;
	}
	for (int i = 0; i < n; i++)
		place_quant(u, &t[i], 1);
}

/* Whether L's routed experts stay quantized on the GPU: all of them quantized alike (the
 * model loader checks every expert's format; the blocks and scale dtype are checked
 * here) in blocks the MoE kernels take (k_cuda_moe_quant_ok). Fills q (scales unset)
 * where so. */
static int experts_keep_quant(const struct model *m, const struct model_layer *L,
			      struct k_cuda_moe_quant *q)
{
	const struct model_config *c = &m->cfg;
	const struct k_expert *x0 = L->experts;
	int n_experts = m->held_experts ? m->held_experts : c->n_experts;	/* an ep shard's */

	memset(q, 0, sizeof(*q));
	if (!L->is_moe || !x0 || n_experts <= 0 || x0->gate_q.fmt == K_Q_NONE)
		return 0;
	for (int e = 0; e < n_experts; e++) {
		const struct k_quant *a[3] = { &x0->gate_q, &x0->up_q, &x0->down_q };
		const struct k_quant *b[3] = { &L->experts[e].gate_q, &L->experts[e].up_q,
					       &L->experts[e].down_q };

		for (int j = 0; j < 3; j++)
			if (b[j]->fmt != a[0]->fmt || b[j]->block_rows != a[j]->block_rows ||
			    b[j]->block_cols != a[j]->block_cols ||
			    b[j]->scale_dtype != a[0]->scale_dtype || !b[j]->scale)
				return 0;
	}
	q->fmt = x0->gate_q.fmt;
	q->scale_dtype = x0->gate_q.scale_dtype == K_BF16 ? K_BF16 : K_F32;
	q->block_rows[0] = x0->gate_q.block_rows;
	q->block_cols[0] = x0->gate_q.block_cols;
	q->block_rows[1] = x0->up_q.block_rows;
	q->block_cols[1] = x0->up_q.block_cols;
	q->block_rows[2] = x0->down_q.block_rows;
	q->block_cols[2] = x0->down_q.block_cols;
	q->scales = (const void *const *)(uintptr_t)1;	/* for the check only */
	if (k_cuda_moe_quant_ok(q, c->hidden_size, c->moe_intermediate_size)) {
		memset(q, 0, sizeof(*q));
		return 0;
	}
	q->scales = NULL;
	return 1;
}

/* 1 where the backend reads t only through cuda_linear_run (so a quantized t can stay
 * quantized): the attention projections but MLA's kv_b (the absorbed attention reads
 * it), and the MLP's of a dense layer; a MoE layer's MLP is its shared expert, which the
 * fused MoE kernels read in bf16, so it stays quantized only where the routed experts
 * do (the fused kernels then decline and it runs as linears). */
static int cuda_weight_is_linear(const struct model *m, const struct model_layer *L,
				 const struct model_tensor *t)
{
	struct k_cuda_moe_quant q;

	if (t == &L->wq || t == &L->wk || t == &L->wv || t == &L->wo || t == &L->wq_a ||
	    t == &L->wq_b || t == &L->wkv_a)
		return 1;
	if (t != &L->w_gate && t != &L->w_up && t != &L->w_down)
		return 0;
	return !L->is_moe || experts_keep_quant(m, L, &q);
}

/* keep: t is read only through the linear ops, so a quantized t stays quantized. */
static void place_tensor_as(struct upload *u, const struct model_tensor *t, int keep)
{
	struct weight_item w = {
		.src = t->data, .dtype = t->dtype, .n = (size_t)t->rows * (size_t)t->cols,
		.vector = t->cols == 1, .q = t->q.fmt != K_Q_NONE ? &t->q : NULL, .cols = t->cols,
	};

	if (w.q && keep && !w.vector) {
		if (t->data && !cuda_ptr_map_get(&u->b->map, t->data))
			place_quant(u, &t, 1);
		return;
	}
	if (w.q && u->pass == 0 && t->data && !cuda_ptr_map_get(&u->b->map, t->data))
		u->n_deq++;
	if (!w.vector && t->cols > u->b->max_K)
		u->b->max_K = (int)t->cols;
	place(u, t->data, &w);
}

static void place_tensor(struct upload *u, const struct model_tensor *t)
{
	place_tensor_as(u, t, 0);
}

/* One quantized expert matrix kept so: its payload, then its scales (as in the file
 * where bf16, else fp32), each aligned; the payload mapped under src, the scales under
 * q->scale. */
static void place_qexpert(struct upload *u, const void *src, const struct k_quant *q,
			  int64_t rows, int64_t cols, enum k_dtype sdt)
{
	struct weight_item w = { .src = src, .n = (size_t)rows * k_quant_row_bytes(q->fmt, cols),
				 .raw = 1 };
	size_t ns = (size_t)((rows + q->block_rows - 1) / q->block_rows) * (size_t)q->scale_cols;
	char *dst;

	if (u->ret || !src || cuda_ptr_map_get(&u->b->map, src))
		return;
	if (u->pass == 0) {
		u->qexp_bytes += w.n + ns * k_dtype_size(sdt);
		u->n_qexp++;
	}
	place(u, src, &w);
	dst = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += align_up(ns * k_dtype_size(sdt));
	if (u->pass == 0 || u->ret)
		return;
	if (!(u->ret = copy_scales(u, dst, q, ns, sdt)))
		u->ret = cuda_ptr_map_put(&u->b->map, q->scale, dst);
}

/* A MoE layer's experts: all gate/up/down matrices (kept quantized where
 * experts_keep_quant says: then b->moe_q[l] holds their format), then a device table
 * (n_experts, 3) of their device pointers, mapped under L->experts, and with quantized
 * experts one (n_experts, 3) of their scales; an expert-parallel shard's share alone
 * (held_experts). */
static void place_experts(struct upload *u, const struct model_layer *L, int l)
{
	const struct model_config *c = &u->b->m->cfg;
	int held = u->b->m->held_experts ? u->b->m->held_experts : c->n_experts;
	size_t inter = (size_t)c->moe_intermediate_size, hidden = (size_t)c->hidden_size;
	size_t table_bytes = (size_t)held * 3 * sizeof(void *);
	void **table = NULL, **stable = NULL;
	struct k_cuda_moe_quant mq;
	const int keep = experts_keep_quant(u->b->m, L, &mq);
	char *dst;

	if (u->pass == 1 && (!(table = malloc(table_bytes)) || (keep && !(stable = malloc(table_bytes))))) {
		free(table);
		u->ret = -ENOMEM;
		return;
	}
	for (int e = 0; e < held; e++) {
		const struct k_expert *x = &L->experts[e];
		const void *src[3] = { x->gate, x->up, x->down };
		const struct k_quant *q[3] = { &x->gate_q, &x->up_q, &x->down_q };

		for (int j = 0; j < 3; j++) {
			struct weight_item w = { .src = src[j], .dtype = L->expert_dtype,
						 .n = inter * hidden,
						 .q = q[j]->fmt != K_Q_NONE ? q[j] : NULL,
						 .cols = (int64_t)(j < 2 ? hidden : inter) };

			if (keep) {
				place_qexpert(u, src[j], q[j], j < 2 ? (int64_t)inter : (int64_t)hidden,
					      w.cols, mq.scale_dtype);
				if (stable)
					stable[3 * e + j] = cuda_ptr_map_get(&u->b->map, q[j]->scale);
			} else {
				if (w.q && u->pass == 0 && src[j] && !cuda_ptr_map_get(&u->b->map, src[j]))
					u->n_deq++;
				place(u, src[j], &w);
			}
			if (table)
				table[3 * e + j] = cuda_ptr_map_get(&u->b->map, src[j]);
		}
	}
	if ((size_t)u->b->max_K < inter)
		u->b->max_K = (int)inter;
	if ((size_t)u->b->max_K < hidden)
		u->b->max_K = (int)hidden;
	dst = u->b->arena ? (char *)u->b->arena + u->off : NULL;
	u->off += align_up(table_bytes);
	if (table && !u->ret) {
		u->ret = CUDA_CHECK(u->b, cudaMemcpy(dst, table, table_bytes, cudaMemcpyHostToDevice));
		if (!u->ret)
			u->ret = cuda_ptr_map_put(&u->b->map, L->experts, dst);
	}
	if (keep) {	/* the scales' table */
		dst = u->b->arena ? (char *)u->b->arena + u->off : NULL;
		u->off += align_up(table_bytes);
		if (stable && !u->ret)
			u->ret = CUDA_CHECK(u->b, cudaMemcpy(dst, stable, table_bytes,
							     cudaMemcpyHostToDevice));
		if (u->pass == 1 && !u->ret) {
			mq.scales = (const void *const *)dst;
			u->b->moe_q[l] = mq;
		}
	}
	free(table);
	free(stable);
}

const struct k_cuda_moe_quant *cuda_moe_q_of(const struct backend_cuda *b,
					     const struct model_layer *L)
{
	ptrdiff_t l = L - b->m->layers;

	if (!b->moe_q || l < 0 || l >= b->m->cfg.n_layers || b->moe_q[l].fmt == K_Q_NONE)
		return NULL;
	return &b->moe_q[l];
}

static void place_layer(struct upload *u, const struct model_layer *L, int l)
{
	const struct model_config *c = &u->b->m->cfg;
	const int lora = L->wq_a.data != NULL;
	/* MLA: the projection of h before kv_a's (wq_a with q-LoRA, else wq_b) right
	 * before wkv_a, so mla_prep reads the two as one matrix (bf16 only) */
	const struct model_tensor *t[] = {
		&L->attn_norm, &L->ffn_norm, &L->wq, &L->wk, &L->wv, &L->q_norm, &L->k_norm,
		lora ? &L->wq_a : &L->wq_b, &L->wkv_a, &L->q_a_norm, lora ? &L->wq_b : &L->wq_a,
		&L->kv_a_norm, &L->wkv_b, &L->wo, &L->w_gate, &L->w_up, &L->w_down, &L->router,
	};

	/* the projections the fused ops run together, stacked where all stay quantized */
	const struct model_tensor *qkv[] = { &L->wq, &L->wk, &L->wv };
	const struct model_tensor *mla[] = { lora ? &L->wq_a : &L->wq_b, &L->wkv_a };
	const struct model_tensor *gu[] = { &L->w_gate, &L->w_up };

	place_quant_stack(u, qkv, 3);
	place_quant_stack(u, mla, 2);
	if (cuda_weight_is_linear(u->b->m, L, &L->w_gate))
		place_quant_stack(u, gu, 2);
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		place_tensor_as(u, t[i], cuda_weight_is_linear(u->b->m, L, t[i]));
	if (L->router_bias) {
		struct weight_item w = { .src = L->router_bias, .dtype = K_F32,
					 .n = (size_t)c->n_experts, .vector = 1 };

		place(u, L->router_bias, &w);
	}
	if (L->is_moe && L->experts)
		place_experts(u, L, l);
}

static void place_model(struct upload *u)
{
	const struct model *m = u->b->m;

	place_tensor(u, &m->embed);
	place_tensor(u, &m->final_norm);
	place_tensor_as(u, &m->lm_head, m->lm_head.data != m->embed.data);
	for (int l = 0; l < m->cfg.n_layers; l++)
		place_layer(u, &m->layers[l], l);
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
	if (u.n_qw && !(b->qw = calloc((size_t)u.n_qw, sizeof(*b->qw))))
		return -ENOMEM;
	if (u.n_qexp && !(b->moe_q = calloc((size_t)b->m->cfg.n_layers, sizeof(*b->moe_q))))
		return -ENOMEM;
	if (u.n_qw || u.n_deq || u.n_qexp) {
		char fmt[24];

		model_quant_name(&b->m->cfg.quant, fmt, sizeof(fmt));
		log_info("cuda: %d %s weights stay quantized on GPU %d (%.2f GiB with their scales); "
			 "%d routed-expert matrices stay quantized too (%.2f GiB with their scales, "
			 "read by the MoE kernels as they are); %d are dequantized to bf16 at load "
			 "(no quantized kernel reads them: MLA's kv_b, MoE shared experts beside "
			 "bf16 routed ones, experts in blocks the MoE kernels do not take)",
			 u.n_kept, fmt, b->dev, (double)u.q_bytes / (1u << 30), u.n_qexp,
			 (double)u.qexp_bytes / (1u << 30), u.n_deq);
	}
	b->n_qw = u.n_qw;
	b->arena_bytes = u.off;
	cudaMemGetInfo(&free_b, &total_b);
	if (cudaMalloc(&b->arena, b->arena_bytes) != cudaSuccess) {
		cudaGetLastError();
		b->arena = NULL;
		snprintf(err, err_len,
			 "cuda: out of GPU memory for the weights: they need %.2f GiB, GPU %d has %.2f GiB free of %.2f GiB%s",
			 (double)b->arena_bytes / (1u << 30), b->dev, (double)free_b / (1u << 30),
			 (double)total_b / (1u << 30), u.n_deq > 0 ? " (the quantized weights "
			 "dequantized at load count as bf16)" : "");
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
	u.n_qw = 0;
	u.t0 = u.last_report = clock_now();
	place_model(&u);
	ret = u.ret;
	cudaFreeHost(u.stage);
	if (ret) {
		snprintf(err, err_len, "cuda: copying the weights to GPU %d failed: %s", b->dev, strerror(-ret));
		return ret;
	}
	report(&u, 1);
	{	/* what the weights took of the GPU: quantized experts show here */
		size_t free_a = 0, total_a = 0;

		cudaMemGetInfo(&free_a, &total_a);
		log_info("cuda: GPU %d memory: %.2f GiB free before the weights, %.2f after "
			 "(arena %.2f GiB)", b->dev, (double)free_b / (1u << 30),
			 (double)free_a / (1u << 30), (double)b->arena_bytes / (1u << 30));
	}
	return 0;
}
