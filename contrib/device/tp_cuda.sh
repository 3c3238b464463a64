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
. contrib/device/lib.sh
use "${B:-build-tp}"
gpu_line
step test_cuda_tp "${T_TEST:-100}" sh "$B/test_cuda_tp.sh"
grep -E "worst row|refused|FAIL|SKIP" "$L/test_cuda_tp.log" | head -60
step san_memcheck_tp2 40 "$CS" --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/llama3 --backend cuda --tp 2 --tokens 5,17,300,2 --out "$L/san.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$L/san_memcheck_tp2.log" | head -6
step san_memcheck_tp4_mla 40 "$CS" --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/deepseek_v3 --backend cuda --tp 4 --incremental --tokens 5,17,300,2 \
	--out "$L/san4.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$L/san_memcheck_tp4_mla.log" | head -6
step san_memcheck_tp2_ep 40 "$CS" --tool memcheck --error-exitcode 9 "$B/kdbench" logits \
	--model tests/data/golden/qwen3_moe --backend cuda --tp 2 --ep --incremental --tokens 5,17,300,2 \
	--out "$L/san_ep.f32"
grep -E "ERROR SUMMARY|Invalid|Program hit" "$L/san_memcheck_tp2_ep.log" | head -6
D="decode --model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda --batch 1,8 --ctx 1024 --steps 32 --warmup 8"
if [ "${AB:-1}" = 1 ] && [ -x "$B/kdbench_main" ]; then
	step decode_main 40 "$B/kdbench_main" $D
	grep -v "^\[" "$L/decode_main.log" | tail -n 6
fi
if [ "${AB:-1}" = 1 ]; then
	step decode_tp1 40 "$B/kdbench" $D
	grep -v "^\[" "$L/decode_tp1.log" | tail -n 6
fi
for tp in ${TPDEC:-2}; do
	step decode_tp$tp 40 "$B/kdbench" $D --tp $tp
	grep -v "^\[" "$L/decode_tp$tp.log" | tail -n 6
done
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" .
