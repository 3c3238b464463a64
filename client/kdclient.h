/* libkdclient: the public C API of kdec for local processes.
 *
 * This release carries the library's versioning and error reporting; connecting to
 * kdecd, submitting requests and receiving streamed tokens arrive with the
 * shared-memory IPC (see docs/ARCHITECTURE.md). All functions here are thread-safe. */
#ifndef KDCLIENT_H
#define KDCLIENT_H

#ifdef __cplusplus
extern "C" {
#endif

/* Library version, e.g. "0.1.0"; the returned string is static. */
const char *kd_version(void);

/* The shared-memory protocol version this library speaks. */
unsigned kd_protocol_version(void);

/* A message for a kd_* error code (a negative errno value); static storage. */
const char *kd_strerror(int err);

#ifdef __cplusplus
}
#endif

#endif
