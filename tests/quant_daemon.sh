#!/bin/sh
# Quantized checkpoints through the real daemon (issue 24): kdecd serves an fp8
# block-scaled, a sharded int4 and a W8A8-static fp8 checkpoint (its input scales
# checked, not applied, as its log line says), kdctl status names each format, and
# kdrun's greedy continuation is
# transformers' (golden.json "greedy", computed on the dequantized weights); a
# malformed scale stops kdecd --check with one line naming the format;
# --synthetic-weights --weight-format builds and checks; --weight-format without
# --synthetic-weights is refused.
set -u
test_name=quant_daemon
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock
Q=$top_srcdir/tests/data/quant
T=120	# a check takes a second; 120 s is for a loaded 2-core machine under ASan

# greedy NAME: the reference's prompt (comma-separated) and output (space-separated)
greedy() {
	python3 - "$Q/$1/golden.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))["greedy"]
print(",".join(map(str, g["prompt"])))
print(" ".join(map(str, g["output"])))
PY
}

if ! command -v python3 >/dev/null 2>&1; then
	skip "no python3 to read golden.json"
	verdict
fi
for name in llama_fp8_block kimi_k2_int4 llama_fp8_tensor_static; do
	prompt=$(greedy $name | sed -n 1p)
	want=$(greedy $name | sed -n 2p)
	if ! kdecd_start "$name.log" $T --model "$Q/$name" --socket "$S" --threads 2; then
		fail "$name: kdecd did not start: $(tail -n 2 "$tmp/$name.log")"
		continue
	fi
	got=$("$B/kdrun" --socket "$S" --prompt "$prompt" --max-tokens 40 2>"$tmp/err")
	[ "$got" = "$want" ] && ok || fail "$name: kdrun gave '$got' ($(tail -n 1 "$tmp/err")), transformers '$want'"
	case $name in *int4) w=int4-g32 ;; *block) w=fp8-block ;; *) w=fp8-tensor ;; esac
	"$B/kdctl" --socket "$S" status | grep -q "^weights  *$w\$" && ok ||
		fail "$name: kdctl status does not say weights $w: $("$B/kdctl" --socket "$S" status | grep weights)"
	case $name in *_static)
		grep -q "(fp8-tensor; its static input scales are not applied" "$tmp/$name.log" && ok ||
			fail "$name: the load line does not say the input scales are not applied: $(grep 'MiB of weights' "$tmp/$name.log")"
	esac
	kdecd_stop || fail "$name: kdecd exit status $?"
done

# a scale tensor's shape against another block size: one line, the format named
rm -rf "$tmp/bad"
cp -r "$Q/llama_fp8_block" "$tmp/bad"
chmod -R u+w "$tmp/bad"
sed -i 's/"weight_block_size": \[/"weight_block_size": [64, 64], "published_block_size": [/' "$tmp/bad/config.json"
expect 1 "expected \[3, 2\] for weight \[144, 96\] (fp8-block)" \
	timeout $T "$B/kdecd" --check --backend cpu --model "$tmp/bad" --socket "$S"

# synthetic quantized weights; --weight-format only with them
for f in fp8-block fp8-channel int4-g32; do
	expect 0 "" timeout $T "$B/kdecd" --check --backend cpu --synthetic-weights --weight-format $f \
		--model "$top_srcdir/tests/data/tiny/kimi_k2.json" --socket "$S" --threads 2
done
expect 1 "needs --synthetic-weights" timeout $T "$B/kdecd" --check --backend cpu \
	--weight-format int4-g32 --model "$Q/llama_fp8_block" --socket "$S"
expect 2 "'int4-g7'" "$B/kdecd" --check --weight-format int4-g7 --model "$Q/llama_fp8_block"
verdict
