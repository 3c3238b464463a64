/* The control protocol's rules without a daemon (issue 28, items 8 and 10):
 * - who may run which command: root and the daemon's uid always, --operator-uid and
 *   --operator-gid (the peer's primary or supplementary group: a socketpair carries
 *   this process's own groups), every other allowed uid only the read-only commands
 *   and session-close, refused in one line that names the operators;
 * - what a client sees: its own rows of clients and sessions, nobody else's pid,
 *   session name or token count; an operator sees all;
 * - resume parses, and drain {"on":false} still means resume;
 * - log_escape: control bytes, ESC, DEL, backslash, invalid UTF-8 and C1 controls as
 *   \xNN, valid UTF-8 kept, truncation at a whole escape. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/serve/control.h"
#include "tests/testutil.h"

static struct control_cmd parse(const char *line)
{
	struct control_cmd cmd;
	char err[256];

	memset(&cmd, 0, sizeof(cmd));
	CHECK(!control_parse(line, strlen(line), &cmd, err, sizeof(err)), "%s: %s", line, err);
	return cmd;
}

/* A uid that is neither root nor ours. */
static uid_t other_uid(void)
{
	return geteuid() == 4242 ? 4343 : 4242;
}

static void test_permit(void)
{
	static const char *const client_ok[] = { "status", "clients", "sessions", "metrics" };
	static const char *const op_only[] = { "drain", "resume", "shutdown", "snapshot" };
	uid_t ops[] = { 7001 };
	gid_t gops[] = { 6001 };
	struct control_operators o = { .uid = ops, .n_uid = 1, .gid = gops, .n_gid = 1 };
	struct control_peer client = { .pid = 1, .uid = other_uid(), .gid = 9999 };
	struct control_peer op = { .pid = 1, .uid = 7001, .gid = 9999, .op = 1 };
	struct control_cmd cmd;
	char line[128], err[256], want[256];

	for (size_t i = 0; i < sizeof(client_ok) / sizeof(client_ok[0]); i++) {
		snprintf(line, sizeof(line), "{\"cmd\":\"%s\"}", client_ok[i]);
		cmd = parse(line);
		CHECK(!control_permit(&cmd, &client, &o, err, sizeof(err)), "client refused %s: %s",
		      client_ok[i], err);
	}
	cmd = parse("{\"cmd\":\"session-close\",\"name\":\"mine\"}");
	CHECK(!control_permit(&cmd, &client, &o, err, sizeof(err)), "client refused session-close");
	cmd = parse("{\"hello\":\"kdclient\",\"protocol\":3}");
	CHECK(!control_permit(&cmd, &client, &o, err, sizeof(err)), "client refused its hello");
	if (geteuid() == 0)
		snprintf(want, sizeof(want), "uid %u is not an operator of this daemon (operators: uid 0, 7001; gid 6001)",
			 (unsigned)client.uid);
	else
		snprintf(want, sizeof(want), "uid %u is not an operator of this daemon (operators: uid 0, %u, 7001; gid 6001)",
			 (unsigned)client.uid, (unsigned)geteuid());
	for (size_t i = 0; i < sizeof(op_only) / sizeof(op_only[0]); i++) {
		snprintf(line, sizeof(line), "{\"cmd\":\"%s\"}", op_only[i]);
		cmd = parse(line);
		err[0] = 0;
		CHECK(control_permit(&cmd, &client, &o, err, sizeof(err)) == -EPERM && !strcmp(err, want),
		      "client ran %s, or the refusal is '%s', want '%s'", op_only[i], err, want);
		CHECK(!control_permit(&cmd, &op, &o, err, sizeof(err)), "operator refused %s", op_only[i]);
	}
	cmd = parse("{\"cmd\":\"log-level\",\"level\":\"debug\"}");
	CHECK(control_permit(&cmd, &client, &o, err, sizeof(err)) == -EPERM, "client ran log-level");
	cmd = parse("{\"cmd\":\"drain\",\"on\":false}");
	CHECK(cmd.kind == CTL_DRAIN && !cmd.on, "drain off parsed as %d/%d", cmd.kind, cmd.on);
	CHECK(control_permit(&cmd, &client, &o, err, sizeof(err)) == -EPERM, "client ran drain off");
	cmd = parse("{\"cmd\":\"resume\"}");
	CHECK(cmd.kind == CTL_RESUME && !strcmp(control_cmd_name(cmd.kind), "resume"), "resume parsed as %d",
	      cmd.kind);
}

