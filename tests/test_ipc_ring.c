/* The shared-memory protocol without a daemon: the daemon's reader against records
 * written as libkdclient writes them (wrapped payload, bad records, impossible
 * indices), the event ring's back-pressure and queued finals, the control parser,
 * the metrics text, and one session-name rule on both sides. */
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/sched/client_conn.h"
#include "daemon/serve/control.h"
#include "client/kdclient.h"
#include "daemon/sched/metrics.h"
#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"
#include "kvcache/session.h"
#include "tests/testutil.h"

static void put_request(void *seg, uint32_t slot, uint32_t pos, uint32_t n)
{
	struct ipc_seg_hdr *h = seg;
	struct ipc_sub *r = ipc_seg_sub(seg, slot);
	int32_t tok[300];

	for (uint32_t i = 0; i < n; i++)
		tok[i] = (int32_t)(pos + i);
	ipc_pay_write(seg, pos, n, tok);
	memset(r, 0, sizeof(*r));
	r->kind = IPC_SUB_REQUEST;
	r->req_id = slot + 1;
	r->tok_pos = pos;
	r->n_tokens = n;
	r->max_tokens = 4;
	strcpy(r->session, "agent-1.main:x");
	ipc_store_release(&h->sub_tail, slot + 1);
}

static void test_reader(void)
{
	const struct client_limits lim = { .max_prompt = 1024, .max_new = 1024, .max_inflight = 8,
					   .vocab_size = 512, .model = "llama" };
	struct client_conn *c;
	struct ipc_sub rec;
	int32_t *tok;
	char err[256];
	int ret;

	ret = client_conn_create(&c, 7, IPC_NOTIFY_FUTEX, &lim, err, sizeof(err));
	CHECK(!ret, "client_conn_create: %s", err);
	if (ret)
		return;
	CHECK((fcntl(c->memfd, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) ==
	      (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), "segment not sealed");
	CHECK(ftruncate(c->memfd, 4096) < 0, "a sealed segment shrank");
	CHECK(client_conn_take(c, &rec, &tok) == 0, "empty ring gave a record");

	/* A prompt that wraps around the end of the payload ring. */
	put_request(c->seg, 0, IPC_PAY_TOKENS - 100, 250);
	ret = client_conn_take(c, &rec, &tok);
	CHECK(ret == 1 && rec.n_tokens == 250, "take: %d", ret);
	if (ret == 1) {
		int ok = 1;

		for (int i = 0; i < 250; i++)
			ok &= tok[i] == (int32_t)(IPC_PAY_TOKENS - 100 + (uint32_t)i);
		CHECK(ok, "wrapped payload read back wrong");
		free(tok);
	}
	CHECK(atomic_load(&((struct ipc_seg_hdr *)c->seg)->sub_head) == 1, "head not published");

	/* Malformed records are protocol violations. */
	put_request(c->seg, 1, 0, 3);
	ipc_seg_sub(c->seg, 1)->reserved[3] = 1;
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "reserved"), "reserved word: %s", c->why);
	ipc_seg_sub(c->seg, 1)->reserved[3] = 0;
	/* Sampling fields out of their bounds. */
	{
		struct ipc_sub *r = ipc_seg_sub(c->seg, 1);

		r->min_p = 1.5f;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "min_p"), "min_p: %s", c->why);
		r->min_p = 0.1f;
		r->repetition_penalty = 11;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "repetition"), "rep: %s", c->why);
		r->repetition_penalty = -1;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "negative repetition penalty accepted");
		r->repetition_penalty = 1.2f;
		r->presence_penalty = NAN;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "presence"), "presence: %s", c->why);
		r->presence_penalty = 2;
		r->frequency_penalty = -2.5f;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "frequency"), "frequency: %s", c->why);
		r->frequency_penalty = -2;
		r->flags = IPC_SUB_TOP_LOGPROB;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "top logprob without logprobs accepted");
		r->flags = 1u << 31;
		CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "unknown flag accepted");
		r->flags = 0;
		r->min_p = r->repetition_penalty = r->presence_penalty = r->frequency_penalty = 0;
	}
	strcpy(ipc_seg_sub(c->seg, 1)->session, "bad name");
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "bad session name accepted");
	memset(ipc_seg_sub(c->seg, 1)->session, 'a', IPC_SESSION_MAX);
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "unterminated session name accepted");
	put_request(c->seg, 1, 0, 3);
	ipc_seg_sub(c->seg, 1)->n_tokens = IPC_PAY_TOKENS + 1;
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "oversized prompt accepted");
	put_request(c->seg, 1, 0, 3);
	ipc_seg_sub(c->seg, 1)->temperature = -1;
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO, "negative temperature accepted");
	put_request(c->seg, 1, 0, 3);
	CHECK(client_conn_take(c, &rec, &tok) == 1, "a good record after bad ones");
	free(tok);
	/* An impossible tail (more records than slots). */
	ipc_store_release(&((struct ipc_seg_hdr *)c->seg)->sub_tail, c->sub_head + IPC_SUB_SLOTS + 1);
	CHECK(client_conn_take(c, &rec, &tok) == -EPROTO && strstr(c->why, "impossible"), "tail: %s", c->why);

	/* Event ring: token space stops one short of full; finals queue past it. */
	{
		struct ipc_event ev = { .req_id = 1, .token = 5 };
		int f = client_conn_ev_free(c), pushed = 0;

		CHECK(f == (int)IPC_EV_SLOTS - 1, "free slots %d", f);
		while (client_conn_ev_free(c) > 0 && pushed < 5000) {
			client_conn_push(c, &ev);
			pushed++;
		}
		ev.flags = IPC_EV_FINAL;
		CHECK(!client_conn_push(c, &ev) && !client_conn_push(c, &ev), "finals not accepted");
		CHECK(c->n_pending == 1, "%d finals pending, want 1", c->n_pending);
		client_conn_publish(c);
		ipc_store_release(&((struct ipc_seg_hdr *)c->seg)->ev_head, 10);
		CHECK(!client_conn_flush(c) && c->n_pending == 0, "pending final not flushed");
		ipc_store_release(&((struct ipc_seg_hdr *)c->seg)->ev_head, c->ev_tail + 5);
		CHECK(client_conn_ev_free(c) == -EPROTO, "impossible ev_head accepted");
	}
	client_conn_destroy(c);
}

