#!/bin/bash
# Top-k draws by vocabulary slices on CUDA ranks (issue 25, docs/PARALLEL.md
# "Vocabulary-split sampling"), one device call, nothing built there:
#   1. test_cuda_topk_slice: k_cuda_topk_slice against k_cpu_sample_top_k, bit for bit
#      (ties, NaN, +-inf, +-0, all-NaN rows, vn 1..262144, rows 1..64, a graph replayed);
#   2. compute-sanitizer memcheck, racecheck and synccheck of it (KD_TEST_QUICK=1: one
#      chunk, the chunked launch and its merge, a graph);
#   3. bench_cuda_topk_slice: us a launch (200 back to back) at rows 1/8/64, vn
#      16K/64K/152K beside the floor of one read of the logits;
#   4. test_cuda_tp_draws on golden llama3, qwen3_moe, deepseek_v3 and a synthetic
#      151937-token llama: every greedy and top-k draw by slices at tp 2 and 4, graphs on
#      and off, equals k_cpu_sample over the same engine's gathered row;
#   5. tests/test_cuda_tp.sh in what is left of TOTAL seconds (default 150).
# Logs to $OUT/logs.tgz, the figures and one line a step to $OUT/summary.txt. Packed with
# the build it runs (from the worktree root):
#   rm -rf devbuild-cudatopk; PACK_XZ=0 PACK_SERVE=1 PACK_TESTS="test_cuda_topk_slice
#   test_cuda_tp_draws bench_cuda_topk_slice" contrib/device/pack.sh build devbuild-cudatopk;
#   mkdir devbuild-cudatopk/scratch; cp contrib/device/topk_cuda.sh tests/test_cuda_tp.sh
#   devbuild-cudatopk/scratch/; git rev-parse --short HEAD > devbuild-cudatopk/COMMIT;
#   tar -cf - devbuild-cudatopk | xz -9 -T2 > /work/main/devbuild-cudatopk.tar.xz; rm -rf devbuild-cudatopk
#   device run "python3 -c 'import tarfile; tarfile.open(\"devbuild-cudatopk.tar.xz\").extractall(\".\")'
#   && B=devbuild-cudatopk bash devbuild-cudatopk/scratch/topk_cuda.sh"  carry [devbuild-cudatopk.tar.xz]
# (the call runs in main's tree: tests/data is main's, the scripts this branch's copies)
set -u
. contrib/device/lib.sh
use "${B:-devbuild-cudatopk}"
say "build: $(cat "$B/COMMIT" 2>/dev/null)"
gpu_line
step test_cuda_topk_slice 90 "$B/tests/test_cuda_topk_slice"
grep -E "rows of|graph of|FAIL|differ" "$L/test_cuda_topk_slice.log" | head -n 12 | tee -a "$S"
for tool in memcheck racecheck synccheck; do
	step "san_$tool" 120 env KD_TEST_QUICK=1 "$CS" --tool "$tool" --error-exitcode 3 \
		"$B/tests/test_cuda_topk_slice"
	grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error" "$L/san_$tool.log" | head -n 3 | tee -a "$S"
done
step bench 60 "$B/tests/bench/bench_cuda_topk_slice"
grep "^topk_slice" "$L/bench.log" | tee -a "$S"
step test_cuda_tp_draws 120 "$B/tests/test_cuda_tp_draws" "$G/llama3" "$G/qwen3_moe" "$G/deepseek_v3"
grep -E "draws \(|FAIL|refused" "$L/test_cuda_tp_draws.log" | tee -a "$S"
left=$((${TOTAL:-150} - (SECONDS - t0)))
[ $left -gt 10 ] || left=10
step test_cuda_tp $left sh "$B/scratch/test_cuda_tp.sh"
grep -E "worst row|draws \(|refused|FAIL|SKIP|passed" "$L/test_cuda_tp.log" | tee -a "$S" | tail -n 8
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
