#!/bin/sh
# docs/ARCHITECTURE.md's map names every source file of the tree (and none that is
# gone), and the check fails when a file is added without a row.
set -eu
src=${top_srcdir:-$(cd "$(dirname "$0")/.." && pwd)}
check=$src/contrib/check_map.sh

sh "$check" "$src"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for d in docs client daemon format ipc kernels kvcache; do cp -R "$src/$d" "$tmp/"; done
chmod -R u+w "$tmp"
echo '/* a file nobody mapped */' >"$tmp/daemon/engine/unmapped.c"
rm "$tmp/kvcache/kv_pool.c"
if sh "$check" "$tmp" >"$tmp/out" 2>&1; then
	cat "$tmp/out"
	echo "FAIL: check_map passed a tree with an unmapped file and a mapped file gone"
	exit 1
fi
cat "$tmp/out"
grep -q '^daemon/engine/unmapped.c: not in' "$tmp/out" || { echo "FAIL: the unmapped file is not named"; exit 1; }
grep -q '^kvcache/kv_pool.c: in docs/ARCHITECTURE.md.s map but not in the tree' "$tmp/out" ||
	{ echo "FAIL: the missing file is not named"; exit 1; }
echo "PASS: the map names every source file; an unmapped and a missing file are both reported"
