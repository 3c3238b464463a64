/* Host-tier moves off the engine thread (engine_mover.c, engine_host.c), on a tiny
 * synthetic model with a codec made slow on purpose (engine.host_delay_us):
 *  - a decoding stream keeps stepping while a large session is offloaded (engine_tick)
 *    and restored (engine_session_restore_start): no step waits for the codec, the KV
 *    comes back bit for bit, the stream's logits equal a cold run's;
 *  - cancellation: a turn arriving mid-offload, a close during an offload and during a
 *    restore, the engine destroyed with a move in flight; every invariant (the moves'
 *    own references counted) after each step.
 * KDEC_TEST_BACKEND=cuda runs it on the GPU (the side copies beside graph replays;
 * logits then within a tolerance, KV still bit for bit); exits 77 without a GPU. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/testutil.h"
#include "tests/kvtest.h"

#define BT 16
#define CUDA_ROW_TOL 2e-2	/* a decode row against a prefill row: other kernels */
#define BIG_BLOCKS 40			/* the large session */
#define DELAY_US 40000			/* per block: the slowed codec, 1.6 s a move */
#define SLOW_S (BIG_BLOCKS * DELAY_US * 1e-6)

static uint64_t fake_now;
static const char *backend = "cpu";

/* Logits of the same tokens: bit for bit on the CPU (batch- and order-invariant). */
static int same_logits(const float *a, const float *b, int vocab)
{
	if (!strcmp(backend, "cpu"))
		return test_same_floats(a, b, (size_t)vocab);
	return test_rel_l2(a, b, (size_t)vocab) <= CUDA_ROW_TOL;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

static uint64_t fake_clock(void)
{
	return fake_now;
}

struct stream {
	struct engine_seq s;
	int32_t tok[256];
	float *l;
	int steps;
	double max_gap;		/* longest loop iteration, s */
};

/* One iteration of an engine loop: commit finished moves, one decode step. */
static void loop_once(struct engine *e, struct stream *d)
{
	double t0 = test_now_s(), gap;
	int32_t next = (int32_t)test_argmax(d->l, e->model->cfg.vocab_size);

	engine_host_poll(e);
	if (d->s.n_tokens >= 200) {	/* a new request in its place: the cache stays small */
		engine_seq_release(e, &d->s);
		kvt_step(e, &d->s, d->tok, 20, d->l);
		next = (int32_t)test_argmax(d->l, e->model->cfg.vocab_size);
	}
	d->tok[d->s.n_tokens] = next;
	kvt_step(e, &d->s, &next, 1, d->l);
	d->steps++;
	gap = test_now_s() - t0;
	if (gap > d->max_gap)
		d->max_gap = gap;
}

static struct engine *open_engine(struct model **m, int kv_blocks)
{
	struct engine_opts eo0 = { .backend = backend, .threads = 1, .block_tokens = BT,
				   .kv_tokens = kv_blocks * BT, .max_rows = 64, .offload_after_s = 5,
				   .session_ttl_s = 1000 };
	struct engine_opts eo = kvt_opts(&eo0);
	struct model_load_opts lo = { .synthetic = 1, .seed = 11 };
	struct engine *e;
	char path[1024], err[512] = "";
	int ret;

	*m = NULL;
	kvt_tiny_path("llama", path, sizeof(path));
	ret = model_load(m, path, &lo, err, sizeof(err));
	kvt_tiny_done(path);
	CHECK(ret == 0, "%s: %s", path, err);
	if (ret)
		return NULL;
	ret = engine_create(&e, *m, &eo, err, sizeof(err));
	if (ret && strcmp(backend, "cpu") && (ret == -ENODEV || ret == -ENOENT)) {
		fprintf(stderr, "test_host_mover: SKIP: %s\n", err);
		model_destroy(*m);
		exit(77);
	}
	CHECK(ret == 0, "engine: %s", err);
	if (ret)
		return NULL;
	e->clock_ns = fake_clock;
	fake_now = 1000000000ull;
	return e;
}

/* A session of BIG_BLOCKS blocks (the last one partial), saved and idle. */
static struct kv_session *big_session(struct engine *e, const char *name, int32_t *hist, int *n)
{
	struct kv_session *sess;
	int32_t gen[2];

	CHECK(engine_session_open(e, name, 1, 1, &sess) == 0, "open %s", name);
	*n = BIG_BLOCKS * BT - 4;
	kvt_fill(hist, *n, 3, e->model->cfg.vocab_size);
	kvt_turn(e, sess, hist, *n, 2, gen, NULL);
	hist[*n] = gen[0];
	*n = sess->n_tokens;
	CHECK(sess->n_blocks == BIG_BLOCKS, "big session: %d blocks", sess->n_blocks);
	return sess;
}

static void stream_start(struct engine *e, struct stream *d)
{
	int vocab = e->model->cfg.vocab_size;

	memset(d, 0, sizeof(*d));
	d->l = malloc((size_t)vocab * sizeof(float));
	engine_seq_init(&d->s);
	kvt_fill(d->tok, 20, 9, vocab);
	kvt_step(e, &d->s, d->tok, 20, d->l);
}

/* The stream's last logits against a cold run of its tokens. */
static void stream_check(struct engine *e, struct stream *d, const char *what)
{
	int vocab = e->model->cfg.vocab_size;
	float *ref = malloc((size_t)vocab * sizeof(float));

	kvt_cold(e, d->tok, d->s.n_tokens, ref);
	CHECK(same_logits(d->l, ref, vocab), "%s: the stream's logits differ from cold", what);
	free(ref);
}

static void stream_end(struct engine *e, struct stream *d)
{
	engine_seq_release(e, &d->s);
	free(d->l);
}

static void test_steps_go_on(void)
{
	struct model *m;
	struct engine *e = open_engine(&m, 128);
	struct kv_session *sess;
	struct stream d;
	int32_t hist[BIG_BLOCKS * BT + 8];
	uint8_t *before, *after;
	double t0, tick_s, offload_s, restore_s;
	uint64_t restored;
	int n, steps;

	if (!e)
		goto out;
	sess = big_session(e, "big", hist, &n);
	stream_start(e, &d);
	before = kvt_session_kv(e, sess);
	e->host_delay_us = DELAY_US;
	/* one worker: a move then takes the codec's whole slow-down, whatever the CPUs
	 * (with several, the blocks are shared and it takes a fraction: 0.8 s of 1.6 on
	 * the 16-CPU GPU machine) */
	e->host_workers = 1;

	/* idle past offload_after: engine_tick starts the offload and returns */
	fake_now += 6000000000ull;
	t0 = test_now_s();
	engine_tick(e);
	tick_s = test_now_s() - t0;
	CHECK(sess->job && !engine_session_restoring(sess), "the tick's offload is in flight");
	while (sess->job)
		loop_once(e, &d);
	offload_s = test_now_s() - t0;
	CHECK(kv_session_blocks_on_device(sess) == 0 && kv_session_blocks_on_host(sess) == BIG_BLOCKS,
	      "offloaded: %d on device, %d on host", kv_session_blocks_on_device(sess),
	      kv_session_blocks_on_host(sess));
	fprintf(stderr, "  offload of %d blocks: %.3f s (codec slowed to %.2f s), tick %.4f s, %d steps beside it, "
		"longest loop iteration %.4f s\n", BIG_BLOCKS, offload_s, SLOW_S, tick_s, d.steps, d.max_gap);
	/* the bounds are against the slow-down, not wall-clock tight: a synchronous move
	 * takes SLOW_S in one iteration */
	CHECK(offload_s >= SLOW_S * 0.9, "the offload ran on the slowed codec (%.3f s)", offload_s);
	CHECK(tick_s < SLOW_S / 2 && d.max_gap < SLOW_S / 2,
	      "a step waited for the offload: tick %.3f s, iteration %.3f s", tick_s, d.max_gap);
	CHECK(d.steps >= 4, "the stream stepped %d times during the offload", d.steps);
	kvt_check_invariants(e, (struct engine_seq *[]){ &d.s }, 1);

	/* the device copies dropped: the restore decodes every block, on the mover */
	engine_cache_drop(e);
	restored = e->stats.restored_blocks;
	steps = d.steps;
	d.max_gap = 0;
	t0 = test_now_s();
	CHECK(engine_session_restore_start(e, sess) == 1, "a restore starts");
	while (engine_session_restore_start(e, sess))
		loop_once(e, &d);
	restore_s = test_now_s() - t0;
	fprintf(stderr, "  restore of %d blocks: %.3f s, %d steps beside it, longest loop iteration %.4f s\n",
		BIG_BLOCKS, restore_s, d.steps - steps, d.max_gap);
	CHECK(restore_s >= SLOW_S * 0.9 && d.max_gap < SLOW_S / 2 && d.steps - steps >= 4,
	      "a step waited for the restore: iteration %.3f s of %.3f s, %d steps", d.max_gap, restore_s,
	      d.steps - steps);
	CHECK(e->stats.restored_blocks - restored == BIG_BLOCKS, "every block decoded (%llu)",
	      (unsigned long long)(e->stats.restored_blocks - restored));
	CHECK(kv_session_blocks_on_device(sess) == BIG_BLOCKS && kv_session_blocks_on_host(sess) == 0,
	      "restored: all on the device, the host copies gone");
	after = kvt_session_kv(e, sess);
	CHECK(!memcmp(before, after, e->block_bytes * BIG_BLOCKS), "restored KV differs");
	kvt_check_invariants(e, (struct engine_seq *[]){ &d.s }, 1);
	stream_check(e, &d, "offload and restore");

	/* the turn finds everything on the device: no restore of its own */
	{
		int vocab = m->cfg.vocab_size, cached;
		int32_t gen[1];
		float *l = malloc((size_t)vocab * sizeof(float)), *ref = malloc((size_t)vocab * sizeof(float));

		kvt_fill(hist + n, 5, 4, vocab);
		restored = e->stats.restored_blocks;
		cached = kvt_turn(e, sess, hist, n + 5, 1, gen, l);
		CHECK(cached == n && e->stats.restored_blocks == restored, "turn: %d reused of %d, %llu restored",
		      cached, n, (unsigned long long)(e->stats.restored_blocks - restored));
		kvt_cold(e, hist, n + 5, ref);
		CHECK(same_logits(l, ref, vocab), "turn after the restore: logits differ");
		free(l);
		free(ref);
	}
	kvt_check_invariants(e, (struct engine_seq *[]){ &d.s }, 1);

	/* the real codec (no delay): what the engine thread pays, start and commit,
	 * against the move itself (printed, not checked) */
	{
		double t_start, t_commit = 0, t1;

		e->host_delay_us = 0;
		t0 = test_now_s();
		CHECK(engine_session_offload_start(e, sess, 0) == 0, "offload");
		t_start = test_now_s() - t0;
		while (sess->job) {
			engine_mover_wait(e->mover);
			t1 = test_now_s();
			engine_host_poll(e);
			t_commit += test_now_s() - t1;
		}
		fprintf(stderr, "  real codec, %d blocks (%.2f MiB): offload on the mover %.2f ms, engine thread "
			"%.3f ms to start + %.3f ms to commit\n", sess->n_blocks,
			(double)e->block_bytes * sess->n_blocks / (1 << 20), (test_now_s() - t0) * 1e3,
			t_start * 1e3, t_commit * 1e3);
		engine_cache_drop(e);
		t_commit = 0;
		t0 = test_now_s();
		CHECK(engine_session_restore_start(e, sess) == 1, "restore");
		t_start = test_now_s() - t0;
		while (sess->job) {
			engine_mover_wait(e->mover);
			t1 = test_now_s();
			engine_host_poll(e);
			t_commit += test_now_s() - t1;
		}
		fprintf(stderr, "  real codec: restore on the mover %.2f ms, engine thread %.3f ms to start + "
			"%.3f ms to commit\n", (test_now_s() - t0) * 1e3, t_start * 1e3, t_commit * 1e3);
		CHECK(kv_session_blocks_on_device(sess) == sess->n_blocks, "restored");
	}
	stream_end(e, &d);
	free(before);
	free(after);
out:
	kvt_close(m, e);
}

/* Polls until no move is in flight, checking the invariants with live seqs. */
static void drain(struct engine *e, struct engine_seq *const *live, int n_live)
{
	while (e->host_jobs) {
		engine_host_poll(e);
		kvt_check_invariants(e, live, n_live);
		sleep_ms(2);
	}
}

static void test_cancel(void)
{
	struct model *m;
	struct engine *e = open_engine(&m, 128);
	struct kv_session *sess;
	int32_t hist[BIG_BLOCKS * BT + 8];
	int vocab, n;

	if (!e)
		goto out;
	vocab = m->cfg.vocab_size;
	e->host_delay_us = DELAY_US;
	e->host_workers = 3;	/* a pool: blocks of one move claimed by several workers */

	/* a turn arriving mid-offload: the offload is cancelled, the session is whole
	 * on the device and the turn computes only what it adds (and perhaps the last
	 * partial block, which the cancelled move may still hold) */
	sess = big_session(e, "t", hist, &n);
	CHECK(engine_session_offload_start(e, sess, 0) == 0 && sess->job, "offload started");
	sleep_ms(50);
	{
		float *l = malloc((size_t)vocab * sizeof(float)), *ref = malloc((size_t)vocab * sizeof(float));
		uint64_t offloaded = e->stats.offloaded_blocks;
		int32_t gen[1];
		double t0 = test_now_s();
		int cached;

		kvt_fill(hist + n, 5, 5, vocab);
		cached = kvt_turn(e, sess, hist, n + 5, 1, gen, l);
		CHECK(test_now_s() - t0 < SLOW_S / 2, "the turn waited for the offload (%.3f s)", test_now_s() - t0);
		CHECK(cached >= n / BT * BT && cached <= n, "turn mid-offload reused %d of %d", cached, n);
		kvt_cold(e, hist, n + 5, ref);
		CHECK(same_logits(l, ref, vocab), "turn mid-offload: logits differ from cold");
		kvt_check_invariants(e, NULL, 0);
		drain(e, NULL, 0);
		CHECK(e->stats.offloaded_blocks == offloaded && kv_session_blocks_on_host(sess) == 0 &&
		      kv_session_blocks_on_device(sess) == sess->n_blocks, "the cancelled offload left nothing");
		free(l);
		free(ref);
	}
	kvt_check_invariants(e, NULL, 0);

	/* closed during its offload: the blocks the move reads stay held until it ends,
	 * and nothing else gets them meanwhile */
	CHECK(engine_session_offload_start(e, sess, 0) == 0 && sess->job, "offload started");
	sleep_ms(30);
	CHECK(engine_session_close(e, "t", 1) == 0, "close during the offload");
	{
		struct engine_seq hog;
		float *l = malloc((size_t)vocab * sizeof(float));
		int avail = kv_pool_available(&e->pool);

		CHECK(e->host_jobs && avail < e->pool.n_blocks, "the move still holds its blocks (%d available)", avail);
		kvt_check_invariants(e, NULL, 0);
		/* every block that is not the move's, filled meanwhile */
		int32_t *fill = malloc((size_t)avail * BT * sizeof(int32_t));

		engine_seq_init(&hog);
		kvt_fill(fill, avail * BT, 6, vocab);
		kvt_step(e, &hog, fill, avail * BT, l);
		free(fill);
		kvt_check_invariants(e, (struct engine_seq *[]){ &hog }, 1);
		drain(e, (struct engine_seq *[]){ &hog }, 1);
		engine_seq_release(e, &hog);
		free(l);
	}
	CHECK(e->host.n_blocks == 0 && e->host.used == 0, "nothing of the closed session in the host tier");
	kvt_check_invariants(e, NULL, 0);

	/* closed during its restore */
	sess = big_session(e, "r", hist, &n);
	e->host_delay_us = 0;
	CHECK(engine_session_offload(e, sess) == 0, "offload (waited for)");
	e->host_delay_us = DELAY_US;
	engine_cache_drop(e);
	CHECK(engine_session_restore_start(e, sess) == 1, "restore started");
	sleep_ms(30);
	kvt_check_invariants(e, NULL, 0);
	CHECK(engine_session_close(e, "r", 1) == 0, "close during the restore");
	kvt_check_invariants(e, NULL, 0);
	drain(e, NULL, 0);
	CHECK(e->host.n_blocks == 0 && kv_pool_available(&e->pool) == e->pool.n_blocks,
	      "the cancelled restore gave everything back");

	/* a turn arriving mid-restore waits for it and uses it */
	sess = big_session(e, "w", hist, &n);
	e->host_delay_us = 0;
	CHECK(engine_session_offload(e, sess) == 0, "offload (waited for)");
	e->host_delay_us = DELAY_US;
	engine_cache_drop(e);
	CHECK(engine_session_restore_start(e, sess) == 1, "restore started");
	{
		int32_t gen[1];
		uint64_t restored = e->stats.restored_blocks;

		kvt_fill(hist + n, 5, 7, vocab);
		CHECK(kvt_turn(e, sess, hist, n + 5, 1, gen, NULL) == n, "the turn used the restore");
		CHECK(e->stats.restored_blocks - restored == BIG_BLOCKS, "restored once");
	}
	kvt_check_invariants(e, NULL, 0);

	/* destroyed with a move in flight (ASan: nothing leaked, nothing used after free) */
	CHECK(engine_session_offload_start(e, sess, 0) == 0 && sess->job, "offload started");
out:
	kvt_close(m, e);
}

int main(void)
{
	if (getenv("KDEC_TEST_BACKEND"))
		backend = getenv("KDEC_TEST_BACKEND");
	test_steps_go_on();
	test_cancel();
	return test_result("test_host_mover");
}
