// The one-shot all-reduce fused with the residual add and RMSNorm (k_cuda_comm.h): the
// ranks' receive buffers, their turn counters, the kernel and its launchers.
//
// A rank's launch k: (1) push: each CTA sends its rows of the partial into slot `rank`
// of buffer k % 3 of every rank (sentinel bits replaced by +0); (2) reset: the CTAs
// refill this rank's buffer (k + 2) % 3 (the previous launch's) with the sentinel, as
// many values per slot as that launch wrote; (3) for each of its rows, each CTA spins
// on its own buffer until every slot holds no sentinel, sums the slots in rank order in
// fp32, adds the residual, and normalises as k_cuda_add_rmsnorm does (fp64 sum of
// squares, one fp32 rounding of the mean); (4) the last CTA to finish records the
// launch's size and advances the turn counter.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_check.cuh"

#define AR_MAX_THREADS 512	// one CTA per row at a time, its threads across the row
#define AR_BATCH 4		// slots whose loads a thread has in flight together
#define AR_WATCHDOG_NS 10000000000ull	// a wait this long means a rank never came: trap

// A rank's turn counter and sizes, in its device's memory.
struct ar_ctl {
	unsigned launch;	// reductions this rank completed
	unsigned arrived;	// CTAs of the current launch that finished
	unsigned elems[3];	// values per slot that the last launch on each buffer wrote
};

struct k_cuda_ar {
	int n, dtype, max_rows, max_width, per_device;
	size_t slot;			// values per slot: max_rows * max_width
	int dev[K_CUDA_AR_MAX_RANKS];
	int sms[K_CUDA_AR_MAX_RANKS];	// SMs of each rank's device
	void *recv[K_CUDA_AR_MAX_RANKS];	// (3, n, slot) payload on rank r's device
	struct ar_ctl *ctl[K_CUDA_AR_MAX_RANKS];
};

namespace {	// kernels and their helpers stay private to this file

// One rank's pointers in the kernel's parameters.
struct ar_rank_dev {
	const uint4 *partial;
	float *residual, *out;
	const float *gamma;
	uint16_t *out_bf16;
	ar_ctl *ctl;
	uint4 *own;		// this rank's receive buffer
	int rank;
};

struct ar_params {
	uint4 *recv[K_CUDA_AR_MAX_RANKS];	// every rank's receive buffer
	ar_rank_dev r[K_CUDA_AR_MAX_RANKS];	// blockIdx.y's rank
	int n, rows, width;
	size_t slot;				// values per slot
	float eps;
};

// ---- the two payloads: 16 bytes = VEC values; the sentinel is -0.0 -----------------

struct pay_bf16 {
	static constexpr int VEC = 8;
	static constexpr unsigned SENT = 0x80008000u;

	__device__ static bool ready(uint4 v)
	{
		const unsigned w[4] = { v.x, v.y, v.z, v.w };
		bool ok = true;

#pragma unroll
		for (int i = 0; i < 4; i++)
			ok &= (w[i] & 0xffffu) != 0x8000u && (w[i] >> 16) != 0x8000u;
		return ok;
	}
	__device__ static unsigned scrub1(unsigned w)
	{
		if ((w & 0xffffu) == 0x8000u)
			w &= 0xffff0000u;
		if ((w >> 16) == 0x8000u)
			w &= 0x0000ffffu;
		return w;
	}
	__device__ static void widen(uint4 v, float (&f)[VEC])
	{
		const unsigned w[4] = { v.x, v.y, v.z, v.w };

#pragma unroll
		for (int i = 0; i < 4; i++) {
			f[2 * i] = __uint_as_float(w[i] << 16);
			f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
		}
	}
};

struct pay_f32 {
	static constexpr int VEC = 4;
	static constexpr unsigned SENT = 0x80000000u;

