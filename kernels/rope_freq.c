/* RoPE frequency tables (kernels/ops.h): inverse frequencies for every HF rope type,
 * computed in float32 step by step as transformers' modeling_rope_utils does. Shared
 * by every backend: the CPU rotates by them, the CUDA backend uploads them. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"

#define ROPE_PI 3.14159265358979323846

/* HF default: 1 / base ** (arange(0, dim, 2).float() / dim), every op in float32. */
static void rope_default(float *inv /* (dim / 2) */, const struct k_rope_params *p)
{
	float base = (float)p->theta;

	for (int i = 0; i < p->dim / 2; i++) {
		float e = (float)(2 * i) / (float)p->dim;

		inv[i] = 1.0f / powf(base, e);
	}
}

/* HF llama3: long wavelengths are divided by factor, short ones kept, the band
 * between blended. Python scalars meet float32 tensors, so they round to float. */
static void rope_llama3(float *inv /* (dim / 2) */, const struct k_rope_params *p)
{
	float factor = (float)p->factor;
	float lff = (float)p->low_freq_factor;
	float orig = (float)p->original_max_pos;
	float low_wl = (float)(p->original_max_pos / p->low_freq_factor);
	float high_wl = (float)(p->original_max_pos / p->high_freq_factor);
	float band = (float)(p->high_freq_factor - p->low_freq_factor);

	rope_default(inv, p);
	for (int i = 0; i < p->dim / 2; i++) {
		float wl = (float)(2.0 * ROPE_PI) / inv[i];
		float f = wl > low_wl ? inv[i] / factor : inv[i];

		if (!(wl < high_wl) && !(wl > low_wl)) {
			float smooth = (orig / wl - lff) / band;

			f = (1.0f - smooth) * f / factor + smooth * f;
		}
		inv[i] = f;
	}
}

/* HF find_correction_dim, in double like the Python. */
static double yarn_corr_dim(double rot, int dim, double base, double orig)
{
	return (dim * log(orig / (rot * 2.0 * ROPE_PI))) / (2.0 * log(base));
}

static double yarn_mscale(double scale, double m)
{
	return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

static float yarn_attn_factor(const struct k_rope_params *p)
{
	if (p->attention_factor > 0)
		return (float)p->attention_factor;
	if (p->mscale != 0 && p->mscale_all_dim != 0)
		return (float)(yarn_mscale(p->factor, p->mscale) /
			       yarn_mscale(p->factor, p->mscale_all_dim));
	return (float)yarn_mscale(p->factor, 1.0);
}

/* HF yarn: a linear ramp over the rotary pairs between interpolated (1 / (factor *
 * pos_freq)) and extrapolated (1 / pos_freq) frequencies. */
static void rope_yarn(float *inv /* (dim / 2) */, const struct k_rope_params *p)
{
	double beta_fast = p->beta_fast != 0 ? p->beta_fast : 32.0;
	double beta_slow = p->beta_slow != 0 ? p->beta_slow : 1.0;
	double low = yarn_corr_dim(beta_fast, p->dim, p->theta, p->original_max_pos);
	double high = yarn_corr_dim(beta_slow, p->dim, p->theta, p->original_max_pos);
	float base = (float)p->theta, factor = (float)p->factor;
	float flow, fspan;

	if (p->truncate) {
		low = floor(low);
		high = ceil(high);
	}
	low = low > 0 ? low : 0;
	high = high < p->dim - 1 ? high : p->dim - 1;
	if (low == high)
		high += 0.001;
	flow = (float)low;
	fspan = (float)(high - low);

	for (int i = 0; i < p->dim / 2; i++) {
		float pos_freq = powf(base, (float)(2 * i) / (float)p->dim);
		float extrap = 1.0f / pos_freq;
		float interp = 1.0f / (factor * pos_freq);
		float ramp = ((float)i - flow) / fspan;
		float ef;

		ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
		ef = 1.0f - ramp;
		inv[i] = interp * (1.0f - ef) + extrap * ef;
	}
}

static int rope_check(const struct k_rope_params *p)
{
	if (p->dim <= 0 || p->dim % 2 || p->dim / 2 > K_ROPE_MAX_HALF || !(p->theta > 0))
		return -EINVAL;
	switch (p->type) {
	case K_ROPE_DEFAULT:
		return 0;
	case K_ROPE_LINEAR:
		return p->factor > 0 ? 0 : -EINVAL;
	case K_ROPE_LLAMA3:
		if (!(p->factor > 0) || !(p->low_freq_factor > 0) ||
		    !(p->high_freq_factor > p->low_freq_factor) || !(p->original_max_pos > 0))
			return -EINVAL;
		return 0;
	case K_ROPE_YARN:
		if (!(p->factor > 0) || !(p->original_max_pos > 0) || p->beta_fast < 0 ||
		    p->beta_slow < 0)
			return -EINVAL;
		return 0;
	}
	return -EINVAL;
}

int k_rope_init(struct k_rope *rope, const struct k_rope_params *p)
{
	int ret = rope_check(p);

	memset(rope, 0, sizeof(*rope));
	if (ret)
		return ret;
	rope->inv_freq = calloc((size_t)p->dim / 2, sizeof(float));
	if (!rope->inv_freq)
		return -ENOMEM;
	rope->dim = p->dim;
	rope->interleaved = p->interleaved;
	rope->attn_factor = 1.0f;

	switch (p->type) {
	case K_ROPE_DEFAULT:
		rope_default(rope->inv_freq, p);
		break;
	case K_ROPE_LINEAR:
		rope_default(rope->inv_freq, p);
		for (int i = 0; i < p->dim / 2; i++)
			rope->inv_freq[i] /= (float)p->factor;
		break;
	case K_ROPE_LLAMA3:
		rope_llama3(rope->inv_freq, p);
		break;
	case K_ROPE_YARN:
		rope_yarn(rope->inv_freq, p);
		rope->attn_factor = yarn_attn_factor(p);
		break;
	}
	for (int i = 0; i < p->dim / 2; i++)
		rope->inv_freq[i] = k_round_to(rope->inv_freq[i], p->freq_dtype);
	return 0;
}

void k_rope_fini(struct k_rope *rope)
{
	if (!rope)
		return;
	free(rope->inv_freq);
	rope->inv_freq = NULL;
}

