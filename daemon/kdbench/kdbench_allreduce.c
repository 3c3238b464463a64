/* kdbench allreduce: the tensor-parallel all-reduce measured alone (issue 25). The CPU
 * ranks' (threads, shared memory: tp_comm.c), per message size p50/p99 of one
 * reduction with the residual add, beside its floor: the two barriers of a reduction
 * that moves no data; every reduction's result is checked. --backend cuda: the GPU's
 * fused one-shot kernel with virtual ranks, and NCCL (kdbench_allreduce_cuda.c). */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/clock.h"
#include "daemon/engine/tp_comm.h"
#include "daemon/kdbench/kdbench.h"

#define AR_MAX_SIZES 16

struct ar_args {
	int tp, iters, warmup, n_sizes, width, bytes_given;
	long bytes[AR_MAX_SIZES];
	const char *backend;
};

/* One size's run, shared by the rank threads. */
struct ar_run {
	struct tp_comm comm;
	struct tp_barrier start;	/* all ranks begin each reduction together */
	size_t n;			/* floats */
	int rounds;
	float *buf[TP_COMM_MAX_RANKS], *res[TP_COMM_MAX_RANKS];
	int bad[TP_COMM_MAX_RANKS];	/* reductions whose sum was wrong */
};

struct ar_rank {
	struct ar_run *run;
	int r;
	double *us;			/* rank 0: the time of each round */
};

/* Rank r's rounds: each reduces buf (all r + 1) into res (zeroed), so every element
 * of res must come out as n_ranks (n_ranks + 1) / 2 exactly (small integers). */
static void *ar_rank_main(void *arg)
{
	struct ar_rank *k = arg;
	struct ar_run *run = k->run;
	float want = (float)run->comm.n * (float)(run->comm.n + 1) / 2;

	for (int i = 0; i < run->rounds; i++) {
		double t0;

		for (size_t j = 0; j < run->n; j++) {
			run->buf[k->r][j] = (float)(k->r + 1);
			run->res[k->r][j] = 0;
		}
		tp_barrier_wait(&run->start);
		t0 = clock_now();
		if (tp_comm_reduce(&run->comm, k->r, run->buf[k->r], run->n, run->res[k->r]))
			run->bad[k->r]++;
		if (k->us)
			k->us[i] = (clock_now() - t0) * 1e6;
		for (size_t j = 0; j < run->n; j++)
			if (run->res[k->r][j] != want) {
				run->bad[k->r]++;
				break;
			}
	}
	return NULL;
}

/* p50 and p99 of one size's timed rounds (after the warm-up); -1 on failure. */
static int ar_measure(const struct ar_args *a, size_t n, double *p50, double *p99)
{
	struct ar_run run = { .n = n, .rounds = a->warmup + a->iters };
	struct ar_rank ranks[TP_COMM_MAX_RANKS];
	pthread_t th[TP_COMM_MAX_RANKS];
	double *us = calloc((size_t)run.rounds, sizeof(double));
	int started = 0, bad = 0, ret = -1;

	if (!us || tp_comm_init(&run.comm, a->tp, n)) {
		free(us);
		return -1;
	}
	tp_barrier_init(&run.start, a->tp);
	for (int r = 0; r < a->tp; r++) {
		run.buf[r] = malloc((n ? n : 1) * sizeof(float));
		run.res[r] = malloc((n ? n : 1) * sizeof(float));
		if (!run.buf[r] || !run.res[r])
			goto out;
	}
	for (int r = 1; r < a->tp; r++, started++) {
		ranks[r] = (struct ar_rank){ .run = &run, .r = r };
		if (pthread_create(&th[r], NULL, ar_rank_main, &ranks[r]))
			goto out;	/* nobody waits yet: no reduction ran */
	}
	ranks[0] = (struct ar_rank){ .run = &run, .r = 0, .us = us };
	ar_rank_main(&ranks[0]);
	for (int r = 1; r <= started; r++)
		pthread_join(th[r], NULL);
	started = 0;
	for (int r = 0; r < a->tp; r++)
		bad += run.bad[r];
	if (bad) {
		fprintf(stderr, "kdbench allreduce: %d reductions of %zu floats gave a wrong sum\n", bad, n);
		goto out;
	}
	qsort(us + a->warmup, (size_t)a->iters, sizeof(double), kdbench_cmp_double);
	*p50 = us[a->warmup + a->iters / 2];
	*p99 = us[a->warmup + (a->iters * 99) / 100];
	ret = 0;
out:
	if (started) {	/* a thread failed to start: the others wait at the start barrier */
		tp_barrier_break(&run.start);
		tp_barrier_break(&run.comm.bar);
		for (int r = 1; r <= started; r++)
			pthread_join(th[r], NULL);
	}
	for (int r = 0; r < a->tp; r++) {
		free(run.buf[r]);
		free(run.res[r]);
	}
	tp_barrier_fini(&run.start);
	tp_comm_fini(&run.comm);
	free(us);
	return ret;
}

