#!/bin/bash
# Issue 24 on the GPU machine in one call: the quantized-linear kernel test, its
# benchmark against the floor, the quantized golden models on cuda (rows and greedy),
# and kdbench decode on Llama-3.1-8B synthetic weights in bf16, fp8-block, fp8-channel
# and int4-g32, one after another in the same call. Logs into $OUT (few files: the
# device tool returns at most 8).
#   here: PACK_SERVE=0 PACK_TESTS="test_cuda_linear_q test_golden bench_cuda_linear_q" \
#         contrib/device/pack.sh build /work/main/build-quant
#         cp contrib/device/quant_gpu.sh /work/main/build-quant/
#   device run: bash build-quant/quant_gpu.sh   carry ["build-quant"]
# QG_PHASES (default "test bench golden decode"; also san) picks phases; QG_FORMATS the decode
# formats; QG_BATCH the batch sizes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${KDEC_BUILD_DIR:-build-quant}
export LD_LIBRARY_PATH="$PWD/$B/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export top_srcdir=$PWD top_builddir=$PWD/$B
O=${OUT:-/tmp/quant_gpu}
mkdir -p "$O"
S=$O/summary.txt

say() { echo "$*" | tee -a "$S"; }

# step NAME LIMIT CMD...: its output to $O/NAME.log, one summary line
step() {
	local name=$1 lim=$2 t0=$SECONDS rc
	shift 2
	timeout "$lim" "$@" >>"$O/$name.log" 2>&1
	rc=$?
	say "$name: exit $rc in $((SECONDS - t0)) s"
}

say "# quant_gpu.sh $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader)"
for p in ${QG_PHASES:-test bench golden decode}; do
	case $p in
	san)	# compute-sanitizer memcheck, racecheck, synccheck of test_cuda_linear_q (quick
		# size) side by side, each cut at QG_SAN_TIMEOUT (default 60 s)
		cs=/usr/local/cuda/bin/compute-sanitizer
		for tool in memcheck racecheck synccheck; do
			env KD_TEST_QUICK=1 timeout "${QG_SAN_TIMEOUT:-60}" "$cs" --tool $tool --print-limit 20 \
				--show-backtrace device --error-exitcode 9 "$B/tests/test_cuda_linear_q" \
				>"$O/san_$tool.log" 2>&1 &
		done
		wait
		for tool in memcheck racecheck synccheck; do
			say "  $tool: $(grep -cE '^========= +(Error|Warning|Invalid|Race|Program hit)' "$O/san_$tool.log") reports," \
				"$(grep -c 'PASS' "$O/san_$tool.log") PASS, $(grep -c FAIL "$O/san_$tool.log") FAIL lines;" \
				"$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$O/san_$tool.log" | tail -n 1)"
		done
		;;
	test)
		step linear_q 90 "$B/tests/test_cuda_linear_q"
		grep -E 'FAIL|PASS|rel L2 .*(mma|dequant)' "$O/linear_q.log" | grep -E 'FAIL|PASS|N  6144|N   520' | head -40 | tee -a "$S"
		;;
	bench)
		step bench_q 90 "$B/tests/bench/bench_cuda_linear_q" ${QG_BENCH_ARGS:-}
		tail -n 12 "$O/bench_q.log" | tee -a "$S"
		;;
	golden)
		step golden 90 env KDEC_TEST_BACKEND=cuda KDEC_GOLDEN_ONLY=quant/ "$B/tests/test_golden"
		grep -E 'fidelity|greedy|FAIL|PASS|stay quantized' "$O/golden.log" | cut -c1-220 | tee -a "$S"
		;;
	decode)
		for f in ${QG_FORMATS:-bf16 fp8-block fp8-channel int4-g32}; do
			echo "## $f" >>"$O/decode.log"
			step "decode" 70 "$B/kdbench" decode --model tests/data/configs/llama3.1-8b.json \
				--synthetic-weights --weight-format "$f" --backend cuda \
				--batch "${QG_BATCH:-1,8,64}" --ctx 512 --steps 24 --warmup 4 --out "$O/decode.jsonl"
		done
		grep -vE ' info | warn ' "$O/decode.log" | tee -a "$S"
		;;
	esac
done
