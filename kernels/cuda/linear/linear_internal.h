/* Shared by the linear-layer .cu files only: the context and the launchers of each
 * variant (linear.cu dispatches, linear_gemv.cu and linear_splitk.cu hold kernels). */
#ifndef KD_KERNELS_CUDA_LINEAR_INTERNAL_H
#define KD_KERNELS_CUDA_LINEAR_INTERNAL_H

#include <stdint.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/launch_check.cuh"
#include "kernels/cuda/linear/k_cuda_linear.h"

/* Largest thread-block cluster the split-K kernel uses: the portable limit. */
#define LIN_SK_MAX_SPLIT	8
/* Instantiations of the split-K kernel: 1, 2, 4, 8 m8 tiles (M <= 8, 16, 32, 64). */
#define LIN_SK_N_MT		4
/* Rows of x one split-K launch covers; more rows are walked in blocks of this. */
#define LIN_SK_MAX_M		64
/* The streaming kernel: instantiations for 1, 2, 4, 8 n8 tiles of x rows (M <= 8, 16,
 * 32, 64 per launch), at most 8 K slices, and a workspace for the partial tiles of at
 * most LIN_ST_MAX_UNITS CTAs of a split launch (24 MB). */
#define LIN_ST_N_NT		4
#define LIN_ST_MAX_M		64
#define LIN_ST_MAX_SPLIT	8
#define LIN_ST_MAX_UNITS	768
/* cuBLAS workspace: what NVIDIA recommends for Hopper. */
#define LIN_BLAS_WS_BYTES	((size_t)32 << 20)
/* cuBLASLt tuning: calls of M <= 64 rows, at most this many shapes per context. */
#define LIN_LT_MAX_M		64
#define LIN_LT_CACHE		256
/* The quantized kernels' tuned K splits (linear_tune.cu): shapes per context, splits. */
#define LIN_SPLIT_CACHE		256
#define LIN_SPLIT_MAX		16
/* The bf16 kinds timed against the ring kind (KDEC_LINEAR_RING_TUNE): shapes per context. */
#define LIN_KIND_CACHE		256

struct lin_lt_entry;
struct lin_split_entry;

/* One shape's kind as KDEC_LINEAR_RING_TUNE timed it; M: the bucket. */
struct lin_kind_entry {
	int M, N, K;
	int kind;	/* enum k_cuda_linear_kind */
};

/* Weights the ring kind ran where the plain choice reads fp32 x (GEMV, GENERIC), so
 * their x was rounded to bf16 by the tuning's choice (k_cuda_linear_rounds_x): the
 * matrix w (N rows of K) at M's bucket. Per context, at most LIN_ROUND_LOG. */
#define LIN_ROUND_LOG		1024
struct lin_round_entry {
	const uint16_t *w;
	int M, N, K;
};

/* cuBLASLt's descriptors of one GEMM (linear_lt.cu's tuned bf16 calls):
 * the operation and the layouts of A, B and C (= D). free: any of them may be NULL; *d is
 * zeroed. check: 0 for success, else the call logged with its device and -ENOMEM
 * (allocation) or -EIO. */
struct lin_lt_descs {
	cublasLtMatmulDesc_t op;
	cublasLtMatrixLayout_t a, b, c;
};
void k_cuda_lin_lt_descs_free(struct lin_lt_descs *d);
int k_cuda_lin_lt_check(cublasStatus_t s, const char *call, int dev);
#define LIN_LT(dev, call) k_cuda_lin_lt_check((call), #call, (dev))

