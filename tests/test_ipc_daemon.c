/* kdecd end to end: a real daemon process on the tiny Llama 3 checkpoint and clients
 * through libkdclient. 64 concurrent greedy clients get exactly kdbench generate's
 * tokens; a client killed mid-stream leaves no running request and no KV block; a
 * client scribbling over its segment is dropped while the others carry on; a client
 * that stops reading stalls nobody and is cancelled after the stall timeout; a uid
 * off the allow-list is refused; penalties, min-p and logprobs cross the wire. Futex
 * mode where the kernel has io_uring futex ops, and eventfd mode always. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/kdclient_internal.h"
#include "ipc/ipc_futex.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

#define N_CLIENTS 64
#define GEN_TOKENS 16
#define VOCAB 512
#define STALL_MS 5000		/* SCHED_DEFAULT_STALL_MS */

static struct daemontest kdecd;

/* Prompt i: 3..9 ids spread over the vocabulary. */
static int prompt_of(int i, int32_t *p)
{
	int n = 3 + i % 7;

	for (int k = 0; k < n; k++)
		p[k] = (int32_t)((i * 37 + k * 11 + 1) % VOCAB);
	return n;
}

/* One control command; the value of "key" in the reply (an integer), or -1. */
static long long ctl(const char *cmd, const char *key)
{
	char line[8192], pat[64], req[128];
	const char *p;

	snprintf(req, sizeof(req), "{\"cmd\":\"%s\"}\n", cmd);
	if (daemontest_control(kdecd.sock, req, line, sizeof(line), 30))
		return -1;
	snprintf(pat, sizeof(pat), "\"%s\":", key);
	return (p = strstr(line, pat)) ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

/* Waits until status reports running == 0 and no KV block in use; -1 on timeout. */
static int wait_idle(double timeout_s)
{
	double t_end = test_now_s() + timeout_s;

	while (test_now_s() < t_end) {
		if (ctl("status", "requests_running") == 0 && ctl("status", "requests_waiting") == 0 &&
		    ctl("status", "kv_blocks_used") == 0)
			return 0;
		usleep(20000);
	}
	return -1;
}

/* ---- concurrent greedy clients ---------------------------------------------- */

enum wait_style { WAIT_SLEEP, WAIT_SPIN, WAIT_FD };

struct job {
	int index;
	enum wait_style style;
	int max_tokens;
	int32_t prompt[16];
	int n_prompt;
	int32_t ref[GEN_TOKENS];
	int32_t got[GEN_TOKENS];
	int n_got;
	int bad_index, bad_id, final_stop, final_count, err;
};

static int recv_events(struct kd_client *c, enum wait_style style, struct kd_event *ev, int max)
{
	if (style == WAIT_FD) {
		/* kd_fd is readable when events MAY be waiting (an eventfd write for an
		 * event an earlier kd_poll already took): poll again until 20 s pass */
		struct pollfd p = { .fd = kd_fd(c), .events = POLLIN };
		double t_end = test_now_s() + 20;

		for (;;) {
			int n = kd_poll(c, ev, max);
			double left = t_end - test_now_s();

			if (n || left <= 0)
				return n;
			poll(&p, 1, (int)(left * 1000) + 1);
		}
	}
	return kd_wait(c, ev, max, 20000);
}

static void *run_job(void *arg)
{
	struct job *j = arg;
	struct kd_connect_opts o = { .socket_path = kdecd.sock };
	struct kd_request r = { .prompt = j->prompt, .n_prompt = (uint32_t)j->n_prompt,
				.max_tokens = (uint32_t)j->max_tokens };
	struct kd_client *c;
	struct kd_event ev[32];
	uint64_t id;
	int done = 0;

	if (j->style == WAIT_SPIN) {
		o.flags = KD_CONNECT_SPIN;
		o.spin_us = 100;
	}
	if ((j->err = kd_connect(&c, &o)))
		return NULL;
	if ((j->err = kd_submit(c, &r, &id))) {
		kd_close(c);
		return NULL;
	}
	while (!done) {
		int n = recv_events(c, j->style, ev, 32);

		if (n <= 0) {
			j->err = n ? n : -ETIMEDOUT;
			break;
		}
		for (int i = 0; i < n; i++) {
			if (ev[i].id != id)
				j->bad_id++;
			if (ev[i].token >= 0) {
				if ((int)ev[i].index != j->n_got)
					j->bad_index++;
				if (j->n_got < GEN_TOKENS)
					j->got[j->n_got] = ev[i].token;
				j->n_got++;
			}
			if (ev[i].flags & KD_EVENT_FINAL) {
				j->final_count++;
				j->final_stop = ev[i].stop;
				done = 1;
			}
		}
	}
	kd_close(c);
	return NULL;
}

static void make_jobs(struct job *jobs, int n, int offset)
{
	for (int i = 0; i < n; i++) {
		struct job *j = &jobs[i];

		memset(j, 0, sizeof(*j));
		j->index = i + offset;
		j->style = i % 8 == 3 ? WAIT_SPIN : i % 8 == 5 ? WAIT_FD : WAIT_SLEEP;
		j->max_tokens = GEN_TOKENS;
		j->n_prompt = prompt_of(i + offset, j->prompt);
		if (daemontest_reference(&kdecd, j->prompt, j->n_prompt, GEN_TOKENS, j->ref) != GEN_TOKENS)
			j->err = -ENOEXEC;
	}
}

static void start_jobs(struct job *jobs, pthread_t *th, int n)
{
	for (int i = 0; i < n; i++)
		pthread_create(&th[i], NULL, run_job, &jobs[i]);
}

static void check_jobs(struct job *jobs, pthread_t *th, int n, const char *what)
{
	int exact = 0;

	for (int i = 0; i < n; i++) {
		struct job *j = &jobs[i];

		pthread_join(th[i], NULL);
		CHECK(!j->err, "%s: client %d: %s", what, i, kd_strerror(j->err));
		CHECK(j->n_got == GEN_TOKENS && j->final_count == 1 && j->final_stop == KD_STOP_LENGTH,
		      "%s: client %d: %d tokens, %d finals, stop %d", what, i, j->n_got, j->final_count,
		      j->final_stop);
		CHECK(!j->bad_id && !j->bad_index, "%s: client %d: %d foreign ids, %d out-of-order indices",
		      what, i, j->bad_id, j->bad_index);
		if (j->n_got == GEN_TOKENS && !memcmp(j->got, j->ref, sizeof(j->ref)))
			exact++;
		else
			CHECK(0, "%s: client %d (prompt %d tokens): tokens differ from kdbench generate",
			      what, i, j->n_prompt);
	}
	fprintf(stderr, "%s: %d of %d clients got exactly kdbench generate's tokens\n", what, exact, n);
}

static void test_concurrent(int n, const char *what)
{
	static struct job jobs[N_CLIENTS];
	static pthread_t th[N_CLIENTS];
	double t0;

	make_jobs(jobs, n, 0);
	t0 = test_now_s();
	start_jobs(jobs, th, n);
	check_jobs(jobs, th, n, what);
	fprintf(stderr, "%s: %d clients x %d tokens in %.2f s\n", what, n, GEN_TOKENS, test_now_s() - t0);
	CHECK(wait_idle(5) == 0, "%s: daemon not idle afterwards", what);
}

/* ---- a client killed mid-stream --------------------------------------------- */

static void test_sigkill(void)
{
	int pfd[2];
	pid_t pid;
	char b;

	if (pipe(pfd))
		return;
	pid = fork();
	if (pid == 0) {
		struct kd_client *c;
		struct kd_event ev[8];
		int32_t p[4] = { 5, 6, 7, 8 };
		struct kd_request r = { .prompt = p, .n_prompt = 4, .max_tokens = 20000 };
		int got = 0;

		if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock }) ||
		    kd_submit(c, &r, NULL))
			_exit(1);
		while (got < 20) {
			int n = kd_wait(c, ev, 8, 10000);

			if (n <= 0)
				_exit(1);
			got += n;
		}
		if (write(pfd[1], "x", 1) != 1)
			_exit(1);
		for (;;)
			pause();	/* streaming on, not reading */
	}
	close(pfd[1]);
	CHECK(read(pfd[0], &b, 1) == 1, "sigkill: the child did not start streaming");
	close(pfd[0]);
	CHECK(ctl("status", "requests_running") == 1 && ctl("status", "kv_blocks_used") > 0,
	      "sigkill: before the kill: running %lld, kv blocks %lld",
	      ctl("status", "requests_running"), ctl("status", "kv_blocks_used"));
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	CHECK(wait_idle(2) == 0, "sigkill: afterwards running %lld, waiting %lld, kv blocks used %lld",
	      ctl("status", "requests_running"), ctl("status", "requests_waiting"),
	      ctl("status", "kv_blocks_used"));
	CHECK(ctl("status", "clients") == 0, "sigkill: %lld clients left", ctl("status", "clients"));
}

