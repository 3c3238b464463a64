/* The routing trace (route_trace.h): record a MoE layer's choices, force another
 * engine's, write and read them as text. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/route_trace.h"
#include "kernels/cpu/k_cpu.h"

#define TRACE_MAX_EXPERTS 4096	/* as kernels/cpu/moe.c */
#define TRACE_MAX_TOPK 64

int route_trace_create(struct route_trace **out, int n_layers, int n_experts, int top_k,
		       int max_seqs, int max_pos)
{
	struct route_trace *t;
	size_t keys;

	*out = NULL;
	if (n_layers < 1 || n_experts < 1 || n_experts > TRACE_MAX_EXPERTS || top_k < 1 ||
	    top_k > TRACE_MAX_TOPK || top_k > n_experts || max_seqs < 1 || max_pos < 1)
		return -EINVAL;
	keys = (size_t)max_seqs * (size_t)n_layers * (size_t)max_pos;
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	*t = (struct route_trace){ .n_layers = n_layers, .n_experts = n_experts, .top_k = top_k,
				   .max_seqs = max_seqs, .max_pos = max_pos };
	t->seq_block = calloc((size_t)max_seqs, sizeof(int32_t));
	t->ids = calloc(keys * (size_t)top_k, sizeof(int32_t));
	t->own = calloc(keys * (size_t)top_k, sizeof(int32_t));
	t->logits = calloc(keys * (size_t)n_experts, sizeof(float));
	t->have = calloc(keys, 1);
	t->force = calloc(keys * (size_t)top_k, sizeof(int32_t));
	t->have_force = calloc(keys, 1);
	if (!t->seq_block || !t->ids || !t->own || !t->logits || !t->have || !t->force || !t->have_force) {
		route_trace_destroy(t);
		return -ENOMEM;
	}
	*out = t;
	return 0;
}

void route_trace_destroy(struct route_trace *t)
{
	if (!t)
		return;
	free(t->seq_block);
	free(t->ids);
	free(t->own);
	free(t->logits);
	free(t->have);
	free(t->force);
	free(t->have_force);
	free(t);
}

static size_t trace_keys(const struct route_trace *t)
{
	return (size_t)t->max_seqs * (size_t)t->n_layers * (size_t)t->max_pos;
}

void route_trace_clear(struct route_trace *t)
{
	memset(t->have, 0, trace_keys(t));
	t->n_seqs = 0;
	t->n_forced = t->n_differ = 0;
}

long route_trace_index(const struct route_trace *t, int seq, int layer, int pos)
{
	pos -= t->pos_base;
	if (seq < 0 || seq >= t->max_seqs || layer < 0 || layer >= t->n_layers || pos < 0 ||
	    pos >= t->max_pos)
		return -1;
	return ((long)seq * t->n_layers + layer) * t->max_pos + pos;
}

int route_trace_experts(const struct route_trace *t, int layer)
{
	uint8_t used[TRACE_MAX_EXPERTS] = { 0 };
	int n = 0;

	for (int s = 0; s < t->n_seqs; s++)
		for (int p = 0; p < t->max_pos; p++) {
			long k = route_trace_index(t, s, layer, t->pos_base + p);

			if (k < 0 || !t->have[k])
				continue;
			for (int j = 0; j < t->top_k; j++) {
				int id = t->ids[k * t->top_k + j];

				if (id >= 0 && id < t->n_experts && !used[id])
					used[id] = 1, n++;
			}
		}
	return n;
}

int route_trace_force_from(struct route_trace *t, const struct route_trace *src)
{
	size_t keys = trace_keys(t);

	if (src->n_layers != t->n_layers || src->top_k != t->top_k ||
	    src->max_seqs != t->max_seqs || src->max_pos != t->max_pos ||
	    src->pos_base != t->pos_base)
		return -EINVAL;
	memcpy(t->have_force, src->have, keys);
	memcpy(t->force, src->ids, keys * (size_t)t->top_k * sizeof(int32_t));
	return 0;
}

/* The trace's number of the sequence whose first block is b; new ones are numbered in
 * order of appearance. -1 when max_seqs are taken. */
static int trace_seq(struct route_trace *t, int32_t b)
{
	for (int i = 0; i < t->n_seqs; i++)
		if (t->seq_block[i] == b)
			return i;
	if (t->n_seqs == t->max_seqs)
		return -1;
	t->seq_block[t->n_seqs] = b;
	return t->n_seqs++;
}

