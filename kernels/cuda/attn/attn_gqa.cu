// GQA attention over the paged bf16 cache: the decode kernel (rows of distinct
// sequences, split along the sequence, each K/V vector read once per kv head for all the
// q heads of its group) and the launcher that picks it or a prefill kernel (tensor-core
// or tiled).
#include <cstdlib>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/ops/k_cuda_ops.h"

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_HEADS 4		// q heads of one kv head per block (Llama-3 GQA 4 in one pass)
#define DEC_U 4			// tokens in flight per lane group per iteration
// Splits: a few blocks per SM, and a split no shorter than this (its fixed cost).
#define DEC_CTAS_PER_SM 2
#define DEC_MIN_SPLIT_TOKENS 32
// Prefetching kernel while the grid fits in this many CTAs per SM (measured on H200:
// it wins at batch 1 and 8, loses at 32 and 64 where occupancy hides the latency).
#define DEC_PF_MAX_WAVES 3
// Prefill: rows per sequence from which a tile of rows shares its K/V loads.
#define GQA_TILED_MIN_ROWS_PER_SEQ 16
#define GQA_TILE_Q 64
#define GQA_TILE_CTAS_PER_SM 2
#define GQA_TILE_MIN_SPLIT_TOKENS 512

struct dec_args {
	float *out;			// (n_rows, n_heads, hd) when n_splits == 1
	uint16_t *out_bf16;		// NULL, or out rounded to bf16 (same layout)
	float *part_o, *part_lse;	// (n_splits, n_rows, n_heads, hd), (..., n_heads)
	const float *q;			// (n_rows, n_heads, hd)
	const uint16_t *k, *v;		// (slots, kv_heads, hd) bf16
	const int32_t *ctx;
	const int32_t *const *blocks;
	attn_div bt;
	int n_rows, n_heads, kv_heads, hd, group, n_hc, n_splits;
	float qscale;			// scale * log2(e)
	int vec;			// 16-byte loads (hd % 8 == 0, aligned bases)
};

// ---- kernels ----------------------------------------------------------------

