// Device discovery and a self-test kernel: the first CUDA code of kdec, so that the
// toolchain, the architecture flags and the link are exercised by every build.
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/launch_check.cuh"

// ---- kernels ----------------------------------------------------------------

__global__ void axpy_kernel(int n, float a, const float *x, float *y)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;

	if (i < n)
		y[i] = a * x[i] + y[i];
}

// ---- launchers --------------------------------------------------------------

extern "C" int k_cuda_device_count(int *count)
{
	// No driver or no device is not an error here: the answer is zero GPUs.
	if (cudaGetDeviceCount(count) != cudaSuccess) {
		cudaGetLastError();
		*count = 0;
	}
	return 0;
}

extern "C" int k_cuda_device_describe(int dev, char *name, unsigned long name_len, double *mem_gib,
				      int *sm_major, int *sm_minor)
{
	cudaDeviceProp p;

	K_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
	snprintf(name, name_len, "%s", p.name);
	*mem_gib = (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0);
	*sm_major = p.major;
	*sm_minor = p.minor;
	return 0;
}

extern "C" int k_cuda_axpy_host(int dev, int n, float a, const float *x, float *y)
{
	size_t bytes = (size_t)n * sizeof(float);
	float *dx = nullptr, *dy = nullptr;
	int ret = -EIO;

	K_CUDA_TRY(cudaSetDevice(dev));
	if (cudaMalloc(&dx, bytes) != cudaSuccess || cudaMalloc(&dy, bytes) != cudaSuccess)
		goto out;
	if (cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
	    cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
		goto out;
	axpy_kernel<<<(n + 255) / 256, 256>>>(n, a, dx, dy);
	if (cudaGetLastError() != cudaSuccess ||
	    cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
		goto out;
	ret = 0;
out:
	if (ret)
		fprintf(stderr, "cuda: axpy self-test failed: %s\n", cudaGetErrorString(cudaGetLastError()));
	cudaFree(dx);
	cudaFree(dy);
	return ret;
}

extern "C" int k_cuda_profile_range(int on)
{
	K_CUDA_TRY(on ? cudaProfilerStart() : cudaProfilerStop());
	return 0;
}
