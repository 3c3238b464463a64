#!/usr/bin/env python3
"""The programmatic-dependent-launch order of built kernels, read off their SASS.

A kernel launched with programmatic stream serialisation may run while the kernel
before it still writes; griddepcontrol.wait (SASS: ACQBULK) is where those writes
become visible. This reads `cuobjdump -sass` output (files named on the command line,
or stdin) and, in every function that contains an ACQBULK, walks the control flow
from the entry along every path that has not yet passed an unpredicated ACQBULK
(branches both ways, predicated exits and waits as not taken). On such a path it
reports:
  - a global memory access (LDG, generic LD, LDGSTS, UTMALDG, UBLKCP, atomics,
    reductions, stores) that lacks the early-load marker LTC256B or LTC128B: the
    .L2::256B / .L2::128B qualifiers that only launch_check.cuh's k_cuda_pdl_early
    helpers emit, for
    weights and settled step inputs (docs/ARCHITECTURE.md, "Programmatic dependent
    launch"). One exception: an LDG whose address is a module-scope table's
    (constant bank 4, see from_symbol: CUDA's sincos reduction table, expf_tab);
    tests/pdl_order.sh checks that kernels/ declares no writable __device__ data;
  - PREEXIT (griddepcontrol.launch_dependents): a kernel must not let the next one
    start before it has waited itself, or a kernel two launches on could read what
    the one before this wrote before it is written -- unless it is a relay, named in
    a comment `pdl-order: relay NAME` in a .cu/.cuh file under the --waivers DIR
    (k_cuda_pdl_relay: the kernel after a relay reads early only what was written
    before the last kernel that is not one);
  - an indirect branch (BRX, JMX), whose targets this cannot follow.
Prints one line per finding, `FUNCTION: ADDR INSTRUCTION: why`, and a summary line;
exits 1 when anything was found, 2 when the input held no waiting function.

--waivers DIR: the kernels the check cannot yet decide, each named in a comment
`pdl-order: waive NAME: reason` in a .cu/.cuh file under DIR beside the kernel (NAME a
part of the mangled name). Their findings are counted and printed as one `waived`
line each, with the reason, and fail nothing; a waiver that matches no waiting
function fails (a stale one hides nothing, but must go).
"""
import os
import re
import sys

INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
PRED = re.compile(r"^@(!?U?P(?:T|\d+))\s+")
TARGET = re.compile(r"\b0x([0-9a-f]+)\b")

# Opcodes (before the first '.') that touch global memory.
ACCESS = {"LDG", "LD", "LDGSTS", "UTMALDG", "UBLKCP", "ATOMG", "ATOM", "RED", "REDG",
	  "REDAS", "STG", "ST", "UTMASTG", "UTMAREDG", "UBLKRED", "SULD", "SUST", "SUATOM",
	  "SURED", "TLD", "TEX", "TLD4"}
MARKS = {"LTC256B", "LTC128B"}


def parse(lines):
	"""{function: [(addr, pred, opcode, text)]} in the order given."""
	funcs, cur = {}, None
	for line in lines:
		m = FUNC.match(line)
		if m:
			cur = funcs.setdefault(m.group(1), [])
			continue
		m = INSN.search(line)
		if not m or cur is None:
			continue
		text = m.group(2).strip()
		pred = None
		p = PRED.match(text)
		if p:
			pred = p.group(1)
			text = text[p.end():]
		op = text.split()[0] if text else ""
		cur.append((int(m.group(1), 16), pred, op, text))
	return funcs


def always(pred):
	return pred is None or pred == "PT"


def successors(insns, i, index):
	"""Indexes that may run after insns[i] (None: an indirect branch)."""
	_, pred, op, text = insns[i]
	base = op.split(".")[0]
	nxt = [i + 1] if i + 1 < len(insns) else []
	if pred == "!PT":
		return nxt
	if base in ("BRX", "JMX", "BRXU", "JMXU"):
		return None
	if base in ("BRA", "JMP", "CALL", "JCAL"):
		m = TARGET.search(text[len(op):])
		tgt = [index[int(m.group(1), 16)]] if m and int(m.group(1), 16) in index else []
		if base == "CALL" or base == "JCAL" or not always(pred):
			return tgt + nxt
		return tgt
	if base in ("EXIT", "RET", "KILL") and always(pred):
		return []
	return nxt


REG = re.compile(r"\[(R\d+)(?:\.64)?(?:\+[^\]]*)?\]")
DEST = re.compile(r"^\S+\s+(R\d+)\b")