static void test_control(void)
{
	static const char *const bad[] = { "", "{", "[]", "{\"cmd\":1}", "{\"cmd\":\"nope\"}",
		"{\"hello\":\"x\",\"protocol\":2}", "{\"hello\":\"kdclient\"}",
		"{\"cmd\":\"log-level\",\"level\":\"loud\"}", "{\"cmd\":\"drain\",\"on\":3}",
		"{\"cmd\":\"status\",\"cmd\":\"status\"}" };
	struct control_cmd cmd;
	char err[256];

	CHECK(!control_parse("{\"cmd\":\"status\"}", 16, &cmd, err, sizeof(err)) && cmd.kind == CTL_STATUS,
	      "status: %s", err);
	CHECK(!control_parse("{\"hello\":\"kdclient\",\"protocol\":2,\"spin\":true}", 45, &cmd, err, sizeof(err)) &&
	      cmd.kind == CTL_HELLO && cmd.protocol == 2 && cmd.spin, "hello: %s", err);
	CHECK(!control_parse("{\"cmd\":\"drain\",\"on\":false}", 26, &cmd, err, sizeof(err)) &&
	      cmd.kind == CTL_DRAIN && !cmd.on, "drain off: %s", err);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		CHECK(control_parse(bad[i], strlen(bad[i]), &cmd, err, sizeof(err)) == -EINVAL && err[0],
		      "accepted '%s'", bad[i]);
}

static void test_metrics(void)
{
	static const char *const names[] = { "kd_time_to_first_token_seconds_bucket",
		"kd_inter_token_latency_seconds_count", "kd_requests_running 3", "kd_requests_waiting 1",
		"kd_kv_cache_usage_ratio 0.25", "kd_prompt_tokens_total 10",
		"kd_generation_tokens_total 2", "kd_prefix_cache_hit_tokens_total 7" };
	struct metrics m = { .prompt_tokens = 10, .generation_tokens = 2 };
	struct metrics_gauges g = { .requests_running = 3, .requests_waiting = 1, .kv_blocks_used = 4,
				    .kv_blocks_total = 16, .prefix_hit_tokens = 7 };
	char *text;

	metrics_observe_ttft(&m, 0.003);
	metrics_observe_itl(&m, 0.0002);
	text = metrics_format(&m, &g);
	CHECK(text != NULL, "metrics_format");
	for (size_t i = 0; text && i < sizeof(names) / sizeof(names[0]); i++)
		CHECK(strstr(text, names[i]), "metrics text lacks '%s'", names[i]);
	CHECK(text && strstr(text, "kd_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"), "ttft bucket");
	free(text);
}

_Static_assert(KD_SESSION_MAX == KV_SESSION_NAME_MAX && KV_SESSION_NAME_MAX == IPC_SESSION_MAX - 1,
	       "one session-name length on the wire, in the client and in the engine");

/* The wire check and the engine's agree on every byte at every length around the
 * limit (the client's kd_session_name_check is the wire check per character). */
static void test_session_names(void)
{
	char name[IPC_SESSION_MAX + 8];
	int bad = 0;

	for (int c = 1; c < 256; c++) {
		for (int n = 0; n <= IPC_SESSION_MAX + 2; n++) {
			int wire, engine;

			memset(name, 'a', (size_t)n);
			name[n] = 0;
			if (n)
				name[n / 2] = (char)c;
			/* the wire record is NUL-padded: a name of 64 or more does not fit */
			wire = n > 0 && n < IPC_SESSION_MAX && !ipc_session_check(name, IPC_SESSION_MAX);
			engine = kv_session_name_ok(name);
			bad += wire != engine;
		}
	}
	CHECK(!bad, "%d names where the wire check and the engine disagree", bad);
	CHECK(kv_session_name_ok("Ab0._:-") && !kv_session_name_ok("a/b") && !kv_session_name_ok("a b") &&
	      !kv_session_name_ok("a\x1b"), "the rule's examples");
}

int main(void)
{
	test_session_names();
	test_reader();
	test_control();
	test_metrics();
	return test_result("test_ipc_ring");
}
