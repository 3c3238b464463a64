/* Chaos against a real kdecd while honest clients stream (issue 28): storms of kdrun
 * processes SIGKILLed mid-stream, garbage on the control socket (random bytes, bad
 * JSON, unread pipelined commands, over-long lines), garbage on client sockets and in
 * a client's segment, connections that never say hello, snapshots, and daemon
 * restarts. Every honest request that ends by length must equal kdbench generate's
 * solo output; the daemon must never die, every stop must exit 0 (ASan's leak check
 * included), and at the end no client, request or descriptor may be left over.
 * Bounded: --seconds (default CHAOS_SECONDS or 15) of chaos, then a settle. contrib/
 * soak.sh runs it for longer with --samples (RSS and descriptors once a second). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kdclient_internal.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

#define N_HONEST 4
#define N_PROMPTS 6
#define GEN 12
#define N_SILENT 16		/* hello-less connections kept open */
#define HUNG_MS 60000		/* an honest request without an event this long is hung
				 * (shutdown timeout 5 s; generous for ASan on 2 loaded cores) */

static struct daemontest d;
static _Atomic int stop_actors;
static int32_t prompts[N_PROMPTS][8], refs[N_PROMPTS][GEN];
static int n_prompt[N_PROMPTS];
static _Atomic long n_matched, n_mismatched, n_interrupted, n_hung, n_kills, n_garbage,
	n_scribbles, n_silent, n_snapshots, n_restarts, n_deaths;
static unsigned long long seed;

static unsigned rnd(unsigned *s)
{
	*s = *s * 1103515245u + 12345u;
	return *s >> 8;
}

static void set_path(struct sockaddr_un *sa, const char *path)
{
	size_t n = strlen(path);

	memcpy(sa->sun_path, path, n < sizeof(sa->sun_path) ? n : sizeof(sa->sun_path) - 1);
}

static int raw_conn(int nonblock)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = 5 };
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);

	set_path(&sa, d.sock);
	if (s < 0)
		return -1;
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa))) {
		close(s);
		return -1;
	}
	return s;
}

/* One control command; the reply's "key" as a number, or -1. */
static long long ctl(const char *cmd, const char *key)
{
	char line[16384], pat[64];
	const char *p;

	if (daemontest_control(d.sock, cmd, line, sizeof(line), 5))
		return -1;
	snprintf(pat, sizeof(pat), "\"%s\":", key);
	if (!(p = strstr(line, pat)))
		return -1;
	p += strlen(pat);
	return *p == 't' ? 1 : *p == 'f' ? 0 : strtoll(p, NULL, 10);
}

/* ---- honest clients ------------------------------------------------------------ */

/* One request on c; 1 matched, 0 interrupted (shutdown, restart), -1 mismatched or hung. */
static int honest_request(struct kd_client *c, int t, int k)
{
	char session[32];
	struct kd_request r = { .prompt = prompts[k], .n_prompt = (uint32_t)n_prompt[k], .max_tokens = GEN };
	struct kd_event ev[16];
	int32_t got[GEN];
	int n_got = 0, ret;
	uint64_t id;

	snprintf(session, sizeof(session), "honest-%d", t);
	if (t % 2)
		r.session = session;	/* sessions, so snapshots and restarts carry something */
	if (kd_submit(c, &r, &id))
		return 0;
	for (;;) {
		ret = kd_wait(c, ev, 16, HUNG_MS);
		if (ret < 0)
			return 0;	/* the daemon went away: a restart */
		if (!ret) {
			n_hung++;
			fprintf(stderr, "honest client %d: no event for %d ms\n", t, HUNG_MS);
			return -1;
		}
		for (int i = 0; i < ret; i++) {
			if (ev[i].token >= 0 && n_got < GEN)
				got[n_got++] = ev[i].token;
			if (!(ev[i].flags & KD_EVENT_FINAL))
				continue;
			if (ev[i].stop != KD_STOP_LENGTH)
				return 0;	/* cancelled or refused by a shutdown */
			if (n_got == GEN && !memcmp(got, refs[k], sizeof(got)))
				return 1;
			fprintf(stderr, "honest client %d, prompt %d: %d tokens, not the solo run's\n", t, k, n_got);
			return -1;
		}
	}
}

static void *honest(void *arg)
{
	int t = (int)(intptr_t)arg, k = t;
	struct kd_client *c = NULL;

	while (!stop_actors) {
		int ret;

		if (!c && kd_connect(&c, &(struct kd_connect_opts){ .socket_path = d.sock })) {
			c = NULL;
			usleep(50000);
			continue;
		}
		ret = honest_request(c, t, k % N_PROMPTS);
		if (ret > 0) {
			n_matched++;
			k++;
		} else {
			if (ret < 0)
				n_mismatched++;
			else
				n_interrupted++;
			kd_close(c);
			c = NULL;
		}
	}
	kd_close(c);
	return NULL;
}

