#!/bin/sh
# contrib/python (the kdclient package, ctypes over libkdclient) installed with pip into
# a throwaway venv and run against a real kdecd on the bundled tiny Llama 3: greedy
# tokens equal kdrun's for the same prompt ids, two requests interleaved, cancel, errors.
# Where contrib/fetch-smollm2.sh fetched SmolLM2: its tokenizer through the binding
# (chat, encode, decode, streamed decoding, tools refused) gives transformers' prompt ids and kdrun
# --text --chat's answer. Skips (77) without python3 + venv, or when pip can build the
# package neither offline (setuptools visible to the venv) nor from PyPI.
set -u
test_name=python_binding
. "${top_srcdir:-.}/tests/testutil.sh"
B=$(cd "$B" && pwd)
S=$tmp/kdecd.sock

command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 77; }
python3 -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1 ||
	{ echo "SKIP: python3 -m venv failed: $(tail -n 1 "$tmp/venv.log")"; exit 77; }
PY=$tmp/venv/bin/python
[ -x "$tmp/venv/bin/pip" ] || { echo "SKIP: the venv has no pip (python3-venv / ensurepip missing)"; exit 77; }
# a copy: pip builds in the source tree, which may be read-only (distcheck)
cp -r "$top_srcdir/contrib/python" "$tmp/pysrc" && chmod -R u+w "$tmp/pysrc"
if ! "$tmp/venv/bin/pip" install -q --no-index --no-build-isolation "$tmp/pysrc" >"$tmp/pip.log" 2>&1 &&
   ! "$tmp/venv/bin/pip" install -q "$tmp/pysrc" >>"$tmp/pip.log" 2>&1; then
	echo "SKIP: pip could not install contrib/python offline or from PyPI (no network?): $(tail -n 1 "$tmp/pip.log")"
	exit 77
fi

export KDCLIENT_LIB=$B/.libs/libkdclient.so
# a sanitizer build's library needs its runtime first in the (unsanitized) interpreter
if nm -D "$KDCLIENT_LIB" 2>/dev/null | grep -q __asan_init; then
	asan=$(${CC:-cc} -print-file-name=libasan.so)
	[ -f "$asan" ] || { echo "SKIP: ASan build and no libasan.so to preload into python"; exit 77; }
	export LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0
fi

"$PY" -c "import kdclient, sys; sys.exit(not kdclient.__file__.startswith('$tmp/venv'))" ||
	{ echo "FAIL: kdclient not imported from the venv"; exit 1; }

kdecd_start daemon.log 30 --model "$M" --socket "$S" --threads 1 ||
	{ echo "FAIL: kdecd did not start: $(tail -n 3 "$tmp/daemon.log")"; exit 1; }
want=$("$B/kdrun" --socket "$S" --prompt 113,124,11,408,469 --max-tokens 16 2>/dev/null)
[ -n "$want" ] || { echo "FAIL: kdrun gave no tokens"; exit 1; }

"$PY" - "$S" "$want" >"$tmp/py.out" 2>&1 <<'PYEOF'
import errno, sys
import kdclient

sock, want = sys.argv[1], [int(x) for x in sys.argv[2].split()]
fails = 0

def check(cond, what):
    global fails
    print(("ok   " if cond else "FAIL ") + what)
    fails += not cond

prompt = [113, 124, 11, 408, 469]
with kdclient.Client(sock) as c:
    got = c.generate(prompt, max_tokens=16)
    check(got == want, "greedy tokens %s == kdrun's %s" % (got, want))
    # two in flight, read in the other order: each iterator gets its own events
    a = c.submit(prompt, max_tokens=16)
    b = c.submit(prompt[:3], max_tokens=8)
    tb = list(c.tokens(b))
    ta = list(c.tokens(a))
    check(ta == want, "interleaved request a: %s" % ta)
    check(tb == c.generate(prompt[:3], max_tokens=8) and len(tb) == 8, "interleaved request b: %s" % tb)
    evs = list(c.stream(prompt, max_tokens=4, logprobs=True))
    check([e.index for e in evs if e.token >= 0] == [0, 1, 2, 3] and evs[-1].final and
          evs[-1].stop == "length" and all(e.logprob is not None and e.logprob <= 0 for e in evs if e.token >= 0),
          "events: indices, final 'length', logprobs: %s" % (evs[-1],))
    r = c.submit(prompt, max_tokens=3000)
    n = 0
    for ev in c.events(r):
        if ev.token >= 0:
            n += 1
        if n == 1 and not ev.final:
            c.cancel(r)
        last = ev
    check(last.final and last.stop == "cancelled" and n < 3000, "cancel: %d tokens, stop %s" % (n, last.stop))
    check(c.generate(prompt, max_tokens=16) == want, "after the cancel: the same tokens")
    try:
        c.submit(prompt, max_tokens=0)
        check(False, "max_tokens 0 refused")
    except kdclient.KdError as e:
        check(e.errno == errno.EINVAL, "max_tokens 0: %s" % e)
