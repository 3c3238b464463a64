/* The tokenizer against Hugging Face (fixtures: contrib/make_tokenizer_fixtures.py), in
 * two parts so that a machine without vocabularies reports SKIP, not a pass:
 *   test_tokenizer: the pre-tokenizers' pieces of every corpus line for six families
 *     and NFC, and open's errors (no vocabulary needed: runs everywhere);
 *   test_tokenizer vocab (tests/tokenizer_vocab.sh): for every family whose vocabulary
 *     is on this machine (contrib/fetch-smollm2.sh, contrib/fetch-vocabs.sh) the ids of
 *     every corpus line with and without special tokens, BOS, decode(encode(s)) == s,
 *     streaming decode one id at a time, random bytes, chat templates, the
 *     tokenizer.json loader on the same vocabulary (with tokenizer_config.json, and the
 *     DeepSeek split patterns through it), and encode speed; exit 77 naming each
 *     vocabulary that is absent. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "client/kdclient.h"
#include "client/tokenizer.h"
#include "client/tokenizer_unicode.h"
#include "format/gguf.h"
#include "tests/testutil.h"

#define MAX_IDS 4096

struct family {
	const char *name;	/* fixture tests/data/tokenizer/<name>.json */
	const char *vocab;	/* file under $KDEC_CACHE/vocab/, or NULL: the SmolLM2 model */
	const char *json_pre;	/* the family's tokenizer.json pre_tokenizer */
};

static const struct family families[] = {
	{ "smollm2", NULL,
	  "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":true},"
	  "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}]}" },
	{ "gpt2", "ggml-vocab-gpt-2.gguf",
	  "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}" },
	{ "llama3", "ggml-vocab-llama-bpe.gguf",
	  "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
	  "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}\\\\p{N}]+"
	  "[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},\"behavior\":\"Isolated\",\"invert\":false},"
	  "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}" },
	{ "qwen2", "ggml-vocab-qwen2.gguf",
	  "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
	  "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+"
	  "[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},\"behavior\":\"Isolated\",\"invert\":false},"
	  "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}" },
	/* its tokenizer.json form is checked by check_split_json */
	{ "deepseek_llm", "ggml-vocab-deepseek-llm.gguf", NULL },
};

static int n_lines_checked, n_lines_normalized;
static double bytes_encoded, seconds_encoding;

static void cache_path(char *buf, size_t len, const struct family *f)
{
	const char *cache = getenv("KDEC_CACHE"), *home = getenv("HOME");
	char dir[PATH_MAX / 2];

	if (cache && *cache)
		snprintf(dir, sizeof(dir), "%s", cache);
	else
		snprintf(dir, sizeof(dir), "%s/.cache/kdec", home ? home : "/nonexistent");
	if (!f->vocab && getenv("KDEC_SMOLLM2_GGUF") && *getenv("KDEC_SMOLLM2_GGUF"))
		snprintf(buf, len, "%s", getenv("KDEC_SMOLLM2_GGUF"));
	else if (!f->vocab)
		snprintf(buf, len, "%s/SmolLM2-135M-Instruct.Q4_1.gguf", dir);
	else
		snprintf(buf, len, "%s/vocab/%s", dir, f->vocab);
}

/* 1 if s[0..n) is whole UTF-8 characters (every sequence complete and valid). */
static int utf8_complete(const char *s, size_t n)
{
	const unsigned char *p = (const unsigned char *)s;

	for (size_t i = 0; i < n;) {
		uint32_t cp;
		int k = tok_utf8_decode(p + i, n - i, &cp);

		if (cp >= TOK_CP_INVALID)
			return 0;
		i += (size_t)k;
	}
	return 1;
}

static void fmt_ids(char *buf, size_t len, const int32_t *ids, long n)
{
	size_t k = 0;

	buf[0] = '\0';
	for (long i = 0; i < n && k + 16 < len; i++)
		k += (size_t)snprintf(buf + k, len - k, "%s%d", i ? "," : "", ids[i]);
}