	__device__ static bool ready(uint4 v)
	{
		return v.x != SENT && v.y != SENT && v.z != SENT && v.w != SENT;
	}
	__device__ static unsigned scrub1(unsigned w)
	{
		return w == SENT ? 0u : w;
	}
	__device__ static void widen(uint4 v, float (&f)[VEC])
	{
		f[0] = __uint_as_float(v.x);
		f[1] = __uint_as_float(v.y);
		f[2] = __uint_as_float(v.z);
		f[3] = __uint_as_float(v.w);
	}
};

// ---- memory access: the receive buffers are read and written around the caches ------

__device__ __forceinline__ uint4 ld_volatile(const uint4 *p)
{
	uint4 v;

	asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
		     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
	return v;
}

__device__ __forceinline__ void st_volatile(uint4 *p, uint4 v)
{
	asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
		     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ unsigned long long globaltimer(void)
{
	unsigned long long t;

	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

// Waits until the 16 bytes at p hold no sentinel. A peer that never sends would hang
// the stream for ever; after AR_WATCHDOG_NS the kernel traps instead (the context's
// error then fails every later call, which the caller sees as -EIO).
template <typename P>
__device__ __forceinline__ uint4 wait_ready(const uint4 *p, int rank, int from)
{
	uint4 v = ld_volatile(p);
	unsigned long long t0 = 0;

	for (unsigned spins = 0; !P::ready(v); spins++) {
		if ((spins & 1023u) == 0) {
			const unsigned long long t = globaltimer();

			if (!t0)
				t0 = t;
			else if (t - t0 > AR_WATCHDOG_NS) {
				printf("k_cuda_ar: rank %d waited %llu s for rank %d's data: trap\n",
				       rank, AR_WATCHDOG_NS / 1000000000ull, from);
				__trap();
			}
		}
		v = ld_volatile(p);
	}
	return v;
}

__device__ __forceinline__ double block_sum_d(double v, double *red)
{
	const int nw = (blockDim.x + 31) / 32;

	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	if (threadIdx.x % 32 == 0)
		red[threadIdx.x / 32] = v;
	__syncthreads();
	v = 0.0;
	for (int w = 0; w < nw; w++)	// same order in every thread
		v += red[w];
	__syncthreads();		// red is free for the next row
	return v;
}

// ---- kernels ----------------------------------------------------------------

__global__ void ar_fill_kernel(uint4 *p, size_t n16, unsigned sent)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
	     i += (size_t)gridDim.x * blockDim.x)
		p[i] = make_uint4(sent, sent, sent, sent);
}

// (1) push this CTA's rows of the partial into slot `rank` of buffer `cur` everywhere.
template <typename P>
__device__ __forceinline__ void ar_push(const ar_params &p, const ar_rank_dev &me, int cur)
{
	const int vpr = p.width / P::VEC;

	for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
		for (int v = threadIdx.x; v < vpr; v += blockDim.x) {
			uint4 x = me.partial[(size_t)row * vpr + v];
			const size_t at = ((size_t)(cur * p.n + me.rank) * p.slot +
					   (size_t)row * p.width) / P::VEC + v;

			x = make_uint4(P::scrub1(x.x), P::scrub1(x.y), P::scrub1(x.z), P::scrub1(x.w));
			for (int d = 0; d < p.n; d++)
				st_volatile(p.recv[d] + at, x);
		}
}

// (2) the previous launch's buffer back to the sentinel, as much of each slot as it wrote.
template <typename P>
__device__ __forceinline__ void ar_reset(const ar_params &p, const ar_rank_dev &me, int old,
					 unsigned n_old)
{
	const size_t n16 = n_old / P::VEC;
	const uint4 s = make_uint4(P::SENT, P::SENT, P::SENT, P::SENT);

	for (int from = 0; from < p.n; from++) {
		uint4 *slot = me.own + (size_t)(old * p.n + from) * p.slot / P::VEC;

		for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
		     i += (size_t)gridDim.x * blockDim.x)
			slot[i] = s;
	}
}

