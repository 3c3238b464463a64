/* The CUDA path's tuning knobs in one struct: every KDEC_* environment switch of the
 * kernels and of the CUDA backend, read once (k_cuda_tuning_from_env) and installed. */
#ifndef KD_KERNELS_CUDA_K_CUDA_TUNING_H
#define KD_KERNELS_CUDA_K_CUDA_TUNING_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Which path k_cuda_moe_experts takes: AUTO picks by M * top_k; SMALL takes the
 * small-batch path wherever it can run (up to 64 pairs); GROUPED always the grouped one. */
enum k_cuda_moe_path { K_CUDA_MOE_PATH_AUTO, K_CUDA_MOE_PATH_SMALL, K_CUDA_MOE_PATH_GROUPED };

/* Every field is named after its variable (KDEC_ dropped, lower case) unless noted.
 * "Flag" variables take 0 or 1; the defaults are the measured winners, the other
 * values are kept for A/B runs and for tests that compare the bits of both paths.
 * Unless noted, a variant gives the same results bit for bit. A kernel reads the
 * installed struct at each launch, so a graph keeps what was installed at its
 * capture. */
struct k_cuda_tuning {
	/* ---- launches ---- */
	int cuda_pdl;		/* KDEC_CUDA_PDL, flag, 1: the small ops are launched with
				 * programmatic stream serialisation (launch_check.cuh) */
	int pdl_relay;		/* KDEC_PDL_RELAY, 0..15, 0: bits of enum k_cuda_relay (1 the
				 * RMSNorm, 2 qkv_post, 4 the decode attention, 8 the split
				 * merge) let those kernels trigger the next launch at their
				 * start, before their wait (k_cuda_pdl_relay), so the GEMV
				 * after them streams its first weights while they run.
				 * Every relay (15) measured slower at batch 1 on an H100
				 * (session 24): Llama-3.1-8B fp8 3.661 ms a step against
				 * 3.557, int4 3.329 against 2.914; batch 8 fp8 4.500
				 * against 4.603. The single relays are not yet measured */
	int topk_match;		/* KDEC_TOPK_MATCH, flag, 1: k_cuda_topk_slice's histograms
				 * count a warp's equal digits with one atomic (match.any);
				 * 0: an atomic an item. Not yet measured (session 10) */

