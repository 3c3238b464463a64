/* The C entry points of the CUDA kernels. Host code includes only this header; the
 * kernels live in .cu files behind it. Every function returns 0 or a negative errno
 * (-ENODEV: no usable GPU; -EIO: a CUDA call failed, logged with call, file, line). */
#ifndef KD_KERNELS_CUDA_K_CUDA_H
#define KD_KERNELS_CUDA_K_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

/* Number of visible GPUs: 0 where the driver or the device is missing. */
int k_cuda_device_count(int *count);

/* Name and memory of device dev; name receives at most name_len bytes. */
int k_cuda_device_describe(int dev, char *name, unsigned long name_len, double *mem_gib,
			   int *sm_major, int *sm_minor);

/* Self-test of the toolchain and device: y = a * x + y on the GPU, n floats of host
 * memory in and out. */
int k_cuda_axpy_host(int dev, int n, float a, const float *x, float *y);

/* Starts (on = 1) or stops the profiler's collection on the current device, so that a
 * profiler run with collection off at start (ncu --profile-from-start off) sees only
 * the work in between. */
int k_cuda_profile_range(int on);

#ifdef __cplusplus
}
#endif

#endif