// (3) each of this CTA's rows: wait, sum in rank order, add the residual, normalise.
// PER: 16-byte groups per thread, so the row's sum sits in registers.
template <typename P, int PER>
__device__ __forceinline__ void ar_reduce_rows(const ar_params &p, const ar_rank_dev &me, int cur)
{
	__shared__ double red[AR_MAX_THREADS / 32];
	const int vpr = p.width / P::VEC;

	for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
		float4 *res = (float4 *)(me.residual + (size_t)row * p.width);	// if residual
		float acc[PER][P::VEC];
		// the residual loaded before the wait where registers allow (PER 1: no spill)
		constexpr bool early = PER <= 2;
		float4 rv[PER][P::VEC / 4];
		double ss = 0.0;

#pragma unroll
		for (int k = 0; k < PER; k++) {
			const int v = threadIdx.x + k * blockDim.x;

#pragma unroll
			for (int e = 0; e < P::VEC; e++)
				acc[k][e] = 0.0f;
#pragma unroll
			for (int q = 0; q < P::VEC / 4; q++)
				if (early && me.residual && v < vpr)
					rv[k][q] = res[v * (P::VEC / 4) + q];
		}
		// AR_BATCH slots' loads in flight at once, then summed in rank order
		for (int f0 = 0; f0 < p.n; f0 += AR_BATCH)
#pragma unroll
			for (int k = 0; k < PER; k++) {
				const int v = threadIdx.x + k * blockDim.x;
				const size_t step = p.slot / P::VEC;	// one slot to the next
				const uint4 *src = me.own + ((size_t)(cur * p.n + f0) * p.slot +
							     (size_t)row * p.width) / P::VEC + v;
				uint4 x[AR_BATCH];

				if (v >= vpr)
					continue;
#pragma unroll
				for (int j = 0; j < AR_BATCH; j++)
					if (f0 + j < p.n)
						x[j] = ld_volatile(src + j * step);
#pragma unroll
				for (int j = 0; j < AR_BATCH; j++) {
					float f[P::VEC];

					if (f0 + j >= p.n)
						break;
					if (!P::ready(x[j]))
						x[j] = wait_ready<P>(src + j * step, me.rank, f0 + j);
					P::widen(x[j], f);
#pragma unroll
					for (int e = 0; e < P::VEC; e++)
						acc[k][e] = __fadd_rn(acc[k][e], f[e]);
				}
			}
		// x = residual + sum (written back), or the sum alone without a residual
#pragma unroll
		for (int k = 0; k < PER; k++) {
			const int v = threadIdx.x + k * blockDim.x;

			if (v >= vpr)
				continue;
#pragma unroll
			for (int q = 0; q < P::VEC / 4; q++) {
				float *a = &acc[k][4 * q];

				if (me.residual) {
					const float4 r = early ? rv[k][q] : res[v * (P::VEC / 4) + q];

					a[0] = __fadd_rn(r.x, a[0]);
					a[1] = __fadd_rn(r.y, a[1]);
					a[2] = __fadd_rn(r.z, a[2]);
					a[3] = __fadd_rn(r.w, a[3]);
					res[v * (P::VEC / 4) + q] = make_float4(a[0], a[1], a[2], a[3]);
				}
				ss += (double)a[0] * a[0] + (double)a[1] * a[1] + (double)a[2] * a[2] +
				      (double)a[3] * a[3];
			}
		}
		// out = rmsnorm(x) * gamma, or x itself without gamma (the same in every thread)
		float rs = 1.0f;

		if (me.gamma) {
			ss = block_sum_d(ss, red);
			rs = 1.0f / sqrtf((float)(ss / p.width) + p.eps);
		}
#pragma unroll
		for (int k = 0; k < PER; k++) {
			const int v = threadIdx.x + k * blockDim.x;
			const size_t at = (size_t)row * p.width + (size_t)v * P::VEC;

			if (v >= vpr || (!me.out && !me.out_bf16))
				continue;
#pragma unroll
			for (int e = 0; e < P::VEC; e++) {
				float o = acc[k][e];

				if (me.gamma) {
					const float4 g = ((const float4 *)me.gamma)[v * (P::VEC / 4) + e / 4];
					const float ge = e % 4 == 0 ? g.x : e % 4 == 1 ? g.y
						       : e % 4 == 2 ? g.z : g.w;

					o = __fmul_rn(ge, __fmul_rn(o, rs));
				}
				if (me.out)
					me.out[at + e] = o;
				if (me.out_bf16)
					me.out_bf16[at + e] = k_cuda_bf16_rn(o);
			}
		}
	}
}

