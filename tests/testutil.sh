# The helpers every shell test shares (testutil.h's counterpart), sourced after
# test_name is set: test_name=NAME; . "${top_srcdir:-.}/tests/testutil.sh"
# The tree's paths (B the build, M the tiny Llama 3 checkpoint), a scratch directory
# $tmp that goes at exit with the daemon in $pid, pass and fail counters, expect, a
# kdecd started and stopped, and the verdict. A test exits 0 (pass), 1 (fail) or 77
# (skipped, automake's convention).
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
B=$top_builddir
M=$top_srcdir/tests/data/golden/llama3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kdec_$test_name.XXXXXX") || exit 1
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
fails=0
passes=0
skips=0

ok() { passes=$((passes + 1)); }
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
# skip REASON: a part that cannot run here; the verdict is then 77 (SKIP) unless a
# check failed, so a run that checked less does not count as a pass
skip() { echo "SKIP: $test_name: $*" >&2; skips=$((skips + 1)); }

# need_cuda: exit 77 (skipped, with the backend's reason) unless kdbench runs a token of
# the tiny Llama 3 on the cuda backend here (a GPU, a CUDA build)
need_cuda() {
	if ! "$B/kdbench" generate --model "$M" --backend cuda --prompt 1 --max-tokens 1 \
		>/dev/null 2>"$tmp/probe"; then
		echo "$test_name: skipped: no usable CUDA backend ($(tail -n 1 "$tmp/probe"))" >&2
		exit 77
	fi
}

# expect STATUS TEXT CMD...: CMD exits with STATUS and its stderr's last line contains
# TEXT (a refusal is one clear line and a plain exit status)
expect() {
	want=$1 text=$2
	shift 2
	"$@" >"$tmp/out" 2>"$tmp/err"
	st=$?
	if [ "$st" -ne "$want" ]; then
		fail "$* -> exit $st, want $want; stderr: $(tail -n 3 "$tmp/err")"
	elif ! tail -n 1 "$tmp/err" | grep -q -- "$text"; then
		fail "$* -> stderr lacks '$text': $(tail -n 3 "$tmp/err")"
	else
		ok
	fi
}

# kdecd_start LOG SECONDS ARG...: kdecd with ARG..., its stderr appended to $tmp/LOG, its
# pid in $pid; waits up to SECONDS for it to say it is running. 0 once it does, 1 when
# it died or took longer. On the CPU backend unless ARG... names another: the tests
# compare with CPU runs (kdbench) and must not move to a GPU because one is present
# (kdecd's default is --backend auto).
kdecd_start() {
	kd_log=$tmp/$1 kd_wait=$2
	shift 2
	: >>"$kd_log"
	# the log may hold an earlier daemon's "running" (a test that starts several with one
	# log): wait for one more than it had, or a slow start passes as ready
	kd_seen=$(grep -c running "$kd_log")
	"$B/kdecd" --backend cpu "$@" 2>>"$kd_log" &
	pid=$!
	kd_i=0
	while [ $kd_i -lt $((kd_wait * 10)) ] && [ "$(grep -c running "$kd_log")" -le "$kd_seen" ]; do
		kill -0 $pid 2>/dev/null || break
		sleep 0.1
		kd_i=$((kd_i + 1))
	done
	[ "$(grep -c running "$kd_log")" -gt "$kd_seen" ]
}

# kdhttpd_start LOG ARG...: kdhttpd on a free port of 127.0.0.1 with ARG..., its stderr
# in $tmp/LOG (emptied first), its pid in $hpid; waits up to 60 s until it has reached
# kdecd. 0 with its base URL in $hurl once it has, 1 when it died or took longer.
kdhttpd_start() {
	kh_log=$tmp/$1
	shift
	: >"$kh_log"
	"$B/kdhttpd" --listen 127.0.0.1:0 "$@" >/dev/null 2>"$kh_log" &
	hpid=$!
	kh_i=0
	while [ $kh_i -lt 600 ] && ! grep -q "connected to kdecd" "$kh_log"; do
		kill -0 $hpid 2>/dev/null || break
		sleep 0.1
		kh_i=$((kh_i + 1))
	done
	kh_port=$(sed -n 's#.*listening on http://127.0.0.1:\([0-9]*\).*#\1#p' "$kh_log")
	hurl=http://127.0.0.1:$kh_port
	[ -n "$kh_port" ] && grep -q "connected to kdecd" "$kh_log"
}

# kdecd_stop: SIGTERM to the daemon in $pid; its exit status.
kdecd_stop() {
	kill -TERM $pid
	wait $pid
	st=$?
	pid=
	return $st
}

# worst_rel A B V: the worst relative L2 over the rows of two raw fp32 files of V
# columns ("nan" when their sizes do not make whole rows)
worst_rel() {
	od -An -v -f -w4 "$1" >"$tmp/a.txt"
	od -An -v -f -w4 "$2" >"$tmp/b.txt"
	paste "$tmp/a.txt" "$tmp/b.txt" | awk -v V="$3" '
		{ d = $1 - $2; num += d * d; den += $2 * $2; n++
		  if (n % V == 0) { r = den > 0 ? sqrt(num / den) : sqrt(num); if (r > w) w = r; num = den = 0 } }
		END { if (n == 0 || n % V) print "nan"; else printf "%.3g\n", w }'
}

# The verdict: the counts on stderr; the exit status (0, 1, or 77 after a skip).
verdict() {
	echo "$test_name: $passes passed, $fails failed, $skips skipped" >&2
	[ "$fails" -eq 0 ] || return 1
	[ "$skips" -eq 0 ] || exit 77
}
