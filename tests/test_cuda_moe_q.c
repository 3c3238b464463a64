/* CUDA MoE experts kept quantized (k_cuda_moe_experts_q, k_cuda_moe_experts_add_q)
 * against the CPU reference on the same quantized weights (k_cpu_moe_experts, which
 * dequantizes exactly: kernels/quant.h). Formats: fp8 block-scaled 128 x 128 (fp32
 * scales, DeepSeek-V3 / Kimi-K2), fp8 per channel (bf16 scales), fp8 per tensor (fp32),
 * int4 groups of 32 (bf16 scales, Kimi-K2-Thinking). Expert shapes of every supported
 * MoE model: Qwen3-30B-A3B (2048 x 768, 128 experts, top 8), DeepSeek-V2-Lite (2048 x
 * 1408, 64, top 6), DeepSeek-V3 (7168 x 2048, 256, top 8) and Kimi-K2 (7168 x 2048,
 * 384, top 8), at M 1, 2, 3, 8 on the small path (M 1 with moe_small_m1.cu's kernels
 * and with the general ones, which must give the same bits), and a grouped M (the
 * tensor-core path: 64 rows, 9 (72 pairs) at the 7168-wide shapes), plus a row naming one expert
 * twice and an id outside [0, n_experts). Random fp8 codes (no NaN code) and int4
 * words, random scales; the payloads of experts nobody chose hold NaN codes (fp8) and
 * their scales NaN (both formats), and outputs start as NaN, so a wrong read or an
 * element left unwritten fails. Tolerance rel L2 <= 1e-4 (each 16-byte chunk's
 * partial sum scaled once, fp32 accumulation; grouped: bf16 hi+lo activations, ~1e-5
 * expected). experts_add_q: without a shared expert (Qwen3) fused on the small path
 * (residual y0 + experts within 1e-4 of the MLP's part); with one (DeepSeek) it must
 * decline (1) and leave y bit for bit; k_cuda_moe_lat_config refuses quantized
 * experts (1, with its reason); bad formats are -EINVAL. The grouped cases run three
 * times: on expert_mma_kernel, then with KDEC_MOE_QTILE_ROWS 64 on moe_qtile.cu's tile
 * kernels (" qtile": every model shape and format above must take them;
 * " qtile-declined": the odd ones below fall back), then in their wide passes
 * (KDEC_MOE_QTILE_WIDE 1, " qtile-wide"), then in passes of 16 spread over 3 CTAs
 * an expert (KDEC_MOE_QTILE_SPLIT 3, " qtile-split"), with a hot expert (every row's
 * slot 0: several passes of 16 rows at 64, one of 64, int4 two of 32, wide; split, also
 * 40 rows where the shape's M is below) added. The small path's cases run on its own CUDA-core kernels
 * (KDEC_MOE_QGEMV_ROWS 0), then again on moe_qgemv.cu's union GEMVs (" qgemv": every
 * model shape and format must take them; x and activations in f16, so QGEMV_TOL 2e-3),
 * with their bits twice the same, a call naming no valid expert at all (zeros), and
 * experts_add_q through them; the union gate/up also in its persistent form
 * (KDEC_MOE_QGEMV_PERSIST 1, and 3: several items a CTA); int4 on them at every M up to 8
 * (KDEC_MOE_QGEMV_INT4_ROWS 8; its default sends 3..8 rows to the tile kernels), and
 * every format with it and KDEC_MOE_QGEMV_FP8_ROWS at 4 (fp8 at every width: the tile
 * kernels at 5..8 rows on the auto path). Shapes outside the vector
 * kernels (the quant goldens' tiny experts 64 x 20 and 96 x 24, an odd 136 x 56, blocks
 * of 96) take the CUDA-core kernels at every M, the same cases. Skips (77) without CUDA or a
 * GPU. KD_TEST_QUICK=1 (for compute-sanitizer): the odd shapes and Qwen3's in fp8-block,
 * fp8 per channel and int4, grouped at 9 rows. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cpu/k_cpu.h"
#include "kernels/cuda/k_cuda.h"
#include "kernels/cuda/moe/k_cuda_moe.h"
#include "tests/cudatest.h"
#include "tests/moetest.h"

#define EXPERT_TOL 1e-4
/* moe_qgemv.cu's union GEMVs: x and the activations rounded to f16 (as the dense
 * quantized GEMV, test_cuda_linear_q's F16X_TOL), int4 values scaled in f16 */
#define QGEMV_TOL 2e-3
#define N_SETS 4		/* distinct weight sets; expert e uses set e % N_SETS */

static unsigned long long seed = 0x5eedf00dull;
static double expert_tol = EXPERT_TOL;	/* the tolerance of the kernels under test */
static cudaStream_t stream;
static struct k_pool *pool;

