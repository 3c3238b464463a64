#!/bin/bash
# GPU checks and benchmarks of a build carried to the GPU machine (DEVICE workflow):
#   contrib/device/pack.sh   (here: build/ -> devbuild/, small enough to carry)
#   device run: KDEC_BUILD_DIR=devbuild bash contrib/device/run.sh PHASE...   carry ["devbuild"]
# Phases: check (GPU unit tests, golden models on cuda, generate cpu vs cuda),
#         serve (kdecd --backend cuda serving kdrun), compare (cpu vs cuda logits by layer),
#         optimes (per-op times), ncu (one step's kernels, clocks never locked),
#         sanitize (compute-sanitizer memcheck + racecheck of the GPU tests),
#         bench (the linear layers' and decode benchmarks), kbench (every kernel
#         benchmark of tests/bench), ab (decode under knob settings), abbuild (decode
#         of another build's kdbench against this one's, alternating), abagent (kdbench
#         agent against another build's kdecd and this one's), peers (HF /
#         torch.compile peers), prefill (kdbench prefill beside eager PyTorch SDPA,
#         per-op times of a prefill), agent (the serving benchmark, 1-64 sessions).
# Logs go to $OUT/logs.tgz (one file: the device tool returns few files) beside
# $OUT/summary.txt, whose lines are also printed. The machine lacks libev and liburing
# (kdecd and kdbench need them): pack.sh puts them in devbuild/devlibs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${KDEC_BUILD_DIR:-build}
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/$B/devlibs${nccl:+:$nccl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export top_srcdir=$PWD top_builddir=$PWD/$B
# a build carried as pack.sh's PACK_XZ archive: unpacked once, beside it
[ -d "$B" ] || [ ! -f "$B.tar.xz" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$B.tar.xz" "$(dirname "$B")"
out=$(mktemp -d /tmp/kdec-device.XXXXXX)
summary=${OUT:-$out}/summary.txt	# written as it goes: a timed-out run still returns it
status=0
echo "# run.sh $* ($(date -u +%FT%TZ))" >>"$summary"	# appends: several runs in one call

say() { echo "$*" | tee -a "$summary"; }

# run NAME CMD...: log to $out/NAME.log, one summary line
run() {
	local name=$1 t0=$SECONDS rc
	shift
	"$@" >"$out/$name.log" 2>&1
	rc=$?
	say "$name: exit $rc in $((SECONDS - t0)) s ($(tail -n 1 "$out/$name.log" | cut -c1-160))"
	[ $rc -eq 0 ] || status=1
	return $rc
}

# A benchmark program's path: tests/bench/ of the build, or tests/ (a build carried
# flat); nothing when it was not built.
bench_bin() {
	local p
	for p in "$B/tests/bench/$1" "$B/tests/$1"; do
		[ -x "$p" ] && { echo "$p"; return; }
	done
}

gpu_tests() {
	for t in ${GPU_TESTS:-test_cuda_smoke test_cuda_linear test_cuda_attn_gqa test_cuda_attn_qkv \
		test_cuda_attn_mla test_cuda_merge test_cuda_ops test_cuda_moe test_cuda_sample test_cuda_pdl \
		test_cuda_capture test_cuda_moe_lat test_cuda_moe_q test_cuda_linear_q test_cuda_allreduce test_cuda_topk_slice}; do
		[ -x "$B/tests/$t" ] && echo "$t"
	done
}

phase_check() {
	nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader |
		tee -a "$summary"
	for t in $(gpu_tests); do	# TEST_TIMEOUT: seconds per test (a hang costs no more)
		run "$t" timeout "${TEST_TIMEOUT:-300}" "$B/tests/$t"
	done
	run golden_cuda env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	for m in llama3 qwen3 qwen3_moe deepseek_v2 deepseek_v3; do
		for be in cpu cuda; do
			"$B/kdbench" generate --model tests/data/golden/$m --backend $be --log-level warn \
				--prompt 113,124,11,408,469 --max-tokens 32 >"$out/gen_${m}_$be.txt" 2>"$out/gen_${m}_$be.log" ||
				say "generate $m $be: exit $? ($(tail -n 1 "$out/gen_${m}_$be.log"))"
		done
		if [ ! -s "$out/gen_${m}_cuda.txt" ]; then
			say "generate $m: no output"
			status=1
		elif cmp -s "$out/gen_${m}_cpu.txt" "$out/gen_${m}_cuda.txt"; then
			say "generate $m: cuda == cpu (32 tokens)"
		else
			say "generate $m: cuda differs from cpu: $(cat "$out/gen_${m}_cuda.txt") vs $(cat "$out/gen_${m}_cpu.txt")"
		fi
	done
}

# kdecd --backend cuda serving kdrun: greedy equal to kdbench generate on the GPU, a
# request sampled on the host (penalties, logprobs) beside GPU-sampled ones, and
# speculative decoding equal to plain greedy
phase_serve() {
	local m=tests/data/golden/llama3 sock=$out/kdecd.sock p=113,124,11,408,469,113,124,11,408
	"$B/kdbench" generate --model $m --backend cuda --log-level warn --prompt $p --max-tokens 32 \
		>"$out/serve_ref.txt" 2>"$out/serve_ref.log"
	"$B/kdbench" generate --model $m --backend cuda --log-level warn --prompt $p --max-tokens 32 \
		--spec ngram:k=4 >"$out/serve_spec.txt" 2>"$out/serve_spec.log"
	if [ -s "$out/serve_ref.txt" ] && cmp -s "$out/serve_ref.txt" "$out/serve_spec.txt"; then say "serve: generate --spec == plain on cuda ($(grep -o 'mean acceptance[^,]*' "$out/serve_spec.log"))"
	else say "serve: generate --spec differs on cuda"; status=1; fi
	"$B/kdecd" --model $m --backend cuda --socket "$sock" --log-level warn >"$out/kdecd.log" 2>&1 &
	local pid=$!
	for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.2; done
	"$B/kdrun" --socket "$sock" --prompt $p --max-tokens 32 >"$out/serve_greedy.txt" 2>"$out/serve_greedy.log"
	"$B/kdrun" --socket "$sock" --prompt $p --max-tokens 32 --temperature 0.8 --top-k 20 --seed 7 \
		--repetition-penalty 1.3 --logprobs 1 >"$out/serve_pen.txt" 2>"$out/serve_pen.log" &
	"$B/kdrun" --socket "$sock" --prompt $p --max-tokens 32 --temperature 0.8 --top-p 0.9 --seed 7 \
		>"$out/serve_samp.txt" 2>"$out/serve_samp.log"
	wait %2 2>/dev/null
	kill -TERM $pid; wait $pid; local rc=$?
	if [ -s "$out/serve_greedy.txt" ] && cmp -s <(tr -s ' \n' ' ' <"$out/serve_ref.txt" | sed 's/ *$//') <(tr -s ' \n' ' ' <"$out/serve_greedy.txt" | sed 's/ *$//'); then
		say "serve: kdecd --backend cuda greedy == kdbench generate (32 tokens)"
	else say "serve: kdrun greedy '$(cat "$out/serve_greedy.txt")' vs generate '$(cat "$out/serve_ref.txt")'"; status=1; fi
	say "serve: penalties+logprobs $(wc -w <"$out/serve_pen.txt") tokens, $(grep -c '^logprob' "$out/serve_pen.log") logprob lines; top-p $(wc -w <"$out/serve_samp.txt") tokens; kdecd exit $rc"
	[ "$(wc -w <"$out/serve_pen.txt")" -eq 32 ] && [ "$(wc -w <"$out/serve_samp.txt")" -eq 32 ] && [ $rc -eq 0 ] || status=1
}

# cpu vs cuda logits of the reference models with 1..all layers: where they part
phase_compare() {
	local toks=113,124,11,48,169,17,29,5,71,3,99,42,8,61,7,150,31,2,90,13
	for d in ${COMPARE_MODELS:-tests/data/reference/*/ tests/data/golden/*/}; do
		local m=$(basename "$d") n
		n=$(python3 -c "import json; print(json.load(open('$d/config.json'))['num_hidden_layers'])")
		for l in $(seq 1 "$n"); do
			for be in cpu cuda; do
				"$B/kdbench" logits --model "$d" --backend $be --layers $l --tokens $toks \
					--out "$out/cmp_$be.f32" --log-level warn 2>>"$out/compare.log"
			done
			python3 - "$out/cmp_cpu.f32" "$out/cmp_cuda.f32" "$m layers=$l" <<'PY' | tee -a "$summary"
import sys, numpy as np
a = np.fromfile(sys.argv[1], np.float32).reshape(20, -1); b = np.fromfile(sys.argv[2], np.float32).reshape(20, -1)
e = np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)
print(f"compare {sys.argv[3]:28s} rel L2 per row: max {e.max():.2e} median {np.median(e):.2e}")
PY
		done
	done
}

# where the time of a decode step goes, per kernel (nsys, when the machine has it)
phase_profile() {
	local nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
	if [ -z "$nsys" ]; then
		say "profile: no nsys on this machine"
		return
	fi
	for b in 1 64; do
		"$nsys" profile -o "$out/prof_b$b" --force-overwrite true "$B/kdbench" decode \
			--model tests/data/configs/llama3.1-8b.json --synthetic-weights --backend cuda \
			--batch $b --ctx 1024 --steps 20 --warmup 4 --log-level warn >"$out/prof_b$b.log" 2>&1
		"$nsys" stats --report cuda_gpu_kern_sum --format csv "$out/prof_b$b.nsys-rep" \
			>"$out/prof_b$b.csv" 2>/dev/null
		say "profile batch $b (top kernels: total ns, instances, avg ns, name)"
		python3 - "$out/prof_b$b.csv" <<'PY' | tee -a "$summary"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0].replace('.', '').isdigit()]
