/* Snapshot file writer (atomic) and reader (all-or-nothing). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "kvcache/host_tier.h"
#include "kvcache/snapshot.h"

#define SNAP_MAGIC "KDKVSNAP"
#define SNAP_META_LEVEL 3
#define SNAP_MAX_META (1ULL << 32)	/* bytes of session records a reader accepts */
#define SNAP_TMP_PREFIX "." KV_SNAP_FILE "."	/* then the writer's pid, then SNAP_TMP_SUFFIX */
#define SNAP_TMP_SUFFIX ".tmp"

/* A fixed, public key: the header checksum detects damage, not forgery. */
static const uint64_t sum_key[2] = { 0x6b64656320736e61ULL, 0x70736875745f7631ULL };

/* ---- little-endian fields ---------------------------------------------- */

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
	uint32_t v = 0;

	for (int i = 3; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static uint64_t get64(const uint8_t *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

/* Header fields and their offsets. */
struct snap_header {
	uint32_t version;
	struct kv_snap_meta meta;
	uint32_t n_sessions;
	uint64_t n_blocks;
	uint64_t meta_zbytes;
	uint64_t meta_raw_bytes;
	uint64_t file_bytes;
};

enum {
	H_MAGIC = 0, H_VERSION = 8, H_SIZE = 12, H_FP0 = 16, H_FP1 = 24, H_BT = 32, H_ELEM = 36,
	H_BLOCK = 40, H_FLAGS = 48, H_NSESS = 52, H_NBLK = 56, H_METAZ = 64, H_METARAW = 72,
	H_FILE = 80, H_DESC = 88, H_SUM = 120,
};

static void header_encode(uint8_t *h, const struct snap_header *x)
{
	memset(h, 0, KV_SNAP_HEADER_BYTES);
	memcpy(h + H_MAGIC, SNAP_MAGIC, 8);
	put32(h + H_VERSION, x->version);
	put32(h + H_SIZE, KV_SNAP_HEADER_BYTES);
	put64(h + H_FP0, x->meta.fingerprint[0]);
	put64(h + H_FP1, x->meta.fingerprint[1]);
	put32(h + H_BT, x->meta.block_tokens);
	put32(h + H_ELEM, x->meta.elem_bytes);
	put64(h + H_BLOCK, x->meta.block_bytes);
	put32(h + H_FLAGS, x->meta.flags);
	put32(h + H_NSESS, x->n_sessions);
	put64(h + H_NBLK, x->n_blocks);
	put64(h + H_METAZ, x->meta_zbytes);
	put64(h + H_METARAW, x->meta_raw_bytes);
	put64(h + H_FILE, x->file_bytes);
	memcpy(h + H_DESC, x->meta.desc, KV_SNAP_DESC_MAX - 1);
	put64(h + H_SUM, kv_siphash64(sum_key, h, H_SUM));
}

static void header_decode(const uint8_t *h, struct snap_header *x)
{
	memset(x, 0, sizeof(*x));
	x->version = get32(h + H_VERSION);
	x->meta.fingerprint[0] = get64(h + H_FP0);
	x->meta.fingerprint[1] = get64(h + H_FP1);
	x->meta.block_tokens = get32(h + H_BT);
	x->meta.elem_bytes = get32(h + H_ELEM);
	x->meta.block_bytes = get64(h + H_BLOCK);
	x->meta.flags = get32(h + H_FLAGS);
	x->n_sessions = get32(h + H_NSESS);
	x->n_blocks = get64(h + H_NBLK);
	x->meta_zbytes = get64(h + H_METAZ);
	x->meta_raw_bytes = get64(h + H_METARAW);
	x->file_bytes = get64(h + H_FILE);
	memcpy(x->meta.desc, h + H_DESC, KV_SNAP_DESC_MAX - 1);
	x->meta.desc[KV_SNAP_DESC_MAX - 1] = 0;
}

/* ---- writer ------------------------------------------------------------- */

static int write_all(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;

	while (n) {
		ssize_t w = write(fd, b, n);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return w < 0 ? -errno : -EIO;
		b += w;
		n -= (size_t)w;
	}
	return 0;
}

static int blocks_of(const struct kv_snap_meta *m, int n_tokens)
{
	return (int)(((int64_t)n_tokens + m->block_tokens - 1) / m->block_tokens);
}

/* The session records, compressed into one frame: *z malloc'd. */
static int meta_build(const struct kv_snap_session *s, int n, void **z, size_t *zbytes,
		      size_t *raw_bytes)
{
	size_t len = 0, off = 0, cap;
	uint8_t *raw;
	void *out;
	int ret = -ENOMEM;

	for (int i = 0; i < n; i++)
		len += 1 + strlen(s[i].name) + 8 + 8 + 4 + 4 * (size_t)s[i].n_tokens;
	raw = malloc(len ? len : 1);
	cap = ZSTD_compressBound(len);
	out = malloc(cap);
	if (!raw || !out)
		goto out;
	for (int i = 0; i < n; i++) {
		size_t nl = strlen(s[i].name);

		raw[off++] = (uint8_t)nl;
		memcpy(raw + off, s[i].name, nl);
		off += nl;
		put64(raw + off, s[i].owner);
		put64(raw + off + 8, s[i].salt);
		put32(raw + off + 16, (uint32_t)s[i].n_tokens);
		off += 20;
		for (int t = 0; t < s[i].n_tokens; t++, off += 4)
			put32(raw + off, (uint32_t)s[i].tokens[t]);
	}
	{
		ZSTD_CCtx *cc = ZSTD_createCCtx();
		size_t r;

		if (!cc)
			goto out;
		ZSTD_CCtx_setParameter(cc, ZSTD_c_compressionLevel, SNAP_META_LEVEL);
		ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 1);
		r = ZSTD_compress2(cc, out, cap, raw, len);
		ZSTD_freeCCtx(cc);
		if (ZSTD_isError(r)) {
			ret = -EIO;
			goto out;
		}
		*zbytes = r;
	}
	*z = out;
	out = NULL;
	*raw_bytes = len;
	ret = 0;
out:
	free(raw);
	free(out);
	return ret;
}

static int fsync_dir(const char *dir)
{
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC), ret = 0;

	if (fd < 0)
		return -errno;
	if (fsync(fd))
		ret = -errno;
	close(fd);
	return ret;
}

