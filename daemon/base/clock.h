/* The one clock the daemon times with: seconds since an arbitrary fixed point
 * (CLOCK_MONOTONIC), for durations and progress lines, never for wall time. */
#ifndef KD_DAEMON_BASE_CLOCK_H
#define KD_DAEMON_BASE_CLOCK_H

#include <time.h>

static inline double clock_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
