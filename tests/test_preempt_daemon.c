/* Preemption through a real kdecd on the tiny Llama 3 checkpoint with a KV cache of
 * 256 tokens (16 blocks of 16), far less than the requests sent together need:
 * - every request finishes with the tokens it gets alone without speculation
 *   (greedy and sampled with speculation, seeded sampled, with penalties, two of
 *   them session turns), kd_preemptions_total moves, and
 *   afterwards no request runs and no block is referenced;
 * - priorities: background requests (-1) running before interactive ones (5)
 *   arrive are the only ones preempted (the daemon's debug log names each);
 * - cancelling everything while preempted requests wait frees every block. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

#define KV_TOKENS "256"
#define MAX_GEN 48
#define N_REQ 8
#define N_CONN 4	/* one client may hold at most the cache's 256 tokens in flight */
#define PROMPT 24

static struct daemontest kdecd;
static char log_path[300];	/* the daemon's log: it names each preemption */

struct req {
	int32_t prompt[PROMPT];
	int max_tokens, priority;
	uint32_t flags;
	struct kd_sampling sp;
	uint64_t id;
	int32_t got[MAX_GEN], want[MAX_GEN];
	int n_got, n_want, done, stop;
	int later;	/* submitted once each other request has a token */
	const char *session;	/* NULL or a session name */
};

static long long preemptions(void)
{
	/* its line, not its # HELP line */
	return daemontest_number(&kdecd, "metrics", "\nkd_preemptions_total");
}

static int submit(struct kd_client *c, struct req *q)
{
	struct kd_request r = { .prompt = q->prompt, .n_prompt = PROMPT,
				.max_tokens = (uint32_t)q->max_tokens, .sampling = q->sp,
				.priority = q->priority, .flags = q->flags, .session = q->session };

	q->n_got = q->done = q->stop = 0;
	return kd_submit(c, &r, &q->id);
}

/* Whether every request but the later ones has a token (or has ended). */
static int started(const struct req *q, int n)
{
	for (int i = 0; i < n; i++)
		if (!q[i].later && !q[i].n_got && !q[i].done)
			return 0;
	return 1;
}

/* Submits q[0..n) over N_CONN connections (request i on i % N_CONN; the later ones
 * once the others have started) and collects them. cancel_after > 0: once
 * kd_preemptions_total reaches it while a request waits, cancels them all. */
static int run(struct req *q, int n, long long cancel_after)
{
	struct kd_client *c[N_CONN] = { 0 };
	struct kd_event ev[64];
	int left = n, ret = 0, cancelled = 0, later = 0;
	time_t t0 = time(NULL);

	for (int k = 0; k < N_CONN && !ret; k++)
		ret = kd_connect(&c[k], &(struct kd_connect_opts){ .socket_path = kdecd.sock });
	for (int i = 0; i < n && !ret; i++) {
		later += q[i].later;
		if (!q[i].later)
			ret = submit(c[i % N_CONN], &q[i]);
	}
	while (!ret && left > 0) {
		int any = 0;

		if (later && started(q, n)) {
			for (int i = 0; i < n && !ret; i++)
				if (q[i].later)
					ret = submit(c[i % N_CONN], &q[i]);
			later = 0;
		}

		if (time(NULL) - t0 > 40) {
			ret = -ETIMEDOUT;
			break;
		}
		if (cancel_after > 0 && !cancelled && preemptions() >= cancel_after &&
		    daemontest_number(&kdecd, "--json status", "requests_waiting") > 0) {
			for (int i = 0; i < n; i++)
				kd_cancel(c[i % N_CONN], q[i].id);
			cancelled = 1;
		}
		for (int k = 0; k < N_CONN && !ret; k++) {
			int m = kd_poll(c[k], ev, 64);

			if (m < 0) {
				ret = m;
				break;
			}
			any += m;
			for (int e = 0; e < m; e++) {
				for (int i = k; i < n; i += N_CONN) {
					if (ev[e].id != q[i].id)
						continue;
					if (ev[e].token >= 0 && q[i].n_got < MAX_GEN)
						q[i].got[q[i].n_got++] = ev[e].token;
					if (ev[e].flags & KD_EVENT_FINAL) {
						q[i].done = 1;
						q[i].stop = (int)ev[e].stop;
						left--;
					}
				}
			}
		}
		if (!any)
			usleep(500);
	}
	for (int k = 0; k < N_CONN; k++)
		if (c[k])
			kd_close(c[k]);
	return ret;
}

