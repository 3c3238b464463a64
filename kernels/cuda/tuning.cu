// The CUDA path's tuning (k_cuda_tuning.h): the built-in defaults, the one place the
// KDEC_* environment is read, and the installed copy that every launcher reads.
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/k_cuda_tuning.h"

static struct k_cuda_tuning tuning_builtin(void)
{
	struct k_cuda_tuning t;

	memset(&t, 0, sizeof(t));
	t.cuda_pdl = 1;
	t.pdl_relay = 0;
	t.topk_match = 1;
	t.linear_tune = 1;
	t.lt_log = 0;
	t.lt_candidates = 16;
	t.linear_small_mb = 16;
	t.linear_stream_mb = 64;
	t.linear_ring = 0;
	t.linear_ring_stream = 1;
	t.linear_ring_tune = 1;
	t.linear_qgemv = 1;
	t.linear_qgemv_warps = 8;
	t.linear_q_tune = 1;
	t.linear_qwg = 1;
	t.linear_qwg_rows = 0;
	t.attn_mma = 1;
	t.attn_mma_tk = 32;
	t.attn_mma_qreg = 1;
	t.attn_mma_early = 1;
	t.attn_prefill_mma = 1;
	t.attn_prefill_pair = 1;
	t.attn_dec_splits = 0;
	t.attn_merge_batched = 0;
	t.qkv_in_attn = -1;
	t.qkv_post_early = 1;
	t.mla_post_early = 1;
	t.mla_carveout = 0;
	t.mla_split_min = 64;
	t.mla_split_live = 64;
	t.mla_mma_ksplit = 1;
	t.mla_proj_mma = 1;
	t.moe_path = K_CUDA_MOE_PATH_AUTO;
	t.moe_fused = 1;
	t.moe_m1 = 1;
	t.moe_m1_bal = 1;
	t.moe_sh_down_early = 1;
	t.moe_down_early = 1;
	t.moe_qtile_rows = 4096;
	t.moe_qtile_bf16 = 2048;
	t.moe_qtile_wide = 256;
	t.moe_qtile_split = 0;
	t.moe_qgemv_rows = 8;
	t.moe_qgemv_int4_rows = 2;
	t.moe_qgemv_fp8_rows = 2;
	t.moe_qgemv_fp8_hidden = 4096;
	t.moe_qgemv_split = 0;
	t.moe_qgemv_persist = 1;
	t.op_times = 0;
	t.moe_fused_rows = 1;
	t.moe_shared_branch = 64;
	t.linear_gemv_split = 1;
	t.moe_route_reg = 1;
	t.mla_post_fused = 1;
	t.mla_prep_fused = 1;
	t.mla_post_in_absorb = 1;
	t.gate_up_bf16 = 1;
	t.silu_bf16_only = 1;
	t.swiglu_in_down = 1;
	t.router_fp32 = 1;
	t.linear_fp32x = 0;
	return t;
}

// Installed before main (no launcher runs before then), replaced by k_cuda_tuning_set.
static struct k_cuda_tuning tuning_installed = tuning_builtin();

extern "C" void k_cuda_tuning_defaults(struct k_cuda_tuning *t)
{
	*t = tuning_builtin();
}

extern "C" void k_cuda_tuning_set(const struct k_cuda_tuning *t)
{
	tuning_installed = t ? *t : tuning_builtin();
}

extern "C" const struct k_cuda_tuning *k_cuda_tuning(void)
{
	return &tuning_installed;
}

// ---- the environment ----------------------------------------------------------

enum tun_kind {
	TUN_INT,	// an int field, lo..hi
	TUN_EITHER,	// an int field, lo or hi
	TUN_LONG,	// a long field, lo..hi
	TUN_MOE_PATH,	// an int field, one of moe_path_words
};

struct tun_var {
	const char *name;
	size_t off;		// of the field in struct k_cuda_tuning
	enum tun_kind kind;
	long lo, hi;
	bool zero_keeps;	// 0 leaves the default (KDEC_LINEAR_SMALL_MB, as it always did)
};

#define TUN_FIELD(f) offsetof(struct k_cuda_tuning, f)
#define TUN_FLAG(name, f) { name, TUN_FIELD(f), TUN_INT, 0, 1, false }
#define TUN_INT(name, f, lo, hi) { name, TUN_FIELD(f), TUN_INT, lo, hi, false }
#define TUN_MB(name, f, zero_keeps) { name, TUN_FIELD(f), TUN_LONG, 0, LONG_MAX >> 20, zero_keeps }

