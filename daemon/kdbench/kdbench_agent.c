/* kdbench agent: agent-shaped traffic against a live kdecd. N sessions hold
 * multi-turn conversations (each turn re-sends the history, the answer and new
 * "tool output" tokens under a session name), pause between turns, sometimes fork
 * sub-agents on the parent's prefix; bounded in time and count, then drained.
 *
 * One thread and one libkdclient handle per session: a session is a blocking
 * sequence (submit, wait, think, repeat), the handle's one-submitter/one-receiver
 * rule holds trivially, and each session is a separate client as agents are; the
 * threads sleep in kd_wait or in their pauses, so 256 of them cost little. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "daemon/kdbench/kdbench.h"
#include "daemon/kdbench/kdbench_agent.h"

#define DRAIN_AFTER_CANCEL_NS 2000000000ull	/* finals after a cancel: wait this long */
#define THINK_SIGMA 1.0				/* log-normal shape of the pauses */
#define THINK_CAP 20.0				/* no pause past 20 x the mean */
#define LONG_TAIL_NS 2000000000ull		/* the run goes on this long after the long prompt */

static struct {
	struct agent_run *run;
	const int32_t *system;		/* (n_system) the system prompt every session shares */
	int n_system;
	atomic_long next_req;		/* records reserved */
	atomic_int stop;		/* 1: submit nothing new */
	atomic_ullong t_stop;		/* when stop was set, ns */
	atomic_int live;		/* session threads still running */
	atomic_int errors;
	atomic_ullong long_end;		/* the long prompt's end, ns; 0: not yet */
} ctl;

/* One request in flight on a session's handle. */
struct pending {
	uint64_t id;
	struct agent_req *r;
	int32_t *ids;		/* (r->max_tokens) the tokens, for the next turn's history */
	int done, cancelled;
};

struct session {
	int idx;		/* -1: the long-prompt client */
	uint64_t rng;
	struct kd_client *c;
	int32_t *hist;		/* (max_context) the conversation so far */
	int n_hist;
	char name[32];		/* "kdb<pid>-<idx>": sub-agents add ".<k>" */
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t rng_next(uint64_t *s)	/* splitmix64 */
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s)	/* (0, 1) */
{
	return ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
}

static void rng_tokens(uint64_t *s, int vocab, int32_t *out, int n)
{
	for (int i = 0; i < n; i++)
		out[i] = (int32_t)(rng_next(s) % (uint64_t)vocab);
}

/* A pause in ms, log-normal with the given mean: think and tool times are skewed,
 * most short and a few long, which an exponential's mode at 0 does not capture. */
static double think_draw(uint64_t *s, double mean_ms)
{
	double mu, z, v;

	if (mean_ms <= 0)
		return 0;
	mu = log(mean_ms) - THINK_SIGMA * THINK_SIGMA / 2;
	z = sqrt(-2 * log(rng_unit(s))) * cos(2 * M_PI * rng_unit(s));
	v = exp(mu + THINK_SIGMA * z);
	return v < THINK_CAP * mean_ms ? v : THINK_CAP * mean_ms;
}

/* Sleeps ms unless the run stops first. */
static void pause_ms(double ms)
{
	uint64_t end = now_ns() + (uint64_t)(ms * 1e6);

	while (!atomic_load(&ctl.stop)) {
		uint64_t t = now_ns();
		uint64_t step = end > t ? end - t : 0;

		if (!step)
			return;
		if (step > 20000000)
			step = 20000000;
		nanosleep(&(struct timespec){ 0, (long)step }, NULL);
	}
}

/* Reserves a record (idx < 0: the long prompt's) and submits. 0, -ENOSPC (the
 * count is spent or the run stopped), or -errno of kd_submit. */
static int submit(struct session *s, const int32_t *prompt, int n, const char *session_name,
		  enum agent_kind kind, int conv, int turn, struct pending *p)
{
	struct agent_run *run = ctl.run;
	const struct agent_opts *o = &run->o;
	struct kd_request req = { .prompt = prompt, .n_prompt = (uint32_t)n,
				  .session = session_name };
	struct agent_req *r;
	long i;
	int ret;

