// The attention inputs of an MLA layer in one launch, after its q and kv_a projections:
// RMSNorm of the kv_lora latent, RoPE of the shared rope key and of every head's q_pe,
// and [latent ; rotated key] rounded to bf16 into each row's cache slot; q either in
// place or out of a fused projection's rows into its own buffer. The arithmetic
// is that of rmsnorm.cu, rope.cu and kv_write.cu (fp64 sum of squares, fp64 cos/sin
// rounded to fp32, no FMA), so the fused and the op-by-op paths agree to the order of
// one fp64 sum.
#include <cstdlib>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"
#include "kernels/cuda/ops/mla_cache_row.cuh"

#define MLAP_THREADS 256
#define MLAP_MAX_LORA 2048	// latent values per row, held in registers
#define MLAP_PER (MLAP_MAX_LORA / MLAP_THREADS)
#define MLAP_MAX_HALF 512	// rotary pairs, as the cos/sin table in shared memory
#define MLAP_QPRE 2		// q pairs per thread loaded before the trig (all of V2-Lite's)
#define MLAP_CPRE 8		// copied q values per thread loaded up front (V2-Lite's nope)

namespace {	// kernels and their helpers stay private to this file


// From a separate source, what the in-place path leaves as it is: each head's nope_dim
// values before q_pe and its pe values past rot_dim. Copied value i of a row sits at
// this offset from the row's q_pe (heads q_hs apart, in source and destination alike).
__device__ __forceinline__ long mlap_copy_at(const k_cuda_mla_post_args &a, int i)
{
	const int nope = a.nope_dim, per = max(nope + a.pe_dim - a.rot_dim, 1);
	const int h = i / per, j = i % per;

	return (long)h * a.q_hs + (j < nope ? j - nope : a.rot_dim + j - nope);
}

// The row's cos/sin table at position p, scaled by attn_factor, into cs.
__device__ __forceinline__ void mlap_table(const k_cuda_mla_post_args &a, float p, int half,
					   float (*cs)[MLAP_MAX_HALF])
{
	for (int i = threadIdx.x; i < half; i += MLAP_THREADS)
		k_cuda_rope_cs(p, k_cuda_pdl_early(a.inv_freq + i), a.attn_factor, cs[0][i], cs[1][i]);
}

// Block (row r). The row's cos/sin table (fp64 sincos: the long pole) needs only the
// step's positions and the constant inv_freq, which no kernel of the step writes (they
// are uploaded before its first kernel, and a kernel launched by PDL starts only once
// the one two before it has completed): so it is computed before the PDL wait, while
// the projection before this kernel drains, as the attention kernel reads its block
// tables early. KDEC_MLA_POST_EARLY=0: after the wait, as before (the table then
// computed while the latent and q loads, issued first, arrive). Then q_pe of every
// head in place and, for slot >= 0, the normalised latent and the rotated key into
// the cache.
template <bool EARLY>
__global__ void __launch_bounds__(MLAP_THREADS) mla_post_kernel(const k_cuda_mla_post_args a)
{
	__shared__ float cs[2][MLAP_MAX_HALF];
	__shared__ double red[MLAP_THREADS / 32];
	const int r = blockIdx.x, L = a.kv_lora, half = a.rot_dim / 2, nq = a.n_heads * half;
	const int step = a.interleaved ? 2 : 1, gap = a.interleaved ? 1 : half;
	const float *kv = a.kv + (size_t)r * a.kv_rs;
	float *qr = a.q_pe + (size_t)r * a.q_rs;
	const float *qs = a.q_src_pe ? a.q_src_pe + (size_t)r * a.q_src_rs : qr;
	const int nc = a.q_src_pe ? a.n_heads * (a.nope_dim + a.pe_dim - a.rot_dim) : 0;
	float lat[MLAP_PER], q1[MLAP_QPRE], q2[MLAP_QPRE], cq[MLAP_CPRE];
	double ss = 0.0;
	int32_t slot;
	float p;

	if (EARLY) {	// step inputs
		slot = k_cuda_pdl_early(a.slots + r);
		p = (float)k_cuda_pdl_early(a.pos + r);
		mlap_table(a, p, half, cs);
		k_cuda_pdl_wait();
	} else {
		k_cuda_pdl_wait();
		slot = a.slots[r];
		p = (float)a.pos[r];
	}
#pragma unroll
	for (int k = 0; k < MLAP_PER; k++) {
		const int i = threadIdx.x + k * MLAP_THREADS;

		lat[k] = i < L ? kv[i] : 0.0f;
	}
#pragma unroll
	for (int k = 0; k < MLAP_QPRE; k++) {
		const int it = threadIdx.x + k * MLAP_THREADS;
		const float *p1 = qs + (size_t)(it / max(half, 1)) * a.q_hs + it % max(half, 1) * step;

		q1[k] = it < nq ? p1[0] : 0.0f;
		q2[k] = it < nq ? p1[gap] : 0.0f;
	}
#pragma unroll
	for (int k = 0; k < MLAP_CPRE; k++) {	// nc is 0 unless q comes from q_src_pe
		const int i = threadIdx.x + k * MLAP_THREADS;

		cq[k] = i < nc ? qs[mlap_copy_at(a, i)] : 0.0f;
	}
	if (!EARLY)
		mlap_table(a, p, half, cs);
#pragma unroll
	for (int k = 0; k < MLAP_PER; k++)
		ss += (double)lat[k] * (double)lat[k];	// zeros past L add nothing
	ss = k_cuda_block_sum_d<MLAP_THREADS>(ss, red);	// its barrier also publishes the cos/sin table
#pragma unroll
	for (int k = 0; k < MLAP_QPRE; k++) {
		const int it = threadIdx.x + k * MLAP_THREADS, i = it % max(half, 1);
		float *p1 = qr + (size_t)(it / max(half, 1)) * a.q_hs + i * step;

		if (it < nq)
			k_cuda_rope_rotate(q1[k], q2[k], cs[0][i], cs[1][i], p1[0], p1[gap]);
	}
	for (int it = threadIdx.x + MLAP_QPRE * MLAP_THREADS; it < nq; it += MLAP_THREADS) {
		const int h = it / half, i = it % half;
		const float *s1 = qs + (size_t)h * a.q_hs + i * step;
		float *p1 = qr + (size_t)h * a.q_hs + i * step;

		k_cuda_rope_rotate(s1[0], s1[gap], cs[0][i], cs[1][i], p1[0], p1[gap]);
	}
#pragma unroll
	for (int k = 0; k < MLAP_CPRE; k++) {
		const int i = threadIdx.x + k * MLAP_THREADS;

		if (i < nc)
			qr[mlap_copy_at(a, i)] = cq[k];
	}
	for (int i = threadIdx.x + MLAP_CPRE * MLAP_THREADS; i < nc; i += MLAP_THREADS)
		qr[mlap_copy_at(a, i)] = qs[mlap_copy_at(a, i)];
	if (slot < 0)
		return;

	uint16_t *dst = a.cache + (size_t)slot * (size_t)(L + a.pe_dim);
	const float rs = 1.0f / sqrtf((float)(ss / L) + a.eps);	// as rmsnorm_rs.cuh's k_rms_row_rs

	mla_cache_row<MLAP_THREADS>(dst, lat, a.norm, rs, kv, cs[0], cs[1], L, half, step, gap,
				    a.pe_dim);
}

}	// namespace

