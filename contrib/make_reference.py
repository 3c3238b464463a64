#!/usr/bin/env python3
"""Writes reference checkpoints and logits with Hugging Face transformers, for configs
the project chooses (other dims and seeds than the shared golden models).

For each config in tests/data/tiny/*.json: build the model with random weights (seed),
cast it to the config's dtype and save it with save_pretrained, cast the same model back
to float32 and compute the logits of a few token sequences with eager attention on the CPU
(the way the shared golden references were made). Output: tests/data/reference/<name>/
with config.json, model.safetensors, golden.json and caseN.logits.f32, the same format
as tests/data/golden.

--greedy: for each reference folder already written (DIR/<name>, its checkpoint as
saved), add golden.json's "greedy": a 20-id prompt and the 40 tokens transformers
generates from it greedily with its KV cache, on the same float32 model (the checkpoint
cast back to float32, buffers rounded through the checkpoint dtype as above). The prompt
is, of N_TRIES seeded random prompts whose continuation holds at least MIN_DISTINCT
different tokens, the one whose smallest top-two margin is widest, so the check
follows a varying sequence (one token repeated, as golden/qwen3's is, proves little);
the versions that made it are recorded beside it. The cases are left as they are.

Needs torch, transformers, safetensors and numpy (pip); not used at build or test time.
usage: contrib/make_reference.py [--seed S] [--out DIR] [--lengths 5,48,150] [--greedy] [CONFIG.json ...]
"""
import argparse
import glob
import json
import os
import shutil
import tempfile

import numpy

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# model_types transformers lacks but whose architecture it has under another name
HF_TYPE = {"kimi_k2": "deepseek_v3"}


def eager(ref):
    """Attention and MoE experts in transformers' plain forms: its grouped_mm experts
    refuse widths whose strides are not multiples of 16 bytes (other dims)."""
    ref.config._attn_implementation = "eager"
    try:
        ref.set_experts_implementation("eager")
    except (AttributeError, ValueError):  # no experts, or a transformers without the switch
        pass


def write_cases(ref, vocab, lengths, seed, out):
    """One random case of each length: its fp32 logits into out/caseI.logits.f32, and the
    golden.json entries (tokens, file, shape, smallest top-two margin)."""
    g = torch.Generator().manual_seed(seed + 1)
    cases = []
    for i, T in enumerate(lengths):
        tokens = torch.randint(0, vocab, (T,), generator=g).tolist()
        with torch.no_grad():
            logits = ref(torch.tensor([tokens])).logits[0].float().contiguous()
        fname = f"case{i}.logits.f32"
        logits.numpy().astype("<f4").tofile(os.path.join(out, fname))
        top2 = logits.topk(2, dim=-1).values
        cases.append({"tokens": tokens, "logits": fname, "shape": [T, vocab],
                      "min_top2_margin": float((top2[:, 0] - top2[:, 1]).min())})
    return cases