for r in rows[:14]:
    print(f"  {r[0]:>5}% {int(float(r[1])):>12} {r[2]:>7} {int(float(r[3])):>9}  {r[-1][:90]}")
PY
	done
}

# per-op GPU time of decode steps, op by op (KDEC_CUDA_OP_TIMES=1, no graphs)
phase_optimes() {
	for cfg in llama3.1-8b deepseek-v2-lite; do
		for b in 1 64; do
			KDEC_CUDA_OP_TIMES=1 "$B/kdbench" decode --model tests/data/configs/$cfg.json \
				--synthetic-weights --backend cuda --no-graphs --batch $b --ctx 1024 --steps 16 \
				--warmup 2 --log-level warn >"$out/optimes_${cfg}_b$b.log" 2>&1
			say "op times $cfg batch $b:"
			grep -A40 "cuda op times" "$out/optimes_${cfg}_b$b.log" | tee -a "$summary"
		done
	done
}

# one decode step's kernels, each timed by ncu at the clocks the GPU runs (never locked)
# (for ncu's per-line source counters, build with `../configure NVCC_EXTRA=-lineinfo`;
# contrib/device/ncu_stalls.py reads them: where each kernel's warps stall, line by line)
# and with warm caches (kernels serialised: the sum is above the
# graph's step time; what it shows is where each kernel stands against its bytes)
phase_ncu() {
	local ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
	[ -n "$ncu" ] || { say "ncu: not on this machine"; return; }
	for cfg in ${NCU_CONFIGS:-llama3.1-8b deepseek-v2-lite}; do
		for b in ${NCU_BATCHES:-1 64}; do
			"$ncu" --profile-from-start off --clock-control none --cache-control none \
				--metrics gpu__time_duration.sum \
				--csv --print-units base "$B/kdbench" decode --model tests/data/configs/$cfg.json \
				--synthetic-weights --backend cuda --batch $b --ctx 1024 --steps 2 --warmup 1 --profile-step \
				--log-level warn >"$out/ncu_${cfg}_b$b.csv" 2>"$out/ncu_${cfg}_b$b.log"
			say "ncu $cfg batch $b (one step; us per kernel name, calls, share):"
			python3 contrib/device/ncu_summary.py "$out/ncu_${cfg}_b$b.csv" | tee -a "$summary"
		done
	done
}

