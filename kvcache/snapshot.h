/* The session snapshot file: every session's token history and compressed KV blocks,
 * written atomically under a state directory and read back only when all of it checks.
 *
 * Layout, little-endian:
 *   header  (KV_SNAP_HEADER_BYTES) magic, version, model fingerprint, block geometry,
 *           counts, lengths, and a SipHash-64 of the header's other bytes;
 *   meta    one zstd frame (content checksum) of the session records:
 *           u8 name_len, name, u64 owner, u64 salt, u32 n_tokens, u32 tokens[n_tokens];
 *   blocks  per session, per block (ceil(n_tokens / block_tokens) of them): u64 length,
 *           then the block's zstd frame as the host tier stores it (host_tier.h).
 * Written to a temporary file (.kv-sessions.snap.PID.tmp), fsync'd, renamed over the
 * old one, the directory fsync'd: a crash leaves the previous snapshot or the new one,
 * never a mix; kv_snap_clean_temps removes the temporary files of killed writers. */
#ifndef KD_KVCACHE_SNAPSHOT_H
#define KD_KVCACHE_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/session.h"

#define KV_SNAP_FILE "kv-sessions.snap"
#define KV_SNAP_ASIDE ".refused-"		/* KV_SNAP_FILE KV_SNAP_ASIDE time: set aside */
#define KV_SNAP_VERSION 1
#define KV_SNAP_HEADER_BYTES 128
#define KV_SNAP_DESC_MAX 32		/* bytes of the description, NUL included */
#define KV_SNAP_SHUFFLED 0x1		/* flags: block frames hold byte-shuffled data */

/* What a snapshot's blocks are valid for: a reader refuses any difference. */
struct kv_snap_meta {
	uint64_t fingerprint[2];	/* of the model, its config, the KV dtype and layout */
	char desc[KV_SNAP_DESC_MAX];	/* the same in words, for the refusal message */
	uint32_t block_tokens;
	uint32_t elem_bytes;		/* bytes per cached K/V element */
	uint64_t block_bytes;		/* raw bytes of one block, all layers */
	uint32_t flags;			/* KV_SNAP_* */
};

/* One session; the writer's tokens are the caller's, the reader's point into
 * struct kv_snap_file. */
struct kv_snap_session {
	char name[KV_SESSION_NAME_MAX + 1];
	uint64_t owner;
	uint64_t salt;
	const int32_t *tokens;		/* (n_tokens) */
	int n_tokens;
	int n_blocks;			/* ceil(n_tokens / block_tokens) */
	const uint8_t **z;		/* reader: (n_blocks) frames, inside the mapped file */
	const size_t *zbytes;		/* reader: (n_blocks) */
};

/* The writer asks for block b of session s: a frame that stays valid until the next
 * call. 0 or -errno (the write is abandoned). */
typedef int (*kv_snap_frame_fn)(void *ctx, int s, int b, const void **z, size_t *zbytes);

/* Writes dir/KV_SNAP_FILE (mode 0600). 0 or -errno with one line in err; on error the
 * previous snapshot is untouched. */
int kv_snap_write(const char *dir, const struct kv_snap_meta *meta, const struct kv_snap_session *s,
		  int n, kv_snap_frame_fn frame, void *ctx, char *err, size_t err_len);

/* A snapshot read and checked in full: every frame decoded once against its checksum. */
struct kv_snap_file {
	void *map;			/* the file, mapped read-only */
	size_t len;
	struct kv_snap_meta meta;
	int n_sessions;
	struct kv_snap_session *sessions;	/* (n_sessions), owned */
	int32_t *tokens;		/* all histories, owned */
	const uint8_t **z;		/* all frames, owned array */
	size_t *zbytes;
};

/* Reads dir/KV_SNAP_FILE and checks everything against expect before returning.
 * Returns 0; -ENOENT (no snapshot); -EBADMSG (damaged or truncated); -ESTALE (another
 * model, config, dtype or block size); -ENOMEM; other -errno from the file system; with
 * one line in err. *f is filled only on success: release it with kv_snap_release. */
int kv_snap_read(struct kv_snap_file *f, const char *dir, const struct kv_snap_meta *expect,
		 char *err, size_t err_len);
void kv_snap_release(struct kv_snap_file *f);	/* accepts a zeroed file */

/* Renames dir/KV_SNAP_FILE to dir/KV_SNAP_FILE.refused-YYYYmmddTHHMMSSZ[-k], never
 * over an existing file; the new path in aside. 0 or -errno with one line in err. */
int kv_snap_set_aside(const char *dir, char *aside, size_t aside_len, char *err, size_t err_len);

/* Removes dir's temporary snapshot files whose writer is gone (its pid is ours or no
 * live process; the pid-less name of older builds): the number removed, the first
 * one's name in first. Regular files only; errors leave a file where it is. */
int kv_snap_clean_temps(const char *dir, char *first, size_t first_len);

#endif
