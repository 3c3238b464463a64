#!/bin/bash
# The attention chain of a batch-1 decode layer (qkv_post, the split attention, the split
# merge: ~13 us of a 109 us Llama-3.1-8B fp8 layer on the H100 for ~1 us of K/V bytes,
# session 15's trace) under the switches that fold it into fewer launches, on the GPU
# machine in one call of < 10 min (the third, the split merge in the attention kernel,
# KDEC_ATTN_MMA_FOLD, was measured slower and removed in session 35):
#   KDEC_ATTN_DEC_SPLITS=N  N splits along the sequence instead of one wave of blocks
#   KDEC_QKV_IN_ATTN=1      qkv_post's rope and cache append in the attention launch
#   AC_PART=trace   CUPTI layer traces (layer_trace.sh) of Llama-3.1-8B fp8-block b1 as
#                   it is and with 8 splits, both folds; Qwen3-30B-A3B bf16 b1
#   AC_PART=decode  kdbench decode of Llama-3.1-8B fp8-block (b1, 8) across the switches,
#                   bf16 and Qwen3-30B-A3B bf16 as they are and with the best guess
#   AC_PART=slices  moe_qtile.sh's slices (Kimi-K2, DeepSeek-V3 fp8-block / int4-g32)
#   AC_PART=all     trace, decode, slices, cut at DEADLINE
# here: PACK_XZ=0 PACK_SERVE=0 PACK_TESTS=" " \
#         contrib/device/pack.sh build devbuild-ac && cc -O2 -shared -fPIC \
#         -I/usr/local/cuda/include contrib/device/kernel_trace.c -o devbuild-ac/libktrace.so \
#         -L/usr/local/cuda/lib64 -lcupti && tar -cJf devbuild-ac.tar.xz devbuild-ac
# device run: AC_PART=all bash contrib/device/attn_chain.sh   carry ["devbuild-ac.tar.xz"]
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-ac}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec
FOLD="KDEC_ATTN_DEC_SPLITS=8 KDEC_QKV_IN_ATTN=1"

trace() {
	NO_ARCHIVE=1 RUNS="llama3.1-8b:fp8-block qwen3-30b-a3b" bash contrib/device/layer_trace.sh
	NO_ARCHIVE=1 TAG=fold RUNS="llama3.1-8b:fp8-block" env $FOLD bash contrib/device/layer_trace.sh
}

decode() {
	local m=llama3.1-8b
	dec "${m}_fp8" $m 1,8 fp8-block
	dec "${m}_fp8_s8" $m 1,8 fp8-block KDEC_ATTN_DEC_SPLITS=8
	dec "${m}_fp8_s8_fq" $m 1,8 fp8-block $FOLD
	dec "${m}_fp8_s4_fq" $m 1,8 fp8-block KDEC_ATTN_DEC_SPLITS=4 KDEC_QKV_IN_ATTN=1
	dec "${m}_bf16" $m 1,8 bf16
	dec "${m}_bf16_s8_fq" $m 1,8 bf16 $FOLD
	dec "qwen3-30b-a3b_bf16" qwen3-30b-a3b 1,8 bf16
	dec "qwen3-30b-a3b_bf16_s8_fq" qwen3-30b-a3b 1,8 bf16 $FOLD
}

slices() {
	for m in kimi-k2 deepseek-v3; do
		for f in bf16 fp8-block int4-g32; do
			dec "${m}_${f}" $m 1,8 $f
		done
	done
}

case ${AC_PART:-all} in
trace) trace ;;
decode) decode ;;
slices) slices ;;
*) trace; decode; slices ;;
esac
tar -C "$L" -cJf "$O/logs.tar.xz" .
