/* test_golden's GPU criterion: a row of logits beyond tolerance fails unless a measured
 * cause explains it. The GPU run records each MoE layer's choices (route_trace.h); the
 * CPU reference engine runs the path again with the GPU's choices forced (MoE) and its
 * KV cache rounded to bf16 as the GPU stores it (engine_opts.kv_bf16), as are the
 * weights it dequantizes to bf16 at load (a quantized MLA's kv_b: engine_opts.w_bf16):
 * "cpu"; and once more with the linear layers' inputs rounded to bf16 too where the
 * GPU's tensor-core kernels round them (engine_opts.x_bf16: "cpux"): the reference's
 * exact arithmetic on what the GPU rounds. The GPU runs the path once more with the same choices and
 * nothing rounded but the cache (fp32 GEMM inputs, CUDA-core attention: "gx"). A row
 * is near when it is within tolerance of cpu or cpux, or when gx is within tolerance
 * of cpu (the GPU's kernels agree with the CPU when nothing is rounded) and the row
 * is within tol + 2 d of cpu, d being how far rounding the GEMM inputs alone moves the
 * CPU row (cpux from cpu): room for the bf16 q and p tiles of the tensor-core
 * attention, which the CPU does not imitate, in proportion to how sensitive the row
 * measurably is to bf16 rounding. A bad row is
 *  - a flip when it is near, and at some MoE layer, at this position or an earlier one
 *    of its sequence (the KV cache carries a flip forward), the CPU's own choice differs
 *    from the GPU's, every such flip a near-tie: the CPU's top-k margin there is at
 *    most twice the largest difference between the GPU's and the CPU's choice values
 *    (score + bias) for that token, computed from each one's router logits (four
 *    times for a group margin of summed pairs), i.e. within what the difference of
 *    their inputs can reorder;
 *  - the bf16 cache when there is no flip, it is within tolerance of cpu, and that CPU
 *    row is itself at least half the tolerance from the reference: the stored precision
 *    alone moves this row that far;
 *  - the GPU's precision when there is no flip and it is within tolerance of cpux, that
 *    CPU row at least half the tolerance from the reference; or it is near through gx,
 *    and gx is within tolerance of the reference or cpu is half of it away.
 * Anything else is reported as a kernel error (or a router error) and fails.
 * Include after testutil.h. */
#ifndef KD_TESTS_GOLDENFLIP_H
#define KD_TESTS_GOLDENFLIP_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/route_trace.h"
#include "kernels/cpu/k_cpu.h"

/* One output row: its sequence (in the trace's numbering) and position. */
struct flip_row {
	int seq, pos;
};

/* What one path of one model measured (the fidelity table's columns). */
struct flip_stats {
	int rows, bad, flips_ok, cache_ok, gemm_ok, argmax_ok;
	double worst, median;
	double same_route_worst;	/* worst row against the forced CPU run: the kernels'
					 * error with the routing and the cache's precision held
					 * equal (-1: no such run) */
	double fp32x_worst;		/* worst row of the fp32-input GPU run against the
					 * forced CPU run (-1: no such run) */
	double bf16x_worst;		/* worst row against the forced CPU run with the GPU's
					 * GEMM input precision too (-1: no such run) */
	long decisions, flipped;	/* MoE decisions compared, of them GPU != CPU's own */
};

static int flip_cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* 1 where a and b (k ids) are different sets. */
static int flip_sets_differ(const int32_t *a, const int32_t *b, int k)
{
	for (int i = 0; i < k; i++) {
		int found = 0;

		for (int j = 0; j < k; j++)
			found |= a[i] == b[j];
		if (!found)
			return 1;
	}
	return 0;
}

/* Decision key k flipped (the experts g's run used, forced on the CPU run c, against
 * c's own choice):
 * 1 flipped at a near-tie, -1 flipped beyond one, 0 not flipped. margin_out and
 * diff_out receive the CPU's margin and the largest choice difference. */
