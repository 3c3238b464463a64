#!/bin/bash
# The headline serving benchmark (issue 21, part 5): kdbench agent against one kdecd at
# 1, 4, 16 and 64 sessions of the agent workload, and kdbench decode's step time at the
# same batch sizes beside it, in one call; a markdown table (agent_table.md) and one PNG
# per session count (agent_S.png) under OUTDIR.
#   contrib/bench/agent_serving.sh BUILD OUTDIR [CONFIG]
# Environment: AGENT_SESSIONS ("1 4 16 64"), AGENT_S (30, seconds per run),
# AGENT_BACKEND (cuda), AGENT_KV_TOKENS (300000), AGENT_FORMAT (bf16, or a --weight-format
# for both kdecd and kdbench decode: fp8-block, int4-g32, ...), KDECD_ARGS (more kdecd
# options).
set -u
B=$1 outdir=$2 cfg=${3:-tests/data/configs/llama3.1-8b.json}
sessions=${AGENT_SESSIONS:-1 4 16 64} dur=${AGENT_S:-30} backend=${AGENT_BACKEND:-cuda}
kv=${AGENT_KV_TOKENS:-300000} fmt=
[ "${AGENT_FORMAT:-bf16}" = bf16 ] || fmt="--weight-format $AGENT_FORMAT"
sock=$outdir/agent.sock
mkdir -p "$outdir"
rm -f "$outdir"/decode.jsonl "$outdir"/agent_*.json

# The daemon: --daemon returns once it serves (or fails with its error line). Every
# agent here runs as one uid, whose 64-session default would refuse the 65th
# conversation: the benchmark lifts it (real agents run under their own uids).
# shellcheck disable=SC2086
if ! "$B/kdecd" --model "$cfg" --synthetic-weights --backend "$backend" --kv-tokens "$kv" \
	--socket "$sock" --log-level warn --daemon --pid-file "$outdir/kdecd.pid" \
	--max-sessions 100000 $fmt \
	${KDECD_ARGS:-} 2>"$outdir/kdecd.log"; then
	echo "agent_serving: kdecd did not start (log: $outdir/kdecd.log)" >&2
	exit 1
fi
status=0
for n in $sessions; do
	"$B/kdbench" agent --socket "$sock" --sessions "$n" --duration "$dur" \
		--first-prompt 2048 --turn-tokens 256 --output-tokens 128 --think-ms 300 \
		--vocab 32000 --max-context 16384 --json "$outdir/agent_$n.json" \
		--plot "$outdir/agent_$n.png" >"$outdir/agent_$n.log" 2>&1 || status=1
	"$B/kdctl" --socket "$sock" metrics >"$outdir/metrics_$n.txt" 2>&1
done
"$B/kdctl" --socket "$sock" shutdown >/dev/null 2>&1
while kill -0 "$(cat "$outdir/kdecd.pid" 2>/dev/null)" 2>/dev/null; do sleep 0.2; done

# kdbench decode at the same batch sizes (the engine alone, no traffic); context 4096,
# about where the agent conversations sit on average.
batches=$(echo $sessions | tr ' ' ',')
# shellcheck disable=SC2086
"$B/kdbench" decode --model "$cfg" --synthetic-weights $fmt --backend "$backend" --batch "$batches" \
	--ctx 4096 --steps 32 --warmup 4 --log-level warn --out "$outdir/decode.jsonl" \
	>"$outdir/decode.log" 2>&1 || status=1
python3 "$(dirname "$0")/agent_table.py" "$outdir" $sessions | tee "$outdir/agent_table.md"
exit $status
