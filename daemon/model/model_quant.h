/* Quantized weights of a safetensors checkpoint (model_quant.c). */
#ifndef KD_DAEMON_MODEL_QUANT_H
#define KD_DAEMON_MODEL_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model.h"

/* Binds the weight `name` (".weight"), shape (rows, cols), quantized as m->cfg.quant
 * says, into slot. Returns 1 when the files hold it unquantized (the caller binds it
 * as usual), 0 when bound quantized, or -errno with one line in err naming the
 * format: payload or scales of the wrong dtype or shape, scales missing or not
 * finite, scales beside an unquantized weight, a quantized embedding. */
int model_quant_bind(struct model *m, const char *name, struct model_tensor *slot, int64_t rows,
		     int64_t cols, char *err, size_t err_len);

/* Bytes of t as stored: payload + scales when quantized, else rows x cols x
 * unquantized_elem. */
size_t model_tensor_bytes(const struct model_tensor *t, size_t unquantized_elem);

#endif
