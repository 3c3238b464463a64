#!/bin/sh
# kdecd and the files it reads at start (issue 28): weights are its own copy, so a model
# file truncated or rewritten under a running daemon changes nothing it serves; a FIFO
# (or any non-regular file) in place of a model file, config.json or the snapshot is
# refused with the path named instead of blocking start-up in open(); a GGUF cut to a
# few bytes names its size; a prompt that fills the model's positions is refused with
# both numbers, a max_tokens past them cut there; --backend auto picks (and logs) a
# backend of the build.
set -u
test_name=model_files
. "${top_srcdir:-.}/tests/testutil.sh"
S=$tmp/kdecd.sock
# A refusal takes well under a second; 60 s is for a loaded 2-core machine under ASan.
# Before the fix, a FIFO blocked open() forever: timeout's 124 is that hang.
T=60

# start_fails TEXT ARG...: kdecd ARG... exits 1 within $T seconds, its last line names TEXT
start_fails() {
	text=$1
	shift
	expect 1 "$text" timeout $T "$B/kdecd" --backend cpu --socket "$S" "$@"
}

copy_model() {	# $1: a writable copy of the tiny checkpoint
	rm -rf "$1"
	mkdir "$1"
	cp "$M/config.json" "$M/model.safetensors" "$1/"
	chmod u+w "$1"/*
}

# ---- 1. a FIFO in place of each file kdecd opens at start ----
mkfifo "$tmp/fifo.gguf"
start_fails "fifo.gguf: not a model directory or a GGUF file (a FIFO)" --model "$tmp/fifo.gguf"
copy_model "$tmp/m"
rm "$tmp/m/config.json"
mkfifo "$tmp/m/config.json"
start_fails "m/config.json: not a regular file (a FIFO)" --model "$tmp/m"
copy_model "$tmp/m"
rm "$tmp/m/model.safetensors"
mkfifo "$tmp/m/model.safetensors"
start_fails "m/model.safetensors: not a regular file (a FIFO)" --model "$tmp/m"
copy_model "$tmp/m"
mkfifo "$tmp/m/model.safetensors.index.json"
start_fails "model.safetensors.index.json: not a regular file (a FIFO)" --model "$tmp/m"

# the snapshot: refused with one line naming it, and kdecd serves without it
mkdir "$tmp/state"
mkfifo "$tmp/state/kv-sessions.snap"
if kdecd_start snap.log $T --backend cpu --model "$M" --socket "$S" --threads 1 \
	--state-dir "$tmp/state"; then
	grep -q "kv-sessions.snap.*not a regular file" "$tmp/snap.log" && ok ||
		fail "the FIFO snapshot's refusal is not logged: $(tail -n 3 "$tmp/snap.log")"
	kdecd_stop || fail "kdecd with a FIFO snapshot exited $?"
else
	fail "kdecd with a FIFO snapshot did not start: $(tail -n 3 "$tmp/snap.log")"
	kill $pid 2>/dev/null
	pid=
fi

# ---- 2. a GGUF cut short: its size, not "t.gguf/config.json: Not a directory" ----
: >"$tmp/t.gguf"
start_fails "t.gguf: 0 bytes, too short for a GGUF header (needs at least 24)" --model "$tmp/t.gguf"
printf 'GGU' >"$tmp/t.gguf"
start_fails "t.gguf: 3 bytes, too short for a GGUF header (needs at least 24)" --model "$tmp/t.gguf"
printf 'GGUF' >"$tmp/t.gguf"
start_fails "t.gguf: 4 bytes, too short for a GGUF header" --model "$tmp/t.gguf"
head -c 100 /dev/zero >"$tmp/t.gguf"
start_fails "t.gguf: not a GGUF file" --model "$tmp/t.gguf"

# ---- 3. --backend: the build's backends listed, auto the default and logged ----
"$B/kdecd" --help | grep -q "auto (default" && ok || fail "--help does not say auto is the default"
"$B/kdecd" --help | grep -q "of this build's: .*cpu" && ok || fail "--help does not list cpu"
expect 2 "unknown backend 'tpu' (this build has: " "$B/kdecd" --model "$M" --backend tpu
"$B/kdecd" --model "$M" --check 2>"$tmp/auto.log" && ok || fail "--check: $(cat "$tmp/auto.log")"
grep -q "backend auto: " "$tmp/auto.log" && ok || fail "auto's choice is not logged: $(cat "$tmp/auto.log")"

# ---- 4. the model file truncated and rewritten under a running daemon ----
copy_model "$tmp/m"
P=5,17,300,2,9,44,71
if kdecd_start run.log $T --backend cpu --model "$tmp/m" --socket "$S" --threads 1 --kv-tokens 8192; then
	want=$("$B/kdrun" --socket "$S" --prompt $P --max-tokens 16 2>"$tmp/err")
	[ -n "$want" ] && ok || fail "first run printed nothing: $(cat "$tmp/err")"
	# rewritten in place at the same size (past the header: the weights themselves)
	size=$(wc -c <"$tmp/m/model.safetensors")
	dd if=/dev/urandom of="$tmp/m/model.safetensors" bs=4096 seek=1 \
		count=$(( (size - 4096) / 4096 )) conv=notrunc 2>/dev/null
	got=$("$B/kdrun" --socket "$S" --prompt $P --max-tokens 16 2>"$tmp/err")
	[ "$got" = "$want" ] && ok || fail "after a rewrite in place: '$got', before '$want' ($(cat "$tmp/err"))"
	# truncated (the attack gave SIGBUS, exit 135, at the next request)
	truncate -s 100 "$tmp/m/model.safetensors"
	got=$("$B/kdrun" --socket "$S" --prompt $P --max-tokens 16 2>"$tmp/err")
	[ "$got" = "$want" ] && ok || fail "after a truncation: '$got', before '$want' ($(cat "$tmp/err"))"
	kill -0 $pid 2>/dev/null && ok || fail "kdecd died after the truncation: $(tail -n 3 "$tmp/run.log")"
	# gone altogether
	rm "$tmp/m/model.safetensors"
	got=$("$B/kdrun" --socket "$S" --prompt $P --max-tokens 16 2>"$tmp/err")
	[ "$got" = "$want" ] && ok || fail "after removal: '$got', before '$want' ($(cat "$tmp/err"))"
	if kill -0 $pid 2>/dev/null; then
		kdecd_stop && ok || fail "kdecd exited $? after the file changes"
	else
		wait $pid
		fail "kdecd died (exit $?): $(tail -n 3 "$tmp/run.log")"
		pid=
	fi
else
	fail "kdecd did not start: $(tail -n 3 "$tmp/run.log")"
fi

# ---- 5. max_position_embeddings (4096 in the tiny model) is enforced ----
ids() { awk -v n="$1" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", i ? "," : "", 3 + i % 500 }'; }
# run_long N K: a prompt of N token ids, K tokens wanted (a short name for expect's lines)
run_long() { "$B/kdrun" --socket "$S" --prompt "$(ids "$1")" --max-tokens "$2"; }
if kdecd_start pos.log $T --backend cpu --model "$M" --socket "$S" --threads 2 --kv-tokens 8192; then
	# the issue's case: a 5,000-token prompt on a 4,096-position model is refused
	expect 1 "prompt + max_tokens = 5008 tokens exceed the model's 4096 positions (max_position_embeddings)" \
		run_long 5000 8
	# a prompt that fills every position leaves none to generate at
	expect 1 "prompt + max_tokens = 4097 tokens exceed the model's 4096 positions" run_long 4096 1
	# max_tokens past the last position is cut there: 4090 + 6 tokens, reason length
	got=$(run_long 4090 10 2>"$tmp/err")
	[ "$(echo $got | wc -w)" -eq 6 ] && ok || fail "4090 + 10 tokens: '$got', want 6 tokens ($(cat "$tmp/err"))"
	# exactly the model's positions: served whole (and the daemon serves on)
	got=$(run_long 4088 8 2>"$tmp/err")
	[ "$(echo $got | wc -w)" -eq 8 ] && ok || fail "4088 + 8 tokens: '$got' ($(cat "$tmp/err"))"
	kdecd_stop || fail "kdecd exited $?"
else
	fail "kdecd did not start: $(tail -n 3 "$tmp/pos.log")"
fi

verdict
