#!/bin/bash
# Issue 22's GPU fidelity run (docs/MODELS.md "Fidelity on the GPU"), on the GPU machine
# with a packed build (contrib/device/pack.sh):
#   device run: KDEC_BUILD_DIR=devbuild FID_COMMIT=abc1234 bash contrib/device/fidelity.sh
# 1. the router's and the MoE kernels' own tests (test_cuda_moe, test_cuda_linear);
# 2. test_golden on cuda with its flip criterion, the fp32 router (the default) and, for
#    comparison, KDEC_ROUTER_FP32=0 (the router on the linear layers' bf16-x path);
# 3. references the project never saw: contrib/make_reference.py with another seed and
#    other dims (one more layer, wider experts, bf16), T = 7, 64, 300, through the same
#    test_golden (KDEC_GOLDEN_EXTRA);
# 4. kdbench logits --dump-routing on cuda, then --force-routing on cpu (the tool).
# Logs under $OUT; summary.txt holds the lines the fidelity table is made of.
# FID_STEPS picks the parts (default "tests golden unseen unseen32 tool"); FID_REF_DIR: the unseen
# references made beforehand (contrib/make_unseen_references.sh), so the GPU machine
# needs no torch.
set -u
. contrib/device/lib.sh
use "${KDEC_BUILD_DIR:-devbuild}"

say "# fidelity.sh commit ${FID_COMMIT:-?} $(date -u +%FT%TZ)"
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
steps=" ${FID_STEPS:-tests golden unseen unseen32 tool} "
wanted() { [[ $steps == *" $1 "* ]]; }
wanted tests && for t in test_cuda_moe test_cuda_linear; do
	timeout 240 "$B/tests/$t" >"$O/$t.log" 2>&1
	say "$t: exit $? ($(tail -n 1 "$O/$t.log"))"
done

golden() {	# golden NAME [ENV...]: test_golden on cuda, its fidelity lines kept
	local name=$1
	shift
	env "$@" KDEC_TEST_BACKEND=cuda timeout 300 "$B/tests/test_golden" >"$O/golden_$name.log" 2>&1
	say "golden $name: exit $? ($(tail -n 1 "$O/golden_$name.log"))"
	grep -E "fidelity:|row [0-9]+ \(position" "$O/golden_$name.log" | sed "s/^/$name /" >>"$S"
}
if wanted golden; then
golden fp32router
golden bf16router KDEC_ROUTER_FP32=0
# the rows left over without a flip: bf16 rounding of activations (prefill GEMMs on
# the tensor cores, the prefill attention's bf16 tiles), or a kernel error? The same
# with every linear on fp32 x and the CUDA-core prefill attention
golden fp32act KDEC_LINEAR_FP32X=1 KDEC_ATTN_PREFILL_MMA=0
fi

# unseen checkpoints: seed 7, other dims, bf16 (contrib/make_unseen_references.sh); made
# here unless FID_REF_DIR names them made elsewhere (torch on the CPU: seconds on any host)
ref7=${FID_REF_DIR:-/tmp/kdec-ref7}
if wanted unseen; then
if [ -z "${FID_REF_DIR:-}" ]; then
	contrib/make_unseen_references.sh "$ref7" >"$O/make_reference.log" 2>&1
	say "make_unseen_references: exit $? ($(tail -n 1 "$O/make_reference.log"))"
fi
extra=$(ls -d "$ref7"/*_s7/ 2>/dev/null | sed 's:/$::' | paste -sd:)
golden unseen KDEC_GOLDEN_EXTRA="$extra"
wanted unseen32 && golden unseen_fp32act KDEC_GOLDEN_EXTRA="$extra" KDEC_LINEAR_FP32X=1 KDEC_ATTN_PREFILL_MMA=0
fi

# the tool: cuda routing forced on the cpu
m=tests/data/golden/deepseek_v3
wanted tool && {
toks=$(python3 -c "import json; print(','.join(map(str, json.load(open('$m/golden.json'))['cases'][-1]['tokens'])))")
"$B/kdbench" logits --model $m --backend cuda --tokens "$toks" --out "$O/dsv3_cuda.f32" \
	--dump-routing "$O/dsv3_cuda.routing" --log-level warn 2>"$O/kdbench.log"
"$B/kdbench" logits --model $m --backend cpu --tokens "$toks" --out "$O/dsv3_cpu_forced.f32" \
	--force-routing "$O/dsv3_cuda.routing" --log-level warn 2>>"$O/kdbench.log"
say "kdbench force-routing: $(tail -n 1 "$O/kdbench.log")"
}
tar czf "$O/logs.tgz" -C "$O" --exclude logs.tgz --exclude '*.f32' . 2>/dev/null
rm -f "$O"/*.f32	# in logs.tgz; the device returns few files
