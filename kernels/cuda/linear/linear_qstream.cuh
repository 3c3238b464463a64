// The per-warp cp.async ring the quantized streaming kernels share (linear_qmma.cu's
// streaming form, linear_qgemv.cu's decode GEMV): each warp copies its 16 weight rows
// 128 bytes a row a stage (one whole L2 line; 4 rows per instruction) into its own ring
// of stages in shared memory, and reads its fragments back with 16-byte shared-memory
// loads: a stage is two slabs (linear_qfrag.cuh). The stage's scales go into registers
// beside it. The ring's depth, the pipeline and the x staging are the kernels' own.
#ifndef KD_KERNELS_CUDA_LINEAR_QSTREAM_CUH
#define KD_KERNELS_CUDA_LINEAR_QSTREAM_CUH

#include <cstdint>

#include "kernels/cuda/linear/linear_internal.h"
#include "kernels/cuda/linear/linear_qfrag.cuh"
#include "kernels/cuda/ptx.cuh"

#define QS_ROW		128			/* bytes of a row per stage */
#define QS_WSTAGE	(16 * QS_ROW)		/* a warp's stage: 2 KB */

template <int FMT> struct qs_fmt {
	static constexpr int SK = 2 * qm_fmt<FMT>::SLAB;	// k per stage
};

// Byte offset of 16-byte unit c of row r in a warp's stage: rows of odd index swap their
// halves, so that lanes (g, t) and (g + 1, t) of a quarter warp read different banks.
static __device__ __forceinline__ int qs_off(int r, int c)
{
	return r * QS_ROW + ((c ^ ((r & 1) << 2)) << 4);
}

