/* The listening socket's path, claimed by an flock on PATH.lock (see the header for
 * why). The lock file is never removed: removing it would let a daemon lock an
 * unlinked inode while another locks a new file at the same path. It holds nothing;
 * the holder's pid comes from /proc/locks. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/base/log.h"
#include "daemon/serve/listen_socket.h"

static const char *type_of(mode_t m)
{
	return S_ISREG(m) ? "a regular file" : S_ISDIR(m) ? "a directory" : S_ISLNK(m) ? "a symbolic link" :
	       S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) || S_ISBLK(m) ? "a device" : "not a socket";
}

/* A path that exists and is not a socket is someone's file: never removed. */
static int refuse_non_socket(const char *path, char *err, size_t err_len)
{
	struct stat st;

	if (lstat(path, &st) || S_ISSOCK(st.st_mode))
		return 0;
	snprintf(err, err_len, "socket path %s exists and is %s: kdecd does not remove it; "
		 "remove it yourself or choose another --socket", path, type_of(st.st_mode));
	return -EEXIST;
}

/* The pid holding an flock on the file st names, from /proc/locks; 0 if unknown. */
static int lock_holder(const struct stat *st)
{
	char line[256], kind[16];
	unsigned maj, min;
	unsigned long ino;
	int pid, found = 0;
	FILE *f = fopen("/proc/locks", "re");

	if (!f)
		return 0;
	while (!found && fgets(line, sizeof(line), f)) {
		if (sscanf(line, "%*d: %15s %*s %*s %d %x:%x:%lu", kind, &pid, &maj, &min, &ino) == 5 &&
		    !strcmp(kind, "FLOCK") && ino == (unsigned long)st->st_ino &&
		    maj == major(st->st_dev) && min == minor(st->st_dev))
			found = pid;
	}
	fclose(f);
	return found;
}

