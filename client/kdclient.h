/* libkdclient: the public C API of kdec for local processes. A client connects to
 * kdecd's Unix socket, gets its own shared-memory segment, writes requests (prompt
 * token ids and sampling parameters) into it and reads the generated tokens back as
 * they are produced. docs/CLIENT.md has a complete example.
 *
 * Errors are negative errno values (kd_strerror). Thread safety: different handles
 * are independent. On one handle, one thread at a time may submit (kd_submit,
 * kd_cancel) and one thread at a time may receive (kd_poll, kd_wait); a submitting
 * and a receiving thread may run concurrently. kd_close must not race with any
 * other call on the handle. kd_version, kd_protocol_version, kd_strerror and
 * kd_event_message are thread-safe. */
#ifndef KDCLIENT_H
#define KDCLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Library version, e.g. "0.1.0"; the returned string is static. */
const char *kd_version(void);

/* The shared-memory protocol version this library speaks. */
unsigned kd_protocol_version(void);

/* A message for a kd_* error code (a negative errno value); static storage. */
const char *kd_strerror(int err);

struct kd_client;	/* opaque handle */

/* kd_connect_opts.flags */
#define KD_CONNECT_SPIN 1u	/* ask the daemon to poll this client's ring for a while
				 * after each step instead of sleeping at once (lowest
				 * pickup latency; costs daemon CPU while connected) */

struct kd_connect_opts {
	const char *socket_path;	/* NULL: the default (see kd_default_socket) */
	unsigned flags;			/* KD_CONNECT_* */
	unsigned spin_us;		/* kd_wait spins this long before sleeping; 0: sleep at once */
};

/* Connects to kdecd. opts may be NULL (defaults). On success *out is a handle that
 * kd_close frees. On failure returns -errno: -ENOENT / -ECONNREFUSED (no daemon),
 * -EACCES (not on the daemon's allow-list), -EPROTO (protocol version mismatch);
 * kd_connect_error says more. */
int kd_connect(struct kd_client **out, const struct kd_connect_opts *opts);

/* The daemon's reason for the last failed kd_connect on this thread, or for the
 * disconnection of c (c may be NULL: the thread's last kd_connect). Static or
 * handle-owned storage; never NULL. */
const char *kd_connect_error(const struct kd_client *c);

/* Closes the connection: the daemon cancels the handle's requests. Accepts NULL. */
void kd_close(struct kd_client *c);

/* The socket kd_connect uses without opts->socket_path: $XDG_RUNTIME_DIR/kdecd.sock;
 * else /run/kdecd/kdecd.sock for root; else /tmp/kdecd-$UID/kdecd.sock. */
int kd_default_socket(char *buf, size_t len);

#define KD_MAX_STOP 8		/* stop tokens per request */
/* A session name is 1..KD_SESSION_MAX characters of A-Z a-z 0-9 . _ : - (the
 * daemon keeps sessions per uid under these names; docs/KVCACHE.md says why). */
#define KD_SESSION_MAX 63
#define KD_SESSION_RULE "1-63 characters of A-Z a-z 0-9 . _ : -"

/* 0 when name is a session name; else -ENAMETOOLONG or -EINVAL with one line in why
 * (the length, or the first character not allowed and where), the rule included. */
int kd_session_name_check(const char *name, char *why, size_t why_len);

/* How the next token is picked: penalties first (over the prompt and the output so
 * far); then temperature <= 0 is greedy (ties: the lower id); otherwise top-k, then
 * top-p, then min-p, then a draw that depends only on (seed, index). A zeroed struct
 * is greedy without penalties. docs/CLIENT.md has the exact procedure. */
struct kd_sampling {
	float temperature;
	int top_k;		/* <= 0: off */
	float top_p;		/* <= 0 or >= 1: off */
	uint64_t seed;
	float min_p;		/* <= 0: off; keep p >= min_p * p_max; <= 1 */
	float repetition_penalty;	/* 0 or 1: off; (0, 10]: HF semantics, prompt + output */
	float presence_penalty;		/* [-2, 2]: OpenAI semantics, output tokens */
	float frequency_penalty;	/* [-2, 2]: per occurrence in the output */
	int logprobs;		/* 1: token events carry the token's logprob (KD_EVENT_LOGPROB) */
	int top_logprobs;	/* 0 or 1 (with logprobs): and the most probable token's */
};

