// The order the samplers rank logits by, as one unsigned key a radix select or a
// histogram can count: a larger logit, a larger key; -0 ranks as +0 (they compare
// equal); NaN is 0, below -inf (0x007fffff), so it is never a candidate. Used by the
// sampler (sample/sample.cu) and the vocabulary slices' top-k (comm/topk_slice.cu),
// which must agree on ties bit for bit.
#ifndef KD_KERNELS_CUDA_LOGIT_KEY_CUH
#define KD_KERNELS_CUDA_LOGIT_KEY_CUH

__device__ __forceinline__ unsigned k_cuda_logit_key(float l)
{
	unsigned u = __float_as_uint(l);

	if (l != l)
		return 0;
	if (l == 0.0f)
		u = 0;
	return u & 0x80000000u ? ~u : u | 0x80000000u;
}

#endif
