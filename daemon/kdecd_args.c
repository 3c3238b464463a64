/* kdecd's command line: every option checked and stored into struct kdecd_args, the
 * usage text with the defaults it states. */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/base/cli.h"
#include "daemon/base/log.h"
#include "daemon/kdecd_args.h"

static void usage(FILE *f)
{
	char sock[256], names[64];

	ipc_default_socket(sock, sizeof(sock));
	backend_names(names, sizeof(names));
	fprintf(f,
		"usage: kdecd --model DIR|FILE.gguf [options]\n"
		"\n"
		"Serves token generation to local clients (libkdclient, kdrun) over shared memory;\n"
		"operators use kdctl on the same socket.\n"
		"\n"
		"  --model DIR             Hugging Face checkpoint (config.json + safetensors),\n"
		"                          or one GGUF file (llama.cpp's format; see docs/MODELS.md)\n"
		"  --backend NAME          auto (default: cuda where built in and a GPU is\n"
		"                          visible, else cpu; the log says which and why), or one\n"
		"                          of this build's: %s\n"
		"  --socket PATH           Unix socket (default: $XDG_RUNTIME_DIR/kdecd.sock; else\n"
		"                          /run/kdecd/kdecd.sock for root; else /tmp/kdecd-$UID/kdecd.sock;\n"
		"                          here: %s); created with mode 0660 (0666 with --allow-uid\n"
		"                          or --allow-gid: those peers are checked by SO_PEERCRED);\n"
		"                          claimed by an flock on PATH.lock for the daemon's life\n"
		"  --threads N             CPU threads of the engine (default: all online CPUs)\n"
		"  --tp N                  tensor parallel: N ranks, each holding its shard of every\n"
		"                          layer (docs/PARALLEL.md); cpu backend: ranks as threads\n"
		"                          sharing --threads; cuda: 2 or 4 virtual ranks on the\n"
		"                          one GPU, op by op (default 1)\n"
		"  --ep                    with --tp N: expert parallel, each rank a share of the\n"
		"                          routed experts whole (default: a slice of every expert)\n"
		"  --mla-cp                with --tp N on an MLA model (cpu; cuda: virtual ranks):\n"
		"                          the latent KV cache split by tokens, 1/N a rank\n"
		"                          (decode context parallel;\n"
		"                          default: replicated on every rank)\n"
		"  --allreduce A           auto (default), fused or nccl: how tp ranks on GPUs\n"
		"                          reduce (auto: the fused one-shot kernel where the ranks\n"
		"                          share a GPU or have peer access, NCCL otherwise; nccl at\n"
		"                          --tp 1: a one-rank NCCL communicator; cuda only)\n"
		"  --gpus LIST|all         the GPUs to run on (cuda), e.g. 2 or 0,1,2,3: one GPU runs\n"
		"                          every rank; several, one rank each (--tp N = their\n"
		"                          count; docs/PARALLEL.md) (default: GPU 0)\n"
		"  --max-clients N         connected clients (default %d)\n"
		"  --max-pending N         connections without a hello (kdctl's too) (default %d);\n"
		"                          past it a new one displaces the oldest of the uid\n"
		"                          holding the most\n"
		"  --handshake-timeout S   seconds a connection without a hello may make no\n"
		"                          progress (no line in, no reply byte out) (default %.0f)\n"
		"  --allow-uid U,...       uids (numbers or names) allowed besides ours and root\n"
		"  --allow-gid G,...       groups allowed (a peer's primary or supplementary group)\n"
		"  --operator-uid U,...    uids that may run kdctl drain, resume, shutdown, log-level\n"
		"                          and snapshot and see every client and session, besides\n"
		"                          ours and root (allowed too); other allowed uids only\n"
		"                          read, and see only their own clients and sessions\n"
		"  --operator-gid G,...    groups whose members are operators (allowed too)\n"
		"  --notify futex|eventfd  how daemon and clients wake each other (default futex:\n"
		"                          io_uring futex ops, Linux 6.7+; eventfd elsewhere)\n"
		"  --max-batch N           requests in the running batch (default %d)\n"
		"  --prefill-chunk N       token budget of one engine step: every running stream's\n"
		"                          decode token first, then prompt chunks of new requests\n"
		"                          (default %d; at least --max-batch), so a long prompt\n"
		"                          never holds up the streams for more than one step; with\n"
		"                          no stream decoding, prompts run in steps of up to the\n"
		"                          engine's rows (2048 on cuda, or N if larger)\n"
		"  --max-sessions N        sessions one uid keeps (KV saved between turns); a\n"
		"                          request naming a new one past it is refused (default %d)\n"
		"  --prefill-pace R        while streams decode, a step that also carries prompt\n"
		"                          chunks aims at no more than R decode-only steps' time:\n"
		"                          chunks are sized from the measured step costs\n"
		"                          (default %.1f; off: the token budget alone)\n"
		"  --kv-tokens N           KV cache capacity in tokens (default %d); requests are\n"
		"                          admitted when their prompt fits with a little room; when\n"
		"                          the cache runs short the lowest-priority, newest one is\n"
		"                          preempted and resumed later (kd_preemptions_total)\n"
		"  --decode-path P         auto (default), standard or latency: the decode kernels\n"
		"                          (latency: fused layers where the backend has them, MoE at\n"
		"                          1-8 rows on cuda; auto times both at each batch bucket's\n"
		"                          graph capture and keeps latency where it is more than\n"
		"                          1%% faster; the cpu backend refuses latency); kdctl\n"
		"                          status shows the choice\n"
		"  --no-graphs             every step op by op, no decode graphs (with --tp N on\n"
		"                          cuda: the ranks' eager path, two host barriers a reduction)\n"
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
		"  --weight-format F       with --synthetic-weights: bf16 (default), fp8-block,\n"
		"                          fp8-channel, fp8-tensor or int4-g32 linear weights\n"
		"  --check                 load and check the model, build the engine, then exit\n"
		"  --daemon                run in the background: the command returns 0 once kdecd\n"
		"                          serves (model loaded, socket open), else the exit status\n"
		"                          of the failed start after its error line\n"
		"  --pid-file F            write kdecd's pid to F once it serves (removed at exit)\n"
		"  --log-level L           error, warn, info (default), debug\n"
		"  --version, --help\n"
		"\n"
		"Runs in the foreground (unless --daemon) and logs to stderr. With NOTIFY_SOCKET\n"
		"set (systemd Type=notify) it sends READY=1 once it serves. SIGTERM or SIGINT:\n"
		"stop admitting, finish running requests within --shutdown-timeout (then cancel\n"
		"them), exit 0; a second signal stops at once. A client whose event ring stays full has its\n"
		"request paused, then cancelled after %d ms.\n",
		names, sock, SERVER_DEFAULT_MAX_CLIENTS, SERVER_DEFAULT_MAX_PENDING, SERVER_DEFAULT_HANDSHAKE_S,
		SCHED_DEFAULT_MAX_BATCH, SCHED_DEFAULT_STEP_TOKENS,
		ENGINE_DEFAULT_MAX_SESSIONS, SCHED_DEFAULT_PREFILL_PACE, ENGINE_DEFAULT_KV_TOKENS,
		ENGINE_DEFAULT_SESSION_TTL_S, ENGINE_DEFAULT_OFFLOAD_AFTER_S, SERVER_DEFAULT_SHUTDOWN_S, SCHED_DEFAULT_STALL_MS);
}

