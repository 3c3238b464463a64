#!/bin/bash
# Packs a CUDA build into a small folder to carry to the GPU machine (the device tool
# carries at most 64 MiB beside the tree): binaries without debug info, the GPU tests,
# test_golden and the kernel benchmarks (tests/bench), the real kdrun/kdctl (not libtool wrappers, whose
# paths name this machine), and devlibs/ with libev, liburing and libkdclient.
#   contrib/device/pack.sh [BUILD [OUT]]    (defaults: build devbuild)
# The carry limit counts the tracked tree too (~28 MB now): PACK_TESTS="test_cuda_attn_gqa bench_cuda_attn ..."
# packs only those test programs, PACK_SERVE=0 leaves out kdecd, kdrun and kdctl.
# then: device run "KDEC_BUILD_DIR=devbuild bash contrib/device/run.sh check"  carry ["devbuild"]
# PACK_XZ=1 also writes OUT.tar.xz (xz -9: the binaries share libkdcuda's code, so all the
# GPU tests, test_golden, kdbench and kdecd, ~70 MB, come to ~4 MB) and removes OUT:
# carry ["OUT.tar.xz"] instead; run.sh and sanitize_all.sh unpack it where OUT is absent.
# Put what else the call needs (another build's kdbench, a scratch script) into OUT first
# with PACK_XZ=0, then archive it by hand the same way.
set -eu
cd "$(dirname "$0")/../.."
src=${1:-build} dst=${2:-devbuild}
[ -x "$src/kdbench" ] || { echo "pack: no $src/kdbench: build first (make -C $src all check TESTS=)" >&2; exit 1; }
rm -rf "$dst"
mkdir -p "$dst/tests/bench" "$dst/devlibs"
cp "$src/kdbench" "$dst/"
if [ "${PACK_SERVE:-1}" != 0 ]; then
	cp "$src/kdecd" "$dst/"
	cp "$src/.libs/kdrun" "$src/.libs/kdctl" "$dst/"
fi
cp -L "$src"/.libs/libkdclient.so.[0-9] "$dst/devlibs/"
cp -L /lib/x86_64-linux-gnu/libev.so.4 /lib/x86_64-linux-gnu/liburing.so.2 "$dst/devlibs/"
for t in "$src"/tests/test_cuda_* "$src/tests/test_golden" "$src"/tests/bench/bench_cuda_*; do
	case $t in *.o) continue ;; esac
	if [ -n "${PACK_TESTS:-}" ]; then
		case " $PACK_TESTS " in *" $(basename "$t") "*) ;; *) continue ;; esac
	fi
	case $t in */bench/*) to=$dst/tests/bench/ ;; *) to=$dst/tests/ ;; esac
	[ -x "$t" ] && cp "$t" "$to"
done
strip --strip-debug "$dst"/kd* $(find "$dst/tests" -type f)	# tests/ may be empty (PACK_TESTS)
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
# what travels: the folder itself when carried as it is, its archive with PACK_XZ
carried() { echo "with the tracked tree $(( ($(du -sb "$1" | cut -f1) + ${tree:-0}) >> 20 )) MiB of the 64 MiB carry limit"; }
[ "${PACK_XZ:-0}" = 1 ] || echo "pack: $dst $(du -sh "$dst" | cut -f1), carried as it is $(carried "$dst") (an xz archive of it is about a tenth)" >&2
if [ "${PACK_XZ:-0}" = 1 ]; then
	tar -C "$(dirname "$dst")" -cf - "$(basename "$dst")" | xz -9 -T1 >"$dst.tar.xz"
	rm -rf "$dst"
	echo "pack: $dst.tar.xz $(du -h "$dst.tar.xz" | cut -f1), $(carried "$dst.tar.xz") (carry it; run.sh unpacks it)" >&2
fi