static void check_ids(const char *fam, const char *what, const char *text, const int32_t *got,
		      long n_got, const json_t *want)
{
	char g[1024], w[1024];
	int32_t wv[MAX_IDS];
	size_t n_want = json_array_size(want), i;
	json_t *v;
	int same = (size_t)n_got == n_want;

	json_array_foreach(want, i, v) {
		if (i < MAX_IDS)
			wv[i] = (int32_t)json_integer_value(v);
		if (same && got[i] != wv[i])
			same = 0;
	}
	if (!same) {
		fmt_ids(g, sizeof(g), got, n_got);
		fmt_ids(w, sizeof(w), wv, n_want < MAX_IDS ? (long)n_want : MAX_IDS);
	}
	CHECK(same, "%s %s: \"%.60s\": ids [%s], HF [%s]", fam, what, text, same ? "" : g,
	      same ? "" : w);
}

/* Decoding text's ids one at a time equals the whole decode, and every piece is whole
 * characters. */
static void check_stream(const struct kd_tokenizer *t, const char *fam, const char *text,
			 const int32_t *ids, long n, const char *full, long full_len)
{
	struct kd_tokenizer_stream *s;
	char *acc = malloc((size_t)full_len * 3 + 16);
	size_t k = 0, len;
	const char *piece;
	int pieces_ok = 1;

	CHECK(!kd_tokenizer_stream_create(&s, t, 0), "%s: stream_create", fam);
	for (long i = 0; i < n; i++) {
		CHECK(!kd_tokenizer_stream_push(s, ids[i], &piece, &len), "%s: push", fam);
		pieces_ok &= utf8_complete(piece, len);
		memcpy(acc + k, piece, len);
		k += len;
	}
	kd_tokenizer_stream_finish(s, &piece, &len);
	memcpy(acc + k, piece, len);
	k += len;
	CHECK(pieces_ok, "%s: \"%.40s\": a streamed piece cut a UTF-8 character", fam, text);
	CHECK(k == (size_t)full_len && !memcmp(acc, full, k),
	      "%s: \"%.40s\": streamed text (%zu bytes) differs from the decode (%ld)", fam, text,
	      k, full_len);
	kd_tokenizer_stream_destroy(s);
	free(acc);
}

/* 1 if some special token decodes to other bytes than its text (DeepSeek LLM). */
static int lossy_specials(const struct kd_tokenizer *t)
{
	for (uint32_t i = 0; i < t->n_special; i++) {
		const struct tok_token *tk = &t->tokens[t->special[i]];

		if (tk->bytes_len != tk->text_len ||
		    memcmp(t->strings + tk->bytes_off, t->strings + tk->text_off, tk->text_len))
			return 1;
	}
	return 0;
}

static void check_case(const struct kd_tokenizer *t, const char *fam, const json_t *c,
		       int32_t bos_added)
{
	const char *text = json_string_value(json_object_get(c, "text"));
	size_t len = json_string_length(json_object_get(c, "text"));
	const json_t *no_special = json_object_get(c, "ids_no_special");
	static int32_t ids[MAX_IDS];
	static char out[MAX_IDS * 8];
	long n, m;
	double t0;

	/* Qwen2 NFC-normalises first: that text comes back normalised, not as it was */
	int normalized = json_is_true(json_object_get(c, "normalized"));

	n_lines_normalized += normalized;
	n_lines_checked++;
	t0 = test_now_s();
	n = kd_tokenizer_encode(t, text, len, KD_TOKENIZE_SPECIAL, ids, MAX_IDS);
	seconds_encoding += test_now_s() - t0;
	bytes_encoded += (double)len;
	CHECK(n >= 0 && n <= MAX_IDS, "%s: encode: %ld", fam, n);
	if (n < 0 || n > MAX_IDS)
		return;
	check_ids(fam, "special", text, ids, n, json_object_get(c, "ids"));
	CHECK(kd_tokenizer_encode(t, text, len, KD_TOKENIZE_SPECIAL, NULL, 0) == n,
	      "%s: size query differs", fam);
	m = kd_tokenizer_decode(t, ids, (size_t)n, 0, out, sizeof(out));
	/* DeepSeek's added tokens "ü", "ø", ... stand for single bytes (0xFC, 0xF8), so a
	 * text with them does not come back from its special-token encoding (nor in HF) */
	CHECK(normalized || lossy_specials(t) || (m == (long)len && !memcmp(out, text, len)),
	      "%s: decode(encode(\"%.40s\")) differs", fam, text);
	if (utf8_complete(out, (size_t)m))
		check_stream(t, fam, text, ids, n, out, m);

	n = kd_tokenizer_encode(t, text, len, 0, ids, MAX_IDS);
	check_ids(fam, "plain", text, ids, n, no_special ? no_special : json_object_get(c, "ids"));
	m = kd_tokenizer_decode(t, ids, (size_t)n, 0, out, sizeof(out));
	CHECK(normalized || (m == (long)len && !memcmp(out, text, len)), "%s: plain decode differs",
	      fam);
	check_stream(t, fam, text, ids, n, out, m);

	n = kd_tokenizer_encode(t, text, len, KD_TOKENIZE_ADD_SPECIAL, ids, MAX_IDS);
	CHECK(bos_added < 0 ? n == 0 || ids[0] != kd_tokenizer_bos(t) || !strncmp(text, "<|", 2) :
	      n >= 1 && ids[0] == bos_added, "%s: BOS: want %d, got %d", fam, bos_added,
	      n > 0 ? ids[0] : -1);
}

