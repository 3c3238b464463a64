/* Command-line helpers shared by kdbench and kdecd: strict number and list parsing. */
#ifndef KD_DAEMON_CLI_H
#define KD_DAEMON_CLI_H

#include <stddef.h>
#include <stdint.h>

/* A decimal integer in [min, max], nothing after it. 0 or -EINVAL / -ERANGE. */
int cli_parse_long(const char *s, long min, long max, long *out);

/* "1,2,3" (spaces allowed after commas) -> *ids (malloc'd, caller frees), *n >= 1.
 * Each id in [0, INT32_MAX]; at most max_n ids. 0 or -errno with a message in err. */
int cli_parse_tokens(const char *s, int max_n, int32_t **ids, int *n, char *err, size_t err_len);

/* --gpus: "all" (*n = -1) or a list of distinct GPU ids "0,1,3", each in [0, 1023], at
 * most max_n of them, into ids. 0 or -EINVAL with a message in err. */
int cli_parse_gpus(const char *s, int *ids, int max_n, int *n, char *err, size_t err_len);

#endif
