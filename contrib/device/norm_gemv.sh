#!/bin/bash
# The RMSNorm folded into the quantized decode GEMVs (k_cuda_linear_q_norm_run,
# KDEC_NORM_IN_GEMV rows, off by default) on the GPU machine, in one call of < 10 min:
#   NG_PART=check  compute-sanitizer memcheck of test_cuda_linear_q's GEMV part (quick:
#                  the norm form's cases among them), the GEMV part at full size (every
#                  model shape; the norm form bit for bit against RMSNorm then the GEMV),
#                  test_golden on cuda with the knob at 8 rows (the quantized goldens
#                  take it at prefill chunks of <= 8 rows and every decode step)
#   NG_PART=decode kdbench decode (ctx 1024) of Llama-3.1-8B and Qwen3-30B-A3B in fp8-block
#                  and int4-g32, batch 1 and 8, the knob 0 / 1 / 8 one after another
#   NG_PART=all    check, then decode, cut at DEADLINE
# here: make -C build -j2 all check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_linear_q test_golden ..." \
#       contrib/device/pack.sh build devbuild-mq
# device run: NG_PART=all bash contrib/device/norm_gemv.sh   carry ["devbuild-mq.tar.xz"]
# (DEVBUILD=NAME for another packed build.)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
D=${DEVBUILD:-devbuild-mq}
[ -d "$D" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1] + ".tar.xz").extractall(".")' "$D"
use "$D"
gpu_line
C=tests/data/configs

# dec NAME MODEL BATCHES FORMAT [ENV...]: one kdbench decode, its table rows kept
dec() {
	local n=$1 m=$2 b=$3 f=$4
	shift 4
	step "$n" 45 env "$@" "$B/kdbench" decode --synthetic-weights --backend cuda --ctx 1024 \
		--steps 32 --warmup 8 --batch "$b" --model "$C/$m.json" --weight-format "$f"
	grep -E '^ +[0-9]' "$L/$n.log" | sed "s/^/$n /" | cut -c1-200 | tee -a "$S"
}

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
	for m in llama3.1-8b qwen3-30b-a3b; do
		for f in fp8-block int4-g32; do
			for k in 0 1 8; do
				dec "${m}_${f}_n$k" $m 1,8 $f KDEC_NORM_IN_GEMV=$k
			done
		done
	done
}

case ${NG_PART:-all} in
check) check ;;
decode) decode ;;
*) check; decode ;;
esac
tar -C "$L" -cJf "$O/logs.tar.xz" .
