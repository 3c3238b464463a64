#!/bin/bash
# Where a decode step's time goes between launches: nsys with --cuda-graph-trace=node
# traces every kernel node of the replayed graphs, and contrib/device/layer_trace.py prints
# one layer's kernels with their start, duration and the gap before each (issue 23: a
# Qwen3-30B-A3B layer takes ~70 us against a ~30 us floor on the H200, while its
# streaming kernels alone measure close to their patterns). kdbench decode at batch 1,
# ctx 1024, synthetic weights, on MODELS (default: Qwen3-30B-A3B, DeepSeek-V2-Lite,
# Llama-3.1-8B). Needs nsys on the machine (the script says so when it has none).
# Packed with the build it runs:
#   PACK_SERVE=0 PACK_TESTS=" " contrib/device/pack.sh build DIR; tar+xz DIR;
#   device run "tar -xJf DIR.tar.xz && B=DIR bash contrib/device/layer_trace.sh" carry [DIR.tar.xz]
set -u
. contrib/device/lib.sh
use "${B:-devbuild}"
C=tests/data/configs
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys \
	/opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)
[ -n "$nsys" ] || { say "layer_trace: no nsys on this machine"; exit 1; }
gpu_line
for m in ${MODELS:-qwen3-30b-a3b deepseek-v2-lite llama3.1-8b}; do
	step "nsys_$m" 60 "$nsys" profile --cuda-graph-trace=node -o "$L/ns_$m" --force-overwrite true \
		"$B/kdbench" decode --model "$C/$m.json" --synthetic-weights --backend cuda --batch 1 \
		--ctx 1024 --steps 6 --warmup 2 --log-level warn
	"$nsys" stats --report cuda_gpu_trace --format csv -o "$L/tr_$m" "$L/ns_$m.nsys-rep" >/dev/null 2>&1
	f=$(ls "$L"/tr_"$m"*.csv 2>/dev/null | head -n 1)
	case $m in llama* | qwen3-8b*) key=qkv_post ;; *) key=m1_down ;; esac
	[ -n "$f" ] && python3 contrib/device/layer_trace.py "$f" "$key" 2>&1 | tail -n 60 | tee -a "$S"
done
say "total $((SECONDS - t0)) s"
tar -C "$L" -czf "$O/logs.tgz" --exclude='*.nsys-rep' --exclude='*.sqlite' .
