#!/bin/bash
# compute-sanitizer memcheck, racecheck and synccheck of every GPU test, each run small enough to
# finish inside its cap: the attention tests (test_cuda_attn_gqa, _qkv, _mla) in their
# quick cases; test_cuda_moe one half at a time (route, then experts);
# test_cuda_linear quick (kdec's own kernels at M <= 64, without cuBLAS), by halves
# (small, big). Racecheck reports hazards inside cuBLAS's own split-K kernels
# (nvjet_sm90_*_splitK, closed source), so the quick runs leave cuBLAS out. Racecheck
# runs the race-sized lists (KD_TEST_QUICK=2, the specs' middle field).
# The runs go SAN_JOBS (default 8) at a time: memcheck's and synccheck's time is mostly
# the host's (the machine has 16 cores), racecheck's the GPU's (runs side by side slow
# each other down about as much as they overlap). One summary line per test, tool and
# half, as run.sh sanitize writes them, all into one summary.txt; a run cut off by
# SAN_TIMEOUT (default 480 s) says so (exit 124). The logs of every run come back as
# one sanlogs.tgz.
#   device run "KDEC_BUILD_DIR=devbuild bash contrib/device/sanitize_all.sh"  carry ["devbuild"]
# (after contrib/device/pack.sh; SAN_TOOLS="memcheck", "racecheck" or "synccheck" runs one
# tool; SAN_MATCH=REGEX runs only the specs below that match it, e.g. "attn_mla|moe_lat")
set -u
cd "$(dirname "$0")/../.."
R=contrib/device/run.sh
B=${KDEC_BUILD_DIR:-build}	# a PACK_XZ archive is unpacked here, before the runs go side by side
[ -d "$B" ] || [ ! -f "$B.tar.xz" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$B.tar.xz" "$(dirname "$B")"
export SAN_TIMEOUT=${SAN_TIMEOUT:-480}
jobs=${SAN_JOBS:-8}
logs=$(mktemp -d /tmp/kdec-san.XXXXXX)
# the longest first: "VARIABLES (memcheck, synccheck)|VARIABLES (racecheck)|tests".
# Racecheck tracks every shared-memory access, so it takes the race-sized lists
# (KD_TEST_QUICK=2 where a test has one: each kernel form once, small shapes).
specs=(
	"KD_TEST_QUICK=1|KD_TEST_QUICK=2|test_cuda_attn_mla"
	"KD_TEST_PART=experts|KD_TEST_PART=experts|test_cuda_moe"
	"KD_TEST_PART=route|KD_TEST_PART=route|test_cuda_moe"
	"KD_TEST_QUICK=1|KD_TEST_QUICK=2|test_cuda_attn_gqa"
	"KD_TEST_QUICK=1|KD_TEST_QUICK=1|test_cuda_attn_qkv"
	"KD_TEST_QUICK=1 KD_TEST_PART=big|KD_TEST_QUICK=2 KD_TEST_PART=big|test_cuda_linear"
	"KD_TEST_QUICK=1 KD_TEST_PART=small|KD_TEST_QUICK=1 KD_TEST_PART=small|test_cuda_linear"
	"KD_TEST_QUICK=1|KD_TEST_QUICK=1|test_cuda_sample"
	"|KD_TEST_QUICK=1|test_cuda_moe_lat"
	"KD_TEST_QUICK=1|KD_TEST_QUICK=1|test_cuda_moe_q"
	"|KD_TEST_QUICK=2 KD_TEST_PART=mma|test_cuda_linear_q"
	"||test_cuda_allreduce"
	"||test_cuda_topk_slice"
	"||test_cuda_merge test_cuda_ops test_cuda_smoke test_cuda_pdl test_cuda_capture"
)
# one run: its exit status in its folder's rc
job() {
	local dir=$1 tool=$2 spec=$3 vars
	vars=${spec%%|*}
	[ "$tool" = racecheck ] && { vars=${spec#*|}; vars=${vars%%|*}; }
	env $vars SAN_TESTS="${spec##*|}" SAN_TOOLS=$tool RUN_LOGS_DIR="$dir" \
		bash $R sanitize
	echo $? >"$dir/rc"
}
i=0
for spec in "${specs[@]}"; do
	[[ -z ${SAN_MATCH:-} || $spec =~ $SAN_MATCH ]] || continue
	for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
		while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
		i=$((i + 1))
		mkdir -p "$logs/$i"
		job "$logs/$i" "$tool" "$spec" &
	done
done
wait
[ -n "${OUT:-}" ] && tar czf "$OUT/sanlogs.tgz" -C "$logs" .
bad=$((i - $(grep -lx 0 "$logs"/*/rc 2>/dev/null | wc -l)))	# a run without an rc counts
echo "sanitize_all: $i runs, $bad failed or cut off"
[ "$bad" -eq 0 ]
