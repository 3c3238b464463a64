/* A loaded model: its config and a view of every weight tensor, checked by name,
 * shape and dtype against what the architecture needs before anything runs.
 * Weights live in memory the model owns: the files read whole at load (never a mapping
 * of a file, which a truncation would turn into SIGBUS and a rewrite into other
 * weights under a running daemon), a dequantized copy, or a synthetic buffer. The one
 * exception, opts->mapped: a model that is only the source of tensor-parallel shards
 * (model_shard.c reads each rank's slice straight from the mapped files at start, so
 * the whole model is never resident; nothing reads the mapping after). */
#ifndef KD_DAEMON_MODEL_H
#define KD_DAEMON_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model_config.h"
#include "daemon/model/safetensors.h"
#include "kernels/ops.h"

struct gguf_file;

/* A weight as stored, row-major (rows, cols); a vector has cols == 1. A quantized
 * weight (q.fmt != K_Q_NONE) keeps its payload in data and its scales in q; dtype is
 * then the model's compute dtype and says nothing about data. */
struct model_tensor {
	const void *data;
	enum k_dtype dtype;
	int64_t rows;
	int64_t cols;
	struct k_quant q;
};

struct model_layer {
	struct model_tensor attn_norm;	/* (hidden) input_layernorm */
	struct model_tensor ffn_norm;	/* (hidden) post_attention_layernorm */

	/* GQA (llama, qwen3, qwen3_moe) */
	struct model_tensor wq;		/* (n_heads * head_dim, hidden) */
	struct model_tensor wk;		/* (n_kv_heads * head_dim, hidden) */
	struct model_tensor wv;		/* (n_kv_heads * head_dim, hidden) */
	struct model_tensor q_norm;	/* (head_dim) qwen3 only */
	struct model_tensor k_norm;	/* (head_dim) qwen3 only */

	/* MLA (deepseek_v2, deepseek_v3, kimi_k2); qk = nope + rope dims */
	struct model_tensor wq_a;	/* (q_lora, hidden) when q_lora_rank > 0 */
	struct model_tensor q_a_norm;	/* (q_lora) */
	struct model_tensor wq_b;	/* (n_heads * qk, q_lora), or q_proj (n_heads * qk, hidden) */
	struct model_tensor wkv_a;	/* (kv_lora + rope, hidden) kv_a_proj_with_mqa */
	struct model_tensor kv_a_norm;	/* (kv_lora) */
	struct model_tensor wkv_b;	/* (n_heads * (nope + v), kv_lora): W_UK, W_UV per head */

	struct model_tensor wo;		/* (hidden, n_heads * head_dim) or (hidden, n_heads * v) */

	/* Dense MLP, or the shared expert of a MoE layer (absent when w_gate.data == NULL) */
	struct model_tensor w_gate;	/* (inter, hidden) */
	struct model_tensor w_up;	/* (inter, hidden) */
	struct model_tensor w_down;	/* (hidden, inter) */

	/* MoE */
	int is_moe;
	struct model_tensor router;	/* (n_experts, hidden) mlp.gate */
	float *router_bias;		/* (n_experts) e_score_correction_bias as fp32, owned; or NULL */
	enum k_dtype expert_dtype;	/* all experts of a layer share one dtype */
	struct model_tensor expert_gate, expert_up, expert_down;	/* the last expert bound:
					 * shape, dtype, quantization (all experts share them) */
	struct k_expert *experts;	/* (n_experts) gate/up (moe_inter, hidden), down (hidden, moe_inter); owned array */
};

struct synth_job;	/* model_synthetic.c */

struct model {
	struct model_config cfg;
	char *path;			/* directory, GGUF or config file it came from; owned */
	int synthetic;			/* weights generated, not read */
	struct st_set files;		/* weight files, read whole, or mapped (empty when
					 * synthetic) */
	int mapped;			/* files mapped, not read (model_load_opts.mapped) */
	void *synthetic_buf;		/* owned storage of synthetic weights */
	struct synth_job *synth_jobs;	/* owned: a synthetic model made lazily (synthetic +
					 * mapped: it only feeds tensor-parallel shards): what each
					 * tensor's values are, generated slice by slice into the
					 * shards (model_synthetic_read); its tensors point into
					 * synth_reserve, address space no page backs (a read
					 * faults) */
	unsigned n_synth_jobs;
	uint64_t synth_seed;
	void *synth_reserve;		/* owned: PROT_NONE reservation, synth_reserve_bytes */
	size_t synth_reserve_bytes;
	struct gguf_file *gguf;		/* owned: the GGUF file the model came from, read whole;
					 * NULL, or released once every weight is in gguf_buf */
	void *gguf_buf;			/* owned: weights dequantized from it (gguf_buf_bytes) */
	size_t gguf_buf_bytes;
	void *shard_buf;		/* owned: a tensor-parallel rank's weights (model_shard.c;
					 * anonymous pages, munmap) */
	size_t shard_bytes;		/* its size */
	int held_experts;		/* an expert-parallel shard: the experts each MoE layer's
					 * array holds (its share, renumbered from 0); 0: all
					 * cfg.n_experts */
	size_t weight_bytes;		/* total bytes of all bound weights (quantized: payload
					 * + scales) */
	int n_quantized;		/* weights bound quantized (q.fmt != K_Q_NONE) */
	int stream_counted;		/* the two sums below are set (model_count_stream_bytes) */
	double stream_dense_bytes;	/* every tensor but the routed experts, as streamed */
	double stream_expert_bytes;	/* all routed experts, as streamed */
	double stream_last_dense_bytes;	/* the last layer's share of each of the two */
	double stream_last_expert_bytes;

