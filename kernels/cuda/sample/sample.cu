// GPU sampling, one block per row (a greedy row may take several: sample_parts).
// Elements are ranked by a 32-bit key that orders logits (ties: the lower id) and
// weighed by exp(l / T - max) in 2^-40 fixed point, so every sum is exact and
// order-free. The procedure of kernels/k_sample.h has up to three stages, each "find
// the first element, in rank order, at which the running count (top-k) or mass (top-p,
// the draw) reaches a target within the current set":
//  - a stage is searched by a radix select over the key (12 + 12 + 8 bits), one pass
//    over the row per digit; as soon as everything up to the boundary fits in shared
//    memory (S_CAND elements) it is gathered, sorted and finished there;
//  - top-k with k <= 1024 first tries a filter: the k-th best of the 1024 per-thread
//    maxima bounds the k-th best logit from below, so one pass gathers a small superset.
// Typical cost: greedy one pass; top-k two or three passes; otherwise three to seven.
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/logit_key.cuh"
#include "kernels/cuda/sample/k_cuda_sample.h"

#define S_THREADS 1024
#define S_WARPS (S_THREADS / 32)
#define S_CAND 4096		// elements finished in shared memory
#define S_BINS 4096		// radix digits of rounds 1 and 2 (12 bits)
#define S_BINS3 256		// round 3 (8 bits)
#define S_UNROLL 4		// float4 loads in flight per thread in a pass
#define S_MAX_VOCAB (1 << 23)	// fixed-point sums of <= 2^23 * 2^40 fit 64 bits
#define MASS_ONE 1099511627776.0f	// 2^40

typedef unsigned long long u64;

enum { ST_TOPK, ST_TOPP, ST_SAMPLE };

/* Greedy rows are split over up to S_MAX_PARTS blocks of at least S_MIN_PART elements
 * where the rows leave SMs idle: one block streams a 128k-entry row at ~40 GB/s, so a
 * batch-1 draw took ~10 us for 0.5 MB. */
#define S_MAX_PARTS 16
#define S_MIN_PART 4096

struct k_cuda_sample_ws {
	int max_M, vocab, n_sms;
	u64 *best;		/* (max_M) device: a greedy row's running best packed key, 0 between launches */
	unsigned *arrived;	/* (max_M) device: its blocks done so far, 0 between launches */
};

// One row's parameters and the current set: the elements ranked at or before
// (cut_key, cut_id); cut_key 0 with cut_id -1 is every non-NaN element.
struct srow {
	const float *row;
	int vocab, vec4;
	float temp, top_p, u, zmax;
	int top_k;
	unsigned cut_key;
	int cut_id;
};

struct smem_t {
	unsigned cnt[S_BINS];		// radix histogram: elements per digit
	u64 mass[S_BINS];		// and their mass
	unsigned min_id[S_BINS3];	// round 3: lowest id per digit
	u64 cand[S_CAND];		// gathered: (~key << 32) | id, sorted ascending
	u64 cum[S_CAND];		// inclusive mass sums in that order
	u64 wa[S_WARPS], wb[S_WARPS];	// scan and reduction scratch
	u64 b0, b1, b2, b3;		// broadcast values
	int i0, n_cand;
};

