#!/bin/bash
# Session 25's device calls: where issue 23's and 24's targets stand on the GPU lent,
# every row of their target tables from one build, the peer beside the dense rows:
#   ST_PART=check  test_golden on cuda
#   ST_PART=dpath  tests/test_cuda_decode_path.sh (both paths and auto give the golden
#                  models' greedy tokens; auto's timing changed)
#   ST_PART=dense  kdbench decode at batch 1,8,64: Llama-3.1-8B bf16, fp8-block,
#                  int4-g32, Qwen3-8B bf16
#   ST_PART=peer   the torch.compile decoder (contrib/bench/run_peers.sh, its
#                  torch-compile part) at batch 1 and 64, Llama-3.1-8B's shape
#   ST_PART=moe    Qwen3-30B-A3B and DeepSeek-V2-Lite in bf16, fp8-block and int4-g32:
#                  batch 1,8 on each decode path (--decode-path standard,latency),
#                  batch 64 on auto
#   ST_PART=slice  the Kimi-K2 (2 layers) and DeepSeek-V3 (4 layers) slices, bf16,
#                  fp8-block, int4-g32, batch 1,8 (layer_us and lay_fl% are the MoE layer's)
#                  (moe and slice: ST_FORMATS="int4-g32" takes fewer formats; session 28
#                  fixed the synthetic int4 weights, whose MoE rows above batch 1 must be
#                  measured again)
#   ST_PART=ring   the ring kind's streaming form on bf16 (KDEC_LINEAR_RING_STREAM):
#                  test_cuda_linear, test_cuda_golden_ring.sh, bench_cuda_linear --quick
#   ST_PART=ringab kdbench decode, bf16 Llama-3.1-8B batch 1,8 and Qwen3-8B batch 1: the
#                  defaults (cuBLAS) against the ring at 8 rows on each of its kernels
#                  (KDEC_LINEAR_RING_STREAM 0, 1, 2); ST_RB: model:batches list
#   ST_PART=ringmin the least of both: test_cuda_golden_ring.sh, the benchmark, Llama
#                  batch 1 (for a call with little device time left)
#   ST_PART=goldring tests/test_cuda_golden_ring.sh alone
#   ST_PART=ringwhy test_golden with each form of test_cuda_golden_ring.sh alone (the ring's
#                  decode GEMV, the norm fold, the ring's streaming form): which one
#                  puts session 26's MLA reference rows over the tolerance
#   ST_PART=ringmoe the ring kind on the MoE models' small bf16 matrices (KDEC_LINEAR_SMALL_MB=0:
#                  q/kv, o_proj, the shared experts: bench_cuda_linear's ring qs beat the
#                  GEMV by 25% on V2-Lite's q/kv in session 26), batch 1,8, each kernel
#   ST_PART=ringtune KDEC_LINEAR_RING_TUNE=1 (each bf16 linear of <= 8 rows timed on the ring
#                  kind and on the plain choice, the faster kept): test_cuda_linear's
#                  big part (test_ring_tune), test_golden with it on, then DeepSeek-V2-Lite, Qwen3-30B-A3B and
#                  Llama-3.1-8B bf16 batch 1,8: defaults, tuned (KDEC_LT_LOG=1: what each
#                  shape kept), tuned with the streaming form everywhere (_STREAM=2)
#   ST_PART=tuneon KDEC_LINEAR_RING_TUNE on by default (session 29, the reference now
#                  follows its choices): test_golden on cuda, test_cuda_decode_path.sh, the
#                  golden models' greedy tokens cuda == cpu, test_cuda_linear's ring tune
#                  part (k_cuda_linear_rounds_x), test_cuda_golden_ring.sh; then Qwen3-30B-A3B
#                  and Llama-3.1-8B bf16 batch 1 with it off beside the default
#   ST_PART=tunecheck tuneon's checks alone (no decode rows)
#   ST_PART=experts the routed experts a traced step reads at full depth (kdbench's
#                  experts column beside uni): Qwen3-30B-A3B bf16 1,8,64, fp8-block 8,
#                  DeepSeek-V2-Lite bf16 8, the Kimi-K2 slice fp8-block 8
#   ST_PART=ncumoe where the union GEMVs' warps stall at 8 rows, where int4 runs no faster
#                  than fp8 (session 29: Qwen3-30B-A3B 171 against 175 us alone): ncu --set
#                  full on bench_cuda_moe q qwen3-30b 8 (each format; their first 8 mg_
#                  launches), the key rates of each kernel and ncu_stalls.py's table; and
#                  the union GEMVs alone at M 1, 2, 4, 8 (pack bench_cuda_moe too)
#   ST_PART=abq    session 29's union bitmap and deferred scale conversion against the
#                  build before them (devbuild-old.tar.xz: its kdbench alone, carried
#                  beside the pack): test_cuda_moe_q and test_cuda_linear_q (quick),
#                  test_golden on cuda, bench_cuda_moe q qwen3-30b at 1 and 8 rows, then
#                  decode old / new / old / new on the MoE int4 and fp8 rows (AB_ROWS:
#                  "model batches format;..." instead)
#   ST_PART=qsplit the union gate/up's K slices forced (KDEC_MOE_QGEMV_SPLIT 2, 4 against
#                  the plan's, which takes 1 at 8 rows: x's 33 KB slice then holds a
#                  multiprocessor to 2 CTAs, ncu's 12.5% occupancy): Qwen3-30B-A3B int4 and
#                  fp8 batch 8, DeepSeek-V2-Lite int4 batch 8 (QS_ROWS "model format;...",
#                  QS_SPLITS instead)
#   ST_PART=int4t  int4 experts past KDEC_MOE_QGEMV_INT4_ROWS on the tile kernels (session
#                  30: at 8 rows bench_cuda_moe timed them 114 us against the union GEMVs'
#                  152): test_cuda_moe_q quick, test_golden on cuda with it 0,
#                  bench_cuda_moe q at 2 and 4 rows (qwen3-30b) and 8 (v2-lite, kimi-k2),
#                  then decode, two rounds of 8 / 2 on I4_ROWS ("model batches;...", int4)
#   ST_PART=i4check the int4 tile default (KDEC_MOE_QGEMV_INT4_ROWS 2, session 31) checked:
#                  test_cuda_moe_q quick (the union GEMVs' int4 cases now at
#                  KDEC_MOE_QGEMV_INT4_ROWS 8), test_golden on cuda
#   ST_PART=i4table the MoE models' int4 rows on it at batch 1, 8 and 64 (I4_TABLE
#                  "model batches;..." instead)
#   ST_PART=i4agent kdbench agent on Qwen3-30B-A3B int4-g32 (contrib/bench/agent_serving.sh,
#                  sessions AGENT_SESSIONS "8 16", AGENT_S 30): KDEC_MOE_QGEMV_INT4_ROWS 8
#                  (the union GEMVs to 8 rows, before session 31) against the default
#   ST_PART=f8t    fp8 experts past KDEC_MOE_QGEMV_FP8_ROWS on the tile kernels too (int4's
#                  switch, session 31): test_cuda_moe_q quick, test_golden on cuda with it 0,
#                  bench_cuda_moe q fp8-block at 4 and 8 rows (every model's experts), then
#                  decode, two rounds of 8 / 2 on F8_ROWS ("model batches;...", fp8-block)
#   ST_PART=f8check the fp8 default that f8t chose (7168-wide experts on the tile kernels
#                  from 3 rows): test_cuda_moe_q quick, test_golden on cuda, fp8-block decode
#                  of the slices at batch 1,8 and Qwen3-30B-A3B at 8, the Kimi-K2 slice with
#                  KDEC_MOE_QGEMV_FP8_ROWS=8 beside it
#   ST_PART=mprefill MoE prefill (session 31: kdbench decode's prefill_s put 8 x 1024 tokens of
#                  Qwen3-30B-A3B at 0.78 s bf16, 1.01 fp8, 1.14 int4 against Llama-3.1-8B's
#                  0.22, and TTFT p50 ~700 ms under 16 agents on its int4): bench_cuda_moe q
#                  at 64 and 256 rows in int4, fp8 and bf16 (expert_mma_kernel's "grouped"
#                  line beside the tile kernels'), kdbench prefill of 256 and 2048 tokens:
#                  Llama-3.1-8B and Qwen3-30B-A3B bf16 (and its experts on the tile kernels
#                  at every M), Qwen3-30B-A3B int4 and fp8 with KDEC_MOE_QTILE_ROWS 64 (the
#                  default) and 4096, then KDEC_CUDA_OP_TIMES=2
#                  (each op of the chunks timed) on Qwen3-30B-A3B bf16 and int4
#   ST_PART=mwide  the tile kernels' wide passes (64 expert rows, int4 32; session 32) at
#                  prefill: test_cuda_moe_q quick and test_cuda_moe's experts (both run
#                  them, " qtile-wide"), test_golden on cuda with every MoE call on them
#                  (KDEC_MOE_QTILE_ROWS 4096, _BF16 1, _WIDE 1), bench_cuda_moe q at a
#                  prefill chunk (Qwen3-30B-A3B and V2-Lite 2048 rows,
#                  DeepSeek-V3 512: expert_mma_kernel's "grouped" line beside "qtile" and
#                  "qtile-wide"), then mpf's prefill of Llama-3.1-8B bf16 and Qwen3-30B-A3B
#                  in each format by default, on the tiles (QTILE_ROWS 4096) narrow, wide
#   ST_PART=mwmin  mwide's least (for a call with ~2 minutes): test_cuda_moe_q quick,
#                  test_cuda_moe's experts, bench_cuda_moe q qwen3-30b 2048 each format
#   ST_PART=mfill  session 32's question (the bf16 experts alone 1.66x faster on the wide
#                  passes, its prefill 6% slower; int4/fp8 gained half the predicted): the
#                  experts alone at 2048 rows on random values (bench_cuda_moe's default
#                  since session 33) and on the old byte pattern (BENCH_MOE_FILL=const),
#                  each format, then each op of a Qwen3-30B-A3B prefill chunk timed
#                  (KDEC_CUDA_OP_TIMES=2), bf16 and int4 by default and on the wide passes;
#                  then the rows between decode and the wide passes' 256 (96, 128, 192:
#                  expert_mma_kernel's "grouped" line beside "qtile" and "qtile-wide")
#   ST_PART=msplit the tile kernels' passes of an expert spread over several CTAs (session
#                  33: a synthetic prefill chunk routes most rows to a few experts, whose
#                  12 gate/up CTAs then ran ~30 passes each one after the other): mwmin
#                  (its tests now run " qtile-split" cases too), the experts alone at
#                  2048 rows with one hot expert (BENCH_MOE_HOT=1), KDEC_MOE_QTILE_SPLIT 1
#                  (the default) against 0 (by the rows), each format; then kdbench
#                  prefill of Qwen3-30B-A3B int4, fp8 and bf16 (on the wide tiles) the
#                  same two ways, and bf16 by default (expert_mma_kernel); then fp8 decode
#                  at batch 64 with KDEC_MOE_QTILE_SPLIT 1 and 4 (a pass of 16 rows a CTA)
#   ST_PART=splitdef the tile kernels' CTAs by the rows and bf16 prefill chunks on them by
#                  default (session 34; after check): test_cuda_moe_q quick,
#                  test_cuda_moe's experts; then kdbench prefill (256 and 2048 tokens)
#                  of Qwen3-30B-A3B in each format and DeepSeek-V2-Lite fp8 and bf16,
#                  the default beside the one before (KDEC_MOE_QTILE_SPLIT 1, bf16 on
#                  expert_mma_kernel), and decode of Qwen3-30B-A3B fp8 at batch 32, 64
#                  and int4 at 64 the same two ways (SD_PF "MODEL:FORMAT[:old] ...": those
#                  prefill rows, :old with the one before, and fp8's decode rows alone)
#   ST_PART=p128   kdbench prefill of 128 tokens, Qwen3-30B-A3B int4 and fp8: the default
#                  (every call on the tile kernels) against KDEC_MOE_QTILE_ROWS=64
#   ST_PART=unseen test_golden on cuda over the checkpoints of another seed and dims
#                  (UNSEEN: a .tar.xz of folders in tests/data/golden's format, e.g. the
#                  quantized ones of contrib/make_quant_reference.py --seed S --widen W and
#                  the bf16 ones of contrib/make_reference.py; carried beside the pack),
#                  those alone (KDEC_GOLDEN_ONLY=none), their failures into the summary
#   ST_PART=unseenq unseen, then again with KDEC_MOE_QGEMV_ROWS=0 (the quantized experts
#                  of <= 8 rows on the small path's kernels, not the f16 union GEMVs)
#   ST_PART=relay  each relay of KDEC_PDL_RELAY alone (ST_MASKS, default "0 1 2 4 8"):
#                  Llama-3.1-8B fp8-block batch 1,8, Qwen3-30B-A3B fp8-block batch 1
#   ST_PART=merge  the split merge's batched warp kernel (KDEC_ATTN_MERGE=1) against the
#                  block kernel, two rounds: Llama-3.1-8B fp8-block batch 1,8,64 and
#                  Qwen3-30B-A3B fp8-block batch 1 (its last measurement, one run each,
#                  was at 19a2906: 2% slower at batch 1, before the chain's early loads)
#   ST_PART=removed the GPU tests of the kernels session 35 took lost variants out of
#                  (no GPU then): test_cuda_attn_gqa, _attn_qkv, _attn_mla, _merge, _mla_cp,
#                  _moe_lat, _pdl, and test_cuda_moe's experts part (the M = 1 gate/up),
#                  quick (KD_TEST_QUICK=1); pack them (PACK_TESTS)
# ST_PART may name several, run in that order.
# here: PACK_XZ=0 PACK_TESTS="test_golden test_cuda_linear" contrib/device/pack.sh build devbuild-s28
#       tar -cf - devbuild-s28 | xz -6 -T2 > devbuild-s28.tar.xz
# device run: DEVBUILD=devbuild-s28 ST_PART="moe slice ringtune" bash contrib/device/state.sh
#             carry ["devbuild-s28.tar.xz"]
# session 29: ST_PART="tuneon experts" (a pack with KDEC_LINEAR_RING_TUNE on by default),
#             then ST_PART="tunecheck ncumoe" (PACK_TESTS with bench_cuda_moe), then
#             ST_PART=abq (PACK_TESTS="test_golden test_cuda_moe_q test_cuda_linear_q",
#             kdecd/kdctl/kdrun taken out; devbuild-old.tar.xz: the previous pack's
#             kdbench; carry both: 64 MiB with the tree, no room for bench_cuda_moe)
set -u
DEADLINE=${DEADLINE:-560}
. contrib/device/lib.sh
use "${DEVBUILD:-devbuild-st2}"
gpu_line
DEC_STEPS=32 DEC_WARMUP=8	# lib.sh's dec

