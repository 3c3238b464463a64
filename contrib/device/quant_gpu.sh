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
# QG_PHASES (default "test bench golden decode"; also san, and check: san + test +
# golden side by side) picks phases; QG_FORMATS the decode
# formats; QG_BATCH the batch sizes.
set -u
. contrib/device/lib.sh
use "${KDEC_BUILD_DIR:-build-quant}"

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
	san | check)	# compute-sanitizer memcheck and synccheck of test_cuda_linear_q (quick
		# size), racecheck of its tensor-core part (no cuBLAS) one format at a time, side
		# by side, each cut at QG_SAN_TIMEOUT (default 60 s); check: the test itself and
		# golden quant/ beside them (correctness only: nothing timed runs meanwhile)
		cs=/usr/local/cuda/bin/compute-sanitizer
		runs="memcheck synccheck"
		for c in ${QG_RACE_CASES:-block channel tensor g32 g128}; do runs="$runs racecheck:$c"; done
		# QG_RACE_PART=wide: racecheck only the 8 < M <= 64 streaming form (default mma:
		# the tensor-core part, whose first 17-20 runs of a format fill 50 s)
		for r in $runs; do
			tool=${r%%:*} c=${r#*:}
			[ "$c" = "$r" ] && c=
			env KD_TEST_QUICK=1 ${c:+KD_TEST_PART=${QG_RACE_PART:-mma} KD_TEST_CASES=$c} \
				timeout "${QG_SAN_TIMEOUT:-60}" "$cs" --tool "$tool" --print-limit 20 \
				--show-backtrace device --error-exitcode 9 "$B/tests/test_cuda_linear_q" \
				>"$O/san_$tool${c:+_$c}.log" 2>&1 &
		done
		if [ "$p" = check ]; then
			timeout 60 "$B/tests/test_cuda_linear_q" >"$O/linear_q.log" 2>&1 &
			timeout 60 env KDEC_TEST_BACKEND=cuda KDEC_GOLDEN_ONLY=quant/ "$B/tests/test_golden" \
				>"$O/golden.log" 2>&1 &
		fi
		wait
		for r in $runs; do
			tool=${r%%:*} c=${r#*:}
			[ "$c" = "$r" ] && c=
			f=$O/san_$tool${c:+_$c}.log
			say "  $tool${c:+ ($c, tensor-core part)}: $(grep -cE '^========= +(Error|Warning|Invalid|Race|Program hit)' "$f") reports;" \
				"$(grep -c FAIL "$f") FAIL lines; $(grep -E 'checks passed|failed' "$f" | tail -n 1);" \
				"$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1)"
		done
		if [ "$p" = check ]; then
			grep -E 'FAIL|checks passed|failed' "$O/linear_q.log" | head -20 | tee -a "$S"
			grep -E 'stream +N .* M +(9|16|33|64) ' "$O/linear_q.log" |
				awk '{for (i = 1; i < NF; i++) if ($i == "L2") { print $(i + 1), $0; break }}' |
				sort -g | tail -n 3 | tee -a "$S"
			grep -E 'fidelity|greedy|FAIL|PASS|passed|failed' "$O/golden.log" | cut -c1-220 | tail -n 20 | tee -a "$S"
		fi
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
				--batch "${QG_BATCH:-1,8,64}" --ctx 512 --steps "${QG_STEPS:-24}" --warmup 4 \
				--out "$O/decode.jsonl"
		done
		grep -vE ' info | warn ' "$O/decode.log" | tee -a "$S"
		;;
	esac
done
