/* The bytes a decode step must read: the weights it touches and the KV cache its rows
 * attend over. Divided by the HBM bandwidth they are the floor under the step's time,
 * which kdbench decode prints beside each figure and kdecd exports for the decode
 * steps it runs under real traffic (kd_decode_step_bytes_total). */
#include "daemon/engine/engine.h"
#include "daemon/engine/forward.h"
#include "daemon/model/model_quant.h"

/* Every matrix except the embedding table (rows of it), in bf16 bytes or as stored
 * when quantized (scales included), and of the routed experts only the share chosen.
 * Which experts a batch chooses is known only on the GPU: engine_weight_bytes assumes
 * uniform routing; kdbench decode traces a step and passes the share it used. */
double engine_uniform_expert_share(const struct model_config *c, int rows)
{
	double E = c->n_experts, k = c->top_k, p_unused = 1;

	if (c->n_experts <= 0)
		return 0;
	for (int i = 0; i < rows; i++)
		p_unused *= 1 - k / E;
	return 1 - p_unused;
}

double engine_weight_bytes_at(const struct model *m, int rows, double expert_share)
{
	const struct model_config *c = &m->cfg;
	double bytes, embed = 2.0 * c->vocab_size * c->hidden_size;

	if (!m->stream_counted)	/* a model not made by model_load */
		model_count_stream_bytes((struct model *)m);
	bytes = m->stream_dense_bytes;
	if (m->lm_head.data != m->embed.data)
		bytes -= embed;	/* the table itself is not streamed */
	bytes += 2.0 * rows * c->hidden_size;
	/* stream_expert_bytes holds every expert of every MoE layer: the used share */
	return bytes + m->stream_expert_bytes * expert_share;
}

double engine_last_layer_bytes_at(const struct model *m, int rows, double expert_share)
{
	const struct model_config *c = &m->cfg;
	double bytes;

	if (!m->stream_counted)
		model_count_stream_bytes((struct model *)m);
	bytes = m->stream_last_dense_bytes + 2.0 * rows * c->hidden_size;
	return bytes + m->stream_last_expert_bytes * expert_share;
}

double engine_weight_bytes(const struct model *m, int rows)
{
	return engine_weight_bytes_at(m, rows, engine_uniform_expert_share(&m->cfg, rows));
}

double engine_last_layer_bytes(const struct model *m, int rows)
{
	return engine_last_layer_bytes_at(m, rows, engine_uniform_expert_share(&m->cfg, rows));
}

double engine_kv_bytes(const struct engine *e, double tokens)
{
	return (double)forward_kv_bytes_per_token(e->model) / sizeof(float) *
	       (double)k_dtype_size(e->be->ops->kv_dtype) * tokens;
}
