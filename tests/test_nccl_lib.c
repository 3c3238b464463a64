/* The run-time NCCL loader (daemon/backend/cuda/nccl_lib.c), no GPU needed: the version
 * code read as NCCL writes it (major * 10000 + minor * 100 + patch since 2.9, major *
 * 1000 before), and where libnccl.so.2 loads here every entry point the engine and
 * kdbench call resolved, the version read, its error strings answering, and a close
 * that leaves the table zeroed (a second close harmless). Skips (77) where the build
 * has no nccl.h; the loading part is skipped where the library does not load, after
 * checking that the refusal names it. */
#include <errno.h>
#include <stdio.h>

#include "config.h"
#include "tests/testutil.h"

#ifdef KD_HAVE_NCCL
#include "daemon/backend/cuda/nccl_lib.h"

static void check_version(int code, const char *want)
{
	struct nccl_lib lib = { .version = code };
	char buf[16];

	nccl_lib_version(&lib, buf, sizeof(buf));
	CHECK(!strcmp(buf, want), "version %d read as %s, want %s", code, buf, want);
}

int main(void)
{
	struct nccl_lib lib;
	char err[256] = "";
	int ret;

	check_version(22803, "2.28.3");
	check_version(21903, "2.19.3");
	check_version(20905, "2.9.5");
	check_version(2708, "2.7.8");
	ret = nccl_lib_open(&lib, err, sizeof(err));
	if (ret) {
		CHECK(ret == -ENOENT || ret == -ENOSYS, "nccl_lib_open: %d", ret);
		CHECK(strstr(err, "libnccl.so.2") != NULL, "the refusal names the library: %s", err);
		CHECK(lib.dl == NULL && lib.all_reduce == NULL, "a failed open leaves nothing open");
		test_skip("test_nccl_lib: %s", err);
		return test_result("test_nccl_lib");
	}
	CHECK(lib.dl && lib.comm_init_all && lib.comm_destroy && lib.all_reduce &&
	      lib.error_string, "every entry point resolved");
	CHECK(lib.version >= 20900, "version code %d (NCCL 2.9 or later: graph capture)", lib.version);
	CHECK(lib.error_string(ncclInvalidArgument) && lib.error_string(ncclInvalidArgument)[0],
	      "ncclGetErrorString answers");
	fprintf(stderr, "test_nccl_lib: %s, version code %d\n", NCCL_LIB_NAME, lib.version);
	nccl_lib_close(&lib);
	CHECK(lib.dl == NULL && lib.all_reduce == NULL, "closed: the table zeroed");
	nccl_lib_close(&lib);	/* a closed one accepted */
	return test_result("test_nccl_lib");
}
#else
int main(void)
{
	fprintf(stderr, "test_nccl_lib: skipped: built without nccl.h (configure's NCCL: no)\n");
	return 77;
}
#endif
