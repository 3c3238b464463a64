#!/usr/bin/env python3
"""Summarises an `ncu --csv --page details` log (sections SpeedOfLight, Occupancy,
LaunchStats and the stall metrics named in stalls()) one line per kernel launch, in launch order: duration,
DRAM throughput, grid x block, registers, theoretical / achieved occupancy, and the
three largest warp stall reasons (cycles per issued instruction of each).

    contrib/device/ncu_details.py ncu.csv [NAME_REGEX]
"""
import csv
import re
import sys
from collections import OrderedDict


def launches(path):
    """OrderedDict: launch ID -> (kernel name, {metric name: (unit, value)})."""
    out = OrderedDict()
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        lid = r.get("ID")
        if lid is None:
            continue
        name, metrics = out.setdefault(lid, (r["Kernel Name"], {}))
        metrics[r["Metric Name"]] = (r.get("Metric Unit", ""), r.get("Metric Value", ""))
        metrics.setdefault("_grid", ("", r.get("Grid Size", "")))
        metrics.setdefault("_block", ("", r.get("Block Size", "")))
    return out


def num(metrics, key):
    v = metrics.get(key, ("", ""))[1].replace(",", "")
    try:
        return float(v)
    except ValueError:
        return None


def short(name):
    name = re.sub(r"\(.*$", "", name).replace("void ", "").replace("<unnamed>::", "")
    return name[:34]


def stalls(metrics, top=3):
    """The largest stall reasons (cycles per issued instruction), from the metrics
    smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio (ask for them
    with --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio)."""
    rows = []
    for k, (unit, v) in metrics.items():
        m = re.match(r"smsp__average_warps_issue_stalled_(.*)_per_issue_active\.ratio", k)
        if m:
            try:
                rows.append((float(v.replace(",", "")), m.group(1)))
            except ValueError:
                pass
    rows.sort(reverse=True)
    return ", ".join(f"{n.lower()} {v:.1f}" for v, n in rows[:top])


def main():
    pat = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
    print(f"  {'kernel':34s} {'us':>7s} {'dram%':>6s} {'grid':>14s} {'block':>12s} {'regs':>4s}"
          f" {'occ th/ach':>10s}  top stalls (cycles per instruction)")
    for _, (name, m) in launches(sys.argv[1]).items():
        if pat and not pat.search(name):
            continue
        dur = num(m, "Duration")
        unit = m.get("Duration", ("", ""))[0]
        us = dur / 1e3 if dur is not None and unit in ("nsecond", "ns") else dur
        dram = num(m, "DRAM Throughput")
        th, ach = num(m, "Theoretical Occupancy"), num(m, "Achieved Occupancy")
        regs = num(m, "Registers Per Thread")
        print(f"  {short(name):34s} {us if us is not None else 0:7.2f} {dram or 0:6.1f}"
              f" {m['_grid'][1]:>14s} {m['_block'][1]:>12s} {int(regs or 0):4d}"
              f" {th or 0:4.0f}/{ach or 0:4.1f}  {stalls(m)}")


if __name__ == "__main__":
    main()