namespace {	// kernels and their helpers stay private to this file

// ---- kernels: block primitives ----------------------------------------------

__device__ __forceinline__ u64 block_max(u64 v, smem_t &S)
{
	int lane = threadIdx.x % 32;

	for (int o = 16; o > 0; o >>= 1) {
		u64 x = __shfl_xor_sync(0xffffffffu, v, o);

		v = x > v ? x : v;
	}
	if (lane == 0)
		S.wa[threadIdx.x / 32] = v;
	__syncthreads();
	v = S.wa[lane];
	for (int o = 16; o > 0; o >>= 1) {
		u64 x = __shfl_xor_sync(0xffffffffu, v, o);

		v = x > v ? x : v;
	}
	__syncthreads();
	return v;
}

// Exclusive scan of (a, b) over the block in thread order; totals in *ta, *tb.
__device__ void block_scan2(u64 a, u64 b, u64 *ea, u64 *eb, u64 *ta, u64 *tb, smem_t &S)
{
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	u64 ia = a, ib = b, xa, xb;

	for (int o = 1; o < 32; o <<= 1) {
		u64 pa = __shfl_up_sync(0xffffffffu, ia, o), pb = __shfl_up_sync(0xffffffffu, ib, o);

		if (lane >= o) {
			ia += pa;
			ib += pb;
		}
	}
	if (lane == 31) {
		S.wa[warp] = ia;
		S.wb[warp] = ib;
	}
	__syncthreads();
	xa = S.wa[lane];
	xb = S.wb[lane];
	for (int o = 1; o < 32; o <<= 1) {
		u64 pa = __shfl_up_sync(0xffffffffu, xa, o), pb = __shfl_up_sync(0xffffffffu, xb, o);

		if (lane >= o) {
			xa += pa;
			xb += pb;
		}
	}
	*ta = __shfl_sync(0xffffffffu, xa, 31);
	*tb = __shfl_sync(0xffffffffu, xb, 31);
	xa = __shfl_sync(0xffffffffu, xa, (warp + 31) % 32);
	xb = __shfl_sync(0xffffffffu, xb, (warp + 31) % 32);
	*ea = (warp ? xa : 0) + ia - a;
	*eb = (warp ? xb : 0) + ib - b;
	__syncthreads();
}

__device__ __forceinline__ u64 block_sum(u64 v, smem_t &S)
{
	u64 e, e2, t, t2;

	block_scan2(v, 0, &e, &e2, &t, &t2, S);
	return t;
}

// Ascending bitonic sort of a[0..n), n a power of two; callers synchronise before.
__device__ void bitonic_sort(u64 *a, int n)
{
	for (int k = 2; k <= n; k <<= 1)
		for (int j = k >> 1; j > 0; j >>= 1) {
			for (int i = threadIdx.x; i < n; i += S_THREADS) {
				int p = i ^ j;

				if (p > i) {
					u64 x = a[i], y = a[p];

					if ((x > y) == ((i & k) == 0)) {
						a[i] = y;
						a[p] = x;
					}
				}
			}
			__syncthreads();
		}
}

// ---- kernels: keys, masses, sets ----------------------------------------------

// Keys: k_cuda_logit_key (logit_key.cuh), the order the slices' top-k shares.

__device__ __forceinline__ float key_logit(unsigned k)
{
	return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

// exp(l / T - max) as k_cpu_sample computes it, in units of 2^-40 (0 for NaN).
__device__ __forceinline__ u64 smass(const srow &R, float l)
{
	float e = expf(__fsub_rn(__fdiv_rn(l, R.temp), R.zmax));

	return e > 0.0f ? __float2ull_rn(__fmul_rn(e, MASS_ONE)) : 0;
}

__device__ __forceinline__ bool in_set(const srow &R, unsigned key, int i)
{
	return key > R.cut_key || (key == R.cut_key && i <= R.cut_id);
}

// First running weight >= frac * total, as a whole number of units, within [0, total].
__device__ __forceinline__ u64 frac_target(float frac, u64 total)
{
	double x = ceil((double)frac * (double)total);

	return x <= 0.0 ? 0 : x >= (double)total ? total : (u64)x;
}

// f(id, logit) for every element of the row; this thread's ids 4i..4i+3 (vec4) or i.
// The vector loop keeps S_UNROLL loads in flight per thread: one block has a whole
// row, so its memory parallelism decides the pass time. Plain loads, not __ldg: the
// logits are written by the kernel just before, which this one overlaps under PDL.
template <class F>
__device__ __forceinline__ void row_scan(const srow &R, F f)
{
	if (R.vec4) {
		const float4 *r4 = (const float4 *)R.row;
		int n4 = R.vocab / 4, i = threadIdx.x;

		for (; i + (S_UNROLL - 1) * S_THREADS < n4; i += S_UNROLL * S_THREADS) {
			float4 v[S_UNROLL];

#pragma unroll
			for (int u = 0; u < S_UNROLL; u++)
				v[u] = r4[i + u * S_THREADS];
#pragma unroll
			for (int u = 0; u < S_UNROLL; u++) {
				int b = 4 * (i + u * S_THREADS);

				f(b, v[u].x);
				f(b + 1, v[u].y);
				f(b + 2, v[u].z);
				f(b + 3, v[u].w);
			}
		}
		for (; i < n4; i += S_THREADS) {
			float4 v = r4[i];

			f(4 * i, v.x);
			f(4 * i + 1, v.y);
			f(4 * i + 2, v.z);
			f(4 * i + 3, v.w);
		}
	} else {
		for (int i = threadIdx.x; i < R.vocab; i += S_THREADS)
			f(i, R.row[i]);
	}
}

// Gathers the set's elements that pred accepts (and, skip0, that have mass) into
// S.cand; false when they do not fit.
template <class P>
__device__ bool gather(const srow &R, smem_t &S, bool skip0, P pred)
{
	int n;

	if (threadIdx.x == 0)
		S.n_cand = 0;
	__syncthreads();
	row_scan(R, [&](int i, float l) {
		unsigned key = k_cuda_logit_key(l);
		int pos;

		if (!in_set(R, key, i) || !pred(key) || (skip0 && smass(R, l) == 0))
			return;
		pos = atomicAdd(&S.n_cand, 1);
		if (pos < S_CAND)
			S.cand[pos] = ((u64)~key << 32) | (unsigned)i;
	});
	__syncthreads();
	n = S.n_cand;
	__syncthreads();
	return n <= S_CAND;
}

// ---- kernels: finishing in shared memory ----------------------------------------

// Number of cum[0..limit) below t (cum is nondecreasing: the index of the first >= t).
__device__ int count_below(smem_t &S, int limit, u64 t)
{
	u64 c = 0;

	for (int i = threadIdx.x; i < limit; i += S_THREADS)
		c += S.cum[i] < t;
	return (int)block_sum(c, S);
}

// The gathered elements are a prefix, in rank order, of the set of stage st (and the
// whole set when !known); target is st's boundary when known. Sorts them, sums their
// masses, runs the remaining stages; returns the token.
__device__ int finish(const srow &R, smem_t &S, int st, bool known, u64 target)
{
	int n = S.n_cand, np = 2, limit, idx;
	u64 v[4], sum = 0, e, e2, t, t2;

	while (np < n)
		np <<= 1;
	for (int i = n + threadIdx.x; i < np; i += S_THREADS)
		S.cand[i] = ~0ull;
	__syncthreads();
	bitonic_sort(S.cand, np);
	for (int q = 0; q < 4; q++) {
		int i = 4 * threadIdx.x + q;

		v[q] = i < n ? smass(R, key_logit(~(unsigned)(S.cand[i] >> 32))) : 0;
		sum += v[q];
	}
	block_scan2(sum, 0, &e, &e2, &t, &t2, S);
	for (int q = 0; q < 4; q++) {
		int i = 4 * threadIdx.x + q;

		e += v[q];
		if (i < n)
			S.cum[i] = e;
	}
	__syncthreads();

	limit = n;
	if (st == ST_TOPK) {
		u64 k = known ? target : (u64)R.top_k;

		limit = k < (u64)n ? (int)k : n;
		st = ST_TOPP;
		known = false;
	}
	if (st == ST_TOPP) {
		if (R.top_p > 0.0f) {
			idx = count_below(S, limit, known ? target : frac_target(R.top_p, S.cum[limit - 1]));
			limit = idx + 1 < limit ? idx + 1 : limit;
		}
		known = false;
	}
	idx = count_below(S, limit, known ? target : frac_target(R.u, S.cum[limit - 1]));
	return (int)(unsigned)S.cand[idx < limit ? idx : limit - 1];
}

// ---- kernels: radix search over the row ------------------------------------------

// Descending scan of the nb digits of the histogram: the highest nonempty digit whose
// running weight (after `before`) reaches target. Round 0 (first) sets *target from the
// totals. S.b0..b3 get the count and mass above the digit and in it.
__device__ int pick_digit(const srow &R, smem_t &S, int st, int nb, bool first, u64 before,
			  u64 *target)
{
	bool mass = st != ST_TOPK;
	unsigned c[4];
	u64 w[4], lc = 0, lw = 0, ec, ew, tc, tw;
	int js;

	for (int q = 0; q < 4; q++) {
		int j = 4 * threadIdx.x + q;

		c[q] = j < nb ? S.cnt[nb - 1 - j] : 0;
		w[q] = j < nb ? (mass ? S.mass[nb - 1 - j] : c[q]) : 0;
		lc += c[q];
		lw += w[q];
	}
	block_scan2(lc, lw, &ec, &ew, &tc, &tw, S);
	if (first)
		*target = !mass ? ((u64)R.top_k < tw ? (u64)R.top_k : tw) :
			  frac_target(st == ST_TOPP ? R.top_p : R.u, tw);
	if (threadIdx.x == 0)
		S.i0 = 0x7fffffff;
	__syncthreads();
	lw = ew;			// running weight through digit j = 4t + q
	for (int q = 0; q < 4; q++) {
		lw += w[q];
		if (c[q] > 0 && before + lw >= *target) {
			atomicMin(&S.i0, 4 * (int)threadIdx.x + q);
			break;
		}
	}
	__syncthreads();
	js = S.i0;
	if (js / 4 == (int)threadIdx.x) {
		u64 xc = ec, xw = ew;

		for (int q = 0; q < js % 4; q++) {
			xc += c[q];
			xw += w[q];
		}
		S.b0 = xc;
		S.b1 = mass ? xw : 0;
		S.b2 = c[js % 4];
		S.b3 = mass ? w[js % 4] : 0;
	}
	__syncthreads();
	return nb - 1 - js;
}

// Among the set's elements with key P, in id order, the first at which before + the
// running weight reaches target. *rc, *rw: count and weight of the set up to it.
__device__ int tie_pass(const srow &R, smem_t &S, unsigned P, bool mass, u64 need, u64 *rc,
			u64 *rw)
{
	u64 base_c = 0, base_w = 0;

	for (int t0 = 0; t0 < R.vocab; t0 += S_THREADS) {
		int i = t0 + threadIdx.x, hit;
		u64 f = 0, w = 0, ef, ew, tf, tw;

		if (i < R.vocab) {
			float l = R.row[i];
			unsigned key = k_cuda_logit_key(l);

			if (key == P && in_set(R, key, i)) {
				f = 1;
				w = mass ? smass(R, l) : 1;
			}
		}
		block_scan2(f, w, &ef, &ew, &tf, &tw, S);
		if (threadIdx.x == 0)
			S.i0 = 0x7fffffff;
		__syncthreads();
		if (f && base_w + ew + w >= need)
			atomicMin(&S.i0, i);
		__syncthreads();
		hit = S.i0;
		if (hit != 0x7fffffff) {
			if (i == hit) {
				S.b0 = base_c + ef + 1;
				S.b1 = base_w + ew + w;
			}
			__syncthreads();
			*rc = S.b0;
			*rw = S.b1;
			__syncthreads();
			return hit;
		}
		base_c += tf;
		base_w += tw;
	}
	*rc = base_c;	// not reached: the boundary exists
	*rw = base_w;
	return R.cut_id;
}

// Stage st over the current set. Returns 1 with *tok set when it finished in shared
// memory; else 0 with the set cut at the stage's boundary and *n the set's new size.
__device__ int search(srow &R, smem_t &S, int st, int *tok, u64 *n)
{
	bool mass = st != ST_TOPK;
	unsigned P = 0;
	u64 bc = 0, bm = 0, cnt_d = 0, mass_d = 0, target = 0, rc, rw;

	for (int r = 0; r < 3; r++) {
		int shift = r == 0 ? 20 : r == 1 ? 8 : 0, bits = r == 2 ? 8 : 12, nb = 1 << bits;
		unsigned hp = P;

		for (int d = threadIdx.x; d < nb; d += S_THREADS) {
			S.cnt[d] = 0;
			S.mass[d] = 0;
			if (r == 2)
				S.min_id[d] = 0xffffffffu;
		}
		__syncthreads();
		row_scan(R, [&](int i, float l) {
			unsigned key = k_cuda_logit_key(l), d;
			u64 m = 0;

			if (!in_set(R, key, i) || (r > 0 && (key >> (shift + bits)) != hp))
				return;
			if (mass && (m = smass(R, l)) == 0)
				return;
			d = (key >> shift) & (nb - 1);
			atomicAdd(&S.cnt[d], 1u);
			if (mass)
				atomicAdd(&S.mass[d], m);
			if (r == 2)
				atomicMin(&S.min_id[d], (unsigned)i);
		});
		__syncthreads();
		P = (P << bits) | (unsigned)pick_digit(R, S, st, nb, r == 0, mass ? bm : bc, &target);
		bc += S.b0;
		bm += S.b1;
		cnt_d = S.b2;
		mass_d = S.b3;
		__syncthreads();
		if (bc + cnt_d <= S_CAND) {
			unsigned pp = P;

			gather(R, S, mass, [=](unsigned key) { return (key >> shift) >= pp; });
			*tok = finish(R, S, st, true, target);
			return 1;
		}
	}
	// P is the boundary's key; cnt_d elements of the set have it.
	if (cnt_d == 1) {
		R.cut_id = (int)S.min_id[P & (S_BINS3 - 1)];
		rc = 1;
		rw = mass_d;
	} else {
		u64 before = mass ? bm : bc;

		R.cut_id = tie_pass(R, S, P, mass, target > before ? target - before : 0, &rc, &rw);
	}
	__syncthreads();
	R.cut_key = P;
	*n = bc + rc;
	*tok = R.cut_id;
	return 0;
}

// ---- kernels: the row -------------------------------------------------------------

// The k-th best of the per-thread best (key, id) packs: every element of the top k has
// a key >= it. At least 1, so that NaN stays out.
__device__ unsigned topk_floor(smem_t &S, int k, u64 mine)
{
	unsigned f;

	S.cand[threadIdx.x] = mine;
	__syncthreads();
	bitonic_sort(S.cand, S_THREADS);
	f = (unsigned)(S.cand[S_THREADS - k] >> 32);
	__syncthreads();
	return f > 0 ? f : 1;
}

__device__ int sample_row(srow &R, smem_t &S, u64 mine)
{
	int st = R.top_k ? ST_TOPK : ST_TOPP, tok;
	u64 n;

	if (R.top_k && R.top_k <= S_THREADS) {
		unsigned fl = topk_floor(S, R.top_k, mine);

		if (gather(R, S, false, [=](unsigned key) { return key >= fl; }))
			return finish(R, S, ST_TOPK, true, (u64)R.top_k);
	}
	for (;; st++) {
		if (st == ST_TOPP && !(R.top_p > 0.0f))
			st = ST_SAMPLE;
		if (search(R, S, st, &tok, &n))
			return tok;
		if (st == ST_SAMPLE)
			return tok;
		if (n <= S_CAND) {	// the whole new set fits: finish there
			gather(R, S, false, [](unsigned) { return true; });
			return finish(R, S, st + 1, false, 0);
		}
	}
}

// k_cpu_sample's argmax from the row's best packed key; with every logit NaN it ends on
// the last id.
__device__ __forceinline__ int32_t greedy_id(u64 best, int vocab)
{
	return (unsigned)(best >> 32) ? (int32_t)~(unsigned)best : vocab - 1;
}

// Block (row, part): a greedy row's parts each take `part` elements, fold their best
// into ws_best[row], and the last to arrive writes the id and clears the row's slots
// for the next launch. Any other row is drawn by its part-0 block alone.
__global__ void __launch_bounds__(S_THREADS, 1)
sample_kernel(int32_t *ids, const float *logits, int vocab, int vec4,
	      const k_sample_params *params, const uint64_t *steps, int part, u64 *ws_best,
	      unsigned *ws_arrived)
{
	extern __shared__ __align__(16) unsigned char smem_raw[];
	smem_t &S = *reinterpret_cast<smem_t *>(smem_raw);
	const k_sample_params p = k_cuda_pdl_early(params + blockIdx.x);	// a step input
	const bool greedy = !(p.temperature > 0.0f) || vocab == 1;
	const int base = greedy ? (int)blockIdx.y * part : 0;
	srow R;
	u64 mine = 0, best;
	unsigned kmax;
	int tok;

	if (!greedy && blockIdx.y > 0)
		return;
	k_cuda_pdl_wait();
	R.row = logits + (size_t)blockIdx.x * vocab + base;
	R.vocab = gridDim.y > 1 && greedy ? min(part, vocab - base) : vocab;
	R.vec4 = vec4;
	row_scan(R, [&](int i, float l) {
		u64 pk = ((u64)k_cuda_logit_key(l) << 32) | (unsigned)~(base + i);

		mine = pk > mine ? pk : mine;
	});
	best = block_max(mine, S);
	kmax = (unsigned)(best >> 32);
	if (greedy && gridDim.y > 1) {
		if (threadIdx.x == 0) {
			atomicMax(&ws_best[blockIdx.x], best);
			__threadfence();	// release: the max before the arrival
			if (atomicAdd(&ws_arrived[blockIdx.x], 1u) == gridDim.y - 1) {
				__threadfence();	// acquire: the others' maxima after theirs
				best = atomicExch(&ws_best[blockIdx.x], 0ull);	// every part's max is in
				ws_arrived[blockIdx.x] = 0;
				ids[blockIdx.x] = greedy_id(best, vocab);
			}
		}
		return;
	}
	if (greedy) {
		if (threadIdx.x == 0)
			ids[blockIdx.x] = greedy_id(best, vocab);
		return;
	}
	if (kmax == 0) {	// every logit NaN
		if (threadIdx.x == 0)
			ids[blockIdx.x] = 0;
		return;
	}
	R.temp = p.temperature;
	R.zmax = __fdiv_rn(key_logit(kmax), R.temp);
	R.top_k = p.top_k > 0 && p.top_k < vocab ? p.top_k : 0;
	R.top_p = p.top_p > 0.0f && p.top_p < 1.0f ? p.top_p : 0.0f;
	R.u = k_sample_uniform(p.seed, steps[blockIdx.x]);
	R.cut_key = 0;
	R.cut_id = -1;
	tok = sample_row(R, S, mine);
	if (threadIdx.x == 0)
		ids[blockIdx.x] = tok;
}

}	// namespace

// ---- launchers --------------------------------------------------------------------

extern "C" void k_cuda_sample_ws_destroy(struct k_cuda_sample_ws *ws)
{
	if (!ws)
		return;
	cudaFree(ws->best);
	cudaFree(ws->arrived);
	free(ws);
}

extern "C" int k_cuda_sample_ws_create(struct k_cuda_sample_ws **out, int max_M, int vocab)
{
	k_cuda_sample_ws *ws;
	int dev = 0;

	*out = nullptr;
	if (max_M <= 0 || vocab <= 0 || vocab > S_MAX_VOCAB)
		return -EINVAL;
	if (K_CUDA_CALL(cudaFuncSetAttribute(sample_kernel,
					     cudaFuncAttributeMaxDynamicSharedMemorySize,
					     (int)sizeof(smem_t))))
		return -EIO;
	ws = (k_cuda_sample_ws *)calloc(1, sizeof(*ws));
	if (!ws)
		return -ENOMEM;
	ws->max_M = max_M;
	ws->vocab = vocab;
	if (K_CUDA_CALL(cudaGetDevice(&dev)) ||
	    K_CUDA_CALL(cudaDeviceGetAttribute(&ws->n_sms, cudaDevAttrMultiProcessorCount, dev)) ||
	    K_CUDA_CALL(cudaMalloc((void **)&ws->best, (size_t)max_M * sizeof(*ws->best))) ||
	    K_CUDA_CALL(cudaMalloc((void **)&ws->arrived, (size_t)max_M * sizeof(*ws->arrived))) ||
	    K_CUDA_CALL(cudaMemset(ws->best, 0, (size_t)max_M * sizeof(*ws->best))) ||
	    K_CUDA_CALL(cudaMemset(ws->arrived, 0, (size_t)max_M * sizeof(*ws->arrived)))) {
		k_cuda_sample_ws_destroy(ws);
		return -EIO;
	}
	*out = ws;
	return 0;
}

// Blocks per greedy row: the SMs the rows leave idle, each part at least S_MIN_PART
// elements; 1 where there are more rows than the workspace holds.
static int sample_parts(const k_cuda_sample_ws *ws, int M, int vocab, int *part)
{
	int n = M <= ws->max_M ? ws->n_sms / M : 1;

	n = n < S_MAX_PARTS ? n : S_MAX_PARTS;
	n = n < vocab / S_MIN_PART ? n : vocab / S_MIN_PART;
	if (n <= 1) {
		*part = vocab;
		return 1;
	}
	*part = (vocab + n - 1) / n;
	*part = (*part + 1023) / 1024 * 1024;	// a multiple of 4: float4 loads stay aligned
	return (vocab + *part - 1) / *part;
}

extern "C" int k_cuda_sample(cudaStream_t s, struct k_cuda_sample_ws *ws, int32_t *ids,
			     const float *logits, int M, int vocab,
			     const struct k_sample_params *params, const uint64_t *steps)
{
	int vec4, n, part;

	if (!ws || M < 0 || vocab <= 0 || vocab > ws->vocab)
		return -EINVAL;
	if (M == 0)
		return 0;
	vec4 = vocab % 4 == 0 && (uintptr_t)logits % 16 == 0;
	n = sample_parts(ws, M, vocab, &part);
	k_cuda_launch_pdl(s, dim3(M, n), dim3(S_THREADS), sizeof(smem_t), sample_kernel, ids, logits,
			  vocab, vec4, params, steps, part, ws->best, ws->arrived);
	return K_CUDA_LAUNCHED("sample");
}
