// Between the MoE launcher (moe_experts.cu) and its small-batch path (moe_small.cu,
// moe_small_gate_up.cu): CUDA C++ only, not part of the C interface (k_cuda_moe.h).
#ifndef KD_KERNELS_CUDA_MOE_INTERNAL_H
#define KD_KERNELS_CUDA_MOE_INTERNAL_H

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"

#define MOE_SMALL_MAX_PAIRS 64	// (row, slot) pairs a small-batch call may have
#define MOE_SMALL_SH_PIECES 4	// down: a shared row in at most this many inter-long pieces

// The shared expert as the small kernels take it (by value); inter 0: none. Every row
// is its pair, with weight 1, after the routed ones.
struct moe_small_shared {
	const uint16_t *gate, *up;	// (inter, hidden) bf16
	const uint16_t *down;		// (hidden, inter) bf16
	int inter;			// 0: no shared expert
	float *act;			// (M, inter) fp32 scratch, 16-byte aligned
};

// The experts' weight format as the kernels take it (a template parameter, F): bf16,
// or kept quantized (k_cuda_moe_quant). Values per 16-byte chunk: 8, 16, 32.
#define MQ_BF16 0
#define MQ_FP8 1
#define MQ_INT4 2
#define MQ_VPC(F) ((F) == MQ_BF16 ? 8 : (F) == MQ_FP8 ? 16 : 32)

// Where a quantized expert's scales are, by value into the kernels; per matrix j (0
// gate, 1 up, 2 down): weight row n's scale row is n >> rshift[j] (31: one row), column
// k's scale column k >> kshift[j] (31: one column), scols[j] scale columns a row.
struct moe_wq {
	int fmt;			// MQ_BF16 (then nothing else is set), MQ_FP8, MQ_INT4
	const void *const *scales;	// (E, 3) device pointers
	int rshift[3], kshift[3], scols[3];
	int brows[3], bcols[3];		// the blocks themselves (the any-shape kernel divides)
	int sbf16;			// scales in bf16 (else fp32)
};

// q's moe_wq at these shapes (host; q valid per k_cuda_moe_quant_ok; NULL or K_Q_NONE:
// MQ_BF16; rshift / kshift -1 where a block is neither a power of two nor the whole
// dimension: then only the any-shape kernel takes q, see moe_wq_vector).
struct moe_wq moe_wq_of(const struct k_cuda_moe_quant *q, int hidden, int inter);

// Whether the vector kernels (small path, tensor-core grouped path) take wq at these
// shapes: hidden and inter multiples of 32 (16-byte chunks of whole rows), every 32
// values of a row in one scale block, blocks indexed by shifts. bf16: always.
bool moe_wq_vector(const struct moe_wq &wq, int hidden, int inter);

// The grouped path's routing plan in device memory (moe_experts.cu's moe_plan_kernel
// builds it); u indexes used experts in increasing id, A = max_M * top_k.
struct ex_plan {
	int *n_used;		// (1)
	int *used_e;		// (A) expert id
	int *used_start;	// (A) its first position in sorted
	int *used_n;		// (A) its number of (row, slot) pairs
	int *sorted;		// (A) m * top_k + j, grouped by expert, ascending within
};

// Whether the small-batch path can run this call: M * top_k <= MOE_SMALL_MAX_PAIRS,
// hidden and inter multiples of 8 (16-byte weight loads), one fp32 x row fits the
// shared-memory budget, x 16-byte aligned; sh (NULL: none) a multiple of 8 wide, at
// most MOE_SMALL_SH_PIECES * inter, its matrices 16-byte aligned.
bool k_cuda_moe_small_fits(int M, int top_k, int hidden, int inter, const float *x,
			   const struct k_cuda_moe_shared *sh);

// Once per process before the first launch (not a stream operation, so never inside
// a capture): lets the gate/up kernel use its shared-memory budget. 0 or -EIO.
int k_cuda_moe_small_setup(void);

// moe_small_gate_up.cu for moe_small.cu: the gate/up kernel's one-time set-up (0 or
// -EIO), and one launch of ctas CTAs with rp x rows staged in shared memory. Its error,
// if any, is the runtime's last error.
int moe_small_gate_up_setup(void);
void moe_small_gate_up_launch(cudaStream_t s, int ctas, int rp,
			      const uint16_t *const *expert_w, const struct moe_wq &wq,
			      const float *x, const int32_t *ids,
			      int n, int top_k, int n_experts, int hidden, int inter, float *act,
			      const struct moe_small_shared &sh);

// moe_small_m1.cu for moe_small.cu: the kernels at M = 1 (each warp's weight rows a
// pipeline of register units, x and the activations staged in shared memory; the
// general kernels' results bit for bit). Whether a call fits them (the activations of
// min(top_k, n_experts) experts and the shared expert within their shared-memory
// budget), their one-time set-up (0 or -EIO), and the two launches (gate/up on
// gate_up_ctas CTAs, then down; its error, if any, is the runtime's last error).
bool moe_small_m1_fits(int top_k, int n_experts, int hidden, int inter, int sh_inter);
int moe_small_m1_setup(void);
void moe_small_m1_launch(cudaStream_t s, int gate_up_ctas, const uint16_t *const *expert_w,
			 const struct moe_wq &wq, const float *x, const int32_t *ids, const float *weights, int top_k,
			 int n_experts, int hidden, int inter, float *act,
			 const struct moe_small_shared &sh, int add, float *out);