	/* ---- linear (kernels/cuda/linear) ---- */
	int linear_tune;	/* KDEC_LINEAR_TUNE, flag, 1: each GEMM shape times cuBLASLt's
				 * candidates once and keeps the fastest; 0: cublasGemmEx's own
				 * choice everywhere */
	int lt_log;		/* KDEC_LT_LOG, flag, 0: 1 prints one line per tuned shape on
				 * stderr (GemmEx's time, the pick's, the nearest other plan;
				 * the quantized GEMV's: every split's time and the one kept) */
	int lt_candidates;	/* KDEC_LT_CANDIDATES, 1..64, 16: candidates asked of
				 * cuBLASLt's heuristic per shape */
	long linear_small_mb;	/* KDEC_LINEAR_SMALL_MB, MiB (>= 0), 16: weights up to this size
				 * try the project's GEMV and split-K kernels before cuBLAS; 0:
				 * none (every matrix takes the kinds for large ones: the ring
				 * where it is on, the streaming kernel, cuBLAS; so the tiny
				 * golden models test those) */
	long linear_stream_mb;	/* KDEC_LINEAR_STREAM_MB, MiB (>= 0), 64: weights above
				 * linear_small_mb and up to this size take the streaming kernel
				 * at M <= 8; 0: never */
	int linear_ring;	/* KDEC_LINEAR_RING, rows 0..8, 0: bf16 linears of up to this many
				 * rows on weights above linear_small_mb take the ring GEMV (the
				 * quantized decode GEMV's kernel on bf16: K_CUDA_LINEAR_RING)
				 * before the streaming kernel and cuBLAS; 0: never. Measured
				 * slower on an H100 (session 22): Llama-3.1-8B bf16 batch 1
				 * 6.497 ms a step against 6.229 without, batch 8 7.566
				 * against 6.654 (gate/up 89 us against cuBLAS's 86 alone) */
	int linear_ring_stream;	/* KDEC_LINEAR_RING_STREAM, 0..2, 1: where the ring kind
				 * runs (linear_ring), its blocks of rows take the cluster
				 * streaming form (linear_qmma.cu) where its clusters leave
				 * room on the GPU (k_cuda_linear_q_choose's rule), the decode
				 * GEMV elsewhere and for the SwiGLU form; 2: the streaming
				 * form wherever it has a plan; 0: the decode GEMV always */
	int linear_ring_tune;	/* KDEC_LINEAR_RING_TUNE, flag, 1: where on, a bf16 linear of
				 * M <= 8 that the ring kind can run is timed at the first call of
				 * its shape at its M bucket outside a capture, on the ring kind
				 * and on k_cuda_linear_pick's, and takes the faster for the life
				 * of the context (k_cuda_linear_choose_tuned; KDEC_LT_LOG=1 prints
				 * both times). Session 26 (one H100) measured the ring's streaming
				 * form on every matrix 0.4-4.7% faster on the MoE models' bf16
				 * steps and 5.6% slower on Llama-3.1-8B's at batch 8; this keeps
				 * it only where it wins alone by 3%. Session 28 (H100, without
				 * the margin): -3.1% Qwen3-30B-A3B batch 1, -3.3% DeepSeek-V2-Lite
				 * batch 8, +1.6% its batch 1, Llama even. Session 29 (H100, with
				 * the margin): Qwen3-30B-A3B batch 1 -2.8%, batch 8 -1.0%,
				 * V2-Lite batch 8 -3.2%, batch 1 -0.4%, Llama within 0.5%; the CPU
				 * reference follows the choice (k_cuda_linear_rounds_x): on */
	int linear_qgemv;	/* KDEC_LINEAR_QGEMV, flag, 1: quantized linears of M <= 8 take
				 * the decode GEMV (linear_qgemv.cu) where the choice rule says
				 * (k_cuda_linear_q_choose); 0: the cluster streaming form there */
	int linear_qgemv_warps;	/* KDEC_LINEAR_QGEMV_WARPS, 4..64, 8: warps a multiprocessor
				 * needs before bytes bound that GEMV, in its split model (more
				 * warps: more K slices, shorter CTAs); read at each call. The
				 * model decides only untuned shapes (linear_q_tune) */
	int linear_q_tune;	/* KDEC_LINEAR_Q_TUNE, flag, 1: the quantized GEMV (M <= 8)
				 * and tile kernel (9..64) time each K split of a shape once at
				 * its M bucket (the first call outside a capture) and keep the
				 * fastest (linear_tune.cu); 0: their models' splits */
	int linear_qwg;		/* KDEC_LINEAR_QWG, flag, 1: fp8 and int4 linears of 9..64 rows
				 * take the wgmma tile kernel (linear_qwgmma.cu) on compute
				 * capability 9.0 where K % 64 == 0 (fp8) or % 128 (int4); 0: the
				 * mma.sync tile kernel */
	int linear_qwg_rows;	/* KDEC_LINEAR_QWG_ROWS, 0..256, 0: weight rows a CTA of that
				 * kernel, 128 or 256; anything else: timed with the K split
				 * per shape (linear_q_tune), untuned 256 above 32 rows of x
				 * and 128 up to 32 */

