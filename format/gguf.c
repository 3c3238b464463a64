/* GGUF: a bounded parse of the header, metadata and tensor infos of a mapped image
 * (the typed readers over it are in gguf_read.c). Nothing here trusts the file; libc
 * only. */
#include "format/file_read.h"
#include "format/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian files with plain loads"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_SHOW 160		/* characters of a key or name shown in a message */

/* ---- ggml type facts ---------------------------------------------------- */

static const struct {
	const char *name;
	uint32_t block_elems, block_bytes;
} gguf_ttypes[] = {
	/* ggml-common.h block structs; gaps are ids ggml retired. */
	[0] = { "F32", 1, 4 }, [1] = { "F16", 1, 2 }, [2] = { "Q4_0", 32, 18 },
	[3] = { "Q4_1", 32, 20 }, [6] = { "Q5_0", 32, 22 }, [7] = { "Q5_1", 32, 24 },
	[8] = { "Q8_0", 32, 34 }, [9] = { "Q8_1", 32, 36 }, [10] = { "Q2_K", 256, 84 },
	[11] = { "Q3_K", 256, 110 }, [12] = { "Q4_K", 256, 144 }, [13] = { "Q5_K", 256, 176 },
	[14] = { "Q6_K", 256, 210 }, [15] = { "Q8_K", 256, 292 },
	[16] = { "IQ2_XXS", 256, 66 }, [17] = { "IQ2_XS", 256, 74 },
	[18] = { "IQ3_XXS", 256, 98 }, [19] = { "IQ1_S", 256, 50 }, [20] = { "IQ4_NL", 32, 18 },
	[21] = { "IQ3_S", 256, 110 }, [22] = { "IQ2_S", 256, 82 }, [23] = { "IQ4_XS", 256, 136 },
	[24] = { "I8", 1, 1 }, [25] = { "I16", 1, 2 }, [26] = { "I32", 1, 4 },
	[27] = { "I64", 1, 8 }, [28] = { "F64", 1, 8 }, [29] = { "IQ1_M", 256, 56 },
	[30] = { "BF16", 1, 2 }, [34] = { "TQ1_0", 256, 54 }, [35] = { "TQ2_0", 256, 66 },
	[39] = { "MXFP4", 32, 17 },
};

#define N_TTYPES (sizeof(gguf_ttypes) / sizeof(gguf_ttypes[0]))

const char *gguf_ttype_name(uint32_t type)
{
	return type < N_TTYPES ? gguf_ttypes[type].name : NULL;
}

int gguf_ttype_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes)
{
	if (type >= N_TTYPES || !gguf_ttypes[type].name)
		return -ENOTSUP;
	*block_elems = gguf_ttypes[type].block_elems;
	*block_bytes = gguf_ttypes[type].block_bytes;
	return 0;
}

uint64_t gguf_vtype_size(uint32_t t)
{
	switch (t) {
	case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL:
		return 1;
	case GGUF_VT_UINT16: case GGUF_VT_INT16:
		return 2;
	case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32:
		return 4;
	case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64:
		return 8;
	}
	return 0;
}

static const char *gguf_vtype_name(uint32_t t)
{
	static const char *const names[] = {
		"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array",
		"u64", "i64", "f64",
	};
	return t < sizeof(names) / sizeof(names[0]) ? names[t] : "unknown";
}

/* ---- messages -------------------------------------------------------------- */

/* A key or name from the file made safe and short for a one-line message. */
static const char *gguf_show(const char *s, uint64_t len, char *buf, size_t n)
{
	size_t i;

	for (i = 0; i < len && i + 1 < n; i++)
		buf[i] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
	if (i < len && n > 4)
		memcpy(buf + n - 4, "...", 3), i = n - 1;
	buf[i] = '\0';
	return buf;
}

/* A tensor name (NUL-terminated) shown the same way; buf holds GGUF_SHOW bytes. */
static const char *show_name(const char *name, char *buf)
{
	return gguf_show(name, strlen(name), buf, GGUF_SHOW);
}

/* ---- the cursor: every read bounded by the image ----------------------------- */

struct gguf_cur {
	const uint8_t *base;
	uint64_t size;		/* bytes of the image */
	uint64_t pos;		/* next byte to read */
	const char *file;	/* for messages */
	char *err;
	size_t err_len;
};

