/* The fp32 dot product the attention kernels share. Internal to kernels/cpu. */
#ifndef KD_KERNELS_CPU_K_CPU_DOT_H
#define KD_KERNELS_CPU_K_CPU_DOT_H

/* Eight partial sums combined pairwise: a fixed order (so results do not depend on
 * the batch) that the compiler vectorises. */
static inline float k_dot_f32(const float *a, const float *b, int n)
{
	float acc[8] = { 0 };
	int nv = n - n % 8;
	int i;

	for (i = 0; i < nv; i += 8)
		for (int j = 0; j < 8; j++)
			acc[j] += a[i + j] * b[i + j];
	for (; i < n; i++)
		acc[i - nv] += a[i] * b[i];
	return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#endif