	/* ---- attention (kernels/cuda/attn) ---- */
	int attn_mma;		/* KDEC_ATTN_MMA, flag, 1: the tensor-core decode kernel;
				 * 0: the tiled and decode kernels only */
	int attn_mma_tk;	/* KDEC_ATTN_MMA_TK, 32 or 64, 32: tokens per tile of GQA's
				 * tensor-core kernel at head_dim 128 */
	int attn_mma_qreg;	/* KDEC_ATTN_MMA_QREG, flag, 1: GQA's tensor-core kernel keeps
				 * q in registers; 0: staged in shared memory for every tile */
	int attn_mma_early;	/* KDEC_ATTN_MMA_EARLY, flag, 1: GQA's tensor-core kernel issues
				 * its first K/V copies before the programmatic-launch wait;
				 * 0: all after it */
	int attn_prefill_mma;	/* KDEC_ATTN_PREFILL_MMA, flag, 1: GQA prefill rows (head_dim
				 * <= 128) on the tensor-core prefill kernel (attn_prefill.cu)
				 * where attn_mma is 1; 0: the tiled CUDA-core kernel. Not
				 * bit-identical (q and p enter the tensor cores in bf16) */
	int attn_prefill_pair;	/* KDEC_ATTN_PREFILL_PAIR, flag, 1: a causal prompt that is
				 * most of its context runs that kernel with query tiles
				 * paired first with last (equal work a block); 0: unpaired */
	int attn_dec_splits;	/* KDEC_ATTN_DEC_SPLITS, >= 0, 0: a fixed split count for the
				 * GQA decode kernels (where the workspace holds it); 0: chosen
				 * by occupancy. Not bit-identical across values */
	int attn_merge_batched;	/* KDEC_ATTN_MERGE, flag, 0: 1 merges splits with the batched
				 * warp kernel instead of a block per head */
	int qkv_in_attn;	/* KDEC_QKV_IN_ATTN, -1, 0 or 1, -1 (unset): in a decode step
				 * qkv_post's work (norm, rope, cache append) is done in the GQA
				 * attention launch where the rows take one split, else launched
				 * before it; 0: never folded (the backend launches qkv_post
				 * itself); 1: folded at any split count */
	int qkv_post_early;	/* KDEC_QKV_POST_EARLY, flag, 1: qkv_post's kernel loads its
				 * inputs together; 0: one after another */
	int mla_post_early;	/* KDEC_MLA_POST_EARLY, flag, 1: mla_post's kernel reads the
				 * cos/sin table before its programmatic-launch wait; 0: after */
	int mla_carveout;	/* KDEC_MLA_CARVEOUT, flag, 0: 1 asks the largest shared-memory
				 * carveout for MLA's attention chain (absorb, attention,
				 * expand); read at workspace creation */
	int mla_split_min;	/* KDEC_MLA_SPLIT_MIN, tokens (>= 0), 64: the fewest tokens per
				 * split of MLA's tensor-core attention, rounded up to 32;
				 * 0: no floor. Not bit-identical across values */
	int mla_split_live;	/* KDEC_MLA_SPLIT_LIVE, splits (>= 0; past 128 as 128), 64:
				 * the split count past which mla_split_min applies; 0: always.
				 * Unset while KDEC_MLA_SPLIT_MIN is set: 0 */
	int mla_mma_ksplit;	/* KDEC_MLA_MMA_KSPLIT, flag, 1: MLA's tensor-core attention
				 * with 8 warps splitting the 576 key dims in two; 0: 4 warps
				 * over all of them */
	int mla_proj_mma;	/* KDEC_CUDA_MLA_PROJ, flag, 1: MLA's absorb and expand on the
				 * tensor-core kernels of mla_proj.cu; 0: the CUDA-core ones of
				 * attn_mla.cu */

