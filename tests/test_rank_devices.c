/* Which GPU each tensor-parallel rank runs on (engine_rank_devices): the rules of
 * --gpus and --tp without a GPU (the count of visible GPUs is the test's): one GPU
 * named or none, every rank on it; several, one rank per GPU; "all", every visible
 * GPU; and the refusals, each one line with the numbers in it. */
#include <errno.h>

#include "tests/testutil.h"
#include "daemon/engine/engine_internal.h"

/* opts with --tp tp and --gpus given as n ids (n 0: not given; -1: all) */
static struct engine_opts opts_of(int tp, int n, const int *ids)
{
	struct engine_opts o = { .tp = tp, .n_gpus = n };

	for (int i = 0; i < n; i++)
		o.gpus[i] = ids[i];
	return o;
}

static void expect(const char *what, int tp, int n, const int *ids, int visible, const int *want,
		   int want_n)
{
	struct engine_opts o = opts_of(tp, n, ids);
	int devs[ENGINE_MAX_GPUS], nd = -1, ret;
	char err[256] = "";

	ret = engine_rank_devices(&o, visible, devs, &nd, err, sizeof(err));
	CHECK(ret == 0, "%s: refused: %s", what, err);
	if (ret)
		return;
	CHECK(nd == want_n, "%s: %d distinct GPUs, want %d", what, nd, want_n);
	for (int r = 0; r < (tp > 1 ? tp : 1); r++)
		CHECK(devs[r] == want[r], "%s: rank %d on GPU %d, want %d", what, r, devs[r], want[r]);
}

static void refused(const char *what, int tp, int n, const int *ids, int visible, int want_ret,
		    const char *needle)
{
	struct engine_opts o = opts_of(tp, n, ids);
	int devs[ENGINE_MAX_GPUS], nd = -1, ret;
	char err[256] = "";

	ret = engine_rank_devices(&o, visible, devs, &nd, err, sizeof(err));
	CHECK(ret == want_ret, "%s: returned %d, want %d (%s)", what, ret, want_ret, err);
	CHECK(strstr(err, needle) && !strchr(err, '\n'), "%s: message '%s' lacks '%s'", what, err,
	      needle);
	fprintf(stderr, "%-34s %s\n", what, err);
}

int main(void)
{
	static const int g2[] = { 2 }, g01[] = { 0, 1 }, g3175[] = { 3, 1, 7, 5 },
			 zeros[8] = { 0 }, twos[4] = { 2, 2, 2, 2 }, seq8[8] = { 0, 1, 2, 3, 4, 5, 6, 7 },
			 g9[] = { 9 };

	expect("nothing given, tp 1", 1, 0, NULL, 1, zeros, 1);
	expect("nothing given, tp 4 (virtual)", 4, 0, NULL, 1, zeros, 1);
	/* no GPU and none named: GPU 0, for the backend to refuse with its own reason */
	expect("nothing given, none visible", 1, 0, NULL, 0, zeros, 1);
	expect("--gpus 2, tp 1", 1, 1, g2, 4, twos, 1);
	expect("--gpus 2, tp 4 (virtual on GPU 2)", 4, 1, g2, 4, twos, 1);
	expect("--gpus 0,1 --tp 2", 2, 2, g01, 2, g01, 2);
	expect("--gpus 3,1,7,5 --tp 4 (order kept)", 4, 4, g3175, 8, g3175, 4);
	expect("--gpus all (8) --tp 8", 8, -1, NULL, 8, seq8, 8);
	expect("--gpus all (1) --tp 2 (virtual)", 2, -1, NULL, 1, zeros, 1);
	expect("--gpus all (1), tp 1", 0, -1, NULL, 1, zeros, 1);

	refused("--gpus 0,1 without --tp", 1, 2, g01, 2, -EINVAL, "give --tp 2");
	refused("--gpus 3,1,7,5 --tp 2", 2, 4, g3175, 8, -EINVAL, "names 4 GPUs with --tp 2");
	refused("--gpus all (8) --tp 4", 4, -1, NULL, 8, -EINVAL, "all is 8 GPUs with --tp 4");
	refused("--gpus 9 of 8", 1, 1, g9, 8, -ENODEV, "GPU 9 named, 8 visible");
	refused("--gpus 0,1 of 1", 2, 2, g01, 1, -ENODEV, "GPU 1 named, 1 visible");
	refused("--gpus all of none", 1, -1, NULL, 0, -ENODEV, "no GPU is visible");
	return test_result("test_rank_devices");
}
