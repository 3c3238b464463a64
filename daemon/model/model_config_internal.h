/* What model_config.c and model_config_rope.c share: the parse state and the checked
 * JSON readers. Only those two files include this. */
#ifndef KD_DAEMON_MODEL_CONFIG_INTERNAL_H
#define KD_DAEMON_MODEL_CONFIG_INTERNAL_H

#include <stddef.h>

#include <jansson.h>

#include "daemon/model/model_config.h"

#define CFG_MAX_POS (1 << 30)

struct cfg_parse {
	char *err;
	size_t err_len;
	const char *prefix;	/* "" at top level, "rope_scaling." inside rope */
};

/* Writes "config.json: <message>" (one line) to p->err; returns rc. */
int cfg_fail(struct cfg_parse *p, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
const char *cfg_show(const json_t *v, char *buf, size_t n);
json_t *cfg_obj_get(const json_t *obj, const char *key);
int cfg_values_equal(const json_t *a, const json_t *b);

/* Checked readers; absent and null both mean "keep the default". cfg_num returns
 * 0 (set), 1 (absent) or -errno; cfg_bool and cfg_str return 0 or -errno, and
 * cfg_str sets *out to NULL when absent. */
int cfg_num(struct cfg_parse *p, const json_t *obj, const char *key,
	    const char *alias, double lo, double hi, double *out);
int cfg_bool(struct cfg_parse *p, const json_t *obj, const char *key, int *out);
int cfg_str(struct cfg_parse *p, const json_t *obj, const char *key,
	    const char *alias, const char **out);

/* cfg->rope and cfg->attn_scale from rope_parameters / rope_scaling. Needs the
 * attention shape, dtype and max_position_embeddings already parsed. */
int cfg_parse_rope(struct cfg_parse *p, const json_t *root, struct model_config *cfg);

#endif
