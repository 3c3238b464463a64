/* The tokenizer's internal state (struct kd_tokenizer, opaque in kdclient.h) and the
 * calls between its files: loaders fill the vocabulary and merges through tok_add_*,
 * tok_build indexes them; encode = special-token split -> pre-tokenizer -> BPE. */
#ifndef KD_CLIENT_TOKENIZER_H
#define KD_CLIENT_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "client/kdclient.h"

#define TOK_MAX_VOCAB (1u << 22)	/* tokens accepted from a file */
#define TOK_MAX_TOKEN_BYTES 1024	/* bytes of one token's text */
#define TOK_MAX_SPECIAL 4096		/* special tokens matched in text */

/* Pre-tokenizer families: each is a hand-written matcher equal to the family's regex. */
enum tok_pre {
	TOK_PRE_GPT2,		/* 's|'t|... | ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
	TOK_PRE_SMOLLM,		/* every \p{N} alone, then GPT2 */
	TOK_PRE_LLAMA3,		/* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|... */
	TOK_PRE_QWEN2,		/* LLAMA3 with \p{N} one at a time */
	TOK_PRE_DEEPSEEK3,	/* \p{N}{1,3}, then CJK runs, then punctuation+ASCII word|... */
	TOK_PRE_DEEPSEEK_LLM,	/* six splits in turn: [\r\n], \s?letters+, \s?punct+, \s+$, CJK+, \p{N}+ */
};

enum tok_chat {
	TOK_CHAT_NONE,		/* no template, or one we do not know: kd_tokenizer_chat -> -ENOTSUP */
	TOK_CHAT_CHATML,	/* <|im_start|>role\ncontent<|im_end|>\n */
	TOK_CHAT_LLAMA3,	/* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
	TOK_CHAT_LLAMA31,	/* Llama 3.1-3.3: LLAMA3 after a system block that always opens
				 * with the knowledge cutoff and a date; tool results as JSON */
	TOK_CHAT_DEEPSEEK2,	/* DeepSeek LLM / V2: bos, "User: c\n\n", "Assistant: c" eos,
				 * system "c\n\n", then "Assistant:" */
	TOK_CHAT_QWEN25,	/* Qwen2.5: ChatML with its default system message, <tools>
				 * in the system block, <tool_call>/<tool_response> */
	TOK_CHAT_QWEN3,		/* ChatML with <tools> in the system block, <think> kept
				 * after the last query, <tool_call>/<tool_response> */
	TOK_CHAT_KIMI_K2,	/* <|im_user|>role<|im_middle|>c<|im_end|>, tools declared
				 * as JSON, <|tool_calls_section_begin|> */
	TOK_CHAT_DEEPSEEK3,	/* DeepSeek-V3.1: bos system <｜User｜>c<｜Assistant｜><think></think>,
				 * <｜tool▁calls▁begin｜>; renders no tool definitions */
};

struct tok_token {
	uint32_t text_off, text_len;	/* the vocabulary string, in strings (bytes) */
	uint32_t bytes_off, bytes_len;	/* what it decodes to (through the byte map), in
					 * strings (bytes) */
	uint8_t special;		/* control / user-defined / added: matched in text
					 * with KD_TOKENIZE_SPECIAL, dropped by
					 * KD_DECODE_SKIP_SPECIAL */
};

struct tok_merge_slot {
	uint64_t key;			/* left id << 32 | right id; UINT64_MAX: empty */
	uint32_t rank;			/* position in the merge list: lower merges first */
	int32_t merged;			/* id of the concatenation */
};

struct kd_tokenizer {
	uint32_t n_vocab;
	struct tok_token *tokens;	/* (n_vocab); a hole (id never given) has text_len 0 */
	char *strings;			/* (strings_len) bytes: token texts and decoded bytes */
	size_t strings_len, strings_cap;
	uint32_t *vocab_slots;		/* (vocab_mask + 1) id + 1 of the text hashed there; 0: empty */
	uint32_t vocab_mask;
	struct tok_merge_slot *merges;	/* (merge_mask + 1) */
	uint32_t merge_mask, n_merges;
	int32_t byte_id[256];		/* the token of each single byte; -1 if missing */
	int32_t *special;		/* (n_special) special ids, longest text first */
	uint32_t n_special;
	uint8_t special_first[256];	/* 1 where a special token's text starts with that byte */

