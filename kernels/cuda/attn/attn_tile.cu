// Tiled attention over the paged bf16 cache: a tile of TQ query vectors (consecutive
// rows of one sequence and the q heads of one kv head) shares every K/V tile it loads,
// so a prefill chunk reads the cache once per tile instead of once per row. Used for
// GQA prefill (TQ 64) and for MLA (TQ 16: the heads of a row share each latent tile).
//
// The arithmetic is fp32 on the CUDA cores (fp32 register tiles over shared memory),
// exact to fp32 rounding. GQA prefill at head_dim <= 128 runs on the tensor cores
// instead (attn_prefill.cu) unless KDEC_ATTN_PREFILL_MMA=0; a tensor-core variant
// would be faster for MLA at many heads too.
#include "kernels/cuda/attn/attn_common.cuh"
#include "kernels/cuda/ptx.cuh"

#define TILE_THREADS 256
#define TILE_K 64		// tokens per K/V tile
#define TILE_NC 4		// most value chunks of one thread (see tile_pv)

// Byte offsets into the dynamic shared memory; the same numbers on host and device.
struct tile_layout {
	int dk8, dv8;		// dims rounded up to 8 (zero padded)
	int ks, vs;		// row strides (bf16) of the K and V tiles
	int dsl;		// dims per slice of the score phase
	unsigned qt, kt, vt, sp, slot, qctx, m, l, al, total;
};

__host__ __device__ inline unsigned tile_align16(unsigned x)
{
	return (x + 15u) & ~15u;
}

// tq: query vectors per tile; v_sep: V has its own tile (GQA) or is K's prefix (MLA).
__host__ __device__ inline tile_layout tile_layout_make(int tq, int dk, int dv, int v_sep)
{
	const int ds = 64 / tq;		// dim slices of the score phase (see tile_scores)
	const int sp_s = ds * tq * (TILE_K + 1), sp_p = TILE_K * (tq + 4);
	tile_layout L;
	unsigned o = 0;

	L.dk8 = (dk + 7) / 8 * 8;
	L.dv8 = (dv + 7) / 8 * 8;
	L.ks = L.dk8 + 8;	// 16 bytes of pad: rows of a warp's 16-byte loads spread banks
	L.vs = v_sep ? L.dv8 + 8 : L.ks;
	L.dsl = ((L.dk8 + ds - 1) / ds + 7) / 8 * 8;
	L.qt = o;
	o = tile_align16(o + 4u * L.dk8 * tq);		// float (dk8, tq): q transposed
	L.kt = o;
	o = tile_align16(o + 2u * 2 * TILE_K * L.ks);	// bf16 (2, TILE_K, ks): two stages
	L.vt = o;
	if (v_sep)
		o = tile_align16(o + 2u * 2 * TILE_K * L.vs);
	L.sp = o;					// float: scores, then probabilities
	o = tile_align16(o + 4u * (sp_s > sp_p ? sp_s : sp_p));
	L.slot = o;
	o = tile_align16(o + 4u * 2 * TILE_K);		// int32 (2, TILE_K) token slots
	L.qctx = o;
	o = tile_align16(o + 4u * tq);
	L.m = o;
	o = tile_align16(o + 4u * tq);
	L.l = o;
	o = tile_align16(o + 4u * tq);
	L.al = o;
	o = tile_align16(o + 4u * tq);
	L.total = o;
	return L;
}

// Shared-memory views of one block.
struct tile_smem {
	float *qt;		// (dk8, TQ) q * qscale, transposed, zero padded
	uint16_t *kt, *vt;	// (2, TILE_K, ks|vs) bf16; vt == kt where V is K's prefix
	float *sp;		// (ds, TQ, TILE_K + 1) scores / (TILE_K, TQ + 4) probabilities
	int32_t *slot;		// (2, TILE_K) slot of each token of a tile, -1 past the range
	int32_t *qctx;		// (TQ) tokens visible to the query, -1: not in this run
	float *m, *l, *al;	// (TQ) running max, sum, last rescale (base 2)
};

// ---- kernels ----------------------------------------------------------------

