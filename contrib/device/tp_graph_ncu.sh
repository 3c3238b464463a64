#!/bin/bash
# Where a tensor-parallel reduction's ~10 us go inside the decode graph of the cuda
# virtual ranks (docs/PARALLEL.md, "CUDA graphs with tp > 1"; not yet run: the device
# was not lent again in session 9). ncu of one decode step (kdbench --profile-step) of
# Llama-3.1-8B's shapes cut to 4 layers, batch 1, tp $TP (default 2), graphs on: every
# kernel's duration (the k_cuda_ar_fused_all nodes beside the ops tp 1 runs, and with
# the step's replay time the gaps between them); then one k_cuda_ar_fused_all node of
# that step with the launch, occupancy, warp-state and memory sections. Clocks never
# locked. Packed with the build it runs:
#   PACK_SERVE=0 PACK_TESTS=" " contrib/device/pack.sh build DIR; tar+xz DIR;
#   device run "tar -xJf DIR.tar.xz && B=DIR bash contrib/device/tp_graph_ncu.sh" carry [DIR.tar.xz]
# About 30 s on a warm H200.
set -u
. contrib/device/lib.sh
use "${B:-devbuild}"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu: not on this machine"; exit 1; }
D="decode --model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda --layers 4
   --batch 1 --ctx 256 --steps 2 --warmup 1 --profile-step --tp ${TP:-2} --log-level warn"
timeout 60 "$ncu" --profile-from-start off --clock-control none --cache-control none \
	--metrics gpu__time_duration.sum --csv --print-units base "$B/kdbench" $D >"$O/ncu_step.csv" 2>"$O/ncu_step.log"
echo "step: rc $? in $((SECONDS - t0)) s (one step's kernels: us per kernel name, calls, share)"
python3 contrib/device/ncu_summary.py "$O/ncu_step.csv" 2>&1 | head -30
timeout 60 "$ncu" --profile-from-start off --clock-control none --cache-control none \
	--kernel-name regex:ar_fused --launch-count 1 \
	--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
	--section SchedulerStats --section MemoryWorkloadAnalysis "$B/kdbench" $D >"$O/ncu_ar.txt" 2>"$O/ncu_ar.log"
echo "ar: rc $? in $((SECONDS - t0)) s"
grep -E "Duration|Elapsed Cycles|SM Frequency|Stall|Warp Cycles Per|Issued Warp|Block Size|Grid Size|Registers|Achieved Occ|Memory Throughput|One or More|No Eligible|Active Warps" "$O/ncu_ar.txt" | head -40
echo "total $((SECONDS - t0)) s"
