#!/bin/bash
# The fused all-reduce's device run (issue 25): test_cuda_allreduce in full, then small
# cases under compute-sanitizer memcheck and racecheck, then kdbench allreduce
# --backend cuda at tp 2, 4, 8. Logs to $OUT. Packed with the build it runs:
#   PACK_SERVE=0 PACK_TESTS="test_cuda_allreduce" contrib/device/pack.sh build DIR
#   cp contrib/device/tp_allreduce.sh DIR/;  device run "B=DIR bash DIR/tp_allreduce.sh" carry [DIR]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${B:-build-tp}
O=${OUT:-/tmp/tpout}; mkdir -p "$O"
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/$B/devlibs${nccl:+:$nccl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$O/gpu.txt"
echo "nccl: ${nccl:-none}"
run() { local n=$1 t=$SECONDS; shift; "$@" >"$O/$n.log" 2>&1; local rc=$?; echo "== $n: rc $rc in $((SECONDS-t)) s: $(tail -n 1 "$O/$n.log" | cut -c1-200)"; }
run test timeout "${T_TEST:-60}" "$B/tests/test_cuda_allreduce"
grep -E "FAIL|done in|trap|seed" "$O/test.log" | head -20
cs=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
	KD_TEST_QUICK=1 run "san_$tool" timeout 40 $cs --tool $tool --error-exitcode 9 "$B/tests/test_cuda_allreduce"
	grep -E "^========= +(Error|Invalid|Race|Program hit)|FAIL|ERROR SUMMARY|RACECHECK SUMMARY" "$O/san_$tool.log" | head -6
done
KD_TEST_QUICK=1 KD_TEST_PART=streams run san_memcheck_streams timeout 25 $cs --tool memcheck --error-exitcode 9 "$B/tests/test_cuda_allreduce"
grep -E "ERROR SUMMARY|FAIL|trap" "$O/san_memcheck_streams.log" | head -4
nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader -lms 100 >"$O/clocks.txt" 2>&1 &
smi=$!
for tp in 2 4 8; do
	run "bench_tp$tp" timeout 15 "$B/kdbench" allreduce --backend cuda --tp $tp --bytes 14336,57344,229376,917504
	cat "$O/bench_tp$tp.log"
done
run bench_tp8_w4096 timeout 15 "$B/kdbench" allreduce --backend cuda --tp 8 --width 4096 --bytes 8192,524288
cat "$O/bench_tp8_w4096.log"
run bench_tp4_w8192 timeout 15 "$B/kdbench" allreduce --backend cuda --tp 4 --width 8192 --bytes 16384,1048576
cat "$O/bench_tp4_w8192.log"
kill "$smi" 2>/dev/null
echo "SM clocks during the benchmarks (MHz): $(cut -d' ' -f1 "$O/clocks.txt" | sort -n | uniq -c | sort -rn | head -5 | tr '\n' ' ')"
echo "total $((SECONDS - t0)) s"
