/* Every kernel a program runs, with its GPU start and end, graph nodes included:
 * a CUPTI injection library for the device machine, where nsys cannot make a report
 * (KINDS.md). The CUDA driver loads it at cuInit where CUDA_INJECTION64_PATH names it
 * and calls InitializeInjection; it writes one line per kernel to $KDEC_KTRACE at exit:
 *   start_ns,end_ns,correlation,graph_id,graph_node,ctas,threads,name
 * Kernels of one graph launch share its correlation id, so one decode step's replay
 * is one group (contrib/device/layer_trace.py reads them).
 * Build: cc -O2 -shared -fPIC -I$CUDA/include kernel_trace.c -o libktrace.so
 *        -L$CUDA/lib -lcupti   (contrib/device/layer_trace.sh does it) */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define BUF_BYTES (8u << 20)

static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
	*buf = aligned_alloc(8, BUF_BYTES);
	*size = *buf ? BUF_BYTES : 0;
	*max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
				      size_t valid)
{
	CUpti_Activity *r = NULL;
	size_t dropped = 0;

	(void)ctx;
	(void)stream;
	(void)size;
	while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
		const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;

		if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || !out)
			continue;
		fprintf(out, "%llu,%llu,%u,%u,%llu,%d,%d,%s\n", (unsigned long long)k->start,
			(unsigned long long)k->end, k->correlationId, k->graphId,
			(unsigned long long)k->graphNodeId, k->gridX * k->gridY * k->gridZ,
			k->blockX * k->blockY * k->blockZ, k->name ? k->name : "?");
	}
	if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
		fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
	free(buf);
}

static void flush_at_exit(void)
{
	cuptiActivityFlushAll(1);
	if (out)
		fclose(out);
	out = NULL;
}

int InitializeInjection(void)
{
	const char *path = getenv("KDEC_KTRACE");

	out = fopen(path ? path : "ktrace.csv", "w");
	if (!out) {
		perror("kernel_trace: KDEC_KTRACE");
		return 0;
	}
	if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
	    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
		fprintf(stderr, "kernel_trace: CUPTI refused the kernel activity\n");
		return 0;
	}
	atexit(flush_at_exit);
	return 1;
}
