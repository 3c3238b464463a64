/* The CUDA backend's MLA decode context parallel (docs/PARALLEL.md, forward_tp.c's
 * forward_tp_mla_attn): the ranks' exchange on one GPU (virtual ranks) in device memory
 * every rank's stream reads and writes (the absorbed q rows, every rank's split
 * partials), and events that start a stage only once every rank's stage before is done.
 *
 * Why the stages cannot reorder: rank r records done[s][r] after its stage s; the
 * caller's barrier then guarantees every rank's record is queued before any rank queues
 * stage s + 1, which waits for all of them. A buffer read in stage s + 1 is written again
 * only by the next layer's stage s, queued after this layer's reductions, which wait for
 * every rank's work before them (backend_cuda_tp.c); done[s][r] is recorded again only
 * after the next barrier, once every rank has queued its wait for it. One rank per GPU
 * (peer stores into one buffer) waits for a multi-GPU machine. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/cuda/backend_cuda.h"
#include "daemon/base/log.h"
#include "kernels/cuda/attn/k_cuda_mla_cp.h"

#define CP_MAX_RANKS 8
/* Partials one rank holds: this many splits at max_rows (more splits for fewer rows) */
#define CP_SPLITS_AT_MAX_ROWS 2
#define CP_SPLIT_ROWS_MIN 32	/* ... and at least this many split-rows */

struct cuda_mla_cp {
	int n, max_rows, bt, trash;
	struct k_mla_dims d;		/* the model's: d.n_heads every rank's heads (H) */
	float *q;			/* (max_rows, H, kv_lora + rope) absorbed q, rank r writing
					 * its heads' columns */
	float *o;			/* (n * cap) this step's split partials: (n * S, rows, H,
					 * kv_lora), rank r's splits [r S, r S + S) */
	float *lse;			/* (n * cap / kv_lora) their log2-sum-exp2 (n * S, rows, H) */
	size_t cap;			/* floats of one rank's partials */
	struct {
		struct backend_cuda *b;		/* the rank's backend (its stream) */
		struct k_cuda_attn_ws *ws;	/* its workspace, for all H heads */
		int32_t *slots, *ctx;		/* (max_rows) its cache rows of the step's latents,
						 * the tokens of each row it holds */
		cudaEvent_t done[2];		/* its stage 0, stage 1 */
	} r[CP_MAX_RANKS];
};

void cuda_mla_cp_destroy(void *cp)
{
	struct cuda_mla_cp *c = cp;

	if (!c)
		return;
	for (int r = 0; r < c->n; r++) {
		if (!c->r[r].b)
			continue;	/* create failed before this rank */
		cudaSetDevice(c->r[r].b->dev);
		k_cuda_attn_ws_destroy(c->r[r].ws);
		cudaFree(c->r[r].slots);
		cudaFree(c->r[r].ctx);
		for (int s = 0; s < 2; s++)
			if (c->r[r].done[s])
				cudaEventDestroy(c->r[r].done[s]);
	}
	if (c->r[0].b)
		cudaSetDevice(c->r[0].b->dev);	/* the exchange's GPU, the caller's current one */
	cudaFree(c->q);
	cudaFree(c->o);
	cudaFree(c->lse);
	free(c);
}

/* Rank r's workspace, rows and events, on its GPU. */
static int cp_rank_create(struct cuda_mla_cp *c, int r, int max_ctx)
{
	struct backend_cuda *b = c->r[r].b;
	int wd = c->d.kv_lora + c->d.rope_dim, ret;

	if ((ret = CUDA_CHECK(b, cudaSetDevice(b->dev))) ||
	    (ret = k_cuda_attn_ws_create(&c->r[r].ws, c->max_rows, c->d.n_heads,
					 wd > c->d.v_dim ? wd : c->d.v_dim, max_ctx)) ||
	    (ret = CUDA_CHECK(b, cudaMalloc((void **)&c->r[r].slots, sizeof(int32_t) * c->max_rows))) ||
	    (ret = CUDA_CHECK(b, cudaMalloc((void **)&c->r[r].ctx, sizeof(int32_t) * c->max_rows))))
		return ret;
	for (int s = 0; s < 2 && !ret; s++)
		ret = CUDA_CHECK(b, cudaEventCreateWithFlags(&c->r[r].done[s], cudaEventDisableTiming));
	return ret;
}