// Eight bf16 of a lane's slice [d0, d0 + 8) of one head vector at p + off; zeros where
// the token is out of range or the dims are past hd. Plain loads, not __ldg: this
// step's K/V rows are written by the kernel just before, inside the PDL overlap.
__device__ __forceinline__ uint4 dec_load8(const uint16_t *p, size_t off, bool ok,
					   int d0, int hd, int vec)
{
	uint32_t w[4] = { 0, 0, 0, 0 };

	if (!ok || d0 >= hd)
		return make_uint4(0, 0, 0, 0);
	if (vec)
		return *(const uint4 *)(p + off);
#pragma unroll
	for (int e = 0; e < 8; e++)
		if (d0 + e < hd)
			w[e / 2] |= (uint32_t)p[off + e] << (16 * (e % 2));
	return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void dec_unpack(uint4 w, float f[8])
{
	f[0] = bf16_lo(w.x);
	f[1] = bf16_hi(w.x);
	f[2] = bf16_lo(w.y);
	f[3] = bf16_hi(w.y);
	f[4] = bf16_lo(w.z);
	f[5] = bf16_hi(w.z);
	f[6] = bf16_lo(w.w);
	f[7] = bf16_hi(w.w);
}

// Block (split, kv head * head chunk, row). A group of LPT lanes takes one token, each
// lane 8 of its dims (16 bytes of K, 16 of V); a warp takes 32 / LPT tokens side by side,
// DEC_U deep. Every lane group keeps its own online softmax (scores in base 2) for the
// block's q heads; groups, then warps, are combined at the end.
// PF: the next iteration's K/V loads are issued before this one's arithmetic (more
// registers, fewer resident warps): pays where the grid is a single wave.
// One function of ~200 lines on purpose: q, the (m, l, acc) softmax state of every head
// and (PF) the double-buffered K/V words live in registers from the q load through the
// token loop to the lane-group combine; split into helpers they would all be passed by
// reference. Its phases (q, the loop, lane groups, warps) are marked inside.
template <int LPT, bool PF>
__global__ void __launch_bounds__(DEC_THREADS) attn_dec_kernel(const dec_args a)
{
	constexpr int TPW = 32 / LPT;
	constexpr int STEP = DEC_WARPS * TPW * DEC_U;
	__shared__ float sm_o[DEC_WARPS][DEC_HEADS][8 * LPT];
	__shared__ float sm_m[DEC_WARPS][DEC_HEADS], sm_l[DEC_WARPS][DEC_HEADS];
	const int split = blockIdx.x, r = blockIdx.z;
	const int kvh = blockIdx.y / a.n_hc, g0 = (blockIdx.y % a.n_hc) * DEC_HEADS;
	const int ng = min(DEC_HEADS, a.group - g0), h0 = kvh * a.group + g0;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	const int gi = lane / LPT, d0 = (lane % LPT) * 8;
	const int ctx = (k_cuda_pdl_wait(), a.ctx[r]), per = attn_split_len(ctx, a.n_splits);
	const int tb = (int)min((long)ctx, (long)split * per), te = min(ctx, tb + per);
	const int32_t *table = a.blocks[r];
	const size_t kv_stride = (size_t)a.kv_heads * a.hd, head_off = (size_t)kvh * a.hd + d0;
	float q[DEC_HEADS][8], acc[DEC_HEADS][8], m[DEC_HEADS], l[DEC_HEADS];

#pragma unroll
	for (int g = 0; g < DEC_HEADS; g++) {
		const float *qh = a.q + ((size_t)r * a.n_heads + h0 + g) * a.hd;

		m[g] = -INFINITY;
		l[g] = 0.0f;
#pragma unroll
		for (int e = 0; e < 8; e++) {
			acc[g][e] = 0.0f;
			q[g][e] = g < ng && d0 + e < a.hd ? qh[d0 + e] * a.qscale : 0.0f;
		}
	}

	// With PF, the K/V of the warp's next DEC_U token slots are loaded while it computes
	// on the current ones (registers double-buffered): otherwise each iteration's loads
	// wait out a whole memory latency with nothing else in flight for the warp, which
	// only other resident warps can hide.
	uint4 kn[DEC_U], vn[DEC_U];
	bool okn[DEC_U];
	auto fetch = [&](int t0) {
#pragma unroll
		for (int u = 0; u < DEC_U; u++) {
			const int t = t0 + u * TPW + gi;
			size_t off = 0;

			okn[u] = t < te;
			if (okn[u]) {
				const uint32_t b = attn_div_q(a.bt, (uint32_t)t);

				off = ((size_t)table[b] * a.bt.d + (t - b * a.bt.d)) * kv_stride +
				      head_off;
			}
			kn[u] = dec_load8(a.k, off, okn[u], d0, a.hd, a.vec);
			vn[u] = dec_load8(a.v, off, okn[u], d0, a.hd, a.vec);
		}
	};

	if (PF && tb + warp * TPW * DEC_U < te)
		fetch(tb + warp * TPW * DEC_U);
	for (int t0 = tb + warp * TPW * DEC_U; t0 < te; t0 += STEP) {
		uint4 kw[DEC_U], vw[DEC_U];
		float s[DEC_HEADS][DEC_U];
		bool ok[DEC_U];

		if (!PF)
			fetch(t0);
#pragma unroll
		for (int u = 0; u < DEC_U; u++) {
			kw[u] = kn[u];
			vw[u] = vn[u];
			ok[u] = okn[u];
		}
		if (PF && t0 + STEP < te)
			fetch(t0 + STEP);
		// Scores: partial dots over the lane's 8 dims, summed over the lane group.
#pragma unroll
		for (int u = 0; u < DEC_U; u++) {
			float kf[8];

			dec_unpack(kw[u], kf);
#pragma unroll
			for (int g = 0; g < DEC_HEADS; g++) {
				float x = 0.0f;

#pragma unroll
				for (int e = 0; e < 8; e++)
					x = fmaf(q[g][e], kf[e], x);
				s[g][u] = x;
			}
		}
#pragma unroll
		for (int off = LPT / 2; off > 0; off >>= 1)
#pragma unroll
			for (int g = 0; g < DEC_HEADS; g++)
				if (g < ng)
#pragma unroll
					for (int u = 0; u < DEC_U; u++)
						s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], off);
		// Online softmax over the DEC_U new tokens; s becomes p.
#pragma unroll
		for (int g = 0; g < DEC_HEADS; g++) {
			float mx = m[g], al, ps = 0.0f;

			if (g >= ng)
				continue;
#pragma unroll
			for (int u = 0; u < DEC_U; u++)
				if (ok[u])
					mx = fmaxf(mx, s[g][u]);
			al = attn_rescale(m[g], mx);
#pragma unroll
			for (int u = 0; u < DEC_U; u++) {
				s[g][u] = ok[u] ? exp2f(s[g][u] - mx) : 0.0f;
				ps += s[g][u];
			}
			l[g] = l[g] * al + ps;
			m[g] = mx;
#pragma unroll
			for (int e = 0; e < 8; e++)
				acc[g][e] *= al;
		}
#pragma unroll
		for (int u = 0; u < DEC_U; u++) {
			float vf[8];

			dec_unpack(vw[u], vf);
#pragma unroll
			for (int g = 0; g < DEC_HEADS; g++)
#pragma unroll
				for (int e = 0; e < 8; e++)
					acc[g][e] = fmaf(s[g][u], vf[e], acc[g][e]);
		}
	}

	// Lane groups of a warp: combine (m, l, acc) pairwise.
