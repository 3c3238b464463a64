/* Loads a tokenizer from a GGUF file's tokenizer.ggml.* keys (llama.cpp's names):
 * model "gpt2" (byte-level BPE), pre (the split pattern), tokens, token_type, merges,
 * the special ids, add_bos_token, and tokenizer.chat_template. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "client/tokenizer.h"
#include "format/gguf.h"

/* token_type values (llama.cpp's llama_token_type) */
enum { GGUF_TOKEN_CONTROL = 3, GGUF_TOKEN_USER_DEFINED = 4 };

static int32_t special_id(const struct gguf_file *f, const struct kd_tokenizer *t,
			  const char *key)
{
	int64_t v;

	if (gguf_kv_int(gguf_find_kv(f, key), &v) || v < 0 || v >= t->n_vocab)
		return -1;
	return (int32_t)v;
}

static int load_tokens(struct kd_tokenizer *t, const struct gguf_file *f)
{
	const struct gguf_kv *tokens = gguf_find_kv(f, "tokenizer.ggml.tokens");
	const struct gguf_kv *types = gguf_find_kv(f, "tokenizer.ggml.token_type");
	int ret;

	if (!tokens || tokens->type != GGUF_VT_ARRAY || tokens->arr_type != GGUF_VT_STRING) {
		tok_set_error("%s: tokenizer.ggml.tokens: missing or not an array of strings",
			      t->path);
		return -EINVAL;
	}
	if (types && types->n != tokens->n) {
		tok_set_error("%s: tokenizer.ggml.token_type has %llu entries for %llu tokens",
			      t->path, (unsigned long long)types->n,
			      (unsigned long long)tokens->n);
		return -EINVAL;
	}
	if (tokens->n > TOK_MAX_VOCAB) {
		tok_set_error("%s: tokenizer.ggml.tokens: %llu tokens (at most %u)", t->path,
			      (unsigned long long)tokens->n, TOK_MAX_VOCAB);
		return -EINVAL;
	}
	ret = tok_vocab_init(t, (uint32_t)tokens->n);
	for (uint64_t i = 0; !ret && i < tokens->n; i++) {
		struct gguf_str s;
		int64_t type = 1;

		ret = gguf_arr_str(tokens, i, &s);
		if (!ret && types)
			ret = gguf_arr_int(types, i, &type);
		if (ret) {
			tok_set_error("%s: tokenizer.ggml.tokens / token_type: entry %llu unreadable",
				      t->path, (unsigned long long)i);
			return -EINVAL;
		}
		ret = tok_add_token(t, (uint32_t)i, s.p, s.len,
				    type == GGUF_TOKEN_CONTROL || type == GGUF_TOKEN_USER_DEFINED);
	}
	return ret ? ret : tok_build(t);
}

static int load_merges(struct kd_tokenizer *t, const struct gguf_file *f)
{
	const struct gguf_kv *merges = gguf_find_kv(f, "tokenizer.ggml.merges");
	int ret = 0;

	if (!merges || merges->type != GGUF_VT_ARRAY || merges->arr_type != GGUF_VT_STRING) {
		tok_set_error("%s: tokenizer.ggml.merges: missing or not an array of strings",
			      t->path);
		return -EINVAL;
	}
	for (uint64_t i = 0; !ret && i < merges->n; i++) {
		struct gguf_str s;
		const char *sp;

		if (gguf_arr_str(merges, i, &s) || !(sp = memchr(s.p, ' ', s.len)) ||
		    sp == s.p || sp + 1 == s.p + s.len) {
			tok_set_error("%s: tokenizer.ggml.merges[%llu]: not \"left right\"", t->path,
				      (unsigned long long)i);
			return -EINVAL;
		}
		ret = tok_add_merge(t, s.p, (size_t)(sp - s.p), sp + 1,
				    (size_t)(s.p + s.len - sp - 1));
	}
	return ret;
}

/* End of turn: the file's eot id, else the token the chat template ends turns with. */
static int32_t find_eot(const struct gguf_file *f, const struct kd_tokenizer *t)
{
	static const char *const names[] = { "<|eot_id|>", "<|im_end|>", "<|end_of_turn|>" };
	int32_t id = special_id(f, t, "tokenizer.ggml.eot_token_id");

	for (size_t i = 0; id < 0 && i < sizeof(names) / sizeof(names[0]); i++)
		id = tok_find(t, names[i], strlen(names[i]));
	return id >= 0 ? id : t->eos;
}

int tok_load_gguf(struct kd_tokenizer *t, const char *path)
{
	struct gguf_file f = { 0 };
	struct gguf_str tmpl;
	char err[256], buf[64];
	int ret, add_bos;

	ret = gguf_open(&f, path, err, sizeof(err));
	if (ret) {
		tok_set_error("%s", err);
		return ret;
	}
	ret = gguf_get_str(&f, "tokenizer.ggml.model", buf, sizeof(buf));
	if (ret || strcmp(buf, "gpt2")) {
		tok_set_error("%s: tokenizer.ggml.model is %s%s%s (only \"gpt2\", byte-level BPE, "
			      "is supported)", path, ret ? "missing" : "\"", ret ? "" : buf,
			      ret ? "" : "\"");
		ret = ret == -ENOENT || !ret ? -ENOTSUP : ret;
		goto out;
	}
	if (gguf_get_str(&f, "tokenizer.ggml.pre", buf, sizeof(buf)))
		strcpy(buf, "default");
	ret = tok_pre_from_name(buf, &t->pre, &t->ignore_merges);
	if (ret) {
		tok_set_error("%s: tokenizer.ggml.pre \"%s\" is not a supported pre-tokenizer "
			      "(gpt2, smollm, llama-bpe, qwen2, deepseek-llm, deepseek-v3)", path, buf);
		goto out;
	}
	/* Qwen2's tokenizer.json normalises to NFC (llama.cpp does not; HF does) */
	t->nfc = t->pre == TOK_PRE_QWEN2;
	ret = load_tokens(t, &f);
	if (!ret)
		ret = load_merges(t, &f);
	if (ret)
		goto out;
	t->bos = special_id(&f, t, "tokenizer.ggml.bos_token_id");
	t->eos = special_id(&f, t, "tokenizer.ggml.eos_token_id");
	t->eot = find_eot(&f, t);
	/* llama.cpp's default when the key is absent: BOS for Llama 3, not for GPT-2 */
	if (gguf_kv_bool(gguf_find_kv(&f, "tokenizer.ggml.add_bos_token"), &add_bos))
		add_bos = t->pre == TOK_PRE_LLAMA3;
	t->add_bos = add_bos;
	if (!gguf_kv_str(gguf_find_kv(&f, "tokenizer.chat_template"), &tmpl))
		ret = tok_chat_detect(t, tmpl.p, tmpl.len);
out:
	gguf_close(&f);
	return ret;
}
