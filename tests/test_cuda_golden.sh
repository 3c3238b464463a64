#!/bin/sh
# The reference models through the whole engine on the CUDA backend (test_golden with
# KDEC_TEST_BACKEND=cuda); test_golden exits 77 where there is no GPU or no CUDA build.
KDEC_TEST_BACKEND=cuda exec "${top_builddir:-.}/tests/test_golden"
