// The warpgroup tensor-core machinery of the quantized tile kernel on wgmma
// (linear_qwgmma.cu, whose header gives the layouts): its configurations, the wgmma
// PTX (descriptor, fence, groups, the register-A MMA at n 16/32/64) and the store of a
// CTA's accumulators with the split's sum.
#ifndef KD_KERNELS_CUDA_LINEAR_QWGMMA_CUH
#define KD_KERNELS_CUDA_LINEAR_QWGMMA_CUH

#include <cstdint>

#include "kernels/cuda/linear/k_cuda_linear_q.h"
#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/linear/linear_split.cuh"

#define QW_BK		64	/* k per stage: 64 fp8 bytes a weight row, one f16 line of x */
#define QW_ALIGN	1024	/* the 128B swizzle repeats every 8 lines of 128 bytes */
#define QW_STAGES	6	/* buffers; QW_STAGES - 1 stages in flight ahead */
#define QW_AHEAD	(QW_STAGES - 1)
/* Fixed cost of a CTA (prologue, ramp, epilogue) in stages, for the split model. */
#define QW_CTA_OVERHEAD	3
/* The split cache's key for this kernel (beside the k_cuda_linear_q_kind values). */
#define QW_SPLIT_KIND	(K_CUDA_LINEAR_Q_N_KINDS + 1)

// NT n8 tiles of x rows (the wgmma N = 8 NT); WGS warpgroups, one m64 tile each.
template <int NT, int WGS> struct qw_cfg {
	static_assert(WGS == 2 || WGS == 4, "128 or 256 rows a CTA");
	static constexpr int ROWS = 64 * WGS;
	static constexpr int THREADS = 128 * WGS;
	static constexpr int MIN_BLOCKS = WGS == 2 ? 2 : 1;	// per SM: 128 registers a thread
	static constexpr int XROWS = 8 * NT;
	static constexpr int ACC = 4 * NT;			// fp32 accumulators a thread
	static constexpr int W_BYTES = ROWS * QW_BK;		// 8, 16 KB
	static constexpr int X_BYTES = XROWS * QW_BK * 2;	// 2, 4, 8 KB
	static constexpr int STAGE = W_BYTES + X_BYTES;		// a multiple of QW_ALIGN
	static constexpr int SMEM = QW_STAGES * STAGE + QW_ALIGN;
	static_assert(STAGE % QW_ALIGN == 0 && W_BYTES % QW_ALIGN == 0, "swizzle alignment");
	static_assert(SMEM <= 227 * 1024, "fits a multiprocessor");
};

// int4 (W4A16): a stage is 128 k, still 64 bytes a weight row; x is two 128-byte lines a
// row (k 0..63, 64..127 of the stage), each its own 128B-swizzled tile of XROWS lines.
// 4 stages at 128 rows (two CTAs a multiprocessor), 6 at 256.
#define QW4_BK		128
template <int NT, int WGS> struct qw4_cfg {
	using B = qw_cfg<NT, WGS>;
	static constexpr int STAGES = WGS == 2 ? 4 : 6;
	static constexpr int AHEAD = STAGES - 1;
	static constexpr int X_HALF = B::XROWS * 128;		// one line of 64 k a row
	static constexpr int STAGE = B::W_BYTES + 2 * X_HALF;
	static constexpr int SMEM = STAGES * STAGE + QW_ALIGN;
	static_assert(STAGES % 2 == 0, "A register halves alternate with the stage's parity");
	static_assert(SMEM <= 227 * 1024, "fits a multiprocessor");
};

// ---- PTX ------------------------------------------------------------------------------

// nvcc -arch=sm_90a also emits compute_90a PTX; any other target has no wgmma: there the
// kernel traps, and qw_probe_kernel tells the host not to launch it.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define QW_ASM(...)	asm volatile(__VA_ARGS__)
#define QW_HAVE		1
#else
#define QW_ASM(...)	__trap()
#define QW_HAVE		0
#endif

// Descriptor of a K-major, 128B-swizzled tile at shared address addr (1024-byte aligned,
// or advanced by k16 steps of 32 bytes inside its lines).
static __device__ __forceinline__ uint64_t qw_desc(uint32_t addr)
{
	return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)1 << 16) |
	       ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

