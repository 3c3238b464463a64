// Top-k draws by vocabulary slices on the GPU (docs/PARALLEL.md): each row's best
// K_CUDA_TOPK_SLICE_K (value, id) pairs of a rank's slice, so that at most 64 pairs a
// row cross to the host instead of the slice. The order is kernels/cpu/sample.c's
// ranks_before: the higher logit, then the lower id; NaN never a candidate; -inf one.
//
// Shape: a row is cut into chunks of TOPK_CHUNK (4096) values, one CTA of 256 threads
// per (chunk, row), 16 values a thread held in registers (one read of the logits:
// rows * vn * 4 bytes, the floor). Each CTA selects its chunk's best K; where the row
// has several chunks a second launch (one CTA per row) selects the row's best K among
// the chunks' (at most 64 chunks of K: the same 4096 items a CTA holds).
//
// The selection: every item gets a unique 48-bit key, (orderable logit << 16) |
// (0xffff - position), so the larger key is the one ranks_before puts first (the
// position follows the id, in both launches); a radix select over 8-bit digits, most
// significant first, finds the bin of the K-th largest and stops as soon as the items
// left in that bin are exactly the ones still needed (usually after 2-3 digits on
// logits; ties of the logit go on into the position's digits: at most 6 passes). The
// selected K are then exactly those whose key's decided digits are >= the prefix:
// gathered in any order (a slot counter), then sorted by position, so the result is
// deterministic and ids come out ascending. The histograms' atomics: a warp's equal
// digits counted at once (match.any) or one an item, k_cuda_tuning()->topk_match (the
// same bits; which is faster is not yet measured).
#include <cstdint>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/logit_key.cuh"

#define TOPK_K K_CUDA_TOPK_SLICE_K
#define TOPK_THREADS 256
#define TOPK_PER_THREAD 16
#define TOPK_CHUNK (TOPK_THREADS * TOPK_PER_THREAD)
#define TOPK_MAX_CHUNKS (TOPK_CHUNK / TOPK_K)	// the merge's items fit one CTA
#define TOPK_POS_BITS 16

static_assert(K_CUDA_TOPK_SLICE_MAX_VN == TOPK_MAX_CHUNKS * TOPK_CHUNK, "the merge holds every chunk's K");
static_assert(TOPK_THREADS == 256, "one histogram bin per thread");

typedef unsigned long long u64;

