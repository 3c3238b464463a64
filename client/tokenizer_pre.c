/* Pre-tokenizers: the regex each family splits text with, written as hand matchers
 * over code points (no regex library). At each position the alternatives are tried in
 * the pattern's order and the first that matches wins, as a backtracking regex engine
 * does; the comments give the alternative each block implements. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client/tokenizer.h"
#include "client/tokenizer_unicode.h"

struct cps {
	uint32_t *cp;		/* (n) code points (TOK_CP_INVALID + byte for a bad byte) */
	uint8_t *fl;		/* (n) TOK_CP_* flags */
	uint32_t *off;		/* (n + 1) byte offset of each; off[n] = text length */
	size_t n;
};

static int is_l(const struct cps *c, size_t i) { return c->fl[i] & TOK_CP_LETTER; }
static int is_n(const struct cps *c, size_t i) { return c->fl[i] & TOK_CP_NUMBER; }
static int is_s(const struct cps *c, size_t i) { return c->fl[i] & TOK_CP_SPACE; }
static int is_nl(const struct cps *c, size_t i) { return c->cp[i] == '\r' || c->cp[i] == '\n'; }
/* [^\s\p{L}\p{N}] */
static int is_other(const struct cps *c, size_t i)
{
	return !(c->fl[i] & (TOK_CP_SPACE | TOK_CP_LETTER | TOK_CP_NUMBER));
}

static uint32_t lower_ascii(uint32_t cp)
{
	return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}

/* 's|'t|'re|'ve|'m|'ll|'d, case-insensitively for the (?i:...) families: the match
 * length or 0. */
static size_t contraction(const struct cps *c, size_t i, size_t end, int icase)
{
	uint32_t a, b;

	if (c->cp[i] != '\'' || i + 1 >= end)
		return 0;
	a = icase ? lower_ascii(c->cp[i + 1]) : c->cp[i + 1];
	if (a == 's' || a == 't' || a == 'm' || a == 'd')
		return 2;
	if (i + 2 >= end)
		return 0;
	b = icase ? lower_ascii(c->cp[i + 2]) : c->cp[i + 2];
	if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
		return 3;
	return 0;
}

static size_t run(const struct cps *c, size_t i, size_t end, int (*cls)(const struct cps *, size_t))
{
	while (i < end && cls(c, i))
		i++;
	return i;
}

/* \s+(?!\S)|\s+ at a white-space position: a run that reaches the end is taken whole;
 * otherwise it stops one short, leaving the last space to the next token ("  a" ->
 * " ", " a"), unless that would leave it empty. */
static size_t spaces(const struct cps *c, size_t i, size_t end)
{
	size_t j = run(c, i, end, is_s);

	if (j == end || j - i == 1)
		return j;
	return j - 1;
}

