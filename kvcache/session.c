/* The session table: a list (sessions are few and found once per turn), with the
 * reference bookkeeping that keeps the session invariant. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/session.h"

void kv_sessions_init(struct kv_sessions *t)
{
	t->head = NULL;
	t->n = 0;
}

void kv_sessions_fini(struct kv_sessions *t, struct kv_pool *pool, struct kv_host *host)
{
	while (t->head)
		kv_session_destroy(t, t->head, pool, host);
}

int kv_session_name_ok(const char *name)
{
	size_t n = 0;

	if (!name)
		return 0;
	for (; name[n]; n++) {
		unsigned char c = (unsigned char)name[n];

		if (n >= KV_SESSION_NAME_MAX || !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
						  (c >= '0' && c <= '9') || c == '.' || c == '_' ||
						  c == ':' || c == '-'))
			return 0;
	}
	return n > 0;
}

struct kv_session *kv_session_find(const struct kv_sessions *t, const char *name, uint64_t owner)
{
	for (struct kv_session *s = t->head; s; s = s->next)
		if (s->owner == owner && !strcmp(s->name, name))
			return s;
	return NULL;
}

int kv_session_create(struct kv_sessions *t, const char *name, uint64_t owner, uint64_t salt,
		      struct kv_session **out)
{
	struct kv_session *s;

	*out = NULL;
	if (!kv_session_name_ok(name))
		return -EINVAL;
	if (kv_session_find(t, name, owner))
		return -EEXIST;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	strcpy(s->name, name);
	s->owner = owner;
	s->salt = salt;
	s->next = t->head;
	t->head = s;
	t->n++;
	*out = s;
	return 0;
}

void kv_session_drop_kv(struct kv_session *s, struct kv_pool *pool, struct kv_host *host)
{
	for (int i = s->n_blocks - 1; i >= 0; i--) {	/* leaves first into the LRU */
		if (s->dev[i] >= 0)
			kv_pool_unref(pool, s->dev[i]);
		if (s->host[i])
			kv_host_unref(host, s->host[i]);
		s->dev[i] = -1;
		s->host[i] = NULL;
	}
	s->n_blocks = 0;
	s->n_tokens = 0;
}

void kv_session_destroy(struct kv_sessions *t, struct kv_session *s, struct kv_pool *pool,
			struct kv_host *host)
{
	struct kv_session **link = &t->head;

	while (*link && *link != s)
		link = &(*link)->next;
	if (*link) {
		*link = s->next;
		t->n--;
	}
	kv_session_drop_kv(s, pool, host);
	free(s->tokens);
	free(s->dev);
	free(s->host);
	free(s);
}

int kv_session_reserve(struct kv_session *s, int n_tokens, int n_blocks)
{
	if (n_tokens > s->tok_cap) {
		int32_t *t = realloc(s->tokens, (size_t)n_tokens * sizeof(*t));

		if (!t)
			return -ENOMEM;
		s->tokens = t;
		s->tok_cap = n_tokens;
	}
	if (n_blocks > s->blk_cap) {
		int32_t *d = realloc(s->dev, (size_t)n_blocks * sizeof(*d));
		struct kv_host_block **h;

		if (!d)
			return -ENOMEM;
		s->dev = d;
		h = realloc(s->host, (size_t)n_blocks * sizeof(*h));
		if (!h)
			return -ENOMEM;
		s->host = h;
		for (int i = s->blk_cap; i < n_blocks; i++) {
			s->dev[i] = -1;
			s->host[i] = NULL;
		}
		s->blk_cap = n_blocks;
	}
	return 0;
}

int kv_session_blocks_on_device(const struct kv_session *s)
{
	int n = 0;

	for (int i = 0; i < s->n_blocks; i++)
		n += s->dev[i] >= 0;
	return n;
}

int kv_session_blocks_on_host(const struct kv_session *s)
{
	int n = 0;

	for (int i = 0; i < s->n_blocks; i++)
		n += s->host[i] != NULL;
	return n;
}

int kv_sessions_count_owner(const struct kv_sessions *t, uint64_t owner)
{
	int n = 0;

	for (const struct kv_session *s = t->head; s; s = s->next)
		n += s->owner == owner;
	return n;
}

int kv_sessions_owner_device_blocks(const struct kv_sessions *t, uint64_t owner)
{
	int n = 0;

	for (const struct kv_session *s = t->head; s; s = s->next)
		if (s->owner == owner)
			n += kv_session_blocks_on_device(s);
	return n;
}