	if (kind == AGENT_LONG) {
		i = o->max_requests;
		req.max_tokens = 1;	/* its first token is the end of its prefill */
	} else {
		if (atomic_load(&ctl.stop) || (i = atomic_fetch_add(&ctl.next_req, 1)) >= o->max_requests)
			return -ENOSPC;
		req.max_tokens = (uint32_t)o->output_tokens;
	}
	r = &run->reqs[i];
	*r = (struct agent_req){ .kind = kind, .session = s->idx, .conv = conv, .turn = turn,
				 .n_prompt = (uint32_t)n, .max_tokens = req.max_tokens };
	memset(p, 0, sizeof(*p));
	p->r = r;
	r->t_tok = calloc(req.max_tokens, sizeof(uint64_t));
	p->ids = calloc(req.max_tokens, sizeof(int32_t));
	if (!r->t_tok || !p->ids)
		return -ENOMEM;
	for (;;) {
		r->t_submit = now_ns();
		ret = kd_submit(s->c, &req, &p->id);
		if (ret != -EAGAIN || atomic_load(&ctl.stop))
			break;
		usleep(1000);	/* the ring is full of our own earlier records: rare */
	}
	if (ret) {
		fprintf(stderr, "kdbench agent: session %d: submit (%d prompt tokens): %s\n", s->idx, n,
			kd_strerror(ret));
		atomic_fetch_add(&ctl.errors, 1);
		p->done = 1;
	}
	return ret;
}

static void on_event(struct pending *p, int np, const struct kd_event *ev)
{
	for (int k = 0; k < np; k++) {
		struct agent_req *r = p[k].r;

		if (p[k].done || p[k].id != ev->id)
			continue;
		if (ev->token >= 0 && r->n_tokens < r->max_tokens) {
			if (!r->n_tokens)
				r->t_first = ev->t_receive_ns;
			p[k].ids[r->n_tokens] = ev->token;
			r->t_tok[r->n_tokens++] = ev->t_receive_ns;
		}
		if (ev->flags & KD_EVENT_FINAL) {
			p[k].done = 1;
			r->t_end = ev->t_receive_ns;
			r->stop = (int)ev->stop;
			r->error = ev->error;
			r->daemon_count = ev->index + (ev->token >= 0);
			if (ev->stop == KD_STOP_ERROR && !atomic_fetch_add(&ctl.errors, 1)) {
				char msg[256];

				kd_event_message(ev, msg, sizeof(msg));
				fprintf(stderr, "kdbench agent: request of %u prompt tokens: %s\n", r->n_prompt, msg);
			}
		}
		return;
	}
}

/* Receives until p[0..np) are final. After the stop plus the grace period the
 * rest are cancelled; DRAIN_AFTER_CANCEL_NS later they are given up. 0, or
 * -ETIMEDOUT / -errno when some never ended. */
static int collect(struct session *s, struct pending *p, int np)
{
	const double grace_ns = ctl.run->o.grace_s * 1e9;
	struct kd_event ev[64];

	for (;;) {
		int left = 0, n;
		uint64_t ts = atomic_load(&ctl.t_stop), t;

		for (int k = 0; k < np; k++)
			left += !p[k].done;
		if (!left)
			return 0;
		n = kd_wait(s->c, ev, 64, 50);
		if (n < 0) {
			fprintf(stderr, "kdbench agent: session %d: %s\n", s->idx, kd_connect_error(s->c));
			atomic_fetch_add(&ctl.errors, 1);
			return n;
		}
		for (int i = 0; i < n; i++)
			on_event(p, np, &ev[i]);
		if (!atomic_load(&ctl.stop) || !ts || (double)((t = now_ns()) - ts) < grace_ns)
			continue;
		for (int k = 0; k < np; k++)
			if (!p[k].done && !p[k].cancelled)
				p[k].cancelled = !kd_cancel(s->c, p[k].id);
		if ((double)(t - ts) > grace_ns + (double)DRAIN_AFTER_CANCEL_NS)
			return -ETIMEDOUT;
	}
}

static void pending_free(struct pending *p, int np)
{
	for (int k = 0; k < np; k++) {
		free(p[k].ids);
		p[k].ids = NULL;
	}
}

/* Appends up to n tokens to the history, as many as fit. */
static void hist_add(struct session *s, const int32_t *t, int n)
{
	int room = ctl.run->o.max_context - s->n_hist;

	n = n < room ? n : room;
	memcpy(s->hist + s->n_hist, t, (size_t)(n > 0 ? n : 0) * sizeof(int32_t));
	s->n_hist += n > 0 ? n : 0;
}

