#!/bin/bash
# fp8 linears on cuBLASLt's block-scaled fp8 GEMM (K_CUDA_LINEAR_Q_LT8, KDEC_LINEAR_QLT8;
# issue 24's batch-64 target) in one device call: test_cuda_linear_q KD_TEST_PART=lt8 (every
# fp8 format against the host's copy of the split, with the weight and with x as cuBLAS's
# A; SKIP lines where cuBLASLt has no algorithm in one arrangement, a FAIL where neither
# has one on sm_90) and under compute-sanitizer memcheck, the whole test quick (the other kinds
# and the choice unchanged), bench_cuda_linear_q's lt8 column beside the tile kernel and
# bf16 on Llama-3.1-8B's shapes at M 16, 32, 64, then kdbench decode of Llama-3.1-8B
# fp8-block at batch 16 and 64 with the knob 0, 1, 0 (the repeat: drift) beside bf16 at
# batch 64, and kdbench prefill fp8-block with the knob 0 and 1. Packed with the build:
#   PACK_XZ=0 PACK_TESTS="test_cuda_linear_q" contrib/device/pack.sh build DIR
#   device run "... && BUILD=DIR bash contrib/device/lt8.sh"
DEADLINE=${DEADLINE:-540}
. contrib/device/lib.sh
use "${BUILD:-devbuild}"
say "# lt8 $(date -u +%FT%TZ): $(cat "$B/COMMIT" 2>/dev/null)"
gpu_line
step test_lt8 150 env KD_TEST_PART=lt8 "$B/tests/test_cuda_linear_q"
grep -E "lt8|FAIL" "$L/test_lt8.log" | head -n 40 | tee -a "$S"
step memcheck_lt8 120 env KD_TEST_PART=lt8 KD_TEST_QUICK=1 "$CS" --tool memcheck \
	--error-exitcode 9 "$B/tests/test_cuda_linear_q"
grep -E "ERROR SUMMARY|Invalid" "$L/memcheck_lt8.log" | head -n 4 | tee -a "$S"
step test_quick 200 env KD_TEST_QUICK=1 "$B/tests/test_cuda_linear_q"
step bench 120 "$B/tests/bench/bench_cuda_linear_q" --only llama --fmt fp8-block --m 16,32,64
grep -E "lt8" "$L/bench.log" | cut -c1-240 | tee -a "$S"
C=tests/data/configs/llama3.1-8b.json
# dec NAME KNOB ARGS...: kdbench decode of Llama-3.1-8B with KDEC_LINEAR_QLT8=KNOB
dec() {
	local n=$1 q=$2
	shift 2
	step "$n" 90 env KDEC_LINEAR_QLT8="$q" "$B/kdbench" decode --model "$C" --synthetic-weights \
		--backend cuda --ctx 1024 --steps 16 --warmup 4 "$@"
	grep -v "^\[\|^20[0-9][0-9]-" "$L/$n.log" | tail -n 4 | sed "s/^/$n: /" | tee -a "$S"
}
for q in 0 1 0; do
	dec "decode_fp8_lt8_$q" "$q" --batch 16,64 --weight-format fp8-block
done
dec decode_bf16 0 --batch 64
for q in 0 1; do
	step "prefill_fp8_lt8_$q" 90 env KDEC_LINEAR_QLT8=$q "$B/kdbench" prefill --model "$C" \
		--synthetic-weights --backend cuda --weight-format fp8-block --tokens 4096 --reps 2
	grep -v "^\[\|^20[0-9][0-9]-" "$L/prefill_fp8_lt8_$q.log" | tail -n 4 | sed "s/^/prefill lt8=$q: /" | tee -a "$S"
done
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
