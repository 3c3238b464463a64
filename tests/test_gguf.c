/* GGUF: dequantization of every loadable type against the gguf package's numpy oracle
 * (tests/data/gguf/dequant.gguf, from tests/make_gguf_fixtures.py), metadata of every
 * value type read back (meta.gguf), and broken files built here from a valid one. */
#include <errno.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "format/gguf.h"
#include "daemon/model/gguf_dequant.h"
#include "kernels/dtype.h"
#include "tests/testutil.h"

static char err[512];

static void data_path(char *buf, size_t len, const char *name)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";

	snprintf(buf, len, "%s/tests/data/gguf/%s", top, name);
}

static uint32_t f2u(float f)
{
	uint32_t u;

	memcpy(&u, &f, 4);
	return u;
}

/* ---- (1) dequantization ---------------------------------------------------------- */

/* q.<T> against ref.<T>. Float types must match bit for bit. Quantized types: within
 * 2^-22 of the largest magnitude in the row (about 1 ulp of the block's scale times its
 * largest quant), which leaves room for a compiler fusing ggml's d*q - m into an FMA;
 * with this build's flags they come out bit-identical, and the exact count is printed. */
static void check_dequant_type(const struct gguf_file *f, const char *tname, int exact)
{
	char qn[32], rn[32];
	const struct gguf_tensor *q, *r;
	int64_t n, rows, row_len, same = 0, bad = 0;
	float *y, *part;
	uint16_t *yb;

	snprintf(qn, sizeof(qn), "q.%s", tname);
	snprintf(rn, sizeof(rn), "ref.%s", tname);
	q = gguf_find_tensor(f, qn);
	r = gguf_find_tensor(f, rn);
	CHECK(q && r && r->type == GGUF_TT_F32, "%s / %s in dequant.gguf", qn, rn);
	if (!q || !r)
		return;
	CHECK(!strcmp(gguf_ttype_name(q->type), tname), "%s has type %u", qn, q->type);
	row_len = q->ne[0];
	rows = q->ne[1];
	n = row_len * rows;
	CHECK(r->ne[0] == row_len && r->ne[1] == rows && rows % 2 == 1, "%s shape", qn);
	y = malloc((size_t)n * sizeof(*y));
	yb = malloc((size_t)n * sizeof(*yb));
	part = malloc((size_t)n * sizeof(*part));
	if (!y || !yb || !part)
		exit(1);
	memset(part, 0xff, (size_t)n * sizeof(*part));
	CHECK(gguf_dequant(q->type, q->data, n, y) == 0, "dequant %s", qn);
	for (int64_t row = 0; row < rows; row++) {
		const float *ref = (const float *)r->data + row * row_len;
		float mx = 0;

		for (int64_t i = 0; i < row_len; i++)
			mx = fabsf(ref[i]) > mx ? fabsf(ref[i]) : mx;
		for (int64_t i = 0; i < row_len; i++) {
			float a = y[row * row_len + i], b = ref[i];

			same += f2u(a) == f2u(b);
			if (exact ? f2u(a) != f2u(b) : !(fabsf(a - b) <= mx * 0x1.0p-22f))
				bad++;
		}
	}
	CHECK(!bad, "%s: %lld of %lld elements off the oracle", qn, (long long)bad, (long long)n);
	fprintf(stderr, "dequant %-5s %3lld x %3lld: %lld/%lld bit-identical to gguf.quants\n",
		tname, (long long)rows, (long long)row_len, (long long)same, (long long)n);

	/* bf16: the float result rounded to nearest even (BF16 sources copied). */
	CHECK(gguf_dequant_bf16(q->type, q->data, n, yb) == 0, "dequant_bf16 %s", qn);
	bad = 0;
	for (int64_t i = 0; i < n; i++)
		bad += yb[i] != k_f32_to_bf16(y[i]);
	CHECK(!bad, "%s: %lld bf16 elements are not the rounded floats", qn, (long long)bad);

	/* A row range writes only its rows, the same bits as the whole call. */
	CHECK(gguf_dequant_rows(q->type, q->data, row_len, 1, rows - 1, part) == 0,
	      "rows %s", qn);
	bad = 0;
	for (int64_t i = 0; i < n; i++) {
		int inside = i >= row_len && i < (rows - 1) * row_len;

		bad += f2u(part[i]) != (inside ? f2u(y[i]) : 0xffffffffu);
	}
	CHECK(!bad, "%s: rows [1, %lld): %lld elements wrong", qn, (long long)rows - 1,
	      (long long)bad);
	memset(yb, 0, (size_t)n * sizeof(*yb));
	CHECK(gguf_dequant_rows_bf16(q->type, q->data, row_len, rows - 1, rows, yb) == 0 &&
	      yb[0] == 0 && yb[(rows - 1) * row_len] == k_f32_to_bf16(y[(rows - 1) * row_len]),
	      "rows_bf16 %s: last row only", qn);
	free(part);
	free(y);
	free(yb);
}