// One launch of ranks r[blockIdx.y]: blockIdx.x splits its rows.
template <typename P, int PER>
__global__ void __launch_bounds__(AR_MAX_THREADS) ar_fused_kernel(const __grid_constant__ ar_params p)
{
	const ar_rank_dev &me = p.r[blockIdx.y];
	// the counter and the three sizes in one go (one line), not one after another
	const unsigned k = *(volatile unsigned *)&me.ctl->launch;
	const unsigned e0 = me.ctl->elems[0], e1 = me.ctl->elems[1], e2 = me.ctl->elems[2];
	const int cur = (int)(k % 3), old = (int)((k + 2) % 3);

	ar_push<P>(p, me, cur);
	ar_reset<P>(p, me, old, old == 0 ? e0 : old == 1 ? e1 : e2);
	ar_reduce_rows<P, PER>(p, me, cur);
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence();
		if (atomicAdd(&me.ctl->arrived, 1u) == gridDim.x - 1) {
			me.ctl->arrived = 0;
			me.ctl->elems[cur] = (unsigned)(p.rows * p.width);
			__threadfence();
			*(volatile unsigned *)&me.ctl->launch = k + 1;
		}
	}
}

}	// namespace

// ---- launchers --------------------------------------------------------------

typedef void (*ar_kernel_fn)(ar_params);

static int ar_vec(const struct k_cuda_ar *ar)
{
	return ar->dtype == K_CUDA_AR_BF16 ? 8 : 4;
}

// Threads and groups per thread of a row of width values: one 16-byte group per thread
// up to 1024 groups, else 2 or 4; 0 where the row is wider than 4096 groups.
static int ar_pick(const struct k_cuda_ar *ar, int width, int *threads, ar_kernel_fn *fn)
{
	const int groups = width / ar_vec(ar);
	const int per = groups <= AR_MAX_THREADS ? 1 : groups <= 2 * AR_MAX_THREADS ? 2
		      : groups <= 4 * AR_MAX_THREADS ? 4 : groups <= 8 * AR_MAX_THREADS ? 8 : 0;
	static const ar_kernel_fn table[2][4] = {
		{ ar_fused_kernel<pay_bf16, 1>, ar_fused_kernel<pay_bf16, 2>,
		  ar_fused_kernel<pay_bf16, 4>, ar_fused_kernel<pay_bf16, 8> },
		{ ar_fused_kernel<pay_f32, 1>, ar_fused_kernel<pay_f32, 2>,
		  ar_fused_kernel<pay_f32, 4>, ar_fused_kernel<pay_f32, 8> },
	};

	if (!per)
		return 0;
	*threads = ((groups + per - 1) / per + 31) / 32 * 32;
	*fn = table[ar->dtype][per == 1 ? 0 : per == 2 ? 1 : per == 4 ? 2 : 3];
	return per;
}

// CTAs per rank: at most the rows, and a 1/per_device share of what fits on the
// device at once, so that every spinning CTA of every rank on it is resident.
static int ar_grid(const struct k_cuda_ar *ar, int rank, ar_kernel_fn fn, int threads, int rows,
		   int *ctas)
{
	int per_sm = 0, g;

	K_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (const void *)fn, threads, 0));
	g = per_sm * ar->sms[rank] / ar->per_device;
	if (g < 1) {
		k_cuda_log("k_cuda_ar: %d ranks of %d-thread CTAs cannot all be resident on device %d "
			   "(%d per SM, %d SMs)", ar->per_device, threads, ar->dev[rank], per_sm,
			   ar->sms[rank]);
		return -EINVAL;
	}
	*ctas = rows < g ? rows : g;
	return 0;
}

static bool ar_aligned(const void *p)
{
	return ((uintptr_t)p & 15u) == 0;
}

static int ar_check(const struct k_cuda_ar *ar, const struct k_cuda_ar_io *io, int rank, int rows,
		    int width)
{
	const int vec = ar ? ar_vec(ar) : 8;

	if (!ar || !io || rank < 0 || rank >= ar->n) {
		k_cuda_log("k_cuda_ar: rank %d of %d ranks", rank, ar ? ar->n : 0);
		return -EINVAL;
	}
	if (rows < 1 || rows > ar->max_rows || width < vec || width % vec || width > ar->max_width ||
	    (size_t)rows * width > ar->slot) {
		k_cuda_log("k_cuda_ar: %d rows of %d values: rows 1..%d, width a multiple of %d in "
			   "%d..%d", rows, width, ar->max_rows, vec, vec, ar->max_width);
		return -EINVAL;
	}
	if (!io->partial || (io->gamma && !io->residual) || (!io->residual && !io->out) ||
	    !ar_aligned(io->partial) || !ar_aligned(io->residual) || !ar_aligned(io->gamma) ||
	    !ar_aligned(io->out) || !ar_aligned(io->out_bf16)) {
		k_cuda_log("k_cuda_ar: rank %d: a partial; with gamma a residual; without a residual "
			   "an out; every pointer 16-byte aligned", rank);
		return -EINVAL;
	}
	if (io->out && (const void *)io->out == io->partial && ar->dtype != K_CUDA_AR_F32) {
		k_cuda_log("k_cuda_ar: rank %d: out in place of a bf16 partial", rank);
		return -EINVAL;
	}
	return 0;
}

