#!/bin/sh
# The real model end to end: kdecd on SmolLM2-135M-Instruct (GGUF, CPU backend) and
# `kdrun --text ... --chat`, greedy: the prompt ids kdrun sends, the ids the daemon
# generates and the text kdrun prints all equal transformers' greedy generation
# (tests/data/tokenizer/smollm2_greedy.*, contrib/make_tokenizer_fixtures.py).
# Skips (77) where contrib/fetch-smollm2.sh has not fetched the model.
set -u
top_srcdir=${top_srcdir:-.}
G=${KDEC_SMOLLM2_GGUF:-${KDEC_CACHE:-$HOME/.cache/kdec}/SmolLM2-135M-Instruct.Q4_1.gguf}
F=$top_srcdir/tests/data/tokenizer/smollm2_greedy
if [ ! -r "$G" ]; then
	echo "text_daemon: skipped: $G absent (contrib/fetch-smollm2.sh fetches it)"
	exit 77
fi
test_name=text_daemon
. "$top_srcdir/tests/testutil.sh"
S=$tmp/kdecd.sock
field() { sed -n "s/^$1=//p" "$F.txt"; }

prompt=$(field prompt)
max=$(field max_tokens)
kdecd_start daemon.log 60 --model "$G" --backend cpu --socket "$S" --threads 2 --kv-tokens 2048 ||
	{ echo "FAIL: kdecd did not start: $(tail -n 3 "$tmp/daemon.log")"; exit 1; }

# the text, streamed
"$B/kdrun" --socket "$S" --tokenizer "$G" --text "$prompt" --chat --max-tokens "$max" \
	>"$tmp/out" 2>"$tmp/err"
st=$?
[ $st -eq 0 ] && ok || fail "kdrun --text --chat exit $st: $(cat "$tmp/err")"
cmp -s "$tmp/out" "$F.out" && ok ||
	fail "kdrun --text --chat printed '$(cat "$tmp/out")', transformers '$(cat "$F.out")'"

# the same ids as transformers: prompt ids in, output ids out (the stop token included)
got=$("$B/kdrun" --socket "$S" --prompt "$(field prompt_ids)" --max-tokens "$max" \
	--stop "$(field stop_id)" 2>/dev/null | tr ' ' ',')
[ "$got" = "$(field output_ids)" ] && ok || fail "ids '$got', transformers '$(field output_ids)'"

# kdctl status says how the GGUF's weights are held: dequantized at load
"$B/kdctl" --socket "$S" status | grep -q "^weights  *f32, from GGUF\$" && ok ||
	fail "kdctl status: $("$B/kdctl" --socket "$S" status | grep weights), want 'f32, from GGUF'"

# without --tokenizer: the model kdecd serves (its status names the file)
"$B/kdrun" --socket "$S" --text "$prompt" --chat --max-tokens "$max" >"$tmp/out2" 2>"$tmp/err"
cmp -s "$tmp/out2" "$F.out" && ok || fail "kdrun without --tokenizer: '$(cat "$tmp/out2")' $(cat "$tmp/err")"
# no daemon to ask and no --tokenizer: one line, exit 1
"$B/kdrun" --socket "$tmp/none.sock" --text hi >/dev/null 2>"$tmp/err"
st=$?
[ $st -eq 1 ] && grep -q -- "--tokenizer" "$tmp/err" && ok || fail "no daemon, no --tokenizer: exit $st, $(cat "$tmp/err")"

kdecd_stop
verdict
