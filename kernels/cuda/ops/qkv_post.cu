// The attention inputs of a GQA layer in one launch: per head, the optional q/k
// RMSNorm (Qwen3), RoPE, then q to its fp32 buffer and k, v rounded to bf16 into their
// cache slots. The arithmetic is that of rmsnorm.cu, rope.cu and kv_write.cu (same
// roundings, fp64 sum of squares), so the fused and the separate paths agree to the
// order of one fp64 sum.
#include <cstdlib>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define QKV_THREADS 128
#define QKV_MAX_DIM 512		// head_dim held in shared memory

namespace {	// kernels and their helpers stay private to this file

// RoPE of the pair (x[at], x[at + gap]) by angle p * inv_freq.
__device__ __forceinline__ void qkv_rotate(float *x, int at, int gap, float p, float inv_freq,
					   float attn_factor)
{
	float c, sn;

	k_cuda_rope_cs(p, inv_freq, attn_factor, c, sn);
	k_cuda_rope_rotate(x[at], x[at + gap], c, sn, x[at], x[at + gap]);
}

// Block (head j of q heads then kv heads, row r). A kv-head block also copies v.
// pdl-order: relay qkv_post_kernel
__global__ void __launch_bounds__(QKV_THREADS) qkv_post_kernel(const k_cuda_qkv_args a, int relay)
{
	__shared__ float x[QKV_MAX_DIM];
	__shared__ double red[QKV_THREADS / 32];
	const int j = blockIdx.x, r = blockIdx.y, D = a.head_dim, half = a.rope_dim / 2;
	const bool is_q = j < a.n_heads;
	const int kvh = j - a.n_heads;
	const float *src = is_q ? a.q_src + (size_t)r * a.q_rs + (size_t)j * D
				: a.k_src + (size_t)r * a.k_rs + (size_t)kvh * D;
	const float *w = is_q ? a.q_norm : a.k_norm;
	int32_t slot;
	size_t cache_off;

	k_cuda_pdl_relay(relay);
	k_cuda_pdl_wait();
	slot = a.slots[r];
	cache_off = (size_t)slot * a.kv_heads * D + (size_t)kvh * D;
	if (!is_q && slot < 0)
		return;
	for (int i = threadIdx.x; i < D; i += QKV_THREADS)
		x[i] = src[i];
	if (w) {
		double ss = 0.0;
		float rs;

		for (int i = threadIdx.x; i < D; i += QKV_THREADS)
			ss += (double)x[i] * (double)x[i];
		ss = k_cuda_block_sum_d<QKV_THREADS>(ss, red);
		rs = 1.0f / sqrtf((float)(ss / D) + a.eps);
		for (int i = threadIdx.x; i < D; i += QKV_THREADS)
			x[i] = __fmul_rn(w[i], __fmul_rn(x[i], rs));
	}
	__syncthreads();
	if (half > 0) {
		const float p = (float)a.pos[r];
		const int step = a.interleaved ? 2 : 1, gap = a.interleaved ? 1 : half;

		for (int i = threadIdx.x; i < half; i += QKV_THREADS)
			qkv_rotate(x, i * step, gap, p, a.inv_freq[i], a.attn_factor);
		__syncthreads();
	}
	if (is_q) {
		float *dst = a.q + ((size_t)r * a.n_heads + j) * D;

		for (int i = threadIdx.x; i < D; i += QKV_THREADS)
			dst[i] = x[i];
		return;
	}
	const float *vs = a.v_src + (size_t)r * a.v_rs + (size_t)kvh * D;

	for (int i = threadIdx.x; i < D; i += QKV_THREADS) {
		a.k_cache[cache_off + i] = k_cuda_bf16_rn(x[i]);
		a.v_cache[cache_off + i] = k_cuda_bf16_rn(vs[i]);
	}
}

#define QKV_PER (QKV_MAX_DIM / QKV_THREADS)	// values of a head a thread holds

// qkv_post_kernel's blocks and arithmetic (the same bits), its loads reordered: the
// block's weights and frequencies (constants) go out before the PDL wait, then every
// input at once (the row's pos and slot, the head of q or k, and v), where the kernel
// above waits on one after another (slot, then the head, then the weights, then the
// frequencies and pos): 4 memory latencies a block, and at Llama batch 64 its 2560
// blocks are 1.2 waves (16 a SM), so a step pays them twice (6.1 us measured).
// pdl-order: relay qkv_post_early_kernel
__global__ void __launch_bounds__(QKV_THREADS) qkv_post_early_kernel(const k_cuda_qkv_args a,
								     int relay)
{
	__shared__ float x[QKV_MAX_DIM];
	__shared__ double red[QKV_THREADS / 32];
	const int j = blockIdx.x, r = blockIdx.y, D = a.head_dim, half = a.rope_dim / 2;
	const bool is_q = j < a.n_heads;
	const int kvh = j - a.n_heads;
	const float *src = is_q ? a.q_src + (size_t)r * a.q_rs + (size_t)j * D
				: a.k_src + (size_t)r * a.k_rs + (size_t)kvh * D;
	const float *vs = is_q ? nullptr : a.v_src + (size_t)r * a.v_rs + (size_t)kvh * D;
	const float *w = is_q ? a.q_norm : a.k_norm;
	float wv[QKV_PER], fr[QKV_PER], xv[QKV_PER], vv[QKV_PER];

#pragma unroll
	for (int k = 0; k < QKV_PER; k++) {
		const int i = threadIdx.x + k * QKV_THREADS;

		wv[k] = w && i < D ? k_cuda_pdl_early(w + i) : 0.0f;	// constants
		fr[k] = i < half ? k_cuda_pdl_early(a.inv_freq + i) : 0.0f;
	}
	k_cuda_pdl_relay(relay);
	k_cuda_pdl_wait();
	const int32_t slot = a.slots[r];
	const float p = (float)a.pos[r];

#pragma unroll
	for (int k = 0; k < QKV_PER; k++) {
		const int i = threadIdx.x + k * QKV_THREADS;

		xv[k] = vv[k] = 0.0f;
		if (i < D) {
			xv[k] = src[i];
			if (!is_q)
				vv[k] = vs[i];
		}
	}
	if (!is_q && slot < 0)
		return;
	if (w) {
		double ss = 0.0;
		float rs;

#pragma unroll
		for (int k = 0; k < QKV_PER; k++)
			if (threadIdx.x + k * QKV_THREADS < D)
				ss += (double)xv[k] * (double)xv[k];
		ss = k_cuda_block_sum_d<QKV_THREADS>(ss, red);
		rs = 1.0f / sqrtf((float)(ss / D) + a.eps);
#pragma unroll
		for (int k = 0; k < QKV_PER; k++)
			xv[k] = __fmul_rn(wv[k], __fmul_rn(xv[k], rs));
	}
#pragma unroll
	for (int k = 0; k < QKV_PER; k++)
		if (threadIdx.x + k * QKV_THREADS < D)
			x[threadIdx.x + k * QKV_THREADS] = xv[k];
	__syncthreads();
	if (half > 0) {
		const int step = a.interleaved ? 2 : 1, gap = a.interleaved ? 1 : half;

#pragma unroll
		for (int k = 0; k < QKV_PER; k++) {
			const int i = threadIdx.x + k * QKV_THREADS;

			if (i >= half)
				break;
			qkv_rotate(x, i * step, gap, p, fr[k], a.attn_factor);
		}
		__syncthreads();
	}
	if (is_q) {
		float *dst = a.q + ((size_t)r * a.n_heads + j) * D;

		for (int i = threadIdx.x; i < D; i += QKV_THREADS)
			dst[i] = x[i];
		return;
	}
	const size_t cache_off = (size_t)slot * a.kv_heads * D + (size_t)kvh * D;

#pragma unroll
	for (int k = 0; k < QKV_PER; k++) {
		const int i = threadIdx.x + k * QKV_THREADS;

		if (i < D) {
			a.k_cache[cache_off + i] = k_cuda_bf16_rn(x[i]);
			a.v_cache[cache_off + i] = k_cuda_bf16_rn(vv[k]);
		}
	}
}

// ---- many rows: one warp per row and HB heads --------------------------------------

#define QKV_WARPS 4				// warps a block of the row kernel
#define QKV_PAIR_MAX (QKV_MAX_DIM / 2 / 32)	// RoPE pairs a lane rotates
// Rows from here on take qkv_post_rows_kernel: a block a (head, row) leaves 3 of its 4
// warps idle at head_dim 128 and is latency-bound (a 1,024-row Llama-3.1-8B prefill
// chunk: 40,960 blocks, 19 waves, 52 us where its 45 MB take ~11 us), and every head
// of a row computes the row's fp64 RoPE angles again. Decode buckets (<= 64 rows)
// keep the kernel above.
#define QKV_ROWS_MIN 65

// qkv_post_early_kernel's arithmetic, a warp per row r and heads [j0, j0 + HB), lane l
// holding values l + 32 v (v < LV) of each: every head's inputs loaded at once (one
// memory latency, not HB: a loop that loaded head by head ran at 54 us against 34 for a
// warp per head), the row's RoPE cos and sin once, then head by head. Its fp64 sum of
// squares is the block kernel's to the bit: there thread t = 32 w + l summed values
// t + 128 k in k order, each warp w reduced them by the xor tree, and the warps' sums
// were added in w order; the lane forms the same four partials (value l + 32 (w + 4 k))
// and reduces them the same way. RoPE and the roundings are elementwise, so q and both
// caches match it bit for bit (test_cuda_attn_qkv).
template <int LV, int HB>
__global__ void __launch_bounds__(QKV_WARPS * 32) qkv_post_rows_kernel(const k_cuda_qkv_args a)
{
	__shared__ float xs[QKV_WARPS][32 * LV];
	const int lane = threadIdx.x % 32, nh = a.n_heads + a.kv_heads;
	const int groups = (nh + HB - 1) / HB;
	const long task = (long)blockIdx.x * QKV_WARPS + threadIdx.x / 32;
	const int D = a.head_dim, half = a.rope_dim / 2;
	const int step = a.interleaved ? 2 : 1, gap = a.interleaved ? 1 : half;
	float *x = xs[threadIdx.x / 32];
	float xv[HB][LV], vv[HB][LV], cs[QKV_PAIR_MAX], sn[QKV_PAIR_MAX];

	k_cuda_pdl_wait();
	if (task >= (long)a.rows * groups)
		return;	// no block-wide barrier below: a warp past the end may leave
	const int r = (int)(task / groups), j0 = (int)(task % groups) * HB;
	const int32_t slot = a.slots[r];
	const float p = (float)a.pos[r];

#pragma unroll
	for (int h = 0; h < HB; h++) {
		const int j = j0 + h, kvh = j - a.n_heads;
		const bool is_q = j < a.n_heads, live = j < nh && (is_q || slot >= 0);
		const float *src = is_q ? a.q_src + (size_t)r * a.q_rs + (size_t)j * D
					: a.k_src + (size_t)r * a.k_rs + (size_t)kvh * D;
		const float *vs = is_q ? nullptr : a.v_src + (size_t)r * a.v_rs + (size_t)kvh * D;

#pragma unroll
		for (int v = 0; v < LV; v++) {
			const bool in = live && lane + 32 * v < D;

			xv[h][v] = in ? src[lane + 32 * v] : 0.0f;
			vv[h][v] = in && !is_q ? vs[lane + 32 * v] : 0.0f;
		}
	}
#pragma unroll
	for (int v = 0; v < QKV_PAIR_MAX; v++)
		if (lane + 32 * v < half)
			k_cuda_rope_cs(p, a.inv_freq[lane + 32 * v], a.attn_factor, cs[v], sn[v]);
#pragma unroll
	for (int h = 0; h < HB; h++) {
		const int j = j0 + h, kvh = j - a.n_heads;
		const bool is_q = j < a.n_heads;
		const float *w = is_q ? a.q_norm : a.k_norm;

		if (j >= nh || (!is_q && slot < 0))
			break;	// kv heads come last: nothing more of this row to write
		if (w) {
			double ss = 0.0;
			float rs;

#pragma unroll
			for (int wp = 0; wp < QKV_THREADS / 32; wp++) {
				double part = 0.0;

#pragma unroll
				for (int k = 0; k < QKV_PER; k++)
					if (wp + 4 * k < LV && lane + 32 * (wp + 4 * k) < D)
						part += (double)xv[h][wp + 4 * k] *
							(double)xv[h][wp + 4 * k];
				for (int o = 16; o > 0; o >>= 1)
					part += __shfl_xor_sync(0xffffffffu, part, o);
				ss += part;
			}
			rs = 1.0f / sqrtf((float)(ss / D) + a.eps);
#pragma unroll
			for (int v = 0; v < LV; v++)
				if (lane + 32 * v < D)
					xv[h][v] = __fmul_rn(w[lane + 32 * v], __fmul_rn(xv[h][v], rs));
		}
		__syncwarp();	// the previous head's reads of x are done
#pragma unroll
		for (int v = 0; v < LV; v++)
			if (lane + 32 * v < D)
				x[lane + 32 * v] = xv[h][v];
		__syncwarp();
#pragma unroll
		for (int v = 0; v < QKV_PAIR_MAX; v++) {
			const int i = lane + 32 * v;

			if (i < half)
				k_cuda_rope_rotate(x[i * step], x[i * step + gap], cs[v], sn[v],
						   x[i * step], x[i * step + gap]);
		}
		__syncwarp();
		if (is_q) {
			float *dst = a.q + ((size_t)r * a.n_heads + j) * D;

#pragma unroll
			for (int v = 0; v < LV; v++)
				if (lane + 32 * v < D)
					dst[lane + 32 * v] = x[lane + 32 * v];
			continue;
		}
		const size_t cache_off = (size_t)slot * a.kv_heads * D + (size_t)kvh * D;

#pragma unroll
		for (int v = 0; v < LV; v++) {
			const int i = lane + 32 * v;

			if (i < D) {
				a.k_cache[cache_off + i] = k_cuda_bf16_rn(x[i]);
				a.v_cache[cache_off + i] = k_cuda_bf16_rn(vv[h][v]);
			}
		}
	}
}

// The row kernel for head_dim D: LV values a lane (a power of two), HB heads a warp
// (at most 32 values of them a lane in flight).
template <int LV, int HB>
static void qkv_rows_launch(cudaStream_t s, const k_cuda_qkv_args &a)
{
	const long tasks = (long)a.rows * ((a.n_heads + a.kv_heads + HB - 1) / HB);

	k_cuda_launch_pdl(s, dim3((unsigned)((tasks + QKV_WARPS - 1) / QKV_WARPS)), QKV_WARPS * 32,
			  0, qkv_post_rows_kernel<LV, HB>, a);
}

static void qkv_rows(cudaStream_t s, const k_cuda_qkv_args &a)
{
	if (a.head_dim <= 32)
		qkv_rows_launch<1, 8>(s, a);
	else if (a.head_dim <= 64)
		qkv_rows_launch<2, 8>(s, a);
	else if (a.head_dim <= 128)
		qkv_rows_launch<4, 8>(s, a);
	else if (a.head_dim <= 256)
		qkv_rows_launch<8, 4>(s, a);
	else
		qkv_rows_launch<16, 2>(s, a);
}

}	// namespace