/* 0 if n more bytes are there, else -EINVAL naming what was being read. */
static int cur_need(struct gguf_cur *c, uint64_t n, const char *what)
{
	if (n <= c->size - c->pos)
		return 0;
	return file_fail(c->err, c->err_len, -EINVAL, "%s: truncated: %s needs %llu bytes at "
			 "offset %llu, the file has %llu", c->file, what, (unsigned long long)n,
			 (unsigned long long)c->pos, (unsigned long long)c->size);
}

static int cur_u32(struct gguf_cur *c, uint32_t *v, const char *what)
{
	int rc = cur_need(c, 4, what);

	if (rc)
		return rc;
	memcpy(v, c->base + c->pos, 4);
	c->pos += 4;
	return 0;
}

static int cur_u64(struct gguf_cur *c, uint64_t *v, const char *what)
{
	int rc = cur_need(c, 8, what);

	if (rc)
		return rc;
	memcpy(v, c->base + c->pos, 8);
	c->pos += 8;
	return 0;
}

/* A length-prefixed string; s->p points into the image. */
static int cur_str(struct gguf_cur *c, struct gguf_str *s, const char *what)
{
	int rc = cur_u64(c, &s->len, what);

	if (rc)
		return rc;
	if (s->len > c->size - c->pos)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: %s at offset %llu claims %llu "
				 "bytes, only %llu remain in the file", c->file, what,
				 (unsigned long long)(c->pos - 8), (unsigned long long)s->len,
				 (unsigned long long)(c->size - c->pos));
	s->p = (const char *)c->base + c->pos;
	c->pos += s->len;
	return 0;
}

/* ---- metadata ------------------------------------------------------------------ */

/* Indexes the n strings of a string array starting at the cursor. */
static int parse_str_array(struct gguf_cur *c, struct gguf_kv *kv, const char *key)
{
	uint64_t start = c->pos, i;
	struct gguf_str s;
	int rc;

	/* Each element takes at least its 8-byte length: bounds n before allocating. */
	if (kv->n > (c->size - c->pos) / 8)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: key '%s': string array of %llu "
				 "elements cannot fit in the %llu bytes left", c->file, key,
				 (unsigned long long)kv->n, (unsigned long long)(c->size - c->pos));
	kv->str_off = malloc((kv->n ? kv->n : 1) * sizeof(*kv->str_off));
	if (!kv->str_off)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: key '%s': no memory for the "
				 "index of %llu strings", c->file, key, (unsigned long long)kv->n);
	for (i = 0; i < kv->n; i++) {
		kv->str_off[i] = c->pos - start;
		rc = cur_str(c, &s, "an element of a string array");
		if (rc)
			return rc;
	}
	return 0;
}

static int parse_value(struct gguf_cur *c, struct gguf_kv *kv, const char *key)
{
	uint64_t esz, bytes;
	uint32_t t;
	struct gguf_str s;
	int rc;

	kv->n = 1;
	kv->data = c->base + c->pos;
	if (kv->type == GGUF_VT_STRING)
		return cur_str(c, &s, "a string value");
	if (kv->type != GGUF_VT_ARRAY) {
		esz = gguf_vtype_size(kv->type);
		if (!esz)
			return file_fail(c->err, c->err_len, -EINVAL, "%s: key '%s' has value type "
					 "%u, which GGUF does not define (0..12)", c->file, key,
					 (unsigned)kv->type);
		rc = cur_need(c, esz, "a scalar value");
		c->pos += rc ? 0 : esz;
		return rc;
	}
	if ((rc = cur_u32(c, &t, "an array's element type")) ||
	    (rc = cur_u64(c, &kv->n, "an array's length")))
		return rc;
	kv->arr_type = (enum gguf_vtype)t;
	kv->data = c->base + c->pos;
	if (t == GGUF_VT_ARRAY)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: key '%s' is an array of arrays "
				 "(nested arrays are not accepted)", c->file, key);
	if (t == GGUF_VT_STRING)
		return parse_str_array(c, kv, key);
	esz = gguf_vtype_size(t);
	if (!esz)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: key '%s' is an array of value "
				 "type %u, which GGUF does not define", c->file, key, (unsigned)t);
	if (__builtin_mul_overflow(kv->n, esz, &bytes) || bytes > c->size - c->pos)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: key '%s': array of %llu %s "
				 "runs past the end of the file (%llu bytes left)", c->file, key,
				 (unsigned long long)kv->n, gguf_vtype_name(t),
				 (unsigned long long)(c->size - c->pos));
	c->pos += bytes;
	return 0;
}

