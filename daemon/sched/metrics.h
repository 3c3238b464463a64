/* Request metrics kept by the engine thread and the Prometheus text rendering of a
 * copy of them (names modelled on vLLM's, prefixed kd_). */
#ifndef KD_DAEMON_METRICS_H
#define KD_DAEMON_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define METRICS_TTFT_BUCKETS 16
#define METRICS_ITL_BUCKETS 16

struct metrics_hist {
	uint64_t counts[METRICS_TTFT_BUCKETS + 1];	/* per bucket, last = +Inf */
	double sum;					/* seconds */
	uint64_t n;
};

struct metrics {
	struct metrics_hist ttft;		/* pickup -> first token published */
	struct metrics_hist itl;		/* between a request's consecutive tokens */
	uint64_t prompt_tokens;			/* prompt tokens prefilled */
	uint64_t generation_tokens;		/* tokens generated */
	uint64_t requests_finished[5];		/* by enum ipc_reason (index 0 unused) */
	uint64_t spec_draft_tokens;		/* n-gram drafts verified */
	uint64_t spec_accepted_tokens;		/* of those, the ones emitted */
	uint64_t preemptions;			/* running requests preempted for KV blocks */
	struct metrics_hist step;		/* wall time of each engine step, seconds */
	uint64_t decode_steps;			/* steps of decode rows only */
	double decode_step_s;			/* their wall time, seconds */
	double decode_step_bytes;		/* the bytes they must read (engine_bytes.c) */
	double loop_gap_max;			/* the engine loop's longest pass, seconds */
};

/* Gauges read at report time. */
struct metrics_gauges {
	int requests_running, requests_waiting, clients;
	int kv_blocks_used, kv_blocks_total;
	uint64_t prefix_hit_tokens;
	/* the host tier (engine_stats) */
	uint64_t offloaded_blocks, offloaded_bytes, offloaded_zbytes;	/* bytes raw / compressed */
	uint64_t restores, restored_blocks, restore_ns;
	uint64_t moves_in_flight, move_bytes_in_flight;	/* host-tier moves on the mover */
	double uptime_s;
	unsigned decode_lat_mask;	/* batch buckets on the latency path: bit i = 2^i rows */
};

void metrics_observe_ttft(struct metrics *m, double seconds);
void metrics_observe_itl(struct metrics *m, double seconds);
void metrics_observe_step(struct metrics *m, double seconds);

/* The Prometheus text exposition; malloc'd, caller frees. NULL on ENOMEM. */
char *metrics_format(const struct metrics *m, const struct metrics_gauges *g);

#endif
