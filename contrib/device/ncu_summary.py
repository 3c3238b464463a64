#!/usr/bin/env python3
"""Summarises an `ncu --csv --metrics gpu__time_duration.sum` log of one decode step:
time per kernel name (total, calls, mean, share), then the kernel sequence of the step's
second layer-sized stretch so that one layer's launches can be read in order."""
import csv
import sys
from collections import OrderedDict


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            yield r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e3


def short(name):
    name = name.split("(")[0]
    return name.replace("void ", "")[:70]


def main():
    ks = [(short(n), us) for n, us in rows(sys.argv[1])]
    if not ks:
        print("  no kernels recorded")
        return
    total = sum(us for _, us in ks)
    agg = OrderedDict()
    for n, us in ks:
        a = agg.setdefault(n, [0.0, 0])
        a[0] += us
        a[1] += 1
    print(f"  {len(ks)} kernels, {total:.1f} us in all")
    for n, (us, c) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:10.1f} {c:5d} {us / c:8.2f} {100 * us / total:5.1f}%  {n}")
    print("  sequence (kernels 1..40):")
    for n, us in ks[1:41]:
        print(f"    {us:8.2f}  {n}")


if __name__ == "__main__":
    main()