static void check_chat(struct kd_tokenizer *t, const char *fam, const json_t *doc)
{
	const json_t *chats = json_object_get(doc, "chat"), *tmpl;
	size_t i;
	json_t *c;

	tmpl = json_object_get(doc, "chat_template");
	if (json_is_string(tmpl))	/* a vocabulary file without one: the fixture's */
		tok_chat_detect(t, json_string_value(tmpl), json_string_length(tmpl));
	json_array_foreach(chats, i, c) {
		const json_t *msgs = json_object_get(c, "messages");
		const char *want = json_string_value(json_object_get(c, "text"));
		struct kd_chat_message m[8];
		char buf[4096];
		size_t j;
		json_t *mj;
		long n;

		memset(m, 0, sizeof(m));
		json_array_foreach(msgs, j, mj) {
			m[j].role = json_string_value(json_object_get(mj, "role"));
			m[j].content = json_string_value(json_object_get(mj, "content"));
		}
		n = kd_tokenizer_chat(t, m, json_array_size(msgs),
				      json_is_true(json_object_get(c, "add_generation_prompt")), buf,
				      sizeof(buf));
		CHECK(n >= 0 && !strcmp(buf, want), "%s: chat %zu: got \"%s\" (%ld), HF \"%s\"", fam, i,
		      n >= 0 ? buf : kd_tokenizer_error(), n, want);
		CHECK(kd_tokenizer_chat(t, m, json_array_size(msgs), 1, NULL, 0) >= n,
		      "%s: chat size query", fam);
	}
}

/* Random byte strings (invalid UTF-8 included) encode, decode back exactly, and stream. */
static void check_random(const struct kd_tokenizer *t, const char *fam)
{
	unsigned long long seed = 0x5eed;
	static int32_t ids[MAX_IDS];
	static char text[600], want[2400], out[MAX_IDS * 8];
	int bad = 0;

	for (int r = 0; r < 400; r++) {
		size_t len = (size_t)((test_randf(&seed) + 1) * 0.5f * 512), n_want = 0;
		long n, m;

		for (size_t i = 0; i < len; i++) {
			float x = test_randf(&seed);

			/* mostly high bytes and spaces: invalid sequences, cut characters */
			text[i] = (char)(x < -0.5f ? ' ' : x < 0 ? 0x80 + (int)((x + 1) * 120) :
					 (int)((x + 1) * 127.5f));
		}
		/* with special tokens matched it must not crash; without, bytes come back */
		n = kd_tokenizer_encode(t, text, len, KD_TOKENIZE_SPECIAL, ids, MAX_IDS);
		bad += n < 0;
		n = kd_tokenizer_encode(t, text, len, 0, ids, MAX_IDS);
		m = n >= 0 ? kd_tokenizer_decode(t, ids, (size_t)n, 0, out, sizeof(out)) : -1;
		/* NFC first where the model normalises; then bytes without a token of their
		 * own are dropped (as HF does) */
		char *norm = NULL;
		size_t norm_len = len;

		if (t->nfc)
			tok_nfc(text, len, &norm, &norm_len);
		for (size_t i = 0; i < norm_len; i++)
			if (t->byte_id[(unsigned char)(norm ? norm : text)[i]] >= 0)
				want[n_want++] = (norm ? norm : text)[i];
		free(norm);
		bad += m != (long)n_want || memcmp(out, want, n_want);
		if (n > 0) {
			struct kd_tokenizer_stream *s;
			const char *p;
			size_t k;

			kd_tokenizer_stream_create(&s, t, 0);
			for (long i = 0; i < n; i++) {
				kd_tokenizer_stream_push(s, ids[i], &p, &k);
				bad += !utf8_complete(p, k);
			}
			kd_tokenizer_stream_finish(s, &p, &k);
			kd_tokenizer_stream_destroy(s);
		}
	}
	CHECK(!bad, "%s: %d of 400 random byte strings did not round-trip", fam, bad);
}

