/* Histograms and counters for kd_* metrics. Buckets reach down to 100 us because a
 * decode step on a small model is that short; vLLM's start at 1 ms. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/sched/metrics.h"

static const double ttft_le[METRICS_TTFT_BUCKETS] = {
	0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
	2.56, 5.12, 10.24, 20.48,
};
static const double itl_le[METRICS_ITL_BUCKETS] = {
	0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16,
	0.32, 0.64, 1.28, 2.56, 5.12,
};

static void observe(struct metrics_hist *h, const double *le, int n, double v)
{
	int i = 0;

	while (i < n && v > le[i])
		i++;
	h->counts[i]++;
	h->sum += v;
	h->n++;
}

void metrics_observe_ttft(struct metrics *m, double seconds)
{
	observe(&m->ttft, ttft_le, METRICS_TTFT_BUCKETS, seconds);
}

void metrics_observe_itl(struct metrics *m, double seconds)
{
	observe(&m->itl, itl_le, METRICS_ITL_BUCKETS, seconds);
}

/* Steps share the inter-token buckets: a step is what a decoding stream waits for. */
void metrics_observe_step(struct metrics *m, double seconds)
{
	observe(&m->step, itl_le, METRICS_ITL_BUCKETS, seconds);
}

struct buf {
	char *p;
	size_t len, cap;
	int oom;
};

static void put(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct buf *b, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (b->oom)
		return;
	for (;;) {
		char *np;

		va_start(ap, fmt);
		n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
		va_end(ap);
		if (n >= 0 && (size_t)n < b->cap - b->len)
			break;
		b->cap = b->cap * 2 + (size_t)n;
		np = realloc(b->p, b->cap);
		if (!np) {
			b->oom = 1;
			return;
		}
		b->p = np;
	}
	b->len += (size_t)n;
}

static void put_hist(struct buf *b, const char *name, const char *help,
		     const struct metrics_hist *h, const double *le, int n)
{
	uint64_t cum = 0;

	put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
	for (int i = 0; i < n; i++) {
		cum += h->counts[i];
		put(b, "%s_bucket{le=\"%g\"} %llu\n", name, le[i], (unsigned long long)cum);
	}
	cum += h->counts[n];
	put(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
	put(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->n);
}

static void put_one(struct buf *b, const char *name, const char *type, const char *help, double v)
{
	put(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

char *metrics_format(const struct metrics *m, const struct metrics_gauges *g)
{
	static const char *const reasons[] = { "", "length", "stop", "cancelled", "error" };
	struct buf b = { .cap = 8192 };

	b.p = malloc(b.cap);
	if (!b.p)
		return NULL;
	b.p[0] = '\0';
	put_hist(&b, "kd_time_to_first_token_seconds",
		 "Time from the daemon's pickup of a request to its first token.",
		 &m->ttft, ttft_le, METRICS_TTFT_BUCKETS);
	put_hist(&b, "kd_inter_token_latency_seconds",
		 "Time between consecutive tokens of a request.", &m->itl, itl_le, METRICS_ITL_BUCKETS);
	put_hist(&b, "kd_step_seconds", "Wall time of an engine step (decodes and prompt chunks).",
		 &m->step, itl_le, METRICS_ITL_BUCKETS);
	put_one(&b, "kd_decode_steps_total", "counter", "Engine steps of decode rows only.",
		(double)m->decode_steps);
	put_one(&b, "kd_decode_step_seconds_total", "counter",
		"Wall time of the decode-only steps.", m->decode_step_s);
	put_one(&b, "kd_decode_step_bytes_total", "counter",
		"Bytes the decode-only steps must read (weights they touch, their rows' KV): "
		"over HBM bandwidth, the floor under their time.", m->decode_step_bytes);
	put_one(&b, "kd_engine_loop_gap_max_seconds", "gauge",
		"The engine thread's longest pass through its loop (a step plus everything around it).",
		m->loop_gap_max);
	put_one(&b, "kd_requests_running", "gauge", "Requests in the running batch.", g->requests_running);
	put_one(&b, "kd_requests_waiting", "gauge", "Requests waiting for admission.", g->requests_waiting);
	put_one(&b, "kd_clients", "gauge", "Connected clients.", g->clients);
	put_one(&b, "kd_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use.",
		g->kv_blocks_total ? (double)g->kv_blocks_used / g->kv_blocks_total : 0.0);
	put_one(&b, "kd_prompt_tokens_total", "counter", "Prompt tokens prefilled.", (double)m->prompt_tokens);
	put_one(&b, "kd_generation_tokens_total", "counter", "Tokens generated.", (double)m->generation_tokens);
	put_one(&b, "kd_spec_draft_tokens_total", "counter", "Speculative draft tokens verified.",
		(double)m->spec_draft_tokens);
	put_one(&b, "kd_spec_accepted_tokens_total", "counter",
		"Speculative draft tokens accepted (mean acceptance length: 1 + accepted / verification steps).",
		(double)m->spec_accepted_tokens);
	put_one(&b, "kd_preemptions_total", "counter",
		"Running requests preempted (KV dropped, recomputed on resume) for KV blocks.",
		(double)m->preemptions);
	put_one(&b, "kd_prefix_cache_hit_tokens_total", "counter",
		"Prompt tokens served from the prefix cache.", (double)g->prefix_hit_tokens);
	put_one(&b, "kd_kv_offloaded_blocks_total", "counter",
		"KV blocks compressed into the host tier.", (double)g->offloaded_blocks);
	put_one(&b, "kd_kv_offloaded_bytes_total", "counter",
		"Raw bytes of the KV blocks offloaded to the host tier.", (double)g->offloaded_bytes);
	put_one(&b, "kd_kv_offloaded_compressed_bytes_total", "counter",
		"Their compressed bytes (the ratio is raw / compressed).", (double)g->offloaded_zbytes);
	put_one(&b, "kd_kv_restores_total", "counter",
		"Restores from the host tier (a session or a prefix hit).", (double)g->restores);
	put_one(&b, "kd_kv_restored_blocks_total", "counter",
		"KV blocks decompressed back into the device cache.", (double)g->restored_blocks);
	put_one(&b, "kd_kv_restore_seconds_total", "counter",
		"Time spent restoring from the host tier.", (double)g->restore_ns / 1e9);
	put_one(&b, "kd_kv_moves_in_flight", "gauge",
		"Host-tier offloads and restores running off the engine thread.", (double)g->moves_in_flight);
	put_one(&b, "kd_kv_move_bytes_in_flight", "gauge",
		"Raw KV bytes those moves copy.", (double)g->move_bytes_in_flight);
	put(&b, "# HELP kd_requests_finished_total Requests finished, by reason.\n"
		"# TYPE kd_requests_finished_total counter\n");
	for (int i = 1; i < 5; i++)
		put(&b, "kd_requests_finished_total{reason=\"%s\"} %llu\n", reasons[i],
		    (unsigned long long)m->requests_finished[i]);
	put_one(&b, "kd_decode_path_latency_buckets", "gauge",
		"Decode graphs on the latency path (--decode-path): bit i set for the 2^i-row bucket.",
		(double)g->decode_lat_mask);
	put_one(&b, "kd_uptime_seconds", "gauge", "Seconds since the daemon started.", g->uptime_s);
	if (b.oom) {
		free(b.p);
		return NULL;
	}
	return b.p;
}
