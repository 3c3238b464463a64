/* Rotary position embedding on the CPU: the rotation, by the frequency table of
 * kernels/rope_freq.c. */
#include <math.h>

#include "kernels/cpu/k_cpu.h"

/* x1' = x1 c - x2 s, x2' = x2 c + x1 s: HF's q * cos + rotate_half(q) * sin, with
 * each product rounded before the sum as torch does. */
static void rope_rotate(float *x /* (dim) */, const struct k_rope *rope,
			const float *c, const float *s /* (dim / 2) */)
{
	int half = rope->dim / 2;
	int step = rope->interleaved ? 2 : 1;	/* index distance from x1 to x2 */
	int gap = rope->interleaved ? 1 : half;

	for (int i = 0; i < half; i++) {
		float *p1 = x + i * step;
		float *p2 = p1 + gap;
		float x1 = *p1, x2 = *p2;
		float a = x1 * c[i], b = x2 * s[i];
		float d = x2 * c[i], e = x1 * s[i];

		*p1 = a - b;
		*p2 = d + e;
	}
}

/* cos/sin of the float32 angle pos * inv_freq, correctly rounded via double. */
static void rope_cos_sin(const struct k_rope *rope, int32_t pos, float *c, float *s)
{
	for (int i = 0; i < rope->dim / 2; i++) {
		float angle = (float)pos * rope->inv_freq[i];

		c[i] = (float)cos((double)angle) * rope->attn_factor;
		s[i] = (float)sin((double)angle) * rope->attn_factor;
	}
}

void k_cpu_rope(const struct k_rope *rope, float *x, int n_rows, int n_heads,
		int row_stride, int head_stride, const int32_t *pos /* (n_rows) */)
{
	float c[K_ROPE_MAX_HALF], s[K_ROPE_MAX_HALF];

	for (int r = 0; r < n_rows; r++) {
		rope_cos_sin(rope, pos[r], c, s);
		for (int h = 0; h < n_heads; h++)
			rope_rotate(x + (size_t)r * row_stride + (size_t)h * head_stride,
				    rope, c, s);
	}
}
