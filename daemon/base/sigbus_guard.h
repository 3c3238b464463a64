/* Reads of a mapped file that may shrink under us. A page of a file mapping past the
 * file's end raises SIGBUS where it is touched: a checkpoint truncated or rewritten by
 * an operator while kdecd maps it (tensor parallel reads its shards straight from the
 * mapped files, model_shard.c) would kill the daemon at start. sigbus_guard_run runs
 * fn(arg) with such a fault turned into -EIO for its caller; a SIGBUS anywhere else, or
 * in another thread, keeps the default action (the process dies, as before). */
#ifndef KD_DAEMON_BASE_SIGBUS_GUARD_H
#define KD_DAEMON_BASE_SIGBUS_GUARD_H

/* fn(arg)'s return value, or -EIO when a SIGBUS interrupted it (fn did not finish: what
 * it wrote is partial, and what it allocated since its last durable store is lost; give
 * it nothing to clean up mid-way). Nests on one thread (the inner guard catches). */
int sigbus_guard_run(int (*fn)(void *arg), void *arg);

#endif
