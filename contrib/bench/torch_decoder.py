#!/usr/bin/env python3
"""Plain PyTorch Llama decoder, decode step under torch.compile(mode="reduce-overhead"): the
"gpt-fast style" peer of `kdbench decode` (issue 3, "Targets"). Llama shapes only.

RMSNorm, RoPE (default / linear / llama3 scaling from the config), GQA attention over a preallocated
static KV cache written at the step's position, SwiGLU MLP, lm_head; random weights of the config's
shape (fused QKV and gate/up matrices). One decode step = embed B tokens, all layers, lm_head, argmax,
compiled with fullgraph=True and static shapes (one compile per batch size; CUDA graphs replay it).
Attention (--attn): "sdpa" = scaled_dot_product_attention with the G query heads of a KV head taken
as G query rows over that head's cache (no K/V replication) and a mask of the valid cache length;
"manual" = the same as two batched matmuls and a softmax. The prefill (eager, not timed) fills the
cache with --ctx random tokens per sequence.

Same command line and table as hf_decode.py; --check-hf compares with transformers' LlamaForCausalLM
given the same weights (tiny configs, to test the implementation).
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args():
    p = pc.common_args(__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=("static",), default="static",
                   help="accepted for a command line shared with hf_decode.py: the cache is static")
    p.add_argument("--attn", choices=("sdpa", "manual"), default="sdpa")
    p.add_argument("--no-compile", action="store_true", help="eager decode steps (debugging)")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--prefill-tokens", type=int, default=16384,
                   help="most tokens per prefill chunk (the batch is prefilled a few rows at a time)")
    p.add_argument("--check-hf", action="store_true",
                   help="compare logits with transformers' LlamaForCausalLM on the same weights (tiny configs)")
    return p.parse_args()


class Shape:
    def __init__(self, c):
        if c.get("model_type") != "llama":
            pc.die(f"torch_decoder.py implements Llama shapes only; this config's model_type is "
                   f"{c.get('model_type')!r} (use hf_decode.py for it)")
        if c.get("attention_bias") or c.get("mlp_bias"):
            pc.die("attention_bias / mlp_bias are not implemented (Llama 3 has none)")
        if c.get("hidden_act", "silu") != "silu":
            pc.die(f"hidden_act {c.get('hidden_act')!r}: only silu (SwiGLU) is implemented")
        self.dim = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.dim // self.n_heads
        self.inter = c["intermediate_size"]
        self.vocab = c["vocab_size"]
        self.eps = c.get("rms_norm_eps", 1e-5)
        self.tied = bool(c.get("tie_word_embeddings", False))
        rp = c.get("rope_scaling") or c.get("rope_parameters") or {}
        self.rope = dict(rp)
        self.rope_theta = c.get("rope_theta", rp.get("rope_theta", 10000.0))
        if self.n_heads % self.n_kv:
            pc.die(f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv}")


def rope_inv_freq(s):
    hd = s.head_dim
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    kind = s.rope.get("rope_type", s.rope.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / s.rope["factor"]
    if kind == "llama3":
        # Wavelengths longer than the original context / low_freq_factor are stretched by `factor`,
        # those shorter than original / high_freq_factor kept; in between, interpolate linearly in
        # original_context / wavelength.
        factor = s.rope["factor"]
        lo, hi = s.rope["low_freq_factor"], s.rope["high_freq_factor"]
        orig = s.rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        ratio = orig / wavelen
        t = ((ratio - lo) / (hi - lo)).clamp(0.0, 1.0)
        return inv / factor * (1 - t) + inv * t
    pc.die(f"rope type {kind!r} is not implemented (default, linear, llama3)")


def rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


def apply_rope(x, cos, sin):
    # x: (B, T, H, hd), halves rotated (the HF layout); cos, sin: (T, hd/2) fp32
    h = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Decoder(torch.nn.Module):
    def __init__(self, s, dtype, device, std=0.02):
        super().__init__()
        self.s = s
        self.dtype = dtype

        def w(*shape):
            t = torch.empty(shape, dtype=dtype, device=device)
            t.normal_(0.0, std)
            return torch.nn.Parameter(t, requires_grad=False)

        def ones(n):
            return torch.nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)

        qkv_out = (s.n_heads + 2 * s.n_kv) * s.head_dim
        self.embed = w(s.vocab, s.dim)
        self.layers = torch.nn.ModuleList()
        for _ in range(s.n_layers):
            m = torch.nn.Module()
            m.attn_norm = ones(s.dim)
            m.wqkv = w(qkv_out, s.dim)
            m.wo = w(s.dim, s.n_heads * s.head_dim)
            m.ffn_norm = ones(s.dim)
            m.w13 = w(2 * s.inter, s.dim)
            m.w2 = w(s.dim, s.inter)
            self.layers.append(m)
        self.norm = ones(s.dim)
        self.lm_head = self.embed if s.tied else w(s.vocab, s.dim)
        self.max_len = 0
        self.k_cache = []
        self.v_cache = []

    def setup_cache(self, batch, max_len, device):
        s = self.s
        self.k_cache, self.v_cache = [], []
        for i in range(s.n_layers):
            for name, lst in (("k", self.k_cache), ("v", self.v_cache)):
                t = torch.zeros(batch, s.n_kv, max_len, s.head_dim, dtype=self.dtype, device=device)
                # a registered buffer with a fixed address: the CUDA graph may mutate it in place
                self.register_buffer(f"{name}_cache_{i}", t, persistent=False)
                torch._dynamo.mark_static_address(t)
                lst.append(t)
        self.max_len = max_len
        inv = rope_inv_freq(s)
        pos = torch.arange(max_len, dtype=torch.float64)
        ang = torch.outer(pos, inv)
        self.register_buffer("rope_cos", ang.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", ang.sin().float().to(device), persistent=False)
        self.register_buffer("kv_index", torch.arange(max_len, device=device), persistent=False)

    def drop_cache(self):
        for i in range(len(self.k_cache)):
            delattr(self, f"k_cache_{i}")
            delattr(self, f"v_cache_{i}")
        self.k_cache, self.v_cache = [], []

    def forward(self, tokens, input_pos, rows=None, attn="sdpa"):
        """tokens (B, T) at positions input_pos (T,); writes K/V there; returns the last position's
        logits (B, V). T > 1 is a prefill from position 0 (cache rows `rows`); T == 1 a decode step."""
        s = self.s
        B, T = tokens.shape
        G = s.n_heads // s.n_kv
        x = F.embedding(tokens, self.embed)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        if T == 1:
            valid = (self.kv_index <= input_pos[-1]).view(1, 1, 1, -1)
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, s.eps)
            qkv = F.linear(h, L.wqkv)
            q, k, v = qkv.split([s.n_heads * s.head_dim, s.n_kv * s.head_dim, s.n_kv * s.head_dim], dim=-1)
            q = apply_rope(q.view(B, T, s.n_heads, s.head_dim), cos, sin)
            k = apply_rope(k.view(B, T, s.n_kv, s.head_dim), cos, sin)
            v = v.view(B, T, s.n_kv, s.head_dim)
            kc, vc = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            if rows is not None:
                kc, vc = kc[rows], vc[rows]
            kc.index_copy_(2, input_pos, k.transpose(1, 2))
            vc.index_copy_(2, input_pos, v.transpose(1, 2))
            if T == 1:
                # the G query heads sharing a KV head are G query rows over that head's cache
                qg = q.view(B, s.n_kv, G, s.head_dim)
                if attn == "sdpa":
                    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=valid)
                else:
                    sc = torch.matmul(qg, kc.transpose(-1, -2)).float() * (1.0 / math.sqrt(s.head_dim))
                    sc = sc.masked_fill(~valid, float("-inf"))
                    o = torch.matmul(sc.softmax(-1).to(vc.dtype), vc)
                o = o.reshape(B, 1, s.n_heads * s.head_dim)
            else:
                qt = q.transpose(1, 2)
                kt = k.transpose(1, 2).repeat_interleave(G, dim=1)
                vt = v.transpose(1, 2).repeat_interleave(G, dim=1)
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                o = o.transpose(1, 2).reshape(B, T, s.n_heads * s.head_dim)
            x = x + F.linear(o, L.wo)
            h = rms_norm(x, L.ffn_norm, s.eps)
            g, u = F.linear(h, L.w13).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, L.w2)
        x = rms_norm(x[:, -1], self.norm, s.eps)
        return F.linear(x, self.lm_head)

    def prefill(self, prompt, chunk_tokens):
        B, T = prompt.shape
        pos = torch.arange(T, device=prompt.device)
        rows_per = max(1, chunk_tokens // T)
        out = []
        for b0 in range(0, B, rows_per):
            r = slice(b0, min(B, b0 + rows_per))
            out.append(self.forward(prompt[r], pos, rows=r).argmax(-1, keepdim=True))
        return torch.cat(out, 0)


def hf_reference(dec, cfg_dict):
    """transformers' LlamaForCausalLM holding `dec`'s weights (for --check-hf)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = {k: v for k, v in cfg_dict.items() if k not in ("model_type", "torch_dtype", "dtype", "architectures")}
    m = LlamaForCausalLM(LlamaConfig(**cfg)).to(dec.dtype).eval()
    s = dec.s
    nq, nk = s.n_heads * s.head_dim, s.n_kv * s.head_dim
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(dec.embed)
        for L, H in zip(dec.layers, m.model.layers):
            H.input_layernorm.weight.copy_(L.attn_norm)
            H.self_attn.q_proj.weight.copy_(L.wqkv[:nq])
            H.self_attn.k_proj.weight.copy_(L.wqkv[nq:nq + nk])
            H.self_attn.v_proj.weight.copy_(L.wqkv[nq + nk:])
            H.self_attn.o_proj.weight.copy_(L.wo)
            H.post_attention_layernorm.weight.copy_(L.ffn_norm)
            H.mlp.gate_proj.weight.copy_(L.w13[:s.inter])
            H.mlp.up_proj.weight.copy_(L.w13[s.inter:])
            H.mlp.down_proj.weight.copy_(L.w2)
        m.model.norm.weight.copy_(dec.norm)
        if not s.tied:
            m.lm_head.weight.copy_(dec.lm_head)
    return m


