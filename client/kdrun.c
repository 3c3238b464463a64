/* kdrun: sends one prompt to kdecd and streams the answer: token ids on stdout as
 * they arrive, timing on stderr, a daemon's refusal as one line and exit 1. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kdclient.h"

#define MAX_PROMPT (1 << 18)

struct run_args {
	struct kd_connect_opts conn;
	struct kd_request req;
	int32_t *prompt;
};

static void usage(FILE *f)
{
	char sock[256];

	kd_default_socket(sock, sizeof(sock));
	fprintf(f,
		"usage: kdrun [--socket PATH] --prompt 1,2,3 [options]\n"
		"\n"
		"Generates from a prompt of token ids on a running kdecd; prints the new ids on\n"
		"stdout, space-separated on one line as they arrive; time to first token and\n"
		"tokens/s on stderr.\n"
		"\n"
		"  --socket PATH       kdecd's socket (default %s)\n"
		"  --prompt IDS        prompt token ids, comma-separated\n"
		"  --max-tokens N      tokens to generate (default 32)\n"
		"  --temperature T     0 (default) is greedy\n"
		"  --top-k K           keep the K most likely tokens (default: off)\n"
		"  --top-p P           keep the smallest set with probability >= P (default: off)\n"
		"  --seed S            seed of the sampling draws (default 0)\n"
		"  --min-p P           keep tokens with p >= P * p_max (default: off)\n"
		"  --repetition-penalty R  divide (logit > 0) or multiply logits of prompt and\n"
		"                      output tokens by R, in (0, 10] (default 1: off)\n"
		"  --presence-penalty A    subtract A from output tokens' logits, [-2, 2]\n"
		"  --frequency-penalty F   subtract F per occurrence in the output, [-2, 2]\n"
		"  --logprobs N        print each token's logprob on stderr, one line per token:\n"
		"                      'logprob INDEX TOKEN LP' and with N = 1 'top TOKEN LP'\n"
		"                      (the most probable token); N is 0 or 1 over the wire\n"
		"  --session NAME      session name ([A-Za-z0-9._:-], at most 63 characters)\n"
		"  --stop IDS          stop token ids, comma-separated (at most %d)\n"
		"  --spin              spin-then-sleep waiting (lowest latency, burns CPU)\n"
		"  --version, --help\n",
		sock, KD_MAX_STOP);
}

/* "1,2,3" -> malloc'd ids. 0 or -1 with a message printed. */
static int parse_ids(const char *opt, const char *s, int max, int32_t **out, uint32_t *n)
{
	int32_t *v = malloc(sizeof(*v) * (size_t)(strlen(s) / 2 + 1));
	const char *p = s;
	uint32_t k = 0;

	if (!v)
		return -1;
	while (*p) {
		char *end;
		long x;

		errno = 0;
		x = strtol(p, &end, 10);
		if (end == p || errno || x < 0 || x > INT32_MAX || (*end && *end != ',') ||
		    (*end == ',' && !end[1])) {
			fprintf(stderr, "kdrun: %s: bad id at character %ld of '%s' (want ids like 1,2,3)\n",
				opt, (long)(p - s) + 1, s);
			free(v);
			return -1;
		}
		if ((int)k == max) {
			fprintf(stderr, "kdrun: %s: more than %d ids\n", opt, max);
			free(v);
			return -1;
		}
		v[k++] = (int32_t)x;
		p = *end ? end + 1 : end;
	}
	if (!k) {
		fprintf(stderr, "kdrun: %s: empty\n", opt);
		free(v);
		return -1;
	}
	*out = v;
	*n = k;
	return 0;
}

static int parse_num(const char *opt, const char *s, double min, double max, double *out)
{
	char *end;
	double v = strtod(s, &end);

	if (end == s || *end || !isfinite(v) || v < min || v > max) {
		fprintf(stderr, "kdrun: %s '%s': want a number in [%g, %g]\n", opt, s, min, max);
		return -1;
	}
	*out = v;
	return 0;
}