// Slots of tokens [t0, t0 + TILE_K) through the table, -1 from te on.
__device__ __forceinline__ void tile_slots(const attn_tile_args &a, const int32_t *table,
					   int32_t *slot, int t0, int te)
{
	for (int i = threadIdx.x; i < TILE_K; i += TILE_THREADS) {
		const int t = t0 + i;
		int32_t sl = -1;

		if (t < te) {
			const uint32_t b = attn_div_q(a.bt, (uint32_t)t);

			sl = table[b] * (int32_t)a.bt.d + (int32_t)(t - b * a.bt.d);
		}
		slot[i] = sl;
	}
}

// One tile's rows (n values of a row at src + slot * stride) into dst (TILE_K, dst_s):
// 16-byte asynchronous copies, or plain loads where a.vec is 0; zeros for slot -1 and
// for the pad up to n8.
__device__ __forceinline__ void tile_copy(uint16_t *dst, int dst_s, const uint16_t *src,
					  long stride, int n, int n8, const int32_t *slot, int vec)
{
	const int tok = threadIdx.x / 4, sub = threadIdx.x % 4;	// 4 threads per token
	const int32_t sl = slot[tok];
	const uint16_t *row = src + (size_t)(sl < 0 ? 0 : sl) * stride;
	uint16_t *out = dst + tok * dst_s;

	if (vec) {
		for (int c = sub * 8; c < n8; c += 32)
			cp_async16(out + c, row + c, sl >= 0);
	} else {
		for (int d = sub; d < n8; d += 4)
			out[d] = sl >= 0 && d < n ? row[d] : (uint16_t)0;
	}
}

__device__ __forceinline__ void tile_issue(const attn_tile_args &a, const tile_layout &L,
					   const tile_smem &S, int buf, int kvh)
{
	const int32_t *slot = S.slot + buf * TILE_K;

	tile_copy(S.kt + buf * TILE_K * L.ks, L.ks, a.k + kvh * a.k_hoff, a.k_stride, a.dk,
		  L.dk8, slot, a.vec);
	if (a.v)
		tile_copy(S.vt + buf * TILE_K * L.vs, L.vs, a.v + kvh * a.v_hoff, a.v_stride,
			  a.dv, L.dv8, slot, a.vec);
}

// Scores of the tile into sp (ds, TQ, TILE_K + 1), base 2 (qscale is in q): thread
// (ds, tq, tt) sums queries tq*4..+3 against tokens tt + 16 j over its dim slice.
template <int TQ>
__device__ __forceinline__ void tile_scores(const tile_layout &L, const tile_smem &S, int buf)
{
	constexpr int NTQ = TQ / 4;
	const int ds = threadIdx.x / (NTQ * 16), tq = threadIdx.x / 16 % NTQ;
	const int tt = threadIdx.x % 16;
	const int dlo = ds * L.dsl, dhi = min(L.dk8, dlo + L.dsl);
	const uint16_t *kb = S.kt + buf * TILE_K * L.ks;
	float s[4][4] = {};

	for (int d = dlo; d < dhi; d += 8) {
		uint4 kw[4];

#pragma unroll
		for (int j = 0; j < 4; j++)
			kw[j] = *(const uint4 *)(kb + (tt + 16 * j) * L.ks + d);
#pragma unroll
		for (int dd = 0; dd < 8; dd++) {
			const float4 qv = *(const float4 *)(S.qt + (d + dd) * TQ + tq * 4);

#pragma unroll
			for (int j = 0; j < 4; j++) {
				const uint32_t w = dd < 2 ? kw[j].x : dd < 4 ? kw[j].y :
						   dd < 6 ? kw[j].z : kw[j].w;
				const float kf = dd % 2 ? bf16_hi(w) : bf16_lo(w);

				s[0][j] = fmaf(qv.x, kf, s[0][j]);
				s[1][j] = fmaf(qv.y, kf, s[1][j]);
				s[2][j] = fmaf(qv.z, kf, s[2][j]);
				s[3][j] = fmaf(qv.w, kf, s[3][j]);
			}
		}
	}
#pragma unroll
	for (int i = 0; i < 4; i++)
#pragma unroll
		for (int j = 0; j < 4; j++)
			S.sp[((ds * TQ) + tq * 4 + i) * (TILE_K + 1) + tt + 16 * j] = s[i][j];
}

