/* The client <-> daemon protocol: the socket handshake, the shared-memory segment's
 * layout and the wire records. Both sides include it; any change of a struct or of
 * the layout bumps IPC_PROTOCOL_VERSION, which both sides compare at connect time. */
#ifndef KD_IPC_IPC_PROTO_H
#define KD_IPC_IPC_PROTO_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define IPC_PROTOCOL_VERSION 3u
#define IPC_MAGIC 0x4345444bu		/* "KDEC" little-endian */

/* Segment geometry: fixed per protocol version, so neither side trusts sizes that
 * the other could have changed. */
#define IPC_HDR_BYTES 4096u
#define IPC_SUB_SLOTS 64u		/* submission records; power of two */
#define IPC_EV_SLOTS 1024u		/* event records; power of two */
#define IPC_PAY_TOKENS (1u << 18)	/* payload ring of prompt token ids; power of two */
#define IPC_STOP_MAX 8			/* stop tokens carried inline in a request */
#define IPC_SESSION_MAX 64		/* session name bytes including the NUL */
#define IPC_LINE_MAX 4096		/* longest JSON line on the socket */
#define IPC_MAX_NEW (1u << 24)		/* max_tokens ceiling of the protocol */

/* How the daemon and its clients wake each other (header field notify). */
enum ipc_notify {
	IPC_NOTIFY_FUTEX = 1,		/* futex words in the segment (io_uring on the daemon side) */
	IPC_NOTIFY_EVENTFD = 2,		/* eventfds passed with SCM_RIGHTS */
};

/* Bits of ipc_seg_hdr.client_sleep: how a sleeping client wants to be woken. */
#define IPC_SLEEP_FUTEX 1u		/* futex-waiting on client_bell */
#define IPC_SLEEP_FD 2u			/* polling its notify eventfd (sticky once kd_fd is used) */

/* ipc_seg_hdr.state, written by the daemon. */
enum ipc_state {
	IPC_STATE_OPEN = 1,
	IPC_STATE_CLOSED = 2,		/* the daemon dropped the client; the reason is on the socket */
};

/* Page 0 of the segment. The daemon writes the geometry once before sealing and
 * never reads it back: the client can write anything anywhere in its segment. Each
 * index lives on its own cache line so producer and consumer do not false-share. */
struct ipc_seg_hdr {
	uint32_t magic;			/* IPC_MAGIC */
	uint32_t version;		/* IPC_PROTOCOL_VERSION */
	uint32_t notify;		/* enum ipc_notify */
	uint32_t client_id;		/* the daemon's id for this client (kdctl clients) */
	uint64_t seg_bytes;		/* whole segment, bytes */
	uint32_t sub_off, sub_slots;	/* submission ring: byte offset, records */
	uint32_t ev_off, ev_slots;	/* event ring: byte offset, records */
	uint32_t pay_off, pay_tokens;	/* payload ring: byte offset, int32 token ids */
	uint32_t max_prompt;		/* prompt tokens per request */
	uint32_t max_new;		/* max_tokens per request */
	uint32_t max_inflight;		/* requests in flight per client */
	uint32_t vocab_size;
	char model[64];			/* model_type, NUL-terminated */
	uint8_t pad0[256 - 128];

	_Alignas(64) _Atomic uint32_t sub_tail;	/* client: records written */
	_Alignas(64) _Atomic uint32_t sub_head;	/* daemon: records taken */
	_Alignas(64) _Atomic uint32_t ev_tail;	/* daemon: events written */
	_Alignas(64) _Atomic uint32_t ev_head;	/* client: events read */
	_Alignas(64) _Atomic uint32_t daemon_bell;	/* futex: client bumps + wakes after a submit */
	_Atomic uint32_t daemon_sleeping;	/* daemon: 1 while it may sleep on daemon_bell */
	_Alignas(64) _Atomic uint32_t client_bell;	/* futex: daemon bumps + wakes after publishing */
	_Atomic uint32_t client_sleep;		/* client: IPC_SLEEP_* while it may sleep */
	_Alignas(64) _Atomic uint32_t state;	/* enum ipc_state */
};

/* Submission record kinds. */
enum ipc_sub_kind {
	IPC_SUB_REQUEST = 1,
	IPC_SUB_CANCEL = 2,
};

