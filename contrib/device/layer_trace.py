#!/usr/bin/env python3
"""One decoder layer's kernels inside a replayed decode graph, from an nsys
`cuda_gpu_trace` csv (contrib/device/layer_trace.sh): each kernel's start from the end
of the layer's previous KEY kernel, its duration and its gap from the kernel before it
(negative: they overlapped, programmatic dependent launch), for the last two layers
of the run that end with a KEY kernel. Usage: layer_trace.py CSV [KEY] (KEY: a
substring of the layer's last kernel name, default m1_down; qkv_post suits dense
models, whose layers it starts)."""
import csv, sys
path, key = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "m1_down")
rows = []
with open(path, newline="") as f:
    for r in csv.DictReader(f):
        name = r.get("Name") or r.get("Kernel Name") or ""
        try:
            s = float(r.get("Start (ns)") or r.get("Start"))
            d = float(r.get("Duration (ns)") or r.get("Duration"))
        except (TypeError, ValueError):
            continue
        if "[CUDA mem" in name:
            continue
        rows.append((s, d, name))
rows.sort()
idx = [i for i, r in enumerate(rows) if key in r[2]]
print(f"# {len(rows)} kernels, {len(idx)} with '{key}'")
if len(idx) < 4:
    for s, d, n in rows[-40:]:
        print(f"{d/1e3:9.2f} us  {n[:100]}")
    sys.exit(0)
for prev, lay in ((idx[-4], idx[-3]), (idx[-3], idx[-2])):
    t0 = pe = rows[prev][0] + rows[prev][1]
    for s, d, n in rows[prev + 1: lay + 1]:
        print(f"  start {(s - t0)/1e3:8.2f}  dur {d/1e3:7.2f}  gap {(s - pe)/1e3:6.2f}  {n.split('(')[0][:90]}")
        pe = s + d
    print(f"  layer: {(pe - t0)/1e3:.2f} us")