/* ---- per-client cap on tokens in flight, and kd_cancel --------------------- */

static void test_client_tokens(void)
{
	int32_t p[3] = { 7, 8, 9 };
	struct kd_request r = { .prompt = p, .n_prompt = 3, .max_tokens = 20000 };
	struct kd_event ev[64];
	struct kd_client *c;
	uint64_t a, b;
	int b_stop = -1, b_err = 0, a_stop = -1, a_tokens = 0;
	double t_end = test_now_s() + 60;

	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock }) ||
	    kd_submit(c, &r, &a) || kd_submit(c, &r, &b)) {
		CHECK(0, "client tokens: cannot submit");
		return;
	}
	while (a_stop < 0 && test_now_s() < t_end) {
		int n = kd_wait(c, ev, 64, 5000);

		for (int i = 0; i < n; i++) {
			if (ev[i].id == a && ev[i].token >= 0)
				a_tokens++;
			if (!(ev[i].flags & KD_EVENT_FINAL))
				continue;
			if (ev[i].id == b) {
				b_stop = ev[i].stop;
				b_err = ev[i].error;
				kd_cancel(c, a);	/* the first has run long enough */
			} else {
				a_stop = ev[i].stop;
			}
		}
		if (n < 0)
			break;
	}
	CHECK(b_stop == KD_STOP_ERROR && b_err == -EAGAIN,
	      "client tokens: the second request (2 x 20003 > 32768 tokens) ended with stop %d error %d",
	      b_stop, b_err);
	CHECK(a_stop == KD_STOP_CANCELLED && a_tokens < 20000,
	      "client tokens: the first request: stop %d after %d tokens, want cancelled", a_stop, a_tokens);
	kd_close(c);
	CHECK(wait_idle(5) == 0, "client tokens: daemon not idle afterwards");
}