/* Header placeholder, meta frame, block records; the header last, once lengths are known. */
static int write_body(int fd, const struct kv_snap_meta *meta, const struct kv_snap_session *s, int n,
		      kv_snap_frame_fn frame, void *ctx, char *err, size_t err_len)
{
	struct snap_header h = { .version = KV_SNAP_VERSION, .meta = *meta, .n_sessions = (uint32_t)n };
	uint8_t hdr[KV_SNAP_HEADER_BYTES] = { 0 }, len8[8];
	uint64_t off;
	void *mz = NULL;
	size_t mzb = 0, mraw = 0;
	int ret;

	if ((ret = meta_build(s, n, &mz, &mzb, &mraw))) {
		snprintf(err, err_len, "snapshot: cannot encode the session records: %s", strerror(-ret));
		return ret;
	}
	h.meta_zbytes = mzb;
	h.meta_raw_bytes = mraw;
	if ((ret = write_all(fd, hdr, sizeof(hdr))) || (ret = write_all(fd, mz, mzb)))
		goto err_io;
	off = sizeof(hdr) + mzb;
	for (int i = 0; i < n; i++) {
		for (int b = 0; b < blocks_of(meta, s[i].n_tokens); b++) {
			const void *z;
			size_t zb;

			if ((ret = frame(ctx, i, b, &z, &zb))) {
				snprintf(err, err_len, "snapshot: block %d of session '%s': %s", b, s[i].name,
					 strerror(-ret));
				goto out;
			}
			put64(len8, zb);
			if ((ret = write_all(fd, len8, 8)) || (ret = write_all(fd, z, zb)))
				goto err_io;
			off += 8 + zb;
			h.n_blocks++;
		}
	}
	h.file_bytes = off;
	header_encode(hdr, &h);
	if (pwrite(fd, hdr, sizeof(hdr), 0) != (ssize_t)sizeof(hdr)) {
		ret = errno ? -errno : -EIO;
		goto err_io;
	}
	if (fsync(fd)) {
		ret = -errno;
		goto err_io;
	}
	ret = 0;
	goto out;

err_io:
	snprintf(err, err_len, "snapshot: write failed: %s", strerror(-ret));
out:
	free(mz);
	return ret;
}