/* K sub-agents on the parent's history (each adds its own task tokens and runs
 * under its own session name); their answers become the parent's tool output. */
static int fork_subagents(struct session *s, int conv, int turn, int32_t *scratch)
{
	const struct agent_opts *o = &ctl.run->o;
	struct pending p[AGENT_MAX_SUBAGENTS];
	char names[AGENT_MAX_SUBAGENTS][KD_SESSION_MAX + 1];
	int task = o->turn_tokens > 0 ? o->turn_tokens : 1, np = 0, ret = 0;

	if (s->n_hist + task + o->output_tokens > o->max_context)
		return 0;
	memcpy(scratch, s->hist, (size_t)s->n_hist * sizeof(int32_t));
	for (int k = 0; k < o->subagents && !ret; k++) {
		rng_tokens(&s->rng, o->vocab, scratch + s->n_hist, task);
		snprintf(names[k], sizeof(names[k]), "%s.%d", s->name, k);
		ret = submit(s, scratch, s->n_hist + task, names[k], AGENT_SUBAGENT, conv, turn, &p[np]);
		np += ret != -ENOSPC;	/* a failed one still owns its buffers */
	}
	if (np)
		ret = collect(s, p, np) ? -EIO : ret;
	for (int k = 0; k < np && ret != -EIO; k++)
		hist_add(s, p[k].ids, (int)p[k].r->n_tokens);
	pending_free(p, np);
	return ret;
}

/* One conversation: turns until --turns, the context limit, a failed request or the
 * stop. 0 to go on with a new one, < 0 to end the session. */
static int conversation(struct session *s, int conv, int32_t *scratch)
{
	const struct agent_opts *o = &ctl.run->o;
	int ret = 0;

	s->n_hist = 0;
	hist_add(s, ctl.system, ctl.n_system);
	rng_tokens(&s->rng, o->vocab, s->hist + s->n_hist, o->first_prompt - ctl.n_system);
	s->n_hist = o->first_prompt;
	for (int turn = 0; turn < o->turns && !atomic_load(&ctl.stop); turn++) {
		struct pending p = { 0 };
		int tool = turn ? o->turn_tokens : 0;

		if (turn && o->subagents && rng_unit(&s->rng) < o->subagent_prob &&
		    (ret = fork_subagents(s, conv, turn, scratch)))
			break;
		if (s->n_hist + tool + o->output_tokens > o->max_context)
			return 0;	/* the context is full: a new conversation */
		rng_tokens(&s->rng, o->vocab, scratch, tool);
		hist_add(s, scratch, tool);
		if ((ret = submit(s, s->hist, s->n_hist, s->name, AGENT_TURN, conv, turn, &p))) {
			pending_free(&p, 1);
			break;
		}
		ret = collect(s, &p, 1);
		if (!ret && p.r->stop == KD_STOP_ERROR)
			ret = -EPROTO;	/* refused (vocabulary, size): every retry would be too */
		else if (!ret && p.r->stop != KD_STOP_LENGTH && p.r->stop != KD_STOP_TOKEN)
			ret = -EIO;	/* cancelled: the history would not match; start over */
		if (!ret)
			hist_add(s, p.ids, (int)p.r->n_tokens);
		pending_free(&p, 1);
		if (ret)
			break;
		pause_ms(think_draw(&s->rng, o->think_ms));
	}
	return ret == -EIO && !atomic_load(&ctl.stop) ? 0 : ret;
}

static int session_open(struct session *s, int idx)
{
	const struct agent_opts *o = &ctl.run->o;
	int ret;

	s->idx = idx;
	s->rng = o->seed ^ (0x5851f42d4c957f2dull * (uint64_t)(idx + 2));
	snprintf(s->name, sizeof(s->name), "kdb%ld-%d", (long)getpid(), idx);
	s->hist = malloc((size_t)o->max_context * sizeof(int32_t));
	if (!s->hist)
		return -ENOMEM;
	ret = kd_connect(&s->c, &(struct kd_connect_opts){ .socket_path = o->socket });
	if (ret) {
		fprintf(stderr, "kdbench agent: session %d: connect %s: %s\n", idx, o->socket,
			kd_connect_error(NULL));
		atomic_fetch_add(&ctl.errors, 1);
	}
	return ret;
}

