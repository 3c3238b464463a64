/* safetensors files, read into memory of our own (file_load: never a mapping of the
 * file, so a file truncated or rewritten under a running daemon changes nothing): a
 * bounded, checked parse of the JSON header and the tensor index, single file or
 * sharded through model.safetensors.index.json. */
#ifndef KD_DAEMON_SAFETENSORS_H
#define KD_DAEMON_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/dtype.h"

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER (100u << 20)	/* bytes of JSON header accepted */

struct st_tensor {
	char *name;			/* owned */
	char dtype_name[16];		/* as written: "BF16", "F8_E4M3", ... */
	int dtype_ok;			/* 1 if dtype is one kdec computes with */
	enum k_dtype dtype;		/* valid when dtype_ok */
	int ndim;
	int64_t shape[ST_MAX_DIMS];
	uint64_t nbytes;
	const void *data;		/* inside the file image; nbytes long */
};

struct st_file {
	char *path;			/* owned */
	void *map;			/* the whole file's copy (anonymous pages, munmap),
					 * or with mapped its read-only mapping; NULL if
					 * not read by us */
	int mapped;			/* map is the file mapped (st_set_map), not a copy */
	size_t size;			/* bytes */
	int n_tensors;
	struct st_tensor *tensors;	/* (n_tensors), owned, sorted by name */
};

/* Parses a whole file image (buf, size) that stays valid while f is used.
 * Checks: header length within the image and ST_MAX_HEADER, JSON object, every entry
 * has dtype/shape/data_offsets, offsets ordered and inside the data section, size equal
 * to shape x element size (overflow-checked), no two tensors overlap, names unique.
 * Unknown dtypes parse (dtype_ok = 0) so that callers can name them in an error.
 * `name` is used in messages only. Returns 0 or -EINVAL/-ENOMEM with one line in err. */
int st_parse(struct st_file *f, const void *buf, size_t size, const char *name,
	     char *err, size_t err_len);

/* Reads path whole (file_load), then st_parse. */
int st_file_open(struct st_file *f, const char *path, char *err, size_t err_len);
void st_file_close(struct st_file *f);	/* accepts a zeroed or half-built file */

/* Binary search by name; NULL if absent. */
const struct st_tensor *st_file_find(const struct st_file *f, const char *name);

/* All weight files of a model directory: DIR/model.safetensors.index.json (its
 * weight_map names the shards; shard names must be plain file names in DIR and every
 * mapped tensor must be in its shard), else DIR/model.safetensors.
 * A tensor name present in two files is an error. */
struct st_set {
	int n_files;
	struct st_file *files;		/* (n_files), owned */
};

int st_set_open(struct st_set *s, const char *dir, char *err, size_t err_len);

/* st_set_open, calling pr->fn (when pr is not NULL) as file_load reads each file. */
struct st_progress {
	void (*fn)(void *ctx, const char *path, size_t done, size_t total);
	void *ctx;
};
int st_set_load(struct st_set *s, const char *dir, const struct st_progress *pr,
		char *err, size_t err_len);
void st_set_close(struct st_set *s);	/* accepts a zeroed or half-built set */

/* As st_set_load, but every file mapped read-only (file_map) instead of read: nothing
 * is read until a tensor's bytes are touched, and the pages touched can be given back
 * (madvise). For tensor parallel's shards, which read each rank's slice of every
 * tensor straight from the files (model_shard.c): a file truncated while mapped
 * raises SIGBUS where it is read, so the shards are built at start, under
 * sigbus_guard_run (the build fails with -EIO and one line), and the mapping is read
 * no more after. */
int st_set_map(struct st_set *s, const char *dir, char *err, size_t err_len);

/* Finds a tensor in any file; *file (if not NULL) gets the file that holds it. */
const struct st_tensor *st_set_find(const struct st_set *s, const char *name,
				    const struct st_file **file);

/* Maps a dtype string to k_dtype: 0, or -ENOTSUP (known but not computed with yet,
 * e.g. F8_E4M3) or -EINVAL (unknown). */
int st_dtype_parse(const char *s, enum k_dtype *out);

#endif
