#!/bin/sh
# The long soak of kdecd: tests/test_chaos_daemon (kill storms, garbage writers,
# hello-less connections, snapshots, restarts while honest clients stream; see its
# header) for SECONDS, one daemon restart a minute, the daemon's RSS and descriptors
# sampled once a second. Prints the chaos counts and, per daemon incarnation, RSS and
# descriptors at its start, peak and end (a leak shows as a climb within one).
# Usage: contrib/soak.sh SECONDS [BUILD_DIR]   (default BUILD_DIR: build/ of this tree)
# Exit status: the chaos test's (0 all checks passed). docs/SOCKET.md has figures.
set -eu
secs=${1:?usage: contrib/soak.sh SECONDS [BUILD_DIR]}
src=$(cd "$(dirname "$0")/.." && pwd)
b=$(cd "${2:-$src/build}" && pwd)
make -C "$b" -s kdecd kdctl kdrun kdbench tests/test_chaos_daemon
out=$(mktemp -d "${TMPDIR:-/tmp}/kdec_soak.XXXXXX")
restarts=$((secs / 60))
echo "soak: $secs s, $restarts restarts; samples in $out/samples.txt"
st=0
top_srcdir=$src top_builddir=$b "$b/tests/test_chaos_daemon" --seconds "$secs" \
	--restarts "$restarts" --samples "$out/samples.txt" 2>"$out/chaos.txt" || st=$?
grep -E '^chaos:|FAIL|died|kept in' "$out/chaos.txt" || true
# samples: seconds pid rss_kib fds clients
awk '{ if (!($2 in first)) { order[n++] = $2; first[$2] = $3; ffd[$2] = $4; t0[$2] = $1 }
       if ($3 > peak[$2]) peak[$2] = $3; if ($4 > pfd[$2]) pfd[$2] = $4
       last[$2] = $3; lfd[$2] = $4; t1[$2] = $1 }
     END { printf "%-8s %12s %22s %22s\n", "pid", "seconds", "RSS KiB start/peak/end", "fds start/peak/end"
           for (i = 0; i < n; i++) { p = order[i]
             printf "%-8s %5.0f-%-6.0f %7d/%7d/%6d %8d/%6d/%6d\n", p, t0[p], t1[p], first[p], peak[p], last[p], ffd[p], pfd[p], lfd[p] } }' \
	"$out/samples.txt"
echo "soak: exit $st (full output in $out/chaos.txt)"
exit $st