static int flip_decision(const struct route_trace *g, const struct route_trace *c, long k,
			 const struct k_moe_route_params *p, double *margin_out, double *diff_out)
{
	struct k_moe_route_params raw = *p;
	int E = g->n_experts;
	float cg[4096], cc[4096], margin;
	double diff = 0;

	if (!flip_sets_differ(g->ids + k * g->top_k, c->own + k * c->top_k, g->top_k))
		return 0;
	margin = k_cpu_moe_route_margin(p, c->logits + k * E, NULL);
	/* the choice values before any group mask: score + bias of every expert */
	raw.select = K_MOE_GREEDY;
	k_cpu_moe_route_margin(&raw, g->logits + k * E, cg);
	k_cpu_moe_route_margin(&raw, c->logits + k * E, cc);
	for (int e = 0; e < E; e++) {
		double d = fabs((double)cg[e] - (double)cc[e]);

		if (d > diff)
			diff = d;
	}
	*margin_out = margin;
	*diff_out = diff;
	/* two values each moved by up to diff swap within 2 diff; a group score is a sum
	 * of two of them (GROUP_TOP2), so groups swap within 4 diff */
	return margin <= (p->select == K_MOE_GROUP_TOP2 ? 4 : 2) * diff ? 1 : -1;
}

/* Judges rows (n) of got against ref, cpu and cpux (the forced CPU runs, without and
 * with the GEMM inputs rounded; NULL for a dense model or the CPU backend; cpux may be
 * NULL alone) and gx (the fp32-input GPU run, measured only; NULL: none), vocab wide.
 * g, c: the traces of the GPU run and the forced CPU runs (NULL with cpu), bias_of the
 * model's router biases. Fills st; returns the rows that fail (each said on stderr
 * with its numbers). */
