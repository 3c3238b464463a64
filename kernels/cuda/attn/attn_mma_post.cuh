// qkv_post's work (q/k RMSNorm, RoPE, the K/V append) as the GQA tensor-core decode
// kernel does it in its prologue (attn_mma.cu's POST shapes); included there only.
#ifndef KD_KERNELS_CUDA_ATTN_MMA_POST_CUH
#define KD_KERNELS_CUDA_ATTN_MMA_POST_CUH

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/attn/attn_mma.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

// Where qkv_post's work runs in the attention launch (k_cuda_attn_gqa_qkv): a.q is the
// fused projection's raw q (qkv_post's q_src), and the new token of each row, its last
// (a decode step: every row its own sequence), has its K/V row appended here by the one
// block whose split holds it. The bits are qkv_post_early_kernel's (qkv_post.cu): the
// same thread of 128 holds the same values, the same fp64 block sum, the same rounded
// products, so the cache rows are that kernel's, and q's fp32 values too.
//
// Scratch: stage ST - 1 of K is free until the loop's first barrier (no tile is issued
// into it before); with q in registers its first MMA_Q * QS bf16 stage q, and past them
// lie a warp's 128 floats for q (mma_post_q), the K row, the block sum's doubles, and
// RoPE's cos and sin per pair (one fp64 sincos a pair for the block, not one per value
// of each head: qkv_post's angles, shared by q and k).
#define MMA_POST_WARP_FLOATS 128

template <int DK>
struct mma_post_scratch {
	static constexpr unsigned q = 2u * MMA_Q * (DK + 8);	// bytes into stage ST - 1
	static constexpr unsigned k = q + 4u * MMA_WARPS * MMA_POST_WARP_FLOATS;
	static constexpr unsigned red = k + 4u * DK;
	static constexpr unsigned cs = red + 8u * MMA_WARPS;	// float2 (DK / 2)
	static constexpr unsigned total = cs + 4u * DK;
	static_assert(red % 8 == 0 && cs % 8 == 0, "alignment");
};

// cs[i] = (cos, sin) of pair i's angle at the row's position, as qkv_post computes it;
// threads below rope_dim / 2. The caller's barrier publishes it.
__device__ __forceinline__ void mma_post_cs_table(const k_cuda_qkv_args &p, int r, float2 *cs)
{
	const int half = p.rope_dim / 2;
	const float ps = (float)p.pos[r];

	for (int i = threadIdx.x; i < half; i += MMA_THREADS) {
		float c, sn;

		k_cuda_rope_cs(ps, p.inv_freq[i], p.attn_factor, c, sn);
		cs[i] = make_float2(c, sn);
	}
}

// The row's new K (k_norm, rope) and V of kv head kvh, rounded to bf16 into the cache at
// its slot (none where the slot is < 0), published for the block's cp.async copies (L2)
// before any of them is issued. All threads (block-uniform call); x: DK floats, red:
// MMA_WARPS doubles of shared memory, cs: mma_post_cs_table's, published.
template <int DK>
__device__ __forceinline__ void mma_post_kv(const k_cuda_qkv_args &p, int r, int kvh, float *x,
					    double *red, const float2 *cs)
{
	constexpr int PER = (DK + MMA_THREADS - 1) / MMA_THREADS;
	const int D = p.head_dim, half = p.rope_dim / 2;
	const int32_t slot = p.slots[r];
	const float *ks = p.k_src + (size_t)r * p.k_rs + (size_t)kvh * D;
	const float *vs = p.v_src + (size_t)r * p.v_rs + (size_t)kvh * D;
	float xv[PER], vv[PER];

	if (slot < 0)
		return;
#pragma unroll
	for (int k = 0; k < PER; k++) {
		const int i = threadIdx.x + k * MMA_THREADS;

		xv[k] = vv[k] = 0.0f;
		if (i < D) {
			xv[k] = ks[i];
			vv[k] = vs[i];
		}
	}
	if (p.k_norm) {
		double ss = 0.0;
		float rs;

#pragma unroll
		for (int k = 0; k < PER; k++)
			if (threadIdx.x + k * MMA_THREADS < D)
				ss += (double)xv[k] * (double)xv[k];
		ss = k_cuda_block_sum_d<MMA_THREADS>(ss, red);
		rs = 1.0f / sqrtf((float)(ss / D) + p.eps);
#pragma unroll
		for (int k = 0; k < PER; k++) {
			const int i = threadIdx.x + k * MMA_THREADS;

			if (i < D)
				xv[k] = __fmul_rn(p.k_norm[i], __fmul_rn(xv[k], rs));
		}
	}
#pragma unroll
	for (int k = 0; k < PER; k++)
		if (threadIdx.x + k * MMA_THREADS < D)
			x[threadIdx.x + k * MMA_THREADS] = xv[k];
	__syncthreads();
	if (half > 0) {
		const int step = p.interleaved ? 2 : 1, gap = p.interleaved ? 1 : half;

		for (int i = threadIdx.x; i < half; i += MMA_THREADS)
			k_cuda_rope_rotate(x[i * step], x[i * step + gap], cs[i].x, cs[i].y,
					   x[i * step], x[i * step + gap]);
		__syncthreads();
	}
	const size_t off = (size_t)slot * p.kv_heads * D + (size_t)kvh * D;

#pragma unroll
	for (int k = 0; k < PER; k++) {
		const int i = threadIdx.x + k * MMA_THREADS;

		if (i < D) {
			p.k_cache[off + i] = attn_bf16(x[i]);
			p.v_cache[off + i] = attn_bf16(vv[k]);
		}
	}
	__threadfence();	// in L2 before the copies (cp.async.cg reads L2) go out
	__syncthreads();
}