/* A format under test: fmt, scale dtype, blocks (0: the whole dimension). */
struct qfmt {
	const char *name;
	enum k_qfmt fmt;
	enum k_dtype sdt;
	int brows, bcols;
};

/* N_SETS random quantized expert sets (host and device), and poisoned copies. */
struct qweights {
	void *h[N_SETS][3], *hs[N_SETS][3];	/* payload, scales */
	void *d[N_SETS][3], *ds[N_SETS][3];
	void *dnan, *dsnan;			/* NaN payload (fp8) and NaN scales */
	struct k_quant q[3];			/* scale unset */
	size_t pay[3], ns[3];
};

static float rand_scale(const struct qfmt *f)
{
	/* values ~1 (fp8 codes below) or ~4 (int4): products ~0.03, outputs O(1) */
	return (test_randf(&seed) + 2.0f) * (f->fmt == K_Q_INT4 ? 0.004f : 0.012f);
}

static void qweights_make(struct qweights *w, const struct moe_shape *s, const struct qfmt *f)
{
	for (int j = 0; j < 3; j++) {
		int64_t N = j < 2 ? s->inter : s->hidden, K = j < 2 ? s->hidden : s->inter;
		int br = f->brows ? f->brows : (int)N, bc = f->bcols ? f->bcols : (int)K;

		w->q[j] = (struct k_quant){ .fmt = f->fmt, .scale_dtype = f->sdt, .block_rows = br,
					    .block_cols = bc, .scale_cols = (K + bc - 1) / bc };
		w->pay[j] = (size_t)N * k_quant_row_bytes(f->fmt, K);
		w->ns[j] = (size_t)((N + br - 1) / br) * (size_t)w->q[j].scale_cols;
	}
	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			uint8_t *p = malloc(w->pay[j]);
			size_t es = k_dtype_size(f->sdt);
			uint8_t *sc = malloc(w->ns[j] * es);

			for (size_t i = 0; i < w->pay[j]; i += 8) {	/* 8 bytes a draw */
				uint64_t r;

				seed ^= seed << 13;	/* xorshift64 */
				seed ^= seed >> 7;
				seed ^= seed << 17;
				r = seed;
				for (size_t b = 0; b < 8 && i + b < w->pay[j]; b++, r >>= 8) {
					uint8_t v = (uint8_t)r;

					if (f->fmt == K_Q_FP8)	/* exponents 0..10: no NaN code */
						v = (uint8_t)((v & 0x87) | ((((v >> 3) & 15) % 11) << 3));
					p[i + b] = v;
				}
			}
			for (size_t i = 0; i < w->ns[j]; i++) {
				float v = rand_scale(f);

				if (f->sdt == K_F32) {
					memcpy(sc + i * 4, &v, 4);
				} else {
					uint16_t h = k_f32_to_bf16(v);

					memcpy(sc + i * 2, &h, 2);
				}
			}
			w->h[k][j] = p;
			w->hs[k][j] = sc;
			w->d[k][j] = dup_to_device(p, w->pay[j]);
			w->ds[k][j] = dup_to_device(sc, w->ns[j] * es);
		}
	{
		size_t most = 0, smost = 0;

		for (int j = 0; j < 3; j++) {
			most = w->pay[j] > most ? w->pay[j] : most;
			smost = w->ns[j] * 4 > smost ? w->ns[j] * 4 : smost;
		}
		w->dnan = dalloc(most);
		w->dsnan = dalloc(smost);
		CU(cudaMemset(w->dnan, 0x7f, most));	/* fp8 NaN; int4: 7s, scaled by NaN */
		CU(cudaMemset(w->dsnan, 0xff, smost));	/* NaN as fp32 and as bf16 */
	}
}

static void qweights_free(struct qweights *w)
{
	for (int k = 0; k < N_SETS; k++)
		for (int j = 0; j < 3; j++) {
			free(w->h[k][j]);
			free(w->hs[k][j]);
			cudaFree(w->d[k][j]);
			cudaFree(w->ds[k][j]);
		}
	cudaFree(w->dnan);
	cudaFree(w->dsnan);
}

#define EX_DUP 1		/* row 0 names its slot 0 expert in slot 1 too */
#define EX_BAD_ID 2		/* the last row's last slot names no expert */
#define EX_HOT 4		/* every row's slot 0 names expert 0 (the grouped kernels'
				 * expert of M rows: several passes of 16) */
#define EX_ALL_BAD 8		/* no slot names an expert: the sum is 0 */

/* One case: routing (moe_make_ids, then flags), the CPU's copies (a bad id becomes a
 * valid one adding 0), host experts for the CPU, device tables (unused experts on the
 * NaN payload and scales). */
struct qcase {
	size_t nx, nk;
	float *x, *y0, *wts, *cpu_wts;
	int32_t *ids, *cpu_ids;
	struct k_expert *ex;
	float *dx, *dw;
	int32_t *dids;
	void *dtable, *dstable;
	int n_used;
};

