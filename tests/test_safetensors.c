/* safetensors: good files (single and sharded) and every kind of broken one, written
 * into a temporary directory by the test itself. */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/time.h>

#include "daemon/model/safetensors.h"
#include "format/file_read.h"
#include "tests/testutil.h"

static char err[512];
static char tmp[64];

/* An image: le64 header length, header, data_len bytes with byte i = i & 0xff. */
static uint8_t *image(const char *header, size_t data_len, size_t *size)
{
	size_t hlen = strlen(header);
	uint8_t *b = malloc(8 + hlen + data_len + 1);

	if (!b)
		exit(1);
	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
	memcpy(b + 8, header, hlen);
	for (size_t i = 0; i < data_len; i++)
		b[8 + hlen + i] = (uint8_t)i;
	*size = 8 + hlen + data_len;
	return b;
}

static void write_file(const char *dir, const char *name, const void *buf, size_t len)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "wb");
	if (!f || fwrite(buf, 1, len, f) != len || fclose(f)) {
		fprintf(stderr, "cannot write %s\n", path);
		exit(1);
	}
}

static void write_st(const char *dir, const char *name, const char *header, size_t data_len)
{
	size_t size;
	uint8_t *b = image(header, data_len, &size);

	write_file(dir, name, b, size);
	free(b);
}

static char *subdir(const char *name)
{
	static char path[8][128];
	static int n;
	char *p = path[n++ % 8];

	snprintf(p, 128, "%s/%s", tmp, name);
	if (mkdir(p, 0700)) {
		fprintf(stderr, "mkdir %s failed\n", p);
		exit(1);
	}
	return p;
}

/* st_parse of header + data must fail with a one-line message holding want1/want2. */
static void expect_bad(const char *header, size_t data_len, const char *want1,
		       const char *want2, int line)
{
	struct st_file f = { 0 };
	size_t size;
	uint8_t *b = image(header, data_len, &size);
	int rc = st_parse(&f, b, size, "t.safetensors", err, sizeof(err));

	CHECK(rc == -EINVAL, "line %d: rc %d (%s)", line, rc, err);
	CHECK(f.n_tensors == 0 && !f.tensors, "line %d: tensors left behind", line);
	CHECK(strstr(err, "t.safetensors: ") == err, "line %d: '%s'", line, err);
	CHECK(!strchr(err, '\n'), "line %d: newline in message", line);
	CHECK(!want1 || strstr(err, want1), "line %d: '%s' lacks '%s'", line, err, want1);
	CHECK(!want2 || strstr(err, want2), "line %d: '%s' lacks '%s'", line, err, want2);
	st_file_close(&f);
	free(b);
}

#define EXPECT_BAD(h, n, w1, w2) expect_bad(h, n, w1, w2, __LINE__)

static const char *GOOD =
	"{\"__metadata__\":{\"format\":\"pt\"},"
	"\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
	"\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
	"\"e8\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[20,24]},"
	"\"empty\":{\"dtype\":\"F16\",\"shape\":[0,5],\"data_offsets\":[24,24]},"
	"\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]}}  ";

static void test_good(void)
{
	const struct st_tensor *t;
	const struct st_file *file;
	struct st_set s;
	char *dir = subdir("good");
	enum k_dtype dt;
	int rc;

	write_st(dir, "model.safetensors", GOOD, 32);
	rc = st_set_open(&s, dir, err, sizeof(err));
	CHECK(rc == 0 && s.n_files == 1, "open: %d %s", rc, err);
	if (rc)
		return;
	CHECK(s.files[0].n_tensors == 5, "n_tensors %d", s.files[0].n_tensors);
	for (int i = 1; i < s.files[0].n_tensors; i++)
		CHECK(strcmp(s.files[0].tensors[i - 1].name, s.files[0].tensors[i].name) < 0,
		      "sorted");
	t = st_set_find(&s, "a", &file);
	CHECK(t && file == &s.files[0], "find a");
	if (t) {
		CHECK(t->dtype_ok && t->dtype == K_F32 && t->ndim == 1 && t->shape[0] == 2 &&
		      t->nbytes == 8 && !strcmp(t->dtype_name, "F32"), "a fields");
		CHECK(((const uint8_t *)t->data)[0] == 12 && ((const uint8_t *)t->data)[7] == 19,
		      "a data");
	}
	t = st_file_find(&s.files[0], "b");
	CHECK(t && t->dtype == K_BF16 && t->ndim == 2 && t->nbytes == 12 &&
	      ((const uint8_t *)t->data)[0] == 0, "b");
	t = st_file_find(&s.files[0], "e8");
	CHECK(t && !t->dtype_ok && !strcmp(t->dtype_name, "F8_E4M3") && t->nbytes == 4,
	      "F8_E4M3 parses as unsupported");
	t = st_file_find(&s.files[0], "s");
	CHECK(t && t->ndim == 0 && t->nbytes == 8 && !t->dtype_ok, "scalar I64");
	t = st_file_find(&s.files[0], "empty");
	CHECK(t && t->nbytes == 0 && t->dtype == K_F16, "empty tensor");
	CHECK(!st_set_find(&s, "zz", NULL) && !st_file_find(&s.files[0], ""), "absent");
	st_set_close(&s);
	st_set_close(&s);	/* twice is harmless */

	CHECK(st_dtype_parse("BF16", &dt) == 0 && dt == K_BF16, "BF16");
	CHECK(st_dtype_parse("F16", &dt) == 0 && dt == K_F16, "F16");
	CHECK(st_dtype_parse("F32", &dt) == 0 && dt == K_F32, "F32");
	CHECK(st_dtype_parse("F8_E4M3", &dt) == -ENOTSUP, "F8_E4M3");
	CHECK(st_dtype_parse("F8_E5M2", &dt) == -ENOTSUP, "F8_E5M2");
	CHECK(st_dtype_parse("I8", &dt) == -ENOTSUP && st_dtype_parse("BOOL", &dt) == -ENOTSUP,
	      "ints");
	CHECK(st_dtype_parse("F64", &dt) == -ENOTSUP && st_dtype_parse("U8", &dt) == -ENOTSUP,
	      "F64");
	CHECK(st_dtype_parse("Q4_K", &dt) == -EINVAL && st_dtype_parse("bf16", &dt) == -EINVAL,
	      "unknown");
}

