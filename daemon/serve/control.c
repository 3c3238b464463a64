/* Control lines in and out. Parsing trusts nothing: the length is bounded by the
 * caller, jansson rejects malformed JSON, and every field is type-checked. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/sched/metrics.h"
#include "daemon/serve/control.h"

/* op: only operators may run it. The others read (a client sees its own rows) or
 * act on the caller's own session only. */
static const struct {
	const char *name;
	enum control_kind kind;
	int op;
} commands[] = {
	{ "status", CTL_STATUS, 0 }, { "clients", CTL_CLIENTS, 0 }, { "sessions", CTL_SESSIONS, 0 },
	{ "metrics", CTL_METRICS, 0 }, { "session-close", CTL_SESSION_CLOSE, 0 },
	{ "drain", CTL_DRAIN, 1 }, { "resume", CTL_RESUME, 1 }, { "shutdown", CTL_SHUTDOWN, 1 },
	{ "log-level", CTL_LOG_LEVEL, 1 }, { "snapshot", CTL_SNAPSHOT, 1 },
};

#define N_COMMANDS (sizeof(commands) / sizeof(commands[0]))

const char *control_cmd_name(enum control_kind kind)
{
	for (size_t i = 0; i < N_COMMANDS; i++)
		if (commands[i].kind == kind)
			return commands[i].name;
	return "hello";
}

static int in_groups(gid_t g, gid_t primary, const gid_t *groups, int n)
{
	if (g == primary)
		return 1;
	for (int k = 0; k < n; k++)
		if (groups[k] == g)
			return 1;
	return 0;
}

int control_peer_is_operator(const struct control_operators *o, int fd, uid_t uid, gid_t gid)
{
	gid_t groups[256];
	socklen_t len = sizeof(groups);
	int n;

	if (uid == 0 || uid == geteuid())
		return 1;
	for (int i = 0; i < o->n_uid; i++)
		if (o->uid[i] == uid)
			return 1;
	if (!o->n_gid)
		return 0;
	/* A peer in more groups than fit (ERANGE) is judged by its primary group. */
	n = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) ? 0 : (int)(len / sizeof(gid_t));
	for (int i = 0; i < o->n_gid; i++)
		if (in_groups(o->gid[i], gid, groups, n))
			return 1;
	return 0;
}

/* "uid 0, 1000, 1002; gid 50": who the operators are, for a refusal. */
static void describe_operators(const struct control_operators *o, char *buf, size_t len)
{
	uid_t me = geteuid();
	size_t n;

	n = (size_t)snprintf(buf, len, "uid 0");
	if (me != 0 && n < len)
		n += (size_t)snprintf(buf + n, len - n, ", %u", (unsigned)me);
	for (int i = 0; i < o->n_uid && n < len; i++)
		if (o->uid[i] != 0 && o->uid[i] != me)
			n += (size_t)snprintf(buf + n, len - n, ", %u", (unsigned)o->uid[i]);
	for (int i = 0; i < o->n_gid && n < len; i++)
		n += (size_t)snprintf(buf + n, len - n, "%s%u", i ? ", " : "; gid ", (unsigned)o->gid[i]);
}

int control_permit(const struct control_cmd *cmd, const struct control_peer *p,
		   const struct control_operators *o, char *err, size_t err_len)
{
	char ops[200];

	if (p->op)
		return 0;
	for (size_t i = 0; i < N_COMMANDS; i++) {
		if (commands[i].kind != cmd->kind || !commands[i].op)
			continue;
		describe_operators(o, ops, sizeof(ops));
		snprintf(err, err_len, "uid %u is not an operator of this daemon (operators: %s)",
			 (unsigned)p->uid, ops);
		return -EPERM;
	}
	return 0;
}

static int parse_hello(json_t *o, struct control_cmd *cmd, char *err, size_t err_len)
{
	json_t *v = json_object_get(o, "hello"), *p = json_object_get(o, "protocol");
	json_t *spin = json_object_get(o, "spin");

	if (!json_is_string(v) || strcmp(json_string_value(v), "kdclient")) {
		snprintf(err, err_len, "hello: want \"kdclient\"");
		return -EINVAL;
	}
	if (!json_is_integer(p)) {
		snprintf(err, err_len, "hello: protocol must be an integer");
		return -EINVAL;
	}
	if (spin && !json_is_boolean(spin)) {
		snprintf(err, err_len, "hello: spin must be true or false");
		return -EINVAL;
	}
	cmd->kind = CTL_HELLO;
	cmd->protocol = json_integer_value(p);
	cmd->spin = json_is_true(spin);
	return 0;
}

