#!/usr/bin/env python3
"""Where a kernel's warps stall, line by line, from ncu's source page:

    ncu --set full --import-source yes -k regex:NAME -o rep ...   (a -lineinfo build)
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    contrib/device/ncu_stalls.py rep_sass.csv [TOP]

For the first profile of each kernel in the file: its stall samples by reason, then the
TOP (default 25) SASS lines with the most samples, in address order, each with its two
largest reasons and how often it ran. long_sb is a wait on global or local memory,
short_sb on shared memory, wait a fixed-latency dependency, barrier a __syncthreads."""
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"


def kernels(path):
    """(name, [row dict per SASS line]) for each kernel section, in file order."""
    name, header, lines = None, None, []
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                if name is not None:
                    yield name, lines
                name, header, lines = r[1].split("(")[0], None, []
            elif r and r[0] == "Address":
                header = r
            elif header and name is not None:
                lines.append(dict(zip(header, r)))
    if name is not None:
        yield name, lines


def count(row, key):
    v = row.get(key, "") or "0"
    try:
        return int(v.replace(",", ""))
    except ValueError:
        return 0


def report(name, lines, top):
    total = sum(count(l, ALL) for l in lines) or 1
    reasons = [k for k in (lines[0] if lines else {})
               if k.startswith("stall_") and "Not Issued" not in k]
    by = sorted(((sum(count(l, k) for l in lines), k[6:]) for k in reasons), reverse=True)
    print(f"== {name}: {len(lines)} SASS lines, {total} samples")
    print("  by reason: " + ", ".join(f"{k} {100 * v / total:.0f}%" for v, k in by[:8] if v))
    worst = sorted(range(len(lines)), key=lambda i: -count(lines[i], ALL))[:top]
    for i in sorted(worst):
        l = lines[i]
        two = sorted(((count(l, k), k[6:]) for k in reasons), reverse=True)[:2]
        print(f"  {i:5d} {100 * count(l, ALL) / total:5.1f}%  {l.get('Source', '').strip()[:58]:58s}"
              f"  {two[0][1]} {two[0][0]}, {two[1][1]} {two[1][0]}"
              f"  (ran {l.get('Instructions Executed', '?')})")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    seen = set()
    for name, lines in kernels(sys.argv[1]):
        if name not in seen:	# a kernel profiled twice: its first profile
            seen.add(name)
            report(name, lines, top)


if __name__ == "__main__":
    main()
