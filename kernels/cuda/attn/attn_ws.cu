// The attention workspace (split partials, MLA scratch), the rule that picks the number
// of splits along the sequence, and the log-sum-exp merge of the split partials.
#include <cstdlib>

#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/launch_check.cuh"

#define MERGE_THREADS 128
#define MERGE_WARPS 8		// most warps in a block of the batched merge
#define MERGE_REGS 32		// partial floats a lane of it has in flight at once
// Warp items of a batched launch: at most this many (32-bit index arithmetic).
#define MERGE_MAX_ITEMS (2147483647L - 32 * MERGE_WARPS)

// ---- kernels ----------------------------------------------------------------
// part_o and part_lse are written by the attention kernel just before, which these
// merges overlap under PDL: plain pointers, never const __restrict__ (nvcc turns those
// into non-coherent LDG.E.CONSTANT loads, which ptxas may move above the wait).

// Block (r, h, dim chunk): out(r, h, d) = sum_s w_s o_s(d) / sum_s w_s with
// w_s = exp2(lse_s - max), for the block's MERGE_THREADS dims. Warp 0 lists the splits
// that count (merge_list); each thread then sums them 4 loads at a time, split j into
// accumulator j % 4 and the last n % 4 into the first. The reference order the batched
// kernel below keeps. The default; KDEC_ATTN_MERGE=1 runs the batched one.
// pdl-order: relay attn_merge_kernel
__global__ void __launch_bounds__(MERGE_THREADS)
attn_merge_kernel(float *__restrict__ out, long out_rs, long out_hs,
		  const float *part_o, const float *part_lse,
		  int n_splits, int n_rows, int n_heads, int dim, uint16_t *__restrict__ out_bf16,
		  int relay)
{
	__shared__ float w[ATTN_MAX_SPLITS];
	__shared__ int live[ATTN_MAX_SPLITS];
	__shared__ int n_live;
	const int r = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
	const size_t rh = (size_t)r * n_heads + h, per_split = (size_t)n_rows * n_heads;
	const int d = blockIdx.y * MERGE_THREADS + threadIdx.x;

	k_cuda_pdl_relay(relay);
	k_cuda_pdl_wait();
	if (threadIdx.x < 32) {
		const int n = merge_list(part_lse, n_splits, rh, per_split, live, w);

		if (threadIdx.x == 0)
			n_live = n;
	}
	__syncthreads();
	if (d < dim) {
		const float *po = part_o + rh * dim + d;
		const size_t sstride = per_split * dim;
		float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
		int i = 0;

		for (; i + 4 <= n_live; i += 4) {
			const float o0 = po[live[i] * sstride], o1 = po[live[i + 1] * sstride];
			const float o2 = po[live[i + 2] * sstride], o3 = po[live[i + 3] * sstride];

			a0 = fmaf(w[i], o0, a0);
			a1 = fmaf(w[i + 1], o1, a1);
			a2 = fmaf(w[i + 2], o2, a2);
			a3 = fmaf(w[i + 3], o3, a3);
		}
		for (; i < n_live; i++)
			a0 = fmaf(w[i], po[live[i] * sstride], a0);
		const float o = (a0 + a1) + (a2 + a3);

		out[r * out_rs + h * out_hs + d] = o;
		if (out_bf16)
			out_bf16[r * out_rs + h * out_hs + d] = attn_bf16(o);
	}
}

// V floats at p (V-aligned) into x.
template <int V>
__device__ __forceinline__ void merge_load(float *x, const float *p)
{
	if constexpr (V == 4) {
		const float4 t = *(const float4 *)p;

		x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
	} else if constexpr (V == 2) {
		const float2 t = *(const float2 *)p;

		x[0] = t.x, x[1] = t.y;
	} else {
		x[0] = *p;
	}
}

