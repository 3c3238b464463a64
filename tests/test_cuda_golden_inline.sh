#!/bin/sh
# test_cuda_golden.sh with the forms the defaults replaced: the MoE shared expert in line
# after the routed experts instead of on the step's branch (KDEC_MOE_SHARED_BRANCH=0),
# moe_route's shared-memory form (KDEC_MOE_ROUTE_REG=0) and the router GEMV a warp per
# row pair (KDEC_LINEAR_GEMV_SPLIT=0): both forms of each hold the references (the
# DeepSeek, Kimi-K2 and quantized goldens have shared experts and group-limited routers).
# test_golden exits 77 where there is no GPU or no CUDA build.
KDEC_TEST_BACKEND=cuda KDEC_MOE_SHARED_BRANCH=0 KDEC_MOE_ROUTE_REG=0 KDEC_LINEAR_GEMV_SPLIT=0 \
	exec "${top_builddir:-.}/tests/test_golden"
