#!/bin/bash
# The RMSNorm folded into the quantized decode GEMVs (k_cuda_linear_q_norm_run,
# KDEC_NORM_IN_GEMV rows, off by default) on the GPU machine, in one call of < 10 min:
#   NG_PART=check  compute-sanitizer memcheck of test_cuda_linear_q's GEMV part (quick:
#                  the norm form's cases among them), the GEMV part at full size (every
#                  model shape; the norm form bit for bit against RMSNorm then the GEMV),
#                  test_golden on cuda with the knob at 8 rows (the quantized goldens
#                  take it at prefill chunks of <= 8 rows and every decode step)
#   NG_PART=decode kdbench decode (ctx 1024, batch 1 and 8) of Llama-3.1-8B fp8-block with
#                  the knob 0 / 1 / 8, its int4-g32 and Qwen3-30B-A3B fp8-block with
#                  the knob 0 / 1, and its bf16, one after another
#   NG_PART=quick  a first look for a call shared with another script: the GEMV part of
#                  test_cuda_linear_q quick, test_golden on cuda with the knob at 8,
#                  Llama-3.1-8B fp8-block batch 1 and 8 with the knob 0 and 1
#   NG_PART=all    check, then decode, cut at DEADLINE
# here: make -C build -j2 all check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_linear_q test_golden ..." \
#       contrib/device/pack.sh build devbuild-mq
# device run: NG_PART=all bash contrib/device/norm_gemv.sh   carry ["devbuild-mq.tar.xz"]
# (DEVBUILD=NAME for another packed build.)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-mq}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

check() {
	step memcheck_gemv 120 env KD_TEST_QUICK=1 KD_TEST_PART=gemv "$CS" --tool memcheck \
		--error-exitcode 9 "$B/tests/test_cuda_linear_q"
	grep -E "norm|FAIL|ERROR SUMMARY|passed" "$L/memcheck_gemv.log" | tail -12 | tee -a "$S"
	step gemv 120 env KD_TEST_PART=gemv "$B/tests/test_cuda_linear_q"
	grep -E "norm GEMV|FAIL|passed" "$L/gemv.log" | tail -12 | tee -a "$S"
	step golden_ng 120 env KDEC_NORM_IN_GEMV=8 KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden_ng.log" | tail -5 | tee -a "$S"
}

decode() {
	local m=llama3.1-8b q=qwen3-30b-a3b
	for k in 0 1 8; do
		dec "${m}_fp8_n$k" $m 1,8 fp8-block KDEC_NORM_IN_GEMV=$k
	done
	for k in 0 1; do
		dec "${m}_int4_n$k" $m 1,8 int4-g32 KDEC_NORM_IN_GEMV=$k
		dec "${q}_fp8_n$k" $q 1,8 fp8-block KDEC_NORM_IN_GEMV=$k
	done
	dec "${m}_bf16" $m 1,8 bf16
}

case ${NG_PART:-all} in
quick)
	step gemv 90 env KD_TEST_QUICK=1 KD_TEST_PART=gemv "$B/tests/test_cuda_linear_q"
	grep -E "norm|FAIL|passed" "$L/gemv.log" | tail -12 | tee -a "$S"
	step golden_ng 100 env KDEC_NORM_IN_GEMV=8 KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden_ng.log" | tail -5 | tee -a "$S"
	for k in 0 1; do
		dec "llama3.1-8b_fp8_n$k" llama3.1-8b 1,8 fp8-block KDEC_NORM_IN_GEMV=$k
	done
	;;
check) check ;;
decode) decode ;;
*) check; decode ;;
esac
tar -C "$L" -cJf "$O/logs.tar.xz" .
