#!/bin/bash
# Reference checkpoints the project never saw, for issue 22's fidelity run
# (contrib/device/fidelity.sh): the tiny configs of tests/data/tiny with one more layer,
# MLPs 16 wider, bf16 weights, seed 7 and cases of 7, 64 and 300 tokens, written by
# contrib/make_reference.py (torch and transformers from PyPI; seconds on a CPU).
#   contrib/make_unseen_references.sh OUTDIR   -> OUTDIR/<model>_s7/ and OUTDIR/cfg/
set -eu
cd "$(dirname "$0")/.."
out=${1:?usage: contrib/make_unseen_references.sh OUTDIR}
mkdir -p "$out/cfg"
for c in deepseek_v2 deepseek_v3 kimi_k2 qwen3_moe llama qwen3; do
	python3 - "tests/data/tiny/$c.json" "$out/cfg/${c}_s7.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["torch_dtype"] = "bfloat16"
c.pop("dtype", None)
c["num_hidden_layers"] += 1
for k in ("moe_intermediate_size", "intermediate_size"):
    if k in c:
        c[k] += 16
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
done
python3 contrib/make_reference.py --seed 7 --lengths 7,64,300 --out "$out" "$out"/cfg/*.json
echo "unseen references: $(ls -d "$out"/*_s7 | wc -l) models in $out"