int kv_snap_write(const char *dir, const struct kv_snap_meta *meta, const struct kv_snap_session *s,
		  int n, kv_snap_frame_fn frame, void *ctx, char *err, size_t err_len)
{
	char tmp[4096], path[4096];
	int fd, ret;

	if (snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE) >= (int)sizeof(path) ||
	    snprintf(tmp, sizeof(tmp), "%s/" SNAP_TMP_PREFIX "%ld" SNAP_TMP_SUFFIX, dir,
		     (long)getpid()) >= (int)sizeof(tmp)) {
		snprintf(err, err_len, "snapshot: state directory path too long");
		return -ENAMETOOLONG;
	}
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0) {
		ret = -errno;
		snprintf(err, err_len, "snapshot: cannot create %s: %s", tmp, strerror(errno));
		return ret;
	}
	ret = write_body(fd, meta, s, n, frame, ctx, err, err_len);
	if (close(fd) && !ret) {
		ret = -errno;
		snprintf(err, err_len, "snapshot: closing %s: %s", tmp, strerror(errno));
	}
	if (!ret && rename(tmp, path)) {
		ret = -errno;
		snprintf(err, err_len, "snapshot: cannot rename %s to %s: %s", tmp, path, strerror(errno));
	}
	if (ret) {
		unlink(tmp);
		return ret;
	}
	if ((ret = fsync_dir(dir)))
		snprintf(err, err_len, "snapshot: fsync of %s: %s", dir, strerror(-ret));
	return ret;
}

/* ---- files around the snapshot ------------------------------------------ */

int kv_snap_set_aside(const char *dir, char *aside, size_t aside_len, char *err, size_t err_len)
{
	char path[4096], stamp[32];
	time_t now = time(NULL);
	struct tm tm;

	if (snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE) >= (int)sizeof(path)) {
		snprintf(err, err_len, "snapshot: state directory path too long");
		return -ENAMETOOLONG;
	}
	gmtime_r(&now, &tm);
	strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &tm);
	/* link, then unlink: a name already taken (an earlier refusal) is never replaced */
	for (int k = 1; k < 1000; k++) {
		int n = k == 1 ? snprintf(aside, aside_len, "%s" KV_SNAP_ASIDE "%s", path, stamp)
			       : snprintf(aside, aside_len, "%s" KV_SNAP_ASIDE "%s-%d", path, stamp, k);

		if (n >= (int)aside_len) {
			snprintf(err, err_len, "snapshot: state directory path too long");
			return -ENAMETOOLONG;
		}
		if (!link(path, aside)) {
			if (unlink(path)) {
				int ret = -errno;

				snprintf(err, err_len, "snapshot: cannot remove %s after linking it to %s: %s",
					 path, aside, strerror(errno));
				unlink(aside);
				return ret;
			}
			fsync_dir(dir);	/* the rename is what matters; it is done */
			return 0;
		}
		if (errno != EEXIST) {
			int ret = -errno;

			snprintf(err, err_len, "snapshot: cannot set %s aside as %s: %s", path, aside,
				 strerror(errno));
			return ret;
		}
	}
	snprintf(err, err_len, "snapshot: cannot set %s aside: 999 refused snapshots of this second", path);
	return -EEXIST;
}