/* tokenizer.json of the same vocabulary, written here from the GGUF (kdec ships no
 * vocabulary), loaded through the Hugging Face directory path. */
static int write_hf_dir(const char *gguf_path, const struct family *f, json_t *pre, json_t *cfg,
			json_t *post, char *dir, size_t len)
{
	struct gguf_file g = { 0 };
	const struct gguf_kv *toks, *types, *merges;
	json_t *root = json_object(), *model = json_object(), *vocab = json_object();
	json_t *mj = json_array(), *added = json_array();
	char err[256], path[PATH_MAX + 32];
	int ret = -1;

	snprintf(dir, len, "/tmp/kdec-test-tokenizer-%d-%s", (int)getpid(), f->name);
	if (gguf_open(&g, gguf_path, err, sizeof(err)) || mkdir(dir, 0700))
		goto out;
	toks = gguf_find_kv(&g, "tokenizer.ggml.tokens");
	types = gguf_find_kv(&g, "tokenizer.ggml.token_type");
	merges = gguf_find_kv(&g, "tokenizer.ggml.merges");
	for (uint64_t i = 0; toks && i < toks->n; i++) {
		struct gguf_str s;
		int64_t type = 1;
		char *tx;

		gguf_arr_str(toks, i, &s);
		if (types)
			gguf_arr_int(types, i, &type);
		tx = strndup(s.p, s.len);
		if (!json_object_get(vocab, tx))
			json_object_set_new(vocab, tx, json_integer((json_int_t)i));
		if (type == 3 || type == 4)
			json_array_append_new(added, json_pack("{s:I, s:s, s:b}", "id", (json_int_t)i,
							       "content", tx, "special", 1));
		free(tx);
	}
	for (uint64_t i = 0; merges && i < merges->n; i++) {
		struct gguf_str s;

		gguf_arr_str(merges, i, &s);
		json_array_append_new(mj, json_stringn(s.p, s.len));
	}
	json_object_set_new(model, "type", json_string("BPE"));
	json_object_set_new(model, "ignore_merges", json_boolean(!strcmp(f->name, "llama3")));
	json_object_set_new(model, "vocab", vocab);
	json_object_set_new(model, "merges", mj);
	json_object_set_new(root, "model", model);
	json_object_set_new(root, "added_tokens", added);
	json_object_set_new(root, "pre_tokenizer", pre ? pre : json_loads(f->json_pre, 0, NULL));
	json_object_set_new(root, "normalizer", strcmp(f->name, "qwen2") ? json_null() :
			    json_pack("{s:s}", "type", "NFC"));
	pre = NULL;
	if (post)
		json_object_set(root, "post_processor", post);
	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	ret = json_dump_file(root, path, JSON_COMPACT);
	if (!ret && cfg) {
		snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
		ret = json_dump_file(cfg, path, JSON_COMPACT);
	}
out:
	json_decref(pre);
	json_decref(root);
	gguf_close(&g);
	return ret;
}

static void remove_hf_dir(const char *dir)
{
	char path[PATH_MAX + 32];

	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	unlink(path);
	rmdir(dir);
}

/* What a Hugging Face directory of this model would hold besides tokenizer.json:
 * tokenizer_config.json (chat_template, bos/eos, add_bos_token) and, where BOS is
 * added, the post-processor that adds it (Llama 3 style). */
