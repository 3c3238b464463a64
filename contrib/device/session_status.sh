#!/bin/bash
# Where the decode step stands on one GPU, one call of < 5 minutes: test_golden on cuda,
# then kdbench decode (ctx 1024) of the issue 23/24 models at batch 1 (STATUS_RUNS:
# NAME:MODEL:BATCHES:FORMAT[:ENV=VALUE,...] entries); the default list runs each MoE
# model twice, as built and with session 21's switches off (the routing's registers,
# the router GEMV's split, the shared expert's branch), one after the other.
# here: PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_golden" contrib/device/pack.sh build devbuild-st
# device run: bash contrib/device/session_status.sh   carry ["devbuild-st.tar.xz"]
set -u
DEADLINE=${DEADLINE:-280}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-st}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec
OFF=KDEC_MOE_ROUTE_REG=0,KDEC_LINEAR_GEMV_SPLIT=0,KDEC_MOE_SHARED_BRANCH=0

step golden 90 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
for r in ${STATUS_RUNS:-llama_fp8:llama3.1-8b:1:fp8-block llama_int4:llama3.1-8b:1:int4-g32
	llama_bf16:llama3.1-8b:1:bf16 qwen3moe_fp8:qwen3-30b-a3b:1:fp8-block
	qwen3moe_fp8_off:qwen3-30b-a3b:1:fp8-block:$OFF v2lite_fp8:deepseek-v2-lite:1:fp8-block
	v2lite_fp8_off:deepseek-v2-lite:1:fp8-block:$OFF kimi_fp8:kimi-k2:1:fp8-block
	kimi_fp8_off:kimi-k2:1:fp8-block:$OFF dsv3_fp8:deepseek-v3:1:fp8-block
	dsv3_fp8_off:deepseek-v3:1:fp8-block:$OFF}; do
	IFS=: read -r n m bt f env <<<"$r"
	dec "$n" "$m" "$bt" "$f" ${env//,/ }
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