static int parse_kv(struct gguf_cur *c, struct gguf_kv *kv, uint64_t i)
{
	char kb[GGUF_SHOW];
	uint32_t t;
	int rc;

	rc = cur_str(c, &kv->key, "a metadata key");
	if (rc)
		return rc;
	if (!kv->key.len)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: metadata key %llu is empty",
				 c->file, (unsigned long long)i);
	gguf_show(kv->key.p, kv->key.len, kb, sizeof(kb));
	rc = cur_u32(c, &t, "a metadata value type");
	if (rc)
		return rc;
	kv->type = (enum gguf_vtype)t;
	return parse_value(c, kv, kb);
}

/* Sorting views for the uniqueness checks (keys and names are byte strings). */
struct gguf_name_ref {
	const char *p;
	uint64_t len;
};

static int name_ref_cmp(const void *a, const void *b)
{
	const struct gguf_name_ref *x = a, *y = b;
	uint64_t n = x->len < y->len ? x->len : y->len;
	int d = memcmp(x->p, y->p, n);

	if (d)
		return d;
	return x->len < y->len ? -1 : x->len > y->len;
}

/* The first name that appears twice, or NULL; -ENOMEM through *rc. */
static const struct gguf_name_ref *find_duplicate(struct gguf_name_ref *refs, uint64_t n)
{
	qsort(refs, n, sizeof(*refs), name_ref_cmp);
	for (uint64_t i = 1; i < n; i++)
		if (!name_ref_cmp(&refs[i - 1], &refs[i]))
			return &refs[i];
	return NULL;
}

static int check_unique_keys(struct gguf_file *f, struct gguf_cur *c)
{
	const struct gguf_name_ref *dup;
	struct gguf_name_ref *refs;
	char kb[GGUF_SHOW];

	if (f->n_kv < 2)
		return 0;
	refs = malloc(f->n_kv * sizeof(*refs));
	if (!refs)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: no memory to check %llu keys",
				 c->file, (unsigned long long)f->n_kv);
	for (uint64_t i = 0; i < f->n_kv; i++)
		refs[i] = (struct gguf_name_ref){ f->kv[i].key.p, f->kv[i].key.len };
	dup = find_duplicate(refs, f->n_kv);
	if (dup)
		gguf_show(dup->p, dup->len, kb, sizeof(kb));
	free(refs);
	if (dup)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: metadata key '%s' appears "
				 "more than once", c->file, kb);
	return 0;
}

static int parse_kvs(struct gguf_file *f, struct gguf_cur *c)
{
	int rc;

	/* Each kv takes at least 8 (key length) + 1 (key) + 4 (type) + 1 bytes. */
	if (f->n_kv > GGUF_MAX_KV || f->n_kv > (c->size - c->pos) / 14)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: header claims %llu metadata "
				 "entries; at most %u, and the %llu bytes left hold fewer", c->file,
				 (unsigned long long)f->n_kv, GGUF_MAX_KV,
				 (unsigned long long)(c->size - c->pos));
	f->kv = calloc(f->n_kv ? f->n_kv : 1, sizeof(*f->kv));
	if (!f->kv)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: no memory for %llu metadata "
				 "entries", c->file, (unsigned long long)f->n_kv);
	for (uint64_t i = 0; i < f->n_kv; i++) {
		rc = parse_kv(c, &f->kv[i], i);
		if (rc)
			return rc;
	}
	return check_unique_keys(f, c);
}

/* general.alignment: a u32 power of two, or absent. */
static int parse_alignment(struct gguf_file *f, struct gguf_cur *c)
{
	const struct gguf_kv *kv = gguf_find_kv(f, "general.alignment");
	uint32_t a;

	f->alignment = GGUF_DEFAULT_ALIGNMENT;
	if (!kv)
		return 0;
	if (kv->type != GGUF_VT_UINT32)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: general.alignment has type %s, "
				 "expected u32", c->file, gguf_vtype_name(kv->type));
	memcpy(&a, kv->data, 4);
	if (!a || (a & (a - 1)))
		return file_fail(c->err, c->err_len, -EINVAL, "%s: general.alignment is %u, not "
				 "a power of two", c->file, (unsigned)a);
	f->alignment = a;
	return 0;
}

/* ---- tensor infos ---------------------------------------------------------------- */