static int parse_cmd(json_t *o, struct control_cmd *cmd, char *err, size_t err_len)
{
	json_t *c = json_object_get(o, "cmd");
	const char *name;

	if (!json_is_string(c)) {
		snprintf(err, err_len, "want {\"cmd\": \"status\"} or a client hello");
		return -EINVAL;
	}
	name = json_string_value(c);
	for (size_t i = 0; i < N_COMMANDS; i++) {
		if (strcmp(name, commands[i].name))
			continue;
		cmd->kind = commands[i].kind;
		if (cmd->kind == CTL_DRAIN) {
			json_t *on = json_object_get(o, "on");

			if (on && !json_is_boolean(on)) {
				snprintf(err, err_len, "drain: on must be true or false");
				return -EINVAL;
			}
			cmd->on = !on || json_is_true(on);
		} else if (cmd->kind == CTL_LOG_LEVEL) {
			json_t *l = json_object_get(o, "level");
			enum log_level lv;

			if (!json_is_string(l) || log_level_parse(json_string_value(l), &lv)) {
				snprintf(err, err_len, "log-level: level must be error, warn, info or debug");
				return -EINVAL;
			}
			cmd->level = (int)lv;
		} else if (cmd->kind == CTL_SESSION_CLOSE) {
			json_t *n = json_object_get(o, "name");

			/* The engine checks the characters: an odd name is simply not found. */
			if (!json_is_string(n) || !json_string_length(n) ||
			    json_string_length(n) > KV_SESSION_NAME_MAX) {
				snprintf(err, err_len, "session-close: name must be 1..%d bytes",
					 KV_SESSION_NAME_MAX);
				return -EINVAL;
			}
			snprintf(cmd->name, sizeof(cmd->name), "%s", json_string_value(n));
		}
		return 0;
	}
	snprintf(err, err_len, "unknown command (status, clients, sessions, metrics, session-close, drain, resume, shutdown, log-level, snapshot)");
	return -EINVAL;
}

int control_parse(const char *line, size_t len, struct control_cmd *cmd, char *err, size_t err_len)
{
	json_error_t je;
	json_t *o;
	int ret;

	memset(cmd, 0, sizeof(*cmd));
	o = json_loadb(line, len, JSON_REJECT_DUPLICATES, &je);
	if (!o) {
		snprintf(err, err_len, "not JSON: %s", je.text);
		return -EINVAL;
	}
	if (!json_is_object(o)) {
		snprintf(err, err_len, "want a JSON object");
		ret = -EINVAL;
	} else if (json_object_get(o, "hello")) {
		ret = parse_hello(o, cmd, err, err_len);
	} else {
		ret = parse_cmd(o, cmd, err, err_len);
	}
	json_decref(o);
	return ret;
}

/* Dumps o as one line and frees it. */
static char *line_of(json_t *o)
{
	char *s, *l;
	size_t n;

	if (!o)
		return NULL;
	s = json_dumps(o, JSON_COMPACT);
	json_decref(o);
	if (!s)
		return NULL;
	n = strlen(s);
	l = realloc(s, n + 2);
	if (!l) {
		free(s);
		return NULL;
	}
	l[n] = '\n';
	l[n + 1] = '\0';
	return l;
}

char *control_reply_error(const char *msg, int err)
{
	return line_of(json_pack("{s:b, s:s, s:i}", "ok", 0, "error", msg, "errno", err < 0 ? -err : err));
}

char *control_reply_ok(void)
{
	return line_of(json_pack("{s:b}", "ok", 1));
}

/* Cache figures: device blocks, the host tier, the prefix cache's hits. */
static int status_cache(json_t *o, const struct et_report *r)
{
	const struct engine_cache_status *c = &r->s.cache;
	json_t *more;
	int ret;

	more = json_pack("{s:i, s:i, s:i, s:I, s:I, s:I, s:i, s:I, s:I}",
			"kv_blocks_cached", c->blocks_cached, "kv_blocks_free", c->blocks_free,
			"kv_block_tokens", c->block_tokens, "kv_host_blocks", (json_int_t)c->host_blocks,
			"kv_host_bytes", (json_int_t)c->host_bytes,
			"kv_host_budget", (json_int_t)c->host_budget, "kv_sessions", c->sessions,
			"prefix_hit_tokens", (json_int_t)r->s.prefix_hit_tokens,
			"kv_offloaded_blocks", (json_int_t)r->s.stats.offloaded_blocks);
	ret = more ? json_object_update(o, more) : -1;
	json_decref(more);
	return ret;
}

