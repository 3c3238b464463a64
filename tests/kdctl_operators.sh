#!/bin/sh
# Operators apart from clients (issue 28, item 8), with kdctl run as other uids
# through setpriv (so root only; it skips elsewhere). kdecd (as root) allows uid 1001
# (a client), has uid 1002 (--operator-uid) and group 2000 (--operator-gid) as
# operators; uid 1003 is not allowed at all.
# - a refused uid gets the daemon's reason, never "Broken pipe" (20 tries: the daemon
#   closes at once, so kdctl's send races with the close);
# - the client runs status, metrics, clients, sessions and its own session-close;
#   drain, resume, shutdown, log-level and snapshot are refused in one line that
#   names the operators, logged, and change nothing;
# - the client sees only its own clients and sessions (not root's pid, session name or
#   tokens); operators by uid, by supplementary and by primary group see them all;
# - an operator drains, resumes and shuts the daemon down.
set -u
test_name=kdctl_operators
if [ "$(id -u)" -ne 0 ]; then
	echo "kdctl_operators: skipped: needs root, to run kdctl as other uids with setpriv" >&2
	exit 77
fi
if ! command -v setpriv >/dev/null || ! setpriv --reuid=1001 --regid=1001 --clear-groups true 2>/dev/null; then
	echo "kdctl_operators: skipped: setpriv cannot change uid here" >&2
	exit 77
fi
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock
# the other uids must reach the binaries, the model and the socket
chmod 755 "$tmp"
if ! setpriv --reuid=1001 --regid=1001 --clear-groups "$B/kdctl" --version >/dev/null 2>&1; then
	echo "kdctl_operators: skipped: uid 1001 cannot run $B/kdctl (a directory above it is closed)" >&2
	exit 77
fi
as() { u=$1; shift; setpriv --reuid="$u" --regid="$u" --clear-groups "$@"; }
client() { as 1001 "$B/kdctl" --socket "$S" "$@"; }

kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 1 --allow-uid 1001 \
	--operator-uid 1002 --operator-gid 2000 --shutdown-timeout 30 || { fail "kdecd did not start"; verdict; exit 1; }
# The socket's own mode is not what this test is about: let every uid reach the daemon.
chmod 666 "$S"

# a uid off the allow-list: the daemon's reason
bad=0
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
	as 1003 "$B/kdctl" --socket "$S" status >/dev/null 2>"$tmp/err" && bad=$((bad + 1))
	grep -q "kdctl status: uid 1003 " "$tmp/err" && ! grep -q "Broken pipe" "$tmp/err" || bad=$((bad + 1))
done
[ $bad -eq 0 ] && ok || fail "refused uid 1003: $bad of 20 tries without the daemon's reason: $(cat "$tmp/err")"

# the client's read-only commands
for c in status metrics clients sessions; do
	client $c >/dev/null 2>"$tmp/err" && ok || fail "uid 1001 kdctl $c: $(cat "$tmp/err")"
done
# operator commands: refused in one line, logged, no effect
ops="operators: uid 0, 1002; gid 2000"
for c in drain resume shutdown snapshot "log-level debug"; do
	name=${c%% *}
	# shellcheck disable=SC2086
	expect 1 "kdctl $name: uid 1001 is not an operator of this daemon ($ops)" client $c
done
[ "$(wc -l <"$tmp/err")" -eq 1 ] && ok || fail "the refusal is not one line: $(cat "$tmp/err")"
grep -q "kdctl shutdown refused (pid [0-9]*): uid 1001 is not an operator" "$tmp/daemon.log" && ok ||
	fail "the refusal is not logged"
kill -0 $pid 2>/dev/null && "$B/kdctl" --socket "$S" status | grep -q "^draining  *no" && ok ||
	fail "uid 1001's drain or shutdown took effect"

# each user's stream with a session of its own
"$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 30000 --session root-secret >/dev/null 2>&1 &
rootrun=$!
# setpriv itself (not the function "as" in a subshell), so that $! is kdrun's pid
setpriv --reuid=1001 --regid=1001 --clear-groups "$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 30000 \
	--session mine >/dev/null 2>&1 &
userrun=$!
i=0
while [ $i -lt 600 ] && [ "$("$B/kdctl" --socket "$S" sessions | grep -c -e '^root-secret ' -e '^mine ')" -lt 2 ]; do
	sleep 0.1
	i=$((i + 1))
done
"$B/kdctl" --socket "$S" clients >"$tmp/all"
rootpid=$(awk '$3 == 0 { print $2 }' "$tmp/all" | head -n 1)
userpid=$(awk '$3 == 1001 { print $2 }' "$tmp/all" | head -n 1)
[ -n "$rootpid" ] && [ -n "$userpid" ] && ok || fail "kdctl clients as root: $(cat "$tmp/all")"
client clients --json >"$tmp/c"
client sessions --json >"$tmp/s"
grep -q "\"pid\":$userpid," "$tmp/c" && ! grep -q "\"pid\":$rootpid," "$tmp/c" && ! grep -q '"uid":0,' "$tmp/c" &&
	ok || fail "uid 1001 kdctl clients: $(cat "$tmp/c")"
grep -q '"name":"mine"' "$tmp/s" && ! grep -q "root-secret" "$tmp/s" && ! grep -q '"owner":0,' "$tmp/s" &&
	ok || fail "uid 1001 kdctl sessions: $(cat "$tmp/s")"
# operators see everything: by uid, by a supplementary group, by the primary group
for who in "--reuid=1002 --regid=1002 --clear-groups" "--reuid=1004 --regid=1004 --groups=2000" \
	"--reuid=1005 --regid=2000 --clear-groups"; do
	# shellcheck disable=SC2086
	setpriv $who "$B/kdctl" --socket "$S" sessions >"$tmp/s" 2>&1
	grep -q "^root-secret " "$tmp/s" && grep -q "^mine " "$tmp/s" && ok ||
		fail "operator ($who) kdctl sessions: $(cat "$tmp/s")"
	# shellcheck disable=SC2086
	setpriv $who "$B/kdctl" --socket "$S" log-level info >/dev/null 2>"$tmp/err" && ok ||
		fail "operator ($who) kdctl log-level: $(cat "$tmp/err")"
done
kill $rootrun $userrun 2>/dev/null
wait $rootrun $userrun 2>/dev/null
# session-close is the client's own: its session yes, root's no
i=0
until client session-close mine >/dev/null 2>&1 || [ $i -ge 100 ]; do
	sleep 0.1
	i=$((i + 1))
done
[ $i -lt 100 ] && ok || fail "uid 1001 cannot close its own session"
client session-close root-secret >/dev/null 2>&1 && fail "uid 1001 closed root's session" || ok
"$B/kdctl" --socket "$S" sessions | grep -q "^root-secret " && ok || fail "root's session is gone"

# an operator drains, resumes and stops the daemon
as 1002 "$B/kdctl" --socket "$S" drain >/dev/null && ok || fail "operator drain"
expect 1 "draining" "$B/kdrun" --socket "$S" --prompt 1,2
as 1002 "$B/kdctl" --socket "$S" resume >/dev/null && ok || fail "operator resume"
"$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 2 >/dev/null 2>&1 && ok || fail "not admitting after resume"
as 1002 "$B/kdctl" --socket "$S" shutdown >/dev/null && ok || fail "operator shutdown"
i=0
while [ $i -lt 600 ] && kill -0 $pid 2>/dev/null; do
	sleep 0.1
	i=$((i + 1))
done
wait $pid
st=$?
pid=
[ $st -eq 0 ] && ok || fail "kdecd exited $st after an operator's shutdown"

verdict