static void test_bad_headers(void)
{
	struct st_file f = { 0 };
	uint8_t hdr[8];
	uint8_t *big;
	size_t size;
	int rc;

	EXPECT_BAD("{\"w\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
		   "tensor 'w'", "unknown dtype 'Q4'");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
		   "\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
		   "overlap", "[4, 12)");
	EXPECT_BAD("{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[4],"
		   "\"data_offsets\":[8,24]}}", 20, "tensor 'model.norm.weight'",
		   "data_offsets [8, 24) run past the data section (20 bytes)");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
		   "tensor 'w'", "needs 12 bytes");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
		   "tensor 'w'", "[8, 0)");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
		   "tensor 'w'", "shape[0]");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
		   "\"data_offsets\":[0,4]}}", 4, "tensor 'w'", "9 dims");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
		   "\"data_offsets\":[0,4]}}", 4, "tensor 'w'", "overflows");
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "tensor 'w'",
		   "missing data_offsets");
	EXPECT_BAD("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "missing dtype", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "missing shape",
		   NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
		   "dtype is not a string", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8,
		   "shape is not a list", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
		   "data_offsets", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8,
		   "data_offsets", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8,
		   "shape[0]", NULL);
	EXPECT_BAD("{\"w\":[1]}", 8, "tensor 'w'", "not an object");
	EXPECT_BAD("{\"__metadata__\":[1]}", 0, "__metadata__", NULL);
	EXPECT_BAD("[1]", 0, "not a JSON object", NULL);
	EXPECT_BAD("{\"w\":{}", 0, "header JSON", NULL);
	EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
		   "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16,
		   "duplicate", NULL);
	EXPECT_BAD("{\"a\\nb\":{\"dtype\":\"X\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
		   "'a?b'", NULL);

	/* Header length past the end, and past the limit. */
	memset(hdr, 0, sizeof(hdr));
	hdr[5] = 1;		/* 1 << 40 */
	rc = st_parse(&f, hdr, sizeof(hdr), "h.safetensors", err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "header length 1099511627776 runs past"), "%s", err);
	rc = st_parse(&f, hdr, 5, "h.safetensors", err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "5 bytes"), "%s", err);
	size = ST_MAX_HEADER + 64;
	big = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (big != MAP_FAILED) {
		big[0] = (uint8_t)(ST_MAX_HEADER + 1);
		big[1] = (uint8_t)((ST_MAX_HEADER + 1) >> 8);
		big[2] = (uint8_t)((ST_MAX_HEADER + 1) >> 16);
		big[3] = (uint8_t)((ST_MAX_HEADER + 1) >> 24);
		rc = st_parse(&f, big, size, "h.safetensors", err, sizeof(err));
		CHECK(rc == -EINVAL && strstr(err, "limit"), "%s", err);
		munmap(big, size);
	}
	st_file_close(&f);
}

