/* libFuzzer target: st_parse on arbitrary bytes must not crash, and every tensor it
 * accepts must lie inside the image (its first and last bytes are read here). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "daemon/model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct st_file f;
	char err[256];
	volatile uint8_t sink = 0;

	memset(&f, 0, sizeof(f));
	if (st_parse(&f, data, size, "fuzz.safetensors", err, sizeof(err)) == 0) {
		for (int i = 0; i < f.n_tensors; i++) {
			const struct st_tensor *t = &f.tensors[i];

			if (st_file_find(&f, t->name) != t)
				__builtin_trap();
			if (t->nbytes) {
				sink ^= ((const uint8_t *)t->data)[0];
				sink ^= ((const uint8_t *)t->data)[t->nbytes - 1];
			}
		}
	}
	st_file_close(&f);
	(void)sink;
	return 0;
}
