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
	int ret;

	K_CUDA_TRY(cudaSetDevice(dev));
	if ((ret = K_CUDA_CALL(cudaMalloc(&dx, bytes))) ||
	    (ret = K_CUDA_CALL(cudaMalloc(&dy, bytes))) ||
	    (ret = K_CUDA_CALL(cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice))) ||
	    (ret = K_CUDA_CALL(cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice))))
		goto out;
	axpy_kernel<<<(n + 255) / 256, 256>>>(n, a, dx, dy);
	if ((ret = K_CUDA_LAUNCHED("axpy_kernel")) ||
	    (ret = K_CUDA_CALL(cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost))))
		goto out;
out:
	cudaFree(dx);
	cudaFree(dy);
	return ret;
}

extern "C" int k_cuda_profile_range(int on)
{
	K_CUDA_TRY(on ? cudaProfilerStart() : cudaProfilerStop());
	return 0;
}