static void test_dequant_fixtures(void)
{
	static const struct { const char *name; int exact; } types[] = {
		{ "F32", 1 }, { "F16", 1 }, { "BF16", 1 }, { "Q8_0", 0 }, { "Q4_0", 0 },
		{ "Q4_1", 0 }, { "Q4_K", 0 }, { "Q5_K", 0 }, { "Q6_K", 0 },
	};
	struct gguf_file f;
	char path[512];
	int rc;

	data_path(path, sizeof(path), "dequant.gguf");
	rc = gguf_open(&f, path, err, sizeof(err));
	CHECK(rc == 0, "open %s: %s", path, err);
	if (rc)
		return;
	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
		check_dequant_type(&f, types[i].name, types[i].exact);
	gguf_close(&f);
}

/* Every half: the branch-free conversion against the reference one in dtype.h. */
static void test_f16_exhaustive(void)
{
	uint16_t *h = malloc(65536 * sizeof(*h));
	float *y = malloc(65536 * sizeof(*y));
	int bad = 0;

	if (!h || !y)
		exit(1);
	for (int i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	CHECK(gguf_dequant(GGUF_TT_F16, h, 65536, y) == 0, "F16 dequant");
	for (int i = 0; i < 65536; i++)
		bad += f2u(y[i]) != f2u(k_f16_to_f32(h[i]));
	CHECK(!bad, "%d of 65536 halves differ from k_f16_to_f32", bad);
	free(h);
	free(y);
}

static void test_dequant_refusals(void)
{
	char msg[256];
	float y[256];
	uint8_t blk[210] = { 0 };

	CHECK(gguf_dequant(GGUF_TT_Q3_K, blk, 256, y) == -ENOTSUP, "Q3_K refused");
	CHECK(gguf_dequant(77, blk, 1, y) == -ENOTSUP, "type 77 refused");
	CHECK(gguf_dequant(GGUF_TT_Q4_0, blk, 33, y) == -EINVAL, "33 elements of Q4_0");
	CHECK(gguf_dequant(GGUF_TT_F32, blk, -1, y) == -EINVAL, "n = -1");
	CHECK(gguf_dequant_rows(GGUF_TT_F32, blk, 4, 2, 1, y) == -EINVAL, "rows 2..1");
	CHECK(gguf_dequant_rows(GGUF_TT_Q4_0, blk, INT64_MAX / 32 * 32, 2, 3, y) == -EINVAL,
	      "row offset overflow");
	CHECK(gguf_dequant_supported(GGUF_TT_Q6_K) && !gguf_dequant_supported(GGUF_TT_Q5_0),
	      "supported set");
	gguf_dequant_refusal(msg, sizeof(msg), "blk.0.attn_q.weight", GGUF_TT_Q3_K);
	CHECK(!strcmp(msg, "tensor 'blk.0.attn_q.weight' has type Q3_K (11), which kdec cannot "
		      "load; supported: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K"), "%s", msg);
	gguf_dequant_refusal(msg, sizeof(msg), "x", 77);
	CHECK(strstr(msg, "type 77 (unknown to kdec)") != NULL, "%s", msg);
	gguf_dequant_refusal(msg, 20, "x", 11);
	CHECK(strlen(msg) == 19, "refusal truncated to its buffer: '%s'", msg);
}

/* ---- (2) metadata ------------------------------------------------------------------ */

static void check_int(const struct gguf_file *f, const char *key, int64_t want)
{
	int64_t v = 0;
	int rc = gguf_kv_int(gguf_find_kv(f, key), &v);

	CHECK(rc == 0 && v == want, "%s: rc %d, %lld (want %lld)", key, rc, (long long)v,
	      (long long)want);
}

static void check_str(struct gguf_str s, const char *want, const char *what)
{
	CHECK(s.len == strlen(want) && !memcmp(s.p, want, s.len), "%s: '%.*s' (want '%s')",
	      what, (int)s.len, s.p, want);
}

static void test_meta_scalars(const struct gguf_file *f)
{
	const struct gguf_kv *kv;
	struct gguf_str s = { 0 };
	int64_t v;
	double d = 0;
	int b = 0;
	char buf[8];

	check_int(f, "t.u8", 200);
	check_int(f, "t.i8", -100);
	check_int(f, "t.u16", 60000);
	check_int(f, "t.i16", -30000);
	check_int(f, "t.u32", 4000000000);
	check_int(f, "t.i32", -2000000000);
	check_int(f, "t.i64", -9000000000000000000);
	check_int(f, "general.alignment", 64);
	kv = gguf_find_kv(f, "t.u64");
	CHECK(kv && kv->type == GGUF_VT_UINT64 && gguf_kv_int(kv, &v) == -EINVAL,
	      "u64 1.8e19 does not fit int64");
	CHECK(gguf_kv_float(kv, &d) == 0 && d == 18000000000000000000.0, "u64 as double %g", d);
	CHECK(gguf_kv_float(gguf_find_kv(f, "t.f32"), &d) == 0 && d == 0.15625, "f32 %g", d);
	CHECK(gguf_kv_float(gguf_find_kv(f, "t.f64"), &d) == 0 && d == -1.0e300, "f64 %g", d);
	CHECK(gguf_kv_float(gguf_find_kv(f, "t.i16"), &d) == 0 && d == -30000, "i16 as f %g", d);
	CHECK(gguf_kv_int(gguf_find_kv(f, "t.f32"), &v) == -EINVAL, "f32 is not an integer");
	CHECK(gguf_kv_bool(gguf_find_kv(f, "t.bool"), &b) == 0 && b == 1, "bool");
	CHECK(gguf_kv_bool(gguf_find_kv(f, "t.u8"), &b) == -EINVAL, "u8 is not a bool");
	CHECK(gguf_kv_str(gguf_find_kv(f, "t.str"), &s) == 0, "str");
	check_str(s, "h\xc3\xa9llo w\xc3\xb6rld", "t.str");
	CHECK(gguf_kv_str(gguf_find_kv(f, "t.u8"), &s) == -EINVAL, "u8 is not a string");
	CHECK(gguf_kv_int(gguf_find_kv(f, "no.such.key"), &v) == -ENOENT, "absent key");
	CHECK(gguf_kv_int(gguf_find_kv(f, "t.arr_i32"), &v) == -EINVAL, "array as scalar");
	CHECK(gguf_get_str(f, "general.architecture", buf, sizeof(buf)) == -ENAMETOOLONG &&
	      !strcmp(buf, "kdec-te"), "get_str truncates: '%s'", buf);
	CHECK(gguf_get_str(f, "t.str", buf, 0) == -ENAMETOOLONG, "get_str len 0");
	CHECK(gguf_get_str(f, "t.u8", buf, sizeof(buf)) == -EINVAL, "get_str of u8");
	CHECK(gguf_get_str(f, "nope", buf, sizeof(buf)) == -ENOENT, "get_str absent");
}

static void test_meta_arrays(const struct gguf_file *f)
{
	static const char *const strs[] = { "", "a", "<|im_start|>", "\xc4\xa0the", "\xc3\xa9" };
	const struct gguf_kv *kv = gguf_find_kv(f, "t.arr_str");
	struct gguf_str s;
	int64_t v = 0;
	double d = 0;

	CHECK(kv && kv->type == GGUF_VT_ARRAY && kv->arr_type == GGUF_VT_STRING && kv->n == 5,
	      "t.arr_str");
	for (uint64_t i = 0; kv && i < 5; i++) {
		CHECK(gguf_arr_str(kv, i, &s) == 0, "arr_str %llu", (unsigned long long)i);
		check_str(s, strs[i], "t.arr_str element");
	}
	CHECK(gguf_arr_str(kv, 5, &s) == -ERANGE, "arr_str past the end");
	CHECK(gguf_arr_int(kv, 0, &v) == -EINVAL, "string array as ints");
	kv = gguf_find_kv(f, "t.arr_i32");
	CHECK(gguf_arr_int(kv, 0, &v) == 0 && v == 1, "i32[0] %lld", (long long)v);
	CHECK(gguf_arr_int(kv, 1, &v) == 0 && v == -2, "i32[1] %lld", (long long)v);
	CHECK(gguf_arr_int(kv, 2, &v) == 0 && v == 2147483647, "i32[2] %lld", (long long)v);
	CHECK(gguf_arr_int(kv, 3, &v) == -ERANGE, "i32[3]");
	CHECK(gguf_arr_float(kv, 1, &d) == 0 && d == -2, "i32[1] as float");
	CHECK(gguf_arr_str(kv, 0, &s) == -EINVAL, "int array as strings");
	kv = gguf_find_kv(f, "t.arr_u8");
	CHECK(gguf_arr_int(kv, 1, &v) == 0 && v == 255, "u8[1] %lld", (long long)v);
	kv = gguf_find_kv(f, "t.arr_u64");
	CHECK(gguf_arr_int(kv, 0, &v) == -EINVAL, "u64[0] 1.8e19 does not fit int64");
	CHECK(gguf_arr_int(kv, 1, &v) == 0 && v == 5, "u64[1]");
	kv = gguf_find_kv(f, "t.arr_f32");
	CHECK(gguf_arr_float(kv, 1, &d) == 0 && d == -1.25, "f32[1] %g", d);
	CHECK(gguf_arr_int(kv, 0, &v) == -EINVAL, "f32 array as ints");
	kv = gguf_find_kv(f, "t.arr_f64");
	CHECK(gguf_arr_float(kv, 0, &d) == 0 && d == 1.0e-300, "f64[0] %g", d);
	kv = gguf_find_kv(f, "t.arr_bool");
	CHECK(kv && kv->arr_type == GGUF_VT_BOOL && kv->n == 3 && kv->data[0] == 1 &&
	      kv->data[1] == 0 && kv->data[2] == 1, "bool array");
	CHECK(gguf_arr_float(gguf_find_kv(f, "t.u8"), 0, &d) == -EINVAL, "scalar as array");
	CHECK(gguf_arr_int(NULL, 0, &v) == -ENOENT, "NULL array");
}

static void test_meta_tensors(const struct gguf_file *f)
{
	const struct gguf_tensor *a = gguf_find_tensor(f, "a"), *q = gguf_find_tensor(f, "b.q8");
	float y[32];

	CHECK(f->version == 3 && f->alignment == 64 && f->n_tensors == 2, "header");
	CHECK(a && a->type == GGUF_TT_F32 && a->n_dims == 2 && a->ne[0] == 3 && a->ne[1] == 2 &&
	      a->ne[2] == 1 && a->nbytes == 24 && a->offset == 0, "tensor a");
	CHECK(a && ((const float *)a->data)[5] == 5.0f, "tensor a data");
	CHECK(q && q->type == GGUF_TT_Q8_0 && q->ne[0] == 32 && q->nbytes == 34 &&
	      q->offset == 64, "tensor b.q8");
	CHECK(q && (const uint8_t *)q->data == (const uint8_t *)a->data + 64, "b.q8 data");
	CHECK(q && gguf_dequant(q->type, q->data, 32, y) == 0, "b.q8 dequant");
	CHECK(!gguf_find_tensor(f, "b") && !gguf_find_kv(f, "t"), "prefixes do not match");
}

static void test_meta(void)
{
	struct gguf_file f;
	char path[512];
	int rc;

	data_path(path, sizeof(path), "meta.gguf");
	CHECK(gguf_is_gguf(path) == 1, "%s is GGUF", path);
	data_path(path, sizeof(path), "no-such.gguf");
	CHECK(gguf_is_gguf(path) == 0, "absent file is not GGUF");
	rc = gguf_open(&f, path, err, sizeof(err));
	CHECK(rc == -ENOENT && strstr(err, "no-such.gguf"), "open absent: %d %s", rc, err);
	data_path(path, sizeof(path), "");
	rc = gguf_open(&f, path, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "not a regular file"), "open a directory: %d %s", rc,
	      err);
	CHECK(gguf_is_gguf(path) == 0, "a directory is not GGUF");
	data_path(path, sizeof(path), "meta.gguf");
	rc = gguf_open(&f, path, err, sizeof(err));
	CHECK(rc == 0, "open %s: %s", path, err);
	if (rc)
		return;
	CHECK(f.n_kv == 21 && f.kv[0].key.len == 20, "21 keys, general.architecture first");
	test_meta_scalars(&f);
	test_meta_arrays(&f);
	test_meta_tensors(&f);
	gguf_close(&f);
	gguf_close(&f);		/* closing twice is harmless */
}

