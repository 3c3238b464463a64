/* Loads a tokenizer from a Hugging Face directory: tokenizer.json (model.vocab,
 * model.merges, added_tokens, the pre-tokenizer recognised by its pattern, the BOS of
 * the post-processor) and tokenizer_config.json (chat_template, eos_token). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"

/* The Split patterns of the families, as tokenizer.json writes them. */
static const char llama3_pattern[] =
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
	"[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char qwen2_pattern[] =
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
	"[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* DeepSeek V3 splits three times: numbers, CJK runs, then words and punctuation. */
static const char deepseek3_numbers[] = "\\p{N}{1,3}";
static const char deepseek3_cjk[] = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";

static const char *type_of(const json_t *o)
{
	const char *s = json_string_value(json_object_get(o, "type"));

	return s ? s : "";
}

/* The family of a Split pattern given the previous ones' answer: a family, -3 / -4
 * (DeepSeek V3 / LLM so far), or -2. The DeepSeek patterns are recognised by their
 * heads (their long character classes are not compared). */
static int split_family(const char *p, int index, int prev)
{
	if (!p)
		return -2;
	if (index == 0 && !strcmp(p, llama3_pattern))
		return TOK_PRE_LLAMA3;
	if (index == 0 && !strcmp(p, qwen2_pattern))
		return TOK_PRE_QWEN2;
	if (index == 0 && !strcmp(p, deepseek3_numbers))
		return -3;	/* DeepSeek V3 so far */
	if (index == 1 && prev == -3 && !strcmp(p, deepseek3_cjk))
		return -3;
	if (index == 2 && prev == -3 && strstr(p, "[\\p{L}\\p{M}]+|"))
		return TOK_PRE_DEEPSEEK3;
	/* DeepSeek LLM: [\r\n], \s?[letters]+, \s?[punctuation]+, \s+$, [CJK]+, \p{N}+ */
	if (index == 0 && (!strcmp(p, "[\r\n]") || !strcmp(p, "[\\r\\n]")))
		return -4;
	if (prev == -4 && index >= 1 && index <= 4) {
		const char *head = index == 3 ? "\\s+$" : index == 4 ? "[\u4e00-" : "\\s?[";

		return strncmp(p, head, strlen(head)) ? -2 : -4;
	}
	if (prev == -4 && index == 5 && !strcmp(p, "\\p{N}+"))
		return TOK_PRE_DEEPSEEK_LLM;
	return -2;
}

/* Recognises the pre-tokenizer: ByteLevel alone (GPT-2), Digits(individual) then
 * ByteLevel (SmolLM2), or Splits with the Llama 3 / Qwen2 / DeepSeek V3 patterns then
 * ByteLevel without its own regex. */
static int detect_pre(struct kd_tokenizer *t, const json_t *pre, const char *file)
{
	const json_t *steps = pre;
	int digits = 0, byte_level_regex = 0, split = -1, n_split = 0;
	size_t n;

	if (!strcmp(type_of(pre), "Sequence"))
		steps = json_object_get(pre, "pretokenizers");
	n = json_is_array(steps) ? json_array_size(steps) : 1;
	for (size_t i = 0; i < n; i++) {
		const json_t *s = json_is_array(steps) ? json_array_get(steps, i) : pre;
		const char *type = type_of(s);

		if (!strcmp(type, "Digits") &&
		    json_is_true(json_object_get(s, "individual_digits"))) {
			digits = 1;
		} else if (!strcmp(type, "ByteLevel")) {
			const json_t *r = json_object_get(s, "use_regex");

			byte_level_regex = !r || json_is_true(r);
		} else if (!strcmp(type, "Split")) {
			const char *p = json_string_value(
				json_object_get(json_object_get(s, "pattern"), "Regex"));

			split = split_family(p, n_split++, split);
		} else {
			split = -2;
		}
	}
	if (split == -1 && byte_level_regex) {
		t->pre = digits ? TOK_PRE_SMOLLM : TOK_PRE_GPT2;
		return 0;
	}
	if (split >= 0 && !digits && !byte_level_regex) {
		t->pre = (enum tok_pre)split;
		return 0;
	}
	tok_set_error("%s: pre_tokenizer is not one kdec knows (GPT-2, SmolLM2, Llama 3, Qwen2, "
		      "DeepSeek LLM, DeepSeek V3)",
		      file);
	return -ENOTSUP;
}

