/* GGUF tensor data to float32 / bf16. One function per ggml block layout (read from
 * ggml-common.h's structs); plain loops over bytes that the compiler vectorises. The
 * float operations follow ggml's reference order, so results match it bit for bit. */
#include "daemon/model/gguf_dequant.h"
#include "format/gguf.h"
#include "kernels/dtype.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#define QK 32			/* elements of a Q4_0 / Q4_1 / Q8_0 block */
#define QK_K 256		/* elements of a K-quant super-block */
#define CHUNK 4096		/* floats staged on the stack for the bf16 path */

/* IEEE half to float in integer arithmetic and masks (no branches, no selects), so
 * loops over it vectorise: a normal half is rebiased by scaling with 2^-112; a
 * subnormal m * 2^-24 is the float 0.5 + m * 2^-24 minus 0.5; inf and NaN get their
 * bits directly (a multiply would quiet a signalling NaN). Exact for every input
 * (test_gguf checks all 65536 against k_f16_to_f32). */
static inline float h2f(uint16_t h)
{
	const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
	/* all ones when the exponent is 31 / nonzero, else 0 */
	const uint32_t special = 0u - ((((uint32_t)h & 0x7c00u) + 0x0400u) >> 15);
	const uint32_t normal = 0u - (((two_w >> 27) + 31u) >> 5);
	uint32_t un, us, bits;
	float norm, sub, f;

	un = (two_w >> 4) + (0xe0u << 23);
	memcpy(&norm, &un, 4);
	norm *= 0x1.0p-112f;
	memcpy(&un, &norm, 4);
	us = (two_w >> 17) | (126u << 23);
	memcpy(&sub, &us, 4);
	sub -= 0.5f;
	memcpy(&us, &sub, 4);
	bits = (special & (0x7f800000u | (((uint32_t)h & 0x3ffu) << 13))) |
	       (~special & ((normal & un) | (~normal & us)));
	bits |= sign;
	memcpy(&f, &bits, 4);
	return f;
}

static inline uint16_t rd16(const uint8_t *p)
{
	uint16_t v;

	memcpy(&v, p, 2);
	return v;
}

/* ---- one block each: b points at the block's bytes, y receives its elements ---- */

/* Q8_0: f16 d, int8 q[32]; x = q * d. */
static void deq_q8_0(const uint8_t *restrict b, float *restrict y)
{
	const float d = h2f(rd16(b));
	const int8_t *q = (const int8_t *)(b + 2);

	for (int i = 0; i < QK; i++)
		y[i] = (float)q[i] * d;
}

/* Q4_0: f16 d, u8 qs[16]; low nibbles are elements 0..15, high 16..31; x = (q - 8) d. */
static void deq_q4_0(const uint8_t *restrict b, float *restrict y)
{
	const float d = h2f(rd16(b));
	const uint8_t *qs = b + 2;

	for (int i = 0; i < QK / 2; i++) {
		y[i] = (float)((qs[i] & 0x0f) - 8) * d;
		y[i + QK / 2] = (float)((qs[i] >> 4) - 8) * d;
	}
}

