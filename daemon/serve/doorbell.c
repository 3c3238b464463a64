/* io_uring futex and eventfd doorbells. Debian 12's liburing (2.3) has no helpers for
 * the futex opcodes, so their SQEs are prepared here by hand, field for field as the
 * kernel's io_uring/futex.c reads them: fd = futex2 flags, addr = the word, addr2 =
 * the value (wait) or the number to wake (wake), addr3 = the bitset mask, futex_flags
 * (the rw_flags union) = 0. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/serve/doorbell.h"

#ifndef IORING_OP_FUTEX_WAIT
#define KD_IORING_OP_FUTEX_WAIT 51
#define KD_IORING_OP_FUTEX_WAKE 52
#else
#define KD_IORING_OP_FUTEX_WAIT IORING_OP_FUTEX_WAIT
#define KD_IORING_OP_FUTEX_WAKE IORING_OP_FUTEX_WAKE
#endif
#ifndef FUTEX2_SIZE_U32
#define FUTEX2_SIZE_U32 0x02
#endif
#define FUTEX_MASK_ANY 0xffffffffull	/* FUTEX_BITSET_MATCH_ANY */

/* user_data of SQEs whose completions are not waits (wakes, cancels): only their
 * failures produce CQEs (IOSQE_CQE_SKIP_SUCCESS), which are dropped. */
#define TAG_INTERNAL UINT64_MAX

static struct io_uring_sqe *get_sqe(struct doorbell *d)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(&d->ring);

	if (!sqe) {
		/* The SQ is full: send what is queued and take the freed entry. */
		io_uring_submit(&d->ring);
		d->queued = 0;
		sqe = io_uring_get_sqe(&d->ring);
		if (!sqe)
			return NULL;
	}
	memset(sqe, 0, sizeof(*sqe));
	d->queued++;
	return sqe;
}

static void prep_futex(struct io_uring_sqe *sqe, int op, _Atomic uint32_t *word, uint64_t val)
{
	sqe->opcode = (uint8_t)op;
	sqe->fd = FUTEX2_SIZE_U32;	/* shared futex: the word is in a MAP_SHARED segment */
	sqe->addr = (uint64_t)(uintptr_t)word;
	sqe->addr2 = val;
	sqe->addr3 = FUTEX_MASK_ANY;
}

int doorbell_probe_futex(char *err, size_t err_len)
{
	struct io_uring ring;
	struct io_uring_sqe *sqe;
	struct io_uring_cqe *cqe;
	_Atomic uint32_t word = 0;
	int ret;

	if ((ret = io_uring_queue_init(4, &ring, 0))) {
		snprintf(err, err_len, "io_uring is not available: %s", strerror(-ret));
		return ret;
	}
	sqe = io_uring_get_sqe(&ring);
	if (!sqe) {
		io_uring_queue_exit(&ring);
		snprintf(err, err_len, "io_uring: no submission entry for the probe");
		return -EBUSY;
	}
	memset(sqe, 0, sizeof(*sqe));
	prep_futex(sqe, KD_IORING_OP_FUTEX_WAKE, &word, 1);
	ret = io_uring_submit_and_wait(&ring, 1);
	if (ret >= 0)
		ret = io_uring_peek_cqe(&ring, &cqe);
	if (!ret) {
		ret = cqe->res < 0 ? cqe->res : 0;
		io_uring_cqe_seen(&ring, cqe);
	}
	io_uring_queue_exit(&ring);
	if (ret == -EINVAL || ret == -EOPNOTSUPP) {
		snprintf(err, err_len, "this kernel's io_uring has no futex operations (Linux 6.7+ needed)");
		return -EOPNOTSUPP;
	}
	if (ret < 0)
		snprintf(err, err_len, "io_uring futex probe failed: %s", strerror(-ret));
	return ret < 0 ? ret : 0;
}

int doorbell_init(struct doorbell *d, enum ipc_notify mode, int n_slots, char *err, size_t err_len)
{
	unsigned entries = 64;
	int ret;

	memset(d, 0, sizeof(*d));
	d->mode = mode;
	d->n_slots = n_slots;
	d->fd_buf = calloc((size_t)n_slots, sizeof(*d->fd_buf));
	if (!d->fd_buf)
		return -ENOMEM;
	while (entries < (unsigned)n_slots * 2 && entries < 4096)
		entries *= 2;
	ret = io_uring_queue_init(entries, &d->ring, 0);
	if (ret) {
		snprintf(err, err_len, "io_uring_queue_init(%u): %s", entries, strerror(-ret));
		return ret;
	}
	d->ring_ok = 1;
	return 0;
}

