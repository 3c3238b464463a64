#!/bin/sh
# Checks that every #include "..." in the tree runs downward: a file may include
# headers of its own folder and of the folders it stands on, as the floors table
# in docs/ARCHITECTURE.md lists them (transitively), and an *_internal.h only from
# the folder it sits in. Prints one line per violation and exits 1 if there is any.
# Usage: check_floors.sh [SRCDIR]   (default: the tree this script is in)
set -eu
src=${1:-$(cd "$(dirname "$0")/.." && pwd)}
doc=$src/docs/ARCHITECTURE.md
[ -r "$doc" ] || { echo "check_floors: $doc not readable" >&2; exit 2; }

# The table: rows "| `folder/` | `a/`, `b/` |" between the "<!-- floors -->" and
# "<!-- /floors -->" markers. Out: "folder a b", one line per folder.
table=$(awk '/<!-- floors -->/ { on = 1; next } /<!-- \/floors -->/ { on = 0 }
	on && /^\| *`/ {
		n = split($0, col, "|")
		gsub(/[` ]/, "", col[2]); line = col[2]
		m = split(col[3], dep, ",")
		for (i = 1; i <= m; i++) { d = dep[i]; gsub(/[` ]|—/, "", d); if (d != "") line = line " " d }
		print line
	}' "$doc")
[ -n "$table" ] || { echo "check_floors: no floors table in $doc" >&2; exit 2; }

cd "$src"
files=$(find client daemon format http ipc kernels kvcache -type f \
	\( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)
printf '%s\n' "$table" | awk -v files="$files" '
	# folder of a path by the longest table entry that prefixes it
	function folder_of(p,   f, best) {
		best = ""
		for (f in deps) if (index(p, f) == 1 && length(f) > length(best)) best = f
		return best
	}
	# transitive closure of what folder f stands on, into ok[f, g]
	function close_over(f, g,   n, i, d) {
		n = split(deps[g], d, " ")
		for (i = 1; i <= n; i++) if (!((f, d[i]) in ok)) { ok[f, d[i]] = 1; close_over(f, d[i]) }
	}
	{ f = $1; deps[f] = ""; for (i = 2; i <= NF; i++) deps[f] = deps[f] " " $i }
	END {
		for (f in deps) { ok[f, f] = 1; close_over(f, f) }
		for (f in deps) { n = split(deps[f], d, " "); for (i = 1; i <= n; i++)
			if (!(d[i] in deps)) { printf "floors table: %s stands on %s, which has no row\n", f, d[i]; bad++ } }
		nf = split(files, list, "\n")
		for (k = 1; k <= nf; k++) {
			p = list[k]; own = folder_of(p)
			if (own == "") { printf "%s: in no folder of the floors table\n", p; bad++; continue }
			dir = p; sub(/[^\/]*$/, "", dir)
			line = 0
			while ((getline l < p) > 0) {
				line++
				if (l !~ /^[ \t]*#[ \t]*include[ \t]*"/) continue
				inc = l; sub(/^[ \t]*#[ \t]*include[ \t]*"/, "", inc); sub(/".*/, "", inc)
				if (inc == "config.h") continue
				if (inc !~ /\//) { printf "%s:%d: \"%s\": name headers from the top of the tree\n", p, line, inc; bad++; continue }
				to = folder_of(inc)
				if (to == "") { printf "%s:%d: \"%s\" is in no folder of the floors table\n", p, line, inc; bad++; continue }
				if (!((own, to) in ok)) {
					printf "%s:%d: includes \"%s\": %s does not stand on %s\n", p, line, inc, own, to; bad++
				}
				idir = inc; sub(/[^\/]*$/, "", idir)
				if (inc ~ /_internal\.h$/ && idir != dir) {
					printf "%s:%d: includes \"%s\": an _internal.h is for its own folder (%s) only\n", p, line, inc, idir; bad++
				}
			}
			close(p)
		}
		if (bad) { printf "check_floors: %d upward or private include(s)\n", bad; exit 1 }
		printf "check_floors: %d files, every include runs downward\n", nf
	}'
