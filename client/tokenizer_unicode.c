/* UTF-8 decoding for the pre-tokenizers (total: every byte string decodes) and the
 * lookups over the generated range tables. */
#include "client/tokenizer_unicode.h"

int tok_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp)
{
	unsigned c = s[0], n;
	uint32_t v, min;

	if (c < 0x80) {
		*cp = c;
		return 1;
	}
	if (c >= 0xc2 && c <= 0xdf) {
		n = 2; v = c & 0x1f; min = 0x80;
	} else if (c >= 0xe0 && c <= 0xef) {
		n = 3; v = c & 0x0f; min = 0x800;
	} else if (c >= 0xf0 && c <= 0xf4) {
		n = 4; v = c & 0x07; min = 0x10000;
	} else {
		goto bad;
	}
	if (len < n)
		goto bad;
	for (unsigned i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			goto bad;
		v = v << 6 | (s[i] & 0x3f);
	}
	/* overlong forms, surrogates and values past U+10FFFF are not UTF-8 */
	if (v < min || (v >= 0xd800 && v <= 0xdfff) || v > 0x10ffff)
		goto bad;
	*cp = v;
	return (int)n;
bad:
	*cp = TOK_CP_INVALID + c;
	return 1;
}

unsigned tok_cp_range_find(const struct tok_cp_range *v, unsigned n, uint32_t cp)
{
	unsigned lo = 0, hi = n;

	while (lo < hi) {
		unsigned mid = lo + (hi - lo) / 2;

		if (cp < v[mid].first)
			hi = mid;
		else if (cp > v[mid].last)
			lo = mid + 1;
		else
			return v[mid].flags;
	}
	return 0;
}

unsigned tok_cp_flags(uint32_t cp)
{
	if (cp >= TOK_CP_INVALID)
		return 0;
	return tok_cp_range_find(tok_cp_ranges, tok_cp_n_ranges, cp);
}

int tok_utf8_encode(uint32_t cp, char *out)
{
	unsigned char *o = (unsigned char *)out;

	if (cp < 0x80) {
		o[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (unsigned char)(0xc0 | cp >> 6);
		o[1] = (unsigned char)(0x80 | (cp & 0x3f));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (unsigned char)(0xe0 | cp >> 12);
		o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
		o[2] = (unsigned char)(0x80 | (cp & 0x3f));
		return 3;
	}
	o[0] = (unsigned char)(0xf0 | cp >> 18);
	o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3f));
	o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
	o[3] = (unsigned char)(0x80 | (cp & 0x3f));
	return 4;
}