/* ipc_sub.flags */
#define IPC_SUB_LOGPROBS 1u		/* token events carry the token's logprob */
#define IPC_SUB_TOP_LOGPROB 2u		/* and the most probable token's (needs LOGPROBS) */
#define IPC_SUB_SPEC 4u			/* n-gram speculative decoding on (kdecd --spec's k, n,
					 * else ngram:k=4,n=3); greedy requests only */
#define IPC_SUB_NO_SPEC 8u		/* off; neither flag: as kdecd --spec says */
#define IPC_SUB_FLAGS (IPC_SUB_LOGPROBS | IPC_SUB_TOP_LOGPROB | IPC_SUB_SPEC | IPC_SUB_NO_SPEC)

/* Bounds of the penalties (the daemon refuses others). */
#define IPC_REP_PENALTY_MAX 10.0f	/* repetition_penalty: 0 (off) or (0, 10] */
#define IPC_PENALTY_MAX 2.0f		/* presence / frequency: [-2, 2] */

/* Client -> daemon: one request (or a cancel of one). 192 bytes. Every field is
 * validated after the daemon has copied the record out of shared memory. */
struct ipc_sub {
	uint32_t kind;			/* enum ipc_sub_kind */
	uint32_t flags;			/* IPC_SUB_* */
	uint64_t req_id;		/* client's id, unique among its requests in flight */
	uint64_t t_submit_ns;		/* CLOCK_MONOTONIC when written (latency figures only) */
	uint32_t tok_pos;		/* prompt's first token in the payload ring (mod pay_tokens) */
	uint32_t n_tokens;		/* prompt length, 1..max_prompt */
	uint32_t max_tokens;		/* tokens to generate, 1..max_new */
	int32_t priority;		/* higher runs first */
	float temperature;		/* >= 0, finite; 0 = greedy */
	int32_t top_k;			/* >= 0; 0 = off */
	float top_p;			/* [0, 1]; 0 or 1 = off */
	uint32_t n_stop;		/* 0..IPC_STOP_MAX */
	uint64_t seed;
	int32_t stop[IPC_STOP_MAX];	/* stop token ids */
	char session[IPC_SESSION_MAX];	/* "" or [A-Za-z0-9._:-]{1,63}, NUL-padded */
	float min_p;			/* [0, 1]; 0 = off */
	float repetition_penalty;	/* 0 = off, or (0, IPC_REP_PENALTY_MAX] */
	float presence_penalty;		/* [-IPC_PENALTY_MAX, IPC_PENALTY_MAX]; 0 = off */
	float frequency_penalty;	/* same range; 0 = off */
	uint32_t reserved[4];		/* issue 6 (speculation); 0 */
};

/* Event flags and reasons. */
#define IPC_EV_FINAL 1u			/* the request's last event */
#define IPC_EV_LOGPROB 2u		/* arg[0]: the token's logprob (f32 bits) */
#define IPC_EV_TOP_LOGPROB 4u		/* arg[1]: the most probable token, arg[2]: its
					 * logprob (f32 bits). Natural log, as defined in
					 * kernels/k_sample.h. Only one alternative fits the
					 * 64-byte record: top-n (n <= 20) is engine-level
					 * (engine_step_sample_ext). */

enum ipc_reason {
	IPC_REASON_NONE = 0,
	IPC_REASON_LENGTH = 1,		/* max_tokens generated */
	IPC_REASON_STOP = 2,		/* a stop token was generated (it is included) */
	IPC_REASON_CANCELLED = 3,	/* kd_cancel, the daemon's shutdown, or a stalled ring */
	IPC_REASON_ERROR = 4,		/* refused or failed: err and detail say why */
};

/* What an error event's arg[] mean (for messages without text on the wire). */
enum ipc_detail {
	IPC_DETAIL_NONE = 0,
	IPC_DETAIL_TOKEN_RANGE = 1,	/* arg0 index, arg1 token id, arg2 vocab size */
	IPC_DETAIL_STOP_RANGE = 2,	/* arg0 index, arg1 token id, arg2 vocab size */
	IPC_DETAIL_TOO_LONG = 3,	/* arg0 prompt + max_tokens, arg1 the limit: the model's
					 * positions when arg2 is IPC_LIMIT_POSITIONS, else
					 * the KV cache's tokens */
	IPC_DETAIL_SHUTDOWN = 4,	/* the daemon is draining or shutting down */
	IPC_DETAIL_STALLED = 5,		/* arg0 ms the event ring stayed full */
	IPC_DETAIL_DUP_ID = 6,		/* arg0 low 32 bits of the id already in flight */
	IPC_DETAIL_SESSIONS = 7,	/* arg0 session names per client */
	IPC_DETAIL_ENGINE = 8,		/* the step failed (see the daemon's log) */
	IPC_DETAIL_CANCEL = 9,		/* cancelled by the client */
	IPC_DETAIL_CLIENT_TOKENS = 10,	/* arg0 the client's tokens in flight with it, arg1 the cap */
	IPC_DETAIL_SHUTDOWN_TIMEOUT = 11,	/* cancelled at shutdown: arg0 the timeout, ms */
	IPC_DETAIL_SESSION_LIMIT = 12,	/* arg0 sessions the uid keeps, arg1 the limit per uid, arg2 the uid */
};