static void test_files(void)
{
	struct st_file f;
	char *dir = subdir("trunc");
	char path[256];
	size_t size;
	uint8_t *b = image(GOOD, 32, &size);
	int rc;

	write_file(dir, "model.safetensors", b, 8 + strlen(GOOD) - 10);
	rc = st_set_open(&(struct st_set){ 0 }, dir, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "model.safetensors: header length") &&
	      strstr(err, "runs past the end"), "truncated header: %s", err);
	write_file(dir, "model.safetensors", b, size - 4);
	snprintf(path, sizeof(path), "%s/model.safetensors", dir);
	rc = st_file_open(&f, path, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "run past the data section (28 bytes)"),
	      "truncated data: %s", err);
	CHECK(!f.path && !f.map && !f.tensors, "closed on failure");
	write_file(dir, "model.safetensors", b, 0);
	rc = st_file_open(&f, path, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "0 bytes"), "empty file: %s", err);
	free(b);

	dir = subdir("none");
	rc = st_set_open(&(struct st_set){ 0 }, dir, err, sizeof(err));
	CHECK(rc == -ENOENT && strstr(err, "no model.safetensors or "
				      "model.safetensors.index.json"), "none: %s", err);
	rc = st_file_open(&f, "/nonexistent/x.safetensors", err, sizeof(err));
	CHECK(rc == -ENOENT && strstr(err, "/nonexistent/x.safetensors"), "%s", err);
}

/* What file_load's progress does to the file after its first chunk. */
enum change { CHANGE_NONE, CHANGE_TRUNCATE, CHANGE_REWRITE };

struct changer {
	const char *path;
	enum change what;
	int calls;
};

static void change_file(void *ctx, const char *path, size_t done, size_t total)
{
	struct changer *c = ctx;
	struct timeval tv[2] = { { 1000000000, 0 }, { 1000000000, 0 } };	/* 2001 */
	int fd;

	(void)path;
	(void)total;
	if (c->calls++ || done != FILE_LOAD_CHUNK)
		return;
	if (c->what == CHANGE_TRUNCATE) {
		CHECK(truncate(c->path, 100) == 0, "truncate");
	} else if (c->what == CHANGE_REWRITE) {
		/* same size, new bytes; the mtime set apart from the load's start, as a
		 * writer's would be (the clock's tick may be coarser than this test) */
		fd = open(c->path, O_WRONLY);
		CHECK(fd >= 0 && pwrite(fd, "x", 1, 5) == 1, "rewrite");
		close(fd);
		CHECK(utimes(c->path, tv) == 0, "utimes");
	}
}

/* file_load: the file read into our own memory; a file changed while it is read is one
 * -ESTALE line; a finished copy does not see the file change (no SIGBUS, no new bytes). */
static void test_file_load(void)
{
	size_t size = FILE_LOAD_CHUNK + 4096, got_size;
	char path[300];
	struct changer c = { .path = path };
	uint8_t *buf;
	void *m;
	int fd, rc;

	snprintf(path, sizeof(path), "%s/big.bin", tmp);
	for (int what = CHANGE_NONE; what <= CHANGE_REWRITE; what++) {
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
		/* sparse: two chunks of zeros without the disk space, a mark at its end */
		CHECK(fd >= 0 && ftruncate(fd, (off_t)size) == 0 &&
		      pwrite(fd, "end", 3, (off_t)size - 3) == 3, "big file");
		close(fd);
		c.what = (enum change)what;
		c.calls = 0;
		rc = file_load(path, &m, &got_size, change_file, &c, err, sizeof(err));
		if (what == CHANGE_NONE) {
			buf = m;
			CHECK(rc == 0 && got_size == size && c.calls == 2 &&
			      !memcmp(buf + size - 3, "end", 3), "load: rc %d (%s), %zu bytes, %d calls",
			      rc, err, got_size, c.calls);
			/* the copy outlives the file's truncation: reading it does not fault */
			CHECK(truncate(path, 0) == 0, "truncate after the load");
			CHECK(rc == 0 && !memcmp(buf + size - 3, "end", 3) && !buf[FILE_LOAD_CHUNK],
			      "the copy changed with the file");
			if (!rc)
				munmap(m, got_size);
		} else {
			CHECK(rc == -ESTALE && !m && strstr(err, "big.bin: changed while being read"),
			      "%s during the load: rc %d, %s", what == CHANGE_TRUNCATE ? "truncated" :
			      "rewritten", rc, err);
		}
	}
	unlink(path);
	CHECK(mkfifo(path, 0600) == 0, "mkfifo");
	rc = file_load(path, &m, &got_size, NULL, NULL, err, sizeof(err));
	CHECK(rc == -EINVAL && strstr(err, "big.bin: not a regular file (a FIFO)"), "FIFO: %s", err);
	unlink(path);
}

static const char *SHARD1 =
	"{\"x\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8]},"
	"\"x2\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[8,16]}}";
static const char *SHARD2 = "{\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

