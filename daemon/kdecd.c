/* kdecd: the decode daemon. Loads the model, builds the engine, then serves local
 * clients over shared memory (daemon/serve/server.c, the engine thread) until SIGTERM:
 * the first stops admitting and lets running requests finish, a second stops now. */
#include <errno.h>
#include <ev.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "daemon/base/clock.h"
#include "daemon/base/log.h"
#include "daemon/engine/engine.h"
#include "daemon/kdecd_args.h"
#include "daemon/kdecd_ready.h"
#include "daemon/model/model.h"
#include "daemon/serve/doorbell.h"
#include "daemon/serve/server.h"
#include "kvcache/snapshot.h"

static int n_signals;

static void on_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
	struct server *s = w->data;

	(void)loop;
	(void)revents;
	if (++n_signals == 1) {
		log_info("signal %d: shutting down", w->signum);
		server_shutdown(s);
	} else {
		log_info("signal %d again: stopping now", w->signum);
		server_stop_now(s);
	}
}

/* Sessions saved by an earlier run. A refused snapshot is set aside (or held in place)
 * and the daemon serves on; sessions that did not fit stay on disk. */
static void load_state(struct engine *e, const char *dir)
{
	struct engine_snap_load r;
	char err[512] = "";
	int ret;

	ret = engine_snapshot_load(e, dir, &r, err, sizeof(err));
	if (r.stale_temps)
		log_warn("state dir %s: removed %d temporary snapshot file(s) of a writer that was killed (%s)",
			 dir, r.stale_temps, r.stale_temp);
	if (ret == -ENOENT) {
		log_info("state dir %s: no snapshot yet", dir);
		return;
	}
	if (ret) {
		log_warn("state dir %s: snapshot not loaded: %s", dir, err[0] ? err : strerror(-ret));
		if (r.set_aside[0])
			log_warn("state dir %s: the refused snapshot is kept as %s (rename it to %s for a "
				 "daemon it fits); new snapshots start afresh", dir, r.set_aside, KV_SNAP_FILE);
		else if (r.held)
			log_warn("state dir %s: %s is left as it is and snapshots are refused until it is "
				 "moved away", dir, KV_SNAP_FILE);
		return;
	}
	log_info("state dir %s: %d sessions loaded", dir, r.loaded);
	if (r.held)
		log_warn("state dir %s: %s", dir, err);
	else if (r.kept)
		log_warn("state dir %s: %d sessions not loaded (%llu bytes of compressed KV; host tier "
			 "budget %llu bytes): %d beyond the budget, %d over the per-user session limit of %d, "
			 "%d larger than the device cache, %d without a host tier; they stay in the snapshot",
			 dir, r.kept, (unsigned long long)r.kept_zbytes, (unsigned long long)r.host_budget,
			 r.kept_budget, r.kept_quota, e->max_sessions, r.kept_too_big, r.kept_no_host);
}

static int serve(struct kdecd_args *a, struct engine *e, struct kdecd_ready *rd)
{
	struct ev_loop *loop = ev_default_loop(EVFLAG_AUTO);
	struct server *s = NULL;
	ev_signal sig_term, sig_int;
	char err[512] = "";
	int ret;

	if (!loop) {
		log_error("libev: cannot initialise the event loop");
		return -EIO;
	}
	if (a->srv.notify == IPC_NOTIFY_FUTEX && (ret = doorbell_probe_futex(err, sizeof(err)))) {
		log_error("%s; start kdecd with --notify eventfd", err);
		return ret;
	}
	if ((ret = server_create(&s, loop, e, &a->srv, err, sizeof(err)))) {
		log_error("%s", err);
		return ret;
	}
	ev_signal_init(&sig_term, on_signal, SIGTERM);
	ev_signal_init(&sig_int, on_signal, SIGINT);
	sig_term.data = sig_int.data = s;
	ev_signal_start(loop, &sig_term);
	ev_signal_start(loop, &sig_int);
	log_info("running (pid %ld): socket %s, notify %s", (long)getpid(), server_socket_path(s),
		 a->srv.notify == IPC_NOTIFY_FUTEX ? "futex" : "eventfd");
	if (!(ret = kdecd_ready_tell(rd)))
		ev_run(loop, 0);
	server_destroy(s);
	ev_signal_stop(loop, &sig_term);
	ev_signal_stop(loop, &sig_int);
	log_info("stopped");
	return ret;
}

int main(int argc, char **argv)
{
	struct kdecd_args a = { 0 };
	struct kdecd_ready rd = { .fd = -1 };
	struct listen_socket ls = { .fd = -1, .lock_fd = -1 };
	struct model *m = NULL;
	struct engine *e = NULL;
	char err[512] = "";
	double t0;
	int ret;

	ret = kdecd_args_parse(&a, argc, argv);
	if (ret)
		return ret > 0 ? 0 : 2;
	signal(SIGPIPE, SIG_IGN);
	rd.pid_file = a.pid_file;
	/* before the model load: the backend may start threads, which a fork would lose */
	if (a.daemon && !a.check && (ret = kdecd_daemonize(&rd))) {
		log_error("--daemon: cannot fork: %s", strerror(-ret));
		return 1;
	}
	/* The socket first: a second kdecd on it refuses before loading a model. */
	if (!a.check && (ret = server_listen(&ls, &a.srv, err, sizeof(err)))) {
		log_error("%s", err);
		goto out;
	}
	a.srv.ls = a.check ? NULL : &ls;
	t0 = clock_now();
	/* tensor parallel: each rank's shard read straight from the files (model.h) */
	a.load.mapped = a.eng.tp > 1;
	ret = model_load(&m, a.model, &a.load, err, sizeof(err));
	if (!ret)
		ret = engine_create(&e, m, &a.eng, err, sizeof(err));
	if (!ret)
		a.srv.backend = e->be->ops->name;	/* what auto chose, for status */
	if (!ret && !a.check)
		ret = engine_warm(e, err, sizeof(err));
	if (ret) {
		log_error("%s", err[0] ? err : strerror(-ret));
		goto out;
	}
	{
		char w[40];

		log_info("model %s: %s, %d layers, %.1f MiB of weights (%s%s); KV cache %.1f MiB; "
			 "ready in %.2f s", a.model, m->cfg.model_type, m->cfg.n_layers,
			 (double)m->weight_bytes / (1 << 20), model_weights_name(m, w, sizeof(w)),
			 m->cfg.quant.input_scales ? "; its static input scales are not applied: "
			 "activations stay unquantized" : "", (double)e->fwd->kv_bytes / (1 << 20),
			 clock_now() - t0);
	}
	if (!ret) {
		char path[160];

		engine_decode_path_describe(e, path, sizeof(path));
		log_info("decode path: %s", path);
	}
	if (!a.check && a.srv.state_dir)
		load_state(e, a.srv.state_dir);
	if (!a.check)
		ret = serve(&a, e, &rd);
	/* an orderly stop writes the snapshot last: its failure (logged) is the exit status */
	if (!a.check && !ret && a.srv.state_dir && n_signals < 2 && engine_snapshot_status(e) < 0) {
		log_error("exiting with status 1: the sessions were not saved to %s", a.srv.state_dir);
		ret = -EIO;
	}
out:
	listen_socket_close(&ls);	/* unless the server took it */
	engine_destroy(e);
	model_destroy(m);
	kdecd_ready_fini(&rd);
	return ret ? 1 : 0;
}
