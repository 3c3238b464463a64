/* kdecd: the decode daemon. Loads the model, builds the engine, then serves local
 * clients over shared memory (daemon/serve/server.c, the engine thread) until SIGTERM:
 * the first stops admitting and lets running requests finish, a second stops now. */
#include <errno.h>
#include <ev.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "daemon/base/cli.h"
#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/model/model.h"
#include "daemon/serve/doorbell.h"
#include "daemon/serve/server.h"

#define MAX_ALLOW 64

struct daemon_args {
	const char *model;
	int check;
	struct model_load_opts load;
	struct engine_opts eng;
	struct server_opts srv;
	uid_t uids[MAX_ALLOW];
	gid_t gids[MAX_ALLOW];
};

static void usage(FILE *f)
{
	char sock[256];

	ipc_default_socket(sock, sizeof(sock));
	fprintf(f,
		"usage: kdecd --model DIR|FILE.gguf [options]\n"
		"\n"
		"Serves token generation to local clients (libkdclient, kdrun) over shared memory;\n"
		"operators use kdctl on the same socket.\n"
		"\n"
		"  --model DIR             Hugging Face checkpoint (config.json + safetensors),\n"
		"                          or one GGUF file (llama.cpp's format; see docs/MODELS.md)\n"
		"  --backend NAME          cpu (default)\n"
		"  --socket PATH           Unix socket (default: $XDG_RUNTIME_DIR/kdecd.sock; else\n"
		"                          /run/kdecd/kdecd.sock for root; else /tmp/kdecd-$UID/kdecd.sock;\n"
		"                          here: %s); created with mode 0660\n"
		"  --threads N             CPU threads of the engine (default: all online CPUs)\n"
		"  --max-clients N         connected clients (default %d)\n"
		"  --allow-uid U,...       uids (numbers or names) allowed besides ours and root\n"
		"  --allow-gid G,...       groups allowed (a peer's primary or supplementary group)\n"
		"  --notify futex|eventfd  how daemon and clients wake each other (default futex:\n"
		"                          io_uring futex ops, Linux 6.7+; eventfd elsewhere)\n"
		"  --max-batch N           requests in the running batch (default %d)\n"
		"  --prefill-chunk N       token budget of one engine step: every running stream's\n"
		"                          decode token first, then prompt chunks of new requests\n"
		"                          (default %d; at least --max-batch), so a long prompt\n"
		"                          never holds up the streams for more than one step\n"
		"  --kv-tokens N           KV cache capacity in tokens (default %d); requests are\n"
		"                          admitted when their prompt fits with a little room; when\n"
		"                          the cache runs short the lowest-priority, newest one is\n"
		"                          preempted and resumed later (kd_preemptions_total)\n"
		"  --share-prefix-cache    share cached prompt prefixes across uids (default: per uid)\n"
		"  --no-prefix-wait        admit a request at once even while another one is still\n"
		"                          prefilling the same prompt prefix (default: wait for\n"
		"                          its blocks and map them from the prefix cache)\n"
		"  --spec ngram:k=N[,n=M]  n-gram speculative decoding: N drafts per step matching\n"
		"                          the last M..1 tokens (default M 3), verified by each\n"
		"                          request's own draws (tokens as without it); requests\n"
		"                          may opt in or out (default: off)\n"
		"  --session-ttl S         seconds an idle session lives (default %d; -1: forever)\n"
		"  --offload-after S       idle seconds before a session's KV moves to host memory\n"
		"                          (default %d; -1: only under memory pressure)\n"
		"  --host-kv-mem BYTES     host tier budget, suffix K, M or G (default 1G; 0: none)\n"
		"  --state-dir DIR         sessions are saved here at shutdown and on kdctl snapshot,\n"
		"                          and loaded at start\n"
		"  --shutdown-timeout S    seconds running requests get after SIGTERM (default %.0f)\n"
		"  --synthetic-weights     deterministic random weights (benchmarks)\n"
		"  --check                 load and check the model, build the engine, then exit\n"
		"  --log-level L           error, warn, info (default), debug\n"
		"  --version, --help\n"
		"\n"
		"Runs in the foreground and logs to stderr. SIGTERM or SIGINT: stop admitting,\n"
		"finish running requests within --shutdown-timeout (then cancel them), exit 0;\n"
		"a second signal stops at once. A client whose event ring stays full has its\n"
		"request paused, then cancelled after %d ms.\n",
		sock, SERVER_DEFAULT_MAX_CLIENTS, SCHED_DEFAULT_MAX_BATCH, SCHED_DEFAULT_STEP_TOKENS,
		ENGINE_DEFAULT_KV_TOKENS,
		ENGINE_DEFAULT_SESSION_TTL_S, ENGINE_DEFAULT_OFFLOAD_AFTER_S, SERVER_DEFAULT_SHUTDOWN_S, SCHED_DEFAULT_STALL_MS);
}

