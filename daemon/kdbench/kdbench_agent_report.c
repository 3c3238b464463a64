/* kdbench agent's report: percentiles over the per-request records, the table on
 * stdout, the JSON file, the gnuplot PNG of latency over time; and the read of the
 * daemon's prefix-cache counters over its control socket. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/control_call.h"
#include "client/kdclient.h"
#include "daemon/kdbench/kdbench_agent.h"

#define PLOT_MAX_POINTS 200000	/* ITL points in the plot; more are thinned evenly */

extern char **environ;

/* ---- the daemon's counters ----------------------------------------------------- */

/* The value of an unlabelled metric line "name value" in Prometheus text. */
static int metric_value(const char *text, const char *name, double *out)
{
	size_t n = strlen(name);

	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (!strncmp(p, name, n) && p[n] == ' ') {
			*out = strtod(p + n + 1, NULL);
			return 0;
		}
	return -ENOENT;
}

int agent_read_metrics(const char *sock, struct agent_counters *c)
{
	char *reply = NULL;
	json_t *o;
	const char *text;
	int ret = control_call(sock, "{\"cmd\":\"metrics\"}\n", &reply);

	if (ret) {
		fprintf(stderr, "kdbench agent: metrics from %s: %s\n", sock, strerror(-ret));
		return ret;
	}
	o = json_loads(reply, 0, NULL);
	text = json_string_value(json_object_get(o, "text"));
	ret = -EPROTO;
	*c = (struct agent_counters){ 0 };
	if (text && !metric_value(text, "kd_prefix_cache_hit_tokens_total", &c->hit_tokens) &&
	    !metric_value(text, "kd_prompt_tokens_total", &c->prompt_tokens)) {
		ret = 0;
		metric_value(text, "kd_decode_steps_total", &c->decode_steps);
		metric_value(text, "kd_decode_step_seconds_total", &c->decode_s);
		metric_value(text, "kd_decode_step_bytes_total", &c->decode_bytes);
	}
	else
		fprintf(stderr, "kdbench agent: metrics from %s: no prefix-cache counters in the reply\n", sock);
	json_decref(o);
	free(reply);
	return ret;
}

/* ---- statistics -------------------------------------------------------------- */

struct dist {
	double *v;	/* (n) sorted, ms or the unit of the figure */
	size_t n, cap;
};