/* ---- (3) broken files ---------------------------------------------------------------- */

/* A growing byte image. */
struct img {
	uint8_t *p;
	size_t n, cap;
};

static void put(struct img *b, const void *v, size_t n)
{
	if (b->n + n > b->cap) {
		b->cap = (b->n + n) * 2 + 64;
		b->p = realloc(b->p, b->cap);
		if (!b->p)
			exit(1);
	}
	memcpy(b->p + b->n, v, n);
	b->n += n;
}

static void put_u32(struct img *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct img *b, uint64_t v) { put(b, &v, 8); }

static void put_str(struct img *b, const char *s)
{
	put_u64(b, strlen(s));
	put(b, s, strlen(s));
}

struct mk_tensor {
	const char *name;
	uint32_t n_dims;
	uint64_t ne[5];
	uint32_t type;
	uint64_t off;
};

/* A small valid file (the defaults of mk_default), described so that each case can
 * spoil one thing. */
struct mk {
	uint32_t version;
	uint64_t n_kv_add, n_tensors_add;	/* added to the true counts as written */
	int64_t alignment;			/* < 0: no general.alignment key */
	uint32_t align_vtype;
	int dup_key, nested, empty_key;
	uint64_t str_len_add;			/* added to k.str's length as written */
	uint64_t arr_n_add, sarr_n_add;		/* added to k.arr's / k.sarr's counts */
	uint32_t bad_vtype;			/* nonzero: k.str written with this type */
	int n_t;
	struct mk_tensor t[3];
	size_t data_len;			/* bytes after the padding */
};