/* "1000,alice" -> ids; names through getpwnam / getgrnam. */
static int parse_ids(const char *opt, const char *s, int group, unsigned *ids, int *n)
{
	char *copy = strdup(s), *save = NULL, *tok;
	int ret = 0;

	if (!copy)
		return -1;
	for (tok = strtok_r(copy, ",", &save); tok && !ret; tok = strtok_r(NULL, ",", &save)) {
		long v;

		if (*n == MAX_ALLOW) {
			fprintf(stderr, "kdecd: %s: at most %d ids\n", opt, MAX_ALLOW);
			ret = -1;
		} else if (!cli_parse_long(tok, 0, 0x7fffffff, &v)) {
			ids[(*n)++] = (unsigned)v;
		} else if (!group && getpwnam(tok)) {
			ids[(*n)++] = getpwnam(tok)->pw_uid;
		} else if (group && getgrnam(tok)) {
			ids[(*n)++] = getgrnam(tok)->gr_gid;
		} else {
			fprintf(stderr, "kdecd: %s '%s': no such %s\n", opt, tok, group ? "group" : "user");
			ret = -1;
		}
	}
	free(copy);
	return ret;
}

static int parse_num(const char *opt, const char *s, long min, long max, long *out)
{
	if (cli_parse_long(s, min, max, out)) {
		fprintf(stderr, "kdecd: %s '%s': want %ld..%ld\n", opt, s, min, max);
		return -1;
	}
	return 0;
}

/* "512M" -> bytes (K, M, G: powers of 1024). */
static int parse_bytes(const char *opt, const char *s, int64_t *out)
{
	char *end;
	long long v;
	int shift = 0;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (*end && !end[1])
		shift = *end == 'K' || *end == 'k' ? 10 : *end == 'M' || *end == 'm' ? 20 :
			*end == 'G' || *end == 'g' ? 30 : -1;
	else if (*end)
		shift = -1;
	if (errno || end == s || v < 0 || shift < 0 || v > (INT64_MAX >> shift)) {
		fprintf(stderr, "kdecd: %s '%s': want bytes, with K, M or G\n", opt, s);
		return -1;
	}
	*out = (int64_t)v << shift;
	return 0;
}

/* Seconds for --session-ttl and --offload-after: 1.., or -1 for never. */
static int parse_secs(const char *opt, const char *s, int *out)
{
	long v;

	if (parse_num(opt, s, -1, 1L << 30, &v))
		return -1;
	if (!v) {
		fprintf(stderr, "kdecd: %s '%s': want -1 (never) or 1..%ld\n", opt, s, 1L << 30);
		return -1;
	}
	*out = (int)v;
	return 0;
}