# decp NAME MODEL BATCHES FORMAT PATHS: dec on the decode paths PATHS (kdbench's list)
decp() {
	local n=$1 m=$2 b=$3 f=$4 p=$5
	KDBENCH=$PWD/$B/kdbench-paths dec "$n" "$m" "$b" "$f" KDBENCH_PATHS="$p"
}

check() {
	step golden 100 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep '^FAIL' "$L/golden.log" | cut -c1-200 | tee -a "$S"
}

removed() {
	local t
	for t in test_cuda_attn_gqa test_cuda_attn_qkv test_cuda_attn_mla test_cuda_merge \
		test_cuda_mla_cp test_cuda_moe_lat test_cuda_pdl; do
		step "$t" 90 env KD_TEST_QUICK=1 "$B/tests/$t"
		grep -E '^FAIL|FAIL$' "$L/$t.log" | head -5 | cut -c1-200 | tee -a "$S"
	done
	step moe_experts 120 env KD_TEST_QUICK=1 KD_TEST_PART=experts "$B/tests/test_cuda_moe"
	grep -E '^FAIL|FAIL$' "$L/moe_experts.log" | head -5 | cut -c1-200 | tee -a "$S"
}

dpath() {
	step decode_path 150 sh tests/test_cuda_decode_path.sh
}

