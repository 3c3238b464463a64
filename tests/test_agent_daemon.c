/* kdbench agent against a real kdecd on the tiny Llama 3 checkpoint (CPU backend):
 * - a 3 s run of 4 sessions: exit 0; its JSON is consistent (every request's
 *   received tokens equal the daemon's count, percentiles ordered, later turns
 *   re-send a longer history, the prefix cache hits since they repeat it);
 * - --max-requests ends the run early with exactly that many requests;
 * - the drain: requests longer than the run are cancelled after --grace, in bounded
 *   time;
 * - bad options are refused with exit 2. */
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/kdclient.h"
#include "tests/daemontest.h"
#include "tests/testutil.h"

#define MAX_REQUESTS 400

static struct daemontest kdecd;

/* Runs kdbench agent with args; its exit status, and how long it took in *secs. */
static int agent(const char *args, double *secs)
{
	char cmd[2048];
	double t0 = test_now_s();
	int st;

	snprintf(cmd, sizeof(cmd), "'%s/kdbench' agent --socket '%s' %s >>'%s/agent.out' 2>&1",
		 kdecd.builddir, kdecd.sock, args, kdecd.dir);
	st = system(cmd);
	if (secs)
		*secs = test_now_s() - t0;
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static json_t *load(const char *name)
{
	char path[400];
	json_error_t err;
	json_t *o;

	snprintf(path, sizeof(path), "%s/%s", kdecd.dir, name);
	o = json_load_file(path, 0, &err);
	CHECK(o != NULL, "%s: %s (line %d)", path, err.text, err.line);
	return o;
}

static double num(json_t *o, const char *key)
{
	return json_number_value(json_object_get(o, key));
}

static void check_dist(json_t *root, const char *key)
{
	json_t *d = json_object_get(root, key);

	CHECK(d && num(d, "p50") <= num(d, "p90") && num(d, "p90") <= num(d, "p99") &&
	      num(d, "p99") <= num(d, "max") && num(d, "n") > 0,
	      "%s: p50 %.3f p90 %.3f p99 %.3f max %.3f n %.0f: not ordered or empty", key, num(d, "p50"),
	      num(d, "p90"), num(d, "p99"), num(d, "max"), num(d, "n"));
}

/* Every record: tokens received == the daemon's count; lengths; turns grow. */
static void check_records(json_t *root, long *n_sub)
{
	json_t *recs = json_object_get(root, "records"), *q;
	int last_prompt[4][64];
	size_t i;

	memset(last_prompt, 0, sizeof(last_prompt));
	CHECK(json_array_size(recs) == (size_t)num(root, "requests"), "%zu records for %.0f requests",
	      json_array_size(recs), num(root, "requests"));
	*n_sub = 0;
	json_array_foreach(recs, i, q) {
		const char *stop = json_string_value(json_object_get(q, "stop"));
		const char *kind = json_string_value(json_object_get(q, "kind"));
		int tokens = (int)num(q, "tokens"), out = (int)num(q, "output_tokens");
		int s = (int)num(q, "session"), conv = (int)num(q, "conversation"), prompt = (int)num(q, "prompt_tokens");

		CHECK(tokens == out, "record %zu: %d tokens received, the daemon says %d", i, tokens, out);
		CHECK(stop && !strcmp(stop, "length") && tokens == (int)num(q, "max_tokens"),
		      "record %zu: stop %s with %d of %.0f tokens", i, stop ? stop : "?", tokens, num(q, "max_tokens"));
		CHECK(num(q, "ttft_ms") > 0 && num(q, "e2e_ms") >= num(q, "ttft_ms"), "record %zu: ttft %.3f e2e %.3f",
		      i, num(q, "ttft_ms"), num(q, "e2e_ms"));
		if (kind && !strcmp(kind, "subagent")) {
			++*n_sub;
			continue;
		}
		/* a later turn re-sends the history: a longer prompt than the turn before */
		if (s >= 0 && s < 4 && conv >= 0 && conv < 64) {
			CHECK(prompt > last_prompt[s][conv], "session %d conversation %d: prompt %d after %d", s, conv,
			      prompt, last_prompt[s][conv]);
			last_prompt[s][conv] = prompt;
		}
	}
}

static void test_run(void)
{
	double secs;
	json_t *root;
	long n_sub;
	char png[300], args[1200];
	FILE *f;

	snprintf(png, sizeof(png), "%s/agent.png", kdecd.dir);
	snprintf(args, sizeof(args),
		 "--sessions 4 --duration 3 --max-requests %d --turns 6 --think-ms 50 --first-prompt 256 "
		 "--turn-tokens 32 --output-tokens 12 --subagent-prob 0.3 --seed 7 --vocab 512 "
		 "--json '%s/agent.json' --plot '%s'", MAX_REQUESTS, kdecd.dir, png);
	CHECK(agent(args, &secs) == 0, "kdbench agent exit status (see %s/agent.out)", kdecd.dir);
	/* an outer bound only (the JSON's counts check the run): a loaded 2-core machine
	 * under ASan may be seconds late; a run that never ended would not be */
	CHECK(secs < 3 + 5 + 20, "run of 3 s + 5 s grace took %.1f s", secs);
	if (!(root = load("agent.json")))
		return;
	CHECK(num(root, "requests") > 0 && num(root, "requests") <= MAX_REQUESTS, "requests %.0f",
	      num(root, "requests"));
	CHECK(num(root, "completed") == num(root, "requests") && num(root, "errors") == 0,
	      "%.0f of %.0f completed, %.0f errors", num(root, "completed"), num(root, "requests"),
	      num(root, "errors"));
	check_dist(root, "ttft_ms");
	check_dist(root, "itl_ms");
	check_dist(root, "normalized_ms_per_token");
	CHECK(num(root, "p90_interactivity_tokens_per_s") > 0, "interactivity %.1f",
	      num(root, "p90_interactivity_tokens_per_s"));
	CHECK(num(root, "prefix_hit_rate") > 0 && num(root, "prefix_hit_rate") <= 1, "prefix hit rate %.3f",
	      num(root, "prefix_hit_rate"));
	CHECK(num(root, "output_tokens_per_s") > 0, "throughput");
	check_records(root, &n_sub);
	fprintf(stderr, "agent run: %.0f requests (%ld sub-agent), TTFT p50 %.1f ms, ITL p50 %.2f ms, "
		"hit rate %.3f, %.0f tokens/s, %.1f s\n", num(root, "requests"), n_sub,
		num(json_object_get(root, "ttft_ms"), "p50"), num(json_object_get(root, "itl_ms"), "p50"),
		num(root, "prefix_hit_rate"), num(root, "output_tokens_per_s"), secs);
	json_decref(root);
	/* the plot exists when gnuplot does (the tool skips it, saying so, otherwise) */
	if (system("command -v gnuplot >/dev/null 2>&1")) {
		test_skip("the latency plot: gnuplot is not installed here");
	} else if ((f = fopen(png, "rb"))) {
		unsigned char m[4] = { 0 };

		CHECK(fread(m, 1, 4, f) == 4 && m[1] == 'P' && m[2] == 'N' && m[3] == 'G', "%s is not a PNG", png);
		fclose(f);
	} else {
		CHECK(0, "gnuplot is installed, and kdbench agent --plot wrote no %s", png);
	}
}

static void test_bounds(void)
{
	char args[600];
	double secs;
	json_t *root;

	/* the count ends the run long before the duration */
	snprintf(args, sizeof(args), "--sessions 4 --duration 20 --max-requests 6 --think-ms 0 "
		 "--first-prompt 64 --output-tokens 8 --vocab 512 --json '%s/bounds.json'", kdecd.dir);
	CHECK(agent(args, &secs) == 0, "--max-requests run");
	/* a run that ignored the count would take the 20 s (and the grace): any time
	 * below that, however loaded the machine, shows the count ended it */
	CHECK(secs < 19, "--max-requests 6 of a 20 s run took %.1f s", secs);
	if ((root = load("bounds.json"))) {
		CHECK(num(root, "requests") == 6 && num(root, "completed") == 6, "requests %.0f completed %.0f, want 6",
		      num(root, "requests"), num(root, "completed"));
		json_decref(root);
	}
}

/* Requests of 3000 tokens in a 1 s run: the drain cancels them after the 0.5 s
 * grace and the run ends in bounded time, every token still accounted for. */
static void test_drain(void)
{
	char args[600];
	double secs;
	json_t *root, *q;
	size_t i;

	snprintf(args, sizeof(args), "--sessions 2 --duration 1 --grace 0.5 --first-prompt 32 "
		 "--output-tokens 3000 --vocab 512 --json '%s/drain.json'", kdecd.dir);
	CHECK(agent(args, &secs) == 0, "drain run");
	/* an outer bound (the cancelled count below is the check that the drain cancels):
	 * generous for a loaded 2-core machine under ASan */
	CHECK(secs < 1 + 0.5 + 20, "1 s run with 0.5 s grace took %.1f s", secs);
	if (!(root = load("drain.json")))
		return;
	CHECK(num(root, "requests") == 2 && num(root, "cancelled") == 2, "requests %.0f cancelled %.0f, want 2 and 2",
	      num(root, "requests"), num(root, "cancelled"));
	json_array_foreach(json_object_get(root, "records"), i, q)
		CHECK(num(q, "tokens") == num(q, "output_tokens") && num(q, "tokens") > 0 &&
		      num(q, "tokens") < 3000, "drained record %zu: %.0f tokens, the daemon says %.0f", i,
		      num(q, "tokens"), num(q, "output_tokens"));
	json_decref(root);
}

static void test_options(void)
{
	CHECK(agent("--sessions 0", NULL) == 2, "--sessions 0 accepted");
	CHECK(agent("--sessions 257", NULL) == 2, "--sessions 257 accepted");
	CHECK(agent("--subagent-prob 1.5", NULL) == 2, "--subagent-prob 1.5 accepted");
	CHECK(agent("--first-prompt 5000 --max-context 4096", NULL) == 2, "a first prompt past the context accepted");
	CHECK(agent("--duration 0", NULL) == 2, "--duration 0 accepted");
	CHECK(agent("--plot \"it's.png\"", NULL) == 2, "a quote in --plot accepted");
}

int main(void)
{
	if (daemontest_init(&kdecd, "agent"))
		return 1;
	test_options();
	if (daemontest_start(&kdecd, "daemon.log", "--notify", "eventfd", NULL) == 0) {
		test_run();
		test_bounds();
		test_drain();
	} else {
		CHECK(0, "kdecd did not start (log in %s)", kdecd.dir);
	}
	daemontest_finish(&kdecd);
	return test_result("test_agent_daemon");
}