static int dist_add(struct dist *d, double x)
{
	if (d->n == d->cap) {
		size_t cap = d->cap ? 2 * d->cap : 1024;
		double *nv = realloc(d->v, cap * sizeof(*nv));

		if (!nv)
			return -ENOMEM;
		d->v = nv;
		d->cap = cap;
	}
	d->v[d->n++] = x;
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static void dist_sort(struct dist *d)
{
	if (d->n)
		qsort(d->v, d->n, sizeof(*d->v), cmp_double);
}

/* Nearest rank: the smallest sample with at least q of them at or below it. */
static double dist_pct(const struct dist *d, double q)
{
	size_t k;

	if (!d->n)
		return NAN;
	k = (size_t)ceil(q * (double)d->n);
	return d->v[k ? k - 1 : 0];
}

struct summary {
	long requests, completed, cancelled, failed;
	double out_tokens, prompt_tokens;	/* totals over the requests */
	double span_s;				/* first submit to last end */
	struct dist ttft, itl, norm;		/* ms, ms, ms per output token */
	double interactivity;			/* 1 / P90(norm), tokens/s per user */
	/* with --long-prompt: the other streams' gaps that end before its submission,
	 * and those that overlap its prefill (submission to first token) */
	struct dist before, during;
	double long_ttft_ms;
};

static int is_done(const struct agent_req *q)
{
	return q->stop == KD_STOP_LENGTH || q->stop == KD_STOP_TOKEN;
}

static int summarize(const struct agent_run *r, struct summary *s)
{
	const struct agent_req *lq = r->long_idx >= 0 ? &r->reqs[r->long_idx] : NULL;
	uint64_t l0 = lq ? lq->t_submit : 0, l1 = lq && lq->t_first ? lq->t_first : r->t_done;
	uint64_t t_last = r->t0;
	int ret = 0;

	for (long i = 0; i < r->n_reqs && !ret; i++) {
		const struct agent_req *q = &r->reqs[i];

		s->requests++;
		s->completed += is_done(q);
		s->cancelled += q->stop == KD_STOP_CANCELLED;
		s->failed += q->stop == KD_STOP_ERROR || !q->stop;
		s->out_tokens += q->n_tokens;
		s->prompt_tokens += q->n_prompt;
		t_last = q->t_end > t_last ? q->t_end : t_last;
		if (q->t_first)
			ret |= dist_add(&s->ttft, (double)(q->t_first - q->t_submit) * 1e-6);
		if (is_done(q) && q->n_tokens)
			ret |= dist_add(&s->norm, (double)(q->t_end - q->t_submit) * 1e-6 / q->n_tokens);
		for (uint32_t k = 1; k < q->n_tokens; k++) {
			double g = (double)(q->t_tok[k] - q->t_tok[k - 1]) * 1e-6;

			ret |= dist_add(&s->itl, g);
			/* a gap that overlaps the prefill counts as during it: the
			 * one straddling the submission is the stall, if any */
			if (lq && q->t_tok[k] <= l0)
				ret |= dist_add(&s->before, g);
			else if (lq && q->t_tok[k - 1] < l1)
				ret |= dist_add(&s->during, g);
		}
	}
	s->span_s = (double)(t_last - r->t0) * 1e-9;
	s->long_ttft_ms = lq && lq->t_first ? (double)(lq->t_first - lq->t_submit) * 1e-6 : NAN;
	dist_sort(&s->ttft);
	dist_sort(&s->itl);
	dist_sort(&s->norm);
	dist_sort(&s->before);
	dist_sort(&s->during);
	s->interactivity = s->norm.n ? 1e3 / dist_pct(&s->norm, 0.9) : NAN;
	return ret ? -ENOMEM : 0;
}

static void summary_fini(struct summary *s)
{
	free(s->ttft.v);
	free(s->itl.v);
	free(s->norm.v);
	free(s->before.v);
	free(s->during.v);
}

/* The decode-only steps' mean wall time and the floor their bytes put under it at
 * --hbm-tbs, ms; NAN without them (no metrics, or none ran). */
static void decode_floor(const struct agent_run *r, double *mean_ms, double *floor_ms)
{
	const double n = r->have_metrics ? r->d.decode_steps : 0;

	*mean_ms = n > 0 ? r->d.decode_s / n * 1e3 : NAN;
	*floor_ms = n > 0 ? r->d.decode_bytes / n / (r->o.hbm_tbs * 1e12) * 1e3 : NAN;
}

static double hit_rate(const struct agent_run *r)
{
	return r->have_metrics && r->d.prompt_tokens > 0 ? r->d.hit_tokens / r->d.prompt_tokens : NAN;
}

/* ---- table ----------------------------------------------------------------- */

static void print_dist(const char *name, const struct dist *d)
{
	printf("%-34s %10.2f %10.2f %10.2f %10.2f  (n %zu)\n", name, dist_pct(d, 0.5), dist_pct(d, 0.9),
	       dist_pct(d, 0.99), d->n ? d->v[d->n - 1] : NAN, d->n);
}

static void print_table(const struct agent_run *r, const struct summary *s)
{
	const struct agent_opts *o = &r->o;
	double mean_ms, floor_ms;

	printf("kdbench agent: %d sessions, %.1f s (stopped at %.1f s, drained at %.1f s), %d turns,\n"
	       "  think %.0f ms mean, prompt %d + %d per turn, output %d, sub-agents %d at p %.2f, seed %llu\n",
	       o->sessions, o->duration_s, (double)(r->t_stop - r->t0) * 1e-9, (double)(r->t_done - r->t0) * 1e-9,
	       o->turns, o->think_ms, o->first_prompt, o->turn_tokens, o->output_tokens, o->subagents,
	       o->subagent_prob, (unsigned long long)o->seed);
	printf("requests %ld: %ld completed, %ld cancelled in the drain, %ld failed or unfinished\n",
	       s->requests, s->completed, s->cancelled, s->failed);
	printf("%-34s %10s %10s %10s %10s\n", "", "p50", "p90", "p99", "max");
	print_dist("time to first token (ms)", &s->ttft);
	print_dist("inter-token latency (ms)", &s->itl);
	print_dist("end-to-end / output token (ms)", &s->norm);
	printf("%-34s %10.1f tokens/s per user (1 / P90 of the line above)\n", "P90 normalized interactivity",
	       s->interactivity);
	if (r->have_metrics)
		printf("%-34s %10.3f (%.0f of %.0f prompt tokens, daemon-wide)\n", "prefix cache hit rate",
		       hit_rate(r), r->d.hit_tokens, r->d.prompt_tokens);
	else
		printf("%-34s %10s (no metrics from the control socket)\n", "prefix cache hit rate", "n/a");
	decode_floor(r, &mean_ms, &floor_ms);
	if (!isnan(mean_ms))
		printf("%-34s %10.2f ms mean of %.0f; their bytes at %.2f TB/s: %.2f ms (%.0f%%)\n",
		       "decode-only steps", mean_ms, r->d.decode_steps, o->hbm_tbs, floor_ms,
		       100 * floor_ms / mean_ms);
	printf("%-34s %10.1f tokens/s (%.0f tokens in %.2f s)\n", "output throughput", s->out_tokens / s->span_s,
	       s->out_tokens, s->span_s);
	printf("%-34s %10.2f requests/s\n", "request rate", (double)s->completed / s->span_s);
	if (r->long_idx >= 0) {
		if (isnan(s->long_ttft_ms))
			printf("long prompt: %d tokens, did not finish; other streams' inter-token latency (ms):\n",
			       o->long_prompt);
		else
			printf("long prompt: %d tokens, time to first token %.1f ms; other streams' inter-token latency (ms):\n",
			       o->long_prompt, s->long_ttft_ms);
		print_dist("  before it was submitted", &s->before);
		print_dist("  overlapping its prefill", &s->during);
	}
	fflush(stdout);
}

/* ---- JSON ------------------------------------------------------------------ */

static json_t *dist_json(const struct dist *d)
{
	return json_pack("{s:f, s:f, s:f, s:f, s:I}", "p50", d->n ? dist_pct(d, 0.5) : 0.0,
			 "p90", d->n ? dist_pct(d, 0.9) : 0.0, "p99", d->n ? dist_pct(d, 0.99) : 0.0,
			 "max", d->n ? d->v[d->n - 1] : 0.0, "n", (json_int_t)d->n);
}

static json_t *request_json(const struct agent_run *r, const struct agent_req *q)
{
	static const char *const kinds[] = { "turn", "subagent", "long" };
	static const char *const stops[] = { "none", "length", "token", "cancelled", "error" };

	return json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:f, s:f, s:f}",
			 "kind", kinds[q->kind], "session", q->session, "conversation", q->conv,
			 "turn", q->turn, "prompt_tokens", (int)q->n_prompt, "max_tokens", (int)q->max_tokens,
			 "tokens", (int)q->n_tokens, "output_tokens", (int)q->daemon_count,
			 "stop", q->stop >= 0 && q->stop <= 4 ? stops[q->stop] : "?", "error", q->error,
			 "submit_s", (double)(q->t_submit - r->t0) * 1e-9,
			 "ttft_ms", q->t_first ? (double)(q->t_first - q->t_submit) * 1e-6 : -1.0,
			 "e2e_ms", q->t_end ? (double)(q->t_end - q->t_submit) * 1e-6 : -1.0);
}

