/* libFuzzer target: model_config_parse on arbitrary text must not crash, and what it
 * accepts must satisfy the invariants the rest of kdec relies on. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "daemon/model/model_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int config_sane(const struct model_config *c)
{
	if (c->n_layers < 1 || c->n_layers > MODEL_MAX_LAYERS || c->hidden_size < 1)
		return 0;
	if (c->n_heads < 1 || c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads)
		return 0;
	if (c->rope.dim <= 0 || c->rope.dim % 2 || c->head_dim <= 0)
		return 0;
	if (c->n_experts && (c->top_k < 1 || c->top_k > c->n_experts ||
			     c->route.n_group < 1 || c->n_experts % c->route.n_group))
		return 0;
	return c->n_eos >= 0 && c->n_eos <= MODEL_MAX_EOS;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct model_config c;
	char err[256];
	volatile int sink = 0;

	if (model_config_parse(&c, (const char *)data, size, err, sizeof(err)) == 0) {
		if (!config_sane(&c))
			__builtin_trap();
		for (int l = -1; l <= c.n_layers; l++)
			sink += model_config_layer_is_moe(&c, l);
	}
	if (!memchr(err, '\0', sizeof(err)) || strchr(err, '\n'))
		__builtin_trap();
	(void)sink;
	return 0;
}
