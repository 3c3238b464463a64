/* The control socket and kdctl against a real kdecd on the tiny Llama 3 checkpoint
 * (issue 28):
 * - log injection: a session name with a newline and ESC (JSON escapes on the control
 *   socket) is logged as \x0a and \x1b, on its own line; no raw ESC in the log;
 * - drain, then kdctl resume admits requests again;
 * - the in-flight cap as docs/CLIENT.md states it: 40 requests of one client all
 *   complete; the daemon works on 32 of a client's requests at a time, the others wait
 *   in its submission ring, and kd_submit says -EAGAIN only once the ring (64 records)
 *   is full: after 64..96 submissions;
 * - shutdown: kdctl resume cannot undo it; a request submitted then is refused as
 *   "admits no requests"; those still running or waiting at the shutdown timeout end
 *   KD_STOP_CANCELLED with a message that says the daemon shut down and the timeout. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

/* Bound on waiting for one phase: generous for the sanitizer build on a loaded
 * 2-core machine; the phases take well under a second in a plain build. */
#define TEST_WAIT_S 120
#define MAX_REQ 128

static struct daemontest kdecd;
static int32_t prompt[] = { 113, 124, 11 };

/* One raw line to the control socket; the reply into buf. 0 or -1. */
static int raw_line(const char *line, char *buf, size_t len)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int s = socket(AF_UNIX, SOCK_STREAM, 0);
	ssize_t n;

	if (strlen(kdecd.sock) >= sizeof(sa.sun_path)) {
		if (s >= 0)
			close(s);
		return -1;
	}
	memcpy(sa.sun_path, kdecd.sock, strlen(kdecd.sock) + 1);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) ||
	    send(s, line, strlen(line), 0) != (ssize_t)strlen(line)) {
		if (s >= 0)
			close(s);
		return -1;
	}
	n = recv(s, buf, len - 1, 0);
	buf[n > 0 ? n : 0] = 0;
	close(s);
	return n > 0 ? 0 : -1;
}

static char *read_log(const char *name, size_t *len)
{
	char path[600], *buf = malloc(1 << 20);
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", kdecd.dir, name);
	*len = 0;
	if (!buf || !(f = fopen(path, "rb"))) {
		free(buf);
		return NULL;
	}
	*len = fread(buf, 1, (1 << 20) - 1, f);
	buf[*len] = 0;
	fclose(f);
	return buf;
}

static void test_log_injection(void)
{
	char reply[512], *log;
	size_t len;

	CHECK(!raw_line("{\"cmd\":\"session-close\",\"name\":\"a\\nfake error line\\u001b[31m\"}\n", reply,
			sizeof(reply)), "no reply to session-close");
	/* the log line comes before the engine thread's answer, so it is written now */
	log = read_log("a.log", &len);
	CHECK(log && strstr(log, "session-close 'a\\x0afake error line\\x1b[31m'"), "escaped name not logged: %s",
	      log ? log : "(no log)");
	CHECK(log && !memchr(log, 0x1b, len), "a raw ESC in the log");
	CHECK(log && !strstr(log, "\nfake error line"), "the name started a line of its own");
	free(log);
}

/* Submits one request on c; 0 or kd_submit's error. */
static int submit(struct kd_client *c, uint32_t max_tokens, uint64_t *id)
{
	struct kd_request r = { .prompt = prompt, .n_prompt = 3, .max_tokens = max_tokens };

	return kd_submit(c, &r, id);
}

/* Waits for the final events of n requests of c; stop reasons and messages into
 * stop[] and msg[] in arrival order. The count of finals taken. */
static int finals(struct kd_client *c, int n, enum kd_stop *stop, char (*msg)[200])
{
	struct kd_event ev[64];
	time_t t0 = time(NULL);
	int got = 0;

	while (got < n && time(NULL) - t0 < TEST_WAIT_S) {
		int m = kd_wait(c, ev, 64, 1000);

		if (m < 0)
			break;
		for (int i = 0; i < m; i++) {
			if (!(ev[i].flags & KD_EVENT_FINAL))
				continue;
			stop[got] = ev[i].stop;
			kd_event_message(&ev[i], msg[got], sizeof(msg[got]));
			got++;
		}
	}
	return got;
}

static void test_resume(void)
{
	static char msg[2][200];
	enum kd_stop stop[2];
	struct kd_client *c;
	char out[4096];
	uint64_t id;

	CHECK(!daemontest_kdctl(&kdecd, "drain", out, sizeof(out)), "kdctl drain");
	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock })) {
		CHECK(0, "connect: %s", kd_connect_error(NULL));
		return;
	}
	CHECK(!submit(c, 2, &id), "submit while draining");
	CHECK(finals(c, 1, stop, msg) == 1 && stop[0] == KD_STOP_ERROR && strstr(msg[0], "draining"),
	      "while draining: stop %d '%s'", stop[0], msg[0]);
	CHECK(!daemontest_kdctl(&kdecd, "resume", out, sizeof(out)) && !strcmp(out, "ok\n"), "kdctl resume: %s",
	      out);
	CHECK(!submit(c, 2, &id), "submit after resume");
	CHECK(finals(c, 1, stop, msg) == 1 && stop[0] == KD_STOP_LENGTH, "after resume: stop %d '%s'", stop[0],
	      msg[0]);
	kd_close(c);
}