static int ar_parse(int argc, char **argv, struct ar_args *a)
{
	static const struct option opts[] = {
		{ "tp", required_argument, NULL, 't' },
		{ "bytes", required_argument, NULL, 'b' },
		{ "iters", required_argument, NULL, 'i' },
		{ "warmup", required_argument, NULL, 'w' },
		{ "backend", required_argument, NULL, 'B' },
		{ "width", required_argument, NULL, 'W' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long v;
	int c;

	*a = (struct ar_args){ .tp = 2, .iters = 200, .warmup = 20, .backend = "cpu", .n_sizes = 4,
			       .width = 7168,
			       .bytes = { 4096, 65536, 1 << 20, 16 << 20 } };
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 't':
			if (kdbench_parse_num("kdbench allreduce", "--tp", optarg, 2, TP_COMM_MAX_RANKS, &v))
				return -1;
			a->tp = (int)v;
			break;
		case 'i':
			if (kdbench_parse_num("kdbench allreduce", "--iters", optarg, 1, 1 << 20, &v))
				return -1;
			a->iters = (int)v;
			break;
		case 'w':
			if (kdbench_parse_num("kdbench allreduce", "--warmup", optarg, 0, 1 << 20, &v))
				return -1;
			a->warmup = (int)v;
			break;
		case 'W':
			if (kdbench_parse_num("kdbench allreduce", "--width", optarg, 8, 65536, &v))
				return -1;
			a->width = (int)v;
			break;
		case 'b': {
			char *s = optarg, *end;

			a->bytes_given = 1;
			for (a->n_sizes = 0; *s; a->n_sizes++) {
				errno = 0;
				v = strtol(s, &end, 10);
				if (end == s || errno || v < 4 || v > (1L << 30) || v % 4 ||
				    (*end && *end != ',') || a->n_sizes == AR_MAX_SIZES) {
					fprintf(stderr, "kdbench allreduce: --bytes %s: up to %d sizes, each a "
						"multiple of 4 in [4, 2^30], separated by commas\n", optarg,
						AR_MAX_SIZES);
					return -1;
				}
				a->bytes[a->n_sizes] = v;
				s = *end ? end + 1 : end;
			}
			break;
		}
		case 'B': a->backend = optarg; break;
		case 'h':
			printf("usage: kdbench allreduce [--tp N] [--bytes 4096,65536,...] [--iters N] "
			       "[--warmup N] [--backend cpu|cuda] [--width W]\n"
			       "  the tensor-parallel all-reduce (sum + residual add) of each message size\n"
			       "  over N ranks (default 2): p50/p99 microseconds and GB/s, beside the floor\n"
			       "  (a reduction of nothing: its two barriers). cpu: ranks as threads over\n"
			       "  shared memory (tp_comm.c). cuda: the fused one-shot all-reduce + residual\n"
			       "  + RMSNorm with N virtual ranks on GPU 0, messages of bf16 rows of W values\n"
			       "  (default 7168; --bytes a multiple of 2W, 1..64 rows; default 1, 4, 16, 64\n"
			       "  rows), beside its launch, HBM and NVLink floors; and NCCL's one-rank\n"
			       "  all-reduce where libnccl loads (NCCL cannot put two ranks on one GPU)\n");
			exit(0);
		default:
			return -1;
		}
	}
	return 0;
}

int kdbench_allreduce_main(int argc, char **argv)
{
	struct ar_args a;
	double f50, f99;

	if (ar_parse(argc, argv, &a))
		return 2;
	if (!strcmp(a.backend, "cuda"))
		return kdbench_allreduce_cuda(a.tp, a.iters, a.warmup, a.bytes_given ? a.bytes : NULL,
					      a.bytes_given ? a.n_sizes : 0, a.width);
	if (strcmp(a.backend, "cpu")) {
		fprintf(stderr, "kdbench allreduce: --backend %s: cpu (ranks as threads) or cuda (the "
			"fused one-shot kernel, virtual ranks on one GPU)\n", a.backend);
		return 1;
	}
	if (ar_measure(&a, 0, &f50, &f99))
		return 1;
	printf("# kdbench allreduce: cpu, tp %d (ranks as threads, shared memory), %d rounds after %d "
	       "warm-up; floor: a reduction of nothing (its two barriers) p50 %.1f us, p99 %.1f us\n",
	       a.tp, a.iters, a.warmup, f50, f99);
	printf("%10s %10s %10s %10s %10s\n", "bytes", "p50_us", "p99_us", "GB/s", "floor%");
	for (int i = 0; i < a.n_sizes; i++) {
		double p50, p99;

		if (ar_measure(&a, (size_t)a.bytes[i] / sizeof(float), &p50, &p99))
			return 1;
		printf("%10ld %10.1f %10.1f %10.2f %9.0f%%\n", a.bytes[i], p50, p99,
		       (double)a.bytes[i] / (p50 * 1e3), 100.0 * f50 / p50);
	}
	return 0;
}