static int load_vocab(struct kd_tokenizer *t, const json_t *vocab, const json_t *added,
		      const char *file)
{
	const char *key;
	json_t *v;
	json_int_t max_id = -1;
	size_t i;
	int ret;

	json_object_foreach((json_t *)vocab, key, v) {
		if (!json_is_integer(v) || json_integer_value(v) < 0 ||
		    json_integer_value(v) >= TOK_MAX_VOCAB) {
			tok_set_error("%s: model.vocab[\"%.40s\"]: not an id in 0..%u", file, key,
				      TOK_MAX_VOCAB - 1);
			return -EINVAL;
		}
		if (json_integer_value(v) > max_id)
			max_id = json_integer_value(v);
	}
	json_array_foreach(added, i, v) {
		json_int_t id = json_integer_value(json_object_get(v, "id"));

		if (!json_is_integer(json_object_get(v, "id")) || id < 0 || id >= TOK_MAX_VOCAB ||
		    !json_is_string(json_object_get(v, "content"))) {
			tok_set_error("%s: added_tokens[%zu]: want an id in 0..%u and a content",
				      file, i, TOK_MAX_VOCAB - 1);
			return -EINVAL;
		}
		if (id > max_id)
			max_id = id;
	}
	ret = tok_vocab_init(t, (uint32_t)(max_id + 1));
	json_object_foreach((json_t *)vocab, key, v) {
		if (!ret)
			ret = tok_add_token(t, (uint32_t)json_integer_value(v), key, strlen(key), 0);
	}
	/* added tokens are matched whole and decode as written; one already in the
	 * vocabulary (SmolLM2's <|im_start|>) takes the added form */
	json_array_foreach(added, i, v) {
		const char *c = json_string_value(json_object_get(v, "content"));

		if (!ret)
			ret = tok_add_token(t, (uint32_t)json_integer_value(json_object_get(v, "id")),
					    c, json_string_length(json_object_get(v, "content")), 1);
	}
	return ret ? ret : tok_build(t);
}

static int load_merges(struct kd_tokenizer *t, const json_t *merges, const char *file)
{
	size_t i;
	json_t *m;
	int ret = 0;

	if (!json_is_array(merges)) {
		tok_set_error("%s: model.merges: missing or not an array", file);
		return -EINVAL;
	}
	json_array_foreach(merges, i, m) {
		const char *s = json_string_value(m), *sp;

		if (s && (sp = strchr(s, ' ')) && sp != s && sp[1]) {
			ret = tok_add_merge(t, s, (size_t)(sp - s), sp + 1, strlen(sp + 1));
		} else if (json_is_array(m) && json_array_size(m) == 2 &&
			   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
			const json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);

			ret = tok_add_merge(t, json_string_value(a), json_string_length(a),
					    json_string_value(b), json_string_length(b));
		} else {
			tok_set_error("%s: model.merges[%zu]: not \"left right\" or [left, right]",
				      file, i);
			return -EINVAL;
		}
		if (ret)
			return ret;
	}
	return 0;
}

/* The BOS a TemplateProcessing post-processor puts first ("single": [{"SpecialToken":
 * {"id": "<|begin_of_text|>"}}, {"Sequence": ...}]), looked for inside a Sequence too. */