# SAN_TESTS (default: the GPU tests), SAN_TOOLS (default: memcheck racecheck) and
# SAN_TIMEOUT (seconds per test and tool, default 240: a run cut off says so, exit 124).
# The tests see the environment: KD_TEST_QUICK=1 (test_cuda_attn_*'s small cases;
# test_cuda_linear's own kernels at M <= 64, without cuBLAS; test_cuda_sample at vocab
# 32768) and KD_TEST_PART (test_cuda_moe: route or experts; test_cuda_linear: small or
# big) fit a tool's slower run into the cap.
phase_sanitize() {
	local cs=/usr/local/cuda/bin/compute-sanitizer tool
	for t in ${SAN_TESTS:-$(gpu_tests)}; do
		for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
			local name=${tool}_$t${KD_TEST_PART:+_$KD_TEST_PART}
			# stdbuf (inherited by the test): a run cut by the timeout still shows
			# how far it got
			run "$name" timeout "${SAN_TIMEOUT:-240}" stdbuf -oL -eL "$cs" --tool "$tool" \
				--error-exitcode 9 "$B/tests/$t"
			# what it reported up to its end or its cut, and the test's own verdicts
			say "  $name: $(grep -cE '^========= +(Error|Warning|Invalid|Race|Program hit)' \
				"$out/$name.log") sanitizer reports, $(grep -c 'PASS' "$out/$name.log") PASS" \
				"and $(grep -cE 'FAIL' "$out/$name.log") FAIL lines"
		done
	done
}

