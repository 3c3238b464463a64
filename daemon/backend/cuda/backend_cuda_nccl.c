/* The tensor-parallel ranks' choice of reduction on the GPU (--allreduce,
 * docs/PARALLEL.md "NCCL in the engine") and the NCCL path: a communicator over the
 * ranks' devices (ncclCommInitAll, one process; the library loaded at run time,
 * nccl_lib.h), each rank's fp32 partial summed in place on its own stream, then the
 * residual add and the next RMSNorm by k_cuda_add_rmsnorm, the op whose math
 * k_cuda_ar_fused fuses. NCCL captures into CUDA graphs, so a rank's graph holds it.
 *
 * NCCL holds each device once per communicator: ranks sharing a GPU (the virtual ranks
 * of one GPU) cannot use it. What one GPU can run is a one-rank communicator (--tp 1
 * --allreduce nccl): the sum is the identity, but the engine's reduction code, the
 * library and its capture into the decode graph all run. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/backend/cuda/nccl_lib.h"
#include "daemon/base/log.h"
#include "kernels/cuda/comm/k_cuda_comm.h"
#include "kernels/cuda/linear/k_cuda_linear.h"
#include "kernels/cuda/ops/k_cuda_ops.h"

#ifdef KD_HAVE_NCCL
struct cuda_nccl {
	struct nccl_lib lib;
	int n;
	ncclComm_t comm[K_CUDA_AR_MAX_RANKS];	/* rank r's, on its device */
	char name[40];				/* "nccl 2.28.3" */
};
#else
struct cuda_nccl {
	int unused;	/* never made: cuda_nccl_create refuses without nccl.h */
};
#endif

/* The first pair of ranks on distinct devices without peer access both ways, in *a
 * and *b: 1; 0 when every pair shares a device or reaches the other's memory. */
static int ranks_without_peers(struct backend *const *ranks, int n, int *a, int *b)
{
	for (int i = 0; i < n; i++)
		for (int j = i + 1; j < n; j++) {
			int di = cuda_of(ranks[i])->dev, dj = cuda_of(ranks[j])->dev, ij = 0, ji = 0;

			if (di == dj)
				continue;
			if (cudaDeviceCanAccessPeer(&ij, di, dj) != cudaSuccess ||
			    cudaDeviceCanAccessPeer(&ji, dj, di) != cudaSuccess || !ij || !ji) {
				cudaGetLastError();	/* a failed query is "no access", not sticky */
				*a = i;
				*b = j;
				return 1;
			}
		}
	return 0;
}

/* The first two ranks on one device, in *a and *b: 1; 0 when every device is once. */
static int ranks_sharing_a_device(struct backend *const *ranks, int n, int *a, int *b)
{
	for (int i = 0; i < n; i++)
		for (int j = i + 1; j < n; j++)
			if (cuda_of(ranks[i])->dev == cuda_of(ranks[j])->dev) {
				*a = i;
				*b = j;
				return 1;
			}
	return 0;
}

#ifdef KD_HAVE_NCCL
static int cuda_nccl_create(struct backend *const *ranks, int n, struct cuda_nccl **out,
			    char *err, size_t err_len)
{
	struct cuda_nccl *c = calloc(1, sizeof(*c));
	int devs[K_CUDA_AR_MAX_RANKS], ret;
	char ver[16];
	ncclResult_t r;

	*out = NULL;
	if (!c)
		return -ENOMEM;
	if ((ret = nccl_lib_open(&c->lib, err, err_len))) {
		free(c);
		return ret;
	}
	for (int i = 0; i < n; i++)
		devs[i] = cuda_of(ranks[i])->dev;
	/* one thread makes every rank's communicator (it sets each device in turn) */
	r = c->lib.comm_init_all(c->comm, n, devs);
	cudaSetDevice(devs[0]);	/* the caller's thread: rank 0's GPU current again */
	if (r != ncclSuccess) {
		snprintf(err, err_len, "NCCL: ncclCommInitAll of %d rank%s on GPU %d%s failed: %s", n,
			 n > 1 ? "s" : "", devs[0], n > 1 ? ".." : "", c->lib.error_string(r));
		memset(c->comm, 0, sizeof(c->comm));
		nccl_lib_close(&c->lib);
		free(c);
		return -EIO;
	}
	c->n = n;
	nccl_lib_version(&c->lib, ver, sizeof(ver));
	snprintf(c->name, sizeof(c->name), "nccl %s", ver);
	*out = c;
	return 0;
}
#endif

void cuda_nccl_destroy(struct cuda_nccl *c)
{
	if (!c)
		return;
#ifdef KD_HAVE_NCCL
	for (int r = 0; r < c->n; r++)
		if (c->comm[r])
			c->lib.comm_destroy(c->comm[r]);
	nccl_lib_close(&c->lib);
#endif
	free(c);
}

const char *cuda_nccl_name(const struct cuda_nccl *c)
{
#ifdef KD_HAVE_NCCL
	return c->name;
#else
	(void)c;
	return "nccl";
#endif
}

