/* kdecd: the decode daemon. This release loads and checks the model, builds the engine
 * (KV cache included) and runs the main loop until SIGTERM; serving clients over shared
 * memory arrives with the IPC layer (docs/ARCHITECTURE.md). */
#include <errno.h>
#include <ev.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "daemon/cli.h"
#include "daemon/engine.h"
#include "daemon/log.h"
#include "daemon/model.h"

struct daemon_args {
	const char *model;
	int check;
	struct model_load_opts load;
	struct engine_opts eng;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kdecd --model DIR [options]\n"
		"\n"
		"  --model DIR           Hugging Face checkpoint (config.json + safetensors)\n"
		"  --backend NAME        cpu (default)\n"
		"  --threads N           CPU threads (default: all online CPUs)\n"
		"  --synthetic-weights   deterministic random weights (benchmarks)\n"
		"  --kv-tokens N         KV cache capacity in tokens (default %d)\n"
		"  --check               load and check the model, build the engine, then exit\n"
		"  --log-level L         error, warn, info (default), debug\n"
		"  --version, --help\n"
		"\n"
		"Runs in the foreground and logs to stderr; SIGTERM or SIGINT stops it.\n"
		"Serving clients (libkdclient, kdrun, kdctl) arrives with the IPC layer.\n",
		ENGINE_DEFAULT_KV_TOKENS);
}

static int parse_args(int argc, char **argv, struct daemon_args *a)
{
	enum { O_BACKEND = 256, O_THREADS, O_SYNTH, O_KV, O_CHECK, O_LOG, O_VERSION };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "backend", required_argument, NULL, O_BACKEND },
		{ "threads", required_argument, NULL, O_THREADS },
		{ "synthetic-weights", no_argument, NULL, O_SYNTH },
		{ "kv-tokens", required_argument, NULL, O_KV },
		{ "check", no_argument, NULL, O_CHECK },
		{ "log-level", required_argument, NULL, O_LOG },
		{ "version", no_argument, NULL, O_VERSION },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c;

	while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
		switch (c) {
		case 'm': a->model = optarg; break;
		case O_BACKEND: a->eng.backend = optarg; break;
		case O_SYNTH: a->load.synthetic = 1; break;
		case O_CHECK: a->check = 1; break;
		case O_THREADS:
			if (cli_parse_long(optarg, 1, 1024, &v)) {
				fprintf(stderr, "kdecd: --threads '%s': want 1..1024\n", optarg);
				return -1;
			}
			a->eng.threads = (int)v;
			break;
		case O_KV:
			if (cli_parse_long(optarg, 1, 1L << 28, &v)) {
				fprintf(stderr, "kdecd: --kv-tokens '%s': want 1..%ld\n", optarg, 1L << 28);
				return -1;
			}
			a->eng.kv_tokens = (int)v;
			break;
		case O_LOG:
			if (log_level_parse(optarg, &log_threshold)) {
				fprintf(stderr, "kdecd: --log-level '%s': want error, warn, info or debug\n", optarg);
				return -1;
			}
			break;
		case O_VERSION:
			printf("kdecd (kdec) %s\n", PACKAGE_VERSION);
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
	if (!a->model) {
		fprintf(stderr, "kdecd: --model DIR is required\n");
		usage(stderr);
		return -1;
	}
	return 0;
}

static void on_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
	(void)revents;
	log_info("signal %d: shutting down", w->signum);
	ev_break(loop, EVBREAK_ALL);
}

int main(int argc, char **argv)
{
	struct daemon_args a = { 0 };
	struct model *m = NULL;
	struct engine *e = NULL;
	struct ev_loop *loop;
	ev_signal sig_term, sig_int;
	char err[512] = "";
	double t0;
	int ret;

	if (parse_args(argc, argv, &a))
		return 2;
	signal(SIGPIPE, SIG_IGN);
	t0 = cli_now();
	ret = model_load(&m, a.model, &a.load, err, sizeof(err));
	if (!ret)
		ret = engine_create(&e, m, &a.eng, err, sizeof(err));
	if (ret) {
		log_error("%s", err[0] ? err : strerror(-ret));
		goto out;
	}
	log_info("model %s: %s, %d layers, %.1f MiB of weights; KV cache %.1f MiB; ready in %.2f s",
		 a.model, m->cfg.model_type, m->cfg.n_layers, (double)m->weight_bytes / (1 << 20),
		 (double)e->fwd->kv_bytes / (1 << 20), cli_now() - t0);
	if (a.check)
		goto out;

	loop = ev_default_loop(EVFLAG_AUTO);
	if (!loop) {
		log_error("libev: cannot initialise the event loop");
		ret = -EIO;
		goto out;
	}
	ev_signal_init(&sig_term, on_signal, SIGTERM);
	ev_signal_init(&sig_int, on_signal, SIGINT);
	ev_signal_start(loop, &sig_term);
	ev_signal_start(loop, &sig_int);
	log_info("running (pid %ld); client serving arrives with the IPC layer", (long)getpid());
	ev_run(loop, 0);
	ev_loop_destroy(loop);
out:
	engine_destroy(e);
	model_destroy(m);
	return ret ? 1 : 0;
}
