/* NCCL loaded at run time (dlopen of libnccl.so.2): the one table of its entry points
 * that the engine (backend_cuda_nccl.c) and kdbench allreduce share, so that neither
 * links libnccl and both run where it is absent (a missing library is an error line
 * for whoever asked for NCCL, nothing more). */
#ifndef KD_DAEMON_BACKEND_CUDA_NCCL_LIB_H
#define KD_DAEMON_BACKEND_CUDA_NCCL_LIB_H

#include <stddef.h>

#include "config.h"

#ifdef KD_HAVE_NCCL
#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"	/* nccl.h declares f() */
#include <nccl.h>
#pragma GCC diagnostic pop

#define NCCL_LIB_NAME "libnccl.so.2"

/* The entry points used, resolved from one dlopen handle. */
struct nccl_lib {
	void *dl;			/* dlopen handle; NULL: not open */
	int version;			/* ncclGetVersion: 22803 for 2.28.3 */
	ncclResult_t (*comm_init_all)(ncclComm_t *comms, int n, const int *devs);
	ncclResult_t (*comm_destroy)(ncclComm_t comm);
	ncclResult_t (*all_reduce)(const void *send, void *recv, size_t count, ncclDataType_t type,
				   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
	ncclResult_t (*group_start)(void);
	ncclResult_t (*group_end)(void);
	const char *(*error_string)(ncclResult_t r);
};

/* Opens libnccl.so.2 and resolves every entry point into *lib (zeroed first). Sets
 * NCCL_NVLS_ENABLE=0 unless the environment gives it (never NVLink multicast:
 * DEVICE.md). 0; -ENOENT when the library does not load, -ENOSYS when it lacks an
 * entry point (too old): one line in err naming what is missing. The caller closes
 * it with nccl_lib_close. */
int nccl_lib_open(struct nccl_lib *lib, char *err, size_t err_len);

/* Closes what nccl_lib_open opened (a zeroed or closed one accepted). Every
 * communicator made through it must be destroyed first. */
void nccl_lib_close(struct nccl_lib *lib);

/* "2.28.3" from lib->version into buf. */
void nccl_lib_version(const struct nccl_lib *lib, char *buf, size_t len);
#endif

#endif