/* NCCL for want (nccl, or auto where the fused kernel cannot run): *out, or one line. */
static int pick_nccl(struct backend *const *ranks, int n, const char *why, struct cuda_nccl **out,
		     char *err, size_t err_len)
{
	int a, b, ret;

	if (ranks_sharing_a_device(ranks, n, &a, &b)) {
		snprintf(err, err_len, "--allreduce nccl with tp %d: ranks %d and %d share GPU %d, and "
			 "NCCL cannot put two ranks on one GPU (a communicator holds each device once); "
			 "use --allreduce fused or auto", n, a, b, cuda_of(ranks[a])->dev);
		return -ENOTSUP;
	}
#ifdef KD_HAVE_NCCL
	if ((ret = cuda_nccl_create(ranks, n, out, err, err_len)))
		return ret;
	log_info("cuda: tp %d: all-reduce %s (%s): %s", n, (*out)->name, why,
		 n == 1 ? "a one-rank communicator (the sum is the identity), then the residual add "
			  "and RMSNorm (k_cuda_add_rmsnorm)"
			: "each rank's fp32 partial summed on its stream, then the residual add and "
			  "RMSNorm (k_cuda_add_rmsnorm)");
	return 0;
#else
	(void)why;
	(void)out;
	ret = -ENOTSUP;
	snprintf(err, err_len, "NCCL: this build has no nccl.h (configure found no NCCL under the "
		 "CUDA toolkit), so it cannot load libnccl.so.2");
	return ret;
#endif
}

int cuda_nccl_fallback(struct backend *const *ranks, int n, int fused_ret, struct cuda_nccl **nccl,
		       char *err, size_t err_len)
{
	int a, b;
	char why[192];

	*nccl = NULL;
	if (cuda_of(ranks[0])->allreduce != BACKEND_AR_AUTO || ranks_sharing_a_device(ranks, n, &a, &b))
		return fused_ret;
	snprintf(why, sizeof(why), "--allreduce auto: the fused kernel's peer buffers could not be "
		 "made (%s)", strerror(-fused_ret));
	log_warn("cuda: tp %d: %s; NCCL instead", n, why);
	return pick_nccl(ranks, n, why, nccl, err, err_len);
}

int cuda_nccl_pick(struct backend *const *ranks, int n, struct cuda_nccl **nccl, char *err,
		   size_t err_len)
{
	enum backend_allreduce want = cuda_of(ranks[0])->allreduce;
	int a = 0, b = 0, no_peers = ranks_without_peers(ranks, n, &a, &b);
	char why[192];
	int ret;

	*nccl = NULL;
	if (want == BACKEND_AR_NCCL)
		return pick_nccl(ranks, n, "--allreduce nccl", nccl, err, err_len);
	if (n < 2) {
		snprintf(err, err_len, "--allreduce %s with tp %d: one rank has nothing to reduce (only "
			 "--allreduce nccl runs a one-rank communicator)", backend_allreduce_name(want), n);
		return -EINVAL;
	}
	if (no_peers && want == BACKEND_AR_FUSED) {
		snprintf(err, err_len, "--allreduce fused with tp %d: GPUs %d and %d (ranks %d and %d) "
			 "have no peer access, which the fused kernel's stores need; use --allreduce nccl "
			 "or auto", n, cuda_of(ranks[a])->dev, cuda_of(ranks[b])->dev, a, b);
		return -ENOTSUP;
	}
	if (no_peers) {	/* auto: NCCL, the fall-back where peer access is missing */
		snprintf(why, sizeof(why), "--allreduce auto: GPUs %d and %d have no peer access",
			 cuda_of(ranks[a])->dev, cuda_of(ranks[b])->dev);
		if ((ret = pick_nccl(ranks, n, why, nccl, err, err_len))) {
			char e2[256];

			snprintf(e2, sizeof(e2), "%s", err);
			snprintf(err, err_len, "tp %d: %s, so the fused kernel cannot run, and %s", n, why, e2);
		}
		return ret;
	}
	/* no size threshold: NCCL's figures with more than one rank wait for a multi-GPU
	 * machine (docs/PARALLEL.md), so auto has nothing to compare the fused kernel with */
	log_info("cuda: tp %d: all-reduce fused (k_cuda_ar_fused; --allreduce %s): %s", n,
		 backend_allreduce_name(want),
		 ranks_sharing_a_device(ranks, n, &a, &b) ? "ranks sharing a GPU (NCCL cannot)"
							   : "every pair of GPUs has peer access");
	return 0;
}

int cuda_nccl_reduce(struct backend *be, struct cuda_nccl *c, int rank, float *buf, int rows,
		     int width, float *residual, const float *gamma, float *out, float eps)
{
	struct backend_cuda *b = cuda_of(be);
	size_t n = (size_t)rows * (size_t)width;
	int ret = 0;

	if (gamma && (!residual || !out))
		return -EINVAL;
	/* residual and buf are rewritten: a bf16 copy of x marked ready is stale after (the
	 * next linear rounds out itself; k_cuda_add_rmsnorm writes no bf16 form) */
	k_cuda_linear_x_ready(b->lin, NULL, 0, 0);
#ifdef KD_HAVE_NCCL
	{
		ncclResult_t r = c->lib.all_reduce(buf, buf, n, ncclFloat32, ncclSum, c->comm[rank],
						   b->stream);

		if (r != ncclSuccess) {
			log_error("cuda: tp %d, rank %d: ncclAllReduce of %zu floats on GPU %d: %s", c->n,
				  rank, n, b->dev, c->lib.error_string(r));
			ret = -EIO;
		}
	}
#else
	(void)c;
	(void)rank;
	ret = -ENOTSUP;
#endif
	if (!ret && gamma)
		ret = k_cuda_add_rmsnorm(b->stream, residual, buf, out, gamma, rows, width, eps);
	else if (!ret && residual)
		ret = k_cuda_add(b->stream, residual, buf, n);
	cuda_fail(b, ret, "tp_reduce (nccl)");
	return ret;
}
