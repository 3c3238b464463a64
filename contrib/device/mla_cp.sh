#!/bin/bash
# MLA decode context parallel on the GPU (--mla-cp on cuda virtual ranks, issue 25): what
# it still needs on a device (none was lent when it was built). tests/test_cuda_mla_cp
# (each stage against the CPU ranks' kernels), tests/test_cuda_tp.sh (its --mla-cp rows
# among the others), compute-sanitizer memcheck of the small unit cases and of kdbench
# logits at tp 2 --mla-cp, kdbench decode --tp 2 with and without --mla-cp on
# DeepSeek-V2-Lite's shapes (synthetic weights, LAYERS layers, default 4) at ctx CTX
# (default 16384), batch 1, and test_cuda_attn_mla's quick list (k_cuda_attn_mla's
# launches were factored out for the parts). Logs to $OUT (summary.txt, logs.tgz).
# Packed with the build it runs:
#   PACK_SERVE=1 PACK_TESTS="test_cuda_mla_cp test_cuda_attn_mla test_cuda_tp_draws" contrib/device/pack.sh build DIR
#   (kdecd: test_cuda_tp.sh starts it; test_cuda_tp_draws: it runs it)
#   cp tests/test_cuda_tp.sh contrib/device/mla_cp.sh DIR/; tar+xz DIR
#   device run "python3 -c 'import tarfile; tarfile.open(\"DIR.tar.xz\").extractall(\".\")' && B=DIR bash DIR/mla_cp.sh"
#   carry ["DIR.tar.xz"]
set -u
B=${B:-devbuild}
export LD_LIBRARY_PATH=$PWD/$B/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export top_srcdir=$PWD top_builddir=$PWD/$B
O=${OUT:-/tmp/mlacp}; L=$(mktemp -d /tmp/mlacp-logs.XXXXXX); mkdir -p "$O"
t0=$SECONDS
run() { local n=$1 t=$SECONDS; shift; "$@" >"$L/$n.log" 2>&1; local rc=$?; echo "== $n: rc $rc in $((SECONDS-t)) s (at $((SECONDS-t0)) s): $(tail -n 1 "$L/$n.log" | cut -c1-200)" | tee -a "$O/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$O/summary.txt"
run unit timeout 60 "$B/tests/test_cuda_mla_cp"
grep -E "FAIL" "$L/unit.log" | head -20 | tee -a "$O/summary.txt"
run test_cuda_tp timeout "${T_TEST:-150}" sh "$B/test_cuda_tp.sh"
grep -E "mla-cp|FAIL" "$L/test_cuda_tp.log" | head -60 | tee -a "$O/summary.txt"
cs=/usr/local/cuda/bin/compute-sanitizer
run san_unit env KD_TEST_QUICK=1 timeout 60 $cs --tool memcheck --error-exitcode 9 "$B/tests/test_cuda_mla_cp"
grep -E "ERROR SUMMARY|Invalid|FAIL" "$L/san_unit.log" | head -6 | tee -a "$O/summary.txt"
run san_tp timeout 30 $cs --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/deepseek_v3 --backend cuda --tp 2 --mla-cp --incremental \
	--tokens 5,17,300,2 --out "$L/san.f32"
grep -E "ERROR SUMMARY|Invalid" "$L/san_tp.log" | head -6 | tee -a "$O/summary.txt"
D="decode --model tests/data/configs/deepseek-v2-lite.json --synthetic-weights --backend cuda
   --layers ${LAYERS:-4} --batch 1 --ctx ${CTX:-16384} --steps 16 --warmup 4 --tp 2"
run dec_tp2 timeout 60 "$B/kdbench" $D
grep -v "^\[" "$L/dec_tp2.log" | tail -n 4 | tee -a "$O/summary.txt"
run dec_tp2_cp timeout 60 "$B/kdbench" $D --mla-cp
grep -v "^\[" "$L/dec_tp2_cp.log" | tail -n 4 | tee -a "$O/summary.txt"
grep -h "KV cache\|exchange" "$L/dec_tp2.log" "$L/dec_tp2_cp.log" | cut -c1-220 | tee -a "$O/summary.txt"
run attn_mla_quick env KD_TEST_QUICK=1 timeout 60 "$B/tests/test_cuda_attn_mla"
grep -E "FAIL" "$L/attn_mla_quick.log" | head -5 | tee -a "$O/summary.txt"
tar -C "$L" -czf "$O/logs.tgz" .
