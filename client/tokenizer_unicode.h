/* Unicode for the tokenizer: UTF-8 decoding that never fails (a bad byte is its own
 * "code point") and the classes the pre-tokenizer patterns test (\p{L}, \p{N}, ...). */
#ifndef KD_CLIENT_TOKENIZER_UNICODE_H
#define KD_CLIENT_TOKENIZER_UNICODE_H

#include <stddef.h>
#include <stdint.h>

/* Class flags of a code point (contrib/gen_unicode_tables.py writes the same numbers). */
#define TOK_CP_LETTER 1		/* \p{L} */
#define TOK_CP_NUMBER 2		/* \p{N} */
#define TOK_CP_MARK 4		/* \p{M} */
#define TOK_CP_PUNCT 8		/* \p{P} */
#define TOK_CP_SYMBOL 16	/* \p{S} */
#define TOK_CP_SPACE 32		/* \s: the White_Space property */
#define TOK_CP_DS_LETTER 64	/* DeepSeek LLM's letter class (its own list of ranges) */

struct tok_cp_range {
	uint32_t first, last;	/* code points, inclusive */
	uint8_t flags;		/* TOK_CP_* */
};

extern const struct tok_cp_range tok_cp_ranges[];	/* (tok_cp_n_ranges) sorted, disjoint */
extern const unsigned tok_cp_n_ranges;
extern const char tok_unicode_version[];

/* A byte that is not part of a valid UTF-8 sequence decodes as this "code point" plus
 * the byte: no class, so it goes with punctuation-like runs, and never merges with
 * the next byte. */
#define TOK_CP_INVALID 0x110000u

/* NFC data (the generator's): canonical combining classes as ranges (flags = class),
 * full canonical decompositions (Hangul syllables excluded), primary composites. */
struct tok_nfd_entry {
	uint32_t cp;
	uint32_t off, len;	/* code points in tok_nfd_data */
};

struct tok_nfc_pair {
	uint32_t first, second, composite;
};

extern const struct tok_cp_range tok_ccc_ranges[];	/* (tok_ccc_n_ranges) sorted */
extern const unsigned tok_ccc_n_ranges;
extern const uint32_t tok_nfd_data[];
extern const struct tok_nfd_entry tok_nfd[];		/* (tok_nfd_n) by cp */
extern const unsigned tok_nfd_n;
extern const struct tok_nfc_pair tok_nfc_pairs[];	/* (tok_nfc_n_pairs) by (first, second) */
extern const unsigned tok_nfc_n_pairs;

/* s[0..len) in Unicode Normalization Form C. 0 with *out NULL when s is already NFC
 * as far as a quick check tells (every code point below U+0300), else 0 with *out a
 * malloc'd string of *out_len bytes (the caller frees), or -ENOMEM. Bytes that are
 * not UTF-8 pass through unchanged. */
int tok_nfc(const char *s, size_t len, char **out, size_t *out_len);

/* Decodes the code point at s[0..len) (len >= 1): returns its byte length (1..4) and
 * stores the code point, or TOK_CP_INVALID + byte for an invalid or cut sequence. */
int tok_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp);

/* The TOK_CP_* flags of cp (0 for TOK_CP_INVALID + x and unassigned code points). */
unsigned tok_cp_flags(uint32_t cp);

/* The flags of the range of v[0..n) (sorted, disjoint) that holds cp; 0 if none does. */
unsigned tok_cp_range_find(const struct tok_cp_range *v, unsigned n, uint32_t cp);

/* Writes cp (< 0x110000) as UTF-8 into out[4]; returns the byte count. */
int tok_utf8_encode(uint32_t cp, char *out);

#endif
