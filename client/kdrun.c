/* kdrun: sends one prompt to kdecd and streams the answer: token ids (--prompt) or
 * text (--text, tokenized here with the model's tokenizer) on stdout as they arrive,
 * timing on stderr, a daemon's refusal as one line and exit 1. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/control_call.h"
#include "client/kdclient.h"

#define MAX_PROMPT (1 << 18)

struct run_args {
	struct kd_connect_opts conn;
	struct kd_request req;
	int32_t *prompt;
	const char *text;		/* --text, or NULL */
	const char *tokenizer_path;	/* --tokenizer */
	int chat;			/* --chat: wrap text in the model's chat template */
	int32_t stop_buf[KD_MAX_STOP];	/* --stop ids plus --chat's end-of-turn ids */
	struct kd_tokenizer *tok;	/* with --text */
	struct kd_tokenizer_stream *detok;
};

static void usage(FILE *f)
{
	char sock[256];

	kd_default_socket(sock, sizeof(sock));
	fprintf(f,
		"usage: kdrun [--socket PATH] --prompt 1,2,3 [options]\n"
		"       kdrun [--socket PATH] --text \"...\" [--chat] [--tokenizer PATH] [options]\n"
		"\n"
		"Generates from a prompt on a running kdecd; prints the new token ids on stdout,\n"
		"space-separated on one line as they arrive (--prompt), or the answer as text\n"
		"(--text); time to first token and tokens/s on stderr.\n"
		"\n"
		"  --socket PATH       kdecd's socket (default %s)\n"
		"  --prompt IDS        prompt token ids, comma-separated\n"
		"  --text TEXT         a text prompt, tokenized here; the answer prints as text\n"
		"  --chat              with --text: send TEXT as one user message in the model's\n"
		"                      chat template and stop at the end of the assistant's turn\n"
		"  --tokenizer PATH    the model's tokenizer for --text: a .gguf, or a directory\n"
		"                      with tokenizer.json (default: the model kdecd serves, from\n"
		"                      its status)\n"
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
		"  --session NAME      session name (" KD_SESSION_RULE ")\n"
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
	       O_VERSION, O_MINP, O_REP, O_PRES, O_FREQ, O_LOGP, O_TEXT, O_CHAT, O_TOK };
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, O_SOCK },
		{ "prompt", required_argument, NULL, O_PROMPT },
		{ "text", required_argument, NULL, O_TEXT },
		{ "chat", no_argument, NULL, O_CHAT },
		{ "tokenizer", required_argument, NULL, O_TOK },
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
		case O_TEXT: a->text = optarg; break;
		case O_CHAT: a->chat = 1; break;
		case O_TOK: a->tokenizer_path = optarg; break;
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
		case O_SES: {
			char why[200];

			if (kd_session_name_check(optarg, why, sizeof(why))) {
				fprintf(stderr, "kdrun: --session: %s\n", why);
				return -1;
			}
			a->req.session = optarg;
			break;
		}
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
	if (!a->prompt == !a->text) {
		fprintf(stderr, "kdrun: give one of --prompt 1,2,3 or --text \"...\"\n");
		return -1;
	}
	if (a->chat && !a->text) {
		fprintf(stderr, "kdrun: --chat goes with --text\n");
		return -1;
	}
	a->req.prompt = a->prompt;
	return 0;
}

/* Adds id to the request's stop ids unless present or full. */
static void add_stop(struct run_args *a, int32_t id)
{
	if (id < 0 || a->req.n_stop >= KD_MAX_STOP)
		return;
	for (uint32_t i = 0; i < a->req.n_stop; i++)
		if (a->req.stop[i] == id)
			return;
	if (a->req.stop != a->stop_buf) {
		if (a->req.n_stop)
			memcpy(a->stop_buf, a->req.stop, sizeof(*a->stop_buf) * a->req.n_stop);
		free((void *)a->req.stop);
		a->req.stop = a->stop_buf;
	}
	a->stop_buf[a->req.n_stop++] = id;
}

/* The model path kdecd serves, from its control status ("model_path"): malloc'd, or
 * NULL. The shared-memory welcome names only the model type. */
static char *daemon_model_path(const char *socket_path)
{
	char def[256], *reply = NULL, *path = NULL;
	json_t *o;

	if (!socket_path && !kd_default_socket(def, sizeof(def)))
		socket_path = def;
	if (!socket_path || control_call(socket_path, "{\"cmd\":\"status\"}\n", &reply))
		return NULL;
	o = json_loads(reply, JSON_DISABLE_EOF_CHECK, NULL);
	if (json_is_string(json_object_get(o, "model_path")))
		path = strdup(json_string_value(json_object_get(o, "model_path")));
	json_decref(o);
	free(reply);
	return path;
}

