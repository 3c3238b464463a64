/* Programmatic-dependent-launch hand-offs under stress: a producer lets the next kernel
 * launch at once, spins, and only then writes; the consumer (the project's kernel,
 * launched with PDL as the engine launches it) must still see this replay's values.
 * Each case is captured once into a CUDA graph (producer, consumer, checker) and
 * replayed PDL_REPLAYS times; the checker compares every element exactly with the
 * replay's values and counts mismatches. Cases: the split merge (part_o / part_lse,
 * both merge kernels) and the greedy sampler over several blocks per row (logits, the
 * blocks' arrival). The positive control, a consumer that copies the producer's buffer
 * before its wait, must see stale values: otherwise the producer did not overlap and
 * the stress proves nothing. Skips (77) without CUDA or a GPU.
 * KD_PDL_REPLAYS=n: another replay count; KD_PDL_SPIN=cycles: the producer's delay. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/k_sample.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/k_cuda_tuning.h"
#include "kernels/cuda/attn/k_cuda_attn.h"
#include "kernels/cuda/sample/k_cuda_sample.h"
#include "tests/cudatest.h"
#include "tests/pdl_stress.h"

static long replays = 10000;
static long long spin_cycles = 20000;	/* ~10 us at the H200's clock */

/* The consumer of one case, queued on s between producer and checker. */
struct pdl_case {
	const char *name;
	int mode;
	int n_splits, rows, n;	/* the producer's shape (pdl_stress.h) */
	int (*consume)(cudaStream_t s, const struct pdl_case *c);
	/* device buffers */
	float *a, *b, *out;
	int32_t *ids;
	struct k_cuda_attn_ws *aws;
	struct k_cuda_sample_ws *sws;
	struct k_sample_params *params;
	uint64_t *steps;
	int heads, dim, batched;
};

static int consume_merge(cudaStream_t s, const struct pdl_case *c)
{
	int n_rows = c->rows / c->heads;

	return k_cuda_attn_merge(s, c->aws, c->a, c->b, c->n_splits, n_rows, c->heads, c->dim,
				 c->out, (long)c->heads * c->dim, c->dim, NULL);
}

static int consume_sample(cudaStream_t s, const struct pdl_case *c)
{
	return k_cuda_sample(s, c->sws, c->ids, c->a, c->rows, c->n, c->params, c->steps);
}

static int consume_early_copy(cudaStream_t s, const struct pdl_case *c)
{
	return pdl_stress_early_copy(s, c->out, c->a, (size_t)c->n_splits * c->rows * c->n);
}

/* Captures producer, consumer, checker; replays; returns the mismatches (-1: failed). */
static long long run_case(struct pdl_case *c)
{
	cudaStream_t s = NULL;
	cudaGraph_t g = NULL;
	cudaGraphExec_t ge = NULL;
	unsigned *gen = dalloc(sizeof(unsigned));
	unsigned long long *errors = dalloc(sizeof(unsigned long long)), bad = 0;
	const struct k_cuda_tuning was = *k_cuda_tuning();
	struct k_cuda_tuning t = was;
	long long ret = -1;
	int ok;

	if (!gen || !errors || !CU(cudaMemset(gen, 0, sizeof(unsigned))) ||
	    !CU(cudaMemset(errors, 0, sizeof(unsigned long long))) ||
	    !CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)))
		goto out;
	t.attn_merge_batched = c->batched;
	t.cuda_pdl = 1;
	k_cuda_tuning_set(&t);
	ok = CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
	if (ok) {
		int r1 = pdl_stress_produce(s, c->mode, c->a, c->b, c->n_splits, c->rows, c->n, gen,
					    spin_cycles);
		int r2 = c->consume(s, c);
		int r3 = pdl_stress_check(s, c->mode, c->out, c->ids, c->n_splits, c->rows, c->n,
					  gen, errors);

		ok = CU(cudaStreamEndCapture(s, &g));
		CHECK(!r1 && !r2 && !r3, "%s: capture: produce %d consume %d check %d", c->name, r1,
		      r2, r3);
		ok = ok && !r1 && !r2 && !r3;
	}
	k_cuda_tuning_set(&was);
	if (!ok || !CU(cudaGraphInstantiate(&ge, g, 0)))
		goto out;
	for (long i = 0; i < replays; i++)
		if (!CU(cudaGraphLaunch(ge, s)))
			goto out;
	if (CU(cudaStreamSynchronize(s)) &&
	    CU(cudaMemcpy(&bad, errors, sizeof(bad), cudaMemcpyDeviceToHost)))
		ret = (long long)bad;