// k_cuda_tuning()->qkv_post_early 0 (KDEC_QKV_POST_EARLY=0): the kernel that loads its
// inputs one after another (read at each call: test_cuda_attn_qkv runs both and compares
// the bits).
static int qkv_post_early(void)
{
	return k_cuda_tuning()->qkv_post_early != 0;
}

extern "C" int k_cuda_qkv_post(cudaStream_t s, const struct k_cuda_qkv_args *a)
{
	if (!a || a->head_dim < 1 || a->head_dim > QKV_MAX_DIM || a->rope_dim < 0 ||
	    a->rope_dim % 2 || a->rope_dim > a->head_dim || a->n_heads < 1 || a->kv_heads < 1 ||
	    a->rows < 0 || a->rows > 65535 || (a->rope_dim && !a->inv_freq))
		return -EINVAL;
	if (a->rows == 0)
		return 0;
	if (qkv_post_early() && a->rows >= QKV_ROWS_MIN)
		qkv_rows(s, *a);
	else
		k_cuda_launch_pdl(s, dim3(a->n_heads + a->kv_heads, a->rows), QKV_THREADS, 0,
				  qkv_post_early() ? qkv_post_early_kernel : qkv_post_kernel, *a,
				  k_cuda_pdl_relay_enabled(K_CUDA_RELAY_QKV_POST));
	return K_CUDA_LAUNCHED("qkv_post");
}
