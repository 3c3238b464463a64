#!/bin/sh
# The include floors (docs/ARCHITECTURE.md, "Floors"): the tree passes the check, and
# a copy of it with one upward include of each kind fails it, naming each.
set -eu
src=${top_srcdir:-$(cd "$(dirname "$0")/.." && pwd)}
check=$src/contrib/check_floors.sh

sh "$check" "$src"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for d in docs client daemon format ipc kernels kvcache; do cp -R "$src/$d" "$tmp/"; done
chmod -R u+w "$tmp"
echo '#include "daemon/engine/engine.h"' >>"$tmp/client/kdctl.c"
echo '#include "kernels/cpu/k_cpu.h"' >>"$tmp/kernels/cuda/device.cu"
echo '#include "daemon/engine/engine_internal.h"' >>"$tmp/daemon/kdbench/kdbench_kvcache.c"
echo '#include "log.h"' >>"$tmp/daemon/base/cli.c"
if sh "$check" "$tmp" >"$tmp/out" 2>&1; then
	cat "$tmp/out"
	echo "FAIL: check_floors passed a tree with upward includes"
	exit 1
fi
cat "$tmp/out"
for want in 'client/kdctl.c:.*client/ does not stand on daemon/engine/' \
	'kernels/cuda/device.cu:.*kernels/cuda/ does not stand on kernels/cpu/' \
	'daemon/kdbench/kdbench_kvcache.c:.*an _internal.h is for its own folder' \
	'daemon/base/cli.c:.*name headers from the top of the tree' \
	'check_floors: 4 upward or private include'; do
	grep -q "$want" "$tmp/out" || { echo "FAIL: no line matching: $want"; exit 1; }
done
echo "PASS: the tree's includes run downward; each of 4 planted violations is reported"
