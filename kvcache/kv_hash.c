/* SipHash-2-4 (Aumasson and Bernstein), written from the paper's description: 2
 * compression rounds per 8-byte word, 4 finalisation rounds; the 128-bit variant
 * xors 0xee into v1 at init and v2 at finalisation, then 0xdd into v1 for the
 * second half. Used for block keys (secret key) and file checksums (fixed key). */
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "kvcache/kv_hash.h"

static inline uint64_t rotl(uint64_t x, int b)
{
	return (x << b) | (x >> (64 - b));
}

static inline void sip_round(struct kv_siphash *h)
{
	h->v0 += h->v1;
	h->v1 = rotl(h->v1, 13);
	h->v1 ^= h->v0;
	h->v0 = rotl(h->v0, 32);
	h->v2 += h->v3;
	h->v3 = rotl(h->v3, 16);
	h->v3 ^= h->v2;
	h->v0 += h->v3;
	h->v3 = rotl(h->v3, 21);
	h->v3 ^= h->v0;
	h->v2 += h->v1;
	h->v1 = rotl(h->v1, 17);
	h->v1 ^= h->v2;
	h->v2 = rotl(h->v2, 32);
}

static inline void sip_word(struct kv_siphash *h, uint64_t m)
{
	h->v3 ^= m;
	sip_round(h);
	sip_round(h);
	h->v0 ^= m;
}

static inline uint64_t load_le64(const unsigned char *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

void kv_siphash_init(struct kv_siphash *h, const uint64_t key[2], int out128)
{
	h->v0 = key[0] ^ 0x736f6d6570736575ULL;
	h->v1 = key[1] ^ 0x646f72616e646f6dULL;
	h->v2 = key[0] ^ 0x6c7967656e657261ULL;
	h->v3 = key[1] ^ 0x7465646279746573ULL;
	if (out128)
		h->v1 ^= 0xee;
	h->tail = 0;
	h->n_tail = 0;
	h->len = 0;
}

void kv_siphash_update(struct kv_siphash *h, const void *p, size_t n)
{
	const unsigned char *b = p;

	h->len += n;
	while (n && h->n_tail) {
		h->tail |= (uint64_t)*b++ << (8 * h->n_tail);
		n--;
		if (++h->n_tail == 8) {
			sip_word(h, h->tail);
			h->tail = 0;
			h->n_tail = 0;
		}
	}
	for (; n >= 8; n -= 8, b += 8)
		sip_word(h, load_le64(b));
	while (n--)
		h->tail |= (uint64_t)*b++ << (8 * h->n_tail++);
}

static void sip_last(struct kv_siphash *h)
{
	sip_word(h, h->tail | (h->len << 56));
}

uint64_t kv_siphash_final64(struct kv_siphash *h)
{
	sip_last(h);
	h->v2 ^= 0xff;
	for (int i = 0; i < 4; i++)
		sip_round(h);
	return h->v0 ^ h->v1 ^ h->v2 ^ h->v3;
}

struct kv_key kv_siphash_final128(struct kv_siphash *h)
{
	struct kv_key k;

	sip_last(h);
	h->v2 ^= 0xee;
	for (int i = 0; i < 4; i++)
		sip_round(h);
	k.lo = h->v0 ^ h->v1 ^ h->v2 ^ h->v3;
	h->v1 ^= 0xdd;
	for (int i = 0; i < 4; i++)
		sip_round(h);
	k.hi = h->v0 ^ h->v1 ^ h->v2 ^ h->v3;
	return k;
}

uint64_t kv_siphash64(const uint64_t key[2], const void *p, size_t n)
{
	struct kv_siphash h;

	kv_siphash_init(&h, key, 0);
	kv_siphash_update(&h, p, n);
	return kv_siphash_final64(&h);
}

struct kv_key kv_siphash128(const uint64_t key[2], const void *p, size_t n)
{
	struct kv_siphash h;

	kv_siphash_init(&h, key, 1);
	kv_siphash_update(&h, p, n);
	return kv_siphash_final128(&h);
}

static void update_u64(struct kv_siphash *h, uint64_t v)
{
	unsigned char b[8];

	for (int i = 0; i < 8; i++)
		b[i] = (unsigned char)(v >> (8 * i));
	kv_siphash_update(h, b, 8);
}

struct kv_key kv_block_key(const uint64_t key[2], uint64_t salt, struct kv_key parent,
			   const int32_t *tokens, int n)
{
	struct kv_siphash h;
	unsigned char buf[256];
	int used = 0;

	kv_siphash_init(&h, key, 1);
	update_u64(&h, salt);
	update_u64(&h, parent.lo);
	update_u64(&h, parent.hi);
	/* tokens as little-endian 32-bit words, batched to keep the update calls few */
	for (int i = 0; i < n; i++) {
		uint32_t t = (uint32_t)tokens[i];

		buf[used++] = (unsigned char)t;
		buf[used++] = (unsigned char)(t >> 8);
		buf[used++] = (unsigned char)(t >> 16);
		buf[used++] = (unsigned char)(t >> 24);
		if (used == (int)sizeof(buf)) {
			kv_siphash_update(&h, buf, (size_t)used);
			used = 0;
		}
	}
	kv_siphash_update(&h, buf, (size_t)used);
	return kv_siphash_final128(&h);
}

int kv_hash_random_key(uint64_t key[2])
{
	struct timespec ts;
	ssize_t got = getrandom(key, 2 * sizeof(uint64_t), GRND_NONBLOCK);

	if (got == (ssize_t)(2 * sizeof(uint64_t)))
		return 0;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	key[0] = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ULL ^ (uint64_t)ts.tv_sec;
	key[1] = (uint64_t)getpid() * 0xc2b2ae3d27d4eb4fULL ^ (uint64_t)(uintptr_t)key;
	return got < 0 ? -errno : -EIO;
}
