/* The registry of backends compiled into this build. */
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "daemon/backend/backend.h"

static const struct backend_ops *const backends[] = {
	&backend_cpu_ops,
#ifdef KD_HAVE_CUDA
	&backend_cuda_ops,
#endif
};

const struct backend_ops *backend_find(const char *name, char *err, size_t err_len)
{
	size_t n = sizeof(backends) / sizeof(backends[0]), used = 0;

	for (size_t i = 0; i < n; i++)
		if (!strcmp(backends[i]->name, name))
			return backends[i];
	used = (size_t)snprintf(err, err_len, "unknown backend '%s' (this build has:", name);
	for (size_t i = 0; i < n && used < err_len; i++)
		used += (size_t)snprintf(err + used, err_len - used, " %s", backends[i]->name);
	if (used < err_len)
		snprintf(err + used, err_len - used, ")");
	return NULL;
}