static void hf_config(const struct kd_tokenizer *t, const json_t *doc, json_t **cfg, json_t **post)
{
	const json_t *tmpl = json_object_get(doc, "chat_template");
	struct gguf_file g = { 0 };
	struct gguf_str gt;
	char err[256];

	*cfg = json_object();
	*post = NULL;
	if (json_is_string(tmpl)) {
		json_object_set(*cfg, "chat_template", (json_t *)tmpl);
	} else if (!gguf_open(&g, t->path, err, sizeof(err))) {
		if (!gguf_kv_str(gguf_find_kv(&g, "tokenizer.chat_template"), &gt))
			json_object_set_new(*cfg, "chat_template", json_stringn(gt.p, gt.len));
		gguf_close(&g);
	}
	if (t->bos >= 0)
		json_object_set_new(*cfg, "bos_token", json_stringn(t->strings +
				    t->tokens[t->bos].text_off, t->tokens[t->bos].text_len));
	if (t->eos >= 0)
		json_object_set_new(*cfg, "eos_token", json_stringn(t->strings +
				    t->tokens[t->eos].text_off, t->tokens[t->eos].text_len));
	if (t->add_bos && t->bos >= 0)
		*post = json_pack("{s:s, s:[{s:{s:s%, s:i}}, {s:{s:s, s:i}}]}", "type",
				  "TemplateProcessing", "single", "SpecialToken", "id",
				  t->strings + t->tokens[t->bos].text_off,
				  (size_t)t->tokens[t->bos].text_len, "type_id", 0, "Sequence", "id", "A",
				  "type_id", 0);
}

static int run_family(const struct family *f, const char *srcdir)
{
	char path[PATH_MAX], fixture[PATH_MAX], dir[PATH_MAX];
	struct kd_tokenizer *t, *tj;
	json_t *cfg, *post;
	json_error_t jerr;
	const json_t *cases, *bos;
	json_t *doc, *c;
	size_t i;
	int ret;

	cache_path(path, sizeof(path), f);
	if (access(path, R_OK)) {
		test_skip("%s: %s absent (contrib/fetch-%s.sh fetches it)", f->name, path,
			  f->vocab ? "vocabs" : "smollm2");
		return 0;
	}
	snprintf(fixture, sizeof(fixture), "%s/tests/data/tokenizer/%s.json", srcdir, f->name);
	doc = json_load_file(fixture, 0, &jerr);
	CHECK(doc, "%s: %s", fixture, jerr.text);
	if (!doc)
		return 0;
	ret = kd_tokenizer_open(&t, path);
	CHECK(!ret, "%s: open: %s", f->name, kd_tokenizer_error());
	if (ret) {
		json_decref(doc);
		return 0;
	}
	cases = json_object_get(doc, "cases");
	bos = json_object_get(doc, "bos_added");
	json_array_foreach(cases, i, c)
		check_case(t, f->name, c, json_is_integer(bos) ? (int32_t)json_integer_value(bos) : -1);
	check_chat(t, f->name, doc);
	check_random(t, f->name);
	fprintf(stderr, "%s: %zu corpus lines, %zu chats checked (%s)\n", f->name,
		json_array_size(cases), json_array_size(json_object_get(doc, "chat")), path);

	/* the same vocabulary through tokenizer.json: the same ids */
	if (!f->json_pre)
		goto done;
	hf_config(t, doc, &cfg, &post);
	CHECK(!write_hf_dir(path, f, NULL, cfg, post, dir, sizeof(dir)), "%s: writing %s", f->name,
	      dir);
	json_decref(cfg);
	json_decref(post);
	ret = kd_tokenizer_open(&tj, dir);
	CHECK(!ret, "%s: open %s: %s", f->name, dir, kd_tokenizer_error());
	if (!ret) {
		/* tokenizer_config.json's template, BOS through the post-processor */
		check_chat(tj, f->name, doc);
		CHECK(kd_tokenizer_eos(tj) == kd_tokenizer_eos(t) && kd_tokenizer_eot(tj) ==
		      kd_tokenizer_eot(t), "%s: tokenizer.json eos/eot %d/%d, GGUF %d/%d", f->name,
		      kd_tokenizer_eos(tj), kd_tokenizer_eot(tj), kd_tokenizer_eos(t),
		      kd_tokenizer_eot(t));
		CHECK(tj->add_bos == t->add_bos && tj->bos == t->bos,
		      "%s: tokenizer.json BOS %d (%s), GGUF %d (%s)", f->name, tj->bos,
		      tj->add_bos ? "added" : "not added", t->bos, t->add_bos ? "added" : "not added");
		json_array_foreach(cases, i, c) {
			const char *text = json_string_value(json_object_get(c, "text"));
			static int32_t ids[MAX_IDS];
			long n;

			n = kd_tokenizer_encode(tj, text, strlen(text), KD_TOKENIZE_SPECIAL, ids, MAX_IDS);
			check_ids(f->name, "tokenizer.json", text, ids, n, json_object_get(c, "ids"));
		}
		kd_tokenizer_close(tj);
	}
	remove_hf_dir(dir);
done:
	kd_tokenizer_close(t);
	json_decref(doc);
	return 1;
}

