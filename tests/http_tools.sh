#!/bin/sh
# Tools through kdhttpd on a real kdecd (the tiny Llama 3, CPU backend): one kdhttpd with
# tests/data/tokenizer/bytes512_qwen3 (bytes512's vocabulary under a Qwen3 template, which
# renders tools) and one with plain bytes512 (ChatML, no tools). tests/http_tools.py sends
# the requests and renders the same conversations through libkdclient's Python binding
# (contrib/python, loaded from the source tree): prompt token counts and greedy answers
# equal the reference's, tools change the prompt, tool history renders, and tools on a
# template without them or malformed tools get the API's 400 error shapes.
set -u
test_name=http_tools
. "${top_srcdir:-.}/tests/testutil.sh"
B=$(cd "$B" && pwd)
[ -x "$B/kdhttpd" ] || { echo "SKIP: kdhttpd not built (configure found no libmicrohttpd)"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 77; }
S=$tmp/kdecd.sock
hpids=
trap 'for p in $hpids; do kill $p 2>/dev/null; done; [ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

export KDCLIENT_LIB=$B/.libs/libkdclient.so
# a sanitizer build's library needs its runtime first in the (unsanitized) interpreter
if nm -D "$KDCLIENT_LIB" 2>/dev/null | grep -q __asan_init; then
	asan=$(${CC:-cc} -print-file-name=libasan.so)
	[ -f "$asan" ] || { echo "SKIP: ASan build and no libasan.so to preload into python"; exit 77; }
	pyenv="LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0"
else
	pyenv=
fi

kdecd_start daemon.log 60 --model "$M" --socket "$S" --threads 1 --kv-tokens 16384 ||
	{ echo "FAIL: kdecd did not start: $(tail -n 3 "$tmp/daemon.log")"; exit 1; }
KEY=kd-test-$$-key
printf '%s\n' "$KEY" >"$tmp/keys"
chmod 600 "$tmp/keys"

# one kdhttpd with the Qwen3-template tokenizer (tools), one with plain bytes512 (none)
kh_ok=0
kdhttpd_start tools.log --socket "$S" --tokenizer "$top_srcdir/tests/data/tokenizer/bytes512_qwen3" \
	--api-key-file "$tmp/keys" --timeout 30 && kh_ok=1
hpids=$hpid UT=$hurl
[ $kh_ok = 1 ] || { echo "FAIL: kdhttpd (Qwen3 template) did not come up: $(cat "$tmp/tools.log")"; exit 1; }
kh_ok=0
kdhttpd_start plain.log --socket "$S" --tokenizer "$top_srcdir/tests/data/tokenizer/bytes512" \
	--api-key-file "$tmp/keys" --timeout 30 && kh_ok=1
hpids="$hpids $hpid" UN=$hurl
[ $kh_ok = 1 ] || { echo "FAIL: kdhttpd (ChatML) did not come up: $(cat "$tmp/plain.log")"; exit 1; }

env $pyenv PYTHONPATH="$top_srcdir/contrib/python" python3 "$top_srcdir/tests/http_tools.py" \
	"$UT" "$UN" "$KEY" "$S" "$top_srcdir/tests/data/tokenizer/bytes512_qwen3" >"$tmp/py.out" 2>&1
rc=$?
cat "$tmp/py.out"
for p in $hpids; do
	kill -0 "$p" 2>/dev/null || { echo "FAIL: a kdhttpd died: $(tail -n 3 "$tmp"/*.log)"; rc=1; }
done
[ $rc = 0 ] && [ -s "$tmp/py.out" ] && ! grep -q '^FAIL' "$tmp/py.out" || { echo "FAIL: http_tools"; exit 1; }
echo "PASS: http_tools"
