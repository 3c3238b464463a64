/* Binding quantized weights from safetensors as the published checkpoints store them
 * (docs/MODELS.md "Quantized checkpoints"): the payload (F8_E4M3 `weight`, or I32
 * `weight_packed` with its `weight_shape`) and its scales (`weight_scale_inv` per
 * 128x128 block, `weight_scale` per channel, tensor or int4 group), each scale tensor
 * checked against its weight: dtype, shape for the block size, every value finite
 * (and a W8A8 checkpoint's static `input_scale`, checked, not applied).
 * The bytes stay as stored; kernels dequantize them as they use them. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "daemon/model/model.h"
#include "daemon/model/model_quant.h"

struct qbind {
	const struct model *m;
	char fmt[24];		/* the format's name for messages */
	char *err;
	size_t err_len;
};

static const char *qbase(const char *path)
{
	const char *s = strrchr(path, '/');

	return s ? s + 1 : path;
}

static const struct st_tensor *qfind(const struct qbind *b, const char *name, const char *suffix,
				     const struct st_file **file)
{
	char full[320];

	snprintf(full, sizeof(full), "%s%s", name, suffix);
	return st_set_find(&b->m->files, full, file);
}

static void qshape(char *buf, size_t n, const struct st_tensor *t)
{
	size_t k = 0;

	buf[0] = '\0';
	for (int i = 0; i < t->ndim && k < n - 24; i++)
		k += (size_t)snprintf(buf + k, n - k, "%s%" PRId64, i ? ", " : "", t->shape[i]);
}

/* The scale tensor base + suffix: float dtype, shape (srows, scols) (a vector when
 * scols is 0 and ndim 1; any of [], [1], [1, 1] for one scale), every value finite. */
static int qscale(const struct qbind *b, const char *base, const char *suffix, int64_t srows,
		  int64_t scols, int64_t rows, int64_t cols, struct k_quant *q)
{
	const struct st_file *f;
	const struct st_tensor *s = qfind(b, base, suffix, &f);
	int64_t n = 1, want = srows * scols;
	int shape_ok;
	char got[96];

	if (!s)
		return snprintf(b->err, b->err_len, "%s: tensor '%s%s' is missing: %s weight "
				"'%s.weight' [%" PRId64 ", %" PRId64 "] needs it", b->m->path, base,
				suffix, b->fmt, base, rows, cols), -EINVAL;
	if (!s->dtype_ok)
		return snprintf(b->err, b->err_len, "%s: tensor '%s%s': dtype %s, expected F32, BF16 "
				"or F16 (%s scales)", qbase(f->path), base, suffix, s->dtype_name,
				b->fmt), -EINVAL;
	for (int i = 0; i < s->ndim; i++)
		n *= s->shape[i];
	if (want == 1)
		shape_ok = n == 1 && s->ndim <= 2;
	else if (s->ndim == 1)
		shape_ok = scols == 1 && s->shape[0] == srows;
	else
		shape_ok = s->ndim == 2 && s->shape[0] == srows && s->shape[1] == scols;
	if (!shape_ok) {
		qshape(got, sizeof(got), s);
		return snprintf(b->err, b->err_len, "%s: tensor '%s%s': shape [%s], expected [%" PRId64
				", %" PRId64 "] for weight [%" PRId64 ", %" PRId64 "] (%s)",
				qbase(f->path), base, suffix, got, srows, scols, rows, cols, b->fmt), -EINVAL;
	}
	q->scale = s->data;
	q->scale_dtype = s->dtype;
	for (int64_t i = 0; i < want; i++) {
		float v = k_quant_scale(q, (size_t)i);

		if (!isfinite(v))
			return snprintf(b->err, b->err_len, "%s: tensor '%s%s': scale %" PRId64 " (row %"
					PRId64 ", column %" PRId64 ") is %g, not finite (%s)",
					qbase(f->path), base, suffix, i, i / scols, i % scols, (double)v,
					b->fmt), -EINVAL;
	}
	q->scale = s->data;
	q->scale_dtype = s->dtype;
	q->scale_cols = scols;
	return 0;
}