static void detect_bos(struct kd_tokenizer *t, const json_t *post)
{
	const json_t *procs = json_object_get(post, "processors");
	const char *first;
	size_t i;
	json_t *p;

	if (json_is_array(procs)) {
		json_array_foreach(procs, i, p)
			detect_bos(t, p);
		return;
	}
	if (strcmp(type_of(post), "TemplateProcessing"))
		return;
	first = json_string_value(json_object_get(json_object_get(
		json_array_get(json_object_get(post, "single"), 0), "SpecialToken"), "id"));
	if (first) {
		t->bos = tok_find(t, first, strlen(first));
		t->add_bos = t->bos >= 0;
	}
}

/* A token named in tokenizer_config.json: "<|im_end|>" or {"content": "<|im_end|>"}. */
static int32_t config_token(const struct kd_tokenizer *t, const json_t *cfg, const char *key)
{
	const json_t *v = json_object_get(cfg, key);
	const char *s = json_string_value(json_is_object(v) ? json_object_get(v, "content") : v);

	return s ? tok_find(t, s, strlen(s)) : -1;
}

static int load_config(struct kd_tokenizer *t, const char *dir)
{
	char file[PATH_MAX];
	json_error_t jerr;
	const json_t *tmpl;
	json_t *cfg;
	int32_t id;
	int ret = 0;

	snprintf(file, sizeof(file), "%s/tokenizer_config.json", dir);
	cfg = json_load_file(file, 0, &jerr);
	if (!cfg)
		return 0;	/* optional: no chat template, ids from tokenizer.json only */
	if (t->bos < 0)
		t->bos = config_token(t, cfg, "bos_token");
	if (json_is_boolean(json_object_get(cfg, "add_bos_token")))
		t->add_bos = json_is_true(json_object_get(cfg, "add_bos_token")) && t->bos >= 0;
	t->eos = config_token(t, cfg, "eos_token");
	tmpl = json_object_get(cfg, "chat_template");
	if (json_is_array(tmpl)) {	/* [{"name": "default", "template": ...}, ...] */
		size_t i;
		json_t *e;

		json_array_foreach(tmpl, i, e) {
			if (!strcmp(json_string_value(json_object_get(e, "name")) ?: "", "default"))
				tmpl = json_object_get(e, "template");
		}
	}
	if (json_is_string(tmpl))
		ret = tok_chat_detect(t, json_string_value(tmpl), json_string_length(tmpl));
	id = tok_find(t, "<|eot_id|>", 10);
	if (id < 0)
		id = tok_find(t, "<|im_end|>", 10);
	t->eot = id >= 0 ? id : t->eos;
	json_decref(cfg);
	return ret;
}

int tok_load_hf_dir(struct kd_tokenizer *t, const char *dir)
{
	char file[PATH_MAX];
	const json_t *model, *norm;
	json_error_t jerr;
	json_t *root;
	int ret;

	snprintf(file, sizeof(file), "%s/tokenizer.json", dir);
	root = json_load_file(file, 0, &jerr);
	if (!root) {
		tok_set_error("%s: line %d: %s", file, jerr.line, jerr.text);
		return -EINVAL;
	}
	model = json_object_get(root, "model");
	if (strcmp(type_of(model), "BPE") || !json_is_object(json_object_get(model, "vocab"))) {
		tok_set_error("%s: model.type is not \"BPE\" with a vocab", file);
		ret = -ENOTSUP;
		goto out;
	}
	ret = detect_pre(t, json_object_get(root, "pre_tokenizer"), file);
	if (ret)
		goto out;
	t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
	norm = json_object_get(root, "normalizer");
	t->nfc = !strcmp(type_of(norm), "NFC");
	if (!json_is_null(norm) && norm && !t->nfc) {
		tok_set_error("%s: normalizer \"%s\" is not supported (none or NFC)", file,
			      type_of(norm));
		ret = -ENOTSUP;
		goto out;
	}
	ret = load_vocab(t, json_object_get(model, "vocab"), json_object_get(root, "added_tokens"),
			 file);
	if (!ret)
		ret = load_merges(t, json_object_get(model, "merges"), file);
	if (ret)
		goto out;
	detect_bos(t, json_object_get(root, "post_processor"));
	ret = load_config(t, dir);
out:
	json_decref(root);
	return ret;
}
