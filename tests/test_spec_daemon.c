/* Speculative decoding through a real kdecd (--spec ngram:k=4,n=2) on the tiny Llama 3
 * checkpoint: greedy requests submitted together (verification rows in one step
 * with the others' decode rows) get exactly kdbench generate's tokens, with
 * speculation and with the per-request opt-out; kd_spec_* metrics move only for
 * requests that speculate; a seeded sampled request with penalties speculates (its
 * drafts verified by its own draws) and gets the tokens it gets without; a stop token reached inside an accepted draft ends the request there. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

#define MAX_GEN 40
#define N_REQ 6

static struct daemontest kdecd;

/* A counter from kdctl metrics, or -1. */
static long long metric(const char *name)
{
	char key[128];

	snprintf(key, sizeof(key), "\n%s", name);	/* the metric's line, not its # HELP */
	return daemontest_number(&kdecd, "metrics", key);
}

struct req {
	int32_t prompt[32];
	int n_prompt, max_tokens;
	uint32_t flags;
	struct kd_sampling sp;
	int32_t stop;
	uint64_t id;
	int32_t got[MAX_GEN];
	int n_got, done;
};

/* Submits reqs[0..n) on one connection at once and collects their tokens. */
static int run(struct req *reqs, int n)
{
	struct kd_client *c;
	struct kd_event ev[64];
	int left = n, ret;

	if ((ret = kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock })))
		return ret;
	for (int i = 0; i < n; i++) {
		struct kd_request r = { .prompt = reqs[i].prompt, .n_prompt = (uint32_t)reqs[i].n_prompt,
					.max_tokens = (uint32_t)reqs[i].max_tokens, .sampling = reqs[i].sp,
					.flags = reqs[i].flags, .stop = &reqs[i].stop,
					.n_stop = reqs[i].stop >= 0 };

		reqs[i].n_got = reqs[i].done = 0;
		if ((ret = kd_submit(c, &r, &reqs[i].id)))
			goto out;
	}
	while (left > 0) {
		int m = kd_wait(c, ev, 64, 20000);

		if (m <= 0) {
			ret = m ? m : -ETIMEDOUT;
			goto out;
		}
		for (int k = 0; k < m; k++) {
			for (int i = 0; i < n; i++) {
				if (ev[k].id != reqs[i].id)
					continue;
				if (ev[k].token >= 0 && reqs[i].n_got < MAX_GEN)
					reqs[i].got[reqs[i].n_got++] = ev[k].token;
				if (ev[k].flags & KD_EVENT_FINAL) {
					reqs[i].done = 1;
					left--;
				}
			}
		}
	}
	ret = 0;
out:
	kd_close(c);
	return ret;
}

static void test_greedy(void)
{
	static const int32_t rep[] = { 5, 17, 300, 2, 9 };
	struct req q[N_REQ];
	int32_t ref[2][MAX_GEN];
	long long d0, a0, d1, a1;

	memset(q, 0, sizeof(q));
	for (int i = 0; i < N_REQ; i++) {
		q[i].n_prompt = 23;
		q[i].max_tokens = 32;
		q[i].stop = -1;
		for (int k = 0; k < q[i].n_prompt; k++)
			q[i].prompt[k] = i % 2 ? (k * 37 + i * 11 + 1) % 512 : rep[k % 5];
	}
	q[1].flags = KD_REQUEST_NO_SPEC;
	q[2].flags = KD_REQUEST_NO_SPEC;	/* the repeating prompt without speculation */
	q[4].flags = KD_REQUEST_SPEC;
	CHECK(daemontest_reference(&kdecd, q[0].prompt, 23, 32, ref[0]) == 32 &&
	      daemontest_reference(&kdecd, q[1].prompt, 23, 32, ref[1]) == 32,
	      "kdbench generate references");
	d0 = metric("kd_spec_draft_tokens_total");
	a0 = metric("kd_spec_accepted_tokens_total");
	CHECK(d0 == 0 && a0 == 0, "spec metrics start at 0 (%lld, %lld)", d0, a0);
	CHECK(run(q, N_REQ) == 0, "greedy requests");
	for (int i = 0; i < N_REQ; i++) {
		const int32_t *want = i % 2 ? NULL : ref[0];

		CHECK(q[i].n_got == 32, "request %d: %d tokens", i, q[i].n_got);
		if (want)
			CHECK(!memcmp(q[i].got, want, 32 * sizeof(int32_t)), "request %d (flags %u): tokens differ from greedy",
			      i, q[i].flags);
	}
	CHECK(!memcmp(q[1].got, ref[1], 32 * sizeof(int32_t)), "request 1: tokens differ from greedy");
	d1 = metric("kd_spec_draft_tokens_total");
	a1 = metric("kd_spec_accepted_tokens_total");
	CHECK(d1 > 0 && a1 > 0 && a1 <= d1, "spec metrics moved: %lld drafted, %lld accepted", d1, a1);

	/* opted out: nothing drafted */
	q[0].flags = KD_REQUEST_NO_SPEC;
	CHECK(run(q, 1) == 0 && !memcmp(q[0].got, ref[0], 32 * sizeof(int32_t)), "opt-out request");
	CHECK(metric("kd_spec_draft_tokens_total") == d1, "an opted-out request drafted");

	/* a stop token that speculation would run past: cut there */
	q[0].flags = 0;
	q[0].stop = ref[0][20];
	for (int k = 0; k < 20; k++)
		if (ref[0][k] == q[0].stop)
			q[0].stop = -1;
	if (q[0].stop >= 0) {
		CHECK(run(q, 1) == 0 && q[0].n_got == 21 && !memcmp(q[0].got, ref[0], 21 * sizeof(int32_t)),
		      "stop token: %d tokens, want 21", q[0].n_got);
	}
}

static void test_sampled(void)
{
	static const int32_t rep[] = { 5, 17, 300, 2, 9 };
	long long d0 = metric("kd_spec_draft_tokens_total"), d1;
	struct req q[2];

	memset(q, 0, sizeof(q));
	for (int i = 0; i < 2; i++) {
		q[i].n_prompt = 10;
		q[i].max_tokens = 24;
		q[i].stop = -1;
		/* cool enough to fall into the loop greedy decoding of this prompt does */
		q[i].sp = (struct kd_sampling){ .temperature = 0.2f, .top_k = 40, .seed = 11,
						.frequency_penalty = 0.01f };
		for (int k = 0; k < 10; k++)
			q[i].prompt[k] = rep[k % 5];
	}
	q[1].flags = KD_REQUEST_NO_SPEC;
	CHECK(run(q, 2) == 0 && q[0].n_got == 24 && q[1].n_got == 24 && !memcmp(q[0].got, q[1].got, 24 * sizeof(int32_t)),
	      "a sampled request does not depend on the switch");
	d1 = metric("kd_spec_draft_tokens_total");
	CHECK(d1 > d0, "the sampled request drafted nothing (%lld, %lld)", d0, d1);
}

int main(void)
{
	if (daemontest_init(&kdecd, "spec"))
		return 1;
	if (daemontest_start(&kdecd, "daemon.log", "--notify", "eventfd", "--spec", "ngram:k=4,n=2",
			     NULL) == 0) {
		test_greedy();
		test_sampled();
	} else {
		CHECK(0, "kdecd --spec did not start");
	}
	daemontest_finish(&kdecd);
	return test_result("test_spec_daemon");
}
