#!/usr/bin/env python3
"""Eager PyTorch prefill: the peer of `kdbench prefill` (issue 21, part 2). The Llama decoder of
torch_decoder.py (fused QKV and gate/up, bf16 weights, scaled_dot_product_attention with
is_causal=True on K/V repeated to the query heads, as an eager HF-style model runs it), one
sequence, one forward of the whole prompt, uncompiled; the median of --reps prefills of fresh
random prompts after one warm-up. --roof first times an 8192^3 bf16 matmul (cuBLAS through
torch): the tensor-core rate that kdbench prefill's floor takes (--tc-tflops).

    python3 contrib/bench/torch_prefill.py --config tests/data/configs/llama3.1-8b.json \\
        --tokens 1024,4096,16384,32768 --roof
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--tokens", type=pc.parse_int_list, default=[1024, 4096, 16384, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="truncate num_hidden_layers")
    p.add_argument("--roof", action="store_true", help="time an 8192^3 bf16 matmul first")
    p.add_argument("--json", default=None, help="append one JSON line per length")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return p.parse_args()


def roof(torch):
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    return 2.0 * n ** 3 / t / 1e12


def main():
    args = parse_args()
    import torch
    import torch_decoder as td

    if args.device == "cuda" and not torch.cuda.is_available():
        pc.die("CUDA is not available; this is a GPU benchmark (--device cpu only tests the code)")
    torch.manual_seed(0)
    with open(args.config) as f:
        cfg = json.load(f)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    s = td.Shape(cfg)
    if args.roof and args.device == "cuda":
        print(f"# roof: 8192^3 bf16 matmul {roof(torch):.0f} TFLOPS (torch {torch.__version__})")
    dec = td.Decoder(s, torch.bfloat16, args.device).eval()
    most = max(args.tokens)
    dec.setup_cache(1, most, args.device)
    print("# torch eager prefill (SDPA, is_causal), %s, %d layers" % (os.path.basename(args.config), s.n_layers))
    print("%7s %10s %10s %11s" % ("tokens", "p50_ms", "min_ms", "tok/s"))

    def once(T):
        prompt = torch.randint(0, s.vocab, (1, T), device=args.device)
        pc.sync(torch, args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            dec.prefill(prompt, T)
        pc.sync(torch, args.device)
        return (time.perf_counter() - t0) * 1e3

    once(min(512, most))
    for T in args.tokens:
        try:
            ts = sorted(once(T) for _ in range(args.reps))
        except Exception as e:  # out of memory at the longest lengths: a row that says so
            print("%7d %s" % (T, pc.short_exc(e)))
            continue
        p50 = ts[len(ts) // 2]
        print("%7d %10.2f %10.2f %11.0f" % (T, p50, ts[0], T / (p50 * 1e-3)))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"peer": "torch-eager-sdpa", "tokens": T, "ms_p50": p50,
                                    "ms_min": ts[0], "tok_s": T / (p50 * 1e-3)}) + "\n")


if __name__ == "__main__":
    main()
