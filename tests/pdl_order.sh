#!/bin/sh
# The programmatic-dependent-launch rule, read off the built kernels' SASS (no GPU
# needed): in every kernel that waits for the grid dependency (ACQBULK), no global
# access the control flow can reach before that wait, except the early loads of
# launch_check.cuh's k_cuda_pdl_early helpers (weights, settled step inputs), and no
# trigger of the next launch before it but in a relay (docs/ARCHITECTURE.md,
# "Programmatic dependent launch"; contrib/check_pdl_order.py). Controls:
# tests/pdl_planted.cu's bad kernel and its early trigger must fail the check, its good
# kernel and its relay pass. Skips (77, saying why) without a CUDA build, python3 or
# cuobjdump (contrib/fetch-cuobjdump.sh fetches it from PyPI).
set -u
src=${top_srcdir:-$(cd "$(dirname "$0")/.." && pwd)}
build=${top_builddir:-.}
check=$src/contrib/check_pdl_order.py
lib=$build/libkdcuda.a
planted=$build/tests/pdl_planted.o

skip() { echo "pdl_order: SKIP: $*"; exit 77; }
[ -f "$lib" ] || skip "no CUDA build here ($lib absent: configured --without-cuda?)"
[ -f "$planted" ] || skip "$planted not built (make check builds it with CUDA)"
command -v python3 >/dev/null || skip "no python3 to read the disassembly"
cache=${KDEC_CACHE:-$HOME/.cache/kdec}
for d in "" "${CUDA_HOME:-/usr/local/cuda}/bin" /usr/local/cuda/bin "$cache/cuda-tools/nvidia/cu13/bin"; do
	if [ -z "$d" ]; then
		command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null && break
	elif [ -x "$d/cuobjdump" ] && [ -x "$d/nvdisasm" ]; then
		PATH=$d:$PATH
		break
	fi
done
command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null ||
	skip "no cuobjdump and nvdisasm (run contrib/fetch-cuobjdump.sh)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

# The marker is the early helpers' alone: any other source that writes it could make
# a produced buffer's load look early.
others=$(grep -rlE 'L2::(256|128)B' "$src/kernels" | grep -v '/kernels/cuda/launch_check.cuh$')
if [ -n "$others" ]; then
	echo "FAIL: the early-load markers .L2::256B / .L2::128B outside launch_check.cuh: $others"
	fail=1
fi

# Loads from module-scope tables pass the check (constant bank 4): such data must be
# const, or a kernel could write what another reads before its wait.
writable=$(grep -rnE '^[[:space:]]*(static[[:space:]]+)?__device__[[:space:]]+[^(]*[;=[]' "$src/kernels" |
	grep -v '__device__[[:space:]]\+const[[:space:]]')
if [ -n "$writable" ]; then
	echo "FAIL: writable __device__ data under kernels/ (only const tables may be read before a wait): $writable"
	fail=1
fi

cuobjdump -sass "$lib" >"$tmp/lib.sass" 2>"$tmp/err" || { cat "$tmp/err"; echo "FAIL: cuobjdump -sass $lib"; exit 1; }
if python3 "$check" --waivers "$src/kernels/cuda" "$tmp/lib.sass" >"$tmp/lib.out"; then
	tail -n 1 "$tmp/lib.out"
	grep ': waived' "$tmp/lib.out"
else
	cat "$tmp/lib.out"
	echo "FAIL: a kernel of libkdcuda.a accesses global memory before its grid-dependency wait"
	fail=1
fi

cuobjdump -sass "$planted" >"$tmp/planted.sass" 2>"$tmp/err" || { cat "$tmp/err"; echo "FAIL: cuobjdump -sass $planted"; exit 1; }
python3 "$check" --waivers "$src/tests" "$tmp/planted.sass" >"$tmp/planted.out"
rc=$?
cat "$tmp/planted.out"
if [ $rc -ne 1 ] || ! grep -q '^_Z15pdl_planted_bad.*global access before the wait' "$tmp/planted.out"; then
	echo "FAIL: the planted kernel that reads a produced buffer before its wait was not caught (exit $rc)"
	fail=1
fi
if ! grep -q '^_Z19pdl_planted_trigger.*launch_dependents before the wait' "$tmp/planted.out"; then
	echo "FAIL: the planted kernel that triggers the next launch before its wait, not a relay, was not caught"
	fail=1
fi
if grep -qE '^_Z16pdl_planted_good|^_Z17pdl_planted_relay' "$tmp/planted.out"; then
	echo "FAIL: the planted kernel that reads only weights early, or the planted relay, was reported"
	fail=1
fi
[ $fail -eq 0 ] && echo "PASS: no kernel reads before its wait but through the early helpers, no kernel but a relay triggers before it; the planted read and trigger are caught"
exit $fail
