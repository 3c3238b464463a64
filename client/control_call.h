/* One request to kdecd's control socket and its reply: the control protocol is one
 * JSON object per line each way (daemon/serve/control.c). kdctl, kdrun and kdbench agent
 * compile this in; it is not part of libkdclient's API. */
#ifndef KD_CLIENT_CONTROL_CALL_H
#define KD_CLIENT_CONTROL_CALL_H

#define CONTROL_REPLY_MAX (1u << 20)	/* bytes of a reply accepted */

/* Sends req (one line, '\n' included) to the Unix socket at path and reads the reply up
 * to its newline. 0 with *reply malloc'd and NUL-terminated, or -errno: -ENAMETOOLONG
 * (path), -ENOMEM, connect's errno, -E2BIG (reply over CONTROL_REPLY_MAX), send's errno
 * or -ECONNRESET (closed without a reply). A daemon that refused the peer and closed
 * before the request went out still has its reply read: that line is the answer. */
int control_call(const char *path, const char *req, char **reply);

#endif
