#!/bin/bash
# The peers of `kdbench decode` on one H200 (issue 3, "Targets"), random bf16 weights, context 1024:
#   1. HF transformers, eager, DynamicCache: Llama-3.1-8B shape, batch 1,64,8,32
#   2. HF transformers, eager: DeepSeek-V2-Lite shape (MLA + 64 experts), batch 1
#   3. plain PyTorch Llama decoder under torch.compile(mode="reduce-overhead"), batch 1,64,8,32
#   4. HF transformers, StaticCache + the compiled decode forward generate() uses, batch 1,64,8,32
# Batch 1 and 64 (the targets) run first, so that a part cut short by its time cap loses 8 and 32.
# Each part has a cap (seconds) and the whole a deadline (PEER_TOTAL_S, default 360 s: 6 min);
# expected ~4-5 min. Run from the repo root on the GPU machine (device run, with OUT set):
#   bash contrib/bench/run_peers.sh
# Logs: $OUT/peer_*.log; results: $OUT/peers.jsonl (one JSON object per batch size); the combined
# table is printed last. Environment: PYTHON, PEER_CTX, PEER_BATCH, PEER_STEPS_EAGER,
# PEER_STEPS_COMPILED, PEER_TOTAL_S, PEER_PARTS (e.g. "hf-dynamic torch-compile"),
# PEER_LLAMA_CONFIG, PEER_DSV2_CONFIG, PEER_EXTRA_ARGS (added to every script's arguments).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
cd "$(dirname "$0")/../.." || exit 1

out=${OUT:-/tmp}
mkdir -p "$out"
PY=${PYTHON:-python3}
CTX=${PEER_CTX:-1024}
BATCH=${PEER_BATCH:-1,64,8,32}
STEPS_EAGER=${PEER_STEPS_EAGER:-30}
STEPS_COMPILED=${PEER_STEPS_COMPILED:-100}
TOTAL=${PEER_TOTAL_S:-360}
PARTS=${PEER_PARTS:-hf-dynamic dsv2-eager torch-compile hf-static}
LLAMA=${PEER_LLAMA_CONFIG:-tests/data/configs/llama3.1-8b.json}
DSV2=${PEER_DSV2_CONFIG:-tests/data/configs/deepseek-v2-lite.json}
# (for tests without a GPU: PEER_EXTRA_ARGS="--device cpu" with the tiny configs of tests/data/tiny)
read -r -a EXTRA <<<"${PEER_EXTRA_ARGS:-}"
json=$out/peers.jsonl
rm -f "$json"

t_start=$(date +%s)
deadline=$((t_start + TOTAL))
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
"$PY" -c 'import torch, transformers, triton; print("torch", torch.__version__, "| transformers", transformers.__version__, "| triton", triton.__version__, "| cuda available:", torch.cuda.is_available())' \
	|| { echo "run_peers: $PY cannot import torch/transformers/triton"; exit 1; }

# part NAME CAP_S SLACK_S MIN_S SCRIPT ARGS...: runs one peer script with a time cap of min(CAP_S, what
# is left before the deadline), or skips it when that is under MIN_S. The script starts no batch size
# after its first in the cap's last SLACK_S seconds (one batch size: model set-up or compile + steps).
part() {
	local name=$1 cap=$2 slack=$3 min=$4 script=$5
	shift 5
	case " $PARTS " in *" $name "*) ;; *) echo "== $name: not in PEER_PARTS, skipped"; return 0 ;; esac
	local now left log t0 rc budget
	now=$(date +%s)
	left=$((deadline - now))
	[ "$left" -lt "$cap" ] && cap=$left
	if [ "$cap" -lt "$min" ]; then
		echo "== $name: skipped, ${left}s left of PEER_TOTAL_S=${TOTAL}s (needs ${min}s)"
		status=1
		return 0
	fi
	budget=$((cap - slack))
	[ "$budget" -lt 0 ] && budget=0
	log=$out/peer_$name.log
	echo "== $name: cap ${cap}s, log $log (at +$((now - t_start))s)"
	t0=$(date +%s)
	timeout -k 10 "$cap" "$PY" "$script" --json "$json" --budget-s "$budget" "$@" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 \
		| tee "$log" | grep --line-buffered -E '^(peer |hf-|torch-|# |error)'
	rc=${PIPESTATUS[0]}
	[ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "   $name: killed at its ${cap}s cap"
	[ "$rc" -eq 0 ] || status=1
	echo "-- $name: exit $rc, $(($(date +%s) - t0))s (total +$(($(date +%s) - t_start))s)"
}

#    name          cap slack min
part hf-dynamic     60  15  30 contrib/bench/hf_decode.py --config "$LLAMA" --cache dynamic \
	--batch "$BATCH" --ctx "$CTX" --steps "$STEPS_EAGER" --warmup 3
part dsv2-eager     70  70  30 contrib/bench/hf_decode.py --config "$DSV2" --cache dynamic \
	--batch 1 --ctx "$CTX" --steps "$STEPS_EAGER" --warmup 3
part torch-compile 150  50  60 contrib/bench/torch_decoder.py --config "$LLAMA" \
	--batch "$BATCH" --ctx "$CTX" --steps "$STEPS_COMPILED" --warmup 10
part hf-static     150  60  60 contrib/bench/hf_decode.py --config "$LLAMA" --cache static \
	--batch "$BATCH" --ctx "$CTX" --steps "$STEPS_COMPILED" --warmup 10

echo
echo "== peers, $(date -u +%Y-%m-%dT%H:%MZ), total $(($(date +%s) - t_start))s; results $json"
"$PY" - "$json" <<'EOF'
import json, sys
rows = []
try:
    with open(sys.argv[1]) as f:
        rows = [json.loads(l) for l in f if l.strip()]
except FileNotFoundError:
    pass
print("%-16s %-22s %5s %6s %12s %11s %12s" % ("peer", "model", "batch", "ctx", "step_ms_p50", "tok_s_user", "tok_s_total"))
for r in sorted(rows, key=lambda r: (r["model"], r["peer"], r["batch"])):
    if "error" in r:
        print("%-16s %-22s %5d %6d %12s %11s %12s   # %s" % (r["peer"], r["model"], r["batch"], r["ctx"], "-", "-", "-", r["error"][:90]))
    else:
        print("%-16s %-22s %5d %6d %12.3f %11.1f %12.1f" % (r["peer"], r["model"], r["batch"], r["ctx"],
              r["step_ms_p50"], r["tok_s_user"], r["tok_s_total"]))
EOF
exit $status
