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

#endif
