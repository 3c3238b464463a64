#!/bin/bash
# A MoE layer's shared expert on a branch of the step (daemon/backend/cuda/
# backend_cuda_branch.c, KDEC_MOE_SHARED_BRANCH rows, default 64) on the GPU machine, in
# one call of < 10 minutes:
#   SH_PART=check   test_golden on cuda with the branch (the default) and without it
#                   (KDEC_MOE_SHARED_BRANCH=0): the DeepSeek goldens have shared experts
#   SH_PART=decode  kdbench decode of the models with a shared expert, the branch on and
#                   off one after the other (SH_DECODE: model:format:batches triples)
#   SH_PART=compact bench_cuda_moe q at M 1 on Kimi-K2's experts: 8 of 384 spread over
#                   17 GB against only the 8 allocated, 8 of 16 and 8 of 64 (fp8-block)
#   SH_PART=fused0  DeepSeek-V2-Lite bf16 batch 1 with KDEC_MOE_FUSED_ROWS=0 (the shared
#                   expert on the branch instead of in the fused MoE call) beside the default
# SH_PART may name several, run in that order.
# here: make -C build -j2 all && make -C build -j2 check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_golden bench_cuda_moe" \
#       contrib/device/pack.sh build devbuild-sh
# device run: SH_PART="check decode" bash contrib/device/moe_shared.sh
#             carry ["devbuild-sh.tar.xz"] (DEVBUILD: another packed build's name)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-sh}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

check() {
	local k
	for k in 64 0; do
		step "golden_branch$k" 150 env KDEC_TEST_BACKEND=cuda KDEC_MOE_SHARED_BRANCH=$k \
			"$B/tests/test_golden"
		grep -E "FAIL|passed|failed" "$L/golden_branch$k.log" | tail -4 | sed "s/^/branch $k: /" |
			tee -a "$S"
	done
}

decode() {
	local r m f bt
	for r in ${SH_DECODE:-deepseek-v2-lite:fp8-block:1,8,64 deepseek-v2-lite:bf16:1,8,64
		deepseek-v2-lite:int4-g32:1,8 deepseek-v3:fp8-block:1,8 kimi-k2:fp8-block:1,8
		kimi-k2:int4-g32:1,8}; do
		m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
		dec "${m}_${f}_branch" $m $bt $f KDEC_MOE_SHARED_BRANCH=64
		grep -m1 "shared experts on a branch" "$L/${m}_${f}_branch.log" | cut -c1-160 | tee -a "$S"
		dec "${m}_${f}_inline" $m $bt $f KDEC_MOE_SHARED_BRANCH=0
	done
}

compact() {
	local sh
	for sh in "kimi-k2 7168" kimi-k2-; do
		step "bench_$(echo $sh | tr ' ' _)" 90 "$B/tests/bench/bench_cuda_moe" q "$sh" 1 fp8-block
		grep "moe_q time.*qgemv" "$L/bench_$(echo $sh | tr ' ' _).log" | cut -c1-200 | tee -a "$S"
	done
}

fused0() {
	dec deepseek-v2-lite_bf16_fused deepseek-v2-lite 1 bf16
	dec deepseek-v2-lite_bf16_fused0 deepseek-v2-lite 1 bf16 KDEC_MOE_FUSED_ROWS=0
}

for part in ${SH_PART:-check decode}; do
	case $part in
	check) check ;;
	decode) decode ;;
	compact) compact ;;
	fused0) fused0 ;;
	*) say "moe_shared.sh: no part $part" ;;
	esac
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
