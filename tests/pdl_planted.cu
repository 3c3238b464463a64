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
