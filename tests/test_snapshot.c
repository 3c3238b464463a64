/* Snapshots: sessions written by one engine and loaded by a fresh one (a restart)
 * continue with tokens identical to an uninterrupted run and without recomputing
 * their history; a damaged, truncated or extended file, another model's (other
 * weights, other config, other block size) and a missing one are refused with one
 * line and load nothing; a failed write leaves the previous snapshot in place. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* Loads into e (no sessions) and expects want; nothing may be loaded on refusal. */
static void expect_load(struct engine *e, int want, const char *what)
{
	char err[512] = "";
	int loaded = -1, ret = engine_snapshot_load(e, dir, &loaded, NULL, err, sizeof(err));

	CHECK(ret == want, "%s: load returned %d, want %d (%s)", what, ret, want, err);
	if (want) {
		CHECK(e->sessions.n == 0 && e->host.n_blocks == 0 && loaded == 0, "%s: something was loaded", what);
		CHECK(strlen(err) > 0 && !strchr(err, '\n'), "%s: one line of error", what);
	}
	if (want && want != -ENOENT && getenv("VERBOSE"))
		fprintf(stderr, "  %s: %s\n", what, err);
	kv_sessions_fini(&e->sessions, &e->pool, &e->host);
}

static int fail_frame(void *ctx, int s, int b, const void **z, size_t *zbytes)
{
	(void)ctx, (void)s, (void)b, (void)z, (void)zbytes;
	return -EIO;
}

int main(void)
{
	struct engine_opts eo = { .threads = 1, .block_tokens = BT, .kv_tokens = 64 * BT, .max_rows = 32 };
	struct engine_opts eo16 = eo;
	struct model *m = NULL, *m2 = NULL;
	struct engine *e = NULL, *e2 = NULL;
	int32_t ha[96], hb[96], ua[GEN], ub[GEN], got[GEN];
	int vocab, na = 29, nb = 30, loaded = 0, skipped = -1, cached;
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
	CHECK(engine_snapshot_load(e, dir, NULL, NULL, err, sizeof(err)) == -EBUSY && e->sessions.n == 2,
	      "load into an engine with sessions refused");
	CHECK(engine_snapshot_save(e, dir, err, sizeof(err)) == 0, "save: %s", err);
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
	CHECK(engine_snapshot_load(e2, dir, &loaded, &skipped, err, sizeof(err)) == 0, "load: %s", err);
	CHECK(loaded == 2 && skipped == 0 && e2->sessions.n == 2, "2 sessions loaded (%d, %d skipped)", loaded, skipped);
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
		snprintf(path, sizeof(path), "%s/.%s.tmp", dir, KV_SNAP_FILE);
		CHECK(access(path, F_OK) != 0, "temporary file removed");
		snprintf(path, sizeof(path), "%s/%s", dir, KV_SNAP_FILE);
		free(before);
		free(after);
	}
	unlink(path);
	if (!kvt_open("llama", 7, &eo, &m2, &e2)) {
		expect_load(e2, -ENOENT, "no snapshot");
		/* no sessions: an empty snapshot, loaded as such */
		CHECK(engine_snapshot_save(e2, dir, err, sizeof(err)) == 0, "empty save: %s", err);
		CHECK(engine_snapshot_load(e2, dir, &loaded, &skipped, err, sizeof(err)) == 0 && loaded == 0 &&
		      skipped == 0, "empty load: %s", err);
	}
	free(file);
out:
	kvt_close(m, e);
	kvt_close(m2, e2);
	unlink(path);
	rmdir(dir);
	return test_result("test_snapshot");
}
