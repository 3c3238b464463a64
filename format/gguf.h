/* GGUF files (llama.cpp's format, versions 2 and 3), mapped or read: a bounded,
 * checked parse of the header, the metadata key/values and the tensor infos.
 * Plain C and libc only: the daemon loads weights through it and libkdclient's
 * tokenizer reads tokenizer.ggml.* through it.
 *
 * Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv
 * (string key, u32 type, value), then n_tensors (string name, u32 n_dims, u64 ne[n_dims],
 * u32 ggml type, u64 offset), padding to general.alignment (default 32), data. A string
 * is u64 length + bytes (no NUL). */
#ifndef KD_FORMAT_GGUF_H
#define KD_FORMAT_GGUF_H

#include <stddef.h>
#include <stdint.h>

#define GGUF_MAX_DIMS 4
#define GGUF_MAX_KV (1u << 20)		/* metadata entries accepted */
#define GGUF_MAX_TENSORS (1u << 20)	/* tensor infos accepted */
#define GGUF_MAX_NAME 256		/* bytes of a tensor name (llama.cpp: 64) */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_HEADER_BYTES 24		/* magic, version, tensor count, metadata count */

/* Metadata value types, as numbered in the file. */
enum gguf_vtype {
	GGUF_VT_UINT8 = 0, GGUF_VT_INT8 = 1, GGUF_VT_UINT16 = 2, GGUF_VT_INT16 = 3,
	GGUF_VT_UINT32 = 4, GGUF_VT_INT32 = 5, GGUF_VT_FLOAT32 = 6, GGUF_VT_BOOL = 7,
	GGUF_VT_STRING = 8, GGUF_VT_ARRAY = 9, GGUF_VT_UINT64 = 10, GGUF_VT_INT64 = 11,
	GGUF_VT_FLOAT64 = 12,
};

/* Tensor element types (ggml_type ids) that kdec knows by name. Others parse (so an
 * error can name their number) but cannot be loaded. */
enum gguf_ttype {
	GGUF_TT_F32 = 0, GGUF_TT_F16 = 1, GGUF_TT_Q4_0 = 2, GGUF_TT_Q4_1 = 3,
	GGUF_TT_Q5_0 = 6, GGUF_TT_Q5_1 = 7, GGUF_TT_Q8_0 = 8, GGUF_TT_Q8_1 = 9,
	GGUF_TT_Q2_K = 10, GGUF_TT_Q3_K = 11, GGUF_TT_Q4_K = 12, GGUF_TT_Q5_K = 13,
	GGUF_TT_Q6_K = 14, GGUF_TT_Q8_K = 15, GGUF_TT_BF16 = 30,
};

/* A string inside the file image: not NUL-terminated. */
struct gguf_str {
	const char *p;
	uint64_t len;
};

/* For a scalar string, data points at its u64 length (the bytes follow); str_off[i] is
 * likewise the offset of string i's u64 length. Read strings through gguf_kv_str and
 * gguf_arr_str. */
struct gguf_kv {
	struct gguf_str key;
	enum gguf_vtype type;
	enum gguf_vtype arr_type;	/* element type when type == GGUF_VT_ARRAY */
	uint64_t n;			/* array elements; 1 for a scalar */
	const uint8_t *data;		/* the value (for an array: its first element) in the image */
	uint64_t *str_off;		/* (n) offsets from data of each string of a string
					 * array; owned; NULL otherwise */
};

struct gguf_tensor {
	char name[GGUF_MAX_NAME];	/* NUL-terminated copy */
	uint32_t type;			/* ggml type id (enum gguf_ttype or unknown) */
	int n_dims;
	int64_t ne[GGUF_MAX_DIMS];	/* ne[0] varies fastest (a row of a matrix); unused = 1 */
	uint64_t offset;		/* from the start of the data section */
	uint64_t nbytes;		/* 0 when the type is unknown */
	const void *data;		/* in the image; NULL when the type is unknown */
};

