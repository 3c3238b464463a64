/* Bounded whole-file reads and read-only maps. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/file_read.h"

/* path opened read-only: the descriptor, or -errno with "PATH: reason" in err. */
static int file_open_ro(const char *path, char *err, size_t err_len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0) {
		fd = -errno;
		snprintf(err, err_len, "%s: %s", path, strerror(-fd));
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
	fd = file_open_ro(path, err, err_len);
	if (fd < 0)
		return fd;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (unsigned long long)st.st_size > cap) {
		snprintf(err, err_len, "%s: not a regular file of at most %zu bytes", path, cap);
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
			snprintf(err, err_len, "%s: read failed: %s", path, strerror(-rc));
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
	fd = file_open_ro(path, err, err_len);
	if (fd < 0)
		return fd;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
		snprintf(err, err_len, "%s: not a regular file", path);
		rc = -EINVAL;
		goto out;
	}
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