static int parse_args(int argc, char **argv, struct daemon_args *a)
{
	enum { O_BACKEND = 256, O_THREADS, O_SYNTH, O_KV, O_CHECK, O_LOG, O_VERSION, O_SOCKET,
	       O_MAXCL, O_UID, O_GID, O_NOTIFY, O_BATCH, O_SHUT, O_SHARE, O_NOWAIT, O_TTL, O_OFFLOAD,
	       O_HOSTMEM, O_STATE, O_SPEC, O_CHUNK };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "backend", required_argument, NULL, O_BACKEND },
		{ "socket", required_argument, NULL, O_SOCKET },
		{ "threads", required_argument, NULL, O_THREADS },
		{ "max-clients", required_argument, NULL, O_MAXCL },
		{ "allow-uid", required_argument, NULL, O_UID },
		{ "allow-gid", required_argument, NULL, O_GID },
		{ "notify", required_argument, NULL, O_NOTIFY },
		{ "max-batch", required_argument, NULL, O_BATCH },
		{ "prefill-chunk", required_argument, NULL, O_CHUNK },
		{ "kv-tokens", required_argument, NULL, O_KV },
		{ "shutdown-timeout", required_argument, NULL, O_SHUT },
		{ "share-prefix-cache", no_argument, NULL, O_SHARE },
		{ "no-prefix-wait", no_argument, NULL, O_NOWAIT },
		{ "spec", required_argument, NULL, O_SPEC },
		{ "session-ttl", required_argument, NULL, O_TTL },
		{ "offload-after", required_argument, NULL, O_OFFLOAD },
		{ "host-kv-mem", required_argument, NULL, O_HOSTMEM },
		{ "state-dir", required_argument, NULL, O_STATE },
		{ "synthetic-weights", no_argument, NULL, O_SYNTH },
		{ "check", no_argument, NULL, O_CHECK },
		{ "log-level", required_argument, NULL, O_LOG },
		{ "version", no_argument, NULL, O_VERSION },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c;

	a->srv.notify = IPC_NOTIFY_FUTEX;
	a->srv.shutdown_timeout_s = -1;
	a->srv.allow_uid = a->uids;
	a->srv.allow_gid = a->gids;
	while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
		switch (c) {
		case 'm': a->model = optarg; break;
		case O_BACKEND: a->eng.backend = a->srv.backend = optarg; break;
		case O_SOCKET: a->srv.socket_path = optarg; break;
		case O_SYNTH: a->load.synthetic = 1; break;
		case O_CHECK: a->check = 1; break;
		case O_THREADS:
			if (parse_num("--threads", optarg, 1, 1024, &v))
				return -1;
			a->eng.threads = (int)v;
			break;
		case O_MAXCL:
			if (parse_num("--max-clients", optarg, 1, 4096, &v))
				return -1;
			a->srv.max_clients = (int)v;
			break;
		case O_BATCH:
			if (parse_num("--max-batch", optarg, 1, 4096, &v))
				return -1;
			a->srv.sched.max_batch = (int)v;
			break;
		case O_CHUNK:
			if (parse_num("--prefill-chunk", optarg, 1, 1L << 20, &v))
				return -1;
			a->srv.sched.step_tokens = (int)v;
			break;
		case O_KV:
			if (parse_num("--kv-tokens", optarg, 1, 1L << 28, &v))
				return -1;
			a->eng.kv_tokens = (int)v;
			break;
		case O_SHUT:
			if (parse_num("--shutdown-timeout", optarg, 0, 86400, &v))
				return -1;
			a->srv.shutdown_timeout_s = (double)v;
			break;
		case O_SHARE: a->srv.sched.share_prefix = 1; break;
		case O_NOWAIT: a->srv.sched.no_prefix_wait = 1; break;
		case O_SPEC: {
			char err[256];

			if (spec_parse(optarg, &a->srv.sched.spec, err, sizeof(err))) {
				fprintf(stderr, "kdecd: %s\n", err);
				return -1;
			}
			break;
		}
		case O_STATE: a->srv.state_dir = optarg; break;
		case O_TTL:
			if (parse_secs("--session-ttl", optarg, &a->eng.session_ttl_s))
				return -1;
			break;
		case O_OFFLOAD:
			if (parse_secs("--offload-after", optarg, &a->eng.offload_after_s))
				return -1;
			break;
		case O_HOSTMEM:
			if (parse_bytes("--host-kv-mem", optarg, &a->eng.host_kv_bytes))
				return -1;
			if (!a->eng.host_kv_bytes)
				a->eng.host_kv_bytes = -1;	/* engine_opts: 0 is the default */
			break;
		case O_UID:
			if (parse_ids("--allow-uid", optarg, 0, a->uids, &a->srv.n_allow_uid))
				return -1;
			break;
		case O_GID:
			if (parse_ids("--allow-gid", optarg, 1, a->gids, &a->srv.n_allow_gid))
				return -1;
			break;
		case O_NOTIFY:
			if (!strcmp(optarg, "futex")) {
				a->srv.notify = IPC_NOTIFY_FUTEX;
			} else if (!strcmp(optarg, "eventfd")) {
				a->srv.notify = IPC_NOTIFY_EVENTFD;
			} else {
				fprintf(stderr, "kdecd: --notify '%s': want futex or eventfd\n", optarg);
				return -1;
			}
			break;
		case O_LOG:
			if (log_level_parse(optarg, &log_threshold)) {
				fprintf(stderr, "kdecd: --log-level '%s': want error, warn, info or debug\n", optarg);
				return -1;
			}
			break;
		case O_VERSION:
			printf("kdecd (kdec) %s, protocol %u\n", PACKAGE_VERSION, IPC_PROTOCOL_VERSION);
			exit(0);
		case 'h':
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kdecd: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	if (a->srv.sched.step_tokens &&
	    a->srv.sched.step_tokens < (a->srv.sched.max_batch ? a->srv.sched.max_batch : SCHED_DEFAULT_MAX_BATCH)) {
		fprintf(stderr, "kdecd: --prefill-chunk %d: want at least --max-batch (%d)\n", a->srv.sched.step_tokens,
			a->srv.sched.max_batch ? a->srv.sched.max_batch : SCHED_DEFAULT_MAX_BATCH);
		return -1;
	}
	if (!a->model) {
		fprintf(stderr, "kdecd: --model DIR|FILE.gguf is required\n");
		usage(stderr);
		return -1;
	}
	return 0;
}

