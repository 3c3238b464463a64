#!/bin/sh
# --tp and --gpus as a user gives them: kdbench logits with tp 2 and 4 (and 4 with
# expert parallel, --ep; MLA with its latent cache split by tokens, --mla-cp) within 1e-5 relative L2 per row of tp 1 (dense, MoE, MLA);
# kdbench generate (also with --no-graphs) and a real kdecd --tp 2 over the socket give tp 1's greedy tokens (one client, then four at once;
# greedy with tp: drawn by vocabulary slices), kdecd reading its shards straight from the mapped files;
# a quantized (fp8-block) checkpoint at tp 2 within 1e-5 of tp 1; a GGUF at tp 2
# within 1e-5 of tp 1, its shards read from the mapped file; kdbench decode runs at tp 2;
# kdbench allreduce's sums come out right; and every bad
# --tp / --gpus / --ep / --allreduce fails with one clear line.
set -u
test_name=tp_cli
. "${top_srcdir:-.}/tests/testutil.sh"
G=$top_srcdir/tests/data/golden
IDS=5,17,300,2,9,33,70,41,8,250

# ---- kdbench logits: tp 2 and 4 against tp 1, prefill and incremental ----
for model in llama3 qwen3_moe deepseek_v3; do
	for mode in "" --incremental; do
		"$B/kdbench" logits --model "$G/$model" --tokens $IDS --threads 2 $mode \
			--out "$tmp/t1.f32" 2>"$tmp/err" || fail "$model tp 1 $mode: $(tail -n 1 "$tmp/err")"
		for tp in 2 4 "4 --ep" "2 --mla-cp" "4 --mla-cp"; do
			[ "$model" = llama3 ] && [ "$tp" = "4 --ep" ] && continue	# no experts
			case "$tp" in *--mla-cp) [ "$model" = deepseek_v3 ] || continue ;; esac
			"$B/kdbench" logits --model "$G/$model" --tokens $IDS --threads 2 --tp $tp $mode \
				--out "$tmp/tn.f32" 2>"$tmp/err" ||
				fail "$model tp $tp $mode: $(tail -n 1 "$tmp/err")"
			w=$(worst_rel "$tmp/tn.f32" "$tmp/t1.f32" 512)
			awk -v w="$w" 'BEGIN { exit !(w != "nan" && w + 0 <= 1e-5) }' && ok ||
				fail "$model tp $tp $mode: worst row $w relative L2 from tp 1 (want <= 1e-5)"
		done
	done
done

# ---- a GGUF at tp 2: its shards dequantized slice by slice from the mapped file ----
GG=$top_srcdir/tests/data/gguf-golden/qwen3_moe.gguf
"$B/kdbench" logits --model "$GG" --tokens $IDS --threads 2 --out "$tmp/t1.f32" 2>"$tmp/err" ||
	fail "qwen3_moe.gguf tp 1: $(tail -n 1 "$tmp/err")"
"$B/kdbench" logits --model "$GG" --tokens $IDS --threads 2 --tp 2 --out "$tmp/tn.f32" 2>"$tmp/err" ||
	fail "qwen3_moe.gguf tp 2: $(tail -n 1 "$tmp/err")"
grep -q "tp 2: the shards of .* read straight from the mapped files" "$tmp/err" && ok ||
	fail "qwen3_moe.gguf tp 2 did not read its shards from the mapped file: $(tail -n 2 "$tmp/err")"
w=$(worst_rel "$tmp/tn.f32" "$tmp/t1.f32" 512)
awk -v w="$w" 'BEGIN { exit !(w != "nan" && w + 0 <= 1e-5) }' && ok ||
	fail "qwen3_moe.gguf tp 2: worst row $w relative L2 from tp 1 (want <= 1e-5)"

# ---- greedy tokens: kdbench generate, and kdecd --tp 2 over the socket ----
"$B/kdbench" generate --model "$M" --prompt 1,2,3 --max-tokens 12 --threads 2 >"$tmp/g1" 2>"$tmp/err" ||
	fail "generate tp 1: $(tail -n 1 "$tmp/err")"