static void test_inflight_cap(void)
{
	static char msg[MAX_REQ][200];
	enum kd_stop stop[MAX_REQ];
	struct kd_client *c;
	int n, ok = 0, seen = 0, ret = 0;
	time_t t0;
	uint64_t id;

	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock })) {
		CHECK(0, "connect: %s", kd_connect_error(NULL));
		return;
	}
	/* 40 > 32: the 8 past the cap wait in the ring, none is refused */
	for (int i = 0; i < 40; i++)
		CHECK(!submit(c, 4, &id), "submit %d of 40", i);
	n = finals(c, 40, stop, msg);
	for (int i = 0; i < n; i++)
		ok += stop[i] == KD_STOP_LENGTH;
	CHECK(n == 40 && ok == 40, "of 40 requests %d ended, %d at their length (first: '%s')", n, ok, msg[0]);

	/* Long requests (each far from finishing while the loop runs): the daemon takes 32,
	 * the ring holds 64 more, then -EAGAIN. */
	for (n = 0; n < MAX_REQ && !(ret = submit(c, 1000, &id)); n++)
		;
	CHECK(ret == -EAGAIN && n >= 64 && n <= 96, "kd_submit said %d after %d submissions, want -EAGAIN after 64..96",
	      ret, n);
	/* kdctl clients shows the daemon's count: 32, never more */
	for (t0 = time(NULL); time(NULL) - t0 < TEST_WAIT_S && seen != 32;) {
		seen = (int)daemontest_number(&kdecd, "clients --json", "requests");
		CHECK(seen <= 32, "the daemon holds %d requests of one client", seen);
		if (seen != 32)
			usleep(20000);
	}
	CHECK(seen == 32, "kdctl clients: %d requests in flight, want 32", seen);
	kd_close(c);	/* cancels them all */
}

static void test_shutdown(void)
{
	static char msg[8][200];
	enum kd_stop stop[8];
	struct kd_client *c;
	char out[4096];
	int n, timed = 0, st = -1;
	uint64_t id;

	if (daemontest_start(&kdecd, "b.log", "--max-batch", "1", "--shutdown-timeout", "2", NULL)) {
		CHECK(0, "kdecd (b) did not start");
		return;
	}
	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = kdecd.sock })) {
		CHECK(0, "connect: %s", kd_connect_error(NULL));
		return;
	}
	/* one runs, two wait (--max-batch 1): none ends within the 2 s */
	for (int i = 0; i < 3; i++)
		CHECK(!submit(c, 10000, &id), "submit %d", i);
	for (time_t t0 = time(NULL); time(NULL) - t0 < TEST_WAIT_S;) {
		if (daemontest_number(&kdecd, "clients --json", "requests") == 3)
			break;
		usleep(20000);
	}
	CHECK(!daemontest_kdctl(&kdecd, "shutdown", out, sizeof(out)), "kdctl shutdown");
	CHECK(daemontest_kdctl(&kdecd, "resume 2>&1", out, sizeof(out)) &&
	      strstr(out, "kdctl resume: kdecd is shutting down: resume cannot undo it"), "kdctl resume: %s", out);
	CHECK(!submit(c, 2, &id), "submit during shutdown");
	n = finals(c, 4, stop, msg);
	CHECK(n == 4, "%d finals of 4", n);
	for (int i = 0; i < n; i++) {
		if (stop[i] == KD_STOP_ERROR) {
			CHECK(strstr(msg[i], "admits no requests"), "refused: '%s'", msg[i]);
			continue;
		}
		if (stop[i] == KD_STOP_LENGTH)
			continue;	/* it finished within the timeout after all */
		CHECK(stop[i] == KD_STOP_CANCELLED && !strcmp(msg[i], "cancelled: the daemon shut down and this request "
							      "did not finish within its shutdown timeout (2.0 s)"),
		      "final %d: stop %d '%s'", i, stop[i], msg[i]);
		timed++;
	}
	CHECK(timed >= 2, "%d requests cancelled by the shutdown timeout, want at least the 2 waiting", timed);
	kd_close(c);
	if (kdecd.pid > 0 && waitpid(kdecd.pid, &st, 0) == kdecd.pid)
		CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kdecd (b) ended with status %d", st);
	kdecd.pid = 0;
}

int main(void)
{
	if (daemontest_init(&kdecd, "control_daemon"))
		return 1;
	if (daemontest_start(&kdecd, "a.log", NULL)) {
		fprintf(stderr, "kdecd did not start (log in %s)\n", kdecd.dir);
		return 1;
	}
	test_log_injection();
	test_resume();
	test_inflight_cap();
	CHECK(daemontest_stop(&kdecd) == 0, "kdecd (a) did not exit 0 on SIGTERM");
	test_shutdown();
	daemontest_finish(&kdecd);
	return test_result("test_control_daemon");
}