struct kd_request {
	const int32_t *prompt;		/* (n_prompt) token ids; copied by kd_submit */
	uint32_t n_prompt;
	uint32_t max_tokens;		/* >= 1 */
	struct kd_sampling sampling;
	const int32_t *stop;		/* (n_stop) token ids that end the request; may be NULL */
	uint32_t n_stop;		/* <= KD_MAX_STOP */
	const char *session;		/* NULL or a session name */
	int priority;			/* higher runs first; 0 default */
	uint32_t flags;			/* KD_REQUEST_* */
	uint64_t reserved[4];		/* reserved: 0 */
};

/* kd_request.flags: n-gram speculative decoding for this request, whatever kdecd
 * --spec says (a greedy request's tokens are the same either way; it is faster when
 * the output repeats its context). Neither: the daemon's default. */
#define KD_REQUEST_SPEC 1u
#define KD_REQUEST_NO_SPEC 2u

/* Queues a request. *id receives its id (events carry it). Returns 0, -EAGAIN (the
 * submission ring or payload area is full: receive events and retry), -EINVAL (a
 * bad field), -E2BIG (prompt longer than the segment allows), -ECONNRESET (the
 * daemon dropped the connection). */
int kd_submit(struct kd_client *c, const struct kd_request *r, uint64_t *id);

/* Asks the daemon to stop request id; its final event says KD_STOP_CANCELLED
 * (unless it finished first). 0, -EAGAIN, -ECONNRESET. */
int kd_cancel(struct kd_client *c, uint64_t id);

enum kd_stop {
	KD_STOP_NONE = 0,	/* not final */
	KD_STOP_LENGTH = 1,	/* max_tokens reached */
	KD_STOP_TOKEN = 2,	/* a stop token was generated (this event carries it) */
	KD_STOP_CANCELLED = 3,	/* kd_cancel, daemon shutdown, or the event ring left full */
	KD_STOP_ERROR = 4,	/* refused or failed: error and kd_event_message say why */
};

#define KD_EVENT_FINAL 1u	/* the request's last event */
#define KD_EVENT_LOGPROB 2u	/* logprob (and top_token, top_logprob) are set */

struct kd_event {
	uint64_t id;		/* the request's id */
	int32_t token;		/* generated token id, or -1 (a final event without a token) */
	uint32_t index;		/* the token's index in the request's output */
	uint32_t flags;		/* KD_EVENT_* */
	enum kd_stop stop;	/* with KD_EVENT_FINAL */
	int error;		/* negative errno with KD_STOP_ERROR */
	uint32_t detail;	/* what kd_event_message formats */
	uint32_t detail_arg[3];
	/* With KD_EVENT_LOGPROB: natural-log probability of token after penalties and
	 * temperature, before top-k/top-p/min-p; top_token (-1 unless top_logprobs) is
	 * the most probable token and top_logprob its logprob. */
	float logprob, top_logprob;
	int32_t top_token;
	/* CLOCK_MONOTONIC, ns: the client's submit, the daemon's pickup of the request,
	 * the daemon's publication of this event, this library's receipt of it. */
	uint64_t t_submit_ns, t_pickup_ns, t_publish_ns, t_receive_ns;
	/* On the request's first token (index 0): how many of its prompt tokens the
	 * daemon took from the KV cache (a shared prefix, or its session's previous
	 * turns) instead of computing them; 0 on every other event. */
	uint32_t cached_tokens;
};

/* A one-line explanation of a final event's stop or error into buf. */
void kd_event_message(const struct kd_event *ev, char *buf, size_t len);

/* Takes up to max events without blocking. Returns the number taken (0: none) or
 * -ECONNRESET / -EPROTO when the daemon dropped the connection. */
int kd_poll(struct kd_client *c, struct kd_event *ev, int max);

/* Like kd_poll, but waits up to timeout_ms (< 0: forever) for at least one event:
 * spins first when the handle was opened with spin_us, then sleeps on a futex (or
 * the daemon's eventfd). Returns the number taken, 0 on timeout, or -errno. */
int kd_wait(struct kd_client *c, struct kd_event *ev, int max, int timeout_ms);

/* A file descriptor for event loops: readable when events may be waiting or the
 * connection ended; then call kd_poll until it returns 0. Owned by the handle. */
int kd_fd(struct kd_client *c);

