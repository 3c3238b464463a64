#!/bin/sh
# GGUF checkpoints into kdec's model:
#  1. the five golden models as converted by llama.cpp's own converter
#     (tests/make_gguf_golden.sh) through test_golden: the same references, the same
#     tolerance as the safetensors checkpoints they were made from;
#  2. test_gguf_model: metadata -> config equals config.json's, a Q8_0 conversion
#     checked loosely, damaged files refused with one clear line;
# The SmolLM2 part (a real model, fetched) is its own test, gguf_smollm2.sh, so that its
# absence shows as SKIP.
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
export top_srcdir

KDEC_GOLDEN_GGUF="$top_srcdir/tests/data/gguf-golden" "$top_builddir/tests/test_golden" || exit 1
"$top_builddir/tests/test_gguf_model"