// Online softmax of the tile: TILE_THREADS / TQ threads per query sum the slices, mask
// tokens past te and past the query's ctx, and leave p in sp (TILE_K, TQ + 4), the new
// max and sum in m and l, the factor for the old accumulators in al.
template <int TQ>
__device__ __forceinline__ void tile_softmax(const tile_smem &S, int t0, int te)
{
	constexpr int TPR = TILE_THREADS / TQ, PER = TILE_K / TPR, DS = 64 / TQ;
	const int q = threadIdx.x / TPR, sub = threadIdx.x % TPR;
	const int lim = min(te, S.qctx[q]) - t0;	// tokens t < lim count
	float x[PER], mx = -INFINITY, m_old, mn, al, sum = 0.0f;

#pragma unroll
	for (int jj = 0; jj < PER; jj++) {
		const int t = sub + TPR * jj;
		float v = 0.0f;

#pragma unroll
		for (int ds = 0; ds < DS; ds++)
			v += S.sp[(ds * TQ + q) * (TILE_K + 1) + t];
		x[jj] = t < lim ? v : -INFINITY;
		mx = fmaxf(mx, x[jj]);
	}
#pragma unroll
	for (int off = 1; off < TPR; off <<= 1)
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
	m_old = S.m[q];
	mn = fmaxf(m_old, mx);
	al = attn_rescale(m_old, mn);
#pragma unroll
	for (int jj = 0; jj < PER; jj++) {
		x[jj] = x[jj] == -INFINITY ? 0.0f : exp2f(x[jj] - mn);
		sum += x[jj];
	}
#pragma unroll
	for (int off = 1; off < TPR; off <<= 1)
		sum += __shfl_xor_sync(0xffffffffu, sum, off);
	__syncthreads();	// every score is read before p overwrites them
#pragma unroll
	for (int jj = 0; jj < PER; jj++)
		S.sp[(sub + TPR * jj) * (TQ + 4) + q] = x[jj];
	if (sub == 0) {
		S.m[q] = mn;
		S.l[q] = S.l[q] * al + sum;
		S.al[q] = al;
	}
}

