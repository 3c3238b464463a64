// The positive and negative controls of tests/pdl_order.sh, built only for it (never
// linked): pdl_planted_bad reads x, which the kernel before it writes, before its
// grid-dependency wait, the hazard the check exists for; pdl_planted_good reads its
// weights early through k_cuda_pdl_early and x after the wait, as the rule allows.
#include "kernels/cuda/launch_check.cuh"

__global__ void pdl_planted_bad(float *y, const float *x, const float *w, int n)
{
	const int i = blockIdx.x * blockDim.x + threadIdx.x;
	const float xi = i < n ? x[i] : 0.0f;	// produced: must come after the wait

	k_cuda_pdl_wait();
	if (i < n)
		y[i] = xi * w[i];
}

__global__ void pdl_planted_good(float *y, const float *x, const float *w, int n)
{
	const int i = blockIdx.x * blockDim.x + threadIdx.x;
	const float wi = i < n ? k_cuda_pdl_early(w + i) : 0.0f;	// a weight

	k_cuda_pdl_wait();
	if (i < n)
		y[i] = x[i] * wi;
}

// pdl_planted_trigger lets the next launch start before its own wait, which only a
// relay may (k_cuda_pdl_relay): the check must report it. pdl_planted_relay does the
// same as a named relay (the comment below) and must pass.
__global__ void pdl_planted_trigger(float *y, const float *x, const float *w, int n)
{
	const int i = blockIdx.x * blockDim.x + threadIdx.x;

	cudaTriggerProgrammaticLaunchCompletion();
	k_cuda_pdl_wait();
	if (i < n)
		y[i] = x[i] * w[i];
}

// pdl-order: relay pdl_planted_relay
__global__ void pdl_planted_relay(float *y, const float *x, const float *w, int n)
{
	const int i = blockIdx.x * blockDim.x + threadIdx.x;

	k_cuda_pdl_relay(1);
	k_cuda_pdl_wait();
	if (i < n)
		y[i] = x[i] * w[i];
}
