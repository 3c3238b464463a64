#!/bin/bash
# The MoE routing at decode on the GPU machine, one call: the router GEMV's warps
# splitting K where its grid is small (KDEC_LINEAR_GEMV_SPLIT), moe_route skipping the
# group mask where every group is kept (Kimi-K2) and keeping a row's experts in
# registers (KDEC_MOE_ROUTE_REG). RT_KNOB: the switch the A/B parts turn (1, then 0;
# default KDEC_LINEAR_GEMV_SPLIT).
#   RT_PART=tests   test_cuda_linear quick, test_cuda_moe quick with RT_KNOB 1 and 0 (the
#                   routing cases), test_golden on cuda
#   RT_PART=bench   bench_cuda_moe route with RT_KNOB 1 and 0
#   RT_PART=decode  kdbench decode of RT_DECODE (model:format:batches), RT_KNOB 1 / 0
# here: make -C build -j2 all && make -C build -j2 check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_linear test_cuda_moe test_golden bench_cuda_moe" \
#       contrib/device/pack.sh build devbuild-rt2
# device run: RT_PART="tests bench decode" bash contrib/device/route.sh
#             carry ["devbuild-rt2.tar.xz"] (DEVBUILD: another packed build's name)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-rt2}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec
KNOB=${RT_KNOB:-KDEC_LINEAR_GEMV_SPLIT}

tests() {
	local k
	step linear 150 env KD_TEST_QUICK=1 "$B/tests/test_cuda_linear"
	grep -E "N=(384|64) .*gemv|FAIL|passed|failed" "$L/linear.log" | tail -8 | tee -a "$S"
	for k in 1 0; do
		step "moe_$k" 150 env KD_TEST_QUICK=1 $KNOB=$k "$B/tests/test_cuda_moe"
		grep -E "kimi-k2 sigmoid 1 group|FAIL|passed|failed" "$L/moe_$k.log" | tail -4 |
			sed "s/^/$KNOB $k: /" | tee -a "$S"
	done
	step golden 150 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden.log" | tail -3 | tee -a "$S"
}

bench() {
	local k
	for k in 1 0; do
		step "route_$k" 60 env $KNOB=$k "$B/tests/bench/bench_cuda_moe" route
		grep "^route" "$L/route_$k.log" | sed "s/^/$KNOB $k: /" | tee -a "$S"
	done
}

decode() {
	local r m f bt
	for r in ${RT_DECODE:-kimi-k2:fp8-block:1,8 deepseek-v3:fp8-block:1,8
		qwen3-30b-a3b:fp8-block:1,8 deepseek-v2-lite:fp8-block:1,8}; do
		m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
		dec "${m}_${f}_1" $m $bt $f $KNOB=1
		dec "${m}_${f}_0" $m $bt $f $KNOB=0
	done
}

for part in ${RT_PART:-tests bench decode}; do
	case $part in
	tests) tests ;;
	bench) bench ;;
	decode) decode ;;
	*) say "route.sh: no part $part" ;;
	esac
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