// out (M, hidden) = the routed experts' sum (add 0: overwritten) or out += routed sum
// + the shared expert sh (add 1; sh.inter 0: none); act (M * top_k, inter) fp32 scratch
// (16-byte aligned) for the SwiGLU activations. n_sm: the device's SM count, sizes the
// grids. Two launches, both with programmatic dependent launch.
// wq: the experts' format (moe_wq_of; quantized only with sh.inter 0).
int k_cuda_moe_small_run(cudaStream_t s, float *act, float *out, const float *x, int M,
			 const int32_t *ids, const float *weights, int top_k,
			 const uint16_t *const *expert_w, const struct moe_wq &wq, int n_experts,
			 int hidden, int inter, const struct moe_small_shared &sh, int add, int n_sm);

// moe_small.cu for moe_lat.cu: small_down_kernel (add 1) launched without programmatic
// serialisation; its error, if any, is the runtime's last error.
void moe_small_down_launch_plain(cudaStream_t s, const uint16_t *const *expert_w,
				 const float *act, const int32_t *ids, const float *weights, int M,
				 int top_k, int n_experts, int hidden, int inter,
				 const struct moe_small_shared &sh, float *out);

// moe_qtile.cu for moe_experts.cu: the grouped path's expert GEMMs as tile kernels.
// Their one-time set-up (0 or -EIO); whether they take a call of M rows (M <=
// k_cuda_tuning()->moe_qtile_rows or, to 4096, wide; hidden and inter multiples of 32
// (bf16), 64 (fp8) or 128 (int4); int4 scales in groups of 32, fp8 blocks of >= 64
// columns); whether a call takes their wide passes (M >= k_cuda_tuning()->moe_qtile_wide);
// the two launches (gate/up into hs, down into y, as expert_mma_kernel's; 0 or -EIO).
int moe_qtile_setup(void);
bool moe_qtile_takes(const struct moe_wq &wq, int hidden, int inter, int M);
bool moe_qtile_wide(int M);
int moe_qtile_run(cudaStream_t s, const struct ex_plan &pl, const uint16_t *const *expert_w,
		  const struct moe_wq &wq, const uint32_t *xs, uint32_t *hs, float *y, int M,
		  int top_k, int hidden, int inter, int max_used);

// moe_qgemv.cu for moe_experts.cu: quantized experts at M <= MOE_QGEMV_MAX_M rows as two
// GEMVs over the union of the chosen experts (the dense decode GEMV's streaming). The
// shape of a call (moe_qgemv_make_plan: false where the kernels do not take it; its sizes
// say the workspace it needs), the workspace (device memory, the arrival counts
// zeroed once: the kernels put them back), the one-time set-up (0 or -EIO), whether a
// call takes them (k_cuda_tuning()->moe_qgemv_rows, the plan, scale columns of whole
// stages), and the two launches (0, -EINVAL or -EIO).
#define MOE_QGEMV_MAX_M 8
struct moe_qgemv_plan {
	int n_max;		// experts the grids are sized for: min(n_experts, M * top_k)
	int gu_tiles, S, KC;	// gate/up: 64-row tiles, K slices, k a slice
	bool persist;		// gate/up persistent: ctas CTAs walk the tiles' S slices
	int ctas;
	int d_tiles, KCd;	// down: 64-row tiles of hidden, inter in whole stages
	int gu_smem, d_smem;	// dynamic shared memory a CTA
	size_t act_floats, part_floats;
	int cnt;		// arrival counts of each kernel
};
struct moe_qgemv_ws {
	float *act, *part;
	unsigned *cnt_gu, *cnt_d;
	size_t act_floats, part_floats;
	int cnt, n_sm;
};
bool moe_qgemv_make_plan(int fmt, int M, int top_k, int n_experts, int hidden, int inter, int n_sm,
			 int persist, struct moe_qgemv_plan *p);
int moe_qgemv_setup(void);
// The rows up to which quantized experts of format fmt (MQ_FP8, MQ_INT4) and width hidden
// take the union GEMVs: moe_qgemv_rows, and no more than moe_qgemv_int4_rows (int4) or,
// where hidden >= moe_qgemv_fp8_hidden, moe_qgemv_fp8_rows (fp8); past them, up to
// moe_qgemv_rows, the tile kernels where they take the call (moe_experts.cu).
int moe_qgemv_fmt_rows(int fmt, int hidden);
bool moe_qgemv_takes(const struct moe_wq &wq, int M, int top_k, int n_experts, int hidden,
		     int inter, const float *x, const struct moe_qgemv_ws &ws);
int moe_qgemv_run(cudaStream_t s, const struct moe_qgemv_ws &ws, float *out, const float *x,
		  int M, const int32_t *ids, const float *weights, int top_k,
		  const uint16_t *const *expert_w, const struct moe_wq &wq, int n_experts,
		  int hidden, int inter, int add);

// moe_route.cu: the routing parameters its kernels take (limits of k_cuda_moe_route).
bool moe_route_params_ok(const struct k_moe_route_params *p);

// moe_experts.cu for moe_lat.cu: the workspace's parts (act: the small path's fp32
// SwiGLU rows; sh_act: the shared expert's; bar: two zeroed words for a grid barrier).
struct moe_ws_parts {
	int max_M, top_k, n_experts, hidden, inter, shared_inter, n_sm;
	float *act, *sh_act;
	unsigned *bar;
};
struct moe_ws_parts moe_ws_parts_of(const struct k_cuda_moe_ws *ws);

#endif
