/* kdhttpd's HTTP side on libmicrohttpd: the listening socket (TCP or Unix), the API
 * key, bounds and timeouts, routing to the endpoints, and kdhttpd's own counters. */
#ifndef KDHTTPD_HTTP_SERVER_H
#define KDHTTPD_HTTP_SERVER_H

#include <stddef.h>

#include "http/http_backend.h"

struct srv_opts {
	const char *listen;		/* "HOST:PORT", "[V6]:PORT" or "unix:PATH" */
	char **api_keys;		/* NULL-terminated; NULL: no key asked */
	size_t max_body;		/* bytes of a request body */
	unsigned timeout_s;		/* an idle connection is closed after this */
	unsigned max_conns;		/* connections at once */
	unsigned queue_timeout_s;	/* a request waiting for tokens in flight */
};

struct srv;

/* Binds and starts serving; prints "kdhttpd: listening on ..." with the bound
 * address (a port 0 gets one from the kernel). 0 or -errno with a line on stderr. */
int srv_start(struct srv **out, const struct srv_opts *o, struct hb *hb);
void srv_stop(struct srv *s);	/* accepts NULL */

#endif