def from_symbol(insns, i, depth=48):
	"""Whether the address of insns[i] is a module-scope symbol's (constant bank 4:
	CUDA's math tables, the tree's const __device__ tables) plus an offset: its base
	register traced back through straight-line code to `LDC.64 R, c[0x4][..]`, each
	step an address sum that keeps R as its last source."""
	m = REG.search(insns[i][3])
	if not m:
		return False
	reg = m.group(1)
	for j in range(i - 1, max(-1, i - 1 - depth), -1):
		_, pred, op, text = insns[j]
		d = DEST.match(text)
		if not d or d.group(1) != reg:
			continue
		if pred is not None:
			return False
		base = op.split(".")[0]
		if base == "LDC" and "c[0x4]" in text:
			return True
		srcs = [s.strip() for s in text[len(op):].split(",")]
		if base == "MOV" or op.startswith("IMAD.MOV"):
			if re.fullmatch(r"R\d+", srcs[-1]):
				reg = srcs[-1]	# a copy: trace its source
				continue
			return False
		if base in ("IMAD", "IADD3", "LEA", "IADD", "VIADD") and srcs and srcs[-1] == reg:
			continue	# reg = f(...) + reg: keep tracing reg
		return False
	return False


def check(name, insns, relay=False):
	"""The findings of one function that waits; relay: its early trigger is allowed."""
	index = {a: i for i, (a, _, _, _) in enumerate(insns)}
	found, seen, todo = [], set(), [0]
	while todo:
		i = todo.pop()
		if i in seen or i >= len(insns):
			continue
		seen.add(i)
		addr, pred, op, text = insns[i]
		base = op.split(".")[0]
		if base == "ACQBULK" and always(pred):
			continue	# this path has waited
		if base in ACCESS and not MARKS & set(op.split(".")) and not (
				base == "LDG" and from_symbol(insns, i)):
			found.append((addr, text, "global access before the wait"))
		elif base == "PREEXIT" and not relay:
			found.append((addr, text, "launch_dependents before the wait"))
		s = successors(insns, i, index)
		if s is None:
			found.append((addr, text, "indirect branch before the wait (not followed)"))
			continue
		todo.extend(s)
	return sorted(found)


WAIVE = re.compile(r"pdl-order: waive (\S+): (.*)")
RELAY = re.compile(r"pdl-order: relay (\S+)\s*$")


def waivers(top):
	"""([(name, reason, file)], [(relay name, file)]) from the sources under top."""
	found, relays = [], []
	for d, _, files in os.walk(top):
		for f in sorted(files):
			if f.endswith((".cu", ".cuh")):
				with open(os.path.join(d, f), errors="replace") as src:
					for line in src:
						m = WAIVE.search(line)
						if m:
							found.append((m.group(1), m.group(2).strip(), f))
						m = RELAY.search(line)
						if m:
							relays.append((m.group(1), f))
	return found, relays


def main(argv):
	args, waive, relays = argv[1:], [], []
	if len(args) >= 2 and args[0] == "--waivers":
		waive, relays = waivers(args[1])
		args = args[2:]
	lines = []
	for path in args or ["-"]:
		with (sys.stdin if path == "-" else open(path, errors="replace")) as f:
			lines.extend(f)
	funcs = parse(lines)
	waiting = {n: v for n, v in funcs.items() if any(op == "ACQBULK" for _, _, op, _ in v)}
	bad = waived = 0
	used = set()
	for name in sorted(waiting):
		relay = next((r for r in relays if r[0] in name), None)
		if relay:
			used.add(relay[0])
		found = check(name, waiting[name], relay is not None)
		w = next((x for x in waive if x[0] in name), None)
		if w and found:
			used.add(w[0])
			print("%s: waived (%d accesses before the wait; %s: %s)" % (name, len(found), w[2], w[1]))
			waived += 1
			continue
		if w:
			used.add(w[0])
		for addr, text, why in found:
			print("%s: %04x %s: %s" % (name, addr, text, why))
			bad += 1
	named = [("waiver", n, f) for n, _, f in waive] + [("relay", n, f) for n, f in relays]
	for kind, name, f in named:
		if name not in used and waiting:
			print("%s: %s in %s matches no waiting function" % (name, kind, f))
			bad += 1
	print("check_pdl_order: %d functions, %d wait, %d waived, %d findings" %
	      (len(funcs), len(waiting), waived, bad))
	if not waiting:
		return 2
	return 1 if bad else 0


if __name__ == "__main__":
	sys.exit(main(sys.argv))