static struct mk mk_default(void)
{
	struct mk m = {
		.version = 3, .alignment = 32, .align_vtype = GGUF_VT_UINT32, .n_t = 2,
		.t = { { "t0", 2, { 8, 2 }, GGUF_TT_F32, 0 },
		       { "t1", 1, { 32 }, GGUF_TT_Q8_0, 64 } },
		.data_len = 128,
	};
	return m;
}

static uint8_t *mk_build(const struct mk *m, size_t *size)
{
	struct img b = { 0 };
	uint64_t n_kv = 5 + (m->alignment >= 0) + !!m->dup_key + !!m->nested + !!m->empty_key;
	uint64_t pad = m->alignment > 0 && !(m->alignment & (m->alignment - 1)) ?
		       (uint64_t)m->alignment : 32;

	put(&b, "GGUF", 4);
	put_u32(&b, m->version);
	put_u64(&b, (uint64_t)m->n_t + m->n_tensors_add);
	put_u64(&b, n_kv + m->n_kv_add);
	put_str(&b, "general.architecture");
	put_u32(&b, GGUF_VT_STRING);
	put_str(&b, "llama");
	if (m->alignment >= 0) {
		put_str(&b, "general.alignment");
		put_u32(&b, m->align_vtype);
		put_u64(&b, (uint64_t)m->alignment);	/* a u32 reads the low half */
		b.n -= m->align_vtype == GGUF_VT_UINT32 ? 4 : 0;
	}
	put_str(&b, "k.str");
	put_u32(&b, m->bad_vtype ? m->bad_vtype : GGUF_VT_STRING);
	put_u64(&b, 5 + m->str_len_add);
	put(&b, "hello", 5);
	put_str(&b, "k.arr");
	put_u32(&b, GGUF_VT_ARRAY);
	put_u32(&b, GGUF_VT_INT32);
	put_u64(&b, 3 + m->arr_n_add);
	for (int32_t i = 1; i <= 3; i++)
		put(&b, &i, 4);
	put_str(&b, "k.sarr");
	put_u32(&b, GGUF_VT_ARRAY);
	put_u32(&b, GGUF_VT_STRING);
	put_u64(&b, 2 + m->sarr_n_add);
	put_str(&b, "x");
	put_str(&b, "yy");
	put_str(&b, "k.u32");
	put_u32(&b, GGUF_VT_UINT32);
	put_u32(&b, 7);
	if (m->dup_key) {
		put_str(&b, "k.arr");
		put_u32(&b, GGUF_VT_UINT8);
		put(&b, "\1", 1);
	}
	if (m->nested) {
		put_str(&b, "k.nest");
		put_u32(&b, GGUF_VT_ARRAY);
		put_u32(&b, GGUF_VT_ARRAY);
		put_u64(&b, 1);
		put_u32(&b, GGUF_VT_INT32);
		put_u64(&b, 0);
	}
	if (m->empty_key) {
		put_str(&b, "");
		put_u32(&b, GGUF_VT_UINT8);
		put(&b, "\1", 1);
	}
	for (int i = 0; i < m->n_t; i++) {
		put_str(&b, m->t[i].name);
		put_u32(&b, m->t[i].n_dims);
		for (uint32_t d = 0; d < m->t[i].n_dims && d < 5; d++)
			put_u64(&b, m->t[i].ne[d]);
		put_u32(&b, m->t[i].type);
		put_u64(&b, m->t[i].off);
	}
	while (b.n % pad)
		put(&b, "", 1);
	for (size_t i = 0; i < m->data_len; i++)
		put(&b, &(uint8_t){ (uint8_t)i }, 1);
	*size = b.n;
	return b.p;
}

