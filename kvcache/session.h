/* Sessions: a client's named conversation whose latest KV blocks stay referenced
 * between turns, on the device (block ids) or in the host tier (compressed blocks).
 * Bookkeeping only: the engine moves the bytes and decides when (daemon/engine/engine_session.c). */
#ifndef KD_KVCACHE_SESSION_H
#define KD_KVCACHE_SESSION_H

#include <stdint.h>

#include "kvcache/host_tier.h"
#include "kvcache/kv_pool.h"

/* A session name: 1..KV_SESSION_NAME_MAX bytes of [A-Za-z0-9._:-]. The wire record
 * holds 64 bytes with the NUL (ipc_proto.h); the characters need no escaping in logs,
 * JSON, shells or file names. ipc_session_check and kd_session_name_check apply the
 * same rule (test_sessions checks that all three agree). */
#define KV_SESSION_NAME_MAX 63
#define KV_SESSION_NAME_RULE "1-63 characters of A-Z a-z 0-9 . _ : -"

/* Invariant: every block i < n_blocks has a device copy (dev[i] >= 0, one pool
 * reference held) or a host copy (host[i], one host reference held), or both. */
struct kv_session {
	struct kv_session *next;	/* the table's list */
	char name[KV_SESSION_NAME_MAX + 1];
	uint64_t owner;			/* the client's uid, say: quotas count per owner */
	uint64_t salt;			/* tenant salt of its prefix-cache keys */
	int32_t *tokens;		/* (tok_cap) the history whose KV the blocks hold */
	int n_tokens;
	int tok_cap;
	int32_t *dev;			/* (blk_cap) device block of block i, -1: not on device */
	struct kv_host_block **host;	/* (blk_cap) host copy of block i, or NULL */
	int n_blocks;			/* blocks for n_tokens */
	int blk_cap;
	uint64_t last_used_ns;		/* engine clock at the end of its last turn */
	uint64_t offload_failed_ns;	/* engine clock of the last failed idle offload; 0: none */
	void *job;			/* the engine's move (offload, restore) in flight on it, or NULL */
	int restore_failed;		/* the last such restore failed: the next turn recomputes */
	int busy;			/* a turn is running on it */
	int closing;			/* closed during a turn: freed when the turn ends */
};

struct kv_sessions {
	struct kv_session *head;	/* most recently created first */
	int n;
};

void kv_sessions_init(struct kv_sessions *t);
/* Destroys every session (references dropped through pool and host). */
void kv_sessions_fini(struct kv_sessions *t, struct kv_pool *pool, struct kv_host *host);

/* 1 when name follows the rule above. */
int kv_session_name_ok(const char *name);

struct kv_session *kv_session_find(const struct kv_sessions *t, const char *name, uint64_t owner);

/* A new empty session (not busy). -EINVAL bad name, -EEXIST, -ENOMEM. Owned by t. */
int kv_session_create(struct kv_sessions *t, const char *name, uint64_t owner, uint64_t salt,
		      struct kv_session **out);

/* Unlinks s from t, drops its references and frees it. */
void kv_session_destroy(struct kv_sessions *t, struct kv_session *s, struct kv_pool *pool,
			struct kv_host *host);

/* Drops every block reference and forgets the history: the session stays, empty. */
void kv_session_drop_kv(struct kv_session *s, struct kv_pool *pool, struct kv_host *host);

/* Grows the arrays for n_tokens tokens and n_blocks blocks; new block slots are
 * empty (-1, NULL). 0 or -ENOMEM (the session unchanged). */
int kv_session_reserve(struct kv_session *s, int n_tokens, int n_blocks);

int kv_session_blocks_on_device(const struct kv_session *s);
int kv_session_blocks_on_host(const struct kv_session *s);

/* Sessions of owner, and the device blocks they hold (a block shared by two of them
 * counts twice: the quota is on what each session pins). */
int kv_sessions_count_owner(const struct kv_sessions *t, uint64_t owner);
int kv_sessions_owner_device_blocks(const struct kv_sessions *t, uint64_t owner);

#endif
