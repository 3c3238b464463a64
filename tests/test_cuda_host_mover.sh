#!/bin/sh
# The host tier's mover on the CUDA backend (test_host_mover with KDEC_TEST_BACKEND=cuda):
# side copies on their own stream beside the decode graphs; exits 77 without a GPU.
KDEC_TEST_BACKEND=cuda exec "${top_builddir:-.}/tests/test_host_mover"
