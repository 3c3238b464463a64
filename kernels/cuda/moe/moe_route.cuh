// The router's device code (moe_route.cu's kernel, moe_lat.cu's fused MoE launch):
// glibc's expf, the order-preserving warp picks, the softmax and group masks and
// route_row, k_cpu_moe_route's arithmetic step for step. CUDA C++ only.
#ifndef KD_KERNELS_CUDA_MOE_ROUTE_CUH
#define KD_KERNELS_CUDA_MOE_ROUTE_CUH

#include <climits>
#include <cstdint>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/moe/k_cuda_moe.h"
#define ROUTE_MAX_EXPERTS 4096	// as kernels/cpu/moe.c
#define ROUTE_MAX_GROUPS 256
#define ROUTE_MAX_TOPK 64
#define FLAG_MASKED 1		// expert of a dropped group
#define FLAG_TAKEN 2		// already chosen

namespace {	// each including file's own copy

// ---- kernels ----------------------------------------------------------------

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, from Arm's optimized-routines):
// exp(x) = 2^(k/32) * 2^(r/32) in fp64 with a cubic, rounded once to fp32. Every fp64
// op is written out so that nvcc cannot contract it: this is the non-FMA build, which
// equals glibc's FMA build except where an fp64 result sits within 2^-52 of a float
// rounding boundary. Checked against glibc on 25M inputs in [-104, 89]: no difference.
// Lane i keeps entry i in a register (expf_tab_lane, loaded before the PDL wait) and
// glibc_expf fetches entry ki % 32 with a shuffle: no memory round trip per call.
__device__ const uint64_t expf_tab[32] = {
	0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
	0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
	0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
	0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
	0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
	0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
	0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
	0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

// This lane's entry of expf_tab, for glibc_expf; the table is constant, so kernels load
// it before their PDL wait.
__device__ __forceinline__ uint64_t expf_tab_lane(void)
{
	return k_cuda_pdl_early(&expf_tab[threadIdx.x % 32]);
}

// All 32 lanes must call it together (the table shuffle); tab: expf_tab_lane().
__device__ float glibc_expf(float x, uint64_t tab)
{
	const double inv_ln2_n = 0x1.71547652b82fep+0 * 32, shift = 0x1.8p+52;
	const double c0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32;
	const double c1 = 0x1.ebfce50fac4f3p-3 / 32 / 32;
	const double c2 = 0x1.62e42ff0c52d6p-1 / 32;
	double z, kd, r, r2, y, s, p;
	uint64_t ki, t;

	// The shuffle comes before the special cases so that every lane takes part; for
	// them ki is garbage and the result is replaced below.
	z = __dmul_rn(inv_ln2_n, (double)x);
	kd = __dadd_rn(z, shift);
	ki = (uint64_t)__double_as_longlong(kd);
	t = __shfl_sync(0xffffffffu, (unsigned long long)tab, (int)(ki % 32));
	if (isnan(x))
		return x + x;
	if (x > 0x1.62e42ep6f)		// exp(x) > FLT_MAX
		return __int_as_float(0x7f800000);
	if (x < -0x1.9fe368p6f)		// exp(x) < 2^-150
		return 0.0f;
	kd = __dsub_rn(kd, shift);
	r = __dsub_rn(z, kd);
	t += ki << 47;
	s = __longlong_as_double((long long)t);
	p = __dadd_rn(__dmul_rn(c0, r), c1);
	r2 = __dmul_rn(r, r);
	y = __dadd_rn(__dmul_rn(c2, r), 1.0);
	y = __dadd_rn(__dmul_rn(p, r2), y);
	return (float)__dmul_rn(y, s);
}

// A float as an unsigned with the same order, so that one redux.sync finds a warp's
// maximum. -0 is folded into +0 first: the CPU's ">" sees them as equal. (NaN has no
// place in the CPU's order either; it is not expected in logits.)
__device__ __forceinline__ unsigned ord_key(float v)
{
	unsigned u = __float_as_uint(__fadd_rn(v, 0.0f));

	return u & 0x80000000u ? ~u : u | 0x80000000u;
}

__device__ __forceinline__ float ord_float(unsigned k)
{
	return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

// The warp's best of each lane's (key, index): the largest key, of those the lowest
// index (k_cpu's route_argmax tie rule); -1 where no lane has one (index INT_MAX).
__device__ __forceinline__ int warp_pick(unsigned key, int idx)
{
	unsigned m = __reduce_max_sync(0xffffffffu, key);
	int i = __reduce_min_sync(0xffffffffu, key == m ? idx : INT_MAX);

	return i == INT_MAX ? -1 : i;
}

// This lane's best of v[lane], v[lane + 32], ... below n minus the entries with
// flag & skip: increasing order and ">" keep the lowest index of a tie.
__device__ __forceinline__ void lane_best(const float *v, const unsigned char *flag,
					  unsigned char skip, int n, unsigned *key, int *idx)
{
	*key = 0;
	*idx = INT_MAX;
	for (int i = threadIdx.x % 32; i < n; i += 32)	// the lane, in any warp of the CTA
		if (!(flag[i] & skip)) {
			unsigned k = ord_key(v[i]);

			if (*idx == INT_MAX || k > *key) {
				*key = k;
				*idx = i;
			}
		}
}

// k_cpu's route_argmax over v[0..n) minus the entries with flag & skip, for the warp.
__device__ int warp_argmax(const float *v, const unsigned char *flag, unsigned char skip, int n)
{
	unsigned key;
	int idx;

	lane_best(v, flag, skip, n, &key, &idx);
	return warp_pick(key, idx);
}

// score[e] = softmax(lg) as route_softmax: max, expf, a sequential fp32 sum, divide.
// lg may be score itself. The maximum may come out +0 where the CPU's is -0: lg - max
// differs only for lg = -0, and expf(+-0) = 1 either way.
__device__ void route_softmax(float *score, const float *lg, int E, uint64_t tab)
{
	unsigned mk = 0;
	float mx, sum = 0.0f;

	for (int e = threadIdx.x % 32; e < E; e += 32)
		mk = max(mk, ord_key(lg[e]));
	mx = ord_float(__reduce_max_sync(0xffffffffu, mk));
	for (int b = 0; b < E; b += 32) {	// warp-uniform: glibc_expf shuffles
		int e = b + threadIdx.x % 32;
		float v = glibc_expf(__fsub_rn(e < E ? lg[e] : mx, mx), tab);

		if (e < E)
			score[e] = v;
	}
	__syncwarp();
	// One lane, in index order, as the CPU; unrolled so that the loads run ahead of
	// the chain of adds.
	if (threadIdx.x % 32 == 0) {
#pragma unroll 8
		for (int e = 0; e < E; e++)
			sum = __fadd_rn(sum, score[e]);
	}
	sum = __shfl_sync(0xffffffffu, sum, 0);
	for (int e = threadIdx.x % 32; e < E; e += 32)
		score[e] = __fdiv_rn(score[e], sum);
}

// route_group_score: max, or the sum of the two largest.
__device__ float group_score(const float *c, int per, int top2)
{
	float a = -INFINITY, b = -INFINITY;

	for (int i = 0; i < per; i++) {
		if (c[i] > a) {
			b = a;
			a = c[i];
		} else if (c[i] > b) {
			b = c[i];
		}
	}
	return !top2 || per < 2 ? a : __fadd_rn(a, b);
}

// Whether p drops any group (a group-limited method keeping fewer groups than there
// are): Kimi-K2's one group, always kept, is never scored, as on the CPU.
__host__ __device__ __forceinline__ bool route_masks_groups(const k_moe_route_params &p)
{
	return p.select != K_MOE_GREEDY && p.n_group > 0 && p.topk_group < p.n_group;
}

// A row's weights from the chosen experts' scores w (top_k, shared memory, written):
// their sum in slot order, as the CPU; then each slot's division by its lane. The whole
// warp.
__device__ __forceinline__ void route_finish(const k_moe_route_params &p, const float *w,
					     float *weights)
{
	const int K = p.top_k, lane = threadIdx.x % 32;
	float sum = 0.0f;

	if (lane == 0)
		for (int j = 0; j < K; j++)
			sum = __fadd_rn(sum, w[j]);
	sum = __shfl_sync(0xffffffffu, sum, 0);
	for (int j = lane; j < K; j += 32) {
		float v = w[j];

		if (p.norm_topk_prob)
			v = __fdiv_rn(v, __fadd_rn(sum, 1e-20f));
		weights[j] = __fmul_rn(v, p.routed_scaling);
	}
}

// One warp's shared scratch for routing one row: n_experts floats in score and choice,
// n_experts bytes in flag, n_group in gs and keep, top_k in w.
struct route_scratch {
	float *score, *choice, *gs, *w;
	unsigned char *flag, *keep;
};

// route_mask_groups: experts outside the topk_group best groups get the fill value
// (0 for GROUP_MAX, -inf for GROUP_TOP2) and the MASKED flag.
__device__ void route_mask_groups(const k_moe_route_params &p, const route_scratch &r)
{
	int per = p.n_experts / p.n_group, top2 = p.select == K_MOE_GROUP_TOP2;
	int lane = threadIdx.x % 32;
	float fill = top2 ? -INFINITY : 0.0f;

	for (int g = lane; g < p.n_group; g += 32) {
		r.gs[g] = group_score(r.choice + g * per, per, top2);
		r.keep[g] = 0;
	}
	__syncwarp();
	for (int i = 0; i < p.topk_group && i < p.n_group; i++) {
		int g = warp_argmax(r.gs, r.keep, 1, p.n_group);

		if (lane == 0)
			r.keep[g] = 1;
		__syncwarp();
	}
	for (int e = lane; e < p.n_experts; e += 32)
		if (!r.keep[e / per]) {
			r.flag[e] |= FLAG_MASKED;
			r.choice[e] = fill;
		}
	__syncwarp();
}

// One row's routing by one warp (all 32 lanes): lg (n_experts) logits (may be r.score),
// bias (n_experts; NULL: none) a copy of p.bias in shared memory, tab expf_tab_lane();
// ids and weights (top_k) out.
__device__ __forceinline__ void route_row(const k_moe_route_params &p, const float *lg,
					  const float *bias, uint64_t tab, const route_scratch &r,
					  int32_t *ids, float *weights)
{
	int E = p.n_experts, K = p.top_k, lane = threadIdx.x % 32;
	unsigned key;
	int idx;

	if (p.scoring == K_MOE_SOFTMAX) {
		route_softmax(r.score, lg, E, tab);
	} else {
		for (int b = 0; b < E; b += 32) {	// warp-uniform: glibc_expf shuffles
			int e = b + lane;
			float v = glibc_expf(e < E ? -lg[e] : 0.0f, tab);

			if (e < E)
				r.score[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, v));
		}
	}
	for (int e = lane; e < E; e += 32) {
		r.choice[e] = bias ? __fadd_rn(r.score[e], bias[e]) : r.score[e];
		r.flag[e] = 0;
	}
	__syncwarp();
	// Where every group is kept nothing is masked, and the group scores (one lane's walk
	// over a group's experts) are skipped: Kimi-K2's 384 experts in one group took 13 us
	// of its 23.6 us routing (session 21, H100).
	if (route_masks_groups(p))
		route_mask_groups(p, r);

	// Top-k: each lane keeps the best of its own experts (e % 32 == lane); a round is
	// one warp pick, then only the winner's lane marks it and looks again at its own.
	lane_best(r.choice, r.flag, FLAG_TAKEN, E, &key, &idx);
	for (int j = 0; j < K; j++) {
		int e = warp_pick(key, idx);

		if (e >= 0 && e % 32 == lane) {
			r.flag[e] |= FLAG_TAKEN;
			ids[j] = e;
			// V2 takes its weights from the masked scores, V3 from the raw ones.
			r.w[j] = (r.flag[e] & FLAG_MASKED) && p.select == K_MOE_GROUP_MAX ?
				 0.0f : r.score[e];
			lane_best(r.choice, r.flag, FLAG_TAKEN, E, &key, &idx);
		}
	}
	__syncwarp();
	route_finish(p, r.w, weights);
	__syncwarp();
}

}	// namespace

#endif