namespace {	// kernels stay private to this file

struct topk_smem {
	unsigned hist[256];	// this pass's digit counts
	unsigned wsum[TOPK_THREADS / 32];
	u64 sel[TOPK_K];	// the selected items' keys, in slot order
	u64 sorted[TOPK_K];	// the same by position
	unsigned n_sel;
	unsigned bin, bin_count, need, total;
};


__device__ __forceinline__ u64 item_key(unsigned key, int pos)
{
	return key ? (u64)key << TOPK_POS_BITS | (u64)(0xffff - pos) : 0;
}

__device__ __forceinline__ int item_pos(u64 c)
{
	return 0xffff - (int)(c & 0xffff);
}

// Inclusive sum of v over the CTA in thread order; *total gets the whole sum.
__device__ unsigned block_scan(unsigned v, unsigned *total, topk_smem &S)
{
	const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	unsigned x = v, before = 0;

	for (int o = 1; o < 32; o <<= 1) {
		unsigned y = __shfl_up_sync(0xffffffffu, x, o);

		if (lane >= o)
			x += y;
	}
	if (lane == 31)
		S.wsum[warp] = x;
	__syncthreads();
	*total = 0;
	for (int w = 0; w < TOPK_THREADS / 32; w++) {
		before += w < warp ? S.wsum[w] : 0;
		*total += S.wsum[w];
	}
	__syncthreads();
	return before + x;
}

// Counts item c's digit d where in: MATCH 1, one atomic per digit a warp holds (logits
// crowd few bins of the first digits; a warp with no item in skips the match);
// MATCH 0, an atomic an item (k_cuda_tuning()->topk_match picks, an A/B of the same
// bits). Every thread of the warp calls it.
template <bool MATCH>
__device__ __forceinline__ void count_digit(bool in, unsigned d, topk_smem &S)
{
	if (!MATCH) {
		if (in)
			atomicAdd(&S.hist[d], 1u);
	} else if (__any_sync(0xffffffffu, in)) {
		const unsigned peers = __match_any_sync(0xffffffffu, in ? d : 256u);

		if (in && threadIdx.x % 32 == (unsigned)__ffs(peers) - 1)
			atomicAdd(&S.hist[d], (unsigned)__popc(peers));
	}
}

// The CTA's best min(K, items) of its items c[] (0: no item), by key, into S.sel
// (S.n_sel of them, in no order). Every thread calls it.
template <bool MATCH>
__device__ void select_best(const u64 (&c)[TOPK_PER_THREAD], topk_smem &S)
{
	int shift = 48;		// the digits at and above shift are decided: prefix
	u64 prefix = 0;
	bool first = true;

	if (threadIdx.x == 0)
		S.n_sel = 0;
	for (;;) {
		unsigned h, incl, total;
		const int s = shift - 8;

		S.hist[threadIdx.x] = 0;
		__syncthreads();
		for (int j = 0; j < TOPK_PER_THREAD; j++) {
			const bool in = c[j] && (c[j] >> shift) == prefix;

			count_digit<MATCH>(in, (unsigned)(c[j] >> s) & 255u, S);
		}
		__syncthreads();
		h = S.hist[255 - threadIdx.x];	// thread t: the t-th bin from the top
		incl = block_scan(h, &total, S);
		if (first) {	// every item is in the first pass: K of them, or all
			if (threadIdx.x == 0) {
				S.total = total;
				S.need = total < TOPK_K ? total : TOPK_K;
			}
			__syncthreads();
			if (S.need == 0 || S.need == S.total)
				break;	// none, or every item: prefix 0 above bit 48
			first = false;
		}
		{
			const unsigned need = S.need;

			__syncthreads();	// every thread read need before it changes
			if (incl >= need && incl - h < need) {	// the bin holding the need-th
				S.bin = 255 - threadIdx.x;
				S.bin_count = h;
				S.need = need - (incl - h);
			}
		}
		__syncthreads();
		prefix = prefix << 8 | S.bin;
		shift = s;
		if (S.bin_count == S.need || shift == 0)	// that bin's items are all wanted
			break;
		__syncthreads();	// S.bin and S.need read before the next pass writes
	}
	for (int j = 0; j < TOPK_PER_THREAD; j++)
		if (c[j] && (c[j] >> shift) >= prefix)
			S.sel[atomicAdd(&S.n_sel, 1u)] = c[j];
	__syncthreads();
}

// S.sel sorted by position (so by id) into S.sorted: each item's rank is the count of
// items before it (positions are unique). Every thread calls it.
__device__ void sort_selected(topk_smem &S)
{
	const int m = (int)S.n_sel, a = threadIdx.x;

	if (a < m) {
		const int p = item_pos(S.sel[a]);
		int rank = 0;

		for (int b = 0; b < m; b++)
			rank += item_pos(S.sel[b]) < p;
		S.sorted[rank] = S.sel[a];
	}
	__syncthreads();
}

struct topk_args {
	void *top;		// (rows, K) f32 values | (rows, K) i32 ids | (rows) i32 counts
	unsigned *ws_key;	// (rows, n_chunks, K) chunks' selected keys (0: none)
	int32_t *ws_id;		// (rows, n_chunks, K) their indices in the slice
	const float *logits;	// (rows, vn) f32
	int rows, vn, v0, n_chunks;
};

// Row blockIdx.y's final K: value re-read from the slice (its own bits: -0 stays -0),
// id v0 + index, ascending; unused slots NaN and -1.
__device__ void write_final(const topk_args &a, const topk_smem &S, int index)
{
	const int row = blockIdx.y, i = threadIdx.x;
	float *val = (float *)a.top + (size_t)row * TOPK_K;
	int32_t *ids = (int32_t *)a.top + (size_t)a.rows * TOPK_K + (size_t)row * TOPK_K;

	if (i == 0)
		((int32_t *)a.top)[(size_t)2 * a.rows * TOPK_K + row] = (int32_t)S.n_sel;
	if (i < (int)S.n_sel) {
		val[i] = a.logits[(size_t)row * a.vn + index];
		ids[i] = a.v0 + index;
	} else if (i < TOPK_K) {
		val[i] = __uint_as_float(0x7fc00000u);
		ids[i] = -1;
	}
}

// MERGE 0: chunk blockIdx.x of row blockIdx.y, from the logits (the final result
// where the row is one chunk); MERGE 1: the row's chunks' selections.
template <bool MERGE, bool MATCH>
__global__ void __launch_bounds__(TOPK_THREADS) topk_slice_kernel(topk_args a)
{
	__shared__ topk_smem S;
	const int row = blockIdx.y, chunk = blockIdx.x;
	const size_t wrow = ((size_t)row * a.n_chunks + (MERGE ? 0 : chunk)) * TOPK_K;
	const int n = MERGE ? a.n_chunks * TOPK_K : min(TOPK_CHUNK, a.vn - chunk * TOPK_CHUNK);
	u64 c[TOPK_PER_THREAD];
	u64 own = 0;
	int index = 0;

	for (int j = 0; j < TOPK_PER_THREAD; j++) {	// every load issued before any use
		const int p = j * TOPK_THREADS + threadIdx.x;
		unsigned key = 0;

		if (p < n)
			key = MERGE ? a.ws_key[wrow + p]
				    : k_cuda_logit_key(a.logits[(size_t)row * a.vn + (size_t)chunk * TOPK_CHUNK + p]);
		c[j] = item_key(key, p);
	}
	select_best<MATCH>(c, S);
	sort_selected(S);
	if (threadIdx.x < S.n_sel) {
		own = S.sorted[threadIdx.x];
		index = MERGE ? a.ws_id[wrow + item_pos(own)] : chunk * TOPK_CHUNK + item_pos(own);
	}
	if (!MERGE && a.n_chunks > 1) {	// the chunk's K for the merge
		if (threadIdx.x < TOPK_K) {
			const bool have = threadIdx.x < S.n_sel;

			a.ws_key[wrow + threadIdx.x] = have ? (unsigned)(own >> TOPK_POS_BITS) : 0u;
			a.ws_id[wrow + threadIdx.x] = have ? index : -1;
		}
		return;
	}
	write_final(a, S, index);
}

}	// namespace

