// The launch check shared by the small-op, MoE and sampling launchers: a failed launch
// becomes -EIO with the kernel, file, line and device logged. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_LAUNCH_CHECK_CUH
#define KD_KERNELS_CUDA_LAUNCH_CHECK_CUH

#include <cerrno>
#include <cstdio>

#include <cuda_runtime.h>

// cudaGetLastError is not a stream operation, so this is safe inside a graph capture.
static inline int k_cuda_launch_status(const char *what, const char *file, int line)
{
	cudaError_t e = cudaGetLastError();
	int dev = -1;

	if (e == cudaSuccess)
		return 0;
	cudaGetDevice(&dev);
	fprintf(stderr, "cuda: launch of %s failed at %s:%d on device %d: %s\n", what, file, line,
		dev, cudaGetErrorString(e));
	return -EIO;
}

#define K_CUDA_LAUNCHED(what) k_cuda_launch_status((what), __FILE__, __LINE__)

// A CUDA runtime call outside a launch (allocation, attribute): 0 or -EIO, logged.
static inline int k_cuda_call_status(cudaError_t e, const char *call, const char *file, int line)
{
	int dev = -1;

	if (e == cudaSuccess)
		return 0;
	cudaGetDevice(&dev);
	fprintf(stderr, "cuda: %s failed at %s:%d on device %d: %s\n", call, file, line, dev,
		cudaGetErrorString(e));
	return -EIO;
}

#define K_CUDA_CALL(call) k_cuda_call_status((call), #call, __FILE__, __LINE__)

#endif