static const char *const moe_path_words[] = { "auto", "small", "grouped" };	// by enum value

static const struct tun_var tun_vars[] = {
	TUN_FLAG("KDEC_CUDA_PDL", cuda_pdl),
	TUN_INT("KDEC_PDL_RELAY", pdl_relay, 0, 15),
	TUN_FLAG("KDEC_TOPK_MATCH", topk_match),
	TUN_FLAG("KDEC_LINEAR_TUNE", linear_tune),
	TUN_FLAG("KDEC_LT_LOG", lt_log),
	TUN_INT("KDEC_LT_CANDIDATES", lt_candidates, 1, 64),
	TUN_MB("KDEC_LINEAR_SMALL_MB", linear_small_mb, false),
	TUN_MB("KDEC_LINEAR_STREAM_MB", linear_stream_mb, false),
	TUN_INT("KDEC_LINEAR_RING", linear_ring, 0, 8),
	TUN_INT("KDEC_LINEAR_RING_STREAM", linear_ring_stream, 0, 2),
	TUN_FLAG("KDEC_LINEAR_RING_TUNE", linear_ring_tune),
	TUN_FLAG("KDEC_LINEAR_QGEMV", linear_qgemv),
	TUN_INT("KDEC_LINEAR_QGEMV_WARPS", linear_qgemv_warps, 4, 64),
	TUN_FLAG("KDEC_LINEAR_Q_TUNE", linear_q_tune),
	TUN_FLAG("KDEC_LINEAR_QWG", linear_qwg),
	TUN_INT("KDEC_LINEAR_QWG_ROWS", linear_qwg_rows, 0, 256),
	TUN_FLAG("KDEC_ATTN_MMA", attn_mma),
	{ "KDEC_ATTN_MMA_TK", TUN_FIELD(attn_mma_tk), TUN_EITHER, 32, 64, false },
	TUN_FLAG("KDEC_ATTN_MMA_QREG", attn_mma_qreg),
	TUN_FLAG("KDEC_ATTN_MMA_EARLY", attn_mma_early),
	TUN_FLAG("KDEC_ATTN_PREFILL_MMA", attn_prefill_mma),
	TUN_FLAG("KDEC_ATTN_PREFILL_PAIR", attn_prefill_pair),
	TUN_INT("KDEC_ATTN_DEC_SPLITS", attn_dec_splits, 0, INT_MAX),
	TUN_FLAG("KDEC_ATTN_MERGE", attn_merge_batched),
	TUN_FLAG("KDEC_QKV_IN_ATTN", qkv_in_attn),
	TUN_FLAG("KDEC_QKV_POST_EARLY", qkv_post_early),
	TUN_FLAG("KDEC_MLA_POST_EARLY", mla_post_early),
	TUN_FLAG("KDEC_MLA_CARVEOUT", mla_carveout),
	TUN_INT("KDEC_MLA_SPLIT_MIN", mla_split_min, 0, INT_MAX),
	TUN_INT("KDEC_MLA_SPLIT_LIVE", mla_split_live, 0, INT_MAX),
	TUN_FLAG("KDEC_MLA_MMA_KSPLIT", mla_mma_ksplit),
	TUN_FLAG("KDEC_CUDA_MLA_PROJ", mla_proj_mma),
	{ "KDEC_MOE_PATH", TUN_FIELD(moe_path), TUN_MOE_PATH, 0, 0, false },
	TUN_FLAG("KDEC_MOE_FUSED", moe_fused),
	TUN_FLAG("KDEC_MOE_M1", moe_m1),
	TUN_FLAG("KDEC_MOE_M1_BAL", moe_m1_bal),
	TUN_FLAG("KDEC_MOE_SH_DOWN_EARLY", moe_sh_down_early),
	TUN_FLAG("KDEC_MOE_DOWN_EARLY", moe_down_early),
	TUN_INT("KDEC_MOE_QTILE_ROWS", moe_qtile_rows, 0, 4096),
	TUN_INT("KDEC_MOE_QTILE_BF16", moe_qtile_bf16, 0, 4096),
	TUN_INT("KDEC_MOE_QTILE_WIDE", moe_qtile_wide, 0, 4096),
	TUN_INT("KDEC_MOE_QTILE_SPLIT", moe_qtile_split, 0, 64),
	TUN_INT("KDEC_MOE_QGEMV_ROWS", moe_qgemv_rows, 0, 8),
	TUN_INT("KDEC_MOE_QGEMV_INT4_ROWS", moe_qgemv_int4_rows, 0, 8),
	TUN_INT("KDEC_MOE_QGEMV_FP8_ROWS", moe_qgemv_fp8_rows, 0, 8),
	TUN_INT("KDEC_MOE_QGEMV_FP8_HIDDEN", moe_qgemv_fp8_hidden, 0, INT_MAX),
	TUN_INT("KDEC_MOE_QGEMV_SPLIT", moe_qgemv_split, 0, 8),
	TUN_INT("KDEC_MOE_QGEMV_PERSIST", moe_qgemv_persist, 0, 1 << 20),
	TUN_INT("KDEC_CUDA_OP_TIMES", op_times, 0, 2),
	TUN_INT("KDEC_MOE_FUSED_ROWS", moe_fused_rows, 0, INT_MAX),
	TUN_INT("KDEC_MOE_SHARED_BRANCH", moe_shared_branch, 0, INT_MAX),
	TUN_INT("KDEC_LINEAR_GEMV_SPLIT", linear_gemv_split, 0, 1),
	TUN_INT("KDEC_MOE_ROUTE_REG", moe_route_reg, 0, 1),
	TUN_FLAG("KDEC_CUDA_MLA_POST", mla_post_fused),
	TUN_FLAG("KDEC_CUDA_MLA_PREP", mla_prep_fused),
	TUN_FLAG("KDEC_MLA_POST_IN_ABSORB", mla_post_in_absorb),
	TUN_FLAG("KDEC_GATE_UP_BF16", gate_up_bf16),
	TUN_FLAG("KDEC_SILU_BF16_ONLY", silu_bf16_only),
	TUN_INT("KDEC_SWIGLU_IN_DOWN", swiglu_in_down, 0, 8),
	TUN_INT("KDEC_NORM_IN_GEMV", norm_in_gemv, 0, 8),
	TUN_FLAG("KDEC_ROUTER_FP32", router_fp32),
	TUN_FLAG("KDEC_LINEAR_FP32X", linear_fp32x),
};

