/* What model_config.c and model_config_rope.c share beyond the JSON getters
 * (config_json.h): the rope half of the parse. Only those two files include this. */
#ifndef KD_DAEMON_MODEL_CONFIG_INTERNAL_H
#define KD_DAEMON_MODEL_CONFIG_INTERNAL_H

#include <jansson.h>

#include "daemon/model/config_json.h"
#include "daemon/model/model_config.h"

#define CFG_MAX_POS (1 << 30)

/* cfg->rope and cfg->attn_scale from rope_parameters / rope_scaling. Needs the
 * attention shape, dtype and max_position_embeddings already parsed. */
int cfg_parse_rope(struct cfg_parse *p, const json_t *root, struct model_config *cfg);

#endif
