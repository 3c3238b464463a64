/* Quantized weights as published (fp8 e4m3 with block, per-channel or per-tensor
 * scales; int4 packed eight to an int32 with group scales) and their exact
 * dequantization to float: element (n, k) = value(n, k) * scale[n / block_rows]
 * [k / block_cols], one fp32 multiply, as torch computes `w.float() * s.float()`.
 * Header-only: the CPU kernels and the model loader use these. */
#ifndef KD_KERNELS_QUANT_H
#define KD_KERNELS_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dtype.h"

enum k_qfmt {
	K_Q_NONE = 0,		/* stored in its dtype */
	K_Q_FP8,		/* e4m3 bytes, (N, K); block/channel/tensor by the block dims */
	K_Q_INT4,		/* int32 words of 8 offset-binary nibbles, low nibble first,
				 * (N, ceil(K / 8)); value = nibble - 8 */
};

/* How a quantized weight (N, K) is stored. The scales are (ceil(N / block_rows),
 * scale_cols) in scale_dtype, scale_cols = ceil(K / block_cols): fp8 block-scaled
 * 128 x 128; per channel 1 x K; per tensor N x K; int4 group g: 1 x g. */
struct k_quant {
	enum k_qfmt fmt;
	const void *scale;
	enum k_dtype scale_dtype;
	int block_rows, block_cols;
	int64_t scale_cols;
};

/* e4m3 (no infinities; 0x7f and 0xff are NaN) to float, exactly. */
static inline float k_e4m3_to_f32(uint8_t b)
{
	uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
	float v;

	if (exp == 0xfu && man == 7u) {
		uint32_t nan = 0x7fc00000u;

		memcpy(&v, &nan, sizeof(v));
		return v;
	}
	if (exp == 0)
		v = (float)man * 0x1p-9f;	/* subnormal: man / 8 * 2^-6 */
	else
		v = (1.0f + (float)man * 0.125f) * (float)(1u << exp) * 0x1p-7f;
	return (b & 0x80u) ? -v : v;
}

/* float to e4m3, rounded to nearest even, saturated to +-448 (infinities too; NaN gives
 * 0x7f with its sign): what CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)
 * gives, for the hosts that check kernels which quantize activations. */
static inline uint8_t k_f32_to_e4m3(float v)
{
	uint32_t u, sign, mag, m, keep, rest, code;
	int e;

	memcpy(&u, &v, sizeof(u));
	sign = (u >> 24) & 0x80u;
	mag = u & 0x7fffffffu;
	if (mag > 0x7f800000u)
		return (uint8_t)(sign | 0x7fu);
	if (mag >= 0x43e00000u)		/* >= 448 */
		return (uint8_t)(sign | 0x7eu);
	e = (int)(mag >> 23) - 127;
	if (e < -6) {			/* below 2^-6: multiples of 2^-9, 0..8 of them */
		float a, t, f;
		uint32_t n;

		memcpy(&a, &mag, sizeof(a));
		t = a * 512.0f;		/* exact */
		n = (uint32_t)t;
		f = t - (float)n;
		n += f > 0.5f || (f == 0.5f && (n & 1u));
		return (uint8_t)(sign | n);	/* 8: 0x08, the smallest normal */
	}
	m = mag & 0x7fffffu;		/* keep 3 of the 23 mantissa bits */
	keep = m >> 20;
	rest = m & 0xfffffu;
	code = ((uint32_t)(e + 7) << 3) | keep;
	code += rest > 0x80000u || (rest == 0x80000u && (keep & 1u));	/* may carry: exact */
	return (uint8_t)(sign | code);
}

/* Bytes of one row of the quantized payload of K columns. */
static inline size_t k_quant_row_bytes(enum k_qfmt fmt, int64_t K)
{
	return fmt == K_Q_INT4 ? (size_t)((K + 7) / 8) * 4 : (size_t)K;
}

/* Bytes of the payload plus the scales of an (N, K) weight. */
static inline size_t k_quant_bytes(const struct k_quant *q, int64_t N, int64_t K)
{
	int64_t srows = (N + q->block_rows - 1) / q->block_rows;

	return (size_t)N * k_quant_row_bytes(q->fmt, K) +
	       (size_t)(srows * q->scale_cols) * k_dtype_size(q->scale_dtype);
}

/* Scale i as float. Scales sit wherever the file put them (an odd-sized fp8 tensor
 * before an F32 scale leaves it unaligned), so they are read bytewise. */
static inline float k_quant_scale(const struct k_quant *q, size_t i)
{
	const uint8_t *p = (const uint8_t *)q->scale + i * k_dtype_size(q->scale_dtype);
	uint16_t h;
	float f;

	if (q->scale_dtype == K_F32) {
		memcpy(&f, p, sizeof(f));
		return f;
	}
	memcpy(&h, p, sizeof(h));
	return q->scale_dtype == K_BF16 ? k_bf16_to_f32(h) : k_f16_to_f32(h);
}

/* Columns [k0, k0 + n) of row `row` of an (.., K) quantized weight w, as float: each
 * run of columns that shares a scale is read with that one scale. */
static inline void k_quant_row_to_f32(float *dst, const void *w, const struct k_quant *q,
				      int64_t K, int64_t row, int64_t k0, int64_t n)
{
	const uint8_t *r = (const uint8_t *)w + (size_t)row * k_quant_row_bytes(q->fmt, K);
	size_t srow = (size_t)(row / q->block_rows) * (size_t)q->scale_cols;

	for (int64_t i = 0; i < n;) {
		int64_t k = k0 + i, blk = k / q->block_cols;
		int64_t end = (blk + 1) * q->block_cols - k0;	/* this scale's last column + 1 */
		float s = k_quant_scale(q, srow + (size_t)blk);

		if (end > n)
			end = n;
		if (q->fmt == K_Q_INT4) {
			for (; i < end; i++) {
				int64_t kk = k0 + i;

				dst[i] = (float)((int)((r[kk / 2] >> (4 * (kk % 2))) & 0xfu) - 8) * s;
			}
		} else {
			for (; i < end; i++)
				dst[i] = k_e4m3_to_f32(r[k0 + i]) * s;
		}
	}
}

#endif
