#!/bin/sh
# The tools as a user runs them: kdbench logits/generate output formats, kdecd's
# lifecycle, and bad input (corrupt files, bad ids, bad flags) failing with one clear
# line and a plain exit status, never a crash.
set -u
test_name=cli_check
. "${top_srcdir:-.}/tests/testutil.sh"

# ---- kdbench logits: format and prefill == incremental ----
"$B/kdbench" logits --model "$M" --tokens 5,17,300,2,9 --out "$tmp/p.f32" --threads 2 2>"$tmp/err" \
	|| fail "logits prefill: $(cat "$tmp/err")"
"$B/kdbench" logits --model "$M" --tokens 5,17,300,2,9 --out "$tmp/i.f32" --incremental 2>"$tmp/err" \
	|| fail "logits incremental: $(cat "$tmp/err")"
size=$(wc -c <"$tmp/p.f32")
[ "$size" -eq $((5 * 512 * 4)) ] && ok || fail "logits file is $size bytes, want $((5 * 512 * 4))"
cmp -s "$tmp/p.f32" "$tmp/i.f32" && ok || fail "prefill and incremental logits differ"

# ---- kdbench logits on a MoE model: routing dumped and forced back, --prefill, @FILE ----
D=$top_srcdir/tests/data/golden/deepseek_v3
echo 5,17,100,2,9,33,70,41 >"$tmp/ids"
"$B/kdbench" logits --model "$D" --tokens "@$tmp/ids" --out "$tmp/r.f32" --threads 2 \
	--dump-routing "$tmp/rt" 2>"$tmp/err" || fail "logits --dump-routing: $(cat "$tmp/err")"
head -n 1 "$tmp/rt" | grep -q '^kdec-routing 1 layers 3 experts 16 top_k 4$' && ok ||
	fail "routing file header: $(head -n 1 "$tmp/rt")"
[ "$(grep -c '^0 ' "$tmp/rt")" -eq 16 ] && ok || fail "routing file: want 2 MoE layers x 8 tokens"
"$B/kdbench" logits --model "$D" --tokens "@$tmp/ids" --out "$tmp/f.f32" --threads 2 \
	--force-routing "$tmp/rt" 2>"$tmp/err" || fail "logits --force-routing: $(cat "$tmp/err")"
cmp -s "$tmp/r.f32" "$tmp/f.f32" && grep -q ' 0 decisions replaced' "$tmp/err" && ok ||
	fail "its own routing forced changed the logits: $(cat "$tmp/err")"
"$B/kdbench" logits --model "$D" --tokens "@$tmp/ids" --out "$tmp/q.f32" --threads 2 \
	--incremental --prefill 5 2>"$tmp/err" || fail "logits --prefill: $(cat "$tmp/err")"
cmp -s "$tmp/r.f32" "$tmp/q.f32" && ok || fail "prefill 5 then 3 decode steps differ from one prefill"
printf 'kdec-routing 1 layers 3 experts 16 top_k 4\n0 1 2 3 3 4 5\n' >"$tmp/bad_rt"
expect 1 "expert 3 chosen twice" "$B/kdbench" logits --model "$D" --tokens 1,2,3 --out "$tmp/x" \
	--force-routing "$tmp/bad_rt"
expect 1 "has no experts" "$B/kdbench" logits --model "$M" --tokens 1,2 --out "$tmp/x" \
	--dump-routing "$tmp/x.rt"
expect 1 "more than the 2 tokens" "$B/kdbench" logits --model "$M" --tokens 1,2 --out "$tmp/x" \
	--incremental --prefill 3

# ---- kdbench generate: ids on stdout, timing on stderr ----
"$B/kdbench" generate --model "$M" --prompt 1,2,3 --max-tokens 8 >"$tmp/gen" 2>"$tmp/err" \
	|| fail "generate: $(cat "$tmp/err")"
grep -Eq '^[0-9]+( [0-9]+){7}$' "$tmp/gen" && ok || fail "generate stdout: '$(cat "$tmp/gen")'"
grep -q 'tokens/s' "$tmp/err" && ok || fail "generate stderr lacks tokens/s"

