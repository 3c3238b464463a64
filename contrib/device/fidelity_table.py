#!/usr/bin/env python3
"""docs/MODELS.md's fidelity table from test_golden's "fidelity:" lines (a CUDA run's
log on stdin or in the files named): one row per model and path (prefill, incremental,
batched), the cases of a path summed; the median is the longest case's."""
import re
import sys

LINE = re.compile(
	r"fidelity: (\S+)\s+(case\d+-prefill|case\d+-incr|batched)\s+rows\s+(\d+) worst (\S+) "
	r"median (\S+) argmax (\d+)/(\d+) over (\d+) flips (\d+) cache (\d+) gemm-in (\d+) "
	r"flip-rate (\d+)/(\d+) same-routing-worst (\S+) fp32-in-worst (\S+)"
	r"(?: bf16-in-worst (\S+))? tol (\S+)")
PATHS = {"prefill": "prefill", "incr": "incremental", "batched": "batched"}


def main():
	rows = {}
	lines = (l for f in (sys.argv[1:] or ["-"]) for l in (sys.stdin if f == "-" else open(f)))
	for line in lines:
		m = LINE.search(line)
		if not m:
			continue
		name, path = m.group(1), PATHS[m.group(2).split("-")[-1]]
		n, worst, median = int(m.group(3)), float(m.group(4)), float(m.group(5))
		r = rows.setdefault((name, path), dict(n=0, worst=0, median=0, longest=0, arg=0, over=0,
							flips=0, cache=0, gemm=0, fl=0, dec=0,
							same=-1, fx=-1, bx=-1, tol=m.group(17)))
		r["n"] += n
		r["worst"] = max(r["worst"], worst)
		if n >= r["longest"]:
			r["longest"], r["median"] = n, median
		r["arg"] += int(m.group(6))
		for k, g in (("over", 8), ("flips", 9), ("cache", 10), ("gemm", 11)):
			r[k] += int(m.group(g))
		r["fl"] += int(m.group(12))
		r["dec"] += int(m.group(13))
		r["same"] = max(r["same"], float(m.group(14)))
		r["fx"] = max(r["fx"], float(m.group(15)))
		if m.group(16):
			r["bx"] = max(r["bx"], float(m.group(16)))
	print("| model | path | rows | worst row | median row (longest case) | argmax agreement "
	      "| rows over tol | flips | bf16 cache | bf16 precision | unexplained | flip rate (decisions) "
	      "| worst vs CPU with GPU routing + bf16 cache | the same + bf16 GEMM inputs "
	      "| worst GPU with nothing rounded but the cache vs the first |")
	print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for (name, path), r in rows.items():
		unexpl = r["over"] - r["flips"] - r["cache"] - r["gemm"]
		rate = (f"{r['fl']}/{r['dec']} ({100.0 * r['fl'] / r['dec']:.2f}%)" if r["dec"] else "—")
		same = f"{r['same']:.2e}" if r["same"] >= 0 else "—"
		fx = f"{r['fx']:.2e}" if r["fx"] >= 0 else "—"
		bx = f"{r['bx']:.2e}" if r["bx"] >= 0 else "—"
		print(f"| {name} | {path} | {r['n']} | {r['worst']:.2e} | {r['median']:.2e} | "
		      f"{100.0 * r['arg'] / r['n']:.1f}% | {r['over']} | {r['flips']} | {r['cache']} | "
		      f"{r['gemm']} | {unexpl} | {rate} | {same} | {bx} | {fx} |")


if __name__ == "__main__":
	main()