#pragma unroll
	for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
		for (int g = 0; g < DEC_HEADS; g++) {
			float mo, lo, mx, a0, a1;

			if (g >= ng)
				continue;
			mo = __shfl_xor_sync(0xffffffffu, m[g], off);
			lo = __shfl_xor_sync(0xffffffffu, l[g], off);
			mx = fmaxf(m[g], mo);
			a0 = attn_rescale(m[g], mx);
			a1 = attn_rescale(mo, mx);
			l[g] = l[g] * a0 + lo * a1;
			m[g] = mx;
#pragma unroll
			for (int e = 0; e < 8; e++) {
				const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], off);

				acc[g][e] = acc[g][e] * a0 + ao * a1;
			}
		}
	if (gi == 0)
#pragma unroll
		for (int g = 0; g < DEC_HEADS; g++) {
			if (g >= ng)
				continue;
#pragma unroll
			for (int e = 0; e < 8; e++)
				sm_o[warp][g][d0 + e] = acc[g][e];
			if (lane == 0) {
				sm_m[warp][g] = m[g];
				sm_l[warp][g] = l[g];
			}
		}
	__syncthreads();

	// Warps: combine and write the output, or this split's normalised partial.
	for (int i = threadIdx.x; i < ng * a.hd; i += DEC_THREADS) {
		const int g = i / a.hd, d = i % a.hd;
		const size_t rh = (size_t)r * a.n_heads + h0 + g;
		float mx = -INFINITY, ls = 0.0f, o = 0.0f, inv;

#pragma unroll
		for (int w = 0; w < DEC_WARPS; w++)
			mx = fmaxf(mx, sm_m[w][g]);
#pragma unroll
		for (int w = 0; w < DEC_WARPS; w++) {
			const float f = attn_rescale(sm_m[w][g], mx);

			ls += sm_l[w][g] * f;
			o += sm_o[w][g][d] * f;
		}
		inv = ls > 0.0f ? 1.0f / ls : 0.0f;
		if (a.n_splits == 1) {
			a.out[rh * a.hd + d] = o * inv;
			if (a.out_bf16)
				a.out_bf16[rh * a.hd + d] = attn_bf16(o * inv);
		} else {
			const size_t sp = (size_t)split * a.n_rows * a.n_heads + rh;

			a.part_o[sp * a.hd + d] = o * inv;
			if (d == 0)
				a.part_lse[sp] = ls > 0.0f ? mx + log2f(ls) : -INFINITY;
		}
	}
}

// ---- launchers --------------------------------------------------------------

static int aligned16(const void *p)
{
	return (uintptr_t)p % 16 == 0;
}

// k_cuda_tuning()->attn_dec_splits (KDEC_ATTN_DEC_SPLITS, experiments): a fixed split
// count for the decode kernel, read at each call (a host launch; a graph reads it once,
// at capture: the tests sweep it); 0 when not a positive number.
static int dec_forced_splits(void)
{
	const int n = k_cuda_tuning()->attn_dec_splits;

	return n > 0 ? n : 0;
}

