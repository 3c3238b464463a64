#!/bin/sh
# --decode-path on the GPU (issue 23): greedy tokens with the latency path forced,
# the standard path forced and auto are the same on every golden model (40 tokens of
# one sequence: the 1-row decode graph); on the MoE models the forced latency path must
# really run (its graph's log line says "latency path") and auto must have timed both,
# on the dense ones the latency path runs the standard kernels and says so.
# kdecd --backend cuda --decode-path latency serves kdrun the same tokens, and kdctl
# status and the metric show the choice.
# Exits 77 without a GPU or a CUDA build.
set -u
test_name=test_cuda_decode_path
. "${top_srcdir:-.}/tests/testutil.sh"
G=$top_srcdir/tests/data/golden
P=113,124,11,408,469,17,29

need_cuda
for m in llama3 qwen3 qwen3_moe deepseek_v2 deepseek_v3; do
	for p in standard latency auto; do
		"$B/kdbench" generate --model "$G/$m" --backend cuda --prompt $P --max-tokens 40 \
			--decode-path $p --log-level info >"$tmp/$p" 2>"$tmp/log_$p" ||
			fail "$m $p: $(tail -n 2 "$tmp/log_$p")"
	done
	[ -s "$tmp/standard" ] && cmp -s "$tmp/standard" "$tmp/latency" && ok ||
		fail "$m: latency '$(cat "$tmp/latency")' vs standard '$(cat "$tmp/standard")'"
	cmp -s "$tmp/standard" "$tmp/auto" && ok ||
		fail "$m: auto '$(cat "$tmp/auto")' vs standard '$(cat "$tmp/standard")'"
	case $m in
	*moe|deepseek*)
		grep -q "1-row decode graph.*latency path" "$tmp/log_latency" && ok ||
			fail "$m: the forced latency path did not run: $(grep 'decode graph' "$tmp/log_latency")"
		grep -q "decode path for 1 rows: latency" "$tmp/log_auto" ||
			grep -q "decode path for 1 rows: .*: standard" "$tmp/log_auto" && ok ||
			fail "$m: auto did not time both paths: $(grep 'decode' "$tmp/log_auto")" ;;
	*)
		grep -q "no fused layers for .*dense layers yet; the standard kernels run" \
			"$tmp/log_latency" && ok || fail "$m: $(grep 'decode path' "$tmp/log_latency")" ;;
	esac
done

S=$tmp/kdecd.sock
if kdecd_start kdecd.log 120 --model "$G/qwen3_moe" --backend cuda --decode-path latency \
	--socket "$S"; then
	"$B/kdrun" --socket "$S" --prompt $P --max-tokens 40 >"$tmp/served" 2>/dev/null
	"$B/kdbench" generate --model "$G/qwen3_moe" --backend cuda --prompt $P --max-tokens 40 \
		--decode-path standard --log-level warn >"$tmp/ref" 2>/dev/null
	[ "$(tr -s ' \n' ' ' <"$tmp/served" | sed 's/ *$//')" = \
	  "$(tr -s ' \n' ' ' <"$tmp/ref" | sed 's/ *$//')" ] && ok ||
		fail "kdecd latency served '$(cat "$tmp/served")', standard '$(cat "$tmp/ref")'"
	"$B/kdctl" --socket "$S" status --json >"$tmp/st"
	grep -q '"decode_path": *"latency (1: latency' "$tmp/st" && ok ||
		fail "status: $(grep -o '"decode_path":[^,]*' "$tmp/st")"
	"$B/kdctl" --socket "$S" metrics | grep -q '^kd_decode_path_latency_buckets 15$' && ok ||
		fail "metric: $("$B/kdctl" --socket "$S" metrics | grep decode_path)"
	kdecd_stop || fail "kdecd exit $?"
else
	fail "kdecd --backend cuda --decode-path latency did not start: $(tail -n 3 "$tmp/kdecd.log")"
fi
verdict
