# The prologue every one-call device script shares (sourced from the tree's root, where
# the device tool runs a command): the multicast switches off, libnccl from the Python
# wheel where the machine has no system copy, $O (results that come back: $OUT), $L (the
# full logs, archived into $O at the end by the script), $S (the summary), and:
#   use BUILD               LD_LIBRARY_PATH, top_srcdir and top_builddir for a packed build
#                           (unpacked first from BUILD.tar.xz where BUILD is absent)
#   say LINE...             to stdout and the summary
#   step NAME LIMIT CMD...  CMD cut at LIMIT seconds, or at what is left of DEADLINE
#                           seconds since the start; its output to $L/NAME.log, one
#                           summary line with its exit status, time and last line
#   dec NAME MODEL BATCHES FORMAT [ENV...]
#                           one kdbench decode (synthetic weights, cuda, ctx 1024,
#                           DEC_STEPS / DEC_WARMUP steps; FORMAT bf16 or a
#                           --weight-format; Kimi-K2 2 layers, DeepSeek-V3 4) under
#                           ENV, a step of 45 s; its table rows into the summary (320
#                           columns: the last, experts and uni, included), the
#                           first call's preceded by kdbench's column names ("model
#                           batch ctx p50_ms ... replay_ms ...": replay is the 7th);
#                           KDBENCH: another kdbench than $B's
# Scripts set DEADLINE (default 540: the device call's 600 s limit, room to archive) and
# O/L/S beforehand to change them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
O=${O:-${OUT:-$(mktemp -d /tmp/kdec-dev.XXXXXX)}}
mkdir -p "$O"
L=${L:-$(mktemp -d /tmp/kdec-devL.XXXXXX)}
S=${S:-$O/summary.txt}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
G=$PWD/tests/data/golden
t0=$SECONDS
export L

use() {
	[ -d "$1" ] || [ ! -f "$1.tar.xz" ] ||
		python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1] + ".tar.xz").extractall(".")' "$1"
	B=$1
	export B top_srcdir=$PWD top_builddir=$PWD/$B
	export LD_LIBRARY_PATH="$PWD/$B/devlibs${nccl:+:$nccl/lib}"
}

say() { echo "$*" | tee -a "$S"; }

gpu_line() {
	nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
}

step() {
	local n=$1 lim=$2 t=$SECONDS rc left
	shift 2
	left=$((${DEADLINE:-540} - (SECONDS - t0)))
	[ "$left" -lt "$lim" ] && lim=$left
	if [ "$lim" -le 5 ]; then
		say "== $n: skipped (no time left of ${DEADLINE:-540} s)"
		return 124
	fi
	timeout "$lim" "$@" >"$L/$n.log" 2>&1
	rc=$?
	say "== [$((SECONDS - t0)) s] $n: rc $rc in $((SECONDS - t)) s: $(tail -n 1 "$L/$n.log" | cut -c1-220)"
	return $rc
}

dec() {
	local n=$1 m=$2 b=$3 f=$4 extra=
	shift 4
	[ "$f" = bf16 ] || extra="--weight-format $f"
	case $m in kimi-k2) extra="$extra --layers 2" ;; deepseek-v3) extra="$extra --layers 4" ;; esac
	step "$n" 45 env "$@" "${KDBENCH:-$B/kdbench}" decode --synthetic-weights --backend cuda --ctx 1024 \
		--steps "${DEC_STEPS:-16}" --warmup "${DEC_WARMUP:-4}" --batch "$b" \
		--model "tests/data/configs/$m.json" $extra
	if [ -z "${DEC_HEADER_DONE:-}" ]; then	# kdbench's column names, once a call
		grep -m1 -E '^ *batch +ctx' "$L/$n.log" | sed "s/^/model /" | cut -c1-320 |
			tee -a "$S" | grep -q . && DEC_HEADER_DONE=1
	fi
	grep -E '^ +[0-9]' "$L/$n.log" | sed "s/^/$n /" | cut -c1-320 | tee -a "$S"
}