// x (V floats) to out, and rounded to bf16 (low half the lower address) to ob if set.
template <int V>
__device__ __forceinline__ void merge_store(float *out, uint16_t *ob, const float *x)
{
	if constexpr (V == 4) {
		*(float4 *)out = make_float4(x[0], x[1], x[2], x[3]);
		if (ob)
			*(uint2 *)ob = make_uint2(attn_bf16(x[0]) | (uint32_t)attn_bf16(x[1]) << 16,
						  attn_bf16(x[2]) | (uint32_t)attn_bf16(x[3]) << 16);
	} else if constexpr (V == 2) {
		*(float2 *)out = make_float2(x[0], x[1]);
		if (ob)
			*(uint32_t *)ob = attn_bf16(x[0]) | (uint32_t)attn_bf16(x[1]) << 16;
	} else {
		*out = x[0];
		if (ob)
			*ob = attn_bf16(x[0]);
	}
}

// attn_merge_kernel's result bit for bit, with a shorter chain of memory latencies.
// Warp item (rh, chunk), items rh-major: lane l owns dims (32 chunk + l) V .. + V - 1
// (dim % V == 0). Each warp lists its own splits (no block barrier; a head split over
// chunks lists them once per chunk, a few lse loads), then issues MERGE_REGS / V
// partial loads at once and only then sums them, in attn_merge_kernel's order: the
// GQA batch-1 merge of ~32 live splits costs the lse latency and one more, where the
// 4-at-a-time loop took ~9; at batch 64 (3 splits) a warp, not a 4-warp block with 3
// waiting on the first, serves a head.
template <int V>
__global__ void __launch_bounds__(MERGE_WARPS * 32)
attn_merge_warp_kernel(float *__restrict__ out, long out_rs, long out_hs,
		       const float *part_o, const float *part_lse,
		       int n_splits, int n_rows, int n_heads, int dim, int n_chunks, int n_items,
		       uint16_t *__restrict__ out_bf16)
{
	constexpr int MB = MERGE_REGS / V;	// a multiple of 4: j % 4 == k % 4 below
	__shared__ float w_s[MERGE_WARPS][ATTN_MAX_SPLITS];
	__shared__ int live_s[MERGE_WARPS][ATTN_MAX_SPLITS];
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	const int item = blockIdx.x * (blockDim.x / 32) + warp;
	const size_t per_split = (size_t)n_rows * n_heads;

	if (item >= n_items)	// whole warps only: the shuffles stay full
		return;
	const int r = item / n_chunks / n_heads, h = item / n_chunks % n_heads;
	const size_t rh = (size_t)r * n_heads + h;
	const int d = (item % n_chunks * 32 + lane) * V;
	const int *live = live_s[warp];
	const float *w = w_s[warp];

	k_cuda_pdl_wait();
	const int n = merge_list(part_lse, n_splits, rh, per_split, live_s[warp], w_s[warp]);
	__syncwarp();
	if (d >= dim)
		return;

	const float *po = part_o + rh * dim + d;
	const size_t sstride = per_split * dim;
	const int n4 = n & ~3;
	float acc[4][V], o[V];

#pragma unroll
	for (int a = 0; a < 4; a++)
#pragma unroll
		for (int v = 0; v < V; v++)
			acc[a][v] = 0.0f;
	for (int j0 = 0; j0 < n; j0 += MB) {
		float x[MB][V];

#pragma unroll
		for (int k = 0; k < MB; k++)
			if (j0 + k < n)
				merge_load<V>(x[k], po + live[j0 + k] * sstride);
#pragma unroll
		for (int k = 0; k < MB; k++) {
			const int j = j0 + k;

			if (j < n4) {
#pragma unroll
				for (int v = 0; v < V; v++)
					acc[k % 4][v] = fmaf(w[j], x[k][v], acc[k % 4][v]);
			} else if (j < n) {
#pragma unroll
				for (int v = 0; v < V; v++)
					acc[0][v] = fmaf(w[j], x[k][v], acc[0][v]);
			}
		}
	}
#pragma unroll
	for (int v = 0; v < V; v++)
		o[v] = (acc[0][v] + acc[1][v]) + (acc[2][v] + acc[3][v]);
	merge_store<V>(out + r * out_rs + h * out_hs + d,
		       out_bf16 ? out_bf16 + r * out_rs + h * out_hs + d : nullptr, o);
}