static int flip_judge(const char *what, const float *got, const float *ref, const float *cpu,
		      const float *cpux, const float *gx, const struct flip_row *rows, int n,
		      int vocab, double tol, const struct route_trace *g, const struct route_trace *c,
		      const struct k_moe_route_params *route,
		      const float *(*bias_of)(void *arg, int layer), void *arg, struct flip_stats *st)
{
	double *errs = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	int fails = 0;

	memset(st, 0, sizeof(*st));
	st->rows = n;
	st->same_route_worst = st->fp32x_worst = st->bf16x_worst = -1;
	for (int r = 0; cpu && r < n; r++) {
		size_t o = (size_t)r * vocab;
		double e = test_rel_l2(got + o, cpu + o, (size_t)vocab);

		st->same_route_worst = e > st->same_route_worst ? e : st->same_route_worst;
		e = gx ? test_rel_l2(gx + o, cpu + o, (size_t)vocab) : -1;
		st->fp32x_worst = e > st->fp32x_worst ? e : st->fp32x_worst;
		e = cpux ? test_rel_l2(got + o, cpux + o, (size_t)vocab) : -1;
		st->bf16x_worst = e > st->bf16x_worst ? e : st->bf16x_worst;
	}
	for (int r = 0; r < n; r++) {
		const float *gr = got + (size_t)r * vocab, *rr = ref + (size_t)r * vocab;
		const float *cr = cpu ? cpu + (size_t)r * vocab : NULL;
		const float *cxr = cpux && cpu ? cpux + (size_t)r * vocab : NULL;
		const float *xr = gx && cpu ? gx + (size_t)r * vocab : NULL;
		double e = test_rel_l2(gr, rr, (size_t)vocab), ef, ec, efx = INFINITY, ecx = 0, dx = 0;
		double worst_margin = 0, worst_diff = 0;
		int flips = 0, beyond = 0, x_near = 0;

		errs[r] = e;
		st->worst = e > st->worst ? e : st->worst;
		st->argmax_ok += test_argmax(gr, vocab) == test_argmax(rr, vocab);
		if (e <= tol)
			continue;
		st->bad++;
		if (!cpu) {
			fprintf(stderr, "  %s row %d (position %d): rel L2 %.3g over %g: a kernel error "
				"(no routing to explain it)\n", what, r, rows[r].pos, e, tol);
			fails++;
			continue;
		}
		ef = test_rel_l2(gr, cr, (size_t)vocab);
		ec = test_rel_l2(cr, rr, (size_t)vocab);
		if (cxr) {
			efx = test_rel_l2(gr, cxr, (size_t)vocab);
			ecx = test_rel_l2(cxr, rr, (size_t)vocab);
			dx = test_rel_l2(cxr, cr, (size_t)vocab);
		}
		/* the kernels right with nothing rounded, and the row within the room the
		 * measured sensitivity to bf16 rounding gives */
		x_near = xr && test_rel_l2(xr, cr, (size_t)vocab) <= tol && ef <= tol + 2 * dx;
		for (int l = 0; g && c && l < g->n_layers; l++)
			for (int q = 0; q <= rows[r].pos; q++) {
				long k = route_trace_index(g, rows[r].seq, l, q);
				struct k_moe_route_params p = *route;
				double m, d;
				int f;

				if (k < 0 || !g->have[k] || !c->have[k])
					continue;
				p.bias = bias_of(arg, l);
				f = flip_decision(g, c, k, &p, &m, &d);
				flips += f != 0;
				if (f < 0 && !beyond++) {
					worst_margin = m;
					worst_diff = d;
				}
			}
		if ((ef <= tol || efx <= tol || x_near) && flips && !beyond) {
			st->flips_ok++;
			continue;
		}
		if (ef <= tol && !flips && ec >= tol / 2) {
			st->cache_ok++;
			continue;
		}
		if (!flips && ((efx <= tol && ecx >= tol / 2) ||
			       (x_near && (test_rel_l2(xr, rr, (size_t)vocab) <= tol || ec >= tol / 2)))) {
			st->gemm_ok++;
			continue;
		}
		fails++;
		if (ef > tol && efx > tol && !x_near)
			fprintf(stderr, "  %s row %d (position %d): rel L2 %.3g over %g, and %.3g from the CPU "
				"run with the GPU's routing and cache precision (%.3g with its GEMM inputs' "
				"too, which move the CPU row %.3g; the GPU with nothing rounded %.3g): a "
				"kernel error\n", what, r, rows[r].pos, e, tol, ef, efx, dx,
				xr ? test_rel_l2(xr, cr, (size_t)vocab) : -1.0);
		else if (beyond)
			fprintf(stderr, "  %s row %d (position %d): rel L2 %.3g over %g after a flip that is "
				"no near-tie (CPU margin %.3g, choice difference %.3g): a router error\n",
				what, r, rows[r].pos, e, tol, worst_margin, worst_diff);
		else
			fprintf(stderr, "  %s row %d (position %d): rel L2 %.3g over %g with the CPU's own "
				"routing at every layer, where the GPU's precision moves the CPU row only "
				"%.3g (cache) and %.3g (cache and GEMM inputs): a kernel error\n", what, r,
				rows[r].pos, e, tol, ec, ecx);
	}
	qsort(errs, (size_t)n, sizeof(double), flip_cmp_double);
	st->median = n ? (n % 2 ? errs[n / 2] : (errs[n / 2 - 1] + errs[n / 2]) / 2) : 0;
	free(errs);
	if (g && c) {
		for (int s = 0; s < g->max_seqs; s++)
			for (int l = 0; l < g->n_layers; l++)
				for (int q = 0; q < g->max_pos; q++) {
					long k = route_trace_index(g, s, l, q);

					if (!g->have[k] || !c->have[k])
						continue;
					st->decisions++;
					st->flipped += flip_sets_differ(g->ids + k * g->top_k,
									c->own + k * c->top_k, g->top_k);
				}
	}
	return fails;
}

#endif