	/* ---- MoE (kernels/cuda/moe) ---- */
	int moe_path;		/* KDEC_MOE_PATH, enum k_cuda_moe_path, "auto", "small" or
				 * "grouped", AUTO. Not bit-identical across values */
	int moe_fused;		/* KDEC_MOE_FUSED, flag, 1: k_cuda_moe_experts_add does the
				 * routed experts, the shared one and the add in two launches on
				 * the small path; 0: it returns 1 (the caller runs the ops) */
	int moe_m1;		/* KDEC_MOE_M1, flag, 1: a single row on the small path takes
				 * moe_small_m1.cu's pipelined kernels; 0: the general ones */
	int moe_m1_bal;		/* KDEC_MOE_M1_BAL, flag, 1: those kernels cut a weight row into
				 * units of even length; 0: units of a fixed length and a short
				 * last one */
	int moe_sh_down_early;	/* KDEC_MOE_SH_DOWN_EARLY, flag, 1: the M = 1 gate/up CTAs ask
				 * L2 for the shared expert's down rows before their wait; 0: the
				 * down kernel alone does */
	int moe_down_early;	/* KDEC_MOE_DOWN_EARLY, flag, 1: the M = 1 down kernel issues
				 * its first weight loads before its wait; 0: after (its plan,
				 * from settled ids, comes before the wait either way) */
	int moe_qtile_rows;	/* KDEC_MOE_QTILE_ROWS, rows 0..4096, 4096: up to this many rows
				 * a call (and from moe_qtile_wide's up), the routed experts (fp8,
				 * int4 g32; bf16 with moe_qtile_bf16) on the grouped path take
				 * moe_qtile.cu's tile kernels; 0 with moe_qtile_wide 0:
				 * expert_mma_kernel always. Not bit-identical.
				 * Measured on an H200 (session 18): Qwen3-30B-A3B fp8 batch 64
				 * 43.53 -> 18.10 ms a step, batch 16 27.47 -> 11.62, int4 batch
				 * 64 17.49 -> 12.94; DeepSeek-V2-Lite fp8 batch 16 17.16 ->
				 * 7.99, 64 23.07 -> 10.71. 64 until session 34, which timed the
				 * calls of 65..255 rows that then took expert_mma_kernel (H100,
				 * Qwen3-30B-A3B's experts alone at 96, 128, 192 rows): int4 228,
				 * 252, 287 us on the tiles against 1196, 1221, 1271; fp8 349,
				 * 377, 416 against 828, 853, 904 */
	int moe_qtile_bf16;	/* KDEC_MOE_QTILE_BF16, rows 0..4096, 2048: bf16 experts take the
				 * tile kernels in calls of at least this many rows (1: every
				 * call they take; 0: never). Measured (H100, session 34,
				 * Qwen3-30B-A3B prefill, with moe_qtile_split's CTAs): a
				 * 2048-row chunk 210 -> 115 ms; at 256 rows 28.9 -> 32.5 with
				 * one CTA an expert's passes (spread: not measured); at decode
				 * slower (H200, session 18: batch 64 28.85 against 25.71 ms) */
	int moe_qtile_wide;	/* KDEC_MOE_QTILE_WIDE, rows 0..4096, 256: from this many rows a
				 * call to 4096 (prefill chunks), the grouped path's experts take
				 * the tile kernels in wide passes (64 expert rows, int4 32; 16
				 * below); 0: never. Measured on an H100 (session 32): kdbench
				 * prefill of Qwen3-30B-A3B, 2048 tokens, int4 294.6 -> 214.0 ms,
				 * fp8 262.4 -> 182.8, 256 tokens 46.8 -> 31.8 and 40.3 -> 29.1;
				 * bf16 (moe_qtile_bf16) 209.6 -> 221.3 then, 115 with
				 * moe_qtile_split's CTAs (session 34) */
	int moe_qtile_split;	/* KDEC_MOE_QTILE_SPLIT, 0..64, 0: the CTAs each used expert's
				 * passes are spread over in the tile kernels, by the call's rows
				 * (moe_qtile.cu's xt_splits: a CTA a pass of an expert every row
				 * chose, to 8; 1 at decode batches of <= 16); n > 0: n; 1: one
				 * CTA takes all of an expert's passes (before session 34). A
				 * prefill chunk routes most rows to a few experts, whose passes
				 * then ran in turn: measured (H100, session 34) a 2048-token
				 * prefill of Qwen3-30B-A3B int4 216 -> 131 ms, fp8 181 -> 117,
				 * bf16 221 -> 115 (8 against 1), decode batch 64 fp8 -1.6% (4) */
	int moe_qgemv_rows;	/* KDEC_MOE_QGEMV_ROWS, rows 0..8, 8: up to this many rows a
				 * call, quantized routed experts (fp8, int4) of the small path's
				 * sizes take moe_qgemv.cu's two GEMVs over the chosen experts'
				 * union (x and activations in f16, as the dense quantized GEMV;
				 * ~3e-4 relative where the small path keeps ~1e-5); 0: the small
				 * path's CUDA-core kernels. Measured on an H100 (session 19):
				 * Qwen3-30B-A3B fp8 batch 1 3.564 -> 3.176 ms a step, batch 8
				 * 12.882 -> 10.392, int4 batch 8 8.859 -> 4.590; DeepSeek-V2-Lite
				 * fp8 batch 1 2.951 -> 2.454; Kimi-K2's MoE layer at batch 1
				 * 331.0 -> 279.8 us */
	int moe_qgemv_int4_rows;	/* KDEC_MOE_QGEMV_INT4_ROWS, rows 0..8, 2: int4 experts
				 * take the union GEMVs up to this many rows (and
				 * moe_qgemv_rows); from there to moe_qgemv_rows the grouped
				 * path's tile kernels (moe_qtile.cu) where they take the call,
				 * even where the small path would. Why: bench_cuda_moe q on an
				 * H100 (sessions 30, 31), int4 experts alone, tile kernels
				 * against union GEMVs: Qwen3-30B-A3B 8 rows 114.0 / 151.8 us,
				 * 4 rows 79.6 / 67.3, 2 rows 55.0 / 40.6; V2-Lite 8 rows 125.4
				 * / 167.6; Kimi-K2 8 rows 859.6 / 1344.7 (fp8: 173.2 against
				 * 171.5 at 8, so fp8 stays). A decode step (kdbench, H100,
				 * session 31, 8 against 2): Qwen3-30B-A3B batch 8 8.95 -> 7.09
				 * ms, batch 4 5.16 -> 5.14; DeepSeek-V2-Lite batch 8 6.24 ->
				 * 4.75, batch 4 4.06 -> 3.64; Kimi-K2 slice batch 8 2.53 ->
				 * 1.98; DeepSeek-V3 slice batch 8 3.04 -> 2.52 */
	int moe_qgemv_fp8_rows;	/* KDEC_MOE_QGEMV_FP8_ROWS, rows 0..8, 2: the same for fp8
				 * experts at least moe_qgemv_fp8_hidden wide */
	int moe_qgemv_fp8_hidden;	/* KDEC_MOE_QGEMV_FP8_HIDDEN, 4096: narrower fp8 experts
				 * stay on the union GEMVs to moe_qgemv_rows. Why (H100,
				 * session 31, decode replay ms, the union GEMVs to 8 rows
				 * against the tile kernels from 3): 7168-wide experts win,
				 * the DeepSeek-V3 slice batch 8 3.32 -> 3.15 (MoE layer 1650
				 * -> 1466 us), Kimi-K2's 2.76 -> 2.60 (1743 -> 1506); 2048-wide
				 * lose, Qwen3-30B-A3B batch 4 5.71 -> 6.18, batch 8 9.65 ->
				 * 9.85, DeepSeek-V2-Lite batch 8 6.34 -> 6.47 (batch 4 flat).
				 * Alone at 8 rows (bench_cuda_moe q, us, tiles / union):
				 * V3 1320.8 / 1497.7, Kimi-K2 1575.5 / 1721.5, Qwen3 170.8 /
				 * 167.5, V2-Lite 184.1 / 186.8. Nothing between measured */
	int moe_qgemv_persist;	/* KDEC_MOE_QGEMV_PERSIST, 0.., 1: moe_qgemv.cu's gate/up as
				 * persistent CTAs (as many as fit at once, each walking its
				 * (64 rows, K slice) items, the split chosen to balance them)
				 * where its items outnumber the CTAs that fit (Kimi-K2's 512
				 * tiles at one row, every model at batch 8); 0: a CTA an item;
				 * N > 1: at most N CTAs (tests: several items a CTA). Measured on
				 * an H100 (session 20, call 3, replay ms): decode batch 8 1.2-3.3%
				 * faster (Qwen3-30B-A3B fp8 10.418 -> 10.148, int4 4.578 ->
				 * 4.458; Kimi-K2 slice fp8 2.855 -> 2.811), batch 1 within noise */
	int moe_qgemv_split;	/* KDEC_MOE_QGEMV_SPLIT, 0..8, 0: moe_qgemv.cu's gate/up K
				 * slices from its plan (the fewest giving every SM two CTAs);
				 * N: at least N where the x slice fits (for measuring) */