static void *session_main(void *arg)
{
	struct session s = { 0 };
	int32_t *scratch = malloc((size_t)ctl.run->o.max_context * sizeof(int32_t));

	if (scratch && !session_open(&s, (int)(intptr_t)arg))
		for (int conv = 0; !atomic_load(&ctl.stop); conv++)
			if (conversation(&s, conv, scratch))
				break;
	kd_close(s.c);
	free(s.hist);
	free(scratch);
	atomic_fetch_sub(&ctl.live, 1);
	return NULL;
}

/* The long prompt: one request at --long-at on its own handle. */
static void *long_main(void *arg)
{
	const struct agent_opts *o = &ctl.run->o;
	uint64_t rng = o->seed ^ 0x10f6u;
	int32_t *prompt = malloc((size_t)o->long_prompt * sizeof(int32_t));
	struct session s = { .idx = -1 };
	struct pending p = { 0 };

	(void)arg;
	if (!prompt || kd_connect(&s.c, &(struct kd_connect_opts){ .socket_path = o->socket })) {
		fprintf(stderr, "kdbench agent: long prompt: cannot connect\n");
		atomic_fetch_add(&ctl.errors, 1);
	} else {
		rng_tokens(&rng, o->vocab, prompt, o->long_prompt);
		pause_ms(o->long_at_s * 1e3);
		if (!atomic_load(&ctl.stop) && !submit(&s, prompt, o->long_prompt, NULL, AGENT_LONG, 0, 0, &p)) {
			ctl.run->long_idx = (int)o->max_requests;
			collect(&s, &p, 1);
			atomic_store(&ctl.long_end, now_ns());
		}
		pending_free(&p, 1);
	}
	kd_close(s.c);
	free(prompt);
	return NULL;
}

