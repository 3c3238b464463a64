/* Snapshots: sessions written by one engine and loaded by a fresh one (a restart)
 * continue with tokens identical to an uninterrupted run and without recomputing
 * their history; a damaged, truncated or extended file, another model's (other
 * weights, other config, other block size) and a missing one are refused with one
 * line, load nothing and are set aside, never written over; a failed write (a full
 * disk, by RLIMIT_FSIZE) leaves the previous snapshot in place and no temporary file;
 * sessions that did not fit stay on disk and are carried into the next snapshot; the
 * temporary files of killed writers go at the next load. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/testutil.h"
#include "tests/kvtest.h"
#include "kvcache/snapshot.h"

#define BT 8
#define GEN 8

static char dir[64];
static char path[128];

/* A turn on session (name, owner), opened or created: kvt_turn. */
static int turn(struct engine *e, const char *name, uint64_t owner, const int32_t *prompt, int n,
		int n_gen, int32_t *gen)
{
	struct kv_session *sess = NULL;

	CHECK(engine_session_open(e, name, owner, owner, &sess) == 0, "open %s", name);
	return sess ? kvt_turn(e, sess, prompt, n, n_gen, gen, NULL) : -1;
}

static void spit(const uint8_t *b, size_t len)
{
	FILE *f = fopen(path, "wb");

	fwrite(b, 1, len, f);
	fclose(f);
}

/* Loads into e (no sessions) and expects want; nothing may be loaded on refusal, and a
 * refused file is set aside unchanged (then put back here). */
static void expect_load(struct engine *e, int want, const char *what)
{
	struct engine_snap_load r;
	char err[512] = "";
	size_t len = 0, len2 = 0;
	uint8_t *before = test_slurp(path, &len), *after;
	int ret = engine_snapshot_load(e, dir, &r, err, sizeof(err));

	CHECK(ret == want, "%s: load returned %d, want %d (%s)", what, ret, want, err);
	if (want) {
		CHECK(e->sessions.n == 0 && e->host.n_blocks == 0 && r.loaded == 0, "%s: something was loaded", what);
		CHECK(strlen(err) > 0 && !strchr(err, '\n'), "%s: one line of error", what);
	}
	if (want == -EBADMSG || want == -ESTALE) {
		after = r.set_aside[0] ? test_slurp(r.set_aside, &len2) : NULL;
		CHECK(access(path, F_OK) != 0 && !r.held, "%s: the refused file is not set aside", what);
		CHECK(after && len2 == len && !memcmp(before, after, len), "%s: %s differs from the refused file",
		      what, r.set_aside);
		unlink(r.set_aside);
		free(after);
		if (before)
			spit(before, len);	/* for the next engine to refuse */
	}
	if (want && want != -ENOENT && getenv("VERBOSE"))
		fprintf(stderr, "  %s: %s\n", what, err);
	free(before);
	kv_sessions_fini(&e->sessions, &e->pool, &e->host);
}

static int fail_frame(void *ctx, int s, int b, const void **z, size_t *zbytes)
{
	(void)ctx, (void)s, (void)b, (void)z, (void)zbytes;
	return -EIO;
}

/* Sessions that do not fit (here: no host tier at all) stay on disk: closed there,
 * replaced by a new session of their name, or written again, unchanged, by the next
 * save; a daemon that has room then loads them and continues as if never stopped. */