int cuda_mla_cp_create(struct backend *const *ranks, int n, int max_rows, int max_ctx,
		       int block_tokens, const struct k_mla_dims *d, int trash, void **cp,
		       char *err, size_t err_len)
{
	struct backend_cuda *b0 = cuda_of(ranks[0]);
	size_t H = (size_t)d->n_heads, L = (size_t)d->kv_lora, wd = L + (size_t)d->rope_dim;
	size_t split_rows = (size_t)max_rows * CP_SPLITS_AT_MAX_ROWS;
	struct cuda_mla_cp *c;
	int ret = 0;

	*cp = NULL;
	if (n < 2 || n > CP_MAX_RANKS || block_tokens % n) {
		snprintf(err, err_len, "--tp %d --mla-cp on cuda: the split latent cache takes 2..%d "
			 "ranks that divide the %d-token blocks (a rank's share of a block is then "
			 "a paged cache of its own)", n, CP_MAX_RANKS, block_tokens);
		return -EINVAL;
	}
	for (int r = 1; r < n; r++)	/* the exchange and the merge read every rank's partials */
		if (cuda_of(ranks[r])->dev != b0->dev) {
			snprintf(err, err_len, "--tp %d --mla-cp on cuda: ranks on different GPUs (rank "
				 "0 on GPU %d, rank %d on GPU %d) are not built yet: the split latent "
				 "cache runs on virtual ranks of one GPU (--gpus N), or leave out "
				 "--mla-cp", n, b0->dev, r, cuda_of(ranks[r])->dev);
			return -ENOTSUP;
		}
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->n = n;
	c->max_rows = max_rows;
	c->bt = block_tokens;
	c->trash = trash;
	c->d = *d;
	if (split_rows < CP_SPLIT_ROWS_MIN)
		split_rows = CP_SPLIT_ROWS_MIN;
	c->cap = split_rows * H * L;
	for (int r = 0; r < n; r++)
		c->r[r].b = cuda_of(ranks[r]);
	for (int r = 0; r < n && !ret; r++)
		ret = cp_rank_create(c, r, max_ctx);
	if (!ret && !(ret = CUDA_CHECK(b0, cudaSetDevice(b0->dev))) &&
	    !(ret = CUDA_CHECK(b0, cudaMalloc((void **)&c->q, sizeof(float) * (size_t)max_rows * H * wd))) &&
	    !(ret = CUDA_CHECK(b0, cudaMalloc((void **)&c->o, sizeof(float) * (size_t)n * c->cap))))
		ret = CUDA_CHECK(b0, cudaMalloc((void **)&c->lse, sizeof(float) * (size_t)n * (c->cap / L)));
	if (ret) {
		snprintf(err, err_len, "cuda: tp %d --mla-cp: cannot make the exchange for %d rows of "
			 "%zu heads (%s)", n, max_rows, H, strerror(-ret));
		cuda_mla_cp_destroy(c);
		return ret;
	}
	log_info("cuda: tp %d --mla-cp: the exchange (absorbed q, %zu split-rows of partials a "
		 "rank) %.1f MiB on GPU %d (virtual ranks: one GPU)", n, split_rows,
		 (double)(sizeof(float) * ((size_t)max_rows * H * wd + (size_t)n * c->cap * (L + 1) / L)) /
			 (1 << 20), b0->dev);
	*cp = c;
	return 0;
}

const int32_t *cuda_mla_cp_step(struct backend *be, void *cp, int rank, const int32_t *slots,
				const struct k_attn_rows *rows)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_mla_cp *c = cp;
	int ret;

	cuda_op_begin(b, CUDA_OP_ATTN_MLA);
	ret = rows->n_rows > c->max_rows ? -EINVAL
		: k_cuda_mla_cp_rows(b->stream, c->r[rank].slots, c->r[rank].ctx, slots, rows->ctx,
				     rows->n_rows, rank, c->n, c->trash);
	cuda_op_end(b, CUDA_OP_ATTN_MLA, ret);
	return ret ? NULL : c->r[rank].slots;
}

/* Queues stream's wait for every other rank's done[s]. */
static int cp_wait(struct cuda_mla_cp *c, int rank, int s)
{
	struct backend_cuda *b = c->r[rank].b;
	int ret = 0;

	for (int r = 0; r < c->n && !ret; r++)
		if (r != rank)
			ret = CUDA_CHECK(b, cudaStreamWaitEvent(b->stream, c->r[r].done[s], 0));
	return ret;
}

int cuda_mla_cp_attn(struct backend *be, void *cp, int rank, int stage, float *out,
		     const float *q, const struct model_tensor *w_kv_b, const struct k_kv_layer *kv,
		     const struct k_attn_rows *rows, const struct k_mla_dims *d, float scale)
{
	struct backend_cuda *b = cuda_of(be);
	struct cuda_mla_cp *c = cp;
	struct k_cuda_attn_rows gr = cuda_attn_rows(rows);
	struct k_cuda_attn_ws *ws = c->r[rank].ws;
	int H = c->d.n_heads, L = c->d.kv_lora, wd = L + c->d.rope_dim, R = rows->n_rows;
	int h0 = rank * d->n_heads, ret;
	/* every rank the same count: host values alone */
	int S = k_cuda_attn_mla_part_splits(ws, R, H, L, rows->max_ctx, c->n, c->n, c->cap);
	size_t at = (size_t)rank * (size_t)S * (size_t)R * (size_t)H;

	cuda_op_begin(b, CUDA_OP_ATTN_MLA);
	if (R > c->max_rows || !S || d->n_heads * c->n != H)
		ret = -EINVAL;
	else if (stage == 0)	/* this rank's heads into the rows every rank reads */
		ret = k_cuda_mla_absorb(b->stream, ws, c->q + (size_t)h0 * wd, (long)H * wd, q,
					W(b, w_kv_b), R, d);
	else if (stage == 1)	/* every head over this rank's tokens: its S splits */
		ret = cp_wait(c, rank, 0);
	else
		ret = cp_wait(c, rank, 1);
	if (!ret && stage == 1)
		ret = k_cuda_attn_mla_part(b->stream, ws, c->o + at * L, c->lse + at, S, c->q,
					   (const uint16_t *)kv->k, c->bt, &gr, c->r[rank].ctx, H, L,
					   c->d.rope_dim, scale, rank, c->n);
	if (!ret && stage == 2)	/* this rank's heads over every rank's splits */
		ret = k_cuda_mla_merge_expand(b->stream, ws, out, c->o, c->lse, c->n * S, R, H, h0,
					      W(b, w_kv_b), d);
	if (!ret && stage < 2)
		ret = CUDA_CHECK(b, cudaEventRecord(c->r[rank].done[stage], b->stream));
	cuda_op_end(b, CUDA_OP_ATTN_MLA, ret);
	return ret;
}