/* ---- Tokenizer -------------------------------------------------------------
 * Byte-level BPE (the GPT-2 scheme of Llama 3, Qwen2, SmolLM2, DeepSeek), run in the
 * client: the daemon takes and returns token ids. Families (pre-tokenizer split):
 * tokenizer.ggml.pre "gpt2", "smollm", "llama-bpe", "qwen2", "deepseek-llm",
 * "deepseek-v3", or the same patterns in a tokenizer.json. Thread safety: a kd_tokenizer is read-only after kd_tokenizer_open;
 * any number of threads may encode, decode and use streams on it at once. A stream is
 * used by one thread at a time. Close the tokenizer after its streams. */
struct kd_tokenizer;

/* Opens a tokenizer: a .gguf file (tokenizer.ggml.*, tokenizer.chat_template), or a
 * directory with tokenizer.json (+ tokenizer_config.json for chat_template, bos/eos,
 * add_bos_token). *out is freed by kd_tokenizer_close. -ENOENT, -EINVAL (malformed),
 * -ENOTSUP (not byte-level BPE, or an unknown pre-tokenizer), -ENOMEM; then
 * kd_tokenizer_error says which file and key. */
int kd_tokenizer_open(struct kd_tokenizer **out, const char *path);
void kd_tokenizer_close(struct kd_tokenizer *t);	/* accepts NULL */

/* The calling thread's last kd_tokenizer_* failure, one line; never NULL. */
const char *kd_tokenizer_error(void);

/* kd_tokenizer_encode flags */
#define KD_TOKENIZE_ADD_SPECIAL 1u	/* prepend BOS where the model asks for it */
#define KD_TOKENIZE_SPECIAL 2u		/* special tokens written in text ("<|im_end|>")
					 * become their ids; otherwise they are plain text */

/* Encodes text[0..len) (any bytes: invalid UTF-8 still encodes byte by byte). Writes
 * at most max_ids ids and returns how many the text needs (call with ids NULL,
 * max_ids 0 to size a buffer), or -EINVAL / -ENOMEM / -E2BIG (len > 2^30). */
long kd_tokenizer_encode(const struct kd_tokenizer *t, const char *text, size_t len,
			 unsigned flags, int32_t *ids, size_t max_ids);

/* kd_tokenizer_decode / kd_tokenizer_stream_create flags */
#define KD_DECODE_SKIP_SPECIAL 1u	/* special tokens decode to nothing */

/* Decodes ids to bytes (not NUL-terminated; may cut a UTF-8 character where the ids
 * do). Writes at most len bytes and returns how many the ids need, or -EINVAL (an id
 * outside the vocabulary). */
long kd_tokenizer_decode(const struct kd_tokenizer *t, const int32_t *ids, size_t n,
			 unsigned flags, char *buf, size_t len);

/* Vocabulary facts: its size; special ids (-1 when the model has none); eot is the
 * end-of-turn token of the chat template (<|eot_id|>, <|im_end|>), else eos. */
int32_t kd_tokenizer_n_vocab(const struct kd_tokenizer *t);
int32_t kd_tokenizer_bos(const struct kd_tokenizer *t);
int32_t kd_tokenizer_eos(const struct kd_tokenizer *t);
int32_t kd_tokenizer_eot(const struct kd_tokenizer *t);
/* The id of the token whose vocabulary text is text (e.g. "<|im_end|>"), or -1. */
int32_t kd_tokenizer_token_id(const struct kd_tokenizer *t, const char *text);

/* Incremental decoding for streaming: push one id at a time, get back only complete
 * UTF-8 characters (a character cut between tokens is held until it completes). A
 * byte sequence that cannot become valid is emitted as U+FFFD; kd_tokenizer_stream_finish
 * emits a held incomplete tail as U+FFFD. */
struct kd_tokenizer_stream;
int kd_tokenizer_stream_create(struct kd_tokenizer_stream **out, const struct kd_tokenizer *t,
			       unsigned flags);
/* *text (not NUL-terminated, *len bytes, possibly 0) stays valid until the next call
 * on s. 0 or -EINVAL (id outside the vocabulary). */
int kd_tokenizer_stream_push(struct kd_tokenizer_stream *s, int32_t id, const char **text,
			     size_t *len);
int kd_tokenizer_stream_finish(struct kd_tokenizer_stream *s, const char **text, size_t *len);
void kd_tokenizer_stream_destroy(struct kd_tokenizer_stream *s);	/* accepts NULL */