static void ar_fill_rank(ar_params *p, const struct k_cuda_ar *ar, int slot, int rank,
			 const struct k_cuda_ar_io *io)
{
	p->r[slot] = ar_rank_dev{ (const uint4 *)io->partial, io->residual, io->out, io->gamma,
				  io->out_bf16, ar->ctl[rank], (uint4 *)ar->recv[rank], rank };
}

static void ar_fill_common(ar_params *p, const struct k_cuda_ar *ar, int rows, int width, float eps)
{
	for (int r = 0; r < ar->n; r++)
		p->recv[r] = (uint4 *)ar->recv[r];
	p->n = ar->n;
	p->rows = rows;
	p->width = width;
	p->slot = ar->slot;
	p->eps = eps;
}

extern "C" int k_cuda_ar_fused(struct k_cuda_ar *ar, int rank, cudaStream_t s,
			       const struct k_cuda_ar_io *io, int rows, int width, float eps)
{
	ar_params p = {};
	ar_kernel_fn fn;
	int threads, ctas;

	K_CUDA_RETURN_IF(ar_check(ar, io, rank, rows, width));
	if (!ar_pick(ar, width, &threads, &fn))
		return -EINVAL;
	K_CUDA_RETURN_IF(ar_grid(ar, rank, fn, threads, rows, &ctas));
	ar_fill_common(&p, ar, rows, width, eps);
	ar_fill_rank(&p, ar, 0, rank, io);
	fn<<<dim3(ctas, 1), threads, 0, s>>>(p);
	return K_CUDA_LAUNCHED("ar_fused");
}

extern "C" int k_cuda_ar_fused_all(struct k_cuda_ar *ar, cudaStream_t s,
				   const struct k_cuda_ar_io *io, int rows, int width, float eps)
{
	ar_params p = {};
	ar_kernel_fn fn;
	int threads, ctas;

	if (!ar || !io)
		return -EINVAL;
	if (ar->per_device != ar->n) {
		k_cuda_log("k_cuda_ar: one launch for all ranks needs them on one device (%d ranks, "
			   "at most %d on one)", ar->n, ar->per_device);
		return -EINVAL;
	}
	for (int r = 0; r < ar->n; r++)
		K_CUDA_RETURN_IF(ar_check(ar, &io[r], r, rows, width));
	if (!ar_pick(ar, width, &threads, &fn))
		return -EINVAL;
	K_CUDA_RETURN_IF(ar_grid(ar, 0, fn, threads, rows, &ctas));
	ar_fill_common(&p, ar, rows, width, eps);
	for (int r = 0; r < ar->n; r++)
		ar_fill_rank(&p, ar, r, r, &io[r]);
	fn<<<dim3(ctas, ar->n), threads, 0, s>>>(p);
	return K_CUDA_LAUNCHED("ar_fused_all");
}

extern "C" int k_cuda_ar_shape(const struct k_cuda_ar *ar, int rows, int width, int *ctas,
			       int *threads)
{
	ar_kernel_fn fn;

	if (!ar || rows < 1 || width < 1 || width % ar_vec(ar) || !ar_pick(ar, width, threads, &fn))
		return -EINVAL;
	return ar_grid(ar, 0, fn, *threads, rows, ctas);
}

extern "C" int k_cuda_ar_ranks_per_device(const struct k_cuda_ar *ar)
{
	return ar ? ar->per_device : 0;
}

// ---- setup ------------------------------------------------------------------

