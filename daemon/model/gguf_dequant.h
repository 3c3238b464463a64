/* GGUF tensor data to float32 or bf16: the element types kdec loads (F32, F16, BF16,
 * Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), block layouts as ggml defines them. */
#ifndef KD_DAEMON_GGUF_DEQUANT_H
#define KD_DAEMON_GGUF_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

/* 1 if gguf_dequant* handles ggml type `type`, else 0. */
int gguf_dequant_supported(uint32_t type);

/* n elements (a multiple of the type's block) of type `type` at src (the bytes
 * gguf_ttype_block says: n / block_elems blocks) to dst (n floats). 0, -ENOTSUP (type
 * not loadable), -EINVAL (n negative or not whole blocks). The bf16 variant rounds to
 * nearest even (k_f32_to_bf16); a BF16 source is copied bit for bit. */
int gguf_dequant(uint32_t type, const void *src, int64_t n, float *dst);
int gguf_dequant_bf16(uint32_t type, const void *src, int64_t n, uint16_t *dst);

/* Rows [row_begin, row_end) of a tensor of rows of row_len elements (ne[0], whole
 * blocks): src and dst are the starts of the whole tensor, so threads can each take a
 * range of the same call. Same returns as above. */
int gguf_dequant_rows(uint32_t type, const void *src, int64_t row_len, int64_t row_begin,
		      int64_t row_end, float *dst);
int gguf_dequant_rows_bf16(uint32_t type, const void *src, int64_t row_len,
			   int64_t row_begin, int64_t row_end, uint16_t *dst);

/* The one-line refusal for a tensor of a type kdec cannot load, e.g. "tensor 'x' has
 * type Q3_K (11), which kdec cannot load; supported: F32 F16 BF16 ...". Returns buf. */
const char *gguf_dequant_refusal(char *buf, size_t len, const char *tensor, uint32_t type);

#endif
