/* A model read from one GGUF file (llama.cpp's format) instead of a Hugging Face
 * directory: metadata -> struct model_config, llama.cpp tensor names -> the same slots
 * the safetensors path fills. Only model.c and model_gguf*.c include this. */
#ifndef KD_DAEMON_MODEL_GGUF_H
#define KD_DAEMON_MODEL_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model.h"
#include "format/gguf.h"

/* Above this many bytes of fp32 weights the dequantized copy is kept in bf16. */
#define MODEL_GGUF_F32_LIMIT (4ull << 30)

/* Opens path into m->gguf (owned by m) and fills m->cfg from its metadata.
 * 0, or -EINVAL / -ENOTSUP / -ENOMEM / -errno with one line in err naming the file
 * and the key. */
int model_gguf_open(struct model *m, const char *path, char *err, size_t err_len);

/* The metadata half (model_gguf_config.c): cfg from an open file. */
int model_gguf_config(struct model_config *cfg, const struct gguf_file *f, const char *name,
		      char *err, size_t err_len);

/* Binds every tensor m->cfg needs (m->layers allocated): dequantizes into m->gguf_buf
 * what is not already in the chosen dtype (fp32 if all weights in fp32 take at most
 * f32_limit bytes, 0 meaning MODEL_GGUF_F32_LIMIT; else bf16), undoes llama.cpp's layout
 * conventions. 0 or -errno with one line in err naming the file, the tensor, its type
 * and shape. */
int model_gguf_bind(struct model *m, uint64_t f32_limit, char *err, size_t err_len);

/* file_load's progress callback of model loading (model.c): a log line every few
 * seconds while a large file is read; ctx a zeroed struct model_load_progress. */
struct model_load_progress {
	double t0, last;	/* clock_now() of the file's first chunk, of the last line */
};
void model_load_progress(void *ctx, const char *path, size_t done, size_t total);

/* Frees m->gguf and m->gguf_buf; accepts a model that has neither. */
void model_gguf_release(struct model *m);

#endif
