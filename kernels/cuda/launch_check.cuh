// The CUDA error path of every launcher and setup function: a failed launch or
// runtime call becomes -EIO (-ENOMEM for an allocation) with the kernel or call, file,
// line and device logged through k_cuda_log, the one writer of the kernels' error
// lines. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_LAUNCH_CHECK_CUH
#define KD_KERNELS_CUDA_LAUNCH_CHECK_CUH

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "kernels/cuda/k_cuda_tuning.h"

// One line on stderr (a newline is added), whole among other threads' lines: every
// failure of kernels/cuda (CUDA, cuBLAS, bad arguments) and every fallback taken
// because of one is reported here. The kernels have no logger of their own to call;
// the daemon's log goes to stderr too.
static inline void k_cuda_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void k_cuda_log(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	flockfile(stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	funlockfile(stderr);
	va_end(ap);
}

// dev < 0: the current device.
static inline int k_cuda_dev_or_current(int dev)
{
	if (dev < 0)
		cudaGetDevice(&dev);
	return dev;
}

// cudaGetLastError is not a stream operation, so this is safe inside a graph capture.
static inline int k_cuda_launch_status(const char *what, const char *file, int line)
{
	cudaError_t e = cudaGetLastError();

	if (e == cudaSuccess)
		return 0;
	k_cuda_log("cuda: launch of %s failed at %s:%d on device %d: %s", what, file, line,
		   k_cuda_dev_or_current(-1), cudaGetErrorString(e));
	return -EIO;
}

#define K_CUDA_LAUNCHED(what) k_cuda_launch_status((what), __FILE__, __LINE__)

// A CUDA runtime call outside a launch (allocation, attribute) on device dev (< 0: the
// current one): 0, -ENOMEM (the allocation failed) or -EIO, logged.
static inline int k_cuda_call_status_on(cudaError_t e, const char *call, const char *file,
					int line, int dev)
{
	if (e == cudaSuccess)
		return 0;
	k_cuda_log("cuda: %s failed at %s:%d on device %d: %s", call, file, line,
		   k_cuda_dev_or_current(dev), cudaGetErrorString(e));
	return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

#define K_CUDA_CALL(call) k_cuda_call_status_on((call), #call, __FILE__, __LINE__, -1)

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
// waits for completion anyway). k_cuda_tuning()->cuda_pdl 0 (KDEC_CUDA_PDL=0) turns the
// attribute off.
static __device__ __forceinline__ void k_cuda_pdl_wait(void)
{
	cudaGridDependencySynchronize();
	cudaTriggerProgrammaticLaunchCompletion();
}

// A relay: a kernel of a latency-bound chain that streams no weights worth the name (an
// RMSNorm, qkv_post, the decode attention, the split merge) lets the next kernel launch
// as soon as its own blocks have all started, before its wait, so the GEMV at the end of
// the chain is resident and has its weights in flight while the chain still runs,
// instead of only from the last link's wait on. Its wait (after this) still orders its
// own reads; the kernel after it waits for it to complete, which follows its wait, so
// that kernel's reads after its wait are ordered too. What changes is the rule for reads
// before the wait: the kernel after a relay may start while the kernel before the relay
// still writes, so "written two or more launches back" counts relays as no launch: the
// writer must come before the last kernel that is not a relay (docs/ARCHITECTURE.md,
// "Programmatic dependent launch"). on: k_cuda_pdl_relay_enabled(its kind) at the
// launch. A relay kernel carries a `pdl-order: relay NAME` comment (tests/pdl_order.sh
// allows its early trigger).
static __device__ __forceinline__ void k_cuda_pdl_relay(int on)
{
	if (on)
		cudaTriggerProgrammaticLaunchCompletion();
}

// Reads before k_cuda_pdl_wait(). A kernel launched with programmatic serialisation
// may read global memory before its wait only through these two helpers, and only
// where the data cannot be written by a kernel still in flight: weights (constant
// while the model is loaded) and step inputs settled before the launch (uploaded by a
// copy ahead of the step's first kernel, or written by a kernel two or more launches
// back: every kernel's trigger follows its own wait, so the kernel in between has
// waited for that writer before this one could start). Everything else is read after
// the wait. Their loads carry the .L2::256B qualifier (SASS LTC256B), their copies
// .L2::128B (LTC128B), which nothing else in kernels/cuda emits: tests/pdl_order.sh disassembles the built kernels and
// fails on any other global access the control flow can reach before the wait
// (docs/ARCHITECTURE.md, "Programmatic dependent launch"). .cg (L2, coherent): an SM's L1
// may still hold an older step's line of a settled input. T: 2, 4, 8 or 16 bytes, or
// a multiple of 4 bytes aligned to 4 (read a word at a time).
template <typename T>
static __device__ __forceinline__ T k_cuda_pdl_early(const T *p)
{
	T v;

	if constexpr (sizeof(T) == 2) {
		unsigned short x;

		asm volatile("ld.global.cg.L2::256B.b16 %0, [%1];" : "=h"(x) : "l"(p));
		memcpy(&v, &x, 2);
	} else if constexpr (sizeof(T) == 8) {
		unsigned long long x;

		asm volatile("ld.global.cg.L2::256B.b64 %0, [%1];" : "=l"(x) : "l"(p));
		memcpy(&v, &x, 8);
	} else if constexpr (sizeof(T) == 16) {
		uint4 x;

		asm volatile("ld.global.cg.L2::256B.v4.b32 {%0, %1, %2, %3}, [%4];"
			     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p));
		memcpy(&v, &x, 16);
	} else {
		static_assert(sizeof(T) % 4 == 0 && alignof(T) >= 4, "k_cuda_pdl_early: words");
		unsigned x[sizeof(T) / 4];

#pragma unroll
		for (unsigned i = 0; i < sizeof(T) / 4; i++)
			asm volatile("ld.global.cg.L2::256B.b32 %0, [%1];"
				     : "=r"(x[i]) : "l"((const unsigned *)p + i));
		memcpy(&v, x, sizeof(T));
	}
	return v;
}

// cp.async of 16 bytes of weights into shared memory before the wait (zeros where
// !valid), the early form of ptx.cuh's cp_async16. .L2::128B, not 256B: with 256B the
// streaming GEMM's early weight stages cost Llama-3.1-8B decode at batch 1 ~18 us a
// step on H200 (4.657 ms against 4.639 unmarked); 128B measured as unmarked (4.640).
static __device__ __forceinline__ void k_cuda_pdl_early_cp16(void *smem, const void *gmem,
							      bool valid)
{
	unsigned dst = (unsigned)__cvta_generic_to_shared(smem);

	asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst),
		     "l"(gmem), "r"(valid ? 16 : 0)
		     : "memory");
}

static inline int k_cuda_pdl_enabled(void)
{
	return k_cuda_tuning()->cuda_pdl != 0;
}

// Which relays run: k_cuda_tuning()->pdl_relay (KDEC_PDL_RELAY) has one bit a kind of
// relay kernel; under programmatic launch only.
enum k_cuda_relay { K_CUDA_RELAY_NORM = 1, K_CUDA_RELAY_QKV_POST = 2, K_CUDA_RELAY_ATTN = 4,
		    K_CUDA_RELAY_MERGE = 8 };

static inline int k_cuda_pdl_relay_enabled(enum k_cuda_relay which)
{
	return k_cuda_pdl_enabled() && (k_cuda_tuning()->pdl_relay & which) != 0;
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