/* IPC_DETAIL_TOO_LONG's arg2 when the limit is the model's max_position_embeddings
 * (any other value, the vocabulary size daemons have always sent there: the KV cache). */
#define IPC_LIMIT_POSITIONS 0xffffffffu

/* Daemon -> client: one token, or the end of a request. 64 bytes. arg[] are detail
 * arguments on error events and logprobs on token events with IPC_EV_LOGPROB. */
struct ipc_event {
	uint64_t req_id;
	int32_t token;			/* -1 when the event carries none */
	uint32_t index;			/* the token's index in the output */
	uint32_t flags;			/* IPC_EV_* */
	uint16_t reason;		/* enum ipc_reason, with IPC_EV_FINAL */
	uint16_t detail;		/* enum ipc_detail */
	union {
		int32_t err;		/* negative errno with IPC_REASON_ERROR */
		uint32_t cached;	/* on a request's first token event (index 0, no
					 * error): its prompt tokens taken from the KV cache
					 * (prefix cache or session) instead of computed */
	};
	uint32_t arg[3];		/* detail arguments */
	uint64_t t_submit_ns;		/* the request's own t_submit_ns, echoed */
	uint64_t t_pickup_ns;		/* CLOCK_MONOTONIC when the daemon took the request */
	uint64_t t_publish_ns;		/* CLOCK_MONOTONIC when this event was written */
};

_Static_assert(sizeof(struct ipc_seg_hdr) <= IPC_HDR_BYTES, "header fits page 0");
_Static_assert(sizeof(struct ipc_sub) == 192, "submission record size is wire format");
_Static_assert(sizeof(struct ipc_event) == 64, "event record size is wire format");

/* Byte offsets of the parts (page-aligned where it matters). */
#define IPC_SUB_OFF IPC_HDR_BYTES
#define IPC_EV_OFF (IPC_SUB_OFF + IPC_SUB_SLOTS * (uint32_t)sizeof(struct ipc_sub))
#define IPC_PAY_OFF (IPC_EV_OFF + IPC_EV_SLOTS * (uint32_t)sizeof(struct ipc_event))
#define IPC_SEG_BYTES (IPC_PAY_OFF + IPC_PAY_TOKENS * (uint32_t)sizeof(int32_t))

static inline struct ipc_sub *ipc_seg_sub(void *seg, uint32_t slot)
{
	return (struct ipc_sub *)((char *)seg + IPC_SUB_OFF) + (slot & (IPC_SUB_SLOTS - 1));
}

static inline struct ipc_event *ipc_seg_ev(void *seg, uint32_t slot)
{
	return (struct ipc_event *)((char *)seg + IPC_EV_OFF) + (slot & (IPC_EV_SLOTS - 1));
}

static inline int32_t *ipc_seg_pay(void *seg)
{
	return (int32_t *)((char *)seg + IPC_PAY_OFF);
}

/* Socket messages are single JSON lines:
 *   client -> daemon  {"hello":"kdclient","protocol":3,"spin":false}
 *   daemon -> client  {"ok":true,"protocol":3,"notify":"futex","seg_bytes":N,"client_id":I}
 *                     with SCM_RIGHTS: memfd, notify eventfd[, doorbell eventfd]
 *                  or {"ok":false,"error":"..."} and the socket closed
 *   kdctl  -> daemon  {"cmd":"status"} ... one reply line each (daemon/serve/control.h) */

/* The default socket: $XDG_RUNTIME_DIR/kdecd.sock; else /run/kdecd/kdecd.sock for root;
 * else /tmp/kdecd-$UID/kdecd.sock. Returns 0 or -ENAMETOOLONG. */
int ipc_default_socket(char *buf, size_t len);

#endif