static int write_json(const struct agent_run *r, const struct summary *s)
{
	const struct agent_opts *o = &r->o;
	json_t *reqs = json_array(), *root;
	double mean_ms, floor_ms;
	int ret;

	for (long i = 0; i < r->n_reqs && reqs; i++)
		json_array_append_new(reqs, request_json(r, &r->reqs[i]));
	if (reqs && r->long_idx >= 0)
		json_array_append_new(reqs, request_json(r, &r->reqs[r->long_idx]));
	root = json_pack("{s:{s:i, s:f, s:I, s:i, s:f, s:i, s:i, s:i, s:f, s:i, s:I}, s:I, s:I, s:I, s:I, s:i,"
			 " s:o, s:o, s:o, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:o}",
			 "config", "sessions", o->sessions, "duration_s", o->duration_s,
			 "max_requests", (json_int_t)o->max_requests, "turns", o->turns, "think_ms", o->think_ms,
			 "first_prompt", o->first_prompt, "turn_tokens", o->turn_tokens,
			 "output_tokens", o->output_tokens, "subagent_prob", o->subagent_prob,
			 "subagents", o->subagents, "seed", (json_int_t)o->seed,
			 "requests", (json_int_t)s->requests, "completed", (json_int_t)s->completed,
			 "cancelled", (json_int_t)s->cancelled, "failed", (json_int_t)s->failed,
			 "errors", r->errors, "ttft_ms", dist_json(&s->ttft), "itl_ms", dist_json(&s->itl),
			 "normalized_ms_per_token", dist_json(&s->norm),
			 "p90_interactivity_tokens_per_s", isnan(s->interactivity) ? 0.0 : s->interactivity,
			 "prefix_hit_rate", r->have_metrics ? (isnan(hit_rate(r)) ? 0.0 : hit_rate(r)) : -1.0,
			 "prefix_hit_tokens", r->have_metrics ? r->d.hit_tokens : -1.0,
			 "daemon_prompt_tokens", r->have_metrics ? r->d.prompt_tokens : -1.0,
			 "output_tokens_per_s", s->out_tokens / s->span_s,
			 "requests_per_s", (double)s->completed / s->span_s, "span_s", s->span_s,
			 "records", reqs);
	decode_floor(r, &mean_ms, &floor_ms);
	if (root && !isnan(mean_ms))
		json_object_set_new(root, "decode_steps",
				    json_pack("{s:f, s:f, s:f, s:f}", "count", r->d.decode_steps,
					      "mean_ms", mean_ms, "floor_ms", floor_ms,
					      "hbm_tbs", o->hbm_tbs));
	if (root && r->long_idx >= 0)
		json_object_set_new(root, "long_prompt",
				    json_pack("{s:i, s:f, s:o, s:o}", "tokens", o->long_prompt,
					      "ttft_ms", isnan(s->long_ttft_ms) ? -1.0 : s->long_ttft_ms,
					      "itl_before_ms", dist_json(&s->before),
					      "itl_during_ms", dist_json(&s->during)));
	if (!root) {
		fprintf(stderr, "kdbench agent: %s: cannot build the JSON (out of memory)\n", o->json_path);
		return -ENOMEM;
	}
	ret = json_dump_file(root, o->json_path, JSON_INDENT(1) | JSON_REAL_PRECISION(6));
	if (ret)
		fprintf(stderr, "kdbench agent: %s: cannot write: %s\n", o->json_path, strerror(errno));
	json_decref(root);
	return ret ? -EIO : 0;
}