static void qcase_make(struct qcase *c, const struct moe_shape *s, const struct qweights *w,
		       int M, int flags)
{
	const void **table = calloc((size_t)s->n_experts * 3, sizeof(void *));
	const void **stable = calloc((size_t)s->n_experts * 3, sizeof(void *));
	unsigned char *used = calloc((size_t)s->n_experts, 1);

	c->nx = (size_t)M * s->hidden;
	c->nk = (size_t)M * s->top_k;
	c->x = malloc(sizeof(float) * c->nx);
	c->y0 = malloc(sizeof(float) * c->nx);
	c->wts = malloc(sizeof(float) * c->nk);
	c->cpu_wts = malloc(sizeof(float) * c->nk);
	c->ids = malloc(sizeof(int32_t) * c->nk);
	c->cpu_ids = malloc(sizeof(int32_t) * c->nk);
	c->ex = calloc((size_t)s->n_experts, sizeof(*c->ex));
	for (size_t i = 0; i < c->nx; i++) {
		c->x[i] = test_randf(&seed) * 2;
		c->y0[i] = test_randf(&seed) * 4;
	}
	moe_make_ids(c->ids, c->wts, M, s, flags & EX_HOT ? 0 : -1, &seed);
	if ((flags & EX_DUP) && s->top_k > 1)
		c->ids[1] = c->ids[0];
	memcpy(c->cpu_ids, c->ids, sizeof(int32_t) * c->nk);
	memcpy(c->cpu_wts, c->wts, sizeof(float) * c->nk);
	if (flags & EX_BAD_ID) {
		c->ids[c->nk - 1] = (c->nk & 1) ? -1 : s->n_experts + 2;
		c->cpu_ids[c->nk - 1] = 0;
		c->cpu_wts[c->nk - 1] = 0.0f;
	}
	for (size_t i = 0; (flags & EX_ALL_BAD) && i < c->nk; i++) {
		c->ids[i] = (i & 1) ? -1 : s->n_experts;
		c->cpu_ids[i] = 0;
		c->cpu_wts[i] = 0.0f;
	}
	for (size_t i = 0; i < c->nk; i++)
		if (c->ids[i] >= 0 && c->ids[i] < s->n_experts)
			used[c->ids[i]] = 1;
	c->n_used = 0;
	for (int e = 0; e < s->n_experts; e++) {
		int k = e % N_SETS;
		struct k_expert *x = &c->ex[e];

		*x = (struct k_expert){ .gate = w->h[k][0], .up = w->h[k][1], .down = w->h[k][2],
					.gate_q = w->q[0], .up_q = w->q[1], .down_q = w->q[2] };
		x->gate_q.scale = w->hs[k][0];
		x->up_q.scale = w->hs[k][1];
		x->down_q.scale = w->hs[k][2];
		for (int j = 0; j < 3; j++) {
			table[3 * e + j] = used[e] ? w->d[k][j] : w->dnan;
			stable[3 * e + j] = used[e] ? w->ds[k][j] : w->dsnan;
		}
		c->n_used += used[e];
	}
	c->dtable = dup_to_device(table, sizeof(void *) * (size_t)s->n_experts * 3);
	c->dstable = dup_to_device(stable, sizeof(void *) * (size_t)s->n_experts * 3);
	c->dx = dup_to_device(c->x, sizeof(float) * c->nx);
	c->dw = dup_to_device(c->wts, sizeof(float) * c->nk);
	c->dids = dup_to_device(c->ids, sizeof(int32_t) * c->nk);
	free(table);
	free(stable);
	free(used);
}

static void qcase_free(struct qcase *c)
{
	cudaFree(c->dtable);
	cudaFree(c->dstable);
	cudaFree(c->dx);
	cudaFree(c->dw);
	cudaFree(c->dids);
	free(c->x);
	free(c->y0);
	free(c->wts);
	free(c->cpu_wts);
	free(c->ids);
	free(c->cpu_ids);
	free(c->ex);
}

static struct k_cuda_moe_quant quant_of(const struct qweights *w, const struct qcase *c)
{
	struct k_cuda_moe_quant q = { .fmt = w->q[0].fmt, .scale_dtype = w->q[0].scale_dtype,
				      .scales = (const void *const *)c->dstable };

	for (int j = 0; j < 3; j++) {
		q.block_rows[j] = w->q[j].block_rows;
		q.block_cols[j] = w->q[j].block_cols;
	}
	return q;
}