ring() {
	step linear 180 env KD_TEST_QUICK=1 "$B/tests/test_cuda_linear"
	grep -E "ring_stream=|ring folds" "$L/linear.log" | grep -c PASS | sed 's/^/ring cases passed: /' |
		tee -a "$S"
	step golden_ring 120 sh tests/test_cuda_golden_ring.sh
	step bench_linear 100 "$B/tests/bench/bench_cuda_linear" --quick
	cat "$L/bench_linear.log" >>"$S"
}

# the least of ring and ringab that says whether the streaming form is correct and
# faster: the golden models on both ring kernels, the kernel benchmark, Llama batch 1
ringmin() {
	step golden_ring 60 sh tests/test_cuda_golden_ring.sh
	step bench_linear 80 "$B/tests/bench/bench_cuda_linear" --quick
	cat "$L/bench_linear.log" >>"$S"
	ST_RB=llama3.1-8b:1 ringab
}

# the golden models on both ring kernels alone (session 26's x_bf16 fix, not yet on a GPU)
goldring() {
	step golden_ring 60 sh tests/test_cuda_golden_ring.sh
	grep '^FAIL' "$L/golden_ring.log" | cut -c1-200 | tee -a "$S"
}

ringwhy() {
	local v
	for v in KDEC_LINEAR_RING=8 KDEC_NORM_IN_GEMV=1 "KDEC_LINEAR_RING=8 KDEC_LINEAR_RING_STREAM=2"; do
		step "golden_${v// /_}" 40 env KDEC_TEST_BACKEND=cuda KDEC_LINEAR_SMALL_MB=0 $v \
			"$B/tests/test_golden"
		grep '^FAIL' "$L/golden_${v// /_}.log" | cut -c1-200 | tee -a "$S"
	done
}

