/* GGUF: lookups by name and the typed readers of metadata values, over a file that
 * gguf_parse has checked (every value, array and string lies inside the image). */
#include "format/gguf.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

/* ---- lookups and typed readers ------------------------------------------------------ */

const struct gguf_kv *gguf_find_kv(const struct gguf_file *f, const char *key)
{
	size_t len = strlen(key);

	for (uint64_t i = 0; i < f->n_kv; i++)
		if (f->kv[i].key.len == len && !memcmp(f->kv[i].key.p, key, len))
			return &f->kv[i];
	return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name)
{
	for (uint64_t i = 0; i < f->n_tensors; i++)
		if (!strcmp(f->tensors[i].name, name))
			return &f->tensors[i];
	return NULL;
}

/* One numeric value of type t at p, as an integer (range-checked) or a double. */
static int read_int(uint32_t t, const uint8_t *p, int64_t *out)
{
	union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
		uint64_t u64; int64_t i64; } v;

	memcpy(&v, p, gguf_vtype_size(t) ? gguf_vtype_size(t) : 1);
	switch (t) {
	case GGUF_VT_UINT8: *out = v.u8; return 0;
	case GGUF_VT_INT8: *out = v.i8; return 0;
	case GGUF_VT_UINT16: *out = v.u16; return 0;
	case GGUF_VT_INT16: *out = v.i16; return 0;
	case GGUF_VT_UINT32: *out = v.u32; return 0;
	case GGUF_VT_INT32: *out = v.i32; return 0;
	case GGUF_VT_INT64: *out = v.i64; return 0;
	case GGUF_VT_UINT64:
		if (v.u64 > INT64_MAX)
			return -EINVAL;
		*out = (int64_t)v.u64;
		return 0;
	}
	return -EINVAL;
}

static int read_float(uint32_t t, const uint8_t *p, double *out)
{
	uint64_t u;
	int64_t i;
	float f;

	switch (t) {
	case GGUF_VT_FLOAT32:
		memcpy(&f, p, 4);
		*out = f;
		return 0;
	case GGUF_VT_FLOAT64:
		memcpy(out, p, 8);
		return 0;
	case GGUF_VT_UINT64:		/* the one integer type read_int may refuse */
		memcpy(&u, p, 8);
		*out = (double)u;
		return 0;
	}
	if (read_int(t, p, &i))
		return -EINVAL;
	*out = (double)i;
	return 0;
}

int gguf_kv_int(const struct gguf_kv *kv, int64_t *out)
{
	if (!kv)
		return -ENOENT;
	return kv->type == GGUF_VT_ARRAY ? -EINVAL : read_int(kv->type, kv->data, out);
}

int gguf_kv_float(const struct gguf_kv *kv, double *out)
{
	if (!kv)
		return -ENOENT;
	return kv->type == GGUF_VT_ARRAY ? -EINVAL : read_float(kv->type, kv->data, out);
}

int gguf_kv_bool(const struct gguf_kv *kv, int *out)
{
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_VT_BOOL)
		return -EINVAL;
	*out = kv->data[0] != 0;
	return 0;
}

/* The string whose 8-byte length prefix is at p (checked at parse). */
static struct gguf_str str_at(const uint8_t *p)
{
	struct gguf_str s;

	memcpy(&s.len, p, 8);
	s.p = (const char *)p + 8;
	return s;
}

int gguf_kv_str(const struct gguf_kv *kv, struct gguf_str *out)
{
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_VT_STRING)
		return -EINVAL;
	*out = str_at(kv->data);
	return 0;
}

int gguf_arr_int(const struct gguf_kv *kv, uint64_t i, int64_t *out)
{
	uint64_t esz;

	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_VT_ARRAY || kv->arr_type == GGUF_VT_BOOL ||
	    kv->arr_type == GGUF_VT_FLOAT32 || kv->arr_type == GGUF_VT_FLOAT64 ||
	    !(esz = gguf_vtype_size(kv->arr_type)))
		return -EINVAL;
	if (i >= kv->n)
		return -ERANGE;
	return read_int(kv->arr_type, kv->data + i * esz, out);
}

int gguf_arr_float(const struct gguf_kv *kv, uint64_t i, double *out)
{
	uint64_t esz;

	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_VT_ARRAY || kv->arr_type == GGUF_VT_BOOL ||
	    !(esz = gguf_vtype_size(kv->arr_type)))
		return -EINVAL;
	if (i >= kv->n)
		return -ERANGE;
	return read_float(kv->arr_type, kv->data + i * esz, out);
}

int gguf_arr_str(const struct gguf_kv *kv, uint64_t i, struct gguf_str *out)
{
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_STRING || !kv->str_off)
		return -EINVAL;
	if (i >= kv->n)
		return -ERANGE;
	*out = str_at(kv->data + kv->str_off[i]);
	return 0;
}

int gguf_get_str(const struct gguf_file *f, const char *key, char *buf, size_t len)
{
	struct gguf_str s;
	size_t n;
	int rc;

	rc = gguf_kv_str(gguf_find_kv(f, key), &s);
	if (rc)
		return rc;
	if (!len)
		return -ENAMETOOLONG;
	n = s.len < len - 1 ? (size_t)s.len : len - 1;
	memcpy(buf, s.p, n);
	buf[n] = '\0';
	return s.len > len - 1 ? -ENAMETOOLONG : 0;
}
