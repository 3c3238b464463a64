#!/bin/bash
# The fused all-reduce's device run (issue 25): test_cuda_allreduce in full, then small
# cases under compute-sanitizer memcheck and racecheck, then kdbench allreduce
# --backend cuda at tp 2, 4, 8. Logs to $OUT. Packed with the build it runs:
#   PACK_SERVE=0 PACK_TESTS="test_cuda_allreduce" contrib/device/pack.sh build DIR
#   cp contrib/device/tp_allreduce.sh DIR/;  device run "B=DIR bash DIR/tp_allreduce.sh" carry [DIR]
set -u
. contrib/device/lib.sh
use "${B:-build-tp}"
gpu_line
echo "nccl: ${nccl:-none}"
step test "${T_TEST:-60}" "$B/tests/test_cuda_allreduce"
grep -E "FAIL|done in|trap|seed" "$L/test.log" | head -20
for tool in memcheck racecheck; do
	step "san_$tool" 40 env KD_TEST_QUICK=1 "$CS" --tool $tool --error-exitcode 9 "$B/tests/test_cuda_allreduce"
	grep -E "^========= +(Error|Invalid|Race|Program hit)|FAIL|ERROR SUMMARY|RACECHECK SUMMARY" "$L/san_$tool.log" | head -6
done
step san_memcheck_streams 25 env KD_TEST_QUICK=1 KD_TEST_PART=streams "$CS" --tool memcheck --error-exitcode 9 "$B/tests/test_cuda_allreduce"
grep -E "ERROR SUMMARY|FAIL|trap" "$L/san_memcheck_streams.log" | head -4
nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader -lms 100 >"$O/clocks.txt" 2>&1 &
smi=$!
for tp in 2 4 8; do
	step "bench_tp$tp" 15 "$B/kdbench" allreduce --backend cuda --tp $tp --bytes 14336,57344,229376,917504
	cat "$L/bench_tp$tp.log"
done
step bench_tp8_w4096 15 "$B/kdbench" allreduce --backend cuda --tp 8 --width 4096 --bytes 8192,524288
cat "$L/bench_tp8_w4096.log"
step bench_tp4_w8192 15 "$B/kdbench" allreduce --backend cuda --tp 4 --width 8192 --bytes 16384,1048576
cat "$L/bench_tp4_w8192.log"
kill "$smi" 2>/dev/null
echo "SM clocks during the benchmarks (MHz): $(cut -d' ' -f1 "$O/clocks.txt" | sort -n | uniq -c | sort -rn | head -5 | tr '\n' ' ')"
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
