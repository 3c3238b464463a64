#!/bin/bash
# The ring GEMV on bf16 weights (K_CUDA_LINEAR_RING: the quantized decode GEMV's kernel,
# linear_qgemv.cu, for bf16 linears of M <= KDEC_LINEAR_RING rows on matrices above
# linear_small_mb, with SwiGLU formed in the down projection) on the GPU machine, in one
# call of < 10 minutes:
#   RG_PART=check   test_cuda_linear (every kind, the folded forms), test_cuda_linear_q,
#                   test_cuda_moe, test_golden on cuda (the defaults), and
#                   test_cuda_golden_ring.sh, test_cuda_golden_inline.sh
#   RG_PART=bench   bench_cuda_linear --quick (the ring column beside cuBLAS and stream)
#   RG_PART=decode  kdbench decode, the ring on (8 rows) and off one after the other
#                   (RG_DECODE: model:format:batches triples), then the defaults of
#                   RG_DEFAULTS (the same form)
#   RG_PART=tune    Llama-3.1-8B bf16 (ring on, off) and fp8, Qwen3-30B-A3B fp8, batch 1,
#                   twice each, with the K splits timed at startup and with the model's
#                   (KDEC_LINEAR_Q_TUNE=0): the spread between processes
#   RG_PART=trace   layer traces of Llama-3.1-8B bf16 batch 1, ring on and off (the build
#                   needs libktrace.so: layer_trace.sh's usage)
# RG_PART may name several, run in that order.
# here: make -C build -j2 all && make -C build -j2 check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_linear test_cuda_linear_q test_cuda_moe
#       test_golden bench_cuda_linear" contrib/device/pack.sh build devbuild-rg
# device run: RG_PART="check bench decode" bash contrib/device/ring.sh
#             carry ["devbuild-rg.tar.xz"] (DEVBUILD: another packed build's name)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-rg}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

check() {
	local t
	for t in test_cuda_linear test_cuda_linear_q test_cuda_moe; do
		step "$t" 150 "$B/tests/$t"
		grep -E "FAIL" "$L/$t.log" | head -5 | tee -a "$S"
	done
	grep -E "^ring folds|ring +acc=0.*N=4096 " "$L/test_cuda_linear.log" | head -12 | cut -c1-200 | tee -a "$S"
	step golden 150 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	step golden_ring 150 sh tests/test_cuda_golden_ring.sh
	step golden_inline 150 sh tests/test_cuda_golden_inline.sh
}

bench() {
	step bench_linear 200 "$B/tests/bench/bench_cuda_linear" --quick
	grep -E "^llama|^dsv2|M=" "$L/bench_linear.log" | cut -c1-190 | tee -a "$S"
}

decode() {
	local r m f bt
	for r in ${RG_DECODE:-llama3.1-8b:bf16:1,8 qwen3-8b:bf16:1}; do
		m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
		dec "${m}_${f}_ring" $m $bt $f KDEC_LINEAR_RING=8
		dec "${m}_${f}_noring" $m $bt $f KDEC_LINEAR_RING=0
	done
	# the defaults at this build, for the issues' tables
	for r in ${RG_DEFAULTS:-llama3.1-8b:fp8-block:1 llama3.1-8b:int4-g32:1
		qwen3-30b-a3b:fp8-block:1 deepseek-v2-lite:fp8-block:1 qwen3-30b-a3b:bf16:1}; do
		m=${r%%:*} r=${r#*:} f=${r%%:*} bt=${r#*:}
		dec "${m}_${f}" $m $bt $f
	done
}

# The spread between processes (each times its K splits at startup) and without the
# tuning (KDEC_LINEAR_Q_TUNE=0: the splits of the per-multiprocessor model).
tune() {
	local i
	for i in 1 2; do
		dec "llama_bf16_ring_t1_$i" llama3.1-8b 1 bf16 KDEC_LINEAR_RING=8 KDEC_LT_LOG=1
		dec "llama_bf16_ring_t0_$i" llama3.1-8b 1 bf16 KDEC_LINEAR_RING=8 KDEC_LINEAR_Q_TUNE=0
		dec "llama_bf16_noring_$i" llama3.1-8b 1 bf16
		dec "llama_fp8_t1_$i" llama3.1-8b 1 fp8-block
		dec "llama_fp8_t0_$i" llama3.1-8b 1 fp8-block KDEC_LINEAR_Q_TUNE=0
		dec "qwen3moe_fp8_t1_$i" qwen3-30b-a3b 1 fp8-block
		dec "qwen3moe_fp8_t0_$i" qwen3-30b-a3b 1 fp8-block KDEC_LINEAR_Q_TUNE=0
	done
	grep -h "qgemv bf16.*kept split" "$L"/llama_bf16_ring_t1_*.log | cut -c1-220 | tee -a "$S"
}

trace() {
	NO_ARCHIVE=1 RUNS=llama3.1-8b TAG=ring KDEC_LINEAR_RING=8 bash contrib/device/layer_trace.sh
	NO_ARCHIVE=1 RUNS=llama3.1-8b TAG=noring KDEC_LINEAR_RING=0 bash contrib/device/layer_trace.sh
}

for part in ${RG_PART:-check bench decode}; do
	case $part in
	check) check ;;
	bench) bench ;;
	decode) decode ;;
	tune) tune ;;
	trace) trace ;;
	*) say "ring.sh: no part $part" ;;
	esac
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