/* The pid in a temporary file's name; 0: the pid-less name of older builds; -1: not ours. */
static long temp_pid(const char *name)
{
	size_t np = strlen(SNAP_TMP_PREFIX), ns = strlen(SNAP_TMP_SUFFIX), n = strlen(name);
	long pid = 0;

	if (!strcmp(name, "." KV_SNAP_FILE SNAP_TMP_SUFFIX))
		return 0;
	if (n <= np + ns || strncmp(name, SNAP_TMP_PREFIX, np) || strcmp(name + n - ns, SNAP_TMP_SUFFIX))
		return -1;
	for (size_t i = np; i < n - ns; i++) {
		if (name[i] < '0' || name[i] > '9' || pid > 1L << 40)
			return -1;
		pid = pid * 10 + (name[i] - '0');
	}
	return pid > 0 ? pid : -1;
}

int kv_snap_clean_temps(const char *dir, char *first, size_t first_len)
{
	DIR *d = opendir(dir);
	struct dirent *de;
	int n = 0;

	if (first_len)
		first[0] = 0;
	if (!d)
		return 0;
	while ((de = readdir(d))) {
		long pid = temp_pid(de->d_name);
		struct stat st;

		if (pid < 0 || fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode))
			continue;
		/* a live writer's (another daemon on this directory) stays */
		if (pid > 0 && pid != (long)getpid() && (!kill((pid_t)pid, 0) || errno == EPERM))
			continue;
		if (unlinkat(dirfd(d), de->d_name, 0))
			continue;
		if (!n++ && first_len)
			snprintf(first, first_len, "%s", de->d_name);
	}
	closedir(d);
	return n;
}

/* ---- reader ------------------------------------------------------------- */

struct snap_reader {
	const char *path;
	const uint8_t *p;	/* the mapped file */
	size_t len;
	char *err;
	size_t err_len;
};

__attribute__((format(printf, 3, 4)))
static int refuse(struct snap_reader *r, int ret, const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	snprintf(r->err, r->err_len, "snapshot %s refused: %s", r->path, msg);
	return ret;
}

static int check_header(struct snap_reader *r, const struct kv_snap_meta *expect, struct snap_header *h)
{
	const struct kv_snap_meta *m = &h->meta;

	if (r->len < KV_SNAP_HEADER_BYTES)
		return refuse(r, -EBADMSG, "truncated (%zu bytes, shorter than the header)", r->len);
	if (memcmp(r->p, SNAP_MAGIC, 8))
		return refuse(r, -EBADMSG, "not a kdec KV snapshot (bad magic)");
	if (get64(r->p + H_SUM) != kv_siphash64(sum_key, r->p, H_SUM))
		return refuse(r, -EBADMSG, "damaged (header checksum mismatch)");
	header_decode(r->p, h);
	if (h->version != KV_SNAP_VERSION || get32(r->p + H_SIZE) != KV_SNAP_HEADER_BYTES)
		return refuse(r, -ESTALE, "format version %u, this build reads version %d", h->version,
			      KV_SNAP_VERSION);
	if (h->file_bytes != r->len)
		return refuse(r, -EBADMSG, "%s: %zu bytes, the header says %llu",
			      r->len < h->file_bytes ? "truncated" : "damaged (trailing bytes)", r->len,
			      (unsigned long long)h->file_bytes);
	if (m->fingerprint[0] != expect->fingerprint[0] || m->fingerprint[1] != expect->fingerprint[1] ||
	    m->block_tokens != expect->block_tokens || m->elem_bytes != expect->elem_bytes ||
	    m->block_bytes != expect->block_bytes || m->flags != expect->flags)
		return refuse(r, -ESTALE,
			      "written for another model or configuration (%s; block %u tokens, %u-byte KV "
			      "elements), this engine runs %s; block %u tokens, %u-byte KV elements",
			      m->desc, m->block_tokens, m->elem_bytes, expect->desc, expect->block_tokens,
			      expect->elem_bytes);
	if (h->meta_zbytes > r->len - KV_SNAP_HEADER_BYTES || h->meta_raw_bytes > SNAP_MAX_META)
		return refuse(r, -EBADMSG, "damaged (session records out of bounds)");
	return 0;
}

