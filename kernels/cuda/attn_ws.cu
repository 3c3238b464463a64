// The attention workspace (split partials, MLA scratch), the rule that picks the number
// of splits along the sequence, and the log-sum-exp merge of the split partials.
#include <cstdlib>

#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/launch_check.cuh"

#define MERGE_THREADS 128

// ---- kernels ----------------------------------------------------------------

// Block (r, h, dim chunk): out(r, h, d) = sum_s w_s o_s(d) / sum_s w_s with
// w_s = exp2(lse_s - max), for the block's MERGE_THREADS dims. Splits with lse = -inf
// saw no token: weight 0, their o is never read. The splits that count are listed
// first, so each thread's loads over them are independent and issued together.
__global__ void __launch_bounds__(MERGE_THREADS)
attn_merge_kernel(float *__restrict__ out, long out_rs, long out_hs,
		  const float *__restrict__ part_o, const float *__restrict__ part_lse,
		  int n_splits, int n_rows, int n_heads, int dim, uint16_t *__restrict__ out_bf16)
{
	__shared__ float w[ATTN_MAX_SPLITS];
	__shared__ int live[ATTN_MAX_SPLITS];
	__shared__ int n_live;
	const int r = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
	const size_t rh = (size_t)r * n_heads + h, per_split = (size_t)n_rows * n_heads;
	const int d = blockIdx.y * MERGE_THREADS + threadIdx.x;

	k_cuda_pdl_wait();
	if (threadIdx.x < 32) {	// one warp: lane owns splits lane + 32 k
		constexpr int PER = ATTN_MAX_SPLITS / 32;
		const int lane = threadIdx.x;
		float x[PER], mx = -INFINITY, sum = 0.0f;
		int base = 0;

#pragma unroll
		for (int k = 0; k < PER; k++) {
			const int sp = lane + 32 * k;

			x[k] = sp < n_splits ? part_lse[sp * per_split + rh] : -INFINITY;
			mx = fmaxf(mx, x[k]);
		}
		for (int off = 16; off > 0; off >>= 1)
			mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
#pragma unroll
		for (int k = 0; k < PER; k++) {
			x[k] = x[k] == -INFINITY ? 0.0f : exp2f(x[k] - mx);
			sum += x[k];
		}
		for (int off = 16; off > 0; off >>= 1)
			sum += __shfl_xor_sync(0xffffffffu, sum, off);
		// sum >= 1 unless no split saw a token (ctx 0): then no split is listed.
#pragma unroll
		for (int k = 0; k < PER; k++) {
			const bool on = sum > 0.0f && x[k] != 0.0f;
			const unsigned m = __ballot_sync(0xffffffffu, on);

			if (on) {
				const int at = base + __popc(m & ((1u << lane) - 1u));

				live[at] = lane + 32 * k;
				w[at] = x[k] / sum;
			}
			base += __popc(m);
		}
		if (lane == 0)
			n_live = base;
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

int attn_merge(cudaStream_t s, const k_cuda_attn_ws *ws, int n_splits, int n_rows,
	       int n_heads, int dim, float *out, long out_rs, long out_hs, uint16_t *out_bf16)
{
	long blocks = (long)n_rows * n_heads;

	if (blocks == 0)
		return 0;
	k_cuda_launch_pdl(s, dim3((unsigned)blocks, attn_cdiv(dim, MERGE_THREADS)), MERGE_THREADS, 0,
			  attn_merge_kernel, out, out_rs, out_hs, (const float *)ws->part_o,
			  (const float *)ws->part_lse, n_splits, n_rows, n_heads, dim, out_bf16);
	ATTN_LAUNCHED("attn_merge_kernel");
	return 0;
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
	ATTN_TRY(cudaMalloc((void **)p, floats * sizeof(float)));
	return 0;
}

// Device facts the launchers need: multiprocessors and the shared-memory opt-in limit.
static int ws_query_device(k_cuda_attn_ws *ws)
{
	int dev;

	ATTN_TRY(cudaGetDevice(&dev));
	ATTN_TRY(cudaDeviceGetAttribute(&ws->n_sm, cudaDevAttrMultiProcessorCount, dev));
	ATTN_TRY(cudaDeviceGetAttribute(&ws->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
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
	    (ret = attn_mma_prepare(ws->smem_optin)))
		goto err;
	*out = ws;
	return 0;
err:
	k_cuda_attn_ws_destroy(ws);
	return ret;
}