/* "1000,alice" -> ids (at most max); names through getpwnam / getgrnam. */
static int parse_ids(const char *opt, const char *s, int group, unsigned *ids, int *n, int max)
{
	char *copy = strdup(s), *save = NULL, *tok;
	int ret = 0;

	if (!copy)
		return -ENOMEM;
	for (tok = strtok_r(copy, ",", &save); tok && !ret; tok = strtok_r(NULL, ",", &save)) {
		long v;

		if (*n == max) {
			fprintf(stderr, "kdecd: %s: at most %d ids\n", opt, max);
			ret = -EINVAL;
		} else if (!cli_parse_long(tok, 0, 0x7fffffff, &v)) {
			ids[(*n)++] = (unsigned)v;
		} else if (!group && getpwnam(tok)) {
			ids[(*n)++] = getpwnam(tok)->pw_uid;
		} else if (group && getgrnam(tok)) {
			ids[(*n)++] = getgrnam(tok)->gr_gid;
		} else {
			fprintf(stderr, "kdecd: %s '%s': no such %s\n", opt, tok, group ? "group" : "user");
			ret = -EINVAL;
		}
	}
	free(copy);
	return ret;
}

/* --operator-uid / --operator-gid: the ids, and the same ids allowed. */
static int parse_operators(struct kdecd_args *a, int group, const char *arg)
{
	struct control_operators *o = &a->srv.operators;
	int *n = group ? &o->n_gid : &o->n_uid, first = *n, ret;

	ret = parse_ids(group ? "--operator-gid" : "--operator-uid", arg, group,
			group ? a->op_gids : a->op_uids, n, KDECD_MAX_OPERATORS);
	for (int i = first; !ret && i < *n; i++) {
		int *na = group ? &a->srv.n_allow_gid : &a->srv.n_allow_uid;

		if (*na == KDECD_MAX_ALLOW) {
			fprintf(stderr, "kdecd: --allow-%s with --operator-%s: at most %d ids\n",
				group ? "gid" : "uid", group ? "gid" : "uid", KDECD_MAX_ALLOW);
			return -EINVAL;
		}
		if (group)
			a->gids[(*na)++] = a->op_gids[i];
		else
			a->uids[(*na)++] = a->op_uids[i];
	}
	return ret;
}

