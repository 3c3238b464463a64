#!/bin/sh
# Remakes tests/data/gguf-golden/: the five golden checkpoints (tests/data/golden/*,
# bf16 safetensors) converted to GGUF by llama.cpp's own converter, so that the GGUF
# path is checked against files an independent tool wrote. Not run by make check.
#
# The converter: convert_hf_to_gguf.py (+ its conversion/ package and gguf-py) of
# llama.cpp commit 0c1e57098, as vendored in the llama-cpp-python 0.3.36 source
# distribution on PyPI (sha256 below). Needs python3 with torch, numpy, safetensors.
# One change, made from outside by a wrapper: the tiny goldens have no tokenizer, so
# every model class's set_vocab writes "no vocabulary" (tokenizer.ggml.model = none);
# tensors and metadata are converted untouched.
#
#   <name>.gguf       --outtype bf16: the checkpoints are bf16, so this is lossless
#                     (f32 would pass 3 MB for deepseek_v3)
#   llama3-q8_0.gguf  --outtype q8_0 (the converter's own Q8_0; llama.cpp's quantize
#                     tool, needed for Q4_K, is a C++ build and is not used here)
#   llama31_rope.gguf (+ .config.json) a 1-layer random llama with Llama 3.1's rope
#                     scaling at head_dim 128 (made here by transformers, seed 0), for
#                     the rope_freqs.weight -> llama3 parameters check; needs transformers
set -eu
top=$(cd "$(dirname "$0")/.." && pwd)
out="$top/tests/data/gguf-golden"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

cd "$work"
pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d sdist >/dev/null
echo "$sdist_sha  sdist/llama_cpp_python-0.3.36.tar.gz" | sha256sum -c -
tar xzf sdist/llama_cpp_python-0.3.36.tar.gz
lc="$work/llama_cpp_python-0.3.36/vendor/llama.cpp"

cat > convert.py <<'PY'
import runpy, sys
lc = sys.argv.pop(1)
sys.path[:0] = [lc, lc + "/gguf-py"]
import conversion
import conversion.base as base

def no_vocab(self):
    self._set_vocab_none()

def patch(cls):
    if "set_vocab" in cls.__dict__:
        cls.set_vocab = no_vocab
    for sub in cls.__subclasses__():
        patch(sub)

find = conversion.get_model_class
def get_model_class(*a, **k):
    c = find(*a, **k)
    patch(base.TextModel)
    return c
conversion.get_model_class = get_model_class
sys.argv[0] = lc + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
PY

mkdir -p "$out"
for m in llama3 qwen3 qwen3_moe deepseek_v2 deepseek_v3; do
	# the directory's name becomes general.name: keep it fixed for identical output
	mkdir "src_$m"
	cp "$top/tests/data/golden/$m/config.json" "$top/tests/data/golden/$m/model.safetensors" "src_$m/"
	python3 convert.py "$lc" "src_$m" --outtype bf16 --outfile "$out/$m.gguf" >"log_$m" 2>&1 ||
		{ cat "log_$m"; exit 1; }
done
python3 convert.py "$lc" src_llama3 --outtype q8_0 --outfile "$out/llama3-q8_0.gguf" >log_q8 2>&1 ||
	{ cat log_q8; exit 1; }

python3 - src_llama31_rope <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=128,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                  bos_token_id=1, eos_token_id=2, dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
python3 convert.py "$lc" src_llama31_rope --outtype bf16 --outfile "$out/llama31_rope.gguf" >log_l31 2>&1 ||
	{ cat log_l31; exit 1; }
cp src_llama31_rope/config.json "$out/llama31_rope.config.json"
ls -l "$out"