struct k_cuda_linear {
	cudaStream_t stream;
	int dev;			/* the device current at create */
	int max_M, max_K;		/* largest call sizes; xb is sized for them */
	int n_sm;			/* multiprocessors */
	int pdl;			/* launch with programmatic stream serialisation */
	int pdl_ok;			/* the device took it at create */
	/* split-K CTAs resident at once, per m-tile instantiation and cluster size
	 * (index 1..LIN_SK_MAX_SPLIT; 0 where that cluster size cannot launch) */
	int sk_cap[LIN_SK_N_MT][LIN_SK_MAX_SPLIT + 1];
	int gemv_resident;		/* GEMV CTAs resident at once */
	int st_cap[LIN_ST_N_NT];	/* streaming-kernel CTAs resident at once */
	int qm_bps;			/* quantized GEMV CTAs resident per multiprocessor */
	/* quantized tile kernel CTAs resident per multiprocessor: [fp8, int4][M <= 16, 32, 64] */
	int qt_bps[2][3];
	int qg_bps;			/* quantized M <= 8 GEMV CTAs per multiprocessor (registers) */
	int qw_ok;			/* the wgmma tile kernel runs on this device */
	int shared;			/* k_cuda_linear_set_shared: no CTA waits for another */
	/* its CTAs resident per multiprocessor: [fp8, int4][M <= 16, 32, 64][128, 256 rows] */
	int qw_bps[2][3][2];
	int qg_smem_sm;			/* shared memory of a multiprocessor, bytes */
	int qg_smem_cta;		/* a GEMV CTA's shared memory beyond the dynamic part */
	float *st_ws;			/* (LIN_ST_MAX_UNITS, LIN_ST_MAX_M, 128) fp32 partials */
	unsigned *st_cnt;		/* (LIN_ST_MAX_UNITS) arrivals per tile, 0 between launches */
	cublasHandle_t blas;
	cublasLtHandle_t lt;		/* NULL: no tuning */
	struct lin_lt_entry *lt_cache;	/* (LIN_LT_CACHE) tuned shapes, lt_n of them used */
	int lt_n;
	struct lin_split_entry *split_cache;	/* (LIN_SPLIT_CACHE) tuned K splits, split_n used */
	int split_n;
	struct lin_kind_entry *kind_cache;	/* (LIN_KIND_CACHE) timed kinds, kind_n used */
	int kind_n;
	struct lin_round_entry *round_log;	/* (LIN_ROUND_LOG) round_n used */
	int round_n;
	void *blas_ws;			/* (LIN_BLAS_WS_BYTES) bytes, cuBLAS workspace */
	uint16_t *xb;			/* (max_M, max_K) bf16: x rounded for cuBLAS */
	const float *ready_x;		/* xb already holds bf16(ready_x) (ready_M, ready_K), */
	int ready_M, ready_K;		/* written by its producer: k_cuda_linear_x_ready */
	bool ready_only;		/* ... and the fp32 ready_x was never written */
};

/* launch_check.cuh's checks naming the context's device: 0 for cudaSuccess; otherwise
 * logs call, file, line and device and returns -ENOMEM (allocation failure) or -EIO. */
#define LIN_CUDA(dev, call) k_cuda_call_status_on((call), #call, __FILE__, __LINE__, (dev))
/* The last launch's error, logged as `what`. */
#define LIN_LAUNCHED(dev, what) \
	k_cuda_call_status_on(cudaGetLastError(), what, __FILE__, __LINE__, (dev))

/* ctx->gemv_resident; called once by k_cuda_linear_create. */
int k_cuda_lin_gemv_setup(struct k_cuda_linear *ctx);
int k_cuda_lin_gemv(const struct k_cuda_linear *ctx, float *y, const float *x,
		    const uint16_t *w, int M, int N, int K, int accumulate);
int k_cuda_lin_generic(const struct k_cuda_linear *ctx, float *y, const float *x,
		       const uint16_t *w, int M, int N, int K, int accumulate);
/* dst (n) bf16 = src (n) fp32, rounded to nearest even. */
int k_cuda_lin_to_bf16(const struct k_cuda_linear *ctx, uint16_t *dst, const float *src,
		       size_t n);

/* Fills attrs[0] with programmatic stream serialisation when ctx->pdl: the kernel may
 * then start while its predecessor in the stream drains; it reads its inputs only after
 * cudaGridDependencySynchronize(). Returns the number of attributes filled (0 or 1). */
int k_cuda_lin_pdl_attr(const struct k_cuda_linear *ctx, cudaLaunchAttribute *attrs);

/* The launch of an elementwise staging kernel over `units` items (one a thread, 256 a
 * CTA, at most 4 CTAs a multiprocessor, the kernel striding over the rest) on the
 * context's stream with PDL where on; attr: its one attribute's storage. */
static inline cudaLaunchConfig_t k_cuda_lin_stage_cfg(const struct k_cuda_linear *ctx,
						      size_t units, cudaLaunchAttribute *attr)
{
	cudaLaunchConfig_t cfg = {};
	size_t blocks = (units + 255) / 256;

	if (blocks > (size_t)ctx->n_sm * 4)
		blocks = (size_t)ctx->n_sm * 4;
	cfg.gridDim = dim3((unsigned)(blocks > 0 ? blocks : 1), 1, 1);
	cfg.blockDim = dim3(256, 1, 1);
	cfg.stream = ctx->stream;
	cfg.attrs = attr;
	cfg.numAttrs = k_cuda_lin_pdl_attr(ctx, attr);
	return cfg;
}

/* Kernel attributes, ctx->sk_cap, and a probe launch that turns ctx->pdl off where a
 * cluster launch with it fails; called once by k_cuda_linear_create (synchronises). */