// A lane's view of its warp's stream: the warp's 16 weight rows from row0, the CTA's K
// slice [k0, kend) in nst stages, the lane's rows ra = row0 + g and rb = ra + 8 and
// their scale rows. A: the kernel's arguments (qf_args or one with the same fields);
// AHEAD: the stages in flight ahead of the one computed (the ring holds AHEAD + 1).
// RAW: 2-byte scales kept as loaded and converted at their use (qm_scale_raw, _use),
// not at their load: the MoE union GEMVs' int4 ran 4-9% faster so (session 29, H100:
// the warp waited for each scale's load at its conversion), the dense decode GEMV 4%
// slower (Llama-3.1-8B int4 batch 1 3.023 -> 3.143 ms), so it is theirs alone.
template <int FMT, typename ST, typename A, int AHEAD, bool RAW = false> struct qs_warp {
	const A &a;
	const uint8_t *w;
	const ST *scale;
	unsigned char *ring;	// the warp's ring: slot j at j * QS_WSTAGE
	int lane, g, t;
	int row0, ra, rb;
	int k0, kend, nst;
	int kb0, kb_end;	// the slice in bytes of a row
	bool aok, bok;		// rows ra, rb exist
	size_t sra, srb;	// their scale rows

	__device__ __forceinline__ qs_warp(const A &a_, const uint8_t *w_, const ST *scale_,
					   unsigned char *ring_, int row0_, int k0_)
		: a(a_), w(w_), scale(scale_), ring(ring_), lane(threadIdx.x & 31), g(lane >> 2),
		  t(lane & 3), row0(row0_), ra(row0 + g), rb(ra + 8), k0(k0_),
		  kend(min(a.K, k0 + a.KC)),
		  nst(k0 < kend ? (kend - k0 + qs_fmt<FMT>::SK - 1) / qs_fmt<FMT>::SK : 0),
		  kb0(qm_fmt<FMT>::bytes(k0)), kb_end(qm_fmt<FMT>::bytes(kend)), aok(ra < a.N),
		  bok(rb < a.N), sra((size_t)((aok ? ra : 0) / a.block_rows) * a.scale_cols),
		  srb((size_t)((bok ? rb : 0) / a.block_rows) * a.scale_cols)
	{
	}

	// Stage i into ring slot `slot`: four instructions of 4 rows x 128 bytes; zeros
	// past N and past the slice. EARLY: before the PDL wait.
	template <bool EARLY>
	__device__ __forceinline__ void issue(int slot, int i) const
	{
#pragma unroll
		for (int j = 0; j < 4; j++) {
			const int r = 4 * j + (lane >> 3), c = lane & 7, n = row0 + r;
			const int kb = kb0 + i * QS_ROW + 16 * c;	// byte of the row
			const bool ok = n < a.N && kb < kb_end;
			const uint8_t *src = ok ? w + (size_t)n * a.row_bytes + kb : w;
			unsigned char *dst = ring + slot * QS_WSTAGE + qs_off(r, c);

			if (EARLY)
				k_cuda_pdl_early_cp16(dst, src, ok);
			else
				cp_async16(dst, src, ok);
		}
	}

	// The first AHEAD stages into slots 0 .. AHEAD-1, one cp.async group each (empty
	// past the slice): weights are constant, so this goes before the PDL wait.
	__device__ __forceinline__ void start() const
	{
#pragma unroll
		for (int i = 0; i < AHEAD; i++) {
			if (i < nst)
				issue<true>(i, i);
			cp_async_commit();
		}
	}

	__device__ __forceinline__ float load(size_t i) const
	{
		return RAW ? qm_scale_raw(scale, i) : qm_scale(scale, i);
	}

	__device__ __forceinline__ float use(float s) const
	{
		return RAW ? qm_scale_use<ST>(s) : s;
	}

	// The scales stage i needs of the lane's rows: fp8 one a row (scale columns of 128 k
	// or more, or the whole row), int4 one a row and slab (the lane's 32 k of it); zeros
	// for k past the slice, where no scale is read. RAW: their bits as loaded
	// (qm_scale_raw), which frag converts stages later.
	__device__ __forceinline__ void scales(float (&sr)[4], int i) const
	{
		if (FMT == K_Q_NONE) {	// bf16 weights: none
			sr[0] = sr[1] = sr[2] = sr[3] = 0.f;
		} else if (FMT == K_Q_FP8) {
			// stages past the slice (the prologue's, or a CTA whose slice starts
			// past K) have no scale column: reading one would run past the scales
			const int k = k0 + i * qs_fmt<FMT>::SK, sc = k >> a.bc_shift;

			sr[0] = aok && k < kend ? load(sra + sc) : 0.f;
			sr[1] = bok && k < kend ? load(srb + sc) : 0.f;
		} else {
#pragma unroll
			for (int h = 0; h < 2; h++) {
				const int k = k0 + i * qs_fmt<FMT>::SK + h * 128 + 32 * t;
				const int sc = k >> a.bc_shift;

				sr[2 * h] = aok && k < kend ? load(sra + sc) : 0.f;
				sr[2 * h + 1] = bok && k < kend ? load(srb + sc) : 0.f;
			}
		}
	}

	// Before stage i: waits for it (AHEAD groups in the prologue, then one a stage: its
	// group has exactly AHEAD - 1 newer ones), then refills slot nx, which held stage
	// i - 1, with stage i + AHEAD and its scales into sr (one group, empty at the end).
	__device__ __forceinline__ void next(float (&sr)[4], int nx, int i) const
	{
		cp_async_wait<AHEAD - 1>();	// stage i is here
		__syncwarp();			// ... for every lane; slot nx is read
		if (i + AHEAD < nst) {
			issue<false>(nx, i + AHEAD);
			scales(sr, i + AHEAD);
		}
		cp_async_commit();
	}

	// The main loop over the slice's stages: stage i in slot j = i % (AHEAD + 1), its
	// scales in sr[j] (the loop over j unrolled: sr stays in registers). For each:
	// before(i) (the CTA's threads alike: it may hold a barrier), next() (the wait and
	// the refill), then slab(i, h, wa, wb, sa, sb) for its two slabs h.
	template <typename B, typename S>
	__device__ __forceinline__ void run(float (&sr)[AHEAD + 1][4], B &&before, S &&slab) const
	{
		for (int i0 = 0; i0 < nst; i0 += AHEAD + 1) {
#pragma unroll
			for (int j = 0; j < AHEAD + 1; j++) {
				const int i = i0 + j, nx = (j + AHEAD) % (AHEAD + 1);

				if (i >= nst)
					break;
				before(i);
				next(sr[nx], nx, i);
#pragma unroll
				for (int h = 0; h < 2; h++) {
					uint4 wa, wb;
					float sa, sb;

					frag(j, sr[j], h, wa, wb, sa, sb);
					slab(i, h, wa, wb, sa, sb);
				}
			}
		}
	}

	// Slab h (0, 1) of the stage in slot j: the 16 bytes of rows g and g + 8, and their
	// scales from the stage's sr (RAW: converted here).
	__device__ __forceinline__ void frag(int j, const float (&sr)[4], int h, uint4 &wa,
					     uint4 &wb, float &sa, float &sb) const
	{
		const unsigned char *st = ring + j * QS_WSTAGE;

		wa = *(const uint4 *)(st + qs_off(g, 4 * h + t));
		wb = *(const uint4 *)(st + qs_off(g + 8, 4 * h + t));
		sa = use(FMT == K_Q_INT4 ? sr[2 * h] : sr[0]);
		sb = use(FMT == K_Q_INT4 ? sr[2 * h + 1] : sr[1]);
	}
};

#endif