"$B/kdbench" generate --model "$M" --prompt 1,2,3 --max-tokens 12 --threads 2 --tp 4 >"$tmp/g4" 2>"$tmp/err" ||
	fail "generate tp 4: $(tail -n 1 "$tmp/err")"
[ -s "$tmp/g1" ] && cmp -s "$tmp/g1" "$tmp/g4" && ok || fail "generate tp 4: '$(cat "$tmp/g4")' vs tp 1 '$(cat "$tmp/g1")'"
# --no-graphs (on cuda the ranks' eager path) is taken on the cpu too, which runs op by op
# anyway: tp 1's tokens
"$B/kdbench" generate --model "$M" --prompt 1,2,3 --max-tokens 12 --threads 2 --tp 2 --no-graphs \
	>"$tmp/g2" 2>"$tmp/err" || fail "generate tp 2 --no-graphs: $(tail -n 1 "$tmp/err")"
[ -s "$tmp/g1" ] && cmp -s "$tmp/g1" "$tmp/g2" && ok ||
	fail "generate tp 2 --no-graphs: '$(cat "$tmp/g2")' vs tp 1 '$(cat "$tmp/g1")'"

S=$tmp/kdecd.sock
if kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 2 --tp 2; then
	grep -q "tp 2: rank 1 holds .* MiB of KV cache; peak host memory" "$tmp/daemon.log" && ok ||
		fail "kdecd --tp 2 logs no rank 1 with its peak host memory"
	# the shards came straight from the files (the model never read whole)
	grep -q "tp 2: the shards of .* read straight from the mapped files" "$tmp/daemon.log" && ok ||
		fail "kdecd --tp 2 did not read its shards from the mapped files"
	"$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 12 >"$tmp/d2" 2>"$tmp/err" ||
		fail "kdrun on kdecd --tp 2: $(tail -n 1 "$tmp/err")"
	[ "$(tr -s ' \n' ' ' <"$tmp/d2" | sed 's/ $//')" = "$(tr -s ' \n' ' ' <"$tmp/g1" | sed 's/ $//')" ] && ok ||
		fail "kdecd --tp 2 generated '$(cat "$tmp/d2")', tp 1 '$(cat "$tmp/g1")'"
	# four clients at once: their steps batched across the ranks, each its own tokens
	cpids=
	for i in 1 2 3 4; do
		"$B/kdrun" --socket "$S" --prompt "$i,$((i * 7)),$((i * 31))" --max-tokens 10 \
			>"$tmp/c$i" 2>/dev/null &
		cpids="$cpids $!"
	done
	wait $cpids
	for i in 1 2 3 4; do
		"$B/kdbench" generate --model "$M" --prompt "$i,$((i * 7)),$((i * 31))" --max-tokens 10 \
			--threads 2 >"$tmp/r$i" 2>/dev/null
		[ -s "$tmp/r$i" ] && [ "$(tr -s ' \n' ' ' <"$tmp/c$i" | sed 's/ $//')" = \
			"$(tr -s ' \n' ' ' <"$tmp/r$i" | sed 's/ $//')" ] && ok ||
			fail "client $i of 4 on kdecd --tp 2: '$(cat "$tmp/c$i")', tp 1 alone '$(cat "$tmp/r$i")'"
	done
	kdecd_stop && ok || fail "kdecd --tp 2 did not stop cleanly"
else
	fail "kdecd --tp 2 did not start: $(tail -n 3 "$tmp/daemon.log")"
fi

# ---- kdbench decode at tp 2 (the figures' format; no figure is checked) ----
"$B/kdbench" decode --model "$G/qwen3_moe" --batch 1,4 --ctx 16 --steps 4 --warmup 1 --threads 2 --tp 2 \
	>"$tmp/dec" 2>"$tmp/err" && grep -q 'tokens/s\|tok/s' "$tmp/dec" && ok ||
	fail "decode --tp 2: $(tail -n 2 "$tmp/err") $(tail -n 2 "$tmp/dec")"

