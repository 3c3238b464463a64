/* Speculative decoding in the scheduler: n-gram drafts for a running request's
 * decode, and the verification of those drafts once the step has sampled every row:
 * each row is drawn by the request's own sampler (greedy or seeded, penalties,
 * logprobs) and a draft stands while the draw agrees (spec_accept), so output is
 * what plain decoding gives, token for token. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/base/log.h"
#include "daemon/sched/sched_internal.h"

/* Tokens r may feed this step within the KV blocks it has, its claim and the
 * spare ones: drafts never cause a preemption. */
static int fed_room(const struct sched *s, const struct sched_req *r)
{
	int spare = sched_spare(s);
	int64_t blocks = (int64_t)r->seq.n_blocks + sched_claim(s, r) + (spare > 0 ? spare : 0);
	int64_t room = blocks * s->e->pool.block_tokens - r->seq.n_tokens;

	return room < SPEC_MAX_K + 1 ? (int)room : SPEC_MAX_K + 1;
}

/* Room in r->out for its output and nd drafts (the penalties' history of the
 * verification rows). 0 or -ENOMEM. */
static int out_reserve(struct sched_req *r, int nd)
{
	int need = r->n_gen + nd, cap = need > 2 * r->cap_out ? need : 2 * r->cap_out;
	int32_t *v;

	if (!k_sample_has_penalty(&r->sp) || need <= r->cap_out)
		return 0;
	v = realloc(r->out, (size_t)cap * sizeof(*v));
	if (!v)
		return -ENOMEM;
	r->out = v;
	r->cap_out = cap;
	return 0;
}

/* Drafts for r's next decode into r->fed[1..], at most room of them; 0: r decodes
 * plainly. Every request may speculate: its draws verify the drafts. */
static int spec_drafts(struct sched *s, struct sched_req *r, int room)
{
	int k = r->spec_k, left = r->max_tokens - r->n_gen - 1, nh = r->seq.n_tokens + 1, blocks_room;

	if (!k)
		return 0;
	blocks_room = fed_room(s, r) - 1;
	k = k < left ? k : left;
	k = k < room ? k : room;
	k = k < blocks_room ? k : blocks_room;
	if (k <= 0 || out_reserve(r, k))
		return 0;	/* no drafts is always correct */
	if (nh > s->spec_cap) {
		int cap = nh > 2 * s->spec_cap ? nh : 2 * s->spec_cap;
		int32_t *h = realloc(s->spec_hist, (size_t)cap * sizeof(*h));

		if (!h)
			return 0;	/* no drafts is always correct */
		s->spec_hist = h;
		s->spec_cap = cap;
	}
	/* the history: what the KV holds (prompt, output) and the token fed next */
	memcpy(s->spec_hist, r->seq.tokens, (size_t)r->seq.n_tokens * sizeof(int32_t));
	s->spec_hist[nh - 1] = r->last;
	return spec_ngram_propose(s->spec_hist, nh, r->spec_n, k, r->fed + 1);
}

/* A decode of r: its last token, and drafts to verify when it speculates. Each
 * token the step may emit takes a budget token and an event slot. */
void sched_add_decode(struct sched *s, int *n, struct sched_req *r, int *budget)
{
	int nd = spec_drafts(s, r, *budget - 1 < r->c->step_space - 1 ? *budget - 1 : r->c->step_space - 1);

	r->fed[0] = r->last;
	sched_add(s, n, r, r->fed, 1 + nd);
	if (nd) {
		s->ereq[*n - 1].all_logits = 1;
		s->ereq[*n - 1].n_draft = nd;
		/* row j draws output token n_gen + j: its counter, and its penalties'
		 * history holds drafts 1..j as output (they are, if it is reached) */
		for (int j = 1; j <= nd; j++, s->n_rows++) {
			s->sp[s->n_rows] = r->sp;
			s->hist[s->n_rows] = s->hist[s->n_rows - 1];
			s->steps[s->n_rows] = (uint64_t)(r->n_gen + j);
			if (r->out) {
				r->out[r->n_gen + j - 1] = r->fed[j];
				s->hist[s->n_rows].n_out = r->n_gen + j;
			}
		}
	}
	r->step_fed = 1 + nd;	/* its drafts' blocks join its claim */
	r->c->step_space -= 1 + nd;
	*budget -= 1 + nd;
}

/* A verification step of r: ids (q->n_tokens) the token drawn after each fed one,
 * lp (q->n_tokens) their logprobs. Emits the drafts the draws agree with and the
 * draw after them, cut after a stop token, and rolls the KV of the rest back. */
void sched_deliver_spec(struct sched *s, struct sched_req *r, const struct engine_req *q,
			const int32_t *ids, const struct k_sample_logprobs *lp, uint64_t now)
{
	int nd = q->n_draft, m = 1 + spec_accept(ids, q->tokens + 1, nd), ret;

	for (int j = 0; j < m - 1; j++)
		for (int k = 0; k < r->n_stop; k++)
			if (ids[j] == r->stop[k])
				m = j + 1;
	s->m.spec_draft_tokens += (uint64_t)nd;
	s->m.spec_accepted_tokens += (uint64_t)(m - 1);
	/* the KV keeps the fed tokens that are now output: last and m - 1 drafts */
	ret = engine_seq_truncate(s->e, &r->seq, r->seq.n_tokens - (nd + 1 - m));
	if (ret) {
		log_error("client %u request %llu: KV rollback failed: %s", r->c->id,
			  (unsigned long long)r->id, strerror(-ret));
		sched_finish(s, r, IPC_REASON_ERROR, IPC_DETAIL_ENGINE, ret, 0, 1);
		return;
	}
	/* drafts stop short of max_tokens and of a stop token: only the last of these
	 * may end r (and free it) */
	for (int j = 0; j < m; j++)
		sched_deliver(s, r, ids[j], &lp[j], now);
}