int k_cuda_lin_splitk_setup(struct k_cuda_linear *ctx);
int k_cuda_lin_splitk(const struct k_cuda_linear *ctx, float *y, const float *x,
		      const uint16_t *w, int M, int N, int K, int accumulate);
int k_cuda_lin_splitk_describe(const struct k_cuda_linear *ctx, int M, int N, int K,
			       char *buf, size_t len);

/* Kernel attributes, ctx->st_cap, the split workspace and counters; once, at create. */
int k_cuda_lin_stream_setup(struct k_cuda_linear *ctx);
/* ready: ctx->xb already holds bf16(x); otherwise x is rounded into it first. */
int k_cuda_lin_stream(const struct k_cuda_linear *ctx, float *y, const float *x,
		      const uint16_t *w, int M, int N, int K, int accumulate, bool ready);
int k_cuda_lin_stream_describe(const struct k_cuda_linear *ctx, int M, int N, int K,
			       char *buf, size_t len);

/* The quantized-weight decode GEMV (linear_qmma.cu): kernel attributes and
 * ctx->qm_bps, once at create; the launch (k_cuda_linear_q_mma_supports must hold). */
struct k_quant;
struct k_cuda_xnorm;
int k_cuda_lin_qmma_setup(struct k_cuda_linear *ctx);
/* stream: the form that copies the weights through a cp.async ring in shared memory
 * (k_cuda_linear_q_stream_supports must hold then), else the register-load form. nrm:
 * NULL, or x is an RMSNorm's input, the GEMV's x its output (the streaming form at
 * M <= 8 only, else -EINVAL). */
int k_cuda_lin_qmma(const struct k_cuda_linear *ctx, bool stream, float *y, const float *x,
		    const void *w, const struct k_quant *q, int M, int N, int K, int accumulate,
		    const struct k_cuda_xnorm *nrm);
int k_cuda_lin_qmma_describe(const struct k_cuda_linear *ctx, bool stream,
			     const struct k_quant *q, int M, int N, int K, char *buf, size_t len);
/* The cluster size S (K slices per 128 rows) the form would launch with; 0: no plan. */
int k_cuda_lin_qmma_split(const struct k_cuda_linear *ctx, bool stream, const struct k_quant *q,
			  int M, int N, int K);
/* Whether the streaming form's clusters at split S (k_cuda_lin_qmma_split's) fill the GPU
 * over N rows: S >= 2 and their CTAs at least K_CUDA_LINEAR_Q_GEMV_FILL % of two a
 * multiprocessor, where a cluster finds no room and the decode GEMV (linear_qgemv.cu) is
 * faster at M <= 8 (the rule of k_cuda_linear_q_choose and of the ring kind's bf16). */
bool k_cuda_lin_qstream_fills(const struct k_cuda_linear *ctx, int S, int N);
/* The quantized tile kernel (linear_qtile.cu, K_CUDA_LINEAR_Q_TILE): kernel attributes
 * and ctx->qt_bps, once at create; the launch: x rounded to f16 into ctx->xb (M <=
 * max_M, K <= max_K), then the kernel, K split through ctx->st_ws / st_cnt (shared with
 * the bf16 streaming kernel: calls on one context run in stream order).
 * -EINVAL where k_cuda_linear_q_tile_supports does not hold or the scratch is small. */
int k_cuda_lin_qtile_setup(struct k_cuda_linear *ctx);
int k_cuda_lin_qtile(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		     const struct k_quant *q, int M, int N, int K, int accumulate);
int k_cuda_lin_qtile_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			      int N, int K, char *buf, size_t len);
/* The quantized tile kernel on wgmma (linear_qwgmma.cu): setup sets ctx->qw_ok where the
 * device is compute capability 9.0 and the build has its sm_90a code (a probe launch),
 * and ctx->qw_bps, once at create; takes: whether it takes this call (qw_ok,
 * KDEC_LINEAR_QWG, M <= K_CUDA_LINEAR_Q_TILE_MAX_M; fp8: K % 64 == 0, scale columns
 * constant over 64 k; int4: K % 128 == 0, groups a power of two >= 32); the launch and
 * its plan, as k_cuda_lin_qtile's. */
int k_cuda_lin_qwg_setup(struct k_cuda_linear *ctx);
int k_cuda_lin_qwg_takes(const struct k_cuda_linear *ctx, const struct k_quant *q, int M, int N,
			 int K);