# ---- kdbench allreduce: the ranks' reduction alone, each result checked by it ----
"$B/kdbench" allreduce --tp 3 --bytes 4,4096,65540 --iters 5 --warmup 1 >"$tmp/ar" 2>"$tmp/err" &&
	grep -q '^# kdbench allreduce: cpu, tp 3' "$tmp/ar" &&
	[ "$(grep -cE '^ +(4|4096|65540) +[0-9.]+ +[0-9.]+ ' "$tmp/ar")" -eq 3 ] && ok ||
	fail "allreduce --tp 3: $(tail -n 1 "$tmp/err") $(cat "$tmp/ar")"
# --backend cuda: the fused kernel's figures where a GPU is (contrib/device), else one line
"$B/kdbench" allreduce --backend cuda --iters 2 --warmup 0 >"$tmp/ar" 2>"$tmp/err"
case $? in
0) grep -q '^# kdbench allreduce: cuda, tp 2' "$tmp/ar" && ok || fail "allreduce cuda: $(cat "$tmp/ar")" ;;
1) tail -n 1 "$tmp/err" | grep -q "no CUDA device here\|built without CUDA" && ok ||
	fail "allreduce --backend cuda without a GPU: $(tail -n 2 "$tmp/err")" ;;
*) fail "allreduce --backend cuda: $(tail -n 2 "$tmp/err")" ;;
esac
expect 2 "multiple of 4" "$B/kdbench" allreduce --bytes 6

# ---- refusals: one line each ----
expect 1 "tp 3 does not divide 8 query heads of llama" "$B/kdbench" logits --model "$M" --tokens 1,2 --tp 3
expect 1 "tp 3 does not divide 8 query heads of llama" "$B/kdecd" --backend cpu --model "$M" --check --tp 3
expect 1 "tp 8 does not divide 4 query heads of qwen3" "$B/kdbench" generate --model "$G/qwen3" --prompt 1 \
	--max-tokens 1 --tp 8
expect 2 "--tp" "$B/kdecd" --model "$M" --check --tp 0
expect 2 "GPU 1 is named twice" "$B/kdecd" --model "$M" --check --gpus 1,1
expect 2 "give 'all' or GPU ids" "$B/kdecd" --model "$M" --check --gpus 0,x
expect 2 "a comma with no GPU" "$B/kdbench" logits --model "$M" --tokens 1 --gpus 0,
# the routing trace with tp: recorded on rank 0 (the router and its input are every
# rank's), the same choices as tp 1's; forcing choices is refused
for tp in 1 2; do
	"$B/kdbench" logits --model "$G/deepseek_v3" --tokens $IDS --threads 2 --tp $tp --out "$tmp/x" \
		--dump-routing "$tmp/rt$tp" 2>"$tmp/err" || fail "--dump-routing at tp $tp: $(tail -n 1 "$tmp/err")"
done
[ -s "$tmp/rt1" ] && [ "$(cut -d' ' -f1-7 "$tmp/rt1")" = "$(cut -d' ' -f1-7 "$tmp/rt2")" ] && ok ||
	fail "--dump-routing at tp 2 chose other experts than tp 1: $(diff "$tmp/rt1" "$tmp/rt2" | head -n 4)"
expect 1 "with --tp 2: not built" "$B/kdbench" logits --model "$G/qwen3_moe" --tokens 1,2 --out "$tmp/x" \
	--tp 2 --force-routing "$tmp/rt1"
expect 1 "needs --tp N of 2 or more" "$B/kdbench" logits --model "$G/qwen3_moe" --tokens 1 --ep
expect 1 "has no routed experts" "$B/kdecd" --backend cpu --model "$M" --check --tp 2 --ep
expect 1 "runs on no GPU" "$B/kdecd" --backend cpu --model "$M" --check --gpus 0
expect 1 "has no latent (MLA) attention" "$B/kdecd" --backend cpu --model "$M" --check --tp 2 --mla-cp
expect 1 "needs --tp N of 2 or more" "$B/kdbench" logits --model "$G/deepseek_v3" --tokens 1 --mla-cp
# MLA context parallel: greedy tokens of tp 1, and each rank's latent cache a half
"$B/kdbench" generate --model "$G/deepseek_v3" --prompt 1,2,3 --max-tokens 12 --threads 2 >"$tmp/m1" \
	2>"$tmp/err" || fail "generate deepseek_v3 tp 1: $(tail -n 1 "$tmp/err")"
