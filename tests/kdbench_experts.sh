#!/bin/sh
# kdbench decode's routed experts (the `experts` column, the floors' count): one more
# step after the timed ones runs under a routing trace and each MoE layer's distinct
# experts over the batch are counted. A row picks top_k distinct experts, so batch 1
# reads exactly top_k, batch B between top_k and min(E, B * top_k); a dense model has
# none ("-"); the JSON line carries the count, the last layer's and the uniform one.
set -u
test_name=kdbench_experts
. "${top_srcdir:-.}/tests/testutil.sh"
G=$top_srcdir/tests/data/golden

# MODEL BATCHES: kdbench decode on the cpu, its table in $tmp/table, JSON in $tmp/json
run() {
	rm -f "$tmp/json"
	"$B/kdbench" decode --model "$G/$1" --backend cpu --threads 2 --batch "$2" --ctx 8 \
		--steps 2 --warmup 1 --out "$tmp/json" >"$tmp/table" 2>"$tmp/err" ||
		fail "kdbench decode $1: $(tail -n 2 "$tmp/err")"
}

# deepseek_v3: 16 experts, top 4, the first layer dense (its count is not averaged in)
run deepseek_v3 1,3,8
awk -v k=4 -v E=16 '
	$1 ~ /^[0-9]+$/ { n++; b = $1; x = $(NF - 1); u = $NF
		hi = b * k < E ? b * k : E
		if (b == 1 && x != k) { print "batch 1: " x " experts, want " k; bad = 1 }
		if (x < k || x > hi) { print "batch " b ": " x " experts outside [" k ", " hi "]"; bad = 1 }
		want = E * (1 - (1 - k / E) ^ b)
		if (u < want - 0.06 || u > want + 0.06) { print "batch " b ": uniform " u ", want " want; bad = 1 } }
	END { if (n != 3) { print n " rows, want 3"; bad = 1 }; exit bad }' "$tmp/table" >"$tmp/chk" &&
	ok || fail "deepseek_v3: $(cat "$tmp/chk")"
grep -q '"batch":8,.*"routed_experts":[0-9.]*,"routed_experts_last":\([4-9]\|1[0-6]\),"routed_experts_uniform":' \
	"$tmp/json" && ok || fail "deepseek_v3 JSON: $(tail -n 1 "$tmp/json")"

# a dense model: no routed experts
run llama3 2
awk '$1 == "2" { found = 1; if ($(NF - 1) != "-" || $NF != "-") exit 1 } END { exit !found }' \
	"$tmp/table" && ok || fail "llama3: $(grep '^ *2 ' "$tmp/table")"
grep -q '"routed_experts":0.00,"routed_experts_last":0,' "$tmp/json" && ok ||
	fail "llama3 JSON: $(tail -n 1 "$tmp/json")"
verdict
