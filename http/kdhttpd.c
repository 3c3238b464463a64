/* kdhttpd: the OpenAI and Anthropic HTTP APIs in front of a running kdecd, a client
 * of it through libkdclient. main: the command line, the API key file, signals. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/kdclient.h"
#include "http/http_backend.h"
#include "http/http_server.h"

#define MAX_KEYS 64

static void usage(FILE *f)
{
	char sock[256];

	kd_default_socket(sock, sizeof(sock));
	fprintf(f,
		"usage: kdhttpd [--socket PATH] [--listen HOST:PORT|unix:PATH] [--api-key-file F]\n"
		"               [--model-name NAME] [options]\n"
		"\n"
		"Serves the OpenAI (/v1/chat/completions, /v1/completions) and Anthropic\n"
		"(/v1/messages) APIs, /v1/models, /health and /metrics over HTTP, generating on a\n"
		"running kdecd (docs/HTTP.md).\n"
		"\n"
		"  --socket PATH         kdecd's socket (default %s)\n"
		"  --listen ADDR         HOST:PORT, [V6]:PORT or unix:PATH (default 127.0.0.1:8000;\n"
		"                        port 0: one from the kernel, printed)\n"
		"  --api-key-file F      requests must carry one of F's keys (one per line) as\n"
		"                        'Authorization: Bearer KEY' or 'x-api-key: KEY'\n"
		"  --model-name NAME     the model's name in answers (default: the served file's)\n"
		"  --tokenizer PATH      the model's tokenizer: a .gguf or a directory with\n"
		"                        tokenizer.json (default: the model kdecd serves)\n"
		"  --max-body BYTES      largest request body (default 8388608)\n"
		"  --timeout S           close a connection idle this long (default 60)\n"
		"  --max-connections N   connections at once (default 256)\n"
		"  --queue-timeout S     how long a request waits while kdhttpd's tokens in flight\n"
		"                        are at kdecd's cap (default 300)\n"
		"  --version, --help\n",
		sock);
}

static int parse_uint(const char *opt, const char *s, unsigned long long min,
		      unsigned long long max, unsigned long long *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (end == s || *end || errno || v < min || v > max || s[0] == '-') {
		fprintf(stderr, "kdhttpd: %s '%s': want an integer in [%llu, %llu]\n", opt, s, min, max);
		return -1;
	}
	*out = v;
	return 0;
}

/* The keys of the file, one per line (blank lines and '#' comments skipped). */
static char **read_keys(const char *path)
{
	char **keys = calloc(MAX_KEYS + 1, sizeof(*keys)), line[1024];
	FILE *f = fopen(path, "r");
	struct stat st;
	int n = 0;

	if (!f || !keys) {
		fprintf(stderr, "kdhttpd: --api-key-file %s: %s\n", path, strerror(errno));
		goto err;
	}
	if (!fstat(fileno(f), &st) && (st.st_mode & 0004))
		fprintf(stderr, "kdhttpd: warning: --api-key-file %s is readable by every user\n", path);
	while (fgets(line, sizeof(line), f)) {
		size_t len = strcspn(line, "\r\n");

		line[len] = 0;
		while (len && (line[len - 1] == ' ' || line[len - 1] == '\t'))
			line[--len] = 0;
		if (!len || line[0] == '#')
			continue;
		if (n == MAX_KEYS) {
			fprintf(stderr, "kdhttpd: --api-key-file %s: more than %d keys\n", path, MAX_KEYS);
			goto err;
		}
		if (!(keys[n++] = strdup(line)))
			goto err;
	}
	if (!n) {
		fprintf(stderr, "kdhttpd: --api-key-file %s: no key in it\n", path);
		goto err;
	}
	fclose(f);
	return keys;
err:
	if (f)
		fclose(f);
	for (int i = 0; keys && keys[i]; i++)
		free(keys[i]);
	free(keys);
	return NULL;
}

static int parse_args(int argc, char **argv, struct hb_opts *h, struct srv_opts *s,
		      const char **key_file)
{
	enum { O_SOCK = 256, O_LISTEN, O_KEYS, O_NAME, O_TOK, O_BODY, O_TIMEOUT, O_CONNS, O_QUEUE,
	       O_VERSION };
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, O_SOCK },
		{ "listen", required_argument, NULL, O_LISTEN },
		{ "api-key-file", required_argument, NULL, O_KEYS },
		{ "model-name", required_argument, NULL, O_NAME },
		{ "tokenizer", required_argument, NULL, O_TOK },
		{ "max-body", required_argument, NULL, O_BODY },
		{ "timeout", required_argument, NULL, O_TIMEOUT },
		{ "max-connections", required_argument, NULL, O_CONNS },
		{ "queue-timeout", required_argument, NULL, O_QUEUE },
		{ "version", no_argument, NULL, O_VERSION },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	unsigned long long v;
	int c;

	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case O_SOCK: h->socket_path = optarg; break;
		case O_LISTEN: s->listen = optarg; break;
		case O_KEYS: *key_file = optarg; break;
		case O_NAME:
			if (!optarg[0] || strlen(optarg) > 200) {
				fprintf(stderr, "kdhttpd: --model-name: 1..200 bytes\n");
				return -1;
			}
			h->model_name = optarg;
			break;
		case O_TOK: h->tokenizer_path = optarg; break;
		case O_BODY:
			if (parse_uint("--max-body", optarg, 1024, 1ull << 30, &v))
				return -1;
			s->max_body = (size_t)v;
			break;
		case O_TIMEOUT:
			if (parse_uint("--timeout", optarg, 1, 86400, &v))
				return -1;
			s->timeout_s = (unsigned)v;
			break;
		case O_CONNS:
			if (parse_uint("--max-connections", optarg, 1, 65536, &v))
				return -1;
			s->max_conns = (unsigned)v;
			break;
		case O_QUEUE:
			if (parse_uint("--queue-timeout", optarg, 0, 86400, &v))
				return -1;
			s->queue_timeout_s = (unsigned)v;
			break;
		case O_VERSION:
			printf("kdhttpd (kdec) %s, protocol %u\n", kd_version(), kd_protocol_version());
			exit(0);
		case 'h':
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kdhttpd: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct hb_opts h = { 0 };
	struct srv_opts so = { .listen = "127.0.0.1:8000", .max_body = 8u << 20, .timeout_s = 60,
			       .max_conns = 256, .queue_timeout_s = 300 };
	const char *key_file = NULL;
	struct hb *hb = NULL;
	struct srv *srv = NULL;
	sigset_t set;
	int sig, ret = 1;

	if (parse_args(argc, argv, &h, &so, &key_file))
		return 2;
	if (key_file && !(so.api_keys = read_keys(key_file)))
		return 1;
	/* the threads inherit the mask: only sigwait below sees these */
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	signal(SIGPIPE, SIG_IGN);
	if (hb_create(&hb, &h)) {
		fprintf(stderr, "kdhttpd: cannot start its kdecd connection thread\n");
		goto out;
	}
	if (srv_start(&srv, &so, hb))
		goto out;
	sigwait(&set, &sig);
	fprintf(stderr, "kdhttpd: %s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
	ret = 0;
out:
	srv_stop(srv);
	hb_destroy(hb);
	for (int i = 0; so.api_keys && so.api_keys[i]; i++)
		free(so.api_keys[i]);
	free(so.api_keys);
	return ret;
}
