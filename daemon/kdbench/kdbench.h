/* kdbench's subcommands that live in files of their own: each takes the arguments
 * after "kdbench" (argv[0] is the subcommand) and returns the exit status; and the
 * option parsing they share. */
#ifndef KD_DAEMON_KDBENCH_H
#define KD_DAEMON_KDBENCH_H

#include <getopt.h>
#include <stdint.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/spec_ngram.h"
#include "daemon/model/model.h"

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

/* The options of the model and the engine that logits/generate, decode and prefill take
 * alike. KDBENCH_MODEL_OPTIONS: the weights and where they run (every one of the three);
 * KDBENCH_RANK_OPTIONS: the ranks and the cache (not prefill). Their getopt_long values
 * start at KDBENCH_O_FIRST; a subcommand's own stay below it. */
enum kdbench_opt {
	KDBENCH_O_FIRST = 0x400,
	KDBENCH_O_BACKEND = KDBENCH_O_FIRST, KDBENCH_O_THREADS, KDBENCH_O_SYNTH, KDBENCH_O_WFMT,
	KDBENCH_O_SEED, KDBENCH_O_LAYERS, KDBENCH_O_LOG,
	KDBENCH_O_KV, KDBENCH_O_TP, KDBENCH_O_GPUS, KDBENCH_O_EP, KDBENCH_O_MLA_CP,
	KDBENCH_O_ALLRED,
};

#define KDBENCH_MODEL_OPTIONS \
	{ "backend", required_argument, NULL, KDBENCH_O_BACKEND }, \
	{ "threads", required_argument, NULL, KDBENCH_O_THREADS }, \
	{ "synthetic-weights", no_argument, NULL, KDBENCH_O_SYNTH }, \
	{ "weight-format", required_argument, NULL, KDBENCH_O_WFMT }, \
	{ "seed", required_argument, NULL, KDBENCH_O_SEED }, \
	{ "layers", required_argument, NULL, KDBENCH_O_LAYERS }, \
	{ "log-level", required_argument, NULL, KDBENCH_O_LOG }

#define KDBENCH_RANK_OPTIONS \
	{ "kv-tokens", required_argument, NULL, KDBENCH_O_KV }, \
	{ "tp", required_argument, NULL, KDBENCH_O_TP }, \
	{ "gpus", required_argument, NULL, KDBENCH_O_GPUS }, \
	{ "ep", no_argument, NULL, KDBENCH_O_EP }, \
	{ "mla-cp", no_argument, NULL, KDBENCH_O_MLA_CP }, \
	{ "allreduce", required_argument, NULL, KDBENCH_O_ALLRED }

/* c, getopt_long's value, with its argument arg, into *load or *eng (or the log level)
 * where c is one of those options: 0; -1 where arg is malformed or out of range (one
 * line on stderr, naming the command who: "kdbench decode"); 1 where c is not one. */
int kdbench_engine_opt(const char *who, int c, const char *arg, struct model_load_opts *load,
		       struct engine_opts *eng);

/* generate with n-gram speculation (kdbench_spec.c): the ids of max_tokens greedy
 * tokens after ids[0..n) to stdout, timing and acceptance to stderr. 0 or -errno. */
int kdbench_generate_spec(struct engine *e, const int32_t *ids, int n, long max_tokens,
			  const struct spec_opts *so);

#endif