	/* ---- the CUDA backend (daemon/backend/cuda) ---- */
	int op_times;		/* KDEC_CUDA_OP_TIMES, 0..2, 0: 1 times every op of the decode
				 * steps with events, 2 those of the prefill chunks; ops then run
				 * one by one (no graphs) */
	int moe_shared_branch;	/* KDEC_MOE_SHARED_BRANCH, rows (>= 0): up to this many rows
				 * a MoE layer's shared expert runs on a branch of the step
				 * beside the routing and the routed experts (the backend's
				 * branch op); 0: after them, in line */
	int linear_gemv_split;	/* KDEC_LINEAR_GEMV_SPLIT, flag, 1: the bf16 GEMV (M <= 2) of
				 * few rows (a CTA a row pair at most two CTAs a multiprocessor:
				 * the MoE routers) runs a CTA a row pair, its warps splitting K */
	int moe_route_reg;	/* KDEC_MOE_ROUTE_REG, flag, 1: moe_route keeps a row's experts
				 * in registers where they fit (<= 512) and no group is masked */
	int moe_fused_rows;	/* KDEC_MOE_FUSED_ROWS, rows (>= 0), 1: up to this many rows a
				 * MoE layer runs as one k_cuda_moe_experts_add call */
	int mla_post_fused;	/* KDEC_CUDA_MLA_POST, flag, 1: mla_post is one kernel
				 * (k_cuda_mla_post); 0: the four kernels of the op-by-op path */
	int mla_prep_fused;	/* KDEC_CUDA_MLA_PREP, flag, 1: mla_prep runs q and kv_a as one
				 * GEMM over the adjacent rows; 0: two linears */
	int mla_post_in_absorb;	/* KDEC_MLA_POST_IN_ABSORB, flag, 1: mla_post's work is done in
				 * the absorb launch where it fits; 0: its own launch */
	int gate_up_bf16;	/* KDEC_GATE_UP_BF16, flag, 1: a dense model's gate/up GEMM
				 * writes bf16 where the down projection reads bf16 only; 0: fp32.
				 * Not bit-identical */
	int swiglu_in_down;	/* KDEC_SWIGLU_IN_DOWN, rows 0..8, 1: a quantized dense MLP's
				 * (or a bf16 one's on the ring GEMV) SwiGLU of up to this many
				 * rows is formed by the down projection's GEMV from gate/up
				 * (k_cuda_linear_q_gemv_swiglu, k_cuda_linear_swiglu_run);
				 * 0: its own launch always. The same bits either way. Measured
				 * on an H100 (session 15): faster at 1 row (Llama-3.1-8B fp8
				 * 3.79 -> 3.70 ms a step, int4 3.14 -> 3.02), slower at 8 (fp8
				 * 4.76 -> 5.18: every CTA of the split forms its x slice's
				 * products again, 8 rows of them) */
	int norm_in_gemv;	/* KDEC_NORM_IN_GEMV, rows 0..8, 0: an RMSNorm of up to this
				 * many rows whose output goes to a quantized linear or the
				 * bf16 ring GEMV next is formed by that linear's GEMV from the
				 * norm's input (k_cuda_linear_q_norm_run, k_cuda_linear_norm_run),
				 * one launch and one round trip fewer; 0: its own launch always.
				 * The same bits either way.
				 * Measured slower on an H200 (session 18): Llama-3.1-8B fp8
				 * batch 1 2.999 ms a step against 2.931 with it off */
	int silu_bf16_only;	/* KDEC_SILU_BF16_ONLY, flag, 1: SwiGLU writes only the bf16
				 * form where the down projection reads nothing else; 0: fp32 too */
	int router_fp32;	/* KDEC_ROUTER_FP32, flag, 1: the MoE router's logits from fp32
				 * x at every row count, as the reference computes them; 0: the
				 * linear layers' path (x rounded to bf16 from 2 rows on), for
				 * measuring what that flips. Not bit-identical */
	int linear_fp32x;	/* KDEC_LINEAR_FP32X, flag, 0: 1 runs every linear layer on the
				 * kernels that read x in fp32 (the GEMV walked over M, or the
				 * generic one): slow, for telling bf16 rounding of activations
				 * from kernel errors (contrib/device/fidelity.sh) */
};

/* The built-in defaults (above), no environment. */
void k_cuda_tuning_defaults(struct k_cuda_tuning *t);

/* The defaults overridden by each KDEC_* variable above that is set and not empty.
 * 0, or -EINVAL with a line naming the variable and its value in err (err_len bytes,
 * may be NULL) where a value is malformed or out of range; *t is then the defaults. */
int k_cuda_tuning_from_env(struct k_cuda_tuning *t, char *err, size_t err_len);

/* Installs a copy of *t (NULL: the defaults) as the struct every later launch reads.
 * Called at backend creation, and by tests between launches to flip a variant. Not
 * safe against launches on other threads at the same time. */
void k_cuda_tuning_set(const struct k_cuda_tuning *t);

/* The installed struct: the defaults until k_cuda_tuning_set. Never NULL. */
const struct k_cuda_tuning *k_cuda_tuning(void);

#ifdef __cplusplus
}
#endif

#endif
