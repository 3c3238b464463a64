/* libFuzzer target: the daemon's reader of a client's segment. The input is laid
 * over the header and the submission ring (indices, records, lengths, offsets: all
 * hostile); the reader must never crash or read outside the segment, and every
 * record it accepts must satisfy the bounds the scheduler relies on. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/ipc_record.h"
#include "ipc/ipc_ring.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void *seg;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int32_t tokens[IPC_PAY_TOKENS];
	struct ipc_seg_hdr *h;
	struct ipc_sub rec;
	char why[256];
	uint32_t head;
	size_t n;

	if (!seg && !(seg = aligned_alloc(4096, IPC_SEG_BYTES)))
		return 0;
	memset(seg, 0, IPC_PAY_OFF);
	n = size < IPC_EV_OFF ? size : IPC_EV_OFF;
	memcpy(seg, data, n);
	h = seg;
	/* The daemon's private head: take it from the input too. */
	head = size >= 4 ? (uint32_t)data[size - 1] << 24 | (uint32_t)data[size - 2] << 16 |
			   (uint32_t)data[size - 3] << 8 | data[size - 4] : 0;
	for (int i = 0; i < 2 * (int)IPC_SUB_SLOTS + 2; i++) {
		int r = ipc_sub_peek(seg, head, &rec, why, sizeof(why));

		if (r <= 0) {
			if (r < 0 && (!why[0] || !memchr(why, '\0', sizeof(why))))
				__builtin_trap();
			break;
		}
		if (rec.kind == IPC_SUB_REQUEST) {
			if (rec.n_tokens < 1 || rec.n_tokens > IPC_PAY_TOKENS || rec.n_stop > IPC_STOP_MAX ||
			    rec.max_tokens < 1 || rec.max_tokens > IPC_MAX_NEW || !memchr(rec.session, '\0', IPC_SESSION_MAX) ||
			    !(rec.temperature >= 0) || !(rec.top_p >= 0 && rec.top_p <= 1) || rec.top_k < 0)
				__builtin_trap();
			ipc_pay_read(seg, rec.tok_pos, rec.n_tokens, tokens);
		} else if (rec.kind != IPC_SUB_CANCEL) {
			__builtin_trap();
		}
		head++;
		ipc_sub_advance(seg, head);
	}
	if (ipc_ev_free(seg, head) > (int)IPC_EV_SLOTS)
		__builtin_trap();
	(void)h;
	return 0;
}
