/* One generation call of kdhttpd, whatever the API: the request as kdecd takes it, the
 * text generated so far with stop strings matched across token boundaries, the
 * response or server-sent events being written, and the API's error shapes. The
 * OpenAI (http_openai.c) and Anthropic (http_anthropic.c) front ends fill it from a
 * JSON body and format its output; http_gen.c runs it on the daemon. */
#ifndef KDHTTPD_HTTP_CALL_H
#define KDHTTPD_HTTP_CALL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "client/kdclient.h"
#include "http/http_backend.h"

#define CALL_MAX_STOPS 4	/* stop strings per request (OpenAI's limit) */
#define CALL_STOP_MAX 256	/* bytes of one stop string */
#define CALL_MAX_PROMPT (1 << 18)	/* prompt tokens (kdrun's bound too) */

enum call_api {
	API_CHAT,		/* POST /v1/chat/completions */
	API_COMPLETION,		/* POST /v1/completions */
	API_MESSAGES,		/* POST /v1/messages (Anthropic) */
};

enum call_fin {
	FIN_NONE,
	FIN_TOKEN,		/* the end-of-turn / end-of-text token */
	FIN_STOP,		/* a stop string; stop_index says which */
	FIN_LENGTH,		/* max_tokens, or the model's positions */
	FIN_ERROR,		/* refused or failed: final says why */
};

/* An error as the API writes it: the HTTP status, the error type of the API's shape
 * (OpenAI "invalid_request_error", Anthropic "invalid_request_error" ...), the field
 * at fault and one line with the names and numbers in it. */
struct call_err {
	int status;
	const char *type;	/* NULL: from status */
	char param[64];
	char msg[512];
};

/* A token's logprob as kdecd returns it: the token's and the most probable one's. */
struct call_lp {
	int32_t token, top;	/* top -1: not asked */
	float lp, top_lp;
	size_t text_at;		/* bytes of text before this token's (completions' text_offset) */
};

struct call {
	enum call_api api;
	struct hb *hb;
	const struct kd_tokenizer *tok;
	const char *model;		/* the name answered in "model" */
	char id[48];			/* chatcmpl-..., cmpl-..., msg_... */
	long long created;		/* unix seconds */
	int stream, include_usage;
	char *tools_json;		/* the OpenAI "tools" array rendered and parsed back
					 * (http_tools.c), malloc'd; NULL: no tools in play */
	int logprobs, top_logprobs;	/* as asked (top_logprobs <= 1: kdecd's top-1) */
	int client_fd;			/* the HTTP connection's socket: a hang-up cancels */
	int timeout_ms;			/* a request queued for tokens in flight waits this long */

	/* the request as submitted */
	struct kd_request req;
	int32_t *prompt;		/* (req.n_prompt) malloc'd */
	int32_t stop_ids[KD_MAX_STOP];
	char session[KD_SESSION_MAX + 1];
	char *stops[CALL_MAX_STOPS];	/* malloc'd stop strings */
	int n_stops;
	size_t max_stop;		/* the longest's bytes */

	/* the run */
	struct hb_req q;
	int submitted;
	struct kd_tokenizer_stream *detok;
	char *text;			/* (len) generated text, cut at a stop string */
	size_t len, cap;
	size_t sent;			/* bytes of text already streamed */
	struct call_lp *lps;		/* (n_lp) */
	size_t n_lp, cap_lp, lp_sent;
	uint32_t n_gen;			/* tokens generated */
	uint32_t cached;		/* prompt tokens kdecd took from its KV cache (the
					 * first token event's cached_tokens) */
	enum call_fin fin;
	int stop_index;
	struct kd_event final;		/* the final event, for FIN_ERROR's message */
	int client_gone;

	/* what the HTTP side writes */
	char *out;			/* (out_len) bytes, [out_pos, out_len) still to send */
	size_t out_len, out_cap, out_pos;
	int phase;			/* the streaming front end's progress */
};

/* ---- http_gen.c: the run ---------------------------------------------------- */
/* Tokenizes nothing: prompt and fields are set by the front end. Submits, and waits
 * for the first event so that a refusal still gets an error status; a refusal for too
 * many tokens in flight is retried as requests end, up to timeout_ms. 0 or -1 with e. */
int call_start(struct call *c, struct call_err *e);
/* Takes the next events (up to wait_ms). 1: something new (text, the end), 0: nothing
 * yet, -1: the client hung up (the request is cancelled). */
int call_step(struct call *c, int wait_ms);
/* Runs to the end (non-streaming). 0, or -1 when the client hung up. */
int call_run(struct call *c);
/* Text that may be sent now: all of it once finished, else what cannot be the start
 * of a stop string. */
size_t call_ready(const struct call *c);
/* The error status and message of a FIN_ERROR call. */
void call_fin_error(const struct call *c, struct call_err *e);
void call_free(struct call *c);

/* Adds a stop string. 0 or -1 with e (too many, too long, empty). */
int call_add_stop(struct call *c, const char *s, size_t len, const char *param,
		  struct call_err *e);