/* ---- sampling over the wire: penalties, min-p, logprobs ------------------ */

struct samp_run {
	int n;
	int32_t tok[GEN_TOKENS], top[GEN_TOKENS];
	float lp[GEN_TOKENS], top_lp[GEN_TOKENS];
	int with_lp;		/* events that carried KD_EVENT_LOGPROB */
};

static int run_sampled(const struct kd_sampling *sp, struct samp_run *o)
{
	int32_t p[5] = { 5, 6, 5, 6, 5 };
	struct kd_request r = { .prompt = p, .n_prompt = 5, .max_tokens = GEN_TOKENS, .sampling = *sp };
	struct kd_event ev[64];
	struct kd_client *c;
	double t_end = test_now_s() + 60;
	int done = 0, ret;

	memset(o, 0, sizeof(*o));
	if ((ret = kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock })))
		return ret;
	if ((ret = kd_submit(c, &r, NULL))) {
		kd_close(c);
		return ret;
	}
	while (!done && test_now_s() < t_end) {
		int n = kd_wait(c, ev, 64, 5000);

		for (int i = 0; i < n; i++) {
			if (ev[i].token >= 0 && o->n < GEN_TOKENS) {
				o->tok[o->n] = ev[i].token;
				o->lp[o->n] = ev[i].logprob;
				o->top[o->n] = ev[i].top_token;
				o->top_lp[o->n] = ev[i].top_logprob;
				o->with_lp += !!(ev[i].flags & KD_EVENT_LOGPROB);
				o->n++;
			}
			if (ev[i].flags & KD_EVENT_FINAL)
				done = ev[i].stop == KD_STOP_LENGTH ? 1 : -1;
		}
		if (n < 0)
			break;
	}
	kd_close(c);
	return done == 1 ? 0 : -EIO;
}

