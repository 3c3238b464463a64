/* The engine thread's sleep and its wake-ups, through one io_uring: waits on every
 * client's doorbell (a futex word in its segment, or an eventfd) plus the main
 * loop's eventfd, and the futex wakes / eventfd writes of one step queued and sent
 * with a single submit. Used by the engine thread only. */
#ifndef KD_DAEMON_DOORBELL_H
#define KD_DAEMON_DOORBELL_H

#include <liburing.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ipc/ipc_proto.h"

struct doorbell {
	struct io_uring ring;
	int ring_ok;
	enum ipc_notify mode;
	int n_slots;
	uint64_t *fd_buf;	/* (n_slots) eventfd read targets, one per waiter slot */
	unsigned queued;	/* SQEs prepared since the last submit */
};

/* Called for each completed wait: tag as armed, res the kernel's result. */
typedef void (*doorbell_fn)(void *arg, uint64_t tag, int res);

/* 0 when this kernel runs IORING_OP_FUTEX_WAIT/WAKE (Linux 6.7+); else -EOPNOTSUPP
 * (or io_uring's own -errno) with a one-line reason in err. */
int doorbell_probe_futex(char *err, size_t err_len);

/* n_slots: waiter slots (tags' low 32 bits index them). 0 or -errno. */
int doorbell_init(struct doorbell *d, enum ipc_notify mode, int n_slots, char *err, size_t err_len);
void doorbell_fini(struct doorbell *d);	/* accepts a zeroed or half-built doorbell */

/* Arms a one-shot wait that completes when *word != expect (futex mode). */
int doorbell_arm_futex(struct doorbell *d, _Atomic uint32_t *word, uint32_t expect, uint64_t tag);
/* Arms a one-shot wait that completes when the eventfd fd is signalled (and reads it). */
int doorbell_arm_fd(struct doorbell *d, int fd, uint64_t tag);
/* Cancels the armed wait with this tag (its completion still arrives, res -ECANCELED). */
int doorbell_cancel(struct doorbell *d, uint64_t tag);

/* Queues a wake of the futex word (any waiter) or an eventfd write. */
int doorbell_wake_futex(struct doorbell *d, _Atomic uint32_t *word);
int doorbell_wake_fd(struct doorbell *d, int fd);

/* Submits everything queued; then, if timeout_ns != 0, sleeps until at least one
 * completion or the timeout (< 0: none); calls fn for each completed wait. Returns
 * the number of completions handled or -errno. */
int doorbell_run(struct doorbell *d, int64_t timeout_ns, doorbell_fn fn, void *arg);

/* Tag layout: slot in the low 32 bits, the slot's generation above. */
static inline uint64_t doorbell_tag(uint32_t slot, uint32_t gen)
{
	return (uint64_t)gen << 32 | slot;
}

#endif