static __device__ __forceinline__ void qw_fence()
{
	QW_ASM("wgmma.fence.sync.aligned;" ::: "memory");
}

static __device__ __forceinline__ void qw_commit()
{
	QW_ASM("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most n of this warpgroup's committed wgmma groups are in flight.
template <int n> static __device__ __forceinline__ void qw_wait()
{
	QW_ASM("wgmma.wait_group.sync.aligned %0;" : : "n"(n) : "memory");
}

// d (m64 x 8NT) (+)= a (m64 x k16 f16, registers) b (k16 x 8NT f16, descriptor);
// accumulate 0 overwrites d.
template <int NT> struct qw_mma;

template <> struct qw_mma<2> {
	static __device__ __forceinline__ void run(float (&d)[8], const uint32_t (&a)[4],
						   uint64_t b, int accumulate)
	{
		QW_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %13, 0;\n\t"
		       "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
		       "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
		       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
			 "+f"(d[6]), "+f"(d[7])
		       : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
	}
};

template <> struct qw_mma<4> {
	static __device__ __forceinline__ void run(float (&d)[16], const uint32_t (&a)[4],
						   uint64_t b, int accumulate)
	{
		QW_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %21, 0;\n\t"
		       "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
		       "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
		       "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
		       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
			 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
			 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
		       : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
	}
};

template <> struct qw_mma<8> {
	static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4],
						   uint64_t b, int accumulate)
	{
		QW_ASM("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
		       "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
		       "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		       "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
		       "%30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
		       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
			 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
			 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
			 "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
			 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]),
			 "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
		       : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
	}
};

// The CTA's accumulators out (S == 1: into y directly; else its partial tile into the
// workspace, then the sum as the kernels' headers say).
template <int NT, int WGS>
static __device__ __forceinline__ void qw_store(float *y, const float (&acc)[4 * NT],
						const qf_args &a, float *ws, unsigned *cnt, int spread,
						int n0, int ra, int rb)
{
	using C = qw_cfg<NT, WGS>;
	const int tid = threadIdx.x, t = tid & 3, tile = blockIdx.x, S = gridDim.y, s = blockIdx.y;

	if (S == 1) {
#pragma unroll
		for (int e = 0; e < C::ACC; e++) {
			const int n = n0 + (e & 2 ? rb : ra), m = 8 * (e >> 2) + 2 * t + (e & 1);

			if (m < a.M && n < a.N) {
				float *p = y + (size_t)m * a.N + n;

				*p = a.accumulate ? *p + acc[e] : acc[e];
			}
		}
		return;
	}
	float *part = ws + ((size_t)tile * S + s) * C::XROWS * C::ROWS;

#pragma unroll
	for (int e = 0; e < C::ACC; e++) {
		const int m = 8 * (e >> 2) + 2 * t + (e & 1);

		if (m < a.M)
			__stcg(part + m * C::ROWS + (e & 2 ? rb : ra), acc[e]);
	}
	const float *tp = ws + (size_t)tile * S * C::XROWS * C::ROWS;

	if (spread) {	// every CTA resident: the S of a tile each sum 1/S of it
		const int chunk = ((a.M * C::ROWS / 4 + S - 1) / S) * 4;
		const int e0 = min(s * chunk, a.M * C::ROWS), e1 = min(e0 + chunk, a.M * C::ROWS);

		lin_split_all(cnt, tile, S);
		lin_split_sum4_span<C::ROWS, C::THREADS, 0>(y, tp, (size_t)C::XROWS * C::ROWS, a.M,
							    a.N, n0, S, a.accumulate, tid, e0, e1);
		lin_split_done(cnt, tile, S);
		return;
	}
	if (!lin_split_last(cnt, tile, S))
		return;
	lin_split_sum4<C::ROWS, C::THREADS, 0>(y, tp, (size_t)C::XROWS * C::ROWS, a.M, a.N, n0, S,
					       a.accumulate, tid);
	if (tid == 0)
		cnt[tile] = 0;
}

#endif
