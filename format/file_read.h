/* Reading small whole files (configs, shard indexes) with a size cap, mapping large
 * ones (weights), and the one-line errors of the parsers over them. libc only:
 * libkdclient compiles it in too. */
#ifndef KD_FORMAT_FILE_READ_H
#define KD_FORMAT_FILE_READ_H

#include <stdarg.h>
#include <stddef.h>

/* Reads the regular file path, at most cap bytes, into a malloc'd buffer with a NUL
 * after the last byte (*out, caller frees; *len bytes). Returns 0, or -errno with one
 * line "PATH: reason" in err (-ENOENT too, for callers that fall back on it). */
int file_read_all(const char *path, size_t cap, char **out, size_t *len, char *err, size_t err_len);

/* Maps the regular file path read-only (MAP_PRIVATE): 0 with *map and *size (*map is
 * NULL for an empty file, which the caller reports in its format's terms), or -errno
 * with one line in err: "PATH: reason", "PATH: not a regular file (a FIFO)" or
 * "PATH: mmap of N bytes: reason". munmap(*map, *size) releases it. The mapping reads
 * the file at every access: a file truncated meanwhile raises SIGBUS, one rewritten
 * shows its new bytes. For short-lived reads (a tokenizer's metadata); what a daemon
 * keeps, file_load copies. */
int file_map(const char *path, void **map, size_t *size, char *err, size_t err_len);

/* Bytes file_load reads per call: bounded so that a signal or a progress line never
 * waits on one multi-GiB read. */
#define FILE_LOAD_CHUNK ((size_t)64 << 20)

/* Reads the regular file path whole into anonymous memory of our own (read(), never a
 * mapping of the file: nothing done to the file afterwards, nor a truncation during
 * the read, can fault or change the copy): 0 with *buf and *size as file_map gives
 * them (munmap(*buf, *size) releases it; *buf NULL for an empty file), or -errno with
 * one line in err as file_map's, plus -ESTALE with "PATH: changed while being read
 * (...)" when its size, inode or modification time moved between the first and the
 * last read. progress, if not NULL, is called after each chunk with the bytes read so
 * far and the total. */
int file_load(const char *path, void **buf, size_t *size,
	      void (*progress)(void *ctx, const char *path, size_t done, size_t total),
	      void *ctx, char *err, size_t err_len);

/* What a file of st_mode mode is, for messages: "a FIFO", "a directory", ... */
const char *file_kind(unsigned mode);

/* The file readers' one-line errors: the message into err (when err_len > 0), rc back. */
int file_fail(char *err, size_t err_len, int rc, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* As file_fail, for a parser's own variadic fail: "WHO: <message>" into err, with
 * every control byte shown as '?' so that what the file held cannot break the line. */
int file_vfail(char *err, size_t err_len, int rc, const char *who, const char *fmt,
	       va_list ap) __attribute__((format(printf, 5, 0)));

#endif