/* ---- options and the run --------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kdbench agent --socket PATH [--sessions N] [--duration S] [--max-requests M]\n"
		"                     [--turns T] [--think-ms MEAN] [--first-prompt TOKENS]\n"
		"                     [--turn-tokens TOKENS] [--output-tokens N] [--subagent-prob P]\n"
		"                     [--subagents K] [--seed S] [--vocab V] [--max-context TOKENS]\n"
		"                     [--grace S] [--long-prompt TOKENS [--long-at S]] [--control PATH]\n"
		"                     [--hbm-tbs X] [--json FILE] [--plot FILE.png]\n"
		"Agent-shaped load against a running kdecd; a table on stdout, optionally a JSON\n"
		"file (summary and every request) and a PNG (gnuplot) of latency over time.\n"
		"  --sessions N        concurrent conversations, 1..%d (default 8)\n"
		"  --duration S        stop submitting after S seconds (default 10)\n"
		"  --max-requests M    ... or after M requests (default 10000)\n"
		"  --turns T           turns per conversation, then a new one (default 8)\n"
		"  --think-ms MEAN     mean pause between turns, log-normal sigma 1 (default 500)\n"
		"  --first-prompt N    turn 1's prompt: N/2 system tokens shared by every\n"
		"                      session, then task tokens (default 512)\n"
		"  --turn-tokens N     new tool-output tokens per later turn (default 64)\n"
		"  --output-tokens N   max_tokens of each request (default 32)\n"
		"  --subagent-prob P   chance per turn of forking sub-agents (default 0.1)\n"
		"  --subagents K       sub-agents per fork, 1..%d (default 2)\n"
		"  --vocab V           prompt tokens drawn from [0, V) (default 256)\n"
		"  --max-context N     a conversation that would pass N tokens restarts (default 4096)\n"
		"  --grace S           after the stop, running requests get S s before being\n"
		"                      cancelled (default 5)\n"
		"  --long-prompt N     one extra N-token request (max_tokens 1) at --long-at S\n"
		"                      (default 2): reports the streams' ITL during its prefill;\n"
		"                      the run ends 2 s after it (or at --duration)\n"
		"  --control PATH      socket for the daemon's metrics (default: --socket)\n"
		"  --hbm-tbs X         bandwidth of the decode steps' floor in TB/s: the bytes\n"
		"                      they must read (kd_decode_step_bytes_total) over it\n"
		"                      (default %.2f, an H200's measured)\n",
		AGENT_MAX_SESSIONS, AGENT_MAX_SUBAGENTS, KDBENCH_HBM_TBS);
}

static int num(const char *opt, const char *s, long min, long max, long *out)
{
	return kdbench_parse_num("kdbench agent", opt, s, min, max, out);
}

static int real(const char *opt, const char *s, double min, double max, double *out)
{
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno || end == s || *end || !(v >= min && v <= max)) {
		fprintf(stderr, "kdbench agent: %s '%s': want a number in [%g, %g]\n", opt, s, min, max);
		return -1;
	}
	*out = v;
	return 0;
}

static int parse(int argc, char **argv, struct agent_opts *o)
{
	static const struct option opts[] = {
		{ "socket", 1, NULL, 'S' }, { "control", 1, NULL, 'C' }, { "json", 1, NULL, 'J' },
		{ "plot", 1, NULL, 'P' }, { "sessions", 1, NULL, 'n' }, { "duration", 1, NULL, 'd' },
		{ "max-requests", 1, NULL, 'm' }, { "turns", 1, NULL, 't' }, { "think-ms", 1, NULL, 'k' },
		{ "first-prompt", 1, NULL, 'f' }, { "turn-tokens", 1, NULL, 'u' },
		{ "output-tokens", 1, NULL, 'o' }, { "subagent-prob", 1, NULL, 'p' },
		{ "subagents", 1, NULL, 'K' }, { "seed", 1, NULL, 's' }, { "vocab", 1, NULL, 'v' },
		{ "max-context", 1, NULL, 'c' }, { "grace", 1, NULL, 'g' }, { "long-prompt", 1, NULL, 'L' },
		{ "long-at", 1, NULL, 'a' }, { "hbm-tbs", 1, NULL, 'B' }, { "help", 0, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c, bad = 0;

	optind = 1;
	while (!bad && (c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'S': o->socket = optarg; break;
		case 'C': o->control = optarg; break;
		case 'J': o->json_path = optarg; break;
		case 'P': o->plot_path = optarg; break;
		case 'n': bad = num("--sessions", optarg, 1, AGENT_MAX_SESSIONS, &v); o->sessions = (int)v; break;
		case 'd': bad = real("--duration", optarg, 0.1, 86400, &o->duration_s); break;
		case 'm': bad = num("--max-requests", optarg, 1, 1000000, &o->max_requests); break;
		case 't': bad = num("--turns", optarg, 1, 100000, &v); o->turns = (int)v; break;
		case 'k': bad = real("--think-ms", optarg, 0, 3600e3, &o->think_ms); break;
		case 'f': bad = num("--first-prompt", optarg, 1, 1 << 20, &v); o->first_prompt = (int)v; break;
		case 'u': bad = num("--turn-tokens", optarg, 0, 1 << 20, &v); o->turn_tokens = (int)v; break;
		case 'o': bad = num("--output-tokens", optarg, 1, 1 << 16, &v); o->output_tokens = (int)v; break;
		case 'p': bad = real("--subagent-prob", optarg, 0, 1, &o->subagent_prob); break;
		case 'K': bad = num("--subagents", optarg, 1, AGENT_MAX_SUBAGENTS, &v); o->subagents = (int)v; break;
		case 's': bad = num("--seed", optarg, 0, __LONG_MAX__, &v); o->seed = (uint64_t)v; break;
		case 'v': bad = num("--vocab", optarg, 2, 1 << 24, &v); o->vocab = (int)v; break;
		case 'c': bad = num("--max-context", optarg, 2, 1 << 20, &v); o->max_context = (int)v; break;
		case 'g': bad = real("--grace", optarg, 0, 3600, &o->grace_s); break;
		case 'L': bad = num("--long-prompt", optarg, 1, 1 << 20, &v); o->long_prompt = (int)v; break;
		case 'a': bad = real("--long-at", optarg, 0, 86400, &o->long_at_s); break;
		case 'B': bad = real("--hbm-tbs", optarg, 0.001, 1000, &o->hbm_tbs); break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); return -1;
		}
	}
	if (bad)
		return -1;
	if (optind < argc) {
		fprintf(stderr, "kdbench agent: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	if (!o->socket) {
		fprintf(stderr, "kdbench agent: --socket PATH is required\n");
		return -1;
	}
	if (o->first_prompt + o->output_tokens > o->max_context) {
		fprintf(stderr, "kdbench agent: --first-prompt %d + --output-tokens %d > --max-context %d\n",
			o->first_prompt, o->output_tokens, o->max_context);
		return -1;
	}
	if (o->plot_path && strpbrk(o->plot_path, "'\n")) {
		fprintf(stderr, "kdbench agent: --plot '%s': no quotes or newlines in the path, please\n",
			o->plot_path);
		return -1;
	}
	return 0;
}

/* Starts the threads, stops submitting at the duration (or once every session has
 * ended: the count is spent), waits for the drain. */