out:
	if (ge)
		cudaGraphExecDestroy(ge);
	if (g)
		cudaGraphDestroy(g);
	if (s)
		cudaStreamDestroy(s);
	cudaFree(gen);
	cudaFree(errors);
	return ret;
}

static void test_merge(int batched)
{
	struct pdl_case c = { .name = batched ? "merge (batched kernel)" : "merge (block kernel)",
			      .mode = PDL_STRESS_MERGE, .n_splits = 4, .heads = 32, .dim = 128,
			      .batched = batched, .consume = consume_merge };
	int n_rows = 2;
	long long bad;

	c.rows = n_rows * c.heads;
	c.n = c.dim;
	c.a = dalloc(sizeof(float) * c.n_splits * c.rows * c.n);
	c.b = dalloc(sizeof(float) * c.n_splits * c.rows);
	c.out = dalloc(sizeof(float) * c.rows * c.n);
	if (!c.a || !c.b || !c.out)
		return;
	CHECK(k_cuda_attn_ws_create(&c.aws, n_rows, c.heads, c.dim, 1024) == 0, "attn ws");
	if (c.aws) {
		bad = run_case(&c);
		CHECK(bad == 0, "%s: %lld of %ld x %d outputs differ from their replay's values",
		      c.name, bad, replays, c.rows * c.n);
		fprintf(stderr, "%s: %ld replays, %lld mismatches\n", c.name, replays, bad);
		k_cuda_attn_ws_destroy(c.aws);
	}
	cudaFree(c.a);
	cudaFree(c.b);
	cudaFree(c.out);
}

static void test_sample(int rows)
{
	struct pdl_case c = { .name = "greedy sampler", .mode = PDL_STRESS_LOGITS, .n_splits = 1,
			      .rows = rows, .n = 128256, .consume = consume_sample };
	struct k_sample_params hp[8];
	uint64_t hs[8] = { 0 };
	long long bad;

	memset(hp, 0, sizeof(hp));	/* temperature 0: greedy */
	c.a = dalloc(sizeof(float) * (size_t)rows * c.n);
	c.ids = dalloc(sizeof(int32_t) * rows);
	c.params = dup_to_device(hp, sizeof(hp));
	c.steps = dup_to_device(hs, sizeof(hs));
	if (!c.a || !c.ids || !c.params || !c.steps)
		return;
	CHECK(k_cuda_sample_ws_create(&c.sws, 8, c.n) == 0, "sample ws");
	if (c.sws) {
		bad = run_case(&c);
		CHECK(bad == 0, "%s, %d rows: %lld of %ld x %d ids differ from their replay's argmax",
		      c.name, rows, bad, replays, rows);
		fprintf(stderr, "%s, %d rows: %ld replays, %lld mismatches\n", c.name, rows, replays,
			bad);
		k_cuda_sample_ws_destroy(c.sws);
	}
	cudaFree(c.a);
	cudaFree(c.ids);
	cudaFree(c.params);
	cudaFree(c.steps);
}

/* The control: a consumer that reads before its wait must be caught. */
static void test_control(void)
{
	struct pdl_case c = { .name = "control (read before the wait)", .mode = PDL_STRESS_MERGE,
			      .n_splits = 1, .rows = 64, .n = 128, .consume = consume_early_copy };
	long long bad;

	c.a = dalloc(sizeof(float) * c.rows * c.n);
	c.b = dalloc(sizeof(float) * c.rows);
	c.out = dalloc(sizeof(float) * c.rows * c.n);
	if (!c.a || !c.b || !c.out)
		return;
	bad = run_case(&c);
	fprintf(stderr, "%s: %ld replays, %lld mismatches (must be > 0)\n", c.name, replays, bad);
	CHECK(bad > 0, "%s: no stale read in %ld replays: the producer never overlapped its "
	      "consumer, so the cases above prove nothing", c.name, replays);
	cudaFree(c.a);
	cudaFree(c.b);
	cudaFree(c.out);
}

int main(void)
{
	const char *e;

	if (!test_gpu_present("test_cuda_pdl"))
		return 77;
	if ((e = getenv("KD_PDL_REPLAYS")) && atol(e) > 0)
		replays = atol(e);
	if ((e = getenv("KD_PDL_SPIN")) && atoll(e) >= 0)
		spin_cycles = atoll(e);
	fprintf(stderr, "test_cuda_pdl: %ld replays per case, producer delay %lld cycles\n",
		replays, spin_cycles);
	test_control();
	test_merge(0);
	test_merge(1);
	test_sample(1);
	test_sample(4);
	return test_result("test_cuda_pdl");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_pdl: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
