/* NFC, as Qwen2's tokenizer.json normaliser applies it before pre-tokenizing: full
 * canonical decomposition (Hangul by arithmetic), canonical reordering of combining
 * marks, then canonical composition, over the generator's tables. */
#include <errno.h>
#include <stdlib.h>

#include "client/tokenizer_unicode.h"

/* Hangul syllables: S = SBASE + (L * VCOUNT + V) * TCOUNT + T */
#define SBASE 0xac00u
#define LBASE 0x1100u
#define VBASE 0x1161u
#define TBASE 0x11a7u
#define LCOUNT 19u
#define VCOUNT 21u
#define TCOUNT 28u
#define SCOUNT (LCOUNT * VCOUNT * TCOUNT)

static unsigned ccc_of(uint32_t cp)
{
	return tok_cp_range_find(tok_ccc_ranges, tok_ccc_n_ranges, cp);
}

static const struct tok_nfd_entry *nfd_of(uint32_t cp)
{
	unsigned lo = 0, hi = tok_nfd_n;

	while (lo < hi) {
		unsigned mid = lo + (hi - lo) / 2;

		if (cp < tok_nfd[mid].cp)
			hi = mid;
		else if (cp > tok_nfd[mid].cp)
			lo = mid + 1;
		else
			return &tok_nfd[mid];
	}
	return NULL;
}

/* The primary composite of (a, b), or 0. */
static uint32_t compose(uint32_t a, uint32_t b)
{
	unsigned lo = 0, hi = tok_nfc_n_pairs;

	if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
		return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
	if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE &&
	    b < TBASE + TCOUNT)
		return a + (b - TBASE);
	while (lo < hi) {
		unsigned mid = lo + (hi - lo) / 2;
		const struct tok_nfc_pair *p = &tok_nfc_pairs[mid];

		if (a < p->first || (a == p->first && b < p->second))
			hi = mid;
		else if (a > p->first || b > p->second)
			lo = mid + 1;
		else
			return p->composite;
	}
	return 0;
}

/* Writes cp's full canonical decomposition to d (room: 4 code points per input byte
 * is plenty, a decomposition being at most 4 code points from at least 2 bytes). */
static size_t decompose(uint32_t cp, uint32_t *d)
{
	const struct tok_nfd_entry *e;

	if (cp >= SBASE && cp < SBASE + SCOUNT) {
		uint32_t s = cp - SBASE, t = s % TCOUNT;

		d[0] = LBASE + s / (VCOUNT * TCOUNT);
		d[1] = VBASE + s % (VCOUNT * TCOUNT) / TCOUNT;
		if (!t)
			return 2;
		d[2] = TBASE + t;
		return 3;
	}
	e = cp < TOK_CP_INVALID ? nfd_of(cp) : NULL;
	if (!e) {
		d[0] = cp;
		return 1;
	}
	for (uint32_t i = 0; i < e->len; i++)
		d[i] = tok_nfd_data[e->off + i];
	return e->len;
}

/* Stable insertion sort of each run of non-starters by combining class. */
static void reorder(uint32_t *d, size_t n)
{
	for (size_t i = 1; i < n; i++) {
		uint32_t x = d[i];
		unsigned c = ccc_of(x);
		size_t j = i;

		if (!c)
			continue;
		while (j > 0 && ccc_of(d[j - 1]) > c) {
			d[j] = d[j - 1];
			j--;
		}
		d[j] = x;
	}
}

/* Composes in place: a character joins the last starter unless something between
 * them blocks it (a starter, or a mark of the same or a higher class). */
static size_t recompose(uint32_t *d, size_t n)
{
	size_t k = 0, starter = 0;
	int have_starter = 0, last_ccc = -1;	/* -1: nothing since the starter */

	for (size_t i = 0; i < n; i++) {
		uint32_t x = d[i], comp;
		int c = (int)ccc_of(x);

		if (have_starter && (last_ccc == -1 || (last_ccc != 0 && last_ccc < c)) &&
		    (comp = compose(d[starter], x))) {
			d[starter] = comp;
			continue;
		}
		if (!c) {
			starter = k;
			have_starter = 1;
			last_ccc = -1;
		} else {
			last_ccc = c;
		}
		d[k++] = x;
	}
	return k;
}

int tok_nfc(const char *s, size_t len, char **out, size_t *out_len)
{
	const unsigned char *p = (const unsigned char *)s;
	uint32_t *d;
	size_t n = 0, k = 0, i;
	char *o;

	*out = NULL;
	for (i = 0; i < len && p[i] < 0xcc; i++)	/* U+0300 is 0xcc 0x80 */
		;
	if (i == len)
		return 0;
	d = malloc(sizeof(*d) * (len * 4 + 4));
	if (!d)
		return -ENOMEM;
	for (i = 0; i < len;) {
		uint32_t cp;

		i += (size_t)tok_utf8_decode(p + i, len - i, &cp);
		n += decompose(cp, d + n);
	}
	reorder(d, n);
	n = recompose(d, n);
	o = malloc(n * 4 + 1);
	if (!o) {
		free(d);
		return -ENOMEM;
	}
	for (i = 0; i < n; i++) {
		if (d[i] >= TOK_CP_INVALID)
			o[k++] = (char)(d[i] - TOK_CP_INVALID);
		else
			k += (size_t)tok_utf8_encode(d[i], o + k);
	}
	free(d);
	*out = o;
	*out_len = k;
	return 0;
}