/* A tokenizer.json whose pre_tokenizer is a sequence of Splits with a DeepSeek
 * family's patterns (HF's exact strings) is recognised as that family; SmolLM2's
 * vocabulary stands in for DeepSeek's. */
static void check_split_json(const char *name, const json_t *patterns, enum tok_pre want)
{
	json_t *pre = json_pack("{s:s, s:[]}", "type", "Sequence", "pretokenizers");
	json_t *steps = json_object_get(pre, "pretokenizers");
	char path[PATH_MAX], dir[PATH_MAX];
	struct kd_tokenizer *t;
	size_t i;
	json_t *p;

	cache_path(path, sizeof(path), &families[0]);
	if (access(path, R_OK)) {
		json_decref(pre);
		return;
	}
	json_array_foreach(patterns, i, p)
		json_array_append_new(steps, json_pack("{s:s, s:{s:O}, s:s, s:b}", "type", "Split",
						       "pattern", "Regex", p, "behavior", "Isolated",
						       "invert", 0));
	json_array_append_new(steps, json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel",
					       "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0));
	CHECK(!write_hf_dir(path, &families[0], pre, NULL, NULL, dir, sizeof(dir)), "%s: writing %s",
	      name, dir);
	CHECK(!kd_tokenizer_open(&t, dir) && t->pre == want,
	      "%s: tokenizer.json not recognised: %s", name, kd_tokenizer_error());
	kd_tokenizer_close(t);
	remove_hf_dir(dir);
}

/* tok_nfc against Python's unicodedata.normalize("NFC") on each [input, output] pair. */
static void check_nfc(const json_t *pairs)
{
	size_t i;
	json_t *p;

	CHECK(json_array_size(pairs) > 0, "splits.json has no nfc pairs");
	json_array_foreach(pairs, i, p) {
		const json_t *in = json_array_get(p, 0), *want = json_array_get(p, 1);
		const char *s = json_string_value(in);
		size_t len = json_string_length(in), out_len = len;
		char *out = NULL;

		CHECK(!tok_nfc(s, len, &out, &out_len), "nfc %zu: failed", i);
		if (!out)
			out_len = len;
		CHECK(out_len == json_string_length(want) &&
		      !memcmp(out ? out : s, json_string_value(want), out_len),
		      "nfc %zu: \"%.40s\" normalised differently from Python", i, s);
		free(out);
	}
}

struct split_acc {
	size_t lens[MAX_IDS];
	size_t n;
};

static int split_collect(void *ctx, size_t off, size_t n)
{
	struct split_acc *a = ctx;

	(void)off;
	if (a->n < MAX_IDS)
		a->lens[a->n] = n;
	a->n++;
	return 0;
}

/* The pre-tokenizers alone against HF's pre_tokenize_str (no vocabulary needed, so
 * this runs everywhere): the byte length of every piece of every corpus line. */
static void check_splits(const char *srcdir)
{
	static const struct { const char *name; enum tok_pre pre; } pres[] = {
		{ "smollm2", TOK_PRE_SMOLLM }, { "gpt2", TOK_PRE_GPT2 }, { "llama3", TOK_PRE_LLAMA3 },
		{ "qwen2", TOK_PRE_QWEN2 }, { "deepseek3", TOK_PRE_DEEPSEEK3 },
		{ "deepseek_llm", TOK_PRE_DEEPSEEK_LLM },
	};
	char fixture[PATH_MAX];
	json_error_t jerr;
	const json_t *corpus;
	json_t *doc;
	int lines = 0;

	snprintf(fixture, sizeof(fixture), "%s/tests/data/tokenizer/splits.json", srcdir);
	doc = json_load_file(fixture, 0, &jerr);
	CHECK(doc, "%s: %s", fixture, jerr.text);
	if (!doc)
		return;
	corpus = json_object_get(doc, "corpus");
	for (size_t p = 0; p < sizeof(pres) / sizeof(pres[0]); p++) {
		const json_t *rows = json_object_get(json_object_get(doc, "splits"), pres[p].name);
		size_t i;
		json_t *row;

		CHECK(json_array_size(rows) == json_array_size(corpus), "splits.json: %s", pres[p].name);
		json_array_foreach(rows, i, row) {
			const json_t *t = json_array_get(corpus, i);
			struct split_acc a = { .n = 0 };
			int same;

			tok_pretokenize(pres[p].pre, json_string_value(t), json_string_length(t),
					split_collect, &a);
			same = a.n == json_array_size(row);
			for (size_t k = 0; same && k < a.n; k++)
				same = (json_int_t)a.lens[k] == json_integer_value(json_array_get(row, k));
			CHECK(same, "%s pre-tokenizer: \"%.50s\": %zu pieces, HF %zu", pres[p].name,
			      json_string_value(t), a.n, json_array_size(row));
			lines++;
		}
	}
	fprintf(stderr, "pre-tokenizers: %d lines split as HF does (6 families)\n", lines);
	check_nfc(json_object_get(doc, "nfc"));
	json_decref(doc);
}

/* The DeepSeek split patterns through tokenizer.json (on SmolLM2's vocabulary). */
static void check_split_jsons(const char *srcdir)
{
	char fixture[PATH_MAX];
	json_error_t jerr;
	json_t *doc;

	snprintf(fixture, sizeof(fixture), "%s/tests/data/tokenizer/splits.json", srcdir);
	doc = json_load_file(fixture, 0, &jerr);
	CHECK(doc, "%s: %s", fixture, jerr.text);
	if (!doc)
		return;
	check_split_json("deepseek3", json_object_get(doc, "deepseek3_patterns"), TOK_PRE_DEEPSEEK3);
	check_split_json("deepseek_llm", json_object_get(doc, "deepseek_llm_patterns"),
			 TOK_PRE_DEEPSEEK_LLM);
	json_decref(doc);
}

/* Encode speed over a text of all corpus lines of one family, repeated. */
static void report_speed(const char *srcdir)
{
	char path[PATH_MAX], fixture[PATH_MAX];
	struct kd_tokenizer *t;
	json_t *doc, *c;
	char *text;
	size_t len = 0, i;
	double t0, dt;
	long n = 0;

	cache_path(path, sizeof(path), &families[0]);
	snprintf(fixture, sizeof(fixture), "%s/tests/data/tokenizer/smollm2.json", srcdir);
	if (kd_tokenizer_open(&t, path))
		return;
	doc = json_load_file(fixture, 0, NULL);
	text = malloc(1 << 22);
	while (doc && len < (1 << 22) - 4096) {
		json_array_foreach(json_object_get(doc, "cases"), i, c) {
			size_t l = json_string_length(json_object_get(c, "text"));

			if (len + l + 1 >= 1 << 22)
				break;
			memcpy(text + len, json_string_value(json_object_get(c, "text")), l);
			len += l;
			text[len++] = '\n';
		}
	}
	t0 = test_now_s();
	for (int r = 0; r < 3; r++)
		n = kd_tokenizer_encode(t, text, len, 0, NULL, 0);
	dt = (test_now_s() - t0) / 3;
	fprintf(stderr, "encode speed (smollm2, %.1f MB of corpus text): %.1f MB/s, %.2f M tokens/s\n",
		(double)len / 1e6, (double)len / 1e6 / dt, (double)n / 1e6 / dt);
	free(text);
	json_decref(doc);
	kd_tokenizer_close(t);
}

/* A chat renderer against transformers' texts of the family's template
 * (tests/data/tokenizer/<name>.json, contrib/make_chat_fixture.py) on the family's
 * vocabulary. */
static void check_chat_fixture(const char *srcdir, const char *name, const char *family)
{
	const struct family *f = NULL;
	char path[PATH_MAX], fixture[PATH_MAX];
	struct kd_tokenizer *t;
	json_error_t jerr;
	json_t *doc;

	for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++)
		if (!strcmp(families[i].name, family))
			f = &families[i];
	CHECK(f, "%s: no family %s", name, family);
	if (!f)
		return;
	cache_path(path, sizeof(path), f);
	if (access(path, R_OK)) {
		test_skip("%s: %s absent", name, path);
		return;
	}
	CHECK(kd_tokenizer_open(&t, path) == 0, "%s: %s: %s", name, path, kd_tokenizer_error());
	if (!t)
		return;
	snprintf(fixture, sizeof(fixture), "%s/tests/data/tokenizer/%s.json", srcdir, name);
	doc = json_load_file(fixture, 0, &jerr);
	CHECK(doc, "%s: %s", fixture, jerr.text);
	if (doc) {
		check_chat(t, name, doc);
		fprintf(stderr, "%s: %zu chats checked\n", name,
			json_array_size(json_object_get(doc, "chat")));
		json_decref(doc);
	}
	kd_tokenizer_close(t);
}

