#!/usr/bin/env python3
"""Writes reference checkpoints and logits with Hugging Face transformers, for configs
the project chooses (other dims and seeds than the shared golden models).

For each config in tests/data/tiny/*.json: build the model with random weights (seed),
cast it to the config's dtype and save it with save_pretrained, cast the same model back
to float32 and compute the logits of a few token sequences with eager attention on the CPU
(the way the shared golden references were made). Output: tests/data/reference/<name>/
with config.json, model.safetensors, golden.json and caseN.logits.f32, the same format
as tests/data/golden.

Needs torch and transformers (pip); not used at build or test time.
usage: contrib/make_reference.py [--seed S] [--out DIR] [CONFIG.json ...]
"""
import argparse
import glob
import json
import os
import shutil
import tempfile

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# model_types transformers lacks but whose architecture it has under another name
HF_TYPE = {"kimi_k2": "deepseek_v3"}


def make(cfg_path, out_root, seed):
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
    ref.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed + 1)
    vocab = raw["vocab_size"]
    cases = []
    for i, T in enumerate((5, 48, 150)):
        tokens = torch.randint(0, vocab, (T,), generator=g).tolist()
        with torch.no_grad():
            logits = ref(torch.tensor([tokens])).logits[0].float().contiguous()
        fname = f"case{i}.logits.f32"
        logits.numpy().astype("<f4").tofile(os.path.join(out, fname))
        top2 = logits.topk(2, dim=-1).values
        cases.append({"tokens": tokens, "logits": fname, "shape": [T, vocab],
                      "min_top2_margin": float((top2[:, 0] - top2[:, 1]).min())})
    json.dump({"arch": raw["model_type"], "seed": seed, "transformers": transformers.__version__,
               "torch": torch.__version__, "dtype": dtype_name, "cases": cases},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default="tests/data/reference")
    ap.add_argument("configs", nargs="*")
    a = ap.parse_args()
    for c in a.configs or sorted(glob.glob("tests/data/tiny/*.json")):
        make(c, a.out, a.seed)


if __name__ == "__main__":
    main()
