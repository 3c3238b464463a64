#!/bin/bash
# Session 23's device call: what a kernel boundary costs (pdl_boundary.cu), another
# build's kdbench beside this one's, and the ring GEMV on this GPU, in one call:
#   BD_PART=boundary  $B/pdl_boundary (built here beside the pack: nvcc -O3
#                     -arch=sm_90a -std=c++17 -o devbuild-bd/pdl_boundary
#                     contrib/device/pdl_boundary.cu)
#   BD_PART=ab        $B/kdbench_base (another build's kdbench, copied into the pack)
#                     and $B/kdbench alternating, BD_AB triples model:format:batches,
#                     BD_ROUNDS rounds (default 1)
#   BD_PART=ring      Llama-3.1-8B and Qwen3-8B bf16 batch 1 with the ring (8 rows) and
#                     without (KDEC_LINEAR_RING), one after the other
# BD_PART may name several, run in that order. (Session 23's second call ran a "router"
# part at 7f5c419: the router GEMV whose last CTA routes, measured slower and removed;
# docs/PERFORMANCE.md, "Session 23".)
# here: PACK_XZ=0 PACK_SERVE=0 PACK_TESTS=" " contrib/device/pack.sh build devbuild-bd,
#       add pdl_boundary and kdbench_base, then tar + xz it as pack.sh does
# device run: BD_PART="boundary ab ring" bash contrib/device/boundary.sh
#             carry ["devbuild-bd.tar.xz"]
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-bd}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

boundary() {
	step pdl_boundary 120 "$B/pdl_boundary"
	tee -a "$S" <"$L/pdl_boundary.log"
}

ab() {
	local r m f bt i
	for i in $(seq "${BD_ROUNDS:-1}"); do
		for r in ${BD_AB:-llama3.1-8b:bf16:1 llama3.1-8b:fp8-block:1 qwen3-30b-a3b:fp8-block:1}; do
			m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
			KDBENCH=$B/kdbench_base dec "base_${m}_${f}_$i" $m $bt $f
			dec "head_${m}_${f}_$i" $m $bt $f
		done
	done
}

ring() {
	local m
	for m in llama3.1-8b qwen3-8b; do
		dec "${m}_ring" $m 1 bf16 KDEC_LINEAR_RING=8
		dec "${m}_noring" $m 1 bf16 KDEC_LINEAR_RING=0
	done
}

for p in ${BD_PART:-boundary ab ring}; do
	$p
done
tar -C "$L" -czf "$O/logs.tgz" . 2>/dev/null
say "total $((SECONDS - t0)) s"
