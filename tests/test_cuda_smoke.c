/* The CUDA toolchain and device end to end: a kernel built by this tree runs on the
 * GPU and its result is checked exactly. Skips (77) where the build has no CUDA or the
 * machine has no GPU. */
#include <stdio.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include "kernels/cuda/k_cuda.h"
#include "tests/cudatest.h"

int main(void)
{
	enum { N = 100003 };	/* odd: exercises the tail of the last block */
	static float x[N], y[N];
	char name[128];
	double gib;
	int major, minor;

	if (!test_gpu_present("test_cuda_smoke"))
		return 77;
	CHECK(k_cuda_device_describe(0, name, sizeof(name), &gib, &major, &minor) == 0, "describe");
	fprintf(stderr, "device 0: %s, %.1f GiB, sm_%d%d\n", name, gib, major, minor);
	for (int i = 0; i < N; i++) {
		x[i] = (float)i;
		y[i] = 1.0f;
	}
	CHECK(k_cuda_axpy_host(0, N, 2.0f, x, y) == 0, "axpy ran");
	for (int i = 0; i < N; i++)
		if (y[i] != 2.0f * (float)i + 1.0f) {
			CHECK(0, "y[%d] = %g, want %g", i, y[i], 2.0f * (float)i + 1.0f);
			break;
		}
	return test_result("test_cuda_smoke");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_smoke: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
