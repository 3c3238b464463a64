/* The registry of backends compiled into this build, and the choice of "auto". */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "daemon/backend/backend.h"

/* In the order auto tries them: a GPU first, the CPU always last (it is available). */
static const struct backend_ops *const backends[] = {
#ifdef KD_HAVE_CUDA
	&backend_cuda_ops,
#endif
	&backend_cpu_ops,
};

#define N_BACKENDS (sizeof(backends) / sizeof(backends[0]))

void backend_names(char *buf, size_t len)
{
	size_t used = 0;

	if (!len)
		return;
	buf[0] = '\0';
	for (size_t i = 0; i < N_BACKENDS && used < len; i++)
		used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? ", " : "",
					 backends[i]->name);
}

const struct backend_ops *backend_find(const char *name, char *err, size_t err_len)
{
	char names[64];

	for (size_t i = 0; i < N_BACKENDS; i++)
		if (!strcmp(backends[i]->name, name))
			return backends[i];
	backend_names(names, sizeof(names));
	snprintf(err, err_len, "unknown backend '%s' (this build has: %s, or %s)", name, names,
		 BACKEND_AUTO);
	return NULL;
}

const struct backend_ops *backend_pick(const char *name, char *why, size_t why_len,
				       char *err, size_t err_len)
{
	char reason[256] = "", skipped[320] = "";
	size_t used = 0;

	if (why && why_len)
		why[0] = '\0';
	if (strcmp(name, BACKEND_AUTO))
		return backend_find(name, err, err_len);
	for (size_t i = 0; i < N_BACKENDS; i++) {
		const struct backend_ops *b = backends[i];

		reason[0] = '\0';
		if (N_BACKENDS == 1)
			snprintf(reason, sizeof(reason), "this build has no GPU backend");
		if (!b->available || b->available(reason, sizeof(reason))) {
			if (why && why_len)
				snprintf(why, why_len, "backend auto: %s%s%s%s%s", b->name,
					 reason[0] ? " (" : "", reason, reason[0] ? ")" : "",
					 skipped);
			return b;
		}
		if (used < sizeof(skipped))
			used += (size_t)snprintf(skipped + used, sizeof(skipped) - used,
						 "; not %s: %s", b->name, reason);
	}
	snprintf(err, err_len, "backend auto: none of this build's backends can run here%s",
		 skipped);
	return NULL;
}

static const char *const allreduce_names[] = { "auto", "fused", "nccl" };

int backend_allreduce_parse(const char *s, enum backend_allreduce *out)
{
	for (int i = 0; i < 3; i++)
		if (s && !strcmp(s, allreduce_names[i])) {
			*out = (enum backend_allreduce)i;
			return 0;
		}
	return -EINVAL;
}

const char *backend_allreduce_name(enum backend_allreduce a)
{
	return (unsigned)a < 3 ? allreduce_names[a] : "?";
}