# The decode runs log the cuBLASLt tuner's picks (KDEC_LT_LOG) into their logs, not the
# summary: a run that lands on an unusual plan (the launches column) shows there which
# shape it tuned otherwise, and by what margin.
phase_bench() {
	local lin=$(bench_bin bench_cuda_linear)
	[ -n "$lin" ] && run bench_linear timeout 300 "$lin"
	run decode_llama8b env KDEC_LT_LOG=1 "$B/kdbench" decode --model tests/data/configs/llama3.1-8b.json \
		--synthetic-weights --backend cuda --batch 1,8,32,64 --ctx 1024 --steps 64 --warmup 8 \
		--out "$out/decode.jsonl"
	run decode_v2lite env KDEC_LT_LOG=1 "$B/kdbench" decode --model tests/data/configs/deepseek-v2-lite.json \
		--synthetic-weights --backend cuda --batch 1,8,32,64 --ctx 1024 --steps 64 --warmup 8 \
		--out "$out/decode.jsonl"
	[ -n "${OUT:-}" ] && cp "$out/decode.jsonl" "$OUT/"
	grep -hv ' info \| warn \|^cublasLt: ' "$out/decode_llama8b.log" "$out/decode_v2lite.log" |
		tee -a "$summary"
}

# The kernel benchmarks (tests/bench: attention, MoE, sampling, small ops, linear), each
# figure beside its HBM floor; KBENCHES (default: all of them) picks some.
phase_kbench() {
	local b p
	for b in ${KBENCHES:-bench_cuda_attn bench_cuda_moe bench_cuda_sample bench_cuda_ops \
		bench_cuda_linear}; do
		p=$(bench_bin "$b")
		if [ -z "$p" ]; then
			say "$b: not in $B/tests/bench"
			continue
		fi
		run "${b#bench_cuda_}_bench" timeout "${TEST_TIMEOUT:-300}" "$p"
		grep -v '^device 0' "$out/${b#bench_cuda_}_bench.log" | tee -a "$summary"
	done
}