static int topk_chunks(int vn)
{
	return (vn + TOPK_CHUNK - 1) / TOPK_CHUNK;
}

extern "C" size_t k_cuda_topk_slice_ws_bytes(int rows, int vn)
{
	const int n_chunks = rows > 0 && vn > 0 ? topk_chunks(vn) : 0;

	return n_chunks > 1 ? (size_t)rows * n_chunks * TOPK_K * (sizeof(unsigned) + sizeof(int32_t)) : 0;
}

extern "C" int k_cuda_topk_slice(cudaStream_t s, void *top, void *ws, size_t ws_bytes,
				 const float *logits, int rows, int vn, int v0)
{
	topk_args a;
	const size_t need = k_cuda_topk_slice_ws_bytes(rows, vn);

	if (!top || !logits || rows < 1 || rows > 65535 || vn < 1 || vn > K_CUDA_TOPK_SLICE_MAX_VN ||
	    v0 < 0 || v0 > INT32_MAX - vn || ws_bytes < need || (need && !ws)) {
		k_cuda_log("k_cuda_topk_slice: %d rows of %d values from %d, %zu bytes of workspace "
			   "(%zu needed)", rows, vn, v0, ws_bytes, need);
		return -EINVAL;
	}
	a.top = top;
	a.n_chunks = topk_chunks(vn);
	a.ws_key = (unsigned *)ws;
	a.ws_id = ws ? (int32_t *)((unsigned *)ws + (size_t)rows * a.n_chunks * TOPK_K) : NULL;
	a.logits = logits;
	a.rows = rows;
	a.vn = vn;
	a.v0 = v0;
	if (k_cuda_tuning()->topk_match)
		topk_slice_kernel<false, true><<<dim3(a.n_chunks, rows), TOPK_THREADS, 0, s>>>(a);
	else
		topk_slice_kernel<false, false><<<dim3(a.n_chunks, rows), TOPK_THREADS, 0, s>>>(a);
	K_CUDA_TRY_LAUNCHED("topk_slice");
	if (a.n_chunks == 1)
		return 0;
	if (k_cuda_tuning()->topk_match)
		topk_slice_kernel<true, true><<<dim3(1, rows), TOPK_THREADS, 0, s>>>(a);
	else
		topk_slice_kernel<true, false><<<dim3(1, rows), TOPK_THREADS, 0, s>>>(a);
	return K_CUDA_LAUNCHED("topk_slice merge");
}
