#!/bin/bash
# Quantized MoE experts on the tensor cores at M = 1..8 (issue 24, round 4: moe_qmma.cu,
# KDEC_MOE_QMMA) in one device call: test_cuda_moe_q quick (the new path against the
# CPU reference, its determinism, the fall-back), compute-sanitizer memcheck of it,
# bench_cuda_moe q at M 1 and 8 on Qwen3-30B-A3B, DeepSeek-V2-Lite, DeepSeek-V3 and
# Kimi-K2 shapes (each quantized row twice: "small" = the CUDA-core kernels, "qmma" = the
# same call on the tensor cores), then kdbench decode (synthetic weights, ctx 1024, 16
# steps after 4, batch 1 and 8) of qwen3-30b-a3b and deepseek-v2-lite in fp8-block and
# int4-g32 with KDEC_MOE_QMMA 0, 1, 0 (the repeat: drift), and the full test in what is
# left of TOTAL seconds (default 420). Logs in $OUT/logs.tgz, lines in $OUT/summary.txt.
# Packed with the build it runs (nothing is built there):
#   PACK_XZ=0 PACK_SERVE=0 PACK_TESTS="test_cuda_moe_q bench_cuda_moe" \
#     contrib/device/pack.sh build devbuild-qmoe3
#   mkdir devbuild-qmoe3/scratch; cp contrib/device/qmoe3.sh devbuild-qmoe3/scratch/
#   (cd devbuild-qmoe3 && git -C .. rev-parse --short HEAD > COMMIT)
#   tar -cf - devbuild-qmoe3 | xz -9 -T2 > /work/main/devbuild-qmoe3.tar.xz
#   device run "python3 -c 'import tarfile; tarfile.open(\"devbuild-qmoe3.tar.xz\").extractall(\".\")'
#   && bash devbuild-qmoe3/scratch/qmoe3.sh"  carry ["devbuild-qmoe3.tar.xz"]
# Expected (not yet run): every test line PASS, memcheck 0 errors; the qmma rows below
# the small rows, most at int4 (docs/PERFORMANCE.md, "round 4 (written, not run)").
set -u
. contrib/device/lib.sh
use "${B:-devbuild-qmoe3}"
say "build: $(cat "$B/COMMIT" 2>/dev/null); $(date -u +%FT%TZ)"
gpu_line

# 1. correctness: the quick test, then memcheck of the same
step test_quick 120 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
grep -cE " PASS$" "$L/test_quick.log" | sed 's/^/PASS lines: /' | tee -a "$S"
grep -E "FAIL|qmma" "$L/test_quick.log" | head -n 40 | tee -a "$S"
step memcheck 300 env KD_TEST_QUICK=1 "$CS" --tool memcheck --error-exitcode 9 \
	"$B/tests/test_cuda_moe_q"
grep -E "ERROR SUMMARY|FAIL" "$L/memcheck.log" | head -n 5 | tee -a "$S"

# 2. the experts alone: old and new side by side, one process per shape and M
for sh in qwen3 v2-lite deepseek-v3 kimi; do
	for M in 1 8; do
		step "bench_${sh}_M$M" 60 "$B/tests/bench/bench_cuda_moe" q "$sh" "$M"
		grep "moe_q time" "$L/bench_${sh}_M$M.log" | sed 's/ (payload + scales)//' | tee -a "$S"
	done
done

# 3. decode steps: knob 0, 1, 0
for model in qwen3-30b-a3b deepseek-v2-lite; do
	for fmt in fp8-block int4-g32; do
		for q in 0 1 0b; do
			step "decode_${model}_${fmt}_$q" 90 env KDEC_MOE_QMMA=${q%b} "$B/kdbench" \
				decode --model "tests/data/configs/$model.json" --synthetic-weights \
				--weight-format "$fmt" --backend cuda --ctx 1024 --steps 16 --warmup 4 \
				--batch 1,8
			grep -v "^\[\|^20[0-9][0-9]-" "$L/decode_${model}_${fmt}_$q.log" | tail -n 4 |
				sed "s/^/$model $fmt qmma=$q: /" | tee -a "$S"
		done
	done
done

# 4. the full test (every shape and format) in what is left
left=$((${TOTAL:-420} - (SECONDS - t0)))
if [ $left -gt 30 ]; then
	step test_full $left "$B/tests/test_cuda_moe_q"
	grep -cE " PASS$" "$L/test_full.log" | sed 's/^/full: PASS lines: /' | tee -a "$S"
	grep -E "FAIL|qmma" "$L/test_full.log" | tee -a "$S" | tail -n 60 >/dev/null
else
	say "full test: skipped ($left s left)"
fi
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
