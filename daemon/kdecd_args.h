/* kdecd's command line: the options it takes, into the options of the model load,
 * the engine and the server; its usage text. */
#ifndef KD_DAEMON_KDECD_ARGS_H
#define KD_DAEMON_KDECD_ARGS_H

#include <sys/types.h>

#include "daemon/engine/engine.h"
#include "daemon/model/model.h"
#include "daemon/serve/server.h"

#define KDECD_MAX_ALLOW 64	/* ids in --allow-uid, and in --allow-gid */
#define KDECD_MAX_OPERATORS 16	/* ids in --operator-uid, and in --operator-gid */

/* srv.allow_uid, srv.allow_gid and srv.operators point into uids, gids, op_uids and
 * op_gids: parse in place, do not copy. An operator is allowed too: its id is also
 * in uids or gids. */
struct kdecd_args {
	const char *model;	/* --model, from argv */
	int check;		/* --check: load, build the engine, exit */
	int daemon;		/* --daemon: the parent exits once the child serves */
	const char *pid_file;	/* --pid-file, from argv; NULL: none */
	struct model_load_opts load;
	struct engine_opts eng;
	struct server_opts srv;
	uid_t uids[KDECD_MAX_ALLOW];
	gid_t gids[KDECD_MAX_ALLOW];
	uid_t op_uids[KDECD_MAX_OPERATORS];
	gid_t op_gids[KDECD_MAX_OPERATORS];
};

/* Parses argv into *a, which the caller zeroed; strings stay argv's. Returns 0 (run),
 * 1 (--help or --version printed: exit 0) or -EINVAL / -ENOMEM (a message, and
 * maybe the usage, on stderr). */
int kdecd_args_parse(struct kdecd_args *a, int argc, char **argv);

#endif
