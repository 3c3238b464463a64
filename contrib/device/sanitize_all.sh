#!/bin/bash
# compute-sanitizer memcheck and racecheck of every GPU test, each run small enough to
# finish inside its cap: test_cuda_attn in its quick cases, one half at a time
# (KD_TEST_PART=gqa, then mla); test_cuda_moe one half at a time (route, then experts).
# One summary line per test, tool and half, as run.sh sanitize writes them; a run cut
# off by SAN_TIMEOUT (default 240 s) says so (exit 124).
#   device run "KDEC_BUILD_DIR=devbuild bash contrib/device/sanitize_all.sh"  carry ["devbuild"]
# (after contrib/device/pack.sh; SAN_TOOLS="memcheck" or "racecheck" runs one tool)
set -u
cd "$(dirname "$0")/../.."
R=contrib/device/run.sh
export SAN_TOOLS=${SAN_TOOLS:-memcheck racecheck}
status=0
for part in gqa mla; do
	KD_TEST_QUICK=1 KD_TEST_PART=$part SAN_TESTS=test_cuda_attn bash $R sanitize || status=1
done
for part in route experts; do
	KD_TEST_PART=$part SAN_TESTS=test_cuda_moe bash $R sanitize || status=1
done
SAN_TESTS="test_cuda_linear test_cuda_merge test_cuda_ops test_cuda_sample test_cuda_smoke" \
	bash $R sanitize || status=1
exit $status
