/* The golden models' references (tests/data/golden, contrib/make_reference.py), for the
 * tests that check a model against them: token lists from their JSON, logits from their
 * raw fp32 files. Include after testutil.h and jansson.h. */
#ifndef KD_TESTS_GOLDENTEST_H
#define KD_TESTS_GOLDENTEST_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The integers of a JSON array as token ids (*n of them); malloc'd, caller frees. */
static inline int32_t *golden_ids(json_t *arr, int *n)
{
	int32_t *v = malloc(json_array_size(arr) * sizeof(int32_t) + 1);

	*n = (int)json_array_size(arr);
	for (int i = 0; i < *n; i++)
		v[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
	return v;
}

/* n floats of a raw fp32 file (a reference's logits); malloc'd, caller frees. NULL,
 * said on stderr, when the file has fewer. */
static inline float *golden_read_floats(const char *path, size_t n)
{
	FILE *f = fopen(path, "rb");
	float *v = malloc(n * sizeof(float) + 1);

	if (!f || !v || fread(v, sizeof(float), n, f) != n) {
		fprintf(stderr, "%s: cannot read %zu floats\n", path, n);
		free(v);
		v = NULL;
	}
	if (f)
		fclose(f);
	return v;
}

#endif