static int qshape_fail(const struct qbind *b, const struct st_file *f, const char *name,
		       const struct st_tensor *t, const char *want)
{
	char got[96];

	qshape(got, sizeof(got), t);
	snprintf(b->err, b->err_len, "%s: tensor '%s': %s [%s], expected %s (%s)", qbase(f->path),
		 name, t->dtype_name, got, want, b->fmt);
	return -EINVAL;
}

/* int4: base.weight_packed I32 (rows, ceil(cols / 8)), base.weight_shape [rows, cols],
 * base.weight_scale (rows, ceil(cols / group)). */
static int bind_int4(const struct qbind *b, const char *base, const struct st_tensor *p,
		     const struct st_file *pf, struct model_tensor *slot, int64_t rows, int64_t cols)
{
	const struct model_quant *mq = &b->m->cfg.quant;
	const struct st_file *sf;
	const struct st_tensor *sh = qfind(b, base, ".weight_shape", &sf);
	int64_t words = (cols + 7) / 8, g = mq->group_size;
	char name[320], want[96];

	snprintf(name, sizeof(name), "%s.weight_packed", base);
	snprintf(want, sizeof(want), "I32 [%" PRId64 ", %" PRId64 "]", rows, words);
	if (strcmp(p->dtype_name, "I32") || p->ndim != 2 || p->shape[0] != rows || p->shape[1] != words)
		return qshape_fail(b, pf, name, p, want);
	snprintf(name, sizeof(name), "%s.weight_shape", base);
	if (!sh)
		return snprintf(b->err, b->err_len, "%s: tensor '%s' is missing (%s needs the "
				"unpacked shape of '%s.weight_packed')", b->m->path, name, b->fmt,
				base), -EINVAL;
	if ((strcmp(sh->dtype_name, "I32") && strcmp(sh->dtype_name, "I64")) || sh->ndim != 1 ||
	    sh->shape[0] != 2)
		return qshape_fail(b, sf, name, sh, "I32 or I64 [2]");
	for (int i = 0; i < 2; i++) {
		int64_t v;

		if (!strcmp(sh->dtype_name, "I64")) {
			memcpy(&v, (const char *)sh->data + 8 * i, 8);
		} else {
			int32_t v32;

			memcpy(&v32, (const char *)sh->data + 4 * i, 4);
			v = v32;
		}
		if (v != (i ? cols : rows))
			return snprintf(b->err, b->err_len, "%s: tensor '%s': [%" PRId64 ", ...] element "
					"%d is %" PRId64 ", expected [%" PRId64 ", %" PRId64 "] (%s)",
					qbase(sf->path), name, v, i, v, rows, cols, b->fmt), -EINVAL;
	}
	slot->q = (struct k_quant){ .fmt = K_Q_INT4, .block_rows = 1, .block_cols = (int)g };
	return qscale(b, base, ".weight_scale", rows, (cols + g - 1) / g, rows, cols, &slot->q) ? -EINVAL
		: (slot->data = p->data, 0);
}

/* W8A8 static checkpoints: base.input_scale, one finite value > 0 (the scale the
 * activations were calibrated to). kdec does not round activations to fp8, so the value
 * is not used; a missing or broken one still means a broken checkpoint. */
static int qinput(const struct qbind *b, const char *base, int64_t rows, int64_t cols)
{
	struct k_quant in = { .fmt = K_Q_FP8 };
	float v;

	if (qscale(b, base, ".input_scale", 1, 1, rows, cols, &in))
		return -EINVAL;
	if ((v = k_quant_scale(&in, 0)) > 0)
		return 0;
	return snprintf(b->err, b->err_len, "%s: tensor '%s.input_scale' is %g, expected a value "
			"> 0 (%s, static input scales)", b->m->path, base, (double)v, b->fmt), -EINVAL;
}

