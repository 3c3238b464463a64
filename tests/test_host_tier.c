/* The host tier's parts on their own: SipHash against the published test vectors,
 * block keys, the byte shuffle, the codec round trip and its refusal of damaged
 * frames, the store's budget, sharing by key and reference counts; and the prefix
 * index's chains. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/host_tier.h"
#include "kvcache/prefix_index.h"
#include "tests/testutil.h"

static void test_siphash(void)
{
	/* key 00..0f, messages 00 01 02 ... (the reference vectors of SipHash-2-4) */
	const uint64_t key[2] = { 0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL };
	const uint8_t v128_empty[16] = { 0xa3, 0x81, 0x7f, 0x04, 0xba, 0x25, 0xa8, 0xe6,
					 0x6d, 0xf6, 0x72, 0x14, 0xc7, 0x55, 0x02, 0x93 };
	uint8_t msg[64], got[16];
	struct kv_siphash h;
	struct kv_key k;

	for (int i = 0; i < 64; i++)
		msg[i] = (uint8_t)i;
	CHECK(kv_siphash64(key, msg, 0) == 0x726fdb47dd0e0e31ULL, "SipHash-2-4-64 of the empty message");
	CHECK(kv_siphash64(key, msg, 15) == 0xa129ca6149be45e5ULL, "SipHash-2-4-64 of 15 bytes");
	k = kv_siphash128(key, msg, 0);
	for (int i = 0; i < 8; i++) {
		got[i] = (uint8_t)(k.lo >> (8 * i));
		got[8 + i] = (uint8_t)(k.hi >> (8 * i));
	}
	CHECK(!memcmp(got, v128_empty, 16), "SipHash-2-4-128 of the empty message");
	/* incremental in odd pieces == one shot */
	kv_siphash_init(&h, key, 1);
	kv_siphash_update(&h, msg, 3);
	kv_siphash_update(&h, msg + 3, 1);
	kv_siphash_update(&h, msg + 4, 60);
	CHECK(kv_key_eq(kv_siphash_final128(&h), kv_siphash128(key, msg, 64)), "incremental == one shot");
}

static void test_block_keys(void)
{
	const uint64_t key[2] = { 1, 2 }, other[2] = { 1, 3 };
	struct kv_key zero = { 0, 0 }, k0, k1, k1b;
	int32_t t[32];

	for (int i = 0; i < 32; i++)
		t[i] = i * 31;
	k0 = kv_block_key(key, 5, zero, t, 16);
	k1 = kv_block_key(key, 5, k0, t + 16, 16);
	CHECK(kv_key_eq(k0, kv_block_key(key, 5, zero, t, 16)), "deterministic");
	CHECK(!kv_key_eq(k0, kv_block_key(key, 6, zero, t, 16)), "salt changes the key");
	CHECK(!kv_key_eq(k0, kv_block_key(other, 5, zero, t, 16)), "secret key changes the key");
	CHECK(!kv_key_eq(k1, kv_block_key(key, 5, zero, t + 16, 16)), "the parent changes the key");
	t[3]++;
	k1b = kv_block_key(key, 5, kv_block_key(key, 5, zero, t, 16), t + 16, 16);
	CHECK(!kv_key_eq(k1, k1b), "a change in block 0 changes block 1's key");
}

static void test_shuffle(void)
{
	uint8_t src[4 * 37], sh[4 * 37], back[4 * 37];

	for (size_t i = 0; i < sizeof(src); i++)
		src[i] = (uint8_t)(i * 13 + 7);
	for (size_t eb = 1; eb <= 4; eb++) {
		size_t n = 37;

		kv_shuffle(sh, src, n, eb);
		kv_unshuffle(back, sh, n, eb);
		CHECK(!memcmp(back, src, n * eb), "round trip, %zu-byte elements", eb);
		CHECK(sh[1] == src[eb] && (eb == 1 || sh[n] == src[1]), "plane layout, %zu-byte elements", eb);
	}
}

/* bf16-like data: one exponent byte of few values, one noisy mantissa byte. */
static void fill_kv(uint8_t *p, size_t n_elems, unsigned long long *seed)
{
	for (size_t i = 0; i < n_elems; i++) {
		float f = test_randf(seed);

		p[2 * i] = (uint8_t)((int)(f * 1000.0f) & 0xff);
		p[2 * i + 1] = (uint8_t)(0x3c + (f > 0.5f) - (f < -0.5f));
	}
}

