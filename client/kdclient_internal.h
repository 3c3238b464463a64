/* The handle behind struct kd_client, shared by the library's files and by tests
 * that reach into a segment on purpose (tests/test_ipc_daemon.c scribbles over it). */
#ifndef KD_CLIENT_KDCLIENT_INTERNAL_H
#define KD_CLIENT_KDCLIENT_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "client/kdclient.h"
#include "ipc/ipc_proto.h"

struct kd_client {
	int sock;			/* the connection; EOF on it means the daemon dropped us */
	void *seg;			/* the mapped segment, seg_bytes */
	size_t seg_bytes;
	int notify_efd;			/* the daemon writes it when IPC_SLEEP_FD is set */
	int bell_efd;			/* eventfd mode: we write it to wake the daemon; else -1 */
	int epfd;			/* kd_fd: epoll over notify_efd and sock; -1 until asked */
	unsigned notify;		/* enum ipc_notify */
	unsigned spin_us;
	uint32_t client_id;
	uint32_t max_prompt;		/* from the header */

	/* submitting side */
	uint32_t sub_tail;		/* records written (private copy of hdr->sub_tail) */
	uint32_t pay_tail;		/* payload tokens written, free-running */
	uint32_t pay_start[IPC_SUB_SLOTS];	/* payload position of each slot's record */
	uint64_t next_id;

	/* receiving side */
	uint32_t ev_head;		/* events read (private copy of hdr->ev_head) */
	_Atomic int closed;		/* 0, or the -errno kd_poll/kd_wait return */
	char err[256];			/* why the daemon dropped us */
};

/* Library-internal (kdclient_conn.c): notices a dropped connection. Returns 0 while
 * connected, else the -errno to report (and records the daemon's reason). */
int kdclient_check_closed(struct kd_client *c);

#endif