static int run_load(struct agent_run *run)
{
	const struct agent_opts *o = &run->o;
	pthread_t th[AGENT_MAX_SESSIONS], lt;
	int n = 0, have_long = 0;

	atomic_store(&ctl.live, o->sessions);
	run->t0 = now_ns();
	for (; n < o->sessions; n++)
		if (pthread_create(&th[n], NULL, session_main, (void *)(intptr_t)n)) {
			atomic_fetch_sub(&ctl.live, o->sessions - n);
			atomic_fetch_add(&ctl.errors, 1);
			break;
		}
	if (o->long_prompt)
		have_long = !pthread_create(&lt, NULL, long_main, NULL);
	/* with a long prompt, the run ends LONG_TAIL_NS after it (the streams after
	 * the prefill are the comparison's last part) */
	while (atomic_load(&ctl.live) > 0 && now_ns() - run->t0 < (uint64_t)(o->duration_s * 1e9) &&
	       !(atomic_load(&ctl.long_end) && now_ns() - atomic_load(&ctl.long_end) > LONG_TAIL_NS))
		usleep(10000);
	run->t_stop = now_ns();
	atomic_store(&ctl.t_stop, run->t_stop);
	atomic_store(&ctl.stop, 1);
	for (int i = 0; i < n; i++)
		pthread_join(th[i], NULL);
	if (have_long)
		pthread_join(lt, NULL);
	run->t_done = now_ns();
	return n == o->sessions ? 0 : -EAGAIN;
}

int kdbench_agent_main(int argc, char **argv)
{
	struct agent_run run = { .o = { .sessions = 8, .duration_s = 10, .max_requests = 10000, .turns = 8,
					.think_ms = 500, .first_prompt = 512, .turn_tokens = 64,
					.output_tokens = 32, .subagent_prob = 0.1, .subagents = 2,
					.vocab = 256, .max_context = 4096, .grace_s = 5, .long_at_s = 2,
					.hbm_tbs = KDBENCH_HBM_TBS },
				 .long_idx = -1 };
	struct kd_client *probe;
	struct agent_counters c0;
	uint64_t rng;
	int32_t *sys = NULL;
	int ret;

	if (parse(argc, argv, &run.o))
		return 2;
	run.reqs = calloc((size_t)run.o.max_requests + 1, sizeof(*run.reqs));
	ctl.n_system = run.o.first_prompt / 2;
	sys = malloc(((size_t)ctl.n_system + 1) * sizeof(int32_t));
	if (!run.reqs || !sys) {
		fprintf(stderr, "kdbench agent: %ld request records: out of memory\n", run.o.max_requests);
		free(run.reqs);
		free(sys);
		return 1;
	}
	rng = run.o.seed;
	rng_tokens(&rng, run.o.vocab, sys, ctl.n_system);
	ctl.system = sys;
	ctl.run = &run;
	if ((ret = kd_connect(&probe, &(struct kd_connect_opts){ .socket_path = run.o.socket }))) {
		fprintf(stderr, "kdbench agent: %s\n", kd_connect_error(NULL));
		free(run.reqs);
		free(sys);
		return 1;
	}
	kd_close(probe);
	run.have_metrics = !agent_read_metrics(run.o.control ? run.o.control : run.o.socket, &c0);
	ret = run_load(&run);
	if (run.have_metrics && !agent_read_metrics(run.o.control ? run.o.control : run.o.socket, &run.d)) {
		run.d.hit_tokens -= c0.hit_tokens;
		run.d.prompt_tokens -= c0.prompt_tokens;
		run.d.decode_steps -= c0.decode_steps;
		run.d.decode_s -= c0.decode_s;
		run.d.decode_bytes -= c0.decode_bytes;
	} else {
		run.have_metrics = 0;
	}
	run.n_reqs = atomic_load(&ctl.next_req);
	if (run.n_reqs > run.o.max_requests)
		run.n_reqs = run.o.max_requests;
	run.errors = atomic_load(&ctl.errors);
	if (!ret)
		ret = agent_report(&run);
	for (long i = 0; i <= run.o.max_requests; i++)
		free(run.reqs[i].t_tok);
	free(run.reqs);
	free(sys);
	return ret || run.errors ? 1 : 0;
}
