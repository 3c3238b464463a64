/* kdbench ipc: the one-way latencies of the client IPC, from the timestamps in the
 * real records: submit -> daemon pickup, and token publish -> client receipt, for 1
 * and 64 concurrent clients, sleeping (futex or eventfd) and spinning. The daemon
 * runs in this process (its own socket, engine thread and libev thread); the
 * clients are threads using libkdclient. The floor beside each figure: a raw futex
 * wake between two threads, or a cache-line hand-off between two spinning ones. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "daemon/base/cli.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/model/model.h"
#include "daemon/serve/doorbell.h"
#include "daemon/serve/server.h"
#include "ipc/ipc_futex.h"
#include "ipc/ipc_ring.h"

struct ipc_args {
	const char *model;
	int requests;		/* per client */
	int tokens;		/* per request */
	int notify;		/* enum ipc_notify */
	struct model_load_opts load;
	struct engine_opts eng;
};

struct samples {
	uint64_t *v;		/* ns */
	size_t n, cap;
	pthread_mutex_t mu;
};

struct run {
	const char *sock;
	int spin;
	int requests, tokens;
	struct samples pickup, receipt;
	int errors;
};

static void add_samples(struct samples *s, const uint64_t *v, size_t n)
{
	pthread_mutex_lock(&s->mu);
	if (s->n + n > s->cap) {
		size_t cap = (s->n + n) * 2;
		uint64_t *nv = realloc(s->v, cap * sizeof(*nv));

		if (!nv) {
			pthread_mutex_unlock(&s->mu);
			return;
		}
		s->v = nv;
		s->cap = cap;
	}
	memcpy(s->v + s->n, v, n * sizeof(*v));
	s->n += n;
	pthread_mutex_unlock(&s->mu);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static double pct(struct samples *s, double q)
{
	if (!s->n)
		return 0;
	qsort(s->v, s->n, sizeof(*s->v), cmp_u64);
	return (double)s->v[(size_t)(q * (double)(s->n - 1))] * 1e-3;
}

static void *client_main(void *arg)
{
	struct run *r = arg;
	struct kd_connect_opts o = { .socket_path = r->sock, .flags = r->spin ? KD_CONNECT_SPIN : 0,
				     .spin_us = r->spin ? 2000 : 0 };
	int32_t prompt[4] = { 1, 2, 3, 4 };
	struct kd_request req = { .prompt = prompt, .n_prompt = 4, .max_tokens = (uint32_t)r->tokens };
	uint64_t *pick = calloc((size_t)r->requests, sizeof(uint64_t));
	uint64_t *rec = calloc((size_t)r->requests * (size_t)r->tokens, sizeof(uint64_t));
	size_t n_pick = 0, n_rec = 0;
	struct kd_event ev[64];
	struct kd_client *c;

	if (!pick || !rec || kd_connect(&c, &o)) {
		__atomic_add_fetch(&r->errors, 1, __ATOMIC_RELAXED);
		goto out;
	}
	for (int q = 0; q < r->requests; q++) {
		int done = 0;

		prompt[0] = q % 500;
		if (kd_submit(c, &req, NULL))
			break;
		while (!done) {
			int n = kd_wait(c, ev, 64, 30000);

			if (n <= 0) {
				__atomic_add_fetch(&r->errors, 1, __ATOMIC_RELAXED);
				done = 1;
			}
			for (int i = 0; i < n; i++) {
				if (ev[i].index == 0 && ev[i].token >= 0 && n_pick < (size_t)r->requests)
					pick[n_pick++] = ev[i].t_pickup_ns - ev[i].t_submit_ns;
				if (ev[i].token >= 0 && n_rec < (size_t)r->requests * (size_t)r->tokens)
					rec[n_rec++] = ev[i].t_receive_ns - ev[i].t_publish_ns;
				done |= !!(ev[i].flags & KD_EVENT_FINAL);
			}
		}
	}
	kd_close(c);
	add_samples(&r->pickup, pick, n_pick);
	add_samples(&r->receipt, rec, n_rec);
out:
	free(pick);
	free(rec);
	return NULL;
}

struct served {
	struct ev_loop *loop;
	struct server *srv;
};

static void *loop_main(void *arg)
{
	struct served *sv = arg;

	ev_run(sv->loop, 0);
	server_destroy(sv->srv);
	return NULL;
}

static void send_shutdown(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	const char *cmd = "{\"cmd\":\"shutdown\"}\n";
	char buf[64];
	int s = socket(AF_UNIX, SOCK_STREAM, 0);

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
	if (s >= 0 && !connect(s, (struct sockaddr *)&sa, sizeof(sa)) &&
	    write(s, cmd, strlen(cmd)) > 0 && read(s, buf, sizeof(buf)) < 0)
		fprintf(stderr, "kdbench ipc: no answer to shutdown\n");
	if (s >= 0)
		close(s);
}

/* One table row: n clients, sleeping or spinning. */
static int measure(struct engine *e, const struct ipc_args *a, const char *dir, int n, int spin,
		   double floor_us)
{
	struct server_opts so = { .notify = (enum ipc_notify)a->notify, .shutdown_timeout_s = 5,
				  .max_clients = n + 4 };
	struct run r = { .spin = spin, .requests = a->requests, .tokens = a->tokens };
	struct served sv;
	pthread_t lt, *th = calloc((size_t)n, sizeof(*th));
	char sock[100], err[512] = "";
	int ret;

	snprintf(sock, sizeof(sock), "%.80s/kdbench-ipc.sock", dir);
	so.socket_path = r.sock = sock;
	pthread_mutex_init(&r.pickup.mu, NULL);
	pthread_mutex_init(&r.receipt.mu, NULL);
	sv.loop = ev_loop_new(EVFLAG_AUTO);
	if (!th || !sv.loop || (ret = server_create(&sv.srv, sv.loop, e, &so, err, sizeof(err)))) {
		fprintf(stderr, "kdbench ipc: %s\n", err[0] ? err : "cannot start the daemon side");
		free(th);
		return -1;
	}
	pthread_create(&lt, NULL, loop_main, &sv);
	for (int i = 0; i < n; i++)
		pthread_create(&th[i], NULL, client_main, &r);
	for (int i = 0; i < n; i++)
		pthread_join(th[i], NULL);
	send_shutdown(sock);
	pthread_join(lt, NULL);
	ev_loop_destroy(sv.loop);
	printf("%7d  %-5s %-7s  %9.1f %9.1f   %9.1f %9.1f   %7.1f   %6zu %7zu%s\n", n,
	       spin ? "spin" : "sleep", a->notify == IPC_NOTIFY_FUTEX ? "futex" : "eventfd",
	       pct(&r.pickup, 0.5), pct(&r.pickup, 0.99), pct(&r.receipt, 0.5), pct(&r.receipt, 0.99),
	       floor_us, r.pickup.n, r.receipt.n, r.errors ? "  (errors)" : "");
	fflush(stdout);
	free(r.pickup.v);
	free(r.receipt.v);
	free(th);
	return r.errors ? -1 : 0;
}

/* ---- floors ---------------------------------------------------------------- */

static _Atomic uint32_t ping_word;
static _Atomic uint64_t ping_t;
static _Atomic int ping_stop;

static void *floor_futex_waiter(void *arg)
{
	uint64_t *lat = arg;

	for (int i = 0; i < 2000 && !atomic_load(&ping_stop); i++) {
		uint32_t v = atomic_load(&ping_word);

		while (atomic_load(&ping_word) == v)
			ipc_futex_wait(&ping_word, v, 100000000);
		lat[i] = ipc_now_ns() - atomic_load(&ping_t);
	}
	return NULL;
}

static void *floor_spin_waiter(void *arg)
{
	uint64_t *lat = arg;

	for (int i = 0; i < 2000 && !atomic_load(&ping_stop); i++) {
		uint32_t v = atomic_load(&ping_word);

		while (atomic_load_explicit(&ping_word, memory_order_acquire) == v)
			ipc_cpu_relax();
		lat[i] = ipc_now_ns() - atomic_load(&ping_t);
	}
	return NULL;
}

/* p50 one-way latency in us of a futex wake (spin = 0) or a spinning hand-off. */
static double floor_us(int spin)
{
	static uint64_t lat[2000];
	struct samples s = { .v = lat, .n = 2000 };
	pthread_t th;

	memset(lat, 0, sizeof(lat));
	atomic_store(&ping_stop, 0);
	pthread_create(&th, NULL, spin ? floor_spin_waiter : floor_futex_waiter, lat);
	for (int i = 0; i < 2000; i++) {
		usleep(spin ? 20 : 200);	/* let the waiter settle into its wait */
		atomic_store(&ping_t, ipc_now_ns());
		atomic_fetch_add(&ping_word, 1);
		if (!spin)
			ipc_futex_wake(&ping_word, 1);
	}
	atomic_store(&ping_stop, 1);	/* the waiter may have missed some bumps */
	atomic_fetch_add(&ping_word, 1);
	ipc_futex_wake(&ping_word, 1);
	pthread_join(th, NULL);
	return pct(&s, 0.5);
}

int kdbench_ipc_main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "requests", required_argument, NULL, 'r' },
		{ "tokens", required_argument, NULL, 't' },
		{ "threads", required_argument, NULL, 'j' },
		{ "notify", required_argument, NULL, 'n' },
		{ "synthetic-weights", no_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	struct ipc_args a = { .requests = 50, .tokens = 16, .notify = IPC_NOTIFY_FUTEX };
	char tmpl[] = "/tmp/kdbench_ipc.XXXXXX", err[512] = "";
	struct model *m = NULL;
	struct engine *e = NULL;
	double f_sleep, f_spin;
	long v;
	int c, ret = 0;

	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'm': a.model = optarg; break;
		case 's': a.load.synthetic = 1; break;
		case 'r':
		case 't':
		case 'j':
			if (cli_parse_long(optarg, 1, 100000, &v)) {
				fprintf(stderr, "kdbench ipc: bad number '%s'\n", optarg);
				return 2;
			}
			*(c == 'r' ? &a.requests : c == 't' ? &a.tokens : &a.eng.threads) = (int)v;
			break;
		case 'n':
			a.notify = !strcmp(optarg, "eventfd") ? IPC_NOTIFY_EVENTFD : IPC_NOTIFY_FUTEX;
			break;
		default:
			fprintf(c == 'h' ? stdout : stderr,
				"usage: kdbench ipc --model DIR|FILE.gguf [--requests N] [--tokens N] [--threads N]\n"
				"                   [--notify futex|eventfd] [--synthetic-weights]\n"
				"One-way IPC latencies (submit -> pickup, publish -> receipt), p50/p99 in us,\n"
				"for 1 and 64 clients, sleeping and spinning; requests per client (default 50)\n"
				"of N tokens (default 16).\n");
			return c == 'h' ? 0 : 2;
		}
	}
	if (!a.model) {
		fprintf(stderr, "kdbench ipc: --model DIR|FILE.gguf is required\n");
		return 2;
	}
	if (a.notify == IPC_NOTIFY_FUTEX && doorbell_probe_futex(err, sizeof(err))) {
		fprintf(stderr, "kdbench ipc: %s; use --notify eventfd\n", err);
		return 1;
	}
	if (!mkdtemp(tmpl))
		return 1;
	log_threshold = LOG_WARN;
	if ((ret = model_load(&m, a.model, &a.load, err, sizeof(err))) ||
	    (ret = engine_create(&e, m, &a.eng, err, sizeof(err)))) {
		fprintf(stderr, "kdbench ipc: %s\n", err);
		goto out;
	}
	f_sleep = floor_us(0);
	f_spin = floor_us(1);
	printf("kdbench ipc: %s, %d requests x %d tokens per client; one-way latencies in us\n",
	       a.model, a.requests, a.tokens);
	printf("%7s  %-5s %-7s  %9s %9s   %9s %9s   %7s   %6s %7s\n", "clients", "wait", "notify",
	       "pickup50", "pickup99", "receipt50", "receipt99", "floor50", "n_pick", "n_recv");
	for (int spin = 0; spin <= 1 && !ret; spin++)
		for (int n = 1; n <= 64 && !ret; n = n == 1 ? 64 : 65)
			ret = measure(e, &a, tmpl, n, spin, spin ? f_spin : f_sleep);
	printf("floor50: p50 of a raw futex wake between two threads (sleep rows) or of a cache-line\n"
	       "hand-off between two spinning threads (spin rows), measured here, now.\n");
out:
	rmdir(tmpl);
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}
