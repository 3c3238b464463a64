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
. contrib/device/lib.sh
use "${B:-devbuild-nccl}"
say "build: $(cat "$B/COMMIT" 2>/dev/null); nccl wheel: ${nccl:-none}; system: $(ldconfig -p | grep -c libnccl) libnccl entries"
gpu_line
step test_cuda_nccl 45 sh "$B/scratch/test_cuda_nccl.sh"
grep -E "worst row|decode graph|^parallel|FAIL|SKIP|not checked|passed" "$L/test_cuda_nccl.log" | tee -a "$S"
grep -m3 -E "all-reduce nccl|one rank through" "$L/test_cuda_nccl.log" | tee -a "$S"
D="decode --model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda --batch 1 --ctx 1024 --steps 32 --warmup 8"
step decode_tp1 25 "$B/kdbench" $D
grep -v "^\[\|^20[0-9][0-9]-" "$L/decode_tp1.log" | tail -n 5 | tee -a "$S"
step decode_nccl 25 "$B/kdbench" $D --allreduce nccl
grep -v "^\[\|^20[0-9][0-9]-" "$L/decode_nccl.log" | tail -n 6 | tee -a "$S"
grep -E "all-reduce nccl|captured the" "$L/decode_nccl.log" | head -n 3 | tee -a "$S"
left=$((${TOTAL:-90} - (SECONDS - t0)))
[ $left -gt 10 ] || left=10
step test_cuda_tp $left sh "$B/scratch/test_cuda_tp.sh"
grep -E "worst row|refused|FAIL|SKIP|passed" "$L/test_cuda_tp.log" | tee -a "$S" | tail -n 5
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