static void test_sampling(void)
{
	struct kd_sampling greedy = { .logprobs = 1, .top_logprobs = 1 };
	struct kd_sampling pen = { .temperature = 0.8f, .seed = 11, .min_p = 0.05f,
				   .repetition_penalty = 1.3f, .presence_penalty = 0.5f,
				   .frequency_penalty = 0.2f, .logprobs = 1 };
	struct samp_run a, b;
	int ok = 1;

	CHECK(run_sampled(&greedy, &a) == 0 && a.n == GEN_TOKENS && a.with_lp == GEN_TOKENS,
	      "sampling: greedy with logprobs: %d tokens, %d with logprobs", a.n, a.with_lp);
	for (int i = 0; i < a.n; i++)
		ok &= a.top[i] == a.tok[i] && a.lp[i] == a.top_lp[i] && a.lp[i] <= 0 && isfinite(a.lp[i]);
	CHECK(ok, "sampling: greedy tokens are their own top logprob");
	CHECK(run_sampled(&pen, &a) == 0 && run_sampled(&pen, &b) == 0 && a.n == GEN_TOKENS &&
	      b.n == GEN_TOKENS && !memcmp(a.tok, b.tok, sizeof(a.tok)) && !memcmp(a.lp, b.lp, sizeof(a.lp)),
	      "sampling: penalties + min-p with a seed are not reproducible");
	ok = a.with_lp == GEN_TOKENS;
	for (int i = 0; i < a.n; i++)
		ok &= a.top[i] == -1 && a.lp[i] <= 0 && isfinite(a.lp[i]);
	CHECK(ok, "sampling: logprobs without top: %d events", a.with_lp);
	pen.presence_penalty = 3;
	CHECK(run_sampled(&pen, &a) == -EINVAL, "sampling: presence penalty 3 not refused");
	pen.presence_penalty = 0;
	pen.top_logprobs = 2;
	CHECK(run_sampled(&pen, &a) == -EINVAL, "sampling: top_logprobs 2 not refused");
}

/* ---- a client scribbling over its whole segment ---------------------------- */

static int scribbler(int go_fd)
{
	unsigned long long seed = 0x5eedULL ^ (unsigned long long)getpid();
	struct kd_client *c;
	int32_t p[3] = { 1, 2, 3 };
	struct kd_request r = { .prompt = p, .n_prompt = 3, .max_tokens = 100000 / 16 };
	char b;

	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock }) || kd_submit(c, &r, NULL))
		return 2;
	if (read(go_fd, &b, 1) != 1)
		return 2;
	for (int round = 0; round < 2000; round++) {
		uint32_t *w = c->seg;
		struct ipc_seg_hdr *h = c->seg;

		for (size_t i = 0; i < c->seg_bytes / 4; i++) {
			seed ^= seed << 13;
			seed ^= seed >> 7;
			seed ^= seed << 17;
			w[i] = (uint32_t)seed;
		}
		ipc_futex_wake(&h->daemon_bell, 1);
		if (c->notify == IPC_NOTIFY_EVENTFD) {
			uint64_t one = 1;

			if (write(c->bell_efd, &one, 8) < 0)
				return 2;
		}
		usleep(1000);
		if (kd_poll(c, NULL, 0) == -ECONNRESET || kdclient_check_closed(c)) {
			fprintf(stderr, "scribbler: after %d rounds: %s\n", round + 1, kd_connect_error(c));
			return strstr(kd_connect_error(c), "protocol violation") ? 0 : 3;
		}
	}
	return 1;
}

static void test_scribble(void)
{
	static struct job jobs[8];
	static pthread_t th[8];
	int go[2], st = -1;
	pid_t pid;

	if (pipe(go))
		return;
	pid = fork();
	if (pid == 0) {
		close(go[1]);
		_exit(scribbler(go[0]));
	}
	close(go[0]);
	make_jobs(jobs, 8, 100);
	usleep(100000);
	start_jobs(jobs, th, 8);
	CHECK(write(go[1], "g", 1) == 1, "scribble: cannot start the scribbler");
	close(go[1]);
	waitpid(pid, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "scribble: the scribbling client was not disconnected for a protocol violation (status %d)", st);
	check_jobs(jobs, th, 8, "scribble: the other clients");
	CHECK(wait_idle(5) == 0, "scribble: daemon not idle afterwards");
}

/* ---- a client that stops reading its event ring ---------------------------- */