/* Parses the image from an allocation of exactly its size (ASan sees any overread). */
static int parse_exact(const uint8_t *img, size_t size, struct gguf_file *f)
{
	uint8_t *copy = malloc(size ? size : 1);
	int rc;

	if (!copy)
		exit(1);
	memcpy(copy, img, size);
	err[0] = '\0';
	rc = gguf_parse(f, copy, size, "bad.gguf", err, sizeof(err));
	for (uint64_t i = 0; !rc && i < f->n_tensors; i++) {
		/* Touch every accepted tensor's first and last byte inside the copy. */
		const volatile uint8_t *d = f->tensors[i].data;

		if (f->tensors[i].nbytes)
			(void)(d[0] + d[f->tensors[i].nbytes - 1]);
	}
	gguf_close(f);
	free(copy);
	return rc;
}

/* The case fails with want_rc and a message holding `want` (and the file's name). */
static void expect_bad(const struct mk *m, int want_rc, const char *want, const char *what)
{
	struct gguf_file f;
	size_t size;
	uint8_t *img = mk_build(m, &size);
	int rc = parse_exact(img, size, &f);

	CHECK(rc == want_rc && strstr(err, want) && !strncmp(err, "bad.gguf: ", 10) &&
	      !strchr(err, '\n'), "%s: rc %d (want %d), message '%s' (want '%s')", what, rc,
	      want_rc, err, want);
	free(img);
}