// A GQA launch over the paged cache as the shared attention arguments (tiled and
// tensor-core kernels): q and out (rows, H, hd), K and V (slots, KV, hd).
static attn_tile_args gqa_args(k_cuda_attn_ws *ws, float *out, const float *q,
			       const uint16_t *k, const uint16_t *v, int block_tokens,
			       const k_cuda_attn_rows *rows, int H, int KV, int hd, float qscale)
{
	attn_tile_args a;

	a.out = out;
	a.out_rs = (long)H * hd;
	a.out_hs = hd;
	a.part_o = ws->part_o;
	a.part_lse = ws->part_lse;
	a.q = q;
	a.q_rs = (long)H * hd;
	a.q_hs = hd;
	a.k = k;
	a.v = v;
	a.k_stride = a.v_stride = (long)KV * hd;
	a.k_hoff = a.v_hoff = hd;
	a.ctx = rows->ctx;
	a.blocks = rows->blocks;
	a.bt = attn_div_make((uint32_t)block_tokens);
	a.n_rows = rows->n_rows;
	a.n_heads = H;
	a.group = H / KV;
	a.kv_heads = KV;
	a.dk = a.dv = hd;
	a.qscale = qscale;
	a.vec = hd % 8 == 0 && aligned16(k) && aligned16(v);
	a.n_splits = 1;
	return a;
}

// The tensor-core decode kernel (attn_mma.cu) over the same rows, where it applies:
// true with its result in *ret, false when it does not.
static bool gqa_decode_mma(cudaStream_t s, k_cuda_attn_ws *ws, float *out, uint16_t *out_bf16,
			   const float *q, const uint16_t *k, const uint16_t *v, int block_tokens,
			   const k_cuda_attn_rows *rows, int H, int KV, int hd, float qscale,
			   int *ret)
{
	attn_tile_args a = gqa_args(ws, out, q, k, v, block_tokens, rows, H, KV, hd, qscale);

	if (!attn_mma_usable(&a))
		return false;
	*ret = attn_mma_launch(s, ws, &a, rows->max_ctx, out_bf16, dec_forced_splits());
	return true;
}

// Decode: rows of distinct sequences, each K/V vector read once per kv head.
static int gqa_decode(cudaStream_t s, k_cuda_attn_ws *ws, float *out, uint16_t *out_bf16,
		      const float *q, const uint16_t *k, const uint16_t *v, int block_tokens,
		      const k_cuda_attn_rows *rows, int H, int KV, int hd, float qscale)
{
	const int R = rows->n_rows, G = H / KV, n_hc = attn_cdiv(G, DEC_HEADS);
	dec_args a;
	dim3 grid;
	int ret;

	if ((long)KV * n_hc > 65535)
		ATTN_INVAL("k_cuda_attn_gqa: %d kv heads x %d head chunks unsupported", KV, n_hc);
	if (gqa_decode_mma(s, ws, out, out_bf16, q, k, v, block_tokens, rows, H, KV, hd, qscale,
			   &ret))
		return ret;
	a.out = out;
	a.out_bf16 = out_bf16;
	a.part_o = ws->part_o;
	a.part_lse = ws->part_lse;
	a.q = q;
	a.k = k;
	a.v = v;
	a.ctx = rows->ctx;
	a.blocks = rows->blocks;
	a.bt = attn_div_make((uint32_t)block_tokens);
	a.n_rows = R;
	a.n_heads = H;
	a.kv_heads = KV;
	a.hd = hd;
	a.group = G;
	a.n_hc = n_hc;
	a.qscale = qscale;
	a.vec = hd % 8 == 0 && aligned16(k) && aligned16(v);
	a.n_splits = attn_pick_splits(ws, (long)R * KV * n_hc, (long)DEC_CTAS_PER_SM * ws->n_sm,
				      rows->max_ctx, DEC_MIN_SPLIT_TOKENS, (size_t)R * H * hd,
				      (size_t)R * H);
	if (const int want = dec_forced_splits()) {
		if (want <= a.n_splits * 64 && (size_t)want * R * H * hd <= ws->part_floats &&
		    (size_t)want * R * H <= ws->lse_floats && want <= ATTN_MAX_SPLITS)
			a.n_splits = want;
	}
	grid = dim3(a.n_splits, KV * n_hc, R);
	if ((long)a.n_splits * KV * n_hc * R <= (long)DEC_PF_MAX_WAVES * ws->n_sm)
		k_cuda_launch_pdl(s, grid, DEC_THREADS, 0,
				  hd <= 32 ? attn_dec_kernel<4, true> : hd <= 64 ? attn_dec_kernel<8, true>
				  : hd <= 128 ? attn_dec_kernel<16, true> : attn_dec_kernel<32, true>, a);
	else
		k_cuda_launch_pdl(s, grid, DEC_THREADS, 0,
				  hd <= 32 ? attn_dec_kernel<4, false> : hd <= 64 ? attn_dec_kernel<8, false>
				  : hd <= 128 ? attn_dec_kernel<16, false> : attn_dec_kernel<32, false>, a);
	K_CUDA_TRY_LAUNCHED("attn_dec_kernel");
	if (a.n_splits > 1)
		return attn_merge(s, ws, a.n_splits, R, H, hd, out, (long)H * hd, hd, out_bf16);
	return 0;
}

