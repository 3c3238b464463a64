#!/bin/sh
# Every source that asks configure's answers (#ifdef KD_HAVE_CUDA and the like)
# includes config.h before it asks: without it the question reads as "no" and the
# code compiles the other branch without a word (test_golden's fp32-input GPU run
# never ran for that reason). The control: a planted file that asks without the
# include must be named.
set -u
src=${top_srcdir:-$(cd "$(dirname "$0")/.." && pwd)}

# check DIR...: the files under DIR that test a KD_HAVE_ or HAVE_ macro before (or
# without) including config.h, one per line
check() {
	find "$@" \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cc' \) \
		! -name config.h -type f | sort | while read -r f; do
		awk -v f="$f" '
			/^[ \t]*#[ \t]*include[ \t]*"config.h"/ { inc = 1 }
			/^[ \t]*#[ \t]*(if|ifdef|ifndef|elif)[ \t(!]*.*(KD_HAVE_|[^_A-Z]HAVE_[A-Z])/ ||
			/^[ \t]*#[ \t]*ifn?def[ \t]+HAVE_/ {
				if (!inc) { print f ": line " NR " tests a configure macro without config.h before it"; exit }
			}' "$f"
	done
}

bad=$(cd "$src" && check client daemon format ipc kernels kvcache http tests)
if [ -n "$bad" ]; then
	echo "$bad"
	echo "FAIL: configure's macros tested without config.h (the test reads as false)"
	exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '#include <stdio.h>\n#ifdef KD_HAVE_CUDA\nint x;\n#endif\n' >"$tmp/planted.c"
printf '#include "config.h"\n#ifdef KD_HAVE_CUDA\nint x;\n#endif\n' >"$tmp/good.c"
out=$(cd "$tmp" && check .)
case $out in
*planted.c*) ;;
*) echo "FAIL: the planted file that tests KD_HAVE_CUDA without config.h was not named"; exit 1 ;;
esac
case $out in
*good.c*) echo "FAIL: a file that includes config.h first was named: $out"; exit 1 ;;
esac
echo "PASS: every file that tests a configure macro includes config.h first; the planted one is named"