/* Decodes the session-record frame into *raw (malloc'd, h->meta_raw_bytes). */
static int read_meta_frame(struct snap_reader *r, const struct snap_header *h, uint8_t **raw)
{
	const uint8_t *z = r->p + KV_SNAP_HEADER_BYTES;
	size_t zb = h->meta_zbytes, n;

	*raw = NULL;
	if (zb < 5 || ZSTD_getFrameContentSize(z, zb) != h->meta_raw_bytes || !(z[4] & 0x04) ||
	    ZSTD_findFrameCompressedSize(z, zb) != zb)
		return refuse(r, -EBADMSG, "damaged (session records frame)");
	*raw = malloc(h->meta_raw_bytes ? h->meta_raw_bytes : 1);
	if (!*raw)
		return refuse(r, -ENOMEM, "out of memory for %llu bytes of session records",
			      (unsigned long long)h->meta_raw_bytes);
	n = ZSTD_decompress(*raw, h->meta_raw_bytes, z, zb);
	if (ZSTD_isError(n) || n != h->meta_raw_bytes)
		return refuse(r, -EBADMSG, "damaged (session records do not decode: %s)",
			      ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short");
	return 0;
}

/* Session records from raw into f (tokens copied out). */
static int parse_sessions(struct snap_reader *r, const struct snap_header *h, const uint8_t *raw,
			  struct kv_snap_file *f)
{
	size_t off = 0, len = h->meta_raw_bytes, tok = 0;
	uint64_t blocks = 0;

	if (h->n_sessions > len / 21 + 1)
		return refuse(r, -EBADMSG, "damaged (%u sessions in %zu bytes)", h->n_sessions, len);
	f->sessions = calloc(h->n_sessions + 1, sizeof(*f->sessions));
	f->tokens = malloc(len + 4);	/* the histories cannot outgrow their records */
	if (!f->sessions || !f->tokens)
		return refuse(r, -ENOMEM, "out of memory reading %u sessions", h->n_sessions);
	for (uint32_t i = 0; i < h->n_sessions; i++) {
		struct kv_snap_session *s = &f->sessions[i];
		size_t nl = off < len ? raw[off] : 0;
		uint32_t nt;

		if (off + 1 + nl + 20 > len || nl > KV_SESSION_NAME_MAX)
			return refuse(r, -EBADMSG, "damaged (session record %u)", i);
		memcpy(s->name, raw + off + 1, nl);
		s->name[nl] = 0;
		off += 1 + nl;
		s->owner = get64(raw + off);
		s->salt = get64(raw + off + 8);
		nt = get32(raw + off + 16);
		off += 20;
		if (!kv_session_name_ok(s->name) || nt > (1u << 30) || (size_t)nt * 4 > len - off)
			return refuse(r, -EBADMSG, "damaged (session record %u)", i);
		for (uint32_t t = 0; t < nt; t++, off += 4)
			f->tokens[tok + t] = (int32_t)get32(raw + off);
		s->tokens = f->tokens + tok;
		s->n_tokens = (int)nt;
		s->n_blocks = blocks_of(&h->meta, (int)nt);
		tok += nt;
		blocks += (uint64_t)s->n_blocks;
		for (uint32_t j = 0; j < i; j++)
			if (f->sessions[j].owner == s->owner && !strcmp(f->sessions[j].name, s->name))
				return refuse(r, -EBADMSG, "damaged (session '%s' listed twice)", s->name);
	}
	if (off != len || blocks != h->n_blocks)
		return refuse(r, -EBADMSG, "damaged (session records and block count disagree)");
	f->n_sessions = (int)h->n_sessions;
	return 0;
}

/* Walks the block records, decoding each frame once to check it. */
static int check_blocks(struct snap_reader *r, const struct snap_header *h, struct kv_snap_file *f)
{
	size_t off = KV_SNAP_HEADER_BYTES + h->meta_zbytes;
	struct kv_codec codec;
	void *scratch = malloc(h->meta.block_bytes);
	uint64_t k = 0;
	int ret = 0;

	f->z = calloc(h->n_blocks + 1, sizeof(*f->z));
	f->zbytes = calloc(h->n_blocks + 1, sizeof(*f->zbytes));
	if (!scratch || !f->z || !f->zbytes ||
	    kv_codec_init(&codec, h->meta.block_bytes, 1, 1, 0)) {
		free(scratch);
		return refuse(r, -ENOMEM, "out of memory checking %llu blocks", (unsigned long long)h->n_blocks);
	}
	for (int i = 0; i < f->n_sessions && !ret; i++) {
		struct kv_snap_session *s = &f->sessions[i];

		s->z = f->z + k;
		s->zbytes = f->zbytes + k;
		for (int b = 0; b < s->n_blocks; b++, k++) {
			uint64_t zb = r->len - off >= 8 ? get64(r->p + off) : 0;

			if (r->len - off < 8 || zb > r->len - off - 8) {
				ret = refuse(r, -EBADMSG, "damaged (block %d of session '%s' out of bounds)", b, s->name);
				break;
			}
			f->z[k] = r->p + off + 8;
			f->zbytes[k] = (size_t)zb;
			if (kv_codec_decompress(&codec, scratch, f->z[k], f->zbytes[k])) {
				ret = refuse(r, -EBADMSG, "damaged (block %d of session '%s' fails its checksum)",
					     b, s->name);
				break;
			}
			off += 8 + (size_t)zb;
		}
	}
	if (!ret && off != r->len)
		ret = refuse(r, -EBADMSG, "damaged (%zu bytes after the last block)", r->len - off);
	kv_codec_fini(&codec);
	free(scratch);
	return ret;
}

static int map_file(struct snap_reader *r, const char *path, void **map)
{
	struct stat st;
	/* O_NONBLOCK: a FIFO in the snapshot's place is refused below, not waited on */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK), ret = 0;

	*map = NULL;
	if (fd < 0) {
		ret = -errno;
		snprintf(r->err, r->err_len, "snapshot %s: %s", path, strerror(errno));
		return ret;
	}
	if (fstat(fd, &st)) {
		ret = -errno;
		snprintf(r->err, r->err_len, "snapshot %s: %s", path, strerror(errno));
	} else if (!S_ISREG(st.st_mode)) {
		ret = refuse(r, -EBADMSG, "not a regular file");
	} else if (st.st_size > 0) {
		*map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
		if (*map == MAP_FAILED) {
			*map = NULL;
			ret = -errno;
			snprintf(r->err, r->err_len, "snapshot %s: mmap: %s", path, strerror(errno));
		}
	}
	close(fd);
	r->p = *map;
	r->len = ret ? 0 : (size_t)st.st_size;
	return ret;
}

