/* The helpers every test shares: CHECK records a failure and goes on, and the test's
 * main returns test_result() (0 pass, 1 fail; exit 77 means skipped, automake's
 * convention); seeded random inputs, KD_TEST_* switches, files and the clock. */
#ifndef KD_TESTS_TESTUTIL_H
#define KD_TESTS_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int test_failures;
static int test_checks;
static int test_skips;	/* parts that could not run here (test_skip) */

#define CHECK(cond, ...)                                                        \
	do {                                                                    \
		test_checks++;                                                  \
		if (!(cond)) {                                                  \
			test_failures++;                                        \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                           \
			fputc('\n', stderr);                                    \
		}                                                               \
	} while (0)

#define CHECK_NEAR(a, b, tol, what)                                             \
	CHECK(fabs((double)(a) - (double)(b)) <= (tol), "%s: %.9g vs %.9g (tol %g)", \
	      (what), (double)(a), (double)(b), (double)(tol))

/* A part of the test that cannot run here (a missing file, uid or kernel feature): one
 * line with the reason, and test_result answers 77 unless a check failed, so that the
 * run reports SKIP rather than a pass that checked less. */
#define test_skip(...)                                                          \
	do {                                                                    \
		test_skips++;                                                   \
		fprintf(stderr, "SKIP: ");                                      \
		fprintf(stderr, __VA_ARGS__);                                   \
		fputc('\n', stderr);                                            \
	} while (0)

static inline int test_result(const char *name)
{
	if (test_failures) {
		fprintf(stderr, "%s: %d of %d checks failed\n", name, test_failures, test_checks);
		return 1;
	}
	if (test_skips) {
		fprintf(stderr, "%s: all %d checks passed, %d part%s skipped (SKIP lines above)\n",
			name, test_checks, test_skips, test_skips == 1 ? "" : "s");
		return 77;
	}
	fprintf(stderr, "%s: all %d checks passed\n", name, test_checks);
	return 0;
}

/* Error reductions that a non-finite value cannot slip through. fmax drops a NaN and
 * every comparison with one is false, so `err = fmax(err, e)` then `err < tol` passes
 * an output that is NaN (or a NaN-filled buffer nobody wrote); and memcmp finds two
 * NaN runs equal. Here a non-finite error is +inf, which fails `<= tol`, passes
 * `> tol` and sticks in a maximum. */

/* The larger of worst and e; +inf once e is not finite. */
static inline double test_err_max(double worst, double e)
{
	return isfinite(e) ? fmax(worst, e) : INFINITY;
}

/* |got - want|; +inf where either is not finite. */
static inline double test_abs_err(double got, double want)
{
	double d = fabs(got - want);

	return isfinite(d) ? d : INFINITY;
}

/* Relative L2 error ||a - b|| / ||b|| over n floats (b the reference); +inf where a
 * value of either is not finite. */
static inline double test_rel_l2(const float *a, const float *b, size_t n)
{
	double num = 0, den = 0, r;

	for (size_t i = 0; i < n; i++) {
		double d = (double)a[i] - (double)b[i];
		num += d * d;
		den += (double)b[i] * (double)b[i];
	}
	r = den > 0 ? sqrt(num / den) : sqrt(num);
	return isfinite(r) ? r : INFINITY;
}

/* 1 when a and b hold the same n floats bit for bit and every one is finite (two runs
 * that both wrote NaN, or wrote nothing into NaN-filled buffers, are not "the same"). */
static inline int test_same_floats(const float *a, const float *b, size_t n)
{
	if (memcmp(a, b, n * sizeof(float)))
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isfinite(a[i]))
			return 0;
	return 1;
}

/* The index of v[0..n-1]'s largest value, the first of equal ones (greedy's choice). */
static inline int test_argmax(const float *v, int n)
{
	int best = 0;

	for (int i = 1; i < n; i++)
		if (v[i] > v[best])
			best = i;
	return best;
}

/* Median of v[0..n-1] (sorted in place: insertion sort, n is a timing run's count). */
static inline float test_median(float *v, int n)
{
	for (int i = 1; i < n; i++)
		for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
			float t = v[j];

			v[j] = v[j - 1];
			v[j - 1] = t;
		}
	return v[n / 2];
}

/* Deterministic xorshift for test inputs. */
static inline float test_randf(unsigned long long *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return (float)((*s >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* n values test_randf * amp (in [-amp, amp)); malloc'd (at least one value), caller
 * frees. */
static inline float *test_rand_floats(size_t n, float amp, unsigned long long *s)
{
	float *p = malloc(sizeof(float) * (n ? n : 1));

	for (size_t i = 0; p && i < n; i++)
		p[i] = test_randf(s) * amp;
	return p;
}

/* An integer in [lo, hi] from test_randf. */
static inline int test_rand_int(int lo, int hi, unsigned long long *s)
{
	return lo + (int)((test_randf(s) + 1.0f) * 0.5f * (float)(hi - lo + 1)) % (hi - lo + 1);
}

/* 0..n-1 in a random order (Fisher-Yates over test_randf); malloc'd, caller frees.
 * Tests use it as shuffled, non-contiguous KV block tables. */
static inline int32_t *test_shuffled_ids(int n, unsigned long long *seed)
{
	int32_t *perm = malloc(sizeof(int32_t) * (size_t)n);

	if (!perm)
		return NULL;
	for (int i = 0; i < n; i++)
		perm[i] = i;
	for (int i = n - 1; i > 0; i--) {
		int j = (int)((test_randf(seed) + 1) * 0.5f * (i + 1)) % (i + 1);
		int32_t t = perm[i];

		perm[i] = perm[j];
		perm[j] = t;
	}
	return perm;
}

/* KD_TEST_PART, for tests run by halves (compute-sanitizer's slower runs): NULL (every
 * part) or one of a and b; any other value ends the test with exit 2. */
static inline const char *test_part(const char *name, const char *a, const char *b)
{
	const char *part = getenv("KD_TEST_PART");

	if (part && strcmp(part, a) && strcmp(part, b)) {
		fprintf(stderr, "%s: KD_TEST_PART=%s: want %s or %s\n", name, part, a, b);
		exit(2);
	}
	return part;
}

/* Whether a run of test_part's part includes p. */
static inline int test_part_runs(const char *part, const char *p)
{
	return !part || !strcmp(part, p);
}

/* An on/off switch of the environment (KD_TEST_QUICK): set and nonzero. */
static inline int test_env_flag(const char *name)
{
	const char *e = getenv(name);

	return e && atoi(e);
}

/* KD_TEST_SEED, or one from the clock; odd, as the generators want. Tests print it, so
 * that KD_TEST_SEED=n repeats a failing run. */
static inline unsigned long long test_seed(void)
{
	const char *e = getenv("KD_TEST_SEED");

	return (e ? strtoull(e, NULL, 0) : (unsigned long long)time(NULL) * 2654435761ull) | 1;
}

/* Seconds on the monotonic clock, for timeouts and the durations a test prints. */
static inline double test_now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The whole file at path and its length in *len, with a NUL after it (so a text file
 * is a string, and one byte more may be written at [*len]); malloc'd, caller frees.
 * NULL when it cannot be read. */
static inline void *test_slurp(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	char *buf = NULL;
	long n;

	if (!f)
		return NULL;
	if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
	    (buf = malloc((size_t)n + 1))) {
		if (fread(buf, 1, (size_t)n, f) == (size_t)n) {
			buf[n] = 0;
			*len = (size_t)n;
		} else {
			free(buf);
			buf = NULL;
		}
	}
	fclose(f);
	return buf;
}

#endif
