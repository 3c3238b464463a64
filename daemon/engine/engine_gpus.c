/* Which GPU each tensor-parallel rank runs on (--gpus, --tp; docs/PARALLEL.md, "Ranks
 * and GPUs"). One GPU named (or none: GPU 0): every rank on it, the virtual ranks that
 * check the multi-GPU code on one device. Several: one rank per GPU, so --tp must
 * equal their count; a GPU is never shared by two ranks then (the per-rank reduction
 * spins, and ranks sharing a GPU need the one-GPU mode's ordering). Pure: the count
 * of visible GPUs comes from the caller, so the rules are tested without a GPU. */
#include <stdio.h>
#include <errno.h>

#include "daemon/engine/engine_internal.h"

int engine_rank_devices(const struct engine_opts *o, int visible, int *devs, int *n_devs,
			char *err, size_t err_len)
{
	int tp = o->tp > 1 ? o->tp : 1, n = o->n_gpus, list[ENGINE_MAX_GPUS];

	if (n == 0) {		/* not given: GPU 0 */
		list[0] = 0;
		n = 1;
	} else if (n < 0) {	/* all visible */
		if (visible < 1) {
			snprintf(err, err_len, "--gpus all: no GPU is visible");
			return -ENODEV;
		}
		n = visible < ENGINE_MAX_GPUS ? visible : ENGINE_MAX_GPUS;
		for (int i = 0; i < n; i++)
			list[i] = i;
	} else {
		for (int i = 0; i < n; i++)
			list[i] = o->gpus[i];
	}
	for (int i = 0; i < n && o->n_gpus != 0; i++)	/* not given: the backend says why */
		if (list[i] >= visible) {
			snprintf(err, err_len, "--gpus: GPU %d named, %d visible (ids 0..%d)", list[i],
				 visible, visible - 1);
			return -ENODEV;
		}
	if (n > 1 && tp != n) {
		snprintf(err, err_len, "--gpus %s%d GPUs with --tp %d: one rank per GPU, so give --tp %d "
			 "(or name %s)", o->n_gpus < 0 ? "all is " : "names ", n, tp, n,
			 tp > 1 ? "as many GPUs as ranks" : "one GPU");
		return -EINVAL;
	}
	for (int r = 0; r < tp; r++)
		devs[r] = list[n > 1 ? r : 0];
	*n_devs = n;
	return 0;
}
