#!/bin/sh
# The real SmolLM2-135M GGUF (Q4_1) against transformers' logits for the same file
# (tests/data/smollm2): test_gguf_model's smollm2 part, a test of its own so that a
# machine without the model (contrib/fetch-smollm2.sh) reports SKIP (77), not a pass.
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
export top_srcdir
exec "$top_builddir/tests/test_gguf_model" smollm2