/* Who is an operator, from a real socket's peer credentials. */
static void test_is_operator(void)
{
	struct control_operators none = { 0 }, by_uid, by_gid, by_other;
	uid_t me = geteuid(), u_other = other_uid();
	gid_t g = getegid(), g_other = getegid() + 1;
	int sv[2];

	by_uid = (struct control_operators){ .uid = &u_other, .n_uid = 1 };
	by_gid = (struct control_operators){ .gid = &g, .n_gid = 1 };
	by_other = (struct control_operators){ .gid = &g_other, .n_gid = 1 };
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
		CHECK(0, "socketpair: %s", strerror(errno));
		return;
	}
	CHECK(control_peer_is_operator(&none, sv[0], 0, 9999), "root is not an operator");
	CHECK(control_peer_is_operator(&none, sv[0], me, 9999), "the daemon's uid is not an operator");
	CHECK(!control_peer_is_operator(&none, sv[0], u_other, 9999), "uid %u is an operator", u_other);
	CHECK(control_peer_is_operator(&by_uid, sv[0], u_other, 9999), "--operator-uid %u ignored", u_other);
	CHECK(control_peer_is_operator(&by_gid, sv[0], u_other, g), "primary group %u ignored", g);
	CHECK(!control_peer_is_operator(&by_other, sv[0], u_other, 9999), "group %u counted", g_other);
	close(sv[0]);
	close(sv[1]);
}

/* A report with two users' clients and sessions. */
static void test_filter(void)
{
	uid_t a = other_uid(), b = a + 1;
	struct et_client_info cl[2] = { { .id = 1, .pid = 111, .uid = a, .inflight = 1 },
					 { .id = 2, .pid = 222, .uid = b, .inflight = 2 } };
	struct engine_session_info ks[2] = { { .name = "alice-chat", .owner = a, .n_tokens = 12 },
					     { .name = "bob-secret", .owner = b, .n_tokens = 34 } };
	struct sched_session_info ss[3] = { { .name = "alice-chat", .client_id = 1, .inflight = 1 },
					    { .name = "bob-secret", .client_id = 2, .inflight = 2 },
					    { .name = "alice-chat", .client_id = 2, .inflight = 5 } };
	struct et_report r = { .clients = cl, .n_clients = 2 };
	struct control_info info = { .model = "m", .backend = "cpu", .notify = "futex" };
	struct control_peer pa = { .uid = a }, pop = { .uid = b, .op = 1 };
	char *s;

	r.s.kv_sessions = ks;
	r.s.n_kv_sessions = 2;
	r.s.sessions = ss;
	r.s.n_sessions = 3;
	s = control_reply(CTL_CLIENTS, &r, &info, &pa);
	CHECK(s && strstr(s, "\"pid\":111") && !strstr(s, "222"), "client sees: %s", s);
	free(s);
	s = control_reply(CTL_SESSIONS, &r, &info, &pa);
	/* bob's client 2 has a session of the same name: not alice's requests */
	CHECK(s && strstr(s, "alice-chat") && !strstr(s, "bob-secret") && !strstr(s, "34") &&
	      strstr(s, "\"requests\":1"), "client sees: %s", s);
	free(s);
	s = control_reply(CTL_CLIENTS, &r, &info, &pop);
	CHECK(s && strstr(s, "111") && strstr(s, "222"), "operator sees: %s", s);
	free(s);
	s = control_reply(CTL_SESSIONS, &r, &info, &pop);
	CHECK(s && strstr(s, "alice-chat") && strstr(s, "bob-secret"), "operator sees: %s", s);
	free(s);
}

static void test_escape(void)
{
	static const struct {
		const char *in, *out;
	} cases[] = {
		{ "plain text: 'x' 1.5", "plain text: 'x' 1.5" },
		{ "a\nb\rc\td", "a\\x0ab\\x0dc\\x09d" },
		{ "\x1b[31mred\x7f", "\\x1b[31mred\\x7f" },
		{ "back\\slash", "back\\x5cslash" },
		{ "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80" },
		{ "c1 \xc2\x9b", "c1 \\xc2\\x9b" },			/* CSI as a C1 control */
		{ "bad \xff \xc0\xaf \xed\xa0\x80 \xe2\x82", "bad \\xff \\xc0\\xaf \\xed\\xa0\\x80 \\xe2\\x82" },
	};
	char out[128];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		size_t n = log_escape(out, sizeof(out), cases[i].in, strlen(cases[i].in));

		CHECK(n == strlen(out) && !strcmp(out, cases[i].out), "case %zu: '%s', want '%s'", i, out,
		      cases[i].out);
	}
	/* a NUL inside the text is a byte like the others */
	CHECK(log_escape(out, sizeof(out), "a\0b", 3) == 6 && !strcmp(out, "a\\x00b"), "NUL: '%s'", out);
	/* truncation never splits an escape or a character */
	CHECK(log_escape(out, 6, "ab\ncd", 5) == 2 && !strcmp(out, "ab"), "cut escape: '%s'", out);
	CHECK(log_escape(out, 4, "a\xc3\xa9x", 4) == 3 && !strcmp(out, "a\xc3\xa9"), "cut char: '%s'", out);
	CHECK(log_escape(out, 3, "a\xc3\xa9x", 4) == 1 && !strcmp(out, "a"), "cut char: '%s'", out);
}

int main(void)
{
	test_permit();
	test_is_operator();
	test_filter();
	test_escape();
	return test_result("test_control");
}
