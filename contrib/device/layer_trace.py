#!/usr/bin/env python3
"""Where one decode step's time goes, kernel by kernel, inside its replayed graph, from
contrib/device/kernel_trace.c's csv (start_ns,end_ns,correlation,graph_id,graph_node,
ctas,threads,name). The last graph launch of at least 40 kernels is the step; its
layers are found as the period of its kernel names. Prints the step's span, the layer
period in time (layer_us), one middle layer kernel by kernel (start from the layer's
first kernel, duration, gap after the kernel before: negative where programmatic
dependent launch overlapped them) and, over the whole step, each kernel name's count,
summed duration and its share of the timeline (the time it alone advanced the end of
the step: overlaps go to the kernel that started first).
Usage: layer_trace.py CSV [TITLE]"""
import re, sys
from collections import defaultdict


def short(name):
    """A mangled kernel name's identifier (the last part of a nested name, anonymous
    namespaces skipped), or the name itself up to its arguments."""
    if not name.startswith("_Z"):
        return name.split("(")[0][:60]
    i, parts = 2 + (name[2:3] == "N"), []
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        n = int(name[i:j])
        parts.append(name[j:j + n])
        i = j + n
        if name[2:3] != "N":
            break
    parts = [p for p in parts if not p.startswith("_GLOBAL__N")]
    return parts[-1] if parts else name[:60]


def load(path):
    groups = defaultdict(list)
    with open(path) as f:
        for line in f:
            p = line.rstrip("\n").split(",", 7)
            if len(p) < 8:
                continue
            s, e, corr = int(p[0]), int(p[1]), int(p[2])
            groups[corr].append((s, e, int(p[5]), short(p[7])))
    return groups


def period(names):
    lo, hi = len(names) // 8, len(names) - len(names) // 8
    for p in range(3, max(4, (hi - lo) // 3)):
        same = sum(names[i] == names[i + p] for i in range(lo, hi - p))
        if same >= 0.97 * (hi - lo - p):
            return p
    return 0


def main():
    path = sys.argv[1]
    title = sys.argv[2] if len(sys.argv) > 2 else path
    steps = [g for g in load(path).values() if len(g) >= 40]
    if not steps:
        print(f"# {title}: no graph launch of 40 kernels or more")
        return
    k = sorted(steps[-1])
    names = [r[3] for r in k]
    t0, t1 = k[0][0], max(r[1] for r in k)
    print(f"# {title}: step {len(k)} kernels, {(t1 - t0) / 1e3:.1f} us span")
    p = period(names)
    if p:
        first = next((i for i in range(len(k) // 4, len(k)) if "rmsnorm" in names[i]), len(k) // 4)
        starts = [k[i][0] for i in range(first, len(k) - p, p) if names[i] == names[first]]
        d = [b - a for a, b in zip(starts, starts[1:])]
        print(f"# layer: {p} kernels, layer_us {sum(d) / len(d) / 1e3:.2f} "
              f"(min {min(d) / 1e3:.2f}, max {max(d) / 1e3:.2f}, {len(d)} layers)")
        mid = first + p * (len(d) // 2)
        lay0, pe = k[mid][0], k[mid - 1][1]
        for s, e, ctas, n in k[mid: mid + p]:
            print(f"  start {(s - lay0) / 1e3:7.2f}  dur {(e - s) / 1e3:7.2f}  "
                  f"gap {(s - pe) / 1e3:6.2f}  ctas {ctas:5d}  {n}")
            pe = e
    else:
        print("# no layer period found")
    tot, cnt, own = defaultdict(int), defaultdict(int), defaultdict(int)
    reach = t0
    for s, e, _, n in k:
        tot[n] += e - s
        cnt[n] += 1
        own[n] += max(0, e - max(s, reach))
        reach = max(reach, e)
    print(f"  {'kernel':44s} {'count':>5s} {'sum us':>9s} {'timeline us':>11s} {'share':>6s}")
    for n in sorted(own, key=lambda n: -own[n]):
        print(f"  {n[:44]:44s} {cnt[n]:5d} {tot[n] / 1e3:9.1f} {own[n] / 1e3:11.1f} "
              f"{100 * own[n] / (t1 - t0):5.1f}%")


main()