static void test_codec(void)
{
	const size_t raw = 8192;
	struct kv_codec c, plain;
	uint8_t *in = malloc(raw), *out = malloc(raw), *z, *bad;
	unsigned long long seed = 3;
	size_t zb = 0, zb_plain = 0, bound;

	fill_kv(in, raw / 2, &seed);
	CHECK(kv_codec_init(&c, raw, 2, 1, 1) == 0 && kv_codec_init(&plain, raw, 2, 1, 0) == 0, "init");
	CHECK(kv_codec_init(&(struct kv_codec){ 0 }, 7, 2, 1, 1) == -EINVAL, "odd size refused");
	bound = kv_codec_bound(&c);
	z = malloc(bound);
	bad = malloc(bound);
	CHECK(kv_codec_compress(&c, z, bound, &zb, in) == 0 && zb > 0 && zb < raw, "compress (%zu bytes)", zb);
	CHECK(kv_codec_decompress(&c, out, z, zb) == 0 && !memcmp(in, out, raw), "round trip");
	CHECK(kv_codec_compress(&plain, bad, bound, &zb_plain, in) == 0, "compress unshuffled");
	CHECK(zb < zb_plain, "the shuffle helps on bf16-like data (%zu vs %zu bytes)", zb, zb_plain);
	CHECK(kv_codec_decompress(&c, out, z, zb - 1) == -EBADMSG, "truncated frame refused");
	for (size_t at = 0; at < zb; at += zb / 7 + 1) {
		memcpy(bad, z, zb);
		bad[at] ^= 0x20;
		CHECK(kv_codec_decompress(&c, out, bad, zb) == -EBADMSG, "bit flip at byte %zu refused", at);
	}
	memcpy(bad, z, zb);
	bad[zb] = 0;
	CHECK(kv_codec_decompress(&c, out, bad, zb + 1) == -EBADMSG, "trailing byte refused");
	kv_codec_fini(&c);
	kv_codec_fini(&plain);
	kv_codec_fini(&c);	/* twice: zeroed */
	free(in);
	free(out);
	free(z);
	free(bad);
}

static void test_store(void)
{
	struct kv_host h;
	struct kv_host_block *a, *b, *c, *d;
	struct kv_key k1 = { 1, 11 }, k2 = { 2, 22 }, k3 = { 1 + 64, 33 };	/* k3 shares k1's bucket */
	uint8_t z[100];

	memset(z, 7, sizeof(z));
	CHECK(kv_host_init(&h, 3 * kv_host_cost(100)) == 0, "init");
	CHECK(kv_host_add(&h, &k1, 9, z, 100, &a) == 0 && a->refs == 1, "add keyed");
	CHECK(kv_host_add(&h, &k1, 9, z, 100, &b) == 0 && b == a && a->refs == 2, "same key shares");
	CHECK(kv_host_add(&h, &k1, 8, z, 100, &c) == 0 && c != a, "another salt does not");
	CHECK(kv_host_find(&h, k1, 9) == a && kv_host_find(&h, k1, 8) == c && !kv_host_find(&h, k2, 9),
	      "find");
	CHECK(kv_host_add(&h, NULL, 9, z, 100, &d) == 0 && !d->keyed, "private block");
	CHECK(h.used == 3 * kv_host_cost(100) && h.n_blocks == 3, "accounting");
	CHECK(kv_host_add(&h, &k3, 9, z, 100, &b) == -ENOSPC, "over budget refused");
	kv_host_unref(&h, d);
	CHECK(kv_host_add(&h, &k3, 9, z, 100, &b) == 0, "fits after a free");
	kv_host_unref(&h, a);
	CHECK(kv_host_find(&h, k1, 9) == a, "still held once");
	kv_host_unref(&h, a);
	CHECK(!kv_host_find(&h, k1, 9) && kv_host_find(&h, k3, 9) == b, "freed at zero, chain intact");
	kv_host_unref(&h, b);
	kv_host_unref(&h, c);
	CHECK(h.used == 0 && h.n_blocks == 0, "empty");
	/* many keyed blocks: the table grows and still finds them all */
	h.budget = (size_t)-1;
	for (uint64_t i = 0; i < 1000; i++)
		kv_host_add(&h, &(struct kv_key){ i * 0x9e3779b97f4a7c15ULL, i }, 0, z, 10, &a);
	for (uint64_t i = 0; i < 1000; i++)
		if (!kv_host_find(&h, (struct kv_key){ i * 0x9e3779b97f4a7c15ULL, i }, 0))
			CHECK(0, "block %llu lost when the table grew", (unsigned long long)i);
	kv_host_fini(&h);
}

static void test_prefix_index(void)
{
	const uint64_t key[2] = { 5, 6 };
	struct kv_prefix x;

	CHECK(kv_prefix_init(&x, 4, key) == 0, "init");
	/* four keys in one bucket (the low bits pick it) */
	for (int b = 0; b < 4; b++)
		CHECK(kv_prefix_insert(&x, (struct kv_key){ (uint64_t)b << 8, (uint64_t)b }, 1, b) == 0, "insert %d", b);
	CHECK(kv_prefix_insert(&x, (struct kv_key){ 0, 0 }, 1, 3) == -EEXIST, "key taken");
	CHECK(kv_prefix_insert(&x, (struct kv_key){ 9, 9 }, 1, 2) == -EEXIST, "block registered");
	CHECK(kv_prefix_insert(&x, (struct kv_key){ 9, 9 }, 1, 4) == -EINVAL, "bad block");
	kv_prefix_remove(&x, 2);
	for (int b = 0; b < 4; b++)
		CHECK(kv_prefix_find(&x, (struct kv_key){ (uint64_t)b << 8, (uint64_t)b }, 1) == (b == 2 ? -ENOENT : b),
		      "find %d after removing 2", b);
	CHECK(kv_prefix_find(&x, (struct kv_key){ 1 << 8, 1 }, 2) == -ENOENT, "salt compared");
	kv_prefix_evict_cb(&x, 0);
	kv_prefix_remove(&x, 0);	/* twice: no-op */
	CHECK(x.n_entries == 2, "entries %d", x.n_entries);
	kv_prefix_fini(&x);
}

int main(void)
{
	test_siphash();
	test_block_keys();
	test_shuffle();
	test_codec();
	test_store();
	test_prefix_index();
	return test_result("test_host_tier");
}