/* 1 where a and b (k ids each) name different sets of experts. */
static int ids_differ(const int32_t *a, const int32_t *b, int k)
{
	for (int i = 0; i < k; i++) {
		int found = 0;

		for (int j = 0; j < k && !found; j++)
			found = a[i] == b[j];
		if (!found)
			return 1;
	}
	return 0;
}

/* Row r of the step: record the own choice (ids, logits already on the host); where a
 * forced choice exists, put it and its weights into ids, w. 1 when replaced. */
static int trace_row(struct route_trace *t, const struct k_moe_route_params *p, long k,
		     const float *lg, int32_t *ids, float *w)
{
	int K = t->top_k;

	memcpy(t->own + k * K, ids, sizeof(int32_t) * (size_t)K);
	memcpy(t->ids + k * K, ids, sizeof(int32_t) * (size_t)K);
	memcpy(t->logits + k * t->n_experts, lg, sizeof(float) * (size_t)t->n_experts);
	t->have[k] = 1;
	if (!t->have_force[k] || !memcmp(t->force + k * K, ids, sizeof(int32_t) * (size_t)K))
		return 0;
	t->n_forced++;
	t->n_differ += ids_differ(t->force + k * K, ids, K);
	memcpy(ids, t->force + k * K, sizeof(int32_t) * (size_t)K);
	memcpy(t->ids + k * K, ids, sizeof(int32_t) * (size_t)K);
	return k_cpu_moe_route_forced(p, lg, ids, w) ? -EINVAL : 1;
}

int route_trace_layer(struct route_trace *t, struct backend *be,
		      const struct k_moe_route_params *p, int layer, int R, const int32_t *pos,
		      const int32_t *first_block, const float *logits, int32_t *ids, float *w,
		      char *err, size_t err_len)
{
	size_t nl = (size_t)R * (size_t)t->n_experts, ni = (size_t)R * (size_t)t->top_k;
	float *hl = malloc(sizeof(float) * (nl + ni));
	int32_t *hi = malloc(sizeof(int32_t) * ni);
	int ret, changed = 0;

	if (p->n_experts != t->n_experts || p->top_k != t->top_k) {
		snprintf(err, err_len, "routing trace: made for %d experts top %d, layer %d has %d top %d",
			 t->n_experts, t->top_k, layer, p->n_experts, p->top_k);
		ret = -EINVAL;
		goto out;
	}
	if (!hl || !hi) {
		snprintf(err, err_len, "routing trace: out of memory for %d rows", R);
		ret = -ENOMEM;
		goto out;
	}
	if ((ret = be->ops->sync(be)) ||
	    (ret = be->ops->download(be, hl, logits, sizeof(float) * nl)) ||
	    (ret = be->ops->download(be, hi, ids, sizeof(int32_t) * ni)) ||
	    (ret = be->ops->download(be, hl + nl, w, sizeof(float) * ni))) {
		snprintf(err, err_len, "routing trace: copying layer %d's routing failed (%d)", layer, ret);
		goto out;
	}
	for (int r = 0; r < R; r++) {
		int s = trace_seq(t, first_block[r]);
		long k = route_trace_index(t, s, layer, pos[r]);

		if (k < 0) {
			snprintf(err, err_len, "routing trace: row %d (sequence %d, position %d) is past "
				 "the trace's %d sequences of positions %d..%d", r, s, pos[r], t->max_seqs,
				 t->pos_base, t->pos_base + t->max_pos - 1);
			ret = -ERANGE;
			goto out;
		}
		ret = trace_row(t, p, k, hl + (size_t)r * t->n_experts, hi + (size_t)r * t->top_k,
				hl + nl + (size_t)r * t->top_k);
		if (ret < 0) {
			snprintf(err, err_len, "routing trace: a forced expert id of layer %d position %d "
				 "is outside [0, %d)", layer, pos[r], t->n_experts);
			goto out;
		}
		changed |= ret;
	}
	ret = 0;
	if (changed && ((ret = be->ops->upload(be, ids, hi, sizeof(int32_t) * ni)) ||
			(ret = be->ops->upload(be, w, hl + nl, sizeof(float) * ni)) ||
			(ret = be->ops->sync(be))))
		snprintf(err, err_len, "routing trace: forcing layer %d's routing failed (%d)", layer, ret);
out:
	free(hl);
	free(hi);
	return ret;
}

