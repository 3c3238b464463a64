#!/bin/sh
# kdhttpd driven by curl on a real kdecd (the tiny Llama 3, CPU backend, with the 512-id
# byte-level tokenizer of tests/data/tokenizer/bytes512): greedy text equal to kdrun's for
# the three endpoints, streamed and not; stop strings across token boundaries; the API key;
# the error shapes and statuses of bad, oversize and too-long bodies; slow clients closed;
# 64 concurrent streams equal to their solo runs; a client killed mid-stream cancels its
# request (kdecd's requests_running back to 0, far fewer tokens than asked); sessions; and
# through it all the daemon and the other streams unaffected. tests/http_check.py reads
# the bodies.
set -u
test_name=http_daemon
. "${top_srcdir:-.}/tests/testutil.sh"
[ -x "$B/kdhttpd" ] || { echo "SKIP: kdhttpd not built (configure found no libmicrohttpd)"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: no python3 (tests/http_check.py reads the bodies)"; exit 77; }
TOK=$top_srcdir/tests/data/tokenizer/bytes512
S=$tmp/kdecd.sock
H="python3 $top_srcdir/tests/http_check.py"
hpid=
trap '[ -n "$hpid" ] && kill $hpid 2>/dev/null; [ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 1 --kv-tokens 16384 ||
	{ echo "FAIL: kdecd did not start: $(tail -n 3 "$tmp/daemon.log")"; exit 1; }
KEY=kd-test-$$-key
printf '# kdhttpd test key\n%s\n' "$KEY" >"$tmp/keys"
chmod 600 "$tmp/keys"
kdhttpd_start http.log --socket "$S" --tokenizer "$TOK" --api-key-file "$tmp/keys" \
	--timeout 3 --max-body 65536 ||
	{ echo "FAIL: kdhttpd did not come up: $(cat "$tmp/http.log")"; exit 1; }
U=$hurl
port=${U##*:}

# req OUT PATH [curl args]: the status on stdout, the body in $tmp/OUT
req() {
	o=$1 p=$2
	shift 2
	curl -s -o "$tmp/$o" -w '%{http_code}' -H "Authorization: Bearer $KEY" \
		-H 'Content-Type: application/json' "$@" "$U$p"
}
# status OUT WANT PATH [curl args]: the status is WANT
status() {
	o=$1 want=$2 p=$3
	shift 3
	got=$(req "$o" "$p" "$@")
	[ "$got" = "$want" ] && ok || fail "$p $*: status $got, want $want: $(head -c 300 "$tmp/$o")"
}
chat() { printf '{"messages":[{"role":"user","content":"%s"}],"max_tokens":%s,"temperature":0%s}' "$1" "$2" "${3:-}"; }
metric() { curl -s -H "Authorization: Bearer $KEY" "$U/metrics" | sed -n "s/^$1 //p"; }

# ---- health, models, the key ----
[ "$(curl -s -o /dev/null -w '%{http_code}' "$U/health")" = 200 ] && ok || fail "/health not 200"
status models 200 /v1/models
[ "$($H field "$tmp/models" data.0.id)" = llama3 ] && ok || fail "/v1/models: $(cat "$tmp/models")"
got=$(curl -s -o "$tmp/nokey" -w '%{http_code}' "$U/v1/models")
[ "$got" = 401 ] && [ "$($H field "$tmp/nokey" error.code)" = invalid_api_key ] && ok ||
	fail "no key: $got $(cat "$tmp/nokey")"
got=$(curl -s -o "$tmp/badkey" -w '%{http_code}' -H "x-api-key: ${KEY}x" -d "$(chat hi 4)" "$U/v1/messages")
[ "$got" = 401 ] && [ "$($H field "$tmp/badkey" error.type)" = authentication_error ] && ok ||
	fail "wrong key (Anthropic shape): $got $(cat "$tmp/badkey")"
got=$(curl -s -o /dev/null -w '%{http_code}' -H "x-api-key: $KEY" "$U/v1/models")
[ "$got" = 200 ] && ok || fail "x-api-key: $got"

# ---- greedy text: kdrun --text ... --chat, and each endpoint streamed and not ----
"$B/kdrun" --socket "$S" --tokenizer "$TOK" --text "Hello there" --chat --max-tokens 24 \
	>"$tmp/kdrun.out" 2>"$tmp/kdrun.err" || fail "kdrun: $(cat "$tmp/kdrun.err")"
head -c -1 "$tmp/kdrun.out" >"$tmp/want"	# without kdrun's newline (the text may hold NULs)
status chat 200 /v1/chat/completions -d "$(chat 'Hello there' 24)"
$H text "$tmp/chat" >"$tmp/got"
cmp -s "$tmp/got" "$tmp/want" && ok || fail "chat '$(cat "$tmp/got")', kdrun '$(cat "$tmp/want")'"
status chats 200 /v1/chat/completions -N -d "$(chat 'Hello there' 24 ',"stream":true,"stream_options":{"include_usage":true}')"
$H sse "$tmp/chats" >"$tmp/got" 2>"$tmp/fin" && cmp -s "$tmp/got" "$tmp/want" && ok ||
	fail "chat stream '$(cat "$tmp/got")' $(cat "$tmp/fin"), kdrun '$(cat "$tmp/want")'"
grep -q '"completion_tokens": 24' "$tmp/fin" && ok || fail "chat stream usage: $(cat "$tmp/fin")"
status msg 200 /v1/messages -d "$(chat 'Hello there' 24)"
$H text "$tmp/msg" >"$tmp/got"
cmp -s "$tmp/got" "$tmp/want" && [ "$($H field "$tmp/msg" stop_reason)" = max_tokens ] && ok ||
	fail "messages '$(cat "$tmp/got")': $(cat "$tmp/msg")"
status msgs 200 /v1/messages -N -d "$(chat 'Hello there' 24 ',"stream":true')"
$H sse "$tmp/msgs" >"$tmp/got" 2>"$tmp/fin" && cmp -s "$tmp/got" "$tmp/want" && ok ||
	fail "messages stream '$(cat "$tmp/got")' $(cat "$tmp/fin")"
"$B/kdrun" --socket "$S" --tokenizer "$TOK" --text "Once upon" --max-tokens 32 >"$tmp/kdrun.out" 2>/dev/null
head -c -1 "$tmp/kdrun.out" >"$tmp/want"
status cmpl 200 /v1/completions -d '{"prompt":"Once upon","max_tokens":32,"temperature":0,"logprobs":1}'
$H text "$tmp/cmpl" >"$tmp/got"
cmp -s "$tmp/got" "$tmp/want" && ok || fail "completion '$(cat "$tmp/got")', kdrun '$(cat "$tmp/want")'"
status cmpls 200 /v1/completions -N -d '{"prompt":"Once upon","max_tokens":32,"temperature":0,"stream":true}'
$H sse "$tmp/cmpls" >"$tmp/got" 2>/dev/null && cmp -s "$tmp/got" "$tmp/want" && ok ||
	fail "completion stream '$(cat "$tmp/got")'"

# ---- usage.prompt_tokens_details.cached_tokens: the prompt's tokens from the KV cache ----
# the same 200-byte question twice (one token a byte): the second finds at least its whole
# 16-token blocks but the last in kdecd's prefix cache; the first found at most the chat
# template's opening, which other chats share
Q=$(printf 'Cached tokens check %0180d' 7)
status cache1 200 /v1/chat/completions -d "$(chat "$Q" 2)"
status cache2 200 /v1/chat/completions -d "$(chat "$Q" 2)"
n=$($H field "$tmp/cache2" usage.prompt_tokens)
c1=$($H field "$tmp/cache1" usage.prompt_tokens_details.cached_tokens)
c2=$($H field "$tmp/cache2" usage.prompt_tokens_details.cached_tokens)
[ -n "$n" ] && [ -n "$c1" ] && [ -n "$c2" ] && [ "$c2" -lt "$n" ] && [ "$c2" -ge $((n - 32)) ] &&
	[ "$c1" -lt $((n - 160)) ] && ok ||
	fail "cached_tokens: first $c1, second $c2 of $n prompt tokens (want the second >= $((n - 32)), the first < $((n - 160)))"

# ---- a stop string across a token boundary, whole and streamed ----
if $H boundary_stop "$tmp/cmpl" >"$tmp/bs" 2>"$tmp/bs.err"; then
	stop=$(head -n 1 "$tmp/bs")
	tail -n +2 "$tmp/bs" >"$tmp/want_stop"
	body=$(python3 -c 'import json,sys; print(json.dumps({"prompt":"Once upon","max_tokens":32,"temperature":0,"stop":[sys.argv[1]]}))' "$stop")
	status st 200 /v1/completions -d "$body"
	$H text "$tmp/st" >"$tmp/got"
	cmp -s "$tmp/got" "$tmp/want_stop" && [ "$($H field "$tmp/st" choices.0.finish_reason)" = stop ] &&
		ok || fail "stop '$stop': '$(cat "$tmp/got")', want '$(cat "$tmp/want_stop")'"
	body=$(python3 -c 'import json,sys; print(json.dumps({"prompt":"Once upon","max_tokens":32,"temperature":0,"stream":True,"stop":sys.argv[1]}))' "$stop")
	status sts 200 /v1/completions -N -d "$body"
	$H sse "$tmp/sts" >"$tmp/got" 2>"$tmp/fin" && cmp -s "$tmp/got" "$tmp/want_stop" &&
		grep -q "finish=stop" "$tmp/fin" && ok || fail "streamed stop '$stop': '$(cat "$tmp/got")' $(cat "$tmp/fin")"
else
	fail "$(cat "$tmp/bs.err")"
fi

# ---- bad requests, while a stream runs beside them: 4xx in the API's shape ----
status solo 200 /v1/chat/completions -N -d "$(chat 'beside' 200 ',"stream":true')"
req beside /v1/chat/completions -N -d "$(chat 'beside' 200 ',"stream":true')" >"$tmp/beside.st" &
bpid=$!
status e1 400 /v1/chat/completions -d '{"messages": [ {"role": "user", "content": "x"'
$H field "$tmp/e1" error.message | grep -q "not JSON" && ok || fail "bad JSON: $(cat "$tmp/e1")"
status e2 400 /v1/chat/completions -d '[1,2]'
status e3 400 /v1/chat/completions -d '{"messages":"hi"}'
status e4 400 /v1/chat/completions -d "$(chat x 4 ',"top_p":"high"')"
[ "$($H field "$tmp/e4" error.param)" = top_p ] && ok || fail "top_p param: $(cat "$tmp/e4")"
status e5 400 /v1/chat/completions -d "$(chat x 4 ',"n":2')"
status e6 400 /v1/chat/completions -d "$(chat x 4 ',"logprobs":true,"top_logprobs":5')"
status e7 400 /v1/chat/completions -d "$(chat x 4 ',"tools":[{"type":"function","function":{"name":"f"}}]')"
$H field "$tmp/e7" error.message | grep -q "chat template has no tool support" && ok || fail "tools: $(cat "$tmp/e7")"
status e8 200 /v1/chat/completions -d "$(chat x 4 ',"tool_choice":"none"')"
status e9 400 /v1/messages -d '{"messages":[{"role":"user","content":"x"}]}'
[ "$($H field "$tmp/e9" type)" = error ] && [ "$($H field "$tmp/e9" error.type)" = invalid_request_error ] &&
	ok || fail "Anthropic shape: $(cat "$tmp/e9")"
python3 -c 'print("{\"prompt\":\"" + "a" * 70000 + "\"}")' >"$tmp/big.json"
status e10 413 /v1/completions --data-binary "@$tmp/big.json"
python3 -c 'print("{\"prompt\":[" + ",".join(["65"] * 20000) + "],\"max_tokens\":4}")' >"$tmp/long.json"
status e11 400 /v1/completions --data-binary "@$tmp/long.json"
$H field "$tmp/e11" error.message | grep -q "kdecd" && ok || fail "too long: $(cat "$tmp/e11")"
status e12 404 /v1/nothing -d '{}'
status e13 405 /v1/chat/completions
status e14 400 /v1/chat/completions -H 'X-Kdec-Session: bad name!' -d "$(chat x 4)"
status e15 400 /v1/chat/completions -d '{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}],"max_tokens":4}'
# slow clients: stalled in the headers, stalled in the body; kdhttpd --timeout 3 closes
$H slow "$port" headers 60 "$KEY" && ok || fail "a client stalled in its headers was not closed"
$H slow "$port" body 60 "$KEY" && ok || fail "a client stalled in its body was not closed"
wait $bpid
st=$(cat "$tmp/beside.st")
$H sse "$tmp/beside" >"$tmp/got" 2>/dev/null && $H sse "$tmp/solo" >"$tmp/want" 2>/dev/null &&
	[ "$st" = 200 ] && cmp -s "$tmp/got" "$tmp/want" && ok || fail "the stream beside the bad requests differs ($st)"

# ---- sessions: X-Kdec-Session and "user" name kdecd sessions ----
status s1 200 /v1/chat/completions -H 'X-Kdec-Session: http-test.1' -d "$(chat 'turn one' 4)"
status s2 200 /v1/chat/completions -d "$(chat 'turn one' 4 ',"user":"http-test.2"')"
"$B/kdctl" --socket "$S" sessions >"$tmp/sessions" 2>&1
grep -q "http-test.1" "$tmp/sessions" && grep -q "http-test.2" "$tmp/sessions" && ok ||
	fail "sessions: $(cat "$tmp/sessions")"

# ---- 64 concurrent streams equal their solo runs ----
for k in 0 1 2 3 4 5 6 7; do
	status "solo$k" 200 /v1/chat/completions -N -d "$(chat "prompt number $k" 24 ',"stream":true')"
	$H sse "$tmp/solo$k" >"$tmp/solo$k.txt" 2>/dev/null || fail "solo $k: $(head -c 300 "$tmp/solo$k")"
done
j=0 cpids=
while [ $j -lt 64 ]; do
	k=$((j % 8))
	req "c$j" /v1/chat/completions -N -d "$(chat "prompt number $k" 24 ',"stream":true')" >"$tmp/c$j.st" &
	cpids="$cpids $!"
	j=$((j + 1))
done
wait $cpids
j=0 bad=0
while [ $j -lt 64 ]; do
	k=$((j % 8))
	if [ "$(cat "$tmp/c$j.st")" != 200 ] || ! $H sse "$tmp/c$j" >"$tmp/c$j.txt" 2>/dev/null ||
	   ! cmp -s "$tmp/c$j.txt" "$tmp/solo$k.txt"; then
		bad=$((bad + 1))
		[ $bad -le 3 ] && fail "concurrent stream $j ($(cat "$tmp/c$j.st")): '$(cat "$tmp/c$j.txt")', solo '$(cat "$tmp/solo$k.txt")'"
	fi
	j=$((j + 1))
done
[ $bad -eq 0 ] && ok

# await_events FILE N TRIES PAUSE: until FILE holds N streamed text events (at most
# TRIES looks, PAUSE seconds apart)
await_events() {
	i=0
	# (cat: the file may not exist yet, and grep -c on no file prints no count)
	while [ $i -lt "$3" ] && [ "$(cat "$1" 2>/dev/null | grep -c '"text"')" -lt "$2" ]; do
		sleep "$4"
		i=$((i + 1))
	done
}

# ---- a stream whose next event takes longer than --timeout (kdecd stopped 4.5 s, a
# stand-in for a long prefill or a busy daemon) is kept open by ": keep-alive" comments
# and ends whole, with the text of the same request run alone ----
long='{"prompt":"keep going","max_tokens":600,"temperature":0,"ignore_eos":true,"stream":true}'
status long 200 /v1/completions -N -d "$long"
$H sse "$tmp/long" >"$tmp/long.txt" 2>/dev/null || fail "a 600-token stream: $(tail -c 300 "$tmp/long")"
curl -s -N -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d "$long" \
	"$U/v1/completions" >"$tmp/paused" &
cpid=$!
await_events "$tmp/paused" 2 500 0.01
kill -STOP "$pid"
sleep 4.5
kill -CONT "$pid"
wait $cpid
crc=$?
$H sse "$tmp/paused" >"$tmp/paused.txt" 2>/dev/null && [ -s "$tmp/long.txt" ] &&
	cmp -s "$tmp/paused.txt" "$tmp/long.txt" && [ $crc -eq 0 ] && grep -q '^: keep-alive' "$tmp/paused" && ok ||
	fail "stream paused past --timeout: curl $crc, $(grep -c '^: keep-alive' "$tmp/paused") keep-alives, $(wc -c <"$tmp/paused.txt") bytes of text against $(wc -c <"$tmp/long.txt")"

# ---- a client killed mid-stream: its request is cancelled at once ----
gen0=$(metric kd_generation_tokens_total)
: >"$tmp/killed"
# a completion with ignore_eos: no stop token can end it before the kill (4000 tokens:
# the tiny model's positions are 4096)
curl -s -N -H "Authorization: Bearer $KEY" \
	-d '{"prompt":"go on","max_tokens":4000,"temperature":0,"ignore_eos":true,"stream":true}' \
	"$U/v1/completions" >"$tmp/killed" &
cpid=$!
await_events "$tmp/killed" 3 600 0.1
kill -9 $cpid
wait $cpid 2>/dev/null
i=0
# kdhttpd counts the disconnect when the connection ends, just after the cancel
while [ $i -lt 600 ] && { [ "$(metric kd_requests_running)" != 0 ] ||
	[ "$(metric kdhttpd_requests_running)" != 0 ]; }; do
	sleep 0.1
	i=$((i + 1))
done
gen1=$(metric kd_generation_tokens_total)
run=$(metric kd_requests_running)
[ "$run" = 0 ] && [ $((gen1 - gen0)) -lt 2000 ] && ok ||
	fail "killed client: kd_requests_running $run, $((gen1 - gen0)) tokens generated of 4000 asked; it got $(wc -c <"$tmp/killed") bytes"
[ "$(metric kdhttpd_requests_running)" = 0 ] && [ "$(metric kdhttpd_client_disconnects_total)" -ge 1 ] && ok ||
	fail "kdhttpd's metrics after the kill: $(curl -s -H "Authorization: Bearer $KEY" "$U/metrics" | grep ^kdhttpd_)"

# ---- everything still up and answering ----
status after 200 /v1/chat/completions -d "$(chat 'Hello there' 24)"
kill -0 $hpid && kill -0 $pid && ok || fail "kdhttpd or kdecd died"
kill -TERM $hpid
wait $hpid
st=$?
hpid=
[ $st -eq 0 ] && ok || fail "kdhttpd exit $st on SIGTERM: $(tail -n 3 "$tmp/http.log")"
kdecd_stop || fail "kdecd exit status"
verdict