/* Llama 3.2's template dates its system block today: strftime_now("%d %b %Y"). */
static void check_llama32_date(void)
{
	static const char mon[12][4] = { "Jan", "Feb", "Mar", "Apr", "May", "Jun",
					 "Jul", "Aug", "Sep", "Oct", "Nov", "Dec" };
	static const char t32[] = "{{- bos_token }} ... strftime_now(\"%d %b %Y\") ... "
				  "<|start_header_id|>system ... Cutting Knowledge Date";
	const struct kd_chat_message m[] = { { .role = "user", .content = "when?" } };
	char path[PATH_MAX], want[64], buf[1024];
	struct kd_tokenizer *t;
	struct tm tm;
	time_t now;
	long n;

	cache_path(path, sizeof(path), &families[2]);	/* llama3 */
	if (access(path, R_OK) || kd_tokenizer_open(&t, path))
		return;
	tok_chat_detect(t, t32, sizeof(t32) - 1);
	n = kd_tokenizer_chat(t, m, 1, 1, buf, sizeof(buf));
	now = time(NULL);
	localtime_r(&now, &tm);
	snprintf(want, sizeof(want), "Today Date: %02d %s %04d\n\n", tm.tm_mday, mon[tm.tm_mon],
		 tm.tm_year + 1900);
	CHECK(n > 0 && strstr(buf, want), "llama3.2 chat: \"%s\" not in \"%s\"", want, buf);
	kd_tokenizer_close(t);
}