/* Each request alone: its reference tokens (no preemption can happen). */
static void references(struct req *q, int n)
{
	for (int i = 0; i < n; i++) {
		struct req one = q[i];

		one.later = 0;
		if (one.flags & KD_REQUEST_SPEC)
			one.flags = KD_REQUEST_NO_SPEC;	/* plain decoding is the reference */
		CHECK(run(&one, 1, 0) == 0 && one.done, "request %d alone", i);
		memcpy(q[i].want, one.got, sizeof(one.got));
		q[i].n_want = one.n_got;
	}
}

static void check_same(const struct req *q, int n, const char *what)
{
	for (int i = 0; i < n; i++)
		CHECK(q[i].done && q[i].n_got == q[i].n_want &&
		      !memcmp(q[i].got, q[i].want, (size_t)q[i].n_got * sizeof(int32_t)),
		      "%s: request %d (priority %d, temperature %.1f, flags %u): %d tokens, %d alone, differ",
		      what, i, q[i].priority, q[i].sp.temperature, q[i].flags, q[i].n_got, q[i].n_want);
}

static void check_idle(const char *what)
{
	long long run = -1, wait = -1, used = -1;

	/* the finals come out before the engine thread's bookkeeping is read: retry */
	for (int t = 0; t < 50; t++) {
		run = daemontest_number(&kdecd, "--json status", "requests_running");
		wait = daemontest_number(&kdecd, "--json status", "requests_waiting");
		used = daemontest_number(&kdecd, "--json status", "kv_blocks_used");
		if (!run && !wait && !used)
			break;
		usleep(20000);
	}
	CHECK(run == 0 && wait == 0 && used == 0, "%s: afterwards %lld running, %lld waiting, %lld blocks used",
	      what, run, wait, used);
}

static void make(struct req *q, int i, int priority)
{
	memset(q, 0, sizeof(*q));
	for (int k = 0; k < PROMPT; k++)
		q->prompt[k] = (int32_t)((k * 29 + i * 53 + 3) % 500 + 4);
	q->max_tokens = MAX_GEN;
	q->priority = priority;
	switch (i % 4) {
	case 0:
		q->flags = KD_REQUEST_SPEC;	/* greedy, speculating in a full cache */
		break;
	case 1:
		q->sp = (struct kd_sampling){ .temperature = 0.9f, .top_k = 40, .seed = 100u + (unsigned)i };
		break;
	case 2:
		q->sp = (struct kd_sampling){ .temperature = 0.7f, .top_p = 0.9f, .seed = 7u * (unsigned)i,
					      .repetition_penalty = 1.3f, .frequency_penalty = 0.2f };
		break;
	default:
		q->sp = (struct kd_sampling){ .temperature = 0.8f, .seed = 5u + (unsigned)i };
		q->flags = KD_REQUEST_SPEC;
	}
}

static int log_preemptions(long offset, const char *want, int *others);
static long log_size(void);