def run_batch(args, dec, B, dev, cfg_dict):
    s = dec.s
    # cache length: the context and every step, rounded up to 16 (mask alignment); attention reads it
    # all, masked to the valid length, as gpt-fast does with its max_seq_length
    total_len = (args.ctx + args.warmup + args.steps + 1 + 15) // 16 * 16
    gen = torch.Generator(device="cpu").manual_seed(args.seed + B)
    prompt = torch.randint(0, s.vocab, (B, args.ctx), generator=gen).to(dev)
    dec.setup_cache(B, total_len, dev)
    st = {"pos": args.ctx, "toks": [], "logits": None}

    def step_tokens(tok, input_pos):
        return dec(tok, input_pos, attn=args.attn).argmax(-1, keepdim=True)

    def step_logits(tok, input_pos):
        return dec(tok, input_pos, attn=args.attn)

    fn = step_logits if args.check_hf else step_tokens
    compiled = not args.no_compile
    if compiled:
        torch._dynamo.reset()  # static shapes: a fresh graph for this batch size and these buffers
        fn = torch.compile(fn, mode=args.compile_mode, fullgraph=True, dynamic=False)
    # the step's position: a graph input (CUDA graphs copy it in at each replay)
    input_pos = torch.tensor([args.ctx], dtype=torch.long, device=dev)

    with torch.no_grad():
        pc.sync(torch, dev)
        t0 = time.perf_counter()
        st["tok"] = dec.prefill(prompt, args.prefill_tokens)
        pc.sync(torch, dev)
        prefill_s = time.perf_counter() - t0
        st["toks"].append(st["tok"])

        def step():
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            input_pos.fill_(st["pos"])
            out = fn(st["tok"], input_pos)
            if args.check_hf:
                st["logits"] = out.float().clone()
                out = out.argmax(-1, keepdim=True)
            st["tok"] = out.clone()
            st["pos"] += 1
            if args.check_hf:
                st["toks"].append(st["tok"])

        pc.sync(torch, dev)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        pc.sync(torch, dev)
        warmup_s = time.perf_counter() - t0
        lat = pc.time_steps(torch, dev, step, args.steps)

        extra = {"prefill_s": round(prefill_s, 3), "warmup_s": round(warmup_s, 3)}
        if args.check_hf:
            ref_model = hf_reference(dec, cfg_dict).to(dev)
            seq = torch.cat([prompt] + st["toks"][:-1], dim=1)
            ref = ref_model(input_ids=seq, use_cache=False).logits.float()
            err = (ref[:, -1] - st["logits"]).abs().max().item() / max(ref[:, -1].abs().max().item(), 1e-30)
            # the greedy tokens this decoder chose at every position after the prompt
            same = bool((ref[:, args.ctx - 1:].argmax(-1) == torch.cat(st["toks"], 1)).all())
            pc.info(f"check-hf B={B}: last step max |diff| / max |logit| = {err:.2e} against "
                    f"LlamaForCausalLM over {seq.shape[1]} tokens; all {len(st['toks'])} greedy tokens "
                    f"equal: {same}")
            extra["check_rel_err"] = err
            extra["check_tokens_equal"] = same
            del ref_model
    dec.drop_cache()
    return lat, extra


