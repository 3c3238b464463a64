/* Bounded whole-file reads, read-only maps and owned copies of large files. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/file_read.h"

const char *file_kind(unsigned mode)
{
	switch (mode & S_IFMT) {
	case S_IFREG: return "a regular file";
	case S_IFDIR: return "a directory";
	case S_IFIFO: return "a FIFO";
	case S_IFSOCK: return "a socket";
	case S_IFCHR: return "a character device";
	case S_IFBLK: return "a block device";
	default: return "not a regular file";
	}
}

/* path opened read-only, if it is a regular file: the descriptor and *st, or -errno
 * with "PATH: reason" in err. O_NONBLOCK, so that a FIFO in a file's place is refused
 * here instead of blocking the open until a writer comes (it changes nothing for a
 * regular file's reads). */
static int file_open_ro(const char *path, struct stat *st, char *err, size_t err_len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);

	if (fd < 0) {
		fd = -errno;
		snprintf(err, err_len, "%s: %s", path, strerror(-fd));
		return fd;
	}
	if (fstat(fd, st)) {
		int rc = -errno;

		snprintf(err, err_len, "%s: %s", path, strerror(-rc));
		close(fd);
		return rc;
	}
	if (!S_ISREG(st->st_mode)) {
		snprintf(err, err_len, "%s: not a regular file (%s)", path, file_kind(st->st_mode));
		close(fd);
		return -EINVAL;
	}
	return fd;
}

int file_read_all(const char *path, size_t cap, char **out, size_t *len, char *err, size_t err_len)
{
	struct stat st;
	size_t got = 0;
	char *buf = NULL;
	int fd, rc = 0;

	*out = NULL;
	*len = 0;
	fd = file_open_ro(path, &st, err, err_len);
	if (fd < 0)
		return fd;
	if ((unsigned long long)st.st_size > cap) {
		snprintf(err, err_len, "%s: %lld bytes, more than the %zu accepted", path,
			 (long long)st.st_size, cap);
		rc = -EINVAL;
		goto out;
	}
	buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		snprintf(err, err_len, "%s: out of memory", path);
		rc = -ENOMEM;
		goto out;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			rc = n < 0 ? -errno : -EIO;
			snprintf(err, err_len, "%s: read failed: %s", path,
				 n < 0 ? strerror(-rc) : "the file got shorter while being read");
			free(buf);
			goto out;
		}
		got += (size_t)n;
	}
	buf[got] = '\0';
	*out = buf;
	*len = got;
out:
	close(fd);
	return rc;
}

int file_map(const char *path, void **map, size_t *size, char *err, size_t err_len)
{
	struct stat st;
	int fd, rc = 0;

	*map = NULL;
	*size = 0;
	fd = file_open_ro(path, &st, err, err_len);
	if (fd < 0)
		return fd;
	if (st.st_size > 0) {
		void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);

		if (m == MAP_FAILED) {
			rc = -errno;
			snprintf(err, err_len, "%s: mmap of %lld bytes: %s", path,
				 (long long)st.st_size, strerror(-rc));
			goto out;
		}
		*map = m;
		*size = (size_t)st.st_size;
	}
out:
	close(fd);
	return rc;
}

/* The same file, unchanged: what a reader compares before and after its reads. */
static int file_same(const struct stat *a, const struct stat *b)
{
	return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
	       a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* size bytes of fd into buf by bounded reads. 0, -ESTALE (the file ended early) or
 * -errno. */
static int file_read_chunks(int fd, uint8_t *buf, size_t size, const char *path,
			    void (*progress)(void *, const char *, size_t, size_t), void *ctx)
{
	size_t got = 0;

	while (got < size) {
		size_t want = size - got < FILE_LOAD_CHUNK ? size - got : FILE_LOAD_CHUNK;
		ssize_t n = pread(fd, buf + got, want, (off_t)got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -ESTALE;
		got += (size_t)n;
		if (progress)
			progress(ctx, path, got, size);
	}
	return 0;
}

int file_load(const char *path, void **buf, size_t *size,
	      void (*progress)(void *ctx, const char *path, size_t done, size_t total),
	      void *ctx, char *err, size_t err_len)
{
	struct stat st, after;
	void *m = NULL;
	int fd, rc = 0;

	*buf = NULL;
	*size = 0;
	fd = file_open_ro(path, &st, err, err_len);
	if (fd < 0)
		return fd;
	if (st.st_size > 0) {
		/* anonymous pages, not malloc: munmap gives a large copy back at once */
		m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) {
			m = NULL;
			rc = -errno;
			snprintf(err, err_len, "%s: %lld bytes of memory for its copy: %s", path,
				 (long long)st.st_size, strerror(-rc));
			goto out;
		}
		posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
		rc = file_read_chunks(fd, m, (size_t)st.st_size, path, progress, ctx);
		if (rc && rc != -ESTALE) {
			snprintf(err, err_len, "%s: read failed: %s", path, strerror(-rc));
			goto out;
		}
	}
	if (fstat(fd, &after)) {
		rc = -errno;
		snprintf(err, err_len, "%s: %s", path, strerror(-rc));
		goto out;
	}
	if (rc == -ESTALE || !file_same(&st, &after)) {
		rc = -ESTALE;
		snprintf(err, err_len, "%s: changed while being read (%lld bytes at the start, "
			 "%lld now); load it again once it is complete", path,
			 (long long)st.st_size, (long long)after.st_size);
		goto out;
	}
	*buf = m;
	*size = (size_t)st.st_size;
	m = NULL;
out:
	if (m)
		munmap(m, (size_t)st.st_size);
	close(fd);
	return rc;
}

int file_fail(char *err, size_t err_len, int rc, const char *fmt, ...)
{
	va_list ap;

	if (!err || !err_len)
		return rc;
	va_start(ap, fmt);
	vsnprintf(err, err_len, fmt, ap);
	va_end(ap);
	return rc;
}

int file_vfail(char *err, size_t err_len, int rc, const char *who, const char *fmt,
	       va_list ap)
{
	int n;

	if (!err || !err_len)
		return rc;
	n = snprintf(err, err_len, "%s: ", who);
	if (n >= 0 && (size_t)n < err_len)
		vsnprintf(err + n, err_len - (size_t)n, fmt, ap);
	for (char *s = err; *s; s++)
		if ((unsigned char)*s < 0x20 || *s == 0x7f)
			*s = '?';
	return rc;
}
