#!/bin/sh
# kdecd --daemon: the command returns once kdecd serves, so kdrun right after it works
# every time; a failed start returns non-zero after its error line; --pid-file names the
# serving process and goes at exit; with NOTIFY_SOCKET, READY=1 arrives.
set -u
test_name=daemon_ready
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock
P=$tmp/kdecd.pid
want=$("$B/kdbench" generate --model "$M" --prompt 1,2,3 --max-tokens 6 --threads 1 2>/dev/null)

# stop_daemon: kdctl shutdown, then wait (up to 10 s) for the pid to go
stop_daemon() {
	"$B/kdctl" --socket "$S" shutdown >/dev/null 2>&1 || fail "kdctl shutdown"
	i=0
	while kill -0 "$1" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
	kill -0 "$1" 2>/dev/null && fail "kdecd $1 still running 10 s after shutdown" || ok
}

for round in 1 2 3 4 5; do
	if ! "$B/kdecd" --daemon --backend cpu --model "$M" --socket "$S" --pid-file "$P" --threads 1 \
		2>>"$tmp/daemon.log"; then
		fail "round $round: kdecd --daemon exited $?: $(tail -n 2 "$tmp/daemon.log")"
		continue
	fi
	ok
	dpid=$(cat "$P" 2>/dev/null)
	[ -n "$dpid" ] && kill -0 "$dpid" 2>/dev/null && ok || fail "round $round: pid file '$dpid' names no process"
	got=$("$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 6 2>"$tmp/err")
	[ "$got" = "$want" ] && ok || fail "round $round: kdrun right after --daemon printed '$got' ($(tail -n 1 "$tmp/err")), want '$want'"
	stop_daemon "$dpid"
	[ ! -e "$P" ] && ok || fail "round $round: pid file left after exit"
done

# a start that fails: non-zero, the error line on stderr, no pid file
expect 1 "config.json" "$B/kdecd" --daemon --model "$tmp/no-such-model" --socket "$S" --pid-file "$P"
[ ! -e "$P" ] && ok || fail "pid file written by a failed start"

# systemd's readiness: READY=1 on the datagram socket NOTIFY_SOCKET names
if command -v python3 >/dev/null 2>&1; then
	python3 - "$tmp/notify.sock" "$tmp/notify.out" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(60)
open(sys.argv[2] + ".bound", "w").close()
try:
    msg = s.recv(4096)
except socket.timeout:
    msg = b"(timeout)"
open(sys.argv[2], "wb").write(msg)
PY
	lpid=$!
	i=0
	while [ ! -e "$tmp/notify.out.bound" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
	NOTIFY_SOCKET=$tmp/notify.sock "$B/kdecd" --daemon --backend cpu --model "$M" --socket "$S" --pid-file "$P" \
		--threads 1 2>>"$tmp/daemon.log" && ok || fail "kdecd --daemon with NOTIFY_SOCKET exited $?"
	wait $lpid
	[ "$(cat "$tmp/notify.out" 2>/dev/null)" = "READY=1" ] && ok ||
		fail "NOTIFY_SOCKET got '$(cat "$tmp/notify.out" 2>/dev/null)', want READY=1"
	dpid=$(cat "$P" 2>/dev/null)
	[ -n "$dpid" ] && stop_daemon "$dpid"
else
	skip "the NOTIFY_SOCKET check: python3 not found"
fi
verdict
