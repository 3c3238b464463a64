#!/bin/sh
# Checks that docs/ARCHITECTURE.md's map names every source file of the tree and no
# file that is gone: the paths in backquotes in the first cell of each row between
# "<!-- map -->" and "<!-- /map -->" (a row may name a header and its source together). Prints one line per difference, exits 1 if any.
# Usage: check_map.sh [SRCDIR]   (default: the tree this script is in)
set -eu
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
doc=$src/docs/ARCHITECTURE.md
[ -r "$doc" ] || { echo "check_map: $doc not readable" >&2; exit 2; }
cd "$src"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
awk '/<!-- map -->/ { on = 1; next } /<!-- \/map -->/ { on = 0 }
	on && /^\| *`/ { split($0, col, "|"); c = col[2]
		while (match(c, /`[^`]*`/)) { print substr(c, RSTART + 1, RLENGTH - 2); c = substr(c, RSTART + RLENGTH) } }' "$doc" |
	sort >"$tmp/doc"
find client daemon format http ipc kernels kvcache -type f \
	\( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort >"$tmp/tree"
[ -s "$tmp/doc" ] || { echo "check_map: no map rows in $doc" >&2; exit 2; }
bad=0
for p in $(comm -23 "$tmp/tree" "$tmp/doc"); do echo "$p: not in docs/ARCHITECTURE.md's map"; bad=$((bad + 1)); done
for p in $(comm -13 "$tmp/tree" "$tmp/doc"); do echo "$p: in docs/ARCHITECTURE.md's map but not in the tree"; bad=$((bad + 1)); done
if [ "$bad" -gt 0 ]; then echo "check_map: $bad difference(s)"; exit 1; fi
echo "check_map: the map names each of the $(wc -l <"$tmp/tree") source files"