# A/B of decode knobs: AB_ENVS="KDEC_ATTN_MMA=0;KDEC_ATTN_MMA=1" (";" between runs,
# " " between variables of one run), each on AB_MODELS at AB_BATCHES, a short run each
phase_ab() {
	local IFS_SAVE=$IFS envs cfg i=0
	IFS=';' read -ra envs <<<"${AB_ENVS:-KDEC_ATTN_MMA=0;KDEC_ATTN_MMA=1}"
	IFS=$IFS_SAVE
	for e in "${envs[@]}"; do
		for cfg in ${AB_MODELS:-llama3.1-8b deepseek-v2-lite}; do
			i=$((i + 1))
			env $e "$B/kdbench" decode --model tests/data/configs/$cfg.json --synthetic-weights \
				--backend cuda --batch ${AB_BATCHES:-1,64} --ctx 1024 --steps ${AB_STEPS:-32} \
				--warmup 4 --log-level warn >"$out/ab_$i.log" 2>&1
			say "ab [$e] $cfg: exit $?"
			grep -v ' info \| warn ' "$out/ab_$i.log" | tee -a "$summary"
		done
	done
}

# A/B of two builds: AB_BASE=DIR holding another build's kdbench (say the commit before
# a refactor) against $B's, alternating AB_ROUNDS times, each on AB_MODELS at AB_BATCHES,
# so that drift of the machine falls on both alike
phase_abbuild() {
	local r bin cfg i=0
	[ -x "${AB_BASE:-}/kdbench" ] || { say "abbuild: no \$AB_BASE/kdbench (AB_BASE=${AB_BASE:-})"; status=1; return; }
	for r in $(seq "${AB_ROUNDS:-3}"); do
		for bin in "$AB_BASE/kdbench" "$B/kdbench"; do
			for cfg in ${AB_MODELS:-llama3.1-8b deepseek-v2-lite}; do
				i=$((i + 1))
				"$bin" decode --model tests/data/configs/$cfg.json --synthetic-weights \
					--backend cuda --batch ${AB_BATCHES:-1,8,64} --ctx 1024 --steps ${AB_STEPS:-64} \
					--warmup 8 --log-level warn >"$out/abbuild_$i.log" 2>&1
				say "abbuild round $r $bin $cfg: exit $?"
				grep -v ' info \| warn \|^cublasLt: ' "$out/abbuild_$i.log" | tee -a "$summary"
			done
		done
	done
}

# kdbench agent (this build's) against AB_BASE's kdecd and $B's, one after the other, each
# serving AB_AGENT_MODEL with synthetic weights on the GPU, at AB_SESSIONS sessions
phase_abagent() {
	local d sock pid n i=0 cfg=tests/data/configs/${AB_AGENT_MODEL:-llama3.1-8b}.json
	[ -x "${AB_BASE:-}/kdecd" ] || { say "abagent: no \$AB_BASE/kdecd (AB_BASE=${AB_BASE:-})"; status=1; return; }
	for d in "$AB_BASE" "$B"; do
		sock=$out/agent$i.sock
		"$d/kdecd" --model "$cfg" --synthetic-weights --backend cuda --kv-tokens 300000 \
			--socket "$sock" --log-level warn >"$out/abagent_kdecd$i.log" 2>&1 &
		pid=$!
		until "$B/kdctl" --socket "$sock" status >/dev/null 2>&1; do
			kill -0 $pid 2>/dev/null || break
			sleep 0.2
		done
		for n in ${AB_SESSIONS:-1 16}; do
			"$B/kdbench" agent --socket "$sock" --sessions $n --duration ${AB_AGENT_S:-20} \
				--first-prompt 2048 --turn-tokens 256 --output-tokens 128 --think-ms 300 \
				--vocab 32000 --max-context 16384 >"$out/abagent_${i}_$n.log" 2>&1
			say "abagent $d/kdecd, $n sessions: exit $?"
			grep -iE 'interactivity|time to first|inter-token|throughput|hit rate' \
				"$out/abagent_${i}_$n.log" | tee -a "$summary"
		done
		"$B/kdctl" --socket "$sock" shutdown >/dev/null 2>&1
		wait $pid
		say "abagent $d/kdecd: exit $?"
		i=$((i + 1))
	done
}