void doorbell_fini(struct doorbell *d)
{
	if (d->ring_ok)
		io_uring_queue_exit(&d->ring);
	free(d->fd_buf);
	memset(d, 0, sizeof(*d));
}

int doorbell_arm_futex(struct doorbell *d, _Atomic uint32_t *word, uint32_t expect, uint64_t tag)
{
	struct io_uring_sqe *sqe = get_sqe(d);

	if (!sqe)
		return -EBUSY;
	prep_futex(sqe, KD_IORING_OP_FUTEX_WAIT, word, expect);
	sqe->user_data = tag;
	return 0;
}

int doorbell_arm_fd(struct doorbell *d, int fd, uint64_t tag)
{
	uint32_t slot = (uint32_t)tag;
	struct io_uring_sqe *sqe;

	if ((int)slot >= d->n_slots)
		return -EINVAL;
	sqe = get_sqe(d);
	if (!sqe)
		return -EBUSY;
	/* A read of the eventfd both waits and clears it. */
	io_uring_prep_read(sqe, fd, &d->fd_buf[slot], sizeof(uint64_t), 0);
	sqe->user_data = tag;
	return 0;
}

int doorbell_cancel(struct doorbell *d, uint64_t tag)
{
	struct io_uring_sqe *sqe = get_sqe(d);

	if (!sqe)
		return -EBUSY;
	io_uring_prep_cancel64(sqe, tag, 0);
	sqe->flags |= IOSQE_CQE_SKIP_SUCCESS;
	sqe->user_data = TAG_INTERNAL;
	return 0;
}

int doorbell_wake_futex(struct doorbell *d, _Atomic uint32_t *word)
{
	struct io_uring_sqe *sqe = get_sqe(d);

	if (!sqe)
		return -EBUSY;
	prep_futex(sqe, KD_IORING_OP_FUTEX_WAKE, word, INT_MAX);
	sqe->flags |= IOSQE_CQE_SKIP_SUCCESS;
	sqe->user_data = TAG_INTERNAL;
	return 0;
}

int doorbell_wake_fd(struct doorbell *d, int fd)
{
	static const uint64_t one = 1;	/* lives as long as any write SQE */
	struct io_uring_sqe *sqe = get_sqe(d);

	if (!sqe)
		return -EBUSY;
	io_uring_prep_write(sqe, fd, &one, sizeof(one), 0);
	sqe->flags |= IOSQE_CQE_SKIP_SUCCESS;
	sqe->user_data = TAG_INTERNAL;
	return 0;
}

static int reap(struct doorbell *d, doorbell_fn fn, void *arg)
{
	struct io_uring_cqe *cqe;
	unsigned head, n = 0;
	int handled = 0;

	io_uring_for_each_cqe(&d->ring, head, cqe) {
		n++;
		if (cqe->user_data != TAG_INTERNAL) {
			fn(arg, cqe->user_data, cqe->res);
			handled++;
		}
	}
	io_uring_cq_advance(&d->ring, n);
	return handled;
}

int doorbell_run(struct doorbell *d, int64_t timeout_ns, doorbell_fn fn, void *arg)
{
	struct io_uring_cqe *cqe;
	int ret;

	if (timeout_ns == 0 || io_uring_cq_ready(&d->ring)) {
		if (d->queued && (ret = io_uring_submit(&d->ring)) < 0)
			return ret;
		d->queued = 0;
		return reap(d, fn, arg);
	}
	if (timeout_ns < 0) {
		ret = io_uring_submit_and_wait(&d->ring, 1);
	} else {
		struct __kernel_timespec ts = { .tv_sec = timeout_ns / 1000000000,
						.tv_nsec = timeout_ns % 1000000000 };

		ret = io_uring_submit_and_wait_timeout(&d->ring, &cqe, 1, &ts, NULL);
	}
	d->queued = 0;
	if (ret < 0 && ret != -ETIME && ret != -EINTR)
		return ret;
	return reap(d, fn, arg);
}
