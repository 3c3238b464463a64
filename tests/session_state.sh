#!/bin/sh
# Saved sessions are never lost by kdecd itself (issue 28, item 7) and session names
# are refused with the reason: a daemon of another model sets the snapshot aside
# (byte for byte) and its own shutdown does not touch it; sessions that did not fit
# a small --host-kv-mem survive the next shutdown and load where they fit; a shutdown
# snapshot that fails (a file size limit stands in for a full disk) exits 1 and
# leaves the old snapshot and no temporary file; a killed writer's temporary file is
# removed at start; the 65th session of a uid is refused with the count and limit.
set -u
test_name=session_state
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock
D=$tmp/state
SNAP=$D/kv-sessions.snap
M2=$top_srcdir/tests/data/golden/qwen3
mkdir "$D"

start() {
	: >"$tmp/daemon.log"
	kdecd_start daemon.log 30 --socket "$S" --threads 1 --state-dir "$D" "$@" ||
		fail "kdecd $* did not start: $(tail -n 3 "$tmp/daemon.log")"
}
stop() {
	kdecd_stop 2>/dev/null
}
run() {	# run SESSION FIRST_TOKEN: a 40-token turn on SESSION
	"$B/kdrun" --socket "$S" --prompt "$(seq -s, "$2" $(($2 + 39)))" --max-tokens 2 --session "$1" \
		>/dev/null 2>"$tmp/kdrun.err"
}
loaded() { sed -n 's/.*: \([0-9]*\) sessions loaded.*/\1/p' "$tmp/daemon.log"; }

# 1. names: the reason, the rule, the limit
start --model "$M"
expect 2 "'/' at position 2 of the session name is not allowed" "$B/kdrun" --socket "$S" --prompt 1,2 --session a/b
long=$(printf 'x%.0s' $(seq 200))
expect 2 "200 characters long, at most 63" "$B/kdrun" --socket "$S" --prompt 1,2 --session "$long"
expect 2 "200 characters long, at most 63" "$B/kdctl" --socket "$S" session-close "$long"
expect 1 "no session 'nosuch' for uid $(id -u)" "$B/kdctl" --socket "$S" session-close nosuch

# 2. the 65th session name of one uid is refused, not silently dropped
i=1
while [ $i -le 64 ]; do
	"$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 1 --session "s$i" >/dev/null 2>&1 || fail "session s$i"
	i=$((i + 1))
done
expect 1 "already keeps 64 sessions, the limit per user is 64" \
	"$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 1 --session s65
"$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 1 --session s7 >/dev/null 2>&1 && ok ||
	fail "a kept session's next turn refused"
i=1
while [ $i -le 64 ]; do
	"$B/kdctl" --socket "$S" session-close "s$i" >/dev/null || fail "close s$i"
	i=$((i + 1))
done

# 3. three sessions saved; another model refuses them, sets the file aside, and its
# shutdown leaves it; renamed back, the first model loads all three
run a 100 && run b 200 && run c 300 && ok || fail "three sessions: $(cat "$tmp/kdrun.err")"
stop
[ -s "$SNAP" ] && cp "$SNAP" "$tmp/orig.snap" && ok || fail "no snapshot after the shutdown"
start --model "$M2"
grep -q "snapshot not loaded.*another model" "$tmp/daemon.log" && ok || fail "qwen3: $(cat "$tmp/daemon.log")"
aside=$(ls "$D" | grep 'kv-sessions.snap.refused-' | head -n 1)
[ -n "$aside" ] && grep -q "kept as $D/$aside" "$tmp/daemon.log" && ok || fail "set aside: $(ls -a "$D")"
stop || fail "the other model's daemon exited $?"
[ -n "$aside" ] && cmp -s "$tmp/orig.snap" "$D/$aside" && ok || fail "the refused snapshot changed"
[ -n "$aside" ] && mv "$D/$aside" "$SNAP"

# 4. a small host tier loads some, keeps the rest (warned, with the numbers); its
# shutdown carries them; the first model with room loads all three again
start --model "$M" --host-kv-mem 40K
n=$(loaded)
kept=$(sed -n 's/.*warn .*: \([0-9]*\) sessions not loaded ([0-9]* bytes of compressed KV; host tier budget 40960 bytes): \1 beyond the budget.*/\1/p' "$tmp/daemon.log")
[ -n "$n" ] && [ -n "$kept" ] && [ "$kept" -ge 1 ] && [ $((n + kept)) = 3 ] && ok ||
	fail "--host-kv-mem 40K: no warning with the numbers: $(cat "$tmp/daemon.log")"
stop || fail "small host tier: exit $?"
start --model "$M"
[ "$(loaded)" = 3 ] && ok || fail "after a small host tier: $(cat "$tmp/daemon.log")"
stop

# 5. a killed writer's temporary file goes at start, logged; a live one's stays
: >"$D/.kv-sessions.snap.2147483646.tmp"
: >"$D/.kv-sessions.snap.1.tmp"
start --model "$M"
[ ! -e "$D/.kv-sessions.snap.2147483646.tmp" ] && grep -q "removed 1 temporary snapshot" "$tmp/daemon.log" &&
	ok || fail "stale temporary file: $(ls -a "$D"; cat "$tmp/daemon.log")"
[ -e "$D/.kv-sessions.snap.1.tmp" ] && ok || fail "pid 1's temporary file removed"
rm -f "$D/.kv-sessions.snap.1.tmp"
stop

# 6. the disk fills (a 4 KiB file size limit set on the running daemon: writes fail
# with EFBIG as with ENOSPC): kdctl snapshot fails, the shutdown exits 1, the old
# snapshot stays and no temporary file
if ! command -v prlimit >/dev/null; then
	echo "session_state: SKIP full-disk checks: needs prlimit (util-linux)"
else
	cp "$SNAP" "$tmp/before.snap"
	: >"$tmp/daemon.log"
	(trap '' XFSZ; exec "$B/kdecd" --model "$M" --socket "$S" --threads 1 --state-dir "$D" \
		2>>"$tmp/daemon.log") &
	pid=$!
	i=0	# up to 30 s: a loaded machine under ASan
	while [ $i -lt 300 ] && ! grep -q running "$tmp/daemon.log"; do sleep 0.1; i=$((i + 1)); done
	run d 400 || fail "a turn before the disk fills: $(cat "$tmp/kdrun.err")"
	prlimit --pid $pid --fsize=4096 || fail "prlimit"
	expect 1 "File too large" "$B/kdctl" --socket "$S" snapshot
	kdecd_stop 2>/dev/null
	st=$?
	[ "$st" = 1 ] && ok || fail "a failed shutdown snapshot exited $st, want 1: $(cat "$tmp/daemon.log")"
	cmp -s "$tmp/before.snap" "$SNAP" && ok || fail "the old snapshot changed"
	ls -a "$D" | grep -q '\.tmp$' && fail "a temporary file is left: $(ls -a "$D")" || ok
fi

verdict
