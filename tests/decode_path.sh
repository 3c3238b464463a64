#!/bin/sh
# --decode-path (issue 23) where there is no GPU: the CPU backend has no latency path,
# so latency is refused with one clear line (kdbench generate, kdbench decode, kdecd),
# auto gives standard's greedy tokens and says the latency kernels are unused (kdecd's
# log, kdctl status, the kd_decode_path_latency_buckets metric at 0); a bad value is
# refused with one line. The GPU side: tests/test_cuda_decode_path.sh.
set -u
test_name=decode_path
. "${top_srcdir:-.}/tests/testutil.sh"
G=$top_srcdir/tests/data/golden
P=113,124,11,408,469

expect 1 "--decode-path latency: the cpu backend has no latency path (use standard or auto)" \
	"$B/kdbench" generate --model "$G/qwen3_moe" --backend cpu --prompt $P --max-tokens 4 \
	--decode-path latency
[ "$(wc -l <"$tmp/err")" -eq 1 ] && ok || fail "kdbench latency on cpu: not one line: $(cat "$tmp/err")"
expect 1 "--decode-path latency: the cpu backend has no latency path" \
	"$B/kdbench" decode --model "$G/deepseek_v2" --backend cpu --batch 1 --ctx 4 --steps 2 \
	--decode-path latency
expect 2 "--decode-path 'fast'" "$B/kdbench" decode --model "$G/qwen3_moe" --decode-path fast
expect 2 "--decode-path 'fast': want auto, standard or latency" \
	"$B/kdecd" --model "$G/qwen3_moe" --backend cpu --check --decode-path fast
expect 1 "--decode-path latency: the cpu backend has no latency path" \
	"$B/kdecd" --model "$G/qwen3_moe" --backend cpu --check --decode-path latency

# auto and standard: the same greedy tokens on every golden model
for m in "$G"/*/; do
	for p in standard auto; do
		"$B/kdbench" generate --model "$m" --backend cpu --threads 2 --prompt $P --max-tokens 12 \
			--decode-path $p >"$tmp/$p" 2>"$tmp/err_$p" || fail "$m $p: $(cat "$tmp/err_$p")"
	done
	[ -s "$tmp/auto" ] && cmp -s "$tmp/standard" "$tmp/auto" && ok ||
		fail "$m: auto '$(cat "$tmp/auto")' vs standard '$(cat "$tmp/standard")'"
done

# kdecd: the choice in its log, kdctl status and the metric
S=$tmp/kdecd.sock
if kdecd_start kdecd.log 60 --model "$G/qwen3_moe" --socket "$S"; then
	grep -q "decode path: auto (latency kernels unused: the cpu backend has no latency path)" \
		"$tmp/kdecd.log" && ok || fail "kdecd log: $(grep -i 'decode path' "$tmp/kdecd.log")"
	"$B/kdctl" --socket "$S" status --json >"$tmp/st" || fail "kdctl status --json"
	grep -q '"decode_path": *"auto (latency kernels unused: the cpu backend has no latency path)"' \
		"$tmp/st" && ok || fail "status lacks decode_path: $(cat "$tmp/st")"
	"$B/kdctl" --socket "$S" status | grep -q "^decode_path  *auto (latency kernels unused" && ok ||
		fail "kdctl status: $("$B/kdctl" --socket "$S" status | grep decode)"
	"$B/kdctl" --socket "$S" metrics >"$tmp/m" || fail "kdctl metrics"
	grep -q '^kd_decode_path_latency_buckets 0$' "$tmp/m" && ok ||
		fail "metric: $(grep decode_path "$tmp/m")"
	kdecd_stop || fail "kdecd exit $?"
else
	fail "kdecd did not start: $(tail -n 3 "$tmp/kdecd.log")"
fi
verdict