static int tun_fail(const struct tun_var *v, const char *e, char *err, size_t err_len)
{
	if (err && err_len) {
		if (v->kind == TUN_MOE_PATH)
			snprintf(err, err_len, "%s=%s: want auto, small or grouped", v->name, e);
		else if (v->kind == TUN_EITHER || (v->lo == 0 && v->hi == 1))
			snprintf(err, err_len, "%s=%s: want %ld or %ld", v->name, e, v->lo, v->hi);
		else
			snprintf(err, err_len, "%s=%s: want an integer from %ld to %ld", v->name, e,
				 v->lo, v->hi);
	}
	return -EINVAL;
}

// One variable, set and not empty, into its field of *t.
static int tun_read(const struct tun_var *v, const char *e, struct k_cuda_tuning *t,
		    char *err, size_t err_len)
{
	char *field = (char *)t + v->off, *end;
	long n;

	if (v->kind == TUN_MOE_PATH) {
		for (int i = 0; i < (int)(sizeof(moe_path_words) / sizeof(*moe_path_words)); i++)
			if (!strcmp(e, moe_path_words[i])) {
				*(int *)field = i;
				return 0;
			}
		return tun_fail(v, e, err, err_len);
	}
	errno = 0;
	n = strtol(e, &end, 10);
	if (errno || *end || n < v->lo || n > v->hi ||
	    (v->kind == TUN_EITHER && n != v->lo && n != v->hi))
		return tun_fail(v, e, err, err_len);
	if (n == 0 && v->zero_keeps)
		return 0;
	if (v->kind == TUN_LONG)
		*(long *)field = n;
	else
		*(int *)field = (int)n;
	return 0;
}

static const char *tun_env(const char *name)
{
	const char *e = getenv(name);

	return e && *e ? e : NULL;
}

extern "C" int k_cuda_tuning_from_env(struct k_cuda_tuning *t, char *err, size_t err_len)
{
	const char *e;
	int ret;

	*t = tuning_builtin();
	if (err && err_len)
		err[0] = '\0';
	for (const struct tun_var &v : tun_vars) {
		if (!(e = tun_env(v.name)))
			continue;
		if ((ret = tun_read(&v, e, t, err, err_len))) {
			*t = tuning_builtin();
			return ret;
		}
	}
	// A split floor set alone applies at every split count, as it always did.
	if (tun_env("KDEC_MLA_SPLIT_MIN") && !tun_env("KDEC_MLA_SPLIT_LIVE"))
		t->mla_split_live = 0;
	return 0;
}
