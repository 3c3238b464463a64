#!/bin/bash
# Where a decode step's time goes between launches: contrib/device/kernel_trace.c (a CUPTI
# injection library; the device machine's nsys makes no report, KINDS.md) records every
# kernel node of the replayed graphs, and contrib/device/layer_trace.py prints one
# layer's kernels with their start, duration and the gap before each, and each kernel's
# share of the step (issue 23: a Qwen3-30B-A3B layer takes ~70 us against a ~30 us floor
# on the H200, while its streaming kernels alone measure close to their patterns).
# kdbench decode at batch ${BATCH:-1}, ctx 1024, synthetic weights, for each entry of RUNS
# (model[:weight-format], default: Qwen3-30B-A3B, DeepSeek-V2-Lite, Llama-3.1-8B in bf16,
# fp8-block and int4-g32). The environment passes through (KDEC_ switches for an A/B).
# Packed with the build (libktrace.so built into it here, where the CUDA headers are):
#   PACK_SERVE=0 PACK_TESTS=" " contrib/device/pack.sh build DIR
#   cc -O2 -shared -fPIC -I$CUDA/include contrib/device/kernel_trace.c -o DIR/libktrace.so \
#      -L$CUDA/lib -lcupti; tar+xz DIR
#   device run "tar -xJf DIR.tar.xz && B=DIR bash contrib/device/layer_trace.sh" carry [DIR.tar.xz]
set -u
. contrib/device/lib.sh
use "${B:-devbuild}"
C=tests/data/configs
lib=$PWD/$B/libktrace.so
[ -f "$lib" ] || { say "layer_trace: no $lib (see the usage above)"; exit 1; }
for d in /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
	"$PWD/$B"; do
	[ -e "$d/libcupti.so.13" ] && { export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d; break; }
done
gpu_line
for r in ${RUNS:-qwen3-30b-a3b deepseek-v2-lite llama3.1-8b llama3.1-8b:fp8-block llama3.1-8b:int4-g32}; do
	m=${r%%:*} fmt=
	[ "$m" != "$r" ] && fmt=${r#*:}
	tag=${m}${fmt:+_$fmt}${TAG:+_$TAG}
	KDEC_KTRACE=$L/kt_$tag.csv CUDA_INJECTION64_PATH=$lib step "trace_$tag" 120 \
		"$B/kdbench" decode --model "$C/$m.json" --synthetic-weights ${fmt:+--weight-format $fmt} \
		--backend cuda --batch "${BATCH:-1}" --ctx 1024 --steps 6 --warmup 2 --log-level warn
	python3 contrib/device/layer_trace.py "$L/kt_$tag.csv" "$tag b${BATCH:-1}" 2>&1 | head -n 60 | tee -a "$S"
done
say "total $((SECONDS - t0)) s"
[ -n "${NO_ARCHIVE:-}" ] || tar -C "$L" -czf "$O/logs.tgz" .
