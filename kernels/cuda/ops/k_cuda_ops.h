/* The small CUDA ops of a layer: embedding, RMSNorm (plain and fused with the residual
 * add), residual add, SwiGLU, RoPE, and the fused attention inputs of GQA and MLA
 * layers. Each computes what its k_cpu_* reference does.
 *
 * Activations and norm weights are fp32, matrices bf16 (as uint16_t). All pointers are
 * device memory unless said. Every launcher returns 0, -EINVAL (bad sizes; nothing
 * launched) or -EIO (the launch failed; logged with kernel, file, line, device); none
 * allocates or synchronises, and the launch configuration depends only on the host
 * arguments, so each can be captured into a CUDA graph. Zero rows or elements: 0, no
 * launch. */
#ifndef KD_KERNELS_CUDA_K_CUDA_OPS_H
#define KD_KERNELS_CUDA_K_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/k_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i, :] = table[ids[i], :] widened to fp32. Every id must be < the table's rows
 * (the engine checks tokens before they reach the GPU). */
int k_cuda_embed(cudaStream_t s, float *out /* (n, dim) */, const int32_t *ids /* (n) */, int n,
		 const uint16_t *table /* (vocab, dim) bf16 */, int dim);

/* out = x / sqrt(mean(x^2) + eps) * w over each row of dim values; rows are x_stride /
 * out_stride floats apart. In place (out == x, equal strides) is allowed; otherwise
 * out and x must not overlap. Sum of squares in fp64 like k_cpu_rmsnorm. */
int k_cuda_rmsnorm(cudaStream_t s, float *out, int out_stride, const float *x, int x_stride,
		   const float *w /* (dim) */, int rows, int dim, float eps);

/* k_cuda_rmsnorm that also writes the output rounded to bf16 (nearest even), rows
 * contiguous: out_bf16 (rows, dim), for a linear layer that takes bf16 input next. */
int k_cuda_rmsnorm_bf16(cudaStream_t s, float *out, int out_stride, const float *x, int x_stride,
			const float *w /* (dim) */, int rows, int dim, float eps,
			uint16_t *out_bf16 /* (rows, dim) */);

/* x += r, then out = rmsnorm(x) * w: the residual add and the next pre-norm in one
 * pass. Rows are contiguous (stride dim). out may alias r (the forward's x += h;
 * h = norm(x)); out must not overlap x. */
int k_cuda_add_rmsnorm(cudaStream_t s, float *x /* (rows, dim) */, const float *r /* (rows, dim) */,
		       float *out /* (rows, dim) */, const float *w /* (dim) */, int rows, int dim,
		       float eps);

/* y += x, n floats. */
int k_cuda_add(cudaStream_t s, float *y, const float *x, size_t n);

/* out = silu(gate) * up, n floats; silu(g) = g / (1 + exp(-g)). out may alias gate. */
int k_cuda_silu_mul(cudaStream_t s, float *out, const float *gate, const float *up, size_t n);

/* The same over a fused gate/up projection: row r of gate_up holds inter gate values
 * then inter up values. out must not overlap gate_up. */
int k_cuda_silu_mul_rows(cudaStream_t s, float *out /* (rows, inter) */,
			 const float *gate_up /* (rows, 2 * inter) */, int rows, int inter);
/* The same, also writing out rounded to bf16 (nearest even) into out_bf16 (rows, inter).
 * out may be NULL (only the bf16 form written) where inter % 8 == 0 and gate_up and
 * out_bf16 are 16-byte aligned; -EINVAL otherwise. */
int k_cuda_silu_mul_rows_bf16(cudaStream_t s, float *out, const float *gate_up, int rows,
			      int inter, uint16_t *out_bf16);
/* The same from a gate_up in bf16 (rows, 2 * inter), into out_bf16 only (rows, inter);
 * inter % 8 == 0 and both 16-byte aligned, else -EINVAL. */
int k_cuda_silu_mul_rows_bf16in(cudaStream_t s, const uint16_t *gate_up, int rows, int inter,
				uint16_t *out_bf16);