int k_cuda_lin_qwg(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		   const struct k_quant *q, int M, int N, int K, int accumulate);
int k_cuda_lin_qwg_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			    int N, int K, char *buf, size_t len);
/* The quantized decode GEMV for M <= 8 (linear_qgemv.cu, K_CUDA_LINEAR_Q_GEMV): kernel
 * attributes, ctx->qg_bps, qg_smem_sm and qg_smem_cta, once at create; the
 * launch, K split through ctx->st_ws / st_cnt like the tile kernel (-EINVAL where
 * k_cuda_linear_q_gemv_supports does not hold). */
int k_cuda_lin_qgemv_setup(struct k_cuda_linear *ctx);
/* What x is to the GEMV: itself; a SwiGLU's gate_up (M, 2K), the GEMV's x its product;
 * an RMSNorm's input, the GEMV's x its output (linear_qgemv.cu's qg_stage_x). */
enum lin_qg_x { LIN_QG_X_PLAIN, LIN_QG_X_SWIGLU, LIN_QG_X_NORM };
/* The launch; its K split as k_cuda_lin_split_tune keeps it (else the split model's).
 * xf: an lin_qg_x; nrm: LIN_QG_X_NORM's norm (else NULL). q: k_cuda_lin_bf16_q for bf16
 * weights (K_CUDA_LINEAR_RING), whose shapes k_cuda_lin_bf16_gemv_supports says. */
extern const struct k_quant k_cuda_lin_bf16_q;
bool k_cuda_lin_bf16_gemv_shape_ok(int M, int N, int K);
bool k_cuda_lin_bf16_gemv_supports(const float *x, const void *w, int M, int N, int K);
int k_cuda_lin_qgemv(struct k_cuda_linear *ctx, float *y, const float *x, const void *w,
		     const struct k_quant *q, int M, int N, int K, int accumulate, int xf,
		     const struct k_cuda_xnorm *nrm);
int k_cuda_lin_qgemv_describe(const struct k_cuda_linear *ctx, const struct k_quant *q, int M,
			      int N, int K, char *buf, size_t len);
/* The bookkeeping of the bf16 copy of x (linear.cu): whether x is the one a producer
 * left there, cleared; -EINVAL (logged) where only that copy was written and kind
 * reads fp32 x. */
int k_cuda_lin_take_ready(struct k_cuda_linear *ctx, enum k_cuda_linear_kind kind,
			  const float *x, int M, int N, int K, bool *ready);

/* What a tuning times (k_cuda_lin_time): the launch enqueue(ctx, arg) queues on
 * ctx->stream, 0 or -errno. */
typedef int (*lin_enqueue_fn)(const struct k_cuda_linear *ctx, void *arg);
/* Written between timed runs so that no weight is still in L2 (50-60 MB on H100/H200). */
#define LIN_TIME_FLUSH_BYTES	((size_t)128 << 20)
/* What a tuning times with: the scratch y its launches write (ys_bytes), the buffer
 * rewritten before each timed replay (LIN_TIME_FLUSH_BYTES) and two events. get: 0,
 * -ENOMEM where the device has no room (error cleared; the caller keeps its untuned
 * choice) or -EIO (logged); put: frees what get made (any part may be NULL). */
struct lin_time_scratch {
	void *ys, *flush;
	cudaEvent_t e0, e1;
};
int k_cuda_lin_time_scratch_get(const struct k_cuda_linear *ctx, size_t ys_bytes,
				struct lin_time_scratch *s);
void k_cuda_lin_time_scratch_put(struct lin_time_scratch *s);
/* The median of five replays of enqueue's launch captured alone in a graph, each after
 * s->flush is rewritten, so from a cold L2 as a decode step reads its weights; in ms,
 * < 0 where capture or replay failed (the error cleared). *nodes (may be NULL): the
 * graph's nodes. */
float k_cuda_lin_time(const struct k_cuda_linear *ctx, const struct lin_time_scratch *s,
		      lin_enqueue_fn enqueue, void *arg, int *nodes);
/* The decode graph bucket that holds M rows (the next power of two): tuning runs only at
 * those sizes, which the engine's warm-up meets outside a capture before the daemon
 * serves; an eager step of another M (decode rows beside a prompt chunk: 17 logits rows)
 * takes its bucket's pick where it fits, instead of a ~20 ms tuning inside a request's
 * step. */
int k_cuda_lin_bucket(int M);
/* Whether ctx->stream runs launches now (no graph capture on it, the query answered):
 * what a tuning needs to time anything. */
bool k_cuda_lin_stream_runs(const struct k_cuda_linear *ctx);