# ---- a sharded checkpoint (model.safetensors.index.json) gives the same logits ----
if command -v python3 >/dev/null 2>&1; then
	python3 "$top_srcdir/tests/shard_checkpoint.py" "$M" "$tmp/sharded" 3
	"$B/kdbench" logits --model "$tmp/sharded" --tokens 5,17,300,2,9 --out "$tmp/s.f32" 2>"$tmp/err" \
		|| fail "sharded logits: $(cat "$tmp/err")"
	cmp -s "$tmp/p.f32" "$tmp/s.f32" && ok || fail "sharded checkpoint gives other logits"
	# a shard named in the index but missing
	rm "$tmp/sharded/model-00002-of-00003.safetensors"
	expect 1 "model-00002-of-00003.safetensors" "$B/kdbench" generate --model "$tmp/sharded" --prompt 1 --max-tokens 1
else
	skip "sharded-checkpoint check: no python3 to write the shards"
fi

# ---- bad arguments ----
expect 2 "unknown command" "$B/kdbench" frobnicate --model "$M"
expect 2 "--model DIR|FILE.gguf is required" "$B/kdbench" logits --tokens 1 --out "$tmp/x"
expect 2 "bad id" "$B/kdbench" logits --model "$M" --tokens 1,x,3 --out "$tmp/x"
expect 2 "trailing comma" "$B/kdbench" logits --model "$M" --tokens 1,2, --out "$tmp/x"
expect 2 "--threads" "$B/kdbench" generate --model "$M" --prompt 1 --max-tokens 2 --threads 0
expect 1 "outside the vocabulary" "$B/kdbench" logits --model "$M" --tokens 1,512 --out "$tmp/x"
expect 1 "config.json: No such file" "$B/kdbench" generate --model "$tmp" --prompt 1 --max-tokens 1
mkdir "$tmp/noweights"; cp "$M/config.json" "$tmp/noweights/"
expect 1 "no model.safetensors" "$B/kdbench" generate --model "$tmp/noweights" --prompt 1 --max-tokens 1
expect 1 "unknown backend 'tpu'" "$B/kdbench" generate --model "$M" --prompt 1 --max-tokens 1 --backend tpu

# ---- damaged checkpoints: one line naming the file (and tensor) ----
mk() { rm -rf "$tmp/m"; mkdir "$tmp/m"; cp "$M/config.json" "$M/model.safetensors" "$tmp/m/"; chmod u+w "$tmp/m"/*; }
mk; head -c 100000 "$M/model.safetensors" >"$tmp/m/model.safetensors"
expect 1 "model.safetensors" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1
mk; head -c 4 "$M/model.safetensors" >"$tmp/m/model.safetensors"
expect 1 "model.safetensors" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1
mk; sed 's/"num_hidden_layers": 3/"num_hidden_layers": 4/' "$M/config.json" >"$tmp/m/config.json"
expect 1 "model.layers.3" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1
mk; sed 's/"hidden_size": 128/"hidden_size": 64/' "$M/config.json" >"$tmp/m/config.json"
expect 1 "shape" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1
mk; sed '/"num_attention_heads"/d' "$M/config.json" >"$tmp/m/config.json"
expect 1 "num_attention_heads" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1
mk; printf '{ "model_type": "llama", ' >"$tmp/m/config.json"
expect 1 "config.json" "$B/kdbench" generate --model "$tmp/m" --prompt 1 --max-tokens 1

# ---- synthetic weights from a full-size config, cut to 1 layer ----
"$B/kdbench" generate --model "$top_srcdir/tests/data/tiny/kimi_k2.json" --synthetic-weights \
	--prompt 1,2,3 --max-tokens 4 >"$tmp/gen" 2>"$tmp/err" && ok || fail "synthetic generate: $(cat "$tmp/err")"

# ---- kdecd: --check, then a foreground run stopped by SIGTERM ----
"$B/kdecd" --model "$M" --check 2>"$tmp/err" && ok || fail "kdecd --check: $(cat "$tmp/err")"
expect 1 "no model.safetensors" "$B/kdecd" --model "$tmp/noweights" --check
expect 2 "want at least --max-batch" "$B/kdecd" --model "$M" --max-batch 8 --prefill-chunk 4
kdecd_start daemon.err 60 --model "$M" --threads 1
kdecd_stop
st=$?
[ $st -eq 0 ] && grep -q "shutting down" "$tmp/daemon.err" && ok || fail "kdecd SIGTERM: exit $st: $(cat "$tmp/daemon.err")"

# ---- client tools ----
"$B/kdctl" --version | grep -q "protocol" && ok || fail "kdctl --version"
"$B/kdrun" --version | grep -q "protocol" && ok || fail "kdrun --version"

verdict
