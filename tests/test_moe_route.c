/* MoE router: hand-built cases for softmax/sigmoid scoring, bias, the two
 * group-limited selections, renormalisation, scaling and tie breaking. */
#include <math.h>

#include "kernels/cpu/k_cpu.h"
#include "tests/testutil.h"

/* Weights are a few fp32 ops on expf values: 1e-6 absolute is ~10 ulps here. */
#define W_TOL 1e-6

static double sigm(double x)
{
	return 1.0 / (1.0 + exp(-x));
}

static void check_route(const struct k_moe_route_params *p, const float *logits,
			const int32_t *want_ids, const double *want_w, const char *what)
{
	int32_t ids[16];
	float w[16];

	k_cpu_moe_route(p, logits, 1, ids, w);
	for (int j = 0; j < p->top_k; j++) {
		CHECK(ids[j] == want_ids[j], "%s: ids[%d] = %d, want %d", what, j, ids[j],
		      want_ids[j]);
		CHECK_NEAR(w[j], want_w[j], W_TOL, what);
	}
}

static void test_softmax_greedy(void)
{
	const float logits[4] = { 1, 3, 2, 0 };
	struct k_moe_route_params p = { .n_experts = 4, .top_k = 2, .scoring = K_MOE_SOFTMAX,
		.select = K_MOE_GREEDY, .routed_scaling = 1 };
	double s = exp(-2) + 1 + exp(-1) + exp(-3);
	const int32_t ids[2] = { 1, 2 };
	double raw[2] = { 1 / s, exp(-1) / s };
	double norm[2] = { 1 / (1 + exp(-1)), exp(-1) / (1 + exp(-1)) };

	check_route(&p, logits, ids, raw, "softmax top2");
	p.norm_topk_prob = 1;
	check_route(&p, logits, ids, norm, "softmax top2 renormalised");
	p.routed_scaling = 2;
	norm[0] *= 2;
	norm[1] *= 2;
	check_route(&p, logits, ids, norm, "softmax top2 renormalised x2");
}

static void test_ties(void)
{
	const float logits[5] = { 2, 5, 5, 1, 5 };
	struct k_moe_route_params p = { .n_experts = 5, .top_k = 3, .scoring = K_MOE_SOFTMAX,
		.select = K_MOE_GREEDY, .norm_topk_prob = 1, .routed_scaling = 1 };
	const int32_t ids[3] = { 1, 2, 4 };
	const double w[3] = { 1.0 / 3, 1.0 / 3, 1.0 / 3 };
	/* Sigmoid of 0 is exactly 0.5, so these biased choices tie exactly:
	 * 0.5, 0.75, 0.75, 0.5. */
	const float lg[4] = { 0, 0, 0, 0 };
	const float bias[4] = { 0, 0.25f, 0.25f, 0 };
	struct k_moe_route_params q = { .n_experts = 4, .top_k = 3, .scoring = K_MOE_SIGMOID,
		.select = K_MOE_GREEDY, .routed_scaling = 1, .bias = bias };
	const int32_t qids[3] = { 1, 2, 0 };
	const double qw[3] = { 0.5, 0.5, 0.5 };

	check_route(&p, logits, ids, w, "ties");
	check_route(&q, lg, qids, qw, "biased ties");
}

/* The bias decides the choice; the weights stay the unbiased scores. */
static void test_bias_greedy(void)
{
	const float lg[4] = { 0, 0.5f, -1, -1 };
	const float bias[4] = { 0.5f, 0, 0, 0 };
	struct k_moe_route_params p = { .n_experts = 4, .top_k = 2, .scoring = K_MOE_SIGMOID,
		.select = K_MOE_GREEDY, .routed_scaling = 1, .bias = bias };
	const int32_t ids[2] = { 0, 1 };
	const double w[2] = { 0.5, sigm(0.5) };

	check_route(&p, lg, ids, w, "bias greedy");
}

/* DeepSeek-V3 style: sigmoid, bias, 4 groups of 4, keep 2 groups, top 4.
 * Unbiased, group 0 would win; the bias moves the choice to groups 3 and 1. */
static const float ds_logits[16] = {
	3.0f, 2.5f, -1, -1,		/* group 0 */
	2.0f, 1.0f, -2, -2,		/* group 1 */
	1.5f, 1.2f, 0.0f, -3,		/* group 2 */
	0.5f, 0.4f, 0.3f, -1,		/* group 3 */
};
static const float ds_bias[16] = {
	-1, -1, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0.5f, 0,
};

