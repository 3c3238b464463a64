#!/bin/bash
# moe_qgemv.cu (quantized routed experts at M <= 8 as two GEMVs over the union of the
# chosen experts, KDEC_MOE_QGEMV_ROWS) on the GPU machine, in calls of < 10 minutes:
#   QG_PART=check  test_cuda_moe_q quick under compute-sanitizer memcheck, then at full
#                  size (every model shape and format: the union GEMVs against the CPU,
#                  their bits twice, the small path's own kernels beside them),
#                  test_golden on cuda (the quantized MoE goldens take them at decode)
#   QG_PART=bench  bench_cuda_moe q at M 1 and 8 (QG_BENCH_M), every shape or those of
#                  QG_BENCH_SHAPES (name substrings): small path, union GEMVs on the
#                  plain grid and persistent, the tile kernels, each beside the floor of
#                  its bytes
#   QG_PART=decode kdbench decode (ctx 1024, batch 1 and 8) of Qwen3-30B-A3B and
#                  DeepSeek-V2-Lite in fp8-block and int4-g32, the Kimi-K2 and DeepSeek-V3
#                  slices, each in the variants QG_VARIANTS (q0 q8: the knob 0, 8;
#                  p / p0: KDEC_MOE_QGEMV_PERSIST=1 / 0)
#                  (QG_DECODE: model:format pairs; QG_DEC_BATCH: the batches, 1,8)
#   QG_PART=sweep  bench_cuda_moe q at M 1 and 8 with the gate/up K slices forced
#                  (KDEC_MOE_QGEMV_SPLIT, QG_SPLITS: 1 2 3 4)
#   QG_PART=trace  layer_trace.sh of Qwen3-30B-A3B fp8 batch 1 with the knob 0 and 8
#   QG_PART=ktrace bench_cuda_moe q's kernels timed one by one (CUPTI; libktrace.so in
#                  the build): Qwen3-30B-A3B and Kimi-K2 fp8 at M 1 and 8
#   QG_PART=dense  bench_cuda_linear_q's dense gate/up (36864 x 7168) at M 1 and 8: the
#                  dense GEMV's rate on a matrix of the union gate/up's size
#                  (QG_DENSE_PDL="1 0": with KDEC_CUDA_PDL 1, then 0)
#   QG_PART=compact bench_cuda_moe q at M 1 on Kimi-K2's experts, 8 of 384 spread over
#                  17 GB against only the 8 allocated and 8 of 16, of 64
#   QG_PART=memcheck test_cuda_moe_q quick under compute-sanitizer memcheck, test_golden
#   QG_PART=tests  test_cuda_moe_q quick
#   QG_PART=quick  a first look: test quick, bench M 1, Qwen3-30B-A3B fp8 decode 0 / 8
# QG_PART may name several, run in that order ("tests bench sweep check").
# here: make -C build -j2 all && make -C build -j2 check TESTS= &&
#       PACK_XZ=1 PACK_SERVE=0 PACK_TESTS="test_cuda_moe_q test_golden bench_cuda_moe bench_cuda_linear_q" \
#       contrib/device/pack.sh build devbuild-qg
# device run: QG_PART=quick bash contrib/device/moe_qgemv.sh   carry ["devbuild-qg.tar.xz"]
# (DEVBUILD: another packed build's name)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-qg}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

verdicts() { grep -E "FAIL|ERROR SUMMARY|passed|failed" "$L/$1.log" | tail -${2:-8} | tee -a "$S"; }

trace() {	# one Qwen3-30B-A3B fp8 layer at batch 1, kernel by kernel, knob 0 and 8 (the
	# build needs libktrace.so: layer_trace.sh's usage)
	for k in 0 8; do
		NO_ARCHIVE=1 TAG=q$k RUNS="qwen3-30b-a3b:fp8-block" KDEC_MOE_QGEMV_ROWS=$k \
			bash contrib/device/layer_trace.sh
	done
}

