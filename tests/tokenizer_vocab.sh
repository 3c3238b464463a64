#!/bin/sh
# test_tokenizer's vocabulary part (ids, round trips, chat templates, tokenizer.json)
# as a test of its own: SKIP (77) naming each vocabulary that is not on this machine
# (contrib/fetch-smollm2.sh, contrib/fetch-vocabs.sh), where test_tokenizer's
# pre-tokenizer part runs everywhere.
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
export top_srcdir
exec "$top_builddir/tests/test_tokenizer" vocab
