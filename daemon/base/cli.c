/* Strict parsing of numbers and token lists given on command lines. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/cli.h"

int cli_parse_long(const char *s, long min, long max, long *out)
{
	char *end;
	long v;

	if (!s || !*s)
		return -EINVAL;
	errno = 0;
	v = strtol(s, &end, 10);
	if (*end)
		return -EINVAL;
	if (errno == ERANGE || v < min || v > max)
		return -ERANGE;
	*out = v;
	return 0;
}

/* One id of a comma-separated list at *p (spaces before it skipped): 0 with it in *x
 * and *p past its comma; -EINVAL where it is no integer in [0, max] followed by a comma
 * or the end (*p then at it, for the message); -ENODATA where a comma ends the list. */
static int cli_list_item(const char **p, long max, long *x)
{
	char *end;

	while (**p == ' ')
		(*p)++;
	errno = 0;
	*x = strtol(*p, &end, 10);
	if (end == *p || errno || *x < 0 || *x > max || (*end && *end != ','))
		return -EINVAL;
	*p = *end ? end + 1 : end;
	return *end && !**p ? -ENODATA : 0;
}

int cli_parse_tokens(const char *s, int max_n, int32_t **ids, int *n, char *err, size_t err_len)
{
	int32_t *v = NULL;
	int count = 0, cap = 0;
	const char *p = s;

	*ids = NULL;
	*n = 0;
	while (*p) {
		int ret;
		long x;

		if ((ret = cli_list_item(&p, INT32_MAX, &x)) == -EINVAL) {
			snprintf(err, err_len, "token list: bad id at character %ld of '%s' (want ids like 1,2,3)",
				 (long)(p - s) + 1, s);
			free(v);
			return -EINVAL;
		}
		if (count == max_n) {
			snprintf(err, err_len, "token list: more than %d ids", max_n);
			free(v);
			return -E2BIG;
		}
		if (count == cap) {
			int32_t *nv;

			cap = cap ? 2 * cap : 64;
			nv = realloc(v, (size_t)cap * sizeof(*v));
			if (!nv) {
				free(v);
				return -ENOMEM;
			}
			v = nv;
		}
		v[count++] = (int32_t)x;
		if (ret == -ENODATA) {
			snprintf(err, err_len, "token list: trailing comma in '%s'", s);
			free(v);
			return -EINVAL;
		}
	}
	if (!count) {
		snprintf(err, err_len, "token list: empty");
		free(v);
		return -EINVAL;
	}
	*ids = v;
	*n = count;
	return 0;
}

int cli_parse_gpus(const char *s, int *ids, int max_n, int *n, char *err, size_t err_len)
{
	const char *p = s;

	*n = 0;
	if (s && !strcmp(s, "all")) {
		*n = -1;
		return 0;
	}
	while (p && *p) {
		int ret;
		long x;

		if ((ret = cli_list_item(&p, 1023, &x)) == -EINVAL) {
			snprintf(err, err_len, "--gpus %s: give 'all' or GPU ids 0..1023 separated by commas", s);
			return -EINVAL;
		}
		for (int i = 0; i < *n; i++)
			if (ids[i] == (int)x) {
				snprintf(err, err_len, "--gpus %s: GPU %ld is named twice", s, x);
				return -EINVAL;
			}
		if (*n == max_n) {
			snprintf(err, err_len, "--gpus %s: at most %d GPUs", s, max_n);
			return -EINVAL;
		}
		ids[(*n)++] = (int)x;
		if (ret == -ENODATA) {
			snprintf(err, err_len, "--gpus %s: a comma with no GPU after it", s);
			return -EINVAL;
		}
	}
	if (*n == 0) {
		snprintf(err, err_len, "--gpus: give 'all' or GPU ids separated by commas");
		return -EINVAL;
	}
	return 0;
}
