#!/usr/bin/env python3
"""HF transformers decode peer for `kdbench decode` (issue 3, "Targets").

Random weights of a local config.json's shape (no download), bf16, one GPU. Per batch size: prefill
--ctx random tokens per sequence, then time --steps single-token greedy decode steps (after --warmup),
each step one forward of the B new tokens with the KV cache plus argmax, between two synchronizations.

  --cache static   StaticCache, decode forward compiled the way `generate()` does it by itself for a
                   static cache (model.get_compiled_call: torch.compile mode="reduce-overhead",
                   i.e. CUDA graphs); the prefill runs eagerly, as in generate(). --no-compile: eager.
  --cache dynamic  DynamicCache, eager (plain HF).

Example (repo root, on the GPU machine):
  python3 contrib/bench/hf_decode.py --config tests/data/configs/llama3.1-8b.json --cache static \
      --batch 1,8,32,64 --ctx 1024 --steps 50 --json /tmp/peers.jsonl
"""

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402


def parse_args():
    p = pc.common_args(__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=("static", "dynamic"), required=True)
    p.add_argument("--no-compile", action="store_true", help="static cache without torch.compile")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--compile-dynamic", choices=("auto", "false", "true"), default="auto",
                   help="torch.compile dynamic=: auto (None, generate()'s default: the batch dimension "
                        "turns dynamic at the second batch size, so 2 compiles for 4 sizes), false "
                        "(one static-shape compile per batch size: slower to run), true")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile fullgraph=True")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--experts-impl", default=None,
                   help="MoE experts_implementation (eager, grouped_mm, batched_mm); default: the "
                        "library's choice, switched for decode the way generate() does")
    p.add_argument("--check", action="store_true",
                   help="after the timed steps, compare the last step's logits with a cache-free forward "
                        "of the whole sequence (tiny models only)")
    return p.parse_args()


def build_model(torch, args, cfg_dict, dtype):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg_dict)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        pc.die(f"{args.config}: no model_type")
    for k in ("torch_dtype", "dtype", "transformers_version", "architectures"):
        cfg.pop(k, None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        pc.die(f"transformers {transformers.__version__} has no config class for model_type "
               f"{model_type!r}: {e}")
    kw = {"attn_implementation": args.attn}
    if args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    t0 = time.perf_counter()
    # Parameters are created (and randomly initialised) directly on the device.
    with torch.device(args.device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kw)
        except TypeError:  # older spelling
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, **kw)
    model.eval()
    nparams = sum(p.numel() for p in model.parameters())
    pc.info(f"{type(model).__name__}: {nparams / 1e9:.3f} B params, {config.num_hidden_layers} layers, "
            f"dtype {next(model.parameters()).dtype}, attn {model.config._attn_implementation}"
            + (f", experts {model.config._experts_implementation}"
               if any(getattr(config, k, None) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
               else "")
            + f", built in {time.perf_counter() - t0:.1f} s (transformers {transformers.__version__}, "
            f"torch {torch.__version__})")
    return model, config, nparams


def decode_context(model):
    """generate() switches MoE experts to their decode implementation around the decode loop."""
    f = getattr(model, "_optimize_model_for_decode", None)
    if f is None:
        return contextlib.nullcontext()
    try:
        return f()
    except Exception:  # private API: never let it break the benchmark
        return contextlib.nullcontext()


def run_batch(torch, args, model, config, B, compiled_call):
    from transformers import DynamicCache, StaticCache

    dev = args.device
    vocab = config.vocab_size
    total_len = args.ctx + args.warmup + args.steps + 1
    maxpos = getattr(config, "max_position_embeddings", None)
    if maxpos and total_len > maxpos:
        raise ValueError(f"ctx+warmup+steps = {total_len} exceeds max_position_embeddings {maxpos}")
    gen = torch.Generator(device="cpu").manual_seed(args.seed + B)
    prompt = torch.randint(0, vocab, (B, args.ctx), generator=gen).to(dev)
    if args.cache == "static":
        cache = StaticCache(config=model.config, max_cache_len=total_len)
    else:
        cache = DynamicCache(config=model.config)

    st = {"pos": args.ctx, "tok": None, "logits": None, "toks": []}
    fwd = compiled_call if compiled_call is not None else model.__call__

    with torch.no_grad():
        pc.sync(torch, dev)
        t0 = time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        st["tok"] = out.logits[:, -1:].argmax(-1)
        pc.sync(torch, dev)
        prefill_s = time.perf_counter() - t0
        del out

        def step():
            if compiled_call is not None:
                torch.compiler.cudagraph_mark_step_begin()
            pos_ids = torch.full((B, 1), st["pos"], dtype=torch.long, device=dev)
            o = fwd(input_ids=st["tok"], past_key_values=cache, position_ids=pos_ids, use_cache=True)
            st["tok"] = o.logits[:, -1:].argmax(-1)
            st["pos"] += 1
            if args.check:
                st["logits"] = o.logits[:, -1].float().clone()
                st["toks"].append(st["tok"])

        if args.check:
            st["toks"].append(st["tok"])
        with decode_context(model):
            pc.sync(torch, dev)
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step()
            pc.sync(torch, dev)
            warmup_s = time.perf_counter() - t0
            lat = pc.time_steps(torch, dev, step, args.steps)

        extra = {"prefill_s": round(prefill_s, 3), "warmup_s": round(warmup_s, 3)}
        if args.check:
            # The last step consumed every generated token but the newest one.
            seq = torch.cat([prompt] + st["toks"][:-1], dim=1)
            ref = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1].float()
            err = (ref - st["logits"]).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            same = bool((ref.argmax(-1) == st["logits"].argmax(-1)).all())
            pc.info(f"check B={B}: max |diff| / max |logit| = {err:.2e} vs a cache-free forward of "
                    f"{seq.shape[1]} tokens; greedy tokens equal: {same}")
            extra["check_rel_err"] = err
    del cache
    return lat, extra