// ---- launchers --------------------------------------------------------------

int attn_pick_splits(const k_cuda_attn_ws *ws, long base_ctas, long target_ctas, int max_ctx,
		     int min_tokens, size_t part_per_split, size_t lse_per_split)
{
	long n = base_ctas >= target_ctas ? 1 : (target_ctas + base_ctas - 1) / base_ctas;
	long by_ctx = (max_ctx + min_tokens - 1) / min_tokens;

	if (n > by_ctx)
		n = by_ctx;
	if (n > ATTN_MAX_SPLITS)
		n = ATTN_MAX_SPLITS;
	if (part_per_split && (size_t)n * part_per_split > ws->part_floats)
		n = (long)(ws->part_floats / part_per_split);
	if (lse_per_split && (size_t)n * lse_per_split > ws->lse_floats)
		n = (long)(ws->lse_floats / lse_per_split);
	return n < 1 ? 1 : (int)n;
}

int attn_check_rows(const char *who, const k_cuda_attn_ws *ws, const k_cuda_attn_rows *rows,
		    int block_tokens, int n_heads, int dim)
{
	if (!ws || !rows)
		ATTN_INVAL("%s: no workspace or rows", who);
	if (rows->n_rows < 0 || rows->n_rows > ws->max_rows || rows->n_rows > 65535)
		ATTN_INVAL("%s: %d rows, the workspace holds %d", who, rows->n_rows, ws->max_rows);
	if (rows->max_ctx < 0 || rows->max_ctx > ws->max_ctx)
		ATTN_INVAL("%s: max_ctx %d, the workspace was made for %d", who, rows->max_ctx,
			   ws->max_ctx);
	if (block_tokens < 1 || block_tokens > 65536)
		ATTN_INVAL("%s: block_tokens %d unsupported (1..65536)", who, block_tokens);
	if (n_heads < 1 || n_heads > ws->max_heads)
		ATTN_INVAL("%s: %d heads, the workspace holds %d", who, n_heads, ws->max_heads);
	if (dim < 1 || dim > ws->max_dim)
		ATTN_INVAL("%s: per-head width %d, the workspace holds %d", who, dim, ws->max_dim);
	return 0;
}

// k_cuda_tuning()->attn_merge_batched (KDEC_ATTN_MERGE=1): the batched warp kernel
// instead of attn_merge_kernel (a block per head, 4 partial loads at a time). Off by
// default: measured on H200 (Llama-3.1-8B, ctx 1024, step p50) the block kernel did no
// worse: 4.50 / 7.50 ms at batch 1 / 64 against 4.61 / 7.55 with the warp kernel, one
// run each. Read at each call: the tests run both.
static int merge_batched_env(void)
{
	return k_cuda_tuning()->attn_merge_batched != 0;
}

// V-float vectors: dim and the strides multiples of V, the bases aligned to them.
static bool merge_vec_ok(int V, int dim, const float *out, long out_rs, long out_hs,
			 const uint16_t *out_bf16, const float *part_o)
{
	return dim % V == 0 && out_rs % V == 0 && out_hs % V == 0 &&
	       (uintptr_t)out % (4 * V) == 0 && (uintptr_t)out_bf16 % (2 * V) == 0 &&
	       (uintptr_t)part_o % (4 * V) == 0;
}

// Warp items of a batched launch of V-float lanes: (row, head, 32 V dims).
static long merge_items(int V, int n_rows, int n_heads, int dim)
{
	return (long)n_rows * n_heads * attn_cdiv(dim, 32 * V);
}

