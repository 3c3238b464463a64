/* RoPE half of config.json: rope_parameters / rope_scaling (both spellings, checked
 * against each other) into struct k_rope_params, and the attention scale YaRN sets. */
#include "daemon/model/model_config_internal.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include <jansson.h>

/* Where rope values come from: rope_parameters (newer files) and/or rope_scaling (hub). */
struct rope_src {
	json_t *rp;
	json_t *rs;
	json_t *merged;		/* rs overlaid by rp; owned */
};

static void rope_prefix(struct cfg_parse *p, const struct rope_src *r, const char *key)
{
	p->prefix = (r->rp && json_object_get(r->rp, key)) || !r->rs ? "rope_parameters."
								   : "rope_scaling.";
}

/* The type named in one rope dict through "rope_type" or "type". */
static int rope_type_of(struct cfg_parse *p, const json_t *d, const char *dname,
			const char **out)
{
	int rc;

	*out = NULL;
	if (!d)
		return 0;
	p->prefix = dname;
	rc = cfg_str(p, d, "rope_type", "type", out);
	p->prefix = "";
	return rc;
}

/* Both spellings given: every key they share must agree. */
static int rope_check_both(struct cfg_parse *p, const struct rope_src *r,
			   const char *tp, const char *ts)
{
	const char *key;
	char sa[64], sb[64];
	json_t *vs, *vp;

	if (tp && ts && strcmp(tp, ts))
		return cfg_fail(p, -EINVAL, "rope_parameters and rope_scaling are contradictory "
				"(type '%.40s' vs '%.40s')", tp, ts);
	json_object_foreach(r->rs, key, vs) {
		if (!strcmp(key, "type") || !strcmp(key, "rope_type"))
			continue;
		vp = cfg_obj_get(r->rp, key);
		if (vp && !json_is_null(vs) && !cfg_values_equal(vp, vs))
			return cfg_fail(p, -EINVAL, "rope_parameters.%.60s and rope_scaling.%.60s "
					"are contradictory (%s vs %s)", key, key,
					cfg_show(vp, sa, sizeof(sa)), cfg_show(vs, sb, sizeof(sb)));
	}
	return 0;
}

static int rope_num(struct cfg_parse *p, const struct rope_src *r, const char *key,
		    double lo, double hi, double *out, int required)
{
	int rc;

	rope_prefix(p, r, key);
	rc = required ? cfg_req_num(p, r->merged, key, lo, hi, out, NULL)
		      : cfg_num(p, r->merged, key, NULL, lo, hi, out);
	p->prefix = "";
	return rc;
}

static int rope_llama3(struct cfg_parse *p, const struct rope_src *r, struct k_rope_params *k)
{
	int rc;

	rc = rope_num(p, r, "factor", 1e-6, 1e6, &k->factor, 1);
	if (!rc)
		rc = rope_num(p, r, "low_freq_factor", 1e-6, 1e6, &k->low_freq_factor, 1);
	if (!rc)
		rc = rope_num(p, r, "high_freq_factor", 1e-6, 1e6, &k->high_freq_factor, 1);
	if (!rc)
		rc = rope_num(p, r, "original_max_position_embeddings", 1, CFG_MAX_POS,
			      &k->original_max_pos, 1);
	if (rc)
		return rc;
	if (k->high_freq_factor <= k->low_freq_factor) {
		rope_prefix(p, r, "high_freq_factor");
		rc = cfg_fail(p, -EINVAL, "%shigh_freq_factor: %g must be above "
			      "low_freq_factor %g", p->prefix, k->high_freq_factor,
			      k->low_freq_factor);
		p->prefix = "";
	}
	return rc;
}

static int rope_yarn(struct cfg_parse *p, const struct rope_src *r, struct k_rope_params *k,
		     int max_pos)
{
	int has_factor;
	int rc;

	k->original_max_pos = max_pos;
	k->beta_fast = 0;
	k->beta_slow = 0;
	k->attention_factor = -1;
	k->truncate = 1;
	rc = rope_num(p, r, "factor", 1e-6, 1e6, &k->factor, 0);
	has_factor = rc == 0;
	if (rc >= 0)
		rc = rope_num(p, r, "original_max_position_embeddings", 1, CFG_MAX_POS,
			      &k->original_max_pos, 0);
	/* transformers derives a missing factor from the context it was stretched to. */
	if (rc >= 0 && !has_factor) {
		k->factor = max_pos / k->original_max_pos;
		if (k->factor < 1e-6 || k->factor > 1e6) {
			rope_prefix(p, r, "factor");
			rc = cfg_fail(p, -EINVAL, "%sfactor: missing, and max_position_embeddings"
				      " / original_max_position_embeddings = %g is out of range "
				      "[1e-06, 1e+06]", p->prefix, k->factor);
			p->prefix = "";
			return rc;
		}
	}
	if (rc >= 0)
		rc = rope_num(p, r, "beta_fast", 0, 1e6, &k->beta_fast, 0);
	if (rc >= 0)
		rc = rope_num(p, r, "beta_slow", 0, 1e6, &k->beta_slow, 0);
	if (rc >= 0)
		rc = rope_num(p, r, "mscale", 0, 1e3, &k->mscale, 0);
	if (rc >= 0)
		rc = rope_num(p, r, "mscale_all_dim", 0, 1e3, &k->mscale_all_dim, 0);
	if (rc >= 0)
		rc = rope_num(p, r, "attention_factor", 1e-6, 1e6, &k->attention_factor, 0);
	if (rc < 0)
		return rc;
	/* transformers: `beta_fast or 32`, so 0 also means the default. */
	if (k->beta_fast == 0)
		k->beta_fast = 32;
	if (k->beta_slow == 0)
		k->beta_slow = 1;
	rope_prefix(p, r, "truncate");
	rc = cfg_bool(p, r->merged, "truncate", &k->truncate);
	p->prefix = "";
	return rc;
}

