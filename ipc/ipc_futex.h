/* Futex calls on the 32-bit doorbell words of a shared segment. The segment is a
 * MAP_SHARED memfd mapped by two processes, so these are shared (not private)
 * futexes. */
#ifndef KD_IPC_IPC_FUTEX_H
#define KD_IPC_IPC_FUTEX_H

#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Sleeps while *word == expect, at most timeout_ns (< 0: no limit). 0 when woken,
 * -EAGAIN (value differed), -ETIMEDOUT, -EINTR. */
static inline int ipc_futex_wait(_Atomic uint32_t *word, uint32_t expect, int64_t timeout_ns)
{
	struct timespec ts, *tp = NULL;

	if (timeout_ns >= 0) {
		ts.tv_sec = (time_t)(timeout_ns / 1000000000);
		ts.tv_nsec = (long)(timeout_ns % 1000000000);
		tp = &ts;
	}
	if (syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expect, tp, NULL, 0) < 0)
		return -errno;
	return 0;
}

/* Wakes up to n waiters; returns how many woke or -errno. */
static inline int ipc_futex_wake(_Atomic uint32_t *word, int n)
{
	long r = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, n, NULL, NULL, 0);

	return r < 0 ? -errno : (int)r;
}

/* CLOCK_MONOTONIC in ns: the clock of every timestamp in the records. */
static inline uint64_t ipc_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