// The batched kernel's lane width: the widest that alignment allows, narrowed while one
// round of MERGE_REGS / V loads would not cover every split or the warps would leave
// SMs idle. Llama-3.1-8B: batch 1 (32 heads, ~50 splits) takes 1 (128 warps, 32 loads
// each), batch 64 (3 splits) 4 (2048 warps, 3 float4 each).
static int merge_pick_vec(int n_sm, int n_splits, int n_rows, int n_heads, int dim,
			  const float *out, long out_rs, long out_hs, const uint16_t *out_bf16,
			  const float *part_o)
{
	int V = 4;

	while (V > 1 && (!merge_vec_ok(V, dim, out, out_rs, out_hs, out_bf16, part_o) ||
			 n_splits > MERGE_REGS / V ||
			 merge_items(V, n_rows, n_heads, dim) < n_sm))
		V /= 2;
	return V;
}

// Warps per block: MERGE_WARPS, fewer while the blocks would not reach every SM (a
// latency-bound merge wants its loads spread over as many SMs as it can).
static int merge_pick_warps(long items, int n_sm)
{
	int wpb = MERGE_WARPS;

	while (wpb > 1 && (items + wpb - 1) / wpb < n_sm)
		wpb /= 2;
	return wpb;
}

static int merge_launch(cudaStream_t s, int n_sm, const float *part_o, const float *part_lse,
			int n_splits, int n_rows, int n_heads, int dim, float *out, long out_rs,
			long out_hs, uint16_t *out_bf16)
{
	const int V = merge_pick_vec(n_sm, n_splits, n_rows, n_heads, dim, out, out_rs, out_hs,
				     out_bf16, part_o);
	const long items = merge_items(V, n_rows, n_heads, dim);
	const int wpb = merge_pick_warps(items, n_sm);
	const long blocks = (items + wpb - 1) / wpb;
	void (*kernel)(float *, long, long, const float *, const float *, int, int, int, int,
		       int, int, uint16_t *) = V == 4 ? attn_merge_warp_kernel<4>
				       : V == 2 ? attn_merge_warp_kernel<2>
						: attn_merge_warp_kernel<1>;

	if (items == 0)
		return 0;
	if (!merge_batched_env() || items > MERGE_MAX_ITEMS) {
		k_cuda_launch_pdl(s, dim3((unsigned)((long)n_rows * n_heads),
					  attn_cdiv(dim, MERGE_THREADS)),
				  MERGE_THREADS, 0, attn_merge_kernel, out, out_rs, out_hs, part_o,
				  part_lse, n_splits, n_rows, n_heads, dim, out_bf16,
				  k_cuda_pdl_relay_enabled(K_CUDA_RELAY_MERGE));
		K_CUDA_TRY_LAUNCHED("attn_merge_kernel");
		return 0;
	}
	k_cuda_launch_pdl(s, dim3((unsigned)blocks), wpb * 32, 0, kernel, out, out_rs, out_hs,
			  part_o, part_lse, n_splits, n_rows, n_heads, dim,
			  attn_cdiv(dim, 32 * V), (int)items, out_bf16);
	K_CUDA_TRY_LAUNCHED("attn_merge_warp_kernel");
	return 0;
}

int attn_merge(cudaStream_t s, const k_cuda_attn_ws *ws, int n_splits, int n_rows,
	       int n_heads, int dim, float *out, long out_rs, long out_hs, uint16_t *out_bf16)
{
	return merge_launch(s, ws->n_sm, ws->part_o, ws->part_lse, n_splits, n_rows, n_heads,
			    dim, out, out_rs, out_hs, out_bf16);
}