/* The quantized kernels' K splits timed (KDEC_LINEAR_Q_TUNE, default 1): the first
 * call of a shape at its M bucket (the next power of two) outside a graph capture times
 * every split 1..max_S (synchronising the stream) and keeps the fastest for the life of
 * the context; a call of another M, or in a capture before its bucket was tuned, takes
 * the bucket's split where there is one, else the kernel's model. kind: the
 * k_cuda_linear_q_kind. find: the split kept, 0 for none (or tuning off). wanted:
 * whether this call is one to tune. tune: the split enqueue times fastest (model_S
 * where none could be timed; KDEC_LT_LOG=1 prints every split's time), enqueue(ctx,
 * arg, S, ys) launching split S into the scratch ys (M, N) fp32, -EINVAL before any
 * launch where S gives no plan. keep: remembers it. */
typedef int (*lin_split_enqueue_fn)(const struct k_cuda_linear *ctx, void *arg, int S, float *ys);
int k_cuda_lin_split_find(const struct k_cuda_linear *ctx, int kind, const struct k_quant *q,
			  int M, int N, int K);
bool k_cuda_lin_split_wanted(const struct k_cuda_linear *ctx, int kind, const struct k_quant *q,
			     int M, int N, int K);
int k_cuda_lin_split_tune(const struct k_cuda_linear *ctx, const char *what, int M, int N, int K,
			  int max_S, int model_S, lin_split_enqueue_fn enqueue, void *arg);
void k_cuda_lin_split_keep(struct k_cuda_linear *ctx, int kind, const struct k_quant *q, int M,
			   int N, int K, int S);
int k_cuda_lin_split_setup(struct k_cuda_linear *ctx);
void k_cuda_lin_split_destroy(struct k_cuda_linear *ctx);

/* cuBLASLt with the algorithm timed fastest for this shape at M's decode bucket (the
 * next power of two; the first call at a bucket size outside graph capture tunes,
 * synchronising the stream; another M takes its bucket's pick where it fits and never
 * tunes); *done = false where it did not run (tuning off, M too large, bucket not
 * tuned, shape first seen in capture, or cublasGemmEx won), and the caller runs
 * cublasGemmEx. xb: bf16 x (M, K); y (M, N) in bf16 where y_bf16
 * (tuned apart from the fp32 form), else fp32; beta 0 or 1. */
int k_cuda_lin_lt(struct k_cuda_linear *ctx, void *y, bool y_bf16, const uint16_t *xb,
		  const uint16_t *w, int M, int N, int K, int beta, bool *done);
int k_cuda_lin_lt_setup(struct k_cuda_linear *ctx);
void k_cuda_lin_lt_destroy(struct k_cuda_linear *ctx);

#ifdef __CUDACC__
/* Programmatic dependent launch. Kernels take `int pdl`: 0 when launched without it;
 * otherwise the number of leading CTAs (blockIdx.y * gridDim.x + blockIdx.x below it)
 * that can be resident at once, the only ones that start while the previous kernel
 * drains and so the only ones that prefetch. */
static __device__ __forceinline__ bool k_cuda_lin_early_cta(int pdl)
{
	return (unsigned)pdl > blockIdx.y * gridDim.x + blockIdx.x;
}

/* The weights are constant, so a kernel may fetch them before its predecessor finishes,
 * but must call this before reading x or y; it then lets the next kernel launch early
 * too. The early fetch is an L2 prefetch (k_cuda_lin_prefetch): ptxas (nvcc 13.0) moved
 * register loads issued before the wait (ACQBULK) to after it, to save registers.
 * The wait is unconditional (pdl unused): without the launch attribute it returns at
 * once, and a wait that a branch can skip leaves every load after it reachable before
 * it in the SASS that tests/pdl_order.sh checks. */
static __device__ __forceinline__ void k_cuda_lin_inputs_ready(int pdl)
{
	(void)pdl;
	cudaGridDependencySynchronize();
	cudaTriggerProgrammaticLaunchCompletion();
}

/* Asks L2 for the 16 bytes at p (weights to be read soon). */
static __device__ __forceinline__ void k_cuda_lin_prefetch(const void *p)
{
	asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
}

/* 16 bytes of weights that are read once: not kept in L1 (x lives there). Returns
 * zeros without touching memory when !ok. */
static __device__ __forceinline__ uint4 k_cuda_lin_ld_stream(const void *p, bool ok)
{
	uint4 v;

	asm volatile("{\n\t"
		     ".reg .pred p;\n\t"
		     "setp.ne.b32 p, %5, 0;\n\t"
		     "mov.b32 %0, 0;\n\t"
		     "mov.b32 %1, 0;\n\t"
		     "mov.b32 %2, 0;\n\t"
		     "mov.b32 %3, 0;\n\t"
		     "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t"
		     "}"
		     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
		     : "l"(p), "r"((int)ok));
	return v;
}
#endif

#endif