static double rel_of(const float *got, const float *want, const float *base, size_t n, int *nan)
{
	double num = 0, den = 0;

	*nan = 0;
	for (size_t i = 0; i < n; i++) {
		double d = (double)got[i] - want[i], m = (double)want[i] - (base ? base[i] : 0);

		num += d * d;
		den += m * m;
		*nan |= got[i] != got[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* k_cuda_moe_experts_q at M rows on path against k_cpu_moe_experts. */
static void test_q_experts(const struct moe_shape *s, const struct qfmt *f,
			   const struct qweights *w, struct k_cuda_moe_ws *ws, int M, int flags,
			   enum k_cuda_moe_path path, const char *tag)
{
	struct qcase c;
	struct k_cuda_moe_quant q;
	float *want, *got, *dout;
	double rel;
	int ret, nan;
	char shape[128];

	qcase_make(&c, s, w, M, flags);
	q = quant_of(w, &c);
	want = malloc(sizeof(float) * c.nx);
	got = malloc(sizeof(float) * c.nx);
	CHECK(k_cpu_moe_experts(pool, want, c.x, M, c.cpu_ids, c.cpu_wts, s->top_k, c.ex,
				s->n_experts, K_BF16, s->hidden, s->inter) == 0, "cpu experts");
	dout = dalloc(sizeof(float) * c.nx);
	CU(cudaMemset(dout, 0xff, sizeof(float) * c.nx));
	moe_set_path(path);
	ret = k_cuda_moe_experts_q(stream, ws, dout, c.dx, M, c.dids, c.dw, s->top_k,
				   (const uint16_t *const *)c.dtable, &q, s->n_experts, s->hidden,
				   s->inter);
	CU(cudaStreamSynchronize(stream));
	to_host(got, dout, sizeof(float) * c.nx);
	rel = rel_of(got, want, NULL, c.nx, &nan);
	snprintf(shape, sizeof(shape), "%s %s M %d (%d used)%s%s%s%s%s", s->name, f->name, M,
		 c.n_used, flags & EX_DUP ? " dup" : "", flags & EX_BAD_ID ? " bad-id" : "",
		 flags & EX_HOT ? " hot" : "", flags & EX_ALL_BAD ? " all-bad" : "", tag);
	printf("%-12s %-7s %-66s rel_l2 %.3g%s  %s\n", "moe_q", moe_path_name(path), shape, rel,
	       nan ? "  NaN" : "", ret == 0 && !nan && rel <= expert_tol ? "PASS" : "FAIL");
	CHECK(ret == 0 && !nan && rel <= expert_tol, "%s: ret %d rel %.3g", shape, ret, rel);
	cudaFree(dout);
	free(want);
	free(got);
	qcase_free(&c);
}

/* M = 1 on the small path: moe_small_m1.cu's kernels and the general ones, the same
 * bits (both outputs start as NaN: finite too). */
static void test_q_m1_bits(const struct moe_shape *s, const struct qfmt *f,
			   const struct qweights *w, struct k_cuda_moe_ws *ws, int flags)
{
	struct qcase c;
	struct k_cuda_moe_quant q;
	float *got[2], *dout;
	int ret = 0, diff = 0;

	qcase_make(&c, s, w, 1, flags);
	q = quant_of(w, &c);
	dout = dalloc(sizeof(float) * c.nx);
	moe_set_path(K_CUDA_MOE_PATH_SMALL);
	for (int m1 = 0; m1 < 2; m1++) {
		moe_set_m1(m1);
		got[m1] = malloc(sizeof(float) * c.nx);
		CU(cudaMemset(dout, 0xff, sizeof(float) * c.nx));
		ret |= k_cuda_moe_experts_q(stream, ws, dout, c.dx, 1, c.dids, c.dw, s->top_k,
					    (const uint16_t *const *)c.dtable, &q, s->n_experts,
					    s->hidden, s->inter);
		to_host(got[m1], dout, sizeof(float) * c.nx);
	}
	moe_set_m1(-1);
	for (size_t i = 0; i < c.nx; i++)
		diff += !test_same_floats(&got[0][i], &got[1][i], 1);
	printf("%-12s %-44s %-10s%s%s  %d of %zu differ  %s\n", "moe_q m1 bits", s->name, f->name,
	       flags & EX_DUP ? " dup" : "", flags & EX_BAD_ID ? " bad-id" : "", diff, c.nx,
	       ret == 0 && !diff ? "PASS" : "FAIL");
	CHECK(ret == 0 && !diff, "m1 bits %s %s: ret %d, %d differ", s->name, f->name, ret, diff);
	free(got[0]);
	free(got[1]);
	cudaFree(dout);
	qcase_free(&c);
}


/* moe_qgemv.cu's kernels twice on the same inputs: the same bits (fixed split and
 * expert orders; the output starts as NaN the first time, as 0 the second). */
static void test_q_qgemv_bits(const struct moe_shape *s, const struct qfmt *f,
			      const struct qweights *w, struct k_cuda_moe_ws *ws, int M, int flags)
{
	struct qcase c;
	struct k_cuda_moe_quant q;
	float *got[2], *dout;
	int ret = 0, diff = 0;

	qcase_make(&c, s, w, M, flags);
	q = quant_of(w, &c);
	dout = dalloc(sizeof(float) * c.nx);
	moe_set_path(K_CUDA_MOE_PATH_SMALL);
	for (int r = 0; r < 2; r++) {
		got[r] = malloc(sizeof(float) * c.nx);
		CU(cudaMemset(dout, r ? 0 : 0xff, sizeof(float) * c.nx));
		ret |= k_cuda_moe_experts_q(stream, ws, dout, c.dx, M, c.dids, c.dw, s->top_k,
					    (const uint16_t *const *)c.dtable, &q, s->n_experts,
					    s->hidden, s->inter);
		to_host(got[r], dout, sizeof(float) * c.nx);
	}
	for (size_t i = 0; i < c.nx; i++)
		diff += !test_same_floats(&got[0][i], &got[1][i], 1);
	printf("%-12s %-44s %-10s M %d%s%s  %d of %zu differ  %s\n", "moe_q qgemv bits", s->name,
	       f->name, M, flags & EX_DUP ? " dup" : "", flags & EX_BAD_ID ? " bad-id" : "", diff,
	       c.nx, ret == 0 && !diff ? "PASS" : "FAIL");
	CHECK(ret == 0 && !diff, "qgemv bits %s %s M %d: ret %d, %d differ", s->name, f->name, M,
	      ret, diff);
	free(got[0]);
	free(got[1]);
	cudaFree(dout);
	qcase_free(&c);
}

/* k_cuda_moe_experts_add_q: no shared expert (si 0): fused, y0 + experts; with one:
 * declined (1), y as it was. */
static void test_q_add(const struct moe_shape *s, const struct qfmt *f, const struct qweights *w,
		       struct k_cuda_moe_ws *ws, int M, int si)
{
	struct qcase c;
	struct k_cuda_moe_quant q;
	struct k_cuda_moe_shared sh = { NULL, NULL, NULL, si };
	uint16_t *dsh = NULL;
	float *want, *got, *dy;
	double rel = 0;
	int ret, nan = 0, moved = 0, ok;

	qcase_make(&c, s, w, M, 0);
	q = quant_of(w, &c);
	want = malloc(sizeof(float) * c.nx);
	got = malloc(sizeof(float) * c.nx);
	if (si > 0) {	/* any bf16 rows: the call must decline before reading them */
		dsh = dalloc(sizeof(uint16_t) * (size_t)s->hidden * si * 3);
		sh.gate = dsh;
		sh.up = dsh + (size_t)s->hidden * si;
		sh.down = dsh + 2 * (size_t)s->hidden * si;
	}
	CHECK(k_cpu_moe_experts(pool, want, c.x, M, c.cpu_ids, c.cpu_wts, s->top_k, c.ex,
				s->n_experts, K_BF16, s->hidden, s->inter) == 0, "cpu experts");
	k_cpu_add(want, c.y0, c.nx);	/* y0 + routed, the order aside: within tolerance */
	dy = dup_to_device(c.y0, sizeof(float) * c.nx);
	moe_set_path(K_CUDA_MOE_PATH_AUTO);
	ret = k_cuda_moe_experts_add_q(stream, ws, dy, c.dx, M, c.dids, c.dw, s->top_k,
				       (const uint16_t *const *)c.dtable, &q, s->n_experts,
				       s->hidden, s->inter, si > 0 ? &sh : NULL);
	CU(cudaStreamSynchronize(stream));
	to_host(got, dy, sizeof(float) * c.nx);
	if (si > 0) {
		for (size_t i = 0; i < c.nx; i++)
			moved |= memcmp(&got[i], &c.y0[i], sizeof(float)) != 0;
		ok = ret == 1 && !moved;
		printf("%-12s %-44s %-10s M %d shared %d  declined, y %s  %s\n", "moe_q add",
		       s->name, f->name, M, si, moved ? "changed" : "kept", ok ? "PASS" : "FAIL");
	} else {
		rel = rel_of(got, want, c.y0, c.nx, &nan);
		ok = ret == 0 && !nan && rel <= expert_tol;
		printf("%-12s %-44s %-10s M %d%s  rel_l2 %.3g%s  %s\n", "moe_q add", s->name,
		       f->name, M, expert_tol > EXPERT_TOL ? " qgemv" : "", rel, nan ? "  NaN" : "",
		       ok ? "PASS" : "FAIL");
	}
	CHECK(ok, "experts_add_q %s %s M %d shared %d: ret %d rel %.3g", s->name, f->name, M, si,
	      ret, rel);
	cudaFree(dy);
	cudaFree(dsh);
	free(want);
	free(got);
	qcase_free(&c);
}

/* expect_qtile: the tile kernels (moe_qtile.cu) must take this shape and format */
static void test_q_shape(const struct moe_shape *s, const struct qfmt *f, int grouped_M,
			 int quick, int expect_qtile)
{
	struct k_cuda_moe_ws *ws;
	struct k_cuda_moe_quant qs;	/* the format alone (a scale table's address, unread) */
	struct qweights w;
	int ret = k_cuda_moe_ws_create(&ws, 64, s->top_k, s->n_experts, s->hidden, s->inter, 0);

	CHECK(ret == 0, "ws create %d", ret);
	if (ret)
		return;
	qweights_make(&w, s, f);
	qs = (struct k_cuda_moe_quant){ .fmt = f->fmt, .scale_dtype = f->sdt,
					.scales = (const void *const *)(uintptr_t)256 };
	for (int j = 0; j < 3; j++) {
		qs.block_rows[j] = w.q[j].block_rows;
		qs.block_cols[j] = w.q[j].block_cols;
	}
	moe_set_qgemv(0);	/* the small path's own kernels first */
	for (int pi = 0; pi < 2; pi++) {	/* small with moe_small_m1 at M 1, then without */
		moe_set_m1(pi == 0);
		for (int m = 0; m < 4; m++) {
			int M = (int[]){ 1, 2, 3, 8 }[m];

			if (pi == 1 && M > 1)
				break;
			test_q_experts(s, f, &w, ws, M, 0, K_CUDA_MOE_PATH_SMALL,
				       pi ? " general" : "");
		}
	}
	moe_set_m1(-1);
	test_q_experts(s, f, &w, ws, 3, EX_DUP | EX_BAD_ID, K_CUDA_MOE_PATH_SMALL, "");
	test_q_m1_bits(s, f, &w, ws, 0);
	if (!quick)
		test_q_m1_bits(s, f, &w, ws, EX_DUP | EX_BAD_ID);
	/* moe_qgemv.cu's union GEMVs at M 1..8 on the small path's sizes, where they take
	 * the shape (every model shape and format: expect_qtile; the odd ones decline and
	 * run the small path's kernels at their tolerance) */
	moe_set_qgemv(8);
	moe_set_qgemv_fmt(8);		/* int4 and wide fp8 too, past their default rows */
	moe_set_qgemv_persist(0);	/* gate/up a CTA an item; its other forms below */
	{
		const int takes = k_cuda_moe_qgemv_takes(ws, &qs, 8);

		if (expect_qtile)
			CHECK(takes, "%s %s: moe_qgemv declined", s->name, f->name);
		expert_tol = takes ? QGEMV_TOL : EXPERT_TOL;
		for (int m = 0; m < 4; m++)
			test_q_experts(s, f, &w, ws, (int[]){ 1, 2, 3, 8 }[m], 0, K_CUDA_MOE_PATH_SMALL,
				       takes ? " qgemv" : " qgemv-declined");
		test_q_experts(s, f, &w, ws, 3, EX_DUP | EX_BAD_ID, K_CUDA_MOE_PATH_SMALL,
			       takes ? " qgemv" : " qgemv-declined");
		test_q_experts(s, f, &w, ws, 2, EX_ALL_BAD, K_CUDA_MOE_PATH_SMALL,
			       takes ? " qgemv" : " qgemv-declined");
		if (takes) {
			test_q_qgemv_bits(s, f, &w, ws, 1, 0);
			test_q_qgemv_bits(s, f, &w, ws, 8, EX_DUP | EX_BAD_ID);
			/* the persistent gate/up: as many CTAs as fit, then 3 (several items
			 * a CTA, its slices' partials summed across them) */
			for (int pc = 0; pc < 2; pc++) {
				const char *tag = pc ? " qgemv persist-3" : " qgemv persist";

				moe_set_qgemv_persist(pc ? 3 : 1);
				test_q_experts(s, f, &w, ws, 1, 0, K_CUDA_MOE_PATH_SMALL, tag);
				test_q_experts(s, f, &w, ws, 8, 0, K_CUDA_MOE_PATH_SMALL, tag);
				test_q_experts(s, f, &w, ws, 3, EX_DUP | EX_BAD_ID,
					       K_CUDA_MOE_PATH_SMALL, tag);
				test_q_experts(s, f, &w, ws, 2, EX_ALL_BAD, K_CUDA_MOE_PATH_SMALL,
					       tag);
				test_q_qgemv_bits(s, f, &w, ws, 8, EX_DUP | EX_BAD_ID);
			}
		}
		expert_tol = EXPERT_TOL;
	}
	moe_set_qgemv_persist(-1);
	moe_set_qgemv_fmt(-1);
	/* past KDEC_MOE_QGEMV_INT4_ROWS and _FP8_ROWS (4 here): the union GEMVs at 1..4 rows,
	 * the tile kernels at 5..8 on the auto path where they take the shape (their
	 * tolerance, as the grouped cases below), the small path's own kernels where they
	 * do not */
	{
		const int tiles = k_cuda_moe_qtile_takes(&qs, s->hidden, s->inter, 8);

		moe_set_qgemv(8);
		moe_set_qgemv_fmt(4);
		CHECK(!k_cuda_moe_qgemv_takes(ws, &qs, 5), "%s %s: union GEMVs took 5 rows",
		      s->name, f->name);
		for (int m = 0; m < 3; m++) {
			const int M = (int[]){ 4, 5, 8 }[m], qg = k_cuda_moe_qgemv_takes(ws, &qs, M);
			const char *tag = qg ? " rows-4 qgemv" : M > 4 && tiles ? " rows-4 qtile" :
					  " rows-4 small";

			expert_tol = qg ? QGEMV_TOL : EXPERT_TOL;
			test_q_experts(s, f, &w, ws, M, 0, K_CUDA_MOE_PATH_AUTO, tag);
		}
		expert_tol = EXPERT_TOL;
		test_q_experts(s, f, &w, ws, 6, EX_DUP | EX_BAD_ID, K_CUDA_MOE_PATH_AUTO,
			       tiles ? " rows-4 qtile" : " rows-4 small");
		moe_set_qgemv_fmt(-1);
	}
	moe_set_qgemv(-1);
	/* the grouped path on expert_mma_kernel, then on moe_qtile.cu's tile kernels where
	 * they take the shapes (the call says which: it falls back where they do not), in
	 * passes of 16 rows all in one CTA an expert, then in wide ones at every M (CTAs by
	 * the rows, the default), then in passes of 16 spread over 3 CTAs an expert (a hot expert of 64 rows: 2, 1 and 1 passes a CTA; of 40: one
	 * each, the last of 8 rows) */
	for (int qt = 0; qt < 4; qt++) {
		const char *tag;

		moe_set_qtile(qt ? 64 : 0);
		moe_set_qtile_wide(qt == 2 ? 1 : 0);
		moe_set_qtile_split(qt == 3 ? 3 : qt == 1 ? 1 : -1);
		tag = !qt ? "" : !k_cuda_moe_qtile_takes(&qs, s->hidden, s->inter, 64) ?
		      " qtile-declined" : qt == 2 ? " qtile-wide" : qt == 3 ? " qtile-split" :
		      " qtile";
		if (qt && expect_qtile)
			CHECK(strcmp(tag, " qtile-declined") != 0, "%s %s: the tile kernels declined",
			      s->name, f->name);
		if (qt)	/* a single row: one n8 tile of one row an expert */
			test_q_experts(s, f, &w, ws, 1, 0, K_CUDA_MOE_PATH_GROUPED, tag);
		test_q_experts(s, f, &w, ws, 2, 0, K_CUDA_MOE_PATH_GROUPED, tag);
		test_q_experts(s, f, &w, ws, 3, EX_DUP | EX_BAD_ID, K_CUDA_MOE_PATH_GROUPED, tag);
		test_q_experts(s, f, &w, ws, grouped_M, 0, K_CUDA_MOE_PATH_AUTO, tag);
		if (qt)
			test_q_experts(s, f, &w, ws, grouped_M, EX_HOT, K_CUDA_MOE_PATH_GROUPED, tag);
		if (qt == 3 && grouped_M < 40 && s->hidden <= 2048)	/* quick's 9 rows: one pass */
			test_q_experts(s, f, &w, ws, 40, EX_HOT, K_CUDA_MOE_PATH_GROUPED, tag);
	}
	moe_set_qtile_split(-1);
	moe_set_qtile_wide(-1);
	moe_set_qtile(-1);
	qweights_free(&w);
	k_cuda_moe_ws_destroy(ws);
}

/* Refusals: formats the kernels do not take, the latency launch, experts_add_q with a
 * shared expert (test_q_add). */
static void test_q_refusals(void)
{
	struct k_cuda_moe_quant q = { .fmt = K_Q_FP8, .scale_dtype = K_F32,
				      .block_rows = { 128, 128, 128 }, .block_cols = { 128, 128, 128 },
				      .scales = (const void *const *)(uintptr_t)256 };
	struct k_cuda_moe_lat_cfg cfg;
	char why[160] = "";
	int ret;

	CHECK(k_cuda_moe_quant_ok(&q, 2048, 768) == 0, "fp8 128x128 taken");
	q.block_cols[2] = 0;
	CHECK(k_cuda_moe_quant_ok(&q, 2048, 768) == -EINVAL, "block 0 refused");
	q.block_cols[2] = 128;
	q.scale_dtype = K_F16;
	CHECK(k_cuda_moe_quant_ok(&q, 2048, 768) == -EINVAL, "f16 scales refused");
	q.scale_dtype = K_F32;
	q.scales = NULL;
	CHECK(k_cuda_moe_quant_ok(&q, 2048, 768) == -EINVAL, "no scale table refused");
	q.scales = (const void *const *)(uintptr_t)256;
	ret = k_cuda_moe_lat_config(&cfg, 1, 8, 128, 2048, 768, 0, NULL, &q,
				    (const float *)(uintptr_t)256, why, sizeof(why));
	printf("%-12s k_cuda_moe_lat_config on fp8 experts: %d (%s)  %s\n", "moe_q lat", ret, why,
	       ret == 1 && strstr(why, "fp8") ? "PASS" : "FAIL");
	CHECK(ret == 1 && strstr(why, "fp8"), "lat config took quantized experts: %d", ret);
}

int main(void)
{
	const struct qfmt fmts[] = {
		{ "fp8-block", K_Q_FP8, K_F32, 128, 128 },
		{ "fp8-chan", K_Q_FP8, K_BF16, 1, 0 },
		{ "fp8-tensor", K_Q_FP8, K_F32, 0, 0 },
		{ "int4-g32", K_Q_INT4, K_BF16, 1, 32 },
	};
	const struct {
		struct moe_shape s;
		int grouped_M, shared;
	} shapes[] = {
		{ { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 }, 64, 0 },
		{ { "v2-lite 2048x1408 E64 k6", 2048, 1408, 64, 6 }, 64, 2816 },
		{ { "v3 7168x2048 E256 k8", 7168, 2048, 256, 8 }, 9, 2048 },
		{ { "kimi-k2 7168x2048 E384 k8", 7168, 2048, 384, 8 }, 9, 2048 },
	};
	const struct {
		struct moe_shape s;
		struct qfmt f;
		int grouped_M;
	} odd[] = {
		{ { "v3-golden 64x20 E8 k2", 64, 20, 8, 2 }, { "fp8-block", K_Q_FP8, K_F32, 128, 128 }, 40 },
		{ { "kimi-golden 96x24 E12 k4", 96, 24, 12, 4 }, { "int4-g32", K_Q_INT4, K_BF16, 1, 32 }, 20 },
		{ { "qwen3-30b 2048x768 E128 k8", 2048, 768, 128, 8 },
		  { "fp8-b96", K_Q_FP8, K_F32, 96, 96 }, 9 },	/* blocks not a power of two */
		{ { "odd 136x56 E7 k3", 136, 56, 7, 3 }, { "int4-g32", K_Q_INT4, K_F32, 1, 32 }, 30 },
	};
	int quick;

	if (!test_gpu_present("test_cuda_moe_q"))
		return 77;
	quick = test_env_flag("KD_TEST_QUICK");
	CU(cudaStreamCreate(&stream));
	if (k_pool_create(&pool, 16))
		return 1;
	test_q_refusals();
	/* the CUDA-core kernels: shapes and blocks outside the vector kernels (the
	 * tests/data/quant goldens' experts: 64 x 20 fp8 128 x 128, 96 x 24 int4 g32) */
	for (size_t oi = 0; oi < sizeof(odd) / sizeof(odd[0]); oi++)
		test_q_shape(&odd[oi].s, &odd[oi].f, quick && odd[oi].grouped_M > 9 ? 9 :
			     odd[oi].grouped_M, quick, 0);
	for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
		if (quick && si > 0)	/* quick: Qwen3's shape, all but per tensor */
			break;
		for (size_t fi = 0; fi < sizeof(fmts) / sizeof(fmts[0]); fi++) {
			/* per tensor: the small models only (the scale logic is the same) */
			if ((fmts[fi].brows == 0 && shapes[si].s.hidden > 2048) ||
			    (quick && fi == 2))
				continue;
			test_q_shape(&shapes[si].s, &fmts[fi], quick ? 9 : shapes[si].grouped_M, quick,
				     1);
		}
		{	/* experts_add_q: fused without a shared expert, declined with one */
			struct k_cuda_moe_ws *ws;
			const struct moe_shape *s = &shapes[si].s;
			struct qweights w;

			if (k_cuda_moe_ws_create(&ws, 8, s->top_k, s->n_experts, s->hidden, s->inter,
						 shapes[si].shared)) {
				CHECK(0, "ws create");
				continue;
			}
			qweights_make(&w, s, &fmts[0]);
			for (int qg = 0; qg < 2; qg++) {	/* the small path, then moe_qgemv */
				moe_set_qgemv(qg ? 8 : 0);
				expert_tol = qg ? QGEMV_TOL : EXPERT_TOL;
				test_q_add(s, &fmts[0], &w, ws, 1, shapes[si].shared);
				test_q_add(s, &fmts[0], &w, ws, 2, shapes[si].shared);
			}
			expert_tol = EXPERT_TOL;
			moe_set_qgemv(-1);
			qweights_free(&w);
			k_cuda_moe_ws_destroy(ws);
		}
	}
	moe_set_path(K_CUDA_MOE_PATH_AUTO);
	k_pool_destroy(pool);
	cudaStreamDestroy(stream);
	return test_result("test_cuda_moe_q");
}
#else
int main(void)
{
	fprintf(stderr, "test_cuda_moe_q: skipped: built without CUDA (--without-cuda)\n");
	return 77;
}
#endif