static int n_signals;

static void on_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
	struct server *s = w->data;

	(void)loop;
	(void)revents;
	if (++n_signals == 1) {
		log_info("signal %d: shutting down", w->signum);
		server_shutdown(s);
	} else {
		log_info("signal %d again: stopping now", w->signum);
		server_stop_now(s);
	}
}

/* Sessions saved by an earlier run: a refused snapshot is one line, no failure. */
static void load_state(struct engine *e, const char *dir)
{
	char err[512] = "";
	int loaded = 0, skipped = 0, ret;

	ret = engine_snapshot_load(e, dir, &loaded, &skipped, err, sizeof(err));
	if (ret == -ENOENT)
		log_info("state dir %s: no snapshot yet", dir);
	else if (ret)
		log_warn("state dir %s: snapshot not loaded: %s", dir, err[0] ? err : strerror(-ret));
	else
		log_info("state dir %s: %d sessions loaded, %d skipped (host memory)", dir, loaded, skipped);
}

static int serve(struct daemon_args *a, struct engine *e)
{
	struct ev_loop *loop = ev_default_loop(EVFLAG_AUTO);
	struct server *s = NULL;
	ev_signal sig_term, sig_int;
	char err[512] = "";
	int ret;

	if (!loop) {
		log_error("libev: cannot initialise the event loop");
		return -EIO;
	}
	if (a->srv.notify == IPC_NOTIFY_FUTEX && (ret = doorbell_probe_futex(err, sizeof(err)))) {
		log_error("%s; start kdecd with --notify eventfd", err);
		return ret;
	}
	if ((ret = server_create(&s, loop, e, &a->srv, err, sizeof(err)))) {
		log_error("%s", err);
		return ret;
	}
	ev_signal_init(&sig_term, on_signal, SIGTERM);
	ev_signal_init(&sig_int, on_signal, SIGINT);
	sig_term.data = sig_int.data = s;
	ev_signal_start(loop, &sig_term);
	ev_signal_start(loop, &sig_int);
	log_info("running (pid %ld): socket %s, notify %s", (long)getpid(), server_socket_path(s),
		 a->srv.notify == IPC_NOTIFY_FUTEX ? "futex" : "eventfd");
	ev_run(loop, 0);
	server_destroy(s);
	ev_signal_stop(loop, &sig_term);
	ev_signal_stop(loop, &sig_int);
	log_info("stopped");
	return 0;
}

int main(int argc, char **argv)
{
	struct daemon_args a = { 0 };
	struct model *m = NULL;
	struct engine *e = NULL;
	char err[512] = "";
	double t0;
	int ret;

	if (parse_args(argc, argv, &a))
		return 2;
	signal(SIGPIPE, SIG_IGN);
	t0 = clock_now();
	ret = model_load(&m, a.model, &a.load, err, sizeof(err));
	if (!ret)
		ret = engine_create(&e, m, &a.eng, err, sizeof(err));
	if (ret) {
		log_error("%s", err[0] ? err : strerror(-ret));
		goto out;
	}
	log_info("model %s: %s, %d layers, %.1f MiB of weights; KV cache %.1f MiB; ready in %.2f s",
		 a.model, m->cfg.model_type, m->cfg.n_layers, (double)m->weight_bytes / (1 << 20),
		 (double)e->fwd->kv_bytes / (1 << 20), clock_now() - t0);
	if (!a.check && a.srv.state_dir)
		load_state(e, a.srv.state_dir);
	if (!a.check)
		ret = serve(&a, e);
out:
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}