/* ---- plot ------------------------------------------------------------------ */

/* FILE.png.dat: block 0 "t_s ttft_ms" at each first token, block 1 "t_s itl_ms"
 * at each token after the first (thinned to PLOT_MAX_POINTS). */
static int write_plot_data(const struct agent_run *r, const struct summary *s, const char *path)
{
	FILE *f = fopen(path, "w");
	size_t stride = s->itl.n / PLOT_MAX_POINTS + 1, k = 0;

	if (!f)
		return -errno;
	fprintf(f, "# wall time since start (s), time to first token (ms)\n");
	for (long i = 0; i < r->n_reqs; i++)
		if (r->reqs[i].t_first)
			fprintf(f, "%.4f %.3f\n", (double)(r->reqs[i].t_first - r->t0) * 1e-9,
				(double)(r->reqs[i].t_first - r->reqs[i].t_submit) * 1e-6);
	fprintf(f, "\n\n# wall time since start (s), inter-token latency (ms)\n");
	for (long i = 0; i < r->n_reqs; i++)
		for (uint32_t t = 1; t < r->reqs[i].n_tokens; t++)
			if (k++ % stride == 0)
				fprintf(f, "%.4f %.3f\n", (double)(r->reqs[i].t_tok[t] - r->t0) * 1e-9,
					(double)(r->reqs[i].t_tok[t] - r->reqs[i].t_tok[t - 1]) * 1e-6);
	return fclose(f) ? -EIO : 0;
}

