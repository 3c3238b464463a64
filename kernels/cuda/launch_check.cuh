// The CUDA error checks of every launcher and setup function: a failed launch or
// runtime call becomes -EIO (-ENOMEM for an allocation) with the kernel or call, file,
// line and device logged. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_LAUNCH_CHECK_CUH
#define KD_KERNELS_CUDA_LAUNCH_CHECK_CUH

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// A CUDA runtime call outside a launch (allocation, attribute): 0, -ENOMEM (the
// allocation failed) or -EIO, logged.
static inline int k_cuda_call_status(cudaError_t e, const char *call, const char *file, int line)
{
	int dev = -1;

	if (e == cudaSuccess)
		return 0;
	cudaGetDevice(&dev);
	fprintf(stderr, "cuda: %s failed at %s:%d on device %d: %s\n", call, file, line, dev,
		cudaGetErrorString(e));
	return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

#define K_CUDA_CALL(call) k_cuda_call_status((call), #call, __FILE__, __LINE__)

// The same two checks for a function returning int: a failure returns its status.
#define K_CUDA_RETURN_IF(status)                                                   \
	do {                                                                       \
		int kd_ret_ = (status);                                            \
		if (kd_ret_)                                                       \
			return kd_ret_;                                            \
	} while (0)
#define K_CUDA_TRY(call) K_CUDA_RETURN_IF(K_CUDA_CALL(call))
#define K_CUDA_TRY_LAUNCHED(what) K_CUDA_RETURN_IF(K_CUDA_LAUNCHED(what))

// Programmatic dependent launch for the small ops: a kernel launched so may be
// scheduled while the kernel before it in the stream drains, which hides most of the
// launch gap between the many short kernels of a decode step. Such a kernel calls
// k_cuda_pdl_wait() before it touches memory: that waits for the previous kernel to
// complete (its writes visible) and lets the next kernel be scheduled in turn, which
// is safe because that one waits the same way (or, launched without the attribute,
// waits for completion anyway). KDEC_CUDA_PDL=0 turns the attribute off.
static __device__ __forceinline__ void k_cuda_pdl_wait(void)
{
	cudaGridDependencySynchronize();
	cudaTriggerProgrammaticLaunchCompletion();
}

// A switch of the environment read once into *v (-1: not read yet): 1 where the
// variable name is "1", 0 where it is "0", def otherwise. Tests and the k_cuda_moe_set_*
// calls may write *v directly.
static inline bool k_cuda_env_flag(int *v, const char *name, int def)
{
	if (*v < 0) {
		const char *e = getenv(name);

		*v = e && !strcmp(e, "1") ? 1 : e && !strcmp(e, "0") ? 0 : def;
	}
	return *v != 0;
}

static inline int k_cuda_pdl_enabled(void)
{
	static int on = -1;

	return k_cuda_env_flag(&on, "KDEC_CUDA_PDL", 1);
}

template <typename... KArgs, typename... Args>
static inline cudaError_t k_cuda_launch_pdl(cudaStream_t s, dim3 grid, dim3 block, size_t smem,
					    void (*kernel)(KArgs...), Args... args)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1] = {};

	attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	attr[0].val.programmaticStreamSerializationAllowed = 1;
	cfg.gridDim = grid;
	cfg.blockDim = block;
	cfg.dynamicSmemBytes = smem;
	cfg.stream = s;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_pdl_enabled() ? 1 : 0;
	return cudaLaunchKernelEx(&cfg, kernel, args...);
}

#endif
