/* kdctl: the operator's tool. One JSON line to kdecd's socket, one line back,
 * printed as text (or as the JSON itself with --json). The daemon decides who may
 * run what (SO_PEERCRED): kdctl only sends and prints its answer. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/control_call.h"
#include "client/kdclient.h"

static void usage(FILE *f)
{
	char sock[256];

	kd_default_socket(sock, sizeof(sock));
	fprintf(f,
		"usage: kdctl [--socket PATH] [--json] COMMAND\n"
		"\n"
		"Any uid kdecd allows:\n"
		"  status         model, backend, uptime, clients, requests, KV blocks,\n"
		"                 decode path, parallel (tp and its all-reduce)\n"
		"  clients        connected clients (id, pid, uid, requests); yours only,\n"
		"                 unless you are an operator\n"
		"  sessions       sessions whose KV the daemon keeps: owner uid, tokens, device\n"
		"                 and host blocks, idle seconds; yours only, unless you are an\n"
		"                 operator\n"
		"  session-close NAME  close your session NAME and drop its KV\n"
		"  metrics        Prometheus text (kd_* metrics)\n"
		"Operators only (root, kdecd's uid, --operator-uid, --operator-gid):\n"
		"  drain          stop admitting new requests (running ones finish)\n"
		"  resume         admit requests again after drain\n"
		"  shutdown       like SIGTERM: drain, finish or cancel, exit\n"
		"  log-level L    error, warn, info or debug\n"
		"  snapshot       write the sessions to kdecd's --state-dir\n"
		"\n"
		"  --socket PATH  kdecd's socket (default %s)\n"
		"  --json         print the daemon's JSON reply\n"
		"  --version, --help\n",
		sock);
}

static void print_status(json_t *o)
{
	static const char *const keys[] = { "model", "model_path", "weights", "backend", "notify", "uptime_s", "clients",
		"max_clients", "requests_running", "requests_waiting", "kv_blocks_used",
		"kv_blocks_total", "kv_blocks_cached", "kv_blocks_free", "kv_host_blocks",
		"kv_host_bytes", "kv_sessions", "prefix_hit_tokens", "draining", "steps",
		"generation_tokens", "decode_path", "parallel" };

	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		json_t *v = json_object_get(o, keys[i]);

		if (json_is_string(v))
			printf("%-18s %s\n", keys[i], json_string_value(v));
		else if (json_is_integer(v))
			printf("%-18s %lld\n", keys[i], (long long)json_integer_value(v));
		else if (json_is_real(v))
			printf("%-18s %.1f\n", keys[i], json_real_value(v));
		else if (json_is_boolean(v))
			printf("%-18s %s\n", keys[i], json_is_true(v) ? "yes" : "no");
	}
}

static void print_table(json_t *o, const char *key)
{
	json_t *a = json_object_get(o, key), *e;
	size_t i;

	if (!strcmp(key, "clients")) {
		printf("%6s %8s %6s %8s %10s %10s %5s\n", "id", "pid", "uid", "requests", "submitted",
		       "generated", "spin");
		json_array_foreach(a, i, e)
			printf("%6lld %8lld %6lld %8lld %10lld %10lld %5s\n",
			       (long long)json_integer_value(json_object_get(e, "id")),
			       (long long)json_integer_value(json_object_get(e, "pid")),
			       (long long)json_integer_value(json_object_get(e, "uid")),
			       (long long)json_integer_value(json_object_get(e, "requests")),
			       (long long)json_integer_value(json_object_get(e, "submitted")),
			       (long long)json_integer_value(json_object_get(e, "generated")),
			       json_is_true(json_object_get(e, "spin")) ? "yes" : "no");
		return;
	}
	printf("%-32s %6s %8s %7s %6s %8s %8s\n", "session", "owner", "tokens", "device", "host",
	       "idle_s", "requests");
	json_array_foreach(a, i, e)
		printf("%-32s %6lld %8lld %7lld %6lld %8.1f %8lld\n",
		       json_string_value(json_object_get(e, "name")),
		       (long long)json_integer_value(json_object_get(e, "owner")),
		       (long long)json_integer_value(json_object_get(e, "tokens")),
		       (long long)json_integer_value(json_object_get(e, "blocks_device")),
		       (long long)json_integer_value(json_object_get(e, "blocks_host")),
		       json_real_value(json_object_get(e, "idle_s")),
		       (long long)json_integer_value(json_object_get(e, "requests")));
}

static const char *const commands[] = { "status", "clients", "sessions", "metrics", "session-close",
	"drain", "resume", "shutdown", "log-level", "snapshot" };

static int known(const char *cmd)
{
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		if (!strcmp(cmd, commands[i]))
			return 1;
	return 0;
}

int main(int argc, char **argv)
{
	const char *socket_path = NULL, *cmd = NULL, *level = NULL;
	char path[256], req[256], *reply = NULL;
	json_t *o;
	int json = 0, ret;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--version")) {
			printf("kdctl (kdec) %s, protocol %u\n", kd_version(), kd_protocol_version());
			return 0;
		} else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(argv[i], "--json")) {
			json = 1;
		} else if (!strcmp(argv[i], "--socket") && i + 1 < argc) {
			socket_path = argv[++i];
		} else if (!cmd && argv[i][0] != '-') {
			cmd = argv[i];
			if ((!strcmp(cmd, "log-level") || !strcmp(cmd, "session-close")) && i + 1 < argc)
				level = argv[++i];
		} else {
			fprintf(stderr, "kdctl: unexpected argument '%s'\n", argv[i]);
			usage(stderr);
			return 2;
		}
	}
	if (!cmd) {
		usage(stderr);
		return 2;
	}
	if (!known(cmd)) {
		fprintf(stderr, "kdctl: unknown command '%s'\n\n", cmd);
		usage(stderr);
		return 2;
	}
	if (!strcmp(cmd, "log-level")) {
		if (!level || strspn(level, "abcdefghijklmnopqrstuvwxyz") != strlen(level)) {
			fprintf(stderr, "kdctl: log-level needs one of error, warn, info, debug\n");
			return 2;
		}
		snprintf(req, sizeof(req), "{\"cmd\":\"log-level\",\"level\":\"%s\"}\n", level);
	} else if (!strcmp(cmd, "session-close")) {
		char why[200];

		/* the rule keeps quotes and escapes out of the JSON */
		if (!level) {
			fprintf(stderr, "kdctl: session-close needs a session name\n");
			return 2;
		}
		if (kd_session_name_check(level, why, sizeof(why))) {
			fprintf(stderr, "kdctl: session-close: %s\n", why);
			return 2;
		}
		snprintf(req, sizeof(req), "{\"cmd\":\"session-close\",\"name\":\"%s\"}\n", level);
	} else {
		snprintf(req, sizeof(req), "{\"cmd\":\"%s\"}\n", cmd);
	}
	if (!socket_path) {
		kd_default_socket(path, sizeof(path));
		socket_path = path;
	}
	if ((ret = control_call(socket_path, req, &reply))) {
		fprintf(stderr, "kdctl: cannot talk to kdecd at %s: %s\n", socket_path, kd_strerror(ret));
		return 1;
	}
	o = json_loads(reply, 0, NULL);
	if (!o || !json_is_true(json_object_get(o, "ok"))) {
		json_t *e = o ? json_object_get(o, "error") : NULL;

		fprintf(stderr, "kdctl %s: %s", cmd, json_is_string(e) ? json_string_value(e) : reply);
		fprintf(stderr, json_is_string(e) ? "\n" : "");
		json_decref(o);
		free(reply);
		return 1;
	}
	if (json)
		fputs(reply, stdout);
	else if (!strcmp(cmd, "status"))
		print_status(o);
	else if (!strcmp(cmd, "clients") || !strcmp(cmd, "sessions"))
		print_table(o, cmd);
	else if (!strcmp(cmd, "metrics"))
		fputs(json_string_value(json_object_get(o, "text")), stdout);
	else if (!strcmp(cmd, "snapshot"))
		printf("%lld sessions saved\n", (long long)json_integer_value(json_object_get(o, "sessions")));
	else
		printf("ok\n");
	json_decref(o);
	free(reply);
	return 0;
}
