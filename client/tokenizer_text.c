/* Text output for the chat renderers: a buffer that counts what did not fit, Python's
 * str.strip(), and JSON written as transformers' tojson filter (Python's json.dumps,
 * ensure_ascii=False) writes it, so templates that embed tool schemas match byte for byte. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/tokenizer.h"

void tok_put(struct tok_out *o, const char *s, size_t n)
{
	if (o->k < o->len)
		memcpy(o->buf + o->k, s, o->len - o->k < n ? o->len - o->k : n);
	o->k += n;
}

void tok_puts(struct tok_out *o, const char *s)
{
	tok_put(o, s, strlen(s));
}

/* Jinja's trim (Python's str.strip): leading and trailing white space. */
int tok_is_py_space(unsigned char c)
{
	return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

void tok_put_trimmed(struct tok_out *o, const char *s)
{
	size_t n = strlen(s);

	while (n && tok_is_py_space((unsigned char)*s)) {
		s++;
		n--;
	}
	while (n && tok_is_py_space((unsigned char)s[n - 1]))
		n--;
	tok_put(o, s, n);
}

void tok_put_token(struct tok_out *o, const struct kd_tokenizer *t, int32_t id)
{
	if (id >= 0)
		tok_put(o, t->strings + t->tokens[id].text_off, t->tokens[id].text_len);
}

/* Quotes, backslashes and control characters escaped, the rest (DEL and non-ASCII
 * included) as is. */
void tok_put_json_string(struct tok_out *o, const char *s, size_t n)
{
	static const char hex[] = "0123456789abcdef";

	tok_puts(o, "\"");
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		char esc[7] = { '\\', 0 };

		switch (c) {
		case '"': esc[1] = '"'; break;
		case '\\': esc[1] = '\\'; break;
		case '\n': esc[1] = 'n'; break;
		case '\r': esc[1] = 'r'; break;
		case '\t': esc[1] = 't'; break;
		case '\b': esc[1] = 'b'; break;
		case '\f': esc[1] = 'f'; break;
		default:
			if (c >= 0x20) {
				tok_put(o, s + i, 1);
				continue;
			}
			memcpy(esc + 1, "u00", 3);
			esc[4] = hex[c >> 4];
			esc[5] = hex[c & 15];
		}
		tok_puts(o, esc);
	}
	tok_puts(o, "\"");
}

/* Python's repr(float): the shortest digits that read back to d, fixed notation for
 * decimal exponents -4..15 (with ".0" when whole), else d.ddde+XX. */
static void put_py_float(struct tok_out *o, double d)
{
	char e[40], digits[20], out[64];
	int p, exp, nd = 0, k = 0;
	const char *c;

	if (d != d || d - d != 0) {	/* jansson holds no NaN or infinity; be total */
		tok_puts(o, d != d ? "NaN" : d < 0 ? "-Infinity" : "Infinity");
		return;
	}
	for (p = 1; p <= 17; p++) {
		snprintf(e, sizeof(e), "%.*e", p - 1, d);
		if (strtod(e, NULL) == d)
			break;
	}
	c = e;
	if (*c == '-')
		out[k++] = *c++;
	for (; *c && *c != 'e'; c++)
		if (*c != '.')
			digits[nd++] = *c;
	exp = atoi(c + 1);
	while (nd > 1 && digits[nd - 1] == '0')
		nd--;
	if (exp >= -4 && exp < 16) {
		if (exp < 0) {
			k += snprintf(out + k, sizeof(out) - k, "0.");
			for (int i = -1; i > exp; i--)
				out[k++] = '0';
			memcpy(out + k, digits, nd);
			k += nd;
		} else {
			for (int i = 0; i <= exp; i++)
				out[k++] = i < nd ? digits[i] : '0';
			out[k++] = '.';
			if (nd > exp + 1) {
				memcpy(out + k, digits + exp + 1, nd - exp - 1);
				k += nd - exp - 1;
			} else {
				out[k++] = '0';
			}
		}
		out[k] = 0;
	} else {
		out[k++] = digits[0];
		if (nd > 1) {
			out[k++] = '.';
			memcpy(out + k, digits + 1, nd - 1);
			k += nd - 1;
		}
		snprintf(out + k, sizeof(out) - k, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
	}
	tok_puts(o, out);
}

static void put_newline_indent(struct tok_out *o, int indent, int depth)
{
	tok_puts(o, "\n");
	for (int i = 0; i < indent * depth; i++)
		tok_puts(o, " ");
}

/* json.dumps: with indent, items on their own lines and "," between; without, ", ".
 * Empty containers stay "[]" and "{}" either way. */
static void put_value(struct tok_out *o, const json_t *v, int indent, int depth)
{
	char num[32];

	switch (json_typeof(v)) {
	case JSON_OBJECT: {
		const char *key;
		json_t *val;
		int first = 1;

		if (!json_object_size(v)) {
			tok_puts(o, "{}");
			return;
		}
		tok_puts(o, "{");
		json_object_foreach((json_t *)v, key, val) {
			if (!first)
				tok_puts(o, indent < 0 ? ", " : ",");
			first = 0;
			if (indent >= 0)
				put_newline_indent(o, indent, depth + 1);
			tok_put_json_string(o, key, strlen(key));
			tok_puts(o, ": ");
			put_value(o, val, indent, depth + 1);
		}
		if (indent >= 0)
			put_newline_indent(o, indent, depth);
		tok_puts(o, "}");
		return;
	}
	case JSON_ARRAY: {
		size_t i;
		json_t *val;

		if (!json_array_size(v)) {
			tok_puts(o, "[]");
			return;
		}
		tok_puts(o, "[");
		json_array_foreach((json_t *)v, i, val) {
			if (i)
				tok_puts(o, indent < 0 ? ", " : ",");
			if (indent >= 0)
				put_newline_indent(o, indent, depth + 1);
			put_value(o, val, indent, depth + 1);
		}
		if (indent >= 0)
			put_newline_indent(o, indent, depth);
		tok_puts(o, "]");
		return;
	}
	case JSON_STRING:
		tok_put_json_string(o, json_string_value(v), json_string_length(v));
		return;
	case JSON_INTEGER:
		snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(v));
		tok_puts(o, num);
		return;
	case JSON_REAL:
		put_py_float(o, json_real_value(v));
		return;
	case JSON_TRUE:
		tok_puts(o, "true");
		return;
	case JSON_FALSE:
		tok_puts(o, "false");
		return;
	default:
		tok_puts(o, "null");
	}
}

void tok_put_pyjson(struct tok_out *o, const struct json_t *v, int indent)
{
	put_value(o, v, indent, 0);
}