ringmoe() {
	local m v
	for m in deepseek-v2-lite qwen3-30b-a3b; do
		dec "rm_${m}_default" "$m" 1,8 bf16
		for v in 0 2; do
			dec "rm_${m}_ring$v" "$m" 1,8 bf16 KDEC_LINEAR_RING=8 KDEC_LINEAR_SMALL_MB=0 \
				KDEC_LINEAR_RING_STREAM=$v
		done
	done
}

ringtune() {
	local m
	step linear_tune 120 env KD_TEST_QUICK=1 KD_TEST_PART=big "$B/tests/test_cuda_linear"
	grep -E '^ring tune' "$L/linear_tune.log" | tee -a "$S"
	# the golden models with the choice on: where the ring is kept at 1-2 rows, x is
	# rounded there as test_golden's CPU model does not expect (stop26: make it follow)
	step golden_tune 60 env KDEC_TEST_BACKEND=cuda KDEC_LINEAR_RING_TUNE=1 "$B/tests/test_golden"
	grep '^FAIL' "$L/golden_tune.log" | cut -c1-200 | tee -a "$S"
	for m in deepseek-v2-lite qwen3-30b-a3b llama3.1-8b; do
		dec "rt_${m}_default" "$m" 1,8 bf16
		dec "rt_${m}_tune" "$m" 1,8 bf16 KDEC_LINEAR_RING_TUNE=1 KDEC_LT_LOG=1
		grep -E 'kept (ring|gemv|splitk|stream|cublas|generic)$' "$L/rt_${m}_tune.log" |
			sed 's/.*cuda linear: //' | sort | uniq -c | tee -a "$S"
		dec "rt_${m}_tune2" "$m" 1,8 bf16 KDEC_LINEAR_RING_TUNE=1 KDEC_LINEAR_RING_STREAM=2
	done
}

tuneon() {
	local m
	tunecheck
	for m in qwen3-30b-a3b llama3.1-8b; do
		dec "to_${m}_off" "$m" 1 bf16 KDEC_LINEAR_RING_TUNE=0
		dec "to_${m}_on" "$m" 1 bf16
	done
}

tunecheck() {
	local m
	step golden_on 100 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep '^FAIL' "$L/golden_on.log" | cut -c1-200 | tee -a "$S"
	step decode_path_on 150 sh tests/test_cuda_decode_path.sh
	for m in llama3 qwen3 qwen3_moe deepseek_v2 deepseek_v3; do
		step "gen_${m}_cpu" 30 "$B/kdbench" generate --model "$G/$m" --backend cpu \
			--log-level warn --prompt 113,124,11,408,469 --max-tokens 32
		step "gen_${m}_cuda" 30 "$B/kdbench" generate --model "$G/$m" --backend cuda \
			--log-level warn --prompt 113,124,11,408,469 --max-tokens 32
		# the tokens (the first line; the timing lines after it differ)
		[ "$(head -n 1 "$L/gen_${m}_cpu.log")" = "$(head -n 1 "$L/gen_${m}_cuda.log")" ] &&
			say "generate $m: cuda == cpu" || say "generate $m: cuda differs from cpu"
	done
	step linear_tune 120 env KD_TEST_QUICK=1 KD_TEST_PART=big "$B/tests/test_cuda_linear"
	grep -E '^ring tune|rounds_x' "$L/linear_tune.log" | tee -a "$S"
	step golden_ring 60 sh tests/test_cuda_golden_ring.sh
	grep '^FAIL' "$L/golden_ring.log" | cut -c1-200 | tee -a "$S"
}

