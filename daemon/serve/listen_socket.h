/* kdecd's listening socket and its claim on the path: an flock on PATH.lock held for
 * the daemon's life is the one authority on who serves PATH (never a connect probe,
 * which a stalled daemon with a full backlog fails); a stale socket is replaced only
 * under the lock, and at exit only the socket file this daemon bound is removed. */
#ifndef KD_DAEMON_LISTEN_SOCKET_H
#define KD_DAEMON_LISTEN_SOCKET_H

#include <stddef.h>
#include <sys/types.h>

struct listen_socket {
	int fd;			/* the listening socket, or -1 */
	int lock_fd;		/* PATH.lock, flock'ed exclusively; or -1 */
	char path[108];		/* sun_path */
	char lock_path[128];
	dev_t dev;		/* the socket file bind made (removed at exit only if */
	ino_t ino;		/* the path still names it) */
	int bound;
};

/* Claims path (lock), refuses a path that exists and is not a socket, replaces a
 * stale socket, binds with mode (chmod) and listens with backlog. make_dir: create
 * the directory (dir_mode) when missing. 0 or -errno with one line in err that names
 * the path and, for a live daemon, its pid. */
int listen_socket_open(struct listen_socket *ls, const char *path, mode_t mode, int backlog,
		       int make_dir, mode_t dir_mode, char *err, size_t err_len);

/* Closes the socket, removes the socket file if it is still the one bound, then
 * drops the lock. Accepts an ls whose open failed, or one with fd = lock_fd = -1. */
void listen_socket_close(struct listen_socket *ls);

/* The first directory on the way to path that others cannot search (no o+x), unless
 * group_ok and it is searchable by its group and gids (n) holds that group; into dir.
 * 0 if every one can be searched, 1 if one cannot. */
int listen_socket_unreachable_dir(const char *path, const gid_t *gids, int n, int group_ok, char *dir,
				  size_t dir_len);

#endif