/* ---- adversaries ----------------------------------------------------------------- */

/* kdrun processes killed at random points of their stream. */
static void *kill_storm(void *arg)
{
	char kdrun[600];
	char *argv[] = { kdrun, "--socket", d.sock, "--prompt", "5,6,7,8,9", "--max-tokens", "64", NULL };
	unsigned s = (unsigned)seed ^ 1;
	posix_spawn_file_actions_t fa;

	(void)arg;
	snprintf(kdrun, sizeof(kdrun), "%s/kdrun", d.builddir);
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
	while (!stop_actors) {
		pid_t pids[4];
		int n = 0;

		for (int i = 0; i < 4; i++)
			if (!posix_spawn(&pids[n], kdrun, &fa, NULL, argv, NULL))
				n++;
		usleep(20000 + rnd(&s) % 300000);
		for (int i = 0; i < n; i++) {
			kill(pids[i], SIGKILL);
			waitpid(pids[i], NULL, 0);
			n_kills++;
		}
	}
	posix_spawn_file_actions_destroy(&fa);
	return NULL;
}

static const char *const bad_lines[] = {
	"{\n", "}\n", "[]\n", "null\n", "\"cmd\"\n", "{\"cmd\":1}\n", "{\"cmd\":\"nosuch\"}\n",
	"{\"cmd\":\"status\",\"cmd\":\"status\"}\n", "{\"hello\":\"kdclient\"}\n",
	"{\"hello\":\"kdclient\",\"protocol\":99999}\n", "{\"hello\":\"kdclient\",\"protocol\":\"1\"}\n",
	"{\"hello\":7,\"protocol\":1}\n", "{\"cmd\":\"session-close\"}\n",
	"{\"cmd\":\"session-close\",\"name\":\"\"}\n", "{\"cmd\":\"session-close\",\"name\":\"a\\nb\\u001b[31m\"}\n",
	"{\"cmd\":\"sessions\"}\n", "{\"cmd\":\"metrics\"}\n", "{\"cmd\":\"clients\"}\n",
	"{\"cmd\":\"snapshot\"}\n", "\xff\xfe\x00\x01\n", "{\"cmd\":\"status\"}\r\n",
};

static void garbage_once(unsigned *s)
{
	char buf[9000];
	int c = raw_conn(1), kind = (int)(rnd(s) % 5);
	size_t n;

	if (c < 0)
		return;
	switch (kind) {
	case 0:		/* random bytes, newlines and NULs among them */
		n = 1 + rnd(s) % sizeof(buf);
		for (size_t i = 0; i < n; i++)
			buf[i] = (char)rnd(s);
		if (send(c, buf, n, MSG_NOSIGNAL) < 0)
			(void)0;
		break;
	case 1:		/* bad and odd lines, pipelined */
		for (int i = 0; i < 40; i++) {
			const char *l = bad_lines[rnd(s) % (sizeof(bad_lines) / sizeof(bad_lines[0]))];

			if (send(c, l, strlen(l), MSG_NOSIGNAL) < 0)
				break;
		}
		break;
	case 2:		/* commands whose replies are never read */
		for (int i = 0; i < 2000; i++)
			if (send(c, "{\"cmd\":\"status\"}\n", 17, MSG_NOSIGNAL) < 0)
				break;
		break;
	case 3:		/* a line past 4096 bytes, no newline */
		memset(buf, 'x', sizeof(buf));
		if (send(c, buf, sizeof(buf), MSG_NOSIGNAL) < 0)
			(void)0;
		break;
	default:	/* a hello, then garbage on what is now a client socket */
		n = (size_t)snprintf(buf, sizeof(buf), "{\"hello\":\"kdclient\",\"protocol\":%u}\n",
				     IPC_PROTOCOL_VERSION);
		if (send(c, buf, n, MSG_NOSIGNAL) < 0)
			break;
		usleep(20000);
		for (size_t i = 0; i < 6000; i++)
			buf[i] = (char)rnd(s);
		if (send(c, buf, 6000, MSG_NOSIGNAL) < 0)
			(void)0;
		break;
	}
	n_garbage++;
	usleep(rnd(s) % 50000);
	close(c);
}