def main():
    args = parse_args()
    pc.setup_device(args)
    t_start = time.perf_counter()
    cfg = pc.load_config_dict(args)
    s = Shape(cfg)
    name = pc.model_name(args, cfg)
    dtype = getattr(torch, args.dtype)
    dev = args.device
    peer = "torch-compile" if not args.no_compile else "torch-eager"
    if not args.no_compile and args.warmup < 3:
        pc.info("warmup raised to 3 (torch.compile runs, then records the CUDA graph, then replays)")
        args.warmup = 3
    if args.check_hf and args.dtype != "float32":
        pc.info("--check-hf: differences are at the scale of --dtype; use float32 for a tight check")

    t0 = time.perf_counter()
    dec = Decoder(s, dtype, dev).eval()
    nparams = sum(p.numel() for p in dec.parameters())
    pc.info(f"Llama decoder: {nparams / 1e9:.3f} B params, {s.n_layers} layers, dim {s.dim}, heads "
            f"{s.n_heads}/{s.n_kv}x{s.head_dim}, ffn {s.inter}, vocab {s.vocab}, rope "
            f"{s.rope.get('rope_type', s.rope.get('type', 'default'))}, {args.dtype}, attn {args.attn}, "
            f"built in {time.perf_counter() - t0:.1f} s (torch {torch.__version__})")
    if not args.no_compile:
        pc.info(f"decode step: torch.compile(mode={args.compile_mode!r}, fullgraph=True, dynamic=False), "
                f"one compile per batch size")

    table = pc.Table(args.json)
    base_extra = {"params": nparams, "layers": s.n_layers, "dtype": args.dtype, "attn": args.attn,
                  "compiled": not args.no_compile, "device": dev}
    for bi, B in enumerate(args.batch):
        # the budget never skips the first batch size
        if bi and args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            table.fail(peer, name, B, args.ctx, f"skipped: --budget-s {args.budget_s:g} s used up", base_extra)
            continue
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        tb = time.perf_counter()
        try:
            try:
                lat, extra = run_batch(args, dec, B, dev, cfg)
            except Exception as e:
                if args.attn != "sdpa" or "OutOfMemoryError" in type(e).__name__:
                    raise
                # insurance for a one-shot device run: the same step with matmul attention
                pc.info(f"B={B} with --attn sdpa failed ({pc.short_exc(e)}); retrying with --attn manual")
                if dec.k_cache:
                    dec.drop_cache()
                args.attn = base_extra["attn"] = "manual"  # and for the batch sizes after this one
                base_extra["attn_note"] = "sdpa failed: " + pc.short_exc(e)
                lat, extra = run_batch(args, dec, B, dev, cfg)
        except Exception as e:
            reason = pc.short_exc(e)
            if "OutOfMemoryError" in type(e).__name__:
                reason = "out of GPU memory: " + reason
            table.fail(peer, name, B, args.ctx, reason, base_extra)
            if dec.k_cache:
                dec.drop_cache()
            if dev == "cuda":
                torch.cuda.empty_cache()
            continue
        extra = dict(base_extra, **extra)
        extra.update(pc.mem_extra(torch, dev))
        extra["batch_wall_s"] = round(time.perf_counter() - tb, 2)
        table.row(peer, name, B, args.ctx, lat, extra)
        pc.info(f"{peer} B={B}: prefill {extra['prefill_s']:.2f} s, warm-up {args.warmup} steps "
                f"{extra['warmup_s']:.2f} s{' (compile included)' if not args.no_compile else ''}, "
                f"{args.steps} steps, wall {extra['batch_wall_s']:.1f} s")
        if dev == "cuda":
            torch.cuda.empty_cache()
    pc.info(f"{peer} {name}: done in {time.perf_counter() - t_start:.1f} s")
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
