#!/bin/sh
# Runs each libFuzzer target for FUZZ_SECONDS over a scratch copy of its seed corpus,
# so new corpus entries never land in the source tree. 0 pass, 1 crash, 77 not built.
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
secs=${FUZZ_SECONDS:-5}
targets="safetensors config control ring gguf tool_parse quant http_request"

for t in $targets; do
	if [ ! -x "$top_builddir/tests/fuzz/fuzz_$t" ]; then
		echo "SKIP: $top_builddir/tests/fuzz/fuzz_$t not built" \
			"(configure found no clang with -fsanitize=fuzzer)"
		exit 77
	fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kdec_fuzz.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
trap 'exit 1' INT TERM
bdir=$(cd "$top_builddir/tests/fuzz" && pwd) || exit 1
sdir=$(cd "$top_srcdir/tests/fuzz" && pwd) || exit 1

rc=0
for t in $targets; do
	mkdir "$work/$t" "$work/$t.art" || exit 1
	cp "$sdir/corpus/$t/"* "$work/$t/" || exit 1
	chmod -R u+w "$work/$t"
	dict=
	[ -f "$sdir/$t.dict" ] && dict="-dict=$sdir/$t.dict"
	echo "fuzz_$t: ${secs}s"
	# UBSan only reports by default; make undefined behaviour a crash too.
	if ! (cd "$work" && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		"$bdir/fuzz_$t" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 \
		-artifact_prefix="$work/$t.art/" $dict "$work/$t") >"$work/$t.log" 2>&1
	then
		tail -n 40 "$work/$t.log"
		# Keep the reproducer where a developer can find it (the build tree).
		for a in "$work/$t.art/"*; do
			[ -f "$a" ] || continue
			cp "$a" "$bdir/" && echo "fuzz_$t: reproducer kept as $bdir/$(basename "$a")"
		done
		echo "FAIL: fuzz_$t"
		rc=1
	else
		grep -E '^(Done|#[0-9]+ +DONE)' "$work/$t.log" | tail -n 1
	fi
done
exit $rc
