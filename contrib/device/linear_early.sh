#!/bin/bash
# How many of a quantized GEMV's ring stages go before its PDL wait (KDEC_LINEAR_EARLY;
# default all: 5) on the GPU machine, one call of < 10 minutes. The hypothesis (session
# 21's layer traces): a GEMV's early weight loads (o_proj's 12.8 MB of 16.8 at Llama
# fp8) fill the memory queues while the latency-bound kernel before it (the attention's
# merge, an RMSNorm) still waits on its own few loads, which then take microseconds.
#   EA_PART=tests   test_cuda_linear_q quick at KDEC_LINEAR_EARLY 1 and 0 (the ring's
#                   stages split around the wait), test_golden on cuda at 1
#   EA_PART=decode  kdbench decode of EA_DECODE (model:format:batches) at each
#                   KDEC_LINEAR_EARLY of EA_EARLY (16 2 1 0) one after the other
#   EA_PART=trace   layer_trace.sh of Llama-3.1-8B fp8 at batch 1 with KDEC_LINEAR_EARLY
#                   EA_TRACE_EARLY (1) (the build needs libktrace.so: layer_trace.sh)
# here: make -C build -j2 all && make -C build -j2 check TESTS= &&
#       PACK_XZ=0 PACK_SERVE=0 PACK_TESTS="test_cuda_linear_q test_golden" \
#       contrib/device/pack.sh build devbuild-ea && (libktrace.so into it) && tar+xz
# device run: EA_PART="tests decode" bash contrib/device/linear_early.sh
#             carry ["devbuild-ea.tar.xz"] (DEVBUILD: another packed build's name)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-ea}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

tests() {
	local e
	for e in 1 0; do
		step "linq_e$e" 120 env KD_TEST_QUICK=1 KDEC_LINEAR_EARLY=$e "$B/tests/test_cuda_linear_q"
		grep -E "FAIL|passed|failed" "$L/linq_e$e.log" | tail -3 | sed "s/^/early $e: /" | tee -a "$S"
	done
	step golden_e1 150 env KDEC_TEST_BACKEND=cuda KDEC_LINEAR_EARLY=1 "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden_e1.log" | tail -3 | sed "s/^/early 1: /" | tee -a "$S"
}

decode() {
	local r m f bt e
	for r in ${EA_DECODE:-llama3.1-8b:fp8-block:1,8 llama3.1-8b:int4-g32:1,8
		qwen3-30b-a3b:fp8-block:1,8 deepseek-v2-lite:fp8-block:1}; do
		m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
		for e in ${EA_EARLY:-16 2 1 0}; do
			dec "${m}_${f}_e$e" $m $bt $f KDEC_LINEAR_EARLY=$e
		done
	done
}

trace() {
	NO_ARCHIVE=1 TAG=e${EA_TRACE_EARLY:-1} RUNS="llama3.1-8b:fp8-block" \
		KDEC_LINEAR_EARLY=${EA_TRACE_EARLY:-1} bash contrib/device/layer_trace.sh
}

for part in ${EA_PART:-tests decode}; do
	case $part in
	tests) tests ;;
	decode) decode ;;
	trace) trace ;;
	*) say "linear_early.sh: no part $part" ;;
	esac
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
