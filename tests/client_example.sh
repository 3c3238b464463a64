#!/bin/sh
# docs/CLIENT.md's example, built against an installed libkdclient through pkg-config
# and run against a kdecd: under `make check` the library, header and .pc are
# installed into a scratch DESTDIR first; under `make installcheck` (KD_INSTALLED=1)
# the installed copy is used as it is. The tokens must equal kdbench generate's.
set -u
test_name=client_example
. "${top_srcdir:-.}/tests/testutil.sh"
B=$(cd "$B" && pwd)

command -v pkg-config >/dev/null || { echo "SKIP: no pkg-config"; exit 77; }
cc=${CC:-cc}
sed -n '/<!-- example:begin -->/,/<!-- example:end -->/p' "$top_srcdir/docs/CLIENT.md" |
	sed '/^<!--/d; /^```/d' >"$tmp/example.c"
[ -s "$tmp/example.c" ] || { echo "FAIL: no example in docs/CLIENT.md"; exit 1; }

if [ "${KD_INSTALLED:-0}" = 1 ]; then
	flags=$(pkg-config --cflags --libs kdclient) || { echo "FAIL: pkg-config kdclient"; exit 1; }
	libdir=$(pkg-config --variable=libdir kdclient)
else
	# Only the library's parts: what a user of libkdclient installs.
	${MAKE:-make} -s -C "$B" DESTDIR="$tmp/dest" install-libLTLIBRARIES install-includeHEADERS \
		install-pkgconfigDATA >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; echo "FAIL: install"; exit 1; }
	pc=$(find "$tmp/dest" -name kdclient.pc | head -n 1)
	[ -n "$pc" ] || { echo "FAIL: no kdclient.pc installed"; exit 1; }
	export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$tmp/dest
	flags=$(pkg-config --cflags --libs kdclient) || { echo "FAIL: pkg-config kdclient"; exit 1; }
	libdir=$tmp/dest$(pkg-config --variable=libdir kdclient | sed "s|^$tmp/dest||")
fi
# A sanitizer build's library needs the sanitizer runtime in the program too.
san=
if nm -D "$libdir/libkdclient.so" 2>/dev/null | grep -q __asan_init; then
	san="-fsanitize=address,undefined"
fi
echo "cc example.c $flags"
$cc -std=c11 -Wall -Werror $san -o "$tmp/example" "$tmp/example.c" $flags || { echo "FAIL: the example does not build"; exit 1; }

kdecd_start daemon.log 60 --model "$M" --socket "$tmp/s" --threads 1
LD_LIBRARY_PATH=$libdir "$tmp/example" "$tmp/s" >"$tmp/out" 2>"$tmp/err" || {
	cat "$tmp/err" "$tmp/daemon.log"; echo "FAIL: the example failed"; exit 1; }
want=$("$B/kdbench" generate --model "$M" --prompt 113,124,11,408,469 --max-tokens 16 --threads 1 2>/dev/null)
got=$(head -n 1 "$tmp/out" | sed 's/ *$//')
cat "$tmp/out"
[ "$got" = "$want" ] || { echo "FAIL: example printed '$got', kdbench generate '$want'"; exit 1; }
grep -q "max_tokens reached" "$tmp/out" || { echo "FAIL: no final event line"; exit 1; }
kdecd_stop
st=$?
[ $st -eq 0 ] || { echo "FAIL: kdecd exit $st"; exit 1; }
echo "PASS: docs/CLIENT.md's example against the installed library"
