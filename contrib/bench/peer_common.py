"""Shared pieces of the peer decode benchmarks (hf_decode.py, torch_decoder.py).

Both scripts take the same command line, time decode steps the same way and print the same
table, so that their rows sit beside `kdbench decode` in one device call (issue 3, "Targets").
"""

import argparse
import json
import os
import statistics
import sys
import time

COLUMNS = ("peer", "model", "batch", "ctx", "step_ms_p50", "tok_s_user", "tok_s_total")


def die(msg, code=2):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_int_list(s):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {s!r}")
    return vals


def parse_override(s):
    """key=value with a JSON value (falls back to the raw string)."""
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"--override wants key=value, got {s!r}")
    k, v = s.split("=", 1)
    try:
        v = json.loads(v)
    except json.JSONDecodeError:
        pass
    return k.strip(), v


def common_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="HF config.json (e.g. tests/data/configs/llama3.1-8b.json)")
    p.add_argument("--batch", type=parse_int_list, default=[1, 8, 32, 64], help="comma-separated batch sizes")
    p.add_argument("--ctx", type=int, default=1024, help="context (prefilled random tokens) per sequence")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps before timing")
    p.add_argument("--layers", type=int, default=None, help="truncate num_hidden_layers (quick tests)")
    p.add_argument("--override", type=parse_override, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value), e.g. --override hidden_size=256; repeatable")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (the benchmark) or cpu (only to test the code paths at tiny scale)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="append one JSON line per result to FILE")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no batch size after the first once this many seconds have passed since start")
    p.add_argument("--name", default=None, help="model name in the table (default: config file name)")
    return p


def load_config_dict(args):
    with open(args.config) as f:
        cfg = json.load(f)
    if args.layers is not None:
        if args.layers < 1:
            die("--layers must be >= 1")
        cfg["num_hidden_layers"] = args.layers
    for k, v in args.override:
        cfg[k] = v
    return cfg


def model_name(args, cfg):
    if args.name:
        return args.name
    name = os.path.splitext(os.path.basename(args.config))[0]
    if args.layers is not None:
        name += f"[L{args.layers}]"
    if args.override:
        name += "[" + ",".join(f"{k}={v}" for k, v in args.override) + "]"
    return name


def setup_device(args):
    """Returns the torch module after checking the device; exits non-zero without CUDA."""
    try:
        import torch
    except ImportError:
        die("PyTorch is not installed (pip install torch)")
    if args.device == "cuda" and not torch.cuda.is_available():
        die("CUDA is not available (torch %s, built for CUDA %s); this is a GPU benchmark. "
            "Use --device cpu only to test the code paths." % (torch.__version__, torch.version.cuda))
    if args.steps < 1 or args.warmup < 0 or args.ctx < 1:
        die("--steps must be >= 1, --warmup >= 0, --ctx >= 1")
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch


def sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(torch, device, step, n):
    """Runs step() n times, each between two synchronizations; returns the latencies in ms."""
    out = []
    for _ in range(n):
        sync(torch, device)
        t0 = time.perf_counter()
        step()
        sync(torch, device)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def percentile(xs, q):
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[i]


class Table:
    def __init__(self, json_path=None):
        self.json_path = json_path
        self.header_done = False
        self.failures = 0

    def _header(self):
        if not self.header_done:
            print("%-16s %-22s %5s %6s %12s %11s %12s" % COLUMNS, flush=True)
            self.header_done = True

    def row(self, peer, model, batch, ctx, lat_ms, extra=None):
        med = statistics.median(lat_ms)
        user = 1000.0 / med
        total = batch * user
        self._header()
        print("%-16s %-22s %5d %6d %12.3f %11.1f %12.1f" % (peer, model, batch, ctx, med, user, total), flush=True)
        rec = {
            "peer": peer, "model": model, "batch": batch, "ctx": ctx,
            "step_ms_p50": round(med, 4), "tok_s_user": round(user, 2), "tok_s_total": round(total, 2),
            "step_ms_p10": round(percentile(lat_ms, 10), 4), "step_ms_p90": round(percentile(lat_ms, 90), 4),
            "step_ms_min": round(min(lat_ms), 4), "steps": len(lat_ms),
        }
        if extra:
            rec.update(extra)
        self._json(rec)

    def fail(self, peer, model, batch, ctx, reason, extra=None):
        """A batch size that did not run: a table row of dashes plus the reason, and a JSON record."""
        self.failures += 1
        self._header()
        print("%-16s %-22s %5d %6d %12s %11s %12s   # %s" % (peer, model, batch, ctx, "-", "-", "-", reason),
              flush=True)
        rec = {"peer": peer, "model": model, "batch": batch, "ctx": ctx, "error": reason}
        if extra:
            rec.update(extra)
        self._json(rec)

    def _json(self, rec):
        if self.json_path:
            rec = dict(rec, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            with open(self.json_path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def info(msg):
    print(f"# {msg}", file=sys.stderr, flush=True)


def short_exc(e, limit=300):
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def mem_extra(torch, device):
    if device != "cuda":
        return {}
    return {"peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