	struct model_tensor embed;	/* (vocab, hidden) */
	struct model_tensor final_norm;	/* (hidden) */
	struct model_tensor lm_head;	/* (vocab, hidden); the embedding when tied */
	struct model_layer *layers;	/* (n_layers), owned */
};

struct model_load_opts {
	int synthetic;		/* build deterministic random weights, read no weight file */
	uint64_t seed;		/* synthetic weights' seed */
	int n_layers;		/* > 0: keep only the first n layers (benchmarks of huge configs) */
	uint64_t gguf_f32_limit;	/* GGUF: dequantize to fp32 up to this many bytes of
					 * weights, else bf16; 0: MODEL_GGUF_F32_LIMIT (4 GiB) */
	struct model_quant weight_format;	/* synthetic: store the linear weights
					 * quantized so (format MODEL_Q_NONE: the config's
					 * dtype; --weight-format) */
	int mapped;		/* map the files (safetensors, or a GGUF) instead of reading
				 * them, for a model that only feeds tensor-parallel shards
				 * (--tp > 1): a GGUF's tensors are then dequantized slice by
				 * slice into the shards; a synthetic model's values are
				 * generated slice by slice into the shards (never whole) */
};

/* --weight-format NAME: bf16 (none), fp8-block (128x128), fp8-channel, fp8-tensor,
 * int4-g32 (any int4-gN). 0, or -EINVAL with one line in err. */
int model_weight_format_parse(const char *s, struct model_quant *q, char *err, size_t err_len);

/* Loads DIR (config.json + safetensors) or a GGUF file (model_gguf.c), or with
 * opts->synthetic a config given as a directory, a config.json or a GGUF path. Returns 0 or -errno with one line in err.
 * *out is owned by the caller: model_destroy. */
int model_load(struct model **out, const char *path, const struct model_load_opts *opts,
	       char *err, size_t err_len);
void model_destroy(struct model *m);	/* accepts NULL and half-built models */

/* How m's linear weights are held, for people (kdctl status, kdecd's load line): the
 * quantized format (model_quant_name), else the dtype in lower case, with ", from GGUF"
 * where a GGUF's blocks were dequantized at load. buf, n >= 32. */
const char *model_weights_name(const struct model *m, char *buf, size_t n);

/* Gives back the pages of a mapped model's files that hold [p, p + bytes) (madvise
 * MADV_DONTNEED: they are read again from the file if touched again), so that a
 * shard built tensor by tensor never keeps more than a tensor of the file resident.
 * Nothing for a model that is not mapped, or a range outside its files. */
void model_release_pages(const struct model *m, const void *p, size_t bytes);

/* Parameters (elements) of all the weights cfg needs, counted over the same tensor list
 * that loading binds, without allocating them. 0 or -ENOMEM. */
int model_count_params(const struct model_config *cfg, int64_t *params);

/* m->stream_dense_bytes / stream_expert_bytes: every tensor's bytes as the GPU
 * streams them (quantized: as stored, with scales; else bf16), routed experts apart
 * (all of them), and the last layer's share of each (stream_last_*: kdbench's
 * layer_us floor). model_load calls it; engine_weight_bytes reads the sums. */
void model_count_stream_bytes(struct model *m);

/* Fills every tensor of m from a synthetic buffer (model_synthetic.c), or with lazy
 * only reserves its addresses and keeps how each tensor is made; with q's format
 * not MODEL_Q_NONE, every linear weight but the embedding, lm_head and the router is
 * stored quantized as q says, with random payloads and scales that keep activations
 * O(1) (the published checkpoints leave those three unquantized too). */
int model_synthesize(struct model *m, uint64_t seed, const struct model_quant *q, int lazy,
		     char *err, size_t err_len);

/* A lazy synthetic model (lazy above): the bytes [src, src + bytes) of one tensor (payload
 * or scales) would hold, into dst. 0, or -EINVAL when the range is not inside one tensor
 * (or not on its elements). */
int model_synthetic_read(const struct model *m, void *dst, const void *src, size_t bytes);

/* The shape of each tensor the architecture needs, in load order: calls fn for each
 * with its HF name, the slot to fill and its shape. Shared by loading and synthesis. */
typedef int (*model_tensor_fn)(void *ctx, const char *name, struct model_tensor *slot,
			       int64_t rows, int64_t cols);
int model_for_each_tensor(struct model *m, model_tensor_fn fn, void *ctx);

#endif
