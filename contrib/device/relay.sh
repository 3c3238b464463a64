#!/bin/bash
# Session 24's device call: the relay kernels (KDEC_PDL_RELAY, k_cuda_pdl_relay in
# kernels/cuda/launch_check.cuh) checked and measured against the default in one call:
#   RL_PART=check  test_golden on cuda and test_cuda_pdl with every relay (KDEC_PDL_RELAY=15)
#   RL_PART=ab     kdbench decode under each KDEC_PDL_RELAY mask of RL_MASKS (default
#                  "0 15") in turn, model by model (RL_AB triples model:format:batches),
#                  RL_ROUNDS rounds (default 1)
#   RL_PART=trace  one batch-1 layer kernel by kernel (layer_trace.sh) under the masks
#                  RL_TRACE_MASKS (default "0 15"), for RL_TRACE (model:format list);
#                  needs libktrace.so in the pack
# RL_PART may name several, run in that order.
# here: PACK_XZ=0 PACK_SERVE=0 PACK_TESTS="test_golden test_cuda_pdl" \
#         contrib/device/pack.sh build devbuild-rl; build libktrace.so into it
#         (layer_trace.sh's usage); tar + xz it as pack.sh does
# device run: RL_PART="check ab trace" bash contrib/device/relay.sh
#             carry ["devbuild-rl.tar.xz"]
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-rl}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

check() {
	step golden_relay 200 env KDEC_PDL_RELAY=15 KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	step pdl_relay 60 env KDEC_PDL_RELAY=15 "$B/tests/test_cuda_pdl"
}

ab() {
	local r m f bt i v
	for i in $(seq "${RL_ROUNDS:-1}"); do
		for r in ${RL_AB:-llama3.1-8b:fp8-block:1 qwen3-30b-a3b:fp8-block:1}; do
			m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
			for v in ${RL_MASKS:-0 15}; do
				dec "r${v}_${m}_${f}_$i" $m $bt $f KDEC_PDL_RELAY=$v
			done
		done
	done
}

trace() {
	local lib=$PWD/$B/libktrace.so r m f d
	[ -f "$lib" ] || { say "trace: no $lib"; return; }
	for d in /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64 \
		/usr/local/cuda/targets/x86_64-linux/lib; do
		[ -e "$d/libcupti.so.13" ] && { LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d; break; }
	done
	for r in ${RL_TRACE:-llama3.1-8b:fp8-block qwen3-30b-a3b:fp8-block}; do
		m=${r%%:*} f=${r#*:}
		for v in ${RL_TRACE_MASKS:-0 15}; do
			KDEC_PDL_RELAY=$v KDEC_KTRACE=$L/kt_${m}_$v.csv CUDA_INJECTION64_PATH=$lib \
				step "trace_${m}_$v" 60 "$B/kdbench" decode --model "tests/data/configs/$m.json" \
				--synthetic-weights --weight-format "$f" --backend cuda --batch 1 --ctx 1024 \
				--steps 6 --warmup 2 --log-level warn
			python3 contrib/device/layer_trace.py "$L/kt_${m}_$v.csv" "$m $f b1 relay $v" 2>&1 |
				head -n 30 | tee -a "$S"
		done
	done
}

for p in ${RL_PART:-check ab}; do
	$p
done
tar -C "$L" -czf "$O/logs.tgz" . 2>/dev/null
say "total $((SECONDS - t0)) s"