static void kept_on_disk(const struct engine_opts *eo, const uint8_t *file, size_t len, const int32_t *ua,
			 const int32_t *ha, int na)
{
	struct engine_opts small = *eo;
	struct model *m = NULL;
	struct engine *e = NULL;
	struct engine_snap_load r;
	struct kv_session *s;
	int32_t hb[16], got[GEN];
	char err[512] = "";
	int cached;

	spit(file, len);
	small.host_kv_bytes = -1;
	if (kvt_open("llama", 7, &small, &m, &e))
		return;
	CHECK(engine_snapshot_load(e, dir, &r, err, sizeof(err)) == 0, "no host tier: load: %s", err);
	CHECK(r.loaded == 0 && r.kept == 2 && r.kept_no_host == 2 && r.kept_zbytes > 0 && e->sessions.n == 0,
	      "no host tier: %d loaded, %d kept, want 0 and 2", r.loaded, r.kept);
	CHECK(engine_session_close(e, "beta", 2) == 0 && engine_session_close(e, "beta", 2) == -ENOENT,
	      "a session left on disk is closed there, once");
	CHECK(engine_session_close(e, "a/b", 2) == -EINVAL, "close of a name with '/' is -EINVAL");
	kvt_fill(hb, 10, 9, m->cfg.vocab_size);
	turn(e, "beta", 2, hb, 10, 3, hb + 10);	/* a new beta: KV of 12 tokens */
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 2, "save with alpha carried: %s", err);
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 2, "a second save carries alpha again: %s", err);
	kvt_close(m, e);
	m = NULL;
	e = NULL;
	if (kvt_open("llama", 7, eo, &m, &e))
		return;
	CHECK(engine_snapshot_load(e, dir, &r, err, sizeof(err)) == 0 && r.loaded == 2 && r.kept == 0,
	      "carried alpha and the new beta load: %s (%d loaded)", err, r.loaded);
	s = engine_session_find(e, "beta", 2);
	CHECK(s && s->n_tokens == 12, "beta is the new one (%d tokens)", s ? s->n_tokens : -1);
	cached = turn(e, "alpha", 1, ha, na + 5, GEN, got);
	CHECK(cached == na - 1, "carried alpha reuses %d tokens, want %d", cached, na - 1);
	CHECK(!memcmp(got, ua, sizeof(got)), "carried alpha generates other tokens");
	kvt_check_invariants(e, NULL, 0);
	kvt_close(m, e);
	spit(file, len);
}

/* Temporary files in dir. */
static int n_temps(void)
{
	DIR *d = opendir(dir);
	struct dirent *de;
	int n = 0;

	while (d && (de = readdir(d)))
		n += strstr(de->d_name, ".tmp") != NULL;
	if (d)
		closedir(d);
	return n;
}

/* The disk fills during the save (RLIMIT_FSIZE: the write fails with EFBIG as on a
 * full disk, root or not): an error, the old snapshot as it was, no temporary file. */
static void disk_full(const struct engine_opts *eo)
{
	struct rlimit old, lim;
	struct model *m = NULL;
	struct engine *e = NULL;
	size_t len = 0, len2 = 0;
	uint8_t *before = test_slurp(path, &len), *after;
	int32_t h[64];
	char err[512] = "";
	int ret;

	if (!before || kvt_open("llama", 7, eo, &m, &e))
		goto out;
	kvt_fill(h, 60, 11, m->cfg.vocab_size);
	turn(e, "long", 5, h, 60, 2, h + 60);
	getrlimit(RLIMIT_FSIZE, &old);
	lim = old;
	lim.rlim_cur = 2048;
	signal(SIGXFSZ, SIG_IGN);
	CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0, "setrlimit: %s", strerror(errno));
	ret = engine_snapshot_save(e, dir, err, sizeof(err));
	setrlimit(RLIMIT_FSIZE, &old);
	signal(SIGXFSZ, SIG_DFL);
	CHECK(ret == -EFBIG && strstr(err, "write failed"), "full disk: save returned %d (%s)", ret, err);
	CHECK(engine_snapshot_status(e) == ret, "the status says the save failed");
	after = test_slurp(path, &len2);
	CHECK(after && len2 == len && !memcmp(before, after, len), "full disk: the old snapshot changed");
	CHECK(n_temps() == 0, "full disk: a temporary file is left");
	free(after);
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 1 && engine_snapshot_status(e) == 1,
	      "room again: save: %s", err);
	spit(before, len);
out:
	free(before);
	kvt_close(m, e);
}

static void touch(const char *name)
{
	char p[256];
	FILE *f;

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	f = fopen(p, "w");
	if (f)
		fclose(f);
}

/* A writer killed mid-snapshot leaves its temporary file: the next load removes those
 * of writers that are gone (our own pid's too: not writing yet), not a live one's. */
