/* Reading untrusted submission records (daemon side) and the checks both sides apply
 * to them: the library refuses to write what the daemon would refuse to read. */
#ifndef KD_IPC_IPC_RECORD_H
#define KD_IPC_IPC_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "ipc/ipc_proto.h"

/* 0 when s is a valid session name within cap bytes ("" included), else -EINVAL. */
int ipc_session_check(const char *s, size_t cap);

/* Structural checks of a record already copied out of shared memory: kind, flags,
 * reserved words, lengths against the protocol's fixed limits, sampling parameters,
 * the session name. 0, or -EPROTO with the reason in why (one line). Token ids and
 * the daemon's own limits are the scheduler's business (error events, not
 * protocol violations). */
int ipc_sub_check(const struct ipc_sub *r, char *why, size_t why_len);

/* Copies the record at *head out of seg's submission ring into rec and checks it.
 * Returns 1 (a record; *head unchanged: the caller calls ipc_sub_advance once it
 * has copied the payload), 0 (ring empty), or -EPROTO (the client's tail is
 * impossible or the record is malformed; why says which). */
int ipc_sub_peek(void *seg, uint32_t head, struct ipc_sub *rec, char *why, size_t why_len);

/* Copies n prompt tokens starting at payload position pos (wrapping) into dst.
 * n must be <= IPC_PAY_TOKENS (ipc_sub_check guarantees it). */
void ipc_pay_read(void *seg, uint32_t pos, uint32_t n, int32_t *dst);

/* Client side: writes n tokens at pos (wrapping). */
void ipc_pay_write(void *seg, uint32_t pos, uint32_t n, const int32_t *src);

/* Publishes head: the client may reuse the slot and the record's payload. */
void ipc_sub_advance(void *seg, uint32_t head);

/* Free event slots for a producer whose private tail is tail, or -EPROTO when the
 * client's ev_head is impossible. */
int ipc_ev_free(void *seg, uint32_t tail);

/* A one-line message for an error event's detail (both sides use it). */
void ipc_detail_describe(const struct ipc_event *ev, char *buf, size_t len);

#endif
