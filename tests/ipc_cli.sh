#!/bin/sh
# kdecd, kdrun and kdctl as an operator runs them: kdrun streams kdbench generate's
# tokens, daemon-side refusals are one line and exit 1, kdctl's commands answer,
# a wrong protocol version and bad options fail clearly, SIGTERM exits 0.
set -u
test_name=ipc_cli
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock

expect 2 "--notify 'bell'" "$B/kdecd" --model "$M" --notify bell
expect 2 "--allow-uid 'nosuchuser_kdec'" "$B/kdecd" --model "$M" --allow-uid nosuchuser_kdec
expect 1 "cannot connect to kdecd" "$B/kdrun" --socket "$tmp/none.sock" --prompt 1,2
expect 1 "cannot talk to kdecd" "$B/kdctl" --socket "$tmp/none.sock" status

kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 1 --shutdown-timeout 5
[ "$(stat -c %a "$S")" = 660 ] && ok || fail "socket mode $(stat -c %a "$S"), want 660"
expect 1 "served by another kdecd (pid $pid" "$B/kdecd" --model "$M" --socket "$S"

# kdrun: the same tokens as kdbench generate, timing on stderr
want=$("$B/kdbench" generate --model "$M" --prompt 113,124,11,408,469 --max-tokens 24 --threads 1 2>/dev/null)
got=$("$B/kdrun" --socket "$S" --prompt 113,124,11,408,469 --max-tokens 24 --session agent-7 2>"$tmp/err")
[ "$got" = "$want" ] && ok || fail "kdrun printed '$got', kdbench generate '$want'"
grep -q "time to first token" "$tmp/err" && grep -q "tokens/s" "$tmp/err" && ok || fail "kdrun timing: $(cat "$tmp/err")"
got=$("$B/kdrun" --socket "$S" --prompt 113,124,11,408,469 --max-tokens 24 --spin 2>/dev/null)
[ "$got" = "$want" ] && ok || fail "kdrun --spin printed '$got'"
# sampling with a seed is repeatable
a=$("$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 12 --temperature 0.8 --top-k 40 --top-p 0.9 --seed 7 2>/dev/null)
b=$("$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 12 --temperature 0.8 --top-k 40 --top-p 0.9 --seed 7 2>/dev/null)
[ -n "$a" ] && [ "$a" = "$b" ] && ok || fail "seeded sampling not repeatable: '$a' vs '$b'"
# a stop token ends the request with it
first=$(echo "$want" | cut -d' ' -f3)
got=$("$B/kdrun" --socket "$S" --prompt 113,124,11,408,469 --max-tokens 24 --stop "$first" 2>/dev/null)
[ "$got" = "$(echo "$want" | cut -d' ' -f1-3)" ] && ok || fail "stop token $first: got '$got'"

# refusals from the daemon: one line, exit 1
expect 1 "prompt token 512 at index 1 is outside the vocabulary (0..511)" "$B/kdrun" --socket "$S" --prompt 1,512,3
expect 1 "stop token 9999" "$B/kdrun" --socket "$S" --prompt 1,2 --stop 9999
expect 1 "exceed" "$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 16000000
expect 2 "bad id" "$B/kdrun" --socket "$S" --prompt 1,x
expect 2 "position 4 of the session name is not allowed" "$B/kdrun" --socket "$S" --prompt 1,2 --session "bad name"

# kdctl
"$B/kdctl" --socket "$S" status --json >"$tmp/st" || fail "kdctl status --json"
for k in model model_path weights backend uptime_s clients requests_running requests_waiting kv_blocks_used kv_blocks_total \
	kv_blocks_cached kv_blocks_free kv_host_blocks kv_host_bytes prefix_hit_tokens preemptions; do
	grep -q "\"$k\":" "$tmp/st" && ok || fail "status --json lacks $k: $(cat "$tmp/st")"
done
"$B/kdctl" --socket "$S" status | grep -q "kv_blocks_total" && ok || fail "kdctl status"
# sessions and clients are those of connected clients: keep one streaming
"$B/kdrun" --socket "$S" --prompt 1,2,3 --max-tokens 30000 --session agent-7 >/dev/null 2>&1 &
bg=$!
sleep 0.3
"$B/kdctl" --socket "$S" sessions | grep -q "^agent-7 .* 1$" && ok || fail "kdctl sessions: $("$B/kdctl" --socket "$S" sessions)"
"$B/kdctl" --socket "$S" clients | grep -q " $bg " && ok || fail "kdctl clients: $("$B/kdctl" --socket "$S" clients)"
kill $bg; wait $bg 2>/dev/null
"$B/kdctl" --socket "$S" metrics >"$tmp/m" || fail "kdctl metrics"
for k in kd_time_to_first_token_seconds_bucket kd_inter_token_latency_seconds_bucket kd_requests_running \
	kd_requests_waiting kd_kv_cache_usage_ratio kd_prompt_tokens_total kd_generation_tokens_total \
	kd_prefix_cache_hit_tokens_total kd_kv_offloaded_blocks_total kd_kv_offloaded_compressed_bytes_total \
	kd_kv_restore_seconds_total; do
	grep -q "^$k" "$tmp/m" && ok || fail "metrics lack $k"
done
"$B/kdctl" --socket "$S" log-level debug >/dev/null && ok || fail "kdctl log-level"
expect 2 "log-level needs" "$B/kdctl" --socket "$S" log-level
"$B/kdctl" --socket "$S" frobnicate 2>"$tmp/err"; st=$?
[ $st -eq 2 ] && head -n 1 "$tmp/err" | grep -q "unknown command 'frobnicate'" && grep -q "^usage: kdctl" "$tmp/err" && ok || fail "kdctl frobnicate: exit $st, $(head -n 2 "$tmp/err")"
# a wrong protocol version: a clear error on both sides
if command -v python3 >/dev/null; then
	python3 - "$S" >"$tmp/proto" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b'{"hello":"kdclient","protocol":1}\n'); print(s.recv(4096).decode())
PY
	grep -q "protocol version 1 is not supported" "$tmp/proto" && ok || fail "protocol 1: $(cat "$tmp/proto")"
	sleep 0.2
	grep -q "protocol version 1 is not supported" "$tmp/daemon.log" && ok || fail "daemon log lacks the protocol error"
fi
# drain: new requests refused, then admitted again
"$B/kdctl" --socket "$S" drain >/dev/null
expect 1 "draining" "$B/kdrun" --socket "$S" --prompt 1,2
printf '{"cmd":"drain","on":false}\n' >"$tmp/undrain"
if command -v python3 >/dev/null; then
	python3 -c "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect('$S'); s.sendall(open('$tmp/undrain','rb').read()); s.recv(100)"
	"$B/kdrun" --socket "$S" --prompt 1,2 --max-tokens 2 >/dev/null 2>&1 && ok || fail "not admitting after drain off"
fi

kdecd_stop
st=$?
[ $st -eq 0 ] && grep -q "shutting down" "$tmp/daemon.log" && ok || fail "kdecd SIGTERM: exit $st"
[ ! -e "$S" ] && ok || fail "socket left behind"

verdict
