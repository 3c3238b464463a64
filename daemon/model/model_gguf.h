/* A model read from one GGUF file (llama.cpp's format) instead of a Hugging Face
 * directory: metadata -> struct model_config, llama.cpp tensor names -> the same slots
 * the safetensors path fills. Only model.c, model_gguf*.c and model_shard.c (the
 * slices of a mapped GGUF) include this. */
#ifndef KD_DAEMON_MODEL_GGUF_H
#define KD_DAEMON_MODEL_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model.h"
#include "format/gguf.h"

/* Above this many bytes of fp32 weights the dequantized copy is kept in bf16. */
#define MODEL_GGUF_F32_LIMIT (4ull << 30)

/* Opens path into m->gguf (owned by m), read whole, or mapped (m->mapped: a model
 * that only feeds tensor-parallel shards), and fills m->cfg from its metadata. 0, or -EINVAL / -ENOTSUP / -ENOMEM / -errno with one line in err naming the file
 * and the key. */
int model_gguf_open(struct model *m, const char *path, int mapped, char *err, size_t err_len);

/* The metadata half (model_gguf_config.c): cfg from an open file. */
int model_gguf_config(struct model_config *cfg, const struct gguf_file *f, const char *name,
		      char *err, size_t err_len);

/* Binds every tensor m->cfg needs (m->layers allocated): dequantizes into m->gguf_buf
 * what is not already in the chosen dtype (fp32 if all weights in fp32 take at most
 * f32_limit bytes, 0 meaning MODEL_GGUF_F32_LIMIT; else bf16), undoes llama.cpp's layout
 * conventions. 0 or -errno with one line in err naming the file, the tensor, its type
 * and shape. A mapped model (m->mapped) gets each slot's shape and the dtype it would
 * have had, its data pointing at its source in the mapping (the tensor, an expert's
 * slab of the stack, attn_k_b for kv_b), and nothing dequantized: model_gguf_slice
 * makes the shards' slices from there. */
int model_gguf_bind(struct model *m, uint64_t f32_limit, char *err, size_t err_len);

/* Scratch of model_gguf_slice (fp32 rows), owned by its caller: zeroed before the
 * first call, freed with free(sc->buf) after the last (also after a SIGBUS cut one
 * short). */
struct model_gguf_scratch {
	float *buf;
	size_t n;	/* floats */
};

/* Rows [r0, r0 + nr) and columns [c0, c0 + nc) of t, a slot of the mapped GGUF model
 * m (model_gguf_bind), into dst (nr, nc) in t->dtype: the same bits as the slot's
 * whole dequantized copy would hold there (read whole: model_gguf_bind). Only the
 * slice is read and dequantized (a row split keeps ggml blocks whole; a column split
 * must start and end on a block of the tensor's type), and the pages of the file it
 * read are given back (model_release_pages). dst NULL: only the checks. 0; -EINVAL
 * with one line in err (columns off the type's blocks; err may be NULL); -ENOMEM;
 * -ENOENT (t is not in m's mapping). */
int model_gguf_slice(const struct model *m, const struct model_tensor *t, int64_t r0, int64_t nr,
		     int64_t c0, int64_t nc, void *dst, struct model_gguf_scratch *sc, char *err,
		     size_t err_len);

/* file_load's progress callback of model loading (model.c): a log line every few
 * seconds while a large file is read; ctx a zeroed struct model_load_progress. */
struct model_load_progress {
	double t0, last;	/* clock_now() of the file's first chunk, of the last line */
};
void model_load_progress(void *ctx, const char *path, size_t done, size_t total);

/* Frees m->gguf and m->gguf_buf; accepts a model that has neither. */
void model_gguf_release(struct model *m);

#endif