static void test_stall(void)
{
	static struct job jobs[8];
	static pthread_t th[8];
	static int32_t ref[IPC_EV_SLOTS], got[IPC_EV_SLOTS + 8];
	int32_t p[5] = { 113, 124, 11, 408, 469 };
	struct kd_request r = { .prompt = p, .n_prompt = 5, .max_tokens = 3000 };
	struct kd_event ev[64];
	struct kd_client *c;
	int n_got = 0, n_ref, final = -1, detail = -1;
	double t0, t_jobs;

	n_ref = daemontest_reference(&kdecd, p, 5, IPC_EV_SLOTS, ref);
	make_jobs(jobs, 8, 200);
	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock }) || kd_submit(c, &r, NULL)) {
		CHECK(0, "stall: cannot connect");
		return;
	}
	/* Wait until the stalled request has filled its event ring (the daemon keeps
	 * one slot back for a final): from then on it is paused. */
	t0 = test_now_s();
	while (test_now_s() < t0 + 120) {
		struct ipc_seg_hdr *h = c->seg;

		if (atomic_load(&h->ev_tail) - atomic_load(&h->ev_head) >= IPC_EV_SLOTS - 1)
			break;
		usleep(10000);
	}
	CHECK(test_now_s() < t0 + 120, "stall: the event ring did not fill");
	t0 = test_now_s();
	start_jobs(jobs, th, 8);
	check_jobs(jobs, th, 8, "stall: the other clients");
	t_jobs = test_now_s() - t0;
	CHECK(t_jobs < STALL_MS * 1e-3, "stall: the others took %.2f s (>= the stall timeout)", t_jobs);
	CHECK(ctl("status", "requests_running") == 1, "stall: the paused request is not held (running %lld)",
	      ctl("status", "requests_running"));
	CHECK(wait_idle(STALL_MS * 1e-3 + 3) == 0, "stall: the paused request was not cancelled");
	for (;;) {
		int n = kd_wait(c, ev, 64, 2000);

		if (n <= 0)
			break;
		for (int i = 0; i < n; i++) {
			if (ev[i].token >= 0 && n_got < (int)(sizeof(got) / sizeof(got[0])))
				got[n_got++] = ev[i].token;
			if (ev[i].flags & KD_EVENT_FINAL) {
				final = ev[i].stop;
				detail = (int)ev[i].detail;
			}
		}
		if (final >= 0)
			break;
	}
	CHECK(final == KD_STOP_CANCELLED && detail == IPC_DETAIL_STALLED,
	      "stall: final stop %d detail %d, want cancelled/stalled", final, detail);
	CHECK(n_got > (int)IPC_EV_SLOTS / 2 && n_got < (int)IPC_EV_SLOTS, "stall: %d tokens before the ring filled", n_got);
	CHECK(n_ref >= n_got && !memcmp(got, ref, (size_t)n_got * sizeof(int32_t)),
	      "stall: the %d tokens differ from kdbench generate's", n_got);
	kd_close(c);
}

/* ---- a uid off the allow-list ---------------------------------------------- */

static void test_uid(void)
{
	int st = -1;
	pid_t pid;

	if (geteuid() != 0) {
		test_skip("uid check: needs root to run a client as another uid");
		return;
	}
	chmod(kdecd.sock, 0666);	/* let the connect through: SO_PEERCRED must refuse it */
	pid = fork();
	if (pid == 0) {
		struct kd_client *c;
		int ret;

		if (setgid(65534) || setuid(65534))
			_exit(2);
		ret = kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock });
		fprintf(stderr, "uid 65534: %s (%s)\n", kd_strerror(ret), kd_connect_error(NULL));
		_exit(ret == -EACCES && strstr(kd_connect_error(NULL), "allow-list") ? 0 : 1);
	}
	waitpid(pid, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid: uid 65534 was not refused (status %d)", st);
	chmod(kdecd.sock, 0660);
}

int main(void)
{
	if (daemontest_init(&kdecd, "ipc"))
		return 1;
	chmod(kdecd.dir, 0755);	/* the uid check's client must reach the socket */

	/* each notify mode, its own log */
	if (daemontest_start(&kdecd, "daemon-futex.log", "--notify", "futex", "--shutdown-timeout",
			     "5", NULL) == 0) {
		test_concurrent(N_CLIENTS, "futex: 64 concurrent greedy clients");
		test_sigkill();
		test_client_tokens();
		test_scribble();
		test_stall();
		test_uid();
		CHECK(daemontest_stop(&kdecd) == 0, "futex: kdecd did not exit 0 on SIGTERM");
	} else {
		char cmd[600];

		snprintf(cmd, sizeof(cmd), "tail -n 2 %s/daemon-futex.log >&2", kdecd.dir);
		test_skip("futex mode (64 clients, SIGKILL, tokens, scribble, stall, uid): "
			  "kdecd --notify futex did not start (needs io_uring futex ops):");
		if (system(cmd))
			fprintf(stderr, "(no log)\n");
	}
	if (daemontest_start(&kdecd, "daemon-eventfd.log", "--notify", "eventfd",
			     "--shutdown-timeout", "5", NULL) == 0) {
		test_concurrent(16, "eventfd: 16 concurrent greedy clients");
		test_sampling();
		test_sigkill();
		test_scribble();
		CHECK(daemontest_stop(&kdecd) == 0, "eventfd: kdecd did not exit 0 on SIGTERM");
	} else {
		CHECK(0, "kdecd --notify eventfd did not start");
	}
	daemontest_finish(&kdecd);
	return test_result("test_ipc_daemon");
}