/* --text: the prompt ids from the text (in the chat template with --chat). 0 or -1 with
 * a message printed. */
static int tokenize_prompt(struct run_args *a)
{
	struct kd_chat_message msg = { .role = "user", .content = a->text };
	const char *text = a->text;
	char *chat = NULL;
	unsigned flags = KD_TOKENIZE_ADD_SPECIAL;
	long n;
	int ret;

	char *served = a->tokenizer_path ? NULL : daemon_model_path(a->conn.socket_path);

	if (!a->tokenizer_path && !served) {
		fprintf(stderr, "kdrun: --text: kdecd did not say which model it serves (is it "
			"running?); give --tokenizer PATH (a .gguf or a tokenizer.json directory)\n");
		return -1;
	}
	ret = kd_tokenizer_open(&a->tok, a->tokenizer_path ? a->tokenizer_path : served);
	if (!ret)
		ret = kd_tokenizer_stream_create(&a->detok, a->tok, KD_DECODE_SKIP_SPECIAL);
	if (ret) {
		fprintf(stderr, "kdrun: %s: %s%s\n", a->tokenizer_path ? "--tokenizer" : "the served model",
			kd_tokenizer_error(), served ? " (give --tokenizer PATH)" : "");
		free(served);
		return -1;
	}
	free(served);
	if (a->chat) {
		n = kd_tokenizer_chat(a->tok, &msg, 1, 1, NULL, 0);
		if (n < 0 || !(chat = malloc((size_t)n + 1)) ||
		    kd_tokenizer_chat(a->tok, &msg, 1, 1, chat, (size_t)n + 1) != n) {
			fprintf(stderr, "kdrun: --chat: %s\n", n < 0 ? kd_tokenizer_error() : "out of memory");
			free(chat);
			return -1;
		}
		text = chat;
		flags = KD_TOKENIZE_SPECIAL;	/* the template's markers are special tokens */
		add_stop(a, kd_tokenizer_eot(a->tok));
		add_stop(a, kd_tokenizer_eos(a->tok));
	}
	n = kd_tokenizer_encode(a->tok, text, strlen(text), flags, NULL, 0);
	if (n > 0 && n <= MAX_PROMPT && (a->prompt = malloc(sizeof(*a->prompt) * (size_t)n)))
		n = kd_tokenizer_encode(a->tok, text, strlen(text), flags, a->prompt, (size_t)n);
	free(chat);
	if (n <= 0 || n > MAX_PROMPT || !a->prompt) {
		fprintf(stderr, "kdrun: --text: %s\n", n < 0 ? kd_strerror((int)n) :
			n == 0 ? "no tokens" : n > MAX_PROMPT ? "too many tokens" : "out of memory");
		return -1;
	}
	a->req.prompt = a->prompt;
	a->req.n_prompt = (uint32_t)n;
	return 0;
}

/* A generated token on stdout: its id, or with --text the characters it completes. */
static void print_token(const struct run_args *a, int32_t token, unsigned n_tok)
{
	const char *piece;
	size_t len;

	if (!a->detok) {
		printf("%s%d", n_tok ? " " : "", token);
		return;
	}
	if (!kd_tokenizer_stream_push(a->detok, token, &piece, &len))
		fwrite(piece, 1, len, stdout);
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
				print_token(a, ev[i].token, n_tok);
				if (!n_tok++)
					t_first = ev[i].t_receive_ns;
				t_last = ev[i].t_receive_ns;
				t_submit = ev[i].t_submit_ns;
			}
			if (ev[i].flags & KD_EVENT_LOGPROB)
				print_logprob(&ev[i]);
			if (!(ev[i].flags & KD_EVENT_FINAL))
				continue;
			if (a->detok) {
				const char *tail;
				size_t len;

				kd_tokenizer_stream_finish(a->detok, &tail, &len);
				fwrite(tail, 1, len, stdout);
			}
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
	if (a.text && tokenize_prompt(&a)) {
		ret = 1;
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
	if (a.req.stop != a.stop_buf)
		free((void *)a.req.stop);
	kd_tokenizer_stream_destroy(a.detok);
	kd_tokenizer_close(a.tok);
	return ret;
}