static int parse_tensor_dims(struct gguf_cur *c, struct gguf_tensor *t)
{
	char nb[GGUF_SHOW];
	const char *name = show_name(t->name, nb);
	uint32_t nd;
	uint64_t ne;
	int64_t nel = 1;
	int rc;

	rc = cur_u32(c, &nd, "a tensor's dimension count");
	if (rc)
		return rc;
	if (nd < 1 || nd > GGUF_MAX_DIMS)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' has %u dims; "
				 "1..%d accepted", c->file, name, (unsigned)nd, GGUF_MAX_DIMS);
	t->n_dims = (int)nd;
	for (int d = 0; d < GGUF_MAX_DIMS; d++)
		t->ne[d] = 1;
	for (uint32_t d = 0; d < nd; d++) {
		rc = cur_u64(c, &ne, "a tensor dimension");
		if (rc)
			return rc;
		if (ne < 1 || ne > INT64_MAX)
			return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' ne[%u] = "
					 "%llu; each dimension must be 1..2^63-1", c->file, name,
					 (unsigned)d, (unsigned long long)ne);
		t->ne[d] = (int64_t)ne;
		if (__builtin_mul_overflow(nel, t->ne[d], &nel))
			return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s': the "
					 "product of its dims overflows 64 bits", c->file, name);
	}
	return 0;
}

static int parse_tensor_info(struct gguf_cur *c, struct gguf_tensor *t, uint64_t i)
{
	struct gguf_str s;
	char nb[GGUF_SHOW];
	int rc;

	rc = cur_str(c, &s, "a tensor name");
	if (rc)
		return rc;
	if (!s.len || s.len >= GGUF_MAX_NAME || memchr(s.p, '\0', s.len))
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor %llu: name '%s' of %llu "
				 "bytes; 1..%d bytes without NUL accepted", c->file,
				 (unsigned long long)i, gguf_show(s.p, s.len, nb, sizeof(nb)),
				 (unsigned long long)s.len, GGUF_MAX_NAME - 1);
	memcpy(t->name, s.p, s.len);
	t->name[s.len] = '\0';
	if ((rc = parse_tensor_dims(c, t)) || (rc = cur_u32(c, &t->type, "a tensor type")) ||
	    (rc = cur_u64(c, &t->offset, "a tensor offset")))
		return rc;
	return 0;
}

/* nbytes of a tensor of a known type: whole blocks along ne[0]. */
static int tensor_size(struct gguf_cur *c, struct gguf_tensor *t)
{
	uint32_t be, bb;
	uint64_t nel = 1, bytes;
	char tn[24], nb[GGUF_SHOW];
	const char *tname = show_name(t->name, nb);

	t->nbytes = 0;
	if (gguf_ttype_block(t->type, &be, &bb))
		return 0;	/* unknown: parses, cannot be loaded */
	for (int d = 0; d < GGUF_MAX_DIMS; d++)
		nel *= (uint64_t)t->ne[d];	/* fits: checked in parse_tensor_dims */
	if (t->ne[0] % be) {
		snprintf(tn, sizeof(tn), "%s", gguf_ttype_name(t->type));
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' of type %s has rows "
				 "of %lld elements, not a multiple of its block of %u", c->file,
				 tname, tn, (long long)t->ne[0], (unsigned)be);
	}
	if (__builtin_mul_overflow(nel / be, (uint64_t)bb, &bytes))
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s': %llu elements "
				 "of type %s overflow 64 bits of bytes", c->file, tname,
				 (unsigned long long)nel, gguf_ttype_name(t->type));
	t->nbytes = bytes;
	return 0;
}

/* Places tensor t in the data section [data_off, size) of the image. */
static int tensor_place(struct gguf_file *f, struct gguf_cur *c, struct gguf_tensor *t,
			uint64_t data_off)
{
	char nb[GGUF_SHOW];
	const char *name = show_name(t->name, nb);
	uint64_t at, end;

	if (t->offset % f->alignment)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' data offset %llu "
				 "is not a multiple of the alignment %llu", c->file, name,
				 (unsigned long long)t->offset, (unsigned long long)f->alignment);
	if (!t->nbytes)
		return 0;
	if (__builtin_add_overflow(data_off, t->offset, &at) ||
	    __builtin_add_overflow(at, t->nbytes, &end) || end > c->size)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' data [offset %llu, "
				 "%llu bytes] runs past the end of the file (%llu bytes)", c->file,
				 name, (unsigned long long)data_off + t->offset,
				 (unsigned long long)t->nbytes, (unsigned long long)c->size);
	t->data = c->base + at;
	return 0;
}

