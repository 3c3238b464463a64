#!/usr/bin/env python3
"""Writes tiny quantized checkpoints in the layouts the published models use, and the
logits Hugging Face transformers computes with their dequantized weights in float32.

For each model below: a tiny bf16 model of a tests/data/tiny config (random weights,
widened like contrib/make_reference.py, seed), saved by save_pretrained; its 2-D
weights quantized from those bf16 values as the publisher's tools do and written with
the tensor names, dtypes and config.json quantization_config of the published models:
  fp8-block    DeepSeek-V3 / Kimi-K2: quant_method fp8, e4m3 `weight`, fp32
               `weight_scale_inv` (ceil(N/128), ceil(K/128)) = block amax / 448
  fp8-channel  compressed-tensors float-quantized, strategy channel: e4m3 `weight`,
               bf16 `weight_scale` (N, 1) = row amax / 448
  fp8-tensor   compressed-tensors float-quantized, strategy tensor: fp32 `weight_scale` [1]
  fp8-tensor-static  the same with static per-tensor input activations (W8A8, as
               RedHatAI's FP8 Llama/Qwen): bf16 `input_scale` [1] = amax / 448 of the
               linear's input over a calibration sequence (minmax observer); the
               reference does not round activations (kdec checks the scales, computes W8A16)
  fp8-fbgemm   Meta's Llama-3.1-405B-Instruct-FP8: quant_method fbgemm_fp8, e4m3 `weight`,
               fp32 `weight_scale` (N, 1) = row amax / 448
  int4-g32     compressed-tensors pack-quantized (Kimi-K2-Thinking): `weight_packed` int32
               (N, K/8), eight values + 8 per word, low nibble first; bf16 `weight_scale`
               (N, ceil(K/32)) = group amax / 7.5; int64 `weight_shape` [N, K]; value
               = clamp(round(w / scale), -8, 7) (a shorter last group where 32 does not
               divide K, as compressed-tensors quantizes it; the published dims divide)
Modules the published configs leave unquantized (embeddings, norms, the router,
lm_head, and for Kimi-K2-Thinking everything but the routed experts) stay bf16.
The reference: every weight dequantized (q.float() * scale.float()), the rest widened
from bf16, loaded into the transformers model in float32 (eager attention, CPU); the
logits of three token sequences and a greedy continuation (as make_reference.py).
Output tests/data/quant/<name>/ in the tests/data/golden format plus golden.json
"quant" and versions. kimi_k2_int4 is written in two shards with an index.

Needs torch, transformers, safetensors, numpy (pip); not used at build or test time.
usage: contrib/make_quant_reference.py [--seed S] [--out DIR] [NAME ...]
"""
import argparse
import importlib.util
import json
import os
import shutil
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("make_reference", os.path.join(HERE, "make_reference.py"))
mr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mr)

FP8_MAX = 448.0
CT_GROUP = {"input_activations": None, "output_activations": None, "targets": ["Linear"]}

# name: (tiny config, format, config overrides, quantized(tensor name) -> bool, shards)
KIMI_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def not_special(n):
    return not (n.startswith("model.embed_tokens") or n.startswith("lm_head") or
                n.endswith("mlp.gate.weight"))


def routed_expert(n):
    return ".mlp.experts." in n


MODELS = {
    "llama_fp8_block": ("llama", "fp8-block", {}, not_special, 1),
    "deepseek_v3_fp8_block": ("deepseek_v3", "fp8-block", {}, not_special, 1),
    "llama_fp8_channel": ("llama", "fp8-channel", {}, not_special, 1),
    "qwen3_fp8_tensor": ("qwen3", "fp8-tensor", {}, not_special, 1),
    "llama_fp8_tensor": ("llama", "fp8-tensor", {}, not_special, 1),
    "llama_fp8_tensor_static": ("llama", "fp8-tensor-static", {}, not_special, 1),
    "qwen3_fp8_channel": ("qwen3", "fp8-channel", {}, not_special, 1),
    "llama_int4": ("llama", "int4-g32", {}, not_special, 1),
    "llama_fp8_fbgemm": ("llama", "fp8-fbgemm", {}, not_special, 1),
    "kimi_k2_int4": ("kimi_k2", "int4-g32", {}, routed_expert, 2),
    # head_dim 20: at tp 2 and 4 o_proj's columns split inside int4 groups (restated)
    "qwen3_moe_int4": ("qwen3_moe", "int4-g32", {}, not_special, 1),
    # not committed: the other architectures in each format (KDEC_GOLDEN_EXTRA)
    "qwen3_moe_fp8_block": ("qwen3_moe", "fp8-block", {}, not_special, 1),
    "deepseek_v2_fp8_channel": ("deepseek_v2", "fp8-channel", {}, not_special, 1),
    "deepseek_v3_int4": ("deepseek_v3", "int4-g32", {}, not_special, 2),
    "kimi_k2_fp8_block": ("kimi_k2", "fp8-block", {}, not_special, 2),
    "qwen3_int4": ("qwen3", "int4-g32", {}, not_special, 1),
}