static int parse_num(const char *opt, const char *s, long min, long max, long *out)
{
	if (cli_parse_long(s, min, max, out)) {
		fprintf(stderr, "kdecd: %s '%s': want %ld..%ld\n", opt, s, min, max);
		return -EINVAL;
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
		return -EINVAL;
	}
	*out = (int64_t)v << shift;
	return 0;
}

/* Seconds for --session-ttl and --offload-after: 1.., or -1 for never. */
static int parse_secs(const char *opt, const char *s, int *out)
{
	long v;

	if (parse_num(opt, s, -1, 1L << 30, &v))
		return -EINVAL;
	if (!v) {
		fprintf(stderr, "kdecd: %s '%s': want -1 (never) or 1..%ld\n", opt, s, 1L << 30);
		return -EINVAL;
	}
	*out = (int)v;
	return 0;
}

enum {
	O_BACKEND = 256, O_THREADS, O_SYNTH, O_KV, O_CHECK, O_LOG, O_VERSION, O_SOCKET,
	O_MAXCL, O_UID, O_GID, O_NOTIFY, O_BATCH, O_SHUT, O_SHARE, O_NOWAIT, O_TTL, O_OFFLOAD,
	O_HOSTMEM, O_STATE, O_SPEC, O_CHUNK, O_DAEMON, O_PIDFILE, O_PACE, O_PENDING, O_HANDSHAKE, O_OPUID, O_OPGID, O_MAXSESS,
	O_TP, O_GPUS, O_EP, O_MLA_CP, O_WFMT, O_DPATH, O_NOGRAPH, O_ALLRED
};

