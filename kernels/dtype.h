/* Element types of stored tensors and their conversion to float.
 * Header-only: every CPU op and the model loader use these. */
#ifndef KD_KERNELS_CPU_DTYPE_H
#define KD_KERNELS_CPU_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum k_dtype {
	K_F32 = 0,
	K_F16 = 1,
	K_BF16 = 2,
};

static inline size_t k_dtype_size(enum k_dtype t)
{
	return t == K_F32 ? 4 : 2;
}

static inline const char *k_dtype_name(enum k_dtype t)
{
	switch (t) {
	case K_F32: return "F32";
	case K_F16: return "F16";
	case K_BF16: return "BF16";
	}
	return "?";
}

static inline float k_bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t k_f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

static inline float k_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t man = h & 0x3ffu;
	uint32_t u;
	float f;

	if (exp == 0) {
		if (man == 0) {
			u = sign;
		} else {		/* subnormal: renormalise */
			exp = 127 - 15 + 1;
			while (!(man & 0x400u)) {
				man <<= 1;
				exp--;
			}
			man &= 0x3ffu;
			u = sign | (exp << 23) | (man << 13);
		}
	} else if (exp == 31) {
		u = sign | 0x7f800000u | (man << 13);
	} else {
		u = sign | ((exp + 127 - 15) << 23) | (man << 13);
	}
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* IEEE half, round to nearest even; overflow to inf, NaN kept, subnormals exact. */
static inline uint16_t k_f32_to_f16(float f)
{
	uint32_t u, sign, mag;

	memcpy(&u, &f, sizeof(u));
	sign = (u >> 16) & 0x8000u;
	mag = u & 0x7fffffffu;
	if (mag > 0x7f800000u)				/* NaN */
		return (uint16_t)(sign | 0x7e00u);
	if (mag >= 0x477ff000u)				/* rounds to >= 65520: inf */
		return (uint16_t)(sign | 0x7c00u);
	if (mag < 0x38800000u) {			/* below 2^-14: subnormal half */
		float a, scaled;
		uint32_t q;

		memcpy(&a, &mag, sizeof(a));
		scaled = a * 16777216.0f;		/* a / 2^-24, exact */
		q = (uint32_t)scaled;
		if (scaled - (float)q > 0.5f || (scaled - (float)q == 0.5f && (q & 1u)))
			q++;
		return (uint16_t)(sign | q);
	}
	mag += 0xfffu + ((mag >> 13) & 1u);		/* round the 13 dropped bits */
	return (uint16_t)(sign | ((mag - 0x38000000u) >> 13));
}

/* f rounded to the precision of t and widened back. */
static inline float k_round_to(float f, enum k_dtype t)
{
	switch (t) {
	case K_F32: return f;
	case K_F16: return k_f16_to_f32(k_f32_to_f16(f));
	case K_BF16: return k_bf16_to_f32(k_f32_to_bf16(f));
	}
	return f;
}

/* Element i of a row stored as dtype t, as float. */
static inline float k_load(const void *p, enum k_dtype t, size_t i)
{
	switch (t) {
	case K_F32: return ((const float *)p)[i];
	case K_F16: return k_f16_to_f32(((const uint16_t *)p)[i]);
	case K_BF16: return k_bf16_to_f32(((const uint16_t *)p)[i]);
	}
	return 0.0f;
}

/* Widen n elements of dtype t to float. */
static inline void k_row_to_f32(float *dst, const void *src, enum k_dtype t, size_t n)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = k_load(src, t, i);
}

#endif
