/* sigbus_guard_run: a process-wide SIGBUS handler installed once, which jumps to the
 * faulting thread's armed guard, if any; unarmed, it puts the default action back and
 * raises the signal again, so the process dies with SIGBUS as it would have without
 * the handler. SIGBUS from a memory access is delivered to the
 * thread that made it, so a thread-local target is the right one. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>

#include "daemon/base/sigbus_guard.h"

static __thread sigjmp_buf *armed;	/* this thread's innermost running guard */
static pthread_once_t installed = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig)
{
	sigjmp_buf *to = armed;

	if (to)
		siglongjmp(*to, 1);	/* restores the mask saved by sigsetjmp */
	signal(sig, SIG_DFL);
	raise(sig);	/* pending until the handler returns, then the default action */
}

static void install(void)
{
	struct sigaction sa = { 0 };

	sa.sa_handler = on_sigbus;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGBUS, &sa, NULL);
}

int sigbus_guard_run(int (*fn)(void *arg), void *arg)
{
	sigjmp_buf jb;
	sigjmp_buf *volatile outer = armed;
	int ret;

	pthread_once(&installed, install);
	if (sigsetjmp(jb, 1)) {
		armed = outer;
		return -EIO;
	}
	armed = &jb;
	ret = fn(arg);
	armed = outer;
	return ret;
}