int route_trace_write(const struct route_trace *t, FILE *f,
		      const struct k_moe_route_params *p,
		      const float *(*bias_of)(void *arg, int layer), void *arg)
{
	fprintf(f, "kdec-routing 1 layers %d experts %d top_k %d\n", t->n_layers, t->n_experts,
		t->top_k);
	for (int s = 0; s < t->n_seqs; s++)
		for (int l = 0; l < t->n_layers; l++)
			for (int pos = t->pos_base; pos < t->pos_base + t->max_pos; pos++) {
				long k = route_trace_index(t, s, l, pos);
				struct k_moe_route_params q = *p;

				if (!t->have[k])
					continue;
				q.bias = bias_of ? bias_of(arg, l) : NULL;
				fprintf(f, "%d %d %d", s, l, pos);
				for (int j = 0; j < t->top_k; j++)
					fprintf(f, " %d", t->ids[k * t->top_k + j]);
				fprintf(f, " %.6e\n", (double)k_cpu_moe_route_margin(
							   &q, t->logits + k * t->n_experts, NULL));
			}
	return fflush(f) || ferror(f) ? -EIO : 0;
}

/* One decision line: seq layer pos id... [margin]. */
static int read_line(struct route_trace *t, const char *line, int ln, char *err, size_t err_len)
{
	int s, l, pos, n, K = t->top_k;
	const char *c = line;
	int32_t ids[TRACE_MAX_TOPK];
	long k;

	if (sscanf(c, "%d %d %d%n", &s, &l, &pos, &n) != 3) {
		snprintf(err, err_len, "routing file line %d: expected 'seq layer pos id...'", ln);
		return -EINVAL;
	}
	k = route_trace_index(t, s, l, pos);
	if (k < 0) {
		snprintf(err, err_len, "routing file line %d: sequence %d layer %d position %d outside "
			 "%d sequences, %d layers, %d positions", ln, s, l, pos, t->max_seqs,
			 t->n_layers, t->max_pos);
		return -EINVAL;
	}
	c += n;
	for (int j = 0; j < K; j++, c += n)
		if (sscanf(c, "%d%n", &ids[j], &n) != 1 || ids[j] < 0 || ids[j] >= t->n_experts) {
			snprintf(err, err_len, "routing file line %d: expert %d of %d missing or outside "
				 "[0, %d)", ln, j + 1, K, t->n_experts);
			return -EINVAL;
		}
	for (int j = 1; j < K; j++)
		for (int i = 0; i < j; i++)
			if (ids[i] == ids[j]) {
				snprintf(err, err_len, "routing file line %d: expert %d chosen twice", ln,
					 ids[j]);
				return -EINVAL;
			}
	memcpy(t->force + k * K, ids, sizeof(int32_t) * (size_t)K);
	t->have_force[k] = 1;
	return 0;
}

int route_trace_read_force(struct route_trace *t, FILE *f, char *err, size_t err_len)
{
	char line[1024];
	int L, E, K, ln = 1, ret;

	memset(t->have_force, 0, trace_keys(t));
	if (!fgets(line, sizeof(line), f) ||
	    sscanf(line, "kdec-routing 1 layers %d experts %d top_k %d", &L, &E, &K) != 3) {
		snprintf(err, err_len, "routing file: the first line is not 'kdec-routing 1 layers L "
			 "experts E top_k K'");
		return -EINVAL;
	}
	if (L != t->n_layers || E != t->n_experts || K != t->top_k) {
		snprintf(err, err_len, "routing file: %d layers, %d experts, top %d; the model has %d, %d, %d",
			 L, E, K, t->n_layers, t->n_experts, t->top_k);
		return -EINVAL;
	}
	while (fgets(line, sizeof(line), f)) {
		ln++;
		if (!strchr(line, '\n') && !feof(f)) {
			snprintf(err, err_len, "routing file line %d: longer than %zu bytes", ln,
				 sizeof(line) - 1);
			return -EINVAL;
		}
		if ((ret = read_line(t, line, ln, err, err_len)))
			return ret;
	}
	return ferror(f) ? -EIO : 0;
}