def make(cfg_path, out_root, seed, lengths=(5, 48, 150)):
    name = os.path.splitext(os.path.basename(cfg_path))[0]
    raw = json.load(open(cfg_path))
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    dtype = DTYPES[dtype_name]
    hf_raw = dict(raw, model_type=HF_TYPE.get(raw["model_type"], raw["model_type"]))
    tmp = tempfile.mkdtemp()
    json.dump(hf_raw, open(os.path.join(tmp, "config.json"), "w"))
    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # default init is tiny; widen it so logits have margins
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            else:
                p.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    model.to(dtype).save_pretrained(out)
    # the project's config keeps its own model_type and spelling
    shutil.copy(cfg_path, os.path.join(out, "config.json"))
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))

    # The shared golden references were computed by this model object cast back to
    # float32 after the cast to the checkpoint dtype, so its buffers (rotary inv_freq)
    # carry the checkpoint dtype's rounding; do the same.
    ref = model.float().eval()
    eager(ref)
    cases = write_cases(ref, raw["vocab_size"], lengths, seed, out)
    json.dump({"arch": raw["model_type"], "seed": seed, "transformers": transformers.__version__,
               "torch": torch.__version__, "dtype": dtype_name, "cases": cases},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {out}")


GREEDY_PROMPT, GREEDY_NEW = 20, 40
MIN_DISTINCT, N_TRIES = 12, 32


def decode(ref, prompt):
    """GREEDY_NEW tokens by argmax through the model's own KV cache (no generate(): its
    logits processors, such as min_new_tokens suppressing EOS, are not greedy decoding);
    the smallest top-two margin over the steps."""
    output, margin = [], float("inf")
    with torch.no_grad():
        o = ref(torch.tensor([prompt]), use_cache=True)
        for _ in range(GREEDY_NEW):
            row = o.logits[0, -1].float()
            top2 = row.topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            output.append(int(row.argmax()))
            o = ref(torch.tensor([[output[-1]]]), past_key_values=o.past_key_values, use_cache=True)
    return output, margin


def pick_greedy(ref, vocab, seed):
    """Of N_TRIES random prompts, the one whose greedy continuation has MIN_DISTINCT or
    more different tokens and the largest smallest top-two margin: (prompt, output,
    margin), or None."""
    g = torch.Generator().manual_seed(seed + 2)
    best = None
    for _ in range(N_TRIES):
        prompt = torch.randint(0, vocab, (GREEDY_PROMPT,), generator=g).tolist()
        output, margin = decode(ref, prompt)
        if len(set(output)) >= MIN_DISTINCT and (best is None or margin > best[2]):
            best = (prompt, output, margin)
    return best


def greedy(cfg_path, out_root, seed):
    name = os.path.splitext(os.path.basename(cfg_path))[0]
    out = os.path.join(out_root, name)
    meta_path = os.path.join(out, "golden.json")
    if not os.path.exists(meta_path):
        print(f"{name}: no {meta_path} (make it first, without --greedy): skipped")
        return
    meta = json.load(open(meta_path))
    raw = json.load(open(os.path.join(out, "config.json")))
    dtype = DTYPES[meta["dtype"]]
    hf_raw = dict(raw, model_type=HF_TYPE.get(raw["model_type"], raw["model_type"]))
    tmp = tempfile.mkdtemp()
    json.dump(hf_raw, open(os.path.join(tmp, "config.json"), "w"))
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.symlink(os.path.abspath(os.path.join(out, f)), os.path.join(tmp, f))
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    ref = model.float().eval()
    with torch.no_grad():  # as make's model.to(dtype).float(): buffers too
        for _, b in ref.named_buffers():
            if b.is_floating_point():
                b.copy_(b.to(dtype).float())
    eager(ref)
    vocab = raw["vocab_size"]
    # the model as loaded must give the stored logits of case 0 (the same model, then)
    c0 = meta["cases"][0]
    with torch.no_grad():
        l0 = ref(torch.tensor([c0["tokens"]])).logits[0].float()
    want = torch.from_numpy(numpy.fromfile(os.path.join(out, c0["logits"]), dtype="<f4")).view(l0.shape)
    err = float((l0 - want).norm() / want.norm())
    if not err <= 1e-5:
        raise SystemExit(f"{name}: the loaded checkpoint gives case 0 at rel L2 {err:.3g}, not the stored logits")
    best = pick_greedy(ref, vocab, seed)
    if best is None:
        raise SystemExit(f"{name}: no prompt of {N_TRIES} with {MIN_DISTINCT} different tokens")
    prompt, output, margin = best
    meta["greedy"] = {"prompt": prompt, "output": output, "min_top2_margin": margin,
                      "distinct": len(set(output)), "transformers": transformers.__version__,
                      "torch": torch.__version__}
    json.dump(meta, open(meta_path, "w"), indent=1)
    shutil.rmtree(tmp)
    print(f"{name}: case 0 rel L2 {err:.3g} as loaded; greedy {len(set(output))} distinct of "
          f"{GREEDY_NEW}, margin {margin:.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default="tests/data/reference")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--lengths", default="5,48,150", help="tokens of each case")
    ap.add_argument("configs", nargs="*")
    a = ap.parse_args()
    lengths = tuple(int(t) for t in a.lengths.split(","))
    for c in a.configs or sorted(glob.glob("tests/data/tiny/*.json")):
        if a.greedy:
            greedy(c, a.out, a.seed)
        else:
            make(c, a.out, a.seed, lengths)


if __name__ == "__main__":
    main()