struct gguf_file {
	char *path;			/* owned; NULL for gguf_parse of a caller's buffer */
	void *map;			/* the file's image, mapped (gguf_open) or our copy
					 * (gguf_load), munmap either way; NULL if not ours */
	size_t size;			/* bytes of the image */
	uint32_t version;		/* 2 or 3 */
	uint64_t alignment;		/* general.alignment or the default; a power of two */
	uint64_t n_kv;
	struct gguf_kv *kv;		/* (n_kv), owned, in file order */
	uint64_t n_tensors;
	struct gguf_tensor *tensors;	/* (n_tensors), owned, in file order */
};

/* Parses a whole image (buf, size) that stays valid while f is used. Checks every
 * count and length against the image and the limits above (overflow-checked), key
 * and tensor-name uniqueness, value types, nested arrays (refused), dims >= 1, the
 * alignment, each known tensor's size = elements / block size x block bytes with
 * ne[0] a multiple of the block size, every tensor inside the data section, aligned,
 * and not overlapping another. `name` is used in messages only. Returns 0 or
 * -EINVAL / -ENOMEM / -ENOTSUP (version) with one line in err. */
int gguf_parse(struct gguf_file *f, const void *buf, size_t size, const char *name,
	       char *err, size_t err_len);

/* Opens and maps path read-only (file_map), then gguf_parse: for a short look at the
 * metadata (the client's tokenizer), since the mapping reads the file at each access.
 * A file under GGUF_HEADER_BYTES is refused with "PATH: N bytes, too short for a GGUF
 * header (needs at least 24)". */
int gguf_open(struct gguf_file *f, const char *path, char *err, size_t err_len);

/* As gguf_open, but reads the whole file into memory of our own (file_load, progress
 * as there): what a daemon keeps weights from, immune to the file changing later. */
int gguf_load(struct gguf_file *f, const char *path,
	      void (*progress)(void *ctx, const char *path, size_t done, size_t total),
	      void *ctx, char *err, size_t err_len);
void gguf_close(struct gguf_file *f);	/* accepts a zeroed or half-built file */

/* 1 if path is a regular file that starts with the GGUF magic, else 0. */
int gguf_is_gguf(const char *path);

/* Lookups: NULL if absent. */
const struct gguf_kv *gguf_find_kv(const struct gguf_file *f, const char *key);
const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name);

/* Scalar readers, converting between integer widths (range-checked) and from any
 * numeric type to double: 0, or -EINVAL (wrong type, out of range). kv may be NULL
 * (then -ENOENT). */
int gguf_kv_int(const struct gguf_kv *kv, int64_t *out);
int gguf_kv_float(const struct gguf_kv *kv, double *out);
int gguf_kv_bool(const struct gguf_kv *kv, int *out);
int gguf_kv_str(const struct gguf_kv *kv, struct gguf_str *out);

/* Element i of an array: 0, or -EINVAL (not an array of a fitting type) / -ERANGE. */
int gguf_arr_int(const struct gguf_kv *kv, uint64_t i, int64_t *out);
int gguf_arr_float(const struct gguf_kv *kv, uint64_t i, double *out);
int gguf_arr_str(const struct gguf_kv *kv, uint64_t i, struct gguf_str *out);

/* The value of key as a NUL-terminated copy into buf (truncated to len - 1), for
 * messages and small strings: 0, -ENOENT, -EINVAL (not a string), -ENAMETOOLONG. */
int gguf_get_str(const struct gguf_file *f, const char *key, char *buf, size_t len);

/* Bytes of one scalar value of a metadata type; 0 for string, array and unknown. */
uint64_t gguf_vtype_size(uint32_t t);

/* ggml type facts: name ("Q4_K"; "type 11" style text is the caller's for unknowns)
 * or NULL; elements per block and bytes per block: 0 or -ENOTSUP. */
const char *gguf_ttype_name(uint32_t type);
int gguf_ttype_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);

#endif
