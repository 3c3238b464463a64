#!/usr/bin/env python3
"""The agent benchmark's table (agent_serving.sh): one row per session count from
OUTDIR/agent_S.json, with kdbench decode's p50 step at that batch (OUTDIR/decode.jsonl),
and the daemon's decode-only steps under the traffic: their mean and the floor their bytes
(weights and the rows' KV, kd_decode_step_bytes_total) put under it at kdbench's --hbm-tbs.
usage: agent_table.py OUTDIR S..."""
import json
import os
import sys


def main():
    outdir, sessions = sys.argv[1], [int(s) for s in sys.argv[2:]]
    decode = {}
    path = os.path.join(outdir, "decode.jsonl")
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            decode[r["batch"]] = r["step_ms_p50"]
    print("| sessions | P90 interactivity (tok/s/user) | vs 1 session | TTFT p50 / p90 (ms) "
          "| ITL p50 / p99 / max (ms) | ITL p99 / p50 | output tok/s | prefix hit rate "
          "| decode step at that batch, ctx 4096 (ms) | decode steps under the traffic: mean / floor (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for s in sessions:
        path = os.path.join(outdir, f"agent_{s}.json")
        if not os.path.exists(path):
            print(f"| {s} | (no result: see agent_{s}.log) | | | | | | | | |")
            continue
        r = json.load(open(path))
        inter = r["p90_interactivity_tokens_per_s"]
        if base is None and s == 1:
            base = inter
        t, i = r["ttft_ms"], r["itl_ms"]
        rel = f"{inter / base:.2f}x" if base else "-"
        ratio = f"{i['p99'] / i['p50']:.1f}" if i["p50"] > 0 else "-"
        step = f"{decode[s]:.2f}" if s in decode else "-"
        d = r.get("decode_steps")
        under = (f"{d['mean_ms']:.2f} / {d['floor_ms']:.2f} ({100 * d['floor_ms'] / d['mean_ms']:.0f}%)"
                 if d else "-")
        print(f"| {s} | {inter:.1f} | {rel} | {t['p50']:.0f} / {t['p90']:.0f} "
              f"| {i['p50']:.1f} / {i['p99']:.1f} / {i['max']:.0f} | {ratio} "
              f"| {r['output_tokens_per_s']:.0f} | {r['prefix_hit_rate']:.3f} | {step} | {under} |")


if __name__ == "__main__":
    main()