def main():
    args = parse_args()
    torch = pc.setup_device(args)
    t_start = time.perf_counter()
    cfg_dict = pc.load_config_dict(args)
    name = pc.model_name(args, cfg_dict)
    dtype = getattr(torch, args.dtype)
    compiled = args.cache == "static" and not args.no_compile
    peer = "hf-static" if compiled else ("hf-static-eager" if args.cache == "static" else "hf-dynamic")
    if compiled and args.warmup < 3:
        pc.info("warmup raised to 3 (torch.compile runs, then records the CUDA graph, then replays)")
        args.warmup = 3

    try:
        model, config, nparams = build_model(torch, args, cfg_dict, dtype)
    except SystemExit:
        raise
    except Exception as e:
        table = pc.Table(args.json)
        for B in args.batch:
            table.fail(peer, name, B, args.ctx, "model construction failed: " + pc.short_exc(e))
        return 1

    compiled_call = None
    if compiled:
        from transformers import CompileConfig
        dyn = {"auto": None, "false": False, "true": True}[args.compile_dynamic]
        cc = CompileConfig(fullgraph=args.fullgraph, dynamic=dyn, mode=args.compile_mode)
        if args.device == "cpu":
            cc._compile_all_devices = True
        compiled_call = model.get_compiled_call(cc)
        if dyn is False:
            pc.info(f"decode forward: torch.compile(model.__call__, mode={args.compile_mode!r}, dynamic=False, "
                    f"fullgraph={args.fullgraph}), compiled afresh for each batch size")
        else:
            pc.info(f"decode forward: torch.compile(mode={args.compile_mode!r}, dynamic={dyn}, "
                    f"fullgraph={args.fullgraph}) via model.get_compiled_call, as generate() does")

    table = pc.Table(args.json)
    base_extra = {"params": nparams, "layers": config.num_hidden_layers, "dtype": args.dtype,
                  "cache": args.cache, "compiled": compiled, "device": args.device}
    for bi, B in enumerate(args.batch):
        # the budget never skips the first batch size
        if bi and args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            table.fail(peer, name, B, args.ctx, f"skipped: --budget-s {args.budget_s:g} s used up", base_extra)
            continue
        if compiled and args.compile_dynamic == "false":
            torch._dynamo.reset()
            compiled_call = torch.compile(model.__call__, mode=args.compile_mode, dynamic=False,
                                          fullgraph=args.fullgraph)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        tb = time.perf_counter()
        try:
            lat, extra = run_batch(torch, args, model, config, B, compiled_call)
        except Exception as e:  # report the reason, go on with the next batch size
            reason = pc.short_exc(e)
            if "OutOfMemoryError" in type(e).__name__:
                reason = "out of GPU memory: " + reason
            elif compiled:
                reason = "static cache + torch.compile failed: " + reason
            table.fail(peer, name, B, args.ctx, reason, base_extra)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        extra.update(base_extra)
        extra.update(pc.mem_extra(torch, args.device))
        extra["batch_wall_s"] = round(time.perf_counter() - tb, 2)
        table.row(peer, name, B, args.ctx, lat, extra)
        pc.info(f"{peer} B={B}: prefill {extra['prefill_s']:.2f} s, warm-up {args.warmup} steps "
                f"{extra['warmup_s']:.2f} s{' (compile included)' if compiled else ''}, {args.steps} steps, "
                f"wall {extra['batch_wall_s']:.1f} s")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    pc.info(f"{peer} {name}: done in {time.perf_counter() - t_start:.1f} s")
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
