#!/bin/bash
# cuda --tp N with virtual ranks on one GPU (issue 25): tests/test_cuda_tp.sh, then one
# small tp 2 run (llama3), one tp 4 (deepseek_v3: MLA, MoE) and one tp 2 --ep (qwen3_moe)
# of kdbench logits under compute-sanitizer memcheck, then kdbench decode --tp 1 A/B (this build's kdbench vs
# kdbench_main, the same call; AB=0 skips it) and cuda --tp $TPDEC's decode figures
# (default 2) on Llama-3.1-8B's shapes with synthetic weights. Logs to $OUT. Packed with the build it runs:
#   PACK_SERVE=1 PACK_TESTS=" " contrib/device/pack.sh build DIR; cp tests/test_cuda_tp.sh
#   contrib/device/tp_cuda.sh DIR/; (optional) cp MAIN_BUILD/kdbench DIR/kdbench_main;
#   tar+xz DIR;  device run "tar -xJf DIR.tar.xz && B=DIR bash DIR/tp_cuda.sh" carry [DIR.tar.xz]
set -u
export NCCL_NVLS_ENABLE=0
B=${B:-build-tp}
O=${OUT:-/tmp/tpout}; mkdir -p "$O"
export LD_LIBRARY_PATH="$PWD/$B/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$O/gpu.txt"
run() { local n=$1 t=$SECONDS; shift; "$@" >"$O/$n.log" 2>&1; local rc=$?; echo "== $n: rc $rc in $((SECONDS-t)) s: $(tail -n 1 "$O/$n.log" | cut -c1-300)"; }
run test_cuda_tp env top_srcdir=. top_builddir="$B" timeout "${T_TEST:-100}" sh "$B/test_cuda_tp.sh"
grep -E "worst row|refused|FAIL|SKIP" "$O/test_cuda_tp.log" | head -60
cs=/usr/local/cuda/bin/compute-sanitizer
run san_memcheck_tp2 timeout 40 $cs --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/llama3 --backend cuda --tp 2 --tokens 5,17,300,2 --out "$O/san.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$O/san_memcheck_tp2.log" | head -6
run san_memcheck_tp4_mla timeout 40 $cs --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/deepseek_v3 --backend cuda --tp 4 --incremental --tokens 5,17,300,2 \
	--out "$O/san4.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$O/san_memcheck_tp4_mla.log" | head -6
run san_memcheck_tp2_ep timeout 40 $cs --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/qwen3_moe --backend cuda --tp 2 --ep --incremental --tokens 5,17,300,2 \
	--out "$O/san_ep.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$O/san_memcheck_tp2_ep.log" | head -6
D="decode --model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda --batch 1,8 --ctx 1024 --steps 32 --warmup 8"
if [ "${AB:-1}" = 1 ] && [ -x "$B/kdbench_main" ]; then
	run decode_main timeout 40 "$B/kdbench_main" $D
	grep -v "^\[" "$O/decode_main.log" | tail -n 6
fi
if [ "${AB:-1}" = 1 ]; then
	run decode_tp1 timeout 40 "$B/kdbench" $D
	grep -v "^\[" "$O/decode_tp1.log" | tail -n 6
fi
for tp in ${TPDEC:-2}; do
	run decode_tp$tp timeout 40 "$B/kdbench" $D --tp $tp
	grep -v "^\[" "$O/decode_tp$tp.log" | tail -n 6
done
echo "total $((SECONDS - t0)) s"
