#!/bin/sh
# kdbench generate --spec: the same ids as plain greedy on every golden model and
# on a repeating prompt, where drafts must also get accepted (acceptance > 1); bad
# --spec values refused with one clear line.
set -u
test_name=spec_cli
. "${top_srcdir:-.}/tests/testutil.sh"
G=$top_srcdir/tests/data/golden

# same MODEL PROMPT N SPEC: plain and speculative ids identical; prints the
# acceptance line
same() {
	"$B/kdbench" generate --model "$1" --prompt "$2" --max-tokens "$3" --threads 2 \
		>"$tmp/plain" 2>"$tmp/err" || { fail "plain $1: $(cat "$tmp/err")"; return; }
	"$B/kdbench" generate --model "$1" --prompt "$2" --max-tokens "$3" --threads 2 --spec "$4" \
		>"$tmp/spec" 2>"$tmp/err" || { fail "spec $1: $(cat "$tmp/err")"; return; }
	cmp -s "$tmp/plain" "$tmp/spec" && ok ||
		fail "$1 --spec $4: '$(cat "$tmp/spec")' differs from greedy '$(cat "$tmp/plain")'"
	grep -q 'mean acceptance length' "$tmp/err" && ok || fail "$1: no acceptance on stderr"
}

rep=5,17,300,2,9,5,17,300,2,9,5,17,300,2,9,5,17,300,2,9,5,17,300
for m in "$G"/*/; do
	same "$m" 285,0,109,336,340,248,478 24 ngram:k=4
	same "$m" "$rep" 32 ngram:k=5,n=2
done
same "$G/qwen3" "$rep" 40 ngram:k=3
acc=$(sed -n 's/.*mean acceptance length \([0-9.]*\).*/\1/p' "$tmp/err")
awk -v a="${acc:-0}" 'BEGIN { exit !(a > 1) }' && ok ||
	fail "repeating prompt: mean acceptance length '$acc', want > 1: $(cat "$tmp/err")"

for bad in ngram ngram:k=0 ngram:k=2,n=99 ngram:k=2, lookup:k=2; do
	"$B/kdbench" generate --model "$G/llama3" --prompt 1 --max-tokens 2 --spec "$bad" \
		>/dev/null 2>"$tmp/err"
	st=$?
	[ "$st" -eq 2 ] && grep -q -- "--spec '$bad'" "$tmp/err" && ok ||
		fail "--spec $bad: exit $st, stderr $(cat "$tmp/err")"
done

verdict