int kv_snap_read(struct kv_snap_file *f, const char *dir, const struct kv_snap_meta *expect,
		 char *err, size_t err_len)
{
	struct kv_snap_file x = { 0 };
	struct snap_reader r = { .err = err, .err_len = err_len };
	struct snap_header h;
	char path[4096];
	uint8_t *raw = NULL;
	int ret;

	memset(f, 0, sizeof(*f));
	if (snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE) >= (int)sizeof(path)) {
		snprintf(err, err_len, "snapshot: state directory path too long");
		return -ENAMETOOLONG;
	}
	r.path = path;
	if ((ret = map_file(&r, path, &x.map)))
		return ret;
	x.len = r.len;
	if ((ret = check_header(&r, expect, &h)) || (ret = read_meta_frame(&r, &h, &raw)) ||
	    (ret = parse_sessions(&r, &h, raw, &x)) || (ret = check_blocks(&r, &h, &x)))
		goto err_release;
	free(raw);
	x.meta = h.meta;
	*f = x;
	return 0;

err_release:
	free(raw);
	kv_snap_release(&x);
	return ret;
}

void kv_snap_release(struct kv_snap_file *f)
{
	if (f->map)
		munmap(f->map, f->len);
	free(f->sessions);
	free(f->tokens);
	free(f->z);
	free(f->zbytes);
	memset(f, 0, sizeof(*f));
}