static const struct option kdecd_opts[] = {
	{ "model", required_argument, NULL, 'm' },
	{ "backend", required_argument, NULL, O_BACKEND },
	{ "socket", required_argument, NULL, O_SOCKET },
	{ "threads", required_argument, NULL, O_THREADS },
	{ "tp", required_argument, NULL, O_TP },
	{ "gpus", required_argument, NULL, O_GPUS },
	{ "ep", no_argument, NULL, O_EP },
	{ "mla-cp", no_argument, NULL, O_MLA_CP },
	{ "allreduce", required_argument, NULL, O_ALLRED },
	{ "max-clients", required_argument, NULL, O_MAXCL },
	{ "max-pending", required_argument, NULL, O_PENDING },
	{ "handshake-timeout", required_argument, NULL, O_HANDSHAKE },
	{ "allow-uid", required_argument, NULL, O_UID },
	{ "allow-gid", required_argument, NULL, O_GID },
	{ "operator-uid", required_argument, NULL, O_OPUID },
	{ "operator-gid", required_argument, NULL, O_OPGID },
	{ "notify", required_argument, NULL, O_NOTIFY },
	{ "max-batch", required_argument, NULL, O_BATCH },
	{ "prefill-chunk", required_argument, NULL, O_CHUNK },
	{ "prefill-pace", required_argument, NULL, O_PACE },
	{ "max-sessions", required_argument, NULL, O_MAXSESS },
	{ "kv-tokens", required_argument, NULL, O_KV },
	{ "decode-path", required_argument, NULL, O_DPATH },
	{ "no-graphs", no_argument, NULL, O_NOGRAPH },
	{ "shutdown-timeout", required_argument, NULL, O_SHUT },
	{ "share-prefix-cache", no_argument, NULL, O_SHARE },
	{ "no-prefix-wait", no_argument, NULL, O_NOWAIT },
	{ "spec", required_argument, NULL, O_SPEC },
	{ "session-ttl", required_argument, NULL, O_TTL },
	{ "offload-after", required_argument, NULL, O_OFFLOAD },
	{ "host-kv-mem", required_argument, NULL, O_HOSTMEM },
	{ "state-dir", required_argument, NULL, O_STATE },
	{ "synthetic-weights", no_argument, NULL, O_SYNTH },
	{ "weight-format", required_argument, NULL, O_WFMT },
	{ "check", no_argument, NULL, O_CHECK },
	{ "daemon", no_argument, NULL, O_DAEMON },
	{ "pid-file", required_argument, NULL, O_PIDFILE },
	{ "log-level", required_argument, NULL, O_LOG },
	{ "version", no_argument, NULL, O_VERSION },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

/* The options with a number: checked against their range, stored. 0 or -EINVAL. */
static int parse_opt_num(struct kdecd_args *a, int c, const char *arg)
{
	long v;

	switch (c) {
	case O_THREADS:
		if (parse_num("--threads", arg, 1, 1024, &v))
			return -EINVAL;
		a->eng.threads = (int)v;
		break;
	case O_TP:
		if (parse_num("--tp", arg, 1, 64, &v))
			return -EINVAL;
		a->eng.tp = (int)v;
		break;
	case O_MAXCL:
		if (parse_num("--max-clients", arg, 1, 4096, &v))
			return -EINVAL;
		a->srv.max_clients = (int)v;
		break;
	case O_PENDING:
		if (parse_num("--max-pending", arg, 1, 4096, &v))
			return -EINVAL;
		a->srv.max_pending = (int)v;
		break;
	case O_HANDSHAKE:
		if (parse_num("--handshake-timeout", arg, 1, 3600, &v))
			return -EINVAL;
		a->srv.handshake_timeout_s = (double)v;
		break;
	case O_BATCH:
		if (parse_num("--max-batch", arg, 1, 4096, &v))
			return -EINVAL;
		a->srv.sched.max_batch = (int)v;
		break;
	case O_CHUNK:
		if (parse_num("--prefill-chunk", arg, 1, 1L << 20, &v))
			return -EINVAL;
		a->srv.sched.step_tokens = (int)v;
		/* a step is one forward call, so its prompt chunk is one GEMM of its M
		 * (H200, Llama-3.1-8B: 1,024 tokens in 24.7 ms as one call, 36.4 ms as
		 * four of 256) */
		a->eng.min_rows = (int)v;
		break;
	case O_PACE: {
		char *end;
		double r;

		if (!strcmp(arg, "off")) {
			a->srv.sched.prefill_pace = -1;
			break;
		}
		errno = 0;
		r = strtod(arg, &end);
		if (errno || end == arg || *end || !(r >= 1.1 && r <= 100)) {
			fprintf(stderr, "kdecd: --prefill-pace '%s': want a ratio from 1.1 to 100, or off\n", arg);
			return -EINVAL;
		}
		a->srv.sched.prefill_pace = r;
		break;
	}
	case O_MAXSESS:
		if (parse_num("--max-sessions", arg, 1, 1L << 20, &v))
			return -EINVAL;
		a->eng.max_sessions = (int)v;
		break;
	case O_KV:
		if (parse_num("--kv-tokens", arg, 1, 1L << 28, &v))
			return -EINVAL;
		a->eng.kv_tokens = (int)v;
		break;
	case O_SHUT:
		if (parse_num("--shutdown-timeout", arg, 0, 86400, &v))
			return -EINVAL;
		a->srv.shutdown_timeout_s = (double)v;
		break;
	case O_TTL:
		return parse_secs("--session-ttl", arg, &a->eng.session_ttl_s);
	case O_OFFLOAD:
		return parse_secs("--offload-after", arg, &a->eng.offload_after_s);
	case O_HOSTMEM:
		if (parse_bytes("--host-kv-mem", arg, &a->eng.host_kv_bytes))
			return -EINVAL;
		if (!a->eng.host_kv_bytes)
			a->eng.host_kv_bytes = -1;	/* engine_opts: 0 is the default */
		break;
	}
	return 0;
}

/* One option c (getopt_long's) with its argument: 0, 1 (--help or --version
 * printed) or -errno. */
static int parse_opt(struct kdecd_args *a, int c, const char *arg)
{
	char err[256];

	switch (c) {
	case 'm': a->model = arg; break;
	case O_BACKEND:
		if (strcmp(arg, BACKEND_AUTO) && !backend_find(arg, err, sizeof(err))) {
			fprintf(stderr, "kdecd: --backend: %s\n", err);
			return -EINVAL;
		}
		a->eng.backend = a->srv.backend = arg;
		break;
	case O_SOCKET: a->srv.socket_path = arg; break;
	case O_SYNTH: a->load.synthetic = 1; break;
	case O_WFMT:
		if (model_weight_format_parse(arg, &a->load.weight_format, err, sizeof(err))) {
			fprintf(stderr, "kdecd: %s\n", err);
			return -EINVAL;
		}
		break;
	case O_CHECK: a->check = 1; break;
	case O_DAEMON: a->daemon = 1; break;
	case O_PIDFILE: a->pid_file = arg; break;
	case O_SHARE: a->srv.sched.share_prefix = 1; break;
	case O_NOWAIT: a->srv.sched.no_prefix_wait = 1; break;
	case O_STATE: a->srv.state_dir = arg; break;
	case O_EP: a->eng.ep = 1; break;
	case O_MLA_CP: a->eng.mla_cp = 1; break;
	case O_NOGRAPH: a->eng.no_graphs = 1; break;
	case O_GPUS:
		if (cli_parse_gpus(arg, a->eng.gpus, ENGINE_MAX_GPUS, &a->eng.n_gpus, err, sizeof(err))) {
			fprintf(stderr, "kdecd: %s\n", err);
			return -EINVAL;
		}
		break;
	case O_ALLRED:
		if (backend_allreduce_parse(arg, &a->eng.allreduce)) {
			fprintf(stderr, "kdecd: --allreduce '%s': want auto, fused or nccl\n", arg);
			return -EINVAL;
		}
		break;
	case O_DPATH:
		if (strcmp(arg, "auto") && strcmp(arg, "standard") && strcmp(arg, "latency")) {
			fprintf(stderr, "kdecd: --decode-path '%s': want auto, standard or latency\n", arg);
			return -EINVAL;
		}
		a->eng.decode_path = arg;
		break;
	case O_THREADS: case O_TP: case O_MAXCL: case O_PENDING: case O_HANDSHAKE: case O_BATCH: case O_CHUNK:
	case O_PACE: case O_MAXSESS: case O_KV: case O_SHUT:
	case O_TTL: case O_OFFLOAD: case O_HOSTMEM:
		return parse_opt_num(a, c, arg);
	case O_SPEC:
		if (spec_parse(arg, &a->srv.sched.spec, err, sizeof(err))) {
			fprintf(stderr, "kdecd: %s\n", err);
			return -EINVAL;
		}
		break;
	case O_UID:
		return parse_ids("--allow-uid", arg, 0, a->uids, &a->srv.n_allow_uid, KDECD_MAX_ALLOW);
	case O_GID:
		return parse_ids("--allow-gid", arg, 1, a->gids, &a->srv.n_allow_gid, KDECD_MAX_ALLOW);
	case O_OPUID:
	case O_OPGID:
		return parse_operators(a, c == O_OPGID, arg);
	case O_NOTIFY:
		if (!strcmp(arg, "futex")) {
			a->srv.notify = IPC_NOTIFY_FUTEX;
		} else if (!strcmp(arg, "eventfd")) {
			a->srv.notify = IPC_NOTIFY_EVENTFD;
		} else {
			fprintf(stderr, "kdecd: --notify '%s': want futex or eventfd\n", arg);
			return -EINVAL;
		}
		break;
	case O_LOG:
		if (log_level_parse(arg, &log_threshold)) {
			fprintf(stderr, "kdecd: --log-level '%s': want error, warn, info or debug\n", arg);
			return -EINVAL;
		}
		break;
	case O_VERSION:
		printf("kdecd (kdec) %s, protocol %u\n", PACKAGE_VERSION, IPC_PROTOCOL_VERSION);
		return 1;
	case 'h':
		usage(stdout);
		return 1;
	default:
		usage(stderr);
		return -EINVAL;
	}
	return 0;
}

/* What no single option says: the options together. 0 or -EINVAL. */
static int check_args(const struct kdecd_args *a)
{
	int batch = a->srv.sched.max_batch ? a->srv.sched.max_batch : SCHED_DEFAULT_MAX_BATCH;

	if (a->srv.sched.step_tokens && a->srv.sched.step_tokens < batch) {
		fprintf(stderr, "kdecd: --prefill-chunk %d: want at least --max-batch (%d)\n",
			a->srv.sched.step_tokens, batch);
		return -EINVAL;
	}
	if (!a->model) {
		fprintf(stderr, "kdecd: --model DIR|FILE.gguf is required\n");
		usage(stderr);
		return -EINVAL;
	}
	return 0;
}

int kdecd_args_parse(struct kdecd_args *a, int argc, char **argv)
{
	int c, ret;

	a->eng.backend = a->srv.backend = BACKEND_AUTO;
	a->srv.notify = IPC_NOTIFY_FUTEX;
	a->srv.shutdown_timeout_s = -1;
	a->srv.allow_uid = a->uids;
	a->srv.allow_gid = a->gids;
	a->srv.operators.uid = a->op_uids;
	a->srv.operators.gid = a->op_gids;
	while ((c = getopt_long(argc, argv, "m:h", kdecd_opts, NULL)) != -1) {
		ret = parse_opt(a, c, optarg);
		if (ret)
			return ret;
	}
	if (optind < argc) {
		fprintf(stderr, "kdecd: unexpected argument '%s'\n", argv[optind]);
		return -EINVAL;
	}
	return check_args(a);
}