try:
    kdclient.Client(sock + ".none")
    check(False, "no daemon: refused")
except kdclient.KdError as e:
    check(e.errno in (errno.ENOENT, errno.ECONNREFUSED), "no daemon: %s" % e)
sys.exit(1 if fails else 0)
PYEOF
st=$?
cat "$tmp/py.out"
[ $st -eq 0 ] && ok || fail "the binding against kdecd (exit $st)"
kdecd_stop || fail "kdecd exit status"

# text through the binding: SmolLM2's tokenizer and model, where fetched
G=${KDEC_SMOLLM2_GGUF:-${KDEC_CACHE:-$HOME/.cache/kdec}/SmolLM2-135M-Instruct.Q4_1.gguf}
F=$top_srcdir/tests/data/tokenizer/smollm2_greedy
if [ ! -r "$G" ]; then
	echo "python_binding: SmolLM2 absent ($G; contrib/fetch-smollm2.sh): text checks skipped"
	verdict
	exit
fi
field() { sed -n "s/^$1=//p" "$F.txt"; }
kdecd_start daemon2.log 60 --model "$G" --socket "$S" --threads 2 --kv-tokens 2048 ||
	{ echo "FAIL: kdecd (SmolLM2) did not start: $(tail -n 3 "$tmp/daemon2.log")"; exit 1; }
"$B/kdrun" --socket "$S" --tokenizer "$G" --text "$(field prompt)" --chat --max-tokens "$(field max_tokens)" \
	>"$tmp/kdrun.out" 2>/dev/null
"$PY" - "$S" "$G" "$(field prompt)" "$(field prompt_ids)" "$(field max_tokens)" "$tmp/kdrun.out" \
	>"$tmp/py2.out" 2>&1 <<'PYEOF'
import errno, sys
import kdclient

sock, gguf, text, prompt_ids, max_tokens, kdrun_out = sys.argv[1:]
fails = 0

def check(cond, what):
    global fails
    print(("ok   " if cond else "FAIL ") + what)
    fails += not cond

with kdclient.Tokenizer(gguf) as tok:
    chat = tok.chat([{"role": "user", "content": text}])
    ids = tok.encode(chat, special=True)
    check(ids == [int(x) for x in prompt_ids.split(",")], "chat + encode == transformers' prompt ids")
    s = "h\u00e9llo \u4e16\u754c \U0001f600"
    check(tok.decode(tok.encode(s)) == s, "decode(encode(s)) == s")
    check(not tok.supports_tools, "SmolLM2 (ChatML): no tools")
    try:
        tok.chat([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "f"}}])
        check(False, "tools refused")
    except kdclient.KdError as e:
        check(e.errno == errno.ENOTSUP and "ChatML" in str(e), "tools refused: %s" % e)
    check(tok.parse_tool_calls("plain") == {"content": "plain", "tool_calls": []}, "parse: prose")
    with kdclient.Client(sock) as c:
        out = c.generate(ids, max_tokens=int(max_tokens), stop=[tok.eot])
    answer = tok.decode(out, skip_special=True)
    want = open(kdrun_out, encoding="utf-8").read()
    check(answer.strip() == want.strip(), "answer == kdrun --text --chat's: %r" % answer)
    st = tok.stream(skip_special=True)
    streamed = "".join(st.push(i) for i in out) + st.finish()
    check(streamed == answer, "streamed decoding == decode")
    # a character cut between tokens: held until complete, never half a character
    emoji = tok.encode("\U0001f600\u4e2d")
    st = tok.stream()
    parts = [st.push(i) for i in emoji] + [st.finish()]
    check("".join(parts) == "\U0001f600\u4e2d" and len(emoji) > 2, "stream holds cut characters: %r" % parts)
sys.exit(1 if fails else 0)
PYEOF
st=$?
cat "$tmp/py2.out"
[ $st -eq 0 ] && ok || fail "text through the binding (exit $st)"
kdecd_stop || fail "kdecd (SmolLM2) exit status"
verdict