struct kd_chat_message {
	const char *role;	/* "system", "user", "assistant", "tool" */
	const char *content;
	/* The rest NULL when unused (zero-initialised callers keep working): */
	const char *tool_calls_json;	/* assistant: the OpenAI "tool_calls" array as JSON
					 * text, [{"id", "type", "function": {"name",
					 * "arguments"}}]; arguments a JSON object or the
					 * string of one (as the API sends it) */
	const char *tool_call_id;	/* tool: the id of the call this result answers */
	const char *name;		/* tool: the function's name */
};

/* Renders a conversation with the model's chat template (ChatML, with the template's
 * default system message if it has one; Llama 3; Llama 3.1-3.3, whose system block is
 * dated as the template dates it and where role "tool" or "ipython" carries a tool's
 * result; Qwen2.5; Qwen3; Kimi-K2; DeepSeek-V3.1; DeepSeek LLM / V2), as HF
 * apply_chat_template would, and add_generation_prompt opens the assistant's turn.
 * Assistant tool calls and tool results render where the family's template has them
 * (kd_tokenizer_chat_tools below adds tool definitions). Encode the result with
 * KD_TOKENIZE_SPECIAL and without KD_TOKENIZE_ADD_SPECIAL (the text carries its BOS).
 * Writes a NUL-terminated string when len > the return value (the text's length), or
 * -ENOTSUP (no template or one not supported: kd_tokenizer_error names it), -EINVAL
 * (a message without role, or without content where it has no tool calls). */
long kd_tokenizer_chat(const struct kd_tokenizer *t, const struct kd_chat_message *msgs,
		       size_t n, int add_generation_prompt, char *buf, size_t len);

/* ---- Tools (function calling) ----------------------------------------------
 * Families whose template renders tool definitions and whose call format is parsed:
 * Llama 3.1-3.3 (JSON calls {"name", "parameters"}, tools in the first user turn),
 * Qwen2.5 and Qwen3 (ChatML, <tools> in the system block, <tool_call>{...}</tool_call>),
 * Kimi-K2 (<|tool_calls_section_begin|>...). DeepSeek-V3.1's template renders calls and
 * results but no tool definitions: its calls are parsed (V3's form too), tools refused.
 * docs/CLIENT.md shows each format. */

/* 1 when t's chat template renders tools and its call format is parsed, else 0. */
int kd_tokenizer_supports_tools(const struct kd_tokenizer *t);

/* kd_tokenizer_chat with tool definitions: tools_json is the OpenAI "tools" array as
 * JSON text ([{"type": "function", "function": {"name", "description", "parameters"}}]),
 * written into the prompt as the family's template writes it (key order kept). NULL
 * or "[]": the same text as kd_tokenizer_chat, which also renders assistant turns'
 * tool_calls_json and "tool" turns for these families. Returns as kd_tokenizer_chat;
 * -ENOTSUP (kd_tokenizer_error names the family) when t has no tool support and tools
 * are given; -EINVAL for malformed tools or tool_calls JSON (kd_tokenizer_error says
 * which message and why). */
long kd_tokenizer_chat_tools(const struct kd_tokenizer *t, const struct kd_chat_message *msgs,
			     size_t n, const char *tools_json, int add_generation_prompt,
			     char *buf, size_t len);

/* Splits a generated text (text[0..len), any bytes) into prose and tool calls in t's
 * family's format. *json_out (malloc'd, NUL-terminated, freed with free() or
 * kd_tool_calls_free) is {"content": "...", "tool_calls": [{"id", "name", "arguments"}]}
 * with arguments the call's JSON object as compact JSON text, ids as the model wrote
 * them (Kimi-K2: "functions.NAME:N") or "call_<index>" where the format has none.
 * content is the text less the well-formed call blocks (trimmed at both ends when
 * there were calls); a malformed or truncated call stays in content, never an error.
 * No calls (or a family without tools): content is the whole text, tool_calls [].
 * Returns 0, -EINVAL (NULL arguments), -ENOMEM. */
int kd_tokenizer_parse_tool_calls(const struct kd_tokenizer *t, const char *text, size_t len,
				  char **json_out);
void kd_tool_calls_free(char *json);	/* accepts NULL; for callers with another allocator */

#ifdef __cplusplus
}
#endif

#endif