/* A library client that scribbles over its own segment, then submits. */
static void scribble_once(unsigned *s)
{
	struct kd_client *c;
	int32_t p[3] = { 1, 2, 3 };
	struct kd_request r = { .prompt = p, .n_prompt = 3, .max_tokens = 4 };
	struct kd_event ev[8];
	uint64_t id;

	if (kd_connect(&c, &(struct kd_connect_opts){ .socket_path = d.sock }))
		return;
	for (int i = 0; i < 64; i++)	/* anywhere in the header and the submission ring */
		((unsigned char *)c->seg)[rnd(s) % (IPC_SUB_OFF + 4096)] = (unsigned char)rnd(s);
	kd_submit(c, &r, &id);
	kd_wait(c, ev, 8, 200);
	kd_close(c);
	n_scribbles++;
}

static void *garbage(void *arg)
{
	unsigned s = (unsigned)seed ^ (unsigned)(intptr_t)arg;

	while (!stop_actors) {
		if (rnd(&s) % 4)
			garbage_once(&s);
		else
			scribble_once(&s);
	}
	return NULL;
}

/* Connections that never say hello (some a partial one), replaced as the daemon
 * closes them. */
static void *silent(void *arg)
{
	int fds[N_SILENT];
	char b[64];

	(void)arg;
	for (int i = 0; i < N_SILENT; i++)
		fds[i] = -1;
	while (!stop_actors) {
		for (int i = 0; i < N_SILENT; i++) {
			ssize_t r = fds[i] >= 0 ? recv(fds[i], b, sizeof(b), MSG_DONTWAIT) : 0;

			if (fds[i] >= 0 && r < 0 && errno == EAGAIN)
				continue;
			if (fds[i] >= 0)
				close(fds[i]);
			if ((fds[i] = raw_conn(1)) >= 0) {
				n_silent++;
				if (i % 2 && send(fds[i], "{\"hello\":", 9, MSG_NOSIGNAL) < 0)
					(void)0;
			}
		}
		usleep(100000);
	}
	for (int i = 0; i < N_SILENT; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	return NULL;
}

/* ---- the daemon ------------------------------------------------------------------ */

static int start_daemon(void)
{
	char state[400];

	snprintf(state, sizeof(state), "%s/state", d.dir);
	mkdir(state, 0700);
	return daemontest_start(&d, "kdecd.log", "--state-dir", state, "--handshake-timeout", "2",
				"--max-pending", "32", "--shutdown-timeout", "5", "--notify", "eventfd", NULL);
}

/* One line a second to the samples file: time, RSS, descriptors, clients. */
static void sample(FILE *f, double t0)
{
	char path[64], line[256];
	long rss = -1;
	int fds = 0;
	FILE *p;

	if (!f || d.pid <= 0)
		return;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)d.pid);
	if ((p = fopen(path, "r"))) {
		while (fgets(line, sizeof(line), p))
			if (sscanf(line, "VmRSS: %ld", &rss) == 1)
				break;
		fclose(p);
	}
	snprintf(line, sizeof(line), "ls /proc/%d/fd 2>/dev/null | wc -l", (int)d.pid);
	if ((p = popen(line, "r"))) {
		if (fscanf(p, "%d", &fds) != 1)
			fds = -1;
		pclose(p);
	}
	fprintf(f, "%.1f %d %ld %d %lld\n", test_now_s() - t0, (int)d.pid, rss, fds,
		ctl("{\"cmd\":\"status\"}\n", "clients"));
	fflush(f);
}