/* Rotates x in place as k_cpu_rope does for a struct k_rope with these fields: head h
 * of row r starts at x + r*row_stride + h*head_stride, and its first dim values are
 * rotated by angle pos[r] * inv_freq[i] (fp32 product; cos and sin rounded from fp64,
 * then multiplied by attn_factor). interleaved: pairs (2i, 2i+1), else (i, i + dim/2).
 * dim even, 2..2048. inv_freq is the device copy of struct k_rope's table. */
int k_cuda_rope(cudaStream_t s, const float *inv_freq /* (dim / 2) */, int dim, int interleaved,
		float attn_factor, float *x, int n_rows, int n_heads, int row_stride,
		int head_stride, const int32_t *pos /* (n_rows) */);

/* The inputs of GQA attention from a layer's q/k/v projections, in one launch. */
struct k_cuda_qkv_args {
	float *q;			/* (rows, n_heads, head_dim) out */
	const float *q_src;		/* row r's q heads at q_src + r * q_rs */
	const float *k_src, *v_src;	/* row r's kv heads at k_src + r * k_rs, v_src + r * v_rs */
	long q_rs, k_rs, v_rs;
	int rows, n_heads, kv_heads, head_dim;	/* head_dim 1..512 */
	const float *q_norm, *k_norm;	/* (head_dim) RMSNorm weights per head, or NULL */
	float eps;
	const float *inv_freq;		/* (rope_dim / 2) */
	int rope_dim;			/* rotary dims of each head (even, <= head_dim; 0: none) */
	int interleaved;
	float attn_factor;
	const int32_t *pos;		/* (rows) */
	uint16_t *k_cache, *v_cache;	/* bf16 (slots, kv_heads, head_dim) */
	const int32_t *slots;		/* (rows); < 0: the row writes no KV */
};

/* q = rope(norm_q(q_src)) per q head; k = rope(norm_k(k_src)) and v = v_src per kv head,
 * rounded to bf16 into the cache at each row's slot: k_cuda_rmsnorm, k_cuda_rope and
 * k_cuda_kv_write's arithmetic in one kernel. 0, -EINVAL or -EIO. */
int k_cuda_qkv_post(cudaStream_t s, const struct k_cuda_qkv_args *a);

/* The inputs of MLA attention from a layer's q and kv_a projections, in one launch. */
struct k_cuda_mla_post_args {
	float *q_pe;		/* head h of row r's rope part at q_pe + r * q_rs + h * q_hs:
				 * its first rot_dim values rotated in place */
	long q_rs;
	int q_hs, n_heads;
	const float *q_src_pe;	/* NULL: q_pe is rotated in place. Else the heads come from
				 * q_src_pe + r * q_src_rs + h * q_hs (a fused projection's
				 * rows): the rope part rotated into q_pe, and the nope_dim
				 * values before it copied to those before q_pe */
	long q_src_rs;
	int nope_dim;
	const float *kv;	/* (rows, kv_rs): the kv_lora latent, then the pe_dim rope key */
	long kv_rs;
	int rows, kv_lora, pe_dim;	/* kv_lora 1..2048 */
	const float *norm;	/* (kv_lora) RMSNorm weight of the latent */
	float eps;
	const float *inv_freq;	/* (rot_dim / 2) */
	int rot_dim;		/* rotary dims (even, <= pe_dim, <= 1024; 0: none) */
	int interleaved;
	float attn_factor;
	const int32_t *pos;	/* (rows) */
	uint16_t *cache;	/* bf16 (slots, kv_lora + pe_dim) */
	const int32_t *slots;	/* (rows); < 0: the row writes no cache entry */
};

/* q_pe = rope(q_pe) per head (or q = [nope ; rope(pe)] from q_src_pe's rows);
 * [rmsnorm(latent) ; rope(key)] rounded to bf16 into the cache at each row's slot:
 * k_cuda_rmsnorm, k_cuda_rope (twice) and k_cuda_kv_write's arithmetic in one kernel.
 * kv and q_src_pe are only read. 0, -EINVAL (logged) or -EIO. */
int k_cuda_mla_post(cudaStream_t s, const struct k_cuda_mla_post_args *a);

#ifdef __cplusplus
}
#endif

#endif
