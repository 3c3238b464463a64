#!/bin/bash
# NCCL in the engine on one GPU (issue 25, docs/PARALLEL.md "NCCL in the engine"):
# tests/test_cuda_nccl.sh (--tp 1 --allreduce nccl against tp 1, the refusals, the
# missing library), kdbench decode on Llama-3.1-8B's shapes (synthetic weights, ctx
# 1024, batch 1) at tp 1 plain and with --allreduce nccl side by side, then
# tests/test_cuda_tp.sh in what is left of TOTAL seconds (default 90). Logs to
# $OUT/logs.tgz and $OUT/summary.txt. Packed with the build it runs:
#   PACK_XZ=0 PACK_SERVE=1 PACK_TESTS=" " contrib/device/pack.sh build DIR;
#   mkdir DIR/scratch; cp contrib/device/nccl_cuda.sh tests/test_cuda_nccl.sh
#   tests/test_cuda_tp.sh DIR/scratch/; tar+xz DIR;
#   device run "python3 -c 'import tarfile; tarfile.open(\"DIR.tar.xz\").extractall(\".\")'
#   && B=DIR bash DIR/scratch/nccl_cuda.sh"  carry [DIR.tar.xz]
set -u
B=${B:-devbuild-nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# libnccl.so.2 from the Python wheel where the machine has no system copy
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/$B/devlibs${nccl:+:$nccl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export top_srcdir=$PWD top_builddir=$PWD/$B
O=${OUT:-/tmp/ncclout}; mkdir -p "$O"; L=$(mktemp -d /tmp/ncclL.XXXXXX)
S=$O/summary.txt
t0=$SECONDS
say() { echo "$*" | tee -a "$S"; }
run() { local n=$1 t=$SECONDS; shift; "$@" >"$L/$n.log" 2>&1; local rc=$?; say "== [$((SECONDS-t0)) s] $n: rc $rc in $((SECONDS-t)) s: $(tail -n 1 "$L/$n.log" | cut -c1-300)"; }
say "build: $(cat "$B/COMMIT" 2>/dev/null); nccl wheel: ${nccl:-none}; system: $(ldconfig -p | grep -c libnccl) libnccl entries"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee -a "$S"
run test_cuda_nccl timeout 45 sh "$B/scratch/test_cuda_nccl.sh"
grep -E "worst row|decode graph|^parallel|FAIL|SKIP|not checked|passed" "$L/test_cuda_nccl.log" | tee -a "$S"
grep -m3 -E "all-reduce nccl|one rank through" "$L/test_cuda_nccl.log" | tee -a "$S"
D="decode --model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda --batch 1 --ctx 1024 --steps 32 --warmup 8"
run decode_tp1 timeout 25 "$B/kdbench" $D
grep -v "^\[\|^20[0-9][0-9]-" "$L/decode_tp1.log" | tail -n 5 | tee -a "$S"
run decode_nccl timeout 25 "$B/kdbench" $D --allreduce nccl
grep -v "^\[\|^20[0-9][0-9]-" "$L/decode_nccl.log" | tail -n 6 | tee -a "$S"
grep -E "all-reduce nccl|captured the" "$L/decode_nccl.log" | head -n 3 | tee -a "$S"
left=$((${TOTAL:-90} - (SECONDS - t0)))
[ $left -gt 10 ] || left=10
run test_cuda_tp timeout $left sh "$B/scratch/test_cuda_tp.sh"
grep -E "worst row|refused|FAIL|SKIP|passed" "$L/test_cuda_tp.log" | tee -a "$S" | tail -n 5
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