// Prefill: enough consecutive rows of one sequence per tile that sharing each loaded
// K/V tile among them pays (rows of other sequences are still handled, just slower).
static int gqa_use_tiled(const k_cuda_attn_rows *rows)
{
	const int seqs = rows->n_seqs > 0 ? rows->n_seqs : rows->n_rows;

	return rows->n_rows >= GQA_TILED_MIN_ROWS_PER_SEQ * seqs;
}

// Prefill on the tensor cores (attn_prefill.cu): the rows gqa_use_tiled takes, at a
// shape it compiled (head_dim a multiple of 8 up to 128), with k_cuda_tuning()->attn_mma
// and ->attn_prefill_mma on (KDEC_ATTN_PREFILL_MMA=0: the tiled kernel below). At 256
// new Llama-3.1-8B rows over 8k tokens the tiled kernel's fp32 arithmetic was the
// whole cost of a prefill step's attention.
static bool gqa_use_prefill_mma(const k_cuda_attn_rows *rows, const attn_tile_args *a)
{
	return gqa_use_tiled(rows) && attn_prefill_usable(a);
}

// The tiled CUDA-core kernel: the other prefill shapes that fit its shared memory.
static bool gqa_use_prefill_tiled(const k_cuda_attn_ws *ws, const k_cuda_attn_rows *rows, int hd)
{
	return gqa_use_tiled(rows) && attn_tile_smem(ws, GQA_TILE_Q, hd, hd, 1) != 0;
}

static int gqa_tiled(cudaStream_t s, k_cuda_attn_ws *ws, float *out, const float *q,
		     const uint16_t *k, const uint16_t *v, int block_tokens,
		     const k_cuda_attn_rows *rows, int H, int KV, int hd, float qscale)
{
	const long tiles = attn_cdiv(rows->n_rows * (H / KV), GQA_TILE_Q);
	attn_tile_args a = gqa_args(ws, out, q, k, v, block_tokens, rows, H, KV, hd, qscale);

	a.n_splits = attn_pick_splits(ws, tiles * KV, (long)GQA_TILE_CTAS_PER_SM * ws->n_sm,
				      rows->max_ctx, GQA_TILE_MIN_SPLIT_TOKENS,
				      (size_t)rows->n_rows * H * hd, (size_t)rows->n_rows * H);
	return attn_tile_launch(s, ws, GQA_TILE_Q, &a);
}

extern "C" int k_cuda_attn_gqa_bf16(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
				    uint16_t *out_bf16, const float *q, const uint16_t *k_cache,
				    const uint16_t *v_cache, int block_tokens,
				    const struct k_cuda_attn_rows *rows, int n_heads, int kv_heads,
				    int head_dim, float scale)
{
	const float qscale = scale * 1.4426950408889634f;	// log2(e): exp2 in the kernels
	int ret;

	if ((ret = attn_check_rows("k_cuda_attn_gqa", ws, rows, block_tokens, n_heads, head_dim)))
		return ret;
	if (kv_heads < 1 || n_heads % kv_heads)
		ATTN_INVAL("k_cuda_attn_gqa: %d heads over %d kv heads unsupported", n_heads,
			   kv_heads);
	if (head_dim > 256)
		ATTN_INVAL("k_cuda_attn_gqa: head_dim %d unsupported (1..256)", head_dim);
	if (rows->n_rows == 0)
		return 0;
	// The kernels by named predicates, in order; the decode kernel takes the rest.
	attn_tile_args a = gqa_args(ws, out, q, k_cache, v_cache, block_tokens, rows, n_heads,
				    kv_heads, head_dim, qscale);

	if (gqa_use_prefill_mma(rows, &a)) {
		ret = attn_prefill_launch(s, ws, &a, rows->max_ctx, out_bf16);
		return ret ? ret : out_bf16 != nullptr;
	}
	if (gqa_use_prefill_tiled(ws, rows, head_dim))
		return gqa_tiled(s, ws, out, q, k_cache, v_cache, block_tokens, rows, n_heads,
				 kv_heads, head_dim, qscale);
	ret = gqa_decode(s, ws, out, out_bf16, q, k_cache, v_cache, block_tokens, rows, n_heads,
			 kv_heads, head_dim, qscale);
	return ret ? ret : out_bf16 != nullptr;
}