// acc = acc * al + p V over the tile: thread (qg, dt) owns queries qg*4..+3 and dims
// (c * NDT + dt) * 4 .. + 3 for c < TILE_NC.
template <int TQ>
__device__ __forceinline__ void tile_pv(const attn_tile_args &a, const tile_layout &L,
					const tile_smem &S, int buf, int nvalid,
					float acc[4][TILE_NC][4])
{
	constexpr int NDT = TILE_THREADS / (TQ / 4);
	const int qg = threadIdx.x / NDT, dt = threadIdx.x % NDT;
	const uint16_t *vb = S.vt + buf * TILE_K * L.vs;

#pragma unroll
	for (int i = 0; i < 4; i++) {
		const float al = S.al[qg * 4 + i];

#pragma unroll
		for (int c = 0; c < TILE_NC; c++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				acc[i][c][e] *= al;
	}
	for (int t = 0; t < nvalid; t++) {
		const float4 p = *(const float4 *)(S.sp + t * (TQ + 4) + qg * 4);

#pragma unroll
		for (int c = 0; c < TILE_NC; c++) {
			const int d0 = (c * NDT + dt) * 4;
			uint2 w;
			float v[4];

			if (d0 >= a.dv)
				continue;
			w = *(const uint2 *)(vb + t * L.vs + d0);
			v[0] = bf16_lo(w.x);
			v[1] = bf16_hi(w.x);
			v[2] = bf16_lo(w.y);
			v[3] = bf16_hi(w.y);
#pragma unroll
			for (int e = 0; e < 4; e++) {
				acc[0][c][e] = fmaf(p.x, v[e], acc[0][c][e]);
				acc[1][c][e] = fmaf(p.y, v[e], acc[1][c][e]);
				acc[2][c][e] = fmaf(p.z, v[e], acc[2][c][e]);
				acc[3][c][e] = fmaf(p.w, v[e], acc[3][c][e]);
			}
		}
	}
}

// Query vector j of the tile: its row and q head, and whether it is in rows [rs, re].
__device__ __forceinline__ bool tile_query(const attn_tile_args &a, int qi0, int j, int kvh,
					   int rs, int re, int *r, int *h)
{
	const int qi = qi0 + j;

	*r = qi / a.group;
	*h = kvh * a.group + qi % a.group;
	return qi < a.n_rows * a.group && *r >= rs && *r <= re;
}

// The run's per-query state and its q tile (scaled, transposed, zero padded).
template <int TQ>
__device__ __forceinline__ void tile_run_init(const attn_tile_args &a, const tile_layout &L,
					      const tile_smem &S, int qi0, int kvh, int rs, int re)
{
	int r, h;

	for (int j = threadIdx.x; j < TQ; j += TILE_THREADS) {
		S.qctx[j] = tile_query(a, qi0, j, kvh, rs, re, &r, &h) ? a.ctx[r] : -1;
		S.m[j] = -INFINITY;
		S.l[j] = 0.0f;
	}
	for (int i = threadIdx.x; i < TQ * L.dk8; i += TILE_THREADS) {
		const int j = i % TQ, d = i / TQ;
		float x = 0.0f;

		if (d < a.dk && tile_query(a, qi0, j, kvh, rs, re, &r, &h))
			x = a.q[r * a.q_rs + h * a.q_hs + d] * a.qscale;
		S.qt[d * TQ + j] = x;
	}
}

// Output (one split) or normalised partial and its log2-sum-exp2 (several splits).
template <int TQ>
__device__ __forceinline__ void tile_run_store(const attn_tile_args &a, const tile_smem &S,
					       int qi0, int kvh, int rs, int re, int split,
					       const float acc[4][TILE_NC][4])
{
	constexpr int NDT = TILE_THREADS / (TQ / 4);
	const int qg = threadIdx.x / NDT, dt = threadIdx.x % NDT;

#pragma unroll
	for (int i = 0; i < 4; i++) {
		const int j = qg * 4 + i;
		const float ls = S.l[j], inv = ls > 0.0f ? 1.0f / ls : 0.0f;
		float *dst;
		int r, h;

		if (!tile_query(a, qi0, j, kvh, rs, re, &r, &h))
			continue;
		if (a.n_splits == 1) {
			dst = a.out + r * a.out_rs + h * a.out_hs;
		} else {
			const size_t sp = ((size_t)split * a.n_rows + r) * a.n_heads + h;

			dst = a.part_o + sp * a.dv;
			if (dt == 0)
				a.part_lse[sp] = ls > 0.0f ? S.m[j] + log2f(ls) : -INFINITY;
		}
#pragma unroll
		for (int c = 0; c < TILE_NC; c++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int d = (c * NDT + dt) * 4 + e;

				if (d < a.dv)
					dst[d] = acc[i][c][e] * inv;
			}
	}
}

// Rows [rs, re] of the tile share table: their queries attend over this split's part of
// [0, run_max), two K/V stages in flight.
template <int TQ>
__device__ void tile_run(const attn_tile_args &a, const tile_layout &L, const tile_smem &S,
			 const int32_t *table, int rs, int re, int run_max, int qi0, int kvh,
			 int split)
{
	const int per = ((run_max + a.n_splits - 1) / a.n_splits + TILE_K - 1) / TILE_K * TILE_K;
	const int tb = (int)min((long)run_max, (long)split * per), te = min(run_max, tb + per);
	const int nt = (te - tb + TILE_K - 1) / TILE_K;
	float acc[4][TILE_NC][4] = {};

	__syncthreads();	// the previous run is done with the shared state
	tile_run_init<TQ>(a, L, S, qi0, kvh, rs, re);
	if (nt > 0)
		tile_slots(a, table, S.slot, tb, te);
	__syncthreads();
	if (nt > 0)
		tile_issue(a, L, S, 0, kvh);
	cp_async_commit();
	for (int it = 0; it < nt; it++) {
		const int cur = it & 1, t0 = tb + it * TILE_K;

		if (it + 1 < nt) {
			tile_slots(a, table, S.slot + (cur ^ 1) * TILE_K, t0 + TILE_K, te);
			__syncthreads();
			tile_issue(a, L, S, cur ^ 1, kvh);
		}
		cp_async_commit();
		cp_async_wait<1>();
		__syncthreads();
		tile_scores<TQ>(L, S, cur);
		__syncthreads();
		tile_softmax<TQ>(S, t0, te);
		__syncthreads();
		tile_pv<TQ>(a, L, S, cur, min(TILE_K, te - t0), acc);
		__syncthreads();	// stage cur is free for the tile after next
	}
	tile_run_store<TQ>(a, S, qi0, kvh, rs, re, split, acc);
}

// Block (tile, kv head, split): the tile's query vectors qi = row * group + g, taken in
// runs of consecutive rows that share a block table.
template <int TQ>
__global__ void __launch_bounds__(TILE_THREADS, 1) attn_tile_kernel(const attn_tile_args a)
{
	extern __shared__ __align__(16) unsigned char attn_smem[];
	const tile_layout L = tile_layout_make(TQ, a.dk, a.dv, a.v != nullptr);
	const int nq = a.n_rows * a.group, qi0 = blockIdx.x * TQ;
	const int r_lo = qi0 / a.group, r_hi = (min(qi0 + TQ, nq) - 1) / a.group;
	tile_smem S;

	S.qt = (float *)(attn_smem + L.qt);
	S.kt = (uint16_t *)(attn_smem + L.kt);
	S.vt = a.v ? (uint16_t *)(attn_smem + L.vt) : S.kt;
	S.sp = (float *)(attn_smem + L.sp);
	S.slot = (int32_t *)(attn_smem + L.slot);
	S.qctx = (int32_t *)(attn_smem + L.qctx);
	S.m = (float *)(attn_smem + L.m);
	S.l = (float *)(attn_smem + L.l);
	S.al = (float *)(attn_smem + L.al);
	for (int rs = r_lo; rs <= r_hi;) {
		const int32_t *const table = a.blocks[rs];
		int re = rs, run_max = a.ctx[rs];

		while (re < r_hi && a.blocks[re + 1] == table)
			run_max = max(run_max, a.ctx[++re]);
		tile_run<TQ>(a, L, S, table, rs, re, run_max, qi0, blockIdx.y, blockIdx.z);
		rs = re + 1;
	}
}

// ---- launchers --------------------------------------------------------------

size_t attn_tile_smem(const k_cuda_attn_ws *ws, int tq, int dk, int dv, int v_separate)
{
	const tile_layout L = tile_layout_make(tq, dk, dv, v_separate);
	const int max_dv = TILE_NC * (TILE_THREADS / (tq / 4)) * 4;

	if (dv > max_dv || (!v_separate && dv > dk) || L.total > (unsigned)ws->smem_optin)
		return 0;
	return L.total;
}

int attn_tile_launch(cudaStream_t s, const k_cuda_attn_ws *ws, int tq, const attn_tile_args *a)
{
	const size_t smem = attn_tile_smem(ws, tq, a->dk, a->dv, a->v != nullptr);
	const long tiles = ((long)a->n_rows * a->group + tq - 1) / tq;
	const dim3 grid((unsigned)tiles, a->kv_heads, a->n_splits);

	if (!smem)
		ATTN_INVAL("attn_tile: dims %d / %d need more shared memory than the %d bytes "
			   "a block may have", a->dk, a->dv, ws->smem_optin);
	if (a->kv_heads > 65535 || tiles < 1)
		ATTN_INVAL("attn_tile: %d kv heads, %ld tiles unsupported", a->kv_heads, tiles);
	if (tq == 64)
		attn_tile_kernel<64><<<grid, TILE_THREADS, smem, s>>>(*a);
	else if (tq == 16)
		attn_tile_kernel<16><<<grid, TILE_THREADS, smem, s>>>(*a);
	else
		ATTN_INVAL("attn_tile: %d query vectors per tile unsupported", tq);
	K_CUDA_TRY_LAUNCHED("attn_tile_kernel");
	// out null: the caller merges the partials (MLA decode context parallel, whose
	// partials are one rank's share of every rank's)
	if (a->n_splits > 1 && a->out)
		return attn_merge(s, ws, a->n_splits, a->n_rows, a->n_heads, a->dv, a->out,
				  a->out_rs, a->out_hs, nullptr);
	return 0;
}

int attn_tile_prepare(int smem_optin)
{
	K_CUDA_TRY(cudaFuncSetAttribute(attn_tile_kernel<64>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	K_CUDA_TRY(cudaFuncSetAttribute(attn_tile_kernel<16>,
					cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
	return 0;
}