static void test_bad_header(void)
{
	struct mk m = mk_default();
	struct gguf_file f;
	size_t size;
	uint8_t *img = mk_build(&m, &size);

	CHECK(parse_exact(img, size, &f) == 0, "the default builder file parses: %s", err);
	img[0] = 'g';
	CHECK(parse_exact(img, size, &f) == -EINVAL && strstr(err, "magic"), "bad magic: %s",
	      err);
	free(img);
	m.version = 1;
	expect_bad(&m, -ENOTSUP, "version 1 ", "version 1");
	m.version = 99;
	expect_bad(&m, -ENOTSUP, "version 99 ", "version 99");
	m.version = 3u << 24;
	expect_bad(&m, -ENOTSUP, "big-endian", "big-endian version 3");
	m = mk_default();
	m.version = 2;		/* same layout: accepted */
	img = mk_build(&m, &size);
	CHECK(parse_exact(img, size, &f) == 0, "version 2: %s", err);
	free(img);
	m = mk_default();
	m.n_kv_add = 1ull << 40;
	expect_bad(&m, -EINVAL, "claims 1099511627782 metadata entries", "huge n_kv");
	m = mk_default();
	m.n_kv_add = 1;
	expect_bad(&m, -EINVAL, "a tensor name at offset 259 claims", "one kv too many");
	m = mk_default();
	m.n_tensors_add = 1ull << 40;
	expect_bad(&m, -EINVAL, "claims 1099511627778 tensors", "huge n_tensors");
}

static void test_bad_kv(void)
{
	struct mk m = mk_default();

	m.str_len_add = UINT64_MAX - 5;
	expect_bad(&m, -EINVAL, "claims 18446744073709551615 bytes", "huge string length");
	m = mk_default();
	m.arr_n_add = 1ull << 62;
	expect_bad(&m, -EINVAL, "key 'k.arr': array of 4611686018427387907 i32 runs past",
		   "huge array count (byte count overflows)");
	m = mk_default();
	m.sarr_n_add = 1ull << 40;
	expect_bad(&m, -EINVAL, "key 'k.sarr': string array of 1099511627778 elements cannot "
		   "fit", "huge string array count");
	m = mk_default();
	m.sarr_n_add = 1;
	expect_bad(&m, -EINVAL, "a metadata key at offset 235 claims", "string array one too long");
	m = mk_default();
	m.dup_key = 1;
	expect_bad(&m, -EINVAL, "key 'k.arr' appears more than once", "duplicate key");
	m = mk_default();
	m.nested = 1;
	expect_bad(&m, -EINVAL, "key 'k.nest' is an array of arrays", "nested array");
	m = mk_default();
	m.empty_key = 1;
	expect_bad(&m, -EINVAL, "is empty", "empty key");
	m = mk_default();
	m.bad_vtype = 13;
	expect_bad(&m, -EINVAL, "key 'k.str' has value type 13", "value type 13");
	m = mk_default();
	m.alignment = 0;
	expect_bad(&m, -EINVAL, "general.alignment is 0, not a power of two", "alignment 0");
	m.alignment = 3;
	expect_bad(&m, -EINVAL, "general.alignment is 3, not a power of two", "alignment 3");
	m.alignment = 64;
	m.align_vtype = GGUF_VT_UINT64;
	expect_bad(&m, -EINVAL, "general.alignment has type u64, expected u32", "u64 alignment");
}