// Whether k_cuda_attn_gqa_qkv folds qkv_post into the attention launch that runs
// `splits` splits. Where the rows take one split (Llama-3.1-8B at batch 64: 512 items
// on 528 slots), every block appends its own row and none waits on another: on H200
// the step took 7.127 ms against 7.219 with the qkv_post launch. With more splits only
// the last split's block does that work, after its wait, and it is the straggler:
// Llama batch 1 4.606 against 4.535 ms, Qwen3-8B batch 64 (2 splits) 7.665 against
// 7.611, so those keep the launch. k_cuda_tuning()->qkv_in_attn (KDEC_QKV_IN_ATTN) 0
// never folds, 1 folds at any split count (read at each call: test_cuda_attn_qkv runs both
// and compares the bits).
static bool qkv_in_attn(int splits)
{
	const int on = k_cuda_tuning()->qkv_in_attn;

	if (on == 0)
		return false;
	return on == 1 || splits == 1;
}

// qkv_post's arguments that the folded launch handles (those k_cuda_qkv_post accepts).
static bool qkv_args_ok(const k_cuda_qkv_args *p)
{
	return p->rope_dim >= 0 && p->rope_dim % 2 == 0 && p->rope_dim <= p->head_dim &&
	       (p->rope_dim == 0 || p->inv_freq);
}

extern "C" int k_cuda_attn_gqa_qkv(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
				   uint16_t *out_bf16, const struct k_cuda_qkv_args *post,
				   int block_tokens, const struct k_cuda_attn_rows *rows,
				   float scale)
{
	const int H = post->n_heads, KV = post->kv_heads, hd = post->head_dim;
	const int seqs = rows->n_seqs > 0 ? rows->n_seqs : rows->n_rows;
	int ret;

	if (rows->n_rows == post->rows && seqs == rows->n_rows && rows->n_rows > 0 &&
	    qkv_args_ok(post) && KV >= 1 && H % KV == 0 && hd <= 256 &&
	    !attn_check_rows("k_cuda_attn_gqa_qkv", ws, rows, block_tokens, H, hd)) {
		attn_tile_args a = gqa_args(ws, out, post->q_src, post->k_cache, post->v_cache,
					    block_tokens, rows, H, KV, hd,
					    scale * 1.4426950408889634f);

		a.q_rs = post->q_rs;
		if (attn_mma_post_usable(&a) &&
		    qkv_in_attn(attn_mma_post_splits(ws, &a, rows->max_ctx, dec_forced_splits()))) {
			ret = attn_mma_launch_post(s, ws, &a, rows->max_ctx, out_bf16,
						   dec_forced_splits(), post);
			return ret ? ret : out_bf16 != nullptr;
		}
	}
	if ((ret = k_cuda_qkv_post(s, post)))
		return ret;
	return k_cuda_attn_gqa_bf16(s, ws, out, out_bf16, post->q, post->k_cache, post->v_cache,
				    block_tokens, rows, H, KV, hd, scale);
}

extern "C" int k_cuda_attn_gqa(cudaStream_t s, struct k_cuda_attn_ws *ws, float *out,
			       const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
			       int block_tokens, const struct k_cuda_attn_rows *rows, int n_heads,
			       int kv_heads, int head_dim, float scale)
{
	return k_cuda_attn_gqa_bf16(s, ws, out, nullptr, q, k_cache, v_cache, block_tokens, rows,
				    n_heads, kv_heads, head_dim, scale);
}