static void stale_temps(const struct engine_opts *eo)
{
	struct engine_snap_load r;
	struct model *m = NULL;
	struct engine *e = NULL;
	char name[64], err[512] = "";

	snprintf(name, sizeof(name), ".%s.%ld.tmp", KV_SNAP_FILE, (long)getpid());
	touch(name);
	touch("." KV_SNAP_FILE ".tmp");
	touch("." KV_SNAP_FILE ".2147483646.tmp");
	touch("." KV_SNAP_FILE ".1.tmp");	/* pid 1 lives */
	touch("other.tmp");
	if (kvt_open("llama", 7, eo, &m, &e))
		return;
	CHECK(engine_snapshot_load(e, dir, &r, err, sizeof(err)) == 0 && r.stale_temps == 3,
	      "%d stale temporary files removed, want 3 (%s)", r.stale_temps, err);
	CHECK(n_temps() == 2, "%d temporary files left, want 2 (pid 1's and other.tmp)", n_temps());
	snprintf(name, sizeof(name), "%s/.%s.1.tmp", dir, KV_SNAP_FILE);
	unlink(name);
	snprintf(name, sizeof(name), "%s/other.tmp", dir);
	unlink(name);
	kvt_close(m, e);
}

/* A snapshot path that can be neither loaded nor set aside (a directory: no hard
 * link) is held: saves refuse to replace it until it is gone. */
static void held(const struct engine_opts *eo)
{
	struct engine_snap_load r;
	struct model *m = NULL;
	struct engine *e = NULL;
	char err[512] = "";
	size_t len = 0;
	uint8_t *keep = test_slurp(path, &len);

	unlink(path);
	mkdir(path, 0700);
	if (!keep || kvt_open("llama", 7, eo, &m, &e))
		goto out;
	CHECK(engine_snapshot_load(e, dir, &r, err, sizeof(err)) < 0 && r.held, "a directory: held (%s)", err);
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == -EEXIST && strstr(err, "not writing over"),
	      "save over a held file refused: %s", err);
	rmdir(path);
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 0, "the held file gone: save: %s", err);
out:
	kvt_close(m, e);
	if (keep)
		spit(keep, len);
	free(keep);
}

