/* NCCL loaded at run time: dlopen of libnccl.so.2 and the table of the entry points
 * kdec calls (nccl_lib.h). Built only where configure found nccl.h (KD_HAVE_NCCL). */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/backend/cuda/nccl_lib.h"

#ifdef KD_HAVE_NCCL
/* name -> the field that receives it, in the order nccl_lib_open resolves them */
#define NCCL_SYM(lib, field, name) { (void **)&(lib)->field, name }

int nccl_lib_open(struct nccl_lib *lib, char *err, size_t err_len)
{
	ncclResult_t (*get_version)(int *) = NULL;
	const struct { void **slot; const char *name; } syms[] = {
		NCCL_SYM(lib, comm_init_all, "ncclCommInitAll"),
		NCCL_SYM(lib, comm_destroy, "ncclCommDestroy"),
		NCCL_SYM(lib, all_reduce, "ncclAllReduce"),
		NCCL_SYM(lib, group_start, "ncclGroupStart"),
		NCCL_SYM(lib, group_end, "ncclGroupEnd"),
		NCCL_SYM(lib, error_string, "ncclGetErrorString"),
		{ (void **)&get_version, "ncclGetVersion" },
	};
	const char *why;

	memset(lib, 0, sizeof(*lib));
	setenv("NCCL_NVLS_ENABLE", "0", 0);
	lib->dl = dlopen(NCCL_LIB_NAME, RTLD_NOW | RTLD_LOCAL);
	if (!lib->dl) {
		why = dlerror();
		snprintf(err, err_len, "NCCL: %s does not load here (%s)", NCCL_LIB_NAME,
			 why ? why : "no reason given");
		return -ENOENT;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		*syms[i].slot = dlsym(lib->dl, syms[i].name);
		if (!*syms[i].slot) {
			snprintf(err, err_len, "NCCL: %s has no %s (too old a library?)", NCCL_LIB_NAME,
				 syms[i].name);
			nccl_lib_close(lib);
			return -ENOSYS;
		}
	}
	if (get_version(&lib->version) != ncclSuccess)
		lib->version = 0;
	return 0;
}

void nccl_lib_close(struct nccl_lib *lib)
{
	if (lib->dl)
		dlclose(lib->dl);
	memset(lib, 0, sizeof(*lib));
}

void nccl_lib_version(const struct nccl_lib *lib, char *buf, size_t len)
{
	int v = lib->version;

	/* the code is major * 10000 + minor * 100 + patch since 2.9 (major * 1000 before) */
	if (v >= 10000)
		snprintf(buf, len, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
	else
		snprintf(buf, len, "%d.%d.%d", v / 1000, v / 100 % 10, v % 100);
}
#endif