/* Q4_1: f16 d, f16 m, u8 qs[16]; x = q d + m. */
static void deq_q4_1(const uint8_t *restrict b, float *restrict y)
{
	const float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
	const uint8_t *qs = b + 4;

	for (int i = 0; i < QK / 2; i++) {
		y[i] = (float)(qs[i] & 0x0f) * d + m;
		y[i + QK / 2] = (float)(qs[i] >> 4) * d + m;
	}
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block, packed in
 * 12 bytes: j < 4 in the low 6 bits of bytes j and j+4; j >= 4 in the nibbles of byte
 * j+4 with their top 2 bits in the high bits of bytes j-4 and j. */
static inline void k_scale_min(const uint8_t *s, int j, float *sc, float *mn)
{
	if (j < 4) {
		*sc = (float)(s[j] & 63);
		*mn = (float)(s[j + 4] & 63);
	} else {
		*sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
		*mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
	}
}

/* Q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128]. Eight sub-blocks of 32; each 32
 * bytes of qs hold two sub-blocks (low nibbles, then high). x = d sc q - dmin m. */
static void deq_q4_k(const uint8_t *restrict b, float *restrict y)
{
	const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
	const uint8_t *sc = b + 4, *qs = b + 16;
	float s0, m0, s1, m1;

	for (int j = 0; j < 8; j += 2, qs += 32, y += 64) {
		k_scale_min(sc, j, &s0, &m0);
		k_scale_min(sc, j + 1, &s1, &m1);
		const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;

		for (int i = 0; i < 32; i++) {
			y[i] = d0 * (float)(qs[i] & 0x0f) - o0;
			y[i + 32] = d1 * (float)(qs[i] >> 4) - o1;
		}
	}
}

/* Q5_K: as Q4_K plus u8 qh[32] before qs: bit k of qh[i] is the fifth bit of element
 * i of sub-block k. */
static void deq_q5_k(const uint8_t *restrict b, float *restrict y)
{
	const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
	const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
	float s0, m0, s1, m1;

	for (int j = 0; j < 8; j += 2, qs += 32, y += 64) {
		k_scale_min(sc, j, &s0, &m0);
		k_scale_min(sc, j + 1, &s1, &m1);
		const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;

		for (int i = 0; i < 32; i++) {
			int lo = (qs[i] & 0x0f) | (((qh[i] >> j) & 1) << 4);
			int hi = (qs[i] >> 4) | (((qh[i] >> (j + 1)) & 1) << 4);

			y[i] = d0 * (float)lo - o0;
			y[i + 32] = d1 * (float)hi - o1;
		}
	}
}

/* Q6_K: u8 ql[128], u8 qh[64], int8 scales[16], f16 d. Two halves of 128; in each, 64
 * bytes of ql (nibbles) and 32 of qh (2-bit pairs) give four runs of 32 six-bit
 * values; x = d scale[16-element group] (q - 32). */
static void deq_q6_k(const uint8_t *restrict b, float *restrict y)
{
	const uint8_t *ql = b, *qh = b + 128;
	const int8_t *sc = (const int8_t *)(b + 192);
	const float d = h2f(rd16(b + 208));

	for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
		for (int g = 0; g < 2; g++) {		/* 16 elements share a scale */
			const float s0 = d * (float)sc[g], s1 = d * (float)sc[g + 2];
			const float s2 = d * (float)sc[g + 4], s3 = d * (float)sc[g + 6];

			for (int i = 16 * g; i < 16 * g + 16; i++) {
				int q0 = ((ql[i] & 0x0f) | (((qh[i] >> 0) & 3) << 4)) - 32;
				int q1 = ((ql[i + 32] & 0x0f) | (((qh[i] >> 2) & 3) << 4)) - 32;
				int q2 = ((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32;
				int q3 = ((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32;

				y[i] = s0 * (float)q0;
				y[i + 32] = s1 * (float)q1;
				y[i + 64] = s2 * (float)q2;
				y[i + 96] = s3 * (float)q3;
			}
		}
	}
}

/* ---- dispatch ------------------------------------------------------------------ */

static const struct {
	uint32_t type;
	uint32_t elems, bytes;			/* per block */
	/* One block; NULL for the element-wise float types. */
	void (*block)(const uint8_t *restrict b, float *restrict y);
} deq_types[] = {
	{ GGUF_TT_F32, 1, 4, NULL },
	{ GGUF_TT_F16, 1, 2, NULL },
	{ GGUF_TT_BF16, 1, 2, NULL },
	{ GGUF_TT_Q8_0, QK, 34, deq_q8_0 },
	{ GGUF_TT_Q4_0, QK, 18, deq_q4_0 },
	{ GGUF_TT_Q4_1, QK, 20, deq_q4_1 },
	{ GGUF_TT_Q4_K, QK_K, 144, deq_q4_k },
	{ GGUF_TT_Q5_K, QK_K, 176, deq_q5_k },
	{ GGUF_TT_Q6_K, QK_K, 210, deq_q6_k },
};

#define N_DEQ (sizeof(deq_types) / sizeof(deq_types[0]))

static int deq_find(uint32_t type)
{
	for (size_t i = 0; i < N_DEQ; i++)
		if (deq_types[i].type == type)
			return (int)i;
	return -1;
}

int gguf_dequant_supported(uint32_t type)
{
	return deq_find(type) >= 0;
}

/* The element-wise conversions run in fixed runs of VEC so that -O2's cheap
 * vectoriser takes them (it will not add a remainder loop itself). */
#define VEC 64

static void f16_run(const uint8_t *restrict src, int64_t n, float *restrict dst)
{
	int64_t i = 0;

	for (; i + VEC <= n; i += VEC)
		for (int l = 0; l < VEC; l++)
			dst[i + l] = h2f(rd16(src + 2 * (i + l)));
	for (; i < n; i++)
		dst[i] = h2f(rd16(src + 2 * i));
}

static void bf16_run(const uint8_t *restrict src, int64_t n, float *restrict dst)
{
	int64_t i = 0;

	for (; i + VEC <= n; i += VEC)
		for (int l = 0; l < VEC; l++)
			dst[i + l] = k_bf16_to_f32(rd16(src + 2 * (i + l)));
	for (; i < n; i++)
		dst[i] = k_bf16_to_f32(rd16(src + 2 * i));
}

static void to_bf16_run(const float *restrict src, int64_t n, uint16_t *restrict dst)
{
	int64_t i = 0;

	for (; i + VEC <= n; i += VEC)
		for (int l = 0; l < VEC; l++)
			dst[i + l] = k_f32_to_bf16(src[i + l]);
	for (; i < n; i++)
		dst[i] = k_f32_to_bf16(src[i]);
}

/* n elements (whole blocks) of entry k at src to dst. */
static void deq_run(int k, const uint8_t *restrict src, int64_t n, float *restrict dst)
{
	const uint32_t be = deq_types[k].elems, bb = deq_types[k].bytes;

	switch (deq_types[k].type) {
	case GGUF_TT_F32:
		memcpy(dst, src, (size_t)n * 4);
		return;
	case GGUF_TT_F16:
		f16_run(src, n, dst);
		return;
	case GGUF_TT_BF16:
		bf16_run(src, n, dst);
		return;
	}
	for (int64_t i = 0; i < n / be; i++)
		deq_types[k].block(src + i * bb, dst + i * be);
}

/* The byte and element offsets of rows [r0, r1) of rows of row_len elements; checks
 * the arguments. Returns the table index or a negative errno. */
static int deq_span(uint32_t type, int64_t row_len, int64_t r0, int64_t r1,
		    int64_t *src_off, int64_t *dst_off, int64_t *n)
{
	int k = deq_find(type);
	int64_t row_bytes;

	if (k < 0)
		return -ENOTSUP;
	if (row_len < 0 || r0 < 0 || r1 < r0 || row_len % deq_types[k].elems)
		return -EINVAL;
	row_bytes = row_len / deq_types[k].elems * deq_types[k].bytes;
	if (__builtin_mul_overflow(r0, row_bytes, src_off) ||
	    __builtin_mul_overflow(r0, row_len, dst_off) ||
	    __builtin_mul_overflow(r1 - r0, row_len, n))
		return -EINVAL;
	return k;
}

int gguf_dequant_rows(uint32_t type, const void *src, int64_t row_len, int64_t row_begin,
		      int64_t row_end, float *dst)
{
	int64_t so, dof, n;
	int k = deq_span(type, row_len, row_begin, row_end, &so, &dof, &n);

	if (k < 0)
		return k;
	deq_run(k, (const uint8_t *)src + so, n, dst + dof);
	return 0;
}

int gguf_dequant(uint32_t type, const void *src, int64_t n, float *dst)
{
	return gguf_dequant_rows(type, src, n, 0, 1, dst);
}

int gguf_dequant_rows_bf16(uint32_t type, const void *src, int64_t row_len,
			   int64_t row_begin, int64_t row_end, uint16_t *dst)
{
	float buf[CHUNK];
	int64_t so, dof, n, step;
	const uint8_t *s;
	int k = deq_span(type, row_len, row_begin, row_end, &so, &dof, &n);

	if (k < 0)
		return k;
	s = (const uint8_t *)src + so;
	dst += dof;
	if (type == GGUF_TT_BF16) {
		memcpy(dst, s, (size_t)n * 2);
		return 0;
	}
	/* CHUNK is a whole number of blocks of every type. */
	for (int64_t i = 0; i < n; i += step) {
		step = n - i < CHUNK ? n - i : CHUNK;
		deq_run(k, s + i / deq_types[k].elems * deq_types[k].bytes, step, buf);
		to_bf16_run(buf, step, dst + i);
	}
	return 0;
}

int gguf_dequant_bf16(uint32_t type, const void *src, int64_t n, uint16_t *dst)
{
	return gguf_dequant_rows_bf16(type, src, n, 0, 1, dst);
}

const char *gguf_dequant_refusal(char *buf, size_t len, const char *tensor, uint32_t type)
{
	const char *name = gguf_ttype_name(type);
	char tn[32];
	size_t at;

	if (name)
		snprintf(tn, sizeof(tn), "%s (%u)", name, (unsigned)type);
	else
		snprintf(tn, sizeof(tn), "%u (unknown to kdec)", (unsigned)type);
	at = (size_t)snprintf(buf, len, "tensor '%s' has type %s, which kdec cannot load; "
			      "supported:", tensor, tn);
	for (size_t i = 0; i < N_DEQ && at < len; i++)
		at += (size_t)snprintf(buf + at, len - at, " %s",
				       gguf_ttype_name(deq_types[i].type));
	return buf;
}
