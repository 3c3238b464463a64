/* kdbench agent, shared between the workload (kdbench_agent.c: options, session
 * threads, the drain) and the report (kdbench_agent_report.c: table, JSON, plot). */
#ifndef KD_DAEMON_KDBENCH_AGENT_H
#define KD_DAEMON_KDBENCH_AGENT_H

#include <stdint.h>

#define AGENT_MAX_SESSIONS 256
#define AGENT_MAX_SUBAGENTS 8

struct agent_opts {
	const char *socket;		/* kdecd's socket (clients and control) */
	const char *control;		/* socket for metrics; NULL: socket */
	const char *json_path, *plot_path;	/* NULL: not written */
	int sessions;			/* concurrent conversations, one thread and handle each */
	double duration_s;		/* submitting stops after this */
	long max_requests;		/* ... or after this many requests */
	int turns;			/* turns of one conversation before a new one starts */
	double think_ms;		/* mean pause between turns (log-normal) */
	int first_prompt;		/* tokens of turn 1: half shared system prompt, half task */
	int turn_tokens;		/* new "tool output" tokens per later turn */
	int output_tokens;		/* max_tokens of every request */
	double subagent_prob;		/* chance that a turn forks sub-agents */
	int subagents;			/* sub-agents per fork */
	uint64_t seed;
	int vocab;			/* prompt tokens are drawn from [0, vocab) */
	int max_context;		/* a conversation whose next turn would pass this restarts */
	double grace_s;			/* after the stop, running requests get this long, then are cancelled */
	int long_prompt;		/* > 0: one extra request of this many tokens ... */
	double long_at_s;		/* ... submitted this long after the start */
	double hbm_tbs;			/* bandwidth of the decode steps' floor, TB/s */
};

enum agent_kind { AGENT_TURN, AGENT_SUBAGENT, AGENT_LONG };

/* One request's record; written only by the thread that submitted it, read by the
 * report after every thread has been joined. Times: CLOCK_MONOTONIC ns. */
struct agent_req {
	enum agent_kind kind;
	int session, conv, turn;
	uint32_t n_prompt, max_tokens;
	uint32_t n_tokens;		/* token events received */
	uint32_t daemon_count;		/* output tokens the final event says (0: no final) */
	int stop;			/* enum kd_stop of the final event, 0: none came */
	int error;			/* the final event's error, negative errno */
	uint64_t t_submit, t_first, t_end;	/* t_first, t_end: 0 when none */
	uint64_t *t_tok;		/* (max_tokens) receipt time of token i */
};

/* Counters of the daemon (kd_*_total) that the report uses. */
struct agent_counters {
	double hit_tokens, prompt_tokens;	/* prefix-cache hits, prompt tokens */
	double decode_steps, decode_s, decode_bytes;	/* decode-only steps: count, wall
							 * seconds, bytes they must read */
};

struct agent_run {
	struct agent_opts o;
	struct agent_req *reqs;		/* (o.max_requests + 1); the last is the long prompt */
	long n_reqs;			/* records used among the first o.max_requests */
	int long_idx;			/* index of the long prompt's record, -1: none */
	uint64_t t0, t_stop, t_done;	/* start, end of submitting, end of the drain */
	int errors;			/* connect or submit failures, protocol errors */
	int have_metrics;		/* the daemon's counters were read before and after */
	struct agent_counters d;	/* their change over the run */
};

/* Writes the table to stdout, then the JSON file and the plot when asked for.
 * 0, or -errno after one line on stderr. */
int agent_report(struct agent_run *r);

/* The daemon's counters kd_prefix_cache_hit_tokens_total, kd_prompt_tokens_total and
 * kd_decode_step{s,_seconds,_bytes}_total (0 where a daemon predates them)
 * through its control socket. 0 or -errno. */
int agent_read_metrics(const char *sock, struct agent_counters *c);

#endif