static int write_plot_script(const struct agent_run *r, const char *path, const char *dat)
{
	const struct agent_req *lq = r->long_idx >= 0 ? &r->reqs[r->long_idx] : NULL;
	FILE *f = fopen(path, "w");

	if (!f)
		return -errno;
	fprintf(f, "set terminal png size 1200,700\nset output '%s'\n", r->o.plot_path);
	fprintf(f, "set title 'kdbench agent: %d sessions, latency over time'\n", r->o.sessions);
	fprintf(f, "set xlabel 'wall time since start (s)'\nset ylabel 'latency (ms)'\n"
		   "set logscale y\nset grid\nset key top left\n");
	if (lq && lq->t_submit) {
		double a = (double)(lq->t_submit - r->t0) * 1e-9;
		double b = lq->t_first ? (double)(lq->t_first - r->t0) * 1e-9 : a;

		fprintf(f, "set object 1 rect from %.4f, graph 0 to %.4f, graph 1 fc rgb '#eeeeee' behind\n",
			a, b > a ? b : a + 1e-3);
		fprintf(f, "set label 1 '%d-token prefill' at %.4f, graph 0.95\n", r->o.long_prompt, a);
	}
	fprintf(f, "plot '%s' index 1 using 1:2 with points pt 7 ps 0.3 lc rgb '#4477aa' title 'inter-token latency', \\\n"
		   "     '%s' index 0 using 1:2 with points pt 5 ps 0.8 lc rgb '#cc3311' title 'time to first token'\n",
		dat, dat);
	return fclose(f) ? -EIO : 0;
}

/* gnuplot as a child process; 1 when it is not installed. */
static int run_gnuplot(const char *script)
{
	char *argv[] = { "gnuplot", (char *)script, NULL };
	pid_t pid;
	int st, ret = posix_spawnp(&pid, "gnuplot", NULL, NULL, argv, environ);

	if (ret == ENOENT)
		return 1;
	if (ret)
		return -ret;
	if (waitpid(pid, &st, 0) != pid)
		return -errno;
	if (WIFEXITED(st) && WEXITSTATUS(st) == 127)
		return 1;
	return WIFEXITED(st) && !WEXITSTATUS(st) ? 0 : -EIO;
}

static int write_plot(const struct agent_run *r, const struct summary *s)
{
	const char *png = r->o.plot_path;
	size_t n = strlen(png) + 8;
	char *dat = malloc(n), *gp = malloc(n);
	int ret = -ENOMEM;

	if (dat && gp) {
		snprintf(dat, n, "%s.dat", png);
		snprintf(gp, n, "%s.gp", png);
		if ((ret = write_plot_data(r, s, dat)) || (ret = write_plot_script(r, gp, dat)))
			fprintf(stderr, "kdbench agent: %s: %s\n", ret == -EIO ? gp : dat, strerror(-ret));
		else if ((ret = run_gnuplot(gp)) == 1)
			fprintf(stderr, "kdbench agent: gnuplot is not installed: no plot (data in %s)\n", dat);
		else if (ret)
			fprintf(stderr, "kdbench agent: gnuplot %s failed (%s); data in %s\n", gp, strerror(-ret), dat);
	}
	free(dat);
	free(gp);
	return ret == 1 ? 0 : ret;
}

int agent_report(struct agent_run *r)
{
	struct summary s = { 0 };
	int ret = summarize(r, &s);

	if (ret) {
		fprintf(stderr, "kdbench agent: %ld requests: out of memory for the statistics\n", r->n_reqs);
	} else {
		if (s.span_s <= 0)
			s.span_s = 1e-9;
		print_table(r, &s);
		if (r->o.json_path)
			ret = write_json(r, &s);
		if (!ret && r->o.plot_path)
			ret = write_plot(r, &s);
	}
	summary_fini(&s);
	return ret;
}