static int take_lock(struct listen_socket *ls, char *err, size_t err_len)
{
	struct stat st;
	int ret, pid;

	ls->lock_fd = open(ls->lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
	if (ls->lock_fd < 0 && errno == EACCES)	/* another user's lock file: reading is enough */
		ls->lock_fd = open(ls->lock_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	if (ls->lock_fd < 0) {
		ret = -errno;
		snprintf(err, err_len, "lock file %s: %s", ls->lock_path, strerror(errno));
		return ret;
	}
	if (fstat(ls->lock_fd, &st) || !S_ISREG(st.st_mode)) {
		snprintf(err, err_len, "lock file %s is not a regular file", ls->lock_path);
		return -EINVAL;
	}
	if (!flock(ls->lock_fd, LOCK_EX | LOCK_NB))
		return 0;
	ret = -errno;
	if (ret != -EWOULDBLOCK) {
		snprintf(err, err_len, "lock file %s: flock: %s", ls->lock_path, strerror(-ret));
		return ret;
	}
	pid = lock_holder(&st);
	if (pid > 0)
		snprintf(err, err_len, "%s is served by another kdecd (pid %d holds %s); not taking it over",
			 ls->path, pid, ls->lock_path);
	else
		snprintf(err, err_len, "%s is served by another kdecd (it holds %s); not taking it over",
			 ls->path, ls->lock_path);
	return -EADDRINUSE;
}

/* Under the lock: a socket file at the path is a dead daemon's. */
static int remove_stale(struct listen_socket *ls, char *err, size_t err_len)
{
	struct stat st;
	int ret;

	if ((ret = refuse_non_socket(ls->path, err, err_len)))
		return ret;
	if (lstat(ls->path, &st))
		return 0;
	log_info("%s: replacing the socket of a daemon that is gone", ls->path);
	if (unlink(ls->path) && errno != ENOENT) {
		ret = -errno;
		snprintf(err, err_len, "cannot remove the stale socket %s: %s", ls->path, strerror(errno));
		return ret;
	}
	return 0;
}

static int make_dir(const char *path, mode_t mode, char *err, size_t err_len)
{
	char copy[108], dir[108];
	struct stat st;
	int ret;

	snprintf(copy, sizeof(copy), "%s", path);
	snprintf(dir, sizeof(dir), "%s", dirname(copy));
	if (!stat(dir, &st))
		return 0;
	if (mkdir(dir, mode) && errno != EEXIST) {
		ret = -errno;
		snprintf(err, err_len, "cannot create %s: %s", dir, strerror(errno));
		return ret;
	}
	return 0;
}

static int bind_listen(struct listen_socket *ls, mode_t mode, int backlog)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	mode_t old;
	int ret;

	strcpy(sa.sun_path, ls->path);
	ls->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (ls->fd < 0)
		return -errno;
	/* The mode at creation (no window with a wider one); no other thread makes files now. */
	old = umask(~mode & 0777);
	ret = bind(ls->fd, (struct sockaddr *)&sa, sizeof(sa)) ? -errno : 0;
	umask(old);
	if (ret)
		return ret;
	if (!lstat(ls->path, &st)) {
		ls->dev = st.st_dev;
		ls->ino = st.st_ino;
		ls->bound = 1;
	}
	return listen(ls->fd, backlog) ? -errno : 0;
}

int listen_socket_open(struct listen_socket *ls, const char *path, mode_t mode, int backlog,
		       int make_dirs, mode_t dir_mode, char *err, size_t err_len)
{
	int ret;

	memset(ls, 0, sizeof(*ls));
	ls->fd = ls->lock_fd = -1;
	if (strlen(path) >= sizeof(ls->path)) {
		snprintf(err, err_len, "socket path %s is too long (at most %zu bytes)", path,
			 sizeof(ls->path) - 1);
		return -ENAMETOOLONG;
	}
	snprintf(ls->path, sizeof(ls->path), "%s", path);
	snprintf(ls->lock_path, sizeof(ls->lock_path), "%s.lock", path);
	if (make_dirs && (ret = make_dir(path, dir_mode, err, err_len)))
		return ret;
	/* before the lock file: no PATH.lock beside someone's file */
	if ((ret = refuse_non_socket(path, err, err_len)) || (ret = take_lock(ls, err, err_len)) ||
	    (ret = remove_stale(ls, err, err_len)))
		return ret;
	if ((ret = bind_listen(ls, mode, backlog))) {
		snprintf(err, err_len, "socket %s: %s", path, strerror(-ret));
		return ret;
	}
	return 0;
}

void listen_socket_close(struct listen_socket *ls)
{
	struct stat st;

	if (ls->fd >= 0)
		close(ls->fd);
	ls->fd = -1;
	/* Only the file this daemon bound: never one that replaced it. */
	if (ls->bound && !lstat(ls->path, &st) && S_ISSOCK(st.st_mode) && st.st_dev == ls->dev &&
	    st.st_ino == ls->ino)
		unlink(ls->path);
	ls->bound = 0;
	if (ls->lock_fd >= 0)
		close(ls->lock_fd);	/* the lock goes with the last descriptor */
	ls->lock_fd = -1;
}

static int group_searchable(const struct stat *st, const gid_t *gids, int n)
{
	for (int i = 0; i < n && (st->st_mode & S_IXGRP); i++)
		if (gids[i] == st->st_gid)
			return 1;
	return 0;
}

int listen_socket_unreachable_dir(const char *path, const gid_t *gids, int n, int group_ok, char *dir,
				  size_t dir_len)
{
	char cur[108], copy[108];
	struct stat st;

	snprintf(cur, sizeof(cur), "%s", path);
	for (;;) {
		snprintf(copy, sizeof(copy), "%s", cur);
		snprintf(cur, sizeof(cur), "%s", dirname(copy));
		if (!stat(cur, &st) && !(st.st_mode & S_IXOTH) && !(group_ok && group_searchable(&st, gids, n))) {
			snprintf(dir, dir_len, "%s", cur);
			return 1;
		}
		if (!strcmp(cur, "/") || !strcmp(cur, "."))
			return 0;
	}
}