static void test_overcommit(void)
{
	static struct req q[N_REQ];
	long long p0, p1, d0;
	int n_log, n_ses = 0;
	long off;

	for (int i = 0; i < N_REQ; i++)
		make(&q[i], i, 0);
	/* two turns of sessions: a preempted one is cancelled and reopened */
	q[1].session = "preempt-a";
	q[6].session = "preempt-b";
	references(q, N_REQ);
	off = log_size();
	p0 = preemptions();
	d0 = daemontest_number(&kdecd, "metrics", "\nkd_spec_draft_tokens_total");
	CHECK(p0 == 0, "requests alone were preempted (%lld)", p0);
	CHECK(run(q, N_REQ, 0) == 0, "%d requests together", N_REQ);
	check_same(q, N_REQ, "together");
	p1 = preemptions();
	CHECK(p1 > p0, "kd_preemptions_total did not move (%lld)", p1);
	CHECK(daemontest_number(&kdecd, "--json status", "preemptions") == p1,
	      "status's preemptions differ from the metric");
	d0 = daemontest_number(&kdecd, "metrics", "\nkd_spec_draft_tokens_total") - d0;
	CHECK(d0 > 0, "no draft verified");
	n_log = log_preemptions(off, "session '", &n_ses);
	n_ses = n_log - n_ses;
	CHECK(n_log == p1 - p0, "%d preemptions logged, %lld counted", n_log, p1 - p0);
	fprintf(stderr, "overcommit: %d requests of %d + %d tokens in a %s-token cache: %lld preemptions "
		"(%d of session turns), %lld drafts\n", N_REQ, PROMPT, MAX_GEN, KV_TOKENS, p1 - p0, n_ses, d0);
	{
		/* the sessions keep their KV between turns: closed, nothing holds a block */
		char out[1024];

		CHECK(daemontest_kdctl(&kdecd, "session-close preempt-a", out, sizeof(out)) == 0 &&
		      daemontest_kdctl(&kdecd, "session-close preempt-b", out, sizeof(out)) == 0,
		      "session-close: %s", out);
	}
	check_idle("overcommit");
}

/* Lines of the daemon's log from offset on that report a preemption: how many, and
 * how many of those do not contain want. */
static int log_preemptions(long offset, const char *want, int *others)
{
	char line[512];
	int n = 0;
	FILE *f = fopen(log_path, "r");

	*others = 0;
	if (!f)
		return -1;
	fseek(f, offset, SEEK_SET);
	while (fgets(line, sizeof(line), f)) {
		if (!strstr(line, "preempted"))
			continue;
		n++;
		*others += !strstr(line, want);
	}
	fclose(f);
	return n;
}

static long log_size(void)
{
	FILE *f = fopen(log_path, "r");
	long n;

	if (!f)
		return 0;
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fclose(f);
	return n;
}

/* Background requests take the cache; interactive ones arrive once they have
 * started: only background ones are preempted, and everyone's tokens stay. */
static void test_priority(void)
{
	static struct req q[N_REQ];
	int n_bg = 6, others = 0, n;
	long off;

	for (int i = 0; i < N_REQ; i++) {
		make(&q[i], i + 20, i < n_bg ? -1 : 5);
		q[i].later = i >= n_bg;
	}
	references(q, N_REQ);
	off = log_size();
	/* the interactive ones come once every background one has a token, so they
	 * are the most recently admitted: newest-first alone would pick them */
	CHECK(run(q, N_REQ, 0) == 0, "background + interactive requests");
	check_same(q, N_REQ, "priorities");
	n = log_preemptions(off, "(priority -1", &others);
	CHECK(n > 0 && others == 0, "%d preemptions logged, %d of them not of a background request", n, others);
	fprintf(stderr, "priority: %d background + %d interactive requests: %d preemptions, %d not background\n",
		n_bg, N_REQ - n_bg, n, others);
	check_idle("priority");
}

/* Long requests preempt one another; once one waits preempted, everything is
 * cancelled: every request ends, every block comes back. */
static void test_cancel(void)
{
	static struct req q[N_CONN];
	long long p0 = preemptions();

	for (int i = 0; i < N_CONN; i++) {
		make(&q[i], i + 40, 0);
		q[i].max_tokens = 200;
	}
	CHECK(run(q, N_CONN, p0 + 1) == 0, "long requests, cancelled");
	for (int i = 0; i < N_CONN; i++)
		CHECK(q[i].done, "request %d ended", i);
	CHECK(preemptions() > p0, "no preemption before the cancel");
	check_idle("cancel");
}

int main(void)
{
	if (daemontest_init(&kdecd, "preempt"))
		return 1;
	snprintf(log_path, sizeof(log_path), "%s/daemon.log", kdecd.dir);
	if (daemontest_start(&kdecd, "daemon.log", "--notify", "eventfd", "--kv-tokens", KV_TOKENS,
			     "--log-level", "debug", NULL) == 0) {
		test_overcommit();
		test_priority();
		test_cancel();
	} else {
		CHECK(0, "kdecd --kv-tokens %s did not start", KV_TOKENS);
	}
	daemontest_finish(&kdecd);
	return test_result("test_preempt_daemon");
}