def quant_config(fmt, ignore):
    if fmt == "fp8-fbgemm":
        return {"activation_scale_ub": 1200.0, "modules_to_not_convert": ignore,
                "quant_method": "fbgemm_fp8"}
    if fmt == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
    group = dict(CT_GROUP)
    if fmt.startswith("fp8-"):
        w = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
             "num_bits": 8, "observer": "minmax", "observer_kwargs": {},
             "strategy": fmt.split("-")[1], "symmetric": True, "type": "float"}
        if fmt.endswith("-static"):
            group["input_activations"] = dict(w)
        fmt_name = "float-quantized"
    else:
        w = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
             "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
             "strategy": "group", "symmetric": True, "type": "int"}
        fmt_name = "pack-quantized"
    return {"config_groups": {"group_0": dict(group, weights=w)}, "format": fmt_name,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


def fp8_block(w):
    N, K = w.shape
    bn, bk = -(-N // 128), -(-K // 128)
    pad = torch.zeros(bn * 128, bk * 128)
    pad[:N, :K] = w
    blocks = pad.view(bn, 128, bk, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / FP8_MAX).float()
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    q = (w / full).to(torch.float8_e4m3fn)
    deq = q.float() * full
    return {"weight": q, "weight_scale_inv": scale.contiguous()}, deq


def fp8_rows(w, per_tensor, row_dtype=torch.bfloat16):
    if per_tensor:
        scale = (w.abs().amax().clamp(min=1e-12) / FP8_MAX).float().reshape(1)
        full = scale.reshape(1, 1)
    else:
        scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX).to(row_dtype)
        full = scale.float()
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * full


def int4_g32(w, g=32):
    """compressed-tensors' symmetric group quantization and pack_to_int32: a last,
    shorter group where g does not divide K; words padded with zero nibbles."""
    N, K = w.shape
    ng, nw = -(-K // g), -(-K // 8)
    pad = torch.zeros(N, ng * g)
    pad[:, :K] = w.abs()
    scale = (pad.view(N, ng, g).amax(dim=2).clamp(min=1e-12) / 7.5).to(torch.bfloat16)
    full = scale.float().repeat_interleave(g, 1)[:, :K]
    q = torch.clamp(torch.round(w / full), -8, 7).to(torch.int32)
    u = torch.zeros(N, nw * 8, dtype=torch.int64)
    u[:, :K] = q + 8
    u = u.view(N, nw, 8)
    packed = torch.zeros(N, nw, dtype=torch.int64)
    for i in range(8):
        packed |= u[:, :, i] << (4 * i)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return ({"weight_packed": packed.contiguous(), "weight_scale": scale.contiguous(),
             "weight_shape": torch.tensor([N, K], dtype=torch.int64)}, q.float() * full)


def quantize(fmt, w):
    w = w.float()
    if fmt == "fp8-block":
        return fp8_block(w)
    if fmt == "fp8-channel":
        return fp8_rows(w, False)
    if fmt == "fp8-fbgemm":
        return fp8_rows(w, False, torch.float32)
    if fmt.startswith("fp8-tensor"):
        return fp8_rows(w, True)
    return int4_g32(w)


def input_scales(model, names, vocab, seed, length=64):
    """llm-compressor's static minmax observer: amax / 448 of each named linear's input
    over one calibration sequence, bf16 [1]."""
    amax, hooks = {}, []
    for n, mod in model.named_modules():
        if n + ".weight" in names:
            def hook(_, args, n=n):
                amax[n] = max(amax.get(n, 0.0), args[0].detach().abs().max().float().item())
            hooks.append(mod.register_forward_pre_hook(hook))
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        model(torch.randint(0, vocab, (1, length), generator=g))
    for h in hooks:
        h.remove()
    return {n + ".input_scale": torch.tensor([amax[n] / FP8_MAX], dtype=torch.bfloat16)
            for n in amax}


def save_shards(tensors, out, shards):
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    wmap = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=1)


def make(name, out_root, seed, widen=0, lengths=(5, 48, 150)):
    base, fmt, over, quantized, shards = MODELS[name]
    raw = dict(json.load(open(os.path.join("tests/data/tiny", base + ".json"))), **over)
    if widen:  # other dims, as contrib/make_unseen_references.sh: one more layer, wider MLPs
        raw["num_hidden_layers"] += 1
        for k in ("moe_intermediate_size", "intermediate_size"):
            if k in raw:
                raw[k] += widen
    raw.pop("dtype", None)  # the published models keep their unquantized parts in bf16
    raw["torch_dtype"] = "bfloat16"
    hf_raw = dict(raw, model_type=mr.HF_TYPE.get(raw["model_type"], raw["model_type"]))
    tmp = tempfile.mkdtemp()
    json.dump(hf_raw, open(os.path.join(tmp, "config.json"), "w"))
    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # as make_reference.py: wide enough for margins
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            else:
                p.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    bf16_dir = os.path.join(tmp, "bf16")
    model.to(torch.bfloat16).save_pretrained(bf16_dir)
    state = {}
    for f in sorted(os.listdir(bf16_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(bf16_dir, f)))
    stored, deq, n_q = {}, {}, 0
    for n, t in sorted(state.items()):
        if t.dim() == 2 and n.endswith(".weight") and quantized(n):
            parts, d = quantize(fmt, t)
            for suffix, v in parts.items():
                stored[n[:-len("weight")] + suffix] = v
            deq[n] = d.contiguous()
            n_q += 1
        else:
            stored[n] = t
            deq[n] = t.float().contiguous()
    if fmt.endswith("-static"):
        scales = input_scales(model, {n for n in state if quantized(n) and state[n].dim() == 2},
                              raw["vocab_size"], seed)
        if len(scales) != n_q:
            raise SystemExit(f"{name}: {len(scales)} input scales for {n_q} quantized linears")
        stored.update(scales)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    save_shards(stored, out, shards)
    ignore = KIMI_THINKING_IGNORE if quantized is routed_expert else ["lm_head"]
    cfg = dict(raw, quantization_config=quant_config(fmt, ignore))
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)

    # the reference: the dequantized weights in float32 through from_pretrained (which
    # maps per-expert names onto transformers' own layout), buffers through bf16
    ref_dir = os.path.join(tmp, "ref")
    os.makedirs(ref_dir)
    json.dump(hf_raw, open(os.path.join(ref_dir, "config.json"), "w"))
    save_file(deq, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, b in ref.named_buffers():
            if b.is_floating_point():
                b.copy_(b.to(torch.bfloat16).float())
        for n, p in ref.named_parameters():  # the load must have taken every weight
            if n in deq and not torch.equal(p, deq[n]):
                raise SystemExit(f"{name}: {n} did not load as written")
    mr.eager(ref)
    vocab = raw["vocab_size"]
    cases = mr.write_cases(ref, vocab, lengths, seed, out)
    best = mr.pick_greedy(ref, vocab, seed)
    meta = {"arch": raw["model_type"], "seed": seed, "transformers": transformers.__version__,
            "torch": torch.__version__, "dtype": "bfloat16",
            "quant": {"format": fmt, "quantized_tensors": n_q, "shards": shards},
            "cases": cases}
    if best:
        meta["greedy"] = {"prompt": best[0], "output": best[1], "min_top2_margin": best[2],
                          "distinct": len(set(best[1]))}
    json.dump(meta, open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {fmt}, {n_q} quantized tensors, {size} bytes -> {out}")


# committed under tests/data/quant; the others are for other dims (KDEC_GOLDEN_EXTRA)
COMMITTED = ("llama_fp8_block", "deepseek_v3_fp8_block", "llama_fp8_channel", "qwen3_fp8_tensor",
             "llama_fp8_tensor_static", "llama_int4", "kimi_k2_int4", "qwen3_moe_int4")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default="tests/data/quant")
    ap.add_argument("--widen", type=int, default=0,
                    help="MLP widths + W and one more layer (other dims; not the committed set)")
    ap.add_argument("names", nargs="*", help="default: the committed set; 'all': every model")
    a = ap.parse_args()
    names = list(MODELS) if a.names == ["all"] else a.names or COMMITTED
    for n in names:
        if n not in MODELS:
            raise SystemExit(f"unknown model {n}: one of {', '.join(MODELS)} or all")
        make(n, a.out, a.seed, a.widen)


if __name__ == "__main__":
    main()
