#!/bin/sh
# Streams during a 32k-token prefill (CPU): kdecd on a small synthetic Llama
# (tests/data/tiny/llama_40k.json, 40960 positions); 6 greedy streams decode while
# one 32768-token prompt arrives, once per --prefill-chunk given (default: 256, 2048,
# and 40960, which puts the whole prompt in one step: chunking off). Prints
# kdbench agent's table for each run, then one markdown row per run:
#   | chunk | load | 32k TTFT (s) | ITL before p50/p99/max | ITL during p50/p99/max | tokens during |
# Usage: [LONG_PROMPT=32768] contrib/bench/prefill_32k.sh [BUILD_DIR] [CHUNK...]  (BUILD_DIR .)
# Takes about 4 minutes on a 2-core VM. Nothing outside BUILD_DIR and a temp dir is written.
set -eu

here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-.}
[ $# -gt 0 ] && shift
chunks=${*:-256 2048 40960}
long=${LONG_PROMPT:-32768}	# tokens of the long prompt
config=$here/tests/data/tiny/llama_40k.json
tmp=$(mktemp -d /tmp/kdec_prefill32k.XXXXXX)
rows=$tmp/rows
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT INT TERM

for c in $chunks; do
	sock=$tmp/kdecd.sock
	"$build/kdecd" --model "$config" --synthetic-weights --socket "$sock" --threads 2 \
		--notify eventfd --kv-tokens 65536 --prefill-chunk "$c" 2>"$tmp/kdecd.log" &
	pid=$!
	i=0
	until "$build/kdctl" --socket "$sock" status >/dev/null 2>&1; do
		i=$((i + 1))
		[ $i -lt 100 ] || { echo "kdecd did not start:" >&2; cat "$tmp/kdecd.log" >&2; exit 1; }
		sleep 0.1
	done
	load=$(cut -d' ' -f1-3 /proc/loadavg)
	echo "== --prefill-chunk $c, load average before: $load"
	"$build/kdbench" agent --socket "$sock" --sessions 6 --think-ms 0 --turns 1000 \
		--first-prompt 64 --turn-tokens 16 --output-tokens 3000 --subagent-prob 0 \
		--vocab 512 --long-prompt "$long" --long-at 3 --duration 600 --grace 1 \
		--json "$tmp/run-$c.json" | tee "$tmp/table"
	"$build/kdctl" --socket "$sock" shutdown >/dev/null
	wait "$pid" || true
	pid=
	awk -v c="$c" -v load="$load" '
		function last4(   i, k) { for (i = 1; i <= NF; i++) if ($i == "(n") k = i;
			n = $(k + 1); sub(/\)/, "", n);
			return sprintf("%s / %s / %s", $(k - 4), $(k - 2), $(k - 1)) }
		/^long prompt:/ { t = $6 == "did" ? "unfinished" : sprintf("%.1f", $9 / 1000) }
		/before it was submitted/ { b = last4() }
		/overlapping its prefill/ { d = last4(); nd = n }
		END { printf "| %s | %s | %s | %s | %s | %s |\n", c, load, t, b, d, nd }
	' "$tmp/table" >>"$rows"
done
echo
echo "| --prefill-chunk | load avg (1/5/15 min) | 32k TTFT (s) | stream ITL before, ms p50 / p99 / max | stream ITL during the prefill, ms p50 / p99 / max | stream tokens during |"
echo "|---|---|---|---|---|---|"
cat "$rows"