ktrace() {	# bench_cuda_moe q's kernels one by one (CUPTI): the union GEMVs' gate/up
	# and down apart, Qwen3-30B-A3B and Kimi-K2 fp8 at M 1 and 8
	local lib=$PWD/$B/libktrace.so
	for d in /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64; do
		[ -e "$d/libcupti.so.13" ] && { export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d; break; }
	done
	for sh in qwen3 kimi; do
		for m in 1 8; do
			KDEC_KTRACE=$L/kt_$sh$m.csv CUDA_INJECTION64_PATH=$lib step "ktrace_$sh$m" 60 \
				"$B/tests/bench/bench_cuda_moe" q "$sh" "$m" fp8-block
			python3 - "$L/kt_$sh$m.csv" "$sh M $m" <<'PY' | tee -a "$S"
import sys, collections, statistics
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split(",", 7)
    if len(f) == 8:
        d[f[7].split("<")[0].split("(")[0][-40:]].append((int(f[1]) - int(f[0])) / 1e3)
for k, v in sorted(d.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
    if len(v) >= 5:
        print(f"ktrace {sys.argv[2]:10s} {k:40s} n {len(v):5d} median {statistics.median(v):8.2f} us")
PY
		done
	done
}

tests_quick() {
	step test_quick 90 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
	grep -E "qgemv" "$L/test_quick.log" | head -40 | tee -a "$S"
	verdicts test_quick
}

check() {
	step memcheck 150 env KD_TEST_QUICK=1 "$CS" --tool memcheck --error-exitcode 9 \
		"$B/tests/test_cuda_moe_q"
	verdicts memcheck
	step test_full 150 "$B/tests/test_cuda_moe_q"
	grep -E "qgemv" "$L/test_full.log" | tee -a "$S"
	verdicts test_full
	step golden 150 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	verdicts golden 5
}

memcheck_golden() {
	step memcheck 150 env KD_TEST_QUICK=1 "$CS" --tool memcheck --error-exitcode 9 \
		"$B/tests/test_cuda_moe_q"
	verdicts memcheck
	step golden 150 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	verdicts golden 5
}

bench() {	# QG_BENCH_M: the rows (1 8); QG_BENCH_SHAPES: name substrings (all)
	local m sh
	for m in ${QG_BENCH_M:-1 8}; do
		for sh in ${QG_BENCH_SHAPES:-all}; do
			[ "$sh" = all ] && sh=
			step "bench_m$m$sh" 120 "$B/tests/bench/bench_cuda_moe" q "$sh" "$m"
			grep "moe_q time" "$L/bench_m$m$sh.log" | cut -c1-200 | tee -a "$S"
		done
	done
}

decode() {	# QG_DECODE: model:format pairs (default: the four MoE models in fp8 and int4)
	local r m f v bt=${QG_DEC_BATCH:-1,8}
	dec qwen3-30b-a3b_bf16 qwen3-30b-a3b $bt bf16
	for r in ${QG_DECODE:-qwen3-30b-a3b:fp8-block qwen3-30b-a3b:int4-g32 deepseek-v2-lite:fp8-block
		deepseek-v2-lite:int4-g32 kimi-k2:fp8-block kimi-k2:int4-g32 deepseek-v3:fp8-block
		deepseek-v3:int4-g32}; do
		m=${r%%:*} f=${r#*:}
		for v in ${QG_VARIANTS:-q0 q8}; do
			case $v in
			q0) dec "${m}_${f}_q0" $m $bt $f KDEC_MOE_QGEMV_ROWS=0 ;;
			q8) dec "${m}_${f}_q8" $m $bt $f KDEC_MOE_QGEMV_ROWS=8 ;;
			# the persistent gate/up
			p) dec "${m}_${f}_q8p" $m $bt $f KDEC_MOE_QGEMV_ROWS=8 KDEC_MOE_QGEMV_PERSIST=1 ;;
			p0) dec "${m}_${f}_q8p0" $m $bt $f KDEC_MOE_QGEMV_ROWS=8 KDEC_MOE_QGEMV_PERSIST=0 ;;
			*) say "moe_qgemv.sh: no decode variant $v" ;;
			esac
		done
	done
}

sweep() {	# the gate/up K slices forced, M 1 and 8
	for sp in ${QG_SPLITS:-1 2 3 4}; do
		for m in 1 8; do
			step "bench_s${sp}_m$m" 90 env KDEC_MOE_QGEMV_SPLIT=$sp \
				"$B/tests/bench/bench_cuda_moe" q "" "$m"
			grep "moe_q time.*qgemv" "$L/bench_s${sp}_m$m.log" | sed "s/^/split $sp /" |
				cut -c1-200 | tee -a "$S"
		done
	done
}

dense() {	# the dense quantized GEMV on a matrix of the union gate/up's size (DeepSeek-V3's
	# dense gate/up, 36864 x 7168: Kimi-K2's 8 experts' gate/up are 32768 x 7168), M 1, 8,
	# with KDEC_CUDA_PDL in QG_DENSE_PDL (1; "1 0": its weights before the wait or not)
	local pdl
	for pdl in ${QG_DENSE_PDL:-1}; do
		step "dense_pdl$pdl" 120 env KDEC_CUDA_PDL=$pdl "$B/tests/bench/bench_cuda_linear_q" \
			--only "dense gate_up" --m 1,8 --fmt fp8-block,int4-g32
		grep -E "gate_up" "$L/dense_pdl$pdl.log" | sed "s/^/pdl $pdl /" | cut -c1-220 |
			tee -a "$S"
	done
}

compact() {	# Kimi-K2's experts at M 1: 8 of 384 spread over 17 GB against only the 8
	# allocated (352 MB) and 8 of 16, of 64 (QG_COMPACT_FMT: one format)
	for sh in "kimi-k2 7168" kimi-k2-; do
		step "bench_$(echo $sh | tr ' ' _)" 90 "$B/tests/bench/bench_cuda_moe" q "$sh" 1 \
			${QG_COMPACT_FMT:-}
		grep "moe_q time.*qgemv" "$L/bench_$(echo $sh | tr ' ' _).log" | cut -c1-200 | tee -a "$S"
	done
}

quick() {
	tests_quick
	QG_BENCH_M=1 bench
	for k in 0 8; do
		dec "qwen3-30b-a3b_fp8-block_q$k" qwen3-30b-a3b 1,8 fp8-block KDEC_MOE_QGEMV_ROWS=$k
	done
}

# QG_PART: one or more of the parts above, in order
for part in ${QG_PART:-quick}; do
	case $part in
	quick) quick ;;
	tests) tests_quick ;;
	check) check ;;
	memcheck) memcheck_golden ;;
	bench) bench ;;
	sweep) sweep ;;
	trace) trace ;;
	ktrace) ktrace ;;
	dense) dense ;;
	compact) compact ;;
	decode) decode ;;
	*) say "moe_qgemv.sh: no part $part" ;;
	esac
done
tar -C "$L" -cJf "$O/logs.tar.xz" .