static void run_chaos(double seconds, int restarts, FILE *samples)
{
	double t0 = test_now_s(), next_restart, next_snap = t0 + 1, next_sample = t0;
	double every = seconds / (restarts + 1);
	pthread_t th[N_HONEST + 4];
	int n_th = 0, st;

	next_restart = t0 + every;
	for (int t = 0; t < N_HONEST; t++)
		pthread_create(&th[n_th++], NULL, honest, (void *)(intptr_t)t);
	pthread_create(&th[n_th++], NULL, kill_storm, NULL);
	pthread_create(&th[n_th++], NULL, garbage, (void *)1);
	pthread_create(&th[n_th++], NULL, garbage, (void *)2);
	pthread_create(&th[n_th++], NULL, silent, NULL);
	while (test_now_s() - t0 < seconds) {
		double now = test_now_s();

		usleep(100000);
		if (waitpid(d.pid, &st, WNOHANG) == d.pid) {
			n_deaths++;
			fprintf(stderr, "kdecd died: %s %d\n", WIFEXITED(st) ? "exit" : "signal",
				WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
			d.pid = 0;
			CHECK(!start_daemon(), "kdecd did not start again after dying");
			continue;
		}
		if (now >= next_snap) {
			n_snapshots += ctl("{\"cmd\":\"snapshot\"}\n", "ok") == 1;
			next_snap = now + 1.5;
		}
		if (now >= next_sample) {
			sample(samples, t0);
			next_sample = now + 1;
		}
		if (restarts && now >= next_restart) {
			st = daemontest_stop(&d);
			CHECK(st == 0, "kdecd exited %d on SIGTERM during the chaos", st);
			CHECK(!start_daemon(), "kdecd did not start again");
			n_restarts++;
			next_restart = now + every;
		}
	}
	stop_actors = 1;
	for (int i = 0; i < n_th; i++)
		pthread_join(th[i], NULL);
}

static int count_fds(pid_t pid)
{
	char cmd[64];
	int n = -1;
	FILE *p;

	snprintf(cmd, sizeof(cmd), "ls /proc/%d/fd | wc -l", (int)pid);
	if ((p = popen(cmd, "r"))) {
		if (fscanf(p, "%d", &n) != 1)
			n = -1;
		pclose(p);
	}
	return n;
}

/* 1 when the daemon's log has text. */
static int log_has(const char *text)
{
	char path[400];
	size_t len;
	char *buf;
	int found;

	snprintf(path, sizeof(path), "%s/kdecd.log", d.dir);
	if (!(buf = test_slurp(path, &len)))
		return 0;
	found = strstr(buf, text) != NULL;
	free(buf);
	return found;
}

/* After the chaos: nothing left over (clients, requests, descriptors). */
static void check_settled(int fds0)
{
	double end = test_now_s() + 30;	/* 2 s handshake timeout; slack for ASan */
	long long clients = -1, running = -1, waiting = -1;
	int fds = -1;

	while (test_now_s() < end) {
		clients = ctl("{\"cmd\":\"status\"}\n", "clients");
		running = ctl("{\"cmd\":\"status\"}\n", "requests_running");
		waiting = ctl("{\"cmd\":\"status\"}\n", "requests_waiting");
		fds = count_fds(d.pid);
		if (!clients && !running && !waiting && fds <= fds0)
			break;
		usleep(200000);
	}
	CHECK(!clients && !running && !waiting, "left over: %lld clients, %lld running, %lld waiting",
	      clients, running, waiting);
	CHECK(fds >= 0 && fds <= fds0, "kdecd holds %d descriptors, %d before the chaos", fds, fds0);
}

int main(int argc, char **argv)
{
	const char *env = getenv("CHAOS_SECONDS"), *samples_path = NULL;
	double seconds = env ? atof(env) : 15;
	int restarts = 2, fds0;
	FILE *samples = NULL;

	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--seconds"))
			seconds = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--restarts"))
			restarts = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--samples"))
			samples_path = argv[i + 1];
	}
	seed = test_seed();
	fprintf(stderr, "chaos: %.0f s, %d restarts, seed %llu (KD_TEST_SEED)\n", seconds, restarts, seed);
	if (daemontest_init(&d, "chaos"))
		return 1;
	for (int k = 0; k < N_PROMPTS; k++) {
		n_prompt[k] = 3 + k;
		for (int j = 0; j < n_prompt[k]; j++)
			prompts[k][j] = (int32_t)((k * 53 + j * 29 + 7) % 500);
		CHECK(daemontest_reference(&d, prompts[k], n_prompt[k], GEN, refs[k]) == GEN,
		      "no reference for prompt %d", k);
	}
	if (samples_path && !(samples = fopen(samples_path, "w")))
		perror(samples_path);
	CHECK(!start_daemon(), "kdecd did not start");
	fds0 = count_fds(d.pid);
	if (!test_failures)
		run_chaos(seconds, restarts, samples);
	if (d.pid > 0)
		check_settled(fds0 + 2);	/* a restart's daemon may hold a snapshot's file */
	fprintf(stderr, "chaos: honest requests %ld matched, %ld mismatched, %ld interrupted, %ld hung; "
		"%ld kdrun killed, %ld garbage connections, %ld segment scribblers, %ld hello-less, "
		"%ld snapshots, %ld restarts, %ld deaths\n", (long)n_matched, (long)n_mismatched,
		(long)n_interrupted, (long)n_hung, (long)n_kills, (long)n_garbage, (long)n_scribbles,
		(long)n_silent, (long)n_snapshots, (long)n_restarts, (long)n_deaths);
	CHECK(n_matched >= N_HONEST, "only %ld honest requests completed", (long)n_matched);
	CHECK(!n_mismatched && !n_hung, "%ld honest outputs differ from the solo run, %ld hung",
	      (long)n_mismatched, (long)n_hung);
	CHECK(!n_deaths, "kdecd died %ld times", (long)n_deaths);
	CHECK(!log_has("runtime error") && !log_has("AddressSanitizer"), "the sanitizers reported in kdecd.log");
	if (samples)
		fclose(samples);
	daemontest_finish(&d);
	return test_result("test_chaos_daemon");
}