static int tensor_offset_cmp(const void *a, const void *b)
{
	const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a;
	const struct gguf_tensor *y = *(const struct gguf_tensor *const *)b;

	return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Tensors with data must not share bytes. */
static int check_overlap(struct gguf_file *f, struct gguf_cur *c)
{
	const struct gguf_tensor **v;
	char nb[GGUF_SHOW], nb2[GGUF_SHOW];
	uint64_t n = 0;
	int rc = 0;

	v = malloc((f->n_tensors ? f->n_tensors : 1) * sizeof(*v));
	if (!v)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: no memory to order %llu tensors",
				 c->file, (unsigned long long)f->n_tensors);
	for (uint64_t i = 0; i < f->n_tensors; i++)
		if (f->tensors[i].nbytes)
			v[n++] = &f->tensors[i];
	qsort(v, n, sizeof(*v), tensor_offset_cmp);
	for (uint64_t i = 1; i < n && !rc; i++) {
		const struct gguf_tensor *a = v[i - 1], *b = v[i];

		if (a->offset + a->nbytes <= b->offset)	/* no overflow: both inside the file */
			continue;
		rc = file_fail(c->err, c->err_len, -EINVAL, "%s: tensors '%s' [%llu, +%llu) and "
			       "'%s' [%llu, +%llu) overlap in the data section", c->file,
			       show_name(a->name, nb), (unsigned long long)a->offset,
			       (unsigned long long)a->nbytes, show_name(b->name, nb2),
			       (unsigned long long)b->offset, (unsigned long long)b->nbytes);
	}
	free(v);
	return rc;
}

static int check_unique_tensors(struct gguf_file *f, struct gguf_cur *c)
{
	const struct gguf_name_ref *dup;
	struct gguf_name_ref *refs;
	char nb[GGUF_SHOW];

	if (f->n_tensors < 2)
		return 0;
	refs = malloc(f->n_tensors * sizeof(*refs));
	if (!refs)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: no memory to check %llu tensor "
				 "names", c->file, (unsigned long long)f->n_tensors);
	for (uint64_t i = 0; i < f->n_tensors; i++)
		refs[i] = (struct gguf_name_ref){ f->tensors[i].name, strlen(f->tensors[i].name) };
	dup = find_duplicate(refs, f->n_tensors);
	if (dup)
		gguf_show(dup->p, dup->len, nb, sizeof(nb));
	free(refs);
	if (dup)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: tensor '%s' appears more than "
				 "once", c->file, nb);
	return 0;
}

static int parse_tensors(struct gguf_file *f, struct gguf_cur *c)
{
	uint64_t data_off;
	int rc;

	/* Each info takes at least 8 + 1 (name) + 4 + 8 (one dim) + 4 + 8 bytes. */
	if (f->n_tensors > GGUF_MAX_TENSORS || f->n_tensors > (c->size - c->pos) / 33)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: header claims %llu tensors; at "
				 "most %u, and the %llu bytes left hold fewer", c->file,
				 (unsigned long long)f->n_tensors, GGUF_MAX_TENSORS,
				 (unsigned long long)(c->size - c->pos));
	f->tensors = calloc(f->n_tensors ? f->n_tensors : 1, sizeof(*f->tensors));
	if (!f->tensors)
		return file_fail(c->err, c->err_len, -ENOMEM, "%s: no memory for %llu tensor infos",
				 c->file, (unsigned long long)f->n_tensors);
	for (uint64_t i = 0; i < f->n_tensors; i++) {
		rc = parse_tensor_info(c, &f->tensors[i], i);
		if (!rc)
			rc = tensor_size(c, &f->tensors[i]);
		if (rc)
			return rc;
	}
	if ((rc = check_unique_tensors(f, c)))
		return rc;
	/* The data section starts at the next alignment boundary (pos < 2^63 here). */
	data_off = (c->pos + f->alignment - 1) / f->alignment * f->alignment;
	if (f->n_tensors && data_off > c->size)
		return file_fail(c->err, c->err_len, -EINVAL, "%s: the data section would start at "
				 "offset %llu, past the end of the file (%llu bytes)", c->file,
				 (unsigned long long)data_off, (unsigned long long)c->size);
	for (uint64_t i = 0; i < f->n_tensors; i++) {
		rc = tensor_place(f, c, &f->tensors[i], data_off);
		if (rc)
			return rc;
	}
	return check_overlap(f, c);
}

/* ---- the file ---------------------------------------------------------------------- */

