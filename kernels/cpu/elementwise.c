/* CPU elementwise ops: embedding lookup, RMSNorm, residual add, SwiGLU.
 * Each follows the float32 order of operations of HF transformers. */
#include <math.h>

#include "kernels/cpu/k_cpu.h"

void k_cpu_embed(float *out /* (n, dim) */, const int32_t *ids /* (n) */, int n,
		 const void *table /* (vocab, dim) */, enum k_dtype dtype, int dim)
{
	size_t esz = k_dtype_size(dtype);

	for (int i = 0; i < n; i++) {
		const char *row = (const char *)table + (size_t)ids[i] * (size_t)dim * esz;

		k_row_to_f32(out + (size_t)i * dim, row, dtype, (size_t)dim);
	}
}

/* Sum of squares in double: the mean then rounds once to float, which is at
 * least as close to torch's fp32 cascade sum as any fp32 order would be. */
static float row_mean_sq(const float *x /* (dim) */, int dim)
{
	double ss = 0.0;

	for (int i = 0; i < dim; i++)
		ss += (double)x[i] * (double)x[i];
	return (float)(ss / dim);
}

/* HF: w * (x * rsqrt(var + eps)); the product x * rsqrt rounds to float before w. */
static void rmsnorm_row_f32(float *out, const float *x, const float *w, int dim, float r)
{
	for (int i = 0; i < dim; i++) {
		float xn = x[i] * r;

		out[i] = w[i] * xn;
	}
}

static void rmsnorm_row_u16(float *out, const float *x, const uint16_t *w,
			    enum k_dtype dtype, int dim, float r)
{
	if (dtype == K_BF16) {
		for (int i = 0; i < dim; i++) {
			float xn = x[i] * r;

			out[i] = k_bf16_to_f32(w[i]) * xn;
		}
	} else {
		for (int i = 0; i < dim; i++) {
			float xn = x[i] * r;

			out[i] = k_f16_to_f32(w[i]) * xn;
		}
	}
}

void k_cpu_rmsnorm(float *out, int out_stride, const float *x, int x_stride,
		   const void *w /* (dim) */, enum k_dtype dtype, int rows, int dim, float eps)
{
	for (int r = 0; r < rows; r++) {
		const float *xr = x + (size_t)r * x_stride;
		float *orow = out + (size_t)r * out_stride;
		float var = row_mean_sq(xr, dim);
		float rs = 1.0f / sqrtf(var + eps);	/* torch.rsqrt: sqrt, then divide */

		if (dtype == K_F32)
			rmsnorm_row_f32(orow, xr, w, dim, rs);
		else
			rmsnorm_row_u16(orow, xr, w, dtype, dim, rs);
	}
}

void k_cpu_add(float *y, const float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		y[i] += x[i];
}

/* HF's SiLU is x * sigmoid(x); g / (1 + exp(-g)) is the form torch evaluates. */
void k_cpu_silu_mul(float *out, const float *gate, const float *up, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		float g = gate[i];
		float s = g / (1.0f + expf(-g));

		out[i] = s * up[i];
	}
}