ncumoe() {
	local f m ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
	local bm=$B/tests/bench/bench_cuda_moe
	[ -n "$ncu" ] || { say "ncu: not on this machine"; return; }
	for f in int4-g32 fp8-block; do
		for m in 1 2 4 8; do
			step "moeq_${f}_$m" 30 "$bm" q qwen3-30b "$m" "$f"
			grep -E 'qgemv' "$L/moeq_${f}_$m.log" | cut -c1-170 | tee -a "$S"
		done
		step "ncu_moe_$f" 150 "$ncu" --set full --clock-control none -k 'regex:mg_' -c 8 -f \
			-o "$L/ncu_moe_$f" "$bm" q qwen3-30b 8 "$f"
		[ -f "$L/ncu_moe_$f.ncu-rep" ] || continue
		"$ncu" -i "$L/ncu_moe_$f.ncu-rep" --page details --csv >"$L/ncu_moe_${f}_details.csv" 2>&1
		python3 - "$L/ncu_moe_${f}_details.csv" <<'PY' | tee -a "$S"
import csv, sys
want = ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Cache Throughput",
        "Compute (SM) Throughput", "Achieved Occupancy", "Theoretical Occupancy",
        "Issue Slots Busy", "Registers Per Thread", "Block Limit Shared Mem",
        "Executed Ipc Active", "Grid Size", "Dynamic Shared Memory Per Block")
seen = {}
for r in csv.DictReader(open(sys.argv[1])):
    k = (r.get("ID"), r.get("Kernel Name", "").split("(")[0])
    if r.get("Metric Name") in want:
        seen.setdefault(k, []).append("%s %s %s" % (r["Metric Name"], r["Metric Value"], r.get("Metric Unit", "")))
for (i, n), v in seen.items():
    print("ncu %s %s: %s" % (i, n, "; ".join(v)))
PY
		"$ncu" -i "$L/ncu_moe_$f.ncu-rep" --page source --csv --print-source sass \
			>"$L/ncu_moe_${f}_sass.csv" 2>&1
		python3 contrib/device/ncu_stalls.py "$L/ncu_moe_${f}_sass.csv" 15 | cut -c1-200 |
			tee -a "$S"
	done
}

abq() {
	local f m r old=devbuild-old
	[ -d $old ] || python3 -c 'import tarfile; tarfile.open("devbuild-old.tar.xz").extractall(".")'
	step moe_q 150 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
	grep '^FAIL' "$L/moe_q.log" | head -5 | cut -c1-200 | tee -a "$S"
	step linear_q 150 env KD_TEST_QUICK=1 "$B/tests/test_cuda_linear_q"
	grep '^FAIL' "$L/linear_q.log" | head -5 | cut -c1-200 | tee -a "$S"
	step golden 100 env KDEC_TEST_BACKEND=cuda "$B/tests/test_golden"
	grep '^FAIL' "$L/golden.log" | cut -c1-200 | tee -a "$S"
	for f in int4-g32 fp8-block; do
		for m in 1 8; do
			[ -x "$B/tests/bench/bench_cuda_moe" ] || continue	# packed where room
			step "moeq_${f}_$m" 30 "$B/tests/bench/bench_cuda_moe" q qwen3-30b "$m" "$f"
			grep -E 'qgemv' "$L/moeq_${f}_$m.log" | cut -c1-170 | tee -a "$S"
		done
	done
	for r in 1 2; do
		each_row "${AB_ROWS:-qwen3-30b-a3b 1,8 int4-g32;qwen3-30b-a3b 1,8 fp8-block;deepseek-v2-lite 8 int4-g32;llama3.1-8b 1 int4-g32;kimi-k2 1,8 int4-g32}" abq_row
	done
}

# abq's old / new pair of one row: MODEL BATCHES FORMAT (abq's r and old)
abq_row() {
	KDBENCH=$PWD/$old/kdbench dec "ab${r}_old_$1_$3" "$1" "$2" "$3"
	dec "ab${r}_new_$1_$3" "$1" "$2" "$3"
}

qsplit() {
	each_row "${QS_ROWS:-qwen3-30b-a3b int4-g32;qwen3-30b-a3b fp8-block;deepseek-v2-lite int4-g32}" \
		qsplit_row
}

# qsplit's splits of one row: MODEL FORMAT
qsplit_row() {
	local v i=0
	for v in ${QS_SPLITS:-0 2 4 0}; do	# the plan's before and after
		i=$((i + 1))
		dec "qs${i}_split${v}_$1_$2" "$1" 8 "$2" KDEC_MOE_QGEMV_SPLIT=$v
	done
}

msplit() {
	local f v
	mwmin
	grep -c 'qtile-split.*PASS' "$L/moe_q.log" "$L/moe.log" | sed 's/^/qtile-split PASS lines: /' |
		tee -a "$S"
	for f in int4-g32 fp8-block bf16; do
		for v in 1 0; do
			qbench "hot_${f}_split$v" qwen3-30b 2048 "$f" BENCH_MOE_HOT=1 \
				KDEC_MOE_QTILE_SPLIT=$v
		done
	done
	for f in int4-g32 fp8-block bf16; do
		for v in 1 0; do
			mpf "pf_qwen3_${f}_split$v" qwen3-30b-a3b "$f" KDEC_MOE_QTILE_SPLIT=$v \
				KDEC_MOE_QTILE_BF16=1
		done
	done
	mpf pf_qwen3_bf16_mma qwen3-30b-a3b bf16	# bf16's default: expert_mma_kernel
	# decode at 64 rows: narrow passes of 16, a hot expert's 4 in one CTA or one each
	for v in 1 4; do
		dec "d64_qwen3_fp8_split$v" qwen3-30b-a3b 64 fp8-block KDEC_MOE_QTILE_SPLIT=$v
	done
}

# prefill chunks of 128 tokens, quantized experts: every call on the tile kernels (the
# default since session 34) against the old 64 rows (65..255 on expert_mma_kernel)
p128() {
	local f
	for f in ${ST_FORMATS:-int4-g32 fp8-block}; do
		MPF_TOKENS=128 mpf "p128_qwen3_${f}_def" qwen3-30b-a3b "$f"
		MPF_TOKENS=128 mpf "p128_qwen3_${f}_rows64" qwen3-30b-a3b "$f" KDEC_MOE_QTILE_ROWS=64
	done
}