"$B/kdbench" generate --model "$G/deepseek_v3" --prompt 1,2,3 --max-tokens 12 --threads 2 --tp 2 \
	--mla-cp >"$tmp/m2" 2>"$tmp/err" || fail "generate deepseek_v3 tp 2 --mla-cp: $(tail -n 1 "$tmp/err")"
[ -s "$tmp/m1" ] && cmp -s "$tmp/m1" "$tmp/m2" && ok ||
	fail "generate tp 2 --mla-cp: '$(cat "$tmp/m2")' vs tp 1 '$(cat "$tmp/m1")'"
grep -q "tp 2 (MLA context parallel: latent cache split by tokens): rank 1 holds" "$tmp/err" && ok ||
	fail "kdbench --tp 2 --mla-cp logs no rank with its split cache: $(grep 'rank 1' "$tmp/err")"
# a quantized checkpoint shards too (its payloads and the scale blocks each slice uses)
Q=$top_srcdir/tests/data/quant/deepseek_v3_fp8_block
if "$B/kdbench" logits --model "$Q" --tokens 1,2,3 --threads 2 --out "$tmp/q1.f32" 2>"$tmp/err" &&
   "$B/kdbench" logits --model "$Q" --tokens 1,2,3 --threads 2 --tp 2 --out "$tmp/q2.f32" 2>"$tmp/err"; then
	w=$(worst_rel "$tmp/q2.f32" "$tmp/q1.f32" 199)
	awk -v w="$w" 'BEGIN { exit !(w != "nan" && w + 0 <= 1e-5) }' && ok ||
		fail "fp8-block deepseek_v3 tp 2: worst row $w relative L2 from tp 1 (want <= 1e-5)"
else
	fail "fp8-block deepseek_v3 tp 2: $(tail -n 1 "$tmp/err")"
fi
# the host KV tier and snapshots with --tp (every rank's cache, kv_spans.h): a session
# saved at shutdown by a tp 2 daemon loads into the next tp 2 daemon and continues with
# the tokens it would have had; a tp 1 daemon sets that snapshot aside (another layout)
"$B/kdecd" --backend cpu --model "$M" --check --tp 2 --host-kv-mem 64M >/dev/null 2>&1 && ok ||
	fail "kdecd --tp 2 --host-kv-mem refused"
D=$tmp/state
mkdir -p "$D"
S=$tmp/kdecd.sock
turn() {	# turn OUT PROMPT: one turn of session s, its tokens in OUT
	"$B/kdrun" --socket "$S" --prompt "$2" --max-tokens 6 --session s >"$tmp/$1" 2>"$tmp/err" ||
		fail "kdrun --session s at tp 2: $(tail -n 1 "$tmp/err")"
}
P1=$(seq -s, 3 42) P2=$(seq -s, 50 60)
if kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 2 --tp 2 --state-dir "$D"; then
	turn a1 "$P1"
	turn a2 "$P2"	# the uninterrupted second turn
	"$B/kdctl" --socket "$S" session-close s >/dev/null || fail "session-close s"
	turn b1 "$P1"
	kdecd_stop && [ -s "$D/kv-sessions.snap" ] && ok || fail "tp 2 shutdown: no snapshot"
	if kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 2 --tp 2 --state-dir "$D"; then
		grep -q "1 sessions loaded" "$tmp/daemon.log" && ok ||
			fail "tp 2 restart: $(grep 'state dir' "$tmp/daemon.log" | tail -n 1)"
		turn b2 "$P2"
		cmp -s "$tmp/a2" "$tmp/b2" && [ -s "$tmp/a2" ] && ok ||
			fail "tp 2 after restart: '$(cat "$tmp/b2")', uninterrupted '$(cat "$tmp/a2")'"
		kdecd_stop || fail "tp 2 restart did not stop cleanly"
	else
		fail "kdecd --tp 2 --state-dir restart: $(tail -n 3 "$tmp/daemon.log")"
	fi
	if kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 2 --state-dir "$D"; then
		grep -q "snapshot not loaded" "$tmp/daemon.log" && [ "$(ls "$D" | grep -c "kv-sessions.snap.")" -ge 1 ] && ok ||
			fail "tp 1 on a tp 2 snapshot: $(grep 'state dir' "$tmp/daemon.log" | head -n 2)"
		kdecd_stop || fail "tp 1 on a tp 2 snapshot did not stop cleanly"
	else
		fail "kdecd tp 1 --state-dir: $(tail -n 3 "$tmp/daemon.log")"
	fi