static void test_sigmoid_group_top2(void)
{
	struct k_moe_route_params p = { .n_experts = 16, .top_k = 4,
		.scoring = K_MOE_SIGMOID, .select = K_MOE_GROUP_TOP2, .n_group = 4,
		.topk_group = 2, .norm_topk_prob = 1, .routed_scaling = 2.5f,
		.bias = ds_bias };
	/* Group scores (top-2 biased sums): g0 0.54, g1 1.61, g2 1.59, g3 1.70. */
	const int32_t ids[4] = { 14, 4, 5, 12 };
	double raw[4] = { sigm(0.3), sigm(2.0), sigm(1.0), sigm(0.5) };
	double sum = raw[0] + raw[1] + raw[2] + raw[3], w[4];
	const int32_t ids_nobias[4] = { 0, 1, 4, 5 };	/* groups 0 and 1 */
	double w_nobias[4] = { sigm(3), sigm(2.5), sigm(2), sigm(1) };

	for (int j = 0; j < 4; j++)
		w[j] = raw[j] / sum * 2.5;
	check_route(&p, ds_logits, ids, w, "noaux_tc");

	p.norm_topk_prob = 0;
	for (int j = 0; j < 4; j++)
		w[j] = raw[j] * 2.5;
	check_route(&p, ds_logits, ids, w, "noaux_tc unnormalised");

	p.bias = NULL;
	p.routed_scaling = 1;
	check_route(&p, ds_logits, ids_nobias, w_nobias, "noaux_tc without bias");
}

/* Dropped groups are -inf for noaux_tc: negative biased choices in kept groups
 * still beat every expert of a dropped group. */
static void test_group_top2_negative(void)
{
	float bias[16];
	struct k_moe_route_params p = { .n_experts = 16, .top_k = 4,
		.scoring = K_MOE_SIGMOID, .select = K_MOE_GROUP_TOP2, .n_group = 4,
		.topk_group = 2, .routed_scaling = 1, .bias = bias };
	const int32_t ids[4] = { 0, 1, 4, 5 };
	double w[4] = { sigm(3), sigm(2.5), sigm(2), sigm(1) };

	for (int e = 0; e < 16; e++)
		bias[e] = -2;
	check_route(&p, ds_logits, ids, w, "noaux_tc negative choices");
}

/* DeepSeek-V2 group_limited_greedy: softmax, group score = max, dropped experts
 * become 0 in both the choice and the weights. */
static void test_group_max(void)
{
	const float logits[8] = { 0, 4, 3.5f, 3.4f, 1, 1, 3.6f, -1 };
	struct k_moe_route_params p = { .n_experts = 8, .top_k = 3,
		.scoring = K_MOE_SOFTMAX, .select = K_MOE_GROUP_MAX, .n_group = 4,
		.topk_group = 2, .routed_scaling = 1 };
	double s = 0;
	double pr[8];

	for (int e = 0; e < 8; e++)
		s += exp(logits[e] - 4.0);
	for (int e = 0; e < 8; e++)
		pr[e] = exp(logits[e] - 4.0) / s;

	{
		/* Group maxima 4, 3.5, 1, 3.6: keep groups 0 and 3; experts 2 and 3
		 * outscore expert 0 but sit in a dropped group. */
		const int32_t ids[3] = { 1, 6, 0 };
		double w[3] = { pr[1], pr[6], pr[0] };

		check_route(&p, logits, ids, w, "group_limited_greedy");
	}
	{
		/* One group kept, three picks: the third is a dropped expert (0 choice,
		 * lowest id) with weight 0, as HF's masked scores give. */
		const int32_t ids[3] = { 1, 0, 2 };
		double w[3] = { pr[1] * 16, pr[0] * 16, 0 };

		p.topk_group = 1;
		p.routed_scaling = 16;
		check_route(&p, logits, ids, w, "group_limited_greedy overflow");
	}
}

/* Several rows at once route independently. */
static void test_rows(void)
{
	float logits[3 * 4] = { 1, 3, 2, 0,  0, 0, 9, 1,  -1, -2, -3, -4 };
	struct k_moe_route_params p = { .n_experts = 4, .top_k = 1, .scoring = K_MOE_SOFTMAX,
		.select = K_MOE_GREEDY, .norm_topk_prob = 1, .routed_scaling = 1 };
	int32_t ids[3];
	float w[3];

	k_cpu_moe_route(&p, logits, 3, ids, w);
	CHECK(ids[0] == 1 && ids[1] == 2 && ids[2] == 0, "rows: %d %d %d", ids[0], ids[1], ids[2]);
	for (int m = 0; m < 3; m++)
		CHECK_NEAR(w[m], 1.0, W_TOL, "top-1 renormalised");
}

int main(void)
{
	test_softmax_greedy();
	test_ties();
	test_bias_greedy();
	test_sigmoid_group_top2();
	test_group_top2_negative();
	test_group_max();
	test_rows();
	return test_result("test_moe_route");
}
