/* libkdclient: version and error reporting. */
#include <string.h>

#include "config.h"
#include "client/kdclient.h"
#include "ipc/ipc_proto.h"

const char *kd_version(void)
{
	return PACKAGE_VERSION;
}

unsigned kd_protocol_version(void)
{
	return IPC_PROTOCOL_VERSION;
}

const char *kd_strerror(int err)
{
	if (err == 0)
		return "success";
	if (err > 0)
		return "not an error code (kd_* errors are negative errno values)";
	/* strerror's buffer is static but not modified for valid codes in glibc; the
	 * thread-safe variant keeps that promise explicit. */
	return strerrordesc_np(-err) ? strerrordesc_np(-err) : "unknown error";
}