static int parse_header(struct gguf_file *f, struct gguf_cur *c)
{
	int rc;

	if (c->size < 4 || memcmp(c->base, GGUF_MAGIC, 4))
		return file_fail(c->err, c->err_len, -EINVAL, "%s: not a GGUF file (no \"GGUF\" "
				 "magic at its start)", c->file);
	c->pos = 4;
	rc = cur_u32(c, &f->version, "the version");
	if (rc)
		return rc;
	if (f->version == 1)
		return file_fail(c->err, c->err_len, -ENOTSUP, "%s: GGUF version 1 (32-bit counts, "
				 "2023) is not supported; convert it to version 3", c->file);
	if (f->version == 0x02000000u || f->version == 0x03000000u)
		return file_fail(c->err, c->err_len, -ENOTSUP, "%s: a big-endian GGUF file "
				 "(version %u byte-swapped); only little-endian ones load",
				 c->file, (unsigned)(f->version >> 24));
	if (f->version != 2 && f->version != 3)
		return file_fail(c->err, c->err_len, -ENOTSUP, "%s: GGUF version %u is not "
				 "supported (2 and 3 are)", c->file, (unsigned)f->version);
	if ((rc = cur_u64(c, &f->n_tensors, "the tensor count")) ||
	    (rc = cur_u64(c, &f->n_kv, "the metadata count")))
		return rc;
	return 0;
}

int gguf_parse(struct gguf_file *f, const void *buf, size_t size, const char *name,
	       char *err, size_t err_len)
{
	struct gguf_cur c = {
		.base = buf, .size = size, .file = name ? name : "gguf", .err = err,
		.err_len = err_len,
	};
	uint64_t n_tensors;
	int rc;

	memset(f, 0, sizeof(*f));
	f->size = size;
	if (!buf && size)
		return file_fail(err, err_len, -EINVAL, "%s: no image", c.file);
	if ((rc = parse_header(f, &c)))
		goto fail;
	/* Tensor infos come after the kvs: hold the count until they are read. */
	n_tensors = f->n_tensors;
	f->n_tensors = 0;
	if ((rc = parse_kvs(f, &c)) || (rc = parse_alignment(f, &c)))
		goto fail;
	f->n_tensors = n_tensors;
	if ((rc = parse_tensors(f, &c)))
		goto fail;
	return 0;
fail:
	gguf_close(f);
	return rc;
}

/* path's image (mapped, or read into our memory when load), then gguf_parse. */
static int gguf_take(struct gguf_file *f, const char *path, int load,
		     void (*progress)(void *, const char *, size_t, size_t), void *ctx,
		     char *err, size_t err_len)
{
	void *map;
	size_t size;
	char *pcopy;
	int rc;

	memset(f, 0, sizeof(*f));
	rc = load ? file_load(path, &map, &size, progress, ctx, err, err_len)
		  : file_map(path, &map, &size, err, err_len);
	if (rc)
		return rc;
	if (size < GGUF_HEADER_BYTES) {
		if (map)
			munmap(map, size);
		return file_fail(err, err_len, -EINVAL, "%s: %zu bytes, too short for a GGUF "
				 "header (needs at least %d)", path, size, GGUF_HEADER_BYTES);
	}
	pcopy = strdup(path);
	if (!pcopy) {
		munmap(map, size);
		return file_fail(err, err_len, -ENOMEM, "%s: no memory", path);
	}
	rc = gguf_parse(f, map, size, path, err, err_len);
	if (rc) {
		free(pcopy);
		munmap(map, size);
		return rc;
	}
	f->path = pcopy;
	f->map = map;
	return 0;
}

int gguf_open(struct gguf_file *f, const char *path, char *err, size_t err_len)
{
	return gguf_take(f, path, 0, NULL, NULL, err, err_len);
}

int gguf_load(struct gguf_file *f, const char *path,
	      void (*progress)(void *ctx, const char *path, size_t done, size_t total),
	      void *ctx, char *err, size_t err_len)
{
	return gguf_take(f, path, 1, progress, ctx, err, err_len);
}

void gguf_close(struct gguf_file *f)
{
	if (!f)
		return;
	if (f->kv)
		for (uint64_t i = 0; i < f->n_kv; i++)
			free(f->kv[i].str_off);
	free(f->kv);
	free(f->tensors);
	if (f->map)
		munmap(f->map, f->size);
	free(f->path);
	memset(f, 0, sizeof(*f));
}

int gguf_is_gguf(const char *path)
{
	struct stat st;
	char m[4];
	int fd, ok;

	fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);	/* a FIFO: no wait for a writer */
	if (fd < 0)
		return 0;
	ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && pread(fd, m, 4, 0) == 4 &&
	     !memcmp(m, GGUF_MAGIC, 4);
	close(fd);
	return ok;
}
