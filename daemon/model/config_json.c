/* Checked readers of JSON config values: each getter checks type, range and the
 * agreement of two spellings of one key, and fails with one line naming the key. */
#include "daemon/model/config_json.h"
#include "format/file_read.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include <jansson.h>

int cfg_fail(struct cfg_parse *p, int rc, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	rc = file_vfail(p->err, p->err_len, rc, p->source, fmt, ap);
	va_end(ap);
	return rc;
}

/* A short rendering of a JSON value for messages. */
const char *cfg_show(const json_t *v, char *buf, size_t n)
{
	switch (json_typeof(v)) {
	case JSON_INTEGER:
		snprintf(buf, n, "%lld", (long long)json_integer_value(v));
		break;
	case JSON_REAL:
		snprintf(buf, n, "%g", json_real_value(v));
		break;
	case JSON_STRING:
		snprintf(buf, n, "'%.40s'", json_string_value(v));
		break;
	case JSON_TRUE:
		snprintf(buf, n, "true");
		break;
	case JSON_FALSE:
		snprintf(buf, n, "false");
		break;
	case JSON_OBJECT:
		snprintf(buf, n, "an object");
		break;
	case JSON_ARRAY:
		snprintf(buf, n, "an array");
		break;
	default:
		snprintf(buf, n, "null");
		break;
	}
	return buf;
}

/* NULL when the key is absent or JSON null: both mean "use the default". */
json_t *cfg_obj_get(const json_t *obj, const char *key)
{
	json_t *v = obj ? json_object_get(obj, key) : NULL;

	return json_is_null(v) ? NULL : v;
}

/* 8 and 8.0 say the same thing. */
int cfg_values_equal(const json_t *a, const json_t *b)
{
	if (json_is_number(a) && json_is_number(b))
		return json_number_value(a) == json_number_value(b);
	return json_equal((json_t *)a, (json_t *)b);
}

/* The value of key or of its alias (may be NULL); *v is NULL if neither is set.
 * Returns 0, or -EINVAL when two spellings disagree. */
static int cfg_get(struct cfg_parse *p, const json_t *obj, const char *key,
		   const char *alias, json_t **v, const char **used)
{
	json_t *a = cfg_obj_get(obj, key);
	json_t *b = alias ? cfg_obj_get(obj, alias) : NULL;
	char sa[64], sb[64];

	*v = NULL;
	*used = key;
	if (a && b && !cfg_values_equal(a, b))
		return cfg_fail(p, -EINVAL, "%s%s and %s%s are contradictory (%s vs %s)",
				p->prefix, key, p->prefix, alias, cfg_show(a, sa, sizeof(sa)),
				cfg_show(b, sb, sizeof(sb)));
	*v = a ? a : b;
	if (!a && b)
		*used = alias;
	return 0;
}

/* Integer key in [lo, hi]. Returns 0 (set), 1 (absent, *out untouched) or -errno.
 * A real with an integral value (4096.0) is accepted. */
int cfg_int(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    long long lo, long long hi, int *out)
{
	const char *name;
	char s[64];
	json_t *v;
	double d;
	long long x;
	int rc;

	rc = cfg_get(p, obj, key, alias, &v, &name);
	if (rc || !v)
		return rc ? rc : 1;
	if (json_is_integer(v)) {
		x = json_integer_value(v);
	} else if (json_is_real(v)) {
		d = json_real_value(v);
		if (!isfinite(d) || d != floor(d) || fabs(d) > 9e15)
			return cfg_fail(p, -EINVAL, "%s%s: %s is not an integer", p->prefix,
					name, cfg_show(v, s, sizeof(s)));
		x = (long long)d;
	} else {
		return cfg_fail(p, -EINVAL, "%s%s: expected an integer, got %s", p->prefix,
				name, cfg_show(v, s, sizeof(s)));
	}
	if (x < lo || x > hi)
		return cfg_fail(p, -EINVAL, "%s%s: %lld is out of range [%lld, %lld]",
				p->prefix, name, x, lo, hi);
	*out = (int)x;
	return 0;
}

/* Number key in [lo, hi]. Returns 0 (set), 1 (absent) or -errno. */
int cfg_num(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    double lo, double hi, double *out)
{
	const char *name;
	char s[64];
	json_t *v;
	double d;
	int rc;

	rc = cfg_get(p, obj, key, alias, &v, &name);
	if (rc || !v)
		return rc ? rc : 1;
	if (!json_is_number(v))
		return cfg_fail(p, -EINVAL, "%s%s: expected a number, got %s", p->prefix, name,
				cfg_show(v, s, sizeof(s)));
	d = json_number_value(v);
	if (!isfinite(d) || d < lo || d > hi)
		return cfg_fail(p, -EINVAL, "%s%s: %g is out of range [%g, %g]", p->prefix,
				name, d, lo, hi);
	*out = d;
	return 0;
}

/* rc of a getter, with "absent" (1) made the error that names the key. */
static int cfg_required(struct cfg_parse *p, int rc, const char *key, const char *why)
{
	if (rc == 1)
		return cfg_fail(p, -EINVAL, "%s%s: required%s%s but missing", p->prefix, key,
				why ? " " : "", why ? why : "");
	return rc;
}

int cfg_req_int(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
		long long lo, long long hi, int *out, const char *why)
{
	return cfg_required(p, cfg_int(p, obj, key, alias, lo, hi, out), key, why);
}

int cfg_req_num(struct cfg_parse *p, const json_t *obj, const char *key, double lo,
		double hi, double *out, const char *why)
{
	return cfg_required(p, cfg_num(p, obj, key, NULL, lo, hi, out), key, why);
}

/* Boolean key; absent leaves *out untouched. Returns 0 or -errno. */
int cfg_bool(struct cfg_parse *p, const json_t *obj, const char *key, int *out)
{
	const char *name;
	char s[64];
	json_t *v;
	int rc;

	rc = cfg_get(p, obj, key, NULL, &v, &name);
	if (rc || !v)
		return rc;
	if (!json_is_boolean(v))
		return cfg_fail(p, -EINVAL, "%s%s: expected true or false, got %s", p->prefix,
				name, cfg_show(v, s, sizeof(s)));
	*out = json_is_true(v);
	return 0;
}

/* String key (or alias); *out NULL when absent. */
int cfg_str(struct cfg_parse *p, const json_t *obj, const char *key, const char *alias,
	    const char **out)
{
	const char *name;
	char s[64];
	json_t *v;
	int rc;

	*out = NULL;
	rc = cfg_get(p, obj, key, alias, &v, &name);
	if (rc || !v)
		return rc;
	if (!json_is_string(v))
		return cfg_fail(p, -EINVAL, "%s%s: expected a string, got %s", p->prefix, name,
				cfg_show(v, s, sizeof(s)));
	*out = json_string_value(v);
	return 0;
}