# prefill: kdbench prefill (chunks of 256, the daemon's default, and of 1024) beside eager
# PyTorch SDPA and the cuBLAS roof, then one 1024-token prefill's per-op times
# (KDEC_CUDA_OP_TIMES=2). PREFILL_TOKENS, PREFILL_MODEL (a config name).
phase_prefill() {
	local cfg=tests/data/configs/${PREFILL_MODEL:-llama3.1-8b}.json toks=${PREFILL_TOKENS:-1024,4096,16384,32768}
	local roof
	python3 contrib/bench/torch_prefill.py --config "$cfg" --tokens "$toks" --roof \
		--json "$out/prefill.jsonl" >"$out/prefill_torch.log" 2>&1
	say "prefill torch: exit $?"
	tee -a "$summary" <"$out/prefill_torch.log"
	roof=$(sed -n 's/^# roof: 8192^3 bf16 matmul \([0-9]*\) TFLOPS.*/\1/p' "$out/prefill_torch.log")
	for chunk in ${PREFILL_CHUNKS:-256 1024}; do
		run prefill_kdec_$chunk "$B/kdbench" prefill --model "$cfg" --synthetic-weights --backend cuda \
			--tokens "$toks" --chunk $chunk ${roof:+--tc-tflops $roof} --log-level warn \
			--out "$out/prefill.jsonl"
		tee -a "$summary" <"$out/prefill_kdec_$chunk.log"
	done
	KDEC_CUDA_OP_TIMES=2 "$B/kdbench" prefill --model "$cfg" --synthetic-weights --backend cuda \
		--tokens 1024 --reps 1 --log-level warn >"$out/prefill_optimes.log" 2>&1
	sed -n "/cuda op times/,\$p" "$out/prefill_optimes.log" | tee -a "$summary"
}

# agent: contrib/bench/agent_serving.sh (1, 4, 16, 64 sessions, kdbench decode beside)
phase_agent() {
	run agent bash contrib/bench/agent_serving.sh "$B" "$out/agent" \
		"tests/data/configs/${AGENT_MODEL:-llama3.1-8b}.json"
	cat "$out/agent/agent_table.md" >>"$summary"
	# the GPU machine has no gnuplot: the .png.dat and .png.gp come back to be drawn here
	mkdir -p "${OUT:-$out}/agent" && cp "$out"/agent/*.png* "$out"/agent/agent_table.md "${OUT:-$out}/agent/" 2>/dev/null
}

phase_peers() {
	run peers bash contrib/bench/run_peers.sh
	grep -E '^(peer|hf|torch)' "$out/peers.log" | tee -a "$summary"
}

[ $# -gt 0 ] || set -- check
for p in "$@"; do
	"phase_$p"
done
# RUN_LOGS_DIR: where logs.tgz goes instead of $OUT (runs side by side, one folder each)
logs_dir=${RUN_LOGS_DIR:-${OUT:-}}
if [ -n "$logs_dir" ]; then
	logs=$logs_dir/logs.tgz n=1
	while [ -e "$logs" ]; do n=$((n + 1)); logs=$logs_dir/logs$n.tgz; done
	tar czf "$logs" -C "$out" .
fi
exit $status