/* fp8: base.weight F8_E4M3 (rows, cols) and its scales. */
static int bind_fp8(const struct qbind *b, const char *base, const struct st_tensor *t,
		    const struct st_file *f, struct model_tensor *slot, int64_t rows, int64_t cols)
{
	const struct model_quant *mq = &b->m->cfg.quant;
	char name[320], want[96];
	int ret;

	snprintf(name, sizeof(name), "%s.weight", base);
	snprintf(want, sizeof(want), "[%" PRId64 ", %" PRId64 "]", rows, cols);
	if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
		return qshape_fail(b, f, name, t, want);
	slot->q = (struct k_quant){ .fmt = K_Q_FP8 };
	switch (mq->format) {
	case MODEL_Q_FP8_BLOCK:
		slot->q.block_rows = mq->block_rows;
		slot->q.block_cols = mq->block_cols;
		ret = qscale(b, base, ".weight_scale_inv", (rows + mq->block_rows - 1) / mq->block_rows,
			     (cols + mq->block_cols - 1) / mq->block_cols, rows, cols, &slot->q);
		break;
	case MODEL_Q_FP8_CHANNEL:
		slot->q.block_rows = 1;
		slot->q.block_cols = (int)cols;
		ret = qscale(b, base, ".weight_scale", rows, 1, rows, cols, &slot->q);
		break;
	default:
		slot->q.block_rows = (int)rows;
		slot->q.block_cols = (int)cols;
		ret = qscale(b, base, ".weight_scale", 1, 1, rows, cols, &slot->q);
		break;
	}
	if (!ret && mq->input_scales)
		ret = qinput(b, base, rows, cols);
	if (!ret)
		slot->data = t->data;
	return ret;
}

int model_quant_bind(struct model *m, const char *name, struct model_tensor *slot, int64_t rows,
		     int64_t cols, char *err, size_t err_len)
{
	struct qbind b = { .m = m, .err = err, .err_len = err_len };
	const struct model_quant *mq = &m->cfg.quant;
	const struct st_file *f, *sf;
	const struct st_tensor *t, *p, *stray;
	size_t n = strlen(name);
	char base[300];
	int ret;

	if (mq->format == MODEL_Q_NONE || cols == 1 || n < 8 || strcmp(name + n - 7, ".weight") ||
	    n - 7 >= sizeof(base))
		return 1;
	memcpy(base, name, n - 7);
	base[n - 7] = '\0';
	model_quant_name(mq, b.fmt, sizeof(b.fmt));
	t = st_set_find(&m->files, name, &f);
	p = mq->format == MODEL_Q_INT4_GROUP ? qfind(&b, base, ".weight_packed", &sf) : NULL;
	if (t && p)
		return snprintf(err, err_len, "%s: tensor '%s' is stored both unquantized and packed "
				"('%s.weight_packed') (%s)", qbase(f->path), name, base, b.fmt), -EINVAL;
	if (!p && !(t && !strcmp(t->dtype_name, "F8_E4M3") && mq->format != MODEL_Q_INT4_GROUP)) {
		/* kept in its dtype (an ignored module): then it must have no scales */
		stray = qfind(&b, base, mq->format == MODEL_Q_FP8_BLOCK ? ".weight_scale_inv"
								    : ".weight_scale", &sf);
		if (t && stray)
			return snprintf(err, err_len, "%s: tensor '%s': dtype %s has scales '%s' but is "
					"not quantized (%s)", qbase(f->path), name, t->dtype_name,
					stray->name, b.fmt), -EINVAL;
		return 1;
	}
	if (!strcmp(name, "model.embed_tokens.weight"))
		return snprintf(err, err_len, "%s: tensor '%s': a quantized embedding table is not "
				"supported (%s)", m->path, name, b.fmt), -ENOTSUP;
	ret = p ? bind_int4(&b, base, p, sf, slot, rows, cols) : bind_fp8(&b, base, t, f, slot, rows, cols);
	if (ret)
		return ret;
	slot->dtype = m->cfg.dtype;
	slot->rows = rows;
	slot->cols = cols;
	m->weight_bytes += k_quant_bytes(&slot->q, rows, cols);
	m->n_quantized++;
	return 0;
}

size_t model_tensor_bytes(const struct model_tensor *t, size_t unquantized_elem)
{
	if (t->q.fmt != K_Q_NONE)
		return k_quant_bytes(&t->q, t->rows, t->cols);
	return (size_t)t->rows * (size_t)t->cols * unquantized_elem;
}