int main(int argc, char **argv)
{
	const char *srcdir = getenv("top_srcdir");
	struct kd_tokenizer *t;
	int n_fam = 0;

	if (!srcdir)
		srcdir = ".";
	if (argc < 2) {	/* the part that needs no vocabulary */
		/* errors are values with a message */
		CHECK(kd_tokenizer_open(&t, "/nonexistent/tok.gguf") == -ENOENT && !t, "missing file");
		CHECK(strstr(kd_tokenizer_error(), "/nonexistent/tok.gguf"), "message: %s",
		      kd_tokenizer_error());
		CHECK(kd_tokenizer_open(&t, "/etc/hostname") == -EINVAL, "not a tokenizer");
		check_splits(srcdir);
		return test_result("test_tokenizer");
	}
	if (strcmp(argv[1], "vocab")) {
		fprintf(stderr, "usage: test_tokenizer [vocab]\n");
		return 2;
	}
	check_split_jsons(srcdir);	/* first: run_family leaves the smollm2 directory */
	for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++)
		n_fam += run_family(&families[i], srcdir);
	check_chat_fixture(srcdir, "llama3_1_chat", "llama3");
	check_chat_fixture(srcdir, "deepseek2_chat", "deepseek_llm");
	check_llama32_date();
	fprintf(stderr, "%d families, %d corpus lines checked (%d that Qwen2's NFC changes)\n",
		n_fam, n_lines_checked, n_lines_normalized);
	if (seconds_encoding > 0)
		fprintf(stderr, "corpus lines: %.1f MB/s\n", bytes_encoded / 1e6 / seconds_encoding);
	if (n_fam)
		report_speed(srcdir);
	return test_result("test_tokenizer vocab");
}