static json_t *status(const struct et_report *r, const struct control_info *info)
{
	json_t *path;
	json_t *o = json_pack("{s:b, s:s, s:s, s:s, s:s, s:f, s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:I, s:I, s:I}",
			      "ok", 1, "model", info->model, "weights", info->weights, "backend", info->backend,
			      "notify", info->notify, "uptime_s", info->uptime_s,
			      "clients", r->n_clients, "max_clients", info->max_clients,
			      "requests_running", r->s.running, "requests_waiting", r->s.waiting,
			      "kv_blocks_used", r->s.kv_blocks_used, "kv_blocks_total", r->s.kv_blocks_total,
			      "draining", r->s.draining, "steps", (json_int_t)r->steps,
			      "generation_tokens", (json_int_t)r->s.m.generation_tokens,
			      "preemptions", (json_int_t)r->s.m.preemptions);

	/* a path that is not UTF-8 (json_string gives NULL) is left out */
	path = o && info->model_path ? json_string(info->model_path) : NULL;
	if (path && json_object_set_new(o, "model_path", path)) {
		json_decref(o);
		return NULL;
	}
	if (o && json_object_set_new(o, "decode_path", json_string(r->decode_path))) {
		json_decref(o);
		return NULL;
	}
	if (o && json_object_set_new(o, "parallel", json_string(r->parallel))) {
		json_decref(o);
		return NULL;
	}
	if (o && status_cache(o, r)) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static json_t *clients(const struct et_report *r, const struct control_peer *p)
{
	json_t *a = json_array();

	for (int i = 0; a && i < r->n_clients; i++) {
		const struct et_client_info *c = &r->clients[i];

		if (!p->op && c->uid != p->uid)
			continue;	/* another user's pid and figures */
		json_array_append_new(a, json_pack("{s:i, s:i, s:i, s:b, s:i, s:I, s:I, s:f}",
						   "id", (int)c->id, "pid", (int)c->pid, "uid", (int)c->uid,
						   "spin", c->spin, "requests", c->inflight,
						   "submitted", (json_int_t)c->submitted,
						   "generated", (json_int_t)c->generated,
						   "connected_s", c->connected_s));
	}
	return json_pack("{s:b, s:o}", "ok", 1, "clients", a);
}

/* The uid of connected client id, or (uint64_t)-1. */
static uint64_t client_uid(const struct et_report *r, uint32_t id)
{
	for (int i = 0; i < r->n_clients; i++)
		if (r->clients[i].id == id)
			return r->clients[i].uid;
	return (uint64_t)-1;
}

/* The engine's sessions (the KV they keep), with the requests using each (its
 * owner's clients' requests with its name). */
static json_t *sessions(const struct et_report *r, const struct control_peer *p)
{
	json_t *a = json_array();

	for (int i = 0; a && i < r->s.n_kv_sessions; i++) {
		const struct engine_session_info *s = &r->s.kv_sessions[i];
		int inflight = 0;

		if (!p->op && s->owner != (uint64_t)p->uid)
			continue;	/* another user's name and token count */
		for (int k = 0; k < r->s.n_sessions; k++)
			if (!strcmp(r->s.sessions[k].name, s->name) &&
			    client_uid(r, r->s.sessions[k].client_id) == s->owner)
				inflight += r->s.sessions[k].inflight;
		json_array_append_new(a, json_pack("{s:s, s:I, s:i, s:i, s:i, s:f, s:b, s:i}",
						   "name", s->name, "owner", (json_int_t)s->owner,
						   "tokens", s->n_tokens, "blocks_device", s->blocks_device,
						   "blocks_host", s->blocks_host, "idle_s", s->idle_s,
						   "busy", s->busy, "requests", inflight));
	}
	return json_pack("{s:b, s:o}", "ok", 1, "sessions", a);
}

static json_t *metrics(const struct et_report *r, const struct control_info *info)
{
	struct metrics_gauges g = {
		.requests_running = r->s.running, .requests_waiting = r->s.waiting,
		.clients = r->n_clients, .kv_blocks_used = r->s.kv_blocks_used,
		.kv_blocks_total = r->s.kv_blocks_total, .prefix_hit_tokens = r->s.prefix_hit_tokens,
		.offloaded_blocks = r->s.stats.offloaded_blocks,
		.offloaded_bytes = r->s.stats.offloaded_bytes,
		.offloaded_zbytes = r->s.stats.offloaded_zbytes, .restores = r->s.stats.restores,
		.restored_blocks = r->s.stats.restored_blocks, .restore_ns = r->s.stats.restore_ns,
		.moves_in_flight = r->s.stats.moves_in_flight,
		.move_bytes_in_flight = r->s.stats.move_bytes_in_flight,
		.uptime_s = info->uptime_s, .decode_lat_mask = r->decode_lat_mask,
	};
	char *text = metrics_format(&r->s.m, &g);
	json_t *o;

	if (!text)
		return NULL;
	o = json_pack("{s:b, s:s}", "ok", 1, "text", text);
	free(text);
	return o;
}

char *control_reply(enum control_kind kind, const struct et_report *r, const struct control_info *info,
		    const struct control_peer *p)
{
	switch (kind) {
	case CTL_SNAPSHOT:
	case CTL_SESSION_CLOSE:
		if (r->op_ret)
			return control_reply_error(r->op_err, r->op_ret);
		if (kind == CTL_SNAPSHOT)
			return line_of(json_pack("{s:b, s:i}", "ok", 1, "sessions", r->op_count));
		return control_reply_ok();
	case CTL_STATUS: return line_of(status(r, info));
	case CTL_CLIENTS: return line_of(clients(r, p));
	case CTL_SESSIONS: return line_of(sessions(r, p));
	case CTL_METRICS: return line_of(metrics(r, info));
	default: return control_reply_ok();
	}
}