// RoPE's cos and sin for the 4 q values (lane % QV) * 4 + e a lane holds of every head
// it stages (the same dims in each): those of element i's pair, from the table (cs).
// Elements past the rotary dims get none (never used).
template <int QV>
__device__ __forceinline__ void mma_post_cs(const k_cuda_qkv_args &p, const float2 *cs,
					    float (&c)[4], float (&sn)[4])
{
	const int half = p.rope_dim / 2, lane = threadIdx.x % 32;

#pragma unroll
	for (int e = 0; e < 4; e++) {
		const int i = lane % QV * 4 + e;
		const int pi = p.interleaved ? i / 2 : (i < half ? i : i - half);

		c[e] = sn[e] = 0.0f;
		if (i < 2 * half) {
			c[e] = cs[pi].x;
			sn[e] = cs[pi].y;
		}
	}
}

// One staging pass of q (qx: the lane's float4 of head lane / QV of the warp's 32 / QV
// heads, dims lane % QV * 4 ..): the raw projection to qkv_post's q (q_norm, rope), in
// place. The norm's sum of squares adds as qkv_post's block sum does (thread t of 128
// holding dim t, a butterfly per warp, the 4 warps' sums in order), so q's fp32 values
// are its bits. sc: the warp's MMA_POST_WARP_FLOATS floats. All lanes of the warp.
template <int QV>
__device__ __forceinline__ void mma_post_q(const k_cuda_qkv_args &p, float4 &qx, float *sc,
					   const float (&c)[4], const float (&sn)[4])
{
	constexpr int HW = 32 / QV, HD = QV * 4;	// heads a warp holds, their stride
	const int lane = threadIdx.x % 32, D = p.head_dim, half = p.rope_dim / 2;
	const int i0 = lane % QV * 4, hb = lane / QV * HD;
	float x[4] = { qx.x, qx.y, qx.z, qx.w };

	static_assert(32 % QV == 0 && HW * HD == MMA_POST_WARP_FLOATS, "a warp's heads");
	*(float4 *)(sc + lane * 4) = qx;
	__syncwarp();
	if (p.q_norm) {
		double mine = 0.0;

#pragma unroll
		for (int hw = 0; hw < HW; hw++) {
			double ss = 0.0;

#pragma unroll
			for (int w = 0; w < MMA_THREADS / 32; w++) {
				const int i = w * 32 + lane;
				double v = 0.0;

				if (i < D && i < HD)
					v = (double)sc[hw * HD + i] * (double)sc[hw * HD + i];
				for (int o = 16; o > 0; o >>= 1)
					v += __shfl_xor_sync(0xffffffffu, v, o);
				ss += v;
			}
			if (hw == lane / QV)
				mine = ss;
		}
		const float rs = 1.0f / sqrtf((float)(mine / D) + p.eps);

#pragma unroll
		for (int e = 0; e < 4; e++)
			if (i0 + e < D)
				x[e] = __fmul_rn(p.q_norm[i0 + e], __fmul_rn(x[e], rs));
		__syncwarp();
		*(float4 *)(sc + lane * 4) = make_float4(x[0], x[1], x[2], x[3]);
		__syncwarp();
	}
	if (half > 0) {
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int i = i0 + e;
			const bool first = p.interleaved ? i % 2 == 0 : i < half;
			const int other = p.interleaved ? i ^ 1 : (first ? i + half : i - half);
			float o1, o2;

			if (i >= 2 * half)
				continue;
			if (first)
				k_cuda_rope_rotate(x[e], sc[hb + other], c[e], sn[e], o1, o2);
			else
				k_cuda_rope_rotate(sc[hb + other], x[e], c[e], sn[e], o2, o1);
			x[e] = o1;	// self's new value (the call's second output when !first)
		}
	}
	__syncwarp();	// sc read before the next pass writes it
	qx = make_float4(x[0], x[1], x[2], x[3]);
}

#endif