/* ` ?X+`: the end of the match at i, or i. */
static size_t opt_space_run(const struct cps *c, size_t i, size_t end,
			    int (*cls)(const struct cps *, size_t))
{
	if (c->cp[i] == ' ' && i + 1 < end && cls(c, i + 1))
		return run(c, i + 1, end, cls);
	return cls(c, i) ? run(c, i, end, cls) : i;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t match_gpt2(const struct cps *c, size_t i, size_t end)
{
	size_t j = contraction(c, i, end, 0);

	if (j)
		return i + j;
	if ((j = opt_space_run(c, i, end, is_l)) > i)
		return j;
	if ((j = opt_space_run(c, i, end, is_n)) > i)
		return j;
	if ((j = opt_space_run(c, i, end, is_other)) > i)
		return j;
	return spaces(c, i, end);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
 * ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t match_llama3(const struct cps *c, size_t i, size_t end, size_t max_digits)
{
	size_t j = contraction(c, i, end, 1);

	if (j)
		return i + j;
	if (!is_nl(c, i) && !is_l(c, i) && !is_n(c, i) && i + 1 < end && is_l(c, i + 1))
		return run(c, i + 1, end, is_l);
	if (is_l(c, i))
		return run(c, i, end, is_l);
	if (is_n(c, i)) {
		for (j = i; j < end && j - i < max_digits && is_n(c, j); j++)
			;
		return j;
	}
	if ((j = opt_space_run(c, i, end, is_other)) > i)
		return run(c, j, end, is_nl);
	/* \s*[\r\n]+: through the last line break of the white-space run */
	j = run(c, i, end, is_s);
	for (size_t k = j; k > i; k--)
		if (is_nl(c, k - 1))
			return k;
	return spaces(c, i, end);
}

static int is_ascii_letter(const struct cps *c, size_t i)
{
	return (c->cp[i] | 32) >= 'a' && (c->cp[i] | 32) <= 'z';
}

static int is_ascii_punct(uint32_t cp)
{
	return (cp >= '!' && cp <= '/') || (cp >= ':' && cp <= '@') || (cp >= '[' && cp <= '`') ||
	       (cp >= '{' && cp <= '~');
}

static int is_lm(const struct cps *c, size_t i) { return c->fl[i] & (TOK_CP_LETTER | TOK_CP_MARK); }
static int is_ps(const struct cps *c, size_t i) { return c->fl[i] & (TOK_CP_PUNCT | TOK_CP_SYMBOL); }

/* DeepSeek V3's third split:
 * [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *  ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * The end of the match at i, or i where nothing matches (a lone digit). */
static size_t match_deepseek3(const struct cps *c, size_t i, size_t end)
{
	size_t j;

	if (is_ascii_punct(c->cp[i]) && i + 1 < end && is_ascii_letter(c, i + 1))
		return run(c, i + 1, end, is_ascii_letter);
	if (!is_nl(c, i) && !is_l(c, i) && !is_ps(c, i) && i + 1 < end && is_lm(c, i + 1))
		return run(c, i + 1, end, is_lm);
	if (is_lm(c, i))
		return run(c, i, end, is_lm);
	if ((j = opt_space_run(c, i, end, is_ps)) > i)
		return run(c, j, end, is_nl);
	if (!is_s(c, i))
		return i;
	j = run(c, i, end, is_s);
	for (size_t k = j; k > i; k--)
		if (is_nl(c, k - 1))
			return k;
	return spaces(c, i, end);
}

static size_t match_one(enum tok_pre pre, const struct cps *c, size_t i, size_t end)
{
	switch (pre) {
	case TOK_PRE_DEEPSEEK3: return match_deepseek3(c, i, end);
	case TOK_PRE_LLAMA3: return match_llama3(c, i, end, 3);
	case TOK_PRE_QWEN2: return match_llama3(c, i, end, 1);
	case TOK_PRE_GPT2:
	case TOK_PRE_SMOLLM:
	default: return match_gpt2(c, i, end);
	}
}

/* Splits code points [i, end) with the family's matcher. */
/* Splits code points [i, end) with the family's matcher, as HF's Split with behaviour
 * Isolated does: each match is a piece, and so is each stretch between matches. */
static int split_range(enum tok_pre pre, const struct cps *c, size_t i, size_t end,
		       int (*emit)(void *, size_t, size_t), void *ctx)
{
	size_t gap = i;
	int ret = 0;

	while (i < end && !ret) {
		size_t j = match_one(pre, c, i, end);

		if (j <= i) {
			i++;
			continue;
		}
		if (gap < i)
			ret = emit(ctx, c->off[gap], c->off[i] - c->off[gap]);
		if (!ret)
			ret = emit(ctx, c->off[i], c->off[j] - c->off[i]);
		i = gap = j;
	}
	if (!ret && gap < end)
		ret = emit(ctx, c->off[gap], c->off[end] - c->off[gap]);
	return ret;
}

/* [一-龥぀-ゟ゠-ヿ]: CJK ideographs U+4E00..9FA5, hiragana, katakana */
static int is_deepseek_cjk(const struct cps *c, size_t i)
{
	uint32_t cp = c->cp[i];

	return (cp >= 0x4e00 && cp <= 0x9fa5) || (cp >= 0x3040 && cp <= 0x30ff);
}

/* DeepSeek V3: three Isolated splits in turn: \p{N}{1,3}, then [一-龥぀-ゟ゠-ヿ]+ in the
 * stretches between numbers, then match_deepseek3 in what is left. */
static int split_deepseek3_cjk(const struct cps *c, size_t i, size_t end,
			       int (*emit)(void *, size_t, size_t), void *ctx)
{
	int ret = 0;

	while (i < end && !ret) {
		size_t j = i;

		if (is_deepseek_cjk(c, i)) {
			j = run(c, i, end, is_deepseek_cjk);
			ret = emit(ctx, c->off[i], c->off[j] - c->off[i]);
		} else {
			while (j < end && !is_deepseek_cjk(c, j))
				j++;
			ret = split_range(TOK_PRE_DEEPSEEK3, c, i, j, emit, ctx);
		}
		i = j;
	}
	return ret;
}

static int split_deepseek3(const struct cps *c, int (*emit)(void *, size_t, size_t), void *ctx)
{
	int ret = 0;

	for (size_t i = 0; i < c->n && !ret;) {
		size_t j = i;

		if (is_n(c, i)) {
			while (j < c->n && j - i < 3 && is_n(c, j))
				j++;
			ret = emit(ctx, c->off[i], c->off[j] - c->off[i]);
		} else {
			while (j < c->n && !is_n(c, j))
				j++;
			ret = split_deepseek3_cjk(c, i, j, emit, ctx);
		}
		i = j;
	}
	return ret;
}

/* DeepSeek LLM (V2): six Isolated splits, each applied to every piece the previous
 * ones made. A step's matcher gives the end of its match at i, or i. */
static int is_ds_letter(const struct cps *c, size_t i) { return c->fl[i] & TOK_CP_DS_LETTER; }

/* [!-/:-~！-／：-～‘-‟　-。] */
static int is_ds_punct(const struct cps *c, size_t i)
{
	uint32_t cp = c->cp[i];

	return (cp >= 0x21 && cp <= 0x2f) || (cp >= 0x3a && cp <= 0x7e) ||
	       (cp >= 0xff01 && cp <= 0xff0f) || (cp >= 0xff1a && cp <= 0xff5e) ||
	       (cp >= 0x2018 && cp <= 0x201f) || (cp >= 0x3000 && cp <= 0x3002);
}

/* [一-龥ࠀ-一가-퟿] */
static int is_ds_cjk(const struct cps *c, size_t i)
{
	uint32_t cp = c->cp[i];

	return (cp >= 0x0800 && cp <= 0x9fa5) || (cp >= 0xac00 && cp <= 0xd7ff);
}

/* \s?X+ */
static size_t opt_ws_run(const struct cps *c, size_t i, size_t end,
			 int (*cls)(const struct cps *, size_t))
{
	if (is_s(c, i) && i + 1 < end && cls(c, i + 1))
		return run(c, i + 1, end, cls);
	return cls(c, i) ? run(c, i, end, cls) : i;
}

static size_t ds_newline(const struct cps *c, size_t i, size_t end)
{
	(void)end;
	return is_nl(c, i) ? i + 1 : i;
}

static size_t ds_letters(const struct cps *c, size_t i, size_t end)
{
	return opt_ws_run(c, i, end, is_ds_letter);
}

static size_t ds_punct(const struct cps *c, size_t i, size_t end)
{
	return opt_ws_run(c, i, end, is_ds_punct);
}

static size_t ds_trailing_space(const struct cps *c, size_t i, size_t end)
{
	return is_s(c, i) && run(c, i, end, is_s) == end ? end : i;
}

static size_t ds_cjk(const struct cps *c, size_t i, size_t end)
{
	return run(c, i, end, is_ds_cjk);
}

static size_t ds_numbers(const struct cps *c, size_t i, size_t end)
{
	return run(c, i, end, is_n);
}

typedef size_t (*split_step_fn)(const struct cps *c, size_t i, size_t end);

static const split_step_fn deepseek_llm_steps[] = {
	ds_newline, ds_letters, ds_punct, ds_trailing_space, ds_cjk, ds_numbers,
};

static int split_steps(const split_step_fn *steps, size_t n_steps, const struct cps *c,
		       size_t i, size_t end, int (*emit)(void *, size_t, size_t), void *ctx)
{
	size_t gap = i;
	int ret = 0;

	if (!n_steps)
		return i < end ? emit(ctx, c->off[i], c->off[end] - c->off[i]) : 0;
	while (i < end && !ret) {
		size_t j = steps[0](c, i, end);

		if (j <= i) {
			i++;
			continue;
		}
		ret = split_steps(steps + 1, n_steps - 1, c, gap, i, emit, ctx);
		if (!ret)
			ret = split_steps(steps + 1, n_steps - 1, c, i, j, emit, ctx);
		i = gap = j;
	}
	return ret ? ret : split_steps(steps + 1, n_steps - 1, c, gap, end, emit, ctx);
}

int tok_pretokenize(enum tok_pre pre, const char *text, size_t len,
		    int (*emit)(void *ctx, size_t off, size_t n), void *ctx)
{
	const unsigned char *s = (const unsigned char *)text;
	struct cps c = { 0 };
	int ret = 0;

	c.cp = malloc(sizeof(*c.cp) * (len + 1));
	c.fl = malloc(len + 1);
	c.off = malloc(sizeof(*c.off) * (len + 1));
	if (!c.cp || !c.fl || !c.off) {
		ret = -ENOMEM;
		goto out;
	}
	for (size_t b = 0; b < len; c.n++) {
		int k = tok_utf8_decode(s + b, len - b, &c.cp[c.n]);

		c.fl[c.n] = (uint8_t)tok_cp_flags(c.cp[c.n]);
		c.off[c.n] = (uint32_t)b;
		b += (size_t)k;
	}
	c.off[c.n] = (uint32_t)len;
	if (pre == TOK_PRE_DEEPSEEK_LLM) {
		ret = split_steps(deepseek_llm_steps, sizeof(deepseek_llm_steps) /
				  sizeof(deepseek_llm_steps[0]), &c, 0, c.n, emit, ctx);
		goto out;
	}
	if (pre == TOK_PRE_DEEPSEEK3) {
		ret = split_deepseek3(&c, emit, ctx);
		goto out;
	}
	if (pre != TOK_PRE_SMOLLM) {
		ret = split_range(pre, &c, 0, c.n, emit, ctx);
		goto out;
	}
	/* SmolLM2: every \p{N} is a piece of its own first (HF's Digits with
	 * individual_digits), then GPT-2's pattern runs inside the stretches between. */
	for (size_t i = 0; i < c.n && !ret;) {
		size_t j = i;

		if (is_n(&c, i)) {
			ret = emit(ctx, c.off[i], c.off[i + 1] - c.off[i]);
			i++;
			continue;
		}
		while (j < c.n && !is_n(&c, j))
			j++;
		ret = split_range(TOK_PRE_GPT2, &c, i, j, emit, ctx);
		i = j;
	}
out:
	free(c.cp);
	free(c.fl);
	free(c.off);
	return ret;
}

int tok_pre_from_name(const char *name, enum tok_pre *out, int *ignore_merges)
{
	static const struct { const char *name; enum tok_pre pre; int ignore_merges; } known[] = {
		{ "default", TOK_PRE_GPT2, 0 }, { "gpt2", TOK_PRE_GPT2, 0 },
		{ "gpt-2", TOK_PRE_GPT2, 0 }, { "smollm", TOK_PRE_SMOLLM, 0 },
		{ "llama-bpe", TOK_PRE_LLAMA3, 1 }, { "llama3", TOK_PRE_LLAMA3, 1 },
		{ "qwen2", TOK_PRE_QWEN2, 0 }, { "deepseek-v3", TOK_PRE_DEEPSEEK3, 0 },
		{ "deepseek-llm", TOK_PRE_DEEPSEEK_LLM, 0 },
	};

	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
		if (!strcmp(name, known[i].name)) {
			*out = known[i].pre;
			*ignore_merges = known[i].ignore_merges;
			return 0;
		}
	}
	return -ENOTSUP;
}