else
	fail "kdecd --tp 2 --state-dir did not start: $(tail -n 3 "$tmp/daemon.log")"
fi
# --allreduce: parsed by kdecd and kdbench (logits, decode); a GPU reduction, so only auto
# on the cpu backend; on cuda (refused before any GPU is touched: checked wherever the
# build has the cuda backend) fused needs two ranks and nccl one rank per GPU
expect 2 "want auto, fused or nccl" "$B/kdecd" --model "$M" --check --allreduce ring
expect 2 "want auto, fused or nccl" "$B/kdbench" logits --model "$M" --tokens 1 --allreduce NCCL
expect 2 "want auto, fused or nccl" "$B/kdbench" decode --model "$M" --allreduce ""
expect 1 "--allreduce nccl on the cpu backend: its ranks reduce through shared memory" \
	"$B/kdecd" --backend cpu --model "$M" --check --allreduce nccl
expect 1 "--allreduce fused on the cpu backend" "$B/kdbench" logits --model "$M" --tokens 1 --tp 2 \
	--allreduce fused --out "$tmp/x"
"$B/kdbench" logits --model "$M" --tokens $IDS --threads 2 --tp 2 --allreduce auto --out "$tmp/ta.f32" \
	2>"$tmp/err" && "$B/kdbench" logits --model "$M" --tokens $IDS --threads 2 --tp 2 --out "$tmp/tb.f32" \
	2>/dev/null && cmp -s "$tmp/ta.f32" "$tmp/tb.f32" && ok ||
	fail "--tp 2 --allreduce auto on the cpu backend is not the default: $(tail -n 1 "$tmp/err")"
if ! "$B/kdbench" logits --backend cuda --model "$M" --tokens 1 --out "$tmp/x" 2>&1 |
	grep -q "unknown backend 'cuda'"; then
	expect 1 "NCCL cannot put two ranks on one GPU" "$B/kdbench" logits --backend cuda --model "$M" \
		--tokens 1 --tp 2 --allreduce nccl --out "$tmp/x"
	expect 1 "NCCL cannot put two ranks on one GPU" "$B/kdecd" --backend cuda --model "$M" --check \
		--tp 4 --allreduce nccl
	expect 1 "--allreduce fused with --tp 1: one rank has nothing to reduce" "$B/kdbench" decode \
		--backend cuda --model "$M" --synthetic-weights --allreduce fused
else
	echo "tp_cli: no cuda backend in this build: the --allreduce refusals on cuda are not checked" >&2
fi
if "$B/kdbench" logits --backend cuda --model "$M" --tokens 1 --out "$tmp/x" >/dev/null 2>&1; then
	# (cuda --tp 2 and 4 run as virtual ranks: tests/test_cuda_tp.sh)
	expect 1 "take --tp 2 or 4" "$B/kdbench" logits --backend cuda --model "$M" \
		--tokens 1 --tp 8
	expect 1 "multi-GPU cuda path is not built yet" "$B/kdbench" logits --backend cuda --model "$M" \
		--tokens 1 --gpus 0,1
	expect 1 "has no latent (MLA) attention" "$B/kdbench" logits \
		--backend cuda --model "$M" --tokens 1 --tp 2 --mla-cp
else
	echo "tp_cli: no cuda backend here: its refusals of --tp 8 and --gpus 0,1 are not checked" >&2
fi
verdict
