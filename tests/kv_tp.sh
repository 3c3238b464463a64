#!/bin/sh
# The KV cache tests again under tensor parallel on the cpu backend: test_sessions
# (multi-turn against cold runs, offload and restore bit for bit, the 3000-operation
# property test), test_host_mover (moves on the mover's threads beside decoding) and
# test_snapshot (restart and continue, refusals) with every rank's cache in the host
# tier's frames (daemon/engine/kv_spans.h): tp 2 with the KV heads split, tp 3 with one
# KV head replicated on every rank (stored once, restored to all) and an MLA latent
# replicated, and tp 3 with the MLA latent split by tokens (--mla-cp; 8-token blocks
# that 3 does not divide: each rank a different share of each block). The tiny configs
# get shapes the ranks split (KDEC_TEST_CFG, tests/kvtest.h).
set -u
test_name=kv_tp
. "${top_srcdir:-.}/tests/testutil.sh"

split='{"num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 168, "moe_intermediate_size": 24}'
twins='{"num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 168, "moe_intermediate_size": 24}'
for run in "2||$split" "3||$twins" "3|1|$twins"; do
	tp=${run%%|*}
	rest=${run#*|}
	cp=${rest%%|*}
	cfg=${rest#*|}
	for t in test_sessions test_host_mover test_snapshot; do
		if KDEC_TEST_TP=$tp KDEC_TEST_MLA_CP=$cp KDEC_TEST_CFG=$cfg "$B/tests/$t" >"$tmp/$t.log" 2>&1; then
			echo "$t at tp $tp${cp:+ --mla-cp}: $(tail -n 1 "$tmp/$t.log")"
			ok
		else
			fail "$t at tp $tp${cp:+ --mla-cp}: $(grep FAIL "$tmp/$t.log" | head -n 3)"
		fi
	done
done
verdict
