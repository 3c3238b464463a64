/* libFuzzer target: gguf_parse on arbitrary bytes must not crash; whatever it accepts
 * must read back in bounds: every kv through its typed reader (each string of a string
 * array), every tensor's first and last byte, and small loadable tensors dequantized. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format/gguf.h"
#include "daemon/model/gguf_dequant.h"

#define FUZZ_MAX_DEQUANT 65536	/* elements dequantized per tensor at most */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t read_kv(const struct gguf_kv *kv)
{
	struct gguf_str s;
	int64_t v;
	double d;
	uint8_t sink = 0;

	if (kv->type == GGUF_VT_STRING) {
		if (gguf_kv_str(kv, &s))
			__builtin_trap();
		sink ^= s.len ? (uint8_t)s.p[s.len - 1] : 0;
	} else if (kv->type != GGUF_VT_ARRAY) {
		sink ^= gguf_kv_int(kv, &v) ? 0 : (uint8_t)v;
		sink ^= gguf_kv_float(kv, &d) ? 0 : (uint8_t)(d != d);
	}
	for (uint64_t i = 0; kv->type == GGUF_VT_ARRAY && i < kv->n; i++) {
		if (kv->arr_type == GGUF_VT_STRING) {
			if (gguf_arr_str(kv, i, &s))
				__builtin_trap();
			sink ^= s.len ? (uint8_t)s.p[0] ^ (uint8_t)s.p[s.len - 1] : 0;
		} else {
			sink ^= gguf_arr_int(kv, i, &v) ? 0 : (uint8_t)v;
			sink ^= gguf_arr_float(kv, i, &d) ? 0 : (uint8_t)(d != d);
		}
	}
	return sink;
}

static uint8_t read_tensor(const struct gguf_file *f, const struct gguf_tensor *t)
{
	int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];	/* checked at parse */
	uint8_t sink = 0;
	float *y;

	if (gguf_find_tensor(f, t->name) != t)
		__builtin_trap();
	if (!t->nbytes)
		return t->data ? 1 : 0;
	sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
	if (!gguf_dequant_supported(t->type) || n > FUZZ_MAX_DEQUANT)
		return sink;
	y = malloc((size_t)n * sizeof(*y));
	if (y && gguf_dequant(t->type, t->data, n, y) != 0)
		__builtin_trap();
	if (y)
		sink ^= (uint8_t)(y[n - 1] != y[n - 1]);
	free(y);
	return sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct gguf_file f;
	char err[256];
	volatile uint8_t sink = 0;

	if (gguf_parse(&f, data, size, "fuzz.gguf", err, sizeof(err)) == 0) {
		if ((f.alignment & (f.alignment - 1)) || !f.alignment)
			__builtin_trap();
		for (uint64_t i = 0; i < f.n_kv; i++)
			sink ^= read_kv(&f.kv[i]);
		for (uint64_t i = 0; i < f.n_tensors; i++)
			sink ^= read_tensor(&f, &f.tensors[i]);
	} else if (!err[0] || strchr(err, '\n')) {
		__builtin_trap();	/* every refusal says why, on one line */
	}
	gguf_close(&f);
	(void)sink;
	return 0;
}