splitdef() {
	local m
	mwmin_tests
	# MODEL:FORMAT[:old]: the default, and with :old the one before beside it
	for m in ${SD_PF:-qwen3-30b-a3b:int4-g32:old qwen3-30b-a3b:fp8-block:old \
		qwen3-30b-a3b:bf16:old deepseek-v2-lite:fp8-block:old deepseek-v2-lite:bf16:old}; do
		set -- ${m//:/ }
		mpf "pf_${1}_${2}_def" "$1" "$2"
		[ "${3:-}" = old ] &&
			mpf "pf_${1}_${2}_old" "$1" "$2" KDEC_MOE_QTILE_SPLIT=1 KDEC_MOE_QTILE_BF16=0
	done
	dec d_qwen3_fp8_def qwen3-30b-a3b 32,64 fp8-block
	dec d_qwen3_fp8_old qwen3-30b-a3b 32,64 fp8-block KDEC_MOE_QTILE_SPLIT=1
	[ -n "${SD_PF:-}" ] && return	# a short call: fp8's decode rows alone
	dec d_qwen3_int4_def qwen3-30b-a3b 64 int4-g32
	dec d_qwen3_int4_old qwen3-30b-a3b 64 int4-g32 KDEC_MOE_QTILE_SPLIT=1
}

unseen() {
	unseen_run golden_unseen
}

# unseen, then again with the small path's CUDA-core kernels for the quantized experts
# of <= 8 rows (~1e-5) in place of the union GEMVs (x and activations in f16, ~3e-4):
# whether the union GEMVs' rounding is what puts those rows over the tolerance
unseenq() {
	unseen_run golden_unseen
	unseen_run golden_unseen_small KDEC_MOE_QGEMV_ROWS=0
}

# unseen_run NAME [ENV...]: test_golden on cuda over UNSEEN's checkpoints alone under ENV
# (the archive unpacked once a call: UNSEEN_DIRS, their folders joined by ':')
unseen_run() {
	local n=$1 d
	shift
	if [ -z "${UNSEEN_DIRS:-}" ]; then
		d=$(mktemp -d /tmp/kdec-unseen.XXXXXX)
		python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
			"${UNSEEN:?unseen: UNSEEN=FILE.tar.xz}" "$d" || return
		UNSEEN_DIRS=$(find "$d" -name golden.json -printf '%h:' | sed 's/:$//')
	fi
	step "$n" 200 env KDEC_TEST_BACKEND=cuda KDEC_GOLDEN_ONLY=none \
		KDEC_GOLDEN_EXTRA="$UNSEEN_DIRS" "$@" "$B/tests/test_golden"
	grep '^FAIL' "$L/$n.log" | cut -c1-200 | tee -a "$S"
}

int4t() {
	moecheck golden_i4 KDEC_MOE_QGEMV_INT4_ROWS=0
	qtiles int4-g32 KDEC_MOE_QGEMV_INT4_ROWS "qwen3-30b 2;qwen3-30b 4;v2-lite 8;kimi-k2 8" \
		"${I4_ROWS:-qwen3-30b-a3b 4,8;deepseek-v2-lite 4,8;kimi-k2 8;deepseek-v3 8}"
}

f8t() {
	moecheck golden_f8 KDEC_MOE_QGEMV_FP8_ROWS=0
	qtiles fp8-block KDEC_MOE_QGEMV_FP8_ROWS \
		"qwen3-30b 4;qwen3-30b 8;v2-lite 4;v2-lite 8;deepseek-v3 8;kimi-k2 8" \
		"${F8_ROWS:-qwen3-30b-a3b 4,8;deepseek-v2-lite 4,8;kimi-k2 8;deepseek-v3 8}"
}

i4check() { moecheck golden; }

f8check() {
	moecheck golden
	dec f8c_kimi-k2 kimi-k2 1,8 fp8-block
	dec f8c_kimi-k2_rows8 kimi-k2 8 fp8-block KDEC_MOE_QGEMV_FP8_ROWS=8
	dec f8c_deepseek-v3 deepseek-v3 1,8 fp8-block
	dec f8c_qwen3-30b-a3b qwen3-30b-a3b 8 fp8-block
}

mprefill() {
	local f m v
	for f in int4-g32 fp8-block bf16; do
		for m in 64 256; do
			step "moeq_${f}_$m" 40 "$B/tests/bench/bench_cuda_moe" q qwen3-30b "$m" "$f"
			grep -E 'grouped|qtile' "$L/moeq_${f}_$m.log" | cut -c1-170 | tee -a "$S"
		done
	done
	mpf pf_llama_bf16 llama3.1-8b bf16
	mpf pf_qwen3_bf16 qwen3-30b-a3b bf16
	mpf pf_qwen3_bf16_tiles qwen3-30b-a3b bf16 KDEC_MOE_QTILE_ROWS=4096 KDEC_MOE_QTILE_BF16=1
	for f in int4-g32 fp8-block; do
		for v in 64 4096; do
			mpf "pf_qwen3_${f}_$v" qwen3-30b-a3b "$f" KDEC_MOE_QTILE_ROWS=$v
		done
	done
	# where a prefill chunk's time goes, op by op (no graphs; its own table at exit)
	for f in bf16 int4-g32; do
		mpfops "pfops_qwen3_$f" "$f"
	done
}

mwide() {
	local f
	mwmin
	step golden_wide 100 env KDEC_TEST_BACKEND=cuda KDEC_MOE_QTILE_ROWS=4096 \
		KDEC_MOE_QTILE_BF16=1 KDEC_MOE_QTILE_WIDE=1 "$B/tests/test_golden"
	grep '^FAIL' "$L/golden_wide.log" | cut -c1-200 | tee -a "$S"
	for f in int4-g32 bf16 fp8-block; do
		mpf "pf_qwen3_${f}_def" qwen3-30b-a3b "$f"
		mpf "pf_qwen3_${f}_wide" qwen3-30b-a3b "$f" KDEC_MOE_QTILE_ROWS=4096 \
			KDEC_MOE_QTILE_BF16=1 KDEC_MOE_QTILE_WIDE=1
	done
	mpf pf_llama_bf16 llama3.1-8b bf16
	mwbench "v2-lite 2048" "deepseek-v3 512"
	for f in int4-g32 bf16; do
		mpf "pf_qwen3_${f}_narrow" qwen3-30b-a3b "$f" KDEC_MOE_QTILE_ROWS=4096 \
			KDEC_MOE_QTILE_BF16=1 KDEC_MOE_QTILE_WIDE=0
	done
}

mwmin() {
	mwmin_tests
	mwbench "qwen3-30b 2048"
}

# mwmin's tests: test_cuda_moe_q quick, test_cuda_moe's experts
mwmin_tests() {
	step moe_q 60 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
	grep -E '^FAIL' "$L/moe_q.log" | head -8 | cut -c1-200 | tee -a "$S"
	grep -c 'qtile-wide.*PASS' "$L/moe_q.log" | sed 's/^/moe_q qtile-wide PASS lines: /' |
		tee -a "$S"
	step moe 40 env KD_TEST_PART=experts "$B/tests/test_cuda_moe"
	grep -E '^FAIL|qtile-wide' "$L/moe.log" | head -12 | cut -c1-200 | tee -a "$S"
}

mfill() {
	local f n
	for f in int4-g32 fp8-block bf16; do
		for n in random const; do
			qbench "mfill_${f}_$n" qwen3-30b 2048 "$f" BENCH_MOE_FILL=$n
		done
	done
	for f in bf16 int4-g32; do
		mpfops "pfops_qwen3_${f}_def" "$f"
		mpfops "pfops_qwen3_${f}_wide" "$f" KDEC_MOE_QTILE_ROWS=4096 KDEC_MOE_QTILE_BF16=1 \
			KDEC_MOE_QTILE_WIDE=1
	done
	mwbench "qwen3-30b 96" "qwen3-30b 128" "qwen3-30b 192"
}

# mpfops NAME FORMAT [ENV...]: a Qwen3-30B-A3B prefill, each op timed, the op table
mpfops() {
	local n=$1 f=$2
	shift 2
	mpf "$n" qwen3-30b-a3b "$f" KDEC_CUDA_OP_TIMES=2 "$@"
	sed -n '/^cuda op times/,$p' "$L/$n.log" | head -n 40 | cut -c1-200 | tee -a "$S"
}

# mwbench "SHAPE M"...: bench_cuda_moe q at each, every format
mwbench() {
	local f m
	for m in "$@"; do
		for f in int4-g32 fp8-block bf16; do
			set -- $m
			qbench "mw_${1}_${2}_$f" "$1" "$2" "$f"
		done
	done
}

# qbench NAME SHAPE M FORMAT [ENV...]: bench_cuda_moe q SHAPE M FORMAT under ENV, its
# lines into the summary after NAME (which says what ENV set)
qbench() {
	local n=$1 sh=$2 m=$3 f=$4
	shift 4
	step "$n" 60 env "$@" "$B/tests/bench/bench_cuda_moe" q "$sh" "$m" "$f"
	grep 'moe_q time' "$L/$n.log" | cut -c11-250 | sed "s/^/$n: /" | tee -a "$S"
}

# mprefill's prefill of 256 and 2048 tokens: NAME MODEL FORMAT [ENV...]
mpf() {
	local n=$1 m=$2 f=$3 extra=
	shift 3
	[ "$f" = bf16 ] || extra="--weight-format $f"
	step "$n" 60 env "$@" "$B/kdbench" prefill --model "tests/data/configs/$m.json" \
		--synthetic-weights $extra --backend cuda --tokens "${MPF_TOKENS:-256,2048}" --reps 2 \
		--log-level info
	grep -E '^ +[0-9]' "$L/$n.log" | sed "s/^/$n /" | cut -c1-200 | tee -a "$S"
}

# moecheck NAME [ENV...]: test_cuda_moe_q quick, then test_golden on cuda under ENV (NAME:
# its log), their failures and test_cuda_moe_q's count of passes into the summary
moecheck() {
	local n=$1
	shift
	step moe_q 150 env KD_TEST_QUICK=1 "$B/tests/test_cuda_moe_q"
	grep -E '^FAIL' "$L/moe_q.log" | head -8 | cut -c1-200 | tee -a "$S"
	grep -c PASS "$L/moe_q.log" | sed 's/^/moe_q PASS lines: /' | tee -a "$S"
	step "$n" 100 env KDEC_TEST_BACKEND=cuda "$@" "$B/tests/test_golden"
	grep '^FAIL' "$L/$n.log" | cut -c1-200 | tee -a "$S"
}

# qtiles FORMAT KNOB BENCHES ROWS: the experts alone (bench_cuda_moe q, each "shape M" of
# BENCHES), then decode, two rounds of KNOB 8 (the union GEMVs to 8 rows) / 2 (the tile
# kernels from 3) on each "model batches" of ROWS (lists ';'-separated)
qtiles() {
	local f=$1 knob=$2 r
	each_row "$3" qtiles_bench
	for r in 1 2; do
		each_row "$4" qtiles_row
	done
}

# qtiles' experts alone: SHAPE M (qtiles' f)
qtiles_bench() {
	step "moeq_${f}_$1_$2" 40 "$B/tests/bench/bench_cuda_moe" q "$1" "$2" "$f"
	grep -E 'qgemv |qtile' "$L/moeq_${f}_$1_$2.log" | cut -c1-170 | tee -a "$S"
}

# qtiles' pair of one row: MODEL BATCHES (qtiles' f, knob and r)
qtiles_row() {
	dec "q${r}_8_${f}_$1" "$1" "$2" "$f" "$knob=8"
	dec "q${r}_2_${f}_$1" "$1" "$2" "$f" "$knob=2"
}

i4table() {
	each_row "${I4_TABLE:-qwen3-30b-a3b 1,8,64;deepseek-v2-lite 1,8,64;kimi-k2 1,8;deepseek-v3 1,8}" \
		i4table_row
}

# i4table's row: MODEL BATCHES
i4table_row() { dec "i4c_$1" "$1" "$2" int4-g32; }

i4agent() {
	local v
	for v in 8 2; do
		step "agent_i4rows$v" 200 env KDEC_MOE_QGEMV_INT4_ROWS=$v \
			AGENT_SESSIONS="${AGENT_SESSIONS:-8 16}" AGENT_S="${AGENT_S:-30}" \
			AGENT_FORMAT=int4-g32 \
			bash contrib/bench/agent_serving.sh "$B" "$L/agent_i4rows$v" \
			tests/data/configs/qwen3-30b-a3b.json
		cat "$L/agent_i4rows$v/agent_table.md" 2>/dev/null | tee -a "$S"
		tail -n 3 "$L/agent_i4rows$v/kdecd.log" 2>/dev/null | cut -c1-200 | tee -a "$S"
	done
}

# each_row LIST FN: FN with the words of each ';'-separated item of LIST
each_row() {
	local item IFS=';'
	for item in $1; do
		IFS=$' \t\n'
		$2 $item
	done
}

experts() {
	dec "x_qwen3-30b-a3b_bf16" qwen3-30b-a3b 1,8,64 bf16
	dec "x_qwen3-30b-a3b_fp8" qwen3-30b-a3b 8 fp8-block
	dec "x_deepseek-v2-lite_bf16" deepseek-v2-lite 8 bf16
	dec "x_kimi-k2_fp8" kimi-k2 8 fp8-block
}

ringab() {
	local m v
	for m in ${ST_RB:-llama3.1-8b:1,8 qwen3-8b:1}; do
		dec "rb_${m%%:*}_cublas" "${m%%:*}" "${m#*:}" bf16
		for v in 0 1 2; do
			dec "rb_${m%%:*}_ring$v" "${m%%:*}" "${m#*:}" bf16 KDEC_LINEAR_RING=8 \
				KDEC_LINEAR_RING_STREAM=$v
		done
	done
}

dense() {
	local m f
	for m in llama3.1-8b:bf16 llama3.1-8b:fp8-block llama3.1-8b:int4-g32 qwen3-8b:bf16; do
		f=${m#*:} m=${m%%:*}
		dec "d_${m}_$f" "$m" 1,8,64 "$f"
	done
}

peer() {
	step peer 240 env OUT="$L" PEER_PARTS=torch-compile PEER_BATCH=1,64 PEER_TOTAL_S=230 \
		bash contrib/bench/run_peers.sh
	grep -E '^(peer|torch)' "$L/peer.log" | tee -a "$S"
	tail -n 8 "$L/peer.log" | tee -a "$S"
}

moe() {
	local m f
	for m in qwen3-30b-a3b deepseek-v2-lite; do
		for f in ${ST_FORMATS:-bf16 fp8-block int4-g32}; do
			decp "m_${m}_$f" "$m" 1,8 "$f" standard,latency
			dec "m64_${m}_$f" "$m" 64 "$f"
		done
	done
}

slice() {
	local m f
	for m in kimi-k2 deepseek-v3; do
		for f in ${ST_FORMATS:-bf16 fp8-block int4-g32}; do
			dec "s_${m}_$f" "$m" 1,8 "$f"
		done
	done
}

relay() {
	local v
	for v in ${ST_MASKS:-0 1 2 4 8}; do
		dec "r${v}_llama_fp8" llama3.1-8b 1,8 fp8-block KDEC_PDL_RELAY=$v
	done
	for v in ${ST_MASKS:-0 1 2 4 8}; do
		dec "r${v}_qwen3moe_fp8" qwen3-30b-a3b 1 fp8-block KDEC_PDL_RELAY=$v
	done
}

merge() {
	local v i
	for i in 1 2; do
		for v in 0 1; do
			dec "m${v}_llama_fp8_$i" llama3.1-8b 1,8,64 fp8-block KDEC_ATTN_MERGE=$v
			dec "m${v}_qwen3moe_fp8_$i" qwen3-30b-a3b 1 fp8-block KDEC_ATTN_MERGE=$v
		done
	done
}

# kdbench with --decode-path from the environment (dec passes only ENV through)
printf '#!/bin/sh\nexec "%s" "$@" --decode-path "$KDBENCH_PATHS"\n' "$PWD/$B/kdbench" \
	>"$B/kdbench-paths"
chmod +x "$B/kdbench-paths"
for p in ${ST_PART:-check ring ringab dense peer dpath}; do
	$p
done
tar -C "$L" -czf "$O/logs.tgz" . 2>/dev/null
say "total $((SECONDS - t0)) s"