static void test_bad_tensors(void)
{
	struct mk m = mk_default();
	struct gguf_file f;
	size_t size;
	uint8_t *img;
	int rc;

	m.t[1].name = "t0";
	expect_bad(&m, -EINVAL, "tensor 't0' appears more than once", "duplicate tensor");
	m = mk_default();
	m.t[0].n_dims = 0;
	expect_bad(&m, -EINVAL, "tensor 't0' has 0 dims", "n_dims 0");
	m.t[0].n_dims = 5;
	expect_bad(&m, -EINVAL, "tensor 't0' has 5 dims", "n_dims 5");
	m = mk_default();
	m.t[0].ne[1] = 0;
	expect_bad(&m, -EINVAL, "tensor 't0' ne[1] = 0", "ne 0");
	m.t[0].ne[1] = 1ull << 63;
	expect_bad(&m, -EINVAL, "ne[1] = 9223372036854775808", "ne 2^63");
	m = mk_default();
	m.t[0].n_dims = 3;
	m.t[0].ne[0] = 1ull << 32;
	m.t[0].ne[1] = 1ull << 32;
	m.t[0].ne[2] = 2;
	expect_bad(&m, -EINVAL, "tensor 't0': the product of its dims overflows", "ne product");
	m = mk_default();
	m.t[0].ne[0] = 1ull << 62;
	m.t[0].ne[1] = 1;
	expect_bad(&m, -EINVAL, "tensor 't0': 4611686018427387904 elements of type F32 overflow",
		   "byte count overflow");
	m = mk_default();
	m.t[1].ne[0] = 16;
	expect_bad(&m, -EINVAL, "rows of 16 elements, not a multiple of its block of 32",
		   "partial block");
	m = mk_default();
	m.t[1].off = 65;
	expect_bad(&m, -EINVAL, "tensor 't1' data offset 65 is not a multiple of the alignment "
		   "32", "misaligned");
	m.t[1].off = 32;
	expect_bad(&m, -EINVAL, "tensors 't0' [0, +64) and 't1' [32, +34) overlap", "overlap");
	m.t[1].off = 96;
	expect_bad(&m, -EINVAL, "tensor 't1' data [offset 416, 34 bytes] runs past the end of "
		   "the file (448 bytes)", "data past the end");
	m.t[1].off = UINT64_MAX - 31;
	expect_bad(&m, -EINVAL, "runs past the end of the file", "offset near 2^64");
	m = mk_default();
	m.t[0].name = "";
	expect_bad(&m, -EINVAL, "tensor 0: name '' of 0 bytes", "empty tensor name");
	m.t[0].name = "a\nname";
	img = mk_build(&m, &size);
	rc = parse_exact(img, size, &f);
	CHECK(rc == 0, "tensor name with a newline parses: %s", err);
	free(img);
	m.t[0].n_dims = 0;	/* and is shown on one line in a message */
	expect_bad(&m, -EINVAL, "tensor 'a?name' has 0 dims", "control character in a name");

	/* Unknown type: parses, with no size and no data; known tensors stay checked. */
	m = mk_default();
	m.t[0].type = 77;
	m.t[0].off = 64;	/* would overlap t1 if it had a size */
	img = mk_build(&m, &size);
	memcpy(err, "", 1);
	rc = gguf_parse(&f, img, size, "bad.gguf", err, sizeof(err));
	CHECK(rc == 0 && f.tensors[0].nbytes == 0 && !f.tensors[0].data && f.tensors[1].data &&
	      !gguf_ttype_name(77), "unknown type 77 parses: %d %s", rc, err);
	gguf_close(&f);
	free(img);
	m.t[0].off = 65;
	expect_bad(&m, -EINVAL, "offset 65 is not a multiple", "unknown type still aligned");

	/* A long name is refused, not cut. */
	{
		char name[GGUF_MAX_NAME + 1];

		memset(name, 'n', GGUF_MAX_NAME);
		name[GGUF_MAX_NAME] = '\0';
		m = mk_default();
		m.t[0].name = name;
		expect_bad(&m, -EINVAL, "of 256 bytes; 1..255 bytes", "name of 256 bytes");
		name[GGUF_MAX_NAME - 1] = '\0';
		img = mk_build(&m, &size);
		CHECK(parse_exact(img, size, &f) == 0, "name of 255 bytes: %s", err);
		free(img);
	}
}

