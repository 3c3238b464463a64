/* The bytes a decode step must read: the weights it touches and the KV cache its rows
 * attend over. Divided by the HBM bandwidth they are the floor under the step's time,
 * which kdbench decode prints beside each figure and kdecd exports for the decode
 * steps it runs under real traffic (kd_decode_step_bytes_total). */
#include "daemon/engine/engine.h"
#include "daemon/engine/forward.h"

/* Every matrix except the embedding table (rows of it), in bf16 bytes, and of the
 * routed experts only those chosen. Which experts a batch chooses is known only on the
 * GPU: the count assumes uniform routing, E * (1 - (1 - k/E)^rows) distinct experts per
 * MoE layer. */
double engine_weight_bytes(const struct model *m, int rows)
{
	const struct model_config *c = &m->cfg;
	int64_t params = 0;
	double embed = (double)c->vocab_size * c->hidden_size, bytes;
	int moe_layers = 0;

	model_count_params(c, &params);
	bytes = (double)params;
	if (m->lm_head.data != m->embed.data)
		bytes -= embed;		/* the table itself is not streamed */
	bytes += (double)rows * c->hidden_size;
	for (int l = 0; l < c->n_layers; l++)
		moe_layers += m->layers[l].is_moe;
	if (moe_layers) {
		double E = c->n_experts, k = c->top_k, per = 3.0 * c->hidden_size * c->moe_intermediate_size;
		double p_unused = 1, used;

		for (int i = 0; i < rows; i++)
			p_unused *= 1 - k / E;
		used = E * (1 - p_unused);
		bytes -= moe_layers * E * per;
		bytes += moe_layers * used * per;
	}
	return bytes * 2;
}

double engine_kv_bytes(const struct engine *e, double tokens)
{
	return (double)forward_kv_bytes_per_token(e->model) / sizeof(float) *
	       (double)k_dtype_size(e->be->ops->kv_dtype) * tokens;
}