/* rope_theta: top level, or inside rope_parameters; 10000 if neither says. */
static int rope_theta(struct cfg_parse *p, const json_t *root, const struct rope_src *r,
		      double *theta)
{
	double top = 0, in = 0;
	int rc_top, rc_in;

	rc_top = cfg_num(p, root, "rope_theta", NULL, 1e-6, 1e12, &top);
	if (rc_top < 0)
		return rc_top;
	rc_in = rope_num(p, r, "rope_theta", 1e-6, 1e12, &in, 0);
	if (rc_in < 0)
		return rc_in;
	if (rc_top == 0 && rc_in == 0 && top != in)
		return cfg_fail(p, -EINVAL, "rope_theta and %s.rope_theta are contradictory "
				"(%g vs %g)", r->rp ? "rope_parameters" : "rope_scaling", top, in);
	*theta = rc_in == 0 ? in : (rc_top == 0 ? top : 10000.0);
	return 0;
}

static int rope_partial(struct cfg_parse *p, const json_t *root, const struct rope_src *r)
{
	double f = 1.0;
	int rc;

	rc = cfg_num(p, root, "partial_rotary_factor", NULL, 0, 1e6, &f);
	if (rc == 1)
		rc = rope_num(p, r, "partial_rotary_factor", 0, 1e6, &f, 0);
	if (rc < 0)
		return rc;
	if (f != 1.0)
		return cfg_fail(p, -ENOTSUP, "partial_rotary_factor: %g is not supported (1 only)",
				f);
	return 0;
}

static int rope_body(struct cfg_parse *p, const json_t *root, struct rope_src *r,
		     struct model_config *cfg)
{
	struct k_rope_params *k = &cfg->rope;
	const char *tp, *ts, *t;
	int rc;

	rc = rope_type_of(p, r->rp, "rope_parameters.", &tp);
	if (!rc)
		rc = rope_type_of(p, r->rs, "rope_scaling.", &ts);
	if (!rc && r->rp && r->rs)
		rc = rope_check_both(p, r, tp, ts);
	if (!rc)
		rc = rope_theta(p, root, r, &k->theta);
	if (!rc)
		rc = rope_partial(p, root, r);
	if (rc)
		return rc;
	t = tp ? tp : ts;
	if (!t || !strcmp(t, "default")) {
		k->type = K_ROPE_DEFAULT;
	} else if (!strcmp(t, "linear")) {
		k->type = K_ROPE_LINEAR;
		rc = rope_num(p, r, "factor", 1e-6, 1e6, &k->factor, 1);
	} else if (!strcmp(t, "llama3")) {
		k->type = K_ROPE_LLAMA3;
		rc = rope_llama3(p, r, k);
	} else if (!strcmp(t, "yarn")) {
		k->type = K_ROPE_YARN;
		rc = rope_yarn(p, r, k, cfg->max_position_embeddings);
	} else {
		rc = cfg_fail(p, -ENOTSUP, "%s.rope_type: '%.40s' is not supported (default, "
			      "linear, llama3, yarn)", tp ? "rope_parameters" : "rope_scaling", t);
	}
	if (rc)
		return rc;
	/* transformers keeps inv_freq as a buffer, so a model cast to the checkpoint dtype
	 * and back (as the reference logits were computed) rotates by frequencies rounded
	 * to that dtype; matching the references to 1e-6 needs the same rounding. */
	k->freq_dtype = cfg->dtype;
	if (k->dim <= 0 || k->dim % 2)
		return cfg_fail(p, -EINVAL, "%s: rotary dim %d must be even",
				cfg->mla ? "qk_rope_head_dim" : "head_dim", k->dim);
	return 0;
}

void model_config_set_attn_scale(struct model_config *cfg)
{
	const struct k_rope_params *k = &cfg->rope;
	double s = 1.0 / sqrt((double)cfg->head_dim);
	double m;

	if (cfg->mla && k->type != K_ROPE_DEFAULT && k->mscale_all_dim != 0) {
		m = k->factor > 1 ? 0.1 * k->mscale_all_dim * log(k->factor) + 1.0 : 1.0;
		s *= m * m;
	}
	cfg->attn_scale = (float)s;
}

int cfg_parse_rope(struct cfg_parse *p, const json_t *root, struct model_config *cfg)
{
	struct rope_src r = { cfg_obj_get(root, "rope_parameters"),
			      cfg_obj_get(root, "rope_scaling"), NULL };
	int rc;

	if (r.rp && !json_is_object(r.rp))
		return cfg_fail(p, -EINVAL, "rope_parameters: expected an object or null");
	if (r.rs && !json_is_object(r.rs))
		return cfg_fail(p, -EINVAL, "rope_scaling: expected an object or null");
	r.merged = json_object();
	if (!r.merged)
		return -ENOMEM;
	if ((r.rs && json_object_update(r.merged, r.rs)) ||
	    (r.rp && json_object_update(r.merged, r.rp))) {
		rc = -ENOMEM;
		goto out;
	}
	rc = rope_body(p, root, &r, cfg);
	if (!rc)
		model_config_set_attn_scale(cfg);
out:
	p->prefix = "";
	json_decref(r.merged);
	return rc;
}
