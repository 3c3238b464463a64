/* libFuzzer target: quantized weights bound from arbitrary safetensors (model_quant_bind)
 * under each format must be refused or lie inside the image: the first byte picks the
 * format, block/group size and whether fp8 has static input scales, the rest is the file. Each tensor named `X.weight` or
 * `X.weight_packed` is bound with the shape its own header (or weight_shape) claims,
 * and every weight that binds is dequantized whole here, so a scale or payload the
 * checks let through out of bounds is an ASan report. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/model/model.h"
#include "daemon/model/model_quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void bind_one(struct model *m, const struct st_tensor *t)
{
	static const char packed[] = ".weight_packed";
	size_t n = strlen(t->name), lp = sizeof(packed) - 1;
	struct model_tensor slot = { 0 };
	char name[300], err[512];
	int64_t rows, cols;
	volatile float sink = 0;
	float *row;

	if (t->ndim != 2 || n >= sizeof(name) - 8)
		return;
	memcpy(name, t->name, n + 1);
	rows = t->shape[0];
	cols = t->shape[1];
	if (n > lp && !strcmp(name + n - lp, packed)) {
		strcpy(name + n - lp, ".weight");
		cols *= 8;	/* what weight_shape must then say */
	} else if (!(n > 7 && !strcmp(name + n - 7, ".weight"))) {
		return;
	}
	if (rows <= 0 || cols <= 0 || rows > (1 << 16) || cols > (1 << 16))
		return;
	if (model_quant_bind(m, name, &slot, rows, cols, err, sizeof(err)) != 0 || slot.q.fmt == K_Q_NONE)
		return;
	row = malloc(sizeof(float) * (size_t)cols);
	for (int64_t r = 0; row && r < rows; r++) {
		k_quant_row_to_f32(row, slot.data, &slot.q, cols, r, 0, cols);
		sink += row[cols - 1];
	}
	free(row);
	(void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const int sizes[4] = { 1, 8, 32, 128 };
	struct model m;
	struct st_file f;
	char err[256];

	if (size < 1)
		return 0;
	memset(&m, 0, sizeof(m));
	memset(&f, 0, sizeof(f));
	m.path = "fuzz";
	m.cfg.dtype = K_BF16;
	m.cfg.quant.format = (enum model_qformat)(1 + data[0] % 4);
	m.cfg.quant.block_rows = sizes[(data[0] >> 2) & 3];
	m.cfg.quant.block_cols = sizes[(data[0] >> 4) & 3];
	m.cfg.quant.group_size = sizes[1 + (data[0] >> 6) % 3];
	m.cfg.quant.input_scales = data[0] >> 6 == 3;	/* fp8: W8A8 static input scales */
	if (st_parse(&f, data + 1, size - 1, "fuzz.safetensors", err, sizeof(err)) == 0) {
		f.path = strdup("fuzz.safetensors");	/* as st_file_open sets it */
		m.files.n_files = 1;
		m.files.files = &f;
		for (int i = 0; i < f.n_tensors; i++)
			bind_one(&m, &f.tensors[i]);
	}
	st_file_close(&f);
	return 0;
}
