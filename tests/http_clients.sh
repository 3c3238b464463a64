#!/bin/sh
# The real `openai` and `anthropic` packages from PyPI, installed into a throwaway venv,
# drive kdhttpd (tests/http_clients.py): chat, completion and messages, streamed and not,
# greedy text equal to `kdrun --text ... [--chat]` for the same prompt. On the tiny Llama 3
# with the 512-id byte-level tokenizer, and on SmolLM2-135M-Instruct where
# contrib/fetch-smollm2.sh fetched it. Skips (77) without kdhttpd, python3's venv, or PyPI.
set -u
test_name=http_clients
. "${top_srcdir:-.}/tests/testutil.sh"
[ -x "$B/kdhttpd" ] || { echo "SKIP: kdhttpd not built (configure found no libmicrohttpd)"; exit 77; }
python3 -c 'import venv, ensurepip' 2>/dev/null ||
	{ echo "SKIP: python3 with venv and ensurepip is needed (Debian: python3-venv)"; exit 77; }
hpid=
trap '[ -n "$hpid" ] && kill $hpid 2>/dev/null; [ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

python3 -m venv "$tmp/venv" >"$tmp/venv.log" 2>&1 || { echo "FAIL: python3 -m venv: $(tail -n 3 "$tmp/venv.log")"; exit 1; }
if ! "$tmp/venv/bin/pip" install -q --disable-pip-version-check --timeout 30 openai anthropic \
	>"$tmp/pip.log" 2>&1; then
	echo "SKIP: pip install openai anthropic failed (PyPI unreachable?): $(tail -n 2 "$tmp/pip.log")"
	exit 77
fi
"$tmp/venv/bin/python" -c 'import openai, anthropic; print("openai", openai.__version__, "anthropic", anthropic.__version__)'

# run MODEL_ARGS TOKENIZER PROMPT MAX: kdecd, kdhttpd and the clients on one model
run() {
	margs=$1 tok=$2 prompt=$3 max=$4
	S=$tmp/kdecd.sock
	# shellcheck disable=SC2086
	kdecd_start daemon.log 120 $margs --socket "$S" --threads 2 --kv-tokens 4096 ||
		{ fail "kdecd did not start: $(tail -n 3 "$tmp/daemon.log")"; return; }
	"$B/kdrun" --socket "$S" --tokenizer "$tok" --text "$prompt" --chat --max-tokens "$max" \
		>"$tmp/chat.out" 2>"$tmp/kdrun.err" || fail "kdrun --chat: $(cat "$tmp/kdrun.err")"
	"$B/kdrun" --socket "$S" --tokenizer "$tok" --text "$prompt" --max-tokens "$max" \
		>"$tmp/cmpl.out" 2>"$tmp/kdrun.err" || fail "kdrun: $(cat "$tmp/kdrun.err")"
	head -c -1 "$tmp/chat.out" >"$tmp/chat.want"	# kdrun's closing newline
	head -c -1 "$tmp/cmpl.out" >"$tmp/cmpl.want"
	echo "k-$$" >"$tmp/keys"
	if ! kdhttpd_start http.log --socket "$S" --tokenizer "$tok" --api-key-file "$tmp/keys" \
		--model-name test-model; then
		fail "kdhttpd did not come up: $(cat "$tmp/http.log")"
	elif "$tmp/venv/bin/python" "$top_srcdir/tests/http_clients.py" "$hurl" "k-$$" \
		test-model "$prompt" "$max" "$tmp/chat.want" "$tmp/cmpl.want"; then
		ok
	else
		fail "the Python clients on $margs (above)"
	fi
	kill -TERM $hpid
	wait $hpid || fail "kdhttpd exit status on SIGTERM"
	hpid=
	kdecd_stop || fail "kdecd exit status"
}

run "--model $M" "$top_srcdir/tests/data/tokenizer/bytes512" "Hello there" 24
G=${KDEC_SMOLLM2_GGUF:-${KDEC_CACHE:-$HOME/.cache/kdec}/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -r "$G" ]; then
	run "--model $G" "$G" "What is the capital of France?" 24
else
	echo "http_clients: SmolLM2 part skipped: $G absent (contrib/fetch-smollm2.sh fetches it)"
fi
verdict