static void sharded(const char *name, const char *index, const char *s2, int want_rc,
		    const char *want1, const char *want2, int line)
{
	char *dir = subdir(name);
	struct st_set s;
	const struct st_file *file = NULL;
	const struct st_tensor *t;
	int rc;

	write_st(dir, "s1.safetensors", SHARD1, 16);
	write_st(dir, "s2.safetensors", s2, 16);
	write_file(dir, "model.safetensors.index.json", index, strlen(index));
	rc = st_set_open(&s, dir, err, sizeof(err));
	CHECK(rc == want_rc, "line %d: rc %d (%s)", line, rc, err);
	CHECK(!want1 || strstr(err, want1), "line %d: '%s' lacks '%s'", line, err, want1);
	CHECK(!want2 || strstr(err, want2), "line %d: '%s' lacks '%s'", line, err, want2);
	CHECK(!strchr(err, '\n'), "line %d: newline", line);
	if (rc == 0) {
		CHECK(s.n_files == 2, "two shards, got %d", s.n_files);
		t = st_set_find(&s, "y", &file);
		CHECK(t && file && strstr(file->path, "s2.safetensors") && t->dtype == K_F32,
		      "y in s2");
		t = st_set_find(&s, "x2", &file);
		CHECK(t && file && strstr(file->path, "s1.safetensors"), "x2 in s1");
	} else {
		CHECK(s.n_files == 0 && !s.files, "line %d: set left half-built", line);
	}
	st_set_close(&s);
}

static void test_sharded(void)
{
	sharded("shard_ok", "{\"metadata\":{\"total_size\":24},\"weight_map\":{"
		"\"x\":\"s1.safetensors\",\"x2\":\"s1.safetensors\",\"y\":\"s2.safetensors\"}}",
		SHARD2, 0, NULL, NULL, __LINE__);
	sharded("shard_dup", "{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s2.safetensors\"}}",
		"{\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
		"\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
		-EINVAL, "tensor 'x' is in both", "s1.safetensors", __LINE__);
	sharded("shard_trav", "{\"weight_map\":{\"x\":\"../s1.safetensors\"}}", SHARD2,
		-EINVAL, "tensor 'x'", "plain file name", __LINE__);
	sharded("shard_dot", "{\"weight_map\":{\"x\":\"..\"}}", SHARD2, -EINVAL,
		"plain file name", NULL, __LINE__);
	sharded("shard_abs", "{\"weight_map\":{\"x\":\"/etc/passwd\"}}", SHARD2, -EINVAL,
		"plain file name", NULL, __LINE__);
	sharded("shard_missing", "{\"weight_map\":{\"x\":\"s1.safetensors\","
		"\"z\":\"s2.safetensors\"}}", SHARD2, -EINVAL, "tensor 'z' is mapped to "
		"'s2.safetensors'", "does not hold it", __LINE__);
	sharded("shard_nofile", "{\"weight_map\":{\"x\":\"s3.safetensors\"}}", SHARD2,
		-ENOENT, "s3.safetensors", NULL, __LINE__);
	sharded("shard_nomap", "{\"metadata\":{}}", SHARD2, -EINVAL, "weight_map", NULL,
		__LINE__);
	sharded("shard_badjson", "{\"weight_map\":", SHARD2, -EINVAL, "index.json", NULL,
		__LINE__);
	sharded("shard_type", "{\"weight_map\":{\"x\":7}}", SHARD2, -EINVAL, "tensor 'x'",
		NULL, __LINE__);
	sharded("shard_badshard", "{\"weight_map\":{\"x\":\"s1.safetensors\","
		"\"y\":\"s2.safetensors\"}}", "{\"y\":{\"dtype\":\"F32\",\"shape\":[9],"
		"\"data_offsets\":[0,36]}}", -EINVAL, "s2.safetensors: tensor 'y'", NULL,
		__LINE__);
}

static void test_real(void)
{
	static const char *names[] = { "llama3", "qwen3", "qwen3_moe", "deepseek_v2",
				       "deepseek_v3" };
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	char dir[1024];
	struct st_set s;
	int rc, ok;

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(dir, sizeof(dir), "%s/tests/data/golden/%s", top, names[i]);
		if (access(dir, F_OK))
			continue;
		rc = st_set_open(&s, dir, err, sizeof(err));
		CHECK(rc == 0 && s.n_files == 1 && s.files[0].n_tensors > 0, "%s: %s", dir, err);
		ok = 1;
		for (int j = 0; !rc && j < s.files[0].n_tensors; j++)
			ok &= s.files[0].tensors[j].dtype_ok;
		CHECK(ok, "%s: every dtype usable", dir);
		st_set_close(&s);
	}
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

int main(void)
{
	snprintf(tmp, sizeof(tmp), "/tmp/kdec_st_XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 1;
	}
	test_good();
	test_bad_headers();
	test_files();
	test_file_load();
	test_sharded();
	test_real();
	if (nftw(tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS))
		fprintf(stderr, "could not remove %s\n", tmp);
	return test_result("test_safetensors");
}