/* Every prefix of a valid file fails cleanly until the last tensor's data is whole. */
static void check_prefixes(const uint8_t *img, size_t size, const char *what)
{
	struct gguf_file f;
	size_t data_end = 0, bad = 0;

	if (gguf_parse(&f, img, size, "p.gguf", err, sizeof(err))) {
		CHECK(0, "%s: %s", what, err);
		return;
	}
	for (uint64_t i = 0; i < f.n_tensors; i++) {
		size_t e = (size_t)((const uint8_t *)f.tensors[i].data - img) + f.tensors[i].nbytes;

		data_end = e > data_end ? e : data_end;
	}
	gguf_close(&f);
	for (size_t len = 0; len <= size; len++) {
		int rc = parse_exact(img, len, &f);

		if (len < data_end ? rc >= 0 || !err[0] || strchr(err, '\n') : rc != 0) {
			if (!bad++)
				fprintf(stderr, "%s: prefix of %zu bytes: rc %d '%s'\n", what, len,
					rc, err);
		}
	}
	CHECK(!bad, "%s: %zu of %zu prefixes wrong (data ends at %zu)", what, bad, size + 1,
	      data_end);
}

static void test_truncation(void)
{
	struct mk m = mk_default();
	char path[512];
	uint8_t *img;
	size_t size;
	FILE *fp;

	img = mk_build(&m, &size);
	check_prefixes(img, size, "builder file");
	free(img);
	data_path(path, sizeof(path), "meta.gguf");
	fp = fopen(path, "rb");
	CHECK(fp != NULL, "open %s", path);
	if (!fp)
		return;
	img = malloc(4096);
	size = img ? fread(img, 1, 4096, fp) : 0;
	fclose(fp);
	CHECK(size > 512 && size < 4096, "meta.gguf is %zu bytes", size);
	check_prefixes(img, size, "meta.gguf");
	free(img);
}

static void test_bad_files(void)
{
	test_bad_header();
	test_bad_kv();
	test_bad_tensors();
	test_truncation();
}

/* A tokenizer-sized string array: every element through the index, in O(1) each. */
static void test_big_string_array(void)
{
	enum { N = 150000 };
	struct img b = { 0 };
	struct gguf_file f;
	struct gguf_str s;
	char tok[32];
	struct timespec t0, t1;
	uint64_t bad = 0;
	int rc;

	put(&b, "GGUF", 4);
	put_u32(&b, 3);
	put_u64(&b, 0);
	put_u64(&b, 1);
	put_str(&b, "tokenizer.ggml.tokens");
	put_u32(&b, GGUF_VT_ARRAY);
	put_u32(&b, GGUF_VT_STRING);
	put_u64(&b, N);
	for (int i = 0; i < N; i++) {
		snprintf(tok, sizeof(tok), "tok%d", i * 7);
		put_str(&b, tok);
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	rc = gguf_parse(&f, b.p, b.n, "big.gguf", err, sizeof(err));
	CHECK(rc == 0, "big string array: %s", err);
	for (uint64_t i = N; !rc && i-- > 0;) {
		snprintf(tok, sizeof(tok), "tok%d", (int)i * 7);
		bad += gguf_arr_str(&f.kv[0], i, &s) || s.len != strlen(tok) ||
		       memcmp(s.p, tok, s.len);
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	CHECK(!bad, "%llu of %d strings wrong", (unsigned long long)bad, N);
	fprintf(stderr, "%d-string array: parse + every element in %.1f ms\n", N,
		(double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6);
	gguf_close(&f);
	free(b.p);
}

int main(void)
{
	test_dequant_fixtures();
	test_f16_exhaustive();
	test_dequant_refusals();
	test_meta();
	test_bad_files();
	test_big_string_array();
	return test_result("test_gguf");
}