static int parse_args(int argc, char **argv, struct run_args *a)
{
	enum { O_SOCK = 256, O_PROMPT, O_MAX, O_TEMP, O_TOPK, O_TOPP, O_SEED, O_SES, O_STOP, O_SPIN,
	       O_VERSION, O_MINP, O_REP, O_PRES, O_FREQ, O_LOGP };
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, O_SOCK },
		{ "prompt", required_argument, NULL, O_PROMPT },
		{ "max-tokens", required_argument, NULL, O_MAX },
		{ "temperature", required_argument, NULL, O_TEMP },
		{ "top-k", required_argument, NULL, O_TOPK },
		{ "top-p", required_argument, NULL, O_TOPP },
		{ "seed", required_argument, NULL, O_SEED },
		{ "min-p", required_argument, NULL, O_MINP },
		{ "repetition-penalty", required_argument, NULL, O_REP },
		{ "presence-penalty", required_argument, NULL, O_PRES },
		{ "frequency-penalty", required_argument, NULL, O_FREQ },
		{ "logprobs", required_argument, NULL, O_LOGP },
		{ "session", required_argument, NULL, O_SES },
		{ "stop", required_argument, NULL, O_STOP },
		{ "spin", no_argument, NULL, O_SPIN },
		{ "version", no_argument, NULL, O_VERSION },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int32_t *stop = NULL;
	double v;
	int c;

	a->req.max_tokens = 32;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case O_SOCK: a->conn.socket_path = optarg; break;
		case O_PROMPT:
			free(a->prompt);
			a->prompt = NULL;
			if (parse_ids("--prompt", optarg, MAX_PROMPT, &a->prompt, &a->req.n_prompt))
				return -1;
			break;
		case O_STOP:
			free(stop);
			stop = NULL;
			if (parse_ids("--stop", optarg, KD_MAX_STOP, &stop, &a->req.n_stop))
				return -1;
			a->req.stop = stop;
			break;
		case O_MAX:
			if (parse_num("--max-tokens", optarg, 1, 1 << 24, &v) || v != (uint32_t)v)
				return -1;
			a->req.max_tokens = (uint32_t)v;
			break;
		case O_TEMP:
			if (parse_num("--temperature", optarg, 0, 1e4, &v))
				return -1;
			a->req.sampling.temperature = (float)v;
			break;
		case O_TOPK:
			if (parse_num("--top-k", optarg, 0, INT_MAX, &v))
				return -1;
			a->req.sampling.top_k = (int)v;
			break;
		case O_TOPP:
			if (parse_num("--top-p", optarg, 0, 1, &v))
				return -1;
			a->req.sampling.top_p = (float)v;
			break;
		case O_SEED:
			if (parse_num("--seed", optarg, 0, 18446744073709551615.0, &v))
				return -1;
			a->req.sampling.seed = strtoull(optarg, NULL, 10);
			break;
		case O_MINP:
			if (parse_num("--min-p", optarg, 0, 1, &v))
				return -1;
			a->req.sampling.min_p = (float)v;
			break;
		case O_REP:
			if (parse_num("--repetition-penalty", optarg, 1e-3, 10, &v))
				return -1;
			a->req.sampling.repetition_penalty = (float)v;
			break;
		case O_PRES:
			if (parse_num("--presence-penalty", optarg, -2, 2, &v))
				return -1;
			a->req.sampling.presence_penalty = (float)v;
			break;
		case O_FREQ:
			if (parse_num("--frequency-penalty", optarg, -2, 2, &v))
				return -1;
			a->req.sampling.frequency_penalty = (float)v;
			break;
		case O_LOGP:
			if (parse_num("--logprobs", optarg, 0, 1, &v) || v != (int)v)
				return -1;
			a->req.sampling.logprobs = 1;
			a->req.sampling.top_logprobs = (int)v;
			break;
		case O_SES: a->req.session = optarg; break;
		case O_SPIN:
			a->conn.flags |= KD_CONNECT_SPIN;
			a->conn.spin_us = 200;
			break;
		case O_VERSION:
			printf("kdrun (kdec) %s, protocol %u\n", kd_version(), kd_protocol_version());
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
		fprintf(stderr, "kdrun: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	if (!a->prompt) {
		fprintf(stderr, "kdrun: --prompt 1,2,3 is required\n");
		return -1;
	}
	a->req.prompt = a->prompt;
	return 0;
}

static void print_logprob(const struct kd_event *ev)
{
	fprintf(stderr, "logprob %u %d %.6f", ev->index, ev->token, ev->logprob);
	if (ev->top_token >= 0)
		fprintf(stderr, " top %d %.6f", ev->top_token, ev->top_logprob);
	fprintf(stderr, "\n");
}

/* Streams the request's events. 0 on a normal end, 1 on an error. */
static int stream(struct kd_client *c, const struct run_args *a)
{
	uint64_t t_first = 0, t_last = 0, t_submit = 0;
	struct kd_event ev[64];
	unsigned n_tok = 0;
	char msg[256];

	for (;;) {
		int n = kd_wait(c, ev, 64, -1);

		if (n < 0) {
			printf("\n");
			fprintf(stderr, "kdrun: %s\n", kd_connect_error(c));
			return 1;
		}
		for (int i = 0; i < n; i++) {
			if (ev[i].token >= 0) {
				printf("%s%d", n_tok ? " " : "", ev[i].token);
				if (!n_tok++)
					t_first = ev[i].t_receive_ns;
				t_last = ev[i].t_receive_ns;
				t_submit = ev[i].t_submit_ns;
			}
			if (ev[i].flags & KD_EVENT_LOGPROB)
				print_logprob(&ev[i]);
			if (!(ev[i].flags & KD_EVENT_FINAL))
				continue;
			printf("\n");
			fflush(stdout);
			if (ev[i].stop == KD_STOP_ERROR || ev[i].stop == KD_STOP_CANCELLED) {
				kd_event_message(&ev[i], msg, sizeof(msg));
				fprintf(stderr, "kdrun: %s: %s\n",
					ev[i].stop == KD_STOP_ERROR ? "refused" : "cancelled", msg);
				return 1;
			}
			fprintf(stderr, "prompt %u tokens: time to first token %.2f ms\n", a->req.n_prompt,
				(double)(t_first - t_submit) * 1e-6);
			if (n_tok > 1)
				fprintf(stderr, "decode %u tokens: %.2f ms/token, %.1f tokens/s\n", n_tok - 1,
					(double)(t_last - t_first) * 1e-6 / (n_tok - 1),
					(n_tok - 1) / ((double)(t_last - t_first) * 1e-9));
			return 0;
		}
		fflush(stdout);
	}
}

int main(int argc, char **argv)
{
	struct run_args a = { 0 };
	struct kd_client *c;
	uint64_t id;
	int ret;

	if (parse_args(argc, argv, &a)) {
		ret = 2;
		goto out;
	}
	ret = kd_connect(&c, &a.conn);
	if (ret) {
		fprintf(stderr, "kdrun: %s\n", kd_connect_error(NULL));
		ret = 1;
		goto out;
	}
	ret = kd_submit(c, &a.req, &id);
	if (ret) {
		fprintf(stderr, "kdrun: submit: %s\n", ret == -E2BIG ? "prompt too long" : kd_strerror(ret));
		ret = 1;
	} else {
		ret = stream(c, &a);
	}
	kd_close(c);
out:
	free(a.prompt);
	free((void *)a.req.stop);
	return ret;
}
