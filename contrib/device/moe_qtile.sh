#!/bin/bash
# The grouped MoE path's tile kernels (kernels/cuda/moe/moe_qtile.cu, KDEC_MOE_QTILE_ROWS,
# off by default) on the GPU machine, in three calls of < 10 minutes:
#   MQ_PART=check  compute-sanitizer memcheck of test_cuda_moe_q (quick: Qwen3's shapes,
#                  grouped at 9 rows, the kernels on), test_cuda_moe_q and test_cuda_moe's
#                  experts (both run the grouped cases on expert_mma_kernel and on the tile
#                  kernels), test_golden on cuda with the kernels on (prefill chunks of
#                  9..64 rows take them), bench_cuda_moe q at M 1, 8, 64, 256 (the auto
#                  path beside the tile kernels, each at its floor)
#   MQ_PART=decode kdbench decode (ctx 1024) of Qwen3-30B-A3B and DeepSeek-V2-Lite in bf16,
#                  fp8-block, int4-g32 at batch 16 and 64 with the knob 0 and 64, and at
#                  batch 1 and 8 with the grouped path forced onto the kernels
#   MQ_PART=quick  a first look in ~4.5 minutes, for a call shared with another script:
#                  test_cuda_moe_q quick, test_golden on cuda with the kernels on, kdbench
#                  Qwen3-30B-A3B fp8-block and int4-g32 at batch 64 with the knob 0 and 64
#   MQ_PART=slices the Kimi-K2 (--layers 2) and DeepSeek-V3 (--layers 4) slices in fp8-block
#                  and int4-g32 at batch 1 and 8 (their MoE layer: issue 24's slice target),
#                  the auto path against the grouped path on the kernels
#   here: make -C build -j8 all && make -C build -j8 check TESTS= &&
#         PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_moe_q test_cuda_moe test_golden bench_cuda_moe" \
#         contrib/device/pack.sh build devbuild-mq
#   device run: MQ_PART=check bash contrib/device/moe_qtile.sh   carry ["devbuild-mq.tar.xz"]
# Each step is cut at what is left of DEADLINE (lib.sh); the summary lines are the
# test verdicts and the timing rows, the full logs come back archived.
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use devbuild-mq
gpu_line

case ${MQ_PART:-check} in
quick)
	step moe_q 100 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
	grep -E "qtile|FAIL" "$L/moe_q.log" | head -30 | tee -a "$S"
	step golden_qt 90 env KDEC_MOE_QTILE_ROWS=64 KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden_qt.log" | tail -5 | tee -a "$S"
	for f in fp8-block int4-g32; do
		dec "qwen3-30b-a3b_${f}_0" qwen3-30b-a3b 64 $f KDEC_MOE_QTILE_ROWS=0
		dec "qwen3-30b-a3b_${f}_64" qwen3-30b-a3b 64 $f KDEC_MOE_QTILE_ROWS=64
	done
	;;
check)
	step memcheck_q 150 env KD_TEST_QUICK=1 "$CS" --tool memcheck --error-exitcode 9 \
		"$B/tests/test_cuda_moe_q"
	grep -E "qtile|FAIL|ERROR SUMMARY" "$L/memcheck_q.log" | head -24 | tee -a "$S"
	step moe_q 150 "$B/tests/test_cuda_moe_q"
	grep -E "qtile|FAIL" "$L/moe_q.log" | head -60 | tee -a "$S"
	step moe 100 env KD_TEST_PART=experts "$B/tests/test_cuda_moe"
	grep -E "qtile|FAIL" "$L/moe.log" | head -30 | tee -a "$S"
	step golden_qt 90 env KDEC_MOE_QTILE_ROWS=64 KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep -E "FAIL|passed|failed" "$L/golden_qt.log" | tail -5 | tee -a "$S"
	for m in 1 8 64 256; do
		step bench_$m 50 "$B/tests/bench/bench_cuda_moe" q "" $m
		grep "moe_q time" "$L/bench_$m.log" | cut -c1-200 | tee -a "$S"
	done
	;;
decode)
	for m in qwen3-30b-a3b deepseek-v2-lite; do
		for f in bf16 fp8-block int4-g32; do
			dec "${m}_${f}_0" $m 16,64 $f KDEC_MOE_QTILE_ROWS=0
			dec "${m}_${f}_64" $m 16,64 $f KDEC_MOE_QTILE_ROWS=64
			dec "${m}_${f}_g" $m 1,8 $f KDEC_MOE_QTILE_ROWS=64 KDEC_MOE_PATH=grouped
		done
	done
	;;
slices)
	for m in kimi-k2 deepseek-v3; do
		for f in fp8-block int4-g32; do
			dec "${m}_${f}_0" $m 1,8 $f KDEC_MOE_QTILE_ROWS=0
			dec "${m}_${f}_g" $m 1,8 $f KDEC_MOE_QTILE_ROWS=64 KDEC_MOE_PATH=grouped
		done
	done
	;;
esac
tar -C "$L" -cJf "$O/logs.tar.xz" .