// Peer access from every rank's device to every other's (ranks on one device need none).
static int ar_enable_peers(const struct k_cuda_ar *ar)
{
	for (int a = 0; a < ar->n; a++)
		for (int b = 0; b < ar->n; b++) {
			int can = 0;
			cudaError_t e;

			if (ar->dev[a] == ar->dev[b])
				continue;
			K_CUDA_TRY(cudaDeviceCanAccessPeer(&can, ar->dev[a], ar->dev[b]));
			if (!can) {
				k_cuda_log("k_cuda_ar: device %d cannot access device %d's memory: no "
					   "one-shot all-reduce between them (NCCL is the path)",
					   ar->dev[a], ar->dev[b]);
				return -EOPNOTSUPP;
			}
			K_CUDA_TRY(cudaSetDevice(ar->dev[a]));
			e = cudaDeviceEnablePeerAccess(ar->dev[b], 0);
			if (e == cudaErrorPeerAccessAlreadyEnabled)
				cudaGetLastError();	// enabled before: what we want
			else
				K_CUDA_TRY(e);
		}
	return 0;
}

// Rank r's buffers on its device, filled with the sentinel, its counter zeroed.
static int ar_alloc_rank(struct k_cuda_ar *ar, int r)
{
	const size_t esize = ar->dtype == K_CUDA_AR_BF16 ? 2 : 4;
	const size_t bytes = 3 * (size_t)ar->n * ar->slot * esize;
	const unsigned sent = ar->dtype == K_CUDA_AR_BF16 ? 0x80008000u : 0x80000000u;

	K_CUDA_TRY(cudaSetDevice(ar->dev[r]));
	K_CUDA_TRY(cudaDeviceGetAttribute(&ar->sms[r], cudaDevAttrMultiProcessorCount, ar->dev[r]));
	K_CUDA_TRY(cudaMalloc(&ar->recv[r], bytes));
	K_CUDA_TRY(cudaMalloc((void **)&ar->ctl[r], sizeof(struct ar_ctl)));
	K_CUDA_TRY(cudaMemset(ar->ctl[r], 0, sizeof(struct ar_ctl)));
	ar_fill_kernel<<<256, 256>>>((uint4 *)ar->recv[r], bytes / 16, sent);
	K_CUDA_TRY_LAUNCHED("ar_fill");
	return K_CUDA_CALL(cudaDeviceSynchronize());
}

extern "C" int k_cuda_ar_create(struct k_cuda_ar **out, int n_ranks, const int *devs,
				enum k_cuda_ar_dtype dtype, int max_rows, int max_width)
{
	struct k_cuda_ar *ar;
	int prev = 0, ret = 0;

	*out = NULL;
	if (n_ranks < 2 || n_ranks > K_CUDA_AR_MAX_RANKS || !devs ||
	    (dtype != K_CUDA_AR_BF16 && dtype != K_CUDA_AR_F32) || max_rows < 1 || max_width < 8 ||
	    max_width % 8 || (size_t)max_rows * max_width > (1u << 30)) {
		k_cuda_log("k_cuda_ar: %d ranks (2..%d), %d rows of %d values (width a multiple of 8, "
			   "at most 2^30 values)", n_ranks, K_CUDA_AR_MAX_RANKS, max_rows, max_width);
		return -EINVAL;
	}
	K_CUDA_TRY(cudaGetDevice(&prev));
	ar = (struct k_cuda_ar *)calloc(1, sizeof(*ar));
	if (!ar)
		return -ENOMEM;
	ar->n = n_ranks;
	ar->dtype = dtype;
	ar->max_rows = max_rows;
	ar->max_width = max_width;
	ar->slot = (size_t)max_rows * max_width;
	for (int r = 0; r < n_ranks; r++) {
		int same = 0;

		ar->dev[r] = devs[r];
		for (int q = 0; q < n_ranks; q++)
			same += devs[q] == devs[r];
		if (same > ar->per_device)
			ar->per_device = same;
	}
	ret = ar_enable_peers(ar);
	for (int r = 0; r < n_ranks && !ret; r++)
		ret = ar_alloc_rank(ar, r);
	cudaSetDevice(prev);
	if (ret) {
		k_cuda_ar_destroy(ar);
		return ret;
	}
	*out = ar;
	return 0;
}

extern "C" void k_cuda_ar_destroy(struct k_cuda_ar *ar)
{
	int prev = 0;

	if (!ar)
		return;
	cudaGetDevice(&prev);
	for (int r = 0; r < ar->n; r++) {
		if (!ar->recv[r] && !ar->ctl[r])
			continue;
		cudaSetDevice(ar->dev[r]);
		cudaFree(ar->recv[r]);
		cudaFree(ar->ctl[r]);
	}
	cudaSetDevice(prev);
	free(ar);
}
