/* Checked readers of JSON config values (jansson): typed getters with ranges and
 * alias spellings, each error one line naming the source and the key. */
#ifndef KD_DAEMON_MODEL_CONFIG_JSON_H
#define KD_DAEMON_MODEL_CONFIG_JSON_H

#include <stddef.h>

#include <jansson.h>

/* One parse: where its messages go and how they name the key. */
struct cfg_parse {
	char *err;		/* one line, err_len bytes; may be NULL */
	size_t err_len;
	const char *source;	/* before every message: "config.json" */
	const char *prefix;	/* before every key: "" at top level, "rope_scaling." inside */
};

/* Writes "SOURCE: <message>" (one line) to p->err; returns rc. */
int cfg_fail(struct cfg_parse *p, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* A short rendering of a JSON value for messages, into buf (n bytes); returns buf. */
const char *cfg_show(const json_t *v, char *buf, size_t n);
/* obj[key]; NULL when obj is NULL, or the key is absent or JSON null. */
json_t *cfg_obj_get(const json_t *obj, const char *key);
/* Whether two values say the same thing (8 and 8.0 do). */
int cfg_values_equal(const json_t *a, const json_t *b);

/* The getters read obj[key], or obj[alias] (alias may be NULL; both set and unequal
 * is an error). Absent and null both mean "keep the default".
 * cfg_int and cfg_num: a value in [lo, hi]; 0 (set), 1 (absent, *out untouched) or
 * -errno. cfg_int takes a real with an integral value (4096.0) too.
 * cfg_req_int and cfg_req_num: the same, but absent is the error "KEY: required WHY
 * but missing" (why, e.g. "for MLA", may be NULL); 0 or -errno.
 * cfg_bool: absent leaves *out untouched; 0 or -errno.
 * cfg_str: *out NULL when absent, else the string inside obj; 0 or -errno. */
int cfg_int(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    long long lo, long long hi, int *out);
int cfg_req_int(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
		long long lo, long long hi, int *out, const char *why);
int cfg_num(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    double lo, double hi, double *out);
int cfg_req_num(struct cfg_parse *p, const json_t *obj, const char *key, double lo,
		double hi, double *out, const char *why);
int cfg_bool(struct cfg_parse *p, const json_t *obj, const char *key, int *out);
int cfg_str(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    const char **out);

#endif