extern "C" int k_cuda_attn_merge(cudaStream_t s, const struct k_cuda_attn_ws *ws,
				 const float *part_o, const float *part_lse, int n_splits,
				 int n_rows, int n_heads, int dim, float *out, long out_rs,
				 long out_hs, uint16_t *out_bf16)
{
	if (!ws || n_splits < 1 || n_splits > ATTN_MAX_SPLITS || n_rows < 0 || n_rows > 65535 ||
	    n_heads < 1 || n_heads > 4096 || dim < 1 || dim > 4096)
		ATTN_INVAL("k_cuda_attn_merge: %d splits, %d rows, %d heads, dim %d unsupported",
			   n_splits, n_rows, n_heads, dim);
	return merge_launch(s, ws->n_sm, part_o, part_lse, n_splits, n_rows, n_heads, dim, out,
			    out_rs, out_hs, out_bf16);
}

extern "C" void k_cuda_attn_ws_destroy(struct k_cuda_attn_ws *ws)
{
	if (!ws)
		return;
	cudaFree(ws->q_lat);
	cudaFree(ws->o_lat);
	cudaFree(ws->part_o);
	cudaFree(ws->part_lse);
	free(ws);
}

static int ws_alloc(float **p, size_t floats)
{
	K_CUDA_TRY(cudaMalloc((void **)p, floats * sizeof(float)));
	return 0;
}

// Device facts the launchers need: multiprocessors and the shared-memory opt-in limit.
static int ws_query_device(k_cuda_attn_ws *ws)
{
	int dev;

	K_CUDA_TRY(cudaGetDevice(&dev));
	K_CUDA_TRY(cudaDeviceGetAttribute(&ws->n_sm, cudaDevAttrMultiProcessorCount, dev));
	K_CUDA_TRY(cudaDeviceGetAttribute(&ws->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
					  dev));
	return 0;
}

extern "C" int k_cuda_attn_ws_create(struct k_cuda_attn_ws **out, int max_rows, int max_heads,
				     int max_dim, int max_ctx)
{
	k_cuda_attn_ws *ws;
	size_t per_head = (size_t)max_heads * max_dim;
	size_t split_rows;
	int ret;

	*out = nullptr;
	if (max_rows < 1 || max_rows > 65535 || max_heads < 1 || max_heads > 4096 ||
	    max_dim < 1 || max_dim > 4096 || max_ctx < 0)
		ATTN_INVAL("k_cuda_attn_ws_create: rows %d, heads %d, dim %d, ctx %d unsupported",
			   max_rows, max_heads, max_dim, max_ctx);
	ws = (k_cuda_attn_ws *)calloc(1, sizeof(*ws));
	if (!ws)
		return -ENOMEM;
	ws->max_rows = max_rows;
	ws->max_heads = max_heads;
	ws->max_dim = max_dim;
	ws->max_ctx = max_ctx;
	// Few rows want many splits, many rows few: hold the larger of the two needs.
	split_rows = (size_t)max_rows * ATTN_WS_SPLITS_AT_MAX_ROWS;
	if (split_rows < ATTN_MAX_SPLITS)
		split_rows = ATTN_MAX_SPLITS;
	ws->part_floats = split_rows * per_head;
	ws->lse_floats = split_rows * (size_t)max_heads;
	if ((ret = ws_query_device(ws)) ||
	    (ret = ws_alloc(&ws->q_lat, (size_t)max_rows * per_head)) ||
	    (ret = ws_alloc(&ws->o_lat, (size_t)max_rows * per_head)) ||
	    (ret = ws_alloc(&ws->part_o, ws->part_floats)) ||
	    (ret = ws_alloc(&ws->part_lse, ws->lse_floats)) ||
	    (ret = attn_tile_prepare(ws->smem_optin)) || (ret = attn_mla_prepare(ws->smem_optin)) ||
	    (ret = attn_mma_prepare(ws->smem_optin)) ||
	    (ret = attn_prefill_prepare(ws->smem_optin)))
		goto err;
	*out = ws;
	return 0;
err:
	k_cuda_attn_ws_destroy(ws);
	return ret;
}
