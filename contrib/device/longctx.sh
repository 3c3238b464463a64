#!/bin/bash
# Issue 22's long-context check on the GPU machine: synthetic models of each family with
# long positions (llama3 rope scaling, YaRN for both MLA models) decode at 8k and 32k
# tokens (64k for MLA: deepseek_v3) on cuda against the CPU reference's prefill of the
# same tokens. At 8k the CPU runs again with its cache rounded to bf16 (--kv-bf16): the
# bf16 KV cache's own share of the error, and the GPU against a reference that stores
# what it stores.
# The GPU prefills N - 4 tokens, then decodes 4 one at a time (the split-KV decode
# kernels and their merge at long context); MoE models' routing is held equal (the
# GPU's --dump-routing forced on the CPU) so the numbers are the kernels' and the bf16
# KV cache's error. At 32k, GQA decode also at forced split counts
# (KDEC_ATTN_DEC_SPLITS) and MLA decode at split floors that give 1 to the most splits
# (KDEC_MLA_SPLIT_MIN).
#   device run: KDEC_BUILD_DIR=devbuild bash contrib/device/longctx.sh   (logs in $OUT)
# LONG_MODELS, LONG_LENS_GQA, LONG_LENS_MLA, LONG_SPLITS: other models, lengths, split counts.
set -u
. contrib/device/lib.sh
use "${KDEC_BUILD_DIR:-devbuild}"
W=$(mktemp -d /tmp/kdec-longw.XXXXXX)
S=$O/longctx.txt

# long_cfg SRC DST [real-mla]: the config with room for 65k positions, bf16 (golden
# llama3 carries llama3 rope scaling from a 64-token original context). real-mla: the
# latent of the full-size models (kv_lora 512, rope key 64), which the tensor-core MLA
# decode kernel and its split/merge take (the tiny dims go to the tiled kernel)
long_cfg() {
	python3 - "$@" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
if len(sys.argv) > 3:
    c.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
c["max_position_embeddings"] = 70000
c["torch_dtype"] = "bfloat16"
c.pop("dtype", None)
json.dump(c, open(sys.argv[2], "w"))
PY
}

# compare NAME N VOCAB GPU CPU: rel L2 at sampled prefill rows and every decode row (of
# GPU against CPU: the GPU's error; or of one CPU run against another)
compare() {
	python3 - "$@" <<'PY' | tee -a "$S"
import sys, numpy as np
name, n, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = np.fromfile(sys.argv[4], np.float32).reshape(n, v); c = np.fromfile(sys.argv[5], np.float32).reshape(n, v)
e = lambda r: float(np.linalg.norm(g[r] - c[r]) / np.linalg.norm(c[r]))
pre = [n // 8, n // 2, n - 5]; dec = list(range(n - 4, n))
print(f"longctx {name:28s} N={n:6d} prefill rows " + " ".join(f"{r}:{e(r):.2e}" for r in pre)
      + " | decode rows " + " ".join(f"{r}:{e(r):.2e}" for r in dec) + f" | worst {max(e(r) for r in pre + dec):.2e}")
PY
}

mkdir -p "$W/cfg"
long_cfg tests/data/golden/llama3/config.json "$W/cfg/llama3.json"
for m in qwen3_moe deepseek_v2 deepseek_v3; do long_cfg tests/data/tiny/$m.json "$W/cfg/$m.json"; done
long_cfg tests/data/tiny/deepseek_v3.json "$W/cfg/mla512.json" real-mla
say "# longctx.sh $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader)"
for m in ${LONG_MODELS:-llama3 qwen3_moe deepseek_v2 deepseek_v3 mla512}; do
	cfg=$W/cfg/$m.json
	vocab=$(python3 -c "import json; print(json.load(open('$cfg'))['vocab_size'])")
	moe=$(python3 -c "import json; c = json.load(open('$cfg')); print(1 if c.get('num_experts') or c.get('n_routed_experts') else 0)")
	case $m in
	deepseek_v3) lens=${LONG_LENS_MLA:-8192 32768 65536} ;;
	mla512) lens=${LONG_LENS_MLA512:-8192} ;;	# the CPU's latent attention is 30x the tiny one's
	*) lens=${LONG_LENS_GQA:-8192 32768} ;;
	esac
	for n in $lens; do
		python3 -c "print(','.join(str((i * 7919 + 13) % $vocab) for i in range($n)))" >"$W/tok"
		common=(--model "$cfg" --synthetic-weights --seed 3 --tokens "@$W/tok" --kv-tokens $((n + 64)) --log-level warn)
		rt=(); [ "$moe" = 1 ] && rt=(--dump-routing "$W/rt")
		timeout 120 "$B/kdbench" logits "${common[@]}" --backend cuda --incremental --prefill $((n - 4)) \
			--out "$W/gpu.f32" "${rt[@]}" 2>>"$O/longctx.log" || { say "longctx $m N=$n: cuda failed"; continue; }
		rt=(); [ "$moe" = 1 ] && rt=(--force-routing "$W/rt")
		timeout 240 "$B/kdbench" logits "${common[@]}" --backend cpu --out "$W/cpu.f32" "${rt[@]}" \
			2>>"$O/longctx.log" || { say "longctx $m N=$n: cpu failed or timed out"; continue; }
		compare "$m" $n $vocab "$W/gpu.f32" "$W/cpu.f32"
		if [ $n = 8192 ] && timeout 240 "$B/kdbench" logits "${common[@]}" --backend cpu --kv-bf16 \
			--out "$W/cpu16.f32" "${rt[@]}" 2>>"$O/longctx.log"; then
			compare "$m cpu-kv-bf16 vs cpu" $n $vocab "$W/cpu16.f32" "$W/cpu.f32"
			compare "$m gpu vs cpu-kv-bf16" $n $vocab "$W/gpu.f32" "$W/cpu16.f32"
		fi
		if [ $m = llama3 ] && [ $n = 32768 ]; then
			for sp in ${LONG_SPLITS:-1 2 8 32 128}; do
				KDEC_ATTN_DEC_SPLITS=$sp timeout 120 "$B/kdbench" logits "${common[@]}" --backend cuda \
					--incremental --prefill $((n - 4)) --out "$W/gpu.f32" 2>>"$O/longctx.log" &&
					compare "$m splits=$sp" $n $vocab "$W/gpu.f32" "$W/cpu.f32"
			done
		fi
		if [ $m = mla512 ]; then	# split floors: the most splits .. 1
			for fl in ${LONG_MLA_FLOORS:-0 64 512 2048 65536}; do
				KDEC_MLA_SPLIT_MIN=$fl timeout 120 "$B/kdbench" logits "${common[@]}" --backend cuda \
					--incremental --prefill $((n - 4)) --out "$W/gpu.f32" "${rt[@]}" \
					2>>"$O/longctx.log" &&
					compare "$m split-min=$fl" $n $vocab "$W/gpu.f32" "$W/cpu.f32"
			done
		fi
	done
done
rm -rf "$W"