int main(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 64 * BT, .max_rows = 32 };
	struct engine_opts eo16 = eo;
	struct model *m = NULL, *m2 = NULL;
	struct engine *e = NULL, *e2 = NULL;
	int32_t ha[96], hb[96], ua[GEN], ub[GEN], got[GEN];
	int vocab, na = 29, nb = 30, cached;
	struct engine_snap_load r;
	char err[512] = "";
	uint8_t *file;
	size_t len;

	strcpy(dir, "/tmp/kdec-snap-XXXXXX");
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
	if (kvt_open("llama", 7, &eo, &m, &e))
		goto out;
	vocab = m->cfg.vocab_size;

	/* two sessions, one left on the device, one offloaded */
	kvt_fill(ha, na, 1, vocab);
	kvt_fill(hb, nb, 2, vocab);
	turn(e, "alpha", 1, ha, na, 6, ha + na);
	turn(e, "beta", 2, hb, nb, 3, hb + nb);
	CHECK(engine_session_offload(e, engine_session_find(e, "beta", 2)) == 0, "offload beta");
	CHECK(engine_snapshot_load(e, dir, NULL, err, sizeof(err)) == -EBUSY && e->sessions.n == 2,
	      "load into an engine with sessions refused");
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 2, "save: %s", err);
	CHECK(access(path, R_OK) == 0, "snapshot file exists");

	/* the uninterrupted run: both sessions continue in the same engine */
	na += 6;
	nb += 3;
	kvt_fill(ha + na, 5, 3, vocab);
	kvt_fill(hb + nb, 4, 4, vocab);
	turn(e, "alpha", 1, ha, na + 5, GEN, ua);
	turn(e, "beta", 2, hb, nb + 4, GEN, ub);

	/* restart: a new engine on the same model loads and continues identically,
	 * reusing the whole history */
	if (kvt_open("llama", 7, &eo, &m2, &e2))
		goto out;
	CHECK(engine_snapshot_load(e2, dir, &r, err, sizeof(err)) == 0, "load: %s", err);
	CHECK(r.loaded == 2 && r.kept == 0 && e2->sessions.n == 2, "2 sessions loaded (%d, %d kept)", r.loaded, r.kept);
	CHECK(kv_session_blocks_on_host(engine_session_find(e2, "alpha", 1)) == 5, "alpha's 5 blocks on host");
	kvt_check_invariants(e2, NULL, 0);
	cached = turn(e2, "alpha", 1, ha, na + 5, GEN, got);
	CHECK(cached == na - 1, "alpha after restart reuses %d tokens, want %d", cached, na - 1);
	CHECK(!memcmp(got, ua, sizeof(got)), "alpha after restart generates other tokens");
	cached = turn(e2, "beta", 2, hb, nb + 4, GEN, got);
	CHECK(cached == nb - 1, "beta after restart reuses %d tokens, want %d", cached, nb - 1);
	CHECK(!memcmp(got, ub, sizeof(got)), "beta after restart generates other tokens");
	kvt_check_invariants(e2, NULL, 0);
	kvt_close(m2, e2);
	e2 = NULL;
	m2 = NULL;

	/* damage: every refused, nothing loaded */
	file = test_slurp(path, &len);
	if (!file || kvt_open("llama", 7, &eo, &m2, &e2))
		goto out;
	{
		const size_t at[] = { 0, 9, 20, 33, 60, 81, 100, 123, 130, 150, len / 2, len - 40, len - 1 };

		for (size_t i = 0; i < sizeof(at) / sizeof(at[0]); i++) {
			char what[64];

			file[at[i]] ^= 0x10;
			spit(file, len);
			snprintf(what, sizeof(what), "bit flip at byte %zu of %zu", at[i], len);
			expect_load(e2, -EBADMSG, what);
			file[at[i]] ^= 0x10;
		}
		for (size_t cut = 0; cut < len; cut += len / 9 + 1) {
			char what[64];

			spit(file, cut);
			snprintf(what, sizeof(what), "truncated to %zu of %zu bytes", cut, len);
			expect_load(e2, -EBADMSG, what);
		}
		spit(file, len - 1);
		expect_load(e2, -EBADMSG, "one byte short");
		file[len] = 0;
		spit(file, len + 1);
		expect_load(e2, -EBADMSG, "one byte extra");
		spit(file, len);
		expect_load(e2, 0, "intact again");
	}
	kvt_close(m2, e2);
	e2 = NULL;
	m2 = NULL;

	/* other weights, other block size, other architecture: refused as stale */
	if (!kvt_open("llama", 8, &eo, &m2, &e2))
		expect_load(e2, -ESTALE, "other weights (seed 8)");
	kvt_close(m2, e2);
	eo16.block_tokens = 16;
	if (!kvt_open("llama", 7, &eo16, &m2, &e2))
		expect_load(e2, -ESTALE, "other block size");
	kvt_close(m2, e2);
	if (!kvt_open("qwen3", 7, &eo, &m2, &e2))
		expect_load(e2, -ESTALE, "other model");
	kvt_close(m2, e2);
	e2 = NULL;
	m2 = NULL;

	/* a write that fails half-way leaves the previous snapshot as it was */
	{
		struct kv_snap_meta meta = { .block_tokens = BT, .elem_bytes = 4, .block_bytes = 1, .flags = 1 };
		struct kv_snap_session rec = { .name = "x", .tokens = ha, .n_tokens = 9 };
		uint8_t *before = test_slurp(path, &len), *after;
		size_t len2 = 0;

		CHECK(kv_snap_write(dir, &meta, &rec, 1, fail_frame, NULL, err, sizeof(err)) == -EIO,
		      "failing write reports the error");
		after = test_slurp(path, &len2);
		CHECK(after && len2 == len && !memcmp(before, after, len), "previous snapshot untouched");
		snprintf(path, sizeof(path), "%s/.%s.%ld.tmp", dir, KV_SNAP_FILE, (long)getpid());
		CHECK(access(path, F_OK) != 0, "temporary file removed");
		snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
		free(before);
		free(after);
	}
	kept_on_disk(&eo, file, len, ua, ha, na);
	disk_full(&eo);
	stale_temps(&eo);
	held(&eo);
	unlink(path);
	if (!kvt_open("llama", 7, &eo, &m2, &e2)) {
		expect_load(e2, -ENOENT, "no snapshot");
		/* no sessions: an empty snapshot, loaded as such */
		CHECK(engine_snapshot_save(e2, dir, err, sizeof(err)) == 0, "empty save: %s", err);
		CHECK(engine_snapshot_load(e2, dir, &r, err, sizeof(err)) == 0 && r.loaded == 0 &&
		      r.kept == 0, "empty load: %s", err);
	}
	free(file);
out:
	kvt_close(m, e);
	kvt_close(m2, e2);
	unlink(path);
	rmdir(dir);
	return test_result("test_snapshot");
}