	enum tok_pre pre;
	int ignore_merges;		/* a piece that is a whole token is not merged (Llama 3) */
	int nfc;			/* text is NFC-normalised first (Qwen2's normaliser) */
	int add_bos;			/* KD_TOKENIZE_ADD_SPECIAL prepends bos */
	int32_t bos, eos, eot;		/* -1: none */
	enum tok_chat chat;
	char *chat_system;		/* ChatML's / Kimi-K2's default system message; NULL: none */
	int chat_today;			/* LLAMA31: the template dates the system block with
					 * today's date (3.2), not its fixed 26 Jul 2024 */
	int chat_tools;			/* LLAMA31: Meta's tool rendering (tools_in_user_message);
					 * fine-tunes with their own (functionary) have none */
	char *path;			/* what was opened, for messages */
};

/* Loaders: fill t (zeroed, pre-set by the caller to no tokens) from a file. 0 or -errno
 * with a message set through tok_set_error. */
int tok_load_gguf(struct kd_tokenizer *t, const char *path);
int tok_load_hf_dir(struct kd_tokenizer *t, const char *dir);

/* Building: tokens by id (text as stored in the vocabulary), merges in rank order. */
int tok_vocab_init(struct kd_tokenizer *t, uint32_t n_vocab);
int tok_add_token(struct kd_tokenizer *t, uint32_t id, const char *text, size_t len, int special);
int tok_add_merge(struct kd_tokenizer *t, const char *left, size_t llen, const char *right,
		  size_t rlen);
int tok_build(struct kd_tokenizer *t);	/* after all tokens, before merges */
int32_t tok_find(const struct kd_tokenizer *t, const char *text, size_t len);	/* -1: absent */
/* The rule merging ids a and b, or NULL. */
const struct tok_merge_slot *tok_merge_find(const struct kd_tokenizer *t, int32_t a, int32_t b);

/* Chat template recognition from its source text (sets t->chat, t->chat_system). */
int tok_chat_detect(struct kd_tokenizer *t, const char *tmpl, size_t len);
/* Pre-tokenizer name as llama.cpp writes tokenizer.ggml.pre: 0 or -ENOTSUP. */
int tok_pre_from_name(const char *name, enum tok_pre *out, int *ignore_merges);

/* Splits text[0..len) into pieces, calling emit(ctx, offset, length) in order; the
 * pieces cover the text exactly. 0 or -ENOMEM. */
int tok_pretokenize(enum tok_pre pre, const char *text, size_t len,
		    int (*emit)(void *ctx, size_t off, size_t n), void *ctx);

/* Text output into a caller's buffer that counts what did not fit (tokenizer_text.c):
 * k is the length the whole text needs; buf gets its first len bytes. */
struct tok_out {
	char *buf;
	size_t len, k;
};
void tok_put(struct tok_out *o, const char *s, size_t n);
void tok_puts(struct tok_out *o, const char *s);
void tok_put_trimmed(struct tok_out *o, const char *s);	/* Python's str.strip() */
void tok_put_token(struct tok_out *o, const struct kd_tokenizer *t, int32_t id);
/* s[0..n) as Python's json.dumps(s, ensure_ascii=False) writes a string. */
void tok_put_json_string(struct tok_out *o, const char *s, size_t n);
/* A jansson value as transformers' tojson filter writes it (json.dumps, ensure_ascii
 * False, key order kept): indent < 0 one line with ", " and ": ", else that indent. */
struct json_t;
void tok_put_pyjson(struct tok_out *o, const struct json_t *v, int indent);
int tok_is_py_space(unsigned char c);

/* Renderers of the families with tools (tokenizer_chat_tools.c); tools: a non-empty
 * JSON array or NULL; calls[i]: message i's tool_calls array or NULL. */
struct tok_chat_in {
	const struct kd_chat_message *m;
	struct json_t **calls;
	size_t n;
	const struct json_t *tools;
	int gen;
};
int tok_render_tools(const struct kd_tokenizer *t, const struct tok_chat_in *in,
		     struct tok_out *o);
/* The families without tools (tokenizer_chat.c); -ENOTSUP with a message for others. */
int tok_render_plain(const struct kd_tokenizer *t, const struct kd_chat_message *m, size_t n,
		     int gen, struct tok_out *o);

/* The thread's last error message (kd_tokenizer_error), printf-style setter. */
void tok_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* GPT-2's byte <-> printable code point map used by byte-level vocabularies. */
uint32_t tok_byte_to_cp(unsigned char b);
int tok_cp_to_byte(uint32_t cp);	/* -1: not a mapped code point */

#endif
