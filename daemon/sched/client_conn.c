/* A client's segment from the daemon's side: built and sealed at the handshake,
 * then read (copy, then check) and written by the engine thread. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/sched/client_conn.h"
#include "ipc/ipc_futex.h"
#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"

static void init_header(struct ipc_seg_hdr *h, uint32_t id, enum ipc_notify notify,
			const struct client_limits *lim)
{
	h->magic = IPC_MAGIC;
	h->version = IPC_PROTOCOL_VERSION;
	h->notify = notify;
	h->client_id = id;
	h->seg_bytes = IPC_SEG_BYTES;
	h->sub_off = IPC_SUB_OFF;
	h->sub_slots = IPC_SUB_SLOTS;
	h->ev_off = IPC_EV_OFF;
	h->ev_slots = IPC_EV_SLOTS;
	h->pay_off = IPC_PAY_OFF;
	h->pay_tokens = IPC_PAY_TOKENS;
	h->max_prompt = lim->max_prompt < IPC_PAY_TOKENS ? lim->max_prompt : IPC_PAY_TOKENS;
	h->max_new = lim->max_new;
	h->max_inflight = lim->max_inflight;
	h->vocab_size = lim->vocab_size;
	snprintf(h->model, sizeof(h->model), "%s", lim->model ? lim->model : "");
	atomic_store(&h->state, IPC_STATE_OPEN);
}

int client_conn_create(struct client_conn **out, uint32_t id, enum ipc_notify notify,
		       const struct client_limits *lim, char *err, size_t err_len)
{
	struct client_conn *c;
	char name[32];
	int ret;

	*out = NULL;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->id = id;
	c->notify = notify;
	c->memfd = c->notify_efd = c->bell_efd = -1;
	c->t_connect_ns = ipc_now_ns();
	snprintf(name, sizeof(name), "kdec-client-%u", id);
	c->memfd = memfd_create(name, MFD_ALLOW_SEALING | MFD_CLOEXEC);
	if (c->memfd < 0 || ftruncate(c->memfd, IPC_SEG_BYTES))
		goto err_errno;
	/* Neither side can resize the segment under the other's mapping. */
	if (fcntl(c->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL))
		goto err_errno;
	c->seg = mmap(NULL, IPC_SEG_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
	if (c->seg == MAP_FAILED) {
		c->seg = NULL;
		goto err_errno;
	}
	init_header(c->seg, id, notify, lim);
	c->notify_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (c->notify_efd < 0)
		goto err_errno;
	if (notify == IPC_NOTIFY_EVENTFD) {
		/* Blocking: only io_uring reads it, and some kernels answer a read of a
		 * non-blocking eventfd with -EAGAIN instead of waiting. */
		c->bell_efd = eventfd(0, EFD_CLOEXEC);
		if (c->bell_efd < 0)
			goto err_errno;
	}
	*out = c;
	return 0;

err_errno:
	ret = -errno;
	snprintf(err, err_len, "client segment: %s", strerror(errno));
	client_conn_destroy(c);
	return ret;
}

void client_conn_destroy(struct client_conn *c)
{
	if (!c)
		return;
	if (c->seg)
		munmap(c->seg, IPC_SEG_BYTES);
	if (c->memfd >= 0)
		close(c->memfd);
	if (c->notify_efd >= 0)
		close(c->notify_efd);
	if (c->bell_efd >= 0)
		close(c->bell_efd);
	free(c->pending);
	free(c);
}

int client_conn_take(struct client_conn *c, struct ipc_sub *rec, int32_t **tokens)
{
	int ret;

	*tokens = NULL;
	ret = ipc_sub_peek(c->seg, c->sub_head, rec, c->why, sizeof(c->why));
	if (ret <= 0)
		return ret;
	if (rec->kind == IPC_SUB_REQUEST) {
		/* The record's copy is checked; n_tokens is bounded by the payload ring. */
		*tokens = malloc((size_t)rec->n_tokens * sizeof(int32_t));
		if (!*tokens)
			return -ENOMEM;
		ipc_pay_read(c->seg, rec->tok_pos, rec->n_tokens, *tokens);
	}
	c->sub_head++;
	ipc_sub_advance(c->seg, c->sub_head);
	return 1;
}

static int ring_free(struct client_conn *c)
{
	int free_slots = ipc_ev_free(c->seg, c->ev_tail);

	if (free_slots < 0)
		snprintf(c->why, sizeof(c->why), "event ring: head %u is impossible for tail %u",
			 atomic_load(&((struct ipc_seg_hdr *)c->seg)->ev_head), c->ev_tail);
	return free_slots;
}

int client_conn_ev_free(struct client_conn *c)
{
	int f = ring_free(c);

	if (f < 0)
		return f;
	/* Space is promised to the finals already waiting, and one slot stays back so
	 * that a final can always follow the tokens. */
	f -= c->n_pending + 1;
	return f > 0 ? f : 0;
}

static void write_ev(struct client_conn *c, const struct ipc_event *ev)
{
	struct ipc_event *slot = ipc_seg_ev(c->seg, c->ev_tail);

	*slot = *ev;
	slot->t_publish_ns = ipc_now_ns();
	c->ev_tail++;
	c->touched = 1;
}

int client_conn_flush(struct client_conn *c)
{
	int f, i;

	if (!c->n_pending)
		return 0;
	if ((f = ring_free(c)) < 0)
		return f;
	for (i = 0; i < c->n_pending && i < f; i++)
		write_ev(c, &c->pending[i]);
	memmove(c->pending, c->pending + i, (size_t)(c->n_pending - i) * sizeof(*c->pending));
	c->n_pending -= i;
	return 0;
}

int client_conn_push(struct client_conn *c, const struct ipc_event *ev)
{
	int f;

	if ((f = ring_free(c)) < 0)
		return f;
	if (f > 0 && !c->n_pending) {
		write_ev(c, ev);
		return 0;
	}
	if (!(ev->flags & IPC_EV_FINAL))
		return -ENOSPC;	/* callers reserve space for tokens: not reached */
	if (c->n_pending == c->cap_pending) {
		int cap = c->cap_pending ? 2 * c->cap_pending : 16;
		struct ipc_event *p = realloc(c->pending, (size_t)cap * sizeof(*p));

		if (!p)
			return -ENOMEM;
		c->pending = p;
		c->cap_pending = cap;
	}
	c->pending[c->n_pending++] = *ev;
	return 0;
}

unsigned client_conn_publish(struct client_conn *c)
{
	struct ipc_seg_hdr *h = c->seg;
	unsigned sleep;

	c->touched = 0;
	ipc_store_release(&h->ev_tail, c->ev_tail);
	/* Mirror of the client's announce-then-recheck: tail store, fence, flag load. */
	atomic_thread_fence(memory_order_seq_cst);
	sleep = atomic_load_explicit(&h->client_sleep, memory_order_relaxed);
	if (sleep & IPC_SLEEP_FUTEX)
		atomic_fetch_add(&h->client_bell, 1);
	return sleep & (IPC_SLEEP_FUTEX | IPC_SLEEP_FD);
}

void client_conn_mark_closed(struct client_conn *c)
{
	struct ipc_seg_hdr *h = c->seg;

	atomic_store_explicit(&h->state, IPC_STATE_CLOSED, memory_order_release);
	atomic_fetch_add(&h->client_bell, 1);
}