// ---- launchers --------------------------------------------------------------

// k_cuda_tuning()->mla_post_early 0 (KDEC_MLA_POST_EARLY=0): the cos/sin table after
// the PDL wait (see mla_post_kernel). Read at each call: the tests run both.
static bool mlap_early(void)
{
	return k_cuda_tuning()->mla_post_early != 0;
}

extern "C" int k_cuda_mla_post(cudaStream_t s, const struct k_cuda_mla_post_args *a)
{
	if (!a || a->rows < 0 || a->n_heads < 0 || a->kv_lora < 1 || a->kv_lora > MLAP_MAX_LORA ||
	    a->rot_dim < 0 || a->rot_dim % 2 || a->rot_dim / 2 > MLAP_MAX_HALF ||
	    a->pe_dim < a->rot_dim || a->kv_rs < (long)a->kv_lora + a->pe_dim ||
	    (a->rot_dim && !a->inv_freq) || (a->n_heads && a->q_hs < a->rot_dim) ||
	    (a->q_src_pe && (a->nope_dim < 0 || a->q_hs < a->nope_dim + a->pe_dim))) {
		k_cuda_log("k_cuda_mla_post: rows %d, heads %d, kv_lora %d (1..%d), rope %d of %d "
			   "(even, <= %d pairs), kv row stride %ld unsupported", a ? a->rows : -1,
			   a ? a->n_heads : -1, a ? a->kv_lora : -1, MLAP_MAX_LORA,
			   a ? a->rot_dim : -1, a ? a->pe_dim : -1, MLAP_MAX_HALF,
			   a ? a->kv_rs : -1L);
		return -EINVAL;
	}
	if (a->rows == 0)
		return 0;
	k_cuda_launch_pdl(s, dim3(a->rows), MLAP_THREADS, 0,
			  mlap_early() ? mla_post_kernel<true> : mla_post_kernel<false>, *a);
	return K_CUDA_LAUNCHED("mla_post");
}