/* Tokenizes text (chat: rendered template with special tokens) into c->prompt. */
int call_set_prompt(struct call *c, const char *text, size_t len, int chat, struct call_err *e);
/* Adds the template's end-of-turn and end-of-text tokens as stop ids. */
void call_stop_at_eot(struct call *c);
/* A session name from X-Kdec-Session or the body. 0 or -1 with e. */
int call_set_session(struct call *c, const char *name, const char *where, struct call_err *e);
/* The token's text (its vocabulary bytes, special tokens as written) into buf. */
size_t call_token_text(const struct call *c, int32_t id, char *buf, size_t len);

/* Appends to c->out: raw bytes, or a JSON value (freed) as one SSE "data:" line,
 * with an "event:" line first when event is not NULL. 0 or -ENOMEM. */
int call_out(struct call *c, const char *s, size_t len);
int call_out_sse(struct call *c, const char *event, json_t *v);

/* Fills e; status 400 unless given. Always returns -1 (so: return call_errf(...)). */
int call_errf(struct call_err *e, int status, const char *param, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* Typed field reads: absent (0, *out untouched), right type (0, set), wrong (-1, e). */
int call_get_num(json_t *body, const char *key, double min, double max, double *out,
		 struct call_err *e);
int call_get_int(json_t *body, const char *key, long long min, long long max, long long *out,
		 struct call_err *e);
int call_get_bool(json_t *body, const char *key, int *out, struct call_err *e);
/* A message's content as one malloc'd text: a string, or an array of {"type": "text",
 * "text": ...} parts concatenated (null or absent: "" where null_ok); other parts are
 * refused with a 400 naming where (param: the error's param). */
int call_text_parts(json_t *v, const char *where, const char *param, int null_ok, char **out,
		    struct call_err *e);
/* The sampling fields both APIs share (temperature, top_p, top_k, min_p, seed,
 * presence_penalty, frequency_penalty), and max_tokens under the names given. */
int call_parse_sampling(struct call *c, json_t *body, struct call_err *e);
int call_parse_max_tokens(struct call *c, json_t *body, const char *const *names, int required,
			  struct call_err *e);

/* ---- the front ends ------------------------------------------------------------ */
/* Fill c from the body (after the API-independent parts are set). 0 or -1 with e. */
int openai_parse(struct call *c, json_t *body, struct call_err *e);
int anthropic_parse(struct call *c, json_t *body, struct call_err *e);
/* The whole response of a finished call (malloc'd JSON text). */
char *openai_response(struct call *c);
char *anthropic_response(struct call *c);
/* Appends the next server-sent events to c->out: 1 more to come, 0 the stream is
 * complete, -1 the client hung up. */
int openai_stream(struct call *c, int wait_ms);
int anthropic_stream(struct call *c, int wait_ms);
/* The API's error body (malloc'd JSON text). */
char *openai_error_body(const struct call_err *e);
char *anthropic_error_body(const struct call_err *e);

/* ---- http_tools.c: tools in the request ------------------------------------------ */
/* tools and tool_choice: checked, and kept in c->tools_json (OpenAI's form) when the
 * model's template renders tools; "none" keeps nothing. 0 or -1 with e. */
int tools_check_openai(struct call *c, json_t *body, struct call_err *e);
int tools_check_anthropic(struct call *c, json_t *body, struct call_err *e);
/* An OpenAI message of role "tool", or an assistant's with "tool_calls", into *m;
 * *own gets the malloc'd text m points to beside content (freed by the caller). */
int tools_openai_message(struct call *c, json_t *msg, size_t i, struct kd_chat_message *m,
			 char **own, struct call_err *e);
/* 1 when an Anthropic content array has tool_use or tool_result blocks. */
int tools_anthropic_has_blocks(json_t *content);
/* Such a message into kd messages m[*k ...] (tool results first, as separate "tool"
 * turns; at most 1 + blocks of them) with their texts in own[*ko ...] (at most 2 +
 * blocks). 0 or -1 with e. */
int tools_anthropic_message(struct call *c, json_t *content, const char *role, size_t i,
			    struct kd_chat_message *m, size_t *k, char **own, size_t *ko,
			    struct call_err *e);
/* The chat template with c->tools_json into c->prompt. 0 or -1 with e. */
int tools_render(struct call *c, const struct kd_chat_message *m, size_t n, struct call_err *e);

/* ---- http_tools_answer.c: tool calls in the answer --------------------------------- */
/* The generated text split into prose and calls (kd_tokenizer_parse_tool_calls). */
struct tools_answer {
	json_t *parsed;			/* {"content", "tool_calls"} */
	const char *content;
	size_t content_len;
	size_t n_calls;
};
int tools_answer(const struct call *c, struct tools_answer *a);	/* 0 or -1 (memory) */
void tools_answer_free(struct tools_answer *a);
/* Call i's id, unique per response: the parser's "call_N" become PREFIX<id>_N. */
void tools_call_id(const struct call *c, const struct tools_answer *a, size_t i,
		   const char *prefix, char *buf, size_t len);
/* OpenAI's tool_calls array [{(index), id, type, function: {name, arguments}}] for
 * calls [from, to). */
json_t *tools_openai_calls(const struct call *c, const struct tools_answer *a, size_t from,
			   size_t to, int with_index);
/* Anthropic's {"type": "tool_use", id, name, input} block of call i; input_json gets
 * the arguments' text (for input_json_delta) when not NULL. */
json_t *tools_anthropic_block(const struct call *c, const struct tools_answer *a, size_t i,
			      const char **input_json);

#endif
