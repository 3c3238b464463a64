/* kdbench's subcommands that live in files of their own: each takes the arguments
 * after "kdbench" (argv[0] is the subcommand) and returns the exit status; and the
 * option parsing they share. */
#ifndef KD_DAEMON_KDBENCH_H
#define KD_DAEMON_KDBENCH_H

#include <stdint.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/spec_ngram.h"

/* The HBM bandwidth of the floors, TB/s: an H200's measured read bandwidth (DEVICE.md) */
#define KDBENCH_HBM_TBS 4.25

int kdbench_decode_main(int argc, char **argv);		/* kdbench_decode.c */
int kdbench_prefill_main(int argc, char **argv);		/* kdbench_prefill.c */
int kdbench_kvcache_main(int argc, char **argv);		/* kdbench_kvcache.c */
int kdbench_ipc_main(int argc, char **argv);		/* kdbench_ipc.c */
int kdbench_agent_main(int argc, char **argv);		/* kdbench_agent.c */
int kdbench_allreduce_main(int argc, char **argv);	/* kdbench_allreduce.c */
/* allreduce --backend cuda: the fused kernel with tp virtual ranks on GPU 0 over bf16
 * messages bytes[0..n_sizes) of rows of width (n_sizes 0: 1, 4, 16, 64 rows); the
 * exit status (kdbench_allreduce_cuda.c) */
int kdbench_allreduce_cuda(int tp, int iters, int warmup, const long *bytes, int n_sizes,
			   int width);

/* xorshift64: the random prompt tokens of decode and prefill (*s never 0). */
static inline uint64_t kdbench_rng_next(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* qsort's comparison of doubles, ascending. */
static inline int kdbench_cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* An integer option of the command who ("kdbench", "kdbench decode"): s in [min, max]
 * into *out, 0; else one line on stderr, -1. */
int kdbench_parse_num(const char *who, const char *opt, const char *s, long min, long max,
		      long *out);

/* generate with n-gram speculation (kdbench_spec.c): the ids of max_tokens greedy
 * tokens after ids[0..n) to stdout, timing and acceptance to stderr. 0 or -errno. */
int kdbench_generate_spec(struct engine *e, const int32_t *ids, int n, long max_tokens,
			  const struct spec_opts *so);

#endif
